#!/usr/bin/env python3
"""Whole-model comparison of Baton (CUDA or CPU) against Hugging Face transformers.

Subcommands (torch + transformers; on the GPU machine, or on a CPU with --device cpu):

  make-1b DIR [--init-std S] [--seed N]
      A random model of Llama-3.2-1B shape (16 layers, hidden 2048, 32/8 heads, head_dim 64,
      vocab 128256, tied embeddings, llama3 RoPE scaling), saved with save_pretrained as bf16
      safetensors. Weights are drawn N(0, S) (transformers' own init with
      initializer_range = S); RMSNorm weights are 1.

  prompts VOCAB SEED OUT.json [--lengths 1,7,16,...] [--chat-tokenizer DIR]
      Deterministic random prompts (token ids below VOCAB) as a JSON list of lists. With
      --chat-tokenizer, a few fixed chat prompts, rendered with DIR's chat template and
      tokenized by DIR's tokenizer (a real model's text, where random ids are noise), follow.

  compare MODEL_DIR DUMP.json OUT.json [--near-tie T] [--device cuda|cpu] [--refs f32,bf16]
          [--round-weights auto|bf16|none]
      DUMP.json is what `greedy_dump run` wrote (greedy tokens and per-step top logits, plus
      DUMP.logits0.f32 with the full first-step logits). For every prompt, transformers runs the
      prompt followed by Baton's own tokens in one causal pass (teacher forcing), so at every
      step both saw the same prefix. Two references:
        f32  - float32 arithmetic on the weights Baton uses: rounded to bf16 for a CUDA dump
               (the CUDA backend stores bf16 weights), as they are for a CPU dump (the CPU
               backend computes in f32); --round-weights overrides;
        bf16 - transformers' native bf16 path (bf16 weights and activations, sdpa).
      Reported per prompt and reference: the first step where the reference's argmax differs
      from Baton's token, the reference's top-2 gap there (nats), whether that is a near tie
      (gap < T, default 0.05), the smallest top-2 gap over the matched steps, and the largest
      |logit difference| (full vocabulary at step 0; Baton's top-k ids at every matched step).
      --device picks where transformers runs; --refs which references (default both).

  prompt-logprobs MODEL_DIR PROMPTS.json OUT.json --url URL [--tol T] [--device cuda|cpu]
          [--refs f32,bf16] [--round-weights auto|bf16|none]
      Baton's prompt logprobs against transformers' teacher forcing. For every prompt of
      PROMPTS.json (what `prompts` wrote), asks the Baton server at URL (`baton serve --model
      MODEL_DIR ...`, already running) for `/v1/completions` with the ids as the prompt, `echo`,
      `logprobs: 1`, `max_tokens: 1` (lm-evaluation-harness's loglikelihood request), and
      compares `token_logprobs[i]` (i >= 1) with log_softmax(transformers' logits at i - 1)[id_i].
      --server-device says where the server computes (cuda: bf16 weights, cpu: the file's).
      Reported per prompt and reference: the largest |difference|, the difference of the sums
      (a loglikelihood), and pass (largest difference < T, default 0.02 nats; --round-weights
      auto rounds the f32 reference's weights to bf16 unless --server-device cpu).
"""
import argparse
import json
import math
import os
import random
import sys

import torch


def make_1b(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    import inspect

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # transformers v5 keeps RoPE settings in `rope_parameters`; v4 in rope_theta + rope_scaling.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        rope = {"rope_parameters": dict(scaling, rope_theta=500000.0)}
    else:
        rope = {"rope_theta": 500000.0, "rope_scaling": scaling}
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=args.init_std,
        bos_token_id=128000,
        eos_token_id=128001,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **rope,
    )
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(args.dir, safe_serialization=True)
    print(f"wrote {args.dir}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, init std {args.init_std}")


def prompts(args):
    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = [[rng.randrange(args.vocab) for _ in range(n)] for n in lengths]
    if args.chat_tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.chat_tokenizer)
        for q in CHAT_PROMPTS:
            msgs = [{"role": "user", "content": q}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            # transformers v5 returns a BatchEncoding here; v4 a plain list.
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            out.append([int(i) for i in ids])
    with open(args.out, "w") as f:
        json.dump(out, f)


# Fixed chat prompts for `prompts --chat-tokenizer` (plain questions a small instruct model
# answers with ordinary text, so greedy runs are not dominated by near ties).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
]


def load_ref(model_dir, kind, device, round_bf16):
    from transformers import AutoModelForCausalLM

    if kind == "f32":
        # float32 arithmetic on the weights Baton uses: for the CUDA backend those are the
        # file's values rounded to bf16 (a no-op for bf16 files).
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if round_bf16:
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(p.to(torch.bfloat16).to(torch.float32))
    else:
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return m.to(device).eval()


@torch.no_grad()
def compare(args):
    import transformers

    dump = json.load(open(args.dump))
    vocab = None
    base = os.path.splitext(args.dump)[0]
    logits0_path = base + ".logits0.f32"
    logits0 = torch.from_numpy(__import__("numpy").fromfile(logits0_path, dtype="<f4")) if os.path.exists(logits0_path) else None
    device = args.device
    round_bf16 = {"bf16": True, "none": False}.get(args.round_weights, dump.get("backend", "cuda") == "cuda")
    result = {
        "model": args.model,
        "baton_device": dump["device"],
        "baton_backend": dump.get("backend"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "reference_device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "f32_weights_rounded_to_bf16": round_bf16,
        "near_tie_nats": args.near_tie,
        "references": {},
    }
    for kind in args.refs.split(","):
        model = load_ref(args.model, kind, device, round_bf16)
        vocab = model.config.vocab_size
        rows = []
        for pi, p in enumerate(dump["prompts"]):
            prompt, toks, steps = p["prompt"], p["tokens"], p["steps"]
            n = len(toks)
            ids = torch.tensor([prompt + toks[:-1]], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].float()
            lsm = torch.log_softmax(logits, dim=-1)
            ref_arg = logits.argmax(dim=-1).tolist()
            first_div = next((t for t in range(n) if ref_arg[t] != toks[t]), None)
            top2 = lsm.topk(2, dim=-1).values
            gaps = (top2[:, 0] - top2[:, 1]).tolist()
            matched = n if first_div is None else first_div
            max_diff = 0.0
            max_lp_diff = 0.0
            for t in range(matched):
                for tid, bl in steps[t]["top"]:
                    max_diff = max(max_diff, abs(bl - logits[t, tid].item()))
                    max_lp_diff = max(max_lp_diff, abs((bl - steps[t]["lse"]) - lsm[t, tid].item()))
            full0 = None
            if logits0 is not None:
                b0 = logits0[pi * vocab : (pi + 1) * vocab].to(device)
                full0 = (b0 - logits[0]).abs().max().item()
                max_diff = max(max_diff, full0)
            row = {
                "prompt_len": len(prompt),
                "steps": n,
                "first_divergence": first_div,
                "min_top2_gap_matched": min(gaps[:matched]) if matched > 0 else None,
                "max_abs_logit_diff": max_diff,
                "max_abs_logprob_diff": max_lp_diff,
                "max_abs_logit_diff_step0_full_vocab": full0,
                "mean_top_logprob": sum(top2[:matched, 0].tolist()) / max(matched, 1),
            }
            if first_div is not None:
                t = first_div
                g_ref = gaps[t]
                # How much the reference prefers its own choice over Baton's token.
                pref = (lsm[t, ref_arg[t]] - lsm[t, toks[t]]).item()
                row.update(
                    {
                        "ref_token": ref_arg[t],
                        "baton_token": toks[t],
                        "ref_top2_gap": g_ref,
                        "ref_pref_over_baton": pref,
                        "near_tie": pref < args.near_tie,
                    }
                )
            rows.append(row)
        ok = all(r["first_divergence"] is None or r["near_tie"] for r in rows)
        result["references"][kind] = {
            "prompts": rows,
            "identical": sum(r["first_divergence"] is None for r in rows),
            "pass": ok,
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        }
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    name = os.path.basename(os.path.normpath(args.model))
    if dump.get("backend", "cuda") != "cuda":
        name += f"[{dump['backend']}]"
    for kind, r in result["references"].items():
        divs = [
            f"p{i}@{x['first_divergence']}(gap {x['ref_pref_over_baton']:.3f}{' tie' if x['near_tie'] else ' FAIL'})"
            for i, x in enumerate(r["prompts"])
            if x["first_divergence"] is not None
        ]
        min_gap = min((x["min_top2_gap_matched"] for x in r["prompts"] if x["min_top2_gap_matched"] is not None), default=float("nan"))
        print(
            f"{name:14} vs HF {kind:4}: {r['identical']}/{len(r['prompts'])} identical over {dump['steps']} tokens,"
            f" max|dlogit| {r['max_abs_logit_diff']:.4f}, min matched top2 gap {min_gap:.3f}"
            f" {'PASS' if r['pass'] else 'FAIL'} {' '.join(divs)}"
        )
    return 0 if all(r["pass"] for r in result["references"].values()) else 1


def http_json(url, body):
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


@torch.no_grad()
def prompt_logprobs(args):
    import urllib.request

    import transformers

    base = args.url.rstrip("/")
    served = json.load(urllib.request.urlopen(base + "/v1/models", timeout=60))["data"][0]["id"]
    prompts = json.load(open(args.prompts))
    baton = []
    for ids in prompts:
        body = {"model": served, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        lp = http_json(base + "/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
        if len(lp) != len(ids) + 1 or lp[0] is not None:
            raise SystemExit(f"malformed echo logprobs for a prompt of {len(ids)} tokens: {lp[:3]}...")
        baton.append(lp[1 : len(ids)])
    # Which weights Baton computes with: bf16 on CUDA, the file's on the CPU.
    round_bf16 = {"auto": "cpu" not in args.server_device, "bf16": True, "none": False}[args.round_weights]
    result = {"model": args.model, "transformers": transformers.__version__, "torch": torch.__version__, "references": {}}
    for kind in args.refs.split(","):
        m = load_ref(args.model, kind, args.device, round_bf16 and kind == "f32")
        rows = []
        for ids, got in zip(prompts, baton):
            if len(ids) < 2:
                continue
            x = torch.tensor([ids], device=args.device)
            logp = torch.log_softmax(m(x).logits[0].float(), dim=-1)
            want = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
            diffs = [abs(a - b) for a, b in zip(got, want)]
            rows.append(
                {
                    "len": len(ids),
                    "max_abs_diff": max(diffs),
                    "sum_diff": sum(got) - sum(want),
                    "pass": max(diffs) < args.tol,
                }
            )
        result["references"][kind] = {"prompts": rows, "pass": all(r["pass"] for r in rows)}
        worst = max((r["max_abs_diff"] for r in rows), default=0.0)
        print(f"{kind}: {len(rows)} prompts, worst |diff| {worst:.3e}, pass {result['references'][kind]['pass']}")
    json.dump(result, open(args.out, "w"), indent=1)
    return 0 if all(r["pass"] for r in result["references"].values()) else 1


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("make-1b")
    a.add_argument("dir")
    a.add_argument("--init-std", type=float, default=0.02)
    a.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("prompts")
    a.add_argument("vocab", type=int)
    a.add_argument("seed", type=int)
    a.add_argument("out")
    a.add_argument("--lengths", default="1,7,16,17,40,100")
    a.add_argument("--chat-tokenizer", default=None)
    a = sub.add_parser("compare")
    a.add_argument("model")
    a.add_argument("dump")
    a.add_argument("out")
    a.add_argument("--near-tie", type=float, default=0.05)
    a.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a.add_argument("--refs", default="f32,bf16")
    a.add_argument("--round-weights", default="auto", choices=["auto", "bf16", "none"])
    a = sub.add_parser("prompt-logprobs")
    a.add_argument("model")
    a.add_argument("prompts")
    a.add_argument("out")
    a.add_argument("--url", required=True)
    a.add_argument("--server-device", default="cuda", help="the device the server runs on (cuda or cpu)")
    a.add_argument("--tol", type=float, default=0.02)
    a.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a.add_argument("--refs", default="f32,bf16")
    a.add_argument("--round-weights", default="auto", choices=["auto", "bf16", "none"])
    args = ap.parse_args()
    if args.cmd == "make-1b":
        make_1b(args)
    elif args.cmd == "prompts":
        prompts(args)
    elif args.cmd == "prompt-logprobs":
        sys.exit(prompt_logprobs(args))
    else:
        sys.exit(compare(args))


if __name__ == "__main__":
    main()
