//! The in-process bus: a broker in shared memory with NATS core semantics.
//!
//! Subscriptions live in a table behind a `parking_lot::RwLock`: subjects without wildcards in a
//! hash map (one lookup per publish, which covers inboxes), wildcard subscriptions in a short
//! list matched token by token. A publish takes the read lock and pushes into unbounded channels,
//! so it never waits for a consumer; the only allocation per delivery is the `Message` itself.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use bytes::Bytes;
use parking_lot::RwLock;
use tokio::sync::mpsc;

use crate::subject;
use crate::Message;

/// The default (and NATS server default) largest payload: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// An in-process broker. Clones share it; it closes (subscriptions end) when the last clone
/// is dropped.
#[derive(Clone)]
pub struct LocalBus {
    broker: Arc<Broker>,
}

impl std::fmt::Debug for LocalBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBus")
            .field("max_payload", &self.broker.max_payload)
            .finish_non_exhaustive()
    }
}

impl Default for LocalBus {
    fn default() -> Self {
        Self::new()
    }
}

struct Broker {
    table: RwLock<Table>,
    next_sub_id: AtomicU64,
    inbox_prefix: String,
    next_inbox: AtomicU64,
    max_payload: usize,
    /// Counter behind queue-group picks: spread like random choices, but the same sequence of
    /// publishes picks the same members every time (deterministic in-process replays).
    picks: AtomicU64,
}

#[derive(Default)]
struct Table {
    literal: HashMap<Box<str>, Node>,
    wildcard: Vec<(Box<str>, Node)>,
}

/// The subscriptions of one subject pattern.
#[derive(Default)]
struct Node {
    plain: Vec<Sink>,
    groups: Vec<Group>,
}

impl Node {
    fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.groups.is_empty()
    }
}

struct Group {
    name: Box<str>,
    members: Vec<Sink>,
}

struct Sink {
    id: u64,
    tx: mpsc::UnboundedSender<Message>,
}

impl Sink {
    fn send(&self, subject: &str, reply: Option<&str>, payload: &Bytes) -> bool {
        self.tx
            .send(Message {
                subject: subject.to_owned(),
                reply: reply.map(str::to_owned),
                payload: payload.clone(),
            })
            .is_ok()
    }
}

/// Delivers to one of `members`, starting at a random one and skipping members whose
/// subscription is being dropped. Returns whether someone got it.
fn deliver_to_one<S: Borrow<Sink>>(
    pick: u64,
    members: &[S],
    subject: &str,
    reply: Option<&str>,
    payload: &Bytes,
) -> bool {
    let n = members.len();
    if n == 0 {
        return false;
    }
    // splitmix64 of the pick counter: uniform enough, and reproducible.
    let mut z = pick.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    let start = ((z ^ (z >> 31)) % n as u64) as usize;
    (0..n).any(|i| {
        members[(start + i) % n]
            .borrow()
            .send(subject, reply, payload)
    })
}

impl LocalBus {
    /// A fresh broker with the default 1 MiB payload limit.
    pub fn new() -> Self {
        Self::with_max_payload(DEFAULT_MAX_PAYLOAD)
    }

    /// A fresh broker that rejects payloads larger than `max_payload` bytes.
    pub fn with_max_payload(max_payload: usize) -> Self {
        Self {
            broker: Arc::new(Broker {
                table: RwLock::new(Table::default()),
                next_sub_id: AtomicU64::new(1),
                inbox_prefix: format!("_INBOX.{:016x}.", fastrand::u64(..)),
                next_inbox: AtomicU64::new(1),
                max_payload,
                picks: AtomicU64::new(0),
            }),
        }
    }

    pub(crate) fn max_payload(&self) -> usize {
        self.broker.max_payload
    }

    pub(crate) fn new_inbox(&self) -> String {
        let n = self.broker.next_inbox.fetch_add(1, Ordering::Relaxed);
        format!("{}{n}", self.broker.inbox_prefix)
    }

    /// Publishes an already validated message; returns how many subscriptions received it.
    pub(crate) fn publish(&self, subject: &str, reply: Option<&str>, payload: &Bytes) -> usize {
        let table = self.broker.table.read();
        let mut delivered = 0;
        // Queue groups are merged across patterns by name, as NATS does; that needs a buffer
        // only when more than one matching pattern has queue subscribers.
        let mut first_grouped: Option<&Node> = None;
        let mut more_grouped: Vec<&Node> = Vec::new();
        let wildcard_nodes = table
            .wildcard
            .iter()
            .filter(|(pattern, _)| subject::matches(pattern, subject))
            .map(|(_, node)| node);
        for node in table.literal.get(subject).into_iter().chain(wildcard_nodes) {
            for sink in &node.plain {
                delivered += usize::from(sink.send(subject, reply, payload));
            }
            if !node.groups.is_empty() {
                if first_grouped.is_none() {
                    first_grouped = Some(node);
                } else {
                    more_grouped.push(node);
                }
            }
        }
        let Some(first) = first_grouped else {
            return delivered;
        };
        let pick = self.broker.picks.fetch_add(1, Ordering::Relaxed);
        if more_grouped.is_empty() {
            for group in &first.groups {
                delivered += usize::from(deliver_to_one(
                    pick,
                    &group.members,
                    subject,
                    reply,
                    payload,
                ));
            }
            return delivered;
        }
        more_grouped.push(first);
        let mut members: Vec<(&str, &Sink)> = more_grouped
            .iter()
            .flat_map(|node| node.groups.iter())
            .flat_map(|g| g.members.iter().map(move |m| (&*g.name, m)))
            .collect();
        members.sort_by(|a, b| a.0.cmp(b.0));
        let mut batch: Vec<&Sink> = Vec::new();
        for chunk in members.chunk_by(|a, b| a.0 == b.0) {
            batch.clear();
            batch.extend(chunk.iter().map(|(_, s)| *s));
            delivered += usize::from(deliver_to_one(pick, &batch, subject, reply, payload));
        }
        delivered
    }

    /// Subscribes with an already validated subject (and queue group).
    pub(crate) fn subscribe(&self, subject: &str, queue: Option<&str>) -> LocalSubscription {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = self.broker.next_sub_id.fetch_add(1, Ordering::Relaxed);
        let sink = Sink { id, tx };
        {
            let mut table = self.broker.table.write();
            let node = if subject::has_wildcard(subject) {
                match table.wildcard.iter().position(|(p, _)| &**p == subject) {
                    Some(i) => &mut table.wildcard[i].1,
                    None => {
                        table.wildcard.push((subject.into(), Node::default()));
                        let last = table.wildcard.len() - 1;
                        &mut table.wildcard[last].1
                    }
                }
            } else {
                table.literal.entry(subject.into()).or_default()
            };
            match queue {
                None => node.plain.push(sink),
                Some(q) => match node.groups.iter_mut().find(|g| &*g.name == q) {
                    Some(g) => g.members.push(sink),
                    None => node.groups.push(Group {
                        name: q.into(),
                        members: vec![sink],
                    }),
                },
            }
        }
        LocalSubscription {
            rx,
            id,
            subject: subject.into(),
            queue: queue.map(Into::into),
            broker: Arc::downgrade(&self.broker),
        }
    }
}

impl Broker {
    fn unsubscribe(&self, subject: &str, queue: Option<&str>, id: u64) {
        let mut table = self.table.write();
        let table = &mut *table;
        let (node, wildcard_index) = if subject::has_wildcard(subject) {
            match table.wildcard.iter().position(|(p, _)| &**p == subject) {
                Some(i) => (&mut table.wildcard[i].1, Some(i)),
                None => return,
            }
        } else {
            match table.literal.get_mut(subject) {
                Some(node) => (node, None),
                None => return,
            }
        };
        match queue {
            None => node.plain.retain(|s| s.id != id),
            Some(q) => {
                for g in node.groups.iter_mut().filter(|g| &*g.name == q) {
                    g.members.retain(|s| s.id != id);
                }
                node.groups.retain(|g| !g.members.is_empty());
            }
        }
        if node.is_empty() {
            match wildcard_index {
                Some(i) => {
                    table.wildcard.swap_remove(i);
                }
                None => {
                    table.literal.remove(subject);
                }
            }
        }
    }
}

/// A subscription on the in-process bus; unsubscribes when dropped.
pub(crate) struct LocalSubscription {
    rx: mpsc::UnboundedReceiver<Message>,
    id: u64,
    subject: Box<str>,
    queue: Option<Box<str>>,
    broker: Weak<Broker>,
}

impl LocalSubscription {
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        self.rx.poll_recv(cx)
    }

    pub(crate) async fn recv(&mut self) -> Option<Message> {
        self.rx.recv().await
    }
}

impl Drop for LocalSubscription {
    fn drop(&mut self) {
        if let Some(broker) = self.broker.upgrade() {
            broker.unsubscribe(&self.subject, self.queue.as_deref(), self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(bus: &LocalBus) -> (usize, usize) {
        let t = bus.broker.table.read();
        (t.literal.len(), t.wildcard.len())
    }

    #[test]
    fn table_is_cleaned_up_on_drop() {
        let bus = LocalBus::new();
        let a = bus.subscribe("a.b", None);
        let b = bus.subscribe("a.b", Some("g"));
        let c = bus.subscribe("a.*", Some("g"));
        let d = bus.subscribe("a.>", None);
        assert_eq!(count(&bus), (1, 2));
        drop(a);
        assert_eq!(count(&bus), (1, 2));
        drop(b);
        assert_eq!(count(&bus), (0, 2));
        drop(c);
        drop(d);
        assert_eq!(count(&bus), (0, 0));
        assert_eq!(bus.publish("a.b", None, &Bytes::new()), 0);
    }

    #[test]
    fn queue_group_spanning_patterns_gets_one_copy() {
        let bus = LocalBus::new();
        let mut subs = [
            bus.subscribe("x.y", Some("g")),
            bus.subscribe("x.*", Some("g")),
            bus.subscribe("x.>", Some("g")),
            bus.subscribe("x.>", Some("h")),
        ];
        for _ in 0..100 {
            // one for g, one for h
            assert_eq!(bus.publish("x.y", None, &Bytes::from_static(b"m")), 2);
        }
        let mut per_sub = [0usize; 4];
        for (i, s) in subs.iter_mut().enumerate() {
            while s.rx.try_recv().is_ok() {
                per_sub[i] += 1;
            }
        }
        assert_eq!(per_sub[0] + per_sub[1] + per_sub[2], 100);
        assert_eq!(per_sub[3], 100);
        assert!(per_sub[..3].iter().all(|&n| n > 0), "{per_sub:?}");
    }

    #[test]
    fn closing_the_broker_ends_subscriptions() {
        let bus = LocalBus::new();
        let mut s = bus.subscribe("a", None);
        drop(bus);
        assert!(s.rx.try_recv().is_err());
        assert!(s.rx.is_closed());
    }

    #[test]
    fn inboxes_are_unique() {
        let bus = LocalBus::new();
        let a = bus.new_inbox();
        let b = bus.new_inbox();
        assert_ne!(a, b);
        assert!(a.starts_with("_INBOX."));
        assert!(subject::validate_publish(&a).is_ok());
    }
}
