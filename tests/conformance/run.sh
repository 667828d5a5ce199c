#!/usr/bin/env bash
# Runs the OpenAI-client conformance tests against a freshly started `baton serve`.
#
#   TINY_MODEL_DIR=/path/to/tiny-model tests/conformance/run.sh [pytest args...]
#
# The model dir can be produced with
#   cargo run -p baton-formats --example write_tiny_models -- DIR   (then DIR/llama)
# BATON_BIN overrides the binary (default: ${CARGO_TARGET_DIR:-target}/debug/baton).
# Without the `openai` and `pytest` modules, a virtualenv with them is created under
# ${CARGO_TARGET_DIR:-target}/conformance-venv.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="${BATON_BIN:-$target/debug/baton}"
: "${TINY_MODEL_DIR:?set TINY_MODEL_DIR to a tiny model folder}"
[ -x "$bin" ] || { echo "no baton binary at $bin (cargo build -p baton first)" >&2; exit 1; }

python=python3
if ! "$python" -c 'import openai, pytest' 2>/dev/null; then
  venv="$target/conformance-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$here/requirements.txt"
  python="$venv/bin/python"
fi

free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port="$(free_port)"
grpc_port="$(free_port)"
model_name="tiny"
log="$(mktemp)"

"$bin" serve --model "$TINY_MODEL_DIR" --device cpu --host 127.0.0.1 --port "$port" \
  --grpc-port "$grpc_port" --served-model-name "$model_name" --max-model-len 512 >"$log" 2>&1 &
server=$!
cleanup() { kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"; }
trap cleanup EXIT

for _ in $(seq 1 600); do
  if "$python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
    break
  fi
  if ! kill -0 "$server" 2>/dev/null; then
    echo "baton serve exited:" >&2; cat "$log" >&2; exit 1
  fi
  sleep 0.2
done

BATON_URL="http://127.0.0.1:$port" BATON_MODEL="$model_name" "$python" -m pytest -q "$here/test_openai.py" "$@" || {
  status=$?; echo "--- server log ---" >&2; tail -50 "$log" >&2; exit $status
}
