//! The wire codec: one format-version byte, then the bincode 2 (serde) encoding.
//!
//! It writes [`FORMAT_VERSION`] and reads it and the version before ([`MIN_READ_VERSION`]),
//! the latter through the type's previous shape ([`Wire`]), so that peers one version apart
//! understand each other during a rolling upgrade. A server answers a request in the
//! version it came in ([`reply_version`], [`encode_as`]).
//!
//! Decoding takes untrusted bytes: every failure is a typed [`CodecError`], allocation is
//! bounded by [`MAX_MESSAGE_BYTES`], and nothing panics.

use crate::wire::Wire;
use bincode::config::{self, Configuration, Fixint, Limit, LittleEndian};
use bincode::enc::write::SizeWriter;
use serde::{de::DeserializeOwned, Serialize};
use std::sync::atomic::{AtomicU8, Ordering};
use thiserror::Error;

/// The format version this build writes.
pub const FORMAT_VERSION: u8 = 8;
/// The oldest version this build still reads: the previous one, read through [`Wire`].
pub const MIN_READ_VERSION: u8 = FORMAT_VERSION - 1;
/// Upper bound on an encoded message and on what decoding may allocate for it.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

type WireConfig = Configuration<LittleEndian, Fixint, Limit<MAX_MESSAGE_BYTES>>;

fn wire_config() -> WireConfig {
    config::standard()
        .with_fixed_int_encoding()
        .with_limit::<MAX_MESSAGE_BYTES>()
}

/// Why bytes could not be encoded or decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CodecError {
    #[error("empty message: no format version byte")]
    Empty,
    #[error("unsupported format version {got} (this build reads {min}..={max})")]
    BadVersion { got: u8, min: u8, max: u8 },
    #[error("truncated message: the payload ends before the value does")]
    Truncated,
    #[error("{0} trailing bytes after the value")]
    TrailingBytes(usize),
    #[error("message of {len} bytes exceeds the {max}-byte limit")]
    Oversized { len: usize, max: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

fn bad_version(got: u8) -> CodecError {
    CodecError::BadVersion {
        got,
        min: MIN_READ_VERSION,
        max: FORMAT_VERSION,
    }
}

/// The version [`encode`] writes: the current one, or the previous one while a fleet is
/// upgraded (`--wire-version`), so that peers still on the previous build read everything.
static WRITE_VERSION: AtomicU8 = AtomicU8::new(FORMAT_VERSION);

/// Sets the version [`encode`] writes for this process (the previous one during a rolling
/// upgrade, until no previous-version peer is left). Answers always follow their request.
pub fn set_write_version(version: u8) -> Result<(), CodecError> {
    if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(bad_version(version));
    }
    WRITE_VERSION.store(version, Ordering::Relaxed);
    Ok(())
}

/// The version [`encode`] writes (see [`set_write_version`]).
pub fn write_version() -> u8 {
    WRITE_VERSION.load(Ordering::Relaxed)
}

/// Encodes `value` in this process's write version ([`write_version`]: the current format
/// version unless set otherwise).
pub fn encode<T: Wire>(value: &T) -> Result<Vec<u8>, CodecError> {
    match write_version() {
        FORMAT_VERSION => write(FORMAT_VERSION, value),
        v => encode_as(value, v),
    }
}

/// Encodes `value` in format `version`: the current one, or the previous one for a peer
/// that reads only that (fields the previous version lacks are dropped). Any other version
/// is `BadVersion`.
pub fn encode_as<T: Wire>(value: &T, version: u8) -> Result<Vec<u8>, CodecError> {
    match version {
        FORMAT_VERSION => write(version, value),
        MIN_READ_VERSION => write(version, &value.to_previous()),
        other => Err(bad_version(other)),
    }
}

fn write<T: Serialize>(version: u8, value: &T) -> Result<Vec<u8>, CodecError> {
    let mut out = vec![version];
    // The limit guards decoding allocations; encoding checks the final size instead.
    let config = config::standard().with_fixed_int_encoding();
    bincode::serde::encode_into_std_write(value, &mut out, config)
        .map_err(|e| CodecError::Encode(e.to_string()))?;
    if out.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::Oversized {
            len: out.len(),
            max: MAX_MESSAGE_BYTES,
        });
    }
    Ok(out)
}

/// Bytes `value` takes in an encoded message, version byte excluded: an item's share of
/// the message holding it (see [`crate::chunk_by_budget`]).
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> Result<usize, CodecError> {
    let mut size = SizeWriter::default();
    let config = config::standard().with_fixed_int_encoding();
    bincode::serde::encode_into_writer(value, &mut size, config)
        .map_err(|e| CodecError::Encode(e.to_string()))?;
    Ok(size.bytes_written)
}

/// Decodes one value of type `T` from untrusted bytes in the current or the previous
/// format version.
pub fn decode<T: Wire>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_versioned(bytes).map(|(value, _)| value)
}

/// Like [`decode`], and says which format version the bytes came in (answer in it with
/// [`encode_as`]).
pub fn decode_versioned<T: Wire>(bytes: &[u8]) -> Result<(T, u8), CodecError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::Oversized {
            len: bytes.len(),
            max: MAX_MESSAGE_BYTES,
        });
    }
    let (&version, payload) = bytes.split_first().ok_or(CodecError::Empty)?;
    let value = match version {
        FORMAT_VERSION => read::<T>(payload)?,
        MIN_READ_VERSION => T::from_previous(read::<T::Previous>(payload)?),
        other => return Err(bad_version(other)),
    };
    Ok((value, version))
}

/// The version to answer a request in: the request's own when this build can write it, the
/// current one otherwise (an empty or unknown-version request is answered with an error a
/// current peer reads).
pub fn reply_version(request: &[u8]) -> u8 {
    match request.first() {
        Some(&v) if (MIN_READ_VERSION..=FORMAT_VERSION).contains(&v) => v,
        _ => FORMAT_VERSION,
    }
}

fn read<T: DeserializeOwned>(payload: &[u8]) -> Result<T, CodecError> {
    let (value, read) =
        bincode::serde::decode_from_slice(payload, wire_config()).map_err(|e| match e {
            bincode::error::DecodeError::UnexpectedEnd { .. } => CodecError::Truncated,
            bincode::error::DecodeError::LimitExceeded => CodecError::Oversized {
                // The version byte counts: the same `len` as the up-front check reports.
                len: payload.len() + 1,
                max: MAX_MESSAGE_BYTES,
            },
            other => CodecError::Malformed(other.to_string()),
        })?;
    if read != payload.len() {
        return Err(CodecError::TrailingBytes(payload.len() - read));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::Lease;
    use crate::messages::*;
    use crate::trace_context::TraceContext;
    use crate::types::*;
    use crate::v7;
    use crate::wire::Wire;
    use proptest::prelude::*;
    use uuid::Uuid;

    /// docs/protocol.md names the versions this build writes and reads.
    #[test]
    fn the_protocol_doc_names_the_current_and_the_previous_version() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/protocol.md");
        let doc = std::fs::read_to_string(path).expect("docs/protocol.md");
        for want in [
            format!("currently `{FORMAT_VERSION}` (`{MIN_READ_VERSION}` still read)"),
            format!("**Version {FORMAT_VERSION}** (current)"),
            format!("**Version {MIN_READ_VERSION}** (still read)"),
        ] {
            assert!(doc.contains(&want), "docs/protocol.md lacks {want:?}");
        }
        assert!(
            !doc.contains(&format!("**Version {}**", FORMAT_VERSION + 1)),
            "docs/protocol.md describes a version this build does not know"
        );
    }

    fn arb_key() -> impl Strategy<Value = WorkerKey> {
        (any::<u64>(), any::<u32>()).prop_map(|(w, r)| WorkerKey::new(w, r))
    }

    fn arb_event() -> impl Strategy<Value = KvEvent> {
        let block = (any::<u64>(), any::<u64>()).prop_map(|(e, l)| StoredBlock {
            engine_hash: EngineBlockHash(e),
            local_hash: LocalBlockHash(l),
        });
        let data = prop_oneof![
            (
                proptest::option::of(any::<u64>()),
                prop::collection::vec(block, 0..20)
            )
                .prop_map(|(p, blocks)| KvEventData::Stored {
                    parent: p.map(EngineBlockHash),
                    blocks
                }),
            prop::collection::vec(any::<u64>(), 0..20).prop_map(|h| KvEventData::Removed {
                engine_hashes: h.into_iter().map(EngineBlockHash).collect()
            }),
            Just(KvEventData::Cleared),
        ];
        let tier = prop::sample::select(Tier::ALL.to_vec());
        (arb_key(), any::<u64>(), tier, data).prop_map(|(key, event_id, tier, data)| KvEvent {
            tier,
            key,
            event_id,
            data,
        })
    }

    fn arb_registration() -> impl Strategy<Value = Registration> {
        let engine = prop_oneof![
            Just(EngineKind::Mocker),
            Just(EngineKind::Vllm),
            Just(EngineKind::Sglang)
        ];
        let role = prop_oneof![
            Just(WorkerRole::Aggregated),
            Just(WorkerRole::Prefill),
            Just(WorkerRole::Decode)
        ];
        (
            (any::<u64>(), any::<u128>(), "[a-z/]{0,12}", role),
            (
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                prop::collection::vec(any::<u32>(), 0..8),
            ),
            (
                any::<u32>(),
                any::<u64>(),
                any::<u32>(),
                engine,
                "[a-z:/.0-9]{0,24}",
            ),
        )
            .prop_map(
                |((w, i, model, role), (bs, dp, start, live), (tp, cap, hb, engine, url))| {
                    Registration {
                        worker_id: w,
                        instance_id: Uuid::from_u128(i),
                        model,
                        role,
                        block_size: bs,
                        dp_size: dp,
                        dp_start_rank: start,
                        live_ranks: live,
                        tp_size: tp,
                        capacity_blocks: cap,
                        heartbeat_interval_ms: hb,
                        engine,
                        base_url: url,
                    }
                },
            )
    }

    proptest! {
        /// A registration is unchanged since version 7: the same bytes behind either version
        /// byte, read back whole from both.
        #[test]
        fn registrations_round_trip_in_both_versions(reg in arb_registration()) {
            let now = encode(&reg).unwrap();
            prop_assert_eq!(decode_versioned::<Registration>(&now).unwrap(), (reg.clone(), 8));
            let old = encode_as(&reg, 7).unwrap();
            prop_assert_eq!(decode_versioned::<Registration>(&old).unwrap(), (reg.clone(), 7));
            prop_assert_eq!(&old[1..], &now[1..]);
        }

        #[test]
        fn registrations_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), v in 0u8..10) {
            let mut bytes = bytes;
            bytes.insert(0, v);
            prop_assert!(decode_within_bounds::<Registration>(&bytes));
        }

        #[test]
        fn route_requests_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), v in 1u8..10) {
            let mut bytes = bytes;
            bytes.insert(0, v);
            prop_assert!(decode_within_bounds::<RouteRequest>(&bytes));
            prop_assert!(decode_within_bounds::<DisaggRouteRequest>(&bytes));
            prop_assert!(decode_within_bounds::<SyncBatch>(&bytes));
        }

        /// Valid messages with any 8 bytes overwritten (a length turned huge, a tag turned
        /// unknown) decode or fail within the allocation bound.
        #[test]
        fn mutated_messages_decode_within_bounds(
            events in prop::collection::vec(arb_event(), 1..32),
            at in any::<prop::sample::Index>(),
            word in prop_oneof![any::<u64>(), Just(u64::MAX), Just(1 << 32), Just(1 << 20)],
        ) {
            let mut bytes = encode(&events).unwrap();
            let at = at.index(bytes.len().saturating_sub(8).max(1));
            let end = (at + 8).min(bytes.len());
            bytes[at..end].copy_from_slice(&word.to_le_bytes()[..end - at]);
            prop_assert!(decode_within_bounds::<Vec<KvEvent>>(&bytes));
            prop_assert!(decode_within_bounds::<SyncBatch>(&bytes));
        }

        #[test]
        fn events_round_trip(events in prop::collection::vec(arb_event(), 0..8)) {
            let bytes = encode(&events).unwrap();
            prop_assert_eq!(bytes[0], FORMAT_VERSION);
            let back: Vec<KvEvent> = decode(&bytes).unwrap();
            prop_assert_eq!(back, events);
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            prop_assert!(decode_within_bounds::<Vec<KvEvent>>(&bytes));
            prop_assert!(decode_within_bounds::<KvEvent>(&bytes));
        }

        #[test]
        fn every_truncation_is_an_error(event in arb_event()) {
            let bytes = encode(&event).unwrap();
            for cut in 0..bytes.len() {
                prop_assert!(decode::<KvEvent>(&bytes[..cut]).is_err());
            }
        }
    }

    /// What decoding may allocate, in all (freed or not): 16 bytes per input byte (a
    /// `u8`-tagged enum or a one-byte bool widened into its Rust value), plus serde's
    /// cautious preallocation of at most 1 MiB for one claimed sequence that then fails.
    fn decode_within_bounds<T: Wire>(bytes: &[u8]) -> bool {
        let (r, allocated) = kvrouter_testkit::allocated_during(|| decode::<T>(bytes));
        drop(r);
        let bound = 16 * bytes.len() as u64 + (1 << 20) + 4096;
        if allocated > bound {
            eprintln!("{allocated} bytes allocated decoding {} bytes", bytes.len());
        }
        allocated <= bound
    }

    /// Routes cross versions: a version-7 request carries no trace; a version-7 peer reads
    /// exactly what version 7 wrote.
    #[test]
    fn route_requests_in_both_versions() {
        let req = v8_route_request();
        assert!(req.trace.is_some());
        assert_eq!(
            decode_versioned::<RouteRequest>(&encode(&req).unwrap()).unwrap(),
            (req.clone(), 8)
        );
        let old = v7_codec_read::<v7::RouteRequest>(&encode_as(&req, 7).unwrap());
        assert_eq!(old, req.to_previous());
        assert_eq!(
            (old.call_id, old.lease, old.fallbacks),
            (req.call_id, req.lease, req.fallbacks)
        );
        let (back, v) = decode_versioned::<RouteRequest>(&encode_as(&req, 7).unwrap()).unwrap();
        assert_eq!((v, back.trace), (7, None));
        assert_eq!(
            RouteRequest {
                trace: req.trace,
                ..back
            },
            req
        );

        let disagg = v8_disagg_request();
        assert!(disagg.trace.is_some());
        assert_eq!(
            decode_versioned::<DisaggRouteRequest>(&encode(&disagg).unwrap()).unwrap(),
            (disagg.clone(), 8)
        );
        let old = v7_codec_read::<v7::DisaggRouteRequest>(&encode_as(&disagg, 7).unwrap());
        assert_eq!(old, disagg.to_previous());
        let (back, v) =
            decode_versioned::<DisaggRouteRequest>(&encode_as(&disagg, 7).unwrap()).unwrap();
        assert_eq!((v, back.trace), (7, None));
        assert_eq!(
            DisaggRouteRequest {
                trace: disagg.trace,
                ..back
            },
            disagg
        );
    }

    /// A traced request crosses version 8 whole; its context is 1 tag byte and 25 raw bytes
    /// at the end.
    #[test]
    fn a_traced_request_round_trips_in_version_8() {
        let req = v8_route_request();
        let t = req.trace.unwrap();
        let bytes = encode_as(&req, 8).unwrap();
        assert_eq!(bytes[0], 8);
        let mut tail = vec![1u8];
        tail.extend_from_slice(&t.trace_id);
        tail.extend_from_slice(&t.parent_id);
        tail.push(t.flags);
        assert!(bytes.ends_with(&tail));
        let untraced = encode_as(&req.clone().with_trace(None), 8).unwrap();
        assert_eq!(bytes.len(), untraced.len() + 25);
        assert_eq!(untraced.last(), Some(&0));
        assert_eq!(decode::<RouteRequest>(&bytes).unwrap(), req);
        assert_eq!(
            decode::<RouteRequest>(&untraced).unwrap(),
            req.clone().with_trace(None)
        );
    }

    /// A peer's context with a zero id is not a decoding error: the request decodes, and
    /// `valid()` tells the receiver to ignore the context.
    #[test]
    fn a_request_whose_trace_has_zero_ids_still_decodes() {
        for zero in [
            TraceContext {
                trace_id: [0; 16],
                parent_id: [0; 8],
                flags: 0,
            },
            TraceContext {
                trace_id: [0; 16],
                parent_id: [7; 8],
                flags: 1,
            },
            TraceContext {
                trace_id: [7; 16],
                parent_id: [0; 8],
                flags: 1,
            },
        ] {
            let req = v8_route_request().with_trace(Some(zero));
            let back: RouteRequest = decode(&encode(&req).unwrap()).unwrap();
            assert_eq!(back, req);
            assert_eq!(back.trace.and_then(TraceContext::valid), None);
            let disagg = DisaggRouteRequest {
                trace: Some(zero),
                ..v8_disagg_request()
            };
            let back: DisaggRouteRequest = decode(&encode(&disagg).unwrap()).unwrap();
            assert_eq!(back.trace.and_then(TraceContext::valid), None);
        }
        let good = v8_route_request().trace;
        assert_eq!(good.and_then(TraceContext::valid), good);
    }

    /// Decisions are unchanged since version 7: the same bytes behind either version byte,
    /// fallbacks and leases included.
    #[test]
    fn decisions_in_both_versions() {
        let d = v8_decision();
        let both = DisaggDecision {
            prefill: d.clone(),
            decode: d.clone(),
            replica_id: "r1".into(),
        };
        assert_eq!(
            decode_versioned::<Reply<DisaggDecision>>(&encode(&Reply::Ok(both.clone())).unwrap())
                .unwrap(),
            (Reply::Ok(both.clone()), 8)
        );
        let old_bytes = encode_as(&both, 7).unwrap();
        assert_eq!(old_bytes[1..], encode(&both).unwrap()[1..]);
        let old: DisaggDecision = v7_codec_read(&old_bytes);
        assert_eq!(old, both);
        let (back, v) = decode_versioned::<DisaggDecision>(&old_bytes).unwrap();
        assert_eq!((v, back), (7, both));
        let old_bytes = encode_as(&Reply::Ok(d.clone()), 7).unwrap();
        assert_eq!(old_bytes[1..], encode(&Reply::Ok(d.clone())).unwrap()[1..]);
        assert_eq!(
            decode::<Reply<RouteDecision>>(&old_bytes).unwrap(),
            Reply::Ok(d)
        );

        let update = RequestUpdate {
            model: "m".into(),
            request_id: "req-1".into(),
            lease: Lease::random(),
        };
        let back: RequestUpdate = decode(&encode_as(&update, 7).unwrap()).unwrap();
        assert_eq!(back, update);
    }

    #[test]
    fn overrides_name_the_bad_value() {
        let ok = RouteOverrides {
            disk_cache_hit_weight: None,
            host_cache_hit_weight: None,
            shared_cache_hit_weight: None,
            overlap_credit: Some(0.0),
            temperature: Some(2.5),
        };
        assert_eq!(ok.invalid(), None);
        assert_eq!(RouteOverrides::default().invalid(), None);
        let bad = RouteOverrides {
            disk_cache_hit_weight: None,
            host_cache_hit_weight: None,
            shared_cache_hit_weight: None,
            overlap_credit: Some(1.0),
            temperature: Some(-1.0),
        };
        assert_eq!(bad.invalid(), Some(("temperature", -1.0)));
        let nan = RouteOverrides {
            disk_cache_hit_weight: None,
            host_cache_hit_weight: None,
            shared_cache_hit_weight: None,
            overlap_credit: Some(f64::NAN),
            temperature: None,
        };
        assert_eq!(nan.invalid().map(|(n, _)| n), Some("overlap_credit"));
    }

    #[test]
    fn typed_errors() {
        let ev = KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(1, 2),
            event_id: 3,
            data: KvEventData::Cleared,
        };
        let bytes = encode(&ev).unwrap();
        assert_eq!(decode::<KvEvent>(&[]), Err(CodecError::Empty));
        let mut bad = bytes.clone();
        bad[0] = 99;
        assert!(matches!(
            decode::<KvEvent>(&bad),
            Err(CodecError::BadVersion { got: 99, .. })
        ));
        assert_eq!(
            decode::<KvEvent>(&bytes[..bytes.len() - 1]),
            Err(CodecError::Truncated)
        );
        let mut long = bytes.clone();
        long.extend_from_slice(&[0, 0]);
        assert_eq!(decode::<KvEvent>(&long), Err(CodecError::TrailingBytes(2)));
        let huge = vec![FORMAT_VERSION; MAX_MESSAGE_BYTES + 1];
        assert!(matches!(
            decode::<KvEvent>(&huge),
            Err(CodecError::Oversized { .. })
        ));
    }

    /// What the version-7 codec wrote: the version byte, then bincode of the v7 type.
    fn v7_codec_bytes<T: Serialize>(value: &T) -> Vec<u8> {
        let mut out = vec![7u8];
        let config = config::standard().with_fixed_int_encoding();
        out.extend(bincode::serde::encode_to_vec(value, config).unwrap());
        out
    }

    /// What a version-7 peer reads.
    fn v7_codec_read<T: DeserializeOwned>(bytes: &[u8]) -> T {
        assert_eq!(bytes[0], 7, "a version-7 peer reads only version 7");
        let config = config::standard().with_fixed_int_encoding();
        let (v, n) = bincode::serde::decode_from_slice(&bytes[1..], config).unwrap();
        assert_eq!(n, bytes.len() - 1);
        v
    }

    /// A route request with every field set, its trace too.
    fn v8_route_request() -> RouteRequest {
        RouteRequest {
            model: "llama".into(),
            request_id: "req-1".into(),
            tokens: vec![1, 2, 0xdead_beef],
            lora: Some("a".into()),
            allowed_workers: Some(vec![4, 0x0102_0304_0506_0708]),
            pin: Some(Pin {
                worker_id: 9,
                dp_rank: Some(3),
            }),
            update_states: true,
            extras: Some(PromptExtras {
                block_extras: vec![vec!["img".into(), "2".into()], vec![]],
                cache_salt: Some("s".into()),
            }),
            excluded_workers: vec![5, 6],
            overrides: Some(RouteOverrides {
                overlap_credit: Some(0.5),
                temperature: None,
                host_cache_hit_weight: Some(0.9),
                disk_cache_hit_weight: None,
                shared_cache_hit_weight: None,
            }),
            priority_jump: 2.5,
            expected_output_tokens: Some(300),
            call_id: 0x1122_3344_5566_7788,
            lease: Lease::from_bits(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff),
            fallbacks: 3,
            trace: Some(TraceContext {
                trace_id: *b"0123456789abcdef",
                parent_id: *b"parent!!",
                flags: 1,
            }),
        }
    }

    /// A disaggregated route request with every field set, its trace too.
    fn v8_disagg_request() -> DisaggRouteRequest {
        DisaggRouteRequest {
            model: "llama".into(),
            request_id: "req-2".into(),
            tokens: vec![7, 8, 0x0102_0304],
            lora: Some("b".into()),
            allowed_workers: Some(vec![10, 11]),
            update_states: true,
            lease: Lease::from_bits(0x0f0e_0d0c_0b0a_0908_0706_0504_0302_0100),
            trace: Some(TraceContext {
                trace_id: [0xab; 16],
                parent_id: [0xcd; 8],
                flags: 0,
            }),
        }
    }

    fn v8_decision() -> RouteDecision {
        RouteDecision {
            worker_id: 7,
            dp_rank: 1,
            overlap_blocks: 3,
            replica_id: "r1".into(),
            base_url: "http://10.0.0.5:8000".into(),
            tier_overlap_blocks: TierBlocks::on_device(3),
            block_size: 16,
            lease: Lease::from_bits(0xfeed_0000_0000_0000_0000_0000_0000_beef),
            fallbacks: vec![Fallback {
                worker_id: 8,
                dp_rank: 0,
                overlap_blocks: 2,
                base_url: "http://10.0.0.6:8000".into(),
            }],
        }
    }

    fn v8_sync_batch() -> SyncBatch {
        let id = || "r1:a".to_string();
        SyncBatch {
            replica_id: "r1".into(),
            model: "m".into(),
            changes: vec![
                SeqChange::Add {
                    request_id: id(),
                    key: WorkerKey::new(3, 1),
                    sequence_hashes: vec![SequenceHash(5), SequenceHash(6)],
                    prefill_tokens: 40,
                    output_blocks: 4,
                },
                SeqChange::Prefilled { request_id: id() },
                SeqChange::Output {
                    request_id: id(),
                    output_blocks: 5,
                },
                SeqChange::Free { request_id: id() },
            ],
            instance_id: Uuid::from_u128(7),
            seq: 12,
        }
    }

    /// `v8_route_request()` and `v8_disagg_request()` (less their traces) as the version-7
    /// codec encoded them, captured by running the code before version 8 existed. Never
    /// update these: a mismatch means v7 types changed.
    const V7_REQUEST_HEX: &str = concat!(
        "0705000000000000006c6c616d6105000000000000007265712d310300000000",
        "0000000100000002000000efbeadde0101000000000000006101020000000000",
        "0000040000000000000008070605040302010109000000000000000103000000",
        "0101020000000000000002000000000000000300000000000000696d67010000",
        "0000000000320000000000000000010100000000000000730200000000000000",
        "050000000000000006000000000000000101000000000000e03f0001cdcccccc",
        "ccccec3f00000000000000000440012c0100008877665544332211ffeeddccbb",
        "aa9988776655443322110003",
    );
    const V7_DISAGG_HEX: &str = concat!(
        "0705000000000000006c6c616d6105000000000000007265712d320300000000",
        "0000000700000008000000040302010101000000000000006201020000000000",
        "00000a000000000000000b0000000000000001000102030405060708090a0b0c",
        "0d0e0f",
    );

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn version_7_bytes_are_frozen() {
        let frozen = unhex(V7_REQUEST_HEX);
        let req = v8_route_request();
        assert_eq!(v7_codec_bytes(&req.to_previous()), frozen);
        assert_eq!(encode_as(&req, 7).unwrap(), frozen);
        let (back, v) = decode_versioned::<RouteRequest>(&frozen).unwrap();
        assert_eq!((v, back.trace), (7, None));
        assert_eq!(back, req.clone().with_trace(None));

        let frozen = unhex(V7_DISAGG_HEX);
        let disagg = v8_disagg_request();
        assert_eq!(v7_codec_bytes(&disagg.to_previous()), frozen);
        assert_eq!(encode_as(&disagg, 7).unwrap(), frozen);
        let (back, v) = decode_versioned::<DisaggRouteRequest>(&frozen).unwrap();
        assert_eq!((v, back.trace), (7, None));
        assert_eq!(
            back,
            DisaggRouteRequest {
                trace: None,
                ..disagg
            }
        );

        // ...and a decision and a sync batch, unchanged, are the same bytes behind either
        // version byte.
        let d = v8_decision();
        assert_eq!(encode_as(&d, 7).unwrap()[1..], encode(&d).unwrap()[1..]);
        let batch = v8_sync_batch();
        assert_eq!(
            encode_as(&batch, 7).unwrap()[1..],
            encode(&batch).unwrap()[1..]
        );
    }

    #[test]
    fn containers_convert_their_items() {
        let replies = vec![
            Reply::Ok(v8_disagg_request()),
            Reply::Err(ErrorReply::new(ErrorKind::Internal, "x")),
        ];
        let seen: Vec<Reply<v7::DisaggRouteRequest>> =
            v7_codec_read(&encode_as(&replies, 7).unwrap());
        assert_eq!(seen[0], Reply::Ok(v8_disagg_request().to_previous()));
        assert_eq!(
            seen[1],
            Reply::Err(ErrorReply::new(ErrorKind::Internal, "x"))
        );
        let back: Vec<Option<RouteRequest>> =
            decode(&encode_as(&vec![Some(v8_route_request()), None], 7).unwrap()).unwrap();
        assert_eq!(back[0].as_ref().map(|r| r.trace), Some(None));
        assert_eq!(back[1], None);
        // An unchanged message is the same bytes behind either version byte.
        let q = StateQuery { dp_rank: 4 };
        assert_eq!(encode_as(&q, 7).unwrap()[1..], encode(&q).unwrap()[1..]);
        assert_eq!(encode(&q).unwrap()[0], FORMAT_VERSION);
    }

    #[test]
    fn only_the_current_and_previous_versions_are_read_and_written() {
        assert_eq!((MIN_READ_VERSION, FORMAT_VERSION), (7, 8));
        let req = v8_route_request();
        let bytes = encode(&req).unwrap();
        for v in [0u8, 1, 2, 3, 4, 5, 6, 9, 255] {
            let mut bad = bytes.clone();
            bad[0] = v;
            assert_eq!(
                decode::<RouteRequest>(&bad),
                Err(CodecError::BadVersion {
                    got: v,
                    min: 7,
                    max: 8
                })
            );
            assert_eq!(
                encode_as(&req, v),
                Err(CodecError::BadVersion {
                    got: v,
                    min: 7,
                    max: 8
                })
            );
        }
    }

    #[test]
    fn replies_go_out_in_the_request_version() {
        let q = StateQuery { dp_rank: 1 };
        assert_eq!(reply_version(&encode(&q).unwrap()), 8);
        assert_eq!(reply_version(&encode_as(&q, 7).unwrap()), 7);
        assert_eq!(reply_version(&[]), FORMAT_VERSION);
        assert_eq!(reply_version(&[0, 1, 2]), FORMAT_VERSION);
        assert_eq!(reply_version(&[6]), FORMAT_VERSION);
        assert_eq!(reply_version(&[9]), FORMAT_VERSION);
        // Even an undecodable request in version 7 is answered in version 7.
        assert_eq!(reply_version(&[7, 0xff]), 7);
    }

    #[test]
    fn encoded_len_is_the_payload_size() {
        let req = v8_route_request();
        assert_eq!(encoded_len(&req).unwrap(), encode(&req).unwrap().len() - 1);
    }

    #[test]
    fn claimed_length_beyond_limit_is_refused_without_allocating() {
        // A Removed event claiming u64::MAX / 2 engine hashes in a tiny payload.
        let ev = KvEvent {
            tier: Tier::Device,
            key: WorkerKey::new(1, 0),
            event_id: 0,
            data: KvEventData::Removed {
                engine_hashes: vec![],
            },
        };
        let mut bytes = encode(&ev).unwrap();
        let n = bytes.len();
        bytes[n - 8..].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(decode::<KvEvent>(&bytes).is_err());
    }
}
