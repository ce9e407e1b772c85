//! The mocker's KV events as vLLM and SGLang put them on ZeroMQ: msgpack batches shaped as
//! their msgspec classes encode them (see tests/engines/engine_wire.py for the classes).

use kvrouter_protocol::{DpRank, KvEvent, KvEventData, Tier};
use rustc_hash::FxHashMap;

/// Which engine to look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emulated {
    Vllm,
    Sglang,
}

/// How batches and events are laid out (engine versions differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZmqWire {
    /// Events as tagged maps in an array batch: vLLM after #42892 and SGLang after #37482
    /// (their batches kept `array_like`).
    ArrayBatch,
    /// Events as tagged arrays in an array batch (the older `array_like` classes).
    Array,
    /// Events as tagged maps in a map batch (`{ts, events, data_parallel_rank}`).
    Map,
}

impl std::str::FromStr for ZmqWire {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "array-batch" => Ok(Self::ArrayBatch),
            "array" => Ok(Self::Array),
            "map" => Ok(Self::Map),
            other => Err(format!(
                "unknown ZMQ wire {other:?} (array-batch, array or map)"
            )),
        }
    }
}

/// The tokens of each block a rank may store, by engine hash (blocks of prompts submitted
/// to the rank; dropped when the block is removed).
#[derive(Default)]
pub struct BlockTokens(FxHashMap<u64, Vec<u32>>);

impl BlockTokens {
    pub fn insert(&mut self, engine_hash: u64, tokens: &[u32]) {
        self.0.entry(engine_hash).or_insert_with(|| tokens.to_vec());
    }

    fn forget(&mut self, data: &KvEventData) {
        match data {
            KvEventData::Removed { engine_hashes } => {
                for h in engine_hashes {
                    self.0.remove(&h.0);
                }
            }
            KvEventData::Cleared => self.0.clear(),
            KvEventData::Stored { .. } => {}
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn w<T>(r: Result<T, rmp::encode::ValueWriteError>) {
    r.expect("writing to a Vec cannot fail");
}

fn str_(out: &mut Vec<u8>, s: &str) {
    w(rmp::encode::write_str(out, s));
}

fn uint(out: &mut Vec<u8>, v: u64) {
    w(rmp::encode::write_uint(out, v));
}

fn nil(out: &mut Vec<u8>) {
    rmp::encode::write_nil(out).expect("writing to a Vec cannot fail");
}

fn array(out: &mut Vec<u8>, n: usize) {
    w(rmp::encode::write_array_len(out, n as u32));
}

fn map(out: &mut Vec<u8>, n: usize) {
    w(rmp::encode::write_map_len(out, n as u32));
}

/// An engine hash as the engine writes it: vLLM an unsigned 64-bit integer, SGLang a signed
/// one (its hashes are the first 8 digest bytes read as an `int64`).
fn hash(out: &mut Vec<u8>, engine: Emulated, h: u64) {
    match engine {
        Emulated::Vllm => uint(out, h),
        Emulated::Sglang => w(rmp::encode::write_sint(out, h as i64)),
    }
}

/// One batch of a rank's events, encoded. `tokens` supplies each stored block's tokens (a
/// block it does not know is stored without tokens, as engines with offloading do).
pub fn encode_batch(
    engine: Emulated,
    wire: ZmqWire,
    ts: f64,
    rank: DpRank,
    events: &[KvEvent],
    block_size: u32,
    tokens: &mut BlockTokens,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + events.len() * 64);
    let rank_key = match engine {
        Emulated::Vllm => "data_parallel_rank",
        Emulated::Sglang => "attn_dp_rank",
    };
    if wire == ZmqWire::Map {
        map(&mut out, 3);
        str_(&mut out, "ts");
    } else {
        array(&mut out, 3);
    }
    w(rmp::encode::write_f64(&mut out, ts));
    if wire == ZmqWire::Map {
        str_(&mut out, "events");
    }
    array(&mut out, events.len());
    for e in events {
        event(&mut out, engine, wire, e.tier, &e.data, block_size, tokens);
        tokens.forget(&e.data);
    }
    if wire == ZmqWire::Map {
        str_(&mut out, rank_key);
    }
    uint(&mut out, u64::from(rank));
    out
}

/// The `medium` an engine names a tier by (vLLM's offloading connector says `CPU`; disk
/// tiers `DISK`).
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::Host => "CPU",
        Tier::Disk => "DISK",
        Tier::Shared => "SHARED",
    }
}

fn event(
    out: &mut Vec<u8>,
    engine: Emulated,
    wire: ZmqWire,
    tier: Tier,
    data: &KvEventData,
    block_size: u32,
    tokens: &BlockTokens,
) {
    let as_map = wire != ZmqWire::Array;
    match data {
        KvEventData::Stored { parent, blocks } => {
            // Every block's tokens, or none if one is unknown; offloaded blocks go without
            // tokens, as vLLM's offloading connector sends them.
            let toks: Vec<&[u32]> = if tier == Tier::Device {
                blocks
                    .iter()
                    .map(|b| tokens.0.get(&b.engine_hash.0).map(Vec::as_slice))
                    .collect::<Option<_>>()
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            // vLLM: hashes, parent, tokens, block_size, lora_id, medium, lora_name,
            // extra_keys, group_idx, kv_cache_spec_kind; SGLang: up to medium.
            let vllm = engine == Emulated::Vllm;
            let fields = if vllm { 10 } else { 6 };
            if as_map {
                map(out, fields + 1);
                str_(out, "type");
            } else {
                array(out, fields + 1);
            }
            str_(out, "BlockStored");
            let key = |out: &mut Vec<u8>, k: &str| {
                if as_map {
                    str_(out, k);
                }
            };
            key(out, "block_hashes");
            array(out, blocks.len());
            for b in blocks {
                hash(out, engine, b.engine_hash.0);
            }
            key(out, "parent_block_hash");
            match parent {
                Some(p) => hash(out, engine, p.0),
                None => nil(out),
            }
            key(out, "token_ids");
            array(out, toks.iter().map(|t| t.len()).sum());
            for &t in toks.iter().copied().flatten() {
                uint(out, u64::from(t));
            }
            key(out, "block_size");
            uint(out, u64::from(block_size));
            key(out, "lora_id");
            nil(out);
            key(out, "medium");
            str_(out, medium(tier));
            if vllm {
                key(out, "lora_name");
                nil(out);
                key(out, "extra_keys");
                nil(out);
                key(out, "group_idx");
                uint(out, 0);
                key(out, "kv_cache_spec_kind");
                str_(out, "full_attention");
            }
        }
        KvEventData::Removed { engine_hashes } => {
            if as_map {
                map(out, 3);
                str_(out, "type");
            } else {
                array(out, 3);
            }
            str_(out, "BlockRemoved");
            if as_map {
                str_(out, "block_hashes");
            }
            array(out, engine_hashes.len());
            for h in engine_hashes {
                hash(out, engine, h.0);
            }
            if as_map {
                str_(out, "medium");
            }
            str_(out, medium(tier));
        }
        KvEventData::Cleared => {
            if as_map {
                map(out, 1);
                str_(out, "type");
            } else {
                array(out, 1);
            }
            str_(out, "AllBlocksCleared");
        }
    }
}
