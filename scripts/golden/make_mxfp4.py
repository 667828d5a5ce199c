#!/usr/bin/env python3
"""An MXFP4 copy of the gpt_oss fixture, as gpt-oss checkpoints are published, with what transformers reads from it.

Usage (torch + transformers; CPU is enough, a few seconds):
    python3 scripts/golden/make_mxfp4.py engine/formats/tests/fixtures/golden

Reads DIR/gpt_oss/ (written by make_hf_tiny.py) and writes DIR/gpt_oss_mxfp4/:

    model.safetensors        every tensor of gpt_oss, except that each expert weight
                             `model.layers.N.mlp.experts.{gate_up_proj,down_proj}` is replaced by
                             `..._blocks` (uint8, [E, out, in/32, 16]: two e2m1 codes per byte, the
                             even element in the low nibble) and `..._scales` (uint8, [E, out, in/32]:
                             e8m0, the power of two 2^(s - 127) shared by 32 consecutive inputs).
                             This is the layout of openai/gpt-oss-20b's checkpoint and of
                             transformers' `convert_moe_packed_tensors` (out = the rows of the
                             weight transposed to [E, out, in]; transformers transposes back).
    config.json              gpt_oss's, plus gpt-oss's `quantization_config` (quant_method mxfp4,
                             the same modules_to_not_convert as openai/gpt-oss-20b)
    dequantized.safetensors  the expert weights transformers itself holds after loading this folder
                             with `Mxfp4Config(dequantize=True)`: the reference a loader must match
                             bit for bit.
    golden.json              transformers' float32 forward of the dequantized model (make_golden's
                             format), for the gpt-oss architecture's golden test.
    tokenizer files          copied from gpt_oss/.

The quantizer (here, in numpy-free torch) follows the OCP Microscaling spec's recipe: per group of 32
inputs, the shared exponent is the smallest power of two whose e2m1 range (max 6) holds the group's
largest magnitude, and each element rounds to the nearest e2m1 value (ties away from zero is fine:
the loader only has to decode what is stored). Some groups are forced to edge cases a decoder must
get right: all zeros (scale 0), negative zero codes, the largest code (±6), and a scale far below 1.
"""
import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402
import make_hf_tiny  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize(w):
    """w: [E, out, in] float32 -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32])."""
    e, rows, cols = w.shape
    assert cols % 32 == 0, cols
    g = w.reshape(e, rows, cols // 32, 32)
    amax = g.abs().amax(dim=-1)
    # Smallest exponent with amax / 2^exp <= 6; an all-zero group gets the smallest scale.
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp).unsqueeze(-1)
    mag = scaled.abs().clamp(max=6.0)
    idx = (mag.unsqueeze(-1) - E2M1).abs().argmin(dim=-1)  # nearest magnitude code 0..7
    codes = idx | ((scaled < 0).to(torch.int64) << 3)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def force_edge_cases(blocks, scales):
    """Edge cases every decoder must handle, in expert 0's first rows."""
    blocks[0, 0, 0, :] = 0  # an all-zero group...
    scales[0, 0, 0] = 0  # ...with the smallest scale 2^-127
    blocks[0, 1, 0, :] = 0x88  # negative zeros
    blocks[0, 2, 0, :] = 0xF7  # +6 (low nibble) and -6 (high nibble)
    scales[0, 2, 0] = 127 + 3  # times 8
    scales[0, 3, 0] = 127 - 20  # a scale far below 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", help="golden fixtures folder (holds gpt_oss/)")
    args = ap.parse_args()
    src = os.path.join(args.dir, "gpt_oss")
    out = os.path.join(args.dir, "gpt_oss_mxfp4")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    written = {}
    quantized = []
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = quantize(t.transpose(1, 2).contiguous())
            if name.endswith("layers.0.mlp.experts.gate_up_proj"):
                force_edge_cases(blocks, scales)
            written[name + "_blocks"] = blocks
            written[name + "_scales"] = scales
            quantized.append(name)
        else:
            written[name] = t
    save_file(written, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, f), os.path.join(out, f))

    # What transformers holds after loading the folder (dequantized on the CPU).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    state = model.state_dict()
    reference = {name: state[name].to(torch.float32).contiguous() for name in quantized}
    for name in quantized:
        assert reference[name].shape == tensors[name].shape, (name, reference[name].shape, tensors[name].shape)
    save_file(reference, os.path.join(out, "dequantized.safetensors"), metadata={"format": "pt"})
    # The forward transformers runs on it: its float32 golden outputs.
    result = {
        "model": "gpt_oss_mxfp4",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "new_tokens": make_golden.NEW_TOKENS,
        "prompts": make_golden.run_model(out, make_hf_tiny.PROMPTS, model=model),
    }
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(result, f)
    err = max(float((reference[n] - tensors[n]).abs().max()) for n in quantized)
    print(f"gpt_oss_mxfp4: {len(quantized)} expert tensors quantized; max |dequantized - original| {err:.4f}; "
          f"smallest top-2 gaps {[round(p['greedy_min_gap'], 4) for p in result['prompts']]}")


if __name__ == "__main__":
    main()
