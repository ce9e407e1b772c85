//! What the attacks aim at, and the one HTTP call everything here makes: raw HTTP/1.1 over
//! a loopback TCP connection (`Connection: close`), so a client can send what no
//! well-behaved library would (a head that never ends, a Content-Length that is a lie, a
//! 1 MiB header).

use super::credentials::FleetCredentials;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// The listeners and names the attacks aim at.
#[derive(Clone, Debug)]
pub struct Targets {
    pub frontend: u16,
    /// A replica's admin port, which serves the JSON API.
    pub replica: u16,
    /// The bridge's admin port.
    pub bridge: u16,
    /// The emulated engine's HTTP port.
    pub engine: u16,
    pub model: String,
    /// The bridge's worker id (one of the 200,000 allowed workers).
    pub worker_id: u64,
    /// The engine's base URL, as its worker registered it.
    pub engine_url: String,
    /// A worker id with a bridge identity of its own and no process: the forger's.
    pub spare_worker: u64,
    pub nats_url: String,
    pub namespace: String,
    /// The replicas' ids (`--replica-id`) and admin ports.
    pub replica_ids: Vec<String>,
    pub replica_ports: Vec<u16>,
    pub creds: Arc<FleetCredentials>,
    /// The honest route clients' bookings while they hold them: their ids, not their
    /// leases, leak to the attackers (as ids do, through logs and headers).
    pub inflight: Arc<Mutex<Vec<InFlight>>>,
}

/// An honest booking the attackers know of.
#[derive(Clone, Debug)]
pub struct InFlight {
    pub request_id: String,
    pub replica_id: String,
}

impl Targets {
    /// The `Authorization` header line an attacker sends to `port`: another tenant's valid
    /// credentials on the frontend and the JSON API, so that the attacks reach what comes
    /// after the door.
    pub fn tenant_auth(&self, port: u16) -> String {
        if port == self.frontend {
            bearer(&self.creds.tenant_key)
        } else if port == self.replica {
            bearer(&self.creds.tenant_token)
        } else {
            String::new()
        }
    }
}

/// The `Authorization` header line for a bearer secret.
pub fn bearer(secret: &str) -> String {
    format!("Authorization: Bearer {secret}\r\n")
}

/// A request head: `Connection: close`, JSON, `len` bytes of body, `extra` header lines
/// (each ending in CRLF).
pub fn head(method: &str, path: &str, extra: &str, len: usize) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\n{extra}\r\n"
    )
}

/// Sends `head` and `body` repeated `repeat` times, reads the answer to its end; the status,
/// or what went wrong: "connect", "io" (the server hung up while the request was written,
/// without an answer), "closed" (no answer), "timeout".
pub async fn send(
    port: u16,
    head: &str,
    body: &[u8],
    repeat: usize,
    limit: Duration,
) -> Result<u16, &'static str> {
    send_read(port, head, body, repeat, limit)
        .await
        .map(|(status, _)| status)
}

/// [`send`], with the answer's body (its first 200 bytes, lossily as text).
pub async fn send_read(
    port: u16,
    head: &str,
    body: &[u8],
    repeat: usize,
    limit: Duration,
) -> Result<(u16, String), &'static str> {
    send_read_n(port, head, body, repeat, limit, 200).await
}

/// [`send`], with the first `keep` bytes of the answer's body (lossily as text).
pub async fn send_read_n(
    port: u16,
    head: &str,
    body: &[u8],
    repeat: usize,
    limit: Duration,
    keep: usize,
) -> Result<(u16, String), &'static str> {
    let call = async {
        let mut s = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|_| "connect")?;
        let _ = s.set_nodelay(true);
        let mut write_failed = s.write_all(head.as_bytes()).await.is_err();
        for _ in 0..repeat {
            if write_failed {
                break;
            }
            write_failed = s.write_all(body).await.is_err();
        }
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf).await;
        let status = status_of(&buf).ok_or(if write_failed { "io" } else { "closed" })?;
        let start = buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(buf.len(), |p| p + 4);
        let end = buf.len().min(start + keep);
        Ok((
            status,
            String::from_utf8_lossy(&buf[start..end]).into_owned(),
        ))
    };
    timeout(limit, call).await.unwrap_or(Err("timeout"))
}

/// The status of an HTTP/1.x answer.
fn status_of(answer: &[u8]) -> Option<u16> {
    let line = answer.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut words = line.split_whitespace();
    if !words.next()?.starts_with("HTTP/1.") {
        return None;
    }
    words.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(
            status_of(b"HTTP/1.1 413 Payload Too Large\r\n\r\n"),
            Some(413)
        );
        assert_eq!(status_of(b"HTTP/1.0 200 OK\r\n"), Some(200));
        assert_eq!(status_of(b""), None);
        assert_eq!(status_of(b"garbage"), None);
    }
}
