#!/usr/bin/env bash
# Session 25, call B (9fe2928): the gpu_* tests of attention, the engine, graphs, FP8 KV and the
# launch switches (the early copies' bit-identity test among them); then why call A's
# bench_cuda of 42875c6 ran b=4 x 4k 23 % slower than cf55dbd's: the three binaries (9fe2928,
# the combine without shared memory; 42875c6, the combine with 1 KB of it; cf55dbd) at one to
# eight rows, and each one's eager per-op profile of b=4 x 4k.
set -uo pipefail
T0=$(date +%s)
C=.carry/s25a
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda* $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/b; mkdir -p $O
L8=configs/models/llama-3.1-8b.json
t2=$(date +%s)
timeout 330 $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
for bin in bench_cuda bench_cuda_smem bench_cuda_head; do
  t0=$(date +%s)
  timeout 45 $S/$bin --commit $bin --graphs on --no-profile --config $L8 --shapes 1:4096,2:4096,4:4096,4:2048,4:8192,8:4096 \
    --out $O/$bin-rows.json > $O/$bin-rows.log 2>&1
  echo "$bin rows rc=$? in $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
  timeout 40 $S/$bin --commit $bin --graphs on --config $L8 --shapes 4:4096 --out $O/$bin-profile.json > $O/$bin-profile.log 2>&1
  echo "$bin profile rc=$? in $(( $(date +%s) - t0 )) s"
  [[ $(( $(date +%s) - T0 )) -gt 560 ]] && break
done
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
for f in $O/bench_cuda*-rows.log; do echo "== $(basename $f)"; grep -E '^  b=' $f | cut -c1-75; done
for f in $O/bench_cuda*-profile.log; do echo "== $(basename $f)"; grep -E '^  b=|attention|eager sum|graph' $f | cut -c1-100 | head -8; done
cd $OUT && tar czf callB.tgz b && rm -rf b
