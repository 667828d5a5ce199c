//! Paged causal attention over the layer's cache: [`AttentionCall`] launches the decode
//! kernel (attention.cu, described in `paged_attention.rs`), the prefill kernel (prefill.cu,
//! described in `prefill.rs`), or both for a mixed batch ([`AttnKernel::Mixed`]).
//!
//! Invariants:
//! - every launch checks the GQA heads, the metadata's cache geometry and the sizes of `q`,
//!   `out` and the caches before it enqueues anything;
//! - the decode kernel splits long contexts across CTAs by [`AttnSplit`] and merges the
//!   partials with a combine launch; the partial buffers live in the step's metadata and grow
//!   on demand (never while a graph is recorded: the staged split count was run op by op
//!   first);
//! - in a mixed batch the decode kernel runs first (over rows up to the last decode row; the
//!   prefill rows among them have context 0 and get zeros) and the prefill kernel after it,
//!   on the same stream, overwriting the prefill rows (see `prefill.rs`);
//! - an FP8 cache ([`KvCacheRef::Fp8`]) takes the same routes through the FP8 entries of both
//!   kernels (`paged_attention_tc_fp8_*`, `prefill_attention_fp8_*`): the launcher folds the K
//!   scale into the softmax scale and passes the V scale, both checked finite and positive;
//! - [`AttentionOptions`] (sliding window, soft-cap, sinks) reach both kernels as runtime
//!   arguments: a windowed decode row's splits cut `[ctx - window, ctx)` only (its split plan
//!   is made for `min(ctx, window)` tokens), and a prefill tile's KV loop starts at the tile
//!   holding its first query's window start, so no block before a window is read.

use super::launch::{Args, MAX_GRID_YZ, cfg, int, need, shape_check, shape_error};
use super::paged_attention::{
    ATTN_FP8_VARIANTS, ATTN_HEAD_DIMS, ATTN_VARIANTS, AttnKind, AttnSplit, DecodeShape, MIN_SPLIT_TOKENS, SplitTarget,
    attn_default, plan_splits, stream_carveout, stream_kv_heads, stream_smem_bytes, tc_dynamic_smem,
};
use super::prefill::{
    PREFILL_DEFAULT_VARIANT, PREFILL_HEAD_DIMS, PREFILL_WARPS, PREFILL_WGMMA, PrefillLists, block_magic,
    prefill_fp8_smem_bytes, prefill_smem_bytes, prefill_supported, prefill_variant_warps, prefill_wg_smem_bytes,
    prefill_wg_supported,
};
use super::{AttentionMeta, CudaDevice, CudaError, CudaSlice, KvGeometry};
use cudarc::driver::LaunchConfig;
use half::bf16;

/// Whether the tuned attention kernels ([`AttentionCall`]) are built for `head_dim`; other
/// head dims take [`super::AttentionExtCall`]. Every [`AttentionOptions`] is supported at
/// these head dims (by the decode kernel; see the module doc for prefill).
pub fn attention_supports(head_dim: usize) -> bool {
    ATTN_HEAD_DIMS.contains(&head_dim)
}

/// What a layer adds to plain causal attention: the meaning of
/// [`AttentionExtCall`](super::AttentionExtCall)'s fields of the same names (reference
/// [`crate::cpu::paged_attention_ext`]). The default is none of them.
#[derive(Clone, Copy, Default)]
pub struct AttentionOptions<'a> {
    /// Sliding window in tokens, the query's own included: a row of context `ctx` reads keys
    /// `[max(0, ctx - window), ctx)`; `None` for the whole context. Never 0.
    pub window: Option<usize>,
    /// Soft-cap of the scaled scores (`cap · tanh(s / cap)`); finite and positive, or `None`.
    pub softcap: Option<f32>,
    /// One sink logit per query head (`n_heads` f32, natural log) joining the softmax
    /// denominator only; `None` for none.
    pub sinks: Option<&'a CudaSlice<f32>>,
}

impl AttentionOptions<'_> {
    /// Whether this is plain causal attention.
    pub fn is_none(&self) -> bool {
        self.window.is_none() && self.softcap.is_none() && self.sinks.is_none()
    }

    /// Tokens a row of `ctx` tokens reads: `min(ctx, window)`. The split plan of a windowed
    /// layer (and a CUDA graph's key for it) is made for this length.
    pub fn effective_ctx(&self, ctx: usize) -> usize {
        self.window.map_or(ctx, |w| ctx.min(w))
    }

    /// The window and the soft-cap as the kernels take them: window 0 for none (an int: a
    /// window past any context is the whole context), the cap in the log2 domain of the scores
    /// (`cap · log2 e`; 0 for none).
    fn kernel_args(&self) -> (i32, f32) {
        let window = self.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        (window, self.softcap.map_or(0.0, |c| c * std::f32::consts::LOG2_E))
    }
}

/// Refuses options no kernel computes: a window of 0 tokens, a soft-cap that is not finite
/// and positive, fewer sinks than query heads (`sinks`: how many the buffer holds).
pub(crate) fn check_options(
    op: &'static str,
    window: Option<usize>,
    softcap: Option<f32>,
    sinks: Option<usize>,
    n_heads: usize,
) -> Result<(), CudaError> {
    shape_check(op, window != Some(0), || "a sliding window of 0 tokens".into())?;
    shape_check(op, softcap.is_none_or(|c| c.is_finite() && c > 0.0), || {
        format!("soft-cap {softcap:?} is not finite and positive")
    })?;
    shape_check(op, sinks.is_none_or(|n| n >= n_heads), || {
        format!("{} sinks for {n_heads} query heads", sinks.unwrap_or(0))
    })
}

/// The layer's K/V cache as the tuned attention kernels read it.
#[derive(Debug, Clone, Copy)]
pub enum KvCacheRef<'a> {
    /// bf16 K and V, `geo.layer_len()` values each.
    Bf16 {
        /// The layer's K cache.
        k: &'a CudaSlice<bf16>,
        /// The layer's V cache.
        v: &'a CudaSlice<bf16>,
    },
    /// E4M3 codes, `geo.layer_len()` bytes each, with the layer's scales (value = code ×
    /// scale; each must be finite and positive).
    Fp8 {
        /// The layer's K codes.
        k: &'a CudaSlice<u8>,
        /// The layer's V codes.
        v: &'a CudaSlice<u8>,
        /// The K scale.
        k_scale: f32,
        /// The V scale.
        v_scale: f32,
    },
}

impl KvCacheRef<'_> {
    /// The softmax scale in the log2 domain the kernels take (with an FP8 cache the K scale
    /// folded in), and the V scale the output is multiplied by (1 for bf16).
    fn kernel_scales(&self, scale: f32) -> (f32, f32) {
        let qscale = scale * std::f32::consts::LOG2_E;
        match *self {
            Self::Bf16 { .. } => (qscale, 1.0),
            Self::Fp8 { k_scale, v_scale, .. } => (qscale * k_scale, v_scale),
        }
    }

    fn is_fp8(&self) -> bool {
        matches!(self, Self::Fp8 { .. })
    }
}

impl<'a> KvCacheRef<'a> {
    /// `args` with the cache's K and V buffers appended.
    fn push<'b>(self, args: Args<'b>) -> Args<'b>
    where
        'a: 'b,
    {
        match self {
            Self::Bf16 { k, v } => args.buf(k).buf(v),
            Self::Fp8 { k, v, .. } => args.buf(k).buf(v),
        }
    }
}

/// Which kernel computes which rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKernel {
    /// The decode kernel on every row: `ATTN_VARIANTS[variant]` (with an FP8 cache
    /// `ATTN_FP8_VARIANTS[variant]`), or when `None` the default for the launch
    /// ([`attn_default`]: the GQA group, the cache type and the rows).
    Decode {
        /// Index in [`ATTN_VARIANTS`].
        variant: Option<usize>,
    },
    /// The prefill kernel on the step's prefill chunks only (sequences of at least
    /// `PREFILL_MIN_TOKENS` rows): the mma.sync kernel with CTAs of `PREFILL_WARPS[variant]`
    /// warps, or at [`PREFILL_WGMMA`] the warpgroup-MMA kernel; other rows are not touched.
    Prefill {
        /// Below `PREFILL_VARIANTS` (see `prefill_variant_warps`).
        variant: usize,
    },
    /// The router: prefill chunks on the prefill kernel, every other row on the decode kernel
    /// (default variants, the warpgroup prefill kernel where `CudaDevice::prefill_wgmma` and
    /// the shape allow; the decode launch splits by [`AttentionCall::split`]). The decode
    /// kernel takes every row when the step has no prefill chunk or the shape has no prefill
    /// kernel ([`prefill_supported`]).
    Mixed,
}

impl AttnKernel {
    /// The decode kernel on every row with the default variant for the GQA group.
    pub const DECODE: Self = Self::Decode { variant: None };
}

/// Paged causal attention of `q` (`rows × n_heads × head_dim`, `rows` the metadata's) over
/// the layer's cache, which already holds every row's own K/V; writes `out` in `q`'s layout.
pub struct AttentionCall<'a> {
    /// `rows × n_heads × head_dim` bf16.
    pub q: &'a CudaSlice<bf16>,
    /// The layer's cache.
    pub cache: KvCacheRef<'a>,
    /// The step's context lengths and block tables; holds the split partials and the prefill
    /// lists.
    pub meta: &'a mut AttentionMeta,
    /// Query heads (a multiple of `geo.n_kv_heads`).
    pub n_heads: usize,
    /// The cache's geometry.
    pub geo: KvGeometry,
    /// Softmax scale (usually `1 / sqrt(head_dim)`); positive for the prefill kernel.
    pub scale: f32,
    /// `rows × n_heads × head_dim` bf16.
    pub out: &'a mut CudaSlice<bf16>,
    /// Which kernel computes which rows.
    pub kernel: AttnKernel,
    /// How the decode kernel splits each row's context ([`AttnSplit::Exact`] for a graph
    /// replay); the prefill kernel does not split.
    pub split: AttnSplit,
    /// Window, soft-cap and sinks ([`AttentionOptions::default`]: none).
    pub options: AttentionOptions<'a>,
}

/// Which rows a decode launch covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeRows {
    /// Every row, at its own context length.
    All,
    /// Rows up to the last decode row, reading the context lengths in which prefill rows hold
    /// 0 (they exit at once).
    DecodeOnly,
}

impl AttentionCall<'_> {
    /// Checks the arguments and enqueues the kernel(s) of [`AttentionCall::kernel`].
    pub fn launch(mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        match self.kernel {
            AttnKernel::Decode { variant } => {
                let v = variant.unwrap_or_else(|| self.default_decode_variant(dev, self.meta.rows));
                self.decode(dev, v, DecodeRows::All)
            }
            AttnKernel::Prefill { variant } => self.prefill(dev, variant),
            AttnKernel::Mixed => self.mixed(dev),
        }
    }

    /// The default decode variant ([`attn_default`]) for a launch over `rows` rows.
    fn default_decode_variant(&self, dev: &CudaDevice, rows: usize) -> usize {
        let (n_heads, geo) = (self.n_heads, self.geo);
        let (n_kv_heads, head_dim, fp8) = (geo.n_kv_heads, geo.head_dim, self.cache.is_fp8());
        attn_default(&DecodeShape { rows, n_heads, n_kv_heads, head_dim, fp8 }, dev.stream_attention())
    }

    /// The checks every attention launch makes: GQA heads, the metadata's cache geometry, and
    /// `q`/`out` (`rows × n_heads × head_dim`) and the caches long enough; an FP8 cache's
    /// scales finite and positive.
    fn check_io(&self, op: &'static str) -> Result<(), CudaError> {
        let (n_heads, geo) = (self.n_heads, self.geo);
        let o = &self.options;
        check_options(op, o.window, o.softcap, o.sinks.map(CudaSlice::len), n_heads)?;
        shape_check(op, geo.n_kv_heads > 0 && n_heads.is_multiple_of(geo.n_kv_heads), || {
            format!("{n_heads} query heads is not a multiple of {} KV heads", geo.n_kv_heads)
        })?;
        self.meta.check_geometry(op, &geo)?;
        let len = self.meta.rows * n_heads * geo.head_dim;
        need(op, "q", self.q, len)?;
        need(op, "out", self.out, len)?;
        match self.cache {
            KvCacheRef::Bf16 { k, v } => {
                need(op, "k_cache", k, geo.layer_len())?;
                need(op, "v_cache", v, geo.layer_len())
            }
            KvCacheRef::Fp8 { k, v, k_scale, v_scale } => {
                need(op, "k_cache", k, geo.layer_len())?;
                need(op, "v_cache", v, geo.layer_len())?;
                shape_check(op, [k_scale, v_scale].iter().all(|s| s.is_finite() && *s > 0.0), || {
                    format!("FP8 KV scales k {k_scale}, v {v_scale}: each must be finite and positive")
                })
            }
        }
    }

    fn mixed(&mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        let (n_heads, geo) = (self.n_heads, self.geo);
        if !self.meta.prefill.has_prefill() || !prefill_supported(n_heads, geo.n_kv_heads, geo.head_dim) {
            let variant = self.default_decode_variant(dev, self.meta.rows);
            return self.decode(dev, variant, DecodeRows::All);
        }
        let variant = self.default_decode_variant(dev, self.meta.prefill.lists.decode_rows_end);
        // The warpgroup kernel where it runs this shape, else the default mma.sync variant.
        let wg =
            dev.prefill_wgmma() && prefill_wg_supported(n_heads, geo.n_kv_heads, geo.head_dim, !self.options.is_none());
        let pf_variant = if wg { PREFILL_WGMMA } else { PREFILL_DEFAULT_VARIANT };
        // Validate the prefill launch before enqueueing anything (both kernels take 4 warps).
        check_prefill_shape(&self.meta.prefill.lists, n_heads, geo, PREFILL_WARPS[PREFILL_DEFAULT_VARIANT])?;
        if self.meta.prefill.lists.decode_rows_end > 0 {
            self.decode(dev, variant, DecodeRows::DecodeOnly)?;
        }
        // After the decode kernel: it wrote zeros into the prefill rows (module doc).
        self.prefill(dev, pf_variant)
    }

    /// The decode kernel with `ATTN_VARIANTS[variant]` (FP8: `ATTN_FP8_VARIANTS[variant]`), then
    /// the combine of its partials when the plan splits the contexts.
    fn decode(&mut self, dev: &CudaDevice, variant: usize, which: DecodeRows) -> Result<(), CudaError> {
        const OP: &str = "paged_attention";
        let (n_heads, geo) = (self.n_heads, self.geo);
        let hd = geo.head_dim;
        let hd_idx = ATTN_HEAD_DIMS
            .iter()
            .position(|&d| d == hd)
            .ok_or_else(|| shape_error(OP, format!("head_dim {hd} has no kernel")))?;
        let (variants, funcs) = match self.cache {
            KvCacheRef::Bf16 { .. } => (&ATTN_VARIANTS[..], &dev.kernels.attention(hd_idx)?.bf16),
            KvCacheRef::Fp8 { .. } => (&ATTN_FP8_VARIANTS[..], &dev.kernels.attention(hd_idx)?.fp8),
        };
        let (v, func) = match (variants.get(variant), funcs.get(variant)) {
            (Some(v), Some(f)) => (*v, f),
            _ => {
                let cache = if self.cache.is_fp8() { "an FP8" } else { "a bf16" };
                return Err(shape_error(OP, format!("no attention variant {variant} for {cache} cache")));
            }
        };
        self.check_io(OP)?;
        let meta = &mut *self.meta;
        let (rows, max_ctx) = match which {
            DecodeRows::All => (meta.rows, meta.max_ctx),
            DecodeRows::DecodeOnly => (meta.prefill.lists.decode_rows_end, meta.prefill.lists.decode_max_ctx),
        };
        if rows == 0 {
            return Ok(());
        }
        shape_check(OP, rows <= MAX_GRID_YZ, || format!("{rows} rows exceed the grid's y limit"))?;
        let smem = match v.kind {
            AttnKind::Stream => {
                shape_check(OP, dev.stream_attention_capable(), || {
                    format!("the streaming attention kernel needs sm_90 (built for {})", dev.arch())
                })?;
                let kvc = stream_kv_heads(&v, geo.n_kv_heads, hd);
                shape_check(OP, kvc > 0, || {
                    format!("no streaming CTA fits {} KV heads of head_dim {hd}", geo.n_kv_heads)
                })?;
                stream_smem_bytes(&v, kvc, hd)
            }
            _ => tc_dynamic_smem(&v, hd, self.cache.is_fp8()),
        };
        let x = v.ctas_per_row(n_heads, geo.n_kv_heads, hd);
        // Only the split count reaches the kernel: each row's chunk is cut there from its own
        // length (`split_chunk` in attention.cu), with MIN_SPLIT_TOKENS as the least.
        // A windowed row reads min(ctx, window) tokens: the plan is made for that length.
        let target = SplitTarget::for_variant(&v, geo.n_kv_heads, hd, self.cache.is_fp8(), dev.attention_split_smem());
        let read = self.options.effective_ctx(max_ctx);
        let (splits, _) = plan_splits(self.split, x * rows, read, dev.sm_count(), target);
        let min_chunk = int(OP, MIN_SPLIT_TOKENS)?;
        if splits > 1 {
            dev.grow(&mut meta.part_o, rows * n_heads * splits * hd)?;
            dev.grow(&mut meta.part_ml, rows * n_heads * splits * 2)?;
        }
        let row_ctx = match which {
            DecodeRows::All => &meta.row_ctx,
            DecodeRows::DecodeOnly => &meta.prefill.decode_ctx,
        };
        let threads = v.threads(geo.n_kv_heads, hd);
        let mut grid = cfg((int(OP, x)? as u32, int(OP, rows)? as u32, splits as u32), threads);
        grid.shared_mem_bytes = smem as u32;
        let (qscale, v_scale) = self.cache.kernel_scales(self.scale);
        let (window, cap2) = self.options.kernel_args();
        let args = self
            .cache
            .push(Args::new(OP).buf(self.q))
            .buf(&*self.out)
            .buf(&meta.part_o)
            .buf(&meta.part_ml)
            .buf(row_ctx)
            .buf(&meta.row_bt)
            .buf(&meta.block_tables)
            .int(n_heads)?
            .int(geo.n_kv_heads)?
            .int(geo.block_size)?
            .f32(qscale)
            .i32(min_chunk);
        // The FP8 entries take the V scale before the options.
        let args = if self.cache.is_fp8() { args.f32(v_scale) } else { args };
        let args = push_sinks(args.i32(window).f32(cap2), self.options.sinks);
        let own = if v.kind == AttnKind::Stream { stream_carveout(rows) } else { None };
        let args = match dev.carveout_pins().attention.or(own) {
            Some(percent) => args.carveout(percent),
            None => args,
        };
        // SAFETY: q, out and the caches were checked against the rows, heads and geometry;
        // the metadata's contexts, block-table offsets and tables were validated against this
        // geometry when it was set; the partials hold `rows × heads × splits` entries; sinks
        // hold at least `n_heads` values; the dynamic shared memory is the variant's own
        // (`tc_dynamic_smem`, `stream_smem_bytes`: at most its limit, raised at load).
        unsafe { args.launch(dev, func, grid) }?;
        if splits > 1 {
            let grid = cfg((int(OP, n_heads)? as u32, int(OP, rows)? as u32, 1), hd as u32);
            let args = Args::new(OP)
                .buf(&meta.part_o)
                .buf(&meta.part_ml)
                .buf(&*self.out)
                .buf(row_ctx)
                .int(n_heads)?
                .int(splits)?
                .i32(min_chunk)
                .i32(window);
            let args = push_sinks(args, self.options.sinks);
            // SAFETY: as above: the partials and out of `rows × n_heads` heads.
            unsafe { args.launch(dev, &dev.kernels.attention(hd_idx)?.combine, grid) }?;
        }
        Ok(())
    }

    /// The prefill kernel with CTAs of `PREFILL_WARPS[variant]` warps over the step's prefill
    /// chunks.
    fn prefill(&self, dev: &CudaDevice, variant: usize) -> Result<(), CudaError> {
        const OP: &str = "prefill_attention";
        let (n_heads, geo, scale) = (self.n_heads, self.geo, self.scale);
        let lists = &self.meta.prefill.lists;
        let warps =
            prefill_variant_warps(variant).ok_or_else(|| shape_error(OP, format!("no prefill variant {variant}")))?;
        let (hd_idx, items) = check_prefill_shape(lists, n_heads, geo, warps)?;
        let wg = variant == PREFILL_WGMMA;
        if wg {
            shape_check(OP, dev.prefill_wgmma_capable(), || {
                format!("the warpgroup prefill kernel needs sm_90a kernels (built for {})", dev.arch())
            })?;
            let opts = !self.options.is_none();
            shape_check(OP, prefill_wg_supported(n_heads, geo.n_kv_heads, geo.head_dim, opts), || {
                format!(
                    "the warpgroup prefill kernel computes head_dim 128 without options (head_dim {}, options {opts})",
                    geo.head_dim
                )
            })?;
        }
        self.check_io(OP)?;
        // The kernel takes the running max on unscaled scores, which needs scale > 0.
        shape_check(OP, scale > 0.0 && scale.is_finite(), || format!("softmax scale {scale} is not positive"))?;
        if items == 0 {
            return Ok(());
        }
        // The `_opt_` entries compute the options; the plain ones compile them out.
        let plain = self.options.is_none();
        if wg {
            return self.prefill_wg(dev, hd_idx, items);
        }
        let k = dev.kernels.prefill(hd_idx)?;
        let (table, smem) = match self.cache {
            KvCacheRef::Bf16 { .. } => (if plain { &k.bf16 } else { &k.bf16_opt }, prefill_smem_bytes(geo.head_dim)),
            KvCacheRef::Fp8 { .. } => (if plain { &k.fp8 } else { &k.fp8_opt }, prefill_fp8_smem_bytes(geo.head_dim)),
        };
        let func = table.get(variant).ok_or_else(|| {
            shape_error(OP, format!("no prefill kernel variant {variant} for head_dim {}", geo.head_dim))
        })?;
        let grid = LaunchConfig {
            grid_dim: (geo.n_kv_heads as u32, items as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let args = self.prefill_args(OP)?;
        let (window, cap2) = self.options.kernel_args();
        let args = push_sinks(args.i32(window).f32(cap2), self.options.sinks);
        // SAFETY: q, out and the caches were checked against the rows, heads and geometry,
        // sinks against the heads; the sequence list was built from the validated metadata (positions below the block
        // index's exact range, checked above), and the grid covers its work items.
        unsafe { args.launch(dev, func, grid) }
    }

    /// The arguments both prefill kernels start with: the cache, q, out, the step's prefill
    /// sequence list and block tables, the head counts and block geometry, the softmax scale
    /// (with the K scale folded in) and, over an FP8 cache, the V scale.
    fn prefill_args(&self, op: &'static str) -> Result<Args<'_>, CudaError> {
        let geo = self.geo;
        let (qscale, v_scale) = self.cache.kernel_scales(self.scale);
        let args = self
            .cache
            .push(Args::new(op).buf(self.q))
            .buf(&*self.out)
            .buf(&self.meta.prefill.seqs)
            .int(self.meta.prefill.lists.seqs.len())?
            .buf(&self.meta.block_tables)
            .int(self.n_heads)?
            .int(geo.n_kv_heads)?
            .int(geo.block_size)?
            .u32(block_magic(geo.block_size))
            .f32(qscale);
        Ok(if self.cache.is_fp8() { args.f32(v_scale) } else { args })
    }

    /// The warpgroup-MMA prefill kernel over the step's prefill chunks (`items` query tiles),
    /// `hd_idx` the head_dim's index in `PREFILL_HEAD_DIMS`; the caller checked the device, the shape and the arguments.
    fn prefill_wg(&self, dev: &CudaDevice, hd_idx: usize, items: usize) -> Result<(), CudaError> {
        const OP: &str = "prefill_attention_wg";
        let geo = self.geo;
        let fp8 = self.cache.is_fp8();
        let [bf16, fp8_func] = dev
            .kernels
            .prefill(hd_idx)?
            .wg
            .as_ref()
            .ok_or_else(|| shape_error(OP, format!("head_dim {} has no warpgroup prefill kernel", geo.head_dim)))?;
        let func = if fp8 { fp8_func } else { bf16 };
        let grid = LaunchConfig {
            grid_dim: (geo.n_kv_heads as u32, items as u32, 1),
            // One warpgroup.
            block_dim: (128, 1, 1),
            shared_mem_bytes: prefill_wg_smem_bytes(fp8) as u32,
        };
        let args = self.prefill_args(OP)?;
        // SAFETY: as the mma.sync prefill launch: q, out and the caches checked against the
        // rows, heads and geometry (head_dim 128), the sequence list built from the validated
        // metadata, and the grid covers its work items.
        unsafe { args.launch(dev, func, grid) }
    }
}

/// `args` with the sink buffer appended, or a null pointer (no sinks) for the kernels.
fn push_sinks<'b>(args: Args<'b>, sinks: Option<&'b CudaSlice<f32>>) -> Args<'b> {
    match sinks {
        Some(s) => args.buf(s),
        None => args.u64(0),
    }
}

/// Checks the prefill launch shape that needs no device for the variant of `warps` warps;
/// returns the head-dim index and the grid height.
fn check_prefill_shape(
    lists: &PrefillLists,
    n_heads: usize,
    geo: KvGeometry,
    warps: usize,
) -> Result<(usize, usize), CudaError> {
    const OP: &str = "prefill_attention";
    let hd = geo.head_dim;
    let bm = 16 * warps;
    let hd_idx = PREFILL_HEAD_DIMS
        .iter()
        .position(|&d| d == hd)
        .ok_or_else(|| shape_error(OP, format!("head_dim {hd} has no prefill kernel")))?;
    shape_check(OP, geo.n_kv_heads > 0 && n_heads.is_multiple_of(geo.n_kv_heads), || {
        format!("{n_heads} query heads is not a multiple of {} KV heads", geo.n_kv_heads)
    })?;
    let group = n_heads / geo.n_kv_heads;
    shape_check(OP, group <= bm, || format!("a GQA group of {group} heads exceeds the tile's {bm} rows"))?;
    shape_check(OP, geo.n_kv_heads <= MAX_GRID_YZ, || format!("{} KV heads exceed the grid", geo.n_kv_heads))?;
    shape_check(OP, (lists.max_end as u64) * (geo.block_size as u64) < 1u64 << 32, || {
        format!("positions up to {} with blocks of {} overflow the block index", lists.max_end, geo.block_size)
    })?;
    let items = lists.items(group, bm);
    shape_check(OP, items <= MAX_GRID_YZ, || format!("{items} query tiles exceed the grid's y limit"))?;
    Ok((hd_idx, items))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(block_size: usize, n_kv_heads: usize, head_dim: usize) -> KvGeometry {
        KvGeometry { num_blocks: 64, block_size, n_kv_heads, head_dim }
    }

    #[test]
    fn option_refusals_name_the_option() {
        assert!(check_options("t", None, None, None, 8).is_ok());
        assert!(check_options("t", Some(1), Some(50.0), Some(8), 8).is_ok());
        assert!(check_options("t", Some(4096), None, Some(16), 8).is_ok(), "a larger sink buffer");
        let msg = |r: Result<(), CudaError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg(check_options("t", Some(0), None, None, 8)).contains("window of 0"));
        for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(msg(check_options("t", None, Some(cap), None, 8)).contains("soft-cap"), "cap {cap}");
        }
        assert!(msg(check_options("t", None, None, Some(7), 8)).contains("7 sinks for 8"));
    }

    #[test]
    fn options_read_the_window_only() {
        let none = AttentionOptions::default();
        assert!(none.is_none());
        assert_eq!(none.effective_ctx(8192), 8192);
        assert_eq!(none.kernel_args(), (0, 0.0));
        let w = AttentionOptions { window: Some(1024), softcap: Some(50.0), sinks: None };
        assert!(!w.is_none());
        assert_eq!(w.effective_ctx(8192), 1024);
        assert_eq!(w.effective_ctx(100), 100);
        let (win, cap2) = w.kernel_args();
        assert_eq!(win, 1024);
        assert!((cap2 - 50.0 * std::f32::consts::LOG2_E).abs() < 1e-4);
        let huge = AttentionOptions { window: Some(usize::MAX), ..Default::default() };
        assert_eq!(huge.kernel_args().0, i32::MAX, "a window past any context");
    }

    #[test]
    fn prefill_shape_refusals() {
        let l = PrefillLists { seqs: vec![[0, 300, 0, 0]], max_end: 300, ..Default::default() };
        assert!(check_prefill_shape(&l, 32, geo(16, 8, 128), 4).is_ok());
        assert_eq!(check_prefill_shape(&l, 32, geo(16, 8, 128), 4).map(|r| r.1).ok(), Some(300usize.div_ceil(16)));
        assert!(check_prefill_shape(&l, 32, geo(16, 8, 96), 4).is_err(), "head_dim without a kernel");
        assert!(check_prefill_shape(&l, 30, geo(16, 8, 128), 4).is_err(), "heads not a multiple of KV heads");
        assert!(check_prefill_shape(&l, 32, geo(16, 0, 128), 4).is_err(), "no KV heads");
        assert!(check_prefill_shape(&l, 128, geo(16, 1, 64), 4).is_err(), "group larger than a tile");
        assert!(check_prefill_shape(&l, 128, geo(16, 1, 64), 8).is_ok(), "a 128-row tile holds 128 heads");
        let far = PrefillLists { max_end: 1 << 28, ..l.clone() };
        assert!(check_prefill_shape(&far, 32, geo(32, 8, 128), 4).is_err(), "block index overflow");
        let many = PrefillLists { seqs: vec![[0, 600_000, 0, 0]], max_end: 600_000, ..Default::default() };
        assert!(check_prefill_shape(&many, 64, geo(16, 8, 128), 4).is_err(), "grid too tall");
        assert!(check_prefill_shape(&many, 64, geo(16, 8, 128), 8).is_ok(), "half the tiles at 128 rows");
    }
}
