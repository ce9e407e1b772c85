//! Where a request may go: its allowed, excluded and pinned workers (and, inside a replica,
//! the worker keys a disaggregated step narrows it to). One home for the concept: the
//! replica builds a [`RouteFilters`] from the wire request, the queue keeps it, and the
//! scheduler applies it through its borrowed [`FilterView`].

use crate::active::{ActiveSequences, Slot};
use crate::error::ScheduleError;
use kvrouter_protocol::{Pin, WorkerId, WorkerKey};
use rustc_hash::FxHashSet;
use std::hash::Hash;

/// The filters of one request, owned (what a route job and a queued request carry).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteFilters {
    /// Only these workers may serve it (`None`: any).
    pub allowed_workers: Option<Vec<WorkerId>>,
    /// Never these workers, whatever the other filters allow.
    pub excluded_workers: Vec<WorkerId>,
    /// Only this worker key may serve it.
    pub pinned: Option<WorkerKey>,
    /// Only this worker (any of its ranks) may serve it.
    pub pinned_worker: Option<WorkerId>,
    /// Only these worker keys may serve it (`None`: any), on top of the other filters (e.g.
    /// the decode ranks a disaggregated request may go to).
    pub allowed_keys: Option<Vec<WorkerKey>>,
}

impl RouteFilters {
    /// The filters a route request carries on the wire: a pin with a rank pins that worker
    /// key, one without pins the worker (any of its ranks).
    pub fn from_request(
        allowed_workers: Option<Vec<WorkerId>>,
        excluded_workers: Vec<WorkerId>,
        pin: Option<Pin>,
    ) -> Self {
        let (pinned, pinned_worker) = match pin {
            Some(Pin {
                worker_id,
                dp_rank: Some(r),
            }) => (Some(WorkerKey::new(worker_id, r)), None),
            Some(Pin {
                worker_id,
                dp_rank: None,
            }) => (None, Some(worker_id)),
            None => (None, None),
        };
        Self {
            allowed_workers,
            excluded_workers,
            pinned,
            pinned_worker,
            allowed_keys: None,
        }
    }

    /// Only `workers` (any of their ranks).
    pub fn only_workers(workers: Vec<WorkerId>) -> Self {
        Self {
            allowed_workers: Some(workers),
            ..Self::default()
        }
    }

    /// Only `keys`.
    pub fn only_keys(keys: Vec<WorkerKey>) -> Self {
        Self {
            allowed_keys: Some(keys),
            ..Self::default()
        }
    }

    /// True if a worker or a worker key is pinned.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some() || self.pinned_worker.is_some()
    }

    /// The filters, borrowed (what a [`crate::RouteQuery`] holds).
    pub fn view(&self) -> FilterView<'_> {
        FilterView {
            allowed_workers: self.allowed_workers.as_deref(),
            excluded_workers: &self.excluded_workers,
            pinned: self.pinned,
            pinned_worker: self.pinned_worker,
            allowed_keys: self.allowed_keys.as_deref(),
        }
    }
}

/// The filters of one request, borrowed: what the scheduler applies.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FilterView<'a> {
    pub allowed_workers: Option<&'a [WorkerId]>,
    pub excluded_workers: &'a [WorkerId],
    pub pinned: Option<WorkerKey>,
    pub pinned_worker: Option<WorkerId>,
    pub allowed_keys: Option<&'a [WorkerKey]>,
}

impl FilterView<'_> {
    /// An owned copy.
    pub fn to_filters(&self) -> RouteFilters {
        RouteFilters {
            allowed_workers: self.allowed_workers.map(<[WorkerId]>::to_vec),
            excluded_workers: self.excluded_workers.to_vec(),
            pinned: self.pinned,
            pinned_worker: self.pinned_worker,
            allowed_keys: self.allowed_keys.map(<[WorkerKey]>::to_vec),
        }
    }

    /// True if any filter (allowed, excluded or pinned workers, allowed or pinned keys) is
    /// set.
    pub fn is_filtered(&self) -> bool {
        self.allowed_workers.is_some()
            || !self.excluded_workers.is_empty()
            || self.pinned.is_some()
            || self.pinned_worker.is_some()
            || self.allowed_keys.is_some()
    }

    /// True if the filters let `key` serve the request (registered or not). Scans the lists:
    /// for one key at a time (the scheduler's candidates use hash sets).
    pub fn allows(&self, key: WorkerKey) -> bool {
        let w = key.worker_id;
        self.allowed_workers.is_none_or(|a| a.contains(&w))
            && !self.excluded_workers.contains(&w)
            && self.pinned.is_none_or(|p| p == key)
            && self.pinned_worker.is_none_or(|p| p == w)
            && self.allowed_keys.is_none_or(|k| k.contains(&key))
    }

    /// Fills `out` with the registered slots the filters allow (busy or not). A pin naming
    /// an unknown worker or rank is its own error; a filter that leaves nothing is
    /// [`ScheduleError::NoAllowedWorkers`].
    pub(crate) fn candidates(
        &self,
        active: &ActiveSequences,
        out: &mut Vec<Slot>,
    ) -> Result<(), ScheduleError> {
        out.clear();
        if active.key_count() == 0 {
            return Err(ScheduleError::NoWorkers);
        }
        // Each list is looked up through a hash set built once here (a long list scanned
        // per worker or per slot would be quadratic: a peer may send thousands of ids).
        let allowed_set = self.allowed_workers.map(Members::new);
        let allowed = |w: WorkerId| allowed_set.as_ref().is_none_or(|a| a.contains(&w));
        if let Some(key) = self.pinned {
            let slot = active.pinned_slot(key)?;
            if !allowed(key.worker_id) || self.pinned_worker.is_some_and(|w| w != key.worker_id) {
                return Err(ScheduleError::NoAllowedWorkers);
            }
            out.push(slot);
        } else if let Some(w) = self.pinned_worker {
            if !active.has_worker(w) {
                return Err(ScheduleError::UnknownWorker(w));
            }
            if !allowed(w) {
                return Err(ScheduleError::NoAllowedWorkers);
            }
            out.extend_from_slice(active.worker_slots(w));
        } else if let Some(list) = self.allowed_workers {
            // In the list's order, each worker once.
            let mut seen = FxHashSet::default();
            for w in list {
                if active.has_worker(*w) && seen.insert(*w) {
                    out.extend_from_slice(active.worker_slots(*w));
                }
            }
            if out.is_empty() {
                return Err(ScheduleError::NoAllowedWorkers);
            }
        } else {
            out.extend(active.slots());
        }
        if !self.excluded_workers.is_empty() {
            let excluded = Members::new(self.excluded_workers);
            out.retain(|&s| !excluded.contains(&active.state(s).key.worker_id));
            if out.is_empty() {
                return Err(ScheduleError::NoAllowedWorkers);
            }
        }
        if let Some(keys) = self.allowed_keys {
            let keys = Members::new(keys);
            out.retain(|&s| keys.contains(&active.state(s).key));
            if out.is_empty() {
                return Err(ScheduleError::NoAllowedWorkers);
            }
        }
        Ok(())
    }
}

/// Membership in a list: a scan while it is short, a hash set (built once, O(n)) past that.
enum Members<'a, T> {
    Few(&'a [T]),
    Many(FxHashSet<T>),
}

impl<'a, T: Copy + Eq + Hash> Members<'a, T> {
    /// Lists up to this long are scanned.
    const SCAN: usize = 16;

    fn new(list: &'a [T]) -> Self {
        if list.len() <= Self::SCAN {
            Self::Few(list)
        } else {
            Self::Many(list.iter().copied().collect())
        }
    }

    fn contains(&self, x: &T) -> bool {
        match self {
            Self::Few(list) => list.contains(x),
            Self::Many(set) => set.contains(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(w: WorkerId, r: u32) -> WorkerKey {
        WorkerKey::new(w, r)
    }

    #[test]
    fn wire_pins_become_a_key_or_a_worker() {
        let pin = |worker_id, dp_rank| Some(Pin { worker_id, dp_rank });
        let f = RouteFilters::from_request(Some(vec![1, 2]), vec![3], pin(1, Some(2)));
        assert_eq!(
            f,
            RouteFilters {
                allowed_workers: Some(vec![1, 2]),
                excluded_workers: vec![3],
                pinned: Some(k(1, 2)),
                pinned_worker: None,
                allowed_keys: None,
            }
        );
        let f = RouteFilters::from_request(None, Vec::new(), pin(4, None));
        assert_eq!((f.pinned, f.pinned_worker), (None, Some(4)));
        assert!(f.is_pinned() && f.view().is_filtered());
        let none = RouteFilters::from_request(None, Vec::new(), None);
        assert_eq!(none, RouteFilters::default());
        assert!(!none.is_pinned() && !none.view().is_filtered());
    }

    #[test]
    fn views_round_trip_and_allow_what_every_filter_allows() {
        let f = RouteFilters {
            allowed_workers: Some(vec![1, 2, 3]),
            excluded_workers: vec![3],
            pinned: None,
            pinned_worker: None,
            allowed_keys: Some(vec![k(1, 0), k(2, 1), k(3, 0)]),
        };
        assert_eq!(f.view().to_filters(), f);
        let v = f.view();
        assert!(v.allows(k(1, 0)) && v.allows(k(2, 1)));
        assert!(!v.allows(k(1, 1)), "not an allowed key");
        assert!(!v.allows(k(3, 0)), "excluded");
        assert!(!v.allows(k(4, 0)), "not an allowed worker");
        let pinned = RouteFilters::from_request(
            None,
            Vec::new(),
            Some(Pin {
                worker_id: 5,
                dp_rank: Some(1),
            }),
        );
        assert!(pinned.view().allows(k(5, 1)) && !pinned.view().allows(k(5, 0)));
        assert!(RouteFilters::only_workers(vec![5]).view().allows(k(5, 9)));
        assert!(!RouteFilters::only_keys(vec![k(5, 0)])
            .view()
            .allows(k(5, 9)));
        assert!(RouteFilters::default().view().allows(k(9, 9)));
    }

    /// What `candidates` answers, by brute force: each list scanned, duplicates kept out.
    fn reference(keys: &[WorkerKey], v: &FilterView<'_>) -> Result<Vec<WorkerKey>, ScheduleError> {
        if keys.is_empty() {
            return Err(ScheduleError::NoWorkers);
        }
        let mut out: Vec<WorkerKey> = match v.allowed_workers {
            Some(list) => {
                let mut seen: Vec<WorkerId> = Vec::new();
                let mut out = Vec::new();
                for w in list {
                    if !seen.contains(w) {
                        seen.push(*w);
                        out.extend(keys.iter().filter(|k| k.worker_id == *w));
                    }
                }
                out
            }
            None => keys.to_vec(),
        };
        out.retain(|k| !v.excluded_workers.contains(&k.worker_id));
        if let Some(allowed) = v.allowed_keys {
            out.retain(|k| allowed.contains(k));
        }
        if out.is_empty() {
            return Err(ScheduleError::NoAllowedWorkers);
        }
        Ok(out)
    }

    fn active_of(keys: &[WorkerKey]) -> ActiveSequences {
        let mut a = ActiveSequences::default();
        for k in keys {
            a.add_key(*k, 10);
        }
        a
    }

    fn candidate_keys(
        a: &ActiveSequences,
        v: &FilterView<'_>,
    ) -> Result<Vec<WorkerKey>, ScheduleError> {
        let mut out = Vec::new();
        v.candidates(a, &mut out)?;
        Ok(out.iter().map(|&s| a.state(s).key).collect())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..Default::default()
        })]

        /// Long lists full of duplicates and unknown workers (short and long enough for the
        /// hash sets) pick what a plain scan picks, in the same order.
        #[test]
        fn lists_with_duplicates_match_a_scan(
            workers in proptest::collection::btree_set(0u64..40, 0..12),
            ranks in 1u32..3,
            allowed in proptest::option::of(proptest::collection::vec(0u64..48, 0..80)),
            excluded in proptest::collection::vec(0u64..48, 0..40),
            allowed_keys in proptest::option::of(
                proptest::collection::vec((0u64..48, 0u32..3), 0..40)
            ),
        ) {
            let keys: Vec<WorkerKey> = workers
                .iter()
                .flat_map(|&w| (0..ranks).map(move |r| k(w, r)))
                .collect();
            let a = active_of(&keys);
            let allowed_keys: Option<Vec<WorkerKey>> =
                allowed_keys.map(|l| l.into_iter().map(|(w, r)| k(w, r)).collect());
            let v = FilterView {
                allowed_workers: allowed.as_deref(),
                excluded_workers: &excluded,
                allowed_keys: allowed_keys.as_deref(),
                ..FilterView::default()
            };
            proptest::prop_assert_eq!(candidate_keys(&a, &v), reference(&keys, &v));
        }
    }

    #[test]
    fn two_hundred_thousand_entries_are_filtered_at_once() {
        // 200,000 allowed entries (every one a duplicate of a few workers, or unknown) and
        // 200,000 excluded ones: linear work, so this finishes in milliseconds (the old
        // per-entry scan of the list before it took seconds).
        let keys: Vec<WorkerKey> = (0..64).map(|w| k(w, 0)).collect();
        let a = active_of(&keys);
        let allowed: Vec<WorkerId> = (0..200_000u64).map(|i| i % 1000).collect();
        let excluded: Vec<WorkerId> = (0..200_000u64).map(|i| 1000 + i).chain([3]).collect();
        let v = FilterView {
            allowed_workers: Some(&allowed),
            excluded_workers: &excluded,
            ..FilterView::default()
        };
        let got = candidate_keys(&a, &v).unwrap();
        let want: Vec<WorkerKey> = (0..64).filter(|&w| w != 3).map(|w| k(w, 0)).collect();
        assert_eq!(got, want);
        let only_unknown: Vec<WorkerId> = (1000..201_000).collect();
        let v = FilterView {
            allowed_workers: Some(&only_unknown),
            ..FilterView::default()
        };
        assert_eq!(candidate_keys(&a, &v), Err(ScheduleError::NoAllowedWorkers));
    }
}
