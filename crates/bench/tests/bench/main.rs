//! The benchmarks' libraries: route latency.

mod route_latency;
