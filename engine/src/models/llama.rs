//! The Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2 with q/k/v biases,
//! SmolLM2): weights and forward only, over the [`Backend`] ops.
//!
//! Weights are fused where it saves GEMM launches: `[q; k; v]` into one matrix and
//! `[gate; up]` into another. One [`Architecture::forward_layers`] runs a whole mixed
//! batch (prefill chunks and decode rows alike). A dense layer ends in a branch boundary that
//! computes the next layer's qkv and, where that layer has no q/k norm, its RoPE and KV write
//! ([`BoundaryRope`]), which a backend may fuse into the projection.
//!
//! Qwen3-MoE and Mixtral are the same layers with routed experts instead of the dense MLP
//! where their [`LayerSpec`] says [`MlpKind::Moe`] (the block is `super::moe`, shared by
//! every family whose attention is this one's).
//! Phi-3 / Phi-4-mini are the same layout too: their checkpoints already store `qkv_proj`
//! and `gate_up_proj` fused, they may rotate only part of each head
//! (`ModelConfig::rotary_dim`) and use LongRoPE (`ModelConfig::longrope`).
//!
//! Qwen3 dense is the same layout with a per-head RMSNorm of q and k before RoPE
//! ([`LayerSpec::qk_norm`], an optional backend op) and its own head_dim; `attention_bias`
//! puts biases on q/k/v (and on o_proj where the family does, see
//! `ModelConfig::o_proj_bias`).
//!
//! Sliding layers (Mistral's `sliding_window`, Qwen2/Qwen3's `use_sliding_window` from
//! `max_window_layers` on, Phi-3's) attend within their window through
//! [`Backend::attention_ext`] (an optional op, checked at load), which never reads keys before
//! the window; a window at least as long as the served context is plain attention.
//!
//! Invariants: every layer has a SiLU-gated MLP, dense or routed experts, and one shared
//! rotary table (other [`LayerSpec`]s are refused at load); activation buffers are reused
//! across steps and only grow.

use super::moe::MoeMlp;
use super::{AfterKv, Architecture, LayerSpec, MlpKind, ModelLoadError, RopeSpec, WeightLoader};
use crate::backend::{
    AttentionExtras, Backend, BackendError, BatchLayout, BoundaryRope, BoundaryScratch, BranchBoundary, Gate, GateAct,
    MoeBranch, OptionalOp,
};
use baton_formats::ModelConfig;
use baton_kernels::cpu::RopeTable;

struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_attn_norm: B::Buf,
    qkv: B::Mat,
    qkv_bias: Option<B::Buf>,
    /// Per-head RMSNorm weights of q and k (`head_dim` each), applied before RoPE.
    qk_norm: Option<(B::Buf, B::Buf)>,
    o: B::Mat,
    o_bias: Option<B::Buf>,
    /// The sliding window of a layer whose window is shorter than the served context
    /// (Mistral's, Qwen2's `use_sliding_window` layers, Phi-3's); `None` attends over the whole
    /// context.
    window: Option<usize>,
    mlp: Mlp<B>,
}

/// A layer's MLP.
enum Mlp<B: Backend> {
    /// `down(silu(gate) * up)` with `[gate; up]` fused, `intermediate_size` wide.
    Dense { gate_up: B::Mat, down: B::Mat, intermediate_size: usize },
    /// Routed experts.
    Moe(MoeMlp<B>),
}

/// Activation buffers reused across steps (resized per batch).
struct Workspace<B: Backend> {
    residual: B::Res,
    hidden: B::Buf,
    qkv: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
    proj: B::Buf,
    gate_up: B::Buf,
    act: B::Buf,
    last: B::Buf,
    last_res: B::Res,
}

/// The Llama family's weights and activations on a backend.
pub struct Llama<B: Backend> {
    cfg: ModelConfig,
    specs: Vec<LayerSpec>,
    /// Every layer's rotary parameters.
    rope: RopeSpec,
    embed: B::Mat,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Mat>,
    final_norm: B::Buf,
    layers: Vec<Layer<B>>,
    ws: Workspace<B>,
    /// Rows of the last forward.
    rows: usize,
}

impl<B: Backend> Llama<B> {
    /// Reads every tensor of `cfg` through `w` into `b`.
    pub fn load(cfg: &ModelConfig, w: &mut WeightLoader<'_>, b: &mut B) -> Result<Self, ModelLoadError> {
        let specs = LayerSpec::from_config(cfg);
        let rope = RopeSpec { theta: cfg.rope_theta, scaling: cfg.rope_scaling };
        let unsupported = |what: String| ModelLoadError::Unsupported {
            architecture: cfg.architecture.model_type(),
            device: b.device_name(),
            what,
        };
        for (i, s) in specs.iter().enumerate() {
            if !s.attends_fully_up_to(cfg.max_position_embeddings) && !b.supports(OptionalOp::AttentionExtras) {
                return Err(unsupported(format!("layer {i} needs {}", OptionalOp::AttentionExtras.name())));
            }
            if s.qk_norm && !b.supports(OptionalOp::HeadRmsNorm) {
                return Err(unsupported(format!("layer {i} needs {}", OptionalOp::HeadRmsNorm.name())));
            }
            // The backend holds one rotary table and the cache one head geometry.
            if (s.rope, s.head_dim, s.num_heads, s.num_kv_heads)
                != (rope, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
            {
                return Err(unsupported(format!("layer {i}: heads or RoPE differing from the other layers'")));
            }
        }
        let h = cfg.hidden_size;
        let hd = cfg.head_dim;
        let qd = cfg.num_attention_heads * hd;
        let kvd = cfg.num_key_value_heads * hd;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(w.mat(b, &[("lm_head.weight".into(), cfg.vocab_size)], h)?)
        };
        let embed = w.mat(b, &[("model.embed_tokens.weight".into(), cfg.vocab_size)], h)?;
        let final_norm = w.vec(b, &[("model.norm.weight".into(), h)])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, spec) in specs.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let attn = |n: &str, rows: usize| (format!("{p}.self_attn.{n}"), rows);
            let qkv_bias = if cfg.attention_bias {
                Some(w.vec(b, &[attn("q_proj.bias", qd), attn("k_proj.bias", kvd), attn("v_proj.bias", kvd)])?)
            } else {
                None
            };
            let qk_norm = if spec.qk_norm {
                Some((w.vec(b, &[attn("q_norm.weight", hd)])?, w.vec(b, &[attn("k_norm.weight", hd)])?))
            } else {
                None
            };
            let o_bias = if cfg.o_proj_bias() { Some(w.vec(b, &[attn("o_proj.bias", h)])?) } else { None };
            layers.push(Layer {
                input_norm: w.vec(b, &[(format!("{p}.input_layernorm.weight"), h)])?,
                post_attn_norm: w.vec(b, &[(format!("{p}.post_attention_layernorm.weight"), h)])?,
                qkv: if cfg.fused_checkpoint() {
                    w.linear(b, &[attn("qkv_proj.weight", qd + 2 * kvd)], h)?
                } else {
                    w.linear(
                        b,
                        &[attn("q_proj.weight", qd), attn("k_proj.weight", kvd), attn("v_proj.weight", kvd)],
                        h,
                    )?
                },
                qkv_bias,
                qk_norm,
                o: w.linear(b, &[attn("o_proj.weight", h)], qd)?,
                o_bias,
                window: spec.window_within(cfg.max_position_embeddings),
                mlp: match spec.mlp {
                    MlpKind::Dense { intermediate_size: inter } => Mlp::Dense {
                        gate_up: if cfg.fused_checkpoint() {
                            w.linear(b, &[(format!("{p}.mlp.gate_up_proj.weight"), 2 * inter)], h)?
                        } else {
                            w.linear(
                                b,
                                &[
                                    (format!("{p}.mlp.gate_proj.weight"), inter),
                                    (format!("{p}.mlp.up_proj.weight"), inter),
                                ],
                                h,
                            )?
                        },
                        down: w.linear(b, &[(format!("{p}.mlp.down_proj.weight"), h)], inter)?,
                        intermediate_size: inter,
                    },
                    kind => Mlp::Moe(MoeMlp::load(cfg, i, kind, w, b)?),
                },
            });
        }
        let ws = Workspace {
            residual: b.alloc_res(0)?,
            hidden: b.alloc(0)?,
            qkv: b.alloc(0)?,
            q: b.alloc(0)?,
            k: b.alloc(0)?,
            v: b.alloc(0)?,
            attn: b.alloc(0)?,
            proj: b.alloc(0)?,
            gate_up: b.alloc(0)?,
            act: b.alloc(0)?,
            last: b.alloc(0)?,
            last_res: b.alloc_res(0)?,
        };
        Ok(Self { cfg: cfg.clone(), specs, rope, embed, lm_head, final_norm, layers, ws, rows: 0 })
    }
}

impl<B: Backend> Architecture<B> for Llama<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn layers(&self) -> &[LayerSpec] {
        &self.specs
    }

    fn key_rope(&self, _layer: usize) -> Result<RopeTable, BackendError> {
        // Over the rotated dims only (partial rotary); LongRoPE's factor list is the one the
        // served context selects (`ModelConfig::with_served_context`).
        let rot = self.cfg.rotary_dim();
        Ok(match &self.cfg.longrope {
            Some(l) => RopeTable::with_factors(rot, self.rope.theta, l.factors(), l.attention_factor)?,
            None => self.rope.table(rot)?,
        })
    }

    fn prepare(&mut self, b: &mut B) -> Result<(), BackendError> {
        b.set_rope(self.key_rope(0)?)
    }

    fn forward_layers(
        &mut self,
        b: &mut B,
        batch: &BatchLayout,
        after_kv: &mut AfterKv<'_, B>,
    ) -> Result<(), BackendError> {
        let cfg = &self.cfg;
        let ws = &mut self.ws;
        let t = batch.tokens.len();
        let hd = cfg.head_dim;
        let nh = cfg.num_attention_heads;
        let qd = nh * hd;
        let kvd = cfg.num_key_value_heads * hd;
        let eps = cfg.rms_norm_eps;
        let scale = 1.0 / (hd as f32).sqrt();
        self.rows = t;
        // `mark` labels each op for a step profile (a no-op unless the backend profiles).
        b.mark("embed");
        b.embed(&batch.tokens, &batch.pending, &self.embed, &mut ws.residual)?;
        // Whether the previous layer's last boundary also ran this layer's RoPE and KV write.
        let mut roped = false;
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                b.mark("norm");
                b.rms_norm(&ws.residual, &layer.input_norm, eps, &mut ws.hidden)?;
                b.mark("qkv");
                b.linear(&ws.hidden, t, &layer.qkv, layer.qkv_bias.as_ref(), &mut ws.qkv)?;
            }
            // (Past layer 0, the previous layer's last boundary computed this layer's qkv.)
            if let Some((q_norm, k_norm)) = &layer.qk_norm {
                b.mark("rope_kv");
                let out = (&mut ws.q, &mut ws.k, &mut ws.v);
                b.split_qk_norm_rope_and_write_kv(i, &ws.qkv, (qd, kvd, kvd), nh, batch, (q_norm, k_norm, eps), out)?;
            } else if !roped {
                b.mark("rope_kv");
                b.split_rope_and_write_kv(i, &ws.qkv, (qd, kvd, kvd), nh, batch, &mut ws.q, &mut ws.k, &mut ws.v)?;
            }
            roped = false;
            after_kv(b, i)?;
            b.mark("attention");
            match layer.window {
                // Keys before the window are never read (the backend's windowed attention).
                Some(window) => {
                    let extras = AttentionExtras { window: Some(window), softcap: None };
                    b.attention_ext(i, &ws.q, nh, scale, batch, extras, None, &mut ws.attn)?;
                }
                None => b.attention(i, &ws.q, nh, scale, batch, &mut ws.attn)?,
            }
            let next = self.layers.get(i + 1);
            match &layer.mlp {
                Mlp::Dense { gate_up, down, intermediate_size } => {
                    // o_proj, the residual add, the post-attention norm and gate_up (SiLU·mul).
                    let s = BranchBoundary {
                        m: t,
                        x: &ws.attn,
                        w: &layer.o,
                        bias: layer.o_bias.as_ref(),
                        norm: &layer.post_attn_norm,
                        eps,
                        next: gate_up,
                        next_bias: None,
                        gate: Some(Gate { act: GateAct::Silu, d: *intermediate_size }),
                        labels: ("o_proj", "gate_up"),
                        // The next boundary (or the last layer's down) reads `act` first.
                        then: Some(down),
                        rope: None,
                    };
                    let scratch =
                        BoundaryScratch { proj: &mut ws.proj, hidden: &mut ws.hidden, gate_up: &mut ws.gate_up };
                    b.branch_boundary(s, &mut ws.residual, scratch, &mut ws.act)?;
                    match next {
                        // down, the residual add, the next layer's input norm and its qkv
                        // (with the next layer's RoPE and KV write where it has no q/k norm).
                        Some(n) => {
                            let rope = n.qk_norm.is_none().then(|| BoundaryRope {
                                layer: i + 1,
                                widths: (qd, kvd, kvd),
                                n_heads: nh,
                                batch,
                                q: &mut ws.q,
                                k: &mut ws.k,
                                v: &mut ws.v,
                            });
                            roped = rope.is_some();
                            let s = BranchBoundary {
                                m: t,
                                x: &ws.act,
                                w: down,
                                bias: None,
                                norm: &n.input_norm,
                                eps,
                                next: &n.qkv,
                                next_bias: n.qkv_bias.as_ref(),
                                gate: None,
                                labels: ("down", "qkv"),
                                then: None,
                                rope,
                            };
                            let scratch = BoundaryScratch {
                                proj: &mut ws.proj,
                                hidden: &mut ws.hidden,
                                gate_up: &mut ws.gate_up,
                            };
                            b.branch_boundary(s, &mut ws.residual, scratch, &mut ws.qkv)?;
                        }
                        // The last layer's output stays in `proj` for the final norm (`logits`).
                        None => {
                            b.mark("down");
                            b.linear(&ws.act, t, down, None, &mut ws.proj)?;
                        }
                    }
                }
                // o_proj, the residual add, the post-attention norm, the experts, their residual
                // add, the next layer's input norm and its qkv (one op, fused where it can be).
                Mlp::Moe(moe) => match next {
                    Some(n) => {
                        let (weights, routing) = moe.weights();
                        let s = MoeBranch {
                            m: t,
                            x: &ws.attn,
                            o: &layer.o,
                            o_bias: layer.o_bias.as_ref(),
                            norm: &layer.post_attn_norm,
                            eps,
                            moe: weights,
                            routing,
                            next_norm: &n.input_norm,
                            next: &n.qkv,
                            next_bias: n.qkv_bias.as_ref(),
                        };
                        let scratch =
                            BoundaryScratch { proj: &mut ws.proj, hidden: &mut ws.hidden, gate_up: &mut ws.gate_up };
                        b.moe_branch(s, &mut ws.residual, scratch, &mut ws.qkv)?;
                    }
                    // The last layer's output stays in `proj` for the final norm (`logits`).
                    None => {
                        b.mark("o_proj");
                        b.linear(&ws.attn, t, &layer.o, layer.o_bias.as_ref(), &mut ws.proj)?;
                        b.mark("norm");
                        b.add_rms_norm(&mut ws.residual, &ws.proj, &layer.post_attn_norm, eps, &mut ws.hidden)?;
                        b.mark("moe");
                        moe.forward(b, &ws.hidden, t, &mut ws.proj)?;
                    }
                },
            }
        }
        Ok(())
    }

    fn logits(&mut self, b: &mut B, rows: &[usize], last_use: bool) -> Result<(), BackendError> {
        let ws = &mut self.ws;
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        // Only the wanted rows need the final norm and the (large) LM head. When that is
        // every row in order (decode) and nothing reads the activations afterwards, the last
        // layer's buffers are used as they are.
        b.mark("final_norm");
        if last_use && rows.iter().copied().eq(0..self.rows) {
            b.add_rms_norm(&mut ws.residual, &ws.proj, &self.final_norm, eps, &mut ws.hidden)?;
        } else {
            b.gather_res_rows(&ws.residual, h, rows, &mut ws.last_res)?;
            b.gather_rows(&ws.proj, h, rows, &mut ws.last)?;
            b.add_rms_norm(&mut ws.last_res, &ws.last, &self.final_norm, eps, &mut ws.hidden)?;
        }
        b.mark("lm_head");
        b.lm_head(&ws.hidden, rows.len(), head)
    }
}
