//! Gemma 2 and Gemma 3 (text): weights and forward only, over the [`Backend`] ops. One file
//! for both: they differ only in data (Gemma 3 adds the q/k norm and a RoPE of its own for
//! local layers; Gemma 2 soft-caps), which the [`LayerSpec`]s and
//! [`baton_formats::GemmaOptions`] carry.
//!
//! What differs from the Llama layout (transformers' `Gemma2Model` / `Gemma3TextModel`):
//! - embeddings are multiplied by `√hidden_size`, in the model dtype
//!   ([`Backend::scale_embedding`]);
//! - every RMSNorm scales by `1 + w` ([`NormWeight::OnePlus`]);
//! - a layer is `x += post_attn_norm(attn(input_norm(x)))`, then
//!   `x += post_ff_norm(mlp(pre_ff_norm(x)))`; the MLP is GELU-tanh gated;
//! - attention scores are scaled by `query_pre_attn_scalar^-0.5`, soft-capped where the
//!   config says so, and local layers see only the last `sliding_window` positions
//!   ([`Backend::attention_ext`]: keys outside the window are never read);
//! - each layer kind has its rotary table ([`Backend::set_layer_ropes`]);
//! - the final logits are soft-capped where the config says so ([`Backend::softcap_logits`]).
//!
//! Invariants: every op beyond the core set is checked with [`Backend::supports`] at load
//! (a backend without one refuses the model there, naming it); every layer has one KV head
//! geometry (the cache has one); activation buffers are reused across steps and only grow.

use super::{AfterKv, Architecture, AttentionKind, LayerSpec, MlpKind, ModelLoadError, RopeSpec, WeightLoader};
use crate::backend::{AttentionExtras, Backend, BackendError, BatchLayout, Gate, GateAct, OptionalOp};
use baton_formats::{GemmaOptions, ModelConfig};
use baton_kernels::cpu::NormWeight;

const STYLE: NormWeight = NormWeight::OnePlus;

struct Layer<B: Backend> {
    input_norm: B::Buf,
    post_attn_norm: B::Buf,
    pre_ff_norm: B::Buf,
    post_ff_norm: B::Buf,
    qkv: B::Mat,
    /// Per-head RMSNorm weights of q and k (`head_dim` each; Gemma 3), applied before RoPE.
    qk_norm: Option<(B::Buf, B::Buf)>,
    o: B::Mat,
    gate_up: B::Mat,
    down: B::Mat,
    attention: AttentionExtras,
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
    /// The last layer's MLP output after its post-norm: what the next layer (or the final
    /// norm) adds to the residual.
    out: B::Buf,
    gate_up: B::Buf,
    act: B::Buf,
    last: B::Buf,
    last_res: B::Res,
}

/// Gemma 2 / Gemma 3 weights and activations on a backend.
pub struct Gemma<B: Backend> {
    cfg: ModelConfig,
    opts: GemmaOptions,
    specs: Vec<LayerSpec>,
    /// The distinct rotary specs and each layer's index into them.
    ropes: (Vec<RopeSpec>, Vec<usize>),
    embed: B::Mat,
    /// `None` when the LM head is tied to the embedding (every released Gemma).
    lm_head: Option<B::Mat>,
    final_norm: B::Buf,
    layers: Vec<Layer<B>>,
    ws: Workspace<B>,
    /// Rows of the last forward.
    rows: usize,
}

impl<B: Backend> Gemma<B> {
    /// Reads every tensor of `cfg` through `w` into `b`; refuses a backend without an op the
    /// config needs, naming it.
    pub fn load(cfg: &ModelConfig, w: &mut WeightLoader<'_>, b: &mut B) -> Result<Self, ModelLoadError> {
        let specs = LayerSpec::from_config(cfg);
        let unsupported = |what: String| ModelLoadError::Unsupported {
            architecture: cfg.architecture.model_type(),
            device: b.device_name(),
            what,
        };
        let opts = cfg.gemma.ok_or_else(|| unsupported("a Gemma config without Gemma options".into()))?;
        let mut needs = vec![
            OptionalOp::GemmaNorms,
            OptionalOp::EmbedScale,
            OptionalOp::GeluTanhMul,
            OptionalOp::AttentionExtras,
            OptionalOp::LayerRope,
        ];
        if opts.final_logit_softcapping.is_some() {
            needs.push(OptionalOp::LogitSoftcap);
        }
        if let Some(op) = needs.into_iter().find(|op| !b.supports(*op)) {
            return Err(unsupported(format!("needs {}", op.name())));
        }
        let mut ropes: (Vec<RopeSpec>, Vec<usize>) = (Vec::new(), Vec::new());
        for (i, s) in specs.iter().enumerate() {
            if !matches!(s.mlp, MlpKind::Dense { .. }) {
                return Err(unsupported(format!("layer {i}: MLP {:?}", s.mlp)));
            }
            // The cache holds one head geometry.
            if (s.head_dim, s.num_heads, s.num_kv_heads)
                != (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads)
            {
                return Err(unsupported(format!("layer {i}: heads differing from the other layers'")));
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
        let h = cfg.hidden_size;
        let hd = cfg.head_dim;
        let qd = cfg.num_attention_heads * hd;
        let kvd = cfg.num_key_value_heads * hd;
        let inter = cfg.intermediate_size;
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
            let norm = |n: &str| (format!("{p}.{n}.weight"), h);
            let qk_norm = if spec.qk_norm {
                Some((w.vec(b, &[attn("q_norm.weight", hd)])?, w.vec(b, &[attn("k_norm.weight", hd)])?))
            } else {
                None
            };
            let window = match spec.attention {
                AttentionKind::Full => None,
                AttentionKind::SlidingWindow { window } => Some(window),
            };
            layers.push(Layer {
                input_norm: w.vec(b, &[norm("input_layernorm")])?,
                post_attn_norm: w.vec(b, &[norm("post_attention_layernorm")])?,
                pre_ff_norm: w.vec(b, &[norm("pre_feedforward_layernorm")])?,
                post_ff_norm: w.vec(b, &[norm("post_feedforward_layernorm")])?,
                qkv: w.linear(
                    b,
                    &[attn("q_proj.weight", qd), attn("k_proj.weight", kvd), attn("v_proj.weight", kvd)],
                    h,
                )?,
                qk_norm,
                o: w.linear(b, &[attn("o_proj.weight", h)], qd)?,
                gate_up: w.linear(
                    b,
                    &[(format!("{p}.mlp.gate_proj.weight"), inter), (format!("{p}.mlp.up_proj.weight"), inter)],
                    h,
                )?,
                down: w.linear(b, &[(format!("{p}.mlp.down_proj.weight"), h)], inter)?,
                attention: AttentionExtras { window, softcap: opts.attn_logit_softcapping },
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
            out: b.alloc(0)?,
            gate_up: b.alloc(0)?,
            act: b.alloc(0)?,
            last: b.alloc(0)?,
            last_res: b.alloc_res(0)?,
        };
        Ok(Self { cfg: cfg.clone(), opts, specs, ropes, embed, lm_head, final_norm, layers, ws, rows: 0 })
    }
}

impl<B: Backend> Architecture<B> for Gemma<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn layers(&self) -> &[LayerSpec] {
        &self.specs
    }

    fn key_shift_blocker(&self) -> Option<&'static str> {
        self.opts.attn_logit_softcapping.map(|_| "attention logit soft-capping (attn_logit_softcapping)")
    }

    fn prepare(&mut self, b: &mut B) -> Result<(), BackendError> {
        let tables = self.ropes.0.iter().map(|r| r.table(self.cfg.head_dim)).collect::<Result<Vec<_>, _>>()?;
        if let Some(first) = tables.first() {
            // The one table too, for any op that reads it.
            b.set_rope(first.clone())?;
        }
        b.set_layer_ropes(tables, self.ropes.1.clone())
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
        let scale = self.opts.attention_scale();
        self.rows = t;
        b.mark("embed");
        b.embed(&batch.tokens, &batch.pending, &self.embed, &mut ws.residual)?;
        // transformers: `hidden * torch.tensor(hidden_size ** 0.5, dtype=hidden.dtype)`.
        b.scale_embedding(&mut ws.residual, (cfg.hidden_size as f64).sqrt() as f32)?;
        for (i, layer) in self.layers.iter().enumerate() {
            b.mark("norm");
            if i == 0 {
                b.rms_norm_styled(&ws.residual, &layer.input_norm, eps, STYLE, &mut ws.hidden)?;
            } else {
                b.add_rms_norm_styled(&mut ws.residual, &ws.out, &layer.input_norm, eps, STYLE, &mut ws.hidden)?;
            }
            b.mark("qkv");
            b.linear(&ws.hidden, t, &layer.qkv, None, &mut ws.qkv)?;
            b.mark("rope_kv");
            if let Some((q_norm, k_norm)) = &layer.qk_norm {
                let out = (&mut ws.q, &mut ws.k, &mut ws.v);
                let norms = (q_norm, k_norm, eps, STYLE);
                b.split_qk_norm_rope_and_write_kv_styled(i, &ws.qkv, (qd, kvd, kvd), nh, batch, norms, out)?;
            } else {
                b.split_rope_and_write_kv(i, &ws.qkv, (qd, kvd, kvd), nh, batch, &mut ws.q, &mut ws.k, &mut ws.v)?;
            }
            after_kv(b, i)?;
            b.mark("attention");
            b.attention_ext(i, &ws.q, nh, scale, batch, layer.attention, None, &mut ws.attn)?;
            b.mark("o_proj");
            b.linear(&ws.attn, t, &layer.o, None, &mut ws.proj)?;
            b.mark("norm");
            b.buf_rms_norm(&ws.proj, &layer.post_attn_norm, eps, STYLE, &mut ws.out)?;
            b.add_rms_norm_styled(&mut ws.residual, &ws.out, &layer.pre_ff_norm, eps, STYLE, &mut ws.hidden)?;
            b.mark("gate_up");
            let gate = Gate { act: GateAct::GeluTanh, d: cfg.intermediate_size };
            b.gated_linear(&ws.hidden, t, &layer.gate_up, gate, &mut ws.gate_up, &mut ws.act)?;
            b.mark("down");
            b.linear(&ws.act, t, &layer.down, None, &mut ws.proj)?;
            b.mark("norm");
            b.buf_rms_norm(&ws.proj, &layer.post_ff_norm, eps, STYLE, &mut ws.out)?;
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
            b.add_rms_norm_styled(&mut ws.residual, &ws.out, &self.final_norm, eps, STYLE, &mut ws.hidden)?;
        } else {
            b.gather_res_rows(&ws.residual, h, rows, &mut ws.last_res)?;
            b.gather_rows(&ws.out, h, rows, &mut ws.last)?;
            b.add_rms_norm_styled(&mut ws.last_res, &ws.last, &self.final_norm, eps, STYLE, &mut ws.hidden)?;
        }
        b.mark("lm_head");
        b.lm_head(&ws.hidden, rows.len(), head)?;
        if let Some(cap) = self.opts.final_logit_softcapping {
            b.mark("softcap");
            b.softcap_logits(cap)?;
        }
        Ok(())
    }
}
