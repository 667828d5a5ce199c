#!/usr/bin/env bash
# Session 25, call D: which change moved the one-to-four-row steps. Three binaries, three rounds,
# alternating (H X1 X2 H X1 X2 ...), so that a per-process effect shows as spread within a
# binary: H = cf55dbd; X1 = cf55dbd with 42875c6's combine only (1 KB of shared memory, batched
# loads); X2 = 42875c6 (that combine and the streaming kernel's early copies + block ids read
# together).
set -uo pipefail
C=.carry/s25d
S=$(mktemp -d); cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/d; mkdir -p $O
L8=configs/models/llama-3.1-8b.json
SH=1:128,1:4096,1:8192,4:4096,8:1024,64:1024
for r in 1 2 3; do
  for bin in head x1 x2; do t0=$(date +%s)
    timeout 40 $S/bench_cuda_$bin --commit $bin --graphs on --no-profile --config $L8 --shapes $SH \
      --out $O/bench-cuda-$bin-$r.json > $O/bench-cuda-$bin-$r.log 2>&1; echo "$bin $r rc=$? in $(( $(date +%s) - t0 )) s"
  done
done
echo "===== summary (ms per step: 1x128 1x4k 1x8k 4x4k 8x1k 64x1k) ====="
for bin in head x1 x2; do for r in 1 2 3; do
  echo "$bin $r: $(grep -E '^  b=' $O/bench-cuda-$bin-$r.log | awk -F'|' '{printf "%s ", $3}')"
done; done
cd $OUT && tar czf callD.tgz d && rm -rf d
