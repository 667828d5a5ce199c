#!/usr/bin/env bash
# Session 26, call E: the per-step carve-out rule as built (carveout.rs: 50 % on every launch of
# a decode step whose attention takes the narrow streaming variant, attention's splits planned in
# that share) against no pins, alternated in one process (--carveout auto,none,auto,none), on the
# models and shapes of issues 14, 15 and 17; then the gpu_* tests of the engine, graphs, launch
# switches (the new carve-out test among them), FP8 KV and weights, and transformers bf16.
set -uo pipefail
T0=$(date +%s)
C=.carry/s26e
export TMPDIR=$PWD/.nx-tmp; mkdir -p $TMPDIR/nx
S=$TMPDIR/carry; mkdir -p $S; cp -r $C/. $S/; xz -d -f $S/*.xz; chmod +x $S/bench_cuda* $S/cargo-nextest
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0
O=$OUT/e; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $O/device.txt
COMMIT=$(cat $S/COMMIT)
L8=configs/models/llama-3.1-8b.json
run() {  # name, timeout, args...
  local name=$1 to=$2; shift 2; local t0=$(date +%s)
  timeout $to $S/bench_cuda --commit $COMMIT --graphs on --no-profile --no-ttft --carveout auto,none,auto,none "$@" --out $O/bench-cuda-$name.json > $O/bench-cuda-$name.log 2>&1
  echo "$name rc=$? in $(( $(date +%s) - t0 )) s"
}
run bf16 150 --config $L8 --shapes 1:128,1:1024,1:4096,1:8192,1:16384,2:1024,2:4096,3:4096,4:1024,4:4096,8:1024,16:1024,64:1024,256:1024,32:8192
run fp8-wkv 80 --config $L8 --quantization fp8 --kv-cache-dtype fp8 --shapes 1:128,1:1024,1:8192,2:4096,4:4096,8:1024,64:1024
run fp8-w 60 --config $L8 --quantization fp8 --shapes 1:128,1:8192,4:1024
run moe 90 --config configs/models/qwen3-30b-a3b.json --shapes 1:128,1:4096,4:1024,8:1024
run gemma 70 --config configs/models/gemma-3-12b.json --shapes 1:128,1:4096,4:4096
run qwen3 60 --config configs/models/qwen3-8b.json --shapes 1:128,1:8192,4:1024
run qwen2 60 --config configs/models/qwen2.5-7b.json --shapes 1:128,4:1024
echo "===== ms per step, median of two rounds: shape | auto | none | auto vs none ====="
python3 - $O <<'PY'
import json,sys,glob,collections,statistics
for f in sorted(glob.glob(sys.argv[1]+'/bench-cuda-*.json')):
    try: d=json.load(open(f))
    except Exception as e: print(f,e); continue
    t=collections.defaultdict(list); fl={}
    for r in d['results']:
        if r['name']=='decode_step':
            t[(r['batch'],r['context'],r['carveout_pin'])].append(r['ms_per_step']); fl[(r['batch'],r['context'])]=r['floor_ms']
    print('--',f.split('/')[-1])
    for (b,c) in sorted({(k[0],k[1]) for k in t}):
        a=statistics.median(t[(b,c,'auto')]); n=statistics.median(t[(b,c,'none')])
        print(f"{b:3}x{c:6} {a:7.3f} {n:7.3f} {100*(a/n-1):+5.1f}%  floor {fl[(b,c)]:.3f} ({100*fl[(b,c)]/a:.1f}% / {100*fl[(b,c)]/n:.1f}%)")
PY
left=$(( T0 + 580 - $(date +%s) )); echo "tests get $left s"
timeout $left $S/cargo-nextest nextest run --archive-file $S/tests.tar.zst --extract-to $TMPDIR/nx --workspace-remap . \
  -E 'test(/^gpu_/) & !test(/^gpu2_/)' --no-fail-fast --success-output never --test-threads 2 > $O/gpu-tests.log 2>&1
echo "tests rc=$?"; grep -E '^\s+(PASS|FAIL|SIGSEGV|TIMEOUT)|Summary' $O/gpu-tests.log | grep -v PASS | tail -15
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf callE.tgz e && rm -rf e
