#!/usr/bin/env bash
# Builds what the 2-GPU disaggregation checks carry to the GPU machine (no Rust there).
#
#   scripts/gpu-disagg/build.sh                     (here)
#   run(command="bash .carry/relay/relay.sh", carry=[".carry/relay"], kind="nvidia-h200-x2")
#       the relay tests (gpu_relay, gpu2_nccl_*) and bench_relay (NCCL ceiling, TTFT unified
#       vs relayed over NCCL and TCP) on a Llama-3.2-1B-shape dummy model;
#   run(command="bash .carry/e2e/e2e.sh", carry=[".carry/e2e"], kind="nvidia-h200-x2")
#       baton router + prefill worker (cuda:0, --kv-transport nccl) + decode worker (cuda:1)
#       against baton serve, through HTTP;
#   run(command="bash .carry/goodput/goodput.sh", carry=[".carry/goodput"], kind="nvidia-h200-x2")
#       goodput of 1P1D vs two unified workers under a mixed baton-loadtest load (~4 min).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_DEV_STRIP=debuginfo CARGO_PROFILE_TEST_DEBUG=0 CARGO_PROFILE_TEST_STRIP=debuginfo
target="${CARGO_TARGET_DIR:-target}"
mkdir -p .carry/relay .carry/e2e
cargo nextest archive -p baton-engine --archive-file .carry/relay/tests.tar.zst
cargo build -p baton-engine --example bench_relay
cargo build -p baton --bin baton
cargo build -p baton-formats --example write_tiny_models
cargo build -p baton-loadtest --bin baton-loadtest
cp "$target/debug/examples/bench_relay" "$(command -v cargo-nextest)" configs/models/llama-3.2-1b.json .carry/relay/
cp scripts/gpu-disagg/relay.sh .carry/relay/
cp "$target/debug/baton" "$target/debug/examples/write_tiny_models" scripts/gpu-disagg/e2e.py scripts/gpu-disagg/e2e.sh .carry/e2e/
mkdir -p .carry/goodput/lib
cp "$target/debug/baton" "$target/debug/baton-loadtest" "$target/debug/examples/write_tiny_models" \
   configs/models/llama-3.2-1b.json scripts/gpu-disagg/goodput.py scripts/gpu-disagg/goodput.sh .carry/goodput/
# The GPU machine lacks the font libraries plotters links against.
for l in libfontconfig.so.1 libfreetype.so.6 libexpat.so.1 libpng16.so.16 libbrotlidec.so.1 libbrotlicommon.so.1; do
    cp -L "/lib/x86_64-linux-gnu/$l" .carry/goodput/lib/
done
git rev-parse --short HEAD | tee .carry/relay/COMMIT > .carry/e2e/COMMIT
du -sh .carry/relay .carry/e2e .carry/goodput
