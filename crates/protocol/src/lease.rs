//! Route leases: what a route answer grants its caller. A route that books load
//! (`update_states`) is held under a lease, 128 random bits its caller chose; only a holder of
//! the lease may mark the request's prefill done, add its output blocks, free or abandon it.
//! The request id alone (often guessable: a client's `x-request-id`) no longer suffices.

use serde::{Deserialize, Serialize};
use thiserror::Error;
use uuid::Uuid;

/// A route lease. [`Lease::NONE`] stands for no lease: what a previous-version peer sends
/// (it knows none), and a booking made without one (which any caller may then end, as
/// before leases existed; replicas refuse such bookings unless allowed).
#[derive(Copy, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Lease(u128);

#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("a lease is 32 hexadecimal digits, got {0} characters")]
pub struct LeaseParseError(pub usize);

impl Lease {
    pub const NONE: Lease = Lease(0);

    /// A fresh lease from the operating system's random source (a version-4 UUID: 122
    /// random bits, never zero).
    pub fn random() -> Self {
        Self(Uuid::new_v4().as_u128())
    }

    /// A lease of the caller's own making (128 random bits, or a test's fixed value).
    pub const fn from_bits(bits: u128) -> Self {
        Self(bits)
    }

    pub fn is_none(self) -> bool {
        self == Self::NONE
    }

    /// Whether a caller presenting `presented` may act on a booking held under `self`: the
    /// same lease, or a booking without one.
    pub fn admits(self, presented: Lease) -> bool {
        self.is_none() || self == presented
    }

    /// 32 lower-case hexadecimal digits (the JSON API's form).
    pub fn to_hex(self) -> String {
        format!("{:032x}", self.0)
    }

    /// The JSON API's form back: exactly 32 hexadecimal digits.
    pub fn parse_hex(s: &str) -> Result<Self, LeaseParseError> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(LeaseParseError(s.chars().count()));
        }
        u128::from_str_radix(s, 16)
            .map(Self)
            .map_err(|_| LeaseParseError(s.len()))
    }
}

/// A lease is a credential: logs and debug output never show it.
impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_none() {
            f.write_str("Lease(none)")
        } else {
            f.write_str("Lease(***)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_leases_differ_and_are_never_none() {
        let a = Lease::random();
        let b = Lease::random();
        assert_ne!(a, b);
        assert!(!a.is_none() && !b.is_none());
    }

    #[test]
    fn a_lease_admits_itself_only_and_none_admits_all() {
        let (a, b) = (Lease::random(), Lease::random());
        assert!(a.admits(a));
        assert!(!a.admits(b));
        assert!(!a.admits(Lease::NONE));
        assert!(Lease::NONE.admits(a));
        assert!(Lease::NONE.admits(Lease::NONE));
    }

    #[test]
    fn hex_round_trips_and_refuses_anything_else() {
        let a = Lease::random();
        assert_eq!(Lease::parse_hex(&a.to_hex()), Ok(a));
        assert_eq!(a.to_hex().len(), 32);
        assert_eq!(Lease::parse_hex(&a.to_hex().to_uppercase()), Ok(a));
        for bad in [
            "",
            "abc",
            &"g".repeat(32),
            &"0".repeat(33),
            "+0000000000000000000000000000001",
        ] {
            assert!(Lease::parse_hex(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn debug_hides_the_lease() {
        let a = Lease::random();
        assert_eq!(format!("{a:?}"), "Lease(***)");
        assert!(!format!("{a:?}").contains(&a.to_hex()));
    }
}
