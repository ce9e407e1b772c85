//! Wire types, codec, subjects and block hashing shared by every kvrouter component.
//!
//! - [`types`]: worker keys, block hashes and KV events.
//! - [`messages`]: what workers, replicas and clients send each other.
//! - [`subjects`]: where on the bus each message travels.
//! - [`codec`]: bincode 2 behind a one-byte format version, safe on untrusted bytes.
//! - [`wire`]: the [`Wire`] trait: a message's current and previous-version shapes.
//! - [`v7`]: the frozen version-7 shapes of the types version 8 changed.
//! - [`lease`]: route leases, what a route answer grants its caller.
//! - [`limits`]: how large a caller's input may be, and the checks ([`LimitError`]).
//! - [`chunk`]: splitting lists into messages under a byte budget.
//! - [`hashing`]: Dynamo-compatible local block hashes and sequence hashes.
//! - [`trace_context`]: W3C `traceparent`, parsed strictly.

pub mod chunk;
pub mod codec;
pub mod hashing;
pub mod lease;
pub mod limits;
pub mod messages;
pub mod subjects;
pub mod trace_context;
pub mod types;
pub mod v7;
pub mod wire;

pub use chunk::chunk_by_budget;
pub use codec::{
    decode, decode_versioned, encode, encode_as, encoded_len, reply_version, set_write_version,
    write_version, CodecError, FORMAT_VERSION, MAX_MESSAGE_BYTES, MIN_READ_VERSION,
};
pub use hashing::{
    block_extra_keys, local_block_hash_with_extras, local_block_hashes, lora_seed,
    prompt_local_hashes, sequence_hashes, HashError, BASE_SEED,
};
pub use lease::{Lease, LeaseParseError};
pub use limits::{check_request_id, check_tracked_request_id, LimitError};
pub use messages::*;
pub use subjects::{
    fleet_subjects, model_token, ModelSubjects, SubjectError, Subjects, WorkerSubject,
};
pub use trace_context::{TraceContext, TraceParentError, TRACEPARENT};
pub use types::*;
pub use wire::Wire;

/// Unit tests measure what decoding allocates (see `codec`'s tests).
#[cfg(test)]
#[global_allocator]
static ALLOC: kvrouter_testkit::CountingAlloc = kvrouter_testkit::CountingAlloc;
