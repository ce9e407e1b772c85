//! Block hashing, byte-compatible with NVIDIA Dynamo's `compute_block_hash_for_seq`.
//!
//! A block is `block_size` consecutive tokens; only full blocks are hashed. The local hash of
//! a block is XXH3-64 of its tokens as u32 little-endian bytes, seeded with [`BASE_SEED`]
//! (shifted by the LoRA name, if any). Sequence hashes chain the local hashes so that two
//! prompts share blocks `0..=k` exactly when their sequence hashes agree at `k`.

use crate::types::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, PromptExtras, SequenceHash,
};
use std::collections::{HashMap, HashSet};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of every local and sequence hash without LoRA.
pub const BASE_SEED: u64 = 1337;

/// Invalid hashing parameters.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HashError {
    #[error("block size must be at least 1 token")]
    ZeroBlockSize,
}

/// The seed for a LoRA adapter: the base seed shifted by the hash of its name.
/// `None` and the empty name both mean "no adapter".
pub fn lora_seed(lora: Option<&str>) -> u64 {
    match lora {
        Some(name) if !name.is_empty() => {
            BASE_SEED.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0))
        }
        _ => BASE_SEED,
    }
}

/// Local hashes of every full block of `tokens`; a trailing partial block is ignored.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
) -> Result<Vec<LocalBlockHash>, HashError> {
    if block_size == 0 {
        return Err(HashError::ZeroBlockSize);
    }
    let seed = lora_seed(lora);
    let mut bytes = Vec::with_capacity(block_size * 4);
    Ok(tokens
        .chunks_exact(block_size)
        .map(|block| {
            bytes.clear();
            for t in block {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            LocalBlockHash(xxh3_64_with_seed(&bytes, seed))
        })
        .collect())
}

/// The local hash of one block whose cache entry also depends on extra keys (multimodal
/// identifiers, a cache salt): XXH3-64 with the block's LoRA `seed` of its tokens (u32 LE),
/// then of each extra as its UTF-8 length (u32 LE) and bytes. Without extras it equals the
/// plain local hash, so such blocks match plain-token requests only when nothing extra was
/// given, and never otherwise.
pub fn local_block_hash_with_extras<S: AsRef<str>>(
    block: &[u32],
    seed: u64,
    extras: &[S],
) -> LocalBlockHash {
    let mut bytes = Vec::with_capacity(block.len() * 4 + 32);
    for t in block {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    for e in extras {
        let e = e.as_ref().as_bytes();
        bytes.extend_from_slice(&(e.len() as u32).to_le_bytes());
        bytes.extend_from_slice(e);
    }
    LocalBlockHash(xxh3_64_with_seed(&bytes, seed))
}

/// The extra keys of block `i` of a prompt: its own, then the cache salt on block 0 (unless
/// already among them, as vLLM puts it there itself).
pub fn block_extra_keys(extras: &PromptExtras, i: usize) -> Vec<&str> {
    let mut keys: Vec<&str> = extras
        .block_extras
        .get(i)
        .map(|k| k.iter().map(String::as_str).collect())
        .unwrap_or_default();
    if i == 0 {
        if let Some(salt) = extras.cache_salt.as_deref() {
            if !keys.contains(&salt) {
                keys.push(salt);
            }
        }
    }
    keys
}

/// Local hashes of every full block of a prompt whose cache keys may depend on extras:
/// [`local_block_hashes`] without them, [`local_block_hash_with_extras`] block by block
/// with them.
pub fn prompt_local_hashes(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    extras: Option<&PromptExtras>,
) -> Result<Vec<LocalBlockHash>, HashError> {
    let Some(extras) = extras.filter(|e| !e.block_extras.is_empty() || e.cache_salt.is_some())
    else {
        return local_block_hashes(tokens, block_size, lora);
    };
    if block_size == 0 {
        return Err(HashError::ZeroBlockSize);
    }
    let seed = lora_seed(lora);
    Ok(tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| local_block_hash_with_extras(block, seed, &block_extra_keys(extras, i)))
        .collect())
}

/// One step of the sequence-hash chain.
#[inline]
pub fn chain_sequence_hash(parent: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.0.to_le_bytes());
    buf[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceHash(xxh3_64_with_seed(&buf, BASE_SEED))
}

/// Sequence hashes of a run of local hashes: `seq[0] = local[0]`,
/// `seq[i] = xxh3(seq[i-1] LE ++ local[i] LE, 1337)`.
pub fn sequence_hashes(local: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    let mut prev: Option<SequenceHash> = None;
    for &l in local {
        let s = match prev {
            None => SequenceHash(l.0),
            Some(p) => chain_sequence_hash(p, l),
        };
        out.push(s);
        prev = Some(s);
    }
    out
}

/// The prefixes a cache snapshot holds (the `Stored` events of a state dump or index dump),
/// each named by its sequence hash, so two caches that name blocks differently compare
/// equal when they hold the same prefixes. Blocks whose parent chain is not in the events
/// are left out; other event kinds are ignored.
pub fn stored_sequence_hashes(events: &[KvEvent]) -> HashSet<SequenceHash> {
    let mut parent_of: HashMap<EngineBlockHash, (Option<EngineBlockHash>, LocalBlockHash)> =
        HashMap::new();
    for ev in events {
        if let KvEventData::Stored { parent, blocks } = &ev.data {
            let mut parent = *parent;
            for b in blocks {
                parent_of.insert(b.engine_hash, (parent, b.local_hash));
                parent = Some(b.engine_hash);
            }
        }
    }
    let mut named: HashMap<EngineBlockHash, SequenceHash> = HashMap::new();
    let mut chain = Vec::new();
    for &start in parent_of.keys() {
        // Walk up to a named block (or the root), then name the chain top-down.
        let mut cur = Some(start);
        let mut base = None;
        while let Some(e) = cur {
            if let Some(&s) = named.get(&e) {
                base = Some(s);
                break;
            }
            let Some(&(parent, _)) = parent_of.get(&e) else {
                chain.clear(); // cut off from the root
                break;
            };
            chain.push(e);
            cur = parent;
            if chain.len() > parent_of.len() {
                chain.clear(); // a cycle: malformed input
                break;
            }
        }
        while let Some(e) = chain.pop() {
            let local = parent_of[&e].1;
            let s = match base {
                None => SequenceHash(local.0),
                Some(p) => chain_sequence_hash(p, local),
            };
            named.insert(e, s);
            base = Some(s);
        }
    }
    named.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Tier;

    #[test]
    fn extras_change_the_hash_and_none_keep_it() {
        let block: Vec<u32> = (1..=4).collect();
        let plain = local_block_hashes(&block, 4, Some("a")).unwrap().remove(0);
        let seed = lora_seed(Some("a"));
        let none: [&str; 0] = [];
        assert_eq!(local_block_hash_with_extras(&block, seed, &none), plain);
        let salted = local_block_hash_with_extras(&block, seed, &["s"]);
        assert_ne!(salted, plain);
        // Lengths keep item boundaries: ["ab"] and ["a", "b"] differ.
        assert_ne!(
            local_block_hash_with_extras(&block, seed, &["ab"]),
            local_block_hash_with_extras(&block, seed, &["a", "b"])
        );
    }

    #[test]
    fn known_answer_matches_dynamo() {
        let tokens: Vec<u32> = (1..=10).collect();
        let local = local_block_hashes(&tokens, 4, None).unwrap();
        assert_eq!(
            local,
            vec![
                LocalBlockHash(0xcb38e4d7fb2dca5c),
                LocalBlockHash(0xe8d3ec39b907b74c)
            ]
        );
        assert_eq!(
            sequence_hashes(&local),
            vec![
                SequenceHash(0xcb38e4d7fb2dca5c),
                SequenceHash(0x44a2b2379d6d3c3d)
            ]
        );
    }

    #[test]
    fn empty_lora_is_no_lora_and_a_named_lora_changes_hashes() {
        let tokens: Vec<u32> = (0..32).collect();
        let base = local_block_hashes(&tokens, 16, None).unwrap();
        assert_eq!(base, local_block_hashes(&tokens, 16, Some("")).unwrap());
        let a = local_block_hashes(&tokens, 16, Some("adapter-a")).unwrap();
        let b = local_block_hashes(&tokens, 16, Some("adapter-b")).unwrap();
        assert_ne!(base, a);
        assert_ne!(a, b);
        assert_eq!(
            lora_seed(Some("x")),
            BASE_SEED.wrapping_add(xxh3_64_with_seed(b"x", 0))
        );
    }

    #[test]
    fn partial_blocks_and_zero_block_size() {
        assert!(local_block_hashes(&[1, 2, 3], 4, None).unwrap().is_empty());
        assert_eq!(
            local_block_hashes(&[1, 2, 3], 0, None),
            Err(HashError::ZeroBlockSize)
        );
        assert!(sequence_hashes(&[]).is_empty());
    }

    #[test]
    fn shared_prefix_iff_equal_sequence_hash() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 9999; // block 2 (tokens 32..48) differs
        let sa = sequence_hashes(&local_block_hashes(&a, 16, None).unwrap());
        let sb = sequence_hashes(&local_block_hashes(&b, 16, None).unwrap());
        assert_eq!(sa[..2], sb[..2]);
        assert_ne!(sa[2], sb[2]);
        assert_ne!(sa[3], sb[3]);
    }

    #[test]
    fn snapshot_prefixes_are_named_by_sequence_hash() {
        use crate::types::{StoredBlock, WorkerKey};
        let tokens: Vec<u32> = (0..16).collect();
        let local = local_block_hashes(&tokens, 4, None).unwrap();
        let seq = sequence_hashes(&local);
        let block = |e: u64, i: usize| StoredBlock {
            engine_hash: EngineBlockHash(e),
            local_hash: local[i],
        };
        let ev = |parent: Option<u64>, blocks: Vec<StoredBlock>| KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(1, 0),
            event_id: 0,
            data: KvEventData::Stored {
                parent: parent.map(EngineBlockHash),
                blocks,
            },
        };
        // Children before parents, split chains, and an orphan (parent 99 unknown).
        let events = vec![
            ev(Some(11), vec![block(12, 2), block(13, 3)]),
            ev(None, vec![block(10, 0), block(11, 1)]),
            ev(Some(99), vec![block(50, 1)]),
        ];
        let got = stored_sequence_hashes(&events);
        assert_eq!(got, seq.iter().copied().collect::<HashSet<_>>());
    }
}
