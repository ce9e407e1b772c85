//! Whatever a payload holds or claims, decoding it costs work and memory linear in its
//! length (issue 26: 8 bytes once grew the bridge to gigabytes), and the good events around
//! a bad one still decode, in order.
//!
//! Work is the msgpack values visited ([`decode_batch_steps`]); memory is the bytes the test
//! thread allocates while decoding (the counting allocator of `main.rs`), the result's own
//! included. Never a wall-clock time.

use kvrouter_bridge::engine_event::{DETAILED_ERRORS, TAG_MAX};
use kvrouter_bridge::{decode_batch_steps, BatchError, EngineBatch, EngineEvent, EventError};
use kvrouter_bridge::{Skip, Stored, WorkerMirror};
use kvrouter_testkit::allocated_during;
use proptest::prelude::*;
use rmp::encode as w;

/// Values visited per payload byte. Every value takes at least its one marker byte, and the
/// decoder reads each event's bytes twice (once stepping over it as a whole to find where
/// it ends, once decoding it from exactly those bytes) and everything else once.
const STEPS_PER_BYTE: u64 = 2;

/// Bytes allocated per payload byte. The costliest shapes, measured (`BOUNDS_REPORT=1`
/// prints each large payload's figures): floats in a block's extra keys (a 9-byte f64 is up
/// to ~330 characters printed, plus its `String` in a list that may double: ~41 a byte);
/// many 15-byte events (the smallest usable, `["BlockRemoved", []]`) in ~250-byte slots of
/// a list that may double (~33); one-byte integers in extra keys (~27). Every other list
/// costs at most 8 bytes an element (a block hash), and bad events past the first few cost
/// nothing. 64 leaves room without hiding a per-element description (~100 bytes a byte).
const ALLOC_PER_BYTE: u64 = 64;

/// Bytes allocated whatever the length: the first [`DETAILED_ERRORS`] bad events' slots and
/// descriptions (a tag of at most [`TAG_MAX`] bytes and a message of about a hundred).
const ALLOC_FIXED: u64 = 8 * 1024;

/// Decodes `payload`, asserting the bounds.
fn decode(payload: &[u8]) -> Result<EngineBatch, BatchError> {
    let ((res, steps), bytes) = allocated_during(|| decode_batch_steps(payload));
    let len = payload.len() as u64;
    // The figures behind the constants above.
    if std::env::var_os("BOUNDS_REPORT").is_some() && len > 1000 {
        eprintln!(
            "{len} bytes: {steps} steps, {bytes} allocated ({:.1}/byte)",
            bytes as f64 / len as f64
        );
    }
    assert!(
        steps <= STEPS_PER_BYTE * len,
        "{steps} values visited for {len} bytes"
    );
    assert!(
        bytes <= ALLOC_PER_BYTE * len + ALLOC_FIXED,
        "{bytes} bytes allocated for {len} bytes"
    );
    res
}

fn uint(b: &mut Vec<u8>, v: u64) {
    w::write_uint(b, v).unwrap();
}

fn nils(n: usize) -> Vec<u8> {
    vec![0xc0; n]
}

/// `[0, events]`: an array batch around events already encoded.
fn array_batch(n: u32, events: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    w::write_array_len(&mut b, 2).unwrap();
    uint(&mut b, 0);
    w::write_array_len(&mut b, n).unwrap();
    b.extend_from_slice(events);
    b
}

/// A good event, as encoded (array or map form) and as it should decode.
#[derive(Debug, Clone)]
enum Good {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
    },
    Removed(Vec<u64>),
    Cleared,
}

impl Good {
    fn encode(&self, map: bool, b: &mut Vec<u8>) {
        let hashes = |b: &mut Vec<u8>, h: &[u64]| {
            w::write_array_len(b, h.len() as u32).unwrap();
            for &x in h {
                uint(b, x);
            }
        };
        match (self, map) {
            (
                Good::Stored {
                    hashes: h,
                    parent,
                    tokens,
                    block_size,
                },
                _,
            ) => {
                if map {
                    w::write_map_len(b, 5).unwrap();
                    w::write_str(b, "type").unwrap();
                }
                if !map {
                    w::write_array_len(b, 5).unwrap();
                }
                w::write_str(b, "BlockStored").unwrap();
                if map {
                    w::write_str(b, "block_hashes").unwrap();
                }
                hashes(b, h);
                if map {
                    w::write_str(b, "parent_block_hash").unwrap();
                }
                match parent {
                    Some(p) => uint(b, *p),
                    None => w::write_nil(b).unwrap(),
                }
                if map {
                    w::write_str(b, "token_ids").unwrap();
                }
                w::write_array_len(b, tokens.len() as u32).unwrap();
                for &t in tokens {
                    uint(b, t.into());
                }
                if map {
                    w::write_str(b, "block_size").unwrap();
                }
                uint(b, (*block_size).into());
            }
            (Good::Removed(h), false) => {
                w::write_array_len(b, 2).unwrap();
                w::write_str(b, "BlockRemoved").unwrap();
                hashes(b, h);
            }
            (Good::Removed(h), true) => {
                w::write_map_len(b, 2).unwrap();
                w::write_str(b, "block_hashes").unwrap();
                hashes(b, h);
                w::write_str(b, "type").unwrap();
                w::write_str(b, "BlockRemoved").unwrap();
            }
            (Good::Cleared, false) => {
                w::write_array_len(b, 1).unwrap();
                w::write_str(b, "AllBlocksCleared").unwrap();
            }
            (Good::Cleared, true) => {
                w::write_map_len(b, 1).unwrap();
                w::write_str(b, "type").unwrap();
                w::write_str(b, "AllBlocksCleared").unwrap();
            }
        }
    }

    fn decoded(&self) -> EngineEvent {
        match self.clone() {
            Good::Stored {
                hashes,
                parent,
                tokens,
                block_size,
            } => EngineEvent::Stored(Stored {
                block_hashes: hashes,
                parent,
                token_ids: tokens,
                block_size,
                ..Stored::default()
            }),
            Good::Removed(block_hashes) => EngineEvent::Removed {
                block_hashes,
                medium: None,
                group_idx: None,
                locality: None,
            },
            Good::Cleared => EngineEvent::Cleared,
        }
    }
}

/// One msgpack value that is not a usable event (each of these is complete msgpack, so the
/// next event starts right after it).
fn bad_event(kind: u8, b: &mut Vec<u8>) {
    match kind % 10 {
        0 => w::write_nil(b).unwrap(),
        1 => uint(b, 7),
        2 => w::write_str(b, "BlockStored").unwrap(),
        3 => drop(w::write_array_len(b, 0).unwrap()),
        // Unknown type.
        4 => {
            w::write_array_len(b, 2).unwrap();
            w::write_str(b, "BlockMoved").unwrap();
            uint(b, 1);
        }
        // A map without a type.
        5 => {
            w::write_map_len(b, 1).unwrap();
            w::write_str(b, "block_hashes").unwrap();
            w::write_array_len(b, 0).unwrap();
        }
        // block_hashes of the wrong type, then fields the decoder never reaches.
        6 => {
            w::write_array_len(b, 5).unwrap();
            w::write_str(b, "BlockStored").unwrap();
            w::write_str(b, "not a list").unwrap();
            w::write_nil(b).unwrap();
            w::write_array_len(b, 2).unwrap();
            uint(b, 1);
            uint(b, 2);
            uint(b, 4);
        }
        // block_size missing.
        7 => {
            w::write_array_len(b, 2).unwrap();
            w::write_str(b, "BlockStored").unwrap();
            w::write_array_len(b, 1).unwrap();
            uint(b, 1);
        }
        // An extension value.
        8 => {
            w::write_ext_meta(b, 1, 5).unwrap();
            b.push(0);
        }
        // A hash list whose first element is a map (decoding stops inside it).
        _ => {
            w::write_array_len(b, 2).unwrap();
            w::write_str(b, "BlockRemoved").unwrap();
            w::write_array_len(b, 2).unwrap();
            w::write_map_len(b, 1).unwrap();
            w::write_nil(b).unwrap();
            w::write_nil(b).unwrap();
            uint(b, 9);
        }
    }
}

fn good() -> impl Strategy<Value = Good> {
    prop_oneof![
        4 => (
            proptest::collection::vec(any::<u64>(), 0..4),
            proptest::option::of(any::<u64>()),
            proptest::collection::vec(any::<u32>(), 0..9),
            0u32..64,
        )
            .prop_map(|(hashes, parent, tokens, block_size)| Good::Stored {
                hashes,
                parent,
                tokens,
                block_size
            }),
        2 => proptest::collection::vec(any::<u64>(), 0..4).prop_map(Good::Removed),
        1 => Just(Good::Cleared),
    ]
}

/// A batch's events: good ones (each in either form) and bad ones.
fn mixed() -> impl Strategy<Value = Vec<(Result<Good, u8>, bool)>> {
    proptest::collection::vec(
        (
            prop_oneof![3 => good().prop_map(Ok), 1 => any::<u8>().prop_map(Err)],
            any::<bool>(),
        ),
        0..24,
    )
}

fn encode_mixed(events: &[(Result<Good, u8>, bool)], map_batch: bool) -> Vec<u8> {
    let mut evs = Vec::new();
    for (e, map) in events {
        match e {
            Ok(g) => g.encode(*map, &mut evs),
            Err(k) => bad_event(*k, &mut evs),
        }
    }
    if !map_batch {
        return array_batch(events.len() as u32, &evs);
    }
    let mut b = Vec::new();
    w::write_map_len(&mut b, 3).unwrap();
    w::write_str(&mut b, "events").unwrap();
    w::write_array_len(&mut b, events.len() as u32).unwrap();
    b.extend_from_slice(&evs);
    w::write_str(&mut b, "ts").unwrap();
    w::write_f64(&mut b, 1.5).unwrap();
    w::write_str(&mut b, "data_parallel_rank").unwrap();
    uint(&mut b, 0);
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random bytes: an error or a batch, within the bounds, never a panic.
    #[test]
    fn random_bytes_decode_within_bounds(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = decode(&bytes);
    }

    /// Random bytes after a batch's start (so they are read as events and their fields).
    #[test]
    fn random_events_decode_within_bounds(
        n in 0u32..40,
        tail in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let _ = decode(&array_batch(n, &tail));
    }

    /// Good events around bad ones: the good ones decode, in order; every bad one is an
    /// error in its place (the first few) or counted.
    #[test]
    fn good_events_around_bad_ones_decode_in_order(events in mixed(), map_batch in any::<bool>()) {
        let payload = encode_mixed(&events, map_batch);
        let batch = decode(&payload).expect("a batch whose every event is one msgpack value");
        let want: Vec<EngineEvent> = events.iter().filter_map(|(e, _)| e.as_ref().ok()).map(Good::decoded).collect();
        let got: Vec<EngineEvent> = batch.events.iter().filter_map(|e| e.as_ref().ok()).cloned().collect();
        prop_assert_eq!(got, want);
        let bad = events.iter().filter(|(e, _)| e.is_err()).count();
        prop_assert_eq!(batch.bad_events(), bad as u64);
        let kept = batch.events.iter().filter(|e| e.is_err()).count();
        prop_assert_eq!(kept, bad.min(DETAILED_ERRORS));
        // Each kept error sits where its bad event was.
        let mut i = 0;
        for (e, _) in &events {
            match e {
                Ok(_) => { prop_assert!(batch.events[i].is_ok()); i += 1; }
                Err(_) if i < batch.events.len() && batch.events[i].is_err() => i += 1,
                Err(_) => {}
            }
        }
    }

    /// A good batch with bytes changed, cut or inserted: within the bounds.
    #[test]
    fn mutated_batches_decode_within_bounds(
        events in mixed(),
        map_batch in any::<bool>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
    ) {
        let mut payload = encode_mixed(&events, map_batch);
        for (at, byte, how) in edits {
            let i = at.index(payload.len() + 1);
            match how {
                0 if i < payload.len() => payload[i] = byte,
                1 => payload.insert(i, byte),
                _ => payload.truncate(i.max(1)),
            }
        }
        let _ = decode(&payload);
    }
}

/// The measure itself: this thread's allocations and growth, not another thread's.
#[test]
fn the_counting_allocator_counts_this_thread_only() {
    let (v, bytes) = allocated_during(|| {
        let mut v: Vec<u8> = Vec::with_capacity(1000);
        v.extend([1; 3000]);
        std::thread::spawn(|| vec![0u8; 1 << 20]).join().unwrap();
        v
    });
    assert!(v.capacity() >= 3000);
    // 1000, then growth to the final capacity; the thread's megabyte is not counted (its
    // spawning allocates a little here).
    assert!(
        (v.capacity() as u64..v.capacity() as u64 + 4096).contains(&bytes),
        "{bytes}"
    );
}

/// Issue 26's frame: an array batch whose events array claims 2^32-1 elements, then a nil.
#[test]
fn the_issue_26_frame_is_refused() {
    let frame = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0];
    let err = decode(&frame).unwrap_err();
    assert!(err.to_string().contains("claimed"), "{err}");
    // With more nils behind it, still refused, still linear.
    let mut long = frame[..7].to_vec();
    long.extend(nils(100_000));
    assert!(decode(&long).is_err());
}

/// 2^32-1 elements claimed by an array or a map, then nils, wherever they sit.
#[test]
fn huge_claimed_counts_followed_by_nils_are_refused() {
    let tail = nils(10_000);
    let mut cases: Vec<Vec<u8>> = Vec::new();
    for claim in [
        [0xdd, 0xff, 0xff, 0xff, 0xff],
        [0xdf, 0xff, 0xff, 0xff, 0xff],
    ] {
        // As the batch, as an event, as an event's hash list, as its extra keys.
        cases.push([&claim[..], &tail].concat());
        cases.push(array_batch(1, &[&claim[..], &tail].concat()));
        let mut ev = vec![0x92];
        w::write_str(&mut ev, "BlockRemoved").unwrap();
        cases.push(array_batch(1, &[&ev, &claim[..], &tail].concat()));
        let mut ev = vec![0x99];
        w::write_str(&mut ev, "BlockStored").unwrap();
        ev.extend([0x91, 0x01, 0xc0, 0xc0, 0x04, 0xc0, 0xc0, 0xc0]);
        cases.push(array_batch(1, &[&ev, &claim[..], &tail].concat()));
    }
    for c in cases {
        assert!(decode(&c).is_err(), "{:02x?}", &c[..12]);
    }
}

/// A million one-byte bad events: a batch of errors, the first few described and the rest
/// counted (not a million descriptions).
#[test]
fn a_megabyte_of_bad_events_costs_a_counter() {
    let n = 1_000_000;
    let payload = array_batch(n, &nils(n as usize));
    let ((res, _), bytes) = allocated_during(|| decode_batch_steps(&payload));
    let batch = res.unwrap();
    assert_eq!(batch.events.len(), DETAILED_ERRORS);
    assert_eq!(
        batch.more_bad.malformed,
        u64::from(n) - DETAILED_ERRORS as u64
    );
    assert_eq!(batch.bad_events(), u64::from(n));
    assert!(bytes <= ALLOC_FIXED, "{bytes} bytes for {n} nils");
    decode(&payload).unwrap();
    // The mirror counts every one of them.
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    m.skip_bad(&batch.more_bad);
    m.apply(0, &batch.events).unwrap();
    assert_eq!(m.skipped(Skip::Malformed), u64::from(n));
}

/// Nesting 100k deep as an event, as a block hash, in extra keys, and as the batch.
#[test]
fn deep_nesting_is_linear() {
    let deep = |n: usize| [vec![0x91; n], vec![0xc0]].concat();
    let d = deep(100_000);
    assert!(decode(&d).is_err());
    let b = decode(&array_batch(1, &d)).unwrap();
    assert!(matches!(&b.events[0], Err(EventError::Malformed { .. })));
    let mut ev = vec![0x92];
    w::write_str(&mut ev, "BlockRemoved").unwrap();
    let b = decode(&array_batch(1, &[&ev[..], &d].concat())).unwrap();
    assert!(b.events[0].is_err());
    // Extra keys flatten nested tuples: 100k levels around one string.
    let mut ev = vec![0x99];
    w::write_str(&mut ev, "BlockStored").unwrap();
    ev.extend([0x91, 0x01, 0xc0, 0xc0, 0x04, 0xc0, 0xc0, 0xc0, 0x91]);
    ev.extend(vec![0x91; 100_000]);
    w::write_str(&mut ev, "k").unwrap();
    let b = decode(&array_batch(1, &ev)).unwrap();
    let Ok(EngineEvent::Stored(s)) = &b.events[0] else {
        panic!("{:?}", b.events[0])
    };
    assert_eq!(s.extra_keys, vec![Some(vec!["k".to_string()])]);
    // Maps nested in maps, as an event.
    let mut m = [0x81, 0xc0].repeat(50_000);
    m.push(0xc0);
    assert!(decode(&array_batch(1, &m)).unwrap().events[0].is_err());
}

/// Strings, bytes and extensions claiming 4 GB in a few bytes.
#[test]
fn huge_claimed_lengths_are_refused() {
    for marker in [0xdb, 0xc6, 0xc9] {
        let claim = [marker, 0xff, 0xff, 0xff, 0xff];
        let tail = [&claim[..], &nils(1000)].concat();
        assert!(decode(&tail).is_err());
        assert!(decode(&array_batch(1, &tail)).is_err());
        let mut ev = vec![0x92];
        w::write_str(&mut ev, "BlockRemoved").unwrap();
        ev.push(0x91);
        assert!(decode(&array_batch(1, &[&ev[..], &tail].concat())).is_err());
    }
    // Every extension form, as an event: skipped, the next event kept.
    for ext in [
        vec![0xd4, 1, 0],
        vec![0xd5, 1, 0, 0],
        vec![0xd6, 1, 0, 0, 0, 0],
        vec![0xd7, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [vec![0xd8, 1], vec![0; 16]].concat(),
        vec![0xc7, 2, 1, 0, 0],
        vec![0xc8, 0, 1, 1, 0],
        vec![0xc9, 0, 0, 0, 1, 1, 0],
    ] {
        let mut evs = ext.clone();
        Good::Cleared.encode(false, &mut evs);
        let b = decode(&array_batch(2, &evs)).unwrap();
        assert!(b.events[0].is_err(), "{ext:02x?}");
        assert_eq!(b.events[1], Ok(EngineEvent::Cleared), "{ext:02x?}");
    }
}

/// Extra keys are the costliest to keep (a string each): integers and floats at their
/// worst, and long byte strings, within the bound.
#[test]
fn extra_keys_at_their_worst_are_within_bounds() {
    for (n, value) in [
        (60_000usize, vec![0x00]),
        (
            10_000,
            vec![0xcb, 0x7f, 0xef, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        ), // f64::MAX
        (10_000, vec![0xcb, 0, 0, 0, 0, 0, 0, 0, 1]), // the least subnormal
        (10_000, vec![0xca, 0, 0, 0, 1]),
        (10_000, vec![0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]), // i64::MIN
    ] {
        let mut ev = vec![0x99];
        w::write_str(&mut ev, "BlockStored").unwrap();
        ev.extend([0x91, 0x01, 0xc0, 0xc0, 0x04, 0xc0, 0xc0, 0xc0, 0x91]);
        w::write_array_len(&mut ev, n as u32).unwrap();
        for _ in 0..n {
            ev.extend(&value);
        }
        let b = decode(&array_batch(1, &ev)).unwrap();
        assert!(b.events[0].is_ok(), "{:?}", b.events[0]);
    }
    let mut ev = vec![0x99];
    w::write_str(&mut ev, "BlockStored").unwrap();
    ev.extend([0x91, 0x01, 0xc0, 0xc0, 0x04, 0xc0, 0xc0, 0xc0, 0x91, 0x91]);
    w::write_bin(&mut ev, &[0xab; 100_000]).unwrap();
    let b = decode(&array_batch(1, &ev)).unwrap();
    let Ok(EngineEvent::Stored(s)) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.extra_keys[0].as_ref().unwrap()[0], "ab".repeat(100_000));
}

/// The smallest usable events, many of them: each takes a slot of the batch.
#[test]
fn many_small_events_are_within_bounds() {
    for (g, map) in [
        (Good::Removed(vec![]), false),
        (Good::Cleared, false),
        (Good::Removed(vec![]), true),
    ] {
        for n in [1000, 1025, 70_000] {
            let mut evs = Vec::new();
            for _ in 0..n {
                g.encode(map, &mut evs);
            }
            let b = decode(&array_batch(n, &evs)).unwrap();
            assert_eq!(b.events.len(), n as usize);
        }
    }
}

/// Unknown and malformed events keep a bounded tag; the good events around them land.
#[test]
fn bad_event_descriptions_are_bounded() {
    let long = "X".repeat(100_000);
    let mut evs = Vec::new();
    Good::Cleared.encode(true, &mut evs);
    w::write_array_len(&mut evs, 1).unwrap();
    w::write_str(&mut evs, &long).unwrap();
    w::write_map_len(&mut evs, 2).unwrap();
    w::write_str(&mut evs, "type").unwrap();
    w::write_str(&mut evs, &format!("é{long}")).unwrap();
    w::write_str(&mut evs, "block_hashes").unwrap();
    w::write_nil(&mut evs).unwrap();
    Good::Removed(vec![3]).encode(false, &mut evs);
    let b = decode(&array_batch(4, &evs)).unwrap();
    assert_eq!(b.events[0], Ok(EngineEvent::Cleared));
    let Err(EventError::UnknownType(t)) = &b.events[1] else {
        panic!("{:?}", b.events[1])
    };
    assert_eq!(t.len(), TAG_MAX);
    let Err(EventError::Malformed { tag, why }) = &b.events[2] else {
        panic!("{:?}", b.events[2])
    };
    assert!(tag.len() <= TAG_MAX && tag.starts_with('é'), "{tag}");
    assert!(why.len() < 200, "{why}");
    assert_eq!(b.events[3], Ok(Good::Removed(vec![3]).decoded()));
}

/// The batch of the end-to-end test: a good event, a nil, a good event.
#[test]
fn good_bad_good() {
    let mut evs = Vec::new();
    let first = Good::Stored {
        hashes: vec![1],
        parent: None,
        tokens: vec![1, 2, 3, 4],
        block_size: 4,
    };
    first.encode(true, &mut evs);
    evs.push(0xc0);
    Good::Removed(vec![1]).encode(true, &mut evs);
    let b = decode(&array_batch(3, &evs)).unwrap();
    assert_eq!(b.events[0], Ok(first.decoded()));
    assert!(
        matches!(&b.events[1], Err(EventError::Malformed { why, .. }) if why.contains("Nil")),
        "{:?}",
        b.events[1]
    );
    assert_eq!(b.events[2], Ok(Good::Removed(vec![1]).decoded()));
    let mut m = WorkerMirror::new(9, 0, 1, 4, 1000);
    assert_eq!(m.apply(0, &b.events).unwrap().len(), 2);
    assert_eq!(m.skipped(Skip::Malformed), 1);
}

/// An engine's `/metrics` text: the load parser allocates at most a rank's entry per line
/// (a line names one rank), whatever the text.
fn metrics_within_bounds(text: &str) {
    for kind in [
        kvrouter_protocol::EngineKind::Vllm,
        kvrouter_protocol::EngineKind::Sglang,
    ] {
        let (loads, bytes) =
            allocated_during(|| kvrouter_bridge::engine_load::parse_engine_metrics(kind, text));
        let lines = text.lines().count() as u64;
        assert!(loads.len() as u64 <= lines);
        // A map entry per line at most (~80 bytes: a B-tree node holds eleven 36-byte
        // entries), nothing per byte.
        assert!(
            bytes <= 128 * lines + 1024,
            "{bytes} bytes allocated for {lines} lines, {} bytes",
            text.len()
        );
    }
}

proptest! {
    #[test]
    fn engine_metrics_text_parses_within_bounds(
        lines in prop::collection::vec(
            prop_oneof![
                "[ -~]{0,80}",
                r#"vllm:num_requests_running\{engine="[0-9]{1,10}"[a-z=",]{0,20}\} [0-9.e+-]{1,12}"#,
                r#"sglang:num_queue_reqs\{dp_rank="[0-9]{1,10}"\} [0-9]{1,6}"#,
                r#"vllm:kv_cache_usage_perc\{engine="[0-9]"[\\"{}=,]{0,30} [0-9.]{1,5}"#,
            ],
            0..64,
        )
    ) {
        metrics_within_bounds(&lines.join("\n"));
    }
}

#[test]
fn engine_metrics_at_their_worst_are_within_bounds() {
    // A rank per line; a line of unclosed quotes and braces; a megabyte of label pairs.
    let ranks: String = (0..100_000)
        .map(|r| format!("vllm:num_requests_running{{engine=\"{r}\"}} 1\n"))
        .collect();
    metrics_within_bounds(&ranks);
    metrics_within_bounds(&format!(
        "vllm:num_requests_running{{{}",
        "\"\\".repeat(500_000)
    ));
    metrics_within_bounds(&format!(
        "vllm:num_requests_running{{{}engine=\"0\"}} 1",
        "a=\"b\",".repeat(200_000)
    ));
}
