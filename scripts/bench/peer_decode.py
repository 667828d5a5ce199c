#!/usr/bin/env python3
"""The torch.compile peer for Baton's decode step (a benchmark program, not a test).

A gpt-fast-style Llama decoder written for this comparison: random bf16 weights of the
Llama-3.1-8B shape (or any config JSON), a dense static KV cache of `ctx + 64` tokens per
sequence, SDPA with a mask and GQA (`enable_gqa`, no repeated copy of the cache), greedy
argmax, and `torch.compile(mode="reduce-overhead", fullgraph=True)` with gpt-fast's Inductor
settings (coordinate-descent tuning): Inductor kernels replayed from CUDA graphs. Every sequence of a batch is
at the same position, as in Baton's `bench_cuda` decode shapes.

For each shape `batch:context` it times decode steps with CUDA events (8 warm-up steps
after compilation, then 40 timed, median) and writes one JSON with the step time, the bytes
the step must read at least (weights, and the KV of `context` tokens; the peer itself reads
its whole static cache of `context + 64`) and the compile time.

Usage: peer_decode.py OUT.json [--config configs/models/llama-3.1-8b.json]
                              [--shapes 1:128,64:1024,256:1024,1:8192,32:8192]

Compiled kernels are cached by Inductor (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): a
later run with the same cache skips most of the ~80 s a shape takes to compile.
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    def __init__(self, d):
        self.dim = d["hidden_size"]
        self.n_layers = d["num_hidden_layers"]
        self.n_heads = d["num_attention_heads"]
        self.n_kv = d.get("num_key_value_heads", self.n_heads)
        self.head_dim = d.get("head_dim") or self.dim // self.n_heads
        self.inter = d["intermediate_size"]
        self.vocab = d["vocab_size"]
        self.eps = d.get("rms_norm_eps", 1e-5)
        self.theta = d.get("rope_theta", 500000.0)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, cos, sin):
    # x: [B, H, T, D]; rotate-half RoPE as Hugging Face's Llama.
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv) * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.w13 = nn.Linear(c.dim, 2 * c.inter, bias=False)
        self.w2 = nn.Linear(c.inter, c.dim, bias=False)
        self.attn_norm = RMSNorm(c.dim, c.eps)
        self.ffn_norm = RMSNorm(c.dim, c.eps)
        # Buffers (not plain attributes): CUDA graphs treat them as static, mutated in place.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, mask, pos):
        c = self.c
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = self.wqkv(h).split([c.n_heads * c.head_dim, c.n_kv * c.head_dim, c.n_kv * c.head_dim], dim=-1)
        q = q.view(b, t, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, t, c.n_kv, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.n_kv, c.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        # GQA inside SDPA (no repeated copy of the cache, which gpt-fast's repeat_interleave
        # would write every step).
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, c.n_heads * c.head_dim))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def setup(self, batch, seq, device):
        c = self.c
        for layer in self.layers:
            shape = (batch, c.n_kv, seq, c.head_dim)
            layer.register_buffer("k_cache", torch.randn(shape, dtype=torch.bfloat16, device=device), persistent=False)
            layer.register_buffer("v_cache", torch.randn(shape, dtype=torch.bfloat16, device=device), persistent=False)
        inv = 1.0 / (c.theta ** (torch.arange(0, c.head_dim, 2, device=device).float() / c.head_dim))
        freqs = torch.outer(torch.arange(seq, device=device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(torch.bfloat16), persistent=False)
        self.register_buffer("sin", emb.sin().to(torch.bfloat16), persistent=False)
        self.register_buffer("causal", torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=device)), persistent=False)

    def forward(self, tokens, pos):
        x = self.embed(tokens)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = self.causal[pos][None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, pos)
        return self.output(self.norm(x))


def decode_one(model, tokens, pos):
    logits = model(tokens, pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True).to(torch.int32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/models/llama-3.1-8b.json")
    ap.add_argument("--shapes", default="1:128,64:1024,256:1024,1:8192,32:8192")
    ap.add_argument("--timed", type=int, default=40)
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every shape (filling Inductor's cache) and time nothing: run it beside other GPU work",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    # gpt-fast's Inductor settings: coordinate-descent tuning of the generated kernels (the
    # decode GEMVs become tuned Triton reductions), a unique name per kernel, the FX graph cache.
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    inductor_config.triton.unique_kernel_names = True
    inductor_config.fx_graph_cache = True
    c = Config(json.load(open(args.config)))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = Model(c)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    weight_bytes = 2 * sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("embed")
    ) + 2 * c.dim
    kv_per_token = 2 * c.n_layers * c.n_kv * c.head_dim * 2
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
    results = []
    for shape in args.shapes.split(","):
        batch, ctx = (int(v) for v in shape.split(":"))
        seq = ctx + 64
        torch._dynamo.reset()
        model.setup(batch, seq, dev)
        tokens = torch.randint(0, c.vocab, (batch, 1), device=dev, dtype=torch.int32)
        t0 = time.time()
        with torch.no_grad():
            for i in range(3):
                pos = torch.tensor([ctx - 3 + i], device=dev)
                tokens = step(model, tokens, pos).clone()
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            if args.compile_only:
                print(f"peer b={batch:3} ctx={ctx:5}: compiled in {compile_s:.0f} s", flush=True)
                for layer in model.layers:
                    layer.register_buffer("k_cache", None, persistent=False)
                    layer.register_buffer("v_cache", None, persistent=False)
                torch.cuda.empty_cache()
                continue
            times = []
            for i in range(8 + args.timed):
                pos = torch.tensor([ctx + i], device=dev)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                tokens = step(model, tokens, pos).clone()
                b.record()
                b.synchronize()
                if i >= 8:
                    times.append(a.elapsed_time(b))
        ms = statistics.median(times)
        floor_bytes = weight_bytes + kv_per_token * batch * ctx
        r = {
            "batch": batch,
            "context": ctx,
            "static_cache_tokens": seq,
            "ms_per_step": round(ms, 4),
            "tok_s": round(batch * 1000.0 / ms, 1),
            "floor_bytes": floor_bytes,
            "bytes_read_by_peer": weight_bytes + kv_per_token * batch * seq,
            "compile_s": round(compile_s, 1),
        }
        results.append(r)
        print(f"peer b={batch:3} ctx={ctx:5}: {ms:.3f} ms/step ({r['tok_s']:.0f} tok/s), compile {compile_s:.0f} s", flush=True)
        for layer in model.layers:
            layer.register_buffer("k_cache", None, persistent=False)
            layer.register_buffer("v_cache", None, persistent=False)
        torch.cuda.empty_cache()
    if args.compile_only:
        return
    doc = {
        "benchmark": "peer-decode-torch-compile",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "mode": "reduce-overhead, fullgraph",
        "config": args.config,
        "weight_bytes": weight_bytes,
        "results": results,
    }
    json.dump(doc, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
