#!/usr/bin/env bash
# Session 29, call E (H100): D = call D's C with the first weight batch loaded after the PDL wait
# (the whole first batch, weights and x, issued before the stats' round trip, nothing before the
# wait), beside A (27da163) and C, order A D C C D A in one call.
set -uo pipefail
C=.carry/s29
S=$PWD/.nx-tmp/carry-e; mkdir -p $S; cp $C/bench_cuda_{A,C,D}.xz $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda_*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for v in A D C C D A; do
  timeout 60 $S/bench_cuda_$v --commit $v --graphs on --no-profile --no-ttft --config configs/models/llama-3.1-8b.json \
    --shapes 1:128,1:8192,4:1024,8:1024 --out $OUT/bench-e-$v-$SECONDS.json >> $OUT/bench-e-$v.log 2>&1
  echo "bench $v rc=$?"
done
cd $OUT && tar czf bench-e-json.tgz bench-e-*.json && rm -f bench-e-*.json; cd - >/dev/null
for v in A C D; do echo "== $v"; grep -E '^  b=' $OUT/bench-e-$v.log | awk -F'|' '{printf "%s|%s|%s\n", $1, $3, $5}'; done
