//! A zero-copy MessagePack reader over one payload: what the engine decoder needs (lengths,
//! integers, strings, bytes, skipping anything), with `rmp` classifying the markers.
//!
//! Hand-driven rather than serde so that one bad event can be skipped on its own: every
//! value can be stepped over structurally, whatever its content.

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
        Self { buf, pos: 0 }
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
            return Ok(true);
        }
        Ok(false)
    }

    pub fn array_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        match self.marker()? {
            Marker::FixArray(n) => Ok(n as usize),
            Marker::Array16 => Ok(u16::from_be_bytes(self.be()?) as usize),
            Marker::Array32 => Ok(u32::from_be_bytes(self.be()?) as usize),
            _ => Err(self.mismatch(at, "array")),
        }
    }

    pub fn map_len(&mut self) -> Result<usize, MsgpackError> {
        let at = self.pos;
        match self.marker()? {
            Marker::FixMap(n) => Ok(n as usize),
            Marker::Map16 => Ok(u16::from_be_bytes(self.be()?) as usize),
            Marker::Map32 => Ok(u32::from_be_bytes(self.be()?) as usize),
            _ => Err(self.mismatch(at, "map")),
        }
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

    /// Steps over the next value, whatever it is.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        // Values still to skip; arrays and maps add their elements (no recursion, so no
        // nesting limit is needed).
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let at = self.pos;
            let m = self.marker()?;
            let n = match m {
                Marker::Null
                | Marker::True
                | Marker::False
                | Marker::FixPos(_)
                | Marker::FixNeg(_) => 0,
                Marker::U8 | Marker::I8 => 1,
                Marker::U16 | Marker::I16 => 2,
                Marker::U32 | Marker::I32 | Marker::F32 => 4,
                Marker::U64 | Marker::I64 | Marker::F64 => 8,
                Marker::FixStr(n) => n as usize,
                Marker::Str8 | Marker::Bin8 => u8::from_be_bytes(self.be()?) as usize,
                Marker::Str16 | Marker::Bin16 => u16::from_be_bytes(self.be()?) as usize,
                Marker::Str32 | Marker::Bin32 => u32::from_be_bytes(self.be()?) as usize,
                Marker::FixExt1 => 2,
                Marker::FixExt2 => 3,
                Marker::FixExt4 => 5,
                Marker::FixExt8 => 9,
                Marker::FixExt16 => 17,
                Marker::Ext8 => u8::from_be_bytes(self.be()?) as usize + 1,
                Marker::Ext16 => u16::from_be_bytes(self.be()?) as usize + 1,
                Marker::Ext32 => u32::from_be_bytes(self.be()?) as usize + 1,
                Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                    self.seek(at);
                    pending += self.array_len()? as u64;
                    0
                }
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                    self.seek(at);
                    pending += 2 * self.map_len()? as u64;
                    0
                }
                Marker::Reserved => return Err(self.mismatch(at, "a msgpack value")),
            };
            // A claimed length longer than what is left cannot be real.
            if pending > self.buf.len() as u64 {
                return Err(MsgpackError::Eof(self.buf.len()));
            }
            self.take(n)?;
        }
        Ok(())
    }
}
