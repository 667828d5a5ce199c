#!/usr/bin/env bash
# Session 33, call A (H100): cuBLASLt's configurations for the batched decode products
# (cuda_bench_lt: today's tuner vs the best of split-K and exhaustive sets, from DRAM), the
# decode step with the split-K search beside today's (bench_cuda --lt-search both, same
# process), and the PyTorch peer of the products.
set -uo pipefail
T0=$(date +%s)
B=$PWD/.nx-tmp/a; mkdir -p $B; cp -r .carry/s33a/. $B/; xz -d -f $B/*.xz; chmod +x $B/*
mkdir -p /work && ln -sfn $PWD /work/main
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
C=$(cat $B/COMMIT)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 240 $B/cuda_bench_lt $OUT/lt.json $C --limit 1500 > $OUT/lt.log 2>&1; echo "cuda_bench_lt rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 $B/bench_cuda --config configs/models/llama-3.1-8b.json --out $OUT/step.json --commit $C --shapes 32:1024,64:1024,256:1024 --graphs on --no-ttft --no-profile --lt-search both > $OUT/step.log 2>&1; echo "bench_cuda rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 python3 scripts/bench/peer_linear.py $OUT/peer-linear.json --autotune-rows 64 > $OUT/peer-linear.log 2>&1; echo "peer_linear rc=$? $(( $(date +%s) - T0 )) s"
echo "===== summary ====="
tail -22 $OUT/lt.log
grep -E "graphs" $OUT/step.log | head -12
tail -18 $OUT/peer-linear.log
