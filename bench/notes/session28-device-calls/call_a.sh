#!/usr/bin/env bash
# Session 28, call A (H100): the torch.compile peer at issue 14's shapes, then bench_cuda at the
# same shapes (+ 8 x 1k) with the peer's JSON: graphs + PDL, the per-step carve-out rule, per-op
# eager profile, TTFT. Results written straight to $OUT so that a cut-off call still returns them.
set -uo pipefail
T0=$(date +%s)
C=.carry/s28a
S=$(mktemp -d); cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ic/inductor TRITON_CACHE_DIR=/tmp/ic/triton
COMMIT=$(cat $S/COMMIT)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee $OUT/device.txt
timeout 430 python3 scripts/bench/peer_decode.py $OUT/peer-decode.json --config configs/models/llama-3.1-8b.json > $OUT/peer-decode.log 2>&1
echo "peer rc=$? at $(( $(date +%s) - T0 )) s"
P=(); [[ -f $OUT/peer-decode.json ]] && P=(--peer $OUT/peer-decode.json)
timeout 150 $S/bench_cuda --config configs/models/llama-3.1-8b.json --out $OUT/bench-cuda.json --commit $COMMIT \
  --shapes 1:128,64:1024,256:1024,1:8192,32:8192,8:1024 --graphs on "${P[@]}" > $OUT/bench-cuda.log 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
echo "===== summary ====="
grep -E '^peer ' $OUT/peer-decode.log
grep -E '^copy|^TTFT|^  b=' $OUT/bench-cuda.log
