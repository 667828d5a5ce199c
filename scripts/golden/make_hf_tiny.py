#!/usr/bin/env python3
"""Tiny random checkpoints of the new architectures, written by transformers itself, with golden outputs.

Usage (on a machine with torch + transformers; CPU float32 is enough, ~1 minute):
    python3 scripts/golden/make_hf_tiny.py engine/formats/tests/fixtures/golden [--only qwen3,gemma2]

Unlike the llama/qwen2/tied fixtures (whose weights Baton's own `write_tiny_models` writes), these
folders are written by transformers' `save_pretrained` from a config built here, so the config
keys, tensor names and shapes are exactly what transformers produces for that architecture
(transformers 5 writes `rope_parameters`, not the legacy `rope_theta`/`rope_scaling` keys). For each
fixture DIR/<name>/ gets:

    config.json, generation_config.json, model.safetensors (float32)   <- save_pretrained
    tokenizer.json, tokenizer_config.json                              <- copied from DIR/llama/
    golden.json        transformers in float32 (the format of make_golden.py, 6 prompts)
    golden_bf16.json   the same prompts through transformers' native bfloat16 path (dtype=bfloat16)

Every fixture uses vocab 288 (the test tokenizer), hidden 64, enough layers that each layer type
occurs, and head_dim != hidden / heads where the architecture has a head_dim key. Sliding windows
are 16 tokens and two prompts (40 and 64 tokens) are longer than that. transformers' window
convention: query i sees keys j with i - window < j <= i (the window counts the query itself).

Weights: every matrix N(0, 0.08) (like write_tiny_models), MoE routers N(0, 0.5) so that routing is
decisive, gpt-oss sinks N(0, 1), and every norm weight its default (1, or 0 for Gemma's `1 + w`
norms) plus N(0, 0.05), so a loader that adds or forgets the `1 +` is caught. Soft-capping values
are small enough that tanh bends the logits (the defaults, 50 and 30, would be linear here).
Each fixture takes the first of a fixed list of seeds whose float32 greedy runs have no near tie
(top-2 gap >= 2e-3 at every step), so rerunning rewrites the same weights on the same torch version;
golden.json records the seed. golden.json also carries "seed" and "dtype" keys beyond make_golden's.
"""
import argparse
import json
import os
import random
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402  (sibling script: the golden.json computation and format)

VOCAB = 288
WINDOW = 16
# The four prompts of make_golden.py plus two longer than the window (ids 3..287, fixed seed).
_rng = random.Random(15)
PROMPTS = make_golden.PROMPTS + [[1] + [_rng.randrange(3, VOCAB) for _ in range(n - 1)] for n in (40, 64)]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, bos_token_id=0, eos_token_id=2, pad_token_id=None,
              max_position_embeddings=512, initializer_range=0.08)
# Phi-3 longrope switches from short_factor to long_factor once the sequence is longer than
# original_max_position_embeddings (transformers: per forward, on max position + 1). 36 keeps the
# four short prompts and their 16 greedy tokens (at most 20 + 15 positions) on the short factors and
# puts the 40- and 64-token prompts on the long ones from their first token, so no run crosses over
# (where a KV cache and transformers' no-cache recompute would legitimately differ).
PHI3_ORIGINAL_MAX = 36


def mistral_window():
    # Every layer slides (Mistral's sliding_window), so the 40- and 64-token prompts and their
    # greedy tokens attend past the 16-token window: a full-attention implementation fails them.
    return transformers.MistralConfig(
        **COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def _factors(n, lo, hi, seed):
    r = random.Random(seed)
    return [round(r.uniform(lo, hi), 4) for _ in range(n)]


def qwen3(tied):
    return transformers.Qwen3Config(
        **COMMON, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def qwen3_moe():
    # Layers: 0 dense ((0+1) % 2 != 0), 1 sparse, 2 dense, 3 dense (in mlp_only_layers).
    return transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=2, mlp_only_layers=[3], rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def mixtral():
    return transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def gemma2():
    # layer_types default: sliding, full, sliding, full.
    return transformers.Gemma2Config(
        **COMMON, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def gemma3_text():
    # layer_types default (pattern 6): five sliding layers, then one full. Local layers use their own
    # rope base; the global one a different base with linear scaling (as Gemma 3 4B and larger).
    return transformers.Gemma3TextConfig(
        **COMMON, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})


def phi3(partial_rotary_factor, tied):
    common = dict(COMMON, max_position_embeddings=4 * PHI3_ORIGINAL_MAX)
    heads = 4
    rot_half = int(64 // heads * partial_rotary_factor) // 2
    return transformers.Phi3Config(
        **common, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
        original_max_position_embeddings=PHI3_ORIGINAL_MAX, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                         "partial_rotary_factor": partial_rotary_factor,
                         "short_factor": _factors(rot_half, 1.0, 1.5, 1),
                         "long_factor": _factors(rot_half, 1.0, 8.0, 2)})


def gpt_oss():
    # layer_types default: sliding, full. YaRN rope (the config's default), attention sinks, biases.
    # max_position_embeddings as the real model's, so YaRN's factor (32) and original length (4096) agree.
    common = dict(COMMON, max_position_embeddings=131_072)
    return transformers.GptOssConfig(
        **common, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, rms_norm_eps=1e-5,
        tie_word_embeddings=False)


FIXTURES = {
    "qwen3": lambda: qwen3(tied=False),
    "qwen3_tied": lambda: qwen3(tied=True),
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
    "gemma2": gemma2,
    "gemma3_text": gemma3_text,
    "phi3": lambda: phi3(1.0, tied=False),
    "phi4_mini": lambda: phi3(0.75, tied=True),
    "gpt_oss": gpt_oss,
    "mistral_window": mistral_window,
}
MAX_SAFETENSORS_BYTES = 1 << 20
MIN_GREEDY_GAP = 2e-3
SEED_ATTEMPTS = 30


@torch.no_grad()
def randomize(model, seed):
    """Deterministic weights with visible structure (see the module docstring)."""
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.normal_(0.0, 1.0)
        elif name.endswith(("mlp.gate.weight", "router.weight")):
            p.normal_(0.0, 0.5)
        elif "norm" in name and p.dim() == 1:
            base = float(p.mean())  # 1.0, or 0.0 for Gemma's (1 + w) norms
            p.normal_(0.0, 0.05).add_(base)
        else:
            p.normal_(0.0, 0.08)


def write_fixture(root, name, seed):
    cfg = FIXTURES[name]()
    cfg.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    out = os.path.join(root, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(root, "llama", f), os.path.join(out, f))
    st = os.path.join(out, "model.safetensors")
    size = os.path.getsize(st)
    if size > MAX_SAFETENSORS_BYTES:
        sys.exit(f"{name}: model.safetensors is {size} bytes, over {MAX_SAFETENSORS_BYTES}; shrink the config")
    # The checkpoint must reload to the same tensors (save_pretrained may rename or convert).
    saved = load_file(st)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in reloaded.state_dict().items():
        if k in saved:
            assert torch.equal(saved[k], v), f"{name}: {k} did not reload identically"
    return out, size, sorted(saved)


def write_golden(out, name, seed, dtype, file_name):
    result = {
        "model": name,
        "seed": seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "new_tokens": make_golden.NEW_TOKENS,
        "prompts": make_golden.run_model(out, PROMPTS, dtype=dtype),
    }
    with open(os.path.join(out, file_name), "w") as f:
        json.dump(result, f)
    return [p["greedy_min_gap"] for p in result["prompts"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", help="golden fixtures folder (holds llama/ with the test tokenizer)")
    ap.add_argument("--only", help="comma-separated fixture names (default: all)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(FIXTURES)
    for n in names:
        if n not in FIXTURES:
            sys.exit(f"unknown fixture {n}; known: {', '.join(FIXTURES)}")
    for i, name in enumerate(FIXTURES):
        if name not in names:
            continue
        # The first seed whose float32 greedy runs have no near tie, so that token-for-token
        # comparisons are meaningful (deterministic: the same seeds are tried in the same order).
        for attempt in range(SEED_ATTEMPTS):
            seed = 1000 + i + 100 * attempt
            out, size, tensors = write_fixture(args.dir, name, seed)
            gaps32 = write_golden(out, name, seed, torch.float32, "golden.json")
            if min(gaps32) >= MIN_GREEDY_GAP:
                break
        else:
            sys.exit(f"{name}: no seed in {SEED_ATTEMPTS} attempts gives greedy gaps >= {MIN_GREEDY_GAP}")
        gaps16 = write_golden(out, name, seed, torch.bfloat16, "golden_bf16.json")
        print(f"{name}: seed {seed}, {size} bytes, {len(tensors)} tensors; smallest top-2 gaps "
              f"f32 {[round(g, 4) for g in gaps32]} bf16 {[round(g, 4) for g in gaps16]}")


if __name__ == "__main__":
    main()
