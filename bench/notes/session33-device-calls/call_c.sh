#!/usr/bin/env bash
# Session 33, call C (H100): cuBLASLt's tuner timing its candidates behind an L2 flush
# (`-flushed`) beside today's isolated timing, in the same process: the products alone
# (cuda_bench_lt's flushed pick column), the bf16 decode step at 32-256 rows (order A B A),
# and the FP8 W+KV step (W8A8 goes through the same tuner). (The torch.compile peer was cut
# from this call: failed machine starts had spent the device time it needed.)
set -uo pipefail
T0=$(date +%s)
B=$PWD/.nx-tmp/c; mkdir -p $B; cp -r .carry/s33c/. $B/; xz -d -f $B/*.xz; chmod +x $B/*
mkdir -p /work && ln -sfn $PWD /work/main
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
C=$(cat $B/COMMIT)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 120 $B/cuda_bench_lt $OUT/lt.json $C --limit 200 > $OUT/lt.log 2>&1; echo "cuda_bench_lt rc=$? $(( $(date +%s) - T0 )) s"
timeout 130 $B/bench_cuda --config configs/models/llama-3.1-8b.json --out $OUT/step.json --commit $C --shapes 32:1024,64:1024,128:1024,256:1024 --graphs on --no-ttft --no-profile --lt-tuner heuristic,heuristic-flushed,heuristic > $OUT/step.log 2>&1; echo "bench_cuda bf16 rc=$? $(( $(date +%s) - T0 )) s"
timeout 90 $B/bench_cuda --config configs/models/llama-3.1-8b.json --out $OUT/step-fp8.json --commit $C --shapes 64:1024,256:1024 --graphs on --no-ttft --no-profile --quantization fp8 --kv-cache-dtype fp8 --lt-tuner heuristic,heuristic-flushed,heuristic > $OUT/step-fp8.log 2>&1; echo "bench_cuda fp8 rc=$? $(( $(date +%s) - T0 )) s"
echo "===== summary ====="
tail -17 $OUT/lt.log | cut -c1-120
grep -E "graphs" $OUT/step.log | head -14
grep -E "graphs" $OUT/step-fp8.log | head -8
