#!/usr/bin/env bash
# Session 29 (from session 28), call C (H100): every gpu_* test of baton-engine at the final commit (the whole
# model against the bf16 reference and transformers, graphs, launch switches with the carve-out
# policies, FP8), then offline 1000/1000: FP8 weights + KV beside bf16 (the peer, same call).
set -uo pipefail
T0=$(date +%s)
C=.carry/s28c
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_throughput $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
COMMIT=$(cat $S/COMMIT)
[[ ${TEST_T:-300} -gt 0 ]] && timeout ${TEST_T:-300} $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $OUT/gpu-tests-engine.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
for q in ${QS-fp8 bf16}; do
  a=(); [[ $q == fp8 ]] && a=(--quantization fp8 --kv-cache-dtype fp8)
  timeout 200 $S/bench_throughput --config configs/models/llama-3.1-8b.json --out $OUT/throughput-1000-1000-$q.json --commit $COMMIT \
    --prompts 1000 --isl 1000 --osl 1000 --max-num-seqs 256 --async-scheduling on --time-limit-s 180 "${a[@]}" > $OUT/throughput-$q.log 2>&1
  echo "$q rc=$? at $(( $(date +%s) - T0 )) s"
done
echo "===== summary ====="
grep -E '^ +Summary' $OUT/gpu-tests-engine.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $OUT/gpu-tests-engine.log | sort -u | head -20
for q in fp8 bf16; do echo "== $q"; tail -3 $OUT/throughput-$q.log; done
