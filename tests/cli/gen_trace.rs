//! `kvrouter bench gen-trace` and `bench trace-stats`, run as a user runs them.

use crate::common;
use common::{repo_file, run};

#[test]
fn a_generated_trace_reads_back_with_the_figures_it_printed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("conv.jsonl");
    let out = run(&[
        "bench",
        "gen-trace",
        "--requests",
        "600",
        "--seed",
        "3",
        "--out",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(printed.contains("600 over"), "{printed}");

    let out = run(&["bench", "trace-stats", "--json", path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 600);
    // every line is a Mooncake request: one hash id per 512 tokens
    let text = std::fs::read_to_string(&path).unwrap();
    let mut blocks = 0u64;
    for line in text.lines() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let n = r["hash_ids"].as_array().unwrap().len() as u64;
        assert_eq!(n, r["input_length"].as_u64().unwrap().div_ceil(512));
        blocks += n;
    }
    assert_eq!(v["prompt_blocks_total"], blocks);
    // printed figures and trace-stats agree
    let mean = format!("mean {:.1}", v["prompt_blocks_mean"].as_f64().unwrap());
    assert!(printed.contains(&mean), "{mean} not in {printed}");

    // the same seed writes the same trace, to stdout without --out
    let again = run(&[
        "bench",
        "gen-trace",
        "--requests",
        "600",
        "--seed",
        "3",
        "-q",
    ]);
    assert!(again.status.success());
    assert_eq!(String::from_utf8_lossy(&again.stdout), text);
    assert!(again.stderr.is_empty());

    // the shipped trace's figures (computed independently in data/SOURCES.md)
    let shipped = repo_file("data/mooncake_trace_1000.jsonl");
    let out = run(&["bench", "trace-stats", "--json", shipped.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 1000);
    assert_eq!(v["input_tokens_mean"], 9792.03);

    let out = run(&["bench", "gen-trace", "--rate", "0", "--requests", "5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rate"));
}
