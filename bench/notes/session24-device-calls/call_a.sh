#!/usr/bin/env bash
# Session 24, call A (d37392f: the residual product stores the next norm's output): the gpu_*
# tests of the changed kernels and routes, then bench_cuda with --fused-norm both (on = the new
# route, off = the old one, same process, alternating): FP8 W+KV Llama-3.1-8B, Qwen3-30B-A3B bf16.
set -uo pipefail
C=.carry/s24a
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/a; mkdir -p $O
COMMIT=$(cat $S/COMMIT)
t2=$(date +%s)
timeout 330 $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
B="$S/bench_cuda --commit $COMMIT --graphs on"
t3=$(date +%s)
timeout 110 $B --config $S/configs/llama-3.1-8b.json --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:1024,4:4096,8:1024,1:8192 \
  --fused-norm both --no-profile --out $O/bench-cuda-fp8-normout.json > $O/bench-cuda-fp8-normout.log 2>&1; echo "fp8 rc=$? in $(( $(date +%s) - t3 )) s"
t3=$(date +%s)
timeout 70 $B --config $S/configs/llama-3.1-8b.json --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128 \
  --out $O/bench-cuda-fp8-profile.json > $O/bench-cuda-fp8-profile.log 2>&1; echo "fp8 profile rc=$? in $(( $(date +%s) - t3 )) s"
t3=$(date +%s)
timeout 110 $B --config $S/configs/qwen3-30b-a3b.json --shapes 1:128,16:1024 --fused-norm both --no-profile \
  --out $O/bench-cuda-moe-normout.json > $O/bench-cuda-moe-normout.log 2>&1; echo "moe rc=$? in $(( $(date +%s) - t3 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
for f in $O/bench-cuda-*.log; do echo "== $(basename $f)"; grep -iE 'decode|copy|ms' $f | grep -v '^ *$' | tail -14; done
cd $OUT && tar czf callA.tgz a && rm -rf a
