#!/usr/bin/env bash
# Session 22, call C, at the final kernel commit: NVRTC compile of every module (cuda_compile:
# per-module times, the check that each module defines what the device loads), the FP8
# epilogues on/off again (FP8 weights over FP8 and bf16 caches) with a bf16 single stream
# beside them, then the gpu_* tests the session touched.
set -uo pipefail
C=.carry/s22
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda $S/cargo-nextest $S/cc_post
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT; mkdir -p $O/c
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/c/device.txt
COMMIT=$(cat $S/COMMIT)
t0=$(date +%s)
timeout 120 $S/cc_post sm_90a $S/cubins > $O/c/cuda-compile.log 2>&1; echo "cuda_compile rc=$?"
B="$S/bench_cuda --config $S/configs/llama-3.1-8b.json --commit $COMMIT --graphs on"
timeout 150 $B --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:1024,1:8192,4:4096,8:1024 \
  --fused-gate both --fused-rope both --out $O/c/fp8-wkv.json > $O/c/fp8-wkv.log 2>&1 || echo "fp8-wkv rc=$?"
timeout 100 $B --quantization fp8 --shapes 1:128,1:1024,8:1024 --no-profile \
  --fused-gate both --fused-rope both --out $O/c/fp8-w.json > $O/c/fp8-w.log 2>&1 || echo "fp8-w rc=$?"
timeout 80 $B --shapes 1:128,8:1024 --no-profile --out $O/c/bf16.json > $O/c/bf16.log 2>&1 || echo "bf16 rc=$?"
echo "compile + benches in $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout $(( 570 - (t1 - t0) )) $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 > $O/c/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t1 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/c/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/c/gpu-tests.log | sort -u | head
grep -E 'gemv|modules in|lacks' $O/c/cuda-compile.log
for f in $O/c/*.log; do [[ $f == *gpu-tests* || $f == *compile* ]] && continue; echo "== $(basename $f)"; grep -E '^copy|^  b=' $f | awk -F'|' '{print $1 "|" $2 "|" $3 "|" $5}'; done
cd $O && tar czf callC.tgz c && rm -rf c
