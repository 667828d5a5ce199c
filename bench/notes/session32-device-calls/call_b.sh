#!/usr/bin/env bash
# Session 32, call B (H100): the MoE branch with both norms fused (ef2b7c1) beside the unfused
# ops in the same process (`bench_cuda --fused-norm both`), Qwen3-30B-A3B shape; the build before
# the change (41ea8a4) as a second baseline; then the GPU tests that cover the change.
set -uo pipefail
T0=$(date +%s)
A=$PWD/.nx-tmp/old; B=$PWD/.nx-tmp/new; mkdir -p $A $B
cp -r .carry/s32a/. $A/; cp -r .carry/s32b/. $B/; xz -d -f $A/*.xz $B/*.xz; chmod +x $A/* $B/*
# The test binaries find their fixtures through the build machine's CARGO_MANIFEST_DIR.
mkdir -p /work && ln -sfn $PWD /work/main
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SH=1:128,1:4096,4:1024,16:1024
timeout 200 $B/bench_cuda --config configs/models/qwen3-30b-a3b.json --out $OUT/moe-new.json --commit $(cat $B/COMMIT) --shapes $SH --graphs on --no-ttft --fused-norm both > $OUT/moe-new.log 2>&1; echo "moe new rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 $A/bench_cuda --config configs/models/qwen3-30b-a3b.json --out $OUT/moe-old.json --commit $(cat $A/COMMIT) --shapes $SH --graphs on --no-ttft --no-profile > $OUT/moe-old.log 2>&1; echo "moe old rc=$? $(( $(date +%s) - T0 )) s"
mkdir -p $OUT/tests
timeout 150 $B/gpu_moe_kernels --test-threads 2 > $OUT/tests/gpu-moe-kernels.log 2>&1; echo "gpu_moe_kernels rc=$? $(( $(date +%s) - T0 )) s"
timeout 60 $B/gpu_norm_linear --test-threads 2 > $OUT/tests/gpu-norm-linear.log 2>&1; echo "gpu_norm_linear rc=$? $(( $(date +%s) - T0 )) s"
timeout 120 $B/gpu_launch_switches --test-threads 2 fused_norm > $OUT/tests/gpu-launch-switches.log 2>&1; echo "gpu_launch_switches rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 $B/gpu_graphs --test-threads 2 moe > $OUT/tests/gpu-graphs.log 2>&1; echo "gpu_graphs moe rc=$? $(( $(date +%s) - T0 )) s"
timeout 120 $B/gpu_engine --test-threads 2 tiny_models well_conditioned fp8_moe gpt_oss > $OUT/tests/gpu-engine.log 2>&1; echo "gpu_engine rc=$? $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf tests.tgz tests && rm -rf tests; cd - > /dev/null
echo "===== summary ====="
tar xzf $OUT/tests.tgz -O | grep -E "^test |test result|panicked" | head -40
for f in moe-new moe-old; do echo "== $f"; grep -E "graphs\+pdl|experts touched" $OUT/$f.log | head -20; done
grep -E "^\s+(norm|qkv|o_proj|moe_[a-z_]+|total)\s" $OUT/moe-new.log | head -40
