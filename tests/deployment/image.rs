//! What the image ships: the Dockerfile builds the operator's set, without the benchmark
//! and chaos stack (kvrouter-bench, plotters and their image and font crates) or the test kit.

use crate::common::repo_file;
use std::process::Command;

/// The feature flags of the Dockerfile's `cargo build` (its words from `--no-default-features`,
/// `--features X`, `--all-features`).
fn dockerfile_features() -> Vec<String> {
    let text = std::fs::read_to_string(repo_file("Dockerfile")).expect("a Dockerfile");
    let build = text
        .lines()
        .find(|l| l.contains("cargo build"))
        .expect("a cargo build in the Dockerfile");
    let words: Vec<&str> = build.split_whitespace().collect();
    let mut flags = Vec::new();
    for (i, w) in words.iter().enumerate() {
        match *w {
            "--no-default-features" | "--all-features" => flags.push(w.to_string()),
            "--features" | "-F" => {
                flags.push("--features".into());
                flags.push(words.get(i + 1).expect("a feature list").to_string());
            }
            w if w.starts_with("--features=") => flags.push(w.to_string()),
            _ => {}
        }
    }
    flags
}

#[test]
fn the_image_builds_without_the_bench_stack() {
    let flags = dockerfile_features();
    assert!(
        flags.iter().any(|f| f == "--no-default-features"),
        "the image would build the default (developer) features: {flags:?}"
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "-e", "normal", "-p", "kvrouter", "--prefix", "none"])
        .args(["--manifest-path", repo_file("Cargo.toml").to_str().unwrap()])
        .arg("--offline")
        .args(&flags)
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for name in ["kvrouter-replay", "kvrouter-replica", "kvrouter-frontend"] {
        assert!(
            crates.contains(&name),
            "{name} missing from the image:\n{tree}"
        );
    }
    for name in ["kvrouter-bench", "plotters", "image", "kvrouter-testkit"] {
        assert!(!crates.contains(&name), "the image links {name}:\n{tree}");
    }

    // And the default (developer) build does have them, so the check above can fail.
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "tree",
            "-e",
            "normal",
            "-p",
            "kvrouter",
            "--prefix",
            "none",
            "--offline",
        ])
        .args(["--manifest-path", repo_file("Cargo.toml").to_str().unwrap()])
        .output()
        .expect("cargo tree runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.lines().any(|l| l.starts_with("kvrouter-bench ")),
        "{tree}"
    );
}
