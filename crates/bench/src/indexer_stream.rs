//! The indexer benchmark's event stream, built from a Mooncake trace exactly as specified so
//! that any other index can be fed the same stream (see `--export-stream`).
//!
//! Trace block `h` becomes `K` sub-blocks with ids `K·h+j`. A sub-block's local hash is
//! xxh3-64 (seed 1337) of its id's little-endian bytes; sequence hashes chain the local hashes
//! as in DESIGN.md, and the engine hash is the sequence hash (XOR a salt when given). Request
//! `r` goes to worker `r mod W`, whose least-recently-used list of `C` sequence hashes decides
//! what is stored and what is evicted.

use crate::trace::TraceError;
use kvrouter_protocol::hashing::chain_sequence_hash;
use kvrouter_protocol::{
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, SequenceHash, StoredBlock, Tier,
    WorkerKey, BASE_SEED,
};
use lru::LruCache;
use rustc_hash::FxBuildHasher;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64_with_seed;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// W: request r goes to worker r mod W.
    pub workers: u64,
    /// C: each worker's LRU capacity in sub-blocks.
    pub capacity_blocks: usize,
    /// K: sub-blocks per trace block.
    pub sub_blocks: u64,
    /// X: engine hash = sequence hash XOR X.
    pub engine_hash_salt: Option<u64>,
}

#[derive(Debug, Error)]
pub enum StreamError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error(
        "request {request}: sub-block id of trace block {hash_id} overflows u64 (K = {sub_blocks})"
    )]
    Overflow {
        request: u64,
        hash_id: u64,
        sub_blocks: u64,
    },
    #[error("request {request} has {blocks} sub-blocks, more than the capacity of {capacity}; raise --capacity-blocks")]
    RequestTooLarge {
        request: u64,
        blocks: usize,
        capacity: usize,
    },
    #[error("invalid stream settings: {0}")]
    Config(String),
}

/// Local and sequence hashes of one request's sub-blocks.
pub fn request_hashes(
    request: u64,
    hash_ids: &[u64],
    sub_blocks: u64,
) -> Result<(Vec<LocalBlockHash>, Vec<SequenceHash>), StreamError> {
    let n = hash_ids.len() * sub_blocks as usize;
    let mut local = Vec::with_capacity(n);
    let mut seq: Vec<SequenceHash> = Vec::with_capacity(n);
    for &h in hash_ids {
        let base = h.checked_mul(sub_blocks).ok_or(StreamError::Overflow {
            request,
            hash_id: h,
            sub_blocks,
        })?;
        for j in 0..sub_blocks {
            let id = base.checked_add(j).ok_or(StreamError::Overflow {
                request,
                hash_id: h,
                sub_blocks,
            })?;
            let l = LocalBlockHash(xxh3_64_with_seed(&id.to_le_bytes(), BASE_SEED));
            let s = match seq.last() {
                None => SequenceHash(l.0),
                Some(&prev) => chain_sequence_hash(prev, l),
            };
            local.push(l);
            seq.push(s);
        }
    }
    Ok((local, seq))
}

/// Builds the stream request by request, holding only the workers' LRU lists.
pub struct StreamBuilder {
    config: StreamConfig,
    lrus: Vec<LruCache<u64, (), FxBuildHasher>>,
    next_event_id: Vec<u64>,
    request: u64,
}

impl StreamBuilder {
    pub fn new(config: StreamConfig) -> Result<Self, StreamError> {
        if config.workers == 0 || config.capacity_blocks == 0 || config.sub_blocks == 0 {
            return Err(StreamError::Config(
                "--workers, --capacity-blocks and --sub-blocks must be at least 1".into(),
            ));
        }
        let w = usize::try_from(config.workers)
            .map_err(|_| StreamError::Config("--workers is too large".into()))?;
        Ok(Self {
            config,
            lrus: (0..w)
                .map(|_| LruCache::unbounded_with_hasher(FxBuildHasher))
                .collect(),
            next_event_id: vec![0; w],
            request: 0,
        })
    }

    /// Requests consumed so far.
    pub fn requests(&self) -> u64 {
        self.request
    }

    /// Appends the events of the next request (none, a Stored, or a Removed then a Stored).
    pub fn push_request(
        &mut self,
        hash_ids: &[u64],
        out: &mut Vec<KvEvent>,
    ) -> Result<(), StreamError> {
        let r = self.request;
        self.request += 1;
        if hash_ids.is_empty() {
            return Ok(());
        }
        let (local, seq) = request_hashes(r, hash_ids, self.config.sub_blocks)?;
        let m = seq.len();
        let cap = self.config.capacity_blocks;
        if m > cap {
            return Err(StreamError::RequestTooLarge {
                request: r,
                blocks: m,
                capacity: cap,
            });
        }
        let w = (r % self.config.workers) as usize;
        let salt = self.config.engine_hash_salt.unwrap_or(0);
        let engine = |s: SequenceHash| EngineBlockHash(s.0 ^ salt);
        let key = WorkerKey::new(w as u64, 0);
        let lru = &mut self.lrus[w];

        let p = seq.iter().take_while(|s| lru.contains(&s.0)).count();
        for s in seq[..p].iter().rev() {
            lru.promote(&s.0);
        }
        let mut evicted = Vec::new();
        while lru.len() + (m - p) > cap {
            match lru.pop_lru() {
                Some((s, ())) => evicted.push(EngineBlockHash(s ^ salt)),
                None => break,
            }
        }
        if !evicted.is_empty() {
            out.push(KvEvent {
                tier: Tier::Device,
                key,
                event_id: self.next_event_id[w],
                data: KvEventData::Removed {
                    engine_hashes: evicted,
                },
            });
            self.next_event_id[w] += 1;
        }
        if m > p {
            let blocks = (p..m)
                .map(|i| StoredBlock {
                    engine_hash: engine(seq[i]),
                    local_hash: local[i],
                })
                .collect();
            out.push(KvEvent {
                tier: Tier::Device,
                key,
                event_id: self.next_event_id[w],
                data: KvEventData::Stored {
                    parent: p.checked_sub(1).map(|i| engine(seq[i])),
                    blocks,
                },
            });
            self.next_event_id[w] += 1;
            for s in &seq[p..] {
                lru.push(s.0, ());
            }
        }
        for s in seq.iter().rev() {
            lru.promote(&s.0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(w: u64, c: usize, k: u64) -> StreamConfig {
        StreamConfig {
            workers: w,
            capacity_blocks: c,
            sub_blocks: k,
            engine_hash_salt: None,
        }
    }

    #[test]
    fn sub_block_hashes_follow_the_spec() {
        let (l, s) = request_hashes(0, &[3], 2).unwrap();
        assert_eq!(l[0].0, xxh3_64_with_seed(&6u64.to_le_bytes(), 1337));
        assert_eq!(l[1].0, xxh3_64_with_seed(&7u64.to_le_bytes(), 1337));
        assert_eq!(s[0].0, l[0].0);
        assert_eq!(s[1], chain_sequence_hash(s[0], l[1]));
        assert!(matches!(
            request_hashes(4, &[u64::MAX / 2], 4),
            Err(StreamError::Overflow { request: 4, .. })
        ));
    }

    #[test]
    fn reuse_eviction_and_event_ids() {
        // one worker, capacity 4 sub-blocks, K = 1
        let mut b = StreamBuilder::new(cfg(1, 4, 1)).unwrap();
        let mut out = vec![];
        b.push_request(&[1, 2, 3], &mut out).unwrap();
        assert_eq!(out.len(), 1);
        let KvEventData::Stored {
            parent: None,
            blocks,
        } = &out[0].data
        else {
            panic!("{:?}", out[0])
        };
        assert_eq!(blocks.len(), 3);
        let (_, s123) = request_hashes(0, &[1, 2, 3], 1).unwrap();
        // shares [1, 2]; needs 1 new block; 3 + 1 <= 4: no eviction
        out.clear();
        b.push_request(&[1, 2, 9], &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].event_id, 1);
        let KvEventData::Stored { parent, blocks } = &out[0].data else {
            panic!()
        };
        assert_eq!(*parent, Some(EngineBlockHash(s123[1].0)));
        assert_eq!(blocks.len(), 1);
        // a 2-block request with nothing shared evicts the 2 least recent: 3 (oldest) then 9?
        // After request 2 the order (least recent first) is: 3, 9, 2, 1.
        out.clear();
        b.push_request(&[7, 8], &mut out).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].event_id, 2);
        let (_, s129) = request_hashes(1, &[1, 2, 9], 1).unwrap();
        assert_eq!(
            out[0].data,
            KvEventData::Removed {
                engine_hashes: vec![EngineBlockHash(s123[2].0), EngineBlockHash(s129[2].0)]
            }
        );
        assert!(matches!(
            out[1].data,
            KvEventData::Stored { parent: None, .. }
        ));
        // empty requests count but emit nothing; too-large requests are named
        out.clear();
        b.push_request(&[], &mut out).unwrap();
        assert!(out.is_empty());
        assert!(matches!(
            b.push_request(&[1, 2, 3, 4, 5], &mut out),
            Err(StreamError::RequestTooLarge {
                request: 4,
                blocks: 5,
                capacity: 4
            })
        ));
    }

    #[test]
    fn requests_round_robin_over_workers_and_salt_applies() {
        let mut b = StreamBuilder::new(StreamConfig {
            engine_hash_salt: Some(0xff),
            ..cfg(3, 100, 2)
        })
        .unwrap();
        let mut out = vec![];
        for _ in 0..4 {
            b.push_request(&[5], &mut out).unwrap();
        }
        let workers: Vec<u64> = out.iter().map(|e| e.key.worker_id).collect();
        assert_eq!(workers, vec![0, 1, 2]); // request 3 hits worker 0's cache
        let (_, s) = request_hashes(0, &[5], 2).unwrap();
        let KvEventData::Stored { blocks, .. } = &out[0].data else {
            panic!()
        };
        assert_eq!(blocks[0].engine_hash.0, s[0].0 ^ 0xff);
    }
}
