//! The kvrouter frontend: OpenAI HTTP in front of the router. What a request means (model,
//! tokens, limits, keys, errors) is kvrouter-openai's; this crate is the door: HTTP in,
//! routing through the replicas, the engine's answer relayed back.

pub mod config;
mod frontend;
mod http;
pub mod metrics;
mod relay;
pub mod upstream;

pub use config::{FrontendConfig, RankConvention};
pub use frontend::Frontend;
pub use http::FrontendServer;
