# Everyday commands (https://github.com/casey/just). Each is a plain cargo/bash line too.

# The main job: the indexer benchmark on a trace that ships in the repo.
bench:
    cargo run --release -- bench indexer --trace data/synthetic_trace.jsonl --workers 16 --capacity-blocks 16384 --sub-blocks 8

# Every test, with its own set-up (installs nats-server 2.10+ if missing).
test:
    bash scripts/test.sh

# What CI runs: fmt, clippy, tests.
ci:
    bash .ci/run

fmt:
    cargo fmt --all

lint:
    cargo clippy --workspace --all-targets --release -- -D warnings

# Criterion micro-benchmarks of the index core.
microbench:
    cargo bench -p kvrouter-indexer
