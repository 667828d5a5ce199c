//! Paged attention with a sliding window, logit soft-capping and attention sinks, at any
//! head_dim up to [`ATTN_EXT_MAX_HEAD_DIM`] (attention_ext.cu): [`AttentionExtCall`], for the
//! layers of Gemma 2/3, Mistral-style windows, gpt-oss and Phi that the tuned kernels
//! ([`super::AttentionCall`]) do not cover yet. Reference: [`crate::cpu::paged_attention_ext`].
//!
//! Invariants: the same metadata contract as [`super::AttentionCall`] (every row's own K/V
//! already in the cache, context `position + 1`, padding rows context 0 and output zeros);
//! one launch covers every row of the step, prefill and decode alike (no split, no prefill
//! work lists); keys before a row's window are never read. Performance is that of a first
//! version: one CTA per (row, query head), one warp per token, so a prefill chunk reads its
//! window (or context) once per query row.

use super::launch::{Args, MAX_GRID_YZ, cfg, int, need, shape_check};
use super::{AttentionMeta, CudaDevice, CudaError, CudaSlice, KvGeometry};
use half::bf16;

/// The largest head_dim [`AttentionExtCall`] takes (8 dims a lane).
pub const ATTN_EXT_MAX_HEAD_DIM: usize = 256;

/// Warps per CTA (`EXT_WARPS` in attention_ext.cu).
const EXT_WARPS: u32 = 4;

/// Causal paged attention of `q` (`rows × n_heads × head_dim`) over the layer's cache with the
/// options below (each `None` is plain causal attention); writes `out` in `q`'s layout.
pub struct AttentionExtCall<'a> {
    /// `rows × n_heads × head_dim` bf16.
    pub q: &'a CudaSlice<bf16>,
    /// The layer's K cache (`geo.layer_len()` bf16).
    pub k_cache: &'a CudaSlice<bf16>,
    /// The layer's V cache.
    pub v_cache: &'a CudaSlice<bf16>,
    /// The step's context lengths and block tables.
    pub meta: &'a AttentionMeta,
    /// Query heads (a multiple of `geo.n_kv_heads`).
    pub n_heads: usize,
    /// The cache's geometry; head_dim at most [`ATTN_EXT_MAX_HEAD_DIM`].
    pub geo: KvGeometry,
    /// Softmax scale applied to `q · k` (`1 / sqrt(head_dim)`, or Gemma's
    /// `query_pre_attn_scalar^-1/2`).
    pub scale: f32,
    /// Sliding window in tokens, the query's own included (transformers' `sliding_window`);
    /// `None` for the whole context.
    pub window: Option<usize>,
    /// Soft-cap of the scaled scores (`cap · tanh(s / cap)`, Gemma 2's
    /// `attn_logit_softcapping`); `None` for none.
    pub softcap: Option<f32>,
    /// One sink logit per query head (`n_heads` f32, gpt-oss `self_attn.sinks`); `None` for none.
    pub sinks: Option<&'a CudaSlice<f32>>,
    /// `rows × n_heads × head_dim` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl AttentionExtCall<'_> {
    /// Checks the arguments and enqueues `paged_attention_ext_d{ceil(head_dim / 32)}`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "paged_attention_ext";
        let (n_heads, geo) = (self.n_heads, self.geo);
        let hd = geo.head_dim;
        shape_check(OP, (1..=ATTN_EXT_MAX_HEAD_DIM).contains(&hd), || {
            format!("head_dim {hd} (1 to {ATTN_EXT_MAX_HEAD_DIM} supported)")
        })?;
        shape_check(OP, geo.n_kv_heads > 0 && n_heads.is_multiple_of(geo.n_kv_heads), || {
            format!("{n_heads} query heads is not a multiple of {} KV heads", geo.n_kv_heads)
        })?;
        shape_check(OP, self.window != Some(0), || "a sliding window of 0 tokens".into())?;
        shape_check(OP, self.softcap.is_none_or(|c| c.is_finite() && c > 0.0), || {
            format!("soft-cap {:?} is not > 0", self.softcap)
        })?;
        shape_check(OP, self.scale.is_finite(), || format!("softmax scale {}", self.scale))?;
        self.meta.check_geometry(OP, &geo)?;
        let rows = self.meta.rows;
        let len = rows * n_heads * hd;
        need(OP, "q", self.q, len)?;
        need(OP, "out", self.out, len)?;
        need(OP, "k_cache", self.k_cache, geo.layer_len())?;
        need(OP, "v_cache", self.v_cache, geo.layer_len())?;
        if let Some(s) = self.sinks {
            need(OP, "sinks", s, n_heads)?;
        }
        if rows == 0 {
            return Ok(());
        }
        shape_check(OP, rows <= MAX_GRID_YZ, || format!("{rows} rows exceed the grid's y limit"))?;
        let func = &dev.kernels.attention_ext[hd.div_ceil(32) - 1];
        // A window past any context is the whole context; the kernel takes an int.
        let window = self.window.map_or(0, |w| w.min(i32::MAX as usize));
        let args = Args::new(OP)
            .buf(self.q)
            .buf(self.k_cache)
            .buf(self.v_cache)
            .buf(&*self.out)
            .buf(&self.meta.row_ctx)
            .buf(&self.meta.row_bt)
            .buf(&self.meta.block_tables)
            .int(n_heads)?
            .int(geo.n_kv_heads)?
            .int(hd)?
            .int(geo.block_size)?
            .f32(self.scale)
            .int(window)?
            .f32(self.softcap.unwrap_or(0.0));
        // A null pointer tells the kernel there are no sinks.
        let args = match self.sinks {
            Some(s) => args.buf(s),
            None => args.u64(0),
        };
        let grid = cfg((int(OP, n_heads)? as u32, int(OP, rows)? as u32, 1), EXT_WARPS * 32);
        // SAFETY: q, out and the caches were checked against the rows, heads and geometry; the
        // metadata's contexts, block-table offsets and tables were validated against this
        // geometry when it was set (the kernel reads positions below each row's context only);
        // sinks hold `n_heads` values. The kernel variant holds ceil(head_dim / 32) dims a lane.
        unsafe { args.launch(dev, func, grid) }
    }
}
