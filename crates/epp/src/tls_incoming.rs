//! The ext_proc listener's connections over TLS (h2 by ALPN): handshakes run off the
//! accept loop, each within a deadline, so a slow or silent client delays nobody.

use kvrouter_admin::tls::ServerTls;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// A handshake not done by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the server to take them.
const READY_QUEUED: usize = 64;

/// One TLS connection, as tonic's server takes it.
pub struct TlsConn<S>(S);

impl<S: AsyncRead + Unpin> AsyncRead for TlsConn<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for TlsConn<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S> tonic::transport::server::Connected for TlsConn<S> {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

/// The TLS connections `listener` accepts, until the stream is dropped.
pub fn tls_incoming(
    listener: TcpListener,
    tls: ServerTls,
) -> impl futures_util::Stream<
    Item = io::Result<TlsConn<impl AsyncRead + AsyncWrite + Unpin + Send + 'static>>,
> {
    let (tx, rx) = mpsc::channel(READY_QUEUED);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let tcp = match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (tls, tx) = (tls.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(TlsConn(s))).await;
                    }
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
            });
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
}
