#!/usr/bin/env bash
# Packs the default model and the two programs for scripts/golden/smollm2-gpu.sh into two
# carry folders, each under the device tool's 64 MiB carry limit:
#   .carry/smol-a/  model.gguf.gz.part-a, SHA256
#   .carry/smol-b/  model.gguf.gz.part-b, SHA256, COMMIT, bin/{export_hf,greedy_dump}.gz
# The GGUF (98 MB) is gzipped (Q4_1 data shrinks ~6%, to ~93 MB) and cut in two; the cut
# moves toward part b's end when the programs would push .carry/smol-b over the limit.
# The programs are the release builds, stripped and gzipped.
#
#   cargo build --release -p baton-engine --examples   # with the CARGO_TARGET_DIR you use
#   scripts/golden/split-model.sh [GGUF]        # default models/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
model="${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
[[ -s "$model" ]] || { echo "error: $model missing (scripts/fetch-default-model.sh)" >&2; exit 1; }
target="${CARGO_TARGET_DIR:-target}"
A=.carry/smol-a
B=.carry/smol-b
limit=$((63 * 1024 * 1024)) # 1 MiB below the carry limit, for the small files and slack

rm -rf "$A" "$B"
mkdir -p "$A" "$B/bin"
for ex in export_hf greedy_dump; do
    f="$target/release/examples/$ex"
    [[ -x "$f" ]] || { echo "error: $f missing: cargo build --release -p baton-engine --examples" >&2; exit 1; }
    strip --strip-debug -o "$B/bin/$ex" "$f"
    gzip -9f "$B/bin/$ex"
done
git rev-parse --short HEAD >"$B/COMMIT" 2>/dev/null || echo unknown >"$B/COMMIT"
sha256sum "$model" | cut -d' ' -f1 | tee "$A/SHA256" >"$B/SHA256"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
gzip -6 -c "$model" >"$tmp/model.gguf.gz"
total=$(stat -c %s "$tmp/model.gguf.gz")
small=$(du -cb "$B" | tail -1 | cut -f1)
cut_at=$(((total + 1) / 2))
if ((total - cut_at + small > limit)); then cut_at=$((total - (limit - small))); fi
if ((cut_at > limit)); then
    echo "error: model ($total bytes gzipped) and programs ($small bytes) do not fit two carries" >&2
    exit 1
fi
head -c "$cut_at" "$tmp/model.gguf.gz" >"$A/model.gguf.gz.part-a"
tail -c +"$((cut_at + 1))" "$tmp/model.gguf.gz" >"$B/model.gguf.gz.part-b"
# Reassembly check here, so that a bad split never travels.
[[ "$(cat "$A/model.gguf.gz.part-a" "$B/model.gguf.gz.part-b" | gunzip | sha256sum | cut -d' ' -f1)" == "$(cat "$A/SHA256")" ]] \
    || { echo "error: parts do not reassemble to $model" >&2; exit 1; }
du -sb "$A" "$B" | awk '{printf "%s: %.1f MiB\n", $2, $1 / 1048576}'
