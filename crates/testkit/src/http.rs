//! Blocking HTTP/1.1 probes on a loopback port: one request, `Connection: close`, the whole
//! answer. For admin pages and JSON APIs in tests; real clients (curl, the openai SDK) test
//! the HTTP servers themselves.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `GET path` on a loopback port: (status code, body). (0, "") when nothing listens or
/// nothing answers within 10 s.
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    call(
        port,
        &format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"),
    )
}

/// `POST path` with a JSON body and extra headers on a loopback port: (status, body).
/// (0, "") when nothing listens.
pub fn http_post(port: u16, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    call(port, &req)
}

fn call(port: u16, request: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    if s.write_all(request.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let resp = String::from_utf8_lossy(&raw);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let Some((head, body)) = resp.split_once("\r\n\r\n") else {
        return (status, String::new());
    };
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

/// The payload of a chunked HTTP/1.1 body (stops at the last chunk or at anything malformed).
pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), "abcde");
        assert_eq!(dechunk("zz\r\nabc"), "");
    }

    #[test]
    fn nothing_listening_is_status_zero() {
        let port = crate::free_port();
        assert_eq!(http_get(port, "/").0, 0);
    }

    #[test]
    fn reads_status_and_body_from_a_real_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).unwrap();
            let req = String::from_utf8_lossy(&buf[..n]).into_owned();
            s.write_all(b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nno\r\n0\r\n\r\n")
                .unwrap();
            req
        });
        assert_eq!(http_get(port, "/readyz"), (503, "no".to_string()));
        assert!(t.join().unwrap().starts_with("GET /readyz HTTP/1.1\r\n"));
    }
}
