#!/usr/bin/env bash
# Session 22, call E (run as one command line on the warm machine right after call D, with
# call D's carry): Qwen2.5-7B bf16, the RoPE epilogue with the qkv bias on/off, two rounds.
S=$(mktemp -d); cp -r .carry/s22/. $S/; gunzip -f $S/bench_cuda.gz; chmod +x $S/bench_cuda
export LD_LIBRARY_PATH=/usr/local/cuda/lib64; mkdir -p $OUT/e
for i in 1 2; do
  timeout 60 $S/bench_cuda --commit $(cat $S/COMMIT) --graphs on --no-profile --fused-rope both \
    --config $S/configs/qwen2.5-7b.json --shapes 4:1024,8:1024,8:4096,12:1024 \
    --out $OUT/e/qwen2-bf16-r$i.json > $OUT/e/qwen2-bf16-r$i.log 2>&1
  grep -E '^  b=' $OUT/e/qwen2-bf16-r$i.log | awk -F'|' '{print $1 "|" $2 "|" $3}'
done
