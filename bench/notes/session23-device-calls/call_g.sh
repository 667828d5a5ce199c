#!/usr/bin/env bash
# Session 23, call G (f4656d4: RoPE one module per cache kind and calibration): time to
# healthy on a fresh machine first (its cold run meets an empty NVRTC cache), bf16 then FP8
# weights; every module compiled (each must define its kernels); then the gpu_* tests of the
# RoPE kernels of every cache kind (kernels) and the FP8 KV engine suite (calibration).
set -uo pipefail
C=.carry/s23g
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_startup $S/baton $S/cc_new $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/g; mkdir -p $O/bf16 $O/fp8
COMMIT=$(cat $S/COMMIT)
t1=$(date +%s)
timeout 100 $S/bench_startup --baton $S/baton --config $S/configs/llama-3.1-8b.json --dir /tmp/bsm --commit $COMMIT \
  --out $O/startup-bf16.json > $O/startup-bf16.log 2>&1; echo "startup bf16 rc=$? in $(( $(date +%s) - t1 )) s"
cp /tmp/bsm/.bench/startup-*.log $O/bf16/ 2>/dev/null
timeout 60 $S/cc_new sm_90a $S/cub > $O/cc-new-all.log 2>&1; echo "cc all rc=$?"
t2=$(date +%s)
timeout 120 $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 1 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
echo "===== summary ====="
grep -E 'healthy in|page cache|^wrote' $O/startup-bf16.log
grep -h 'kernel module' $O/bf16/startup-no_kernel_cache.log | sed 's/.*cuda: //' | sort -t= -k4 -n | tail -4
echo "cc: $(grep -E 'modules in' $O/cc-new-all.log) $(grep -c lacks $O/cc-new-all.log) lacking"
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
cd $OUT && tar czf callG.tgz g && rm -rf g
