//! The benchmarks' libraries: the replay runner and report, route latency.

mod replay_report;
mod replay_runner;
mod route_latency;
