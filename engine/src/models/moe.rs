//! The routed mixture-of-experts MLP block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, Mixtral's
//! `block_sparse_moe`): a router, then every token's top-k experts, each a SiLU-gated MLP,
//! summed with the routing weights. It is a drop-in for the dense MLP of a decoder layer, so
//! the architectures whose attention is the Llama family's use it from `llama.rs` rather than
//! repeating that family's whole layer in a file of their own; a family with other MoE
//! details (shared experts, expert biases, another activation) extends this block.
//!
//! Invariants: the experts' weights are stacked in the layout [`MoeWeights`] documents (the
//! HF per-expert tensors, in expert order, gate rows before up rows), each tensor checked
//! against the config's shapes as it loads; the routing follows transformers (softmax over
//! all experts, top-k, renormalised over the k when `norm_topk_prob` / always for Mixtral,
//! ties to the lower expert index); the backend op is [`OptionalOp::Moe`], checked at load.

use super::{MlpKind, ModelLoadError, WeightLoader};
use crate::backend::{Backend, BackendError, MoeWeights, OptionalOp};
use baton_formats::{ExpertProj, ModelConfig};
use baton_kernels::cpu::{MoeRouting, MoeScoring};

/// One layer's experts and router on a backend.
pub struct MoeMlp<B: Backend> {
    router: B::Mat,
    gate_up: B::Mat,
    down: B::Mat,
    num_experts: usize,
    intermediate_size: usize,
    routing: MoeRouting,
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
        let router = w.mat(b, &[(cfg.router_tensor(layer), num_experts)], h)?;
        let gate_up_names: Vec<(String, usize)> = (0..num_experts)
            .flat_map(|e| [ExpertProj::Gate, ExpertProj::Up].map(|p| (cfg.expert_tensor(layer, e, p), inter)))
            .collect();
        let gate_up = w.mat(b, &gate_up_names, h)?;
        let down_names: Vec<(String, usize)> =
            (0..num_experts).map(|e| (cfg.expert_tensor(layer, e, ExpertProj::Down), h)).collect();
        let down = w.mat(b, &down_names, inter)?;
        let routing = MoeRouting { k: experts_per_token, scoring: MoeScoring::Softmax, renormalize, scale: 1.0 };
        Ok(Self { router, gate_up, down, num_experts, intermediate_size: inter, routing })
    }

    /// The block over `m` rows of `x` (normed hidden states) into `out`.
    pub fn forward(&self, b: &mut B, x: &B::Buf, m: usize, out: &mut B::Buf) -> Result<(), BackendError> {
        let w = MoeWeights {
            router: &self.router,
            gate_up: &self.gate_up,
            down: &self.down,
            num_experts: self.num_experts,
            intermediate_size: self.intermediate_size,
        };
        b.moe(x, m, w, self.routing, out)
    }
}
