#!/usr/bin/env bash
# Session 22, call A: the FP8 skinny GEMM's fused epilogues (gated activation, RoPE + KV write)
# on/off in one binary (bench_cuda --fused-gate both --fused-rope both), FP8 weights over a bf16
# and an FP8 cache, Llama-3.1-8B shape; a bf16 single stream beside it (no change expected);
# then the gpu_* tests the change touches.
set -uo pipefail
C=.carry/s22
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT; mkdir -p $O/a
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/a/device.txt
COMMIT=$(cat $S/COMMIT)
B="$S/bench_cuda --config $S/configs/llama-3.1-8b.json --commit $COMMIT --graphs on"
t0=$(date +%s)
timeout 150 $B --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:1024,1:8192,8:1024 \
  --fused-gate both --fused-rope both --out $O/a/fp8-wkv.json > $O/a/fp8-wkv.log 2>&1 || echo "fp8-wkv rc=$?"
echo "fp8 wkv in $(( $(date +%s) - t0 )) s"
timeout 100 $B --quantization fp8 --shapes 1:128,1:1024,8:1024 --no-profile \
  --fused-gate both --fused-rope both --out $O/a/fp8-w.json > $O/a/fp8-w.log 2>&1 || echo "fp8-w rc=$?"
timeout 80 $B --shapes 1:128,8:1024 --no-profile --out $O/a/bf16.json > $O/a/bf16.log 2>&1 || echo "bf16 rc=$?"
echo "benches in $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout $(( 560 - (t1 - t0) )) $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 > $O/a/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t1 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/a/gpu-tests.log | tail -1
grep -E '^ +(PASS|FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/a/gpu-tests.log | awk '{print $1, $NF}' | sort | uniq -c | sort -rn | head -40
for f in $O/a/*.log; do [[ $f == *gpu-tests* ]] && continue; echo "== $(basename $f)"; grep -E '^copy|^  b=' $f; done
cd $O && tar czf callA.tgz a && rm -rf a
