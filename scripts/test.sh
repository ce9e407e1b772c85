#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: installs what the tests need, then
# runs unit, property and end-to-end tests (the end-to-end ones run the real binary).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
cargo test --workspace --all-targets --release "$@"
