//! The OpenAI API surface: requests in, errors and answers out. Plain data, no I/O.

pub mod body;
pub mod error;
pub mod request;
pub mod response;

pub use error::ApiError;
pub use request::{parse, ClientRequest, Conversation, Endpoint, Input, Prompt, RouterExt};
pub use response::{read_chunk, Chunk, ChunkShaper, Gathered};
