//! A zero-copy MessagePack reader over one payload: what the engine decoder needs (lengths,
//! integers, strings, bytes, skipping anything), with `rmp` classifying the markers.
//!
//! Hand-driven rather than serde so that one bad event can be skipped on its own: every
//! value can be stepped over structurally, whatever its content.
//!
//! Linear in its input, whatever the input claims: every read consumes at least its marker
//! byte or fails, a claimed length is checked against the bytes left before anything is
//! taken or counted on it, and nothing here allocates. [`Reader::steps`] counts the markers
//! read, so callers' tests can bound the work a payload costs by its length.

use rmp::Marker;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MsgpackError {
    #[error("payload ends early (at byte {0})")]
    Eof(usize),
    #[error("expected {expected} at byte {at}, found {found}")]
    Type {
        expected: &'static str,
        found: &'static str,
        at: usize,
    },
    #[error("integer at byte {0} does not fit")]
    Range(usize),
    #[error("string at byte {0} is not UTF-8")]
    Utf8(usize),
    /// More elements than bytes left (each takes at least one).
    #[error("{claimed} values claimed at byte {at} with {left} bytes left")]
    Claim {
        claimed: u64,
        left: usize,
        at: usize,
    },
}

impl MsgpackError {
    /// The same error with its byte position moved by `by` (an error of a reader over a part
    /// of a payload, placed in the whole payload).
    pub fn offset(self, by: usize) -> Self {
        match self {
            Self::Eof(at) => Self::Eof(at + by),
            Self::Type {
                expected,
                found,
                at,
            } => Self::Type {
                expected,
                found,
                at: at + by,
            },
            Self::Range(at) => Self::Range(at + by),
            Self::Utf8(at) => Self::Utf8(at + by),
            Self::Claim { claimed, left, at } => Self::Claim {
                claimed,
                left,
                at: at + by,
            },
        }
    }
}

/// The kind of the next value, as far as the decoder cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::Int => "integer",
            Kind::Float => "float",
            Kind::Str => "string",
            Kind::Bin => "bytes",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "extension",
        }
    }
}

/// An integer as msgpack carries it: unsigned, or negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    U(u64),
    I(i64),
}

impl Int {
    /// The 64 bits, whatever the sign (how engine block hashes are taken).
    pub fn bits(self) -> u64 {
        match self {
            Int::U(u) => u,
            Int::I(i) => i as u64,
        }
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Markers read (values visited), re-reads after a `seek` included.
    steps: u64,
}

fn kind_of(m: Marker) -> Kind {
    match m {
        Marker::Null => Kind::Nil,
        Marker::True | Marker::False => Kind::Bool,
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => Kind::Int,
        Marker::F32 | Marker::F64 => Kind::Float,
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
        // Reserved (0xc1) is refused by `peek`'s callers as an extension they do not know.
        _ => Kind::Ext,
    }
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            steps: 0,
        }
    }

    /// Markers read so far: the values this reader visited, each time it visited them. A
    /// decoder that reads each byte of its input at most a few times keeps this within a
    /// small multiple of the input's length (a marker is at least one byte).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Counts the steps of another reader (one over a part of this payload) as this one's.
    pub fn add_steps(&mut self, steps: u64) {
        self.steps = self.steps.saturating_add(steps);
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// The bytes from `start` to the current position.
    pub fn since(&self, start: usize) -> &'a [u8] {
        &self.buf[start.min(self.pos)..self.pos]
    }

    /// Moves back to `pos` (a position this reader returned), to retry or skip a value.
    pub fn seek(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(MsgpackError::Eof(self.buf.len()))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn marker(&mut self) -> Result<Marker, MsgpackError> {
        let b = self.take(1)?[0];
        self.steps += 1;
        Ok(Marker::from_u8(b))
    }

    /// The kind of the next value, without consuming it.
    pub fn peek(&self) -> Result<Kind, MsgpackError> {
        let b = *self.buf.get(self.pos).ok_or(MsgpackError::Eof(self.pos))?;
        Ok(kind_of(Marker::from_u8(b)))
    }

    fn mismatch(&self, at: usize, expected: &'static str) -> MsgpackError {
        let found = self
            .buf
            .get(at)
            .map(|&b| kind_of(Marker::from_u8(b)).name())
            .unwrap_or("end of payload");
        MsgpackError::Type {
            expected,
            found,
            at,
        }
    }

    /// Consumes a nil if one is next.
    pub fn nil(&mut self) -> Result<bool, MsgpackError> {
        if self.peek()? == Kind::Nil {
            self.pos += 1;
            self.steps += 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// An array's element count; one larger than the bytes left is refused (every element
    /// takes at least one), so a caller may loop over it, or reserve room for it.
    pub fn array_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixArray(n) => n as usize,
            Marker::Array16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Array32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.mismatch(at, "array")),
        };
        self.claim(n as u64, at)?;
        Ok(n)
    }

    /// A map's entry count; more keys and values than bytes left are refused.
    pub fn map_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixMap(n) => n as usize,
            Marker::Map16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Map32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.mismatch(at, "map")),
        };
        self.claim(2 * n as u64, at)?;
        Ok(n)
    }

    fn claim(&self, values: u64, at: usize) -> Result<(), MsgpackError> {
        if values > self.remaining() as u64 {
            return Err(MsgpackError::Claim {
                claimed: values,
                left: self.remaining(),
                at,
            });
        }
        Ok(())
    }

    pub fn int(&mut self) -> Result<Int, MsgpackError> {
        let at = self.pos;
        Ok(match self.marker()? {
            Marker::FixPos(v) => Int::U(v.into()),
            Marker::FixNeg(v) => Int::I(v.into()),
            Marker::U8 => Int::U(u8::from_be_bytes(self.be()?).into()),
            Marker::U16 => Int::U(u16::from_be_bytes(self.be()?).into()),
            Marker::U32 => Int::U(u32::from_be_bytes(self.be()?).into()),
            Marker::U64 => Int::U(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Int::I(i8::from_be_bytes(self.be()?).into()),
            Marker::I16 => Int::I(i16::from_be_bytes(self.be()?).into()),
            Marker::I32 => Int::I(i32::from_be_bytes(self.be()?).into()),
            Marker::I64 => Int::I(i64::from_be_bytes(self.be()?)),
            _ => return Err(self.mismatch(at, "integer")),
        })
    }

    /// A non-negative integer that fits `T`.
    pub fn uint<T: TryFrom<u64>>(&mut self) -> Result<T, MsgpackError> {
        let at = self.pos;
        match self.int()? {
            Int::U(u) => T::try_from(u).map_err(|_| MsgpackError::Range(at)),
            Int::I(i) => u64::try_from(i)
                .ok()
                .and_then(|u| T::try_from(u).ok())
                .ok_or(MsgpackError::Range(at)),
        }
    }

    /// A signed integer (an unsigned one above `i64::MAX` is out of range).
    pub fn sint(&mut self) -> Result<i64, MsgpackError> {
        let at = self.pos;
        match self.int()? {
            Int::U(u) => i64::try_from(u).map_err(|_| MsgpackError::Range(at)),
            Int::I(i) => Ok(i),
        }
    }

    /// A float; integers are accepted too (a timestamp of 0 may be encoded as one).
    pub fn float(&mut self) -> Result<f64, MsgpackError> {
        let at = self.pos;
        match self.peek()? {
            Kind::Int => return Ok(self.sint()? as f64),
            Kind::Float => {}
            _ => return Err(self.mismatch(at, "float")),
        }
        Ok(match self.marker()? {
            Marker::F32 => f32::from_be_bytes(self.be()?).into(),
            _ => f64::from_be_bytes(self.be()?),
        })
    }

    pub fn bool(&mut self) -> Result<bool, MsgpackError> {
        let at = self.pos;
        match self.marker()? {
            Marker::True => Ok(true),
            Marker::False => Ok(false),
            _ => Err(self.mismatch(at, "bool")),
        }
    }

    pub fn str(&mut self) -> Result<&'a str, MsgpackError> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::FixStr(n) => n as usize,
            Marker::Str8 => u8::from_be_bytes(self.be()?) as usize,
            Marker::Str16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Str32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.mismatch(at, "string")),
        };
        std::str::from_utf8(self.take(n)?).map_err(|_| MsgpackError::Utf8(at))
    }

    pub fn bin(&mut self) -> Result<&'a [u8], MsgpackError> {
        let at = self.pos;
        let n = match self.marker()? {
            Marker::Bin8 => u8::from_be_bytes(self.be()?) as usize,
            Marker::Bin16 => u16::from_be_bytes(self.be()?) as usize,
            Marker::Bin32 => u32::from_be_bytes(self.be()?) as usize,
            _ => return Err(self.mismatch(at, "bytes")),
        };
        self.take(n)
    }

    /// Steps over the next value, whatever it is: one step per marker, no allocation, no
    /// recursion (any nesting depth), and a claimed element count or length larger than the
    /// bytes left is refused at once rather than counted down.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        // Values still to skip; arrays and maps add their elements. Every value takes at
        // least one byte, so more pending values than bytes left cannot be real.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let at = self.pos;
            let m = self.marker()?;
            let (n, elements) = match m {
                Marker::Null
                | Marker::True
                | Marker::False
                | Marker::FixPos(_)
                | Marker::FixNeg(_) => (0, 0),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(n) => (n as usize, 0),
                Marker::Str8 | Marker::Bin8 => (u8::from_be_bytes(self.be()?) as usize, 0),
                Marker::Str16 | Marker::Bin16 => (u16::from_be_bytes(self.be()?) as usize, 0),
                Marker::Str32 | Marker::Bin32 => (u32::from_be_bytes(self.be()?) as usize, 0),
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (u8::from_be_bytes(self.be()?) as usize + 1, 0),
                Marker::Ext16 => (u16::from_be_bytes(self.be()?) as usize + 1, 0),
                Marker::Ext32 => (u32::from_be_bytes(self.be()?) as usize + 1, 0),
                Marker::FixArray(n) => (0, u64::from(n)),
                Marker::Array16 => (0, u64::from(u16::from_be_bytes(self.be()?))),
                Marker::Array32 => (0, u64::from(u32::from_be_bytes(self.be()?))),
                Marker::FixMap(n) => (0, 2 * u64::from(n)),
                Marker::Map16 => (0, 2 * u64::from(u16::from_be_bytes(self.be()?))),
                Marker::Map32 => (0, 2 * u64::from(u32::from_be_bytes(self.be()?))),
                Marker::Reserved => return Err(self.mismatch(at, "a msgpack value")),
            };
            self.take(n)?;
            pending += elements;
            if pending > self.remaining() as u64 {
                return Err(MsgpackError::Claim {
                    claimed: pending,
                    left: self.remaining(),
                    at,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Skipping visits each marker once, at any depth, and stops at once on a claim larger
    /// than what is left.
    #[test]
    fn skip_is_one_step_per_marker_and_refuses_impossible_claims() {
        let mut deep = vec![0x91; 100_000];
        deep.push(0xc0);
        let mut r = Reader::new(&deep);
        r.skip().unwrap();
        assert_eq!((r.position(), r.steps()), (deep.len(), deep.len() as u64));

        for claim in [
            &[0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0][..],
            &[0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0],
            &[0xdc, 0x00, 0x03, 0xc0, 0xc0],
            &[0x82, 0xc0, 0xc0, 0xc0],
        ] {
            let mut r = Reader::new(claim);
            assert!(
                matches!(r.skip(), Err(MsgpackError::Claim { .. })),
                "{claim:02x?}"
            );
            assert_eq!(r.steps(), 1, "{claim:02x?}");
            let mut r = Reader::new(claim);
            let len = if claim[0] & 0xf0 == 0x80 || claim[0] == 0xdf {
                r.map_len()
            } else {
                r.array_len()
            };
            assert!(
                matches!(len, Err(MsgpackError::Claim { .. })),
                "{claim:02x?}"
            );
        }
        // Strings, bytes, extensions longer than the payload.
        for claim in [
            [0xdb, 0xff, 0xff, 0xff, 0xff],
            [0xc6, 0xff, 0xff, 0xff, 0xff],
        ] {
            assert!(Reader::new(&claim).skip().is_err());
            assert!(Reader::new(&claim).str().is_err());
            assert!(Reader::new(&claim).bin().is_err());
        }
        assert!(Reader::new(&[0xc9, 0xff, 0xff, 0xff, 0xff, 1])
            .skip()
            .is_err());
        // An exact claim is fine.
        let mut r = Reader::new(&[0x92, 0xc0, 0xc0]);
        assert_eq!(r.array_len(), Ok(2));
    }

    #[test]
    fn errors_move_by_an_offset() {
        let e = Reader::new(&[0xc0]).str().unwrap_err().offset(10);
        assert!(e.to_string().contains("at byte 10"), "{e}");
    }
}
