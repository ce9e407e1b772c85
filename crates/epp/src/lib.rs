//! kvrouter as a Gateway API Inference Extension endpoint picker (`kvrouter epp`): Envoy's
//! external processor, asked per request which engine should serve it.

pub mod directory;
pub mod exchange;
pub mod ext_proc;
pub mod metrics;
pub mod picker;
pub mod server;
pub mod service;
pub mod tls_incoming;

pub use directory::{AtEndpoint, Directory};
pub use exchange::{Effect, Exchange, ExchangeError, Pick, RouteAsk};
pub use metrics::EppMetrics;
pub use picker::{Booking, Picker};
pub use server::{EppServer, GrpcLimits, Listeners};
pub use service::{ExchangeLimits, ExtProcService};
