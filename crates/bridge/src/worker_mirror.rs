//! The bridge's copy of what one engine's ranks cache, and the translation of the engine's
//! events into kvrouter KV events.
//!
//! Every engine event is first applied to the mirror (a kvrouter [`Index`], so it refuses
//! exactly what a replica's index would); only the events it accepts get the rank's next
//! event id and go to the router. A replica that applies the forwarded events, or loads a
//! [`snapshot`](WorkerMirror::snapshot), holds what the mirror holds.

use crate::engine_event::{BadEvents, EngineEvent, EventError, Extras, Stored};
use kvrouter_indexer::{block_limit_for_capacity, Index, IndexError};
use kvrouter_protocol::{
    prompt_local_hashes, DpRank, EngineBlockHash, EventId, KvEvent, KvEventData, LocalBlockHash,
    PromptExtras, StoredBlock, Tier, WorkerId, WorkerKey,
};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// Why an engine event was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Skip {
    /// A `medium` that names no tier kvrouter knows.
    UnknownMedium,
    /// Held by another node (`locality` other than `LOCAL`).
    OtherNode,
    /// Not the full-attention group (sliding window, mamba, another group index).
    OtherGroup,
    /// `block_size` differs from the bridge's `--block-size`.
    BlockSize,
    /// No `token_ids` and blocks the mirror does not know (never seen, or forgotten).
    NoTokens,
    /// `token_ids` is not `block_size` tokens per block.
    TokenCount,
    /// The parent is not held (it was evicted or never seen).
    MissingParent,
    /// The rank would hold more than its capacity allows.
    Capacity,
    /// A `BlockRemoved` of blocks the mirror does not hold.
    UnknownBlocks,
    UnknownType,
    Malformed,
}

impl Skip {
    pub const ALL: [Skip; 11] = [
        Skip::UnknownMedium,
        Skip::OtherNode,
        Skip::OtherGroup,
        Skip::BlockSize,
        Skip::NoTokens,
        Skip::TokenCount,
        Skip::MissingParent,
        Skip::Capacity,
        Skip::UnknownBlocks,
        Skip::UnknownType,
        Skip::Malformed,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::UnknownMedium => "unknown_medium",
            Skip::OtherNode => "other_node",
            Skip::OtherGroup => "other_group",
            Skip::BlockSize => "block_size",
            Skip::NoTokens => "no_tokens",
            Skip::TokenCount => "token_count",
            Skip::MissingParent => "missing_parent",
            Skip::Capacity => "capacity",
            Skip::UnknownBlocks => "unknown_blocks",
            Skip::UnknownType => "unknown_type",
            Skip::Malformed => "malformed",
        }
    }
}

/// Attention kinds whose blocks a plain-token prefix match can use.
const MAIN_ATTENTION: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// One engine's ranks `dp_start_rank .. dp_start_rank + dp_size`, mirrored.
pub struct WorkerMirror {
    worker_id: WorkerId,
    dp_start_rank: DpRank,
    block_size: u32,
    index: Index,
    /// Per rank (by index from `dp_start_rank`): the last event id forwarded.
    last_ids: Vec<Option<EventId>>,
    /// What each KV cache group index turned out to be (learned from `BlockStored`).
    main_group: FxHashMap<u32, bool>,
    skipped: FxHashMap<Skip, u64>,
    lineage: Lineage,
    /// Lower-tier announcements per (rank slot, tier, engine hash): vLLM's offloading
    /// connector announces a block once per chunk that covers it and removes it as often
    /// (its documentation asks consumers to count them), so only the last removal goes on.
    refs: FxHashMap<(usize, Tier, u64), u32>,
}

/// Where each block the mirror placed sat: by (rank slot, engine hash), its parent's
/// engine hash and its local hash. vLLM's offload placeholders name a block by its hash
/// alone (no tokens, no parent, block size 0), often after the device dropped it; this is
/// how they land under their prefix instead of nowhere. Bounded: the oldest entries go
/// first past `cap`.
#[derive(Default)]
struct Lineage {
    at: FxHashMap<(usize, u64), (Option<u64>, LocalBlockHash, u64)>,
    order: VecDeque<((usize, u64), u64)>,
    next: u64,
    cap: usize,
}

impl Lineage {
    fn get(&self, slot: usize, engine: u64) -> Option<(Option<u64>, LocalBlockHash)> {
        self.at.get(&(slot, engine)).map(|&(p, l, _)| (p, l))
    }

    fn insert(&mut self, slot: usize, engine: u64, parent: Option<u64>, local: LocalBlockHash) {
        let n = self.next;
        self.next += 1;
        self.at.insert((slot, engine), (parent, local, n));
        self.order.push_back(((slot, engine), n));
        // Entries replaced since leave stale places in `order`: drop those as they come.
        while self.at.len() > self.cap || self.order.len() > 2 * self.cap.max(1) {
            let Some((k, n)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&k).is_some_and(|e| e.2 == n) {
                self.at.remove(&k);
            }
        }
    }

    fn forget_slot(&mut self, slot: usize) {
        self.at.retain(|k, _| k.0 != slot);
        self.order.retain(|(k, _)| k.0 != slot);
    }
}

impl WorkerMirror {
    pub fn new(
        worker_id: WorkerId,
        dp_start_rank: DpRank,
        dp_size: u32,
        block_size: u32,
        capacity_blocks: u64,
    ) -> Self {
        let mut index = Index::new();
        let cap = usize::try_from(capacity_blocks).unwrap_or(usize::MAX / 2);
        index.set_block_limit(worker_id, Some(block_limit_for_capacity(cap)));
        Self {
            worker_id,
            dp_start_rank,
            block_size,
            index,
            last_ids: vec![None; dp_size as usize],
            main_group: FxHashMap::default(),
            skipped: FxHashMap::default(),
            lineage: Lineage {
                cap: cap.saturating_mul(2).saturating_mul(dp_size as usize),
                ..Lineage::default()
            },
            refs: FxHashMap::default(),
        }
    }

    /// Bounds each rank's copy of a lower tier (the engine's offload capacity, in blocks);
    /// `None` leaves it unbounded.
    pub fn with_tier_capacity(mut self, tier: Tier, capacity_blocks: Option<u64>) -> Self {
        if let Some(cap) = capacity_blocks {
            let cap = usize::try_from(cap).unwrap_or(usize::MAX / 2);
            let ranks = self.last_ids.len();
            self.lineage.cap = self.lineage.cap.saturating_add(cap.saturating_mul(ranks));
            self.index.set_tier_block_limit(
                self.worker_id,
                tier,
                Some(block_limit_for_capacity(cap)),
            );
        }
        self
    }

    fn slot(&self, rank: DpRank) -> Option<usize> {
        rank.checked_sub(self.dp_start_rank)
            .map(|i| i as usize)
            .filter(|&i| i < self.last_ids.len())
    }

    pub fn key(&self, rank: DpRank) -> WorkerKey {
        WorkerKey::new(self.worker_id, rank)
    }

    /// How many events were not forwarded, by reason.
    pub fn skipped(&self, why: Skip) -> u64 {
        self.skipped.get(&why).copied().unwrap_or(0)
    }

    fn skip(&mut self, why: Skip) {
        *self.skipped.entry(why).or_default() += 1;
    }

    /// Counts the bad events a decoded batch left out (past the ones it kept in place).
    pub fn skip_bad(&mut self, more: &BadEvents) {
        for (why, n) in [
            (Skip::UnknownType, more.unknown_type),
            (Skip::Malformed, more.malformed),
        ] {
            if n > 0 {
                *self.skipped.entry(why).or_default() += n;
            }
        }
    }

    /// Blocks the mirror holds for `rank`.
    pub fn held_blocks(&self, rank: DpRank) -> usize {
        self.index.held_blocks(self.key(rank))
    }

    /// Applies one decoded batch of `rank` and returns the events to forward, in order.
    /// `None` if `rank` is not one of this worker's ranks.
    pub fn apply(
        &mut self,
        rank: DpRank,
        events: &[Result<EngineEvent, EventError>],
    ) -> Option<Vec<KvEvent>> {
        let slot = self.slot(rank)?;
        let key = self.key(rank);
        let mut out = Vec::new();
        for ev in events {
            let (tier, data) = match ev {
                Err(EventError::UnknownType(_)) => {
                    self.skip(Skip::UnknownType);
                    continue;
                }
                Err(EventError::Malformed { .. }) => {
                    self.skip(Skip::Malformed);
                    continue;
                }
                Ok(EngineEvent::Stored(s)) => match self.stored(slot, key, s) {
                    Ok(stored) => stored,
                    Err(why) => {
                        self.skip(why);
                        continue;
                    }
                },
                Ok(EngineEvent::Removed {
                    block_hashes,
                    medium,
                    group_idx,
                    locality,
                }) => {
                    let tier = match tier_of(medium.as_deref(), locality.as_deref()) {
                        Ok(t) => t,
                        Err(why) => {
                            self.skip(why);
                            continue;
                        }
                    };
                    if !self.is_main_group(*group_idx) {
                        self.skip(Skip::OtherGroup);
                        continue;
                    }
                    let engine_hashes: Vec<EngineBlockHash> = block_hashes
                        .iter()
                        .filter(|&&h| self.last_reference(slot, tier, h))
                        .map(|&h| EngineBlockHash(h))
                        .collect();
                    if engine_hashes.is_empty() {
                        // Still announced by another of the engine's offload chunks.
                        continue;
                    }
                    (tier, KvEventData::Removed { engine_hashes })
                }
                Ok(EngineEvent::Cleared) => (Tier::Device, KvEventData::Cleared),
            };
            match self.index.apply_unsequenced_in(key, tier, &data) {
                Ok(applied) => {
                    if matches!(data, KvEventData::Removed { .. }) && applied.removed == 0 {
                        self.skip(Skip::UnknownBlocks);
                        continue;
                    }
                    self.remember(slot, tier, &data);
                }
                Err(IndexError::MissingParent { .. }) => {
                    self.skip(Skip::MissingParent);
                    continue;
                }
                Err(_) => {
                    self.skip(Skip::Capacity);
                    continue;
                }
            }
            out.push(self.next_event(slot, key, tier, data));
        }
        Some(out)
    }

    /// Whether a removal of `engine` from `tier` is its last announcement's (lower tiers
    /// count them; the device's are exact).
    fn last_reference(&mut self, slot: usize, tier: Tier, engine: u64) -> bool {
        if tier == Tier::Device {
            return true;
        }
        match self.refs.get_mut(&(slot, tier, engine)) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.refs.remove(&(slot, tier, engine));
                true
            }
            None => true,
        }
    }

    /// Notes what an applied event placed (lineage, lower-tier counts) or cleared.
    fn remember(&mut self, slot: usize, tier: Tier, data: &KvEventData) {
        match data {
            KvEventData::Stored { parent, blocks } => {
                let mut parent = parent.map(|p| p.0);
                for b in blocks {
                    let e = b.engine_hash.0;
                    self.lineage.insert(slot, e, parent, b.local_hash);
                    if tier != Tier::Device {
                        *self.refs.entry((slot, tier, e)).or_insert(0) += 1;
                    }
                    parent = Some(e);
                }
            }
            KvEventData::Cleared => {
                self.refs.retain(|k, _| k.0 != slot);
                self.lineage.forget_slot(slot);
            }
            KvEventData::Removed { .. } => {}
        }
    }

    fn next_event(
        &mut self,
        slot: usize,
        key: WorkerKey,
        tier: Tier,
        data: KvEventData,
    ) -> KvEvent {
        let id = self.last_ids[slot].map_or(0, |l| l + 1);
        self.last_ids[slot] = Some(id);
        KvEvent {
            tier,
            key,
            event_id: id,
            data,
        }
    }

    /// Whether blocks of KV cache group `g` can serve a plain prefix match.
    fn is_main_group(&self, g: Option<u32>) -> bool {
        match g {
            None => true,
            Some(g) => self.main_group.get(&g).copied().unwrap_or(g == 0),
        }
    }

    fn stored(
        &mut self,
        slot: usize,
        key: WorkerKey,
        s: &Stored,
    ) -> Result<(Tier, KvEventData), Skip> {
        let tier = tier_of(s.medium.as_deref(), s.locality.as_deref())?;
        let main = s.sliding_window.unwrap_or(0) == 0
            && match s.spec_kind.as_deref() {
                Some(kind) => MAIN_ATTENTION.contains(&kind),
                None => self.is_main_group(s.group_idx),
            };
        if let Some(g) = s.group_idx {
            if s.spec_kind.is_some() {
                self.main_group.insert(g, main);
            }
        }
        if !main {
            return Err(Skip::OtherGroup);
        }
        let tokenless = s.token_ids.is_empty();
        // vLLM's offload placeholders say block size 0: they name blocks, not tokens.
        if s.block_size != self.block_size && !(tokenless && s.block_size == 0) {
            return Err(Skip::BlockSize);
        }
        let n = s.block_hashes.len();
        let mut parent = s.parent.map(EngineBlockHash);
        let local: Vec<LocalBlockHash> = if tokenless {
            let local = s
                .block_hashes
                .iter()
                .map(|&h| {
                    self.index
                        .local_hash(key, EngineBlockHash(h))
                        .or_else(|| self.lineage.get(slot, h).map(|l| l.1))
                })
                .collect::<Option<Vec<_>>>()
                .ok_or(Skip::NoTokens)?;
            // Named without its parent: it goes where the mirror last placed it.
            if parent.is_none() {
                let first = s.block_hashes.first().copied();
                parent = first
                    .and_then(|h| self.lineage.get(slot, h))
                    .and_then(|l| l.0)
                    .map(EngineBlockHash);
            }
            local
        } else {
            let bs = self.block_size as usize;
            if s.token_ids.len() != n * bs {
                return Err(Skip::TokenCount);
            }
            local_hashes(s, bs)
        };
        let blocks = s
            .block_hashes
            .iter()
            .zip(local)
            .map(|(&h, local_hash)| StoredBlock {
                engine_hash: EngineBlockHash(h),
                local_hash,
            })
            .collect();
        Ok((tier, KvEventData::Stored { parent, blocks }))
    }

    /// A rank's batches were lost for good: drop what it held and tell the router so.
    pub fn clear_rank(&mut self, rank: DpRank) -> Option<KvEvent> {
        let slot = self.slot(rank)?;
        let key = self.key(rank);
        self.index.remove_worker_rank(key);
        self.remember(slot, Tier::Device, &KvEventData::Cleared);
        Some(self.next_event(slot, key, Tier::Device, KvEventData::Cleared))
    }

    /// A new worker instance (the engine process started again): every rank's cache is
    /// gone and event ids start again at 0.
    pub fn new_instance(&mut self) {
        for i in 0..self.last_ids.len() as u32 {
            self.index
                .remove_worker_rank(self.key(self.dp_start_rank + i));
        }
        self.last_ids.iter_mut().for_each(|l| *l = None);
        self.refs.clear();
        self.lineage = Lineage {
            cap: self.lineage.cap,
            ..Lineage::default()
        };
    }

    /// What `rank` holds as events that rebuild it (parents first), each carrying the last
    /// event id forwarded; `None` if `rank` is not one of this worker's.
    pub fn snapshot(&self, rank: DpRank) -> Option<(Vec<KvEvent>, Option<EventId>)> {
        let slot = self.slot(rank)?;
        let last = self.last_ids[slot];
        let mut events = self
            .index
            .dump(self.key(rank))
            .map(|d| d.events)
            .unwrap_or_default();
        for e in &mut events {
            e.event_id = last.unwrap_or(0);
        }
        Some((events, last))
    }
}

/// The tier an engine's `medium` names (vLLM's offloading connector, LMCache, SGLang's
/// hierarchical cache and Dynamo's block manager spell them differently); blocks of another
/// node (`locality` other than `LOCAL`) are not this worker's.
pub fn tier_of(medium: Option<&str>, locality: Option<&str>) -> Result<Tier, Skip> {
    if !locality.is_none_or(|l| l.eq_ignore_ascii_case("LOCAL")) {
        return Err(Skip::OtherNode);
    }
    let Some(m) = medium else {
        return Ok(Tier::Device);
    };
    const NAMES: [(&str, Tier); 13] = [
        ("GPU", Tier::Device),
        ("CPU", Tier::Host),
        ("CPU_PINNED", Tier::Host),
        ("CPU_TIER1", Tier::Host),
        ("DISK", Tier::Disk),
        ("CPU_TIER2", Tier::Disk),
        ("NVME", Tier::Disk),
        // vLLM's offloading connector's MEDIUM_STORAGE: the worker's own storage backend.
        ("STORAGE", Tier::Disk),
        // vLLM 0.26's file-system and object-store tiers (0.33 folds them into STORAGE).
        ("FS", Tier::Disk),
        ("OBJ", Tier::Shared),
        ("EXTERNAL", Tier::Shared),
        ("SHARED", Tier::Shared),
        ("REMOTE", Tier::Shared),
    ];
    NAMES
        .iter()
        .find(|(name, _)| m.eq_ignore_ascii_case(name))
        .map(|&(_, t)| t)
        .ok_or(Skip::UnknownMedium)
}

/// The extra key a block hashed with lookahead tokens gets: `lookahead:` and the tokens.
pub const LOOKAHEAD_KEY: &str = "lookahead:";

/// The router's local hashes of a stored run: the LoRA (its name, else its decimal id) seeds
/// the hash; each block's extra keys other than the LoRA name go in as a route request's
/// [`PromptExtras`] would put them, and the salt on the run's block 0 only when that is the
/// sequence's block 0 (no parent): SGLang names the salt on every run of a salted request,
/// continuations included, but a route request salts only the prompt's first block (the
/// salted root keeps different salts apart; the blocks after it chain from it).
fn local_hashes(s: &Stored, bs: usize) -> Vec<LocalBlockHash> {
    let lora_id_name = s.lora_id.map(|id| id.to_string());
    let lora = s.lora_name.as_deref().or(lora_id_name.as_deref());
    let mut block_extras: Vec<Extras> = s
        .extra_keys
        .iter()
        .map(|keys| {
            let mut keys: Extras = keys.clone().unwrap_or_default();
            // The LoRA is in the seed already.
            if let Some(i) = keys.iter().position(|k| Some(k.as_str()) == lora) {
                keys.remove(i);
            }
            keys
        })
        .collect();
    // A block whose engine hash covers tokens after it (vLLM's lookahead hashing) is cached
    // only for prompts that go on with those tokens; a route request hashes a block's own
    // tokens, so such a block gets a key no route request names: it never claims a match
    // the engine would not honour (nor does what chains from it).
    for (i, tokens) in s.lookahead.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        if block_extras.len() <= i {
            block_extras.resize(i + 1, Extras::new());
        }
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        block_extras[i].push(format!("{LOOKAHEAD_KEY}{}", list.join(",")));
    }
    let extras = PromptExtras {
        block_extras,
        cache_salt: s.cache_salt.clone().filter(|_| s.parent.is_none()),
    };
    prompt_local_hashes(&s.token_ids, bs, lora, Some(&extras)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BS: u32 = 2;

    #[derive(Debug, Clone)]
    enum Op {
        /// Store `n` blocks on a parent chosen among the hashes seen (or none).
        Store {
            parent: Option<usize>,
            n: u8,
            seed: u8,
        },
        Remove {
            pick: Vec<usize>,
        },
        Clear,
        /// A rank's batches lost for good.
        Lost,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (proptest::option::of(0usize..64), 1u8..4, any::<u8>())
                .prop_map(|(parent, n, seed)| Op::Store { parent, n, seed }),
            3 => proptest::collection::vec(0usize..64, 1..4).prop_map(|pick| Op::Remove { pick }),
            1 => Just(Op::Clear),
            1 => Just(Op::Lost),
        ]
    }

    /// A store without tokens (an engine re-announcing blocks) takes the local hashes the
    /// mirror already has for those engine hashes, and is refused for blocks it has not.
    #[test]
    fn stores_without_tokens_use_the_mirror() {
        let mut m = WorkerMirror::new(5, 0, 1, BS, 100);
        let store = |hashes: Vec<u64>, tokens: Vec<u32>| {
            Ok(EngineEvent::Stored(Stored {
                block_hashes: hashes,
                token_ids: tokens,
                block_size: BS,
                ..Stored::default()
            }))
        };
        let first = m.apply(0, &[store(vec![1, 2], vec![7, 8, 9, 10])]).unwrap();
        let KvEventData::Stored {
            blocks: with_tokens,
            ..
        } = &first[0].data
        else {
            panic!()
        };
        let again = m.apply(0, &[store(vec![1, 2], vec![])]).unwrap();
        let KvEventData::Stored {
            blocks: from_mirror,
            ..
        } = &again[0].data
        else {
            panic!()
        };
        assert_eq!(from_mirror, with_tokens);
        assert!(m.apply(0, &[store(vec![3], vec![])]).unwrap().is_empty());
        assert_eq!(m.skipped(Skip::NoTokens), 1);
        assert!(m
            .apply(0, &[store(vec![4], vec![1, 2, 3])])
            .unwrap()
            .is_empty());
        assert_eq!(m.skipped(Skip::TokenCount), 1);
    }

    fn placeholder(hash: u64, medium: &str) -> Result<EngineEvent, EventError> {
        Ok(EngineEvent::Stored(Stored {
            block_hashes: vec![hash],
            block_size: 0,
            medium: Some(medium.into()),
            ..Stored::default()
        }))
    }

    fn removed(hash: u64, medium: &str) -> Result<EngineEvent, EventError> {
        Ok(EngineEvent::Removed {
            block_hashes: vec![hash],
            medium: Some(medium.into()),
            group_idx: None,
            locality: None,
        })
    }

    /// vLLM's offload placeholders (a hash, no tokens, no parent, block size 0) land under
    /// the prefix their block had on the device, even once the device dropped it: a
    /// replica following the mirror finds the offloaded tail of a prompt in the host tier.
    /// A hash the mirror never saw is skipped.
    #[test]
    fn offload_placeholders_land_where_their_blocks_were() {
        let tokens: Vec<u32> = (1..=6).collect();
        let mut m = WorkerMirror::new(5, 0, 1, BS, 100);
        let mut replica = Index::new();
        fn follow_in(
            m: &mut WorkerMirror,
            replica: &mut Index,
            evs: &[Result<EngineEvent, EventError>],
        ) -> Vec<KvEvent> {
            let out = m.apply(0, evs).unwrap();
            for e in &out {
                replica.apply(e).unwrap();
            }
            out
        }
        follow_in(
            &mut m,
            &mut replica,
            &[Ok(EngineEvent::Stored(Stored {
                block_hashes: vec![1, 2, 3],
                token_ids: tokens.clone(),
                block_size: BS,
                ..Stored::default()
            }))],
        );
        // Blocks 2 and 3 offloaded, then dropped from the device.
        let out = follow_in(
            &mut m,
            &mut replica,
            &[placeholder(2, "CPU"), placeholder(3, "CPU")],
        );
        assert_eq!(out.len(), 2);
        let KvEventData::Stored { parent, .. } = &out[0].data else {
            panic!("{out:?}")
        };
        assert_eq!(*parent, Some(EngineBlockHash(1)));
        follow_in(
            &mut m,
            &mut replica,
            &[Ok(EngineEvent::Removed {
                block_hashes: vec![2, 3],
                medium: None,
                group_idx: None,
                locality: None,
            })],
        );
        let local = prompt_local_hashes(&tokens, BS as usize, None, None).unwrap();
        let found = replica.find_matches(&local);
        let key = WorkerKey::new(5, 0);
        let tiers = found.tier_blocks(key);
        assert_eq!((tiers.device, tiers.host), (1, 2), "{found:?}");
        // Dropped from the device, a block is still placed by what the mirror remembers.
        assert_eq!(
            follow_in(&mut m, &mut replica, &[placeholder(3, "STORAGE")]).len(),
            1
        );
        // Never seen: skipped, never at the root.
        assert!(follow_in(&mut m, &mut replica, &[placeholder(99, "CPU")]).is_empty());
        assert_eq!(m.skipped(Skip::NoTokens), 1);
    }

    /// An offloaded block announced twice (two chunks sharing it) stays until its second
    /// removal; only that one goes to the router.
    #[test]
    fn repeated_offload_announcements_are_counted() {
        let mut m = WorkerMirror::new(5, 0, 1, BS, 100);
        let stored = Ok(EngineEvent::Stored(Stored {
            block_hashes: vec![1],
            token_ids: vec![1, 2],
            block_size: BS,
            ..Stored::default()
        }));
        m.apply(0, &[stored]).unwrap();
        assert_eq!(
            m.apply(0, &[placeholder(1, "CPU"), placeholder(1, "CPU")])
                .unwrap()
                .len(),
            2
        );
        assert!(m.apply(0, &[removed(1, "CPU")]).unwrap().is_empty());
        let last = m.apply(0, &[removed(1, "CPU")]).unwrap();
        assert!(
            matches!(
                &last[..],
                [KvEvent {
                    tier: Tier::Host,
                    data: KvEventData::Removed { .. },
                    ..
                }]
            ),
            "{last:?}"
        );
        // A third removal: the block is gone (unknown, as before).
        assert!(m.apply(0, &[removed(1, "CPU")]).unwrap().is_empty());
        assert_eq!(m.skipped(Skip::UnknownBlocks), 1);
    }

    /// A block hashed with the tokens after it (vLLM's lookahead) never matches a route
    /// request of its own tokens; the blocks before it still do.
    #[test]
    fn a_lookahead_block_claims_no_match() {
        let tokens: Vec<u32> = (1..=6).collect();
        let mut m = WorkerMirror::new(5, 0, 1, BS, 100);
        let out = m
            .apply(
                0,
                &[Ok(EngineEvent::Stored(Stored {
                    block_hashes: vec![1, 2, 3],
                    token_ids: tokens.clone(),
                    block_size: BS,
                    lookahead: vec![vec![], vec![], vec![7, 8]],
                    ..Stored::default()
                }))],
            )
            .unwrap();
        let KvEventData::Stored { blocks, .. } = &out[0].data else {
            panic!("{out:?}")
        };
        let route =
            prompt_local_hashes(&[tokens, vec![7, 8]].concat(), BS as usize, None, None).unwrap();
        assert_eq!(blocks[0].local_hash, route[0]);
        assert_eq!(blocks[1].local_hash, route[1]);
        assert!(
            !route.contains(&blocks[2].local_hash),
            "the lookahead block matches a route request"
        );
    }

    /// Every medium vLLM and SGLang name today has its tier (SGLang's StorageMedium: GPU,
    /// CPU_PINNED, DISK, EXTERNAL; vLLM 0.33's: GPU, CPU, STORAGE; 0.26's FS and OBJ), in
    /// any case.
    #[test]
    fn the_engines_media_name_tiers() {
        for (m, t) in [
            ("GPU", Tier::Device),
            ("CPU", Tier::Host),
            ("cpu_pinned", Tier::Host),
            ("DISK", Tier::Disk),
            ("STORAGE", Tier::Disk),
            ("FS", Tier::Disk),
            ("OBJ", Tier::Shared),
            ("EXTERNAL", Tier::Shared),
        ] {
            assert_eq!(tier_of(Some(m), None), Ok(t), "{m}");
        }
        assert_eq!(tier_of(None, Some("LOCAL")), Ok(Tier::Device));
        assert_eq!(tier_of(Some("TAPE"), None), Err(Skip::UnknownMedium));
        assert_eq!(tier_of(Some("GPU"), Some("REMOTE")), Err(Skip::OtherNode));
    }

    /// A salted conversation as SGLang stores it (a root run, then a continuation, each
    /// naming the salt) hashes as a route request of the whole prompt with that salt does
    /// (so it matches in full); another salt shares no block with it, from the root on.
    #[test]
    fn a_salted_conversation_hashes_as_its_route_request() {
        let tokens: Vec<u32> = (1..=8).collect();
        let run = |salt: &str| {
            let mut m = WorkerMirror::new(5, 0, 1, BS, 100);
            let store = |hashes: Vec<u64>, parent: Option<u64>, tokens: &[u32]| {
                Ok(EngineEvent::Stored(Stored {
                    block_hashes: hashes,
                    parent,
                    token_ids: tokens.to_vec(),
                    block_size: BS,
                    cache_salt: Some(salt.to_string()),
                    ..Stored::default()
                }))
            };
            let out = m
                .apply(
                    0,
                    &[
                        store(vec![1, 2], None, &tokens[..4]),
                        store(vec![3, 4], Some(2), &tokens[4..]),
                    ],
                )
                .unwrap();
            out.iter()
                .flat_map(|e| match &e.data {
                    KvEventData::Stored { blocks, .. } => {
                        blocks.iter().map(|b| b.local_hash).collect::<Vec<_>>()
                    }
                    _ => panic!("{e:?}"),
                })
                .collect::<Vec<_>>()
        };
        let route = |salt: &str| {
            let extras = PromptExtras {
                cache_salt: Some(salt.to_string()),
                ..PromptExtras::default()
            };
            prompt_local_hashes(&tokens, BS as usize, None, Some(&extras)).unwrap()
        };
        assert_eq!(run("tenant-a"), route("tenant-a"));
        let (a, b) = (run("tenant-a"), run("tenant-b"));
        assert_ne!(a[0], b[0], "different salts, one root");
        let unsalted = prompt_local_hashes(&tokens, BS as usize, None, None).unwrap();
        assert_ne!(a[0], unsalted[0]);
        // Past the root the chain carries the salt (the index walks from the root).
        assert_eq!(a[1..], unsalted[1..]);
    }

    proptest! {
        /// A replica applying exactly the forwarded events (ids checked, gap-free) holds what
        /// the mirror holds, and so does one that loads the mirror's snapshot instead (blocks
        /// cut off from the root by a removed ancestor match nothing and are not compared).
        #[test]
        fn replicas_following_the_mirror_hold_what_it_holds(
            ops in proptest::collection::vec((0u32..2, op()), 1..80),
            capacity in 4u64..40,
        ) {
            let mut mirror = WorkerMirror::new(5, 0, 2, BS, capacity);
            let mut replica = Index::new();
            replica.set_block_limit(5, Some(block_limit_for_capacity(capacity as usize)));
            let mut seen: Vec<u64> = Vec::new();
            let mut next_hash = 1u64;
            for (rank, op) in ops {
                let forwarded = match op {
                    Op::Store { parent, n, seed } => {
                        let parent = parent.and_then(|i| seen.get(i % seen.len().max(1)).copied());
                        let hashes: Vec<u64> = (0..n).map(|_| { next_hash += 1; next_hash }).collect();
                        seen.extend(&hashes);
                        let tokens = (0..u32::from(n) * BS).map(|t| t + u32::from(seed)).collect();
                        let ev = Ok(EngineEvent::Stored(Stored {
                            block_hashes: hashes,
                            parent,
                            token_ids: tokens,
                            block_size: BS,
                            ..Stored::default()
                        }));
                        mirror.apply(rank, &[ev]).unwrap()
                    }
                    Op::Remove { pick } => {
                        let hashes = pick.iter().filter_map(|&i| seen.get(i % seen.len().max(1)).copied()).collect();
                        let ev = Ok(EngineEvent::Removed { block_hashes: hashes, medium: None, group_idx: None, locality: None });
                        mirror.apply(rank, &[ev]).unwrap()
                    }
                    Op::Clear => mirror.apply(rank, &[Ok(EngineEvent::Cleared)]).unwrap(),
                    Op::Lost => vec![mirror.clear_rank(rank).unwrap()],
                };
                for e in &forwarded {
                    let applied = replica.apply(e);
                    prop_assert!(applied.is_ok(), "{:?}: {:?}", e, applied);
                    prop_assert_eq!(applied.unwrap().gap, 0);
                }
            }
            for rank in 0..2 {
                let key = WorkerKey::new(5, rank);
                let (events, last) = mirror.snapshot(rank).unwrap();
                prop_assert_eq!(replica.last_event_id(key), last);
                let followed = replica.dump(key).map(|d| d.events).unwrap_or_default();
                let strip = |v: &[KvEvent]| v.iter().map(|e| e.data.clone()).collect::<Vec<_>>();
                prop_assert_eq!(strip(&followed), strip(&events));
                prop_assert_eq!(replica.held_blocks(key), mirror.held_blocks(rank));

                let mut loaded = Index::new();
                for e in &events {
                    loaded.apply_unsequenced(key, &e.data).unwrap();
                }
                let reloaded = loaded.dump(key).map(|d| d.events).unwrap_or_default();
                prop_assert_eq!(strip(&reloaded), strip(&events));
            }
        }
    }
}
