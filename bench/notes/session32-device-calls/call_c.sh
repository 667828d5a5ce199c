#!/usr/bin/env bash
# Session 32, call C (H100): which of a MoE layer's two norms to fuse (4b0c067). Each
# `bench_cuda --moe-norm X --fused-norm both` run has the unfused ops as its peer in the same
# process; Qwen3-30B-A3B shape. Then the GPU tests of the change (each fusion choice against the
# unfused steps, the MoE graph replays, the tiny models against the CPU).
set -uo pipefail
T0=$(date +%s)
B=$PWD/.nx-tmp/c; mkdir -p $B; cp -r .carry/s32c/. $B/; xz -d -f $B/*.xz; chmod +x $B/*
mkdir -p /work && ln -sfn $PWD /work/main
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
SH=1:128,1:4096,2:1024,4:1024,8:1024
for mode in down router both; do
  timeout 150 $B/bench_cuda --config configs/models/qwen3-30b-a3b.json --out $OUT/moe-$mode.json --commit $(cat $B/COMMIT) --shapes $SH --graphs on --no-ttft --no-profile --fused-norm both --moe-norm $mode > $OUT/moe-$mode.log 2>&1; echo "moe $mode rc=$? $(( $(date +%s) - T0 )) s"
done
mkdir -p $OUT/tests
timeout 200 $B/gpu_launch_switches --test-threads 2 fused_norm > $OUT/tests/gpu-launch-switches.log 2>&1; echo "gpu_launch_switches rc=$? $(( $(date +%s) - T0 )) s"
timeout 120 $B/gpu_graphs --test-threads 2 moe > $OUT/tests/gpu-graphs.log 2>&1; echo "gpu_graphs moe rc=$? $(( $(date +%s) - T0 )) s"
timeout 100 $B/gpu_engine --test-threads 2 tiny_models well_conditioned > $OUT/tests/gpu-engine.log 2>&1; echo "gpu_engine rc=$? $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf tests.tgz tests && rm -rf tests; cd - > /dev/null
echo "===== summary ====="
tar xzf $OUT/tests.tgz -O | grep -E "^test |test result|panicked|assertion|left|right" | head -30
for mode in down router both; do echo "== $mode"; grep -E "graphs\+pdl" $OUT/moe-$mode.log; done
