//! The process-wide write version (its own test binary: it is global state).

use kvrouter_protocol::{
    decode, decode_versioned, encode, set_write_version, v1, write_version, EngineKind,
    Registration, WorkerRole, FORMAT_VERSION,
};
use uuid::Uuid;

fn registration() -> Registration {
    Registration {
        worker_id: 7,
        instance_id: Uuid::from_u128(9),
        model: "m".into(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        dp_size: 2,
        dp_start_rank: 0,
        live_ranks: vec![0, 1],
        tp_size: 1,
        capacity_blocks: 1024,
        heartbeat_interval_ms: 500,
        engine: EngineKind::Vllm,
        base_url: "http://10.0.0.7:8000".into(),
    }
}

#[test]
fn a_process_set_to_the_previous_version_writes_what_previous_peers_read() {
    assert_eq!(write_version(), FORMAT_VERSION);
    let current = encode(&registration()).unwrap();
    assert_eq!(current[0], FORMAT_VERSION);

    set_write_version(FORMAT_VERSION - 1).unwrap();
    let old = encode(&registration()).unwrap();
    assert_eq!(old[0], FORMAT_VERSION - 1);
    // A previous-version peer reads it with its own types...
    let seen: v1::Registration = bincode::serde::decode_from_slice(
        &old[1..],
        bincode::config::standard().with_fixed_int_encoding(),
    )
    .unwrap()
    .0;
    assert_eq!((seen.worker_id, seen.capacity_blocks), (7, 1024));
    // ...and this build reads it too, without the fields the previous version lacks.
    let (back, version): (Registration, u8) = decode_versioned(&old).unwrap();
    assert_eq!(version, FORMAT_VERSION - 1);
    assert_eq!(
        (back.engine, back.base_url.as_str()),
        (EngineKind::Mocker, "")
    );

    assert!(set_write_version(FORMAT_VERSION + 1).is_err());
    assert!(set_write_version(0).is_err());
    assert_eq!(
        write_version(),
        FORMAT_VERSION - 1,
        "a refused setting changes nothing"
    );
    set_write_version(FORMAT_VERSION).unwrap();
    assert_eq!(
        decode::<Registration>(&encode(&registration()).unwrap()).unwrap(),
        registration()
    );
}
