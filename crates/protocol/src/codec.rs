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
pub const FORMAT_VERSION: u8 = 2;
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
    use crate::messages::*;
    use crate::types::*;
    use crate::v1;
    use proptest::prelude::*;
    use uuid::Uuid;

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
        (arb_key(), any::<u64>(), data).prop_map(|(key, event_id, data)| KvEvent {
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
        #[test]
        fn registrations_round_trip_in_both_versions(reg in arb_registration()) {
            prop_assert_eq!(decode_versioned::<Registration>(&encode(&reg).unwrap()).unwrap(), (reg.clone(), 2));
            let old = decode_versioned::<Registration>(&encode_as(&reg, 1).unwrap()).unwrap();
            let expected = Registration { engine: EngineKind::Mocker, base_url: String::new(), ..reg.clone() };
            prop_assert_eq!(old, (expected, 1));
            prop_assert_eq!(v1_codec_read::<v1::Registration>(&encode_as(&reg, 1).unwrap()), reg.to_previous());
        }

        #[test]
        fn registrations_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), v in 0u8..4) {
            let mut bytes = bytes;
            bytes.insert(0, v);
            let _ = decode::<Registration>(&bytes);
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
            let _ = decode::<Vec<KvEvent>>(&bytes);
            let _ = decode::<KvEvent>(&bytes);
        }

        #[test]
        fn every_truncation_is_an_error(event in arb_event()) {
            let bytes = encode(&event).unwrap();
            for cut in 0..bytes.len() {
                prop_assert!(decode::<KvEvent>(&bytes[..cut]).is_err());
            }
        }
    }

    /// Routes cross versions: a version-1 request hashes on tokens alone (no extras), a
    /// version-1 answer names no HTTP address; both read exactly what version 1 wrote.
    #[test]
    fn route_messages_in_both_versions() {
        let req = RouteRequest {
            model: "m".into(),
            request_id: "r".into(),
            tokens: vec![1, 2, 3],
            lora: Some("a".into()),
            allowed_workers: Some(vec![4]),
            pin: None,
            update_states: true,
            extras: Some(PromptExtras {
                block_extras: vec![vec!["img".into(), "2".into()]],
                cache_salt: Some("s".into()),
            }),
        };
        assert_eq!(
            decode_versioned::<RouteRequest>(&encode(&req).unwrap()).unwrap(),
            (req.clone(), 2)
        );
        let old = v1_codec_read::<v1::RouteRequest>(&encode_as(&req, 1).unwrap());
        assert_eq!(old, req.to_previous());
        let back = decode_versioned::<RouteRequest>(&encode_as(&req, 1).unwrap()).unwrap();
        assert_eq!(
            back,
            (
                RouteRequest {
                    extras: None,
                    ..req
                },
                1
            )
        );

        let d = RouteDecision {
            worker_id: 7,
            dp_rank: 1,
            overlap_blocks: 3,
            replica_id: "r1".into(),
            base_url: "http://10.0.0.5:8000".into(),
        };
        let both = DisaggDecision {
            prefill: d.clone(),
            decode: d.clone(),
            replica_id: "r1".into(),
        };
        assert_eq!(
            decode_versioned::<DisaggDecision>(&encode(&both).unwrap())
                .unwrap()
                .0,
            both
        );
        let old: v1::DisaggDecision = v1_codec_read(&encode_as(&both, 1).unwrap());
        assert_eq!(old.decode, d.to_previous());
        let back = decode_versioned::<RouteDecision>(&encode_as(&d, 1).unwrap()).unwrap();
        assert_eq!(
            back,
            (
                RouteDecision {
                    base_url: String::new(),
                    ..d
                },
                1
            )
        );
    }

    #[test]
    fn typed_errors() {
        let ev = KvEvent {
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

    /// What the version-1 codec wrote: the version byte, then bincode of the v1 type.
    fn v1_codec_bytes(reg: &v1::Registration) -> Vec<u8> {
        let mut out = vec![1u8];
        let config = config::standard().with_fixed_int_encoding();
        out.extend(bincode::serde::encode_to_vec(reg, config).unwrap());
        out
    }

    /// What a version-1 peer reads.
    fn v1_codec_read<T: DeserializeOwned>(bytes: &[u8]) -> T {
        assert_eq!(bytes[0], 1, "a version-1 peer reads only version 1");
        let config = config::standard().with_fixed_int_encoding();
        let (v, n) = bincode::serde::decode_from_slice(&bytes[1..], config).unwrap();
        assert_eq!(n, bytes.len() - 1);
        v
    }

    fn v1_registration() -> v1::Registration {
        v1::Registration {
            worker_id: 0x0102_0304_0506_0708,
            instance_id: Uuid::from_u128(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff),
            model: "llama".into(),
            role: WorkerRole::Prefill,
            block_size: 16,
            dp_size: 4,
            dp_start_rank: 2,
            live_ranks: vec![2, 3, 5],
            tp_size: 2,
            capacity_blocks: 1000,
            heartbeat_interval_ms: 1500,
        }
    }

    fn v2_registration(engine: EngineKind, base_url: &str) -> Registration {
        let r = v1_registration();
        Registration {
            worker_id: r.worker_id,
            instance_id: r.instance_id,
            model: r.model,
            role: r.role,
            block_size: r.block_size,
            dp_size: r.dp_size,
            dp_start_rank: r.dp_start_rank,
            live_ranks: r.live_ranks,
            tp_size: r.tp_size,
            capacity_blocks: r.capacity_blocks,
            heartbeat_interval_ms: r.heartbeat_interval_ms,
            engine,
            base_url: base_url.into(),
        }
    }

    /// `v1_registration()` as the version-1 codec encoded it, captured by running the code
    /// before version 2 existed. Never update this: a mismatch means v1 types changed.
    const V1_REGISTRATION_HEX: &str = concat!(
        "010807060504030201100000000000000000112233445566778899aabbccddee",
        "ff05000000000000006c6c616d61010000001000000004000000020000000300",
        "00000000000002000000030000000500000002000000e803000000000000dc05",
        "0000",
    );

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn version_1_registration_bytes_are_frozen() {
        let frozen = unhex(V1_REGISTRATION_HEX);
        assert_eq!(v1_codec_bytes(&v1_registration()), frozen);
        // A v2 registration answered to a v1 peer is exactly those bytes.
        let reg = v2_registration(EngineKind::Vllm, "http://10.0.0.5:8000");
        assert_eq!(encode_as(&reg, 1).unwrap(), frozen);
        assert_eq!(
            decode_versioned::<Registration>(&frozen).unwrap(),
            (v2_registration(EngineKind::Mocker, ""), 1)
        );
    }

    #[test]
    fn version_1_bytes_decode_with_the_new_fields_defaulted() {
        let bytes = v1_codec_bytes(&v1_registration());
        let reg: Registration = decode(&bytes).unwrap();
        assert_eq!(reg.worker_id, 0x0102_0304_0506_0708);
        assert_eq!(reg.model, "llama");
        assert_eq!(reg.role, WorkerRole::Prefill);
        assert_eq!(reg.live_ranks, vec![2, 3, 5]);
        assert_eq!(reg.heartbeat_interval_ms, 1500);
        assert_eq!(reg.engine, EngineKind::Mocker);
        assert_eq!(reg.base_url, "");
        // Containers convert their items.
        let reply: Reply<v1::Registration> = Reply::Ok(v1_registration());
        let mut bytes = vec![1u8];
        bytes.extend(
            bincode::serde::encode_to_vec(&reply, config::standard().with_fixed_int_encoding())
                .unwrap(),
        );
        assert_eq!(
            decode::<Reply<Registration>>(&bytes).unwrap(),
            Reply::Ok(v2_registration(EngineKind::Mocker, ""))
        );
    }

    #[test]
    fn decode_versioned_says_which_version_came() {
        let reg = v2_registration(EngineKind::Sglang, "http://h:30000");
        let (back, v) = decode_versioned::<Registration>(&encode(&reg).unwrap()).unwrap();
        assert_eq!((back, v), (reg.clone(), 2));
        let (back, v) = decode_versioned::<Registration>(&encode_as(&reg, 1).unwrap()).unwrap();
        assert_eq!((back, v), (v2_registration(EngineKind::Mocker, ""), 1));
        let ev = KvEvent {
            key: WorkerKey::new(1, 2),
            event_id: 3,
            data: KvEventData::Cleared,
        };
        assert_eq!(decode_versioned(&encode_as(&ev, 1).unwrap()), Ok((ev, 1)));
    }

    #[test]
    fn encoding_as_version_1_is_what_a_version_1_peer_reads() {
        let reg = v2_registration(EngineKind::Vllm, "http://10.0.0.5:8000");
        let bytes = encode_as(&reg, 1).unwrap();
        assert_eq!(bytes[0], 1);
        assert_eq!(v1_codec_read::<v1::Registration>(&bytes), v1_registration());
        let replies = vec![
            Reply::Ok(reg.clone()),
            Reply::Err(ErrorReply::new(ErrorKind::Internal, "x")),
        ];
        let back: Vec<Reply<v1::Registration>> = v1_codec_read(&encode_as(&replies, 1).unwrap());
        assert_eq!(back[0], Reply::Ok(v1_registration()));
        assert_eq!(
            back[1],
            Reply::Err(ErrorReply::new(ErrorKind::Internal, "x"))
        );
        let some: Option<v1::Registration> = v1_codec_read(&encode_as(&Some(reg), 1).unwrap());
        assert_eq!(some, Some(v1_registration()));
        // An unchanged message is the same bytes behind either version byte.
        let batch = KvEventBatch {
            worker_id: 9,
            instance_id: Uuid::from_u128(7),
            events: vec![],
        };
        assert_eq!(
            encode_as(&batch, 1).unwrap()[1..],
            encode(&batch).unwrap()[1..]
        );
        assert_eq!(encode(&batch).unwrap()[0], FORMAT_VERSION);
    }

    #[test]
    fn only_the_current_and_previous_versions_are_read_and_written() {
        assert_eq!((MIN_READ_VERSION, FORMAT_VERSION), (1, 2));
        let reg = v2_registration(EngineKind::Mocker, "");
        let bytes = encode(&reg).unwrap();
        for v in [0u8, 3, 255] {
            let mut bad = bytes.clone();
            bad[0] = v;
            assert_eq!(
                decode::<Registration>(&bad),
                Err(CodecError::BadVersion {
                    got: v,
                    min: 1,
                    max: 2
                })
            );
            assert_eq!(
                encode_as(&reg, v),
                Err(CodecError::BadVersion {
                    got: v,
                    min: 1,
                    max: 2
                })
            );
        }
    }

    #[test]
    fn replies_go_out_in_the_request_version() {
        let q = StateQuery { dp_rank: 1 };
        assert_eq!(reply_version(&encode(&q).unwrap()), 2);
        assert_eq!(reply_version(&encode_as(&q, 1).unwrap()), 1);
        assert_eq!(reply_version(&[]), FORMAT_VERSION);
        assert_eq!(reply_version(&[0, 1, 2]), FORMAT_VERSION);
        assert_eq!(reply_version(&[3]), FORMAT_VERSION);
        // Even an undecodable request in version 1 is answered in version 1.
        assert_eq!(reply_version(&[1, 0xff]), 1);
    }

    #[test]
    fn encoded_len_is_the_payload_size() {
        let reg = v2_registration(EngineKind::Vllm, "http://x");
        assert_eq!(encoded_len(&reg).unwrap(), encode(&reg).unwrap().len() - 1);
    }

    #[test]
    fn claimed_length_beyond_limit_is_refused_without_allocating() {
        // A Removed event claiming u64::MAX / 2 engine hashes in a tiny payload.
        let ev = KvEvent {
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
