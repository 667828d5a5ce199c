#!/usr/bin/env python3
"""A tiny FP8 Qwen3-MoE checkpoint (block scales, the layout Qwen3-MoE-FP8 and DeepSeek-V3
publish), from the golden `qwen3_moe` fixture (f32 weights), and its bf16 reference.

Usage (numpy + ml_dtypes; no torch needed; CPU, a second):
    python3 scripts/golden/make_fp8_moe.py engine/formats/tests/fixtures/golden/qwen3_moe \
        engine/formats/tests/fixtures/fp8/qwen3_moe_experts

Writes OUT/ with:
  - model.safetensors: every MoE expert's gate_proj / up_proj / down_proj as F8_E4M3 [N, K]
    plus `W_scale_inv` f32 [ceil(N/16), ceil(K/24)] (HF / vLLM `quant_method: "fp8"` with
    `weight_block_size: [16, 24]`: the published checkpoints use [128, 128]; 16 x 24 splits the
    tiny 32 x 64 and 64 x 32 experts into several blocks, partial ones included), the value
    being `code * scale_inv`. Everything else as in the source (f32): attention, the router,
    the dense MLP layer, norms, embeddings and the LM head, which `modules_to_not_convert`
    names ("lm_head", "self_attn", "mlp.gate" (the router), "mlp.up_proj", "mlp.down_proj":
    substrings, as vLLM and Baton match them; none is a substring of an expert's name);
  - config.json: the source's, with that `quantization_config`;
  - reference/model.safetensors + reference/config.json: the source checkpoint with each
    expert replaced by its dequantized values (`code * scale` in f32) rounded to bf16 (round to
    nearest even), stored as BF16, and no quantization_config: what Baton must compute from
    the FP8 checkpoint bit for bit, since it dequantizes FP8 experts at load to bf16.

Scales are amax / 448 over the block (a zero block gets scale 1); codes are ml_dtypes'
round-to-nearest-even float8_e4m3fn conversion of `w / scale` (clamped to +-448 first). The
safetensors files are written from the format's public description (an 8-byte little-endian
header length, a JSON header of dtype / shape / data_offsets per tensor, then the bytes).
"""
import argparse
import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
BLOCK = (16, 24)
NOT_CONVERTED = ["lm_head", "self_attn", "mlp.gate", "mlp.up_proj", "mlp.down_proj"]
DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(body[a:b], dtype=DTYPES[meta["dtype"]]).reshape(meta["shape"]).copy()
    return out


def write_safetensors(path, tensors):
    names = {np.dtype(v).name: k for k, v in DTYPES.items()}
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        raw = t.tobytes()
        header[name] = {"dtype": names[t.dtype.name], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for c in chunks:
            f.write(c)


def quantize_block(w):
    bn, bk = BLOCK
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    scales = np.empty((sn, sk), dtype=np.float32)
    for i in range(sn):
        for j in range(sk):
            amax = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max()
            scales[i, j] = amax / np.float32(E4M3_MAX) if amax > 0 else np.float32(1.0)
    full = np.repeat(np.repeat(scales, bn, axis=0)[:n], bk, axis=1)[:, :k]
    codes = np.clip(w / full, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return codes, scales, codes.astype(np.float32) * full


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    a = ap.parse_args()
    config = json.load(open(os.path.join(a.src, "config.json")))
    weights = read_safetensors(os.path.join(a.src, "model.safetensors"))
    fp8, ref = {}, {}
    experts = 0
    for name, w in weights.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            codes, scales, dq = quantize_block(w.astype(np.float32))
            fp8[name], fp8[name + "_scale_inv"] = codes, scales
            ref[name] = dq.astype(ml_dtypes.bfloat16)
            experts += 1
        else:
            fp8[name] = ref[name] = w
    os.makedirs(os.path.join(a.out, "reference"), exist_ok=True)
    write_safetensors(os.path.join(a.out, "model.safetensors"), fp8)
    write_safetensors(os.path.join(a.out, "reference", "model.safetensors"), ref)
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(BLOCK), "modules_to_not_convert": NOT_CONVERTED}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(dict(config, quantization_config=qcfg), f, indent=2)
    with open(os.path.join(a.out, "reference", "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        if os.path.exists(os.path.join(a.src, extra)):
            for d in [a.out, os.path.join(a.out, "reference")]:
                shutil.copy(os.path.join(a.src, extra), os.path.join(d, extra))
    print(experts, "FP8 experts ->", a.out)


if __name__ == "__main__":
    main()
