//! W3C trace context (`traceparent`): which distributed trace a request belongs to and its
//! parent span, as HTTP clients, gateways and the engines (vLLM and SGLang, with tracing on)
//! pass it on. Parsed strictly: a header that is not a valid version-00 `traceparent` is
//! dropped rather than passed on.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A `traceparent`'s trace, parent span and flags. On the wire (format version 8, a route
/// request's `trace`) the 16 trace-id bytes, the 8 parent-id bytes, then the flags byte.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    /// The caller's span: the parent of whatever the receiver does.
    pub parent_id: [u8; 8],
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
}

/// The header's name.
pub const TRACEPARENT: &str = "traceparent";

/// Why a `traceparent` value was not taken.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    #[error("traceparent must be 55 characters (00-<32 hex>-<16 hex>-<2 hex>)")]
    Length,
    #[error("traceparent is not lowercase hex fields separated by dashes")]
    Format,
    #[error("traceparent version {0:#04x} is not 00")]
    Version(u8),
    #[error("traceparent with an all-zero trace id or parent id")]
    ZeroId,
}

fn hex_into(s: &[u8], out: &mut [u8]) -> Result<(), TraceParentError> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(TraceParentError::Format),
    };
    for (i, o) in out.iter_mut().enumerate() {
        *o = digit(s[2 * i])? << 4 | digit(s[2 * i + 1])?;
    }
    Ok(())
}

impl TraceContext {
    /// The context, unless its trace id or parent id is all zero (which W3C forbids). A
    /// context from a peer's bytes is not checked by decoding: a receiver treats one this
    /// gives `None` for as no context at all, rather than failing the request.
    pub fn valid(self) -> Option<Self> {
        (self.trace_id != [0; 16] && self.parent_id != [0; 8]).then_some(self)
    }

    /// Parses a version-00 `traceparent` (surrounding whitespace allowed).
    pub fn parse(value: &str) -> Result<Self, TraceParentError> {
        let v = value.trim().as_bytes();
        if v.len() != 55 {
            return Err(TraceParentError::Length);
        }
        if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return Err(TraceParentError::Format);
        }
        let mut version = [0u8; 1];
        hex_into(&v[0..2], &mut version)?;
        if version[0] != 0 {
            return Err(TraceParentError::Version(version[0]));
        }
        let mut t = Self {
            trace_id: [0; 16],
            parent_id: [0; 8],
            flags: 0,
        };
        hex_into(&v[3..35], &mut t.trace_id)?;
        hex_into(&v[36..52], &mut t.parent_id)?;
        let mut flags = [0u8; 1];
        hex_into(&v[53..55], &mut flags)?;
        t.flags = flags[0];
        t.valid().ok_or(TraceParentError::ZeroId)
    }
}

/// The `traceparent` header value.
impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.parent_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specs_example_parses_and_prints_back() {
        let t = TraceContext::parse(EXAMPLE).unwrap();
        assert_eq!(t.trace_id[0], 0x4b);
        assert_eq!(t.parent_id[7], 0xb7);
        assert_eq!(t.flags, 1);
        assert_eq!(t.to_string(), EXAMPLE);
        assert_eq!(TraceContext::parse(&format!(" {EXAMPLE}\t")), Ok(t));
    }

    #[test]
    fn invalid_values_are_refused() {
        use TraceParentError::*;
        let bad = [
            ("", Length),
            (&EXAMPLE[..54], Length),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0100",
                Length,
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                Format,
            ),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Format,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
                Format,
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Version(0xff),
            ),
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Version(1),
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                ZeroId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                ZeroId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-é",
                Format,
            ),
        ];
        for (value, why) in bad {
            assert_eq!(TraceContext::parse(value), Err(why), "{value:?}");
        }
    }

    #[test]
    fn a_context_with_a_zero_id_is_not_valid() {
        let t = TraceContext::parse(EXAMPLE).unwrap();
        assert_eq!(t.valid(), Some(t));
        let no_trace = TraceContext {
            trace_id: [0; 16],
            ..t
        };
        assert_eq!(no_trace.valid(), None);
        let no_parent = TraceContext {
            parent_id: [0; 8],
            ..t
        };
        assert_eq!(no_parent.valid(), None);
        // The flags do not matter.
        let unsampled = TraceContext { flags: 0, ..t };
        assert_eq!(unsampled.valid(), Some(unsampled));
        let one_bit = TraceContext {
            trace_id: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            parent_id: [1, 0, 0, 0, 0, 0, 0, 0],
            flags: 0xff,
        };
        assert_eq!(one_bit.valid(), Some(one_bit));
    }

    /// 25 raw bytes in bincode's fixed-int encoding: trace id, parent id, flags.
    #[test]
    fn a_context_encodes_as_its_raw_bytes() {
        let t = TraceContext::parse(EXAMPLE).unwrap();
        let config = bincode::config::standard().with_fixed_int_encoding();
        let bytes = bincode::serde::encode_to_vec(t, config).unwrap();
        let mut want = t.trace_id.to_vec();
        want.extend_from_slice(&t.parent_id);
        want.push(t.flags);
        assert_eq!(bytes, want);
        assert_eq!(bytes.len(), 25);
        let (back, n): (TraceContext, usize) =
            bincode::serde::decode_from_slice(&bytes, config).unwrap();
        assert_eq!((back, n), (t, 25));
    }

    proptest! {
        #[test]
        fn every_context_prints_what_parses_back(
            trace_id in any::<[u8; 16]>().prop_filter("non-zero", |t| *t != [0; 16]),
            parent_id in any::<[u8; 8]>().prop_filter("non-zero", |p| *p != [0; 8]),
            flags in any::<u8>(),
        ) {
            let t = TraceContext { trace_id, parent_id, flags };
            let text = t.to_string();
            prop_assert_eq!(text.len(), 55);
            prop_assert_eq!(TraceContext::parse(&text), Ok(t));
        }

        #[test]
        fn no_string_panics_the_parser(s in "\\PC{0,80}") {
            let _ = TraceContext::parse(&s);
        }
    }
}
