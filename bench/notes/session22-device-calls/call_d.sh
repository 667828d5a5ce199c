#!/usr/bin/env bash
# Session 22, call D: the RoPE epilogue with Qwen2's qkv bias. Qwen2.5-7B shape, bf16 and FP8
# W+KV, --fused-rope both; Llama-3.1-8B bf16 beside (no bias: unchanged expected); then the
# gpu_* tests of the RoPE epilogue, the launch switches, the engine and transformers bf16.
set -uo pipefail
C=.carry/s22
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT; mkdir -p $O/d
COMMIT=$(cat $S/COMMIT)
t0=$(date +%s)
B="$S/bench_cuda --commit $COMMIT --graphs on --no-profile --fused-rope both"
timeout 100 $B --config $S/configs/qwen2.5-7b.json --shapes 1:128,1:1024,8:1024,16:1024 \
  --out $O/d/qwen2-bf16.json > $O/d/qwen2-bf16.log 2>&1 || echo "qwen2 bf16 rc=$?"
timeout 100 $B --config $S/configs/qwen2.5-7b.json --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:1024,8:1024 \
  --out $O/d/qwen2-fp8-wkv.json > $O/d/qwen2-fp8-wkv.log 2>&1 || echo "qwen2 fp8 rc=$?"
timeout 80 $B --config $S/configs/llama-3.1-8b.json --shapes 1:128,8:1024 \
  --out $O/d/llama-bf16.json > $O/d/llama-bf16.log 2>&1 || echo "llama rc=$?"
echo "benches in $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout $(( 420 - (t1 - t0) )) $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 > $O/d/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t1 )) s"
grep -E '^ +Summary' $O/d/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/d/gpu-tests.log | sort -u | head
for f in $O/d/*.log; do [[ $f == *gpu-tests* ]] && continue; echo "== $(basename $f)"; grep -E '^copy|^  b=' $f | awk -F'|' '{print $1 "|" $2 "|" $3 "|" $5}'; done
cd $O && tar czf callD.tgz d && rm -rf d
