#!/usr/bin/env bash
# Session 24, call B (38b70d0, the kernels and routes of 5f645c5: session 23's host-only review
# commit, never GPU-run): the gpu_* suites of the engine (engine, FP8 weights and KV, graphs,
# launch switches, transformers bf16) and the kernels (compile, kernels, FP8 linear and KV,
# norm + linear, norm + RoPE, weight upload). Archive extracted on the repo's disk (call A's
# extraction into /tmp failed: "failed to write entire file").
set -uo pipefail
C=.carry/s24b
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/b; mkdir -p $O
df -h /tmp $PWD | tail -2
t2=$(date +%s)
timeout 540 $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
grep -E 'error' $O/gpu-tests.log | head -5
cd $OUT && tar czf callB.tgz b && rm -rf b
