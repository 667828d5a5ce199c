#!/usr/bin/env bash
# Session 26, call A: is the decode step's L1/shared split (carve-out) different per kernel, and
# does one split for every launch (CudaDevice::set_carveout_pin) change the step?
# - ncu: each kernel's shared-memory configuration in one eager b=1 ctx 4k step (head binary),
#   each launch's own choice and pinned at 100.
# - bench_cuda (head = HEAD + the pin switch): --carveout none,100,50,25 twice over, alternating
#   per shape in one process: Llama-3.1-8B bf16, FP8 W+KV, Qwen3-30B-A3B.
# - bench_cuda_x (4bbbdf7, session 25's early copies with run-time switches, + the pin):
#   --attn-launch default,serial x --carveout none,100, twice over.
set -uo pipefail
T0=$(date +%s)
C=.carry/s26a
S=$(mktemp -d); cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/a; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $O/device.txt
L8=configs/models/llama-3.1-8b.json
M='launch__shared_mem_config_size,launch__shared_mem_per_block_static,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_shared_mem,launch__grid_size,gpu__time_duration.sum'
for co in none 100; do t0=$(date +%s)
  timeout 90 ncu --clock-control none --launch-skip 3000 --launch-count 30 --metrics $M --csv \
    $S/bench_cuda_head --graphs off --no-ttft --no-profile --carveout $co --config $L8 --shapes 1:4096 \
    --out $O/ncu-bench.json > $O/ncu-co$co.csv 2> $O/ncu-co$co.err; echo "ncu co=$co rc=$? in $(( $(date +%s) - t0 )) s"
done
run() {  # name, timeout, binary, args...
  local name=$1 to=$2 bin=$3; shift 3; local t0=$(date +%s)
  timeout $to $S/$bin --commit $bin --graphs on --no-profile --no-ttft "$@" --out $O/bench-cuda-$name.json > $O/bench-cuda-$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s"
}
SH=1:128,1:4096,1:8192,4:4096,8:1024,16:1024,64:1024
run bf16-co 120 bench_cuda_head --config $L8 --shapes $SH --carveout none,100,50,25,none,100,50,25
run bf16-x 120 bench_cuda_x --config $L8 --shapes 1:128,1:4096,1:8192,4:4096,8:1024,64:1024 --attn-launch default,serial,default,serial --carveout none,100
run fp8-co 100 bench_cuda_head --config $L8 --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:8192,4:4096,8:1024,64:1024 --carveout none,100,50,25,none,100,50,25
run moe-co 100 bench_cuda_head --config configs/models/qwen3-30b-a3b.json --shapes 1:128,1:4096,16:1024 --carveout none,100,50,25,none,100,50,25
echo "===== ncu: kernel | config size | static | dynamic | grid (co=none, then co=100) ====="
for co in none 100; do echo "-- co=$co"; python3 - $O/ncu-co$co.csv <<'PY'
import csv,sys,collections
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ix={k:i for i,k in enumerate(h)}
k=collections.OrderedDict()
for r in rows[1:]:
    if r[ix['Metric Name']]: k.setdefault((r[ix['ID']],r[ix['Kernel Name']][:40]),{})[r[ix['Metric Name']]]=r[ix['Metric Value']]
for (i,n),m in list(k.items())[:14]:
    print(n, m.get('launch__shared_mem_config_size'), m.get('launch__shared_mem_per_block_static'), m.get('launch__shared_mem_per_block_dynamic'), m.get('launch__grid_size'), m.get('gpu__time_duration.sum'))
PY
done
echo "===== decode steps (ms) ====="
for f in $O/bench-cuda-*.log; do echo "-- $(basename $f)"; grep -E '^  b=' $f | awk -F'|' '{printf "%s|%s|%s\n", $1, $2, $3}'; done
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf callA.tgz a && rm -rf a
