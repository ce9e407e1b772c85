//! The kvrouter frontend: OpenAI HTTP in front of the router.
//!
//! This crate's cores are the model directory ([`model_dir`]), the tokenizer
//! ([`tokenizer`]) and the chat template ([`chat_template`]): plain, I/O-free after loading,
//! and rendering and tokenizing exactly as the engine behind the frontend does, so the
//! router sees the token blocks the engine will cache.

pub mod chat_template;
pub mod model_dir;
pub mod tokenizer;

// The HTTP side: OpenAI requests in, routed through the replicas, answered by the engines.
pub mod auth;
pub mod config;
mod frontend;
mod http;
pub mod metrics;
pub mod openai;
mod relay;
pub mod route_lease;
pub mod sse;
pub mod upstream;

/// Unit tests measure what parsing allocates (see `openai::request`'s tests).
#[cfg(test)]
#[global_allocator]
static ALLOC: kvrouter_testkit::CountingAlloc = kvrouter_testkit::CountingAlloc;

pub use auth::{Access, ApiKeys, Grants, KeyError, KeysError};
pub use config::{FrontendConfig, RankConvention};
pub use frontend::Frontend;
pub use http::FrontendServer;

pub use chat_template::{ChatInput, ChatTemplate, ChatTemplateError};
pub use model_dir::{ModelDirError, ModelFiles, PromptLimit, PromptLimitSource};
pub use tokenizer::{Tokenizer, TokenizerError};
