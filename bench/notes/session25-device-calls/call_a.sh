#!/usr/bin/env bash
# Session 25, call A (42875c6): streaming decode attention's early copies (the stages before the
# row's new token copied before the PDL wait) and the batched split combine.
# - bench_cuda of 42875c6 with --early-kv both (on = the new route, off = the copies after the
#   wait; same process, alternating per shape), and bench_cuda of cf55dbd (the old combine, no
#   early copies) in the same call: Llama-3.1-8B bf16, FP8 W+KV, Qwen3-30B-A3B.
# - cuda_bench attention (decode attention alone) of both commits at one to four rows, and ncu
#   on the one-row 8k launch (narrow streaming kernel + combine) of 42875c6.
# - the gpu_* tests of attention, the engine, graphs, FP8 KV and the launch switches.
set -uo pipefail
T0=$(date +%s)
C=.carry/s25a
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; gunzip -f $S/*.gz; chmod +x $S/bench_cuda* $S/cuda_bench* $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/a; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/device.txt
COMMIT=$(cat $S/COMMIT)
L8=configs/models/llama-3.1-8b.json
run_pair() {  # name, timeout, args...
  local name=$1 to=$2; shift 2
  local t0=$(date +%s)
  timeout $to $S/bench_cuda --commit $COMMIT --graphs on --early-kv both --no-profile "$@" --out $O/bench-cuda-$name.json > $O/bench-cuda-$name.log 2>&1
  echo "$name new rc=$? in $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
  timeout $to $S/bench_cuda_head --commit cf55dbd --graphs on --no-profile "$@" --out $O/bench-cuda-$name-head.json > $O/bench-cuda-$name-head.log 2>&1
  echo "$name head rc=$? in $(( $(date +%s) - t0 )) s"
}
run_pair bf16 120 --config $L8 --shapes 1:128,1:1024,1:8192,4:4096,8:1024,64:1024,256:1024,32:8192
run_pair fp8 80 --config $L8 --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:8192,8:1024,64:1024
run_pair moe 80 --config configs/models/qwen3-30b-a3b.json --shapes 1:128,1:4096,16:1024
t0=$(date +%s)
timeout 60 $S/cuda_bench $O/cuda-attn.json $COMMIT attention 1:128,1:1024,1:8192,4:4096 > $O/cuda-attn.log 2>&1; echo "attn new rc=$?"
timeout 60 $S/cuda_bench_head $O/cuda-attn-head.json cf55dbd attention > $O/cuda-attn-head.log 2>&1; echo "attn head rc=$? at $(( $(date +%s) - t0 )) s"
timeout 60 ncu --clock-control none -k 'regex:paged_attention_st_hd128_w1|attention_combine' -c 2 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  $S/cuda_bench $O/cuda-attn-ncu.json $COMMIT attention 1:8192 > $O/ncu-1x8k.txt 2>&1; echo "ncu rc=$? at $(( $(date +%s) - t0 )) s"
t2=$(date +%s)
left=$(( T0 + 575 - $(date +%s) )); echo "tests get $left s"
timeout $left $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$? in $(( $(date +%s) - t2 )) s"
echo "===== summary ====="
grep -E '^ +Summary' $O/gpu-tests.log | tail -1
grep -E '^ +(FAIL|SIGSEGV|TIMEOUT|SIGABRT)' $O/gpu-tests.log | sort -u | head -20
for f in $O/bench-cuda-*.log; do echo "== $(basename $f)"; grep -E '^  b=' $f | cut -c1-75; done
grep -E 'st_w1_s4_g8\*|copy 1 GiB' $O/cuda-attn.log $O/cuda-attn-head.log | cut -c1-120
grep -E 'Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|paged_attention|attention_combine' $O/ncu-1x8k.txt | head -20
cd $OUT && tar czf callA.tgz a && rm -rf a
