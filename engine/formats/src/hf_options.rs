//! The options of a HF `config.json` beyond the plain sizes, in both generations of
//! transformers: RoPE (`rope_theta` + `rope_scaling` in transformers 4; `rope_parameters`,
//! flat or nested per layer type, in transformers 5), the compute dtype (`torch_dtype` /
//! `dtype`), the layer types (`layer_types`, or the family's sliding-window options), and the
//! options Baton refuses because they change the math and are not implemented.
//!
//! Invariant: every option read here either maps onto a [`ModelConfig`](crate::ModelConfig)
//! field the models implement, or is refused with [`FormatError::Unsupported`] naming the
//! option and its value. Options that do not change the math (dropout, `use_cache`,
//! `pretraining_tp`, `initializer_range`...) are ignored.

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{Architecture, ConfigDType, GemmaOptions, GptOssOptions, LayerType, RopeParameters, RopeScaling};
use crate::error::FormatError;

/// Activations the gated MLP implements (`silu` and its alias `swish`).
const IMPLEMENTED_ACTIVATIONS: [&str; 2] = ["silu", "swish"];

/// The activation of Gemma's gated MLP (GELU with the tanh approximation), the only one
/// implemented for the Gemma families.
const GEMMA_ACTIVATIONS: [&str; 1] = ["gelu_pytorch_tanh"];

/// Refuses options that change the math and that `architecture` does not implement.
pub(crate) fn refuse_unimplemented_options(
    v: &Value,
    architecture: Architecture,
    path: &Path,
) -> Result<(), FormatError> {
    let implemented: &[&str] = if architecture.is_gemma() { &GEMMA_ACTIVATIONS } else { &IMPLEMENTED_ACTIVATIONS };
    for key in ["hidden_act", "hidden_activation"] {
        if let Some(act) = v.get(key).filter(|a| !a.is_null()) {
            match act.as_str() {
                Some(a) if implemented.contains(&a) => {}
                _ => {
                    return Err(FormatError::unsupported(
                        path,
                        format!("{key} {act} (implemented: {})", implemented.join(", ")),
                    ));
                }
            }
        }
    }
    if v.get("use_bidirectional_attention").and_then(Value::as_bool) == Some(true) {
        return Err(FormatError::unsupported(path, "use_bidirectional_attention = true (only causal attention)"));
    }
    if v.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
        return Err(FormatError::unsupported(path, "mlp_bias = true"));
    }
    // `quantization_config` is parsed (and what is not implemented refused) by
    // `crate::quantization::Quantization::from_hf`, except MXFP4: gpt-oss's expert format,
    // which the safetensors store serves as the bf16 tensors it dequantizes to, in the layout
    // of the unquantized checkpoint (`crate::mxfp4`), and which only gpt-oss's experts use.
    if let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
        if method == "mxfp4" && architecture != Architecture::GptOss {
            return Err(FormatError::unsupported(
                path,
                "quantization_config (quant_method \"mxfp4\" is implemented for gpt_oss only)",
            ));
        }
    }
    // Soft-capping is implemented for the Gemma families only (read by `gemma_options`).
    for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(cap) = v.get(key).filter(|c| !c.is_null() && !architecture.is_gemma()) {
            return Err(FormatError::unsupported(path, format!("{key} {cap}")));
        }
    }
    refuse_unimplemented_moe_options(v, path)?;
    Ok(())
}

/// Refuses the MoE options Baton's routing does not implement: shared experts (Qwen2-MoE,
/// DeepSeek), a scale on the routed weights, grouped expert selection and non-softmax scoring
/// (DeepSeek-V3), dense leading layers by count (`first_k_dense_replace`). Each is refused
/// only when it would change the math (present, not null, and not its no-op value).
fn refuse_unimplemented_moe_options(v: &Value, path: &Path) -> Result<(), FormatError> {
    let present = |key: &str| v.get(key).filter(|x| !x.is_null());
    for key in ["shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "first_k_dense_replace"] {
        if let Some(x) = present(key).filter(|x| x.as_u64() != Some(0)) {
            return Err(FormatError::unsupported(path, format!("{key} {x} (MoE option not implemented)")));
        }
    }
    if let Some(x) = present("routed_scaling_factor").filter(|x| x.as_f64() != Some(1.0)) {
        return Err(FormatError::unsupported(path, format!("routed_scaling_factor {x} (MoE option not implemented)")));
    }
    for key in ["n_group", "topk_group"] {
        if let Some(x) = present(key).filter(|x| x.as_u64() != Some(1)) {
            return Err(FormatError::unsupported(
                path,
                format!("{key} {x} (grouped expert selection not implemented)"),
            ));
        }
    }
    if let Some(x) = present("scoring_func").filter(|x| x.as_str() != Some("softmax")) {
        return Err(FormatError::unsupported(path, format!("scoring_func {x} (implemented: softmax)")));
    }
    Ok(())
}

/// The config's `partial_rotary_factor` (top level, or inside transformers 5's flat
/// `rope_parameters`), 1 when absent; [`ModelConfig::validate`](crate::ModelConfig::validate)
/// checks its range.
pub(crate) fn partial_rotary_factor(v: &Value) -> f32 {
    let in_rope = v.get("rope_parameters").and_then(|r| r.get("partial_rotary_factor"));
    in_rope.or_else(|| v.get("partial_rotary_factor")).and_then(Value::as_f64).map_or(1.0, |f| f as f32)
}

/// The flat RoPE object of a config: transformers 5's `rope_parameters`, else transformers
/// 4's `rope_scaling`.
fn flat_rope_object(v: &Value) -> Option<&Value> {
    v.get("rope_parameters").filter(|r| r.is_object()).or_else(|| v.get("rope_scaling").filter(|s| s.is_object()))
}

/// LongRoPE (`rope_type` `longrope`, legacy `su`), if the config's RoPE is that: both factor
/// lists, the original context (in the RoPE object or at the top level), and the attention
/// factor (given, else from `max_position_embeddings`). Per-list `short_mscale` /
/// `long_mscale` (Phi-3.5-MoE) are refused, naming them.
pub(crate) fn parse_longrope(
    v: &Value,
    max_position_embeddings: usize,
    path: &Path,
) -> Result<Option<crate::config::LongRope>, FormatError> {
    let Some(s) = flat_rope_object(v) else { return Ok(None) };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str);
    if !matches!(kind, Some("longrope" | "su")) {
        return Ok(None);
    }
    for key in ["short_mscale", "long_mscale"] {
        if let Some(m) = s.get(key).filter(|m| !m.is_null()) {
            return Err(FormatError::unsupported(path, format!("longrope {key} {m}")));
        }
    }
    let list = |key: &str| -> Result<Vec<f32>, FormatError> {
        s.get(key)
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|x| x.as_f64().map(|f| f as f32)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| FormatError::config(path, format!("longrope {key} must be a list of numbers")))
    };
    let original = s
        .get("original_max_position_embeddings")
        .or_else(|| v.get("original_max_position_embeddings"))
        .and_then(Value::as_u64)
        .ok_or_else(|| FormatError::config(path, "longrope needs original_max_position_embeddings"))?
        as usize;
    let attention_factor = match s.get("attention_factor").and_then(Value::as_f64) {
        Some(f) => f as f32,
        None => baton_longrope_attention_factor(max_position_embeddings, original),
    };
    Ok(Some(crate::config::LongRope {
        short_factor: list("short_factor")?,
        long_factor: list("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
        use_long: max_position_embeddings > original,
    }))
}

/// transformers' default LongRoPE attention factor: `sqrt(1 + ln(s) / ln(o))` with
/// `s = max_position_embeddings / o`, 1 when the context is not extended.
pub(crate) fn baton_longrope_attention_factor(max_position_embeddings: usize, original: usize) -> f32 {
    let s = max_position_embeddings as f64 / original.max(1) as f64;
    if s <= 1.0 { 1.0 } else { (1.0 + s.ln() / (original.max(2) as f64).ln()).sqrt() as f32 }
}

/// The compute dtype a `config.json` declares: transformers 5's `dtype`, else transformers
/// 4's `torch_dtype` (`None` when absent, null or `auto`); an unknown one is refused, naming it.
pub fn declared_dtype(v: &Value, path: &Path) -> Result<Option<ConfigDType>, FormatError> {
    for key in ["dtype", "torch_dtype"] {
        match v.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::String(name)) if name == "auto" => return Ok(None),
            Some(d) => {
                return d
                    .as_str()
                    .and_then(ConfigDType::parse)
                    .map(Some)
                    .ok_or_else(|| FormatError::unsupported(path, format!("{key} {d}")));
            }
        }
    }
    Ok(None)
}

/// The kind of each of `num_layers` layers and the sliding window (set only when some layer
/// slides). transformers 5 lists them in `layer_types`; before that, each family had its own
/// options: Mistral's `sliding_window` covers every layer; Qwen2/Qwen3's only with
/// `use_sliding_window`, from layer `max_window_layers` on. A window of null means no layer
/// slides, whatever the types say (transformers' masks then attend to everything).
pub(crate) fn layer_types(
    v: &Value,
    architecture: Architecture,
    num_layers: usize,
    path: &Path,
) -> Result<(Vec<LayerType>, Option<usize>), FormatError> {
    let listed = match v.get("layer_types").filter(|t| !t.is_null()) {
        None => None,
        Some(Value::Array(types)) => {
            if types.len() != num_layers {
                return Err(FormatError::config(
                    path,
                    format!("layer_types has {} entries for {num_layers} layers", types.len()),
                ));
            }
            let parsed = types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(LayerType::Full),
                    Some("sliding_attention") => Ok(LayerType::Sliding),
                    _ => Err(FormatError::unsupported(path, format!("layer_types entry {t}"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Some(parsed)
        }
        Some(other) => return Err(FormatError::config(path, format!("layer_types must be a list, got {other}"))),
    };
    let all_full = vec![LayerType::Full; num_layers];
    if architecture.is_gemma() {
        return gemma_layer_types(v, architecture, listed, num_layers);
    }
    let declared = match (v.get("sliding_window"), architecture) {
        // GptOssConfig's default window; a null one means every layer attends fully.
        (None, Architecture::GptOss) => Some(128),
        (w, _) => w.and_then(Value::as_u64).map(|w| w as usize),
    };
    let Some(window) = declared else {
        return Ok((all_full, None));
    };
    let types = match architecture {
        // gpt-oss before `layer_types` was written: sliding first, alternating (transformers'
        // GptOssConfig default).
        Architecture::GptOss => listed.unwrap_or_else(|| {
            (0..num_layers).map(|i| if i % 2 == 0 { LayerType::Sliding } else { LayerType::Full }).collect()
        }),
        // Phi-3's `sliding_window` (Phi-3-mini-4k: 2047) masks every layer, as Mistral's does.
        Architecture::Mistral | Architecture::Mixtral | Architecture::Phi3 => {
            listed.unwrap_or_else(|| vec![LayerType::Sliding; num_layers])
        }
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
            if v.get("use_sliding_window").and_then(Value::as_bool) != Some(true) {
                all_full
            } else {
                listed.unwrap_or_else(|| {
                    let from = v.get("max_window_layers").and_then(Value::as_u64).map_or(0, |m| m as usize);
                    (0..num_layers).map(|i| if i >= from { LayerType::Sliding } else { LayerType::Full }).collect()
                })
            }
        }
        Architecture::Llama | Architecture::Gemma2 | Architecture::Gemma3Text => listed.unwrap_or(all_full),
    };
    let window = types.contains(&LayerType::Sliding).then_some(window);
    Ok((types, window))
}

/// Gemma's layer kinds when the config lists none (transformers 4): Gemma 2 alternates,
/// sliding first; Gemma 3 has every `sliding_window_pattern`-th layer global (default 6).
/// Gemma's window defaults to transformers' 4096 when the config omits it; a null window
/// means every layer attends fully.
fn gemma_layer_types(
    v: &Value,
    architecture: Architecture,
    listed: Option<Vec<LayerType>>,
    num_layers: usize,
) -> Result<(Vec<LayerType>, Option<usize>), FormatError> {
    let window = match v.get("sliding_window") {
        None => Some(4096),
        Some(w) => w.as_u64().map(|w| w as usize),
    };
    let Some(window) = window else { return Ok((vec![LayerType::Full; num_layers], None)) };
    let types = listed.unwrap_or_else(|| {
        let pattern = match architecture {
            Architecture::Gemma2 => 2,
            _ => ["sliding_window_pattern", "_sliding_window_pattern"]
                .iter()
                .find_map(|k| v.get(*k).and_then(Value::as_u64))
                .map_or(6, |p| p.max(1) as usize),
        };
        LayerType::periodic(num_layers, pattern)
    });
    let window = types.contains(&LayerType::Sliding).then_some(window);
    Ok((types, window))
}

/// The Gemma options of a Gemma 2 / Gemma 3 config (`None` for other families), with
/// transformers' defaults where a key is absent (Gemma 2 soft-caps at 50 and 30 unless the
/// config says null; `query_pre_attn_scalar` defaults to 256).
pub(crate) fn gemma_options(
    v: &Value,
    architecture: Architecture,
    path: &Path,
) -> Result<Option<GemmaOptions>, FormatError> {
    if !architecture.is_gemma() {
        return Ok(None);
    }
    let positive = |key: &str, default: Option<f64>| -> Result<Option<f32>, FormatError> {
        let x = match v.get(key) {
            None => default,
            Some(Value::Null) => None,
            Some(x) => Some(x.as_f64().ok_or_else(|| FormatError::config(path, format!("{key} must be a number")))?),
        };
        match x {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(FormatError::config(path, format!("{key} ({x}) must be positive")))
            }
            x => Ok(x.map(|x| x as f32)),
        }
    };
    let gemma2 = architecture == Architecture::Gemma2;
    Ok(Some(GemmaOptions {
        query_pre_attn_scalar: positive("query_pre_attn_scalar", Some(256.0))?.unwrap_or(256.0),
        attn_logit_softcapping: positive("attn_logit_softcapping", gemma2.then_some(50.0))?,
        final_logit_softcapping: positive("final_logit_softcapping", gemma2.then_some(30.0))?,
    }))
}

/// The gpt-oss options (`None` for other families), with transformers' defaults where a key
/// is absent (`swiglu_alpha` 1.702, `swiglu_limit` 7).
pub(crate) fn gpt_oss_options(
    v: &Value,
    architecture: Architecture,
    path: &Path,
) -> Result<Option<GptOssOptions>, FormatError> {
    if architecture != Architecture::GptOss {
        return Ok(None);
    }
    let positive = |key: &str, default: f64| -> Result<f32, FormatError> {
        let x = match v.get(key).filter(|x| !x.is_null()) {
            None => default,
            Some(x) => x.as_f64().ok_or_else(|| FormatError::config(path, format!("{key} must be a number")))?,
        };
        if x.is_finite() && x > 0.0 {
            Ok(x as f32)
        } else {
            Err(FormatError::config(path, format!("{key} ({x}) must be positive")))
        }
    };
    Ok(Some(GptOssOptions {
        swiglu_alpha: positive("swiglu_alpha", 1.702)?,
        swiglu_limit: positive("swiglu_limit", 7.0)?,
    }))
}

/// The RoPE of full-attention layers, and of sliding ones where it differs. transformers 5's
/// `rope_parameters` wins over the transformers 4 keys when both are present; nested per
/// layer type it is `{"full_attention": {...}, "sliding_attention": {...}}`. Gemma 3 in
/// transformers 4 gives its local layers a base of their own (`rope_local_base_freq`,
/// default 10000, no scaling).
pub(crate) fn parse_rope(
    v: &Value,
    architecture: Architecture,
    path: &Path,
) -> Result<(RopeParameters, Option<RopeParameters>), FormatError> {
    let (full, sliding) = parse_rope_keys(v, path)?;
    let nested = v
        .get("rope_parameters")
        .and_then(Value::as_object)
        .is_some_and(|p| [LayerType::Full, LayerType::Sliding].iter().any(|t| p.contains_key(t.hf_name())));
    if architecture == Architecture::Gemma3Text && !nested {
        let theta = v.get("rope_local_base_freq").and_then(Value::as_f64).map_or(10000.0, |t| t as f32);
        let local = RopeParameters { theta, scaling: None };
        return Ok((full, (local != full).then_some(local)));
    }
    Ok((full, sliding))
}

fn parse_rope_keys(v: &Value, path: &Path) -> Result<(RopeParameters, Option<RopeParameters>), FormatError> {
    let legacy_theta = v.get("rope_theta").and_then(Value::as_f64).map(|t| t as f32);
    let Some(params) = v.get("rope_parameters").and_then(Value::as_object) else {
        let theta = legacy_theta.unwrap_or(10000.0);
        let rope = match v.get("rope_scaling").filter(|s| s.is_object()) {
            Some(s) => parse_one(s, v, theta, path, "rope_scaling")?,
            None => RopeParameters { theta, scaling: None },
        };
        return Ok((rope, None));
    };
    let nested = [LayerType::Full, LayerType::Sliding].iter().any(|t| params.contains_key(t.hf_name()));
    if !nested {
        let theta = legacy_theta.unwrap_or(10000.0);
        return Ok((parse_one(&Value::Object(params.clone()), v, theta, path, "rope_parameters")?, None));
    }
    if let Some(other) =
        params.keys().find(|k| ![LayerType::Full, LayerType::Sliding].iter().any(|t| t.hf_name() == *k))
    {
        return Err(FormatError::unsupported(path, format!("rope_parameters for layer type {other:?}")));
    }
    let per_type = |t: LayerType| -> Result<Option<RopeParameters>, FormatError> {
        nested_entry(params, t)
            .map(|p| {
                let name = format!("rope_parameters.{}", t.hf_name());
                parse_one(p, v, legacy_theta.unwrap_or(10000.0), path, &name)
            })
            .transpose()
    };
    let full = per_type(LayerType::Full)?;
    let sliding = per_type(LayerType::Sliding)?;
    match (full, sliding) {
        (Some(full), sliding) => Ok((full, sliding.filter(|s| *s != full))),
        // Every layer slides (no full-attention entry): the sliding parameters are the model's.
        (None, Some(sliding)) => Ok((sliding, None)),
        (None, None) => Err(FormatError::config(path, "rope_parameters per layer type must be objects")),
    }
}

fn nested_entry(params: &Map<String, Value>, t: LayerType) -> Option<&Value> {
    params.get(t.hf_name()).filter(|p| p.is_object())
}

/// One RoPE object (`rope_scaling`, flat `rope_parameters` or one of its per-type entries):
/// its `rope_type` (or legacy `type`), its `rope_theta` (else `theta`), and the scaling's
/// parameters. `config` is the whole config (for keys transformers reads beside the object);
/// `name` names the object in errors.
fn parse_one(s: &Value, config: &Value, theta: f32, path: &Path, name: &str) -> Result<RopeParameters, FormatError> {
    // The flat object's partial rotation is read by `partial_rotary_factor`; a different one
    // per layer type is not implemented.
    if name.contains('.')
        && let Some(f) = s.get("partial_rotary_factor").filter(|f| !f.is_null() && f.as_f64() != Some(1.0))
    {
        return Err(FormatError::unsupported(path, format!("{name}.partial_rotary_factor {f} (per layer type)")));
    }
    let theta = s.get("rope_theta").and_then(Value::as_f64).map_or(theta, |t| t as f32);
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |key: &str| -> Result<f32, FormatError> {
        s.get(key)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| FormatError::config(path, format!("{name}.{key} is missing")))
    };
    let scaling = match kind {
        "default" => None,
        // The frequencies are LongRope's (`parse_longrope`), outside `RopeScaling`.
        "longrope" | "su" if !name.contains('.') => None,
        "longrope" | "su" => {
            return Err(FormatError::unsupported(path, format!("{name} rope_type {kind:?} per layer type")));
        }
        "linear" => Some(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: s
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .ok_or_else(|| {
                    FormatError::config(path, format!("{name}.original_max_position_embeddings is missing"))
                })? as usize,
        }),
        "yarn" => Some(parse_yarn(s, config, path, name)?),
        other => {
            return Err(FormatError::unsupported(
                path,
                format!("{name} rope_type {other:?} (implemented: default, linear, llama3, yarn, longrope)"),
            ));
        }
    };
    Ok(RopeParameters { theta, scaling })
}

/// The keys a YaRN object may hold (transformers 5's `_validate_yarn_rope_parameters`); any
/// other is refused, naming it, rather than ignored.
const YARN_KEYS: [&str; 12] = [
    "rope_type",
    "type",
    "factor",
    "original_max_position_embeddings",
    "rope_theta",
    "partial_rotary_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
];

/// YaRN's parameters as transformers 5 computes them (`_compute_yarn_parameters`): the
/// original context is the config's top-level `original_max_position_embeddings` when it has
/// one, else the object's, else `max_position_embeddings`; `beta_fast`/`beta_slow` default to
/// 32/1 and `truncate` to true; the attention factor is `attention_factor`, else
/// `mscale`/`mscale_all_dim`'s ratio when both are set, else (left to the table)
/// `0.1 · ln(factor) + 1`. (transformers 4 took the factor as `max_position_embeddings /
/// original` when the object named the original context; every released config has the two
/// agree.)
fn parse_yarn(s: &Value, config: &Value, path: &Path, name: &str) -> Result<RopeScaling, FormatError> {
    if let Some(obj) = s.as_object()
        && let Some(key) = obj.keys().find(|k| !YARN_KEYS.contains(&k.as_str()))
    {
        return Err(FormatError::unsupported(path, format!("{name} yarn option {key:?} (not implemented)")));
    }
    let num = |key: &str| -> Result<Option<f64>, FormatError> {
        match s.get(key).filter(|x| !x.is_null()) {
            None => Ok(None),
            Some(x) => {
                x.as_f64().map(Some).ok_or_else(|| FormatError::config(path, format!("{name}.{key} must be a number")))
            }
        }
    };
    let factor = num("factor")?.ok_or_else(|| FormatError::config(path, format!("{name}.factor is missing")))?;
    let original = config
        .get("original_max_position_embeddings")
        .or_else(|| s.get("original_max_position_embeddings"))
        .or_else(|| config.get("max_position_embeddings"))
        .and_then(Value::as_u64)
        .ok_or_else(|| FormatError::config(path, format!("{name}.original_max_position_embeddings is missing")))?;
    let truncate = match s.get("truncate").filter(|t| !t.is_null()) {
        None => true,
        Some(t) => {
            t.as_bool().ok_or_else(|| FormatError::config(path, format!("{name}.truncate must be a boolean")))?
        }
    };
    // transformers' `get_mscale`.
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let attention_factor = match (num("attention_factor")?, num("mscale")?, num("mscale_all_dim")?) {
        (Some(a), _, _) => Some(a as f32),
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => Some((mscale(factor, m) / mscale(factor, all)) as f32),
        _ => None,
    };
    Ok(RopeScaling::Yarn {
        factor: factor as f32,
        original_max_position_embeddings: original as usize,
        // transformers: `get("beta_fast") or 32` (a 0 means the default too).
        beta_fast: num("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0) as f32,
        beta_slow: num("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0) as f32,
        truncate,
        attention_factor,
    })
}
