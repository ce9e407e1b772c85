//! The simulated engine's own block ids ([`EngineBlockHash`]).
//!
//! Real engines name cached blocks with their own hash functions (vLLM chains a hash of the
//! parent block's hash and the block's tokens; SGLang and TensorRT-LLM do similar things).
//! The router treats these ids as opaque: it can only link a stored block to its parent and
//! name blocks in `Removed`. To keep the mocker honest about that, its engine hashes are a
//! *different* function from the router's local and sequence hashes: XXH3-64 with
//! [`DEFAULT_ENGINE_HASH_SEED`] (or a per-engine seed) over a one-byte parent marker, the
//! parent's engine hash (little-endian, when there is a parent) and the block's tokens
//! (u32 little-endian), chained block by block as vLLM does.
//!
//! The seed is configurable ([`crate::EngineConfig::engine_hash_seed`]): vLLM seeds its chain
//! with a per-process random value unless `PYTHONHASHSEED` is set, so two workers holding the
//! same prompt may well publish different engine hashes for it.

use kvrouter_protocol::EngineBlockHash;
use xxhash_rust::xxh3::Xxh3;

/// The default seed of the engine hash chain ("kvmocker" in ASCII), deliberately not the
/// router's 1337.
pub const DEFAULT_ENGINE_HASH_SEED: u64 = 0x6b76_6d6f_636b_6572;

/// The engine hash of one block: XXH3-64(seed) over `[has_parent] ++ parent LE ++ tokens LE`.
pub fn engine_block_hash(
    seed: u64,
    parent: Option<EngineBlockHash>,
    block_tokens: &[u32],
) -> EngineBlockHash {
    let mut h = Xxh3::with_seed(seed);
    match parent {
        None => h.update(&[0u8]),
        Some(p) => {
            h.update(&[1u8]);
            h.update(&p.0.to_le_bytes());
        }
    }
    // Hash the tokens in small stack batches rather than one heap buffer.
    let mut buf = [0u8; 256];
    for chunk in block_tokens.chunks(buf.len() / 4) {
        for (i, t) in chunk.iter().enumerate() {
            buf[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..chunk.len() * 4]);
    }
    EngineBlockHash(h.digest())
}

/// Engine hashes of every full block of `tokens`, chained from the first block; a trailing
/// partial block is ignored. `block_size` 0 yields no blocks.
pub fn engine_block_hashes(seed: u64, tokens: &[u32], block_size: usize) -> Vec<EngineBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for block in tokens.chunks_exact(block_size) {
        let h = engine_block_hash(seed, parent, block);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_protocol::{local_block_hashes, sequence_hashes};

    #[test]
    fn chained_deterministic_and_prefix_identified() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 7777; // block 2 of size 8 (tokens 16..24) differs
        let ha = engine_block_hashes(DEFAULT_ENGINE_HASH_SEED, &a, 8);
        let hb = engine_block_hashes(DEFAULT_ENGINE_HASH_SEED, &b, 8);
        assert_eq!(ha.len(), 5);
        assert_eq!(ha, engine_block_hashes(DEFAULT_ENGINE_HASH_SEED, &a, 8));
        assert_eq!(ha[..2], hb[..2]);
        // Chained: a change in block 2 changes every later block too.
        assert!(ha[2..].iter().zip(&hb[2..]).all(|(x, y)| x != y));
        // Same block tokens at a different position (different parent) hash differently.
        let c: Vec<u32> = a[8..16].iter().chain(a[8..16].iter()).copied().collect();
        let hc = engine_block_hashes(DEFAULT_ENGINE_HASH_SEED, &c, 8);
        assert_ne!(hc[0], hc[1]);
    }

    #[test]
    fn differs_from_router_hashes_and_across_seeds() {
        let tokens: Vec<u32> = (100..164).collect();
        let engine = engine_block_hashes(DEFAULT_ENGINE_HASH_SEED, &tokens, 16);
        let local = local_block_hashes(&tokens, 16, None).unwrap();
        let seq = sequence_hashes(&local);
        for i in 0..engine.len() {
            assert_ne!(engine[i].0, local[i].0);
            assert_ne!(engine[i].0, seq[i].0);
        }
        assert_ne!(engine, engine_block_hashes(42, &tokens, 16));
    }

    #[test]
    fn partial_and_degenerate_inputs() {
        assert!(engine_block_hashes(1, &[1, 2, 3], 4).is_empty());
        assert!(engine_block_hashes(1, &[1, 2, 3], 0).is_empty());
        // Blocks larger than the internal batch buffer hash all their tokens.
        let long: Vec<u32> = (0..200).collect();
        let mut long2 = long.clone();
        long2[199] = 0;
        assert_ne!(
            engine_block_hash(1, None, &long),
            engine_block_hash(1, None, &long2)
        );
    }
}
