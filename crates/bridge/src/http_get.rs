//! One plain HTTP/1.1 GET with a deadline: the engine's health check and metrics scrape.

use crate::endpoints::HttpUrl;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use std::time::Duration;
use thiserror::Error;

/// The largest body read (an engine's /metrics is tens of kilobytes).
const MAX_BODY: usize = 8 << 20;

#[derive(Debug, Error)]
pub enum HttpGetError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {0}")]
    Connect(std::io::Error),
    #[error("HTTP: {0}")]
    Http(String),
}

/// `GET url` within `timeout`: the status and the body (at most 8 MiB).
pub async fn http_get(url: &HttpUrl, timeout: Duration) -> Result<(u16, Bytes), HttpGetError> {
    tokio::time::timeout(timeout, get(url))
        .await
        .map_err(|_| HttpGetError::Timeout(timeout))?
}

async fn get(url: &HttpUrl) -> Result<(u16, Bytes), HttpGetError> {
    let stream = tokio::net::TcpStream::connect(&url.authority)
        .await
        .map_err(HttpGetError::Connect)?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| HttpGetError::Http(e.to_string()))?;
    let conn = tokio::spawn(conn);
    let req = hyper::Request::get(&url.path)
        .header(hyper::header::HOST, &url.authority)
        .header(hyper::header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| HttpGetError::Http(e.to_string()))?;
    let res = sender
        .send_request(req)
        .await
        .map_err(|e| HttpGetError::Http(e.to_string()))?;
    let status = res.status().as_u16();
    let body = Limited::new(res.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| HttpGetError::Http(e.to_string()))?
        .to_bytes();
    conn.abort();
    Ok((status, body))
}
