//! The runtime's clock as a std `Instant`: the same as `Instant::now()` in production, and
//! under tokio's paused clock (the replay, tests) it follows virtual time, so windows,
//! timeouts and cooldowns do not depend on how fast the machine runs.

use std::time::Instant;

pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}
