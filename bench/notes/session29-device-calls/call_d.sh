#!/usr/bin/env bash
# Session 29, call D (H100): the skinny GEMM's first weight batch loaded before the PDL wait
# (and, for norm inputs with room, the first x batch before the stats). Three bench_cuda
# binaries in one process order A B C C B A: A = 27da163 (the peer), B = the change, C = the
# change + the RoPE-fused qkv on the 4-warp variant at <= 8 rows (where the x batch fits early
# too). Then the gpu_* tests of baton-kernels and of gpu_engine + gpu_launch_switches on B.
set -uo pipefail
T0=$(date +%s)
C=.carry/s29
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda_* $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
for v in A B C C B A; do
  timeout 60 $S/bench_cuda_$v --commit $v --graphs on --no-profile --no-ttft --config configs/models/llama-3.1-8b.json \
    --shapes 1:128,1:8192,4:1024,8:1024,16:1024 --out $OUT/bench-$v-$SECONDS.json >> $OUT/bench-$v.log 2>&1
  echo "bench $v rc=$? at $(( $(date +%s) - T0 )) s"
done
mkdir -p $TMPDIR/nx-k $TMPDIR/nx-e
timeout 150 $S/cargo-nextest nextest run --archive-file $S/tests-kernels.tar.zst --extract-to $TMPDIR/nx-k --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $OUT/gpu-tests-kernels.log 2>&1
echo "tests kernels rc=$? at $(( $(date +%s) - T0 )) s"
LEFT=$(( 575 - ( $(date +%s) - T0 ) ))
timeout $LEFT $S/cargo-nextest nextest run --archive-file $S/tests-engine.tar.zst --extract-to $TMPDIR/nx-e --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $OUT/gpu-tests-engine.log 2>&1
echo "tests engine rc=$? at $(( $(date +%s) - T0 )) s (window $LEFT s)"
cd $OUT && tar czf bench-json.tgz bench-*.json && rm -f bench-*.json; cd - >/dev/null
echo "===== summary ====="
for f in kernels engine; do grep -E '^ +Summary' $OUT/gpu-tests-$f.log | tail -1; done
grep -hE '^ +(FAIL|SIGSEGV|SIGTERM|TIMEOUT|SIGABRT)' $OUT/gpu-tests-*.log | sort -u | head -20
for v in A B C; do echo "== $v"; grep -E '^  b=' $OUT/bench-$v.log | awk -F'|' '{printf "%s|%s|%s\n", $1, $3, $5}'; done
