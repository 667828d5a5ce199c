#!/usr/bin/env bash
# Session 31, call B (H100): ncu on the FP8 streaming kernel and the work-queue kernel at 32 x 2k,
# 8 and 16 splits: does the queue even out the SMs' active cycles, and does the time follow?
set -uo pipefail
T0=$(date +%s)
S=$PWD/.nx-tmp/carry; mkdir -p $S; cp -r .carry/s31/. $S/; xz -d -f $S/*.xz; chmod +x $S/*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
COMMIT=$(cat $S/COMMIT)
M=gpu__time_duration.sum,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size
run_ncu() { # tag kernel skip
  timeout 100 ncu --clock-control none --metrics $M --kernel-name $2 --launch-skip $3 --launch-count 1 $S/cuda_bench_fp8 /tmp/x.json $COMMIT 32:2048 > $OUT/ncu-$1.txt 2>&1
  echo "ncu $1 rc=$? at $(( $(date +%s) - T0 )) s"
}
# Each fixed split count is 46 launches (3 + 20 timed, 3 + 20 back to back); splits 1, 2, 4, 8, 16.
run_ncu st-s8 paged_attention_st_fp8_hd128_w8_s3_g8 141
run_ncu st-s16 paged_attention_st_fp8_hd128_w8_s3_g8 187
run_ncu sq-s8 paged_attention_sq_fp8_hd128_w8_s3_g8 141
run_ncu sq-s16 paged_attention_sq_fp8_hd128_w8_s3_g8 187
echo "===== summary ====="
for f in $OUT/ncu-*.txt; do echo "== $f"; grep -E "paged_attention|attention_combine|gpu__time|sm__cycles|dram__|launch__grid" $f | head -12; done
