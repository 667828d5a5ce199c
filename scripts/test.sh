#!/usr/bin/env bash
# The project's test command (the README points here, and .ci/run runs it).
# Runs on a machine without a GPU: every test named gpu_* or gpu2_* (two GPUs) is excluded here and
# runs on the GPU machine instead (scripts/gpu-tests.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

# The default model (SmolLM2-135M-Instruct Q4_1) is needed by the tests that load it.
scripts/fetch-default-model.sh || exit 1

# Rust: unit, property and end-to-end tests (real `baton` processes on loopback). With
# cargo-nextest (what CI uses: each test in its own process, in parallel); on a machine with only
# rustup's toolchain, plain `cargo test` runs the same tests (GPU tests skipped by name).
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast -E 'not test(/^gpu/)' 2>&1 | tee "$logs/nextest.log"
  rust_rc=${PIPESTATUS[0]}
else
  echo "cargo-nextest is not installed (cargo install cargo-nextest --locked): running cargo test"
  cargo test --workspace --no-fail-fast -- --skip gpu_ --skip gpu2_ 2>&1 | tee "$logs/cargo-test.log"
  rust_rc=${PIPESTATUS[0]}
  # One summary line in nextest's words, summed over the test binaries.
  awk '/^test result:/ { p += $4; f += $6 } END { printf "Summary: %d passed, %d failed\n", p, f }' \
    "$logs/cargo-test.log" > "$logs/nextest.log"
fi

# OpenAI client conformance: the official `openai` Python package against `baton serve`
# on a tiny random model written by the real writer.
cargo build --quiet -p baton -p baton-formats --examples --bins || exit 1
"$target/debug/examples/write_tiny_models" "$logs/models" >/dev/null || exit 1
TINY_MODEL_DIR="$logs/models/llama" BATON_BIN="$target/debug/baton" tests/conformance/run.sh 2>&1 | tee "$logs/pytest.log"
py_rc=${PIPESTATUS[0]}

# One closing line over both runners.
count() { grep -oE "$1" "$2" | tail -n1 | grep -oE '^[0-9]+' || echo 0; }
rust_passed=$(count '[0-9]+ passed' "$logs/nextest.log")
rust_failed=$(count '[0-9]+ failed' "$logs/nextest.log")
py_passed=$(count '[0-9]+ passed' "$logs/pytest.log")
py_failed=$(count '[0-9]+ (failed|error)' "$logs/pytest.log")
echo "total: $((rust_passed + py_passed)) passed, $((rust_failed + py_failed)) failed"
if [[ $rust_rc -ne 0 || $py_rc -ne 0 ]]; then
  echo "FAILED: nextest exit $rust_rc, conformance exit $py_rc" >&2
  exit 1
fi
