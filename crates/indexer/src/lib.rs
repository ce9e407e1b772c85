//! The KV block index: for a prompt's blocks, how many leading ones each worker rank holds.
//!
//! - [`Index`]: the synchronous core (events in, overlaps out), no I/O.
//! - [`ApproxTracker`]: approximate mode, feeding the index from routing decisions.
//! - [`ShardedIndex`]: shard actors that own cores, with a lock-light shared read path.

pub mod approx;
pub mod error;
pub mod index;
pub mod overlap;
pub mod prefix;
pub mod sharded;
mod table_alloc;

pub use approx::{ApproxConfig, ApproxTracker, Imported};
pub use error::IndexError;
pub use index::{block_limit_for_capacity, Applied, Index, IndexCounters, IndexStats, RankDump};
pub use overlap::OverlapScores;
pub use sharded::{IndexReader, ShardError, ShardMsg, ShardedIndex, ShardedIndexConfig};
