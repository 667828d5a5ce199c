#!/usr/bin/env bash
# Session 26, call B: which one carve-out for every launch of a step, by rows. Call A found 50 %
# (-2 to -12 % at one row) faster than each launch's own choice and 100 % much slower (the skinny
# GEMMs lose their L1), 50 % slower at 4-8 rows and, over FP8, at 64. Sweep none,40,50,60,75,85
# twice over, alternating per shape in one process (same head binary as call A).
set -uo pipefail
T0=$(date +%s)
C=.carry/s26a
S=$(mktemp -d); cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda*
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/b; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $O/device.txt
L8=configs/models/llama-3.1-8b.json
CO=none,40,50,60,75,85,none,40,50,60,75,85
run() {  # name, timeout, args...
  local name=$1 to=$2; shift 2; local t0=$(date +%s)
  timeout $to $S/bench_cuda_head --commit head-pin --graphs on --no-profile --no-ttft "$@" --carveout $CO --out $O/bench-cuda-$name.json > $O/bench-cuda-$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s"
}
run bf16 200 --config $L8 --shapes 1:128,1:1024,1:4096,1:8192,1:16384,2:4096,4:1024,4:4096,8:1024,8:4096,12:1024,16:1024
run fp8 150 --config $L8 --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:4096,1:8192,2:4096,4:4096,8:1024,16:1024,32:1024
run moe 120 --config configs/models/qwen3-30b-a3b.json --shapes 1:128,1:4096,4:1024,8:1024,16:1024
run gemma 120 --config configs/models/gemma-3-12b.json --shapes 1:128,1:4096,4:4096
echo "===== ms per step, median of the two rounds: shape | none 40 50 60 75 85 ====="
python3 - $O <<'PY'
import json,sys,glob,collections,statistics
for f in sorted(glob.glob(sys.argv[1]+'/bench-cuda-*.json')):
    try: d=json.load(open(f))
    except Exception as e: print(f,e); continue
    t=collections.defaultdict(list)
    for r in d['results']:
        if r['name']=='decode_step': t[(r['batch'],r['context'],r['carveout_pin'])].append(r['ms_per_step'])
    print('--',f.split('/')[-1])
    for (b,c) in sorted({(k[0],k[1]) for k in t}):
        base=statistics.median(t[(b,c,None)])
        cells=[f"{statistics.median(t[(b,c,p)]):.3f}({100*(statistics.median(t[(b,c,p)])/base-1):+.1f})" for p in [None,40,50,60,75,85] if (b,c,p) in t]
        print(f"{b:3}x{c:6}", ' '.join(cells))
PY
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf callB.tgz b && rm -rf b
