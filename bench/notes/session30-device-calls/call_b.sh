#!/usr/bin/env bash
# Session 30, call B (H100): per-SM active cycles and CTA counts of the streaming decode
# attention kernels at 32 x 2k (FP8 and bf16, Auto splits) and 64 x 2k FP8: do the SMs finish
# at different times (the 15-18 % idle SM time call A's ncu showed)?
set -uo pipefail
S=$PWD/.nx-tmp/carry; mkdir -p $S; cp -r .carry/s30/. $S/; xz -d -f $S/*.xz; chmod +x $S/cuda_bench*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
COMMIT=$(cat $S/COMMIT)
M="--metrics sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__ctas_launched.sum,sm__ctas_launched.max,sm__ctas_launched.min,gpu__time_duration.sum,sm__cycles_elapsed.max"
NCU="ncu --clock-control none $M --print-metric-instances values --launch-count 1"
timeout 90 $NCU --kernel-name paged_attention_st_fp8_hd128_w8_s3_g8 --launch-skip 352 $S/cuda_bench_fp8 /tmp/x.json $COMMIT 32:2048 > $OUT/ncu-sm-fp8-32x2k.txt 2>&1; echo "rc=$?"
timeout 90 $NCU --kernel-name paged_attention_st_fp8_hd128_w8_s3_g8 --launch-skip 352 $S/cuda_bench_fp8 /tmp/x.json $COMMIT 64:2048 > $OUT/ncu-sm-fp8-64x2k.txt 2>&1; echo "rc=$?"
timeout 90 $NCU --kernel-name paged_attention_st_hd128_w8_s2_g8 --launch-skip 30 $S/cuda_bench /tmp/y.json $COMMIT attention 32:2048 > $OUT/ncu-sm-bf16-32x2k.txt 2>&1; echo "rc=$?"
nvidia-smi -q | grep -i -E "product name|gpc|clocks" | head; 
for f in $OUT/ncu-sm-*.txt; do echo "== $f"; grep -E "sm__|gpu__" $f | cut -c1-400; done
