#!/usr/bin/env bash
# Session 32, call A (H100): where a MoE decode step's time goes at the current code (41ea8a4):
# Qwen3-30B-A3B shape, graphs + PDL step and the eager per-op profile (its moe_* kernels apart),
# at 1 x 128, 1 x 4k, 4 x 1k and 16 x 1k; then Llama-3.1-8B and Qwen3-8B at 1 x 128 for the
# same per-op view of the dense layers beside it.
set -uo pipefail
T0=$(date +%s)
S=$PWD/.nx-tmp/s32a; mkdir -p $S; cp -r .carry/s32a/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
C=$(cat $S/COMMIT)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 240 $S/bench_cuda --config configs/models/qwen3-30b-a3b.json --out $OUT/moe.json --commit $C --shapes 1:128,1:4096,4:1024,16:1024 --graphs on --no-ttft > $OUT/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 $S/bench_cuda --config configs/models/llama-3.1-8b.json --out $OUT/llama.json --commit $C --shapes 1:128,1:8192 --graphs on --no-ttft > $OUT/llama.log 2>&1; echo "llama rc=$? $(( $(date +%s) - T0 )) s"
timeout 150 $S/bench_cuda --config configs/models/qwen3-8b.json --out $OUT/qwen3.json --commit $C --shapes 1:128 --graphs on --no-ttft > $OUT/qwen3.log 2>&1; echo "qwen3 rc=$? $(( $(date +%s) - T0 )) s"
echo "===== summary ====="
for f in moe llama qwen3; do echo "== $f"; grep -v "^\s*$" $OUT/$f.log | tail -60 | cut -c1-200; done
