//! Benchmarks: Mooncake traces, the indexer event stream and its measurement.

pub mod indexer_bench;
pub mod indexer_stream;
pub mod stream_file;
pub mod trace;
