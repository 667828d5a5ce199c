#!/usr/bin/env python3
"""Anchor for Baton's prefill attention: torch SDPA at the same shapes as the prefill section
of kernels/examples/cuda_bench.rs (one sequence of S tokens, causal, bf16, 32 query heads,
8 KV heads, head_dim 128), through the FLASH_ATTENTION (FA2) and CUDNN_ATTENTION backends.

FLOPs = 4 * S * S * head_dim * n_heads / 2 (causal; the FA2/FA3 convention, same formula as
cuda_bench). Times: CUDA events around each call, median of the repeats after warm-up.
Inputs are random normal (never zeros). GQA: enable_gqa=True when the backend accepts it,
else K/V expanded to 32 heads beforehand (the expansion is not timed); the row says which.

Usage: python3 scripts/bench/sdpa_anchor.py OUT.json   (prints a table, writes JSON)
"""

import json
import statistics
import sys

SEQS = (512, 2048, 4096, 8192)
N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
WARMUP, REPS = 5, 20


def time_call(torch, fn):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_backend(torch, F, backend, s):
    """Median ms of one causal SDPA call at sequence length s, and how GQA was done."""
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(1, N_HEADS, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, N_KV_HEADS, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, N_KV_HEADS, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([backend]):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
            ms = time_call(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            return ms, "enable_gqa"
        except RuntimeError:
            # Some backends refuse GQA; expand K/V to every query head (same FLOPs).
            rep = N_HEADS // N_KV_HEADS
            ke = k.repeat_interleave(rep, dim=1).contiguous()
            ve = v.repeat_interleave(rep, dim=1).contiguous()
            ms = time_call(torch, lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
            return ms, "expanded"


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    out_path = sys.argv[1]
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    dev = torch.cuda.get_device_name(0)
    rows = []
    print(f"device {dev}, torch {torch.__version__}")
    print(f"{'S':>6} {'backend':16} {'gqa':10} {'us':>9} {'TFLOP/s':>8}")
    for name, backend in (("FLASH_ATTENTION", SDPBackend.FLASH_ATTENTION), ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION)):
        for s in SEQS:
            flops = 4.0 * s * s * HEAD_DIM * N_HEADS / 2.0
            try:
                ms, gqa = run_backend(torch, F, backend, s)
            except RuntimeError as e:  # backend unavailable for this shape/device
                print(f"{s:6} {name:16} unavailable: {str(e).splitlines()[0][:80]}")
                rows.append({"name": "sdpa_prefill", "backend": name, "seq": s, "error": str(e)[:300]})
                continue
            tf = flops / (ms * 1e-3) / 1e12
            print(f"{s:6} {name:16} {gqa:10} {ms * 1e3:9.1f} {tf:8.1f}")
            rows.append(
                {
                    "name": "sdpa_prefill",
                    "backend": name,
                    "gqa": gqa,
                    "seq": s,
                    "n_heads": N_HEADS,
                    "n_kv_heads": N_KV_HEADS,
                    "head_dim": HEAD_DIM,
                    "causal": True,
                    "us": round(ms * 1e3, 2),
                    "flops": flops,
                    "tflop_s": round(tf, 2),
                }
            )
    doc = {
        "benchmark": "sdpa-anchor",
        "device": dev,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "flop_formula": "4*S*S*head_dim*n_heads/2",
        "results": rows,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
