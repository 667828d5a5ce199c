#!/usr/bin/env bash
# Session 33, call A (H100): cuBLASLt's configurations for the batched decode products
# (cuda_bench_lt: today's tuner vs the best of split-K and exhaustive sets, from DRAM), the
# PyTorch peer of the same products, then the GPU tests session 32 left unrun (the corrected
# fused-norm test, the MoE graph replays, the tiny models) at the carry's commit.
set -uo pipefail
T0=$(date +%s)
B=$PWD/.nx-tmp/a; mkdir -p $B; cp -r .carry/s33a/. $B/; xz -d -f $B/*.xz; chmod +x $B/*
mkdir -p /work && ln -sfn $PWD /work/main
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
C=$(cat $B/COMMIT)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 260 $B/cuda_bench_lt $OUT/lt.json $C --limit 1500 > $OUT/lt.log 2>&1; echo "cuda_bench_lt rc=$? $(( $(date +%s) - T0 )) s"
timeout 200 python3 scripts/bench/peer_linear.py $OUT/peer-linear.json --autotune-rows 64 > $OUT/peer-linear.log 2>&1; echo "peer_linear rc=$? $(( $(date +%s) - T0 )) s"
mkdir -p $OUT/tests
timeout 200 $B/gpu_launch_switches --test-threads 2 fused_norm > $OUT/tests/gpu-launch-switches.log 2>&1; echo "gpu_launch_switches rc=$? $(( $(date +%s) - T0 )) s"
timeout 100 $B/gpu_graphs --test-threads 2 moe > $OUT/tests/gpu-graphs.log 2>&1; echo "gpu_graphs moe rc=$? $(( $(date +%s) - T0 )) s"
timeout 80 $B/gpu_engine --test-threads 2 tiny_models well_conditioned > $OUT/tests/gpu-engine.log 2>&1; echo "gpu_engine rc=$? $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf tests.tgz tests && rm -rf tests; cd - > /dev/null
echo "===== summary ====="
tar xzf $OUT/tests.tgz -O | grep -E "^test |test result|panicked" | head -30
cat $OUT/lt.log | tail -20
cat $OUT/peer-linear.log | tail -20
