#!/usr/bin/env bash
# Session 26, call F (the last ~230 s of device time): the per-step carve-out restricted to
# models whose qkv product carries RoPE. bench_cuda auto,none,auto,none on Qwen3-8B (now never
# pinned: auto must equal none) and Llama-3.1-8B (pinned as in call E), then the one GPU test of
# the policies. Results written straight to $OUT so that a cut-off call still returns them.
set -uo pipefail
T0=$(date +%s)
C=.carry/s26f
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
COMMIT=$(cat $S/COMMIT)
for m in qwen3-8b llama-3.1-8b; do t0=$(date +%s)
  timeout 60 $S/bench_cuda --commit $COMMIT --graphs on --no-profile --no-ttft --carveout auto,none,auto,none \
    --config configs/models/$m.json --shapes 1:128,1:4096,4:1024 --out $OUT/bench-cuda-$m.json > $OUT/bench-cuda-$m.log 2>&1
  echo "$m rc=$? in $(( $(date +%s) - t0 )) s"; grep -E '^  b=' $OUT/bench-cuda-$m.log | awk -F'|' '{printf "%s|%s|%s\n", $1, $2, $3}'
done
timeout 300 $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(gpu_carveout_policies_give_bit_identical_steps)' --no-fail-fast --success-output never > $OUT/gpu-tests.log 2>&1
echo "tests rc=$?"; grep -E 'PASS|FAIL|Summary' $OUT/gpu-tests.log | tail -5
echo "total $(( $(date +%s) - T0 )) s"
