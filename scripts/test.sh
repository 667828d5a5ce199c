#!/usr/bin/env bash
# The project's test command (the README points here, and .ci/run runs it).
# Runs on a machine without a GPU: every test named gpu_* is excluded here and
# runs on the GPU machine instead (scripts/gpu-tests.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The default model (SmolLM2-135M-Instruct Q4_1) is needed by the tests that load it.
scripts/fetch-default-model.sh

# Rust: unit, property and end-to-end tests (real `baton` processes on loopback).
cargo nextest run --workspace --no-fail-fast -E 'not test(/^gpu_/)'

# OpenAI client conformance: the official `openai` Python package against `baton serve`.
tests/conformance/run.sh
