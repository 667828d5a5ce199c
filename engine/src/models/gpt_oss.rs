//! gpt-oss (`GptOssForCausalLM`): weights and forward only, over the [`Backend`] ops.
//!
//! The layer is the Llama layout (`x += o(attn(norm(x)))`, `x += moe(norm(x))`, plain RMSNorms)
//! with what transformers' `modeling_gpt_oss.py` adds:
//! - q/k/v and o_proj have biases (`attention_bias`, set in every released checkpoint);
//! - every layer's attention has learned *sinks*: one logit per query head, an extra softmax
//!   column with no value ([`Backend::attention_ext`] with `sinks`), so every layer, full and
//!   sliding alike, attends through `attention_ext`;
//! - layers alternate between a sliding window (`sliding_window`, counting the query itself)
//!   and full attention, by `layer_types` ([`LayerSpec::attention`]);
//! - RoPE is YaRN (the rotary table's blend of frequencies and its attention factor on
//!   cos/sin, [`RopeSpec::table`]);
//! - the MLP is always routed experts (`super::moe`, which holds gpt-oss's biases, its
//!   transposed fused expert tensors and the clamped SwiGLU).
//!
//! Invariants: every op beyond the core set is checked with [`Backend::supports`] at load;
//! every layer is MoE and has one KV head geometry (the cache has one); activation buffers
//! are reused across steps and only grow.

use super::moe::MoeMlp;
use super::{AfterKv, Architecture, AttentionKind, LayerSpec, MlpKind, ModelLoadError, RopeSpec, WeightLoader};
use crate::backend::{AttentionExtras, Backend, BackendError, BatchLayout, OptionalOp};
use baton_formats::ModelConfig;

struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_attn_norm: B::Buf,
    qkv: B::Mat,
    /// q/k/v and o_proj biases (`attention_bias`, true in every released gpt-oss).
    qkv_bias: Option<B::Buf>,
    o: B::Mat,
    o_bias: Option<B::Buf>,
    /// One sink logit per query head.
    sinks: B::Buf,
    attention: AttentionExtras,
    moe: MoeMlp<B>,
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
    last: B::Buf,
    last_res: B::Res,
}

/// gpt-oss weights and activations on a backend.
pub struct GptOss<B: Backend> {
    cfg: ModelConfig,
    specs: Vec<LayerSpec>,
    /// The distinct rotary specs and each layer's index into them (one, unless the config
    /// gives sliding layers RoPE parameters of their own).
    ropes: (Vec<RopeSpec>, Vec<usize>),
    embed: B::Mat,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Mat>,
    final_norm: B::Buf,
    layers: Vec<Layer<B>>,
    ws: Workspace<B>,
    /// Rows of the last forward.
    rows: usize,
}

impl<B: Backend> GptOss<B> {
    /// Reads every tensor of `cfg` through `w` into `b`; refuses a backend without an op the
    /// model needs, naming it.
    pub fn load(cfg: &ModelConfig, w: &mut WeightLoader<'_>, b: &mut B) -> Result<Self, ModelLoadError> {
        let specs = LayerSpec::from_config(cfg);
        let unsupported = |b: &B, what: String| ModelLoadError::Unsupported {
            architecture: cfg.architecture.model_type(),
            device: b.device_name(),
            what,
        };
        if !b.supports(OptionalOp::AttentionExtras) {
            return Err(unsupported(b, format!("needs {}", OptionalOp::AttentionExtras.name())));
        }
        let mut ropes: (Vec<RopeSpec>, Vec<usize>) = (Vec::new(), Vec::new());
        for (i, s) in specs.iter().enumerate() {
            if !matches!(s.mlp, MlpKind::Moe { .. }) {
                return Err(unsupported(b, format!("layer {i}: MLP {:?} (gpt-oss layers are MoE)", s.mlp)));
            }
            if s.qk_norm {
                return Err(unsupported(b, format!("layer {i}: q/k norm")));
            }
            // The cache holds one head geometry.
            if (s.head_dim, s.num_heads, s.num_kv_heads)
                != (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
            {
                return Err(unsupported(b, format!("layer {i}: heads differing from the other layers'")));
            }
            let t = match ropes.0.iter().position(|r| *r == s.rope) {
                Some(t) => t,
                None => {
                    ropes.0.push(s.rope);
                    ropes.0.len() - 1
                }
            };
            ropes.1.push(t);
        }
        if ropes.0.len() > 1 && !b.supports(OptionalOp::LayerRope) {
            return Err(unsupported(b, format!("needs {}", OptionalOp::LayerRope.name())));
        }
        let h = cfg.hidden_size;
        let nh = cfg.num_attention_heads;
        let qd = cfg.q_dim();
        let kvd = cfg.kv_dim();
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
            let window = match spec.attention {
                AttentionKind::SlidingWindow { window } => Some(window),
                _ => None,
            };
            layers.push(Layer {
                input_norm: w.vec(b, &[(format!("{p}.input_layernorm.weight"), h)])?,
                post_attn_norm: w.vec(b, &[(format!("{p}.post_attention_layernorm.weight"), h)])?,
                qkv: w.mat(
                    b,
                    &[attn("q_proj.weight", qd), attn("k_proj.weight", kvd), attn("v_proj.weight", kvd)],
                    h,
                )?,
                qkv_bias: if cfg.attention_bias {
                    let names = [attn("q_proj.bias", qd), attn("k_proj.bias", kvd), attn("v_proj.bias", kvd)];
                    Some(w.vec(b, &names)?)
                } else {
                    None
                },
                o: w.mat(b, &[attn("o_proj.weight", h)], qd)?,
                o_bias: if cfg.o_proj_bias() { Some(w.vec(b, &[attn("o_proj.bias", h)])?) } else { None },
                sinks: w.vec(b, &[attn("sinks", nh)])?,
                attention: AttentionExtras { window, softcap: None },
                moe: MoeMlp::load(cfg, i, spec.mlp, w, b)?,
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
            last: b.alloc(0)?,
            last_res: b.alloc_res(0)?,
        };
        Ok(Self { cfg: cfg.clone(), specs, ropes, embed, lm_head, final_norm, layers, ws, rows: 0 })
    }
}

impl<B: Backend> Architecture<B> for GptOss<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn layers(&self) -> &[LayerSpec] {
        &self.specs
    }

    fn key_shift_blocker(&self) -> Option<&'static str> {
        Some("attention sinks (a sink logit does not move with the keys)")
    }

    fn prepare(&mut self, b: &mut B) -> Result<(), BackendError> {
        let tables = self.ropes.0.iter().map(|r| r.table(self.cfg.head_dim)).collect::<Result<Vec<_>, _>>()?;
        let mut tables = tables.into_iter();
        let Some(first) = tables.next() else { return Ok(()) };
        b.set_rope(first.clone())?;
        if self.ropes.0.len() > 1 {
            let all = std::iter::once(first).chain(tables).collect();
            b.set_layer_ropes(all, self.ropes.1.clone())?;
        }
        Ok(())
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
        let nh = cfg.num_attention_heads;
        let qd = cfg.q_dim();
        let kvd = cfg.kv_dim();
        let eps = cfg.rms_norm_eps;
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        self.rows = t;
        b.mark("embed");
        b.embed(&batch.tokens, &batch.pending, &self.embed, &mut ws.residual)?;
        for (i, layer) in self.layers.iter().enumerate() {
            b.mark("norm");
            if i == 0 {
                b.rms_norm(&ws.residual, &layer.input_norm, eps, &mut ws.hidden)?;
            } else {
                b.add_rms_norm(&mut ws.residual, &ws.proj, &layer.input_norm, eps, &mut ws.hidden)?;
            }
            b.mark("qkv");
            b.linear(&ws.hidden, t, &layer.qkv, layer.qkv_bias.as_ref(), &mut ws.qkv)?;
            b.mark("rope_kv");
            b.split_rope_and_write_kv(i, &ws.qkv, (qd, kvd, kvd), nh, batch, &mut ws.q, &mut ws.k, &mut ws.v)?;
            after_kv(b, i)?;
            b.mark("attention");
            b.attention_ext(i, &ws.q, nh, scale, batch, layer.attention, Some(&layer.sinks), &mut ws.attn)?;
            b.mark("o_proj");
            b.linear(&ws.attn, t, &layer.o, layer.o_bias.as_ref(), &mut ws.proj)?;
            b.mark("norm");
            b.add_rms_norm(&mut ws.residual, &ws.proj, &layer.post_attn_norm, eps, &mut ws.hidden)?;
            b.mark("moe");
            layer.moe.forward(b, &ws.hidden, t, &mut ws.proj)?;
        }
        Ok(())
    }

    fn logits(&mut self, b: &mut B, rows: &[usize], last_use: bool) -> Result<(), BackendError> {
        let ws = &mut self.ws;
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
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
