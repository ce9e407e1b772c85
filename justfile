# Everyday commands (https://github.com/casey/just). Each is a plain cargo/bash line too.

# The main job: kv routing against round robin on a trace that ships in the repo.
demo:
    cargo run --release -- demo

# Routing quality on both shipped traces, with plots in docs/img/.
replay:
    cargo run --release -- bench replay --trace data/mooncake_trace_1000.jsonl --rate-scales 0.25,0.5,1,1.5,2,3 --plot docs/img/replay_mooncake.svg
    cargo run --release -- bench replay --trace data/synthetic_trace.jsonl --rate-scales 0.5,1,1.5,2 --plot docs/img/replay_synthetic.svg

# The indexer benchmark on a trace that ships in the repo.
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
