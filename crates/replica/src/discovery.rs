//! Which worker ranks of one model are alive: registrations, heartbeats, leases.
//!
//! A plain core: messages in, [`Change`]s out, time passed in. The worker tracker turns changes
//! into index, scheduler and state-sync work.

use kvrouter_protocol::{DpRank, Heartbeat, Registration, WorkerId, WorkerKey, MAX_PARALLEL_SIZE};
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// What a discovery message changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A rank joined routing (fetch its state).
    RankAdded {
        key: WorkerKey,
        capacity_blocks: u64,
    },
    /// A rank left (a heartbeat no longer lists it).
    RankRemoved(WorkerKey),
    /// Every rank of a worker left (deregistration, expired lease, or replaced instance).
    WorkerRemoved {
        worker_id: WorkerId,
        reason: &'static str,
    },
    /// The registration was refused; the worker is not routed to. `first`: the first refusal
    /// of this instance in [`REFUSAL_MEMORY`] (log it; later ones are the same news).
    Refused {
        worker_id: WorkerId,
        reason: String,
        first: bool,
    },
    /// A heartbeat or event came from a worker (or instance) we have no registration for:
    /// ask the fleet who is there.
    Unknown { worker_id: WorkerId },
    /// A new instance registered under a worker id whose instance was still live (within its
    /// lease): a restart, or two engines configured with one id. Allowed (the old instance's
    /// state is dropped, a `WorkerRemoved` follows) but worth a warning and a count.
    InstanceTakeover {
        worker_id: WorkerId,
        old: Uuid,
        new: Uuid,
    },
}

/// Largest `capacity_blocks` a registration may claim: 2^36 blocks (over a trillion tokens
/// at block size 16) is beyond any cache tier; the scheduler does arithmetic on it.
pub const MAX_CAPACITY_BLOCKS: u64 = 1 << 36;
/// Longest heartbeat interval accepted.
pub const MAX_HEARTBEAT_INTERVAL_MS: u32 = 60_000;

struct Entry {
    instance_id: Uuid,
    capacity_blocks: u64,
    ranks: BTreeSet<DpRank>,
    valid: std::ops::Range<DpRank>,
    last_seen: Instant,
}

/// How long a refused worker instance is remembered: its heartbeats and events ask for no
/// roll call meanwhile (each roll call makes every worker re-register to every replica), and
/// its refusal is logged once per this period, not on every re-announcement.
pub const REFUSAL_MEMORY: Duration = Duration::from_secs(60);

/// Checks of the leases this far apart mean this process was stopped or starved meanwhile
/// (they run every 250 ms): the heartbeats sent during that time wait unread in its socket.
pub const STALLED_CHECKS: Duration = Duration::from_secs(2);

/// Live workers of one model.
pub struct Discovery {
    model: String,
    block_size: Option<u32>,
    lease: Duration,
    workers: FxHashMap<WorkerId, Entry>,
    /// Refused instances and when they were first refused (pruned after REFUSAL_MEMORY).
    refused: FxHashMap<(WorkerId, Uuid), Instant>,
    /// When the leases were last checked.
    last_check: Option<Instant>,
}

impl Discovery {
    /// `block_size`: fixed by configuration, or `None` to take the first worker's.
    pub fn new(model: &str, block_size: Option<u32>, lease: Duration) -> Self {
        Self {
            model: model.to_string(),
            block_size,
            lease,
            workers: FxHashMap::default(),
            refused: FxHashMap::default(),
            last_check: None,
        }
    }

    /// Whether this worker instance was refused within [`REFUSAL_MEMORY`].
    pub fn is_refused(&self, worker_id: WorkerId, instance_id: Uuid, now: Instant) -> bool {
        self.refused
            .get(&(worker_id, instance_id))
            .is_some_and(|&t| now.saturating_duration_since(t) < REFUSAL_MEMORY)
    }

    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    pub fn keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.workers
            .iter()
            .flat_map(|(&w, e)| e.ranks.iter().map(move |&r| WorkerKey::new(w, r)))
    }

    pub fn capacity_blocks(&self, worker_id: WorkerId) -> Option<u64> {
        self.workers.get(&worker_id).map(|e| e.capacity_blocks)
    }

    pub fn instance(&self, worker_id: WorkerId) -> Option<Uuid> {
        self.workers.get(&worker_id).map(|e| e.instance_id)
    }

    pub fn has_key(&self, key: WorkerKey) -> bool {
        self.workers
            .get(&key.worker_id)
            .is_some_and(|e| e.ranks.contains(&key.dp_rank))
    }

    fn check(&self, reg: &Registration) -> Result<(), String> {
        if reg.model != self.model {
            return Err(format!(
                "registered for model {:?}, not {:?}",
                reg.model, self.model
            ));
        }
        if reg.block_size == 0 {
            return Err("block size 0".into());
        }
        if let Some(b) = self.block_size {
            if reg.block_size != b {
                return Err(format!(
                    "block size {} differs from the model's {b} (set by its first worker or --block-size)",
                    reg.block_size
                ));
            }
        }
        if reg.dp_size == 0
            || reg.dp_size > MAX_PARALLEL_SIZE
            || reg.dp_start_rank.checked_add(reg.dp_size).is_none()
        {
            return Err(format!(
                "invalid data-parallel ranks: dp_start_rank {} dp_size {} (dp_size 1..={MAX_PARALLEL_SIZE})",
                reg.dp_start_rank, reg.dp_size
            ));
        }
        if reg.tp_size == 0 || reg.tp_size > MAX_PARALLEL_SIZE {
            return Err(format!(
                "invalid tp_size {} (1..={MAX_PARALLEL_SIZE})",
                reg.tp_size
            ));
        }
        if reg.capacity_blocks == 0 || reg.capacity_blocks > MAX_CAPACITY_BLOCKS {
            return Err(format!(
                "capacity {} blocks (1..={MAX_CAPACITY_BLOCKS})",
                reg.capacity_blocks
            ));
        }
        if reg.heartbeat_interval_ms == 0 || reg.heartbeat_interval_ms > MAX_HEARTBEAT_INTERVAL_MS {
            return Err(format!(
                "heartbeat interval {} ms (1..={MAX_HEARTBEAT_INTERVAL_MS})",
                reg.heartbeat_interval_ms
            ));
        }
        if u128::from(reg.heartbeat_interval_ms) >= self.lease.as_millis() {
            return Err(format!(
                "heartbeat interval {} ms is not shorter than this replica's worker lease of {} ms: it would expire between heartbeats (raise --worker-lease-secs or heartbeat more often)",
                reg.heartbeat_interval_ms,
                self.lease.as_millis()
            ));
        }
        if let Some(r) = reg.live_ranks.iter().find(|r| !reg.ranks().contains(r)) {
            return Err(format!(
                "live rank {r} outside its ranks {}..{}",
                reg.dp_start_rank,
                reg.dp_start_rank + reg.dp_size
            ));
        }
        Ok(())
    }

    /// A registration (first start, re-announcement, or a new instance).
    pub fn on_registration(&mut self, reg: &Registration, now: Instant) -> Vec<Change> {
        if let Err(reason) = self.check(reg) {
            let first = !self.is_refused(reg.worker_id, reg.instance_id, now);
            if first {
                self.refused
                    .retain(|_, &mut t| now.saturating_duration_since(t) < REFUSAL_MEMORY);
                self.refused.insert((reg.worker_id, reg.instance_id), now);
            }
            return vec![Change::Refused {
                worker_id: reg.worker_id,
                reason,
                first,
            }];
        }
        self.block_size.get_or_insert(reg.block_size);
        let mut out = Vec::new();
        if let Some(e) = self.workers.get_mut(&reg.worker_id) {
            if e.instance_id == reg.instance_id {
                e.last_seen = now;
                let live: BTreeSet<DpRank> = reg.live_ranks.iter().copied().collect();
                Self::diff_ranks(reg.worker_id, e, live, &mut out);
                return out;
            }
            if now.saturating_duration_since(e.last_seen) <= self.lease {
                out.push(Change::InstanceTakeover {
                    worker_id: reg.worker_id,
                    old: e.instance_id,
                    new: reg.instance_id,
                });
            }
            self.workers.remove(&reg.worker_id);
            out.push(Change::WorkerRemoved {
                worker_id: reg.worker_id,
                reason: "replaced by a new instance",
            });
        }
        let ranks: BTreeSet<DpRank> = reg.live_ranks.iter().copied().collect();
        for &r in &ranks {
            out.push(Change::RankAdded {
                key: WorkerKey::new(reg.worker_id, r),
                capacity_blocks: reg.capacity_blocks,
            });
        }
        self.workers.insert(
            reg.worker_id,
            Entry {
                instance_id: reg.instance_id,
                capacity_blocks: reg.capacity_blocks,
                ranks,
                valid: reg.ranks(),
                last_seen: now,
            },
        );
        out
    }

    fn diff_ranks(
        worker_id: WorkerId,
        e: &mut Entry,
        live: BTreeSet<DpRank>,
        out: &mut Vec<Change>,
    ) {
        let live: BTreeSet<DpRank> = live.into_iter().filter(|r| e.valid.contains(r)).collect();
        for &r in e.ranks.difference(&live) {
            out.push(Change::RankRemoved(WorkerKey::new(worker_id, r)));
        }
        for &r in live.difference(&e.ranks) {
            out.push(Change::RankAdded {
                key: WorkerKey::new(worker_id, r),
                capacity_blocks: e.capacity_blocks,
            });
        }
        e.ranks = live;
    }

    pub fn on_heartbeat(&mut self, hb: &Heartbeat, now: Instant) -> Vec<Change> {
        let mut out = Vec::new();
        let refused = self.is_refused(hb.worker_id, hb.instance_id, now);
        match self.workers.get_mut(&hb.worker_id) {
            Some(e) if e.instance_id == hb.instance_id => {
                e.last_seen = now;
                let live = hb.live_ranks.iter().copied().collect();
                Self::diff_ranks(hb.worker_id, e, live, &mut out);
            }
            _ if refused => {}
            _ => out.push(Change::Unknown {
                worker_id: hb.worker_id,
            }),
        }
        out
    }

    /// A worker leaving on purpose; ignored unless it names the current instance.
    pub fn on_deregistration(&mut self, worker_id: WorkerId, instance_id: Uuid) -> Vec<Change> {
        match self.workers.get(&worker_id) {
            Some(e) if e.instance_id == instance_id => {
                self.workers.remove(&worker_id);
                vec![Change::WorkerRemoved {
                    worker_id,
                    reason: "deregistered",
                }]
            }
            _ => Vec::new(),
        }
    }

    /// Workers whose last registration or heartbeat is older than the lease. Time this
    /// process did not run (checks [`STALLED_CHECKS`] or more apart) does not count against
    /// them: their heartbeats of that time are still unread, and dropping every worker (its
    /// index, its routed requests) on waking would be a storm of state fetches for nothing.
    pub fn expire(&mut self, now: Instant) -> Vec<Change> {
        if let Some(gap) = self
            .last_check
            .map(|t| now.saturating_duration_since(t))
            .filter(|gap| *gap >= STALLED_CHECKS)
        {
            for e in self.workers.values_mut() {
                e.last_seen = (e.last_seen + gap).min(now);
            }
        }
        self.last_check = Some(now);
        let lease = self.lease;
        let gone: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.last_seen) > lease)
            .map(|(&w, _)| w)
            .collect();
        gone.into_iter()
            .map(|worker_id| {
                self.workers.remove(&worker_id);
                Change::WorkerRemoved {
                    worker_id,
                    reason: "missed heartbeats (lease expired)",
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::WorkerRole;

    fn reg(worker_id: u64, instance: u128, ranks: &[u32]) -> Registration {
        Registration {
            worker_id,
            instance_id: Uuid::from_u128(instance),
            model: "m".into(),
            role: WorkerRole::Aggregated,
            block_size: 16,
            dp_size: 4,
            dp_start_rank: 0,
            live_ranks: ranks.to_vec(),
            tp_size: 1,
            capacity_blocks: 100,
            heartbeat_interval_ms: 1000,
            engine: kvrouter_protocol::EngineKind::Mocker,
            base_url: String::new(),
        }
    }

    fn added(w: u64, r: u32) -> Change {
        Change::RankAdded {
            key: WorkerKey::new(w, r),
            capacity_blocks: 100,
        }
    }

    #[test]
    fn registration_heartbeat_and_rank_changes() {
        let now = Instant::now();
        let mut d = Discovery::new("m", None, Duration::from_secs(3));
        assert_eq!(
            d.on_registration(&reg(1, 1, &[0, 1]), now),
            vec![added(1, 0), added(1, 1)]
        );
        assert_eq!(d.block_size(), Some(16));
        // Same instance again: nothing new.
        assert!(d.on_registration(&reg(1, 1, &[0, 1]), now).is_empty());
        // A heartbeat dropping rank 1 and adding rank 2.
        let hb = Heartbeat {
            worker_id: 1,
            instance_id: Uuid::from_u128(1),
            live_ranks: vec![0, 2],
        };
        assert_eq!(
            d.on_heartbeat(&hb, now),
            vec![Change::RankRemoved(WorkerKey::new(1, 1)), added(1, 2)]
        );
        // Ranks outside the registered range are ignored.
        let hb = Heartbeat {
            live_ranks: vec![0, 2, 9],
            ..hb
        };
        assert!(d.on_heartbeat(&hb, now).is_empty());
        let mut keys: Vec<_> = d.keys().collect();
        keys.sort();
        assert_eq!(keys, vec![WorkerKey::new(1, 0), WorkerKey::new(1, 2)]);
    }

    #[test]
    fn new_instance_replaces_the_old_one() {
        let now = Instant::now();
        let mut d = Discovery::new("m", None, Duration::from_secs(3));
        d.on_registration(&reg(1, 1, &[0]), now);
        let ch = d.on_registration(&reg(1, 2, &[0]), now);
        // The old instance was live: a takeover, logged and counted, then replaced.
        assert_eq!(
            ch[0],
            Change::InstanceTakeover {
                worker_id: 1,
                old: Uuid::from_u128(1),
                new: Uuid::from_u128(2)
            }
        );
        assert!(matches!(ch[1], Change::WorkerRemoved { worker_id: 1, .. }));
        assert_eq!(ch[2], added(1, 0));
        // A restart after the old instance's lease ran out is no takeover.
        let later = now + Duration::from_secs(4);
        let ch = d.on_registration(&reg(1, 3, &[0]), later);
        assert!(matches!(ch[0], Change::WorkerRemoved { worker_id: 1, .. }));
        d.on_registration(&reg(1, 2, &[0]), later);
        // The old instance's deregistration does not remove the new one.
        assert!(d.on_deregistration(1, Uuid::from_u128(1)).is_empty());
        assert_eq!(d.on_deregistration(1, Uuid::from_u128(2)).len(), 1);
        assert_eq!(d.worker_count(), 0);
    }

    #[test]
    fn absurd_registrations_are_refused_with_a_reason() {
        let now = Instant::now();
        type Change_ = fn(&mut Registration);
        let cases: Vec<(Change_, &str)> = vec![
            (|r| r.capacity_blocks = 1 << 63, "capacity"),
            (|r| r.capacity_blocks = 0, "capacity"),
            (|r| r.heartbeat_interval_ms = 0, "heartbeat interval 0"),
            (|r| r.heartbeat_interval_ms = 120_000, "heartbeat interval"),
            (|r| r.heartbeat_interval_ms = 3_000, "not shorter than"),
            (|r| r.dp_size = MAX_PARALLEL_SIZE + 1, "data-parallel"),
            (|r| r.tp_size = 0, "tp_size"),
        ];
        for (i, (change, words)) in cases.into_iter().enumerate() {
            let mut d = Discovery::new("m", None, Duration::from_secs(3));
            let mut r = reg(i as u64, i as u128, &[0]);
            change(&mut r);
            match d.on_registration(&r, now).as_slice() {
                [Change::Refused { reason, .. }] => {
                    assert!(reason.contains(words), "{words:?} not in {reason:?}")
                }
                other => panic!("{words}: {other:?}"),
            }
            assert_eq!(d.worker_count(), 0);
        }
    }

    #[test]
    fn lease_expiry() {
        let t0 = Instant::now();
        let mut d = Discovery::new("m", None, Duration::from_secs(3));
        d.on_registration(&reg(1, 1, &[0]), t0);
        d.on_registration(&reg(2, 2, &[0]), t0);
        let hb = Heartbeat {
            worker_id: 2,
            instance_id: Uuid::from_u128(2),
            live_ranks: vec![0],
        };
        d.on_heartbeat(&hb, t0 + Duration::from_secs(2));
        assert!(d.expire(t0 + Duration::from_secs(3)).is_empty());
        let gone = d.expire(t0 + Duration::from_secs(4));
        assert_eq!(gone.len(), 1);
        assert!(matches!(
            gone[0],
            Change::WorkerRemoved { worker_id: 1, .. }
        ));
        assert_eq!(d.worker_count(), 1);
    }

    #[test]
    fn a_stall_of_this_process_does_not_count_against_the_leases() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut d = Discovery::new("m", None, Duration::from_secs(3));
        d.on_registration(&reg(1, 1, &[0]), t0);
        // Checked every 250 ms, then nothing for 5 s (stopped): 2 s of the lease were used,
        // 1 s is left after the stall.
        for ms in (250..=2000).step_by(250) {
            assert!(d.expire(at(ms)).is_empty());
        }
        assert!(d.expire(at(7000)).is_empty(), "the stall counted");
        assert!(d.expire(at(7250)).is_empty());
        assert!(d.expire(at(7750)).is_empty());
        // No heartbeat read since: the rest of the lease runs out as usual.
        let gone = d.expire(at(8250));
        assert_eq!(gone.len(), 1, "{gone:?}");
    }

    #[test]
    fn a_refused_instance_is_remembered_so_it_asks_for_no_roll_call() {
        let t0 = Instant::now();
        let mut d = Discovery::new("m", Some(32), Duration::from_secs(3));
        let bad = reg(1, 7, &[0]); // block size 16, the model's is 32
        let first = |c: &[Change]| match c {
            [Change::Refused { first, .. }] => Some(*first),
            _ => None,
        };
        assert_eq!(first(&d.on_registration(&bad, t0)), Some(true));
        let hb = Heartbeat {
            worker_id: 1,
            instance_id: bad.instance_id,
            live_ranks: vec![0],
        };
        assert!(d.is_refused(1, bad.instance_id, t0));
        assert!(d.on_heartbeat(&hb, t0).is_empty(), "no roll call for it");
        let later = t0 + Duration::from_secs(30);
        assert_eq!(first(&d.on_registration(&bad, later)), Some(false));
        // Another instance of the same worker id is news.
        assert!(!d.is_refused(1, Uuid::from_u128(8), later));
        let other = Heartbeat {
            instance_id: Uuid::from_u128(8),
            ..hb.clone()
        };
        assert_eq!(
            d.on_heartbeat(&other, later),
            vec![Change::Unknown { worker_id: 1 }]
        );
        // Remembered for REFUSAL_MEMORY only, then checked (and logged) again.
        let after = t0 + REFUSAL_MEMORY;
        assert_eq!(
            d.on_heartbeat(&hb, after),
            vec![Change::Unknown { worker_id: 1 }]
        );
        assert_eq!(first(&d.on_registration(&bad, after)), Some(true));
        assert_eq!(d.worker_count(), 0);
    }

    #[test]
    fn refusals() {
        let now = Instant::now();
        let mut d = Discovery::new("m", Some(32), Duration::from_secs(3));
        let refused = |c: &[Change]| matches!(c, [Change::Refused { .. }]);
        assert!(refused(&d.on_registration(&reg(1, 1, &[0]), now)));
        let mut d = Discovery::new("m", None, Duration::from_secs(3));
        d.on_registration(&reg(1, 1, &[0]), now);
        let mut other = reg(2, 2, &[0]);
        other.block_size = 64;
        assert!(refused(&d.on_registration(&other, now)));
        let mut bad = reg(3, 3, &[7]);
        assert!(refused(&d.on_registration(&bad, now)));
        bad.live_ranks = vec![0];
        bad.model = "other".into();
        assert!(refused(&d.on_registration(&bad, now)));
        // A peer must not make the router keep state for billions of ranks.
        for (dp, tp) in [
            (MAX_PARALLEL_SIZE + 1, 1),
            (1, 0),
            (1, MAX_PARALLEL_SIZE + 1),
        ] {
            let mut huge = reg(4, 4, &[0]);
            (huge.dp_size, huge.tp_size) = (dp, tp);
            assert!(refused(&d.on_registration(&huge, now)), "{dp} {tp}");
        }
        let mut widest = reg(5, 5, &[0]);
        (widest.dp_size, widest.tp_size) = (MAX_PARALLEL_SIZE, MAX_PARALLEL_SIZE);
        assert!(!refused(&d.on_registration(&widest, now)));
        assert_eq!(d.worker_count(), 2);
        // Heartbeats from strangers ask for a roll call.
        let hb = Heartbeat {
            worker_id: 9,
            instance_id: Uuid::nil(),
            live_ranks: vec![0],
        };
        assert_eq!(
            d.on_heartbeat(&hb, now),
            vec![Change::Unknown { worker_id: 9 }]
        );
    }
}
