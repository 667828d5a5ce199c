//! Model hyperparameters ([`ModelConfig`]) and sampling defaults ([`GenerationConfig`]),
//! parsed from Hugging Face `config.json` / `generation_config.json` (GGUF metadata is
//! mapped onto the same types in `gguf::model`). A `ModelConfig` that passed
//! [`ModelConfig::validate`] has consistent head counts and sizes, so
//! [`ModelConfig::expected_tensors`] describes exactly what a loader must find. The RoPE types
//! live in `rope`, [`GenerationConfig`] in `generation` (both re-exported here), and the
//! config.json Baton writes (`ModelConfig::to_hf_json`) in `config_json`.

use std::path::Path;

use serde_json::Value;

use crate::error::FormatError;
pub use crate::generation::GenerationConfig;
pub use crate::hf_options::declared_dtype;
use crate::hf_options::{
    gemma_options, gpt_oss_options, layer_types, parse_longrope, parse_rope, partial_rotary_factor,
    refuse_unimplemented_options,
};
pub use crate::rope::{LongRope, RopeParameters, RopeScaling, llama3_rope_divisors};

/// The transformer families Baton implements. All share Llama's attention layout; Qwen2 adds
/// q/k/v biases, Qwen3 a per-head RMSNorm of q and k before RoPE; Qwen3-MoE and Mixtral
/// replace (some of) the dense MLPs with routed experts ([`MoeConfig`]); Gemma 2 and 3 add
/// norms after attention and MLP, GELU-tanh, soft-capping and sliding-window layers (see
/// [`GemmaOptions`]); gpt-oss has biases everywhere, attention sinks, alternating
/// sliding-window layers, YaRN and routed experts with a clamped SwiGLU ([`GptOssOptions`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// Llama 2/3/3.1/3.2 and SmolLM2.
    Llama,
    /// Mistral (same tensors as Llama).
    Mistral,
    /// Qwen2 / Qwen2.5 (q/k/v biases).
    Qwen2,
    /// Qwen3 dense (q/k norm, head_dim independent of the hidden size).
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention, routed experts in the layers `decoder_sparse_step` and
    /// `mlp_only_layers` select, dense MLPs in the others.
    Qwen3Moe,
    /// Mixtral: Mistral's attention, routed experts (top-2 of 8) in every layer.
    Mixtral,
    /// Gemma 2 (`Gemma2ForCausalLM`): alternating sliding and global layers, soft-capping.
    Gemma2,
    /// Gemma 3, the text model only (`Gemma3ForCausalLM`, `model_type` `gemma3_text`): 5:1
    /// local/global layers, q/k norm, a RoPE base of its own for local layers.
    Gemma3Text,
    /// Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): fused `qkv_proj` and `gate_up_proj`
    /// in the checkpoint, partial rotary embeddings and LongRoPE.
    Phi3,
    /// gpt-oss (`GptOssForCausalLM`): q/k/v/o biases, learned attention sinks, alternating
    /// sliding/full layers, YaRN, routed experts (router and experts with biases, clamped
    /// SwiGLU on interleaved gate/up columns), MXFP4 expert weights dequantized at load.
    GptOss,
}

impl Architecture {
    /// Every architecture, in the order messages list them.
    pub const ALL: [Architecture; 10] = [
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Qwen3Moe,
        Self::Mixtral,
        Self::Gemma2,
        Self::Gemma3Text,
        Self::Phi3,
        Self::GptOss,
    ];

    /// Maps a HF `model_type` or `architectures[0]` entry, or a GGUF `general.architecture`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == name || a.hf_class() == name || a.gguf_name() == Some(name))
    }

    /// llama.cpp's `general.architecture` for this family, where Baton reads GGUF files of it
    /// (Mistral and Mixtral GGUF files say `llama`, Mixtral's with `llama.expert_count`; the
    /// experts' stacked layout, and the Gemma files' norm names and `1 + w` norm weights:
    /// `gguf/model.rs`).
    pub fn gguf_name(self) -> Option<&'static str> {
        match self {
            Self::Llama => Some("llama"),
            Self::Mistral | Self::Mixtral => None,
            Self::Gemma2 => Some("gemma2"),
            Self::Gemma3Text => Some("gemma3"),
            Self::Qwen2 => Some("qwen2"),
            Self::Qwen3 => Some("qwen3"),
            Self::Qwen3Moe => Some("qwen3moe"),
            // Fused `attn_qkv` / `ffn_up`, LongRoPE factors as tensors (`gguf/model.rs`).
            Self::Phi3 => Some("phi3"),
            // Split or fused gate/up experts with biases, MXFP4 or float (`gguf/gpt_oss.rs`).
            Self::GptOss => Some("gpt-oss"),
        }
    }

    /// The supported architectures for messages: `llama (LlamaForCausalLM), ...`.
    pub fn supported_list() -> String {
        Self::ALL.iter().map(|a| format!("{} ({})", a.model_type(), a.hf_class())).collect::<Vec<_>>().join(", ")
    }

    /// The HF `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Mixtral => "mixtral",
            Self::Gemma2 => "gemma2",
            Self::Gemma3Text => "gemma3_text",
            Self::Phi3 => "phi3",
            Self::GptOss => "gpt_oss",
        }
    }

    /// Whether this is Gemma 2 or Gemma 3 (their layer layout, norms and options).
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3Text)
    }

    /// The HF `architectures[0]` class name.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::Gemma3Text => "Gemma3ForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::GptOss => "GptOssForCausalLM",
        }
    }
}

/// What kind of attention a layer runs (HF `layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerType {
    /// `full_attention`: causal attention over the whole context.
    Full,
    /// `sliding_attention`: causal attention over the last `sliding_window` positions.
    Sliding,
}

impl LayerType {
    /// Layers that slide except every `period`-th one (layer `i` is full when `(i + 1) % period
    /// == 0`): transformers' and llama.cpp's Gemma rule (Gemma 2: period 2, Gemma 3: 6).
    pub fn periodic(num_layers: usize, period: usize) -> Vec<Self> {
        let period = period.max(1);
        (0..num_layers).map(|i| if (i + 1) % period != 0 { Self::Sliding } else { Self::Full }).collect()
    }

    /// The HF name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Full => "full_attention",
            Self::Sliding => "sliding_attention",
        }
    }
}

/// What Gemma 2 and Gemma 3 add to the shared layout (`None` in [`ModelConfig::gemma`] for
/// every other family). Implied by the family and not listed here: embeddings scaled by
/// `√hidden_size`, RMSNorms scaling by `1 + w`, norms after attention and after the MLP
/// (`post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`),
/// the GELU-tanh gated MLP, and (Gemma 3) the q/k norm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmaOptions {
    /// Attention scores are scaled by `query_pre_attn_scalar^-0.5` (not `head_dim^-0.5`).
    pub query_pre_attn_scalar: f32,
    /// Each scaled attention score `s` becomes `cap · tanh(s / cap)` (`attn_logit_softcapping`).
    pub attn_logit_softcapping: Option<f32>,
    /// Each final logit `x` becomes `cap · tanh(x / cap)` (`final_logit_softcapping`).
    pub final_logit_softcapping: Option<f32>,
}

impl GemmaOptions {
    /// The softmax scale of attention scores.
    pub fn attention_scale(&self) -> f32 {
        (1.0 / f64::from(self.query_pre_attn_scalar).sqrt()) as f32
    }
}

/// The default compute dtype a checkpoint declares (transformers 4's `torch_dtype`,
/// transformers 5's `dtype`; see [`declared_dtype`]). Informational: Baton computes in f32
/// on the CPU and bf16 on GPUs whatever it says, and reads each tensor in its stored dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigDType {
    /// `float32`.
    F32,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
}

impl ConfigDType {
    /// The transformers name (`float32`, `float16`, `bfloat16`).
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
        }
    }

    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "float32" | "torch.float32" => Some(Self::F32),
            "float16" | "torch.float16" => Some(Self::F16),
            "bfloat16" | "torch.bfloat16" => Some(Self::BF16),
            _ => None,
        }
    }
}

/// What gpt-oss adds to the shared layout (`None` in [`ModelConfig::gpt_oss`] for every
/// other family). Implied by the family: q/k/v/o biases, one learned sink logit per query
/// head and layer (`self_attn.sinks`), router and expert biases, experts stored fused and
/// transposed (`gate_up_proj` `[E, hidden, 2·inter]` with gate and up interleaved by column,
/// `down_proj` `[E, inter, hidden]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptOssOptions {
    /// The experts' activation `(up + 1) · g · σ(alpha · g)` uses this `alpha` (`swiglu_alpha`).
    pub swiglu_alpha: f32,
    /// Gate clamped above, up clamped to ±`limit` before it (`swiglu_limit`).
    pub swiglu_limit: f32,
}

/// The routed experts of a mixture-of-experts model (Qwen3-MoE, Mixtral, gpt-oss).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts`, transformers 5: `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// Inner width of each expert (Qwen3-MoE: `moe_intermediate_size`; Mixtral:
    /// `intermediate_size`, its only MLP width).
    pub intermediate_size: usize,
    /// The chosen experts' softmax weights are renormalised to sum to 1 (`norm_topk_prob`;
    /// always for Mixtral).
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer (layer `i` with `(i + 1) % step == 0`) is MoE
    /// (Qwen3-MoE; 1 for Mixtral).
    pub decoder_sparse_step: usize,
    /// Layers that stay dense whatever the step says (`mlp_only_layers`).
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `layer` routes its tokens to experts (transformers' rule for Qwen3-MoE).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && self.decoder_sparse_step > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// One of an expert's three projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProj {
    /// The gate projection (`[intermediate, hidden]`; Mixtral's `w1`).
    Gate,
    /// The up projection (`[intermediate, hidden]`; Mixtral's `w3`).
    Up,
    /// The down projection (`[hidden, intermediate]`; Mixtral's `w2`).
    Down,
}

/// Architecture hyperparameters of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub architecture: Architecture,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when smaller than `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Per-head width (`head_dim` field, else hidden / heads).
    pub head_dim: usize,
    /// Rows of the embedding and LM head.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Optional RoPE scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// LongRoPE, instead of `rope_scaling` (Phi-3 family).
    pub longrope: Option<LongRope>,
    /// Fraction of each head that rotates (`partial_rotary_factor`; 1 = all of it): the
    /// first [`ModelConfig::rotary_dim`] dims, the rest pass through.
    pub partial_rotary_factor: f32,
    /// Longest context the model supports: the config's `max_position_embeddings` (sliding
    /// layers attend within [`Self::sliding_window`] at any context).
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding matrix (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// q/k/v projections have biases (Qwen2, or `attention_bias`), and so has o_proj where
    /// the family puts one there too (see [`ModelConfig::o_proj_bias`]).
    pub attention_bias: bool,
    /// The kind of each layer, one per layer (all [`LayerType::Full`] unless the config's
    /// `layer_types`, or its family's sliding-window options, say otherwise).
    pub layer_types: Vec<LayerType>,
    /// The window of [`LayerType::Sliding`] layers.
    pub sliding_window: Option<usize>,
    /// RoPE of sliding layers where it differs from the full layers' (`rope_theta`,
    /// `rope_scaling`): transformers 5's `rope_parameters` nested per layer type.
    pub sliding_rope: Option<RopeParameters>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (any of them stops generation).
    pub eos_token_ids: Vec<u32>,
    /// The routed experts, for the MoE families; `None` for dense models.
    pub moe: Option<MoeConfig>,
    /// Gemma 2 / Gemma 3 options; `None` for every other family.
    pub gemma: Option<GemmaOptions>,
    /// gpt-oss options; `None` for every other family.
    pub gpt_oss: Option<GptOssOptions>,
    /// FP8 weights: the checkpoint's `quantization_config`, or quantization at load
    /// (`--quantization fp8`); `None` for unquantized weights.
    pub quantization: Option<crate::quantization::Quantization>,
}

impl ModelConfig {
    /// Width of the q projection output.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Dims of each head that RoPE rotates: `head_dim × partial_rotary_factor`, rounded down
    /// as transformers does.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * f64::from(self.partial_rotary_factor)) as usize
    }

    /// This config as an engine serving contexts up to `len` tokens runs it: LongRoPE's
    /// factor list is chosen by the served context (see [`LongRope`]).
    pub fn with_served_context(&self, len: usize) -> Self {
        let mut cfg = self.clone();
        if let Some(l) = cfg.longrope.as_mut() {
            l.use_long = len > l.original_max_position_embeddings;
        }
        cfg
    }

    /// Width of the k and v projection outputs.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The model's identity in a cluster: the shape and the weights' quantization, which
    /// decide whether two workers can exchange KV and produce the same tokens, independent of
    /// the file format it came from. A worker registers with it and the router refuses a
    /// worker whose fingerprint differs. Computed on the config as served: after
    /// [`Self::with_served_context`] and with any at-load quantization applied.
    pub fn fingerprint(&self) -> String {
        let moe = match &self.moe {
            Some(m) => format!(
                "-experts{}x{}-top{}-norm{}-step{}-dense{:?}",
                m.num_experts,
                m.intermediate_size,
                m.experts_per_token,
                m.norm_topk_prob,
                m.decoder_sparse_step,
                m.mlp_only_layers
            ),
            None => String::new(),
        };
        format!(
            "{:?}-vocab{}-hidden{}-layers{}-heads{}-kv{}-hd{}-ffn{}-theta{}-bias{}-rot{}{}{moe}{}",
            self.architecture,
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
            self.rope_theta,
            self.attention_bias,
            self.rotary_dim(),
            // Prefill and decode workers must rotate with the same LongRoPE list.
            match &self.longrope {
                Some(l) if l.use_long => "-longrope-long",
                Some(_) => "-longrope-short",
                None => "",
            },
            // FP8 and bf16 weights (or two FP8 schemes) give different KV for one prompt.
            self.quantization.as_ref().map_or(String::new(), |q| format!("-{}", q.fingerprint()))
        )
    }

    /// The checkpoint stores `[q; k; v]` as one `qkv_proj` and `[gate; up]` as one
    /// `gate_up_proj` (Phi-3), the layout Baton computes with anyway.
    pub fn fused_checkpoint(&self) -> bool {
        self.architecture == Architecture::Phi3
    }

    /// q and k are RMS-normalised per head before RoPE (Qwen3's and Gemma 3's `q_norm`/`k_norm`).
    pub fn qk_norm(&self) -> bool {
        matches!(self.architecture, Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3Text)
    }

    /// Whether layer `layer` has routed experts instead of a dense MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_moe_layer(layer))
    }

    /// o_proj has a bias: `attention_bias` in Llama and Qwen3 covers o_proj too; Qwen2's
    /// biases are on q/k/v only, and Mistral has none.
    pub fn o_proj_bias(&self) -> bool {
        self.attention_bias
            && matches!(
                self.architecture,
                Architecture::Llama | Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::GptOss
            )
    }

    /// The rotary parameters of full-attention layers.
    pub fn rope(&self) -> RopeParameters {
        RopeParameters { theta: self.rope_theta, scaling: self.rope_scaling }
    }

    /// The rotary parameters of layers of `kind`.
    pub fn rope_for(&self, kind: LayerType) -> RopeParameters {
        match kind {
            LayerType::Sliding => self.sliding_rope.unwrap_or_else(|| self.rope()),
            LayerType::Full => self.rope(),
        }
    }

    /// Checks internal consistency; the error names "config" as the source.
    pub fn validate(&self) -> Result<(), FormatError> {
        self.validate_at(Path::new("config"))
    }

    /// Checks internal consistency; errors name `path`.
    pub fn validate_at(&self, path: &Path) -> Result<(), FormatError> {
        let bad = |m: String| Err(FormatError::config(path, m));
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in sizes {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        // Far above any real model; keeps shape arithmetic and dummy allocations sane when
        // a config file is corrupt.
        const MAX_DIM: usize = 1 << 22;
        for (name, v) in sizes {
            let limit = if name == "max_position_embeddings" { 1 << 26 } else { MAX_DIM };
            if v > limit {
                return bad(format!("{name} ({v}) is implausibly large (limit {limit})"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return bad(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim ({}) must be even for RoPE", self.head_dim));
        }
        let rot = self.rotary_dim();
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0) || rot < 2 || !rot.is_multiple_of(2)
        {
            return bad(format!(
                "partial_rotary_factor {} gives {rot} rotary dims of head_dim {} (need an even number ≥ 2)",
                self.partial_rotary_factor, self.head_dim
            ));
        }
        if let Some(l) = &self.longrope {
            for (name, f) in [("short_factor", &l.short_factor), ("long_factor", &l.long_factor)] {
                if f.len() != rot / 2 || !f.iter().all(|x| x.is_finite() && *x > 0.0) {
                    return bad(format!(
                        "longrope {name} has {} entries (need {} = rotary dims / 2, all positive)",
                        f.len(),
                        rot / 2
                    ));
                }
            }
            if l.original_max_position_embeddings == 0 || !(l.attention_factor.is_finite() && l.attention_factor > 0.0)
            {
                return bad("longrope needs original_max_position_embeddings and a positive attention_factor".into());
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!("rms_norm_eps ({}) must be positive", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta ({}) must be positive", self.rope_theta));
        }
        match self.rope_scaling {
            Some(RopeScaling::Linear { factor }) if !(factor.is_finite() && factor > 0.0) => {
                return bad(format!("rope_scaling.factor ({factor}) must be positive"));
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) if !(factor > 0.0 && low_freq_factor > 0.0 && high_freq_factor > low_freq_factor)
                || original_max_position_embeddings == 0 =>
            {
                return bad(format!(
                    "llama3 rope_scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and \
                     original_max_position_embeddings > 0 (got {factor}, {low_freq_factor}, \
                     {high_freq_factor}, {original_max_position_embeddings})"
                ));
            }
            _ => {}
        }
        for rope in [Some(self.rope()), self.sliding_rope].into_iter().flatten() {
            if let Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            }) = rope.scaling
                && !(factor.is_finite()
                    && factor > 0.0
                    && beta_fast > 0.0
                    && beta_slow > 0.0
                    && original_max_position_embeddings > 0
                    && attention_factor.is_none_or(|a| a.is_finite() && a > 0.0))
            {
                return bad(format!(
                    "yarn rope scaling needs factor, beta_fast, beta_slow, original_max_position_embeddings \
                     and any attention_factor > 0 (got {factor}, {beta_fast}, {beta_slow}, \
                     {original_max_position_embeddings}, {attention_factor:?})"
                ));
            }
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return bad(format!(
                "layer_types has {} entries for {} layers",
                self.layer_types.len(),
                self.num_hidden_layers
            ));
        }
        if self.layer_types.contains(&LayerType::Sliding) && self.sliding_window.is_none_or(|w| w == 0) {
            return bad("sliding_attention layers need a positive sliding_window".into());
        }
        if let Some(m) = &self.moe {
            self.validate_moe(m, path)?;
        }
        let vocab = self.vocab_size;
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= vocab {
                return bad(format!("special token id {id} is outside the vocabulary ({vocab})"));
            }
        }
        Ok(())
    }

    /// The expert fields' consistency (see [`ModelConfig::validate_at`]).
    fn validate_moe(&self, m: &MoeConfig, path: &Path) -> Result<(), FormatError> {
        let bad = |msg: String| Err(FormatError::config(path, msg));
        // Far above any released model (DeepSeek-V3 has 256); keeps a corrupt config from
        // asking for absurd allocations.
        const MAX_EXPERTS: usize = 1 << 12;
        if !(1..=MAX_EXPERTS).contains(&m.num_experts) {
            return bad(format!("num_experts ({}) must be between 1 and {MAX_EXPERTS}", m.num_experts));
        }
        if !(1..=m.num_experts).contains(&m.experts_per_token) {
            return bad(format!(
                "num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                m.experts_per_token, m.num_experts
            ));
        }
        if m.intermediate_size == 0 || m.intermediate_size > 1 << 22 {
            return bad(format!(
                "the experts' intermediate size ({}) must be positive and plausible",
                m.intermediate_size
            ));
        }
        if m.decoder_sparse_step == 0 {
            return bad("decoder_sparse_step must be positive".into());
        }
        if let Some(l) = m.mlp_only_layers.iter().find(|&&l| l >= self.num_hidden_layers) {
            return bad(format!("mlp_only_layers entry {l} is not a layer ({} layers)", self.num_hidden_layers));
        }
        Ok(())
    }

    /// The HF name of layer `layer`'s router (`[num_experts, hidden]`).
    pub fn router_tensor(&self, layer: usize) -> String {
        match self.architecture {
            Architecture::Mixtral => format!("model.layers.{layer}.block_sparse_moe.gate.weight"),
            Architecture::GptOss => format!("model.layers.{layer}.mlp.router.weight"),
            _ => format!("model.layers.{layer}.mlp.gate.weight"),
        }
    }

    /// The HF name of projection `proj` of expert `expert` in layer `layer` (Mixtral calls
    /// gate, up and down `w1`, `w3` and `w2`).
    pub fn expert_tensor(&self, layer: usize, expert: usize, proj: ExpertProj) -> String {
        match self.architecture {
            Architecture::Mixtral => {
                let w = match proj {
                    ExpertProj::Gate => "w1",
                    ExpertProj::Up => "w3",
                    ExpertProj::Down => "w2",
                };
                format!("model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight")
            }
            _ => {
                let w = match proj {
                    ExpertProj::Gate => "gate_proj",
                    ExpertProj::Up => "up_proj",
                    ExpertProj::Down => "down_proj",
                };
                format!("model.layers.{layer}.mlp.experts.{expert}.{w}.weight")
            }
        }
    }

    /// Every tensor a loader must provide, with its HF name and HF shape (`[out, in]` for linears).
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, q, kv, ffn) = (self.hidden_size, self.q_dim(), self.kv_dim(), self.intermediate_size);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab_size, h])];
        for i in 0..self.num_hidden_layers {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            if self.fused_checkpoint() {
                out.push((format!("{p}.self_attn.qkv_proj.weight"), vec![q + 2 * kv, h]));
            } else {
                out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
                out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
                out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            }
            if self.attention_bias {
                out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
            }
            if self.qk_norm() {
                out.push((format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]));
                out.push((format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            if self.o_proj_bias() {
                out.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
            }
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            if self.architecture.is_gemma() {
                out.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h]));
                out.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h]));
            }
            if self.architecture == Architecture::GptOss {
                out.push((format!("{p}.self_attn.sinks"), vec![self.num_attention_heads]));
            }
            if let Some(m) = self.moe.as_ref().filter(|m| m.is_moe_layer(i)) {
                let inter = m.intermediate_size;
                out.push((self.router_tensor(i), vec![m.num_experts, h]));
                if self.architecture == Architecture::GptOss {
                    let (e, x) = (m.num_experts, format!("{p}.mlp.experts"));
                    out.push((format!("{p}.mlp.router.bias"), vec![e]));
                    out.push((format!("{x}.gate_up_proj"), vec![e, h, 2 * inter]));
                    out.push((format!("{x}.gate_up_proj_bias"), vec![e, 2 * inter]));
                    out.push((format!("{x}.down_proj"), vec![e, inter, h]));
                    out.push((format!("{x}.down_proj_bias"), vec![e, h]));
                    continue;
                }
                for e in 0..m.num_experts {
                    out.push((self.expert_tensor(i, e, ExpertProj::Gate), vec![inter, h]));
                    out.push((self.expert_tensor(i, e, ExpertProj::Up), vec![inter, h]));
                    out.push((self.expert_tensor(i, e, ExpertProj::Down), vec![h, inter]));
                }
                continue;
            }
            if self.fused_checkpoint() {
                out.push((format!("{p}.mlp.gate_up_proj.weight"), vec![2 * ffn, h]));
            } else {
                out.push((format!("{p}.mlp.gate_proj.weight"), vec![ffn, h]));
                out.push((format!("{p}.mlp.up_proj.weight"), vec![ffn, h]));
            }
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, ffn]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        out
    }

    /// Parses a HF `config.json` file.
    pub fn from_hf_file(path: &Path) -> Result<Self, FormatError> {
        let v = read_json(path)?;
        Self::from_hf_json(&v, path)
    }

    /// Parses a HF `config.json` value; `path` is only used in error messages. Reads both
    /// generations: transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and
    /// transformers 5 (`rope_parameters`, flat or nested per layer type, and `dtype`). An
    /// option that changes the math and is not implemented is refused, naming it.
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<Self, FormatError> {
        let arch_name = v
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| v.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str))
            .ok_or_else(|| FormatError::config(path, "neither model_type nor architectures is set"))?;
        if let Some(multimodal) = ["gemma3", "Gemma3ForConditionalGeneration"].into_iter().find(|n| {
            *n == arch_name || v.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str) == Some(n)
        }) {
            return Err(FormatError::unsupported(
                path,
                format!(
                    "{multimodal}: the multimodal Gemma 3 (vision tower + text model) is not served; only the text \
                     model is (model_type \"gemma3_text\", Gemma3ForCausalLM)"
                ),
            ));
        }
        let architecture = Architecture::from_name(arch_name).ok_or_else(|| FormatError::UnsupportedArchitecture {
            path: path.to_path_buf(),
            name: arch_name.to_string(),
        })?;
        let req = |key: &str| -> Result<usize, FormatError> {
            v.get(key)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| FormatError::config(path, format!("missing or non-integer {key:?}")))
        };
        let opt_usize = |key: &str| v.get(key).and_then(Value::as_u64).map(|x| x as usize);
        refuse_unimplemented_options(v, architecture, path)?;
        // Read (and an unknown one refused) but not kept: Baton computes in f32 on the CPU and
        // bf16 on GPUs, and reads each tensor in its stored dtype.
        declared_dtype(v, path)?;
        let hidden_size = req("hidden_size")?;
        let num_attention_heads = req("num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(FormatError::config(path, "num_attention_heads must be positive"));
        }
        let num_hidden_layers = req("num_hidden_layers")?;
        let num_key_value_heads = opt_usize("num_key_value_heads").unwrap_or(num_attention_heads);
        let head_dim = opt_usize("head_dim").unwrap_or(hidden_size / num_attention_heads);
        let attention_bias = match architecture {
            Architecture::Qwen2 => true,
            _ => v.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
        };
        let (layer_types, sliding_window) = layer_types(v, architecture, num_hidden_layers, path)?;
        let (rope, sliding_rope) = parse_rope(v, architecture, path)?;
        let declared_len = opt_usize("max_position_embeddings").unwrap_or(2048);
        let moe = parse_moe(v, architecture, path)?;
        let longrope = parse_longrope(v, declared_len, path)?;
        let cfg = Self {
            architecture,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: req("vocab_size")?,
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            longrope,
            partial_rotary_factor: partial_rotary_factor(v),
            // Every family attends within its window on sliding layers (engine/src/models),
            // so an active window no longer caps the context.
            max_position_embeddings: declared_len,
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            attention_bias,
            layer_types,
            sliding_window,
            sliding_rope,
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
            eos_token_ids: parse_id_list(v.get("eos_token_id")),
            moe,
            gemma: gemma_options(v, architecture, path)?,
            gpt_oss: gpt_oss_options(v, architecture, path)?,
            quantization: match v.get("quantization_config").filter(|q| !q.is_null()) {
                // MXFP4 (gpt-oss's experts) is dequantized by the safetensors store at load
                // (`crate::mxfp4`; `hf_options` allows it for gpt-oss only): nothing stays
                // quantized for the engine.
                Some(q) if q.get("quant_method").and_then(Value::as_str) == Some("mxfp4") => None,
                Some(q) => Some(crate::quantization::Quantization::from_hf(q, path)?),
                None => None,
            },
        };
        cfg.validate_at(path)?;
        Ok(cfg)
    }
}

/// The experts of the MoE families (`None` for the dense ones). Qwen3-MoE names the expert
/// count `num_experts` (transformers 4) or `num_local_experts` (transformers 5), Mixtral
/// `num_local_experts`. The router options that change the math and are not implemented are
/// refused in `hf_options`; the training-only ones (`router_aux_loss_coef`,
/// `output_router_logits`, `router_jitter_noise`, which only perturbs the router in training)
/// are ignored.
fn parse_moe(v: &Value, architecture: Architecture, path: &Path) -> Result<Option<MoeConfig>, FormatError> {
    let num = |key: &str| v.get(key).and_then(Value::as_u64).map(|x| x as usize);
    let req = |key: &str| num(key).ok_or_else(|| FormatError::config(path, format!("missing or non-integer {key:?}")));
    let experts = || {
        num("num_experts")
            .or_else(|| num("num_local_experts"))
            .ok_or_else(|| FormatError::config(path, "missing or non-integer \"num_experts\" / \"num_local_experts\""))
    };
    match architecture {
        Architecture::Qwen3Moe => Ok(Some(MoeConfig {
            num_experts: experts()?,
            experts_per_token: req("num_experts_per_tok")?,
            intermediate_size: req("moe_intermediate_size")?,
            // transformers' Qwen3MoeConfig defaults.
            norm_topk_prob: v.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false),
            decoder_sparse_step: num("decoder_sparse_step").unwrap_or(1),
            mlp_only_layers: match v.get("mlp_only_layers").filter(|l| !l.is_null()) {
                None => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|l| {
                        l.as_u64().map(|x| x as usize).ok_or_else(|| {
                            FormatError::config(path, format!("mlp_only_layers entry {l} is not a layer index"))
                        })
                    })
                    .collect::<Result<_, _>>()?,
                Some(other) => {
                    return Err(FormatError::config(path, format!("mlp_only_layers must be a list, got {other}")));
                }
            },
        })),
        // gpt-oss: top-k of the router logits, then a softmax over the k, which is the softmax
        // over all experts renormalised over the chosen ones.
        Architecture::GptOss => Ok(Some(MoeConfig {
            num_experts: experts()?,
            experts_per_token: req("num_experts_per_tok")?,
            intermediate_size: req("intermediate_size")?,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
        })),
        Architecture::Mixtral => Ok(Some(MoeConfig {
            num_experts: experts()?,
            experts_per_token: req("num_experts_per_tok")?,
            intermediate_size: req("intermediate_size")?,
            // Mixtral always renormalises over the chosen experts (softmax over the top-k logits).
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
        })),
        Architecture::Llama
        | Architecture::Mistral
        | Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Gemma2
        | Architecture::Gemma3Text
        | Architecture::Phi3 => Ok(None),
    }
}

/// Reads an int, a list of ints, or null as a list of token ids.
pub(crate) fn parse_id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// Reads and parses a JSON file, with errors naming the file.
pub(crate) fn read_json(path: &Path) -> Result<Value, FormatError> {
    let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| FormatError::Json { path: path.to_path_buf(), message: e.to_string() })
}
