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
}

impl ModelStatus {
    pub fn block_size(&self) -> Option<u32> {
        match self.block_size.load(Ordering::Relaxed) {
            0 => None,
            b => Some(b),
        }
    }

    /// Whether the model can route (and its index answer): the first roll call had its
    /// window, no rank is in its first fetch, and any approximate index is loaded. A rank
    /// whose fetch failed does not count: it is left out of routing instead.
    pub fn ready(&self) -> Result<(), String> {
        if !self.discovered.load(Ordering::Relaxed) {
            return Err("discovering workers".into());
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
}
