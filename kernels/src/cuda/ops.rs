//! Typed launchers for the kernels of `kernels/cuda/*.cu`, plus the per-step metadata the
//! paged kernels read (positions, cache slots, context lengths, block tables).
//!
//! Every launcher checks its element counts against the slices it is given before it
//! enqueues anything, so a shape bug is a [`CudaError::Shape`], never an out-of-bounds
//! access. Values that index memory inside a kernel (token ids, gathered rows, block ids)
//! are validated on the host before they are uploaded, which is why those launchers take
//! host data. Slices may be longer than the op needs (buffers grow and are reused).

use super::step_meta::grow;
pub use super::step_meta::{AttentionMeta, HostSeq, KvWriteMeta, StepMeta};
use super::{CudaDevice, CudaError, StepIds, shape_check};
use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

const THREADS: u32 = 256;

fn grid_for(total: usize) -> u32 {
    // Grid-stride kernels: enough blocks to fill any current GPU several times over.
    total.div_ceil(THREADS as usize).clamp(1, 65_535) as u32
}

pub(super) fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

pub(super) fn int(op: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape { op, message: format!("{v} does not fit a 32-bit index") })
}

pub(super) fn need<T>(op: &'static str, what: &str, s: &CudaSlice<T>, n: usize) -> Result<(), CudaError> {
    shape_check(op, s.len() >= n, || format!("{what} has {} elements, needs {n}", s.len()))
}

/// Which paged attention kernel a variant instantiates (see attention.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKind {
    /// `paged_attention_hd*`: each thread loads K/V rows into registers (16 bytes a token) and
    /// the dot products run on the CUDA cores with shuffle reductions.
    Registers,
    /// `paged_attention_tc_hd*`: K/V tiles go to a ring of shared-memory stages by cp.async
    /// (loads in flight without registers) and both products run on the tensor cores
    /// (`mma.sync`, the CTA's query heads as the M rows).
    TensorCore,
}

/// One compiled shape of the paged attention kernel (see attention.cu): the kernel kind,
/// warps per CTA, the load depth, query heads per CTA (a larger GQA group is split across
/// CTAs), and whether the next tile's loads are issued before the current one is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnVariant {
    /// Which kernel.
    pub kind: AttnKind,
    /// Warps per CTA.
    pub warps: u32,
    /// [`AttnKind::Registers`]: tokens in flight per thread (each a 16-byte K and a 16-byte V
    /// load). [`AttnKind::TensorCore`]: shared-memory stages in the ring (one is consumed while
    /// the others are in flight).
    pub unroll: u32,
    /// Query heads per CTA.
    pub max_group: u32,
    /// Register double-buffering of the next tile ([`AttnKind::Registers`] only).
    pub prefetch: bool,
}

impl AttnVariant {
    /// The kernel's name for `head_dim` (see `ATT_INSTANCE` and `ATT_TC_INSTANCE` in
    /// attention.cu). Both kinds are instantiated for every head_dim the launcher accepts
    /// (16, 32, 64, 128), so no variant needs a fallback.
    pub fn kernel_name(&self, head_dim: usize) -> String {
        format!("paged_attention_{}", self.label_for(head_dim))
    }

    /// A short name of the shape, as in the kernel name without the head_dim
    /// (`w4_u4_g4_p0`, `tc_w2_s4_g8`): for benchmark tables and result files.
    pub fn label(&self) -> String {
        match self.kind {
            AttnKind::Registers => {
                let p = u8::from(self.prefetch);
                format!("w{}_u{}_g{}_p{p}", self.warps, self.unroll, self.max_group)
            }
            AttnKind::TensorCore => format!("tc_w{}_s{}_g{}", self.warps, self.unroll, self.max_group),
        }
    }

    fn label_for(&self, head_dim: usize) -> String {
        match self.kind {
            AttnKind::Registers => format!("hd{head_dim}_{}", self.label()),
            AttnKind::TensorCore => {
                format!("tc_hd{head_dim}_w{}_s{}_g{}", self.warps, self.unroll, self.max_group)
            }
        }
    }
}

const fn reg(warps: u32, unroll: u32, max_group: u32, prefetch: bool) -> AttnVariant {
    AttnVariant { kind: AttnKind::Registers, warps, unroll, max_group, prefetch }
}

const fn tc(warps: u32, stages: u32, max_group: u32) -> AttnVariant {
    AttnVariant { kind: AttnKind::TensorCore, warps, unroll: stages, max_group, prefetch: false }
}

/// Every instantiated variant: the register kernels in the order of `ATT_VARIANTS`, then the
/// tensor-core kernels in the order of `ATT_TC_VARIANTS` (attention.cu).
pub const ATTN_VARIANTS: [AttnVariant; 9] = [
    reg(4, 4, 4, false),
    reg(4, 8, 4, false),
    reg(4, 4, 8, false),
    reg(4, 4, 4, true),
    reg(4, 2, 4, true),
    reg(4, 2, 8, true),
    // 2 warps, 4 stages of 16 tokens: 34.8 KB of shared memory at head_dim 128, 6 CTAs per SM.
    tc(2, 4, 8),
    // One more stage, one CTA fewer per SM (43.5 KB: 5 per SM): 4 stages in flight each.
    tc(2, 5, 8),
    // Up to 16 query heads per CTA (all 16 M rows): a group of 12 or 16 reads K/V once.
    tc(2, 4, 16),
];

/// The variant [`CudaDevice::attention`] uses for a GQA group of `group` query heads: the
/// tensor-core kernel with 4 shared-memory stages, 8 heads per CTA up to a group of 8 and 16
/// beyond (so that a group of 12 or 16 reads each K/V row once). Measured on an H100
/// (bench/results/cuda-kernels-tc-prefill-*): 71-86 % of copy at batch >= 32 and contexts of
/// 1k-4k, where the register kernels reached 50-57 %.
pub fn attn_default(group: usize) -> usize {
    if group > 8 { 8 } else { 6 }
}

/// How [`CudaDevice::attention_variant`] splits each row's context: `Auto` aims at several
/// CTAs per SM, `Fixed(n)` forces at most `n` splits (1 = no split; for benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnSplit {
    /// Chosen from the batch, the context lengths and the SM count.
    Auto,
    /// At most this many splits.
    Fixed(usize),
    /// Exactly this many splits (clamped to 1..=128) whatever the contexts: one launch
    /// configuration for any lengths, as a captured CUDA graph needs. Each row's context is
    /// cut in the kernel, so rows shorter than the splits leave the extra CTAs idle.
    Exact(usize),
}

/// Most splits of one row's context.
const MAX_SPLITS: usize = 128;
/// Fewest tokens per split: below this the partial results cost more than they save.
const MIN_SPLIT_TOKENS: usize = 64;

/// Splits and tokens per split for `ctas` CTAs per split over contexts of at most `max_ctx`
/// tokens on `sms` SMs: enough splits for about 4 CTAs per SM, each split at least
/// `MIN_SPLIT_TOKENS` long. Returns `(splits, chunk)` with `splits * chunk >= max_ctx`.
pub fn plan_splits(split: AttnSplit, ctas: usize, max_ctx: usize, sms: usize) -> (usize, usize) {
    let max_ctx = max_ctx.max(1);
    if let AttnSplit::Exact(n) = split {
        let n = n.clamp(1, MAX_SPLITS);
        return (n, max_ctx.div_ceil(n).next_multiple_of(16).max(MIN_SPLIT_TOKENS));
    }
    let by_len = max_ctx.div_ceil(MIN_SPLIT_TOKENS).clamp(1, MAX_SPLITS);
    let want = match split {
        AttnSplit::Auto => (4 * sms.max(1)).div_ceil(ctas.max(1)),
        AttnSplit::Fixed(n) | AttnSplit::Exact(n) => n,
    };
    let splits = want.clamp(1, by_len);
    // Chunks a multiple of 16 tokens (a common block size); recount after rounding.
    let chunk = max_ctx.div_ceil(splits).next_multiple_of(16);
    (max_ctx.div_ceil(chunk), chunk)
}

/// The checks every attention launcher (decode and prefill kernels) makes: GQA heads, the
/// metadata's cache geometry, and `q`/`out` (`rows × n_heads × head_dim`) and the caches long
/// enough.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_attention_io(
    op: &'static str,
    q: &CudaSlice<bf16>,
    out: &CudaSlice<bf16>,
    k_cache: &CudaSlice<bf16>,
    v_cache: &CudaSlice<bf16>,
    meta: &AttentionMeta,
    n_heads: usize,
    geo: KvGeometry,
) -> Result<(), CudaError> {
    shape_check(op, geo.n_kv_heads > 0 && n_heads.is_multiple_of(geo.n_kv_heads), || {
        format!("{n_heads} query heads is not a multiple of {} KV heads", geo.n_kv_heads)
    })?;
    meta.check_geometry(op, geo.block_size, geo.num_blocks)?;
    let len = meta.rows * n_heads * geo.head_dim;
    need(op, "q", q, len)?;
    need(op, "out", out, len)?;
    need(op, "k_cache", k_cache, geo.layer_len())?;
    need(op, "v_cache", v_cache, geo.layer_len())
}

/// The checks both RoPE + KV-write launchers share (head_dim, the metadata's geometry, the
/// caches and the frequency table), and their launch shape: one CTA per row, threads a
/// multiple of head_dim / 2. `None` when there are no rows.
fn rope_launch_config(
    op: &'static str,
    k_cache: &CudaSlice<bf16>,
    v_cache: &CudaSlice<bf16>,
    meta: &KvWriteMeta,
    inv_freq: &CudaSlice<f64>,
    geo: KvGeometry,
) -> Result<Option<LaunchConfig>, CudaError> {
    let hd = geo.head_dim;
    shape_check(op, hd >= 2 && hd.is_multiple_of(2) && hd <= 256, || format!("head_dim {hd} unsupported"))?;
    meta.check_geometry(op, geo.block_size, geo.num_blocks)?;
    need(op, "k_cache", k_cache, geo.layer_len())?;
    need(op, "v_cache", v_cache, geo.layer_len())?;
    need(op, "inv_freq", inv_freq, hd / 2)?;
    if meta.rows == 0 {
        return Ok(None);
    }
    let half = (hd / 2) as u32;
    Ok(Some(cfg((int(op, meta.rows)? as u32, 1, 1), half * (128 / half).max(1))))
}

/// The arguments of a RoPE + KV-write kernel: its own inputs (`lead`), then the caches, the
/// metadata, the frequency table and the head counts every entry takes in the same order.
#[allow(clippy::too_many_arguments)]
fn rope_args<'a>(
    op: &'static str,
    mut lead: Vec<Arg<'a>>,
    k_cache: &'a CudaSlice<bf16>,
    v_cache: &'a CudaSlice<bf16>,
    meta: &'a KvWriteMeta,
    inv_freq: &'a CudaSlice<f64>,
    n_heads: usize,
    geo: KvGeometry,
) -> Result<ArgList<'a>, CudaError> {
    lead.extend([
        Arg::Bf(k_cache),
        Arg::Bf(v_cache),
        Arg::I32s(&meta.positions),
        Arg::I64s(&meta.slots),
        Arg::F64s(inv_freq),
        Arg::I(int(op, n_heads)?),
        Arg::I(int(op, geo.n_kv_heads)?),
        Arg::I(int(op, geo.head_dim)?),
    ]);
    Ok(ArgList(lead))
}

/// Geometry of one layer's paged cache: `[num_blocks * block_size][n_kv_heads][head_dim]` bf16.
#[derive(Debug, Clone, Copy)]
pub struct KvGeometry {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl KvGeometry {
    /// Elements in one layer's K (or V) array.
    pub fn layer_len(&self) -> usize {
        self.num_blocks * self.block_size * self.n_kv_heads * self.head_dim
    }
}

impl CudaDevice {
    pub(super) fn run(
        &self,
        f: &cudarc::driver::CudaFunction,
        c: LaunchConfig,
        args: &mut ArgList<'_>,
    ) -> Result<(), CudaError> {
        let mut b = self.stream.launch_builder(f);
        for a in args.0.iter() {
            match a {
                Arg::Bf(s) => b.arg(*s),
                Arg::F32(s) => b.arg(*s),
                Arg::I32s(s) => b.arg(*s),
                Arg::I64s(s) => b.arg(*s),
                Arg::U32s(s) => b.arg(*s),
                Arg::F64s(s) => b.arg(*s),
                Arg::I(v) => b.arg(v),
                Arg::L(v) => b.arg(v),
                Arg::F(v) => b.arg(v),
            };
        }
        // SAFETY: every caller checked the element counts its kernel touches against the
        // slices, and index data (tokens, rows, block ids, slots) was validated on the host.
        unsafe { b.launch(c) }?;
        Ok(())
    }

    /// `out[i] = table[tokens[i]]` widened to f32, the residual stream (`table` is
    /// `vocab × dim` bf16). `ids` receives the ids (see [`StepIds::stage`]).
    pub fn embed(
        &self,
        tokens: &[u32],
        ids: &mut StepIds,
        table: &CudaSlice<bf16>,
        vocab: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        ids.stage(self, tokens, vocab, &[], None)?;
        self.embed_staged(tokens.len(), ids.ids(), table, vocab, dim, out)
    }

    /// The launch half of [`CudaDevice::embed`]: rows `0..n` from ids already in `ids`
    /// (staged by [`StepIds::stage`]); nothing is uploaded, so it can be recorded.
    pub fn embed_staged(
        &self,
        n: usize,
        ids: &CudaSlice<u32>,
        table: &CudaSlice<bf16>,
        vocab: usize,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "embed";
        need(OP, "table", table, vocab * dim)?;
        need(OP, "out", out, n * dim)?;
        need(OP, "ids", ids, n)?;
        if n == 0 {
            return Ok(());
        }
        let rows = int(OP, n)?;
        let d = int(OP, dim)?;
        self.run(
            &self.funcs.embed,
            cfg((rows as u32, 1, 1), THREADS),
            &mut ArgList(vec![Arg::U32s(ids), Arg::Bf(table), Arg::F32(out), Arg::I(d)]),
        )
    }

    /// `out = x / rms(x) * w` for `rows` rows of width `dim`: `x` is the f32 residual
    /// stream, `out` the bf16 activation.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "rms_norm";
        need(OP, "x", x, rows * dim)?;
        need(OP, "weight", w, dim)?;
        need(OP, "out", out, rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let d = int(OP, dim)?;
        self.run(
            &self.funcs.rms_norm,
            cfg((int(OP, rows)? as u32, 1, 1), THREADS),
            &mut ArgList(vec![Arg::F32(x), Arg::Bf(w), Arg::Bf(out), Arg::I(d), Arg::F(eps)]),
        )
    }

    /// `residual += x; out = rms_norm(residual) * w`, row by row: the residual is f32 (the
    /// bf16 branch output `x` is added without rounding the sum), `out` is bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        residual: &mut CudaSlice<f32>,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "add_rms_norm";
        need(OP, "residual", residual, rows * dim)?;
        need(OP, "x", x, rows * dim)?;
        need(OP, "weight", w, dim)?;
        need(OP, "out", out, rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let d = int(OP, dim)?;
        self.run(
            &self.funcs.add_rms_norm,
            cfg((int(OP, rows)? as u32, 1, 1), THREADS),
            &mut ArgList(vec![Arg::F32(residual), Arg::Bf(x), Arg::Bf(w), Arg::Bf(out), Arg::I(d), Arg::F(eps)]),
        )
    }

    /// `out = silu(gate) * up` for rows `[gate | up]` of width `2d`.
    pub fn silu_mul(
        &self,
        gate_up: &CudaSlice<bf16>,
        rows: usize,
        d: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "silu_mul";
        need(OP, "gate_up", gate_up, rows * 2 * d)?;
        need(OP, "out", out, rows * d)?;
        let total = rows * d;
        if total == 0 {
            return Ok(());
        }
        self.run(
            &self.funcs.silu_mul,
            cfg((grid_for(total), 1, 1), THREADS),
            &mut ArgList(vec![Arg::Bf(gate_up), Arg::Bf(out), Arg::I(int(OP, d)?), Arg::L(total as i64)]),
        )
    }

    /// `x[r, j] += bias[j]` for `rows` rows of width `n`.
    pub fn bias_add(
        &self,
        x: &mut CudaSlice<bf16>,
        bias: &CudaSlice<bf16>,
        rows: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "bias_add";
        need(OP, "x", x, rows * n)?;
        need(OP, "bias", bias, n)?;
        let total = rows * n;
        if total == 0 {
            return Ok(());
        }
        self.run(
            &self.funcs.bias_add,
            cfg((grid_for(total), 1, 1), THREADS),
            &mut ArgList(vec![Arg::Bf(x), Arg::Bf(bias), Arg::I(int(OP, n)?), Arg::L(total as i64)]),
        )
    }

    /// `dst[r, c] = src[r, col0 + c]` for `rows` rows, `c < dst_w`; `src` rows have width `src_w`.
    pub fn copy_cols(
        &self,
        src: &CudaSlice<bf16>,
        rows: usize,
        src_w: usize,
        col0: usize,
        dst: &mut CudaSlice<bf16>,
        dst_w: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "copy_cols";
        shape_check(OP, col0 + dst_w <= src_w, || format!("columns {col0}..{} of width {src_w}", col0 + dst_w))?;
        need(OP, "src", src, rows * src_w)?;
        need(OP, "dst", dst, rows * dst_w)?;
        let total = rows * dst_w;
        if total == 0 {
            return Ok(());
        }
        self.run(
            &self.funcs.copy_cols,
            cfg((grid_for(total), 1, 1), THREADS),
            &mut ArgList(vec![
                Arg::Bf(src),
                Arg::I(int(OP, src_w)?),
                Arg::I(int(OP, col0)?),
                Arg::Bf(dst),
                Arg::I(int(OP, dst_w)?),
                Arg::L(total as i64),
            ]),
        )
    }

    /// `dst[i] = src[rows[i]]` for bf16 rows of width `w`; `src` has `src_rows` rows.
    /// `scratch` receives the row ids.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        src: &CudaSlice<bf16>,
        src_rows: usize,
        w: usize,
        rows: &[usize],
        scratch: &mut CudaSlice<i32>,
        dst: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        if !self.gather_prepare("gather_rows", src.len(), dst.len(), src_rows, w, rows, scratch)? {
            return Ok(());
        }
        self.run(
            &self.funcs.gather_rows,
            cfg((int("gather_rows", rows.len())? as u32, 1, 1), THREADS),
            &mut ArgList(vec![Arg::Bf(src), Arg::I32s(scratch), Arg::Bf(dst), Arg::I(int("gather_rows", w)?)]),
        )
    }

    /// [`CudaDevice::gather_rows`] over f32 rows (the residual stream).
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows_f32(
        &self,
        src: &CudaSlice<f32>,
        src_rows: usize,
        w: usize,
        rows: &[usize],
        scratch: &mut CudaSlice<i32>,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if !self.gather_prepare("gather_rows_f32", src.len(), dst.len(), src_rows, w, rows, scratch)? {
            return Ok(());
        }
        self.run(
            &self.funcs.gather_rows_f32,
            cfg((int("gather_rows_f32", rows.len())? as u32, 1, 1), THREADS),
            &mut ArgList(vec![Arg::F32(src), Arg::I32s(scratch), Arg::F32(dst), Arg::I(int("gather_rows_f32", w)?)]),
        )
    }

    /// Validates a row gather and uploads the row ids; `false` when there is nothing to do.
    #[allow(clippy::too_many_arguments)]
    fn gather_prepare(
        &self,
        op: &'static str,
        src_len: usize,
        dst_len: usize,
        src_rows: usize,
        w: usize,
        rows: &[usize],
        scratch: &mut CudaSlice<i32>,
    ) -> Result<bool, CudaError> {
        if let Some(r) = rows.iter().find(|&&r| r >= src_rows) {
            return Err(CudaError::Shape { op, message: format!("row {r} outside {src_rows} rows") });
        }
        shape_check(op, src_len >= src_rows * w, || format!("src has {src_len} elements, needs {}", src_rows * w))?;
        shape_check(op, dst_len >= rows.len() * w, || format!("dst has {dst_len} elements, needs {}", rows.len() * w))?;
        if rows.is_empty() || w == 0 {
            return Ok(false);
        }
        let ids = rows.iter().map(|&r| int(op, r)).collect::<Result<Vec<_>, _>>()?;
        grow(self, scratch, ids.len())?;
        self.upload_into(&ids, scratch)?;
        Ok(true)
    }

    /// Widens the first `n` values of `src` into `dst`.
    pub fn bf16_to_f32(&self, src: &CudaSlice<bf16>, dst: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        need("bf16_to_f32", "src", src, n)?;
        need("bf16_to_f32", "dst", dst, n)?;
        if n == 0 {
            return Ok(());
        }
        self.run(
            &self.funcs.bf16_to_f32,
            cfg((grid_for(n), 1, 1), THREADS),
            &mut ArgList(vec![Arg::Bf(src), Arg::F32(dst), Arg::L(n as i64)]),
        )
    }

    /// Rounds the first `n` values of `src` to bf16 (nearest even) into `dst`.
    pub fn f32_to_bf16(&self, src: &CudaSlice<f32>, dst: &mut CudaSlice<bf16>, n: usize) -> Result<(), CudaError> {
        need("f32_to_bf16", "src", src, n)?;
        need("f32_to_bf16", "dst", dst, n)?;
        if n == 0 {
            return Ok(());
        }
        self.run(
            &self.funcs.f32_to_bf16,
            cfg((grid_for(n), 1, 1), THREADS),
            &mut ArgList(vec![Arg::F32(src), Arg::Bf(dst), Arg::L(n as i64)]),
        )
    }

    /// `out = x · wᵀ` through cuBLAS (bf16 in and out, f32 accumulation): `x` is `m × k`,
    /// `w` is `n × k` row-major (the Hugging Face layout), `out` is `m × n`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "linear";
        need(OP, "x", x, m * k)?;
        need(OP, "w", w, n * k)?;
        need(OP, "out", out, m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        // Column-major view: outᵀ (n × m) = W (k × n col-major, transposed) · xᵀ (k × m).
        let c = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: int(OP, n)?,
            n: int(OP, m)?,
            k: int(OP, k)?,
            alpha: bf16::ONE,
            lda: int(OP, k)?,
            ldb: int(OP, k)?,
            beta: bf16::ZERO,
            ldc: int(OP, n)?,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: the sizes were checked against the slices above.
        unsafe { self.blas.gemm(c, w, x, out) }?;
        Ok(())
    }

    /// `out = x · wᵀ` like [`CudaDevice::linear`], but the product is written in f32 (bf16
    /// operands, f32 accumulation and output): used for the LM head, so that logits reach the
    /// sampler without bf16 rounding (a 1/16 grid at |logit| ≈ 16).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_f32_out(
        &self,
        x: &CudaSlice<bf16>,
        m: usize,
        k: usize,
        w: &CudaSlice<bf16>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{result::gemm_ex, sys};
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        const OP: &str = "linear_f32_out";
        need(OP, "x", x, m * k)?;
        need(OP, "w", w, n * k)?;
        need(OP, "out", out, m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (int(OP, m)?, int(OP, n)?, int(OP, k)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.ctx.bind_to_thread()?;
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        // Column-major view as in `linear`: outᵀ (n × m) = Wᵀ-view (n × k) · xᵀ (k × m).
        // SAFETY: the sizes were checked against the slices above; the pointers stay valid
        // while the guards live, and the handle enqueues on this device's stream.
        unsafe {
            gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                ki,
                xp as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                ki,
                (&beta) as *const f32 as *const _,
                op as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                ni,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    /// RoPE on `q` (`rows × n_heads × head_dim`) and `k` (`rows × n_kv_heads × head_dim`) in
    /// place at each row's position, then the rotated k and `v` into the layer's cache slots.
    /// `inv_freq` holds `head_dim / 2` inverse frequencies (scaling applied).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_write_kv(
        &self,
        q: &mut CudaSlice<bf16>,
        k: &mut CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        k_cache: &mut CudaSlice<bf16>,
        v_cache: &mut CudaSlice<bf16>,
        meta: &KvWriteMeta,
        inv_freq: &CudaSlice<f64>,
        n_heads: usize,
        geo: KvGeometry,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_write_kv";
        let (rows, hd) = (meta.rows, geo.head_dim);
        need(OP, "q", q, rows * n_heads * hd)?;
        need(OP, "k", k, rows * geo.n_kv_heads * hd)?;
        need(OP, "v", v, rows * geo.n_kv_heads * hd)?;
        let Some(launch) = rope_launch_config(OP, k_cache, v_cache, meta, inv_freq, geo)? else {
            return Ok(());
        };
        self.run(
            &self.funcs.rope_write_kv,
            launch,
            &mut rope_args(
                OP,
                vec![Arg::Bf(q), Arg::Bf(k), Arg::Bf(v)],
                k_cache,
                v_cache,
                meta,
                inv_freq,
                n_heads,
                geo,
            )?,
        )
    }

    /// [`CudaDevice::rope_write_kv`] reading rows `[q | k | v]` of the QKV projection
    /// (`rows × (n_heads + 2·n_kv_heads) × head_dim`) in place of three split buffers: the
    /// rotated q goes to `q_out` (`rows × n_heads × head_dim`), the rotated k and v only to
    /// the cache. Saves the three column copies of a split and their launches.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qkv_write_kv(
        &self,
        qkv: &CudaSlice<bf16>,
        q_out: &mut CudaSlice<bf16>,
        k_cache: &mut CudaSlice<bf16>,
        v_cache: &mut CudaSlice<bf16>,
        meta: &KvWriteMeta,
        inv_freq: &CudaSlice<f64>,
        n_heads: usize,
        geo: KvGeometry,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_qkv_write_kv";
        let (rows, hd) = (meta.rows, geo.head_dim);
        need(OP, "qkv", qkv, rows * (n_heads + 2 * geo.n_kv_heads) * hd)?;
        need(OP, "q_out", q_out, rows * n_heads * hd)?;
        let Some(launch) = rope_launch_config(OP, k_cache, v_cache, meta, inv_freq, geo)? else {
            return Ok(());
        };
        self.run(
            &self.funcs.rope_qkv_write_kv,
            launch,
            &mut rope_args(OP, vec![Arg::Bf(qkv), Arg::Bf(q_out)], k_cache, v_cache, meta, inv_freq, n_heads, geo)?,
        )
    }

    /// Paged causal attention of `q` (`rows × n_heads × head_dim`) over the layer's cache,
    /// which already holds every row's own K/V; writes `out` in `q`'s layout. Long contexts
    /// are split across CTAs (`meta` holds the partials).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        meta: &mut AttentionMeta,
        n_heads: usize,
        geo: KvGeometry,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.attention_split(AttnSplit::Auto, q, k_cache, v_cache, meta, n_heads, geo, scale, out)
    }

    /// [`CudaDevice::attention`] with the given split policy (graph replays use
    /// [`AttnSplit::Exact`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_split(
        &self,
        split: AttnSplit,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        meta: &mut AttentionMeta,
        n_heads: usize,
        geo: KvGeometry,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let group = n_heads / geo.n_kv_heads.max(1);
        let v = attn_default(group);
        self.attention_variant(v, split, q, k_cache, v_cache, meta, n_heads, geo, scale, out)
    }

    /// The splits [`CudaDevice::attention`] would use for `rows` rows of contexts up to
    /// `max_ctx` (what a graph recorded for such a step is keyed by).
    pub fn attention_auto_splits(&self, rows: usize, n_heads: usize, n_kv_heads: usize, max_ctx: usize) -> usize {
        let group = n_heads / n_kv_heads.max(1);
        let max_group = ATTN_VARIANTS.get(attn_default(group)).map_or(1, |v| v.max_group as usize);
        let ctas = n_kv_heads * group.div_ceil(max_group.max(1)) * rows;
        plan_splits(AttnSplit::Auto, ctas, max_ctx, self.sm_count).0
    }

    /// [`CudaDevice::attention`] with the kernel variant `ATTN_VARIANTS[variant]` and the
    /// given split policy. Returns after enqueueing; the split count used is
    /// [`plan_splits`] of the same arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_variant(
        &self,
        variant: usize,
        split: AttnSplit,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        meta: &mut AttentionMeta,
        n_heads: usize,
        geo: KvGeometry,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        self.attention_launch(variant, split, q, k_cache, v_cache, meta, n_heads, geo, scale, out, false)
    }

    /// The decode kernel's launch. With `decode_only` it reads the context lengths in which
    /// prefill rows hold 0 (they exit at once; see `prefill.rs`) and covers rows up to the last
    /// decode row only.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_launch(
        &self,
        variant: usize,
        split: AttnSplit,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        meta: &mut AttentionMeta,
        n_heads: usize,
        geo: KvGeometry,
        scale: f32,
        out: &mut CudaSlice<bf16>,
        decode_only: bool,
    ) -> Result<(), CudaError> {
        const OP: &str = "paged_attention";
        let all_rows = meta.rows;
        let hd = geo.head_dim;
        let hd_idx = match hd {
            16 => 0,
            32 => 1,
            64 => 2,
            128 => 3,
            _ => return Err(CudaError::Shape { op: OP, message: format!("head_dim {hd} has no kernel") }),
        };
        let (v, func) = match (ATTN_VARIANTS.get(variant), self.funcs.attention[hd_idx].get(variant)) {
            (Some(v), Some(f)) => (*v, f),
            _ => return Err(CudaError::Shape { op: OP, message: format!("no attention variant {variant}") }),
        };
        check_attention_io(OP, q, out, k_cache, v_cache, meta, n_heads, geo)?;
        let (rows, max_ctx) = if decode_only {
            (meta.prefill.lists.decode_rows_end, meta.prefill.lists.decode_max_ctx)
        } else {
            (all_rows, meta.max_ctx)
        };
        if rows == 0 {
            return Ok(());
        }
        shape_check(OP, rows <= 65_535, || format!("{rows} rows exceed the grid's y limit"))?;
        let group = n_heads / geo.n_kv_heads;
        let gchunks = group.div_ceil(v.max_group as usize);
        let x = geo.n_kv_heads * gchunks;
        // Only the split count reaches the kernel: each row's chunk is cut there from its own
        // length (`split_chunk` in attention.cu), with MIN_SPLIT_TOKENS as the least.
        let (splits, _) = plan_splits(split, x * rows, max_ctx, self.sm_count);
        let min_chunk = int(OP, MIN_SPLIT_TOKENS)?;
        if splits > 1 {
            grow(self, &mut meta.part_o, rows * n_heads * splits * hd)?;
            grow(self, &mut meta.part_ml, rows * n_heads * splits * 2)?;
        }
        let qscale = scale * std::f32::consts::LOG2_E;
        let row_ctx = if decode_only { &meta.prefill.decode_ctx } else { &meta.row_ctx };
        self.run(
            func,
            cfg((int(OP, x)? as u32, int(OP, rows)? as u32, splits as u32), v.warps * 32),
            &mut ArgList(vec![
                Arg::Bf(q),
                Arg::Bf(k_cache),
                Arg::Bf(v_cache),
                Arg::Bf(out),
                Arg::F32(&meta.part_o),
                Arg::F32(&meta.part_ml),
                Arg::I32s(row_ctx),
                Arg::I32s(&meta.row_bt),
                Arg::I32s(&meta.block_tables),
                Arg::I(int(OP, n_heads)?),
                Arg::I(int(OP, geo.n_kv_heads)?),
                Arg::I(int(OP, geo.block_size)?),
                Arg::F(qscale),
                Arg::I(min_chunk),
            ]),
        )?;
        if splits > 1 {
            self.run(
                &self.funcs.attention_combine[hd_idx],
                cfg((int(OP, n_heads)? as u32, int(OP, rows)? as u32, 1), hd as u32),
                &mut ArgList(vec![
                    Arg::F32(&meta.part_o),
                    Arg::F32(&meta.part_ml),
                    Arg::Bf(out),
                    Arg::I32s(row_ctx),
                    Arg::I(int(OP, n_heads)?),
                    Arg::I(int(OP, splits)?),
                    Arg::I(min_chunk),
                ]),
            )?;
        }
        Ok(())
    }
}

/// One kernel argument; device slices by reference, scalars by value.
pub(super) enum Arg<'a> {
    Bf(&'a CudaSlice<bf16>),
    F32(&'a CudaSlice<f32>),
    I32s(&'a CudaSlice<i32>),
    I64s(&'a CudaSlice<i64>),
    U32s(&'a CudaSlice<u32>),
    F64s(&'a CudaSlice<f64>),
    I(i32),
    L(i64),
    F(f32),
}

pub(super) struct ArgList<'a>(pub(super) Vec<Arg<'a>>);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_variants_name_their_kernels() {
        assert_eq!(ATTN_VARIANTS[0].kernel_name(128), "paged_attention_hd128_w4_u4_g4_p0");
        assert_eq!(ATTN_VARIANTS[6].kernel_name(16), "paged_attention_tc_hd16_w2_s4_g8");
        assert_eq!(ATTN_VARIANTS[6].label(), "tc_w2_s4_g8");
        // The default exists for any group and, being a tensor-core variant, covers a group of
        // up to 8 (16 beyond) in one CTA per KV head.
        for group in 1..=32 {
            let v = ATTN_VARIANTS[attn_default(group)];
            assert_eq!(v.kind, AttnKind::TensorCore);
            assert!(group <= 8 || v.max_group == 16, "group {group}: {v:?}");
        }
    }

    #[test]
    fn split_plans_cover_the_context_and_fill_the_device() {
        // Batch 1, 8 KV heads, 2k context on 132 SMs: many splits of at least 64 tokens.
        let (s, c) = plan_splits(AttnSplit::Auto, 8, 2048, 132);
        assert!(s >= 16 && c >= MIN_SPLIT_TOKENS && s * c >= 2048 && (s - 1) * c < 2048, "{s} × {c}");
        // A large batch already fills the device: no split.
        assert_eq!(plan_splits(AttnSplit::Auto, 256 * 8, 4096, 132).0, 1);
        // Forced values, clamped by the context; every split but the last is non-empty.
        assert_eq!(plan_splits(AttnSplit::Fixed(1), 8, 100_000, 132), (1, 100_000usize.next_multiple_of(16)));
        for ctx in [1usize, 15, 16, 17, 63, 64, 65, 1000, 4100, 131_072] {
            for f in [1usize, 2, 7, 64, 1000] {
                let (s, c) = plan_splits(AttnSplit::Fixed(f), 8, ctx, 132);
                assert!(
                    (1..=MAX_SPLITS).contains(&s) && s * c >= ctx && (s - 1) * c < ctx,
                    "ctx {ctx} f {f}: {s} × {c}"
                );
                assert!(c.is_multiple_of(16));
            }
        }
    }
}
