#!/usr/bin/env bash
set -uo pipefail
H="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
"$H/write_tiny_models" /tmp/m > /dev/null || exit 1
timeout 240 python3 "$H/e2e.py"; rc=$?
echo "e2e rc=$rc"
for f in router prefill decode; do echo "== $f"; grep -iE "error|warn|NCCL|registered|ready" "$OUT/$f.log" | tail -6; done
