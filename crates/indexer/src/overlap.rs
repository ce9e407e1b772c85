use kvrouter_protocol::WorkerKey;

/// How many leading blocks of a query each worker key holds; keys holding none are absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub scores: Vec<(WorkerKey, u32)>,
}

impl OverlapScores {
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
        self
    }
}
