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
//! A lost batch (NATS drops what a disconnected client published, a slow consumer's
//! backlog) shows as a gap in the peer's sequence numbers: that peer's own requests are then
//! fetched from it again ([`ReplicaSync::start_resync`], [`ReplicaSync::on_resync`]) and
//! its changes buffered meanwhile, so a lost `Free` does not hold load until the
//! request-timeout sweep. A peer first heard mid-sequence is fetched the same way (what it
//! sent before is unknown here), so a joiner's view of each peer does not rest on its
//! snapshot source having heard everything; gaps seen while catching up are fetched once the
//! snapshot is in. `tests/replica_sync_model.rs` checks all of it against a reference model
//! with lost, duplicated and interleaved batches.
//!
//! Origins. Each replica publishes on its own subject (`NS.router.sync.<id>`), which NATS
//! permissions let only its credentials use; [`SyncOrigins`] drops a batch naming another
//! replica than its subject, and every change a peer sends must be to one of its own requests
//! (`"{peer}:..."`, [`retain_own`]), so a peer can neither free nor add the receiver's or a
//! third replica's requests. Batches on the previous release's shared subject are accepted
//! for one release, unsequenced (their sequence numbers and instance ids are ignored, so they
//! can make no genuine batch look stale and drop nobody's requests), and not at all for a
//! replica heard on its own subject. A catch-up snapshot (any caught-up peer answers) is
//! provisional beyond its answerer: every origin in it is fetched from itself afterwards
//! ([`ReplicaSync::on_snapshot`]), and origins that never answer expire with the lease. A
//! jump of more than [`MAX_SEQ_JUMP`] in a peer's numbers is not taken as its new baseline:
//! the peer is fetched instead, and its own answer sets the baseline.
//!
//! Peers are live while their batches keep coming (an idle replica sends an empty one every
//! [`HEARTBEAT`]); one silent for [`PEER_LEASE`] is gone, and its sequences with it: nobody
//! is left to free them, and the workers' own load reports cover what is still running.

use kvrouter_protocol::{SeqChange, SequenceHash, SyncBatch, WorkerKey};
use kvrouter_scheduler::Scheduler;
use rustc_hash::{FxHashMap, FxHashSet};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// An idle replica's empty batch, at most this far apart.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// A peer silent for this long is gone.
pub const PEER_LEASE: Duration = Duration::from_secs(3);

/// Peer changes buffered while catching up (or while one peer's requests are fetched
/// again), before the buffer is dropped (then the request-timeout sweep bounds the damage).
const MAX_BUFFERED: usize = 1 << 16;
/// The same buffers' bound in bytes (ids and sequence hashes, see [`change_bytes`]).
pub const MAX_BUFFERED_BYTES: usize = 64 << 20;
/// The largest catch-up answer (a peer's whole active set, or its own requests) collected,
/// in bytes: a longer one is cut short (snapshot) or fails (a peer's own requests).
pub const MAX_CATCH_UP_BYTES: usize = 256 << 20;
/// The longest global request id a peer may send: its replica id, `:`, a request id and a
/// disaggregated prefill half's `/prefill`. Changes with longer ids are refused.
pub const MAX_SYNC_ID_BYTES: usize = kvrouter_protocol::limits::MAX_REPLICA_ID_BYTES
    + 1
    + kvrouter_protocol::limits::MAX_REQUEST_ID_BYTES
    + "/prefill".len();

/// A peer's sequence number this far past the last one heard from its instance is not
/// believed: a replica numbers its batches one by one, and one silent for [`PEER_LEASE`] is
/// forgotten, so a genuine gap stays far below it. The peer is fetched instead
/// ([`SeqCheck::Unheard`]); its own answer sets the baseline.
pub const MAX_SEQ_JUMP: u64 = 1 << 20;
/// Stale batches in a row from one peer before its baseline is doubted: NATS never
/// redelivers, so genuine duplicates come one at a time at most; a run means the baseline was
/// set by a batch that was not the peer's. The peer is fetched and its answer sets the
/// baseline.
pub const MAX_STALE_RUN: u32 = 16;
/// Replica ids remembered as publishing on their own sync subjects (for refusing legacy
/// batches in their name); more are not remembered.
const MAX_UPGRADED_PEERS: usize = 4096;
/// Origins of a catch-up snapshot asked for their own requests afterwards, at most.
pub const MAX_SNAPSHOT_FETCHES: usize = 1024;

/// Why a sync batch was refused before it reached a scheduler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OriginRefusal {
    /// On replica `subject`'s own subject, but naming another replica.
    Misattributed { subject: String, claimed: String },
    /// On the previous release's shared subject, naming a replica that publishes on its own
    /// subject (it never uses the shared one).
    LegacyFromUpgraded { claimed: String },
}

impl std::fmt::Display for OriginRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Misattributed { subject, claimed } => write!(
                f,
                "a sync batch on replica {subject:?}'s subject names replica {claimed:?}"
            ),
            Self::LegacyFromUpgraded { claimed } => write!(
                f,
                "a sync batch on the shared legacy subject names replica {claimed:?}, which \
                 publishes on its own subject"
            ),
        }
    }
}

/// Checks where peers' sync batches come from (one per replica, before the batches reach
/// the models' schedulers).
#[derive(Default)]
pub struct SyncOrigins {
    /// Replicas heard on their own subjects.
    upgraded: FxHashSet<String>,
}

impl SyncOrigins {
    /// A batch that arrived on replica `sender`'s own subject (`Some`) or on the shared
    /// legacy one (`None`). Refused if it names another replica than its subject, or (legacy)
    /// a replica heard on its own subject; otherwise its changes to requests the named replica
    /// did not route are dropped (returned: how many) and a legacy batch is made unsequenced.
    pub fn check(
        &mut self,
        sender: Option<&str>,
        batch: &mut SyncBatch,
    ) -> Result<usize, OriginRefusal> {
        match sender {
            Some(subject) if subject != batch.replica_id => {
                return Err(OriginRefusal::Misattributed {
                    subject: subject.to_string(),
                    claimed: batch.replica_id.clone(),
                })
            }
            Some(subject) => {
                if self.upgraded.len() < MAX_UPGRADED_PEERS && !self.upgraded.contains(subject) {
                    self.upgraded.insert(subject.to_string());
                }
            }
            None if self.upgraded.contains(&batch.replica_id) => {
                return Err(OriginRefusal::LegacyFromUpgraded {
                    claimed: batch.replica_id.clone(),
                })
            }
            None => {
                // Anyone allowed on the shared subject may write any number and instance:
                // neither may make a peer's genuine batches stale nor drop its requests.
                batch.seq = 0;
                batch.instance_id = Uuid::nil();
            }
        }
        Ok(retain_own(&batch.replica_id, &mut batch.changes))
    }
}

/// Keeps only `peer`'s changes to its own requests (global ids `"{peer}:..."`); returns how
/// many were dropped.
pub fn retain_own(peer: &str, changes: &mut Vec<SeqChange>) -> usize {
    let before = changes.len();
    changes.retain(|c| ReplicaSync::is_from(change_id(c), peer));
    before - changes.len()
}

/// What a change holds in memory, about: its id, its sequence hashes and a fixed overhead.
pub fn change_bytes(change: &SeqChange) -> usize {
    let hashes = match change {
        SeqChange::Add {
            sequence_hashes, ..
        } => sequence_hashes.len() * std::mem::size_of::<SequenceHash>(),
        _ => 0,
    };
    change_id(change).len() + hashes + std::mem::size_of::<SeqChange>()
}

/// Whether a peer's change is within the limits (its id within [`MAX_SYNC_ID_BYTES`]).
pub fn within_limits(change: &SeqChange) -> bool {
    change_id(change).len() <= MAX_SYNC_ID_BYTES
}

/// A buffer of peer changes bounded by count and bytes.
struct Held<T> {
    changes: Vec<T>,
    bytes: usize,
}

impl<T> Default for Held<T> {
    fn default() -> Self {
        Self {
            changes: Vec::new(),
            bytes: 0,
        }
    }
}

impl<T> Held<T> {
    /// Adds `changes` (sized by `size`); when that would pass either bound, what was held is
    /// dropped first (returned as the count dropped).
    fn extend(&mut self, changes: Vec<T>, size: impl Fn(&T) -> usize) -> u64 {
        let bytes: usize = changes.iter().map(&size).sum();
        let mut dropped = 0;
        if self.changes.len() + changes.len() > MAX_BUFFERED
            || self.bytes + bytes > MAX_BUFFERED_BYTES
        {
            dropped = self.changes.len() as u64;
            self.changes.clear();
            self.bytes = 0;
        }
        self.changes.extend(changes);
        self.bytes += bytes;
        dropped
    }
}

pub struct ReplicaSync {
    replica_id: String,
    outbox: Vec<SeqChange>,
    /// `Some` until the catch-up snapshot is applied.
    buffer: Option<Held<SeqChange>>,
    dropped: u64,
    /// Peer changes refused for ids over [`MAX_SYNC_ID_BYTES`].
    refused: u64,
    /// Peer changes dropped for naming requests the peer did not route.
    foreign: u64,
    /// Peer sequence numbers not believed (more than [`MAX_SEQ_JUMP`] ahead, or a baseline
    /// [`MAX_STALE_RUN`] batches in a row are stale against).
    jumps: u64,
    /// Stale batches in a row, per peer.
    stale_runs: FxHashMap<String, u32>,
    /// Peers whose baseline their next answer replaces, whatever it says.
    suspect: FxHashSet<String>,
    /// Live peers and when each was last heard from.
    peers: FxHashMap<String, Instant>,
    /// Origins of catch-up snapshot entries not heard from themselves yet (e.g. crashed
    /// before we joined), since when: they expire on the same lease as peers, so their
    /// requests do not wait for the request-timeout sweep. Not counted as live peers.
    unconfirmed: FxHashMap<String, Instant>,
    last_sent: Option<Instant>,
    /// Each peer's instance and the last sequence number heard from it.
    seqs: FxHashMap<String, (Uuid, u64)>,
    /// Peers whose own requests are being fetched again after a lost batch, with their
    /// changes since, each with its batch's sequence number (those the answer does not
    /// cover apply after it).
    resyncing: FxHashMap<String, Held<(u64, SeqChange)>>,
    /// Peers that lost us a batch while we were catching up: fetched once the snapshot is
    /// in (the snapshot's source may have had the lost change or not).
    deferred: Vec<String>,
    /// Peers to fetch now (see [`Self::take_fetches`]).
    fetches: Vec<String>,
}

/// How a peer's sequenced batch follows the last one heard from it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next one, the first of an instance, or an unsequenced (version-4 or legacy
    /// subject) batch.
    InOrder,
    /// The first heard from this instance, past its first batch: what came before is not
    /// known here (fetch its requests, as after a loss). Also a number more than
    /// [`MAX_SEQ_JUMP`] ahead of the last (not believed, nor taken as the baseline) and the
    /// [`MAX_STALE_RUN`]th stale batch in a row: the peer's requests are fetched instead, and
    /// its answer sets the baseline.
    Unheard,
    /// Heard already (a duplicate): ignore it.
    Stale,
    /// Batches between this one and the last were lost.
    Lost { missed: u64 },
    /// The peer restarted under its id (another instance than the last heard): the requests
    /// of its previous instance died with it (nobody will free them), and `unheard` says
    /// whether batches of the new one came before this.
    Restarted { unheard: bool },
}

impl ReplicaSync {
    /// `catch_up`: buffer peers' changes until [`ReplicaSync::on_snapshot`].
    pub fn new(replica_id: &str, catch_up: bool) -> Self {
        Self {
            replica_id: replica_id.to_string(),
            outbox: Vec::new(),
            buffer: catch_up.then(Held::default),
            dropped: 0,
            refused: 0,
            foreign: 0,
            jumps: 0,
            stale_runs: FxHashMap::default(),
            suspect: FxHashSet::default(),
            peers: FxHashMap::default(),
            unconfirmed: FxHashMap::default(),
            last_sent: None,
            seqs: FxHashMap::default(),
            resyncing: FxHashMap::default(),
            deferred: Vec::new(),
            fetches: Vec::new(),
        }
    }

    /// Checks a peer batch's sequence number (before [`Self::on_peer_batch`]). A new
    /// instance starts a new sequence; seq 0 is unsequenced.
    pub fn check_seq(&mut self, from: &str, instance: Uuid, seq: u64) -> SeqCheck {
        if seq == 0 || from == self.replica_id {
            return SeqCheck::InOrder;
        }
        match self.seqs.get_mut(from) {
            Some((inst, last)) if *inst == instance => {
                if seq <= *last {
                    // NATS does not redeliver: a run of stale batches means the baseline
                    // is not the peer's (see MAX_STALE_RUN).
                    let run = self.stale_runs.entry(from.to_string()).or_insert(0);
                    *run += 1;
                    if *run < MAX_STALE_RUN {
                        return SeqCheck::Stale;
                    }
                    *run = 0;
                    self.jumps += 1;
                    self.suspect.insert(from.to_string());
                    return SeqCheck::Unheard;
                }
                let missed = seq - *last - 1;
                if missed >= MAX_SEQ_JUMP {
                    self.jumps += 1;
                    return SeqCheck::Unheard;
                }
                self.stale_runs.remove(from);
                *last = seq;
                if missed == 0 {
                    SeqCheck::InOrder
                } else {
                    SeqCheck::Lost { missed }
                }
            }
            known => {
                let restarted = known.is_some();
                self.stale_runs.remove(from);
                self.seqs.insert(from.to_string(), (instance, seq));
                match (restarted, seq > 1) {
                    (true, unheard) => SeqCheck::Restarted { unheard },
                    (false, true) => SeqCheck::Unheard,
                    (false, false) => SeqCheck::InOrder,
                }
            }
        }
    }

    /// A batch from `peer` was lost: its own requests are to be fetched again
    /// ([`Self::take_fetches`] says when), its changes buffered until [`Self::on_resync`].
    /// While catching up, the fetch waits for the snapshot. Nothing new when one is already
    /// under way.
    pub fn start_resync(&mut self, peer: &str) {
        if self.buffer.is_some() {
            if !self.deferred.iter().any(|p| p == peer) {
                self.deferred.push(peer.to_string());
            }
        } else if !self.resyncing.contains_key(peer) {
            self.resyncing.insert(peer.to_string(), Held::default());
            self.fetches.push(peer.to_string());
        }
    }

    /// Peers whose own requests to fetch now (answer each with [`Self::on_resync`]).
    pub fn take_fetches(&mut self) -> Vec<String> {
        std::mem::take(&mut self.fetches)
    }

    /// `peer`'s own active requests as it answered, with the last sequence number it had
    /// published then (`None`: it did not answer), given the ids of its requests our core
    /// holds: the changes to apply. Those it no longer has are freed, those it has are added
    /// or brought up to date (prefill, output), then its changes buffered meanwhile apply,
    /// but for those of batches the answer already covers (a batch of the buffer may predate
    /// it: applied after it, an `Add` whose `Free` was lost would come back).
    pub fn on_resync(
        &mut self,
        peer: &str,
        answer: Option<(u64, Vec<SeqChange>)>,
        held: Vec<String>,
    ) -> Vec<SeqChange> {
        let Some(buffered) = self.resyncing.remove(peer) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut covered = 0;
        if let Some((answer_seq, answer)) = answer {
            covered = answer_seq;
            // The peer's own word on what it published: a baseline far ahead of it was not
            // the peer's (see MAX_SEQ_JUMP); one behind it is covered by the answer.
            let suspect = self.suspect.remove(peer);
            if let Some((_, last)) = self.seqs.get_mut(peer) {
                if suspect || *last < covered || *last > covered.saturating_add(MAX_SEQ_JUMP) {
                    *last = covered;
                }
            }
            let theirs: Vec<SeqChange> = answer
                .into_iter()
                .filter(|c| within_limits(c) && Self::is_from(change_id(c), peer))
                .collect();
            let live: rustc_hash::FxHashSet<&str> = theirs.iter().map(change_id).collect();
            for id in held {
                if !live.contains(id.as_str()) {
                    out.push(SeqChange::Free { request_id: id });
                }
            }
            for c in theirs {
                if let SeqChange::Add {
                    request_id,
                    prefill_tokens,
                    output_blocks,
                    ..
                } = &c
                {
                    let (id, prefilled, output) =
                        (request_id.clone(), *prefill_tokens == 0, *output_blocks);
                    out.push(c);
                    if prefilled {
                        out.push(SeqChange::Prefilled {
                            request_id: id.clone(),
                        });
                    }
                    out.push(SeqChange::Output {
                        request_id: id,
                        output_blocks: output,
                    });
                }
            }
        }
        out.extend(
            buffered
                .changes
                .into_iter()
                .filter(|&(seq, _)| seq > covered)
                .map(|(_, c)| c),
        );
        out
    }

    /// Peers being fetched again after a lost batch.
    pub fn resyncing(&self) -> usize {
        self.resyncing.len()
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
        output_blocks: u32,
    ) {
        self.outbox.push(SeqChange::Add {
            request_id: global_id.to_string(),
            key,
            sequence_hashes,
            prefill_tokens,
            output_blocks,
        });
    }

    /// A request of ours now counts `output_blocks` of output.
    pub fn output(&mut self, request_id: &str, output_blocks: u32) {
        self.outbox.push(SeqChange::Output {
            request_id: self.global_id(request_id),
            output_blocks,
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

    /// The core dropped a request by its global id (its worker went away, or the sweep):
    /// if it is ours, peers are told, since their own view of the worker may differ (a
    /// worker restarted within one replica's lease but not another's).
    pub fn dropped_global(&mut self, global_id: &str) {
        if Self::is_from(global_id, &self.replica_id) {
            self.outbox.push(SeqChange::Free {
                request_id: global_id.to_string(),
            });
        }
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

    /// A peer's batch (after [`Self::check_seq`], which tells its sequence number): the
    /// changes to apply now (none while catching up or fetching the peer's requests). Our
    /// own batches (the bus echoes them) are ignored. Returns whether the peer is new.
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
        let mut changes = changes;
        let before = changes.len();
        changes.retain(within_limits);
        self.refused += (before - changes.len()) as u64;
        self.foreign += retain_own(from, &mut changes) as u64;
        if let Some(buf) = self.resyncing.get_mut(from) {
            // Unsequenced (legacy): applied after the answer, in order, whatever it covers.
            let seq = self.seqs.get(from).map_or(u64::MAX, |&(_, seq)| seq);
            let changes = changes.into_iter().map(|c| (seq, c)).collect();
            self.dropped += buf.extend(changes, |(_, c)| change_bytes(c));
            return (Vec::new(), new);
        }
        let apply = match &mut self.buffer {
            None => changes,
            Some(buf) => {
                self.dropped += buf.extend(changes, change_bytes);
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
        for id in &gone {
            self.seqs.remove(id);
            self.stale_runs.remove(id);
            self.suspect.remove(id);
            self.resyncing.remove(id);
            self.deferred.retain(|p| p != id);
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
    ///
    /// The snapshot is any caught-up peer's word about everybody: every origin in it (the
    /// first [`MAX_SNAPSHOT_FETCHES`]) is then asked for its own requests
    /// ([`Self::take_fetches`]), whose answer frees what the snapshot claimed and the origin
    /// does not hold. An origin that does not answer keeps the snapshot's entries until it
    /// is heard from (a live peer heard mid-sequence is fetched anyway) or the lease expires.
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
                    .filter(within_limits)
                    .partition(|c| Self::is_from(change_id(c), &self.replica_id));
                for c in ours {
                    if let SeqChange::Add { request_id, .. } = c {
                        if !ours_active(&request_id) {
                            self.outbox.push(SeqChange::Free { request_id });
                        }
                    }
                }
                let mut origins: Vec<&str> = Vec::new();
                for c in &out {
                    if let Some((origin, _)) = change_id(c).split_once(':') {
                        if !self.peers.contains_key(origin) {
                            self.unconfirmed.entry(origin.to_string()).or_insert(now);
                        }
                        if origins.last() != Some(&origin) && !origins.contains(&origin) {
                            origins.push(origin);
                        }
                    }
                }
                // Whoever answered vouches only for itself: each origin is asked for its own.
                let origins: Vec<String> = origins
                    .into_iter()
                    .take(MAX_SNAPSHOT_FETCHES)
                    .map(str::to_string)
                    .collect();
                out.extend(buf.changes);
                for peer in std::mem::take(&mut self.deferred)
                    .into_iter()
                    .chain(origins)
                {
                    self.start_resync(&peer);
                }
                out
            }
        }
    }

    /// Peer changes dropped because the catch-up buffer overflowed.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Peer changes refused for an id over [`MAX_SYNC_ID_BYTES`].
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Peer changes dropped for naming a request the peer did not route.
    pub fn foreign(&self) -> u64 {
        self.foreign
    }

    /// Peer sequence numbers not believed (more than [`MAX_SEQ_JUMP`] ahead of the last).
    pub fn jumps(&self) -> u64 {
        self.jumps
    }
}

fn change_id(change: &SeqChange) -> &str {
    match change {
        SeqChange::Add { request_id, .. }
        | SeqChange::Prefilled { request_id }
        | SeqChange::Free { request_id }
        | SeqChange::Output { request_id, .. } => request_id,
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
                output_blocks,
            } => {
                if !core.contains_request(&request_id) {
                    // A key this replica does not know (yet) is skipped: the sweep or the
                    // peer's free would drop it anyway. The clamp keeps a corrupt peer from
                    // wrapping the load sums (no real prompt comes near it).
                    let prefill_tokens = prefill_tokens.min(u64::from(u32::MAX));
                    let added = core.add_request(
                        request_id.clone(),
                        key,
                        &sequence_hashes,
                        prefill_tokens,
                        now,
                    );
                    if added.is_ok() && output_blocks > 0 {
                        core.set_output_blocks(&request_id, output_blocks);
                    }
                }
            }
            SeqChange::Output {
                request_id,
                output_blocks,
            } => {
                core.set_output_blocks(&request_id, output_blocks);
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

/// A core's active sequences as `Add`s (the catch-up snapshot a joining peer asks for), or
/// only those whose global id says `origin` routed them (a peer that lost one of its
/// batches asks that).
pub fn export_active<P>(core: &Scheduler<P>, origin: Option<&str>) -> Vec<SeqChange> {
    core.active_sequences()
        .filter(|(id, ..)| origin.is_none_or(|o| ReplicaSync::is_from(id, o)))
        .map(|(id, key, hashes, prefill)| SeqChange::Add {
            request_id: id.clone(),
            key,
            sequence_hashes: hashes.to_vec(),
            prefill_tokens: prefill,
            output_blocks: core.output_blocks(id).unwrap_or(0),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(id: &str) -> SeqChange {
        add_with(id, 10, 0)
    }

    fn add_with(id: &str, prefill_tokens: u64, output_blocks: u32) -> SeqChange {
        SeqChange::Add {
            request_id: id.into(),
            key: WorkerKey::new(1, 0),
            sequence_hashes: vec![SequenceHash(1)],
            prefill_tokens,
            output_blocks,
        }
    }

    #[test]
    fn own_changes_go_out_with_global_ids() {
        let mut s = ReplicaSync::new("r1", false);
        let id = s.global_id("a");
        s.added_global(&id, WorkerKey::new(1, 0), vec![SequenceHash(1)], 10, 0);
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

    #[test]
    fn sequence_numbers_tell_lost_and_repeated_batches() {
        let mut s = ReplicaSync::new("r1", false);
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        assert_eq!(s.check_seq("r2", a, 5), SeqCheck::Unheard, "first heard");
        assert_eq!(s.check_seq("r2", a, 6), SeqCheck::InOrder);
        assert_eq!(s.check_seq("r2", a, 6), SeqCheck::Stale);
        assert_eq!(s.check_seq("r2", a, 9), SeqCheck::Lost { missed: 2 });
        assert_eq!(s.check_seq("r2", a, 10), SeqCheck::InOrder);
        assert_eq!(
            s.check_seq("r2", b, 1),
            SeqCheck::Restarted { unheard: false },
            "a new instance"
        );
        assert_eq!(
            s.check_seq("r2", a, 4),
            SeqCheck::Restarted { unheard: true }
        );
        assert_eq!(s.check_seq("r2", b, 0), SeqCheck::InOrder, "unsequenced");
        assert_eq!(
            s.check_seq("r3", a, 1),
            SeqCheck::InOrder,
            "per peer, from its start"
        );
        assert_eq!(s.check_seq("r1", a, 99), SeqCheck::InOrder, "our own echo");
    }

    #[test]
    fn a_resync_frees_what_the_peer_lost_and_keeps_later_changes_in_order() {
        let mut s = ReplicaSync::new("r1", false);
        let now = Instant::now();
        let inst = Uuid::from_u128(9);
        assert_eq!(s.check_seq("r2", inst, 3), SeqCheck::Unheard);
        s.start_resync("r2");
        s.start_resync("r2");
        assert_eq!(s.take_fetches(), vec!["r2".to_string()], "one at a time");
        // r2's changes meanwhile wait; other peers' apply.
        assert!(s.on_peer_batch("r2", vec![add("r2:old")], now).0.is_empty());
        let free_c = SeqChange::Free {
            request_id: "r2:c".into(),
        };
        assert_eq!(s.check_seq("r2", inst, 4), SeqCheck::InOrder);
        assert!(s
            .on_peer_batch("r2", vec![add("r2:d"), free_c.clone()], now)
            .0
            .is_empty());
        assert_eq!(
            s.on_peer_batch("r3", vec![add("r3:x")], now).0,
            vec![add("r3:x")]
        );
        // We hold r2:a (whose Free we lost) and r2:b; r2 has b (prefilled, 2 output
        // blocks) and c (whose Add we lost).
        let b = add_with("r2:b", 0, 2);
        // r2 answered having published batch 3, not 4: batch 3 (r2:old, freed since in a
        // batch we lost) is in its answer already and must not come back.
        let answer = vec![b.clone(), add("r2:c"), add("r3:stale")];
        let out = s.on_resync("r2", Some((3, answer)), vec!["r2:a".into(), "r2:b".into()]);
        let output = |id: &str, n| SeqChange::Output {
            request_id: id.into(),
            output_blocks: n,
        };
        assert_eq!(
            out,
            vec![
                SeqChange::Free {
                    request_id: "r2:a".into()
                },
                b,
                SeqChange::Prefilled {
                    request_id: "r2:b".into()
                },
                output("r2:b", 2),
                add("r2:c"),
                output("r2:c", 0),
                add("r2:d"),
                free_c,
            ]
        );
        assert_eq!(s.resyncing(), 0);
        assert_eq!(
            s.on_peer_batch("r2", vec![add("r2:e")], now).0,
            vec![add("r2:e")]
        );
        // No answer: the buffered changes still apply.
        s.start_resync("r2");
        assert_eq!(s.take_fetches().len(), 1);
        s.on_peer_batch("r2", vec![add("r2:f")], now);
        assert_eq!(
            s.on_resync("r2", None, vec!["r2:a".into()]),
            vec![add("r2:f")]
        );
        // While catching up, once the snapshot is in.
        let mut s = ReplicaSync::new("r1", true);
        s.start_resync("r2");
        assert!(s.take_fetches().is_empty());
        s.on_snapshot(Vec::new(), now, |_| false);
        assert_eq!(s.take_fetches(), vec!["r2".to_string()]);
        assert_eq!(s.resyncing(), 1);
    }

    fn batch(replica_id: &str, changes: Vec<SeqChange>) -> SyncBatch {
        SyncBatch {
            replica_id: replica_id.into(),
            model: "m".into(),
            changes,
            instance_id: Uuid::from_u128(7),
            seq: 5,
        }
    }

    fn free(id: &str) -> SeqChange {
        SeqChange::Free {
            request_id: id.into(),
        }
    }

    #[test]
    fn a_batch_must_come_from_the_replica_its_subject_names() {
        let mut o = SyncOrigins::default();
        // On r2's own subject, in r2's name: accepted, sequence and instance kept.
        let mut ok = batch("r2", vec![add("r2:a")]);
        assert_eq!(o.check(Some("r2"), &mut ok), Ok(0));
        assert_eq!((ok.seq, ok.instance_id), (5, Uuid::from_u128(7)));
        // On r2's subject in r3's name: refused whole.
        let mut forged = batch("r3", vec![add("r3:a")]);
        assert_eq!(
            o.check(Some("r2"), &mut forged),
            Err(OriginRefusal::Misattributed {
                subject: "r2".into(),
                claimed: "r3".into()
            })
        );
        // r2 may not speak of r1's or r3's requests, nor of ids without an origin.
        let mut mixed = batch(
            "r2",
            vec![
                free("r1:x"),
                add("r2:b"),
                free("r3:y"),
                free("r2"),
                free("r22:z"),
            ],
        );
        assert_eq!(o.check(Some("r2"), &mut mixed), Ok(4));
        assert_eq!(mixed.changes, vec![add("r2:b")]);
    }

    #[test]
    fn the_legacy_subject_is_heard_unsequenced_and_never_for_an_upgraded_replica() {
        let mut o = SyncOrigins::default();
        let mut old = batch("old", vec![add("old:a"), free("r2:a")]);
        assert_eq!(o.check(None, &mut old), Ok(1));
        assert_eq!(old.changes, vec![add("old:a")]);
        assert_eq!((old.seq, old.instance_id), (0, Uuid::nil()), "unsequenced");
        // r2 published on its own subject: a legacy batch in its name is not r2's.
        o.check(Some("r2"), &mut batch("r2", Vec::new())).unwrap();
        assert_eq!(
            o.check(None, &mut batch("r2", Vec::new())),
            Err(OriginRefusal::LegacyFromUpgraded {
                claimed: "r2".into()
            })
        );
        // Unsequenced, a legacy batch naming a new instance drops nothing, stales nothing.
        let mut s = ReplicaSync::new("r1", false);
        let inst = Uuid::from_u128(1);
        assert_eq!(s.check_seq("old", inst, 1), SeqCheck::InOrder);
        let mut forged = batch("old", Vec::new());
        forged.seq = u64::MAX;
        o.check(None, &mut forged).unwrap();
        assert_eq!(
            s.check_seq("old", forged.instance_id, forged.seq),
            SeqCheck::InOrder,
            "no restart, no baseline"
        );
        assert_eq!(s.check_seq("old", inst, 2), SeqCheck::InOrder);
    }

    #[test]
    fn a_peer_batch_applies_only_the_peers_own_requests() {
        let mut s = ReplicaSync::new("r1", false);
        let now = Instant::now();
        let (apply, _) = s.on_peer_batch(
            "r2",
            vec![free("r1:mine"), add("r2:a"), add("r3:b"), free("r2:a")],
            now,
        );
        assert_eq!(apply, vec![add("r2:a"), free("r2:a")]);
        assert_eq!(s.foreign(), 2);
    }

    #[test]
    fn a_huge_sequence_jump_is_not_believed_and_the_peers_answer_sets_the_baseline() {
        let mut s = ReplicaSync::new("r1", false);
        let now = Instant::now();
        let inst = Uuid::from_u128(3);
        assert_eq!(s.check_seq("r2", inst, 1), SeqCheck::InOrder);
        assert_eq!(s.check_seq("r2", inst, 2), SeqCheck::InOrder);
        // Forged far ahead: the peer is fetched, its changes held, the baseline unmoved.
        assert_eq!(
            s.check_seq("r2", inst, 2 + MAX_SEQ_JUMP + 1),
            SeqCheck::Unheard
        );
        assert_eq!(s.jumps(), 1);
        s.start_resync("r2");
        assert_eq!(s.take_fetches(), vec!["r2".to_string()]);
        assert!(s
            .on_peer_batch("r2", vec![add("r2:forged")], now)
            .0
            .is_empty());
        // The genuine next batch is still in order.
        assert_eq!(s.check_seq("r2", inst, 3), SeqCheck::InOrder);
        s.on_peer_batch("r2", vec![add("r2:real")], now);
        // r2 answers having published 2: batch 3 (after it) applies, the forged one (held
        // under the baseline, 2) does not.
        let out = s.on_resync("r2", Some((2, vec![add("r2:old")])), Vec::new());
        assert_eq!(
            out,
            vec![
                add("r2:old"),
                SeqChange::Output {
                    request_id: "r2:old".into(),
                    output_blocks: 0
                },
                add("r2:real")
            ]
        );
        assert_eq!(s.check_seq("r2", inst, 4), SeqCheck::InOrder);
        // A baseline far ahead of what the peer says it published (a forged first batch)
        // is reset by its answer, so its genuine batches are not stale for good.
        let mut s = ReplicaSync::new("r1", false);
        assert_eq!(s.check_seq("r3", inst, u64::MAX - 5), SeqCheck::Unheard);
        s.start_resync("r3");
        s.on_resync("r3", Some((10, Vec::new())), Vec::new());
        assert_eq!(s.check_seq("r3", inst, 11), SeqCheck::InOrder);
        // Without an answer nothing is reset (nobody vouched for anything), but a run of
        // stale batches is doubted: the peer is fetched again and its answer believed.
        let mut s = ReplicaSync::new("r1", false);
        s.check_seq("r3", inst, 1000);
        s.start_resync("r3");
        s.on_resync("r3", None, Vec::new());
        for seq in 11..10 + u64::from(MAX_STALE_RUN) {
            assert_eq!(s.check_seq("r3", inst, seq), SeqCheck::Stale);
        }
        let doubted = 10 + u64::from(MAX_STALE_RUN);
        assert_eq!(s.check_seq("r3", inst, doubted), SeqCheck::Unheard);
        s.start_resync("r3");
        s.on_resync("r3", Some((doubted, Vec::new())), Vec::new());
        assert_eq!(s.check_seq("r3", inst, doubted + 1), SeqCheck::InOrder);
        // A genuine duplicate now and then stays just stale.
        assert_eq!(s.check_seq("r3", inst, doubted + 1), SeqCheck::Stale);
        assert_eq!(s.check_seq("r3", inst, doubted + 2), SeqCheck::InOrder);
    }

    #[test]
    fn a_snapshot_is_checked_with_each_origin() {
        let mut s = ReplicaSync::new("r3", true);
        let t0 = Instant::now();
        // Any caught-up peer answers; it claims requests of r1 and r2 (and of r1 again).
        let snapshot = vec![add("r1:x"), add("r2:y"), add("r1:z"), add("r3:gone")];
        let out = s.on_snapshot(snapshot, t0, |_| false);
        assert_eq!(out, vec![add("r1:x"), add("r2:y"), add("r1:z")]);
        assert_eq!(s.take_fetches(), vec!["r1".to_string(), "r2".to_string()]);
        // r1 holds only x: z, which the snapshot claimed, goes.
        let out = s.on_resync(
            "r1",
            Some((4, vec![add("r1:x")])),
            vec!["r1:x".into(), "r1:z".into()],
        );
        assert_eq!(out[0], free("r1:z"));
        // r2 does not answer (gone, or never was): its entries wait for the lease.
        assert!(s.on_resync("r2", None, vec!["r2:y".into()]).is_empty());
        assert_eq!(
            s.expire_peers(t0 + PEER_LEASE),
            vec!["r1".to_string(), "r2".to_string()]
        );
    }

    #[test]
    fn applied_changes_carry_output_blocks() {
        let mut core: Scheduler = Scheduler::new(Default::default()).unwrap();
        core.add_worker_key(WorkerKey::new(1, 0), 100);
        let now = Instant::now();
        let with_output = add_with("r2:a", 10, 3);
        apply_changes(&mut core, vec![with_output, add("r3:b")], now);
        let blocks = |c: &Scheduler| c.load(WorkerKey::new(1, 0)).unwrap().active_blocks;
        assert_eq!(blocks(&core), 1 + 3);
        let output = SeqChange::Output {
            request_id: "r3:b".into(),
            output_blocks: 2,
        };
        apply_changes(&mut core, vec![output], now);
        assert_eq!(blocks(&core), 1 + 3 + 2);
        let mut exported = export_active(&core, Some("r2"));
        assert_eq!(exported.len(), 1);
        assert!(matches!(
            exported.pop(),
            Some(SeqChange::Add {
                output_blocks: 3,
                ..
            })
        ));
        assert_eq!(export_active(&core, None).len(), 2);
    }

    #[test]
    fn peer_changes_are_bounded_in_id_length_and_buffered_bytes() {
        let t0 = Instant::now();
        let mut r = ReplicaSync::new("me", true);
        let long = format!("p:{}", "x".repeat(MAX_SYNC_ID_BYTES));
        let (apply, _) = r.on_peer_batch("p", vec![add(&long), add("p:ok")], t0);
        assert!(apply.is_empty(), "still catching up");
        assert_eq!(r.refused(), 1);
        // A flood of large Adds: the buffer never holds more than its byte bound.
        let big = |i: usize| SeqChange::Add {
            request_id: format!("p:{i}"),
            key: WorkerKey::new(1, 0),
            sequence_hashes: vec![SequenceHash(7); 100_000],
            prefill_tokens: 0,
            output_blocks: 0,
        };
        let per = change_bytes(&big(0));
        let n = MAX_BUFFERED_BYTES / per + 2;
        for i in 0..n {
            r.on_peer_batch("p", vec![big(i)], t0);
            let held = r.buffer.as_ref().unwrap();
            assert!(held.bytes <= MAX_BUFFERED_BYTES);
            assert_eq!(
                held.bytes,
                held.changes.iter().map(change_bytes).sum::<usize>()
            );
        }
        assert!(r.dropped() > 0, "the buffer overflowed and was dropped");
        // Snapshots refuse oversize ids too.
        let out = r.on_snapshot(vec![add(&long), add("q:fine")], t0, |_| false);
        assert!(out.iter().all(within_limits));
        assert!(out.iter().any(|c| change_id(c) == "q:fine"));
    }
}
