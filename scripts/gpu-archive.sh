#!/usr/bin/env bash
# Builds a nextest archive of the gpu_* test binaries small enough for the device tool's carry
# (64 MiB with the working tree): only the `gpu_*` test targets of baton-kernels and
# baton-engine (not every test binary of the two packages: ~160 MB), and without the static and
# rust libraries of llguidance, which nextest packs for its cdylib but no test loads (48 MB).
#
#   scripts/gpu-archive.sh OUT.tar.zst [kernels|engine|all]
#
# `all` (the default) is ~42 MB compressed at 2026-12 (22 binaries); `kernels` and `engine`
# are the two halves, for calls that carry more programs beside the tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="$1"
which="${2:-all}"
export CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_DEV_STRIP=debuginfo
export CARGO_PROFILE_TEST_DEBUG=0 CARGO_PROFILE_TEST_STRIP=debuginfo
targets() { for f in "$1"/tests/gpu_*.rs; do printf -- '--test %s ' "$(basename "$f" .rs)"; done; }
args=()
# shellcheck disable=SC2207
case "$which" in
    kernels) args=(-p baton-kernels $(targets kernels)) ;;
    engine) args=(-p baton-engine $(targets engine)) ;;
    all) args=(-p baton-kernels $(targets kernels) -p baton-engine $(targets engine)) ;;
    *) echo "usage: $0 OUT.tar.zst [kernels|engine|all]" >&2; exit 2 ;;
esac
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
cargo nextest archive "${args[@]}" --archive-file "$raw/full.tar.zst"
mkdir "$raw/x"
zstd -dc "$raw/full.tar.zst" | tar -x -C "$raw/x"
rm -f "$raw"/x/target/debug/deps/libllguidance-*.a "$raw"/x/target/debug/deps/libllguidance-*.rlib
tar -C "$raw/x" -cf - target | zstd -19 -T0 -q -f -o "$out"
du -h "$out"
