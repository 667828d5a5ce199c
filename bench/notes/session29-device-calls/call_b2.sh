#!/usr/bin/env bash
# Session 29, call B2 (H100): what session 28's call B left unrun at 27da163. Its 200 s test
# window ran out (SIGTERM, not failures) inside gpu_launch_switches. Here: decode attention alone
# under the step's pin, Qwen3-8B's carve-out split, then the eleven unrun gpu_* tests of
# gpu_launch_switches and gpu_transformers_bf16, with the time left.
set -uo pipefail
T0=$(date +%s)
C=.carry/s28b
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda $S/cuda_bench $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
COMMIT=$(cat $S/COMMIT)
timeout 60 $S/cuda_bench $OUT/cuda-bench-attention.json $COMMIT attention 1:2048,1:8192,2:4096,4:1024,4:4096,32:2048 > $OUT/cuda-bench-attention.log 2>&1
echo "attention rc=$? at $(( $(date +%s) - T0 )) s"
timeout 90 $S/bench_cuda --commit $COMMIT --graphs on --no-profile --no-ttft --carveout auto,none,50/none,50/50p,none,50/none,50/50p \
  --config configs/models/qwen3-8b.json --shapes 1:128,1:4096,4:1024 --out $OUT/bench-cuda-carveout-qwen3-8b.json > $OUT/bench-cuda-carveout-qwen3-8b.log 2>&1
echo "qwen3 rc=$? at $(( $(date +%s) - T0 )) s"
LEFT=$(( 570 - ( $(date +%s) - T0 ) ))
mkdir -p $TMPDIR/nx-e
timeout $LEFT $S/cargo-nextest nextest run --archive-file $S/tests-engine1.tar.zst --extract-to $TMPDIR/nx-e --workspace-remap . \
  -E '(binary(gpu_launch_switches) & !test(fused_gate) & !test(fp8_weight_epilogues)) | binary(gpu_transformers_bf16)' \
  --no-fail-fast --success-output never --test-threads 2 > $OUT/gpu-tests-engine1-rest.log 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s (window $LEFT s)"
echo "===== summary ====="
grep -E '^ +Summary' $OUT/gpu-tests-engine1-rest.log | tail -1
grep -hE '^ +(PASS|FAIL|SIGSEGV|SIGTERM|TIMEOUT|SIGABRT)' $OUT/gpu-tests-engine1-rest.log | sort -u | head -20
grep -iE 'pin|GB/s|%' $OUT/cuda-bench-attention.log | head -30
grep -E '^  b=' $OUT/bench-cuda-carveout-qwen3-8b.log | awk -F'|' '{printf "%s|%s|%s|%s\n", $1, $2, $3, $5}'
