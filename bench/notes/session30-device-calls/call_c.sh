#!/usr/bin/env bash
# Session 30, call C (H100): the windowed decode attention bench with its new back-to-back timing.
set -uo pipefail
S=$PWD/.nx-tmp/carry; mkdir -p $S; cp -r .carry/s30/. $S/; xz -d -f $S/*.xz; chmod +x $S/cuda_bench*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
timeout 200 $S/cuda_bench_window $OUT/cuda-bench-window.json $(cat $S/COMMIT) > $OUT/cuda-bench-window.log 2>&1
echo "window rc=$?"; tail -30 $OUT/cuda-bench-window.log
