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

use super::launch::{Args, Elem, MAX_GRID_YZ, cfg, int, need, shape_check};
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
        let Self { q, k_cache, v_cache, meta, n_heads, geo, scale, window, softcap, sinks, out } = self;
        let opts = ExtOptions { meta, n_heads, geo, scale, window, softcap, sinks };
        launch_ext(dev, q, [k_cache, v_cache], None, opts, out)
    }
}

/// [`AttentionExtCall`] over an FP8 (E4M3) cache, one byte an element, dequantized as it is
/// read (`code × k_scale`, `code × v_scale`; reference: [`crate::cpu::paged_attention_fp8`]).
/// Kernels `paged_attention_ext_fp8_d*`.
pub struct AttentionExtFp8Call<'a> {
    /// `rows × n_heads × head_dim` bf16.
    pub q: &'a CudaSlice<bf16>,
    /// The layer's K codes (`geo.layer_len()` bytes).
    pub k_cache: &'a CudaSlice<u8>,
    /// The layer's V codes.
    pub v_cache: &'a CudaSlice<u8>,
    /// What a K code is multiplied by (finite, positive).
    pub k_scale: f32,
    /// What a V code is multiplied by (finite, positive).
    pub v_scale: f32,
    /// The step's context lengths and block tables.
    pub meta: &'a AttentionMeta,
    /// Query heads (a multiple of `geo.n_kv_heads`).
    pub n_heads: usize,
    /// The cache's geometry; head_dim at most [`ATTN_EXT_MAX_HEAD_DIM`].
    pub geo: KvGeometry,
    /// Softmax scale applied to `q · k`.
    pub scale: f32,
    /// Sliding window (see [`AttentionExtCall::window`]).
    pub window: Option<usize>,
    /// Soft-cap (see [`AttentionExtCall::softcap`]).
    pub softcap: Option<f32>,
    /// Sink logits (see [`AttentionExtCall::sinks`]).
    pub sinks: Option<&'a CudaSlice<f32>>,
    /// `rows × n_heads × head_dim` bf16.
    pub out: &'a mut CudaSlice<bf16>,
}

impl AttentionExtFp8Call<'_> {
    /// Checks the arguments and scales and enqueues `paged_attention_ext_fp8_d{ceil(head_dim / 32)}`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        let Self { q, k_cache, v_cache, k_scale, v_scale, meta, n_heads, geo, scale, window, softcap, sinks, out } =
            self;
        let opts = ExtOptions { meta, n_heads, geo, scale, window, softcap, sinks };
        launch_ext(dev, q, [k_cache, v_cache], Some([k_scale, v_scale]), opts, out)
    }
}

/// What both calls pass through unchanged.
struct ExtOptions<'a> {
    meta: &'a AttentionMeta,
    n_heads: usize,
    geo: KvGeometry,
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
    sinks: Option<&'a CudaSlice<f32>>,
}

/// The launch behind [`AttentionExtCall`] (bf16 caches, no scales) and
/// [`AttentionExtFp8Call`] (E4M3 caches and their scales).
fn launch_ext<T: Elem>(
    dev: &CudaDevice,
    q: &CudaSlice<bf16>,
    [k_cache, v_cache]: [&CudaSlice<T>; 2],
    fp8_scales: Option<[f32; 2]>,
    o: ExtOptions<'_>,
    out: &mut CudaSlice<bf16>,
) -> Result<(), CudaError> {
    let op: &'static str = if fp8_scales.is_some() { "paged_attention_ext_fp8" } else { "paged_attention_ext" };
    let (n_heads, geo) = (o.n_heads, o.geo);
    let hd = geo.head_dim;
    shape_check(op, (1..=ATTN_EXT_MAX_HEAD_DIM).contains(&hd), || {
        format!("head_dim {hd} (1 to {ATTN_EXT_MAX_HEAD_DIM} supported)")
    })?;
    shape_check(op, geo.n_kv_heads > 0 && n_heads.is_multiple_of(geo.n_kv_heads), || {
        format!("{n_heads} query heads is not a multiple of {} KV heads", geo.n_kv_heads)
    })?;
    shape_check(op, o.window != Some(0), || "a sliding window of 0 tokens".into())?;
    shape_check(op, o.softcap.is_none_or(|c| c.is_finite() && c > 0.0), || {
        format!("soft-cap {:?} is not > 0", o.softcap)
    })?;
    shape_check(op, o.scale.is_finite(), || format!("softmax scale {}", o.scale))?;
    o.meta.check_geometry(op, &geo)?;
    let rows = o.meta.rows;
    let len = rows * n_heads * hd;
    need(op, "q", q, len)?;
    need(op, "out", out, len)?;
    need(op, "k_cache", k_cache, geo.layer_len())?;
    need(op, "v_cache", v_cache, geo.layer_len())?;
    if let Some(s) = o.sinks {
        need(op, "sinks", s, n_heads)?;
    }
    if let Some([k, v]) = fp8_scales {
        shape_check(op, [k, v].iter().all(|s| s.is_finite() && *s > 0.0), || {
            format!("FP8 KV scales k {k}, v {v}: each must be finite and positive")
        })?;
    }
    if rows == 0 {
        return Ok(());
    }
    shape_check(op, rows <= MAX_GRID_YZ, || format!("{rows} rows exceed the grid's y limit"))?;
    let table = if fp8_scales.is_some() { &dev.kernels.attention_ext_fp8 } else { &dev.kernels.attention_ext };
    let func = &table[hd.div_ceil(32) - 1];
    // A window past any context is the whole context; the kernel takes an int.
    let window = o.window.map_or(0, |w| w.min(i32::MAX as usize));
    let args = Args::new(op)
        .buf(q)
        .buf(k_cache)
        .buf(v_cache)
        .buf(&*out)
        .buf(&o.meta.row_ctx)
        .buf(&o.meta.row_bt)
        .buf(&o.meta.block_tables)
        .int(n_heads)?
        .int(geo.n_kv_heads)?
        .int(hd)?
        .int(geo.block_size)?
        .f32(o.scale)
        .int(window)?
        .f32(o.softcap.unwrap_or(0.0));
    // A null pointer tells the kernel there are no sinks.
    let args = match o.sinks {
        Some(s) => args.buf(s),
        None => args.u64(0),
    };
    let args = match fp8_scales {
        Some([k, v]) => args.f32(k).f32(v),
        None => args,
    };
    let grid = cfg((int(op, n_heads)? as u32, int(op, rows)? as u32, 1), EXT_WARPS * 32);
    // SAFETY: q, out and the caches were checked against the rows, heads and geometry; the
    // metadata's contexts, block-table offsets and tables were validated against this
    // geometry when it was set (the kernel reads positions below each row's context only);
    // sinks hold `n_heads` values. The kernel variant holds ceil(head_dim / 32) dims a lane.
    unsafe { args.launch(dev, func, grid) }
}
