//! The process-wide write version (its own test binary: it is global state).

use kvrouter_protocol::{
    decode, decode_versioned, encode, set_write_version, v7, write_version, Lease, RouteOverrides,
    RouteRequest, TraceContext, FORMAT_VERSION,
};

/// A route request with every field set, the current version's new ones too.
fn request_with_every_field() -> RouteRequest {
    RouteRequest {
        model: "m".into(),
        request_id: "r".into(),
        tokens: vec![1, 2, 3],
        lora: None,
        allowed_workers: None,
        pin: None,
        update_states: true,
        extras: None,
        excluded_workers: vec![7],
        overrides: Some(RouteOverrides {
            temperature: Some(1.0),
            host_cache_hit_weight: Some(0.5),
            ..RouteOverrides::default()
        }),
        priority_jump: 1.5,
        expected_output_tokens: Some(64),
        call_id: 3,
        lease: Lease::parse_hex("0123456789abcdef0123456789abcdef").unwrap(),
        fallbacks: 2,
        trace: Some(
            TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap(),
        ),
    }
}

#[test]
fn a_process_set_to_the_previous_version_writes_what_previous_peers_read() {
    assert_eq!(write_version(), FORMAT_VERSION);
    let current = encode(&request_with_every_field()).unwrap();
    assert_eq!(current[0], FORMAT_VERSION);

    set_write_version(FORMAT_VERSION - 1).unwrap();
    let old = encode(&request_with_every_field()).unwrap();
    assert_eq!(old[0], FORMAT_VERSION - 1);
    // A previous-version peer reads it with its own types...
    let seen: v7::RouteRequest = bincode::serde::decode_from_slice(
        &old[1..],
        bincode::config::standard().with_fixed_int_encoding(),
    )
    .unwrap()
    .0;
    assert_eq!(
        (seen.tokens, seen.update_states, seen.fallbacks),
        (vec![1, 2, 3], true, 2)
    );
    // ...and this build reads it too, without the fields the previous version lacks.
    let (back, version): (RouteRequest, u8) = decode_versioned(&old).unwrap();
    assert_eq!(version, FORMAT_VERSION - 1);
    assert_eq!(back.overrides, request_with_every_field().overrides);
    assert_eq!(
        (
            back.priority_jump,
            back.expected_output_tokens,
            back.call_id
        ),
        (1.5, Some(64), 3)
    );
    assert_eq!(back.lease, request_with_every_field().lease);
    assert_eq!(back.fallbacks, 2);
    assert_eq!(back.trace, None);

    assert!(set_write_version(FORMAT_VERSION + 1).is_err());
    assert!(set_write_version(0).is_err());
    assert_eq!(
        write_version(),
        FORMAT_VERSION - 1,
        "a refused setting changes nothing"
    );
    set_write_version(FORMAT_VERSION).unwrap();
    assert_eq!(
        decode::<RouteRequest>(&encode(&request_with_every_field()).unwrap()).unwrap(),
        request_with_every_field()
    );
}
