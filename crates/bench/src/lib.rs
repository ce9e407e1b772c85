//! Benchmarks: Mooncake traces (read, generated, described), the indexer event stream and its measurement, the trace
//! replay through router replicas and a mocker fleet, open-loop route latency against
//! running replicas, the bridge, what the frontend adds over calling an engine directly, and
//! what the endpoint picker adds behind Envoy.

pub mod bridge_bench;
pub mod chaos;
pub mod epp_bench;
pub mod frontend_bench;
pub mod hostile;
pub mod http_load;
pub mod indexer_bench;
pub mod indexer_experiment;
pub mod indexer_scale;
pub mod indexer_stream;
pub mod machine;
pub mod phase_ab;
pub mod plot;
pub mod radix_ruler;
pub mod route_latency;
pub mod stream_file;
pub mod trace_gen;
pub mod trace_stats;

// The trace format, the replay and the statistics live in kvrouter-replay (the demo needs
// them without the benches); re-exported so every bench names them the same way.
pub use kvrouter_replay::{stats, trace};
