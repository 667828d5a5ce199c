#!/usr/bin/env python3
"""Reference outputs for Baton's tiny golden models, computed with Hugging Face transformers.

Usage (on a machine with torch + transformers; CPU float32 is enough):
    python3 scripts/golden/make_golden.py engine/formats/tests/fixtures/golden

For every model folder DIR/<name>/ (config.json + model.safetensors + tokenizer files, written by
`cargo run -p baton-formats --example write_tiny_models -- DIR`), writes DIR/<name>/golden.json:

    {"model": name, "transformers": version, "torch": version,
     "prompts": [{"ids": [...], "last_logits": [vocab floats], "greedy": [16 ids]}, ...]}

`last_logits` are the logits at the last prompt position; `greedy` are 16 tokens chosen by argmax
with a full forward pass per step (no KV cache, no eos stopping), so they only depend on the
model's math. Optional: --smollm-gguf FILE also dumps token ids of the default GGUF model's
tokenizer (transformers' GGUF support; needs the `gguf` pip package) to DIR/smollm2_tokens.json.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

# Token ids (all < 288, the golden vocab size). Mixed lengths, repeated ids, specials (0, 1, 2).
PROMPTS = [
    [1, 72, 101, 108, 108, 111],
    [5, 17, 200, 201, 202, 99, 42, 7, 7, 7, 260, 270, 280],
    [0],
    [1, 12, 150, 33, 2, 1, 120, 64, 64, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
]
NEW_TOKENS = 16

# Mixed-script texts for the optional tokenizer dump (same spirit as the Rust tests).
TEXTS = [
    "Hello world! The quick brown fox.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "numbers 1234567890 3.14159 1,000,000 and 2024-11-21",
    "你好，世界！今天天气很好。",
    "こんにちは世界 안녕하세요",
    "Привет, мир! Café naïve résumé",
    "emoji 😀🚀🎉 👍🏽 ❤️ family 👨‍👩‍👧",
    "fn main() { println!(\"hi\"); }    // comment",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's YOU'RE and we've I'D",
]


@torch.no_grad()
def run_model(model_dir, prompts=PROMPTS, dtype=torch.float32, model=None):
    """`model`: one already loaded (e.g. with a quantization config); else loaded from `model_dir`."""
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    vocab = model.config.vocab_size
    out = []
    for ids in prompts:
        assert all(0 <= i < vocab for i in ids), f"prompt id out of range for {model_dir}"
        x = torch.tensor([ids], dtype=torch.long)
        logits = model(input_ids=x, use_cache=False).logits[0, -1].float()
        # 9 significant digits round-trip float32 exactly and keep the fixtures small.
        last = [float(f"{v:.9g}") for v in logits.tolist()]
        seq = list(ids)
        greedy = []
        min_gap = float("inf")
        for _ in range(NEW_TOKENS):
            step = model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False).logits[0, -1].float()
            t2 = torch.topk(step, 2).values.tolist()
            min_gap = min(min_gap, t2[0] - t2[1])
            nxt = int(torch.argmax(step).item())
            greedy.append(nxt)
            seq.append(nxt)
        top2 = torch.topk(logits, 2).values.tolist()
        out.append({"ids": ids, "last_logits": last, "greedy": greedy, "top2_gap": top2[0] - top2[1],
                    "greedy_min_gap": min_gap})
    return out


def dump_smollm_tokens(gguf_path, out_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    rows = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TEXTS]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"model": os.path.basename(gguf_path), "transformers": transformers.__version__, "texts": rows},
                  f, ensure_ascii=False, indent=1)
    print(f"wrote {out_path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", help="folder holding the tiny model folders")
    ap.add_argument("--smollm-gguf", help="optional: default model GGUF to dump tokenizer ids for")
    args = ap.parse_args()
    torch.manual_seed(0)
    # Folders written by make_hf_tiny.py (transformers checkpoints) get their goldens from that script.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_hf_tiny import FIXTURES as HF_TINY

    names = sorted(n for n in os.listdir(args.dir)
                   if n not in HF_TINY and os.path.isfile(os.path.join(args.dir, n, "config.json")))
    if not names:
        sys.exit(f"no model folders (with config.json) under {args.dir}")
    for name in names:
        model_dir = os.path.join(args.dir, name)
        result = {
            "model": name,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "new_tokens": NEW_TOKENS,
            "prompts": run_model(model_dir),
        }
        path = os.path.join(model_dir, "golden.json")
        with open(path, "w") as f:
            json.dump(result, f)
        gaps = [round(p["greedy_min_gap"], 5) for p in result["prompts"]]
        print(f"wrote {path} (smallest top-2 logit gap along each greedy run: {gaps})")
    if args.smollm_gguf:
        dump_smollm_tokens(args.smollm_gguf, os.path.join(args.dir, "smollm2_tokens.json"))


if __name__ == "__main__":
    main()
