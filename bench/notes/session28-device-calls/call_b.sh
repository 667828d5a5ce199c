#!/usr/bin/env bash
# Session 28, call B (H100): every gpu_* test of baton-kernels and four of baton-engine's
# targets (engine, transformers bf16, launch switches with the carve-out policies, graphs); decode
# attention alone under the step's pin (cuda_bench attention, the first pinned figures); the
# per-step carve-out routing of 0d30898 (Qwen3-8B never pinned: auto must equal none; Llama
# pinned), and on Qwen3-8B the pin split as 50/none and 50/50p beside none, alternated in one
# process. Results written straight to $OUT.
set -uo pipefail
T0=$(date +%s)
C=.carry/s28b
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda $S/cuda_bench $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
COMMIT=$(cat $S/COMMIT)
for a in kernels engine1; do mkdir -p $TMPDIR/nx-$a
timeout 280 $S/cargo-nextest nextest run --archive-file $S/tests-$a.tar.zst --extract-to $TMPDIR/nx-$a --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $OUT/gpu-tests-$a.log 2>&1
echo "tests $a rc=$? at $(( $(date +%s) - T0 )) s"; done
timeout 60 $S/cuda_bench $OUT/cuda-bench-attention.json $COMMIT attention 1:2048,1:8192,2:4096,4:1024,4:4096,32:2048 > $OUT/cuda-bench-attention.log 2>&1
echo "attention rc=$? at $(( $(date +%s) - T0 )) s"
for m in qwen3-8b; do
  cv=auto,none,auto,none; [[ $m == qwen3-8b ]] && cv=auto,none,50/none,50/50p,none,50/none,50/50p
  timeout 90 $S/bench_cuda --commit $COMMIT --graphs on --no-profile --no-ttft --carveout $cv \
    --config configs/models/$m.json --shapes 1:128,1:4096,4:1024 --out $OUT/bench-cuda-carveout-$m.json > $OUT/bench-cuda-carveout-$m.log 2>&1
  echo "$m rc=$? at $(( $(date +%s) - T0 )) s"
done
echo "===== summary ====="
for a in kernels engine1; do grep -E '^ +Summary' $OUT/gpu-tests-$a.log | tail -1; done
grep -hE '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $OUT/gpu-tests-*.log | sort -u | head -20
grep -iE 'pin|GB/s|%' $OUT/cuda-bench-attention.log | head -30
for m in qwen3-8b llama-3.1-8b; do echo "== $m"; grep -E '^  b=' $OUT/bench-cuda-carveout-$m.log | awk -F'|' '{printf "%s|%s|%s|%s\n", $1, $2, $3, $5}'; done
