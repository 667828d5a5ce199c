#!/usr/bin/env python3
"""The PyTorch peer of `cuda_bench_lt` (a benchmark program, not a test).

`torch.nn.functional.linear` (cuBLAS / cuBLASLt as PyTorch calls them) on bf16 at the
Llama-3.1-8B projection shapes and the same rows of x, timed the way `cuda_bench_lt` times
its DRAM figure: 20 calls back to back between two CUDA events after 3 warm-up calls, the
weights rotating among copies of at least 256 MB together so that no call is served from L2.
Also `torch.compile(mode="max-autotune-no-cudagraphs")` of the same product, which lets
Inductor try its Triton GEMM templates beside cuBLAS (compile time is reported, not timed).

Usage: peer_linear.py OUT.json [--rows 32,64,128,256] [--autotune-rows 64] (Inductor compiles
for tens of seconds a shape, so it runs only at --autotune-rows; empty for none)
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def back_to_back_us(fn, ws, warm=3, reps=20):
    for i in range(warm):
        fn(ws[i % len(ws)])
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        fn(ws[i % len(ws)])
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", default="32,64,128,256")
    p.add_argument("--autotune-rows", default="64")
    a = p.parse_args()
    rows = [int(v) for v in a.rows.split(",")]
    autotune_rows = {int(v) for v in a.autotune_rows.split(",") if v}
    torch.manual_seed(0)
    results = []
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(" shape      M   F.linear   max-autotune  compile_s")
    for name, k, n in SHAPES:
        copies = max(2, min(8, -(-(256 << 20) // (2 * n * k))))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager = back_to_back_us(lambda w: F.linear(x, w), ws)
            tuned, compile_s = None, None
            if m in autotune_rows:
                f = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False)
                t0 = time.time()
                f(x, ws[0])
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                tuned = back_to_back_us(lambda w: f(x, w), ws)
            print(f" {name:8} {m:4} {eager:10.1f} {tuned if tuned is not None else float('nan'):13.1f} {compile_s or 0:9.1f}")
            results.append({"shape": name, "m": m, "n": n, "k": k, "f_linear_us": eager, "max_autotune_us": tuned, "compile_s": compile_s})
    with open(a.out, "w") as fh:
        json.dump({"benchmark": "peer_linear", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
