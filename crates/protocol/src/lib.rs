//! Wire types, codec, subjects and block hashing shared by every kvrouter component.
//!
//! - [`types`]: worker keys, block hashes and KV events.
//! - [`messages`]: what workers, replicas and clients send each other.
//! - [`subjects`]: where on the bus each message travels.
//! - [`codec`]: bincode 2 behind a one-byte format version, safe on untrusted bytes.
//! - [`hashing`]: Dynamo-compatible local block hashes and sequence hashes.

pub mod codec;
pub mod hashing;
pub mod messages;
pub mod subjects;
pub mod types;

pub use codec::{decode, encode, CodecError, FORMAT_VERSION, MAX_MESSAGE_BYTES};
pub use hashing::{local_block_hashes, lora_seed, sequence_hashes, HashError, BASE_SEED};
pub use messages::*;
pub use subjects::{fleet_subjects, model_token, ModelSubjects, SubjectError, Subjects};
pub use types::*;
