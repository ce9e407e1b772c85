#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: installs what the tests need, then
# runs unit, property and end-to-end tests (the end-to-end ones run the real binary), and
# prints how many ran. Arguments go to cargo test in place of `--workspace --all-targets`
# (e.g. `-p kvrouter-replica`, `-p kvrouter --test e2e`).
# The `ci` profile is release without LTO: optimised binaries that link in seconds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
# No arguments: everything. Arguments choose what runs (`-p CRATE`, `--test SUITE`, filters).
[ $# -gt 0 ] || set -- --workspace --all-targets
cargo test --profile ci "$@" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { p += $4; f += $6; i += $8; b += 1 }
     END { printf "tests: %d passed, %d failed, %d ignored, in %d test binaries\n", p, f, i, b }' "$log"
exit "$status"
