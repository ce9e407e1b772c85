//! What the worker tracker publishes about one model for readiness, metrics and endpoints,
//! read without an actor hop.

use crate::layouts::Layouts;
use kvrouter_protocol::WorkerKey;
use parking_lot::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// Counts the worker tracker publishes for readiness and the endpoints.
#[derive(Default)]
pub struct ModelStatus {
    /// 0 until the first worker registers (or `--block-size` sets it).
    pub block_size: AtomicU32,
    pub ranks: AtomicUsize,
    /// Ranks whose state is being fetched (first sync, or again after a gap).
    pub unsynced: AtomicUsize,
    /// Ranks in their first fetch that has not failed yet: readiness waits for these only.
    pub first_syncs: AtomicUsize,
    /// Ranks never synced whose fetches failed: left out of routing, reported in /readyz.
    pub unroutable: RwLock<Vec<WorkerKey>>,
    /// The first roll call ("who is there") has had time to be answered.
    pub discovered: AtomicBool,
    /// A serving indexer in approximate mode is loading a peer's entries (see
    /// `served_indexer::spawn_approx`): it must not answer from a half-loaded index.
    pub index_catching_up: AtomicBool,
    /// Each registered worker's role and data-parallel layout (disaggregation).
    pub layouts: Layouts,
    /// Workers registered (published by the worker tracker).
    pub workers: AtomicUsize,
    /// `--min-initial-workers`: the model is not ready before that many workers are known,
    /// until that happens once or the wait times out ([`ModelStatus::waive_min_workers`]).
    pub min_initial_workers: usize,
    pub min_workers_met: AtomicBool,
}

impl ModelStatus {
    pub fn block_size(&self) -> Option<u32> {
        match self.block_size.load(Ordering::Relaxed) {
            0 => None,
            b => Some(b),
        }
    }

    /// A status that waits for `min_initial_workers` workers before its first readiness.
    pub fn with_min_initial_workers(min_initial_workers: usize) -> Self {
        Self {
            min_initial_workers,
            ..Self::default()
        }
    }

    /// The `--min-initial-workers` timeout passed: ready without them. Returns how many
    /// workers were known if the wait was still on (for the warning).
    pub fn waive_min_workers(&self) -> Option<usize> {
        let was_met = self.min_workers_met.swap(true, Ordering::Relaxed);
        let known = self.workers.load(Ordering::Relaxed);
        (!was_met && known < self.min_initial_workers).then_some(known)
    }

    /// The workers discovery knows now. Reaching `min_initial_workers` once is enough:
    /// losing workers later does not take the replica out of service.
    pub fn set_workers(&self, workers: usize) {
        self.workers.store(workers, Ordering::Relaxed);
        if workers >= self.min_initial_workers {
            self.min_workers_met.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the model can route (and its index answer): the first roll call had its
    /// window, at least `min_initial_workers` workers were known once (or the wait timed
    /// out), no rank is in its first fetch, and any approximate index is loaded. A rank
    /// whose fetch failed does not count: it is left out of routing instead.
    pub fn ready(&self) -> Result<(), String> {
        if !self.discovered.load(Ordering::Relaxed) {
            return Err("discovering workers".into());
        }
        let known = self.workers.load(Ordering::Relaxed);
        if !self.min_workers_met.load(Ordering::Relaxed) && known < self.min_initial_workers {
            return Err(format!(
                "{known} of {} workers known (--min-initial-workers)",
                self.min_initial_workers
            ));
        }
        if self.index_catching_up.load(Ordering::Relaxed) {
            return Err("loading the approximate index from a peer".into());
        }
        let syncing = self.first_syncs.load(Ordering::Relaxed);
        if syncing > 0 {
            return Err(format!(
                "{syncing} of {} worker ranks still syncing",
                self.ranks.load(Ordering::Relaxed)
            ));
        }
        Ok(())
    }

    /// Ranks left out of routing, for `/readyz` (at most `max` named).
    pub fn unroutable_summary(&self, max: usize) -> Option<String> {
        let keys = self.unroutable.read();
        if keys.is_empty() {
            return None;
        }
        let named: Vec<String> = keys.iter().take(max).map(|k| k.to_string()).collect();
        let more = keys.len().saturating_sub(max);
        Some(format!(
            "{} rank(s) left out of routing, their state cannot be fetched: {}{}",
            keys.len(),
            named.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_follows_discovery_and_first_syncs_only() {
        let st = ModelStatus::default();
        assert!(st.ready().is_err());
        st.discovered.store(true, Ordering::Relaxed);
        assert!(st.ready().is_ok());
        st.ranks.store(2, Ordering::Relaxed);
        st.first_syncs.store(1, Ordering::Relaxed);
        assert_eq!(st.ready().unwrap_err(), "1 of 2 worker ranks still syncing");
        st.first_syncs.store(0, Ordering::Relaxed);
        // A rank refetching after a gap, or one that cannot be synced, does not hold it.
        st.unsynced.store(1, Ordering::Relaxed);
        *st.unroutable.write() = vec![WorkerKey::new(7, 0)];
        assert!(st.ready().is_ok());
        assert!(st.unroutable_summary(5).unwrap().contains("1 rank(s)"));
        st.index_catching_up.store(true, Ordering::Relaxed);
        assert!(st.ready().unwrap_err().contains("approximate index"));
    }

    #[test]
    fn min_initial_workers_holds_readiness_once() {
        let st = ModelStatus::with_min_initial_workers(2);
        st.discovered.store(true, Ordering::Relaxed);
        st.set_workers(1);
        assert_eq!(
            st.ready().unwrap_err(),
            "1 of 2 workers known (--min-initial-workers)"
        );
        st.set_workers(2);
        assert!(st.ready().is_ok());
        st.set_workers(0);
        assert!(st.ready().is_ok(), "only the initial count holds it");
        assert_eq!(
            st.waive_min_workers(),
            None,
            "met already: nothing to warn of"
        );

        let timed_out = ModelStatus::with_min_initial_workers(3);
        timed_out.discovered.store(true, Ordering::Relaxed);
        timed_out.set_workers(1);
        assert!(timed_out.ready().is_err());
        assert_eq!(timed_out.waive_min_workers(), Some(1));
        assert!(timed_out.ready().is_ok());
        assert_eq!(timed_out.waive_min_workers(), None, "warned once");
    }
}
