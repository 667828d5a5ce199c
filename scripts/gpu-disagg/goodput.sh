#!/usr/bin/env bash
set -uo pipefail
H="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$H/lib:$LD_LIBRARY_PATH"   # baton-loadtest needs libfontconfig and friends: carry them in lib/
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
GOODPUT_CONFIGS=${GOODPUT_CONFIGS:-1p1d,2unified} timeout 330 python3 "$H/goodput.py"; echo "goodput rc=$?"
for f in "$OUT"/*-router.log; do grep -iE "error|warn" "$f" | tail -3; done
tail -5 "$OUT"/1p1d-long_prompt.txt "$OUT"/2unified-long_prompt.txt 2>/dev/null
