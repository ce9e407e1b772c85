//! vLLM's and SGLang's KV event payloads (msgpack, as `msgspec` writes them), decoded.
//!
//! A payload is a batch, `{ts, events, data_parallel_rank?}` as a map or as an array
//! `[ts, events, data_parallel_rank?]`. Each event is tagged by its class name, either as a
//! map with a `"type"` key or as an array whose first element is the tag; array fields come
//! in declaration order and trailing ones may be missing (`omit_defaults`). Engine versions
//! mix the forms (array batches with map events exist), so every combination is read.
//! Unknown fields are ignored; an unknown event type, or an event that cannot be read, is
//! reported on its own and the rest of the batch still decodes.
//!
//! Linear in the payload, whatever it claims: each event is first stepped over as one
//! msgpack value (so the next one starts where it ends, whatever decoding it made of it),
//! then decoded from exactly its own bytes; element counts are checked against the bytes
//! left before anything loops or reserves on them ([`Reader::array_len`]); and only the
//! first [`DETAILED_ERRORS`] bad events of a batch keep a (bounded) description, the rest
//! are counted ([`EngineBatch::more_bad`]). [`decode_batch_steps`] reports the work done.

use crate::msgpack::{Int, Kind, MsgpackError, Reader};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// A block's extra hash keys, rendered as strings (see [`render_extra`]).
pub type Extras = Vec<String>;

/// `BlockStored`: blocks cached on a rank, `block_hashes[0]` extending `parent`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored {
    pub block_hashes: Vec<u64>,
    pub parent: Option<u64>,
    /// The tokens of every stored block, `block_size` per block (may be empty).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block (empty: none given); `None` for a block without extra keys.
    pub extra_keys: Vec<Option<Extras>>,
    pub group_idx: Option<u32>,
    pub spec_kind: Option<String>,
    pub sliding_window: Option<u32>,
    /// SGLang's salt (a field, or its `metadata` map); vLLM puts it in block 0's extra keys.
    pub cache_salt: Option<String>,
    /// `"LOCAL"`, `"REMOTE"` or absent.
    pub locality: Option<String>,
    /// vLLM's `lookahead_token_ids`: per block, the tokens after it that its hash also
    /// covers (empty: none, or lookahead hashing off).
    pub lookahead: Vec<Vec<u32>>,
}

/// One decoded engine KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        group_idx: Option<u32>,
        locality: Option<String>,
    },
    Cleared,
}

/// Why one event of a batch could not be used. Its strings are bounded: a tag taken from
/// the payload keeps at most [`TAG_MAX`] bytes.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EventError {
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    #[error("malformed {tag} event: {why}")]
    Malformed { tag: String, why: String },
}

/// Bad events of a batch that are kept in place, described; past these they are only
/// counted. Eight is enough to show what is wrong with an engine's stream (its bad events
/// are usually all alike) while a payload of a million one-byte bad events costs a counter,
/// not a million descriptions (about 100 bytes each, in a slot of the events' size).
pub const DETAILED_ERRORS: usize = 8;

/// The most bytes of an event tag an error keeps (longer tags are cut at a character
/// boundary); the engines' own tags are at most 16 bytes.
pub const TAG_MAX: usize = 64;

/// Bad events counted but not kept (past the first [`DETAILED_ERRORS`] of a batch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BadEvents {
    pub unknown_type: u64,
    pub malformed: u64,
}

impl BadEvents {
    pub fn total(&self) -> u64 {
        self.unknown_type + self.malformed
    }
}

/// A payload that is not a batch at all.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("malformed event batch: {0}")]
pub struct BatchError(String);

impl From<MsgpackError> for BatchError {
    fn from(e: MsgpackError) -> Self {
        Self(e.to_string())
    }
}

/// One decoded payload.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    pub ts: f64,
    pub data_parallel_rank: Option<u32>,
    /// In order; a bad event is an `Err` in its place, for the first [`DETAILED_ERRORS`]
    /// bad events (later ones are left out and counted in `more_bad`).
    pub events: Vec<Result<EngineEvent, EventError>>,
    /// Bad events past the first [`DETAILED_ERRORS`]: counted, not kept.
    pub more_bad: BadEvents,
}

impl EngineBatch {
    /// Every bad event of the batch: those kept in place and those only counted.
    pub fn bad_events(&self) -> u64 {
        self.events.iter().filter(|e| e.is_err()).count() as u64 + self.more_bad.total()
    }

    /// The first bad event's description, if any.
    pub fn first_error(&self) -> Option<&EventError> {
        self.events.iter().find_map(|e| e.as_ref().err())
    }
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, BatchError> {
    decode_batch_steps(payload).0
}

/// [`decode_batch`], with the msgpack values it visited ([`Reader::steps`]): at most twice
/// the payload's length (each event's bytes are read once to find its end and once to
/// decode it; nothing else is read twice).
pub fn decode_batch_steps(payload: &[u8]) -> (Result<EngineBatch, BatchError>, u64) {
    let mut r = Reader::new(payload);
    let batch = batch(&mut r, payload);
    (batch, r.steps())
}

fn batch(r: &mut Reader<'_>, payload: &[u8]) -> Result<EngineBatch, BatchError> {
    let mut batch = EngineBatch {
        ts: 0.0,
        data_parallel_rank: None,
        events: Vec::new(),
        more_bad: BadEvents::default(),
    };
    let mut have_events = false;
    match r.peek()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n < 2 {
                return Err(BatchError(format!(
                    "an array batch has {n} fields, needs 2"
                )));
            }
            batch.ts = r.float()?;
            (batch.events, batch.more_bad) = events(r)?;
            have_events = true;
            if n >= 3 {
                batch.data_parallel_rank = opt(r, |r| r.uint())?;
            }
            for _ in 3..n {
                r.skip()?;
            }
        }
        Kind::Map => {
            for _ in 0..r.map_len()? {
                match r.str()? {
                    "ts" => batch.ts = r.float()?,
                    "events" => {
                        (batch.events, batch.more_bad) = events(r)?;
                        have_events = true;
                    }
                    "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => {
                        batch.data_parallel_rank = opt(r, |r| r.uint())?
                    }
                    _ => r.skip()?,
                }
            }
        }
        other => {
            return Err(BatchError(format!(
                "a batch is an array or a map, not {other:?}"
            )));
        }
    }
    if !have_events {
        return Err(BatchError("a batch without events".into()));
    }
    if !r.is_empty() {
        return Err(BatchError(format!(
            "{} trailing bytes after the batch",
            payload.len() - r.position()
        )));
    }
    Ok(batch)
}

type Events = (Vec<Result<EngineEvent, EventError>>, BadEvents);

fn events(r: &mut Reader<'_>) -> Result<Events, BatchError> {
    // A count larger than the bytes left is refused here (`array_len`): the batch is a lie.
    let n = r.array_len()?;
    // Room for a typical batch only: an event's slot is some 200 bytes, and what a payload
    // holds in place of events is unknown until they are read (nils would not fill it).
    let mut out = Vec::with_capacity(n.min(16));
    let mut detailed = 0;
    let mut more = BadEvents::default();
    for _ in 0..n {
        // The event's bytes, stepped over as one value whatever they hold: the next event
        // starts right after them however decoding this one goes. If even that fails, the
        // batch's structure is broken.
        let start = r.position();
        r.skip()?;
        let mut e = Reader::new(r.since(start));
        let decoded = event(&mut e);
        r.add_steps(e.steps());
        let bad = match decoded {
            Ok(ev) => {
                out.push(Ok(ev));
                continue;
            }
            Err(bad) => bad,
        };
        if detailed < DETAILED_ERRORS {
            detailed += 1;
            out.push(Err(bad.describe(start)));
        } else {
            match bad {
                Bad::Unknown(_) => more.unknown_type += 1,
                Bad::Malformed { .. } => more.malformed += 1,
            }
        }
    }
    Ok((out, more))
}

/// Why an event cannot be used, before it is described: borrowed and allocation-free, so a
/// bad event past the first few costs nothing but a count.
enum Bad<'a> {
    Unknown(&'a str),
    Malformed { tag: &'a str, why: Why },
}

enum Why {
    Read(MsgpackError),
    Shape(&'static str),
    NotContainer(Kind),
}

impl Bad<'_> {
    /// The error, its positions in the payload (the event started at `start`).
    fn describe(self, start: usize) -> EventError {
        match self {
            Bad::Unknown(tag) => EventError::UnknownType(bounded(tag).to_string()),
            Bad::Malformed { tag, why } => EventError::Malformed {
                tag: bounded(tag).to_string(),
                why: match why {
                    Why::Read(e) => e.offset(start).to_string(),
                    Why::Shape(s) => s.to_string(),
                    Why::NotContainer(k) => format!("{k:?}, not an array or map"),
                },
            },
        }
    }
}

/// `s` cut to at most [`TAG_MAX`] bytes, at a character boundary.
fn bounded(s: &str) -> &str {
    if s.len() <= TAG_MAX {
        return s;
    }
    let mut end = TAG_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    CacheSalt,
    Locality,
    Lookahead,
}

/// Array-form field order, as the engines declare the classes.
const STORED_FIELDS: &[Field] = &[
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
    Field::Locality,
];
const REMOVED_FIELDS: &[Field] = &[
    Field::BlockHashes,
    Field::Medium,
    Field::GroupIdx,
    Field::Locality,
];

fn field_named(name: &str) -> Option<Field> {
    Some(match name {
        "block_hashes" => Field::BlockHashes,
        "parent_block_hash" => Field::Parent,
        "token_ids" => Field::TokenIds,
        "block_size" => Field::BlockSize,
        "lora_id" => Field::LoraId,
        "medium" => Field::Medium,
        "lora_name" => Field::LoraName,
        "extra_keys" => Field::ExtraKeys,
        "group_idx" => Field::GroupIdx,
        "kv_cache_spec_kind" => Field::SpecKind,
        "kv_cache_spec_sliding_window" => Field::SlidingWindow,
        "cache_salt" => Field::CacheSalt,
        "locality" => Field::Locality,
        "lookahead_token_ids" => Field::Lookahead,
        _ => return None,
    })
}

#[derive(Default)]
struct Raw {
    stored: Stored,
    have_hashes: bool,
    have_block_size: bool,
}

/// One field. Lists reserve what they claim: `array_len` has checked the claim against the
/// bytes left (of this event alone), so what is reserved is at most a few bytes per byte.
fn read_field(r: &mut Reader<'_>, f: Field, raw: &mut Raw) -> Result<(), MsgpackError> {
    let s = &mut raw.stored;
    match f {
        Field::BlockHashes => {
            let n = r.array_len()?;
            s.block_hashes = Vec::with_capacity(n);
            for _ in 0..n {
                s.block_hashes.push(block_hash(r)?);
            }
            raw.have_hashes = true;
        }
        Field::Parent => s.parent = opt(r, block_hash)?,
        Field::TokenIds => {
            if !r.nil()? {
                let n = r.array_len()?;
                s.token_ids = Vec::with_capacity(n);
                for _ in 0..n {
                    s.token_ids.push(r.uint()?);
                }
            }
        }
        Field::BlockSize => {
            s.block_size = r.uint()?;
            raw.have_block_size = true;
        }
        Field::LoraId => s.lora_id = opt(r, |r| r.sint())?,
        Field::Medium => s.medium = opt(r, |r| r.str().map(str::to_string))?,
        // SGLang's array form has its metadata map where vLLM has the LoRA name.
        Field::LoraName if r.peek()? == Kind::Map => s.cache_salt = salt_in_metadata(r)?,
        Field::LoraName => s.lora_name = opt(r, |r| r.str().map(str::to_string))?,
        Field::CacheSalt => s.cache_salt = opt(r, |r| r.str().map(str::to_string))?,
        Field::Locality => s.locality = opt(r, |r| r.str().map(str::to_string))?,
        Field::ExtraKeys => {
            if !r.nil()? {
                let n = r.array_len()?;
                s.extra_keys = Vec::with_capacity(n);
                for _ in 0..n {
                    let e = opt(r, render_extra)?.filter(|e| !e.is_empty());
                    s.extra_keys.push(e);
                }
            }
        }
        Field::GroupIdx => s.group_idx = opt(r, |r| r.uint())?,
        Field::SpecKind => s.spec_kind = opt(r, |r| r.str().map(str::to_string))?,
        Field::SlidingWindow => s.sliding_window = opt(r, |r| r.uint())?,
        Field::Lookahead => {
            if !r.nil()? {
                let n = r.array_len()?;
                s.lookahead = Vec::with_capacity(n);
                for _ in 0..n {
                    let mut tokens = Vec::new();
                    if !r.nil()? {
                        let k = r.array_len()?;
                        tokens.reserve(k);
                        for _ in 0..k {
                            tokens.push(r.uint()?);
                        }
                    }
                    s.lookahead.push(tokens);
                }
            }
        }
    }
    Ok(())
}

/// The tag of an event whose own tag was not read (`malformed untagged event: ...`).
const UNTAGGED: &str = "untagged";

/// One event, from a reader over exactly its bytes.
fn event<'a>(r: &mut Reader<'a>) -> Result<EngineEvent, Bad<'a>> {
    // The tag, once read: a read error after it names it.
    let mut tag = None;
    match event_in(r, &mut tag) {
        Ok(res) => res,
        Err(e) => Err(Bad::Malformed {
            tag: tag.unwrap_or(UNTAGGED),
            why: Why::Read(e),
        }),
    }
}

fn event_in<'a>(
    r: &mut Reader<'a>,
    tag_out: &mut Option<&'a str>,
) -> Result<Result<EngineEvent, Bad<'a>>, MsgpackError> {
    let shape = |why| {
        Ok(Err(Bad::Malformed {
            tag: UNTAGGED,
            why: Why::Shape(why),
        }))
    };
    let mut raw = Raw::default();
    let tag = match r.peek()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n == 0 {
                return shape("an empty array");
            }
            let tag = r.str()?;
            *tag_out = Some(tag);
            let fields = match tag {
                "BlockStored" => STORED_FIELDS,
                "BlockRemoved" => REMOVED_FIELDS,
                _ => &[],
            };
            for i in 1..n {
                match fields.get(i - 1) {
                    Some(&f) => read_field(r, f, &mut raw)?,
                    None => r.skip()?,
                }
            }
            tag
        }
        Kind::Map => {
            let mut tag = None;
            for _ in 0..r.map_len()? {
                let key = r.str()?;
                if key == "type" {
                    tag = Some(r.str()?);
                    *tag_out = tag;
                } else if let Some(f) = field_named(key) {
                    read_field(r, f, &mut raw)?;
                } else {
                    r.skip()?;
                }
            }
            match tag {
                Some(t) => t,
                None => return shape("a map without \"type\""),
            }
        }
        other => {
            return Ok(Err(Bad::Malformed {
                tag: UNTAGGED,
                why: Why::NotContainer(other),
            }))
        }
    };
    let malformed = |why| {
        Err(Bad::Malformed {
            tag,
            why: Why::Shape(why),
        })
    };
    Ok(match tag {
        "BlockStored" => {
            if !raw.have_hashes || !raw.have_block_size {
                malformed("block_hashes or block_size missing")
            } else {
                Ok(EngineEvent::Stored(raw.stored))
            }
        }
        "BlockRemoved" => {
            if !raw.have_hashes {
                malformed("block_hashes missing")
            } else {
                let s = raw.stored;
                Ok(EngineEvent::Removed {
                    block_hashes: s.block_hashes,
                    medium: s.medium,
                    group_idx: s.group_idx,
                    locality: s.locality,
                })
            }
        }
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Err(Bad::Unknown(other)),
    })
}

/// SGLang's `BlockStoredMetadata` map: its `cache_salt`.
fn salt_in_metadata(r: &mut Reader<'_>) -> Result<Option<String>, MsgpackError> {
    let mut salt = None;
    for _ in 0..r.map_len()? {
        if r.str()? == "cache_salt" {
            salt = opt(r, |r| r.str().map(str::to_string))?;
        } else {
            r.skip()?;
        }
    }
    Ok(salt)
}

/// `nil` as `None`, anything else through `f`.
fn opt<'a, T>(
    r: &mut Reader<'a>,
    f: impl FnOnce(&mut Reader<'a>) -> Result<T, MsgpackError>,
) -> Result<Option<T>, MsgpackError> {
    if r.nil()? {
        Ok(None)
    } else {
        f(r).map(Some)
    }
}

/// An engine block hash: an integer (its 64 bits, whatever the sign) or a raw digest
/// (bytes, folded to 64 bits with XXH3).
fn block_hash(r: &mut Reader<'_>) -> Result<u64, MsgpackError> {
    match r.peek()? {
        Kind::Bin => Ok(xxh3_64(r.bin()?)),
        _ => r.int().map(Int::bits),
    }
}

/// One block's extra keys (a tuple, possibly nested: LoRA name, multimodal identifiers,
/// cache salt), flattened to strings: a string as is, an integer in decimal, bytes in
/// lowercase hex, a float as Rust prints it, a bool as `true`/`false`; nils are left out.
fn render_extra(r: &mut Reader<'_>) -> Result<Extras, MsgpackError> {
    let mut out = Vec::new();
    let mut pending = 1usize;
    while pending > 0 {
        pending -= 1;
        match r.peek()? {
            Kind::Nil => {
                r.nil()?;
            }
            Kind::Bool => out.push(r.bool()?.to_string()),
            Kind::Int => out.push(match r.int()? {
                Int::U(u) => u.to_string(),
                Int::I(i) => i.to_string(),
            }),
            Kind::Float => out.push(float_string(r.float()?)),
            Kind::Str => out.push(r.str()?.to_string()),
            Kind::Bin => out.push(hex(r.bin()?)),
            // `array_len` refuses more elements than bytes left: `pending` stays below them.
            Kind::Array => pending += r.array_len()?,
            Kind::Map | Kind::Ext => r.skip()?,
        }
    }
    Ok(out)
}

/// Lowercase hex, two characters a byte, in one allocation.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// A float as Rust prints it (`Display`: every digit, no exponent, up to ~330 characters),
/// in a string of exactly that size: `to_string` would double its buffer up to 512 bytes
/// for a 9-byte msgpack float.
fn float_string(x: f64) -> String {
    use std::fmt::Write;
    struct Stack {
        buf: [u8; 400],
        len: usize,
    }
    impl Write for Stack {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let end = self.len + s.len();
            let dst = self.buf.get_mut(self.len..end).ok_or(std::fmt::Error)?;
            dst.copy_from_slice(s.as_bytes());
            self.len = end;
            Ok(())
        }
    }
    let mut b = Stack {
        buf: [0; 400],
        len: 0,
    };
    match write!(b, "{x}") {
        // Whole `&str` pieces were copied: still UTF-8.
        Ok(()) => String::from_utf8_lossy(&b.buf[..b.len]).into_owned(),
        Err(_) => x.to_string(),
    }
}
