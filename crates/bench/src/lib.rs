//! Benchmarks: Mooncake traces, the indexer event stream and its measurement, and the trace
//! replay through router replicas and a mocker fleet.

pub mod indexer_bench;
pub mod indexer_stream;
pub mod replay;
pub mod stream_file;
pub mod trace;
