#!/usr/bin/env bash
# Session 33, call B (H100): the GPU tests of the cuBLASLt search (every split-K candidate
# against the CPU GEMM) and those session 32 left unrun (the corrected fused-norm test, the MoE
# graph replays, the tiny models), at the carry's commit.
set -uo pipefail
T0=$(date +%s)
B=$PWD/.nx-tmp/a; mkdir -p $B; cp -r .carry/s33a/. $B/; xz -d -f $B/*.xz; chmod +x $B/*
mkdir -p /work && ln -sfn $PWD /work/main
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
mkdir -p $OUT/tests
timeout 90 $B/gpu_kernels --test-threads 1 lt_split_k linear_matches > $OUT/tests/gpu-kernels.log 2>&1; echo "gpu_kernels rc=$? $(( $(date +%s) - T0 )) s"
timeout 220 $B/gpu_launch_switches --test-threads 2 fused_norm > $OUT/tests/gpu-launch-switches.log 2>&1; echo "gpu_launch_switches rc=$? $(( $(date +%s) - T0 )) s"
timeout 110 $B/gpu_graphs --test-threads 2 moe > $OUT/tests/gpu-graphs.log 2>&1; echo "gpu_graphs moe rc=$? $(( $(date +%s) - T0 )) s"
timeout 90 $B/gpu_engine --test-threads 2 tiny_models well_conditioned > $OUT/tests/gpu-engine.log 2>&1; echo "gpu_engine rc=$? $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf tests.tgz tests && rm -rf tests; cd - > /dev/null
echo "===== summary ====="
tar xzf $OUT/tests.tgz -O | grep -E "^test |test result|panicked|candidates," | head -40
