//! The wire codec: one format-version byte, then the bincode 2 (serde) encoding.
//!
//! Decoding takes untrusted bytes: every failure is a typed [`CodecError`], allocation is
//! bounded by [`MAX_MESSAGE_BYTES`], and nothing panics.

use bincode::config::{self, Configuration, Fixint, Limit, LittleEndian};
use serde::{de::DeserializeOwned, Serialize};
use thiserror::Error;

/// The format version this build writes.
pub const FORMAT_VERSION: u8 = 1;
/// The oldest version this build still reads (rolling upgrades accept current and previous).
pub const MIN_READ_VERSION: u8 = 1;
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

/// Encodes `value` behind the current format version.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    let mut out = vec![FORMAT_VERSION];
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

/// Decodes one value of type `T` from untrusted bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::Oversized {
            len: bytes.len(),
            max: MAX_MESSAGE_BYTES,
        });
    }
    let (&version, payload) = bytes.split_first().ok_or(CodecError::Empty)?;
    if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(CodecError::BadVersion {
            got: version,
            min: MIN_READ_VERSION,
            max: FORMAT_VERSION,
        });
    }
    let (value, read) =
        bincode::serde::decode_from_slice(payload, wire_config()).map_err(|e| match e {
            bincode::error::DecodeError::UnexpectedEnd { .. } => CodecError::Truncated,
            bincode::error::DecodeError::LimitExceeded => CodecError::Oversized {
                len: bytes.len(),
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
    use crate::types::*;
    use proptest::prelude::*;

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

    proptest! {
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
