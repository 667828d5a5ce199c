//! The routed mixture-of-experts MLP block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, Mixtral's
//! `block_sparse_moe`, gpt-oss's `GptOssMLP`): a router, then every token's top-k experts,
//! each a gated MLP, summed with the routing weights. It is a drop-in for the dense MLP of a
//! decoder layer, so the architectures use it from their own files (`llama.rs`,
//! `gpt_oss.rs`) rather than each repeating it; a family with other MoE details extends this
//! block (gpt-oss: biases on the router and the experts, the clamped SwiGLU, experts stored
//! fused and transposed).
//!
//! Invariants: the experts' weights are stacked in the layout [`MoeWeights`] documents (the
//! HF per-expert tensors, in expert order, gate rows before up rows; gpt-oss's fused
//! `[E, hidden, 2·inter]` tensors transposed per expert, gate and up rows interleaved as its
//! columns are), each tensor checked against the config's shapes as it loads; the routing
//! follows transformers (softmax over all experts, top-k, renormalised over the k when
//! `norm_topk_prob` / always for Mixtral and gpt-oss, whose top-k-then-softmax is the same
//! function; ties to the lower expert index); the backend op is [`OptionalOp::Moe`], checked
//! at load.

use super::{MlpKind, ModelLoadError, WeightLoader};
use crate::backend::{Backend, BackendError, MoeActivation, MoeWeights, OptionalOp};
use baton_formats::{Architecture, ExpertProj, ModelConfig};
use baton_kernels::cpu::{MoeRouting, MoeScoring};

/// One layer's experts and router on a backend.
pub struct MoeMlp<B: Backend> {
    router: B::Mat,
    gate_up: B::Mat,
    down: B::Mat,
    /// Router, gate/up and down biases (gpt-oss; `None` elsewhere).
    biases: Option<[B::Buf; 3]>,
    num_experts: usize,
    intermediate_size: usize,
    routing: MoeRouting,
    activation: MoeActivation,
}

impl<B: Backend> MoeMlp<B> {
    /// Reads layer `layer`'s router and experts (`kind` must be [`MlpKind::Moe`]); refuses a
    /// backend without the MoE op.
    pub fn load(
        cfg: &ModelConfig,
        layer: usize,
        kind: MlpKind,
        w: &mut WeightLoader<'_>,
        b: &mut B,
    ) -> Result<Self, ModelLoadError> {
        let unsupported = |b: &B, what: String| ModelLoadError::Unsupported {
            architecture: cfg.architecture.model_type(),
            device: b.device_name(),
            what,
        };
        let MlpKind::Moe { num_experts, experts_per_token, intermediate_size, renormalize } = kind else {
            return Err(unsupported(b, format!("layer {layer}: MLP {kind:?} is not a mixture of experts")));
        };
        if !b.supports(OptionalOp::Moe) {
            return Err(unsupported(b, format!("layer {layer} needs {}", OptionalOp::Moe.name())));
        }
        let h = cfg.hidden_size;
        let inter = intermediate_size;
        let routing = MoeRouting { k: experts_per_token, scoring: MoeScoring::Softmax, renormalize, scale: 1.0 };
        let router = w.mat(b, &[(cfg.router_tensor(layer), num_experts)], h)?;
        if cfg.architecture == Architecture::GptOss {
            let opts = cfg.gpt_oss.ok_or_else(|| unsupported(b, "a gpt-oss config without its options".into()))?;
            let (p, e) = (format!("model.layers.{layer}.mlp"), num_experts);
            let biases = [
                w.vec(b, &[(format!("{p}.router.bias"), e)])?,
                w.vec(b, &[(format!("{p}.experts.gate_up_proj_bias"), e * 2 * inter)])?,
                w.vec(b, &[(format!("{p}.experts.down_proj_bias"), e * h)])?,
            ];
            return Ok(Self {
                router,
                gate_up: w.mat_transposed(b, &format!("{p}.experts.gate_up_proj"), e, 2 * inter, h)?,
                down: w.mat_transposed(b, &format!("{p}.experts.down_proj"), e, h, inter)?,
                biases: Some(biases),
                num_experts,
                intermediate_size: inter,
                routing,
                activation: MoeActivation::ClampedSwiglu { alpha: opts.swiglu_alpha, limit: opts.swiglu_limit },
            });
        }
        let gate_up_names: Vec<(String, usize)> = (0..num_experts)
            .flat_map(|e| [ExpertProj::Gate, ExpertProj::Up].map(|p| (cfg.expert_tensor(layer, e, p), inter)))
            .collect();
        let gate_up = w.experts(b, &gate_up_names, h)?;
        let down_names: Vec<(String, usize)> =
            (0..num_experts).map(|e| (cfg.expert_tensor(layer, e, ExpertProj::Down), h)).collect();
        let down = w.experts(b, &down_names, inter)?;
        Ok(Self {
            router,
            gate_up,
            down,
            biases: None,
            num_experts,
            intermediate_size: inter,
            routing,
            activation: MoeActivation::SiluGated,
        })
    }

    /// The block over `m` rows of `x` (normed hidden states) into `out`.
    pub fn forward(&self, b: &mut B, x: &B::Buf, m: usize, out: &mut B::Buf) -> Result<(), BackendError> {
        let (w, routing) = self.weights();
        b.moe(x, m, w, routing, out)
    }

    /// The block's weights and routing as the backend's MoE ops take them.
    pub fn weights(&self) -> (MoeWeights<'_, B::Mat, B::Buf>, MoeRouting) {
        let [router_bias, gate_up_bias, down_bias] = match &self.biases {
            Some([r, g, d]) => [Some(r), Some(g), Some(d)],
            None => [None; 3],
        };
        let w = MoeWeights {
            router: &self.router,
            router_bias,
            gate_up: &self.gate_up,
            gate_up_bias,
            down: &self.down,
            down_bias,
            num_experts: self.num_experts,
            intermediate_size: self.intermediate_size,
            activation: self.activation,
        };
        (w, self.routing)
    }
}
