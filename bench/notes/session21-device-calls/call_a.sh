#!/usr/bin/env bash
# Session 21, call A: every gpu_* test at the working tree, then the WC (16-byte copy) one-warp
# streaming variant against the bulk-copy one (bench_cuda_bulk, same tree but HEAD's
# attention_stream.cu), alternating, and the RoPE epilogue on/off, single streams and 4x4k.
set -uo pipefail
C=.carry/a
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/* 2>/dev/null
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT; mkdir -p $O/a
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $O/a/device.txt
# The kernel cache built on the dev machine (used where its NVRTC version matches).
for d in /tmp/baton-gpu-test-kernels /tmp/baton-bench-kernels; do mkdir -p $d; cp -r $S/kernels/. $d/ 2>/dev/null; done
t0=$(date +%s)
timeout ${TEST_T:-400} $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 > $O/a/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t0 )) s"
SH=${SHAPES:-1:128,1:8192,4:4096}
for i in 1 2; do
  for b in bench_cuda bench_cuda_bulk; do
    extra=""; [[ $b == bench_cuda ]] && extra="--fused-rope both"
    timeout 120 $S/$b --config $S/configs/llama-3.1-8b.json --out $O/a/$b-$i.json --commit "$(cat $S/COMMIT)" \
      --shapes $SH --graphs on --no-profile $extra > $O/a/$b-$i.log 2>&1 || echo "$b $i failed rc=$?"
  done
done
echo "===== summary ====="
grep -E '^ +Summary' $O/a/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/a/gpu-tests.log | sort -u | head -20
for f in $O/a/bench_cuda*-?.log; do echo "== $(basename $f)"; grep -E '^copy|^single|^  b=' $f; done
cd $O && tar czf callA.tgz a && rm -rf a
