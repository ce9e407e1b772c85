//! Payloads made by the pinned vLLM and SGLang releases' own classes (and, for the older forms
//! no pinned release sends, classes declared field for field: /tests/engines/engine_wire.py)
//! decode to what the engine meant, in every wire form, and turn into the router's events;
//! and any payload at all decodes in work and memory linear in its length ([`bounds`]).

mod bounds;

/// Counts what each test thread allocates, for [`bounds`].
#[global_allocator]
static ALLOC: kvrouter_testkit::CountingAlloc = kvrouter_testkit::CountingAlloc;

use kvrouter_bridge::{decode_batch, EngineBatch, EngineEvent, EventError, Skip, WorkerMirror};
use kvrouter_protocol::{
    local_block_hash_with_extras, local_block_hashes, lora_seed, prompt_local_hashes,
    EngineBlockHash, KvEvent, KvEventData, LocalBlockHash, PromptExtras, Tier, BASE_SEED,
};
use std::collections::HashMap;
use std::process::Command;
use xxhash_rust::xxh3::xxh3_64;

const BIG: u64 = u64::MAX;

fn cases() -> HashMap<String, Vec<u8>> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/engines/engine_wire.py"
    );
    let out = Command::new("python3")
        .args([script, "cases"])
        .output()
        .expect("python3 runs (scripts/setup.sh installs what the tests need)");
    assert!(
        out.status.success(),
        "engine_wire.py failed (msgspec or the engines missing? source scripts/setup.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let hex = v["payload"].as_str().unwrap();
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (v["name"].as_str().unwrap().to_string(), bytes)
        })
        .collect()
}

fn batch(cases: &HashMap<String, Vec<u8>>, name: &str) -> EngineBatch {
    decode_batch(&cases[name]).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn ok_events(b: &EngineBatch) -> Vec<EngineEvent> {
    b.events.iter().map(|e| e.clone().unwrap()).collect()
}

fn plain(tokens: &[u32], lora: Option<&str>) -> Vec<LocalBlockHash> {
    local_block_hashes(tokens, 4, lora).unwrap()
}

const T8: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

/// Every form decodes to the same events: stored (with a hash above 2^63), removed, cleared.
#[test]
fn vllm_map_and_array_forms_agree() {
    let c = cases();
    for (name, rank) in [("vllm_map", 0), ("vllm_array", 1)] {
        let b = batch(&c, name);
        assert_eq!(b.data_parallel_rank, Some(rank), "{name}");
        let ev = ok_events(&b);
        assert_eq!(ev.len(), 3, "{name}");
        let EngineEvent::Stored(s) = &ev[0] else {
            panic!("{name}: {:?}", ev[0])
        };
        assert_eq!(s.block_hashes, vec![BIG, 7]);
        assert_eq!(s.parent, None);
        assert_eq!(s.token_ids, T8);
        assert_eq!(s.block_size, 4);
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert_eq!(s.group_idx, Some(0));
        assert_eq!(s.spec_kind.as_deref(), Some("full_attention"));
        assert!(
            matches!(&ev[1], EngineEvent::Removed { block_hashes, .. } if block_hashes == &[7])
        );
        assert_eq!(ev[2], EngineEvent::Cleared);

        let mut m = WorkerMirror::new(9, rank, 1, 4, 1000);
        let out = m.apply(rank, &b.events).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(
            out.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let KvEventData::Stored { blocks, parent } = &out[0].data else {
            panic!()
        };
        assert_eq!(*parent, None);
        let locals: Vec<_> = blocks.iter().map(|b| b.local_hash).collect();
        assert_eq!(locals, plain(&T8, None));
        assert_eq!(blocks[0].engine_hash, EngineBlockHash(BIG));
    }
}

#[test]
fn byte_digests_fold_to_u64_and_link_parents() {
    let c = cases();
    let b = batch(&c, "vllm_bytes");
    let ev = ok_events(&b);
    let (a, bb) = (
        xxh3_64(&(0u8..32).collect::<Vec<_>>()),
        xxh3_64(&(32u8..64).collect::<Vec<_>>()),
    );
    let EngineEvent::Stored(s) = &ev[1] else {
        panic!()
    };
    assert_eq!(s.block_hashes, vec![bb]);
    assert_eq!(s.parent, Some(a));
    assert_eq!(b.data_parallel_rank, None);
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &b.events).unwrap();
    assert_eq!(
        out.len(),
        3,
        "the child links to its parent by the folded digest"
    );
    assert_eq!(m.held_blocks(0), 1);
}

#[test]
fn lora_name_seeds_the_hash_and_leaves_the_extras() {
    let c = cases();
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &batch(&c, "vllm_lora").events).unwrap();
    let KvEventData::Stored { blocks, .. } = &out[0].data else {
        panic!()
    };
    let locals: Vec<_> = blocks.iter().map(|b| b.local_hash).collect();
    assert_eq!(locals, plain(&T8, Some("ad1")));
    assert_ne!(locals, plain(&T8, None));

    // A lora_id without a name hashes as the LoRA named by the id.
    let out = m.apply(0, &batch(&c, "vllm_lora_id_only").events).unwrap();
    let KvEventData::Stored { blocks, .. } = &out[0].data else {
        panic!()
    };
    assert_eq!(blocks[0].local_hash, plain(&T8[..4], Some("3"))[0]);
}

#[test]
fn salt_and_multimodal_keys_change_the_hash() {
    let c = cases();
    let b = batch(&c, "vllm_salt_mm");
    let EngineEvent::Stored(s) = &ok_events(&b)[0] else {
        panic!()
    };
    assert_eq!(
        s.extra_keys,
        vec![
            Some(vec!["img-abc".into(), "2".into(), "salt-1".into()]),
            Some(vec!["img-abc".into(), "-2".into()])
        ]
    );
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &b.events).unwrap();
    let KvEventData::Stored { blocks, .. } = &out[0].data else {
        panic!()
    };
    let plain = plain(&T8, None);
    assert_ne!(blocks[0].local_hash, plain[0]);
    assert_ne!(blocks[1].local_hash, plain[1]);
    assert_eq!(
        blocks[0].local_hash,
        local_block_hash_with_extras(&T8[..4], BASE_SEED, &["img-abc", "2", "salt-1"])
    );
    // A route request naming the same image and salt hashes its blocks the same way.
    let extras = PromptExtras {
        block_extras: vec![
            vec!["img-abc".into(), "2".into()],
            vec!["img-abc".into(), "-2".into()],
        ],
        cache_salt: Some("salt-1".into()),
    };
    let request = prompt_local_hashes(&T8, 4, None, Some(&extras)).unwrap();
    assert_eq!(
        request,
        blocks.iter().map(|b| b.local_hash).collect::<Vec<_>>()
    );
}

#[test]
fn lower_tiers_are_forwarded_and_remote_blocks_unknown_media_and_other_groups_skipped() {
    let c = cases();
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &batch(&c, "vllm_cpu").events).unwrap();
    let tiers: Vec<Tier> = out.iter().map(|e| e.tier).collect();
    use Tier::{Device, Disk, Host};
    assert_eq!(tiers, [Host, Host, Device, Host, Device, Disk], "{out:?}");
    // The host copy named by hash alone gets the device copy's local hash.
    let stored_local = |e: &KvEvent| match &e.data {
        KvEventData::Stored { blocks, .. } => blocks[0].local_hash,
        other => panic!("{other:?}"),
    };
    assert_eq!(stored_local(&out[3]), stored_local(&out[2]));
    assert_eq!(stored_local(&out[3]), plain(&T8[..4], None)[0]);
    assert_eq!(
        (m.skipped(Skip::OtherNode), m.skipped(Skip::UnknownMedium)),
        (1, 1)
    );
    assert_eq!(m.held_blocks(0), 0, "nothing left on the device");
    let (snapshot, _) = m.snapshot(0).unwrap();
    let mut kept: Vec<Tier> = snapshot.iter().map(|e| e.tier).collect();
    kept.sort_by_key(|t| t.as_str());
    assert_eq!(
        kept,
        [Disk, Host],
        "the mirror keeps the host and storage copies"
    );
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);

    let out = m.apply(0, &batch(&c, "vllm_groups").events).unwrap();
    assert_eq!(out.len(), 1, "only the full-attention block");
    assert_eq!(
        m.skipped(Skip::OtherGroup),
        2,
        "the sliding-window store and its removal"
    );
    assert_eq!(m.held_blocks(0), 1);
}

#[test]
fn the_oldest_vllm_form_decodes() {
    let c = cases();
    let b = batch(&c, "vllm_oldest");
    assert_eq!(b.ts, 8.0);
    assert_eq!(b.data_parallel_rank, None);
    let EngineEvent::Stored(s) = &ok_events(&b)[0] else {
        panic!()
    };
    assert_eq!(s.block_hashes, vec![51, 52]);
    assert_eq!(s.medium, None);
}

#[test]
fn an_unknown_event_type_is_skipped_and_the_next_one_kept() {
    let c = cases();
    let b = batch(&c, "unknown_then_good");
    assert_eq!(
        b.events[0],
        Err(EventError::UnknownType("BlockMoved".into()))
    );
    assert!(matches!(b.events[1], Ok(EngineEvent::Stored(_))));
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &b.events).unwrap();
    assert_eq!((out.len(), out[0].event_id), (1, 0));
    assert_eq!(m.skipped(Skip::UnknownType), 1);
}

#[test]
fn another_block_size_is_refused() {
    let c = cases();
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &batch(&c, "block_size_other").events).unwrap();
    assert!(out.is_empty());
    assert_eq!(m.skipped(Skip::BlockSize), 1);
}

/// vLLM 0.26 named its storage tiers FS and OBJ (0.33 has one, STORAGE).
#[test]
fn vllm_0_26_storage_media_are_tiers() {
    let c = cases();
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &batch(&c, "vllm26_media").events).unwrap();
    let tiers: Vec<Tier> = out.iter().map(|e| e.tier).collect();
    assert_eq!(tiers, [Tier::Disk, Tier::Shared], "{out:?}");
}

#[test]
fn sglang_forms_signed_hashes_and_salt() {
    let c = cases();
    // 0.5.3: array events, no medium, the rank as `attn_dp_rank`.
    let b = batch(&c, "sglang_array");
    assert_eq!(b.data_parallel_rank, Some(1));
    let ev = ok_events(&b);
    let EngineEvent::Stored(first) = &ev[0] else {
        panic!()
    };
    assert_eq!(first.block_hashes, vec![(-5i64) as u64]);
    let EngineEvent::Stored(second) = &ev[1] else {
        panic!()
    };
    assert_eq!(second.parent, Some((-5i64) as u64));
    let EngineEvent::Removed {
        block_hashes,
        medium,
        ..
    } = &ev[2]
    else {
        panic!()
    };
    assert_eq!((block_hashes, medium), (&vec![9], &None));
    let mut m = WorkerMirror::new(9, 1, 1, 4, 1000);
    assert_eq!(m.apply(1, &b.events).unwrap().len(), 3);

    // The array form with a metadata map (between those releases): the salt is read.
    let b = batch(&c, "sglang_array_metadata");
    let EngineEvent::Stored(s) = &ok_events(&b)[1] else {
        panic!()
    };
    assert_eq!(
        (s.parent, s.cache_salt.as_deref()),
        (Some((-5i64) as u64), Some("t"))
    );

    // 0.5.23: map events naming the salt on every run of a salted request.
    let b = batch(&c, "sglang_map");
    assert_eq!(b.data_parallel_rank, Some(0));
    let ev = ok_events(&b);
    let EngineEvent::Stored(s) = &ev[0] else {
        panic!()
    };
    assert_eq!(
        (s.block_hashes[0], s.cache_salt.as_deref()),
        ((-5i64) as u64, Some("t"))
    );
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &b.events).unwrap();
    let stored = |i: usize| match &out[i].data {
        KvEventData::Stored { blocks, .. } => blocks[0].local_hash,
        other => panic!("{other:?}"),
    };
    // The root run is salted at its block 0, as a route request salts its prompt's; the
    // continuation is not (its block is not the sequence's first).
    assert_eq!(
        stored(0),
        local_block_hash_with_extras(&T8[..4], lora_seed(None), &["t"])
    );
    assert_eq!(
        stored(1),
        local_block_hash_with_extras::<&str>(&T8[4..], lora_seed(None), &[])
    );
    // CPU_PINNED: the host tier.
    assert_eq!(out[2].tier, Tier::Host);
}

/// vLLM 0.33's `lookahead_token_ids` (and `session_id`, ignored): the block hashed with
/// the tokens after it gets a key no route request names.
#[test]
fn lookahead_tokens_are_read_and_keep_their_block_from_matching() {
    let c = cases();
    let b = batch(&c, "vllm_lookahead");
    let EngineEvent::Stored(s) = &ok_events(&b)[0] else {
        panic!()
    };
    assert_eq!(s.lookahead, vec![vec![], vec![9, 10]]);
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    let out = m.apply(0, &b.events).unwrap();
    let KvEventData::Stored { blocks, .. } = &out[0].data else {
        panic!()
    };
    let route = plain(&T8, None);
    assert_eq!(blocks[0].local_hash, route[0]);
    assert_ne!(blocks[1].local_hash, route[1]);
}

#[test]
fn garbage_is_a_typed_error_never_a_panic() {
    let c = cases();
    let good = &c["vllm_map"];
    for cut in 0..good.len() {
        let _ = decode_batch(&good[..cut]);
    }
    assert!(decode_batch(&[]).is_err());
    assert!(decode_batch(&[0xc1]).is_err());
    assert!(decode_batch(b"\x93\xcb").is_err());
    // A claimed 4-billion-element array in a few bytes.
    assert!(decode_batch(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
}
