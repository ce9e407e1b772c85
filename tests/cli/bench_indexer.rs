//! `kvrouter bench indexer`, run as a user runs it, on small hand-made traces.

use crate::common;
use common::run;
use std::io::Write;

fn trace(lines: &[&str]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    for l in lines {
        writeln!(f, "{l}").unwrap();
    }
    f
}

#[test]
fn json_report_holds_every_figure_and_exact_counts() {
    // Two workers, K = 2, capacity 4: request 2 (worker 0) finds block 1 cached, request 3
    // is empty, request 4 (worker 0) evicts block 2's two sub-blocks to store its own.
    let t = trace(&[
        r#"{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [3, 4]}"#,
        r#"{"timestamp": 2, "input_length": 512, "output_length": 1, "hash_ids": [1]}"#,
        r#"{"timestamp": 3, "input_length": 0, "output_length": 1, "hash_ids": []}"#,
        r#"{"timestamp": 4, "input_length": 512, "output_length": 1, "hash_ids": [9]}"#,
    ]);
    for mode in ["sharded", "core"] {
        let out = bench_indexer(
            &t,
            "2",
            "4",
            "2",
            &[
                "--runs",
                "1",
                "--mode",
                mode,
                "--json",
                "--chase-loads",
                "1000",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for field in [
            "block_ops_per_s",
            "lookup_p50_us",
            "lookup_p99_us",
            "lookups_per_s",
            "mean_best_overlap",
            "bytes_per_pair",
            "live_pairs",
            "live_blocks",
        ] {
            assert!(v[field].is_number(), "{field} missing in {v}");
        }
        assert_eq!(v["requests"], 5);
        assert_eq!(v["lookups"], 4);
        // stored: 4 + 4 + 0 + 2; removed: 2 (request 4 on worker 0 evicts 2 of 4)
        assert_eq!(v["stored_blocks"], 10);
        assert_eq!(v["removed_blocks"], 2);
        assert_eq!(v["live_pairs"], 8);
        assert_eq!(v["refused_events"], 0);
        // best overlaps at the end: [1,2] -> 2 (evicted tail), [3,4] -> 4, [1] -> 2, [9] -> 2
        assert_eq!(v["mean_best_overlap"], 2.5);

        // the ruler, on the same stream, finds the same and holds the same
        let r = &v["ruler"];
        assert_eq!(r["mean_best_overlap"], 2.5, "{r}");
        assert_eq!(r["live_pairs"], 8);
        assert_eq!(r["refused_events"], 0);
        assert_eq!(v["overlaps_agree"], true);
        for field in [
            "block_ops_per_s",
            "lookup_p99_us",
            "lookups_per_s",
            "bytes_per_pair",
        ] {
            assert!(r[field].is_number(), "ruler {field} missing in {r}");
            assert!(
                v["ruler_ratios"][field].is_number(),
                "ratio {field} missing in {v}"
            );
        }
        // the route's lookup: 8,192 tokens in blocks of 512 / K = 256
        let route = &v["route"];
        assert_eq!(route["prompt_tokens"], 8192);
        assert_eq!(route["block_size"], 256);
        assert_eq!(route["mean_query_blocks"], 3.0, "{route}");
        assert!(route["p99_us"].as_f64().unwrap() >= route["hash_p50_us"].as_f64().unwrap());
        // faults, counters (a count, or why not), the calibration
        assert!(v["lookup_minor_page_faults"].is_u64());
        let cycles = &v["lookup_pmu"]["cycles"];
        assert!(
            cycles.is_u64() || cycles.as_str().unwrap().starts_with("unavailable ("),
            "{cycles}"
        );
        assert_eq!(v["apply_pmu"].is_null(), mode == "sharded");
        let cal = &v["calibration"];
        assert!(cal["table_huge"]["ns"].as_f64().unwrap() > 0.0, "{cal}");
        assert_eq!(cal["table_8_chains"]["chains"], 8);
        assert!(v["miss_equivalents"]["index_per_block_op"].is_number());
    }
}

#[test]
fn text_report_is_one_table_beside_the_ruler() {
    let t = trace(&[
        r#"{"hash_ids": [1, 2]}"#,
        r#"{"hash_ids": [1, 3]}"#,
        r#"{"hash_ids": [1, 2, 4]}"#,
    ]);
    let out = bench_indexer(&t, "2", "16", "1", &["--runs", "2", "--chase-loads", "0"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for row in [
        "ruler (plain radix tree)",
        "index/ruler",
        "block ops/s",
        "lookup p99",
        "mean best overlap",
        "equal",
        "route      8192 tokens in blocks of 512",
        "PMU ",
        "no calibration",
    ] {
        assert!(text.contains(row), "{row:?} missing in\n{text}");
    }
    assert!(!text.contains("chase ns"), "{text}");
}

#[test]
fn export_stream_matches_the_specified_records() {
    let t = trace(&[r#"{"hash_ids": [5]}"#, r#"{"hash_ids": [5, 6]}"#]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stream.bin");
    let out = bench_indexer(
        &t,
        "1",
        "8",
        "1",
        &[
            "--runs",
            "1",
            "--json",
            "--chase-loads",
            "0",
            "--engine-hash-salt",
            "0xff",
            "--export-stream",
            path.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&path).unwrap();
    let w: Vec<u64> = bytes
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let l5 = xxhash_rust::xxh3::xxh3_64_with_seed(&5u64.to_le_bytes(), 1337);
    let l6 = xxhash_rust::xxh3::xxh3_64_with_seed(&6u64.to_le_bytes(), 1337);
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&l5.to_le_bytes());
    buf[8..].copy_from_slice(&l6.to_le_bytes());
    let s6 = xxhash_rust::xxh3::xxh3_64_with_seed(&buf, 1337);
    assert_eq!(
        w,
        vec![
            0,
            0,
            0,
            1,
            l5 ^ 0xff,
            l5,
            1,
            0,
            1,
            l5 ^ 0xff,
            1,
            s6 ^ 0xff,
            l6
        ]
    );
}

/// `kvrouter bench indexer` on `trace` with W, C and K, plus any extra flags.
fn bench_indexer(
    trace: &tempfile::NamedTempFile,
    workers: &str,
    capacity: &str,
    sub_blocks: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut args = vec![
        "bench",
        "indexer",
        "--trace",
        trace.path().to_str().unwrap(),
        "--workers",
        workers,
        "--capacity-blocks",
        capacity,
        "--sub-blocks",
        sub_blocks,
    ];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn bad_traces_and_settings_are_named() {
    let t = trace(&[r#"{"hash_ids": [1]}"#, "", r#"{"hash_ids": [2]}"#]);
    let out = bench_indexer(&t, "1", "8", "1", &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(":2: blank line"), "{err}");

    let t = trace(&[r#"{"hash_ids": [1, 2, 3]}"#]);
    let out = bench_indexer(&t, "1", "4", "2", &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("request 0 has 6 sub-blocks"), "{err}");
}

#[test]
fn scale_mode_builds_the_fleet_it_is_asked_for() {
    // 10 workers x 2 ranks, 20 x 400 pairs: 8 system blocks and two 192-block chains a rank.
    let out = run(&[
        "bench",
        "indexer",
        "--scale",
        "--workers",
        "10",
        "--ranks",
        "2",
        "--pairs",
        "8000",
        "--runs",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let first = &v["runs"][0];
    assert_eq!(first["worker_keys"], 20);
    assert_eq!(first["live_pairs"], 20 * (8 + 2 * 192));
    assert_eq!(first["mean_best_overlap"], 8.0 + 192.0);
    assert_eq!(first["dump_blocks"], 8 + (65_536 - 8) / 192 * 192);
    for field in [
        "block_ops_per_s",
        "lookup_p99_us",
        "bytes_per_pair",
        "rebuild_ms",
    ] {
        assert!(v[field]["median"].is_number(), "{field} missing in {v}");
    }
    assert!(v["git_revision"].is_string());

    // --scale takes no trace; without it the trace flags are required
    let out = run(&["bench", "indexer", "--scale", "--trace", "x.jsonl"]);
    assert!(!out.status.success());
    let out = run(&["bench", "indexer", "--workers", "2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--trace"));
}
