#!/usr/bin/env python3
"""Tiny FP8 checkpoints in each Hub format, from the golden `llama` fixture (f32 weights).

Usage (torch + safetensors; CPU, a second):
    python3 scripts/golden/make_fp8.py engine/formats/tests/fixtures/golden/llama engine/formats/tests/fixtures/fp8

Writes OUT/<format>/ for three formats, each written from the format's public description:

  block   HF / vLLM `quant_method: "fp8"` with `weight_block_size: [32, 48]` (DeepSeek-V3 and
          Qwen3-FP8 publish [128, 128]; a smaller block splits the 64-wide tiny matrices, and 48
          leaves a partial last column block): each quantized `W` is F8_E4M3 [N, K] plus
          `W_scale_inv` f32 [ceil(N/32), ceil(K/48)], the value being `code * scale_inv`.
          `modules_to_not_convert: ["lm_head"]`, activation_scheme dynamic.
  tensor  HF / vLLM `quant_method: "fp8"` without a block size (AutoFP8 / vLLM per-tensor):
          `W_scale` f32 [] (one value per tensor); activation_scheme dynamic.
  ct      compressed-tensors `format: "float-quantized"` (llm-compressor's FP8_DYNAMIC scheme):
          one group targeting Linear, weights {num_bits 8, type float, strategy channel,
          symmetric, static} with `W_scale` f32 [N, 1]; input activations {num_bits 8, type
          float, strategy token, dynamic}; `ignore: ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"]`
          (so that one linear stays in its f32 original).

Quantized linears: q/k/v/o_proj and gate/up/down_proj of every layer. Embeddings, norms and the LM
head stay f32. Scales are amax / 448 over the scale's group (a zero group gets scale 1); codes are
torch's round-to-nearest-even float8_e4m3fn conversion of `w / scale` (clamped to ±448 first).

Each folder also gets `reference/dequantized.safetensors`: every quantized weight as torch dequantizes it
(`code.float() * scale`, f32), the reference the loader must match bit for bit; plus the
tokenizer files and generation config of the source fixture.
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
E4M3_MAX = 448.0


def to_codes(scaled):
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def scale_of(amax):
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_block(w, bn, bk):
    n, k = w.shape
    sn, sk = -(-n // bn), -(-k // bk)
    scales = torch.empty(sn, sk, dtype=torch.float32)
    for i in range(sn):
        for j in range(sk):
            scales[i, j] = scale_of(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax())
    full = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    codes = to_codes(w / full)
    return codes, scales, codes.float() * full


def quantize_tensor(w):
    s = scale_of(w.abs().amax()).reshape(())
    codes = to_codes(w / s)
    return codes, s.clone(), codes.float() * s


def quantize_channel(w):
    s = scale_of(w.abs().amax(dim=1, keepdim=True))
    codes = to_codes(w / s)
    return codes, s, codes.float() * s


FORMATS = {
    "block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
               "weight_block_size": [32, 48], "modules_to_not_convert": ["lm_head"]},
              "_scale_inv", lambda w: quantize_block(w, 32, 48)),
    "tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "_scale", quantize_tensor),
    "ct": ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True, "group_size": None, "block_structure": None,
                                      "observer": None},
                "output_activations": None}},
            "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"], "kv_cache_scheme": None},
           "_scale", quantize_channel),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    a = ap.parse_args()
    config = json.load(open(os.path.join(a.src, "config.json")))
    weights = load_file(os.path.join(a.src, "model.safetensors"))
    layers = config["num_hidden_layers"]
    for name, (qcfg, suffix, quantize) in FORMATS.items():
        d = os.path.join(a.out, name)
        os.makedirs(d, exist_ok=True)
        out, deq = {}, {}
        ignored = ["model.layers.1.mlp.down_proj"] if name == "ct" else []
        for k, v in weights.items():
            module = k[: -len(".weight")] if k.endswith(".weight") else None
            quantized = module is not None and module not in ignored and any(
                module == f"model.layers.{i}.{l}" for i in range(layers) for l in LINEARS)
            if not quantized:
                out[k] = v.contiguous()
                continue
            codes, scales, dq = quantize(v.float())
            out[k] = codes.contiguous()
            out[k + suffix] = scales.contiguous()
            deq[k] = dq.contiguous()
        save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        # In a subfolder: the loader reads every *.safetensors file beside config.json as a shard.
        os.makedirs(os.path.join(d, "reference"), exist_ok=True)
        save_file(deq, os.path.join(d, "reference", "dequantized.safetensors"), metadata={"format": "pt"})
        cfg = dict(config, quantization_config=qcfg)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        for extra in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
            if os.path.exists(os.path.join(a.src, extra)):
                shutil.copy(os.path.join(a.src, extra), os.path.join(d, extra))
        print(name, len(deq), "quantized weights ->", d)


if __name__ == "__main__":
    main()
