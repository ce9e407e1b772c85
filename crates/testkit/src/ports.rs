//! Free loopback ports, for processes that cannot bind port 0 and report theirs.

use std::net::TcpListener;

/// A free loopback TCP port (0 if none could be had).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// The first of `n` consecutive free loopback TCP ports (engines offset their ZMQ ports by
/// data-parallel rank); 0 if none were found in 200 tries.
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let base = free_port();
        if base == 0 || base.checked_add(n).is_none() {
            continue;
        }
        let held: Vec<_> = (base..base + n)
            .map_while(|p| TcpListener::bind(("127.0.0.1", p)).ok())
            .collect();
        if held.len() == usize::from(n) {
            return base;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    /// The ports are free when found; another test running meanwhile may take one before
    /// this one binds it (they are released on return), so a few tries are allowed.
    #[test]
    fn consecutive_ports_are_free_together() {
        let bound = (0..5).any(|_| {
            let base = super::free_ports(4);
            assert_ne!(base, 0);
            (base..base + 4)
                .map(|p| std::net::TcpListener::bind(("127.0.0.1", p)))
                .collect::<Result<Vec<_>, _>>()
                .is_ok()
        });
        assert!(bound, "no run of 4 free ports in 5 tries");
    }
}
