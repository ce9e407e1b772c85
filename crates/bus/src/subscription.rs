//! What subscribing and streamed requests hand back.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::StatusCode;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use crate::local::LocalSubscription;
use crate::nats::from_nats;
use crate::{BusError, Message};

/// Messages matching one subscription, in publish order per publisher. Unsubscribes when
/// dropped. Also a [`Stream`] of [`Message`]s.
pub struct Subscription {
    inner: SubInner,
}

enum SubInner {
    Nats(async_nats::Subscriber),
    Local(LocalSubscription),
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.inner {
            SubInner::Nats(_) => "nats",
            SubInner::Local(_) => "local",
        };
        f.debug_struct("Subscription")
            .field("bus", &kind)
            .finish_non_exhaustive()
    }
}

impl Subscription {
    pub(crate) fn nats(sub: async_nats::Subscriber) -> Self {
        Self {
            inner: SubInner::Nats(sub),
        }
    }

    pub(crate) fn local(sub: LocalSubscription) -> Self {
        Self {
            inner: SubInner::Local(sub),
        }
    }

    /// The next message, or `None` once the bus is closed (the NATS client shut down, or every
    /// handle of the in-process bus dropped).
    pub async fn next(&mut self) -> Option<Message> {
        std::future::poll_fn(|cx| self.poll_message(cx)).await
    }

    fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        match &mut self.inner {
            SubInner::Nats(sub) => sub.poll_next_unpin(cx).map(|m| m.map(from_nats)),
            SubInner::Local(sub) => sub.poll_recv(cx),
        }
    }
}

impl Stream for Subscription {
    type Item = Message;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        self.get_mut().poll_message(cx)
    }
}

/// The replies to one [`Bus::request_stream`](crate::Bus::request_stream), up to the
/// end-of-stream marker (an empty payload).
///
/// After the end marker, or after any error (`Timeout`, `NoResponders`, `Closed`), the stream is
/// finished and `next` returns `None`.
pub struct ReplyStream {
    subject: String,
    idle_timeout: Duration,
    inner: ReplyInner,
    done: bool,
}

enum ReplyInner {
    Nats(async_nats::Subscriber),
    /// `no_responders`: the request reached no subscriber (known when it was published).
    Local {
        sub: LocalSubscription,
        no_responders: bool,
    },
}

impl std::fmt::Debug for ReplyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyStream")
            .field("subject", &self.subject)
            .field("idle_timeout", &self.idle_timeout)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ReplyStream {
    pub(crate) fn nats(subject: &str, idle_timeout: Duration, sub: async_nats::Subscriber) -> Self {
        Self {
            subject: subject.to_string(),
            idle_timeout,
            inner: ReplyInner::Nats(sub),
            done: false,
        }
    }

    pub(crate) fn local(
        subject: &str,
        idle_timeout: Duration,
        sub: LocalSubscription,
        no_responders: bool,
    ) -> Self {
        Self {
            subject: subject.to_string(),
            idle_timeout,
            inner: ReplyInner::Local { sub, no_responders },
            done: false,
        }
    }

    /// The next reply payload; `None` after the end-of-stream marker or an error.
    ///
    /// `Err(Timeout)` when nothing arrives within the idle timeout, `Err(NoResponders)` when
    /// nobody was subscribed to the request's subject.
    pub async fn next(&mut self) -> Option<Result<Bytes, BusError>> {
        if self.done {
            return None;
        }
        let idle = self.idle_timeout;
        let received = match &mut self.inner {
            ReplyInner::Local {
                no_responders: true,
                ..
            } => Reply::NoResponders,
            ReplyInner::Local { sub, .. } => match tokio::time::timeout(idle, sub.recv()).await {
                Err(_) => Reply::Timeout,
                Ok(None) => Reply::Closed,
                Ok(Some(m)) => Reply::Payload(m.payload),
            },
            ReplyInner::Nats(sub) => match tokio::time::timeout(idle, sub.next()).await {
                Err(_) => Reply::Timeout,
                Ok(None) => Reply::Closed,
                Ok(Some(m)) if m.status == Some(StatusCode::NO_RESPONDERS) => Reply::NoResponders,
                Ok(Some(m)) => Reply::Payload(m.payload),
            },
        };
        let result = match received {
            Reply::Payload(p) if !p.is_empty() => return Some(Ok(p)),
            Reply::Payload(_) => {
                self.done = true;
                return None;
            }
            Reply::Timeout => BusError::Timeout {
                subject: self.subject.clone(),
                after: idle,
            },
            Reply::NoResponders => BusError::NoResponders {
                subject: self.subject.clone(),
            },
            Reply::Closed => BusError::Closed,
        };
        self.done = true;
        Some(Err(result))
    }
}

enum Reply {
    Payload(Bytes),
    Timeout,
    NoResponders,
    Closed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Bus;

    #[tokio::test]
    async fn a_subscription_is_a_stream() {
        let bus = Bus::local();
        let sub = bus.subscribe("s.>").await.unwrap();
        for i in 0..3u8 {
            bus.publish("s.x", Bytes::from(vec![i])).await.unwrap();
        }
        drop(bus);
        let got: Vec<Message> = sub.collect().await;
        let payloads: Vec<&[u8]> = got.iter().map(|m| m.payload.as_ref()).collect();
        assert_eq!(payloads, [[0u8], [1], [2]]);
    }

    #[tokio::test]
    async fn a_reply_stream_ends_when_the_local_bus_closes() {
        let bus = crate::LocalBus::new();
        let mut responder = bus.subscribe("svc", None);
        let mut stream = Bus::Local(bus.clone())
            .request_stream("svc", Bytes::from_static(b"q"), Duration::from_secs(5))
            .await
            .unwrap();
        let request = responder.recv().await.unwrap();
        assert!(request.reply.is_some());
        drop(responder);
        drop(bus);
        assert_eq!(stream.next().await, Some(Err(BusError::Closed)));
        assert_eq!(stream.next().await, None);
    }
}
