//! The bus against a real nats-server and in-process: one conformance suite, bounded work.

mod bounded;
mod conformance;
mod nkey;
