#!/usr/bin/env bash
# Session 21, call C: the gpu_* test binaries call A did not run (MoE, FP8 weights, relay,
# sampling, prompt logprobs, compile, arch kernels, weight upload), at the final commit.
set -uo pipefail
C=.carry/c
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/* 2>/dev/null
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/c; mkdir -p $O
t0=$(date +%s)
timeout ${TEST_T:-280} $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
cd $OUT && tar czf callC.tgz c && rm -rf c
