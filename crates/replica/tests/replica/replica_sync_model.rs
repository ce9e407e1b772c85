//! Property test of replica sync (`--replica-sync`) against a reference model: 2 to 4
//! replicas, each a scheduling core plus its `ReplicaSync`, route, prefill and free their own
//! requests and flush their changes into one FIFO channel per (origin, destination) pair, so
//! each origin's order is kept while origins interleave at random. A late replica may join
//! (catching up), route its own requests at once, and at a random later moment gets a
//! snapshot exported from a random caught-up peer. Batches are numbered per origin and may be
//! lost on any channel: the receiver sees the gap at the origin's next batch and fetches
//! the origin's own requests (answered at a random later moment, with the origin's state
//! then). Once everything is delivered (every replica flushing once more, as its heartbeat
//! does), every replica must hold exactly the live requests, prefilled or not, and
//! delivering a batch twice must change nothing.
//!
//! One assumption: a snapshot's source has received every batch flushed before the joiner
//! subscribed (the real joiner asks only once its ranks are synced, long after subscribing).
//! Without it a change still in flight to the source when the joiner subscribed reaches
//! neither the snapshot nor the joiner, and the joiner misses it for good (an `Add`: a live
//! request it never counts; a `Free`: one it counts until the request-timeout sweep).

use kvrouter_protocol::{SeqChange, SequenceHash, WorkerKey};
use kvrouter_replica::replica_sync::{apply_changes, export_active, ReplicaSync, SeqCheck};
use kvrouter_scheduler::{Scheduler, SchedulerConfig};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};
use uuid::Uuid;

const KEYS: [WorkerKey; 3] = [
    WorkerKey::new(1, 0),
    WorkerKey::new(1, 1),
    WorkerKey::new(2, 0),
];

#[derive(Clone, Debug)]
enum Op {
    /// Replica `r` routes a new request.
    Route {
        r: usize,
        key: usize,
        hashes: Vec<u8>,
        prefill: u16,
    },
    /// Replica `r` marks one of its live requests prefilled.
    Prefill { r: usize, which: usize },
    /// Replica `r` frees one of its live requests.
    Free { r: usize, which: usize },
    /// Replica `r` sends its pending changes to every peer.
    Flush { r: usize },
    /// The next batch on a random non-empty channel arrives (twice when `dup`).
    Deliver { ch: usize, dup: bool },
    /// The late replica joins (catching up).
    Join,
    /// The late replica's catch-up snapshot, exported now by a random caught-up peer.
    Snapshot { from: usize },
    /// The next batch on a random non-empty channel is lost.
    Lose { ch: usize },
    /// A random pending fetch of a peer's own requests (after a gap) is answered now.
    Answer { which: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<usize>(), any::<usize>(), prop::collection::vec(0u8..8, 0..4), 1u16..500)
            .prop_map(|(r, key, hashes, prefill)| Op::Route { r, key, hashes, prefill }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(r, which)| Op::Prefill { r, which }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(r, which)| Op::Free { r, which }),
        3 => any::<usize>().prop_map(|r| Op::Flush { r }),
        6 => (any::<usize>(), any::<bool>()).prop_map(|(ch, dup)| Op::Deliver { ch, dup }),
        2 => Just(Op::Join),
        2 => any::<usize>().prop_map(|from| Op::Snapshot { from }),
        1 => any::<usize>().prop_map(|ch| Op::Lose { ch }),
        2 => any::<usize>().prop_map(|which| Op::Answer { which }),
    ]
}

struct Replica {
    core: Scheduler<()>,
    sync: ReplicaSync,
    /// False for the late replica until it joins: it neither acts nor receives.
    joined: bool,
}

/// A batch in flight, its sequence number, and whether it was sent before the late replica
/// joined.
type Channel = VecDeque<(Vec<SeqChange>, u64, bool)>;

/// The reference: every live request by global id, with its origin, local id and whether it
/// is prefilled.
#[derive(Default)]
struct Truth {
    live: BTreeMap<String, (usize, String, bool)>,
}

impl Truth {
    fn expected(&self) -> BTreeSet<(String, bool)> {
        self.live
            .iter()
            .map(|(id, (_, _, prefilled))| (id.clone(), *prefilled))
            .collect()
    }

    fn own(&self, origin: usize) -> Vec<String> {
        self.live
            .iter()
            .filter(|(_, (o, ..))| *o == origin)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

struct World {
    replicas: Vec<Replica>,
    /// `channels[from * n + to]`.
    channels: Vec<Channel>,
    late: Option<usize>,
    truth: Truth,
    next_request: usize,
    now: Instant,
    /// Each origin's last sequence number.
    seq: Vec<u64>,
    /// Fetches of a peer's own requests not answered yet: (asker, peer).
    pending: Vec<(usize, usize)>,
}

fn instance(r: usize) -> Uuid {
    Uuid::from_u128(r as u128 + 1)
}

/// What a replica holds: every active sequence's id, and whether its prefill is done.
fn held_requests(core: &Scheduler<()>) -> BTreeSet<(String, bool)> {
    export_active(core, None)
        .into_iter()
        .map(|c| match c {
            SeqChange::Add {
                request_id,
                prefill_tokens,
                ..
            } => (request_id, prefill_tokens == 0),
            other => panic!("a snapshot holds only adds, got {other:?}"),
        })
        .collect()
}

/// Everything about a core's sequences (for "a duplicate changes nothing").
fn full_state(core: &Scheduler<()>) -> Vec<SeqChange> {
    let mut v = export_active(core, None);
    v.sort_by_key(|c| format!("{c:?}"));
    v
}

impl World {
    fn new(n: usize, late: bool) -> Self {
        let replicas = (0..n)
            .map(|i| {
                let mut core = Scheduler::new(SchedulerConfig::default()).unwrap();
                for k in KEYS {
                    core.add_worker_key(k, 0);
                }
                let is_late = late && i == n - 1;
                Replica {
                    core,
                    sync: ReplicaSync::new(&format!("r{i}"), is_late),
                    joined: !is_late,
                }
            })
            .collect();
        Self {
            replicas,
            channels: (0..n * n).map(|_| VecDeque::new()).collect(),
            late: late.then_some(n - 1),
            truth: Truth::default(),
            next_request: 0,
            now: Instant::now(),
            seq: vec![0; n],
            pending: Vec::new(),
        }
    }

    fn n(&self) -> usize {
        self.replicas.len()
    }

    fn tick(&mut self) -> Instant {
        self.now += Duration::from_millis(1);
        self.now
    }

    fn joined(&self) -> Vec<usize> {
        (0..self.n()).filter(|&i| self.replicas[i].joined).collect()
    }

    fn pick_joined(&self, r: usize) -> usize {
        let j = self.joined();
        j[r % j.len()]
    }

    fn route(&mut self, r: usize, key: WorkerKey, hashes: &[u8], prefill: u64) {
        let now = self.tick();
        let local = format!("q{}", self.next_request);
        self.next_request += 1;
        let rep = &mut self.replicas[r];
        let global = rep.sync.global_id(&local);
        let hashes: Vec<SequenceHash> = hashes.iter().map(|&h| SequenceHash(h.into())).collect();
        rep.core
            .add_request(global.clone(), key, &hashes, prefill, now)
            .unwrap();
        rep.sync.added_global(&global, key, hashes, prefill, 0);
        self.truth.live.insert(global, (r, local, false));
    }

    fn prefill(&mut self, r: usize, which: usize) {
        let own = self.truth.own(r);
        if own.is_empty() {
            return;
        }
        let global = &own[which % own.len()];
        let (_, local, prefilled) = self.truth.live.get_mut(global).unwrap();
        *prefilled = true;
        let rep = &mut self.replicas[r];
        assert!(
            rep.core.mark_prefill(global),
            "own request {global} unknown"
        );
        rep.sync.prefilled(local);
    }

    fn free(&mut self, r: usize, which: usize) {
        let own = self.truth.own(r);
        if own.is_empty() {
            return;
        }
        let global = &own[which % own.len()];
        let (_, local, _) = self.truth.live.remove(global).unwrap();
        let rep = &mut self.replicas[r];
        assert!(rep.core.free(global), "own request {global} unknown");
        rep.sync.freed(&local);
    }

    fn flush(&mut self, r: usize) {
        let now = self.tick();
        let batch = self.replicas[r].sync.take_outgoing(now);
        let pre_join = self.late.is_some_and(|l| !self.replicas[l].joined);
        self.seq[r] += 1;
        let seq = self.seq[r];
        for to in self.joined() {
            if to != r {
                let n = self.n();
                self.channels[r * n + to].push_back((batch.clone(), seq, pre_join));
            }
        }
    }

    /// The next batch on channel `ch` arrives (twice if `dup`, which must change nothing).
    fn deliver(&mut self, ch: usize, dup: bool) {
        let now = self.tick();
        let n = self.n();
        let (from, to) = (ch / n, ch % n);
        let Some((batch, seq, _)) = self.channels[ch].pop_front() else {
            return;
        };
        let from_id = format!("r{from}");
        let rep = &mut self.replicas[to];
        let receive = |rep: &mut Replica, mut batch: Vec<SeqChange>| {
            match rep.sync.check_seq(&from_id, instance(from), seq) {
                SeqCheck::InOrder => {}
                SeqCheck::Stale => batch.clear(),
                SeqCheck::Lost { .. } | SeqCheck::Unheard => rep.sync.start_resync(&from_id),
                SeqCheck::Restarted { .. } => unreachable!("no replica restarts here"),
            }
            let (apply, _) = rep.sync.on_peer_batch(&from_id, batch, now);
            apply_changes(&mut rep.core, apply, now);
        };
        receive(rep, batch.clone());
        if dup {
            let before = full_state(&rep.core);
            receive(rep, batch);
            assert_eq!(
                full_state(&rep.core),
                before,
                "a duplicate batch from r{from} changed r{to}"
            );
        }
        self.queue_fetches(to);
    }

    /// Fetches replica `r` wants made (answered later by `answer`).
    fn queue_fetches(&mut self, r: usize) {
        for peer in self.replicas[r].sync.take_fetches() {
            let p: usize = peer[1..].parse().unwrap();
            self.pending.push((r, p));
        }
    }

    /// Peer `p` answers `r`'s fetch with its own requests as they are now.
    fn answer(&mut self, which: usize) {
        if self.pending.is_empty() {
            return;
        }
        let (r, p) = self.pending.remove(which % self.pending.len());
        let peer = format!("r{p}");
        let own = export_active(&self.replicas[p].core, Some(&peer));
        let published = self.seq[p];
        let now = self.tick();
        let rep = &mut self.replicas[r];
        let held: Vec<String> = rep
            .core
            .active_sequences()
            .filter(|(id, ..)| ReplicaSync::is_from(id, &peer))
            .map(|(id, ..)| id.clone())
            .collect();
        let apply = rep.sync.on_resync(&peer, Some((published, own)), held);
        apply_changes(&mut rep.core, apply, now);
    }

    fn join(&mut self) {
        if let Some(l) = self.late {
            self.replicas[l].joined = true;
        }
    }

    /// The late replica's snapshot, exported now by peer `from` (caught up) once it has
    /// received what was sent before the join (see the module docs).
    fn snapshot(&mut self, from: usize) {
        let Some(l) = self.late else { return };
        if !self.replicas[l].joined || self.replicas[l].sync.is_caught_up() {
            return;
        }
        let sources: Vec<usize> = (0..self.n())
            .filter(|&i| i != l && self.replicas[i].sync.is_caught_up())
            .collect();
        let src = sources[from % sources.len()];
        let n = self.n();
        for origin in 0..n {
            while self.channels[origin * n + src]
                .front()
                .is_some_and(|(_, _, pre_join)| *pre_join)
            {
                self.deliver(origin * n + src, false);
            }
        }
        let snapshot = export_active(&self.replicas[src].core, None);
        let now = self.tick();
        let rep = &mut self.replicas[l];
        let core = &rep.core;
        let apply = rep
            .sync
            .on_snapshot(snapshot, now, |id| core.contains_request(id));
        apply_changes(&mut rep.core, apply, now);
        assert!(rep.sync.is_caught_up());
        self.queue_fetches(l);
    }

    fn run(&mut self, op: &Op) {
        match op {
            Op::Route {
                r,
                key,
                hashes,
                prefill,
            } => {
                let r = self.pick_joined(*r);
                self.route(r, KEYS[key % KEYS.len()], hashes, u64::from(*prefill));
            }
            Op::Prefill { r, which } => self.prefill(self.pick_joined(*r), *which),
            Op::Free { r, which } => self.free(self.pick_joined(*r), *which),
            Op::Flush { r } => self.flush(self.pick_joined(*r)),
            Op::Deliver { ch, dup } => {
                let busy: Vec<usize> = (0..self.channels.len())
                    .filter(|&c| !self.channels[c].is_empty())
                    .collect();
                if !busy.is_empty() {
                    self.deliver(busy[ch % busy.len()], *dup);
                }
            }
            Op::Join => self.join(),
            Op::Snapshot { from } => self.snapshot(*from),
            Op::Lose { ch } => {
                let busy: Vec<usize> = (0..self.channels.len())
                    .filter(|&c| !self.channels[c].is_empty())
                    .collect();
                if !busy.is_empty() {
                    self.channels[busy[ch % busy.len()]].pop_front();
                }
            }
            Op::Answer { which } => self.answer(*which),
        }
    }

    /// Catches the late replica up if it has not been (joining it first if it never did),
    /// with whatever is still in flight, then flushes every outbox and delivers every batch.
    /// Then answers the fetches that revealed, and again until none is left.
    fn settle(&mut self) {
        self.join();
        self.snapshot(0);
        loop {
            for r in 0..self.n() {
                self.flush(r);
            }
            for ch in 0..self.channels.len() {
                while !self.channels[ch].is_empty() {
                    self.deliver(ch, false);
                }
            }
            if self.pending.is_empty() {
                break;
            }
            while !self.pending.is_empty() {
                self.answer(0);
            }
        }
    }
}

/// Runs `ops`, settles, and checks every replica against the reference.
fn check(n: usize, late: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut world = World::new(n, late);
    for op in ops {
        world.run(op);
    }
    world.settle();
    let expected = world.truth.expected();
    for (i, rep) in world.replicas.iter().enumerate() {
        prop_assert!(rep.sync.is_caught_up());
        prop_assert_eq!(held_requests(&rep.core), expected.clone(), "replica r{}", i);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn every_replica_ends_with_the_live_requests(
        n in 2usize..=4,
        late in prop::bool::weighted(0.75),
        ops in prop::collection::vec(op(), 0..80),
    ) {
        check(n, late, &ops)?;
    }
}

/// The joiner (r1) routes and frees a request while catching up; the peer answering its
/// snapshot has the `Add` but not yet the `Free`. The request must not come back.
#[test]
fn a_joiner_does_not_get_back_its_own_freed_request() {
    let ops = [
        Op::Join,
        Op::Route {
            r: 1,
            key: 0,
            hashes: vec![1],
            prefill: 10,
        },
        Op::Flush { r: 1 },
        Op::Deliver { ch: 0, dup: false },
        Op::Free { r: 1, which: 0 },
        Op::Snapshot { from: 0 },
    ];
    check(2, true, &ops).unwrap();
}

/// r0's `Free` reaches the joiner (r2) before its snapshot, which r1 takes still holding the
/// `Add`: the buffered `Free` must apply after the snapshot.
#[test]
fn a_buffered_free_applies_after_a_snapshot_still_holding_the_add() {
    let ops = [
        Op::Route {
            r: 0,
            key: 0,
            hashes: vec![1],
            prefill: 10,
        },
        Op::Flush { r: 0 },
        Op::Join,
        Op::Free { r: 0, which: 0 },
        Op::Flush { r: 0 },
        // In flight: 0->1 (the add, sent before the join; then the free) and 0->2 (the
        // free). The second busy channel is 0->2: the free reaches r2.
        Op::Deliver { ch: 1, dup: true },
        Op::Snapshot { from: 1 },
    ];
    check(3, true, &ops).unwrap();
}
