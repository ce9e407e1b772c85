//! The bus handle: one enum over the two implementations. Validation and the payload limit are
//! checked here, once, so both behave the same.

use std::time::Duration;

use bytes::Bytes;

use crate::local::LocalBus;
use crate::nats::NatsBus;
use crate::subject::{validate_publish, validate_queue_group, validate_subscribe};
use crate::{BusError, Message, NatsOptions, ReplyStream, Subscription};

/// A handle on the bus. Clones share the same NATS connection or in-process broker.
#[derive(Clone, Debug)]
pub enum Bus {
    Nats(NatsBus),
    Local(LocalBus),
}

impl From<LocalBus> for Bus {
    fn from(bus: LocalBus) -> Self {
        Bus::Local(bus)
    }
}

impl From<NatsBus> for Bus {
    fn from(bus: NatsBus) -> Self {
        Bus::Nats(bus)
    }
}

impl Bus {
    /// Connects to NATS. Fails promptly with [`BusError::Connect`] (naming the URL) if no server
    /// accepts the first connection; after that, reconnects on its own for ever.
    pub async fn connect(opts: &NatsOptions) -> Result<Bus, BusError> {
        NatsBus::connect(opts).await.map(Bus::Nats)
    }

    /// A fresh in-process broker (1 MiB payload limit; see [`LocalBus::with_max_payload`]).
    pub fn local() -> Bus {
        Bus::Local(LocalBus::new())
    }

    /// Publishes `payload` to `subject` (no wildcards).
    pub async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), BusError> {
        self.send(subject, None, payload).await
    }

    /// Publishes `payload` to `subject`, asking for replies on `reply`.
    pub async fn publish_with_reply(
        &self,
        subject: &str,
        reply: &str,
        payload: Bytes,
    ) -> Result<(), BusError> {
        validate_publish(reply)?;
        self.send(subject, Some(reply), payload).await
    }

    /// Subscribes to `subject`, which may contain the wildcards `*` and `>`.
    pub async fn subscribe(&self, subject: &str) -> Result<Subscription, BusError> {
        validate_subscribe(subject)?;
        match self {
            Bus::Nats(n) => n.subscribe(subject, None).await.map(Subscription::nats),
            Bus::Local(l) => Ok(Subscription::local(l.subscribe(subject, None))),
        }
    }

    /// Subscribes to `subject` as a member of the queue group `group`: each message goes to one
    /// member of each group (and to every plain subscriber).
    pub async fn queue_subscribe(
        &self,
        subject: &str,
        group: &str,
    ) -> Result<Subscription, BusError> {
        validate_subscribe(subject)?;
        validate_queue_group(group)?;
        match self {
            Bus::Nats(n) => n
                .subscribe(subject, Some(group))
                .await
                .map(Subscription::nats),
            Bus::Local(l) => Ok(Subscription::local(l.subscribe(subject, Some(group)))),
        }
    }

    /// Sends a request and waits up to `timeout` for the first reply.
    /// [`BusError::NoResponders`] when nobody is subscribed to `subject`,
    /// [`BusError::Timeout`] when somebody is but did not answer in time.
    pub async fn request(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Message, BusError> {
        validate_publish(subject)?;
        self.check_payload(payload.len())?;
        match self {
            Bus::Nats(n) => n.request(subject, payload, timeout).await,
            Bus::Local(l) => {
                let inbox = l.new_inbox();
                let mut sub = l.subscribe(&inbox, None);
                if l.publish(subject, Some(&inbox), &payload) == 0 {
                    return Err(BusError::NoResponders {
                        subject: subject.to_string(),
                    });
                }
                match tokio::time::timeout(timeout, sub.recv()).await {
                    Ok(Some(m)) => Ok(m),
                    Ok(None) => Err(BusError::Closed),
                    Err(_) => Err(BusError::Timeout {
                        subject: subject.to_string(),
                        after: timeout,
                    }),
                }
            }
        }
    }

    /// Sends a request whose answer is a stream of messages ended by the end-of-stream marker
    /// (an empty payload, see [`Bus::end_stream`]). Each message must arrive within
    /// `idle_timeout` of the previous one (or of the request).
    pub async fn request_stream(
        &self,
        subject: &str,
        payload: Bytes,
        idle_timeout: Duration,
    ) -> Result<ReplyStream, BusError> {
        validate_publish(subject)?;
        self.check_payload(payload.len())?;
        match self {
            Bus::Nats(n) => {
                let inbox = n.new_inbox();
                let sub = n.subscribe(&inbox, None).await?;
                n.publish(subject, Some(&inbox), payload).await?;
                Ok(ReplyStream::nats(subject, idle_timeout, sub))
            }
            Bus::Local(l) => {
                let inbox = l.new_inbox();
                let sub = l.subscribe(&inbox, None);
                let delivered = l.publish(subject, Some(&inbox), &payload);
                Ok(ReplyStream::local(
                    subject,
                    idle_timeout,
                    sub,
                    delivered == 0,
                ))
            }
        }
    }

    /// Responder side of a streamed reply: sends the end-of-stream marker (an empty payload)
    /// to `reply`.
    pub async fn end_stream(&self, reply: &str) -> Result<(), BusError> {
        self.send(reply, None, Bytes::new()).await
    }

    /// A fresh, unique reply subject (`_INBOX.<unique>`; on NATS under the connection's
    /// reply prefix, see [`NatsOptions::reply_prefix`](crate::NatsOptions::reply_prefix)).
    pub fn new_inbox(&self) -> String {
        match self {
            Bus::Nats(n) => n.new_inbox(),
            Bus::Local(l) => l.new_inbox(),
        }
    }

    /// Waits until everything published so far has been written to the server (NATS);
    /// immediate for the in-process bus, which delivers on publish.
    pub async fn flush(&self) -> Result<(), BusError> {
        match self {
            Bus::Nats(n) => n.flush().await,
            Bus::Local(_) => Ok(()),
        }
    }

    /// [`Bus::flush`] that gives up after `limit` with [`BusError::Stalled`]. Shutdown paths use
    /// it: while NATS is down a flush waits for the reconnect, which may never come.
    pub async fn flush_within(&self, limit: Duration) -> Result<(), BusError> {
        tokio::time::timeout(limit, self.flush())
            .await
            .unwrap_or_else(|_| {
                Err(BusError::Stalled {
                    what: "flush".into(),
                    after: limit,
                })
            })
    }

    /// [`Bus::publish`] that gives up after `limit` with [`BusError::Stalled`]: while NATS is
    /// down, a publish waits once async-nats' outbound queue is full. A publish that returned
    /// `Ok` is only queued; follow it with [`Bus::flush_within`] to know it reached the server.
    pub async fn publish_within(
        &self,
        subject: &str,
        payload: Bytes,
        limit: Duration,
    ) -> Result<(), BusError> {
        tokio::time::timeout(limit, self.publish(subject, payload))
            .await
            .unwrap_or_else(|_| {
                Err(BusError::Stalled {
                    what: format!("publish to '{subject}'"),
                    after: limit,
                })
            })
    }

    /// How many times the NATS connection was lost since it was made (0 for the in-process
    /// bus).
    pub fn disconnects(&self) -> u64 {
        match self {
            Bus::Nats(n) => n.disconnects(),
            Bus::Local(_) => 0,
        }
    }

    /// Whether the NATS connection is currently up (false while reconnecting); always true for
    /// the in-process bus.
    pub fn is_connected(&self) -> bool {
        match self {
            Bus::Nats(n) => n.is_connected(),
            Bus::Local(_) => true,
        }
    }

    /// The largest payload one message may carry: the server's `max_payload` for NATS, the
    /// configured limit (default 1 MiB) for the in-process bus.
    pub fn max_payload(&self) -> usize {
        match self {
            Bus::Nats(n) => n.max_payload(),
            Bus::Local(l) => l.max_payload(),
        }
    }

    /// The one place the payload limit is checked, for both implementations.
    fn check_payload(&self, len: usize) -> Result<(), BusError> {
        let max = self.max_payload();
        if len > max {
            return Err(BusError::PayloadTooLarge { len, max });
        }
        Ok(())
    }

    /// Validates and publishes.
    async fn send(
        &self,
        subject: &str,
        reply: Option<&str>,
        payload: Bytes,
    ) -> Result<(), BusError> {
        validate_publish(subject)?;
        self.check_payload(payload.len())?;
        match self {
            Bus::Nats(n) => n.publish(subject, reply, payload).await,
            Bus::Local(l) => {
                l.publish(subject, reply, &payload);
                // Publishing never waits for consumers; let them run now and then so a tight
                // publish loop does not starve them.
                tokio::task::coop::consume_budget().await;
                Ok(())
            }
        }
    }
}
