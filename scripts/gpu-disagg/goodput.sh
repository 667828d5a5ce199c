#!/usr/bin/env bash
# Goodput of 1P1D vs two unified workers (see goodput.py for the load and the overrides).
set -uo pipefail
H="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$H/lib:$LD_LIBRARY_PATH"   # baton-loadtest needs libfontconfig and friends: carry them in lib/
export OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
GOODPUT_CONFIGS=${GOODPUT_CONFIGS:-1p1d,2unified} timeout "${GOODPUT_TIMEOUT:-500}" python3 "$H/goodput.py"; echo "goodput rc=$?"
for f in "$OUT"/*-router.log; do grep -iE "error|warn" "$f" | tail -3; done
# The device tool returns few files: everything but the summary goes into one archive.
(cd "$OUT" && tar czf logs.tar.gz --exclude goodput.json --exclude logs.tar.gz --remove-files -- * 2>/dev/null)
