//! The command line: each subcommand run as a user runs it (the real binary), its output,
//! exit codes and errors; the benchmark commands on small inputs.

#[path = "../common/mod.rs"]
mod common;

mod bench_indexer;
mod bridge;
mod chaos;
mod gen_trace;
mod hash;
mod hostile;
mod output;
mod replay;
mod subjects;
