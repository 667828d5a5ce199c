#!/usr/bin/env bash
# The gpu_* tests (and the CUDA kernel benchmark) from a carried nextest archive.
#
# There is no Rust toolchain on the GPU machine, so this works in two halves:
#
#   here (dev machine):   scripts/gpu-tests.sh --build
#       builds a nextest archive of the crates that hold gpu_* tests (debuginfo stripped so
#       it fits the 64 MiB carry limit), the benchmark programs, and copies cargo-nextest,
#       all into .carry/gpu/ (git-ignored);
#   there (GPU machine):  scripts/gpu-tests.sh [--bench]
#       runs every test named gpu_* from the archive (a test that cannot open a GPU fails,
#       it is never skipped), then with --bench runs kernels/examples/cuda_bench and writes
#       bench/results-style JSON to $OUT (or bench/results/).
#
# With the device tool: run(command="bash scripts/gpu-tests.sh --bench", carry=[".carry/gpu"]).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CARRY="${BATON_GPU_CARRY:-.carry/gpu}"

if [[ "${1:-}" == "--build" ]]; then
    set -e
    # Stripped test binaries: with debuginfo the archive is ~170 MB.
    export CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_DEV_STRIP=debuginfo
    export CARGO_PROFILE_TEST_DEBUG=0 CARGO_PROFILE_TEST_STRIP=debuginfo
    mkdir -p "$CARRY"
    scripts/gpu-archive.sh "$CARRY/tests.tar.zst" "${BATON_GPU_TESTS:-all}"
    cargo build -p baton-kernels --examples
    target="${CARGO_TARGET_DIR:-target}"
    cp "$target/debug/examples/cuda_bench" "$target/debug/examples/cuda_compile" "$CARRY/"
    cp "$(command -v cargo-nextest)" "$CARRY/"
    git rev-parse HEAD > "$CARRY/COMMIT" 2>/dev/null || echo unknown > "$CARRY/COMMIT"
    du -sh "$CARRY"
    exit 0
fi

export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
OUTDIR="${OUT:-bench/results}"
mkdir -p "$OUTDIR"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
"$CARRY/cuda_compile" compute_90a "$OUTDIR/baton_kernels_compute_90a.ptx" || status=1

timeout "${BATON_GPU_TEST_TIMEOUT:-360}" "$CARRY/cargo-nextest" nextest run --archive-file "$CARRY/tests.tar.zst" --workspace-remap . \
    -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 || status=1

if [[ "${1:-}" == "--bench" ]]; then
    dev="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | sed 's/[^a-z0-9-]//g')"
    day="$(date -u +%Y-%m-%d)"
    timeout "${BATON_GPU_BENCH_TIMEOUT:-200}" "$CARRY/cuda_bench" "$OUTDIR/cuda-kernels-${dev:-gpu}-$day.json" "$(cat "$CARRY/COMMIT" 2>/dev/null)" || status=1
fi
exit $status
