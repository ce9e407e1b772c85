//! `curl` as the HTTP client of the real binary's listeners: what a user would run, with a
//! bearer token, HTTPS and a client certificate when asked, and a body sent on stdin (a
//! server may refuse before reading it all).

use kvrouter_testkit::TestCerts;
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Who calls, and how it reaches the server.
#[derive(Default)]
pub struct Caller<'a> {
    pub token: Option<&'a str>,
    /// HTTPS trusting `certs.ca`, with the client certificate (cert, key) when given.
    pub tls: Option<&'a TestCerts>,
    pub client_cert: Option<(&'a Path, &'a Path)>,
}

impl<'a> Caller<'a> {
    /// A plain-HTTP caller with a bearer token.
    pub fn bearer(token: &'a str) -> Self {
        Self {
            token: Some(token),
            ..Self::default()
        }
    }
}

/// One answer: the status, the header lines (lower-cased) and the body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.body))
    }

    /// `(status, error kind)` of an error answer.
    pub fn error(&self) -> (u16, String) {
        let kind = self.json()["error"]["kind"]
            .as_str()
            .unwrap_or("")
            .to_string();
        (self.status, kind)
    }

    pub fn message(&self) -> String {
        self.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }
}

/// `curl -X METHOD` on `127.0.0.1:port` as `who`, with `body` (if any) as a JSON body; curl's
/// own failure (a refused handshake, a timeout) as its exit code and message.
pub fn curl_as(
    who: &Caller,
    method: &str,
    port: u16,
    path: &str,
    body: Option<&[u8]>,
) -> Result<Answer, String> {
    let scheme = if who.tls.is_some() { "https" } else { "http" };
    // With TLS, `localhost` (in the server certificate) resolved to the loopback address.
    let url = format!("{scheme}://localhost:{port}{path}");
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-S", "-i", "--max-time", "10", "-X", method, &url]);
    cmd.args(["--resolve", &format!("localhost:{port}:127.0.0.1")]);
    if let Some(t) = who.token {
        cmd.args(["-H", &format!("authorization: Bearer {t}")]);
    }
    if let Some(certs) = who.tls {
        cmd.arg("--cacert").arg(&certs.ca);
    }
    if let Some((cert, key)) = who.client_cert {
        cmd.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    if body.is_some() {
        cmd.args([
            "-H",
            "content-type: application/json",
            "--data-binary",
            "@-",
        ]);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("curl runs");
    let mut stdin = child.stdin.take().expect("stdin");
    if let Some(b) = body {
        // A refusal may come before the whole body is sent.
        let _ = stdin.write_all(b);
    }
    drop(stdin);
    let out = child.wait_with_output().expect("curl output");
    if !out.status.success() {
        return Err(format!(
            "curl exit {:?}: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // `-i`: status line and headers, a blank line, the body (a 100 Continue comes first).
    let mut rest = text.as_str();
    loop {
        let Some((head, body)) = rest.split_once("\r\n\r\n") else {
            return Err(format!("{method} {path}: no HTTP answer: {text:?}"));
        };
        if head.starts_with("HTTP/1.1 100") {
            rest = body;
            continue;
        }
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        return Ok(Answer {
            status,
            headers: head.to_lowercase(),
            body: body.to_string(),
        });
    }
}

/// [`curl_as`] without credentials, over plain HTTP; panics if curl fails.
pub fn curl(method: &str, port: u16, path: &str, body: Option<&[u8]>) -> Answer {
    curl_as(&Caller::default(), method, port, path, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}
