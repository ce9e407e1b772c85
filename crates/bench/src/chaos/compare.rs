//! The differential check, plain: what a replica's index holds for a worker rank against
//! what the worker really caches, both as sets of prefixes (sequence hashes), so caches that
//! name blocks differently still compare equal when they hold the same prefixes.

use kvrouter_protocol::hashing::stored_sequence_hashes;
use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, SequenceHash, StoredBlock, Tier,
    WorkerKey,
};
use serde::Serialize;
use std::collections::BTreeSet;

/// A cache as the prefixes it holds.
pub type Prefixes = BTreeSet<SequenceHash>;

/// The prefixes a worker's state answer (its events) holds.
pub fn truth_prefixes(events: &[KvEvent]) -> Prefixes {
    stored_sequence_hashes(events).into_iter().collect()
}

/// The prefixes of a replica's `/debug/rank` answer: `{"blocks": [[engine_hash,
/// parent_engine_hash, local_hash, tier], ...]}`. `None` when the body is not that shape.
pub fn index_prefixes(body: &str, key: WorkerKey) -> Option<Prefixes> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let blocks = v.get("blocks")?.as_array()?;
    let mut events = Vec::with_capacity(blocks.len());
    for b in blocks {
        let engine = b.get(0)?.as_u64()?;
        let parent = match b.get(1)? {
            serde_json::Value::Null => None,
            p => Some(EngineBlockHash(p.as_u64()?)),
        };
        let local = b.get(2)?.as_u64()?;
        events.push(KvEvent {
            key,
            event_id: 0,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent,
                blocks: vec![StoredBlock {
                    engine_hash: EngineBlockHash(engine),
                    local_hash: LocalBlockHash(local),
                }],
            },
        });
    }
    Some(stored_sequence_hashes(&events).into_iter().collect())
}

/// How one replica's index of one rank differs from the truth.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// Prefixes the worker holds that the index lacks.
    pub missing: usize,
    /// Prefixes the index holds that the worker does not.
    pub extra: usize,
}

impl Divergence {
    pub fn of(truth: &Prefixes, index: &Prefixes) -> Self {
        Self {
            missing: truth.difference(index).count(),
            extra: index.difference(truth).count(),
        }
    }

    pub fn total(&self) -> usize {
        self.missing + self.extra
    }

    pub fn is_zero(&self) -> bool {
        self.total() == 0
    }
}

/// One comparison of the whole fleet: per (replica, rank) divergence, plus each replica's
/// active requests and blocks (which must be 0 when nothing is in flight).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FleetDiff {
    /// (replica, worker key, divergence) for every pair that differs.
    pub ranks: Vec<(String, WorkerKey, Divergence)>,
    /// (replica, active requests, active blocks) for every replica with any.
    pub active: Vec<(String, u64, u64)>,
    /// Things that could not be compared (a replica or worker that did not answer).
    pub unreachable: Vec<String>,
    /// Prefixes of the truth compared, summed over replicas (shows the check is not empty).
    pub prefixes_checked: usize,
    /// Of them, the prefixes of the bridged engines' workers.
    pub engine_prefixes_checked: usize,
}

impl FleetDiff {
    pub fn add_rank(&mut self, replica: &str, key: WorkerKey, truth: &Prefixes, index: &Prefixes) {
        let d = Divergence::of(truth, index);
        if !d.is_zero() {
            self.ranks.push((replica.to_string(), key, d));
        }
    }

    pub fn add_active(&mut self, replica: &str, requests: u64, blocks: u64) {
        if requests > 0 || blocks > 0 {
            self.active.push((replica.to_string(), requests, blocks));
        }
    }

    /// Differing prefixes, summed, plus active requests left over, plus what could not be
    /// compared: 0 when the fleet agrees with the truth.
    pub fn total(&self) -> usize {
        self.ranks.iter().map(|r| r.2.total()).sum::<usize>()
            + self.active.iter().map(|a| a.1 as usize).sum::<usize>()
            + self.unreachable.len()
    }

    pub fn is_zero(&self) -> bool {
        self.total() == 0
    }

    /// One line for an operator.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (r, k, d) in &self.ranks {
            parts.push(format!(
                "{r}: worker {} rank {} missing {} extra {}",
                k.worker_id, k.dp_rank, d.missing, d.extra
            ));
        }
        for (r, req, blocks) in &self.active {
            parts.push(format!(
                "{r}: {req} active requests, {blocks} active blocks"
            ));
        }
        for u in &self.unreachable {
            parts.push(format!("unreachable: {u}"));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("; ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::hashing::chain_sequence_hash;

    fn key() -> WorkerKey {
        WorkerKey::new(7, 1)
    }

    fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEvent {
        KvEvent {
            key: key(),
            event_id: 0,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: parent.map(EngineBlockHash),
                blocks: blocks
                    .iter()
                    .map(|&(e, l)| StoredBlock {
                        engine_hash: EngineBlockHash(e),
                        local_hash: LocalBlockHash(l),
                    })
                    .collect(),
            },
        }
    }

    #[test]
    fn an_index_dump_equal_to_the_state_has_no_divergence() {
        let truth = truth_prefixes(&[
            stored(None, &[(1, 10), (2, 20)]),
            stored(Some(1), &[(3, 30)]),
        ]);
        // The replica names the same blocks with other engine hashes: still equal.
        let body = r#"{"last_event_id": 4, "blocks": [[91, null, 10, "device"], [92, 91, 20, "device"], [93, 91, 30, "device"]]}"#;
        let index = index_prefixes(body, key()).unwrap();
        assert_eq!(index.len(), 3);
        assert!(Divergence::of(&truth, &index).is_zero());
        let s0 = SequenceHash(10);
        assert!(index.contains(&s0));
        assert!(index.contains(&chain_sequence_hash(s0, LocalBlockHash(30))));
    }

    #[test]
    fn missing_and_extra_prefixes_are_counted() {
        let truth = truth_prefixes(&[stored(None, &[(1, 10), (2, 20), (3, 30)])]);
        let body = r#"{"blocks": [[1, null, 10, "device"], [5, 1, 50, "device"]]}"#;
        let index = index_prefixes(body, key()).unwrap();
        let d = Divergence::of(&truth, &index);
        assert_eq!(
            d,
            Divergence {
                missing: 2,
                extra: 1
            }
        );
        assert_eq!(d.total(), 3);
        let empty = index_prefixes(r#"{"last_event_id": null, "blocks": []}"#, key()).unwrap();
        assert_eq!(Divergence::of(&truth, &empty).missing, 3);
    }

    #[test]
    fn a_malformed_body_is_none() {
        assert!(index_prefixes("not json", key()).is_none());
        assert!(index_prefixes(r#"{"error": "unknown model"}"#, key()).is_none());
        assert!(index_prefixes(r#"{"blocks": [["x"]]}"#, key()).is_none());
    }

    #[test]
    fn a_fleet_diff_sums_ranks_active_requests_and_unreachable() {
        let mut f = FleetDiff::default();
        let t: Prefixes = [SequenceHash(1), SequenceHash(2)].into_iter().collect();
        f.add_rank("a", key(), &t, &t);
        f.add_active("a", 0, 0);
        assert!(f.is_zero());
        assert_eq!(f.describe(), "none");
        f.add_rank("b", key(), &t, &Prefixes::new());
        f.add_active("c", 2, 8);
        f.unreachable.push("worker 7".into());
        assert_eq!(f.total(), 2 + 2 + 1);
        assert!(f
            .describe()
            .contains("b: worker 7 rank 1 missing 2 extra 0"));
    }
}
