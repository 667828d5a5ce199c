#!/usr/bin/env bash
# Session 21, call B: the torch.compile peer at the issue-14 shapes, then bench_cuda at the same
# shapes (+ 8 x 1k) with the peer's JSON, graphs + PDL, the RoPE epilogue on and off, per-op profile.
set -uo pipefail
C=.carry/b
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/* 2>/dev/null
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=$OUT/b; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/device.txt
export TORCHINDUCTOR_CACHE_DIR=/tmp/ic/inductor TRITON_CACHE_DIR=/tmp/ic/triton
t0=$(date +%s)
timeout 420 python3 $S/peer_decode.py $O/peer-decode.json --config $S/configs/llama-3.1-8b.json > $O/peer-decode.log 2>&1
echo "peer rc=$? in $(( $(date +%s) - t0 )) s"
P=(); [[ -f $O/peer-decode.json ]] && P=(--peer $O/peer-decode.json)
timeout 160 $S/bench_cuda --config $S/configs/llama-3.1-8b.json --out $O/bench-cuda.json --commit "$(cat $S/COMMIT)" \
  --shapes 1:128,64:1024,256:1024,1:8192,32:8192,8:1024 --graphs on --fused-rope both "${P[@]}" > $O/bench-cuda.log 2>&1
echo "bench rc=$? at $(( $(date +%s) - t0 )) s"
echo "===== summary ====="
grep -E '^peer ' $O/peer-decode.log
grep -E '^copy|^single|^TTFT|^  b=' $O/bench-cuda.log
cd $OUT && tar czf callB.tgz b && rm -rf b
