//! vLLM's and SGLang's KV event payloads (msgpack, as `msgspec` writes them), decoded.
//!
//! A payload is a batch, `{ts, events, data_parallel_rank?}` as a map or as an array
//! `[ts, events, data_parallel_rank?]`. Each event is tagged by its class name, either as a
//! map with a `"type"` key or as an array whose first element is the tag; array fields come
//! in declaration order and trailing ones may be missing (`omit_defaults`). Engine versions
//! mix the forms (array batches with map events exist), so every combination is read.
//! Unknown fields are ignored; an unknown event type, or an event that cannot be read, is
//! reported on its own and the rest of the batch still decodes.

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

/// Why one event of a batch could not be used.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EventError {
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    #[error("malformed {tag} event: {why}")]
    Malformed { tag: String, why: String },
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
    /// In order; a bad event is an `Err` in its place.
    pub events: Vec<Result<EngineEvent, EventError>>,
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, BatchError> {
    let mut r = Reader::new(payload);
    let mut batch = EngineBatch {
        ts: 0.0,
        data_parallel_rank: None,
        events: Vec::new(),
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
            batch.events = events(&mut r)?;
            have_events = true;
            if n >= 3 {
                batch.data_parallel_rank = opt(&mut r, |r| r.uint())?;
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
                        batch.events = events(&mut r)?;
                        have_events = true;
                    }
                    "data_parallel_rank" | "attn_dp_rank" | "dp_rank" => {
                        batch.data_parallel_rank = opt(&mut r, |r| r.uint())?
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

fn events(r: &mut Reader<'_>) -> Result<Vec<Result<EngineEvent, EventError>>, BatchError> {
    let n = r.array_len()?;
    // Every event takes at least one byte: a claimed count beyond that is a lie.
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let start = r.position();
        match event(r) {
            Ok(ev) => out.push(ev),
            Err(e) => {
                // Step over the bad event as a whole; if even that fails the batch is broken.
                r.seek(start);
                r.skip()?;
                out.push(Err(EventError::Malformed {
                    tag: tag_at(r, start),
                    why: e.to_string(),
                }));
            }
        }
    }
    Ok(out)
}

/// The tag of the event at `start`, for an error message.
fn tag_at(r: &Reader<'_>, start: usize) -> String {
    let bytes = r.since(start);
    let mut t = Reader::new(bytes);
    let tag = match t.peek() {
        Ok(Kind::Array) => t.array_len().ok().and_then(|_| t.str().ok()),
        Ok(Kind::Map) => t.map_len().ok().and_then(|n| {
            (0..n).find_map(|_| match t.str() {
                Ok("type") => t.str().ok(),
                Ok(_) => t.skip().ok().and(None),
                Err(_) => None,
            })
        }),
        _ => None,
    };
    tag.unwrap_or("event").to_string()
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
        _ => return None,
    })
}

#[derive(Default)]
struct Raw {
    stored: Stored,
    have_hashes: bool,
    have_block_size: bool,
}

fn read_field(r: &mut Reader<'_>, f: Field, raw: &mut Raw) -> Result<(), MsgpackError> {
    let s = &mut raw.stored;
    match f {
        Field::BlockHashes => {
            let n = r.array_len()?;
            s.block_hashes = Vec::with_capacity(n.min(r_left(r)));
            for _ in 0..n {
                s.block_hashes.push(block_hash(r)?);
            }
            raw.have_hashes = true;
        }
        Field::Parent => s.parent = opt(r, block_hash)?,
        Field::TokenIds => {
            if !r.nil()? {
                let n = r.array_len()?;
                s.token_ids = Vec::with_capacity(n.min(r_left(r)));
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
                s.extra_keys = Vec::with_capacity(n.min(r_left(r)));
                for _ in 0..n {
                    let e = opt(r, render_extra)?.filter(|e| !e.is_empty());
                    s.extra_keys.push(e);
                }
            }
        }
        Field::GroupIdx => s.group_idx = opt(r, |r| r.uint())?,
        Field::SpecKind => s.spec_kind = opt(r, |r| r.str().map(str::to_string))?,
        Field::SlidingWindow => s.sliding_window = opt(r, |r| r.uint())?,
    }
    Ok(())
}

/// Bytes left in the payload: an upper bound on any element count still to come.
fn r_left(r: &Reader<'_>) -> usize {
    r.remaining()
}

fn event(r: &mut Reader<'_>) -> Result<Result<EngineEvent, EventError>, MsgpackError> {
    let mut raw = Raw::default();
    let tag = match r.peek()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n == 0 {
                return Ok(Err(malformed("event", "an empty array")));
            }
            let tag = r.str()?;
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
                } else if let Some(f) = field_named(key) {
                    read_field(r, f, &mut raw)?;
                } else {
                    r.skip()?;
                }
            }
            match tag {
                Some(t) => t,
                None => return Ok(Err(malformed("event", "a map without \"type\""))),
            }
        }
        other => {
            return Ok(Err(malformed(
                "event",
                &format!("{other:?}, not an array or map"),
            )))
        }
    };
    Ok(match tag {
        "BlockStored" => {
            if !raw.have_hashes || !raw.have_block_size {
                Err(malformed(tag, "block_hashes or block_size missing"))
            } else {
                Ok(EngineEvent::Stored(raw.stored))
            }
        }
        "BlockRemoved" => {
            if !raw.have_hashes {
                Err(malformed(tag, "block_hashes missing"))
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
        other => Err(EventError::UnknownType(other.to_string())),
    })
}

fn malformed(tag: &str, why: &str) -> EventError {
    EventError::Malformed {
        tag: tag.to_string(),
        why: why.to_string(),
    }
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
            Kind::Float => out.push(r.float()?.to_string()),
            Kind::Str => out.push(r.str()?.to_string()),
            Kind::Bin => out.push(r.bin()?.iter().map(|b| format!("{b:02x}")).collect()),
            Kind::Array => pending += r.array_len()?.min(r.remaining()),
            Kind::Map | Kind::Ext => r.skip()?,
        }
    }
    Ok(out)
}
