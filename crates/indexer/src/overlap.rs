use kvrouter_protocol::{TierBlocks, WorkerKey};

/// How many leading blocks of a query each worker key holds; keys holding none are absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// Device overlaps.
    pub scores: Vec<(WorkerKey, u32)>,
    /// Keys whose overlap a lower tier extends, split by tier.
    pub tiers: Vec<(WorkerKey, TierBlocks)>,
    /// The shared-storage overlap of a key in neither list (it holds no leading block).
    pub shared_blocks: u32,
}

impl OverlapScores {
    /// A key's overlap by tier.
    pub fn tier_blocks(&self, key: WorkerKey) -> TierBlocks {
        if let Some((_, t)) = self.tiers.iter().find(|(k, _)| *k == key) {
            return *t;
        }
        match self.get(key) {
            0 => TierBlocks {
                shared: self.shared_blocks,
                ..TierBlocks::default()
            },
            device => TierBlocks {
                device,
                ..TierBlocks::default()
            },
        }
    }

    /// No key holds any leading block in any tier.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty() && !self.has_lower_tiers()
    }

    /// Whether any lower tier adds to any key's overlap.
    pub fn has_lower_tiers(&self) -> bool {
        !self.tiers.is_empty() || self.shared_blocks > 0
    }

    pub fn get(&self, key: WorkerKey) -> u32 {
        self.scores
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, n)| *n)
    }

    /// The largest overlap of any worker key (0 when none matched).
    pub fn best(&self) -> u32 {
        self.scores.iter().map(|(_, n)| *n).max().unwrap_or(0)
    }

    /// Scores ordered by worker key, for comparisons.
    pub fn sorted(mut self) -> Self {
        self.scores.sort_unstable();
        self.tiers.sort_unstable_by_key(|(k, _)| *k);
        self
    }
}
