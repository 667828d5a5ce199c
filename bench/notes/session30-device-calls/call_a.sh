#!/usr/bin/env bash
# Session 30, call A (H100): decode attention over FP8 and bf16 caches, each figure timed from an
# idle stream (as before) and as 20 calls queued back to back; then ncu on the FP8 kernels at
# 32 x 2k (the tensor-core kernel unsplit and at Auto, the streaming default at Auto) and 64 x 2k.
set -uo pipefail
T0=$(date +%s)
S=$PWD/.nx-tmp/carry; mkdir -p $S; cp -r .carry/s30/. $S/; xz -d -f $S/*.xz; chmod +x $S/cuda_bench*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
COMMIT=$(cat $S/COMMIT)
SH=1:8192,8:4096,32:2048,32:8192,64:2048,128:4096,256:1024
timeout 150 $S/cuda_bench_fp8 $OUT/cuda-bench-fp8.json $COMMIT $SH > $OUT/cuda-bench-fp8.log 2>&1
echo "fp8 bench rc=$? at $(( $(date +%s) - T0 )) s"
timeout 150 $S/cuda_bench $OUT/cuda-bench-attn.json $COMMIT attention 1:2048,1:8192,32:2048,64:2048,32:8192,256:1024 > $OUT/cuda-bench-attn.log 2>&1
echo "bf16 bench rc=$? at $(( $(date +%s) - T0 )) s"
NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats --launch-count 1"
mkdir -p $OUT/ncu
run_ncu() { # tag kernel skip shape
  timeout 90 $NCU --kernel-name $2 --launch-skip $3 $S/cuda_bench_fp8 /tmp/x.json $COMMIT $4 > $OUT/ncu/$1.txt 2>&1
  echo "ncu $1 rc=$? at $(( $(date +%s) - T0 )) s"
}
run_ncu tc-32x2k-split1 paged_attention_tc_fp8_hd128_w2_s3_g8 30 32:2048
run_ncu tc-32x2k-auto paged_attention_tc_fp8_hd128_w2_s3_g8 352 32:2048
run_ncu st-32x2k-auto paged_attention_st_fp8_hd128_w8_s3_g8 352 32:2048
run_ncu st-64x2k-auto paged_attention_st_fp8_hd128_w8_s3_g8 352 64:2048
run_ncu st-32x8k-auto paged_attention_st_fp8_hd128_w8_s3_g8 352 32:8192
cd $OUT && tar czf ncu.tgz ncu && rm -rf ncu; cd - >/dev/null
echo "===== summary ====="
grep -E "^ fp8 |^ bf16 " $OUT/cuda-bench-fp8.log | grep -v "fixed splits" | head -70
grep -E "fixed splits" $OUT/cuda-bench-fp8.log | head -30
grep -E "\*" $OUT/cuda-bench-attn.log | head -20
