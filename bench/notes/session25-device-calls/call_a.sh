#!/usr/bin/env bash
# Session 25, call A: streaming decode attention's early copies (the stages before the row's new
# token copied before the PDL wait). bench_cuda with --early-kv both (on = the new route, off =
# the copies after the wait; same process, alternating per shape): Llama-3.1-8B bf16 at the
# issue-14 shapes and a few single-stream ones, FP8 W+KV, Qwen3-30B-A3B; then the gpu_* tests
# of attention, the engine, graphs and the launch switches.
set -uo pipefail
C=.carry/s25a
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/a; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/device.txt
COMMIT=$(cat $S/COMMIT)
B="$S/bench_cuda --commit $COMMIT --graphs on --early-kv both --no-profile"
t0=$(date +%s)
timeout 200 $B --config configs/models/llama-3.1-8b.json --shapes 1:128,1:1024,1:8192,4:4096,8:1024,64:1024,256:1024,32:8192 \
  --out $O/bench-cuda-earlykv.json > $O/bench-cuda-earlykv.log 2>&1; echo "bf16 rc=$? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 100 $B --config configs/models/llama-3.1-8b.json --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:8192,8:1024,64:1024 \
  --out $O/bench-cuda-fp8-earlykv.json > $O/bench-cuda-fp8-earlykv.log 2>&1; echo "fp8 rc=$? in $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 100 $B --config configs/models/qwen3-30b-a3b.json --shapes 1:128,1:4096,16:1024 \
  --out $O/bench-cuda-moe-earlykv.json > $O/bench-cuda-moe-earlykv.log 2>&1; echo "moe rc=$? in $(( $(date +%s) - t0 )) s"
t2=$(date +%s)
timeout 200 $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
for f in $O/bench-cuda-*.log; do echo "== $(basename $f)"; grep -E '^copy|^  b=' $f | cut -c1-90; done
cd $OUT && tar czf callA.tgz a && rm -rf a
