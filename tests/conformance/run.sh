#!/usr/bin/env bash
# Runs the OpenAI-client conformance tests against a freshly started `baton serve`.
#
#   TINY_MODEL_DIR=/path/to/tiny-model tests/conformance/run.sh [pytest args...]
#
# The model dir can be produced with
#   cargo run -p baton-formats --example write_tiny_models -- DIR   (then DIR/llama)
# A second server runs the default model (DEFAULT_MODEL, default
# models/SmolLM2-135M-Instruct.Q4_1.gguf; scripts/fetch-default-model.sh fetches it) with
# --enable-auto-tool-choice --tool-call-parser hermes, for the structured-output, tool-calling
# and agent tests, whose grammar-following output needs a real tokenizer and chat template.
# BATON_BIN overrides the binary (default: ${CARGO_TARGET_DIR:-target}/debug/baton).
# Without the `openai` and `pytest` modules, a virtualenv with them is created under
# ${CARGO_TARGET_DIR:-target}/conformance-venv.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
bin="${BATON_BIN:-$target/debug/baton}"
: "${TINY_MODEL_DIR:?set TINY_MODEL_DIR to a tiny model folder}"
default_model="${DEFAULT_MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -s "$default_model" ] || { echo "no default model at $default_model (scripts/fetch-default-model.sh)" >&2; exit 1; }
[ -x "$bin" ] || { echo "no baton binary at $bin (cargo build -p baton first)" >&2; exit 1; }

python=python3
if ! "$python" -c 'import openai, pytest, pydantic, jsonschema, agents' 2>/dev/null; then
  venv="$target/conformance-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$here/requirements.txt"
  python="$venv/bin/python"
fi

free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
model_name="tiny"
servers=()
logs=()
cleanup() {
  for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  rm -f "${logs[@]}"
}
trap cleanup EXIT

# start_server MODEL NAME EXTRA_FLAGS...: starts `baton serve`, waits for /health, and sets
# $url and $log.
start_server() {
  local model="$1" name="$2"; shift 2
  local port grpc_port server
  port="$(free_port)"
  grpc_port="$(free_port)"
  log="$(mktemp)"
  logs+=("$log")
  "$bin" serve --model "$model" --device cpu --host 127.0.0.1 --port "$port" \
    --grpc-port "$grpc_port" --served-model-name "$name" "$@" >"$log" 2>&1 &
  server=$!
  servers+=("$server")
  for _ in $(seq 1 600); do
    if "$python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
      url="http://127.0.0.1:$port"
      return 0
    fi
    if ! kill -0 "$server" 2>/dev/null; then
      echo "baton serve exited:" >&2; cat "$log" >&2; exit 1
    fi
    sleep 0.2
  done
  echo "baton serve did not become healthy:" >&2; cat "$log" >&2; exit 1
}

start_server "$TINY_MODEL_DIR" "$model_name" --max-model-len 512
tiny_url="$url"; tiny_log="$log"
start_server "$default_model" "smollm2" --max-model-len 2048 --enable-auto-tool-choice --tool-call-parser hermes
smol_url="$url"; smol_log="$log"

BATON_URL="$tiny_url" BATON_MODEL="$model_name" BATON_SMOL_URL="$smol_url" BATON_SMOL_MODEL="smollm2" \
  "$python" -m pytest -q "$here/test_openai.py" "$here/test_structured.py" "$here/test_agents.py" "$@" || {
  status=$?
  echo "--- tiny server log ---" >&2; tail -50 "$tiny_log" >&2
  echo "--- default-model server log ---" >&2; tail -50 "$smol_log" >&2
  exit $status
}
