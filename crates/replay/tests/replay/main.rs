//! The replay: trace to requests, ideal caches, the report (summaries, goodput, kv against
//! round robin, the table and the JSON) and the runner through real replicas and a fleet.

mod report;
mod runner;
