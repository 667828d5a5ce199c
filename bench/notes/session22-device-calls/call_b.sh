#!/usr/bin/env bash
# Session 22, call B: the FP8 RoPE kernels triggering the next launch (PDL) at their start
# (bench_cuda, commit 864989a) or after their k loop (bench_cuda_late, the same tree with that
# one change), alternating, two rounds, each with the RoPE epilogue on and off (--fused-rope both).
set -uo pipefail
C=.carry/s22
S=$(mktemp -d); cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
O=$OUT; mkdir -p $O/b
for i in 1 2; do
  for b in bench_cuda bench_cuda_late; do
    timeout 100 $S/$b --config $S/configs/llama-3.1-8b.json --commit "$(cat $S/COMMIT)" --graphs on --no-profile \
      --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:1024,1:8192,4:4096,8:1024 --fused-rope both \
      --out $O/b/$b-wkv-$i.json > $O/b/$b-wkv-$i.log 2>&1 || echo "$b wkv $i rc=$?"
  done
done
for b in bench_cuda bench_cuda_late; do
  timeout 100 $S/$b --config $S/configs/llama-3.1-8b.json --commit "$(cat $S/COMMIT)" --graphs on --no-profile \
    --quantization fp8 --shapes 1:1024,1:8192 --fused-rope both \
    --out $O/b/$b-w.json > $O/b/$b-w.log 2>&1 || echo "$b w rc=$?"
done
for f in $O/b/*.log; do echo "== $(basename $f)"; grep -E '^  b=' $f | awk -F'|' '{print $1 "|" $2 "|" $3}'; done
cd $O && tar czf callB.tgz b && rm -rf b
