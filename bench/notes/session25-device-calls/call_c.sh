#!/usr/bin/env bash
# Session 25, call C (4bbbdf7): calls A and B compared binaries across processes, and cf55dbd's own
# b=4 x 4k step moved 9 % between two processes, so each of 4bbbdf7's attention launch choices
# (`--attn-launch`: default, late = no early copies, serial-ids, serial-combine, serial = every
# choice off) runs in one process, alternating per shape; cf55dbd's binary twice beside it.
# Then the gpu_* tests of the launch switches, attention options, kernels and graphs.
set -uo pipefail
T0=$(date +%s)
C=.carry/s25a
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda* $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/c; mkdir -p $O
L8=configs/models/llama-3.1-8b.json
SH=1:128,1:1024,1:4096,1:8192,2:4096,4:4096,8:1024,64:1024,256:1024
ALL=default,late,serial-ids,serial-combine,serial
t0=$(date +%s)
timeout 150 $S/bench_cuda --commit 4bbbdf7 --graphs on --no-profile --config $L8 --shapes $SH --attn-launch $ALL \
  --out $O/bench-cuda-attn-launch.json > $O/bench-cuda-attn-launch.log 2>&1; echo "bf16 rc=$? in $(( $(date +%s) - t0 )) s"
for r in 1 2; do t0=$(date +%s)
  timeout 40 $S/bench_cuda_head --commit cf55dbd --graphs on --no-profile --config $L8 --shapes $SH \
    --out $O/bench-cuda-head-$r.json > $O/bench-cuda-head-$r.log 2>&1; echo "head $r rc=$? in $(( $(date +%s) - t0 )) s"
done
t0=$(date +%s)
timeout 60 $S/bench_cuda --commit 4bbbdf7 --graphs on --no-profile --config $L8 --quantization fp8 --kv-cache-dtype fp8 \
  --shapes 1:128,1:8192,4:4096,64:1024 --attn-launch default,serial --out $O/bench-cuda-fp8-attn-launch.json > $O/bench-cuda-fp8-attn-launch.log 2>&1
echo "fp8 rc=$? in $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 $S/bench_cuda --commit 4bbbdf7 --graphs on --no-profile --config configs/models/qwen3-30b-a3b.json \
  --shapes 1:128,1:4096 --attn-launch default,serial --out $O/bench-cuda-moe-attn-launch.json > $O/bench-cuda-moe-attn-launch.log 2>&1
echo "moe rc=$? in $(( $(date +%s) - t0 )) s"
left=$(( T0 + 560 - $(date +%s) )); echo "tests get $left s"; t2=$(date +%s)
timeout $left $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
for f in $O/bench-cuda-*.log; do echo "== $(basename $f)"; grep -E '^  b=' $f | cut -c1-70; done
cd $OUT && tar czf callC.tgz c && rm -rf c
