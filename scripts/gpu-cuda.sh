#!/usr/bin/env bash
# The CUDA backend's checks and benchmarks on the GPU machine, in one call: every gpu_* test,
# the kernel benchmark, the whole-model comparison with Hugging Face transformers (tiny test
# models and a random Llama-3.2-1B-shape model) and, when built, the whole-model benchmark.
#
#   here (dev machine):   scripts/gpu-cuda.sh --build
#       builds the nextest archive of the gpu_* tests (scripts/gpu-archive.sh; BATON_GPU_TESTS =
#       kernels|engine|all, default all), the example programs (release) and copies
#       cargo-nextest and the Python scripts into $BATON_GPU_CARRY (default .carry/cuda).
#       Everything together (~85 MB at 2026-12: tests ~42, programs ~32, kernel cache ~11) is
#       over the carry limit beside the ~25 MB working tree: copy what a call needs into a
#       folder of its own (say the tests and cargo-nextest for one call, bench_cuda and the
#       peer script for the next) and carry that;
#   there (GPU machine):  bash .carry/cuda/gpu-cuda.sh [tests] [bench] [golden] [model] [e2e] [throughput] [smollm2] [startup]
#       (default: the first four; e2e is the whole-model bench_cuda, throughput the offline
#       throughput runs, startup the start-up benchmark (bench_startup: an 8B-shape bf16
#       checkpoint to /health 200, without and with a kernel cache, and with the kernel cache
#       built here by `baton kernels build` when NVRTC was found), smollm2 the default model vs transformers through
#       scripts/golden/smollm2-gpu.sh, which needs the GGUF's parts stashed by earlier calls
#       or SMOL_GGUF; the usual way is that script's own two calls) writes logs and JSON to
#       $OUT (or bench/results/) and prints a short summary last.
#
# With the device tool: run(command="bash .carry/cuda/gpu-cuda.sh", carry=[".carry/cuda"]).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ "${1:-}" == "--build" ]]; then
    set -e
    cd "$HERE/.."
    CARRY="${BATON_GPU_CARRY:-.carry/cuda}"
    export CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_DEV_STRIP=debuginfo
    export CARGO_PROFILE_TEST_DEBUG=0 CARGO_PROFILE_TEST_STRIP=debuginfo
    mkdir -p "$CARRY"
    scripts/gpu-archive.sh "$CARRY/tests.tar.zst" "${BATON_GPU_TESTS:-all}"
    # The benchmark programs are release builds: host-side launch overhead is part of what
    # single-stream decode measures.
    cargo build --release -p baton-kernels -p baton-engine --examples
    cargo build --release -p baton
    target="${CARGO_TARGET_DIR:-target}"
    for ex in cuda_bench cuda_compile greedy_dump export_hf bench_cuda bench_throughput bench_startup; do
        [[ -f "$target/release/examples/$ex" ]] && cp "$target/release/examples/$ex" "$CARRY/" && strip "$CARRY/$ex"
    done
    cp "$target/release/baton" "$CARRY/" && strip "$CARRY/baton"
    # Compiled kernels for the GPU machine, built here without a GPU (needs NVRTC 13.0, e.g.
    # LD_LIBRARY_PATH=/opt/cuda-pip/x/nvidia/cu13/lib); `startup` then times a shipped cache.
    rm -rf "$CARRY/kernels"
    "$CARRY/baton" kernels build --arch sm_90a --out "$CARRY/kernels" \
        || { echo "no NVRTC here: the startup step will not time a shipped kernel cache"; rm -rf "$CARRY/kernels"; }
    cp "$(command -v cargo-nextest)" scripts/gpu-cuda.sh scripts/golden/hf_compare.py scripts/bench/sdpa_anchor.py \
        scripts/bench/peer_decode.py "$CARRY/"
    mkdir -p "$CARRY/configs" && cp configs/models/*.json "$CARRY/configs/"
    git rev-parse --short HEAD > "$CARRY/COMMIT" 2>/dev/null || echo unknown > "$CARRY/COMMIT"
    # The carry limit is 64 MiB: the programs travel gzipped and are unpacked on arrival.
    for f in cargo-nextest cuda_bench cuda_compile greedy_dump export_hf bench_cuda bench_throughput bench_startup baton; do
        if [[ -f "$CARRY/$f" ]]; then gzip -9f "$CARRY/$f"; fi
    done
    du -sh "$CARRY"
    exit 0
fi

# Gzipped programs (see --build) are unpacked into a scratch copy, which then runs.
if compgen -G "$HERE/*.gz" > /dev/null; then
    scratch="$(mktemp -d)"
    cp -r "$HERE"/. "$scratch"/ && gunzip -f "$scratch"/*.gz && chmod +x "$scratch"/* 2>/dev/null
    exec bash "$scratch/gpu-cuda.sh" "$@"
fi

export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUTDIR="${OUT:-bench/results}"
mkdir -p "$OUTDIR"
COMMIT="$(cat "$HERE/COMMIT" 2>/dev/null || echo unknown)"
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests bench golden model)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
summary=()
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/device.txt"

if want tests; then
    timeout 300 "$HERE/cargo-nextest" nextest run --archive-file "$HERE/tests.tar.zst" --workspace-remap . \
        -E 'test(/^gpu_/)' --no-fail-fast --success-output immediate --test-threads 1 >"$OUTDIR/gpu-tests.log" 2>&1
    rc=$?
    [[ $rc -ne 0 ]] && status=1
    summary+=("tests: $(grep -E '^ +Summary' "$OUTDIR/gpu-tests.log" | tail -1 | sed 's/^ *//') (rc $rc)")
    while read -r l; do summary+=("  $l"); done < <(grep -E '^ +(FAIL|PASS) ' "$OUTDIR/gpu-tests.log" | sed 's/^ *//' | sort -u | head -20)
fi

if want bench; then
    timeout 240 "$HERE/cuda_bench" "$OUTDIR/cuda-kernels.json" "$COMMIT" >"$OUTDIR/cuda-bench.log" 2>&1 || status=1
    summary+=("$(grep -E '^copy' "$OUTDIR/cuda-bench.log")")
    while read -r l; do summary+=("  $l"); done < <(grep -E '\*' "$OUTDIR/cuda-bench.log" | head -14)
    while read -r l; do summary+=("  $l"); done < <(grep -E 'prefill_mma|decode_kernel' "$OUTDIR/cuda-bench.log")
    # The prefill kernel's anchor, same run: torch SDPA (FA2 and cuDNN backends), same shapes.
    timeout 120 python3 "$HERE/sdpa_anchor.py" "$OUTDIR/sdpa-anchor.json" >"$OUTDIR/sdpa-anchor.log" 2>&1 || status=1
    while read -r l; do summary+=("  sdpa $l"); done < <(grep -E '_ATTENTION' "$OUTDIR/sdpa-anchor.log")
fi

if want golden; then
    G=/tmp/golden
    mkdir -p $G
    {
        "$HERE/greedy_dump" write-tiny $G/models
        python3 "$HERE/hf_compare.py" prompts 384 7 $G/prompts_tiny.json --lengths 1,7,16,17,40,100
        for m in llama qwen2 tied llama_wc qwen2_wc tied_wc; do
            "$HERE/greedy_dump" run $G/models/$m $G/prompts_tiny.json $G/$m.json --steps 64
            python3 "$HERE/hf_compare.py" compare $G/models/$m $G/$m.json $G/cmp_$m.json
        done
    } >"$OUTDIR/golden.log" 2>&1 || status=1
    summary+=("golden (tiny):")
    while read -r l; do summary+=("  $l"); done < <(grep -E ' vs HF ' "$OUTDIR/golden.log")
fi

if want model; then
    G=/tmp/golden
    mkdir -p $G
    {
        python3 "$HERE/hf_compare.py" prompts 128256 11 $G/prompts_1b.json --lengths 1,7,16,17,40,100,300,1000
        for std in ${BATON_1B_STDS:-0.02 0.08}; do
            d=$G/llama1b_std$std
            python3 "$HERE/hf_compare.py" make-1b $d --init-std $std
            "$HERE/greedy_dump" run $d $G/prompts_1b.json $G/1b_$std.json --steps 64
            python3 "$HERE/hf_compare.py" compare $d $G/1b_$std.json $G/cmp_1b_$std.json
        done
    } >>"$OUTDIR/golden.log" 2>&1 || status=1
    summary+=("golden (1B shape):")
    while read -r l; do summary+=("  $l"); done < <(grep -E 'llama1b.* vs HF ' "$OUTDIR/golden.log")
fi

if want golden || want model; then
    python3 - "$OUTDIR/golden-compare.json" "$COMMIT" <<'EOF'
import glob, json, sys
out = {"commit": sys.argv[2], "results": {}}
for f in sorted(glob.glob("/tmp/golden/cmp_*.json")):
    out["results"][f.split("cmp_")[1][:-5]] = json.load(open(f))
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF
fi

if want smollm2; then
    SMOL_BIN="$HERE" OUT="$OUTDIR" bash scripts/golden/smollm2-gpu.sh >"$OUTDIR/smollm2-summary.txt" 2>&1 || status=1
    summary+=("smollm2 (default model) vs transformers:")
    while read -r l; do summary+=("  $l"); done < <(sed -n '/^backend /,$p' "$OUTDIR/smollm2-summary.txt" | head -8)
fi

# The torch.compile peer (scripts/bench/peer_decode.py) at bench_cuda's decode shapes, before
# bench_cuda in the same call. Inductor's compiled kernels are cached: a carried
# inductor-cache.tar.gz (from an earlier call's $OUT) is unpacked first, and the cache is
# packed into $OUT again afterwards (each shape compiles for ~80 s without it).
if want peer; then
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache/inductor TRITON_CACHE_DIR=/tmp/inductor-cache/triton
    mkdir -p /tmp/inductor-cache
    [[ -f "$HERE/inductor-cache.tar.gz" ]] && tar -xzf "$HERE/inductor-cache.tar.gz" -C /tmp/inductor-cache
    timeout "${PEER_TIMEOUT:-480}" python3 "$HERE/peer_decode.py" "$OUTDIR/peer-decode.json" \
        --config "$HERE/configs/llama-3.1-8b.json" ${PEER_SHAPES:+--shapes $PEER_SHAPES} >"$OUTDIR/peer-decode.log" 2>&1 || status=1
    tar -czf "$OUTDIR/inductor-cache.tar.gz" -C /tmp/inductor-cache . 2>/dev/null
    while read -r l; do summary+=("$l"); done < <(grep -E '^peer ' "$OUTDIR/peer-decode.log")
fi

if want e2e && [[ -x "$HERE/bench_cuda" ]]; then
    peer_arg=()
    [[ -f "$OUTDIR/peer-decode.json" ]] && peer_arg=(--peer "$OUTDIR/peer-decode.json")
    timeout "${BENCH_CUDA_TIMEOUT:-420}" "$HERE/bench_cuda" --config "$HERE/configs/llama-3.1-8b.json" --out "$OUTDIR/bench-cuda.json" \
        --commit "$COMMIT" "${peer_arg[@]}" ${BENCH_CUDA_ARGS:-} >"$OUTDIR/bench-cuda.log" 2>&1 || status=1
    while read -r l; do summary+=("$l"); done < <(grep -E '^  b=|^TTFT|^copy' "$OUTDIR/bench-cuda.log")
fi

# Offline throughput, Llama-3.1-8B shape:
# THROUGHPUT_RUNS="isl:osl:prompts:time_limit_s[:max_num_seqs[:on|off|both]] ..." (the last field
# is --async-scheduling; `both` runs off then on with one model load and writes a JSON array).
if want throughput && [[ -x "$HERE/bench_throughput" ]]; then
    for r in ${THROUGHPUT_RUNS:-128:128:1000:200 1000:1000:1000:240}; do
        IFS=: read -r isl osl n lim seqs mode <<<"$r"
        seqs="${seqs:-256}" mode="${mode:-on}"
        name="throughput-$isl-$osl-n$n-s$seqs-async-$mode"
        runs=1; [[ "$mode" == both ]] && runs=2
        timeout $((runs * lim + 150)) "$HERE/bench_throughput" --config "$HERE/configs/llama-3.1-8b.json" \
            --out "$OUTDIR/$name.json" --commit "$COMMIT" --prompts "$n" --isl "$isl" --osl "$osl" \
            --max-num-seqs "$seqs" --async-scheduling "$mode" --time-limit-s "$lim" ${THROUGHPUT_ARGS:-} \
            >"$OUTDIR/$name.log" 2>&1 || status=1
        while read -r line; do summary+=("$name: $line"); done < <(grep '^async scheduling' "$OUTDIR/$name.log")
        [[ -s "$OUTDIR/$name.log" ]] || summary+=("$name: no output")
    done
fi

# Start-up: process start to /health 200 of `baton serve` on a random bf16 8B-shape checkpoint
# (16 GB in 4 shards, written to /tmp and read once so the page cache is warm), without and
# with a kernel cache (and with the one built on the dev machine, when carried).
if want startup && [[ -x "$HERE/bench_startup" && -x "$HERE/baton" ]]; then
    shipped=()
    [[ -d "$HERE/kernels" ]] && shipped=(--shipped-cache "$HERE/kernels")
    timeout "${STARTUP_TIMEOUT:-300}" "$HERE/bench_startup" --baton "$HERE/baton" --config "$HERE/configs/llama-3.1-8b.json" \
        --dir /tmp/baton-startup-model --commit "$COMMIT" --out-dir "$OUTDIR" "${shipped[@]}" \
        ${STARTUP_ARGS:-} >"$OUTDIR/startup.log" 2>&1 || status=1
    cp /tmp/baton-startup-model/.bench/startup-*.log "$OUTDIR/" 2>/dev/null
    while read -r l; do summary+=("startup $l"); done < <(grep -E 'healthy in|^wrote|page cache' "$OUTDIR/startup.log")
fi

echo "===== summary (commit $COMMIT) ====="
printf '%s\n' "${summary[@]}"
exit $status
