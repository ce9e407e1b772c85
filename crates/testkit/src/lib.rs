//! The test kit: what tests and the benches need to drive real processes. A real
//! nats-server on a loopback port ([`NatsServer`]), Envoy as an inference gateway
//! ([`EnvoyGateway`]), child processes stopped by PID ([`Proc`]), free ports, blocking HTTP
//! probes, Prometheus text sums, an OTLP traces receiver ([`OtlpReceiver`]), throwaway certificates for TLS tests ([`TestCerts`]), and a
//! counting global allocator for tests that bound what a decoder allocates
//! ([`CountingAlloc`]). Blocking on purpose: tests call it from plain
//! threads, async callers from `spawn_blocking`.
//!
//! Nothing here knows kvrouter's command line; the suites that start `kvrouter` build the
//! command themselves (the binary's path is only known to the package that owns it).

mod alloc;
mod envoy;
mod http;
mod metrics;
mod nats;
mod otlp;
mod ports;
mod proc;
mod tls;

pub use alloc::{allocated_bytes, allocated_during, CountingAlloc};
pub use envoy::{EnvoyError, EnvoyGateway};
pub use http::{dechunk, http_get, http_post};
pub use metrics::{metric_sum_in, metric_where_in};
pub use nats::{NatsError, NatsServer};
pub use otlp::{decode_traces, OtlpReceiver, ReceivedSpan};
pub use ports::{free_port, free_ports};
pub use proc::Proc;
pub use tls::TestCerts;

use std::time::{Duration, Instant};

/// Polls `f` every 50 ms until it returns true or `timeout` passes; returns the last answer.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
