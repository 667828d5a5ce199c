#!/usr/bin/env bash
# The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), on Baton's CUDA backend (and CPU)
# against Hugging Face transformers, on the GPU machine. transformers there cannot read GGUF,
# so Baton exports the exact weights it uses (export_hf: dequantized, HF names and order) as
# a HF folder, and hf_compare.py runs transformers on that folder with Baton's own tokens
# (teacher forcing), as the `golden` step of scripts/gpu-cuda.sh does for the tiny models.
#
# The GGUF (98 MB) plus the programs exceed one call's 64 MiB carry, so they travel in two
# device calls, back to back (part a waits in /tmp on the warm machine in between):
#
#   here:   cargo build -p baton-engine --examples
#           scripts/golden/split-model.sh       # .carry/smol-a: part a; .carry/smol-b: part b + programs
#   call 1: run(command="bash scripts/golden/smollm2-gpu.sh stash", carry=[".carry/smol-a"])
#   call 2: run(command="bash scripts/golden/smollm2-gpu.sh", carry=[".carry/smol-b"])
#
# Call 2 reassembles the GGUF (cat part-a part-b | gunzip, checked against SHA256), exports
# it, makes prompts (random ids of several lengths, plus chat prompts through the exported
# tokenizer), runs greedy_dump for SMOL_STEPS tokens on cuda:0 and on the CPU backend, runs
# `hf_compare.py compare` on each dump, prints a summary table last and writes logs and
# JSON under $OUT (or bench/results/).
#
# Environment: SMOL_PART_A / SMOL_PART_B (folders holding the parts; defaults .carry/smol-a,
# .carry/smol-b, and the stash is searched too), SMOL_STASH (/tmp/baton-smol/stash),
# SMOL_GGUF (use this GGUF file instead of parts), SMOL_BIN (folder with export_hf and
# greedy_dump, plain or .gz), SMOL_STEPS (64), SMOL_CPU (1; 0 skips the CPU run),
# SMOL_DTYPE (f32: the export's dtype).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PART_A="${SMOL_PART_A:-.carry/smol-a}"
PART_B="${SMOL_PART_B:-.carry/smol-b}"
STASH="${SMOL_STASH:-/tmp/baton-smol/stash}"
W=/tmp/baton-smol/work

if [[ "${1:-}" == "stash" ]]; then
    mkdir -p "$STASH"
    for d in "$PART_A" "$PART_B"; do
        [[ -d "$d" ]] && cp -r "$d"/. "$STASH"/
    done
    ls -la "$STASH"
    exit 0
fi

export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
OUTDIR="${OUT:-bench/results}"
mkdir -p "$OUTDIR" "$W"
LOG="$OUTDIR/smollm2.log"
: >"$LOG"
fail() { echo "smollm2-gpu: $*" | tee -a "$LOG" >&2; exit 1; }

# The first of the candidate folders that holds `name`.
find_in() {
    local name="$1"; shift
    for d in "$@"; do [[ -e "$d/$name" ]] && { echo "$d/$name"; return 0; }; done
    return 1
}

# 1. The model.
if [[ -n "${SMOL_GGUF:-}" ]]; then
    MODEL="$SMOL_GGUF"
else
    a="$(find_in model.gguf.gz.part-a "$PART_A" "$STASH")" || fail "part a not found (call 1: smollm2-gpu.sh stash)"
    b="$(find_in model.gguf.gz.part-b "$PART_B" "$STASH")" || fail "part b not found"
    sum="$(find_in SHA256 "$PART_B" "$PART_A" "$STASH")" || fail "SHA256 not found"
    MODEL="$W/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat "$a" "$b" | gunzip >"$MODEL" || fail "reassembly failed"
    [[ "$(sha256sum "$MODEL" | cut -d' ' -f1)" == "$(cat "$sum")" ]] || fail "reassembled GGUF has the wrong sha256"
fi
[[ -s "$MODEL" ]] || fail "no model at $MODEL"

# 2. The programs (gzipped ones are unpacked into $W/bin).
BIN_DIRS=("${SMOL_BIN:-}" "$PART_B/bin" "$PART_A/bin" "$STASH/bin" .carry/cuda)
mkdir -p "$W/bin"
for p in export_hf greedy_dump; do
    if f="$(find_in "$p" "${BIN_DIRS[@]}")"; then
        cp "$f" "$W/bin/$p"
    elif f="$(find_in "$p.gz" "${BIN_DIRS[@]}")"; then
        gunzip -c "$f" >"$W/bin/$p"
    else
        fail "$p not found in ${BIN_DIRS[*]} (scripts/golden/split-model.sh packs it)"
    fi
    chmod +x "$W/bin/$p"
done
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if f="$(find_in COMMIT "$PART_B" "$STASH")"; then COMMIT="$(cat "$f")"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/device.txt"

# 3. Export, prompts, Baton runs, comparisons.
status=0
HF="$W/hf"
STEPS="${SMOL_STEPS:-64}"
{
    "$W/bin/export_hf" "$MODEL" "$HF" --dtype "${SMOL_DTYPE:-f32}" --force || exit 1
    python3 scripts/golden/hf_compare.py prompts 49152 17 "$W/prompts.json" --lengths 1,7,16,17,40,100,300 \
        --chat-tokenizer "$HF" \
        || python3 scripts/golden/hf_compare.py prompts 49152 17 "$W/prompts.json" --lengths 1,7,16,17,40,100,300
} >>"$LOG" 2>&1 || fail "export or prompts failed (see $LOG)"

backends=(cuda)
[[ "${SMOL_CPU:-1}" != 0 ]] && backends+=(cpu)
for dev in "${backends[@]}"; do
    dump="$W/dump_$dev.json"
    {
        timeout 300 "$W/bin/greedy_dump" run "$MODEL" "$W/prompts.json" "$dump" --steps "$STEPS" --device "$dev" \
            && timeout 300 python3 scripts/golden/hf_compare.py compare "$HF" "$dump" "$W/cmp_$dev.json"
    } >>"$LOG" 2>&1 || status=1
    cp "$dump" "$OUTDIR/smollm2-dump-$dev.json" 2>/dev/null
done

python3 - "$OUTDIR/golden-smollm2.json" "$COMMIT" "$W" "$MODEL" >"$W/table.txt" 2>>"$LOG" <<'EOF' || status=1
import glob, json, os, sys

out, commit, w, model = sys.argv[1:5]
res = {"model": os.path.basename(model), "commit": commit, "prompts": json.load(open(f"{w}/prompts.json")), "results": {}}
for f in sorted(glob.glob(f"{w}/cmp_*.json")):
    res["results"][os.path.basename(f)[4:-5]] = json.load(open(f))
json.dump(res, open(out, "w"), indent=1)
print(f"{'backend':8} {'ref':5} {'identical':>10} {'max|dlogit|':>12} {'min gap':>8}  result")
for dev, r in res["results"].items():
    for kind, x in r["references"].items():
        gaps = [p["min_top2_gap_matched"] for p in x["prompts"] if p["min_top2_gap_matched"] is not None]
        print(f"{dev:8} {kind:5} {x['identical']:>4}/{len(x['prompts']):<5} {x['max_abs_logit_diff']:12.4f}"
              f" {min(gaps, default=float('nan')):8.3f}  {'PASS' if x['pass'] else 'FAIL'}")
EOF
echo "===== smollm2 vs transformers (commit $COMMIT, $STEPS tokens; log $LOG) ====="
cat "$W/table.txt"
grep -E ' vs HF ' "$LOG"
exit $status
