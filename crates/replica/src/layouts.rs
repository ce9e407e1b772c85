//! Each registered worker's role and data-parallel layout, and the rules that pick
//! candidates from them: which workers an aggregated route may use, and which decode rank a
//! prefill rank hands over to. Written by the worker tracker, read by the endpoints.

use kvrouter_protocol::{DpRank, EngineKind, Registration, WorkerId, WorkerKey, WorkerRole};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// A worker's role and data-parallel layout, from its registration.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WorkerLayout {
    pub role: WorkerRole,
    pub dp_start_rank: DpRank,
    pub dp_size: u32,
    pub tp_size: u32,
    pub engine: EngineKind,
}

impl WorkerLayout {
    pub fn of(reg: &Registration) -> Self {
        Self {
            role: reg.role,
            dp_start_rank: reg.dp_start_rank,
            dp_size: reg.dp_size,
            tp_size: reg.tp_size,
            engine: reg.engine,
        }
    }
}

/// Every registered worker's layout and HTTP address (one model).
#[derive(Default)]
pub struct Layouts(RwLock<FxHashMap<WorkerId, (WorkerLayout, Arc<str>)>>);

impl Layouts {
    pub fn set(&self, worker_id: WorkerId, layout: WorkerLayout, base_url: &str) {
        let mut map = self.0.write();
        match map.get_mut(&worker_id) {
            // Re-registrations repeat the address: keep the allocation.
            Some(entry) if &*entry.1 == base_url => entry.0 = layout,
            _ => {
                map.insert(worker_id, (layout, base_url.into()));
            }
        }
    }

    pub fn remove(&self, worker_id: WorkerId) {
        self.0.write().remove(&worker_id);
    }

    pub fn get(&self, worker_id: WorkerId) -> Option<WorkerLayout> {
        self.0.read().get(&worker_id).map(|e| e.0)
    }

    /// Every registered worker with its layout and HTTP address, by worker id.
    pub fn all(&self) -> Vec<(WorkerId, WorkerLayout, String)> {
        let mut out: Vec<_> = (self.0.read().iter())
            .map(|(&w, (l, url))| (w, *l, url.to_string()))
            .collect();
        out.sort_unstable_by_key(|e| e.0);
        out
    }

    /// Where a worker takes HTTP requests (empty when unknown or it has no address).
    pub fn base_url(&self, worker_id: WorkerId) -> String {
        self.0
            .read()
            .get(&worker_id)
            .map(|e| e.1.to_string())
            .unwrap_or_default()
    }

    /// Whether `key` is a rank of a registered worker (within its data-parallel ranks).
    pub fn has_rank(&self, key: WorkerKey) -> bool {
        self.get(key.worker_id).is_some_and(|l| {
            (l.dp_start_rank..l.dp_start_rank.saturating_add(l.dp_size)).contains(&key.dp_rank)
        })
    }

    /// Workers of a role, sorted, that `allowed` (if any) lists.
    pub fn workers_with(&self, role: WorkerRole, allowed: Option<&[WorkerId]>) -> Vec<WorkerId> {
        let mut out: Vec<WorkerId> = self
            .0
            .read()
            .iter()
            .filter(|(w, (l, _))| l.role == role && allowed.is_none_or(|a| a.contains(w)))
            .map(|(&w, _)| w)
            .collect();
        out.sort_unstable();
        out
    }

    /// (workers of role `role`, workers of any other role).
    fn role_counts(&self, role: WorkerRole) -> (usize, usize) {
        let map = self.0.read();
        let n = map.values().filter(|(l, _)| l.role == role).count();
        (n, map.len() - n)
    }
}

/// The workers an aggregated `route` may use: unchanged when it pins a worker or when the
/// model's workers are all of one kind; otherwise its aggregated workers (within
/// `allowed`). A model with no aggregated worker routes over all of them.
pub fn aggregated_workers(
    layouts: &Layouts,
    allowed: Option<Vec<WorkerId>>,
    pinned: bool,
) -> Option<Vec<WorkerId>> {
    if pinned {
        return allowed;
    }
    match layouts.role_counts(WorkerRole::Aggregated) {
        (agg, others) if agg > 0 && others > 0 => {
            Some(layouts.workers_with(WorkerRole::Aggregated, allowed.as_deref()))
        }
        _ => allowed,
    }
}

/// The decode rank for a prefill on `prefill_rank` of a worker starting at
/// `prefill_start`: the decode worker's `decode_start + (offset mod decode_size)`.
pub fn decode_rank(
    prefill_rank: DpRank,
    prefill_start: DpRank,
    decode_start: DpRank,
    decode_size: u32,
) -> DpRank {
    let offset = prefill_rank.saturating_sub(prefill_start);
    decode_start.saturating_add(offset % decode_size.max(1))
}

/// One key per decode worker (within `allowed`): the rank the prefill's offset maps to.
pub fn decode_candidates(
    layouts: &Layouts,
    prefill: WorkerKey,
    prefill_layout: WorkerLayout,
    allowed: Option<&[WorkerId]>,
) -> Vec<WorkerKey> {
    let map = layouts.0.read();
    let mut out: Vec<WorkerKey> = map
        .iter()
        .filter(|(w, (l, _))| l.role == WorkerRole::Decode && allowed.is_none_or(|a| a.contains(w)))
        .map(|(&w, (l, _))| {
            WorkerKey::new(
                w,
                decode_rank(
                    prefill.dp_rank,
                    prefill_layout.dp_start_rank,
                    l.dp_start_rank,
                    l.dp_size,
                ),
            )
        })
        .collect();
    out.sort_unstable_by_key(|k| (k.worker_id, k.dp_rank));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(role: WorkerRole, start: u32, size: u32) -> WorkerLayout {
        WorkerLayout {
            role,
            dp_start_rank: start,
            dp_size: size,
            tp_size: 1,
            engine: EngineKind::Mocker,
        }
    }

    #[test]
    fn decode_rank_carries_the_prefill_offset() {
        // Prefill ranks 2..4, decode ranks 0..4: offsets 0, 1.
        assert_eq!(decode_rank(2, 2, 0, 4), 0);
        assert_eq!(decode_rank(3, 2, 0, 4), 1);
        // Offset modulo the decode worker's dp size.
        assert_eq!(decode_rank(7, 2, 10, 2), 11);
        assert_eq!(decode_rank(6, 2, 10, 2), 10);
        assert_eq!(decode_rank(0, 0, 5, 1), 5);
    }

    #[test]
    fn candidates_and_aggregated_filter() {
        let l = Layouts::default();
        l.set(1, layout(WorkerRole::Prefill, 2, 2), "");
        l.set(2, layout(WorkerRole::Decode, 0, 4), "");
        l.set(3, layout(WorkerRole::Decode, 8, 1), "");
        let pre = WorkerKey::new(1, 3);
        assert_eq!(
            decode_candidates(&l, pre, l.get(1).unwrap(), None),
            vec![WorkerKey::new(2, 1), WorkerKey::new(3, 8)]
        );
        assert_eq!(
            decode_candidates(&l, pre, l.get(1).unwrap(), Some(&[1, 3])),
            vec![WorkerKey::new(3, 8)]
        );
        // No aggregated worker: aggregated routes keep every worker.
        assert_eq!(aggregated_workers(&l, None, false), None);
        l.set(4, layout(WorkerRole::Aggregated, 0, 1), "");
        assert_eq!(aggregated_workers(&l, None, false), Some(vec![4]));
        assert_eq!(aggregated_workers(&l, Some(vec![1]), false), Some(vec![]));
        assert_eq!(aggregated_workers(&l, Some(vec![1]), true), Some(vec![1]));
        assert_eq!(l.workers_with(WorkerRole::Decode, Some(&[2, 4])), vec![2]);
        l.remove(2);
        assert_eq!(l.workers_with(WorkerRole::Decode, None), vec![3]);
        let all: Vec<WorkerId> = l.all().iter().map(|e| e.0).collect();
        assert_eq!(all, vec![1, 3, 4]);
    }
}
