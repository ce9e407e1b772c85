//! Identifiers and KV events, as they travel on the bus.

use serde::{Deserialize, Serialize};
use std::fmt;

/// One engine instance (a worker process serving one model in one role).
pub type WorkerId = u64;
/// A data-parallel rank inside a worker; each rank has its own KV cache.
pub type DpRank = u32;
/// Per-(worker instance, rank) event counter: starts at 0 and grows by one.
pub type EventId = u64;

/// The unit the indexer and the scheduler score: one rank of one worker.
#[derive(
    Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct WorkerKey {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl WorkerKey {
    pub const fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

macro_rules! hash_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:#018x})", stringify!($name), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#018x}", self.0)
            }
        }
    };
}

hash_newtype!(
    /// XXH3-64 of one block's tokens: what the router matches requests by.
    LocalBlockHash
);
hash_newtype!(
    /// Rolling hash naming a whole prefix of blocks (Dynamo's chain).
    SequenceHash
);
hash_newtype!(
    /// The id an engine gives a cached block. Opaque to the router: it only links a
    /// stored block to its parent and names blocks in `Removed`.
    EngineBlockHash
);

/// One block of a `Stored` event.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    pub engine_hash: EngineBlockHash,
    pub local_hash: LocalBlockHash,
}

/// What happened to a worker rank's KV cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEventData {
    /// A chain of blocks was cached: `blocks[0]` extends `parent` (or starts a prompt when
    /// `parent` is `None`), each later block extends the one before it.
    Stored {
        parent: Option<EngineBlockHash>,
        blocks: Vec<StoredBlock>,
    },
    /// Blocks were evicted.
    Removed { engine_hashes: Vec<EngineBlockHash> },
    /// The rank dropped its whole cache.
    Cleared,
}

/// Where a worker keeps a cached block. A hit in a lower tier costs a transfer, not a
/// prefill, and earns less credit (see docs/architecture.md, "Tiers").
#[derive(
    Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Tier {
    /// The engine's GPU memory.
    #[default]
    Device,
    /// The worker's host (CPU) memory.
    Host,
    /// The worker's local disk.
    Disk,
    /// Storage outside the worker that every worker of the model can load from. Belongs to
    /// no worker: the router keeps such a block once per model and credits every worker.
    Shared,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::Shared];

    pub const fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Shared => "shared",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An overlap split by tier: the device prefix, then how far each lower tier extends it
/// (blocks held at or above that tier, beyond what the tiers above already counted).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TierBlocks {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    pub shared: u32,
}

impl TierBlocks {
    /// An overlap all on the device.
    pub const fn on_device(blocks: u32) -> Self {
        Self {
            device: blocks,
            host: 0,
            disk: 0,
            shared: 0,
        }
    }

    /// Leading blocks held in any tier.
    pub fn total(&self) -> u32 {
        self.device + self.host + self.disk + self.shared
    }

    /// Blocks held below the device.
    pub fn lower(&self) -> u32 {
        self.host + self.disk + self.shared
    }

    pub fn get(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Device => self.device,
            Tier::Host => self.host,
            Tier::Disk => self.disk,
            Tier::Shared => self.shared,
        }
    }
}

/// A KV event from one worker rank. `tier` says where the blocks of a `Stored` or `Removed`
/// are; a `Cleared` clears every tier of the rank (shared storage belongs to no rank and
/// stays).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    pub key: WorkerKey,
    pub event_id: EventId,
    /// New in format version 4.
    pub tier: Tier,
    pub data: KvEventData,
}

impl KvEvent {
    /// Number of blocks the event stores or removes (0 for `Cleared`).
    pub fn block_count(&self) -> usize {
        match &self.data {
            KvEventData::Stored { blocks, .. } => blocks.len(),
            KvEventData::Removed { engine_hashes } => engine_hashes.len(),
            KvEventData::Cleared => 0,
        }
    }
}

/// Extra keys a prompt's cached blocks depend on besides their tokens, as the engine keys
/// them: multimodal identifiers per block, a cache salt. A block with extras matches only
/// blocks cached with the same extras (see [`crate::prompt_local_hashes`] and
/// docs/protocol.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptExtras {
    /// Per block, in order, its extra keys as strings; blocks past the end have none.
    pub block_extras: Vec<Vec<String>>,
    /// The request's cache salt: an extra key of block 0, after that block's others.
    pub cache_salt: Option<String>,
}
