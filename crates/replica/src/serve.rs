//! Serving a bus subject, the one way every handler does it.
//!
//! - [`serve_requests`]: request subjects (route, mark_prefill, overlap lookups ...): each
//!   message is decoded, handled in a task of its own (counted in flight, so shutdown can wait
//!   for it) and answered in the format version it came in; a request that cannot be decoded
//!   is counted and answered `malformed`. Nothing a peer sends stops the loop.
//! - [`forward`]: one-way subjects (registrations, heartbeats, events ...): each message is
//!   decoded and handed on; an undecodable one is counted and dropped, logged at most every
//!   10 s per subject. [`forward_from_workers`] also drops what a worker says on another
//!   worker's subject.

use crate::config::ReplicaError;
use crate::metrics::Metrics;
use crate::route_phases::{RouteClock, RoutePhase};
use bytes::Bytes;
use kvrouter_bus::{Bus, Subscription};
use kvrouter_protocol::{
    decode_versioned, encode_as, reply_version, ErrorKind, ErrorReply, FromWorker, ModelSubjects,
    Reply, Wire, WorkerSubject,
};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// Requests being answered; shutdown waits for them.
#[derive(Default)]
pub struct InFlight(AtomicUsize);

impl InFlight {
    pub fn count(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Counts one request until the guard is dropped (the drain waits for it).
    pub fn enter(self: &Arc<Self>) -> InFlightGuard {
        InFlightGuard::new(self)
    }
}

pub struct InFlightGuard(Arc<InFlight>);

impl InFlightGuard {
    fn new(f: &Arc<InFlight>) -> Self {
        f.0.fetch_add(1, Ordering::AcqRel);
        Self(f.clone())
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Subscribes (in a queue group when given), naming the subject in the error.
pub async fn subscribe(
    bus: &Bus,
    subject: String,
    group: Option<&str>,
) -> Result<Subscription, ReplicaError> {
    let r = match group {
        Some(g) => bus.queue_subscribe(&subject, g).await,
        None => bus.subscribe(&subject).await,
    };
    r.map_err(|source| ReplicaError::Subscribe { subject, source })
}

/// What every request loop needs besides its handler.
#[derive(Clone)]
pub struct Server {
    pub bus: Bus,
    pub inflight: Arc<InFlight>,
    pub metrics: Arc<Metrics>,
}

/// Whether a request without a reply subject is still handled.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OneWay {
    /// Handled, the answer dropped (mark_prefill and free may be fire-and-forget).
    Handle,
    /// Dropped: an answer nobody reads is work (and maybe load) for nothing.
    Drop,
}

/// A reply in format `version`; an encoding failure becomes an `internal` error reply.
pub fn encode_reply<T: Wire>(result: Result<T, ErrorReply>, version: u8) -> Bytes {
    let reply: Reply<T> = result.into();
    match encode_as(&reply, version) {
        Ok(b) => Bytes::from(b),
        Err(e) => {
            let err: Reply<T> = Reply::Err(ErrorReply::new(ErrorKind::Internal, e.to_string()));
            Bytes::from(encode_as(&err, version).unwrap_or_default())
        }
    }
}

/// A handler's answer, and what to do once it is encoded: the route endpoint observes its
/// phases there, the encoding's time included.
pub struct Answer<Resp> {
    pub result: Result<Resp, ErrorReply>,
    pub encoded: Option<Box<dyn FnOnce(Duration) + Send>>,
}

impl<Resp> From<Result<Resp, ErrorReply>> for Answer<Resp> {
    fn from(result: Result<Resp, ErrorReply>) -> Self {
        Self {
            result,
            encoded: None,
        }
    }
}

/// The error answer to a request that cannot be decoded.
pub fn malformed(e: impl std::fmt::Display) -> ErrorReply {
    ErrorReply::new(
        ErrorKind::Malformed,
        format!("cannot decode the request: {e}"),
    )
}

/// Serves the requests of `sub` with `handler`, each in a task of its own, until the
/// subscription ends (run it in a task; aborting that task stops taking requests). `kind`
/// names the subject in metrics (`kvrouter_undecodable_messages_total{subject}`). The
/// handler gets the request's phase clock, its decoding timed (when phase timing is on).
pub async fn serve_requests<Req, Resp, F, Fut>(
    mut sub: Subscription,
    server: Server,
    kind: &'static str,
    one_way: OneWay,
    handler: F,
) where
    Req: Wire + Send + 'static,
    Resp: Wire + Send + 'static,
    F: Fn(Req, RouteClock) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Answer<Resp>> + Send + 'static,
{
    let handler = Arc::new(handler);
    {
        while let Some(msg) = sub.next().await {
            let guard = InFlightGuard::new(&server.inflight);
            let (server, handler) = (server.clone(), handler.clone());
            tokio::spawn(async move {
                let _guard = guard;
                let mut clock: RouteClock = server.metrics.phase_switch.clock();
                let (answer, version) = match decode_versioned::<Req>(&msg.payload) {
                    Ok((req, version)) => {
                        if msg.reply.is_none() && one_way == OneWay::Drop {
                            tracing::debug!(subject = %msg.subject, "request without a reply subject dropped");
                            return;
                        }
                        clock.lap(RoutePhase::Decode);
                        (handler(req, clock).await, version)
                    }
                    Err(e) => {
                        server.metrics.undecodable(kind);
                        server.metrics.error("", ErrorKind::Malformed);
                        tracing::debug!(subject = %msg.subject, error = %e, "undecodable request");
                        // Answered in the version it claims when this build reads it.
                        (Err(malformed(e)).into(), reply_version(&msg.payload))
                    }
                };
                let Some(reply_to) = msg.reply else { return };
                let Answer { result, encoded } = answer;
                let payload = match encoded {
                    Some(then) => {
                        let started = Instant::now();
                        let payload = encode_reply(result, version);
                        then(started.elapsed());
                        payload
                    }
                    None => encode_reply(result, version),
                };
                if let Err(e) = server.bus.publish(&reply_to, payload).await {
                    tracing::debug!(error = %e, "cannot send a reply (the requester may have gone)");
                }
            });
        }
    }
}

/// Decodes every message of a one-way subscription and hands it on; undecodable ones are
/// counted, logged (at most every 10 s per subject) and dropped.
pub fn forward<T: Wire + Send + 'static>(
    sub: Subscription,
    metrics: Arc<Metrics>,
    kind: &'static str,
    to: impl FnMut(T) + Send + 'static,
) -> JoinHandle<()> {
    forward_checked(sub, metrics, kind, |_: &str, _: &T| true, to)
}

/// [`forward`] for `what` workers publish, subscribed on every worker's subject (or, for one
/// release, the model-wide legacy one): a message whose payload names another worker than
/// its subject does is counted as misattributed, logged and dropped. With NATS permissions
/// confining each worker's credentials to its own subjects, no worker speaks for another.
pub fn forward_from_workers<T: Wire + FromWorker + Send + 'static>(
    sub: Subscription,
    subjects: ModelSubjects,
    what: WorkerSubject,
    metrics: Arc<Metrics>,
    kind: &'static str,
    to: impl FnMut(T) + Send + 'static,
) -> JoinHandle<()> {
    let legacy = subjects.legacy(what);
    let check = move |subject: &str, v: &T| {
        subjects.worker_of(subject) == Some(v.worker_id()) || legacy.as_deref() == Some(subject)
    };
    forward_checked(sub, metrics, kind, check, to)
}

/// [`forward_from_workers`] on every worker's subject for `what` and, for one release, the
/// model-wide legacy one: a task each, both handing to `to`.
pub async fn follow_workers<T, F>(
    bus: &Bus,
    subjects: &ModelSubjects,
    what: WorkerSubject,
    metrics: &Arc<Metrics>,
    kind: &'static str,
    to: F,
    back: &mut Vec<JoinHandle<()>>,
) -> Result<(), ReplicaError>
where
    T: Wire + FromWorker + Send + 'static,
    F: FnMut(T) + Clone + Send + 'static,
{
    for subject in [subjects.every_worker(what)]
        .into_iter()
        .chain(subjects.legacy(what))
    {
        let sub = subscribe(bus, subject, None).await?;
        back.push(forward_from_workers(
            sub,
            subjects.clone(),
            what,
            metrics.clone(),
            kind,
            to.clone(),
        ));
    }
    Ok(())
}

fn forward_checked<T: Wire + Send + 'static>(
    mut sub: Subscription,
    metrics: Arc<Metrics>,
    kind: &'static str,
    check: impl Fn(&str, &T) -> bool + Send + 'static,
    mut to: impl FnMut(T) + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let (mut dropped, mut misattributed) = (0u64, 0u64);
        let mut last_warn: Option<Instant> = None;
        let mut warn_now = || {
            let due = last_warn.is_none_or(|t| t.elapsed() > Duration::from_secs(10));
            if due {
                last_warn = Some(Instant::now());
            }
            due
        };
        while let Some(msg) = sub.next().await {
            match decode_versioned::<T>(&msg.payload) {
                Ok((v, _)) if check(&msg.subject, &v) => to(v),
                Ok(_) => {
                    misattributed += 1;
                    metrics.misattributed(kind);
                    if warn_now() {
                        tracing::warn!(subject = %msg.subject, misattributed, "{kind} naming another worker than its subject dropped (a worker speaking for another: check the bus credentials)");
                    }
                }
                Err(e) => {
                    dropped += 1;
                    metrics.undecodable(kind);
                    if warn_now() {
                        tracing::warn!(subject = %msg.subject, error = %e, dropped, "undecodable {kind} dropped");
                    }
                }
            }
        }
    })
}
