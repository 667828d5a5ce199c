#!/usr/bin/env bash
# Session 31, call C (H100): the streaming decode kernel's fused combine (8c281ba) beside the
# same kernel with the separate combine launch (cdc5d63, call A's build), in one call; then the
# GPU tests that cover it: every decode variant against the CPU reference and the streaming
# variants bit for bit (gpu_attention_options, gpu_kv_fp8), the attention kernel tests of
# gpu_kernels, and graph replays against eager steps (gpu_graphs: the counters must be zero at
# every replay).
set -uo pipefail
T0=$(date +%s)
A=$PWD/.nx-tmp/old; B=$PWD/.nx-tmp/new; mkdir -p $A $B
cp -r .carry/s31/. $A/; cp -r .carry/s31b/. $B/; xz -d -f $A/*.xz $B/*.xz; chmod +x $A/* $B/*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
F=32:2048,64:2048,32:8192,128:4096,256:1024,8:4096,1:8192
H=1:2048,1:8192,8:4096,32:2048,64:2048,32:8192,256:1024
for round in 1 2; do
  timeout 120 $A/cuda_bench_fp8 $OUT/fp8-old-$round.json $(cat $A/COMMIT) $F > $OUT/fp8-old-$round.log 2>&1; echo "fp8 old r$round rc=$? $(( $(date +%s) - T0 )) s"
  timeout 120 $B/cuda_bench_fp8 $OUT/fp8-new-$round.json $(cat $B/COMMIT) $F > $OUT/fp8-new-$round.log 2>&1; echo "fp8 new r$round rc=$? $(( $(date +%s) - T0 )) s"
done
timeout 120 $A/cuda_bench $OUT/attn-old.json $(cat $A/COMMIT) attention $H > $OUT/attn-old.log 2>&1; echo "bf16 old rc=$? $(( $(date +%s) - T0 )) s"
timeout 120 $B/cuda_bench $OUT/attn-new.json $(cat $B/COMMIT) attention $H > $OUT/attn-new.log 2>&1; echo "bf16 new rc=$? $(( $(date +%s) - T0 )) s"
mkdir -p $OUT/tests
timeout 150 $B/gpu_attention_options --test-threads 2 > $OUT/tests/gpu-attention-options.log 2>&1; echo "gpu_attention_options rc=$? $(( $(date +%s) - T0 )) s"
timeout 100 $B/gpu_kv_fp8 --test-threads 2 attention > $OUT/tests/gpu-kv-fp8.log 2>&1; echo "gpu_kv_fp8 rc=$? $(( $(date +%s) - T0 )) s"
timeout 100 $B/gpu_kernels --test-threads 2 attention > $OUT/tests/gpu-kernels.log 2>&1; echo "gpu_kernels attention rc=$? $(( $(date +%s) - T0 )) s"
timeout 200 $B/gpu_graphs --test-threads 1 > $OUT/tests/gpu-graphs.log 2>&1; echo "gpu_graphs rc=$? $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf tests.tgz tests && rm -rf tests; cd - > /dev/null
echo "===== summary ====="
tar xzf $OUT/tests.tgz -O | grep -E "^test |test result" | head -40
for f in fp8-old-2 fp8-new-2; do echo "== $f"; grep -E "^ fp8 |^ bf16 " $OUT/$f.log | grep -v "fixed splits" | grep -E "default|\*" ; done
for f in attn-old attn-new; do echo "== $f"; grep -E "\*" $OUT/$f.log | head -12; done
