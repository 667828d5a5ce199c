#!/usr/bin/env bash
# Disaggregation checks on 2 GPUs: the relay tests (CPU, gpu_relay*, gpu2_nccl_*), then bench_relay.
set -uo pipefail
H="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O="${OUT:-/tmp/out}"; mkdir -p "$O"
nvidia-smi -L | tee "$O/device.txt"
timeout 260 "$H/cargo-nextest" nextest run --archive-file "$H/tests.tar.zst" --workspace-remap . \
  -E 'test(/relay/)' --no-fail-fast --success-output immediate --test-threads 1 > "$O/gpu-tests.log" 2>&1
echo "tests rc=$?"
timeout 220 "$H/bench_relay" --config "$H/llama-3.2-1b.json" --out "$O/relay.json" --commit "$(cat "$H/COMMIT")" > "$O/bench-relay.log" 2>&1
echo "bench rc=$?"
echo "== tests"; grep -E "^ +(PASS|FAIL|SIGSEGV|SIGABRT|TIMEOUT)" "$O/gpu-tests.log" | sed 's/^ *//' | sort | uniq | head -40
grep -E "Summary" "$O/gpu-tests.log" | tail -1
grep -B2 -A12 "panicked" "$O/gpu-tests.log" | grep -v "^ *[0-9]*: \|^ *at " | head -60
echo "== bench"; tail -25 "$O/bench-relay.log"
