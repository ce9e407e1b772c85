//! KV transfers of disaggregated requests, across tensor-parallel ranks: a plain core.
//!
//! A disaggregated request's prefill runs on every tensor-parallel (tp) rank of one prefill
//! worker rank, and its KV moves to every tp rank of one decode worker rank. Each tp rank
//! reports on its own ([`kvrouter_protocol::TransferReport`]). The request counts as
//! - **sent** (its prefill blocks may be freed and the router's prefill load released) only
//!   once every prefill tp rank reported it sent;
//! - **received** (decode may start) only once every decode tp rank reported it received.
//!
//! A missing report keeps the request pending; a request pending for longer than the
//! timeout is reported once as overdue (and dropped altogether after `max_age`). A
//! duplicate report changes nothing; a report for an unknown request, or from a worker rank
//! or tp rank the request does not use, is counted and dropped. No I/O, time passed in.

use kvrouter_protocol::{TransferSide, WorkerId, WorkerKey};
use rustc_hash::FxHashMap;
use std::time::{Duration, Instant};

/// Where one side of a transfer happens: a worker rank and its tp size.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TransferEnd {
    pub key: WorkerKey,
    pub tp_size: u32,
}

/// What one report did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReportOutcome {
    /// Recorded; the side still waits for other tp ranks.
    Pending,
    /// The last missing tp rank of this side: the side is complete now.
    Completed(TransferSide),
    /// Already reported (or the side already complete): nothing changed.
    Duplicate,
    /// No pending request of that id (never expected, finished, or dropped).
    Unknown,
    /// The request exists but not on that worker rank or tp rank.
    Foreign,
}

/// A side still incomplete after the timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overdue {
    pub request_id: String,
    pub side: TransferSide,
    pub end: TransferEnd,
    /// tp ranks that have not reported.
    pub missing_tp_ranks: Vec<u32>,
    /// True if the request was dropped (older than `max_age`) rather than just reported.
    pub dropped: bool,
}

/// Counts of reports that changed nothing.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferCounters {
    pub duplicate: u64,
    pub unknown: u64,
    pub foreign: u64,
    pub overdue: u64,
    pub dropped: u64,
}

struct Side {
    end: TransferEnd,
    /// One flag per tp rank.
    reported: Vec<bool>,
    missing: u32,
}

impl Side {
    fn new(end: TransferEnd) -> Self {
        let tp = end.tp_size.max(1);
        Self {
            end: TransferEnd { tp_size: tp, ..end },
            reported: vec![false; tp as usize],
            missing: tp,
        }
    }

    fn done(&self) -> bool {
        self.missing == 0
    }

    fn missing_ranks(&self) -> Vec<u32> {
        (0..self.end.tp_size)
            .filter(|&r| !self.reported[r as usize])
            .collect()
    }
}

struct Pending {
    sent: Side,
    received: Side,
    since: Instant,
    overdue_reported: bool,
}

impl Pending {
    fn side_mut(&mut self, side: TransferSide) -> &mut Side {
        match side {
            TransferSide::Sent => &mut self.sent,
            TransferSide::Received => &mut self.received,
        }
    }
}

/// Pending transfers of one model.
pub struct TransferTracker {
    timeout: Duration,
    max_age: Duration,
    pending: FxHashMap<String, Pending>,
    counters: TransferCounters,
}

impl TransferTracker {
    /// `timeout`: when an incomplete request is reported overdue; `max_age` (at least
    /// `timeout`): when it is dropped.
    pub fn new(timeout: Duration, max_age: Duration) -> Self {
        Self {
            timeout,
            max_age: max_age.max(timeout),
            pending: FxHashMap::default(),
            counters: TransferCounters::default(),
        }
    }

    pub fn counters(&self) -> TransferCounters {
        self.counters
    }

    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    #[cfg(test)]
    pub fn is_pending(&self, request_id: &str) -> bool {
        self.pending.contains_key(request_id)
    }

    /// Whether a side of a pending request is complete (`None`: not pending).
    #[cfg(test)]
    pub fn is_complete(&self, request_id: &str, side: TransferSide) -> Option<bool> {
        self.pending.get(request_id).map(|p| match side {
            TransferSide::Sent => p.sent.done(),
            TransferSide::Received => p.received.done(),
        })
    }

    /// Starts tracking a request routed to `prefill` then `decode`. False (and nothing
    /// changes) if it is already pending.
    pub fn expect(
        &mut self,
        request_id: &str,
        prefill: TransferEnd,
        decode: TransferEnd,
        now: Instant,
    ) -> bool {
        if self.pending.contains_key(request_id) {
            return false;
        }
        self.pending.insert(
            request_id.to_string(),
            Pending {
                sent: Side::new(prefill),
                received: Side::new(decode),
                since: now,
                overdue_reported: false,
            },
        );
        true
    }

    /// Stops tracking a request; true if it was pending.
    #[cfg(test)]
    pub fn forget(&mut self, request_id: &str) -> bool {
        self.pending.remove(request_id).is_some()
    }

    /// Drops every pending request one of whose ends is on a worker for which `gone` holds
    /// (it left: its reports will never come); returns their ids.
    pub fn forget_workers(&mut self, gone: impl Fn(WorkerId) -> bool) -> Vec<String> {
        let mut out = Vec::new();
        self.pending.retain(|id, p| {
            let keep = !gone(p.sent.end.key.worker_id) && !gone(p.received.end.key.worker_id);
            if !keep {
                out.push(id.clone());
            }
            keep
        });
        out
    }

    /// One tp rank of `key` reports `request_id` done on `side`.
    pub fn report(
        &mut self,
        key: WorkerKey,
        tp_rank: u32,
        side: TransferSide,
        request_id: &str,
    ) -> ReportOutcome {
        let Some(p) = self.pending.get_mut(request_id) else {
            self.counters.unknown += 1;
            return ReportOutcome::Unknown;
        };
        let s = p.side_mut(side);
        if s.end.key != key || tp_rank >= s.end.tp_size {
            self.counters.foreign += 1;
            return ReportOutcome::Foreign;
        }
        let flag = &mut s.reported[tp_rank as usize];
        if *flag {
            self.counters.duplicate += 1;
            return ReportOutcome::Duplicate;
        }
        *flag = true;
        s.missing -= 1;
        if !s.done() {
            return ReportOutcome::Pending;
        }
        if p.sent.done() && p.received.done() {
            self.pending.remove(request_id);
        }
        ReportOutcome::Completed(side)
    }

    /// Incomplete sides of requests pending for `timeout` (each reported once) and of
    /// requests pending for `max_age` (dropped now).
    pub fn expire(&mut self, now: Instant) -> Vec<Overdue> {
        let mut out = Vec::new();
        let (timeout, max_age) = (self.timeout, self.max_age);
        self.pending.retain(|id, p| {
            let age = now.saturating_duration_since(p.since);
            let drop = age >= max_age;
            if (age >= timeout && !p.overdue_reported) || drop {
                p.overdue_reported = true;
                for (side, s) in [
                    (TransferSide::Sent, &p.sent),
                    (TransferSide::Received, &p.received),
                ] {
                    if !s.done() {
                        out.push(Overdue {
                            request_id: id.clone(),
                            side,
                            end: s.end,
                            missing_tp_ranks: s.missing_ranks(),
                            dropped: drop,
                        });
                    }
                }
            }
            !drop
        });
        out.sort_by(|a, b| (&a.request_id, a.dropped).cmp(&(&b.request_id, b.dropped)));
        for o in &out {
            if o.dropped {
                self.counters.dropped += 1;
            } else {
                self.counters.overdue += 1;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    const P: WorkerKey = WorkerKey {
        worker_id: 1,
        dp_rank: 2,
    };
    const D: WorkerKey = WorkerKey {
        worker_id: 2,
        dp_rank: 0,
    };

    fn end(key: WorkerKey, tp_size: u32) -> TransferEnd {
        TransferEnd { key, tp_size }
    }

    #[test]
    fn a_side_completes_only_when_every_tp_rank_reported() {
        let t0 = Instant::now();
        let mut t = TransferTracker::new(Duration::from_secs(1), Duration::from_secs(10));
        assert!(t.expect("a", end(P, 2), end(D, 3), t0));
        assert!(!t.expect("a", end(P, 2), end(D, 3), t0));
        use TransferSide::*;
        assert_eq!(t.report(P, 0, Sent, "a"), ReportOutcome::Pending);
        assert_eq!(t.report(P, 0, Sent, "a"), ReportOutcome::Duplicate);
        assert_eq!(t.is_complete("a", Sent), Some(false));
        assert_eq!(t.report(P, 1, Sent, "a"), ReportOutcome::Completed(Sent));
        assert_eq!(t.report(P, 1, Sent, "a"), ReportOutcome::Duplicate);
        assert_eq!(t.is_complete("a", Sent), Some(true));
        // Wrong worker rank, tp rank out of range, wrong side's worker.
        assert_eq!(t.report(D, 0, Sent, "a"), ReportOutcome::Foreign);
        assert_eq!(t.report(D, 3, Received, "a"), ReportOutcome::Foreign);
        assert_eq!(
            t.report(WorkerKey::new(2, 1), 0, Received, "a"),
            ReportOutcome::Foreign
        );
        assert_eq!(t.report(D, 2, Received, "a"), ReportOutcome::Pending);
        assert_eq!(t.report(D, 0, Received, "a"), ReportOutcome::Pending);
        assert_eq!(
            t.report(D, 1, Received, "a"),
            ReportOutcome::Completed(Received)
        );
        // Both sides done: the request is gone; later reports are unknown.
        assert!(!t.is_pending("a"));
        assert_eq!(t.report(D, 1, Received, "a"), ReportOutcome::Unknown);
        assert_eq!(t.report(P, 0, Sent, "zz"), ReportOutcome::Unknown);
        let c = t.counters();
        assert_eq!((c.duplicate, c.foreign, c.unknown), (2, 3, 2));
    }

    #[test]
    fn missing_reports_are_overdue_once_then_dropped() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut t = TransferTracker::new(s(1), s(5));
        t.expect("a", end(P, 2), end(D, 1), t0);
        t.expect("b", end(P, 1), end(D, 1), t0 + s(2));
        t.report(P, 1, TransferSide::Sent, "a");
        assert!(t.expire(t0 + Duration::from_millis(999)).is_empty());
        let out = t.expire(t0 + s(1));
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].side, TransferSide::Sent);
        assert_eq!(out[0].missing_tp_ranks, vec![0]);
        assert_eq!(out[1].side, TransferSide::Received);
        assert!(out.iter().all(|o| o.request_id == "a" && !o.dropped));
        // Reported once only; still pending and completable.
        assert!(t.expire(t0 + s(2)).is_empty());
        assert!(t.is_pending("a"));
        assert_eq!(
            t.report(P, 0, TransferSide::Sent, "a"),
            ReportOutcome::Completed(TransferSide::Sent)
        );
        let out = t.expire(t0 + s(5));
        assert_eq!(out.len(), 3); // a: received dropped; b: both overdue
        assert!(!t.is_pending("a"));
        assert!(t.is_pending("b"));
        assert_eq!(t.counters().dropped, 1);
        assert!(t.forget_workers(|w| w == D.worker_id + 100).is_empty());
        assert_eq!(
            t.forget_workers(|w| w == P.worker_id),
            vec!["b".to_string()]
        );
        assert_eq!(t.pending_count(), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Expect(u8, u32, u32),
        Report(u8, bool, u64, u32, bool),
        Forget(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            1 => (0u8..4, 1u32..4, 1u32..4).prop_map(|(r, p, d)| Op::Expect(r, p, d)),
            6 => (0u8..5, any::<bool>(), 1u64..4, 0u32..4, any::<bool>())
                .prop_map(|(r, right_key, w, tp, sent)| Op::Report(r, right_key, w, tp, sent)),
            1 => (0u8..4).prop_map(Op::Forget),
        ]
    }

    /// The reference: per request, the set of reported tp ranks on each side.
    #[derive(Default)]
    struct Model {
        pending: BTreeMap<String, [(WorkerKey, u32, BTreeSet<u32>); 2]>,
    }

    proptest! {
        #[test]
        fn matches_a_set_model(ops in prop::collection::vec(op(), 1..80)) {
            let t0 = Instant::now();
            let mut t = TransferTracker::new(Duration::from_secs(1), Duration::from_secs(2));
            let mut m = Model::default();
            let mut completed = 0u64;
            for op in ops {
                match op {
                    Op::Expect(r, p, d) => {
                        let id = format!("r{r}");
                        let fresh = !m.pending.contains_key(&id);
                        prop_assert_eq!(t.expect(&id, end(P, p), end(D, d), t0), fresh);
                        if fresh {
                            m.pending.insert(id, [(P, p, BTreeSet::new()), (D, d, BTreeSet::new())]);
                        }
                    }
                    Op::Forget(r) => {
                        let id = format!("r{r}");
                        prop_assert_eq!(t.forget(&id), m.pending.remove(&id).is_some());
                    }
                    Op::Report(r, right_key, w, tp, sent) => {
                        let id = format!("r{r}");
                        let (side, i) = if sent { (TransferSide::Sent, 0) } else { (TransferSide::Received, 1) };
                        let expected = match m.pending.get_mut(&id) {
                            None => ReportOutcome::Unknown,
                            Some(sides) => {
                                let key = if right_key { sides[i].0 } else { WorkerKey::new(w + 10, 0) };
                                let (k, size, set) = &mut sides[i];
                                if key != *k || tp >= *size {
                                    ReportOutcome::Foreign
                                } else if !set.insert(tp) {
                                    ReportOutcome::Duplicate
                                } else if set.len() as u32 == *size {
                                    ReportOutcome::Completed(side)
                                } else {
                                    ReportOutcome::Pending
                                }
                            }
                        };
                        let key = match m.pending.get(&id) {
                            Some(sides) if right_key => sides[i].0,
                            _ => WorkerKey::new(w + 10, 0),
                        };
                        let got = t.report(key, tp, side, &id);
                        prop_assert_eq!(&got, &expected);
                        if matches!(got, ReportOutcome::Completed(_)) {
                            completed += 1;
                            let sides = &m.pending[&id];
                            if sides.iter().all(|(_, n, s)| s.len() as u32 == *n) {
                                m.pending.remove(&id);
                            }
                        }
                    }
                }
                prop_assert_eq!(t.pending_count(), m.pending.len());
                for (id, sides) in &m.pending {
                    prop_assert_eq!(t.is_complete(id, TransferSide::Sent), Some(sides[0].2.len() as u32 == sides[0].1));
                    prop_assert_eq!(t.is_complete(id, TransferSide::Received), Some(sides[1].2.len() as u32 == sides[1].1));
                }
            }
            // Everything left is overdue, and then dropped with exactly its missing ranks.
            let missing: usize = m.pending.values().map(|s| s.iter().filter(|(_, n, s)| s.len() as u32 != *n).count()).sum();
            let out = t.expire(t0 + Duration::from_secs(2));
            prop_assert_eq!(out.len(), missing);
            for o in &out {
                let i = usize::from(o.side == TransferSide::Received);
                let (_, n, set) = &m.pending[&o.request_id][i];
                let want: Vec<u32> = (0..*n).filter(|r| !set.contains(r)).collect();
                prop_assert_eq!(&o.missing_tp_ranks, &want);
            }
            prop_assert_eq!(t.pending_count(), 0);
            let _ = completed;
        }
    }
}
