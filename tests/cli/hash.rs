//! `kvrouter hash`, run as a user runs it.

use crate::common;
use common::run;

#[test]
fn known_answer_in_text_and_json() {
    let out = run(&[
        "hash",
        "--block-size",
        "4",
        "--tokens",
        "1,2,3,4,5,6,7,8,9,10",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("0xcb38e4d7fb2dca5c 0xcb38e4d7fb2dca5c"),
        "{text}"
    );
    assert!(
        text.contains("0xe8d3ec39b907b74c 0x44a2b2379d6d3c3d"),
        "{text}"
    );

    let out = run(&[
        "hash",
        "--block-size",
        "4",
        "--json",
        "--tokens",
        "1,2,3,4,5,6,7,8,9,10",
    ]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "local": ["0xcb38e4d7fb2dca5c", "0xe8d3ec39b907b74c"],
            "sequence": ["0xcb38e4d7fb2dca5c", "0x44a2b2379d6d3c3d"]
        })
    );
}

#[test]
fn lora_changes_hashes_and_env_twins_work() {
    let base = run(&["hash", "--block-size", "2", "--json", "--tokens", "1,2"]);
    let lora = run(&[
        "hash",
        "--block-size",
        "2",
        "--json",
        "--lora",
        "my-adapter",
        "--tokens",
        "1,2",
    ]);
    assert_ne!(base.stdout, lora.stdout);
    let via_env = common::kvrouter()
        .args(["hash", "--json"])
        .env("KVROUTER_BLOCK_SIZE", "2")
        .env("KVROUTER_TOKENS", "1,2")
        .output()
        .unwrap();
    assert_eq!(via_env.stdout, base.stdout);
}

#[test]
fn bad_input_is_a_clear_error() {
    let out = run(&["hash", "--block-size", "0", "--tokens", "1,2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--block-size must be at least 1"));
    let out = run(&["hash", "--block-size", "2", "--tokens", "1,x,3"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("token 2"));
}
