//! Maps a llama.cpp GGUF model onto Baton's HF view: hyperparameters → [`ModelConfig`],
//! tensor names → HF names, quantized tensors → f32, and llama.cpp's RoPE row permutation
//! of Q/K (applied to `llama`-architecture files only; `qwen2`/`qwen3` files keep HF order) undone.
//!
//! Mixture-of-experts files as llama.cpp's converter writes them: `qwen3moe` (Qwen3-MoE) and
//! `llama` with `llama.expert_count` (Mixtral) here, `gpt-oss` in `gpt_oss.rs`. Each MoE layer holds its router
//! (`blk.N.ffn_gate_inp`) and its experts stacked in one 3-D tensor per projection
//! (`blk.N.ffn_{gate,up,down}_exps`, `[experts, out, in]` in HF order), which this store serves
//! as the per-expert HF tensors the engine loads (views into the mapped file for plain floats).
//! A layer without a router is dense (`mlp_only_layers`). Routing is a softmax over the
//! experts, renormalised over the chosen ones unless `{arch}.expert_weights_norm` says false
//! (llama.cpp's `qwen3moe` always renormalises); shared experts, a gating function other than
//! softmax and a routed scaling factor other than 1 are refused by name.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::gpt_oss::{ExpertJob, build_expert, expert_job};
use super::quant::dequantize;
use super::reader::{GgufFile, GgufTensorInfo, GgufType, GgufValue, ggml_type_name};
use crate::config::{
    Architecture, ExpertProj, GemmaOptions, GptOssOptions, LayerType, LongRope, ModelConfig, MoeConfig, RopeParameters,
    RopeScaling, llama3_rope_divisors,
};
use crate::error::FormatError;
use crate::tensor::{DType, TensorView, WeightStore, f32_to_bytes};

/// The HF name of a GGUF tensor name, if it is one the model uses.
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = tail.rsplit_once('.')?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The per-layer tensors whose GGUF names in a file of `architecture` differ from the shared
/// layout of [`gguf_to_hf_name`]: (name after `blk.N.`, name after `model.layers.N.`), read both
/// ways by [`gguf_to_hf_name_for`] and [`hf_to_gguf_name_for`].
fn layer_renames(architecture: Architecture) -> &'static [(&'static str, &'static str)] {
    match architecture {
        // llama.cpp's Phi-3 files keep the checkpoint's fused projections.
        Architecture::Phi3 => {
            &[("attn_qkv.weight", "self_attn.qkv_proj.weight"), ("ffn_up.weight", "mlp.gate_up_proj.weight")]
        }
        // Gemma files put the pre-feedforward norm in `ffn_norm` and add two post norms.
        Architecture::Gemma2 | Architecture::Gemma3Text => &[
            ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
            ("post_attention_norm.weight", "post_attention_layernorm.weight"),
            ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
        ],
        // gpt-oss files rename their sinks, router bias, down bias and post-attention norm (its
        // experts are reshaped in `gpt_oss.rs`).
        Architecture::GptOss => &[
            ("post_attention_norm.weight", "post_attention_layernorm.weight"),
            ("attn_sinks.weight", "self_attn.sinks"),
            ("ffn_gate_inp.bias", "mlp.router.bias"),
            ("ffn_down_exps.bias", "mlp.experts.down_proj_bias"),
        ],
        _ => &[],
    }
}

/// `name` with prefix `from` and a layer number, renamed through `pairs` (`(from tail, to tail)`)
/// under prefix `to`.
fn rename_layer_tensor<'a>(
    name: &str,
    from: &str,
    to: &str,
    pairs: impl Iterator<Item = (&'a str, &'a str)>,
) -> Option<String> {
    let (layer, tail) = name.strip_prefix(from)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, renamed) = pairs.into_iter().find(|(f, _)| *f == tail)?;
    Some(format!("{to}{layer}.{renamed}"))
}

/// The HF name of a GGUF tensor name in a file of `architecture`: its family's
/// [`layer_renames`], else [`gguf_to_hf_name`].
pub fn gguf_to_hf_name_for(name: &str, architecture: Architecture) -> Option<String> {
    let pairs = layer_renames(architecture).iter().copied();
    rename_layer_tensor(name, "blk.", "model.layers.", pairs).or_else(|| gguf_to_hf_name(name))
}

/// The GGUF name of a HF tensor name in a file of `architecture` (inverse of
/// [`gguf_to_hf_name_for`]).
pub fn hf_to_gguf_name_for(name: &str, architecture: Architecture) -> Option<String> {
    let pairs = layer_renames(architecture).iter().map(|&(g, h)| (h, g));
    rename_layer_tensor(name, "model.layers.", "blk.", pairs).or_else(|| hf_to_gguf_name(name))
}

/// The GGUF name of a HF tensor name (inverse of [`gguf_to_hf_name`]).
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let (module, suffix) = tail.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// The head count llama.cpp's converter interleaved the rows of HF tensor `hf_name` by, in a
/// file of `config`'s family ([`permute_qk_rows`]): the Q and K projections of
/// `llama`-architecture files (Llama, Mistral, Mixtral); None for every other tensor and family.
pub fn qk_permute_heads(config: &ModelConfig, hf_name: &str) -> Option<usize> {
    if !matches!(config.architecture, Architecture::Llama | Architecture::Mistral | Architecture::Mixtral) {
        return None;
    }
    if hf_name.contains(".q_proj.") {
        Some(config.num_attention_heads)
    } else if hf_name.contains(".k_proj.") {
        Some(config.num_key_value_heads)
    } else {
        None
    }
}

/// Reorders the rows of a Q or K projection between HF order and llama.cpp's interleaved
/// RoPE order. Within each head of `rows / n_head` rows, HF keeps the two rotary halves
/// apart (row `half·hd/2 + i`) while llama.cpp interleaves them (row `2i + half`).
/// `to_gguf` selects the direction. `bytes` is `rows` equal-sized rows.
pub fn permute_qk_rows(bytes: &[u8], rows: usize, n_head: usize, to_gguf: bool) -> Option<Vec<u8>> {
    if rows == 0
        || n_head == 0
        || !rows.is_multiple_of(n_head)
        || !(rows / n_head).is_multiple_of(2)
        || !bytes.len().is_multiple_of(rows)
    {
        return None;
    }
    let hd = rows / n_head;
    let rb = bytes.len() / rows;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for half in 0..2 {
                let g = h * hd + 2 * i + half;
                let f = h * hd + half * (hd / 2) + i;
                let (src, dst) = if to_gguf { (f, g) } else { (g, f) };
                out[dst * rb..(dst + 1) * rb].copy_from_slice(&bytes[src * rb..(src + 1) * rb]);
            }
        }
    }
    Some(out)
}

/// Reads the model hyperparameters from GGUF metadata.
pub fn gguf_config(g: &GgufFile) -> Result<ModelConfig, FormatError> {
    let path = &g.path;
    let arch_name = g
        .get("general.architecture")
        .and_then(GgufValue::as_str)
        .ok_or_else(|| FormatError::gguf(path, "missing general.architecture"))?;
    let experts = g.get(&format!("{arch_name}.expert_count")).and_then(GgufValue::as_u64).filter(|&n| n > 0);
    // Only the families whose GGUF tensor layout is mapped (those with a `gguf_name`, and
    // Mistral and Mixtral, which llama.cpp writes as `llama`) load from GGUF.
    let architecture = match (experts, arch_name) {
        (Some(_), "qwen3moe") => Architecture::Qwen3Moe,
        (Some(_), "llama") => Architecture::Mixtral,
        (Some(_), "gpt-oss") => Architecture::GptOss,
        (Some(n), _) => {
            return Err(FormatError::unsupported(
                path,
                format!(
                    "mixture-of-experts GGUF ({arch_name}.expert_count {n}): Baton maps the expert layout of \
                     `qwen3moe`, `llama` (Mixtral) and `gpt-oss` files only; load the Hugging Face safetensors checkpoint instead"
                ),
            ));
        }
        (None, "qwen3moe" | "gpt-oss") => {
            return Err(FormatError::gguf(path, format!("missing metadata {arch_name}.expert_count")));
        }
        (None, _) => Architecture::from_name(arch_name)
            .filter(|a| a.gguf_name().is_some() || *a == Architecture::Mistral)
            .ok_or_else(|| FormatError::UnsupportedArchitecture { path: path.clone(), name: arch_name.to_string() })?,
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let num = |k: &str| g.get(&key(k)).and_then(GgufValue::as_u64).map(|v| v as usize);
    let req = |k: &str| num(k).ok_or_else(|| FormatError::gguf(path, format!("missing metadata {}", key(k))));
    let hidden_size = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    if heads == 0 {
        return Err(FormatError::config(path, "attention.head_count must be positive"));
    }
    let head_dim = num("attention.key_length").unwrap_or(hidden_size / heads);
    let tokens_len = g.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array).map(<[GgufValue]>::len);
    let embd_rows = g.tensor("token_embd.weight").and_then(|t| t.dims.get(1)).map(|&d| d as usize);
    let vocab_size = num("vocab_size")
        .or(embd_rows)
        .or(tokens_len)
        .ok_or_else(|| FormatError::gguf(path, "cannot determine the vocabulary size"))?;
    let rope_theta = g.get(&key("rope.freq_base")).and_then(GgufValue::as_f64).unwrap_or(10000.0) as f32;
    let mut rope_scaling = match g.get(&key("rope.scaling.type")).and_then(GgufValue::as_str) {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling::Linear {
            factor: g
                .get(&key("rope.scaling.factor"))
                .and_then(GgufValue::as_f64)
                .ok_or_else(|| FormatError::gguf(path, "linear rope scaling without rope.scaling.factor"))?
                as f32,
        }),
        Some("yarn") => Some(gguf_yarn(g, arch_name, architecture)?),
        Some(other) => return Err(FormatError::unsupported(path, format!("rope scaling type {other:?}"))),
    };
    let max_position_embeddings = num("context_length").unwrap_or(2048);
    if let Some(t) = g.tensor("rope_freqs.weight") {
        let ty = GgufType::from_id(t.ggml_type)
            .ok_or_else(|| FormatError::unsupported(path, "rope_freqs.weight has an unsupported type"))?;
        let divisors = dequantize(ty, g.tensor_bytes(t, ty)?);
        rope_scaling =
            Some(fit_llama3(&divisors, rope_theta, head_dim).ok_or_else(|| {
                FormatError::unsupported(path, "rope_freqs.weight does not match Llama 3 rope scaling")
            })?);
    }
    let id = |k: &str| g.get(k).and_then(GgufValue::as_u64).map(|v| v as u32);
    let mut eos_token_ids = Vec::new();
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(v) = id(k).filter(|v| !eos_token_ids.contains(v)) {
            eos_token_ids.push(v);
        }
    }
    let moe = match experts {
        Some(n) => Some(gguf_moe(g, arch_name, architecture, n as usize)?),
        None => None,
    };
    let blocks = req("block_count")?;
    let phi3 = architecture == Architecture::Phi3;
    // Phi-3: the rotary share (`rope.dimension_count` rotary dims of each head) and LongRoPE's
    // factor lists as tensors.
    let rotary_dims = num("rope.dimension_count").filter(|_| phi3).unwrap_or(head_dim);
    let longrope = if phi3 { gguf_longrope(g, arch_name, max_position_embeddings)? } else { None };
    let full_rope = RopeParameters { theta: rope_theta, scaling: rope_scaling };
    let layout = gguf_layers(g, arch_name, architecture, blocks, full_rope);
    let gemma =
        architecture.is_gemma().then(|| gguf_gemma(g, arch_name, architecture, blocks, hidden_size / heads, head_dim));
    let cfg = ModelConfig {
        architecture,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: num("attention.head_count_kv").unwrap_or(heads),
        head_dim,
        vocab_size,
        rms_norm_eps: g.get(&key("attention.layer_norm_rms_epsilon")).and_then(GgufValue::as_f64).unwrap_or(1e-5)
            as f32,
        rope_theta,
        rope_scaling,
        longrope,
        partial_rotary_factor: rotary_dims as f32 / head_dim as f32,
        max_position_embeddings,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        attention_bias: g.tensor("blk.0.attn_q.bias").is_some(),
        layer_types: layout.layer_types,
        sliding_window: layout.window,
        sliding_rope: layout.sliding_rope,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids,
        moe,
        gemma,
        // llama.cpp's gpt-oss graph fixes the clamped SwiGLU at transformers' defaults; the
        // file carries neither.
        gpt_oss: (architecture == Architecture::GptOss)
            .then_some(GptOssOptions { swiglu_alpha: 1.702, swiglu_limit: 7.0 }),
        quantization: None,
    };
    cfg.validate_at(path)?;
    Ok(cfg)
}

/// YaRN as llama.cpp's converter writes it (`{arch}.rope.scaling.*`): the factor and the
/// original context (both required), `yarn_beta_fast` / `yarn_beta_slow` (transformers' 32 and
/// 1 where absent), `yarn_attn_factor` as the cos/sin scale where given. The file does not say
/// whether the ramp's ends round to whole dims (transformers' `truncate`): gpt-oss checkpoints
/// all say false, every other family the default, true. An extrapolation factor other than 1
/// or a log multiplier (DeepSeek's mscale) is refused by name: transformers' YaRN has neither.
fn gguf_yarn(g: &GgufFile, arch_name: &str, architecture: Architecture) -> Result<RopeScaling, FormatError> {
    let path = &g.path;
    let key = |k: &str| format!("{arch_name}.rope.scaling.{k}");
    let float = |k: &str| g.get(&key(k)).and_then(GgufValue::as_f64).map(|v| v as f32);
    let need = |k: &str| format!("yarn rope scaling without {}", key(k));
    for (k, neutral) in [("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)] {
        if let Some(v) = float(k).filter(|&v| v != neutral) {
            return Err(FormatError::unsupported(path, format!("{} {v}", key(k))));
        }
    }
    Ok(RopeScaling::Yarn {
        factor: float("factor").ok_or_else(|| FormatError::gguf(path, need("factor")))?,
        original_max_position_embeddings: g
            .get(&key("original_context_length"))
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| FormatError::gguf(path, need("original_context_length")))?
            as usize,
        beta_fast: float("yarn_beta_fast").unwrap_or(32.0),
        beta_slow: float("yarn_beta_slow").unwrap_or(1.0),
        truncate: architecture != Architecture::GptOss,
        attention_factor: float("yarn_attn_factor"),
    })
}

/// LongRoPE as llama.cpp's Phi-3 converter writes it: the factor lists as the tensors
/// `rope_factors_short.weight` and `rope_factors_long.weight`, the original context in
/// `rope.scaling.original_context_length`, the attention factor in `rope.scaling.attn_factor`.
/// None when the file has no factor tensors.
fn gguf_longrope(g: &GgufFile, arch_name: &str, max_position: usize) -> Result<Option<LongRope>, FormatError> {
    let path = &g.path;
    let factors = |name: &str| -> Result<Option<Vec<f32>>, FormatError> {
        let Some(t) = g.tensor(name) else { return Ok(None) };
        let ty = GgufType::from_id(t.ggml_type)
            .ok_or_else(|| FormatError::unsupported(path, format!("{name} has an unsupported type")))?;
        Ok(Some(dequantize(ty, g.tensor_bytes(t, ty)?)))
    };
    let (short, long) = match (factors("rope_factors_short.weight")?, factors("rope_factors_long.weight")?) {
        (Some(s), Some(l)) => (s, l),
        (None, None) => return Ok(None),
        _ => return Err(FormatError::gguf(path, "one of rope_factors_short / rope_factors_long without the other")),
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let original = g.get(&key("rope.scaling.original_context_length")).and_then(GgufValue::as_u64).ok_or_else(|| {
        FormatError::gguf(path, format!("LongRoPE factors without {}", key("rope.scaling.original_context_length")))
    })? as usize;
    let attention_factor = g
        .get(&key("rope.scaling.attn_factor"))
        .and_then(GgufValue::as_f64)
        .map_or_else(|| crate::hf_options::baton_longrope_attention_factor(max_position, original), |f| f as f32);
    Ok(Some(LongRope {
        short_factor: short,
        long_factor: long,
        original_max_position_embeddings: original,
        attention_factor,
        use_long: max_position > original,
    }))
}

/// A Gemma file's options as llama.cpp reads them (`llama-model.cpp`): the soft-caps from the
/// metadata (Gemma 2: llama.cpp's defaults 50 and 30 where absent; Gemma 3: no attention cap),
/// and the attention scale, which the file does not carry, from the model size: the 27B models
/// (46 layers for Gemma 2, 62 for Gemma 3) scale by `hidden / heads` (`embd_per_head`), every
/// other by `head_dim`, as their `query_pre_attn_scalar` says.
fn gguf_gemma(
    g: &GgufFile,
    arch_name: &str,
    architecture: Architecture,
    blocks: usize,
    embd_per_head: usize,
    head_dim: usize,
) -> GemmaOptions {
    let cap = |k: &str| g.get(&format!("{arch_name}.{k}")).and_then(GgufValue::as_f64).map(|c| c as f32);
    let gemma2 = architecture == Architecture::Gemma2;
    GemmaOptions {
        query_pre_attn_scalar: gemma_attention_scalar(architecture, blocks, embd_per_head, head_dim),
        attn_logit_softcapping: if gemma2 { Some(cap("attn_logit_softcapping").unwrap_or(50.0)) } else { None }
            .filter(|&c| c > 0.0),
        final_logit_softcapping: cap("final_logit_softcapping").or(gemma2.then_some(30.0)).filter(|&c| c > 0.0),
    }
}

/// `query_pre_attn_scalar` as llama.cpp derives it for a Gemma file (which does not store it):
/// `embd_per_head` (hidden / heads) for the 27B sizes (46 layers for Gemma 2, 62 for Gemma 3),
/// else `head_dim`.
pub fn gemma_attention_scalar(architecture: Architecture, blocks: usize, embd_per_head: usize, head_dim: usize) -> f32 {
    let big = if architecture == Architecture::Gemma2 { 46 } else { 62 };
    (if blocks == big { embd_per_head } else { head_dim }) as f32
}

/// Which layers of a file slide, over which window, with which RoPE.
struct LayerLayout {
    layer_types: Vec<LayerType>,
    window: Option<usize>,
    sliding_rope: Option<RopeParameters>,
}

/// The layers of a file as llama.cpp lays them out, given `{arch}.attention.sliding_window`
/// (absent or 0: every layer full). Gemma 2 slides on even layers, Gemma 3 on five of every six,
/// as transformers' `layer_types` do ([`LayerType::periodic`]); their sliding layers rotate with
/// `{arch}.rope.freq_base_swa` (Gemma 3: 10,000 where absent, unscaled). gpt-oss slides on even
/// layers like Gemma 2 (llama.cpp's swa pattern 2), with the full layers' RoPE. Phi-3 slides on
/// every layer. Other families' files are read all full, as before.
fn gguf_layers(
    g: &GgufFile,
    arch_name: &str,
    architecture: Architecture,
    blocks: usize,
    full: RopeParameters,
) -> LayerLayout {
    let all_full = LayerLayout { layer_types: vec![LayerType::Full; blocks], window: None, sliding_rope: None };
    let window = g
        .get(&format!("{arch_name}.attention.sliding_window"))
        .and_then(GgufValue::as_u64)
        .map(|w| w as usize)
        .filter(|&w| w > 0);
    let Some(window) = window else { return all_full };
    let layer_types = match architecture {
        Architecture::Gemma2 | Architecture::GptOss => LayerType::periodic(blocks, 2),
        Architecture::Gemma3Text => LayerType::periodic(blocks, 6),
        Architecture::Phi3 => vec![LayerType::Sliding; blocks],
        _ => return all_full,
    };
    let swa_theta = g.get(&format!("{arch_name}.rope.freq_base_swa")).and_then(GgufValue::as_f64).map(|t| t as f32);
    let theta = match architecture {
        Architecture::Gemma3Text => Some(swa_theta.unwrap_or(10000.0)),
        Architecture::Gemma2 => swa_theta,
        _ => None,
    };
    let sliding_rope = theta.map(|theta| RopeParameters { theta, scaling: None }).filter(|s| *s != full);
    LayerLayout { layer_types, window: Some(window), sliding_rope }
}

/// The routing of a mixture-of-experts file of `n` experts a layer (see the module doc).
fn gguf_moe(g: &GgufFile, arch_name: &str, architecture: Architecture, n: usize) -> Result<MoeConfig, FormatError> {
    let path = &g.path;
    let key = |k: &str| format!("{arch_name}.{k}");
    let num = |k: &str| g.get(&key(k)).and_then(GgufValue::as_u64).map(|v| v as usize);
    let req = |k: &str| num(k).ok_or_else(|| FormatError::gguf(path, format!("missing metadata {}", key(k))));
    if let Some(shared) = num("expert_shared_count").filter(|&s| s > 0) {
        return Err(FormatError::unsupported(
            path,
            format!("{} {shared} (shared experts)", key("expert_shared_count")),
        ));
    }
    // llama.cpp's gating functions: 1 softmax, 2 sigmoid.
    if let Some(f) = num("expert_gating_func").filter(|&f| f != 1) {
        return Err(FormatError::unsupported(
            path,
            format!("{} {f} (Baton routes by softmax, 1)", key("expert_gating_func")),
        ));
    }
    if let Some(s) = g.get(&key("expert_weights_scale")).and_then(GgufValue::as_f64).filter(|&s| s != 1.0) {
        return Err(FormatError::unsupported(
            path,
            format!("{} {s} (a routed scaling factor)", key("expert_weights_scale")),
        ));
    }
    // Qwen3-MoE's experts have their own width; Mixtral's is the model's feed-forward length.
    let intermediate_size = match architecture {
        Architecture::Qwen3Moe | Architecture::GptOss => req("expert_feed_forward_length")?,
        _ => num("expert_feed_forward_length").map_or_else(|| req("feed_forward_length"), Ok)?,
    };
    let blocks = req("block_count")?;
    Ok(MoeConfig {
        num_experts: n,
        experts_per_token: req("expert_used_count")?,
        intermediate_size,
        norm_topk_prob: g.get(&key("expert_weights_norm")).and_then(GgufValue::as_bool).unwrap_or(true),
        decoder_sparse_step: 1,
        mlp_only_layers: (0..blocks).filter(|i| g.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_none()).collect(),
    })
}

/// The GGUF name of projection `proj`'s stacked experts in layer `layer`.
pub fn gguf_experts_name(layer: usize, proj: ExpertProj) -> String {
    let p = match proj {
        ExpertProj::Gate => "gate",
        ExpertProj::Up => "up",
        ExpertProj::Down => "down",
    };
    format!("blk.{layer}.ffn_{p}_exps.weight")
}

/// The GGUF name of layer `layer`'s router.
pub fn gguf_router_name(layer: usize) -> String {
    format!("blk.{layer}.ffn_gate_inp.weight")
}

/// What the store makes of a GGUF tensor: a whole HF tensor, or expert `expert` of a stacked
/// `[experts, out, in]` tensor.
enum Job {
    Whole(String, GgufTensorInfo),
    Expert {
        hf: String,
        info: GgufTensorInfo,
        expert: usize,
        experts: usize,
    },
    /// gpt-oss's fused, transposed experts, built from one or two GGUF tensors.
    GptOss(ExpertJob),
}

/// The HF tensors of a GGUF tensor under `config` (a MoE layer's router and stacked experts
/// included; names the model does not use map to nothing).
fn jobs_for(t: &GgufTensorInfo, config: &ModelConfig) -> Vec<Job> {
    if let Some(hf) = gguf_to_hf_name_for(&t.name, config.architecture) {
        return vec![Job::Whole(hf, t.clone())];
    }
    let Some(moe) = &config.moe else { return Vec::new() };
    let layer = t.name.strip_prefix("blk.").and_then(|r| r.split_once('.')).and_then(|(l, _)| l.parse::<usize>().ok());
    let Some(layer) = layer.filter(|&l| l < config.num_hidden_layers) else { return Vec::new() };
    if t.name == gguf_router_name(layer) {
        return vec![Job::Whole(config.router_tensor(layer), t.clone())];
    }
    if config.architecture == Architecture::GptOss {
        // The up tensors are read by their gate tensor's job.
        return expert_job(&t.name, config.num_hidden_layers).map(Job::GptOss).into_iter().collect();
    }
    for proj in [ExpertProj::Gate, ExpertProj::Up, ExpertProj::Down] {
        if t.name == gguf_experts_name(layer, proj) {
            return (0..moe.num_experts)
                .map(|e| Job::Expert {
                    hf: config.expert_tensor(layer, e, proj),
                    info: t.clone(),
                    expert: e,
                    experts: moe.num_experts,
                })
                .collect();
        }
    }
    Vec::new()
}

/// Recovers Llama 3 rope scaling from llama.cpp's per-frequency divisors, assuming the
/// parameters every Llama 3.x release uses (low 1, high 4, original context 8192).
fn fit_llama3(divisors: &[f32], theta: f32, head_dim: usize) -> Option<RopeScaling> {
    let factor = divisors.iter().copied().fold(f32::NAN, f32::max);
    let guess = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let expect = llama3_rope_divisors(theta, head_dim, &guess);
    let close = expect.len() == divisors.len()
        && expect.iter().zip(divisors).all(|(a, b)| (a - b).abs() <= 1e-3 * a.abs().max(1.0));
    close.then_some(guess)
}

/// Where a served tensor's bytes live.
pub(super) enum Stored {
    Mapped(GgufTensorInfo, GgufType),
    /// Bytes `start..start + len` of a plain-float tensor (one expert of a stacked tensor).
    Slice(GgufTensorInfo, GgufType, usize, usize),
    Owned(DType, Vec<u8>),
}

/// Weights of a GGUF model under HF names: plain-float tensors borrowed from the map,
/// quantized or permuted ones converted once at load.
pub struct GgufStore {
    file: GgufFile,
    tensors: HashMap<String, (Vec<usize>, Stored)>,
}

impl std::fmt::Debug for GgufStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufStore").field("path", &self.file.path).field("tensors", &self.tensors.len()).finish()
    }
}

fn plain_dtype(ty: GgufType) -> Option<DType> {
    match ty {
        GgufType::F32 => Some(DType::F32),
        GgufType::F16 => Some(DType::F16),
        GgufType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

impl GgufStore {
    /// Converts the tensors of `file` (already parsed) for `config`.
    pub fn new(file: GgufFile, config: &ModelConfig) -> Result<Self, FormatError> {
        let jobs: Vec<Job> = file.tensors.iter().flat_map(|t| jobs_for(t, config)).collect();
        let converted: Result<Vec<_>, FormatError> = jobs
            .into_par_iter()
            .map(|job| match job {
                Job::Whole(hf, t) => whole_tensor(&file, config, hf, t),
                Job::Expert { hf, info, expert, experts } => expert_tensor(&file, hf, info, expert, experts),
                Job::GptOss(job) => build_expert(&file, config, job),
            })
            .collect();
        Ok(Self { tensors: converted?.into_iter().collect(), file })
    }

    /// The underlying parsed file (metadata access).
    pub fn file(&self) -> &GgufFile {
        &self.file
    }
}

/// The type of a GGUF tensor, refused by name when Baton does not read it.
pub(super) fn tensor_type(file: &GgufFile, t: &GgufTensorInfo) -> Result<GgufType, FormatError> {
    GgufType::from_id(t.ggml_type).ok_or_else(|| {
        FormatError::unsupported(
            &file.path,
            format!(
                "tensor {:?} has type {} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, MXFP4)",
                t.name,
                ggml_type_name(t.ggml_type)
            ),
        )
    })
}

/// A whole GGUF tensor under its HF name `hf`: borrowed when plain floats in HF order,
/// otherwise dequantized and/or with llama.cpp's Q/K row permutation undone.
fn whole_tensor(
    file: &GgufFile,
    config: &ModelConfig,
    hf: String,
    t: GgufTensorInfo,
) -> Result<(String, (Vec<usize>, Stored)), FormatError> {
    let ty = tensor_type(file, &t)?;
    let shape = t.hf_shape();
    let n_head = qk_permute_heads(config, &hf);
    // llama.cpp's Gemma converter stores every norm weight as 1 + w (the RMSNorm's factor):
    // back to w, which is exact for factors in [0.5, 2] (Sterbenz).
    if config.architecture.is_gemma() && hf.ends_with("norm.weight") {
        let raw = file.tensor_bytes(&t, ty)?;
        let values = match plain_dtype(ty) {
            Some(dtype) => {
                TensorView { name: hf.clone(), shape: shape.clone(), dtype, bytes: Cow::Borrowed(raw) }.to_f32()
            }
            None => dequantize(ty, raw),
        };
        let shifted: Vec<f32> = values.iter().map(|v| v - 1.0).collect();
        return Ok((hf, (shape, Stored::Owned(DType::F32, f32_to_bytes(&shifted)))));
    }
    let stored = match (plain_dtype(ty), n_head) {
        (Some(_), None) => Stored::Mapped(t.clone(), ty),
        (dtype, _) => {
            let raw = file.tensor_bytes(&t, ty)?;
            let (dtype, bytes) = match dtype {
                Some(d) => (d, raw.to_vec()),
                None => (DType::F32, f32_to_bytes(&dequantize(ty, raw))),
            };
            let bytes = match n_head {
                Some(n) => permute_qk_rows(&bytes, shape[0], n, false).ok_or_else(|| {
                    FormatError::gguf(
                        &file.path,
                        format!("tensor {:?}: {} rows do not split into {n} heads", t.name, shape[0]),
                    )
                })?,
                None => bytes,
            };
            Stored::Owned(dtype, bytes)
        }
    };
    Ok((hf, (shape, stored)))
}

/// Expert `expert` of the stacked `[experts, out, in]` tensor `t` under its HF name `hf`: a view
/// of the mapped file for plain floats, dequantized otherwise (an expert is whole rows, so
/// whole quantization blocks).
fn expert_tensor(
    file: &GgufFile,
    hf: String,
    t: GgufTensorInfo,
    expert: usize,
    experts: usize,
) -> Result<(String, (Vec<usize>, Stored)), FormatError> {
    let ty = tensor_type(file, &t)?;
    let shape = t.hf_shape();
    if shape.len() != 3 || shape[0] != experts {
        return Err(FormatError::gguf(
            &file.path,
            format!("tensor {:?}: shape {shape:?} is not [{experts} experts, out, in]", t.name),
        ));
    }
    let raw = file.tensor_bytes(&t, ty)?;
    let len = raw.len() / experts;
    let start = expert * len;
    let stored = match plain_dtype(ty) {
        Some(_) => Stored::Slice(t.clone(), ty, start, len),
        None => Stored::Owned(DType::F32, f32_to_bytes(&dequantize(ty, &raw[start..start + len]))),
    };
    Ok((hf, (shape[1..].to_vec(), stored)))
}

impl WeightStore for GgufStore {
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        let (shape, stored) = self
            .tensors
            .get(name)
            .ok_or_else(|| FormatError::MissingTensor { path: self.file.path.clone(), name: name.to_string() })?;
        let (dtype, bytes) = match stored {
            Stored::Mapped(t, ty) => {
                (plain_dtype(*ty).unwrap_or(DType::F32), Cow::Borrowed(self.file.tensor_bytes(t, *ty)?))
            }
            Stored::Slice(t, ty, start, len) => (
                plain_dtype(*ty).unwrap_or(DType::F32),
                Cow::Borrowed(&self.file.tensor_bytes(t, *ty)?[*start..*start + *len]),
            ),
            Stored::Owned(d, b) => (*d, Cow::Borrowed(b.as_slice())),
        };
        Ok(TensorView { name: name.to_string(), shape: shape.clone(), dtype, bytes })
    }

    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.sort();
        v
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        self.tensors
            .get(name)
            .map(|(s, _)| s.clone())
            .ok_or_else(|| FormatError::MissingTensor { path: self.file.path.clone(), name: name.to_string() })
    }
}

/// Parses `path` and returns the file with its config (the caller builds the store).
pub fn open_gguf(path: &Path) -> Result<(GgufFile, ModelConfig), FormatError> {
    let file = GgufFile::open(path)?;
    let config = gguf_config(&file)?;
    Ok((file, config))
}
