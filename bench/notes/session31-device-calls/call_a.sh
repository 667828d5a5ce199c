#!/usr/bin/env bash
# Session 31, call A (H100): the work-queue decode attention kernel (paged_attention_sq_*).
# First its correctness (the attention-options and FP8 GPU tests, which run every variant
# against the CPU reference and the streaming kernel bit for bit), then decode attention over
# FP8 and bf16 caches with the queue variants beside the streaming defaults, at fixed splits.
set -uo pipefail
T0=$(date +%s)
S=$PWD/.nx-tmp/carry; mkdir -p $S; cp -r .carry/s31/. $S/; xz -d -f $S/*.xz; chmod +x $S/*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
COMMIT=$(cat $S/COMMIT)
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 200 $S/gpu_attention_options --test-threads 2 > $OUT/gpu-attention-options.log 2>&1
echo "gpu_attention_options rc=$? at $(( $(date +%s) - T0 )) s"
timeout 150 $S/gpu_kv_fp8 --test-threads 2 attention > $OUT/gpu-kv-fp8.log 2>&1
echo "gpu_kv_fp8 (attention) rc=$? at $(( $(date +%s) - T0 )) s"
SH=32:2048,64:2048,32:8192,128:4096,256:1024,8:4096,1:8192
timeout 200 $S/cuda_bench_fp8 $OUT/cuda-bench-fp8.json $COMMIT $SH > $OUT/cuda-bench-fp8.log 2>&1
echo "fp8 bench rc=$? at $(( $(date +%s) - T0 )) s"
timeout 150 $S/cuda_bench $OUT/cuda-bench-attn.json $COMMIT attention 32:2048,64:2048,32:8192,256:1024,1:8192 > $OUT/cuda-bench-attn.log 2>&1
echo "bf16 bench rc=$? at $(( $(date +%s) - T0 )) s"
echo "===== summary ====="
grep -E "test result|FAILED|panicked" $OUT/gpu-attention-options.log $OUT/gpu-kv-fp8.log | head -20
grep -E "^ fp8 |^ bf16 " $OUT/cuda-bench-fp8.log | grep -v "fixed splits" | grep -E "default|st_w8_s3_g8|sq_" | head -40
grep -E "fixed splits" $OUT/cuda-bench-fp8.log | grep -E " st | sq_" | head -30
grep -E "sq_|\*" $OUT/cuda-bench-attn.log | head -60
