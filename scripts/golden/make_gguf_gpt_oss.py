#!/usr/bin/env python3
"""gpt-oss GGUF fixtures, written the way llama.cpp's converter writes gpt-oss checkpoints.

Baton's GGUF reader maps llama.cpp's gpt-oss layout back onto the HF one. No llama.cpp-written
gpt-oss file is available here, so this script converts the golden gpt-oss checkpoints
(`engine/formats/tests/fixtures/golden/{gpt_oss,gpt_oss_mxfp4}`, written by transformers) with
llama.cpp's own Python package, `gguf` (PyPI; its writer, its tensor-name map for the
`gpt-oss` architecture, its MXFP4 block type), following `GptOssModel` in llama.cpp's
`convert_hf_to_gguf.py` step for step (read, not copied):

- names through `gguf.TensorNameMap(MODEL_ARCH.GPT_OSS)`, `self_attn.sinks` given a `.weight`
  suffix first (the converter's `filter_tensors`);
- MXFP4 experts repacked, not re-quantized: each block's scale byte first, then its 16 code
  bytes with the nibbles reordered from the checkpoint's pairs (2j, 2j+1) to ggml's halves
  (j, j+16) (`transform_nibble_layout`); the fused `gate_up_proj` rows split into gate (even)
  and up (odd);
- float experts transposed to `[E, out, in]`, gate/up split likewise, or with
  `--fuse-gate-up-exps` concatenated (gate rows, then up rows) as `ffn_gate_up_exps`;
- the converter's metadata keys (YaRN's factor, original context and betas, the window, the
  expert width); float tensors as F32 (`--outtype f32`).

The tokenizer is the fixture's own (a byte-level BPE that splits digits, llama.cpp's
`smollm` pre-tokenizer), so the file loads whole.

Usage: make_gguf_gpt_oss.py [OUT_DIR]   (default engine/formats/tests/fixtures/gguf)
Writes gpt_oss_mxfp4.gguf (split gate/up, MXFP4) and gpt_oss_fused_f32.gguf (fused, F32).
Needs numpy and gguf (pip install gguf).
"""

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "engine/formats/tests/fixtures/golden"


def read_safetensors(path):
    """name -> numpy array (F32 and U8 only: what the fixtures hold)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = {"F32": np.float32, "U8": np.uint8}[info["dtype"]]
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(body[a:b], dtype=dtype).reshape(info["shape"]).copy()
    return out


def ggml_nibbles(blocks):
    """Checkpoint MXFP4 codes (byte j: element 2j low, 2j+1 high) -> ggml's (byte j: element j
    low, element j + 16 high), over the last axis of 16 bytes."""
    lo = blocks & 0x0F
    hi = blocks >> 4
    elems = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    return (elems[..., :16] | (elems[..., 16:] << 4)).astype(np.uint8)


def repack_mxfp4(blocks, scales):
    """[E, rows, G, 16] codes and [E, rows, G] scales -> ggml MXFP4 bytes [E, rows, G * 17]."""
    packed = np.concatenate([scales[..., None], ggml_nibbles(blocks)], axis=-1)
    return packed.reshape(*packed.shape[:2], -1)


def convert(name, out_path, fuse):
    src = GOLDEN / name
    cfg = json.loads((src / "config.json").read_text())
    tensors = read_safetensors(src / "model.safetensors")
    n_layers = cfg["num_hidden_layers"]
    arch = gguf.MODEL_ARCH.GPT_OSS
    names = gguf.TensorNameMap(arch, n_layers)
    w = gguf.GGUFWriter(str(out_path), gguf.MODEL_ARCH_NAMES[arch])

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta")))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])

    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for piece, i in vocab.items():
        tokens[i] = piece
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])

    def put(hf_name, array):
        key = hf_name + ".weight" if hf_name.endswith("sinks") else hf_name
        g = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        w.add_tensor(g, np.ascontiguousarray(array, dtype=np.float32))

    def put_raw(g, array, dtype=None):
        if dtype is None:
            w.add_tensor(g, np.ascontiguousarray(array, dtype=np.float32))
        else:
            w.add_tensor(g, np.ascontiguousarray(array), raw_dtype=dtype)

    for hf_name in sorted(tensors):
        t = tensors[hf_name]
        if ".mlp.experts." not in hf_name:
            put(hf_name, t)
            continue
        layer = int(hf_name.split(".")[2])
        base = f"blk.{layer}"
        leaf = hf_name.rsplit(".", 1)[1]
        if leaf == "gate_up_proj_blocks":
            scales = tensors[hf_name.replace("_blocks", "_scales")]
            put_raw(f"{base}.ffn_gate_exps.weight", repack_mxfp4(t[:, ::2], scales[:, ::2]), gguf.GGMLQuantizationType.MXFP4)
            put_raw(f"{base}.ffn_up_exps.weight", repack_mxfp4(t[:, 1::2], scales[:, 1::2]), gguf.GGMLQuantizationType.MXFP4)
        elif leaf == "down_proj_blocks":
            scales = tensors[hf_name.replace("_blocks", "_scales")]
            put_raw(f"{base}.ffn_down_exps.weight", repack_mxfp4(t, scales), gguf.GGMLQuantizationType.MXFP4)
        elif leaf.endswith("_scales"):
            continue
        elif leaf == "gate_up_proj":
            # [E, hidden, 2·inter] -> [E, 2·inter, hidden]; gate rows even, up rows odd.
            tt = np.swapaxes(t, -1, -2)
            gate, up = tt[:, ::2], tt[:, 1::2]
            if fuse:
                put_raw(f"{base}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1))
            else:
                put_raw(f"{base}.ffn_gate_exps.weight", gate)
                put_raw(f"{base}.ffn_up_exps.weight", up)
        elif leaf == "gate_up_proj_bias":
            gate, up = t[..., ::2], t[..., 1::2]
            if fuse:
                put_raw(f"{base}.ffn_gate_up_exps.bias", np.concatenate([gate, up], axis=-1))
            else:
                put_raw(f"{base}.ffn_gate_exps.bias", gate)
                put_raw(f"{base}.ffn_up_exps.bias", up)
        elif leaf == "down_proj":
            put_raw(f"{base}.ffn_down_exps.weight", np.swapaxes(t, -1, -2))
        elif leaf == "down_proj_bias":
            put_raw(f"{base}.ffn_down_exps.bias", t)
        else:
            raise ValueError(f"unexpected expert tensor {hf_name}")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out_path} ({out_path.stat().st_size} bytes)")


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "engine/formats/tests/fixtures/gguf"
    out.mkdir(parents=True, exist_ok=True)
    convert("gpt_oss_mxfp4", out / "gpt_oss_mxfp4.gguf", fuse=False)
    convert("gpt_oss", out / "gpt_oss_fused_f32.gguf", fuse=True)


if __name__ == "__main__":
    main()
