//! The per-layer spec: what kind of attention and MLP each decoder layer runs, with its
//! head geometry and rotary parameters. An architecture builds its layers from these rather
//! than from the flat config, so a model whose layers differ (sliding-window layers between
//! full ones, MoE layers between dense ones, per-layer-type RoPE) is described by data, and
//! an architecture refuses at load any kind it does not implement.
//!
//! Invariants: [`LayerSpec::from_config`] returns one spec per layer, in order; every spec it
//! returns was derived from options the config parser accepted (options that change the math
//! and are not implemented are refused there, naming them).

use baton_formats::{LayerType, ModelConfig, RopeScaling};
use baton_kernels::cpu::{KernelError, RopeScalingKind, RopeTable};

/// How a layer attends.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum AttentionKind {
    /// Causal attention over the whole context.
    Full,
    /// Causal attention over the last `window` positions (Mistral, Gemma 2/3 local layers,
    /// gpt-oss's alternating layers).
    SlidingWindow {
        /// Positions attended to, the current one included.
        window: usize,
    },
}

/// What a layer's MLP is.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum MlpKind {
    /// One gated MLP (`down(act(gate) * up)`).
    Dense {
        /// Inner width.
        intermediate_size: usize,
    },
    /// A routed mixture of gated experts (Qwen3-MoE, Mixtral, gpt-oss).
    Moe {
        /// Experts in the layer.
        num_experts: usize,
        /// Experts each token is routed to.
        experts_per_token: usize,
        /// Inner width of each expert.
        intermediate_size: usize,
        /// The chosen experts' weights are renormalised to sum to 1 (Mixtral; Qwen3-MoE's
        /// `norm_topk_prob`).
        renormalize: bool,
    },
}

/// Rotary position embedding of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    /// RoPE base.
    pub theta: f32,
    /// Frequency scaling, if any.
    pub scaling: Option<RopeScaling>,
}

impl RopeSpec {
    /// The rotary table of this spec for heads of `head_dim`.
    pub fn table(&self, head_dim: usize) -> Result<RopeTable, KernelError> {
        let kind = match self.scaling {
            None => RopeScalingKind::None,
            Some(RopeScaling::Linear { factor }) => RopeScalingKind::Linear { factor },
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                RopeScalingKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }
            }
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            }) => RopeScalingKind::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            },
        };
        RopeTable::new(head_dim, self.theta, kind)
    }
}

/// One decoder layer, as an architecture builds and runs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    /// Attention kind.
    pub attention: AttentionKind,
    /// MLP kind.
    pub mlp: MlpKind,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Rotary parameters.
    pub rope: RopeSpec,
    /// q and k are RMS-normalised per head (over `head_dim`) before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
}

impl LayerSpec {
    /// One spec per layer of `cfg`, from its `layer_types` (the window of sliding layers and
    /// their RoPE where it differs) and its experts (which layers are MoE:
    /// `MoeConfig::is_moe_layer`).
    pub fn from_config(cfg: &ModelConfig) -> Vec<LayerSpec> {
        cfg.layer_types
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let rope = cfg.rope_for(kind);
                let mlp = match cfg.moe.as_ref().filter(|m| m.is_moe_layer(i)) {
                    Some(m) => MlpKind::Moe {
                        num_experts: m.num_experts,
                        experts_per_token: m.experts_per_token,
                        intermediate_size: m.intermediate_size,
                        renormalize: m.norm_topk_prob,
                    },
                    None => MlpKind::Dense { intermediate_size: cfg.intermediate_size },
                };
                LayerSpec {
                    attention: match (kind, cfg.sliding_window) {
                        (LayerType::Sliding, Some(window)) => AttentionKind::SlidingWindow { window },
                        _ => AttentionKind::Full,
                    },
                    mlp,
                    num_heads: cfg.num_attention_heads,
                    num_kv_heads: cfg.num_key_value_heads,
                    head_dim: cfg.head_dim,
                    rope: RopeSpec { theta: rope.theta, scaling: rope.scaling },
                    qk_norm: cfg.qk_norm(),
                }
            })
            .collect()
    }

    /// Whether this layer's attention equals full attention for every context up to
    /// `max_len` tokens (a window at least that long never cuts anything off).
    pub fn attends_fully_up_to(&self, max_len: usize) -> bool {
        self.window_within(max_len).is_none()
    }

    /// The window this layer must attend within at contexts up to `max_len` tokens; `None`
    /// when it attends fully there (no window, or one at least `max_len` long).
    pub fn window_within(&self, max_len: usize) -> Option<usize> {
        match self.attention {
            AttentionKind::SlidingWindow { window } if window < max_len => Some(window),
            _ => None,
        }
    }
}
