//! Replica sync (`--replica-sync`): every replica shares its active-sequence changes, so each
//! routes on the whole fleet's load.
//!
//! A plain core per model. Outgoing: this replica's changes, with global request ids
//! (`"{replica}:{request}"`), batched until the owner flushes them. Incoming: peers'
//! changes in the order each peer made them; until the catch-up snapshot from a peer has
//! landed they are buffered, then applied after it. Applying is idempotent (an `Add` of a
//! known id and a `Free` of an unknown one change nothing), so a change that is both in the
//! snapshot and in the buffer counts once, and order per origin keeps the result right.
//! One gap remains: a change still on its way to the answering peer when the joiner
//! subscribed is in neither (the joiner asks only once its ranks are synced, so in practice
//! long after; `tests/replica_sync_model.rs` assumes it).
//!
//! Peers are live while their batches keep coming (an idle replica sends an empty one every
//! [`HEARTBEAT`]); one silent for [`PEER_LEASE`] is gone, and its sequences with it: nobody
//! is left to free them, and the workers' own load reports cover what is still running.

use kvrouter_protocol::{SeqChange, SequenceHash, WorkerKey};
use kvrouter_scheduler::Scheduler;
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// An idle replica's empty batch, at most this far apart.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// A peer silent for this long is gone.
pub const PEER_LEASE: Duration = Duration::from_secs(3);

/// Peer changes buffered while catching up, before the oldest are dropped (then the
/// request-timeout sweep bounds the damage).
const MAX_BUFFERED: usize = 1 << 16;

pub struct ReplicaSync {
    replica_id: String,
    outbox: Vec<SeqChange>,
    /// `Some` until the catch-up snapshot is applied.
    buffer: Option<Vec<SeqChange>>,
    dropped: u64,
    /// Live peers and when each was last heard from.
    peers: FxHashMap<String, Instant>,
    /// Origins of catch-up snapshot entries not heard from themselves yet (e.g. crashed
    /// before we joined), since when: they expire on the same lease as peers, so their
    /// requests do not wait for the request-timeout sweep. Not counted as live peers.
    unconfirmed: FxHashMap<String, Instant>,
    last_sent: Option<Instant>,
}

impl ReplicaSync {
    /// `catch_up`: buffer peers' changes until [`ReplicaSync::on_snapshot`].
    pub fn new(replica_id: &str, catch_up: bool) -> Self {
        Self {
            replica_id: replica_id.to_string(),
            outbox: Vec::new(),
            buffer: catch_up.then(Vec::new),
            dropped: 0,
            peers: FxHashMap::default(),
            unconfirmed: FxHashMap::default(),
            last_sent: None,
        }
    }

    /// The id peers know one of this replica's requests by.
    pub fn global_id(&self, request_id: &str) -> String {
        format!("{}:{request_id}", self.replica_id)
    }

    pub fn is_caught_up(&self) -> bool {
        self.buffer.is_none()
    }

    /// A request of ours was added, under its global id.
    pub fn added_global(
        &mut self,
        global_id: &str,
        key: WorkerKey,
        sequence_hashes: Vec<SequenceHash>,
        prefill_tokens: u64,
    ) {
        self.outbox.push(SeqChange::Add {
            request_id: global_id.to_string(),
            key,
            sequence_hashes,
            prefill_tokens,
        });
    }

    pub fn prefilled(&mut self, request_id: &str) {
        self.outbox.push(SeqChange::Prefilled {
            request_id: self.global_id(request_id),
        });
    }

    pub fn freed(&mut self, request_id: &str) {
        self.outbox.push(SeqChange::Free {
            request_id: self.global_id(request_id),
        });
    }

    pub fn pending(&self) -> usize {
        self.outbox.len()
    }

    /// This replica's changes since the last call, in order (sent at `now`).
    pub fn take_outgoing(&mut self, now: Instant) -> Vec<SeqChange> {
        self.last_sent = Some(now);
        std::mem::take(&mut self.outbox)
    }

    /// Whether an idle replica should send an empty batch so peers keep it live.
    pub fn heartbeat_due(&self, now: Instant) -> bool {
        self.last_sent
            .is_none_or(|t| now.saturating_duration_since(t) >= HEARTBEAT)
    }

    /// A peer's batch: the changes to apply now (none while catching up). Our own batches
    /// (the bus echoes them) are ignored. Returns whether the peer is new.
    pub fn on_peer_batch(
        &mut self,
        from: &str,
        changes: Vec<SeqChange>,
        now: Instant,
    ) -> (Vec<SeqChange>, bool) {
        if from == self.replica_id {
            return (Vec::new(), false);
        }
        let new = self.peers.insert(from.to_string(), now).is_none();
        self.unconfirmed.remove(from);
        let apply = match &mut self.buffer {
            None => changes,
            Some(buf) => {
                if buf.len() + changes.len() > MAX_BUFFERED {
                    self.dropped += buf.len() as u64;
                    buf.clear();
                }
                buf.extend(changes);
                Vec::new()
            }
        };
        (apply, new)
    }

    /// Forgets peers (and snapshot origins never heard from) silent for [`PEER_LEASE`];
    /// returns them.
    pub fn expire_peers(&mut self, now: Instant) -> Vec<String> {
        let mut gone = Vec::new();
        for map in [&mut self.peers, &mut self.unconfirmed] {
            map.retain(|id, &mut seen| {
                let live = now.saturating_duration_since(seen) < PEER_LEASE;
                if !live {
                    gone.push(id.clone());
                }
                live
            });
        }
        gone.sort_unstable();
        gone
    }

    /// Live peers before this replica in the replicas' common order (by id).
    pub fn live_peers_ahead(&self) -> usize {
        self.peers
            .keys()
            .filter(|p| p.as_str() < self.replica_id.as_str())
            .count()
    }

    pub fn live_peers(&self) -> usize {
        self.peers.len()
    }

    /// Whether a global request id is one of `peer`'s.
    pub fn is_from(global_id: &str, peer: &str) -> bool {
        global_id
            .strip_prefix(peer)
            .is_some_and(|rest| rest.starts_with(':'))
    }

    /// The catch-up snapshot (a peer's active sequences as `Add`s): the changes to apply,
    /// snapshot first, then what was buffered meanwhile. Later snapshots are ignored.
    ///
    /// Our own requests in the snapshot are left out: our core is the truth about them, and
    /// the peer's copy may be stale. A replica routes while it catches up, so it may have
    /// freed a request whose `Free` the peer had not yet applied when it answered; that
    /// `Free` is in no buffer (our own changes never come back to us), so applying the
    /// peer's `Add` would bring the request back until the request-timeout sweep.
    ///
    /// Requests under our id that our core does not hold (`ours_active` says which it
    /// does) were left by a previous instance of this replica, restarted under the same id
    /// before its peers noticed it was gone: nobody else would ever free them, so this
    /// replica frees them (their `Free`s go out with its next batch).
    ///
    /// The origins of its requests that are no live peer are remembered from `now`: if they
    /// stay silent for the lease, their requests are dropped like a lost peer's.
    pub fn on_snapshot(
        &mut self,
        snapshot: Vec<SeqChange>,
        now: Instant,
        ours_active: impl Fn(&str) -> bool,
    ) -> Vec<SeqChange> {
        match self.buffer.take() {
            None => Vec::new(),
            Some(buf) => {
                let (ours, mut out): (Vec<SeqChange>, Vec<SeqChange>) = snapshot
                    .into_iter()
                    .partition(|c| Self::is_from(change_id(c), &self.replica_id));
                for c in ours {
                    if let SeqChange::Add { request_id, .. } = c {
                        if !ours_active(&request_id) {
                            self.outbox.push(SeqChange::Free { request_id });
                        }
                    }
                }
                for c in &out {
                    if let Some((origin, _)) = change_id(c).split_once(':') {
                        if !self.peers.contains_key(origin) {
                            self.unconfirmed.entry(origin.to_string()).or_insert(now);
                        }
                    }
                }
                out.extend(buf);
                out
            }
        }
    }

    /// Peer changes dropped because the catch-up buffer overflowed.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }
}

fn change_id(change: &SeqChange) -> &str {
    match change {
        SeqChange::Add { request_id, .. }
        | SeqChange::Prefilled { request_id }
        | SeqChange::Free { request_id } => request_id,
    }
}

/// Applies peers' changes to a scheduling core, in order. Idempotent: an `Add` of a known id
/// and a `Free` (or `Prefilled`) of an unknown one change nothing. The caller retries its
/// queue afterwards (load may have dropped).
pub fn apply_changes<P>(core: &mut Scheduler<P>, changes: Vec<SeqChange>, now: Instant) {
    for c in changes {
        match c {
            SeqChange::Add {
                request_id,
                key,
                sequence_hashes,
                prefill_tokens,
            } => {
                if !core.contains_request(&request_id) {
                    // A key this replica does not know (yet) is skipped: the sweep or the
                    // peer's free would drop it anyway. The clamp keeps a corrupt peer from
                    // wrapping the load sums (no real prompt comes near it).
                    let prefill_tokens = prefill_tokens.min(u64::from(u32::MAX));
                    let _ =
                        core.add_request(request_id, key, &sequence_hashes, prefill_tokens, now);
                }
            }
            SeqChange::Prefilled { request_id } => {
                core.mark_prefill(&request_id);
            }
            SeqChange::Free { request_id } => {
                core.free(&request_id);
            }
        }
    }
}

/// A core's active sequences as `Add`s (the catch-up snapshot a joining peer asks for).
pub fn export_active<P>(core: &Scheduler<P>) -> Vec<SeqChange> {
    core.active_sequences()
        .map(|(id, key, hashes, prefill)| SeqChange::Add {
            request_id: id.clone(),
            key,
            sequence_hashes: hashes.to_vec(),
            prefill_tokens: prefill,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(id: &str) -> SeqChange {
        SeqChange::Add {
            request_id: id.into(),
            key: WorkerKey::new(1, 0),
            sequence_hashes: vec![SequenceHash(1)],
            prefill_tokens: 10,
        }
    }

    #[test]
    fn own_changes_go_out_with_global_ids() {
        let mut s = ReplicaSync::new("r1", false);
        let id = s.global_id("a");
        s.added_global(&id, WorkerKey::new(1, 0), vec![SequenceHash(1)], 10);
        s.prefilled("a");
        s.freed("a");
        assert_eq!(
            s.take_outgoing(Instant::now()),
            vec![
                add("r1:a"),
                SeqChange::Prefilled {
                    request_id: "r1:a".into()
                },
                SeqChange::Free {
                    request_id: "r1:a".into()
                }
            ]
        );
        let now = Instant::now();
        assert!(s.take_outgoing(now).is_empty());
        // Our own echo is ignored; a peer's batch applies at once.
        assert_eq!(
            s.on_peer_batch("r1", vec![add("r1:b")], now),
            (vec![], false)
        );
        assert_eq!(
            s.on_peer_batch("r2", vec![add("r2:x")], now),
            (vec![add("r2:x")], true)
        );
    }

    #[test]
    fn catching_up_buffers_until_the_snapshot() {
        let mut s = ReplicaSync::new("r3", true);
        let now = Instant::now();
        assert!(!s.is_caught_up());
        assert!(s.on_peer_batch("r2", vec![add("r2:y")], now).0.is_empty());
        let free = SeqChange::Free {
            request_id: "r1:x".into(),
        };
        assert!(s.on_peer_batch("r1", vec![free.clone()], now).0.is_empty());
        let out = s.on_snapshot(vec![add("r1:x")], now, |_| false);
        assert_eq!(out, vec![add("r1:x"), add("r2:y"), free]);
        assert!(s.is_caught_up());
        assert!(s.on_snapshot(vec![add("r9:z")], now, |_| false).is_empty());
    }

    #[test]
    fn a_snapshot_never_brings_back_our_own_requests() {
        // r3 routed r3:a while catching up and freed it; the peer answering had the add
        // but not yet the free.
        let mut s = ReplicaSync::new("r3", true);
        let snapshot = vec![add("r3:a"), add("r1:x"), add("r31:b")];
        let out = s.on_snapshot(snapshot, Instant::now(), |_| false);
        assert_eq!(out, vec![add("r1:x"), add("r31:b")]);
    }

    #[test]
    fn a_restarted_replica_frees_what_its_previous_instance_left() {
        // r3 was killed with r3:old active and restarted under its id before its peers
        // noticed; since then it routed r3:new. Only r3:old goes.
        let mut s = ReplicaSync::new("r3", true);
        let snapshot = vec![add("r3:old"), add("r3:new"), add("r1:x")];
        let out = s.on_snapshot(snapshot, Instant::now(), |id| id == "r3:new");
        assert_eq!(out, vec![add("r1:x")]);
        let free = SeqChange::Free {
            request_id: "r3:old".into(),
        };
        assert_eq!(s.take_outgoing(Instant::now()), vec![free]);
    }

    #[test]
    fn a_snapshot_origin_never_heard_from_expires_like_a_silent_peer() {
        let t0 = Instant::now();
        let mut s = ReplicaSync::new("r3", true);
        s.on_peer_batch("r2", Vec::new(), t0);
        // r1 crashed before r3 joined; r2's snapshot still holds r1's request.
        let out = s.on_snapshot(vec![add("r1:x"), add("r2:y")], t0, |_| false);
        assert_eq!(out.len(), 2);
        assert_eq!(s.live_peers(), 1, "r1 is no live peer");
        let half = t0 + PEER_LEASE / 2;
        s.on_peer_batch("r2", Vec::new(), half);
        assert!(s.expire_peers(half).is_empty());
        assert_eq!(s.expire_peers(t0 + PEER_LEASE), vec!["r1".to_string()]);
        // One heard from after the snapshot is a live peer like any other.
        let mut s = ReplicaSync::new("r3", true);
        s.on_snapshot(vec![add("r1:x")], t0, |_| false);
        s.on_peer_batch("r1", Vec::new(), half);
        assert!(s.expire_peers(t0 + PEER_LEASE).is_empty());
        assert_eq!(s.live_peers(), 1);
    }

    #[test]
    fn peers_live_while_heard_from() {
        let t0 = Instant::now();
        let mut s = ReplicaSync::new("m", false);
        assert!(s.heartbeat_due(t0));
        s.take_outgoing(t0);
        assert!(!s.heartbeat_due(t0 + HEARTBEAT / 2));
        assert!(s.heartbeat_due(t0 + HEARTBEAT));
        assert_eq!(s.live_peers(), 0);
        s.on_peer_batch("a", vec![], t0);
        s.on_peer_batch("z", vec![], t0);
        s.on_peer_batch("b", vec![], t0 + PEER_LEASE / 2);
        assert_eq!(s.live_peers(), 3);
        assert_eq!(s.live_peers_ahead(), 2, "a and b come before m");
        assert!(!s.on_peer_batch("a", vec![], t0 + PEER_LEASE / 2).1);
        assert_eq!(s.expire_peers(t0 + PEER_LEASE), vec!["z".to_string()]);
        assert_eq!(s.live_peers(), 2);
        assert!(s.expire_peers(t0 + PEER_LEASE).is_empty());
        assert!(ReplicaSync::is_from("a:1", "a"));
        assert!(!ReplicaSync::is_from("ab:1", "a"));
        assert!(!ReplicaSync::is_from("a", "a"));
    }
}
