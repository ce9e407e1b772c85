//! HTTP/1 serving with every connection bounded: how long a client may take to send a
//! request head, how long a connection may sit idle or stall a response, how many
//! connections may be open at once; and request bodies read within a size and a time.
//!
//! Every listener of kvrouter (the frontend, the replica's admin port and JSON API, the
//! bridge's admin port, the mocker's emulated engine) serves through [`HttpServer`], so a
//! slow or half-open client costs a connection slot for a bounded time and nothing more.

use crate::auth::{HttpAuth, Refusal, VerifiedClientCert};
use crate::tls::ServerTls;
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Sleep;

/// The bounds on one listener's connections, and who may connect (TLS) and call (tokens).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// From a request head's first byte to its end.
    pub header_timeout: Duration,
    /// From the end of a request head to the end of its body.
    pub body_timeout: Duration,
    /// A connection with no request in flight is closed after this long; a response write
    /// that makes no progress for this long closes the connection too.
    pub idle_timeout: Duration,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Largest request head (request line and headers); a longer one is answered 431.
    pub max_header_bytes: usize,
    /// HTTPS (and mTLS) instead of plain HTTP. The handshake must end within
    /// `header_timeout`, and holds a connection slot meanwhile.
    pub tls: Option<ServerTls>,
    /// Who may call what: checked by the admin endpoint ([`crate::serve`]) on its API,
    /// debug and (on request) metrics paths, and by any handler that asks
    /// ([`HttpAuth::check`]). Open by default.
    pub auth: HttpAuth,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_header_bytes: 64 << 10,
            tls: None,
            auth: HttpAuth::open(),
        }
    }
}

impl HttpLimits {
    /// Zero durations and counts make no sense: say which.
    pub fn validate(&self) -> Result<(), String> {
        let zero = [
            ("header timeout", self.header_timeout.is_zero()),
            ("body timeout", self.body_timeout.is_zero()),
            ("idle timeout", self.idle_timeout.is_zero()),
            ("connection cap", self.max_connections == 0),
            ("header size limit", self.max_header_bytes < 1024),
        ];
        match zero.iter().find(|(_, bad)| *bad) {
            Some((what, _)) if *what == "header size limit" => {
                Err("the HTTP header size limit must be at least 1024 bytes".into())
            }
            Some((what, _)) => Err(format!("the HTTP {what} must be above zero")),
            None => Ok(()),
        }
    }
}

/// What a listener has seen, for its process's metrics.
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections refused at the cap.
    pub refused: AtomicU64,
    /// Connections closed because a client was too slow (head, idle, stalled write or TLS
    /// handshake).
    pub timed_out: AtomicU64,
    /// Whether the listener serves TLS, and its failed handshakes (no or a bad client
    /// certificate, not TLS at all ...).
    pub tls: bool,
    pub tls_failed: AtomicU64,
    /// Whether calls are authenticated, and the calls refused, by [`Refusal::index`].
    pub auth: bool,
    pub auth_refused: [AtomicU64; Refusal::REASONS.len()],
}

impl HttpStats {
    /// The counts of a listener served within `limits`.
    pub fn for_limits(limits: &HttpLimits) -> Self {
        Self {
            tls: limits.tls.is_some(),
            auth: !limits.auth.is_open(),
            ..Self::default()
        }
    }

    /// Counts a refused call.
    pub fn refused_call(&self, why: Refusal) {
        self.auth_refused[why.index()].fetch_add(1, Ordering::Relaxed);
    }
}

/// The connection counts of `listeners` (each named by its address) as OpenMetrics
/// families named `{prefix}_http_...`, put before the `# EOF` that ends `text`.
pub fn append_http_stats(
    mut text: String,
    prefix: &str,
    listeners: &[(SocketAddr, Arc<HttpStats>)],
) -> String {
    use std::fmt::Write;
    if listeners.is_empty() {
        return text;
    }
    let eof = text.rfind("# EOF").unwrap_or(text.len());
    let tail = text.split_off(eof);
    type Family = (
        &'static str,
        &'static str,
        &'static str,
        fn(&HttpStats) -> u64,
    );
    let families: [Family; 3] = [
        ("connections", "gauge", "Client connections open.", |s| {
            s.open.load(Ordering::Relaxed) as u64
        }),
        (
            "connections_refused",
            "counter",
            "Connections refused at the connection cap.",
            |s| s.refused.load(Ordering::Relaxed),
        ),
        (
            "connections_timed_out",
            "counter",
            "Connections closed for a slow client (request head, idle or unread answer).",
            |s| s.timed_out.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, value) in families {
        let suffix = if kind == "counter" { "_total" } else { "" };
        let _ = writeln!(text, "# HELP {prefix}_http_{name} {help}");
        let _ = writeln!(text, "# TYPE {prefix}_http_{name} {kind}");
        for (addr, stats) in listeners {
            let _ = writeln!(
                text,
                "{prefix}_http_{name}{suffix}{{listener=\"{addr}\"}} {}",
                value(stats)
            );
        }
    }
    let tls: Vec<_> = listeners.iter().filter(|(_, s)| s.tls).collect();
    if !tls.is_empty() {
        let name = format!("{prefix}_http_tls_handshakes_failed");
        let _ = writeln!(
            text,
            "# HELP {name} TLS handshakes that failed (no or an unverified client certificate, not TLS, ...)."
        );
        let _ = writeln!(text, "# TYPE {name} counter");
        for (addr, stats) in tls {
            let n = stats.tls_failed.load(Ordering::Relaxed);
            let _ = writeln!(text, "{name}_total{{listener=\"{addr}\"}} {n}");
        }
    }
    let auth: Vec<_> = listeners.iter().filter(|(_, s)| s.auth).collect();
    if !auth.is_empty() {
        let name = format!("{prefix}_http_auth_refused");
        let _ = writeln!(
            text,
            "# HELP {name} Calls refused for their credentials (401 missing, malformed or invalid_token; 403 insufficient_scope)."
        );
        let _ = writeln!(text, "# TYPE {name} counter");
        for (addr, stats) in auth {
            for (reason, n) in Refusal::REASONS.iter().zip(&stats.auth_refused) {
                let n = n.load(Ordering::Relaxed);
                let _ = writeln!(
                    text,
                    "{name}_total{{listener=\"{addr}\",reason=\"{reason}\"}} {n}"
                );
            }
        }
    }
    text.push_str(&tail);
    text
}

/// Why a request body could not be had.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum BodyError {
    #[error("the request body is over {0} bytes")]
    TooLarge(usize),
    #[error("the request body did not arrive within {0:?}")]
    TimedOut(Duration),
    #[error("cannot read the request body: {0}")]
    Read(String),
    #[error("the server is reading {0} MiB of request bodies already; retry shortly")]
    Busy(usize),
}

impl BodyError {
    /// The HTTP status that says it: 413, 408 or 400.
    pub fn status(&self) -> u16 {
        match self {
            Self::TooLarge(_) => 413,
            Self::TimedOut(_) => 408,
            Self::Read(_) => 400,
            Self::Busy(_) => 503,
        }
    }
}

/// A request's whole body: refused unread when its `Content-Length` is over `limit`,
/// refused once `limit` bytes are passed otherwise, and given up after `timeout`.
pub async fn read_body(
    req: Request<Incoming>,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, BodyError> {
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge(limit));
    }
    let read = Limited::new(req.into_body(), limit).collect();
    match tokio::time::timeout(timeout, read).await {
        Err(_) => Err(BodyError::TimedOut(timeout)),
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(BodyError::TooLarge(limit))
        }
        Ok(Err(e)) => Err(BodyError::Read(e.to_string())),
    }
}

/// The request body bytes a server holds at once, over all its connections: bytes count
/// as they arrive (a slow client holds only what it has sent), in KiB.
#[derive(Clone, Debug)]
pub struct BodyBudget {
    kib: Arc<tokio::sync::Semaphore>,
    total_kib: usize,
}

/// Bytes of a [`BodyBudget`] held until the body they count is dropped or parsed.
pub struct BudgetHold(Option<tokio::sync::OwnedSemaphorePermit>);

impl BodyBudget {
    pub fn new(bytes: usize) -> Self {
        let total_kib = bytes
            .div_ceil(1024)
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        Self {
            kib: Arc::new(tokio::sync::Semaphore::new(total_kib)),
            total_kib,
        }
    }

    /// Bytes held now.
    pub fn held_bytes(&self) -> usize {
        (self.total_kib - self.kib.available_permits()) * 1024
    }

    /// Like [`read_body`], counting the bytes against this budget as they come; a body that
    /// finds the budget spent is refused ([`BodyError::Busy`]) rather than waited for.
    pub async fn read_body(
        &self,
        req: Request<Incoming>,
        limit: usize,
        timeout: Duration,
    ) -> Result<(Bytes, BudgetHold), BodyError> {
        let declared = req
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(BodyError::TooLarge(limit));
        }
        let mut body = req.into_body();
        let mut hold = BudgetHold(None);
        let read = async {
            let mut buf = bytes::BytesMut::new();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| BodyError::Read(e.to_string()))?;
                let Ok(data) = frame.into_data() else {
                    continue; // trailers
                };
                if buf.len() + data.len() > limit {
                    return Err(BodyError::TooLarge(limit));
                }
                let held = hold.0.as_ref().map_or(0, |p| p.num_permits());
                let need = (buf.len() + data.len()).div_ceil(1024);
                if need > held {
                    let more = u32::try_from(need - held)
                        .ok()
                        .and_then(|n| self.kib.clone().try_acquire_many_owned(n).ok())
                        .ok_or(BodyError::Busy(self.total_kib / 1024))?;
                    match &mut hold.0 {
                        Some(p) => p.merge(more),
                        None => hold.0 = Some(more),
                    }
                }
                buf.extend_from_slice(&data);
            }
            Ok(buf.freeze())
        };
        match tokio::time::timeout(timeout, read).await {
            Err(_) => Err(BodyError::TimedOut(timeout)),
            Ok(r) => r.map(|b| (b, hold)),
        }
    }
}

/// A listener serving HTTP/1 within [`HttpLimits`]. Dropping it stops accepting and closes
/// every connection.
pub struct HttpServer {
    pub addr: SocketAddr,
    pub stats: Arc<HttpStats>,
    accept: JoinHandle<()>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl HttpServer {
    /// Serves `listener`; `handle` answers each request (`name` is for logs). A request
    /// that came over a connection with a verified client certificate carries
    /// [`VerifiedClientCert`] in its extensions.
    pub fn start<H, F, B>(
        listener: TcpListener,
        limits: HttpLimits,
        name: &'static str,
        handle: H,
    ) -> io::Result<Self>
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<B>> + Send + 'static,
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let stats = Arc::new(HttpStats::for_limits(&limits));
        Self::start_with_stats(listener, limits, name, stats, handle)
    }

    /// [`HttpServer::start`] counting into `stats`, which the handler may hold too (to count
    /// the calls it refuses, [`HttpStats::refused_call`]).
    pub fn start_with_stats<H, F, B>(
        listener: TcpListener,
        limits: HttpLimits,
        name: &'static str,
        stats: Arc<HttpStats>,
        handle: H,
    ) -> io::Result<Self>
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<B>> + Send + 'static,
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let addr = listener.local_addr()?;
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let accept = tokio::spawn(accept_loop(
            listener,
            limits,
            name,
            handle,
            stats.clone(),
            connections.clone(),
        ));
        Ok(Self {
            addr,
            stats,
            accept,
            connections,
        })
    }

    /// Binds `addr` and serves it.
    pub async fn bind<H, F, B>(
        addr: SocketAddr,
        limits: HttpLimits,
        name: &'static str,
        handle: H,
    ) -> io::Result<Self>
    where
        H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response<B>> + Send + 'static,
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        Self::start(TcpListener::bind(addr).await?, limits, name, handle)
    }

    /// Stops accepting; open connections go on.
    pub fn stop_accepting(&self) {
        self.accept.abort();
    }

    /// Closes every open connection now.
    pub fn close_connections(&self) {
        self.connections.lock().abort_all();
    }

    /// Runs until the task is aborted, then closes everything (how a plain
    /// `JoinHandle`-shaped server is kept).
    pub async fn run_until_aborted(self) {
        std::future::pending::<()>().await;
        drop(self);
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.accept.abort();
        self.connections.lock().abort_all();
    }
}

/// At most one warning a minute per listener: a flood must not flood the logs too.
struct Warn {
    last: Mutex<Option<Instant>>,
}

impl Warn {
    fn due(&self) -> bool {
        let mut last = self.last.lock();
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(60)) {
            return false;
        }
        *last = Some(now);
        true
    }
}

const REFUSED: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\nretry-after: 1\r\ncontent-length: 0\r\n\r\n";

async fn accept_loop<H, F, B>(
    listener: TcpListener,
    limits: HttpLimits,
    name: &'static str,
    handle: H,
    stats: Arc<HttpStats>,
    connections: Arc<Mutex<JoinSet<()>>>,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let warn = Warn {
        last: Mutex::new(None),
    };
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors, typically: wait for some to close.
                if warn.due() {
                    tracing::warn!(listener = name, error = %e, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            if warn.due() {
                tracing::warn!(
                    listener = name,
                    cap = limits.max_connections,
                    "connection cap reached: refusing new connections (503)"
                );
            }
            // Best effort and never waiting: the socket buffer takes it or it is dropped. A
            // TLS client could not read it.
            if limits.tls.is_none() {
                let _ = stream.try_write(REFUSED);
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        let stats = stats.clone();
        let limits = limits.clone();
        let mut set = connections.lock();
        // Reap finished connections so the set stays small.
        while set.try_join_next().is_some() {}
        set.spawn(async move {
            let _slot = slot;
            stats.open.fetch_add(1, Ordering::Relaxed);
            let _open = OnDrop(|| {
                stats.open.fetch_sub(1, Ordering::Relaxed);
            });
            let Some(tls) = limits.tls.clone() else {
                return serve_connection(stream, false, &limits, name, handle, stats.clone()).await;
            };
            // A slow handshake is a slow request head: the same bound, the same slot.
            let handshake = tls.acceptor().accept(stream);
            match tokio::time::timeout(limits.header_timeout, handshake).await {
                Ok(Ok(s)) => {
                    let cert = s
                        .get_ref()
                        .1
                        .peer_certificates()
                        .is_some_and(|c| !c.is_empty());
                    serve_connection(s, cert, &limits, name, handle, stats.clone()).await
                }
                Ok(Err(e)) => {
                    stats.tls_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(listener = name, %peer, error = %e, "TLS handshake failed");
                }
                Err(_) => {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        listener = name,
                        %peer,
                        timeout = ?limits.header_timeout,
                        "TLS handshake did not end in time"
                    );
                }
            }
        });
    }
}

/// Serves HTTP/1 on one accepted (and, with TLS, handshaken) connection.
async fn serve_connection<S, H, F, B>(
    stream: S,
    client_cert: bool,
    limits: &HttpLimits,
    name: &'static str,
    handle: H,
    stats: Arc<HttpStats>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<B>> + Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let busy = Arc::new(InFlight::default());
    let io = Guarded::new(stream, busy.clone(), limits, stats);
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        if client_cert {
            req.extensions_mut().insert(VerifiedClientCert);
        }
        let guard = Busy::enter(&busy);
        let answer = handle(req);
        async move {
            let res = answer.await;
            Ok::<_, std::convert::Infallible>(res.map(|body| Tracked {
                body,
                _guard: guard,
            }))
        }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .max_buf_size(limits.max_header_bytes.max(8192))
        .serve_connection(TokioIo::new(io), service)
        .await;
    if let Err(e) = served {
        tracing::debug!(listener = name, error = %e, "connection ended with an error");
    }
}

struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Requests in flight on one connection, and who to wake when the last one ends (so the
/// idle deadline starts even if hyper polled the socket before the answer was done).
#[derive(Default)]
struct InFlight {
    n: AtomicUsize,
    reader: Mutex<Option<Waker>>,
}

/// A request in flight on a connection, from its head to its answer's last byte.
struct Busy(Arc<InFlight>);

impl Busy {
    fn enter(f: &Arc<InFlight>) -> Self {
        f.n.fetch_add(1, Ordering::AcqRel);
        Self(f.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(w) = self.0.reader.lock().take() {
                w.wake();
            }
        }
    }
}

/// An answer's body that keeps its request counted as in flight until hyper is done with it.
struct Tracked<B> {
    body: B,
    _guard: Busy,
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// What the connection is waiting for, as far as its read deadline goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// No request in flight and no byte of the next one: the idle timeout runs.
    Idle,
    /// Part of a request head has come: the header timeout runs.
    Head,
    /// A request is being answered: its handler bounds the body read.
    Busy,
}

/// The client's socket, with the read and write deadlines of [`HttpLimits`]: a deadline
/// passed is an `io::ErrorKind::TimedOut` error, on which hyper closes the connection.
struct Guarded<S> {
    stream: S,
    busy: Arc<InFlight>,
    phase: Phase,
    header_timeout: Duration,
    idle_timeout: Duration,
    read_deadline: Pin<Box<Sleep>>,
    write_deadline: Option<Pin<Box<Sleep>>>,
    stats: Arc<HttpStats>,
    timed_out: bool,
}

impl<S> Guarded<S> {
    fn new(stream: S, busy: Arc<InFlight>, limits: &HttpLimits, stats: Arc<HttpStats>) -> Self {
        Self {
            stream,
            busy,
            phase: Phase::Idle,
            header_timeout: limits.header_timeout,
            idle_timeout: limits.idle_timeout,
            read_deadline: Box::pin(tokio::time::sleep(limits.idle_timeout)),
            write_deadline: None,
            stats,
            timed_out: false,
        }
    }

    fn expired(&mut self, what: &str) -> io::Error {
        if !std::mem::replace(&mut self.timed_out, true) {
            self.stats.timed_out.fetch_add(1, Ordering::Relaxed);
        }
        io::Error::new(io::ErrorKind::TimedOut, format!("client too slow: {what}"))
    }

    fn arm(&mut self, after: Duration) {
        let at = tokio::time::Instant::now() + after;
        self.read_deadline.as_mut().reset(at);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let busy = self.busy.n.load(Ordering::Acquire) > 0;
        match (self.phase, busy) {
            (Phase::Busy, false) => {
                self.phase = Phase::Idle;
                let t = self.idle_timeout;
                self.arm(t);
            }
            (Phase::Idle | Phase::Head, true) => self.phase = Phase::Busy,
            _ => {}
        }
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if this.phase == Phase::Idle && buf.filled().len() > before {
                    this.phase = Phase::Head;
                    let t = this.header_timeout;
                    this.arm(t);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if this.phase == Phase::Busy {
                    *this.busy.reader.lock() = Some(cx.waker().clone());
                    // The answer may have ended between the check above and now.
                    if this.busy.n.load(Ordering::Acquire) == 0 {
                        cx.waker().wake_by_ref();
                    }
                } else if this.read_deadline.as_mut().poll(cx).is_ready() {
                    let what = match this.phase {
                        Phase::Head => "the request head did not arrive in time",
                        _ => "idle for too long",
                    };
                    return Poll::Ready(Err(this.expired(what)));
                }
                Poll::Pending
            }
        }
    }
}

impl<S: Unpin> Guarded<S> {
    /// Runs the write deadline around one write-side poll.
    fn write_side<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut S>, &mut Context<'_>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match poll(Pin::new(&mut self.stream), cx) {
            Poll::Ready(r) => {
                self.write_deadline = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let idle = self.idle_timeout;
                let deadline = self
                    .write_deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                if deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(self.expired("the client does not read its answer")));
                }
                Poll::Pending
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.write_side(cx, |s, cx| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.write_side(cx, |s, cx| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.write_side(cx, |s, cx| s.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use std::io::{Read, Write};

    fn limits() -> HttpLimits {
        HttpLimits {
            header_timeout: Duration::from_millis(300),
            body_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(600),
            max_connections: 4,
            max_header_bytes: 4096,
            ..HttpLimits::default()
        }
    }

    /// `/body` reads the body (within 64 bytes and the body timeout) and says how long it
    /// was; `/big` answers 32 MiB; anything else `ok`.
    async fn server(limits: HttpLimits) -> HttpServer {
        let body_timeout = limits.body_timeout;
        HttpServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            limits,
            "test",
            move |req| async move {
                let (status, body) = match req.uri().path() {
                    "/body" => match read_body(req, 64, body_timeout).await {
                        Ok(b) => (200, Bytes::from(format!("{} bytes", b.len()))),
                        Err(e) => (e.status(), Bytes::from(e.to_string())),
                    },
                    "/big" => (200, Bytes::from(vec![b'x'; 32 << 20])),
                    _ => (200, Bytes::from_static(b"ok")),
                };
                let mut r = Response::new(Full::new(body));
                *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                r
            },
        )
        .await
        .unwrap()
    }

    fn connect(addr: SocketAddr) -> std::net::TcpStream {
        let s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    /// Reads until the server closes; the bytes read.
    fn read_to_close(mut s: std::net::TcpStream) -> String {
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).to_string()
    }

    async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        tokio::task::spawn_blocking(f).await.unwrap()
    }

    #[tokio::test]
    async fn a_head_that_never_ends_is_cut() {
        let srv = server(limits()).await;
        let addr = srv.addr;
        let out = blocking(move || {
            let mut s = connect(addr);
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
            read_to_close(s)
        })
        .await;
        // Closed without an answer (hyper may say 408 first).
        assert!(!out.contains("200 OK"), "{out}");
        assert_eq!(srv.stats.timed_out.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_or_idles_is_closed() {
        let srv = server(limits()).await;
        let addr = srv.addr;
        let (silent, idle) = blocking(move || {
            let silent = connect(addr);
            let mut idle = connect(addr);
            idle.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            (read_to_close(silent), read_to_close(idle))
        })
        .await;
        assert_eq!(silent, "");
        // One answer on the kept-alive connection, then closed for idling.
        assert!(
            idle.starts_with("HTTP/1.1 200") && idle.ends_with("ok"),
            "{idle}"
        );
        assert_eq!(srv.stats.timed_out.load(Ordering::Relaxed), 2);
        let deadline = Instant::now() + Duration::from_secs(5);
        while srv.stats.open.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(srv.stats.open.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_slow_body_gets_408_and_a_long_one_413() {
        let srv = server(limits()).await;
        let addr = srv.addr;
        let (slow, long, fine) = blocking(move || {
            let mut slow = connect(addr);
            slow.write_all(
                b"POST /body HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 10\r\n\r\nab",
            )
            .unwrap();
            let mut long = connect(addr);
            long.write_all(
                b"POST /body HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100000\r\n\r\n",
            )
            .unwrap();
            let mut fine = connect(addr);
            fine.write_all(
                b"POST /body HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc",
            )
            .unwrap();
            (read_to_close(slow), read_to_close(long), read_to_close(fine))
        })
        .await;
        assert!(slow.starts_with("HTTP/1.1 408"), "{slow}");
        assert!(slow.contains("did not arrive within"), "{slow}");
        assert!(long.starts_with("HTTP/1.1 413"), "{long}");
        assert!(
            fine.starts_with("HTTP/1.1 200") && fine.ends_with("3 bytes"),
            "{fine}"
        );
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_refused_until_one_closes() {
        let srv = server(limits()).await;
        let addr = srv.addr;
        let stats = srv.stats.clone();
        let (refused, later) = blocking(move || {
            // Four silent connections hold every slot.
            let held: Vec<_> = (0..4).map(|_| connect(addr)).collect();
            while stats.open.load(Ordering::Relaxed) < 4 {
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut extra = connect(addr);
            let _ = extra.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
            let refused = read_to_close(extra);
            drop(held);
            while stats.open.load(Ordering::Relaxed) > 0 {
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut again = connect(addr);
            again
                .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            (refused, read_to_close(again))
        })
        .await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        assert!(later.starts_with("HTTP/1.1 200"), "{later}");
        assert_eq!(srv.stats.refused.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_client_that_does_not_read_its_answer_is_cut() {
        let srv = server(limits()).await;
        let addr = srv.addr;
        let stats = srv.stats.clone();
        blocking(move || {
            let mut s = connect(addr);
            s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            // Never read: the server's writes stall once the socket buffers are full.
            let deadline = Instant::now() + Duration::from_secs(20);
            while stats.timed_out.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            drop(s);
        })
        .await;
        assert_eq!(srv.stats.timed_out.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_long_answer_in_progress_is_not_idle() {
        // A handler slower than the idle timeout still answers.
        let lim = limits();
        let srv = HttpServer::bind("127.0.0.1:0".parse().unwrap(), lim, "test", |_req| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Response::new(Full::new(Bytes::from_static(b"late")))
        })
        .await
        .unwrap();
        let addr = srv.addr;
        let out = blocking(move || {
            let mut s = connect(addr);
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            read_to_close(s)
        })
        .await;
        assert!(
            out.starts_with("HTTP/1.1 200") && out.ends_with("late"),
            "{out}"
        );
    }

    #[test]
    fn limits_must_be_sensible() {
        assert!(HttpLimits::default().validate().is_ok());
        let zero = HttpLimits {
            idle_timeout: Duration::ZERO,
            ..HttpLimits::default()
        };
        assert_eq!(
            zero.validate().unwrap_err(),
            "the HTTP idle timeout must be above zero"
        );
    }

    mod tls {
        use super::*;
        use crate::tls::{ServerTls, TlsFiles};
        use kvrouter_testkit::TestCerts;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        /// An mTLS server whose handler says whether the request came with a verified client
        /// certificate.
        async fn server(certs: &TestCerts) -> HttpServer {
            let tls = ServerTls::load(&TlsFiles {
                cert: certs.server_cert.clone(),
                key: certs.server_key.clone(),
                client_ca: Some(certs.ca.clone()),
            })
            .unwrap();
            assert!(tls.requires_client_cert());
            // A long idle timeout: only the header timeout (300 ms) can cut a handshake.
            let limits = HttpLimits {
                tls: Some(tls),
                idle_timeout: Duration::from_secs(20),
                ..limits()
            };
            HttpServer::bind(
                "127.0.0.1:0".parse().unwrap(),
                limits,
                "test",
                |req| async move {
                    let who = match req.extensions().get::<VerifiedClientCert>() {
                        Some(_) => "verified",
                        None => "anonymous",
                    };
                    Response::new(Full::new(Bytes::from(who)))
                },
            )
            .await
            .unwrap()
        }

        /// `GET /` over TLS trusting `certs.ca`, with a client certificate (cert, key) or
        /// none: the answer, or the error that ended it.
        async fn get(
            addr: SocketAddr,
            certs: &TestCerts,
            client: Option<(&std::path::Path, &std::path::Path)>,
        ) -> Result<String, String> {
            let mut roots = rustls::RootCertStore::empty();
            roots
                .add(CertificateDer::from_pem_file(&certs.ca).unwrap())
                .unwrap();
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let builder = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots);
            let config = match client {
                Some((cert, key)) => builder
                    .with_client_auth_cert(
                        vec![CertificateDer::from_pem_file(cert).unwrap()],
                        PrivateKeyDer::from_pem_file(key).unwrap(),
                    )
                    .unwrap(),
                None => builder.with_no_client_auth(),
            };
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let name = ServerName::try_from("localhost").unwrap();
            let mut s = connector
                .connect(name, tcp)
                .await
                .map_err(|e| e.to_string())?;
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
            Ok(String::from_utf8_lossy(&out).to_string())
        }

        #[tokio::test]
        async fn mtls_admits_only_clients_with_a_certificate_from_the_ca() {
            let dir = tempfile::tempdir().unwrap();
            let certs = TestCerts::generate(dir.path()).unwrap();
            let srv = server(&certs).await;
            let ok = get(
                srv.addr,
                &certs,
                Some((&certs.client_cert, &certs.client_key)),
            )
            .await
            .unwrap();
            assert!(
                ok.starts_with("HTTP/1.1 200") && ok.ends_with("verified"),
                "{ok}"
            );
            // No certificate, or one from another CA: no answer (TLS 1.3 tells the client
            // after its handshake, on its first read).
            let none = get(srv.addr, &certs, None).await;
            assert!(none.is_err(), "{none:?}");
            let stranger = get(
                srv.addr,
                &certs,
                Some((&certs.stranger_cert, &certs.stranger_key)),
            )
            .await;
            assert!(stranger.is_err(), "{stranger:?}");
            // Plain HTTP on the TLS port: refused too.
            let plain = blocking(move || {
                let mut s = connect(srv.addr);
                let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
                read_to_close(s)
            })
            .await;
            assert!(!plain.contains("200"), "{plain}");
            let failed = srv.stats.tls_failed.load(Ordering::Relaxed);
            assert_eq!(failed, 3, "each failed handshake is counted");
            let text = append_http_stats(
                "# EOF\n".into(),
                "kvrouter",
                &[(srv.addr, srv.stats.clone())],
            );
            assert!(
                text.contains(&format!(
                    "kvrouter_http_tls_handshakes_failed_total{{listener=\"{}\"}} 3",
                    srv.addr
                )),
                "{text}"
            );
        }

        #[tokio::test]
        async fn a_handshake_that_never_ends_is_cut_at_the_header_timeout() {
            let dir = tempfile::tempdir().unwrap();
            let certs = TestCerts::generate(dir.path()).unwrap();
            let srv = server(&certs).await;
            let addr = srv.addr;
            let (silent, partial, took) = blocking(move || {
                let started = Instant::now();
                let silent = connect(addr);
                let mut partial = connect(addr);
                // The first bytes of a ClientHello, then nothing.
                partial
                    .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
                    .unwrap();
                let out = (read_to_close(silent), read_to_close(partial));
                (out.0, out.1, started.elapsed())
            })
            .await;
            assert_eq!((silent.as_str(), partial.as_str()), ("", ""));
            // The header timeout (300 ms) cut them, not the idle timeout (20 s).
            assert!(took < Duration::from_secs(10), "{took:?}");
            assert_eq!(srv.stats.timed_out.load(Ordering::Relaxed), 2);
            let deadline = Instant::now() + Duration::from_secs(5);
            while srv.stats.open.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(srv.stats.open.load(Ordering::Relaxed), 0, "slots freed");
        }
    }
}
