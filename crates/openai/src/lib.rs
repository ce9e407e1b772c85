//! The OpenAI request as kvrouter understands it, whichever door it comes through (the
//! HTTP frontend, a gateway's endpoint picker).
//!
//! Its cores are the model directory ([`model_dir`]), the tokenizer ([`tokenizer`]) and the
//! chat template ([`chat_template`]): plain, I/O-free after loading, and rendering and
//! tokenizing exactly as the engine does, so the router sees the token blocks the engine
//! will cache. Above them: the request parsed and checked ([`request`], [`body`]), the
//! callers' API keys and grants ([`auth`]), what a request asks of the models served
//! ([`models`]), errors and answers as OpenAI clients read them ([`error`], [`response`],
//! [`sse`]), and what every door measures ([`door_metrics`]). Plain data, no I/O.

pub mod chat_template;
pub mod model_dir;
pub mod tokenizer;

pub mod auth;
pub mod body;
pub mod door_metrics;
pub mod error;
pub mod models;
pub mod request;
pub mod response;
pub mod sse;

/// Unit tests measure what parsing allocates (see `request`'s tests).
#[cfg(test)]
#[global_allocator]
static ALLOC: kvrouter_testkit::CountingAlloc = kvrouter_testkit::CountingAlloc;

pub use auth::{Access, ApiKeys, Grants, KeyError, KeysError};
pub use chat_template::{ChatInput, ChatTemplate, ChatTemplateError};
pub use door_metrics::{DoorClock, DoorPhase};
pub use error::ApiError;
pub use model_dir::{ModelDirError, ModelFiles, PromptLimit, PromptLimitSource};
pub use models::{Models, RankConvention, Understood, UNKNOWN_MODEL_LABEL};
pub use request::{parse, ClientRequest, Conversation, Endpoint, Input, Prompt, RouterExt};
pub use response::{read_chunk, Chunk, ChunkShaper, Gathered};
pub use tokenizer::{Tokenizer, TokenizerError};
