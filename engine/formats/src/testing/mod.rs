//! Tiny random models for tests (this crate's, the engine's and the router's): a
//! [`TinySpec`] describes one; [`write_hf_folder`] and [`write_gguf`] write it as a HF
//! folder or a GGUF file with the same weights (a pure function of the spec and its seed)
//! and the same tokenizer. GGUF files use llama.cpp's Q/K row permutation, so loading them
//! exercises the real un-permutation.

pub mod bpe_learn;

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::config::{
    Architecture, ExpertProj, GemmaOptions, GenerationConfig, LayerType, LongRope, ModelConfig, MoeConfig,
    RopeParameters, RopeScaling, llama3_rope_divisors,
};
use crate::dummy::DummyStore;
use crate::error::FormatError;
use crate::gguf::{
    GgufType, GgufValue, GgufWriter, gemma_attention_scalar, gguf_experts_name, gguf_router_name, hf_to_gguf_name_for,
    permute_qk_rows, qk_permute_heads,
};
use crate::tensor::{DType, WeightStore, f32_to_bytes};
use crate::tokenizer::gguf_vocab::bpe_to_gguf_metadata;
use crate::tokenizer::{ByteLevelBpe, PreTokenizerKind};

pub use bpe_learn::{CORPUS, SPECIAL_TOKENS, learn_bpe};

/// Deterministic pseudo-random token ids: `len` of them below `vocab`, a pure function of
/// `seed` (xorshift64). For test prompts and benchmark loads.
pub fn random_token_ids(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// The ChatML template written into test models.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Id of `<|endoftext|>` (bos) in test tokenizers.
pub const BOS_ID: u32 = 0;
/// Id of `<|im_end|>` (eos) in test tokenizers.
pub const EOS_ID: u32 = 2;

/// Shape and seed of a tiny test model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    /// Model family.
    pub architecture: Architecture,
    /// Residual width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width when not `hidden_size / num_heads` (as in Mistral Nemo, Qwen3).
    pub head_dim: Option<usize>,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary size (the test tokenizer is learned to exactly this size).
    pub vocab_size: usize,
    /// Tied embeddings.
    pub tie_embeddings: bool,
    /// q/k/v biases.
    pub attention_bias: bool,
    /// RoPE scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE base.
    pub rope_theta: f32,
    /// Context length.
    pub max_position_embeddings: usize,
    /// Weight seed.
    pub seed: u64,
    /// Standard deviation of linear/embedding weights.
    pub init_std: f32,
    /// Pre-tokenizer of the test tokenizer.
    pub pre_tokenizer: PreTokenizerKind,
    /// Routed experts (Qwen3-MoE, Mixtral); `None` for a dense model.
    pub moe: Option<MoeConfig>,
    /// Gemma 2 / 3 options; `None` for the other families.
    pub gemma: Option<GemmaOptions>,
    /// The sliding window of a Gemma spec: Gemma 2 slides on even layers, Gemma 3 on five of
    /// every six (transformers' and llama.cpp's patterns).
    pub sliding_window: Option<usize>,
    /// RoPE of the sliding layers where it differs (Gemma 3's local base).
    pub sliding_rope: Option<RopeParameters>,
    /// Share of each head's dims that rotate (Phi-3 / Phi-4-mini).
    pub partial_rotary_factor: f32,
    /// LongRoPE factors (Phi-3).
    pub longrope: Option<LongRope>,
}

impl TinySpec {
    /// Llama, GQA (4 heads, 2 kv heads), untied.
    pub fn llama() -> Self {
        Self {
            architecture: Architecture::Llama,
            hidden_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: None,
            intermediate_size: 128,
            vocab_size: 384,
            tie_embeddings: false,
            attention_bias: false,
            rope_scaling: None,
            rope_theta: 10000.0,
            max_position_embeddings: 512,
            seed: 1,
            init_std: 0.08,
            pre_tokenizer: PreTokenizerKind::Smollm,
            moe: None,
            gemma: None,
            sliding_window: None,
            sliding_rope: None,
            partial_rotary_factor: 1.0,
            longrope: None,
        }
    }

    /// Qwen2 with q/k/v biases.
    pub fn qwen2() -> Self {
        Self {
            architecture: Architecture::Qwen2,
            attention_bias: true,
            rope_theta: 1_000_000.0,
            seed: 2,
            pre_tokenizer: PreTokenizerKind::Qwen2,
            ..Self::llama()
        }
    }

    /// Qwen3: per-head q/k norm, head_dim 32 (not hidden / heads), untied.
    pub fn qwen3() -> Self {
        Self {
            architecture: Architecture::Qwen3,
            head_dim: Some(32),
            rope_theta: 1_000_000.0,
            seed: 4,
            pre_tokenizer: PreTokenizerKind::Qwen2,
            ..Self::llama()
        }
    }

    /// Qwen3-MoE: Qwen3's attention, 3 layers of which the middle one stays dense
    /// (`mlp_only_layers`), the others 8 experts of width 32, top-2 *without* renormalising
    /// the chosen experts' weights (`norm_topk_prob` false, transformers' default: Mixtral
    /// covers the renormalised routing).
    pub fn qwen3_moe() -> Self {
        Self {
            architecture: Architecture::Qwen3Moe,
            num_layers: 3,
            seed: 5,
            moe: Some(MoeConfig {
                num_experts: 8,
                experts_per_token: 2,
                intermediate_size: 32,
                norm_topk_prob: false,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![1],
            }),
            ..Self::qwen3()
        }
    }

    /// Mixtral: Llama's attention (GQA), every layer 8 experts of width 64 (the config's
    /// `intermediate_size`), top-2 renormalised.
    pub fn mixtral() -> Self {
        Self {
            architecture: Architecture::Mixtral,
            intermediate_size: 64,
            rope_theta: 1_000_000.0,
            seed: 6,
            moe: Some(MoeConfig {
                num_experts: 8,
                experts_per_token: 2,
                intermediate_size: 64,
                norm_topk_prob: true,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
            }),
            ..Self::llama()
        }
    }

    /// Gemma 2: 4 layers sliding on even ones (window 16), both soft-caps, head_dim 32 with
    /// `query_pre_attn_scalar` 32 (the only value a llama.cpp file of this size can express),
    /// tied embeddings.
    pub fn gemma2() -> Self {
        Self {
            architecture: Architecture::Gemma2,
            num_layers: 4,
            head_dim: Some(32),
            tie_embeddings: true,
            seed: 7,
            gemma: Some(GemmaOptions {
                query_pre_attn_scalar: 32.0,
                attn_logit_softcapping: Some(50.0),
                final_logit_softcapping: Some(30.0),
            }),
            sliding_window: Some(16),
            ..Self::llama()
        }
    }

    /// Gemma 3 (text): 7 layers of which the sixth is global (window 16 elsewhere), q/k norm,
    /// global RoPE base 1e6 with linear scaling 8, local base 1e4, no soft-caps, tied.
    pub fn gemma3() -> Self {
        Self {
            architecture: Architecture::Gemma3Text,
            num_layers: 7,
            rope_theta: 1_000_000.0,
            rope_scaling: Some(RopeScaling::Linear { factor: 8.0 }),
            seed: 8,
            gemma: Some(GemmaOptions {
                query_pre_attn_scalar: 32.0,
                attn_logit_softcapping: None,
                final_logit_softcapping: None,
            }),
            sliding_rope: Some(RopeParameters { theta: 10000.0, scaling: None }),
            ..Self::gemma2()
        }
    }

    /// Phi-3 / Phi-4-mini: fused qkv and gate_up, three quarters of each head's dims rotating,
    /// LongRoPE (long factors: the served context passes the original one), a sliding window on
    /// every layer, tied embeddings.
    pub fn phi3() -> Self {
        let rotary_half = 16 * 3 / 4 / 2;
        Self {
            architecture: Architecture::Phi3,
            tie_embeddings: true,
            seed: 9,
            sliding_window: Some(24),
            partial_rotary_factor: 0.75,
            longrope: Some(LongRope {
                short_factor: (0..rotary_half).map(|i| 1.0 + i as f32 * 0.05).collect(),
                long_factor: (0..rotary_half).map(|i| 1.5 + i as f32 * 0.25).collect(),
                original_max_position_embeddings: 128,
                attention_factor: 1.2,
                use_long: true,
            }),
            ..Self::llama()
        }
    }

    /// Llama with tied embeddings and Llama 3.1 RoPE scaling.
    pub fn tied() -> Self {
        Self {
            tie_embeddings: true,
            rope_scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            rope_theta: 500_000.0,
            // Above the original 8192 context, as transformers expects for llama3 scaling.
            max_position_embeddings: 16384,
            seed: 3,
            pre_tokenizer: PreTokenizerKind::Llama3,
            ..Self::llama()
        }
    }

    /// The variants committed as golden fixtures (smaller MLP and vocabulary so that all
    /// of them stay under 1 MB): `llama` (untied), `qwen2` (biases, tied), `tied` (llama3 rope).
    pub fn golden_set() -> Vec<(&'static str, TinySpec)> {
        let shrink = |s: TinySpec| TinySpec { intermediate_size: 64, vocab_size: 288, ..s };
        vec![
            ("llama", shrink(Self::llama())),
            ("qwen2", shrink(TinySpec { tie_embeddings: true, ..Self::qwen2() })),
            ("tied", shrink(Self::tied())),
        ]
    }

    /// The model config this spec describes.
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            architecture: self.architecture,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_layers,
            num_attention_heads: self.num_heads,
            num_key_value_heads: self.num_kv_heads,
            head_dim: self.head_dim.unwrap_or(self.hidden_size / self.num_heads.max(1)),
            vocab_size: self.vocab_size,
            rms_norm_eps: 1e-5,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling,
            longrope: self.longrope.clone(),
            partial_rotary_factor: self.partial_rotary_factor,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_embeddings,
            attention_bias: self.attention_bias,
            layer_types: self.layer_types(),
            sliding_window: self.sliding_window,
            sliding_rope: self.sliding_rope,
            bos_token_id: Some(BOS_ID),
            eos_token_ids: vec![EOS_ID],
            moe: self.moe.clone(),
            gemma: self.gemma,
            gpt_oss: None,
            quantization: None,
        }
    }

    /// The layers' kinds: sliding where the family's pattern says so and a window is set.
    fn layer_types(&self) -> Vec<LayerType> {
        let n = self.num_layers;
        match (self.sliding_window, self.architecture) {
            (Some(_), Architecture::Gemma2) => LayerType::periodic(n, 2),
            (Some(_), Architecture::Gemma3Text) => LayerType::periodic(n, 6),
            (Some(_), Architecture::Phi3) => vec![LayerType::Sliding; n],
            _ => vec![LayerType::Full; n],
        }
    }

    /// The weights, by HF name, as f32 (identical for every file format).
    pub fn weights(&self) -> DummyStore {
        DummyStore::new(&self.config(), self.seed, self.init_std, DType::F32)
    }

    /// The test tokenizer of this spec.
    pub fn tokenizer_spec(&self) -> Result<ByteLevelBpe, FormatError> {
        learn_bpe(self.vocab_size, self.pre_tokenizer)
    }
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), FormatError> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| FormatError::Json { path: path.to_path_buf(), message: e.to_string() })?;
    std::fs::write(path, text).map_err(|e| FormatError::io(path, e))
}

/// Writes `spec` as a HF folder in `dir` (created if needed): config.json, model.safetensors
/// (f32), tokenizer.json, tokenizer_config.json (ChatML template), generation_config.json.
pub fn write_hf_folder(dir: &Path, spec: &TinySpec) -> Result<PathBuf, FormatError> {
    std::fs::create_dir_all(dir).map_err(|e| FormatError::io(dir, e))?;
    let config = spec.config();
    config.validate()?;
    write_json(&dir.join("config.json"), &config.to_hf_json())?;
    let store = spec.weights();
    let mut tensors = Vec::new();
    for (name, shape) in config.expected_tensors() {
        tensors.push((name.clone(), shape, f32_to_bytes(&store.values(&name)?)));
    }
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| FormatError::InvalidArgument(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let st_path = dir.join("model.safetensors");
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &st_path)
        .map_err(|e| FormatError::Safetensors { path: st_path.clone(), message: e.to_string() })?;
    let bpe = spec.tokenizer_spec()?;
    let tok = bpe.build("test tokenizer")?;
    let tok_path = dir.join("tokenizer.json");
    tok.save(&tok_path, false)
        .map_err(|e| FormatError::Tokenizer { context: tok_path.display().to_string(), message: e.to_string() })?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "bos_token": SPECIAL_TOKENS[BOS_ID as usize],
            "eos_token": SPECIAL_TOKENS[EOS_ID as usize],
            "pad_token": SPECIAL_TOKENS[BOS_ID as usize],
            "add_bos_token": false,
            "chat_template": CHATML_TEMPLATE,
            "model_max_length": spec.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }),
    )?;
    write_json(&dir.join("generation_config.json"), &GenerationConfig::from_model(&config).to_hf_json())?;
    Ok(dir.to_path_buf())
}

/// Writes `spec` as a GGUF v3 file: 2-D tensors as `tensor_type`, 1-D ones as F32 (as
/// llama.cpp does), Q/K rows permuted for `llama`-architecture files, the tokenizer and
/// ChatML template in the metadata, and `rope_freqs.weight` for Llama 3 scaling. A
/// mixture-of-experts spec is written as llama.cpp's converter writes Qwen3-MoE (`qwen3moe`)
/// and Mixtral (`llama` with an expert count): each MoE layer's router and its experts stacked
/// per projection (`[experts, out, in]`), the routing in the metadata.
pub fn write_gguf(path: &Path, spec: &TinySpec, tensor_type: GgufType) -> Result<PathBuf, FormatError> {
    let w = gguf_writer(spec, tensor_type)?;
    w.write(path)?;
    Ok(path.to_path_buf())
}

/// The writer [`write_gguf`] uses, for tests that need to alter or re-version the file.
pub fn gguf_writer(spec: &TinySpec, tensor_type: GgufType) -> Result<GgufWriter, FormatError> {
    let config = spec.config();
    config.validate()?;
    let arch = match config.architecture {
        Architecture::Qwen2 => "qwen2",
        Architecture::Qwen3 => "qwen3",
        Architecture::Llama | Architecture::Mistral | Architecture::Mixtral => "llama",
        Architecture::Qwen3Moe => "qwen3moe",
        Architecture::GptOss => {
            return Err(FormatError::unsupported(Path::new("gguf"), "gpt-oss GGUF (not written or read)"));
        }
        Architecture::Gemma2 => "gemma2",
        Architecture::Gemma3Text => "gemma3",
        Architecture::Phi3 => "phi3",
    };
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", GgufValue::String(arch.into()));
    w.add_meta("general.name", GgufValue::String(format!("baton-tiny-{arch}")));
    w.add_meta("general.alignment", GgufValue::U32(32));
    let u = |v: usize| GgufValue::U32(v as u32);
    let k = |s: &str| format!("{arch}.{s}");
    w.add_meta(&k("context_length"), u(config.max_position_embeddings));
    w.add_meta(&k("embedding_length"), u(config.hidden_size));
    w.add_meta(&k("block_count"), u(config.num_hidden_layers));
    w.add_meta(&k("feed_forward_length"), u(config.intermediate_size));
    w.add_meta(&k("rope.dimension_count"), u(config.rotary_dim()));
    w.add_meta(&k("attention.head_count"), u(config.num_attention_heads));
    w.add_meta(&k("attention.head_count_kv"), u(config.num_key_value_heads));
    w.add_meta(&k("attention.key_length"), u(config.head_dim));
    w.add_meta(&k("attention.value_length"), u(config.head_dim));
    w.add_meta(&k("attention.layer_norm_rms_epsilon"), GgufValue::F32(config.rms_norm_eps));
    w.add_meta(&k("rope.freq_base"), GgufValue::F32(config.rope_theta));
    w.add_meta(&k("vocab_size"), u(config.vocab_size));
    if let Some(gemma) = &config.gemma {
        // What llama.cpp's Gemma converter writes; the attention scale is not in the file, so a
        // spec whose scale the size rule would not give cannot be written faithfully.
        let rule = gemma_attention_scalar(
            config.architecture,
            config.num_hidden_layers,
            config.hidden_size / config.num_attention_heads,
            config.head_dim,
        );
        if gemma.query_pre_attn_scalar != rule {
            return Err(FormatError::InvalidArgument(format!(
                "query_pre_attn_scalar {} is not what a {arch} GGUF of this size implies ({rule})",
                gemma.query_pre_attn_scalar
            )));
        }
        if let Some(window) = config.sliding_window {
            w.add_meta(&k("attention.sliding_window"), u(window));
        }
        for (key, cap) in [
            ("attn_logit_softcapping", gemma.attn_logit_softcapping),
            ("final_logit_softcapping", gemma.final_logit_softcapping),
        ] {
            if let Some(c) = cap {
                w.add_meta(&k(key), GgufValue::F32(c));
            }
        }
        if let Some(s) = config.sliding_rope.filter(|s| s.theta != 10000.0 || arch == "gemma2") {
            w.add_meta(&k("rope.freq_base_swa"), GgufValue::F32(s.theta));
        }
    }
    if config.architecture == Architecture::Phi3 {
        // What llama.cpp's Phi-3 converter writes (0: no window, as for Phi-4-mini).
        w.add_meta(&k("attention.sliding_window"), u(config.sliding_window.unwrap_or(0)));
        if let Some(lr) = &config.longrope {
            w.add_meta(&k("rope.scaling.original_context_length"), u(lr.original_max_position_embeddings));
            w.add_meta(&k("rope.scaling.attn_factor"), GgufValue::F32(lr.attention_factor));
            w.add_tensor("rope_factors_long.weight", &[lr.long_factor.len()], GgufType::F32, &lr.long_factor)?;
            w.add_tensor("rope_factors_short.weight", &[lr.short_factor.len()], GgufType::F32, &lr.short_factor)?;
        }
    }
    if let Some(moe) = &config.moe {
        w.add_meta(&k("expert_count"), u(moe.num_experts));
        w.add_meta(&k("expert_used_count"), u(moe.experts_per_token));
        if config.architecture == Architecture::Qwen3Moe {
            w.add_meta(&k("expert_feed_forward_length"), u(moe.intermediate_size));
        }
        // llama.cpp renormalises unless told otherwise.
        if !moe.norm_topk_prob {
            w.add_meta(&k("expert_weights_norm"), GgufValue::Bool(false));
        }
    }
    if let Some(RopeScaling::Linear { factor }) = config.rope_scaling {
        w.add_meta(&k("rope.scaling.type"), GgufValue::String("linear".into()));
        w.add_meta(&k("rope.scaling.factor"), GgufValue::F32(factor));
    }
    let bpe = spec.tokenizer_spec()?;
    for (key, v) in bpe_to_gguf_metadata(&bpe, Some(EOS_ID)) {
        w.add_meta(&key, v);
    }
    w.add_meta("tokenizer.chat_template", GgufValue::String(CHATML_TEMPLATE.into()));
    let store = spec.weights();
    // The MoE layers' routers and experts, written stacked below rather than one by one.
    let mut moe_names = std::collections::HashSet::new();
    if let Some(moe) = &config.moe {
        for layer in (0..config.num_hidden_layers).filter(|&l| moe.is_moe_layer(l)) {
            let router = config.router_tensor(layer);
            let values = store.values(&router)?;
            w.add_tensor(&gguf_router_name(layer), &[moe.num_experts, config.hidden_size], tensor_type, &values)?;
            moe_names.insert(router);
            for proj in [ExpertProj::Gate, ExpertProj::Up, ExpertProj::Down] {
                let mut stacked = Vec::new();
                let mut rows_cols = Vec::new();
                for e in 0..moe.num_experts {
                    let name = config.expert_tensor(layer, e, proj);
                    rows_cols = store.shape(&name)?;
                    stacked.extend(store.values(&name)?);
                    moe_names.insert(name);
                }
                let shape = [vec![moe.num_experts], rows_cols].concat();
                w.add_tensor(&gguf_experts_name(layer, proj), &shape, tensor_type, &stacked)?;
            }
        }
    }
    for (name, shape) in config.expected_tensors().into_iter().filter(|(n, _)| !moe_names.contains(n)) {
        let mut values = store.values(&name)?;
        if let Some(n) = qk_permute_heads(&config, &name) {
            let bytes = permute_qk_rows(&f32_to_bytes(&values), shape[0], n, true)
                .ok_or_else(|| FormatError::InvalidArgument(format!("{name}: rows do not split into {n} heads")))?;
            values = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        }
        // llama.cpp's Gemma converter stores each norm weight as its factor, 1 + w.
        if config.gemma.is_some() && name.ends_with("norm.weight") {
            values.iter_mut().for_each(|v| *v += 1.0);
        }
        let ty = if shape.len() == 1 { GgufType::F32 } else { tensor_type };
        let gname = hf_to_gguf_name_for(&name, config.architecture)
            .ok_or_else(|| FormatError::InvalidArgument(format!("no GGUF name for {name}")))?;
        w.add_tensor(&gname, &shape, ty, &values)?;
    }
    if let Some(s @ RopeScaling::Llama3 { .. }) = &config.rope_scaling {
        let div = llama3_rope_divisors(config.rope_theta, config.head_dim, s);
        w.add_tensor("rope_freqs.weight", &[div.len()], GgufType::F32, &div)?;
    }
    Ok(w)
}

/// Where the golden fixtures (tiny HF folders + transformers outputs) are committed.
pub fn golden_fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden")
}

/// The GGUF fixtures (`scripts/golden/make_gguf_gpt_oss.py`): golden checkpoints written as
/// llama.cpp's converter writes them.
pub fn gguf_fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

/// Where `scripts/fetch-default-model.sh` puts the default model.
pub fn default_model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// One prompt of a golden fixture (`golden.json`, written by scripts/golden/make_golden.py).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct GoldenPrompt {
    /// Prompt token ids.
    pub ids: Vec<u32>,
    /// transformers' float32 logits at the last prompt position (full vocabulary).
    pub last_logits: Vec<f32>,
    /// Greedy continuation (argmax, no cache, no EOS stop).
    pub greedy: Vec<u32>,
    /// Smallest top-2 logit margin along the greedy run.
    #[serde(default)]
    pub greedy_min_gap: f32,
    /// Top-2 logit margin at the last prompt position (fixtures from `make_hf_tiny.py`).
    #[serde(default)]
    pub top2_gap: f32,
}

/// A golden fixture's reference outputs.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Golden {
    /// Fixture name (`llama`, `qwen2`, `tied`).
    pub model: String,
    /// transformers version that produced it.
    pub transformers: String,
    /// One entry per prompt.
    pub prompts: Vec<GoldenPrompt>,
}

/// The model folder and reference outputs of golden fixture `name` (see
/// [`TinySpec::golden_set`]); load the folder with `load_model(.., LoadFormat::Auto)`.
pub fn load_golden(name: &str) -> Result<(PathBuf, Golden), FormatError> {
    let dir = golden_fixtures_dir().join(name);
    let golden = read_golden(&dir.join("golden.json"))?;
    Ok((dir, golden))
}

/// The model files of golden fixture `name` copied into `dst` (created), without the
/// reference files beside them: the golden outputs and `dequantized.safetensors`
/// (`gpt_oss_mxfp4`'s expected dequantization, which a loader would read as one more shard,
/// serving the experts from it instead of dequantizing the MXFP4 ones). Returns `dst`.
pub fn golden_checkpoint_copy(name: &str, dst: &Path) -> Result<PathBuf, FormatError> {
    const REFERENCES: [&str; 3] = ["dequantized.safetensors", "golden.json", "golden_bf16.json"];
    let src = golden_fixtures_dir().join(name);
    std::fs::create_dir_all(dst).map_err(|e| FormatError::io(dst, e))?;
    for entry in std::fs::read_dir(&src).map_err(|e| FormatError::io(&src, e))? {
        let path = entry.map_err(|e| FormatError::io(&src, e))?.path();
        let Some(file) = path.file_name() else { continue };
        if path.is_file() && !REFERENCES.iter().any(|r| file == *r) {
            std::fs::copy(&path, dst.join(file)).map_err(|e| FormatError::io(&path, e))?;
        }
    }
    Ok(dst.to_path_buf())
}

/// Golden fixture `name`'s outputs from transformers' bf16 forward (`golden_bf16.json`, written
/// by `scripts/golden/make_hf_tiny.py` beside the f32 `golden.json`).
pub fn load_golden_bf16(name: &str) -> Result<Golden, FormatError> {
    read_golden(&golden_fixtures_dir().join(name).join("golden_bf16.json"))
}

fn read_golden(path: &std::path::Path) -> Result<Golden, FormatError> {
    let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| FormatError::Json { path: path.to_path_buf(), message: e.to_string() })
}
