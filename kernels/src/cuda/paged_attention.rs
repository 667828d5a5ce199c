//! The decode kernel of `kernels/cuda/attention.cu` (`paged_attention_*`), described: its
//! compiled variants and their names, which one runs by default, and how each row's context
//! is split across CTAs. Pure data and rules, no device: the launcher is
//! [`AttentionCall`](super::AttentionCall).
//!
//! Invariants: [`ATTN_VARIANTS`] lists the `ATT_INSTANCE` then the `ATT_TC_INSTANCE` lines of
//! attention.cu in order (a unit test of `sources.rs` compares them), and every variant is
//! instantiated for every head_dim of [`ATTN_HEAD_DIMS`]; [`plan_splits`] never returns more
//! than 128 splits, and its splits cover the longest context.

use super::gemv::GEMV_KERNEL_MAX_M;

/// Head dims every attention variant is instantiated for, in the order of the device's
/// function table. 256 is Gemma 2/3's (the other listed models: gpt-oss 64, Llama and Qwen3
/// 128; Phi-3/4-mini's 96 is not here: the register kernels need `head_dim / 8` to divide a
/// warp, so 96 takes `AttentionExtCall`).
///
/// At head_dim 256 the tensor-core shapes need more than the 48 KiB a CTA may declare
/// statically, and take it as dynamic shared memory ([`tc_dynamic_smem`]), by
/// `tc_smem_bytes` (attention.cu; [`tc_smem_bytes`] here):
/// - bf16 `tc_w2_s4_g8` / `tc_w2_s4_g16`: 4 stages × (K + V) × 16 tokens × 528-byte rows =
///   67,584 B (the g16 merge, 2 × 16 × 258 × 4 = 33,024 B, fits in it): 3 CTAs per SM;
///   `tc_w2_s5_g8`: 84,480 B, 2 per SM;
/// - FP8 (16 tokens a warp) `tc_w2_s3_g8`: 3 × 2 × 32 × 272 = 52,224 B of codes (4 per SM);
///   `tc_w2_s4_g8` / `_g16`: 69,632 B (3 per SM);
/// - registers (the accumulators are 64 f32 a thread at 8 heads, 128 at 16; Q fragments 32 /
///   64): ptxas (NVRTC sm_90a, `cuobjdump -res-usage`) gives 245-252 registers, no stack or
///   local memory, for all six tensor-core shapes at 256 (64 threads: 4 CTAs per SM by
///   registers, so shared memory sets the residency above); the register variants 223.
///
/// The register variants keep static shared memory at 256 (8 heads: 32 KiB of merge space).
pub(crate) const ATTN_HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];

/// Shared memory a CTA may declare statically; a tensor-core shape needing more takes it as
/// dynamic shared memory (`TC_STATIC_SMEM` in attention.cu).
const TC_STATIC_SMEM: usize = 48 * 1024;

/// Shared memory of one tensor-core CTA (`tc_smem_bytes` in attention.cu): the ring of
/// `stages` stages of K and V for `8 × warps` tokens (FP8: `16 × warps`; rows padded by 16
/// bytes), or the end-of-kernel merge if larger. 0 for register variants.
pub(crate) fn tc_smem_bytes(v: &AttnVariant, head_dim: usize, fp8: bool) -> usize {
    if v.kind != AttnKind::TensorCore {
        return 0;
    }
    let (nw, ns, mg) = (v.warps as usize, v.unroll as usize, v.max_group as usize);
    // FP8: 16 tokens a warp (tokens are the mma's M, attention_tc_fp8.cu); bf16: 8.
    let (ring_row, warp_tokens) = if fp8 { (head_dim + 16, 16) } else { ((head_dim + 8) * 2, 8) };
    let ring = ns * 2 * (warp_tokens * nw) * ring_row;
    ring.max(nw * mg * (head_dim + 2) * 4)
}

/// The dynamic shared memory a variant's launch passes: its [`tc_smem_bytes`] when that is
/// over the static limit (the kernel then declares none statically), else 0.
pub(crate) fn tc_dynamic_smem(v: &AttnVariant, head_dim: usize, fp8: bool) -> usize {
    let bytes = tc_smem_bytes(v, head_dim, fp8);
    if bytes > TC_STATIC_SMEM { bytes } else { 0 }
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
    /// `paged_attention_st_hd*` (attention_stream.cu, sm_90): a CTA takes every KV head of a row
    /// (up to `warps`, one a warp) and streams the row's contiguous token slots into its ring
    /// with the bulk copy engine, one copy per token row (the one-warp variant, whose rows are a
    /// single KV head, by 16-byte cp.async copies instead: a bulk copy costs the same ~55 ns
    /// for 256 bytes as for 2 KB); products as [`AttnKind::TensorCore`].
    Stream,
}

/// One compiled shape of the paged attention kernel (see attention.cu): the kernel kind,
/// warps per CTA, the load depth, query heads per CTA (a larger GQA group is split across
/// CTAs), and whether the next tile's loads are issued before the current one is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnVariant {
    /// Which kernel.
    pub kind: AttnKind,
    /// Warps per CTA ([`AttnKind::Stream`]: the most, one per KV head of the CTA; see
    /// [`stream_kv_heads`]).
    pub warps: u32,
    /// [`AttnKind::Registers`]: tokens in flight per thread (each a 16-byte K and a 16-byte V
    /// load). [`AttnKind::TensorCore`]: shared-memory stages in the ring (one is consumed while
    /// the others are in flight).
    pub unroll: u32,
    /// Query heads per CTA.
    pub max_group: u32,
    /// Register double-buffering of the next tile ([`AttnKind::Registers`] only).
    pub prefetch: bool,
    /// Whether the kernel reads an FP8 (E4M3) cache: the entries of [`ATTN_FP8_VARIANTS`].
    pub fp8: bool,
}

impl AttnVariant {
    /// The kernel's name for `head_dim` (see `ATT_INSTANCE` and `ATT_TC_INSTANCE` in
    /// attention.cu). Both kinds are instantiated for every head_dim the launcher accepts
    /// ([`ATTN_HEAD_DIMS`]), so no variant needs a fallback.
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
            AttnKind::Stream => format!("st_w{}_s{}_g{}", self.warps, self.unroll, self.max_group),
        }
    }

    fn label_for(&self, head_dim: usize) -> String {
        match self.kind {
            AttnKind::Registers => format!("hd{head_dim}_{}", self.label()),
            AttnKind::TensorCore => {
                format!("tc_hd{head_dim}_w{}_s{}_g{}", self.warps, self.unroll, self.max_group)
            }
            AttnKind::Stream => format!("st_hd{head_dim}_w{}_s{}_g{}", self.warps, self.unroll, self.max_group),
        }
    }

    /// CTAs one row takes along the grid's x axis: one per KV head (a streaming variant: per
    /// [`stream_kv_heads`] KV heads) and chunk of `max_group` query heads of its GQA group.
    pub fn ctas_per_row(&self, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> usize {
        let group = n_heads / n_kv_heads.max(1);
        let heads = match self.kind {
            AttnKind::Stream => n_kv_heads / stream_kv_heads(self, n_kv_heads, head_dim).max(1),
            _ => n_kv_heads,
        };
        heads * group.div_ceil((self.max_group as usize).max(1))
    }

    /// Threads of one CTA: `warps` warps, or for a streaming variant one warp per KV head of
    /// the CTA.
    pub(crate) fn threads(&self, n_kv_heads: usize, head_dim: usize) -> u32 {
        match self.kind {
            AttnKind::Stream => 32 * stream_kv_heads(self, n_kv_heads, head_dim).max(1) as u32,
            _ => 32 * self.warps,
        }
    }

    /// CTAs of this variant that fit on one SM of `sm_smem` bytes of shared memory (1 KiB
    /// reserved per CTA; [`split_smem`]), for the split rule: the streaming ring usually takes
    /// the SM alone.
    pub(crate) fn stream_ctas_per_sm(&self, n_kv_heads: usize, head_dim: usize, sm_smem: usize) -> usize {
        let kvc = stream_kv_heads(self, n_kv_heads, head_dim).max(1);
        (sm_smem / (stream_smem_bytes(self, kvc, head_dim) + 1024)).max(1)
    }
}

/// Shared memory of one SM (H100), of which a CTA may take [`CTA_SMEM_LIMIT`].
const SM_SMEM: usize = 228 * 1024;

/// The shared memory per SM the split rule plans the streaming kernel's CTAs in: the SM's
/// whole, or, when decode attention's carve-out is pinned and the plan follows it
/// (`CudaDevice::attention_split_smem`), that share of it.
pub(crate) fn split_smem(pin: Option<u32>) -> usize {
    pin.map_or(SM_SMEM, |p| SM_SMEM * p.min(100) as usize / 100)
}
/// The most dynamic shared memory one CTA may take on sm_90 (227 KiB).
pub(crate) const CTA_SMEM_LIMIT: usize = 227 * 1024;
/// Tokens of one streaming ring stage (`ST_TOKENS` in attention_stream.cu).
const STREAM_STAGE_TOKENS: usize = 16;

/// Shared memory of a streaming CTA over `kvc` KV heads (`attention_stream.cu`): `unroll`
/// stages of K and V rows of 16 tokens, each row the CTA's heads (bf16, or FP8 codes) padded by
/// 16 bytes, and one 8-byte mbarrier per stage.
pub(crate) fn stream_smem_bytes(v: &AttnVariant, kvc: usize, head_dim: usize) -> usize {
    let (ns, elem) = (v.unroll as usize, if v.fp8 { 1 } else { 2 });
    ns * 2 * STREAM_STAGE_TOKENS * (kvc * head_dim * elem + 16) + ns * 8
}

/// KV heads one CTA of a streaming variant takes: the largest divisor of `n_kv_heads` of at
/// most `warps` whose ring fits a CTA's shared memory ([`CTA_SMEM_LIMIT`]); 0 for other kinds
/// or when none fits.
pub fn stream_kv_heads(v: &AttnVariant, n_kv_heads: usize, head_dim: usize) -> usize {
    if v.kind != AttnKind::Stream {
        return 0;
    }
    (1..=(v.warps as usize).min(n_kv_heads))
        .rev()
        .find(|&d| n_kv_heads.is_multiple_of(d) && stream_smem_bytes(v, d, head_dim) <= CTA_SMEM_LIMIT)
        .unwrap_or(0)
}

/// The combine kernel's name for `head_dim` (the merge of split partials; attention.cu).
pub(crate) fn combine_kernel_name(head_dim: usize) -> String {
    format!("attention_combine_hd{head_dim}")
}

const fn reg(warps: u32, unroll: u32, max_group: u32, prefetch: bool) -> AttnVariant {
    AttnVariant { kind: AttnKind::Registers, warps, unroll, max_group, prefetch, fp8: false }
}

const fn tc(warps: u32, stages: u32, max_group: u32) -> AttnVariant {
    AttnVariant { kind: AttnKind::TensorCore, warps, unroll: stages, max_group, prefetch: false, fp8: false }
}

const fn st(warps: u32, stages: u32, max_group: u32) -> AttnVariant {
    AttnVariant { kind: AttnKind::Stream, warps, unroll: stages, max_group, prefetch: false, fp8: false }
}

/// `variant` over an FP8 cache.
const fn fp8(variant: AttnVariant) -> AttnVariant {
    AttnVariant { fp8: true, ..variant }
}

/// The variants over an FP8 (E4M3) cache: the tensor-core ones (`ATT_TC_FP8_INSTANCE` in
/// attention_tc_fp8.cu, kernel names `paged_attention_tc_fp8_*`: tokens are the mma's M, 16 a
/// warp per stage, so a stage of 2 warps is 32 tokens; at head_dim 128, 4 stages are 36.9 KB
/// of codes (6 CTAs per SM), 3 stages 27.6 KB), then the streaming ones (`ATT_ST_FP8_INSTANCE` in
/// attention_stream.cu, `paged_attention_st_fp8_*`).
pub const ATTN_FP8_VARIANTS: [AttnVariant; 8] = [
    fp8(tc(2, 3, 8)),
    fp8(tc(2, 4, 8)),
    fp8(tc(2, 4, 16)),
    // Streaming (attention_stream.cu): 8 KV heads a CTA at 3 stages of 33 KB (Llama-3.1-8B heads:
    // two CTAs per SM), at 6 (one per SM); 4 KV heads at 4 stages (three per SM); 16 heads a warp.
    fp8(st(8, 3, 8)),
    fp8(st(8, 6, 8)),
    fp8(st(4, 4, 8)),
    fp8(st(8, 3, 16)),
    // One KV head a CTA, 4 stages (17.4 KB at those heads), for small batches.
    fp8(st(1, 4, 8)),
];

/// The FP8 variant the decode kernel uses by default for a GQA group of `group` query heads
/// (index in [`ATTN_FP8_VARIANTS`]): the 3-stage ring, or with 16 heads per CTA beyond a group
/// of 8 the 4-stage one. Measured on the H100 (`cuda_bench_fp8`, session 14, Llama-3.1-8B
/// heads): 3 stages were as fast as or faster than 4 at every batch and context (128 x 4096:
/// 423 against 467 µs); the 16-head shape was measured at 4 stages only.
pub fn attn_fp8_default(group: usize) -> usize {
    if group > 8 { 2 } else { 0 }
}

/// The FP8-cache kernel's name of `variant` (a tensor-core variant) for `head_dim`.
pub(crate) fn fp8_kernel_name(variant: &AttnVariant, head_dim: usize) -> String {
    let kind = if variant.kind == AttnKind::Stream { "st" } else { "tc" };
    format!("paged_attention_{kind}_fp8_hd{head_dim}_w{}_s{}_g{}", variant.warps, variant.unroll, variant.max_group)
}

/// Every instantiated variant: the register kernels in the order of `ATT_VARIANTS`, then the
/// tensor-core kernels in the order of `ATT_TC_VARIANTS` (attention.cu), then the streaming
/// kernels in the order of `ATT_ST_VARIANTS` (attention_stream.cu).
pub const ATTN_VARIANTS: [AttnVariant; 14] = [
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
    // Streaming: up to 8 KV heads a CTA, 3 stages (Llama-3.1-8B heads: 198 KB, one CTA per SM).
    st(8, 3, 8),
    // Two stages (132 KB at those heads: still one CTA per SM, one stage in flight while the
    // other is consumed): the default streaming shape, the fastest at every measured shape.
    st(8, 2, 8),
    // Up to 4 KV heads a CTA, 3 stages (99 KB: two CTAs per SM).
    st(4, 3, 8),
    // 16 query heads a warp (a group of 12 or 16 reads K/V once), two stages.
    st(8, 2, 16),
    // One KV head a CTA, 4 stages (Llama-3.1-8B heads: 34.8 KB, six CTAs per SM): for small
    // batches, where CTAs of every KV head of a row would leave SMs idle.
    st(1, 4, 8),
];

/// The tensor-core variant for a GQA group of `group` query heads: 4 shared-memory stages, 8
/// heads per CTA up to a group of 8 and 16 beyond (so that a group of 12 or 16 reads each K/V
/// row once). Measured on an H100 (bench/results/cuda-kernels-tc-prefill-*): 71-86 % of copy
/// at batch >= 32 and contexts of 1k-4k, where the register kernels reached 50-57 %. The
/// default for launches too small for the streaming kernel ([`attn_default`]).
pub fn attn_tc_default(group: usize) -> usize {
    if group > 8 { 8 } else { 6 }
}

/// The streaming variant for a GQA group of `group` query heads (index in [`ATTN_VARIANTS`], or
/// with `fp8` in [`ATTN_FP8_VARIANTS`]): up to 8 KV heads a CTA, bf16 two stages, FP8 three, 8
/// query heads a warp up to a group of 8 and 16 beyond.
pub fn attn_stream_default(group: usize, fp8: bool) -> usize {
    match (fp8, group > 8) {
        (false, false) => 10,
        (false, true) => 12,
        (true, false) => 3,
        (true, true) => 6,
    }
}

/// The streaming variant of one KV head a CTA (8 query heads a warp; index as
/// [`attn_stream_default`]), for launches of fewer than [`STREAM_WIDE_MIN_CTAS`] wide CTAs per
/// split. Its rows are bit for bit those of the wide variant (attention_stream.cu: each warp
/// computes its KV head alike whatever its CTA; `gpu_attention_options` checks it), so the
/// switch keeps a row's output independent of the rows beside it. It fills its ring with
/// 16-byte copies, not bulk copies (H200, Llama-3.1-8B step, one call, 2026-12-01: one row at
/// ctx 128 4.82 → 4.72 ms, at ctx 8k 5.68 → 5.33; 4 rows at 4k 6.14 → 5.44).
pub fn attn_stream_narrow(fp8: bool) -> usize {
    if fp8 { 7 } else { 13 }
}

/// Fewest CTAs per split of the wide streaming variant ([`attn_stream_default`]) below which a
/// launch takes the narrow one ([`attn_stream_narrow`]): with every KV head of a row in one CTA,
/// a batch of one row fills a fraction of the SMs (Llama-3.1-8B, H100: one row at 8k 33.4 µs at
/// its best split count against 30.5 for the tensor-core kernel's eight CTAs a split).
pub const STREAM_WIDE_MIN_CTAS: usize = 8;

/// The shared-memory carve-out a streaming launch of `rows` rows asks for (percent of the
/// largest; `None`: no preference, the driver sizes it to the launch). An SM changes its
/// L1/shared split only once drained, so the streaming kernel should take the split of the
/// GEMMs around it: up to [`GEMV_KERNEL_MAX_M`] rows those are the skinny GEMMs (little shared
/// memory, much L1), beyond it cuBLASLt's (the largest carve-out). Measured on an H100
/// (Llama-3.1-8B step, graphs, session 20): the largest carve-out at every batch cost 8 rows ×
/// 4k 14 % (9.00 against 7.85 ms); no preference at every batch cost 64 × 1k and 32 × 8k 1–2 %.
pub fn stream_carveout(rows: usize) -> Option<u32> {
    (rows > GEMV_KERNEL_MAX_M).then_some(100)
}

/// One decode attention launch as the default rules see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// Query rows of the launch (a graph's padded bucket included).
    pub rows: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dim.
    pub head_dim: usize,
    /// Whether the cache holds FP8 codes.
    pub fp8: bool,
}

impl DecodeShape {
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads.max(1)
    }
}

/// The variant the decode kernel uses by default for `shape` (an index in [`ATTN_VARIANTS`], or
/// over an FP8 cache in [`ATTN_FP8_VARIANTS`]): where the device has the bulk copy engine
/// (`stream`: sm_90) and the CTA's ring fits, [`attn_stream_default`]; else the tensor-core
/// kernel, [`attn_tc_default`] or [`attn_fp8_default`].
///
/// The kernel does not depend on the batch (`shape.rows`), only the variant does, among
/// variants that compute a row bit for bit alike ([`attn_stream_narrow`]): a row's output must
/// not change with how many rows share its step, or a graph replay (at its padded bucket) would
/// differ from the eager step (at the exact count), and async scheduling (whose steps may carry a
/// row that has just stopped) from sync scheduling; the GPU tests check both token for token. A
/// rule that switched between the tensor-core and streaming kernels by batch size failed both
/// (H100, 1a3484f: `gpu_gemma_graph_replays_match_eager_steps`,
/// `gpu_async_scheduling_matches_sync`). Measured on an H100 (Llama-3.1-8B heads; `cuda_bench`
/// 34590ad, `cuda_bench_fp8` 1a3484f), the wide streaming variant is as fast as the tensor-core
/// kernel or faster from 8 rows (bf16 381 against 428 µs at 256 × 1k, 743 against 877 at
/// 128 × 4k; FP8 204.5 against 220.6 at 256 × 1k).
pub fn attn_default(shape: &DecodeShape, stream: bool) -> usize {
    let group = shape.group();
    let table: &[AttnVariant] = if shape.fp8 { &ATTN_FP8_VARIANTS } else { &ATTN_VARIANTS };
    let wide = attn_stream_default(group, shape.fp8);
    let v = &table[wide];
    let (n_heads, n_kv, hd) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    if stream && stream_kv_heads(v, n_kv, hd) > 0 {
        let narrow = attn_stream_narrow(shape.fp8);
        let small = shape.rows * v.ctas_per_row(n_heads, n_kv, hd) < STREAM_WIDE_MIN_CTAS;
        return if small && group <= 8 && stream_kv_heads(&table[narrow], n_kv, hd) > 0 { narrow } else { wide };
    }
    if shape.fp8 { attn_fp8_default(group) } else { attn_tc_default(group) }
}

/// How the decode kernel splits each row's context across CTAs: `Auto` aims at several CTAs
/// per SM, `Fixed(n)` forces at most `n` splits (1 = no split; for benchmarks).
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

/// CTAs per SM that `Auto` aims at. Six of the default (tensor-core) variants fit on an SM
/// at head_dim 128 (`tc_min_ctas` in attention.cu), but filling them is slower: on an H100
/// (`cuda_bench`, Llama-3.1-8B heads, d1fc2af) one row at 8k ran 35.6 µs at the 86 splits
/// that fill six per SM and 27.6 µs at 32 splits (two per SM); 32 rows at 2k ran 115 µs at
/// 3 splits and 110 µs at 1; 8 rows at 4k 65 µs at 12 and 62 µs at 4. Each CTA keeps its own
/// pipeline of KV tiles in flight, so two per SM already cover the memory latency, and more
/// splits only add partial results and shorter pipelines.
pub(crate) const TARGET_CTAS_PER_SM: usize = 2;

/// How many CTAs per SM [`AttnSplit::Auto`] aims at: [`SplitTarget::BF16`] (see
/// [`TARGET_CTAS_PER_SM`]) or [`SplitTarget::FP8`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitTarget {
    ctas_per_sm: usize,
    round_up: bool,
    /// Most splits `Auto` makes (the context's length allowing).
    max_auto: usize,
}

impl SplitTarget {
    /// Two CTAs per SM, rounded down (a batch with more CTAs is not split).
    pub const BF16: Self = Self { ctas_per_sm: TARGET_CTAS_PER_SM, round_up: false, max_auto: MAX_SPLITS };
    /// Two CTAs per SM, rounded up: an FP8 stage carries half the bytes, so a CTA alone streams
    /// more slowly and a batch just short of two per SM gains from a second split. Measured on
    /// an H100 (`cuda_bench_fp8` fixed-split sweep of the tokens-as-M kernel, Llama-3.1-8B heads,
    /// 5e43b81): one row at 8k 23.1 µs at 32 splits against 26.6 at the 50 of the earlier rule
    /// (three per SM, rounded up); 8 rows at 4k 39.9 at 4, 40.6 at 8 (41.0 at that rule's 7);
    /// 32 rows at 8k 218.8 at 2 splits, 223.5 unsplit; 32 rows at 2k 66.1 at 2, 64.2 unsplit
    /// (the one shape where rounding down would win, by 3 %); 64 rows and more fastest unsplit.
    pub const FP8: Self = Self { ctas_per_sm: 2, round_up: true, max_auto: MAX_SPLITS };

    /// The target for a cache of FP8 codes or of bf16 values.
    pub fn for_cache(fp8: bool) -> Self {
        if fp8 { Self::FP8 } else { Self::BF16 }
    }

    /// The target of `variant` over such a cache: a streaming variant aims at the CTAs that fit
    /// an SM by shared memory (usually one: its ring holds every KV head of a row), rounded down,
    /// in at most 64 splits. Measured on an H100 (`cuda_bench`, Llama-3.1-8B heads, 34590ad; one
    /// CTA per row and split): one row at 8k 33.4 µs at 64 splits, 40.6 at 128; at 32k 72.2
    /// against 75.7; at 2k the context allows 32 (22.0 µs).
    pub fn for_variant(variant: &AttnVariant, n_kv_heads: usize, head_dim: usize, fp8: bool, sm_smem: usize) -> Self {
        match variant.kind {
            AttnKind::Stream => Self {
                ctas_per_sm: variant.stream_ctas_per_sm(n_kv_heads, head_dim, sm_smem),
                round_up: false,
                max_auto: MAX_SPLITS / 2,
            },
            _ => Self::for_cache(fp8),
        }
    }
}

/// Most splits of one row's context.
pub(crate) const MAX_SPLITS: usize = 128;
/// Fewest tokens per split: below this the partial results cost more than they save. The
/// kernel receives it too: it cuts each row's chunk from the row's own length with this as
/// the least (`split_chunk` in attention.cu).
pub(crate) const MIN_SPLIT_TOKENS: usize = 64;

/// Splits and tokens per split for `ctas` CTAs per split over contexts of at most `max_ctx`
/// tokens on `sms` SMs: about `target`'s CTAs per SM (`Auto`), each at least
/// `MIN_SPLIT_TOKENS` long. Returns `(splits, chunk)` with `splits * chunk >= max_ctx`.
pub fn plan_splits(split: AttnSplit, ctas: usize, max_ctx: usize, sms: usize, target: SplitTarget) -> (usize, usize) {
    let max_ctx = max_ctx.max(1);
    if let AttnSplit::Exact(n) = split {
        let n = n.clamp(1, MAX_SPLITS);
        return (n, max_ctx.div_ceil(n).next_multiple_of(16).max(MIN_SPLIT_TOKENS));
    }
    let by_len = max_ctx.div_ceil(MIN_SPLIT_TOKENS).clamp(1, MAX_SPLITS);
    let want = match split {
        // About two CTAs per SM, in one wave (see `TARGET_CTAS_PER_SM`); a batch that
        // already has that many CTAs is not split.
        AttnSplit::Auto => {
            let (want, have) = (target.ctas_per_sm * sms.max(1), ctas.max(1));
            let want = if target.round_up { want.div_ceil(have) } else { (want / have).max(1) };
            want.min(target.max_auto)
        }
        AttnSplit::Fixed(n) | AttnSplit::Exact(n) => n,
    };
    let splits = want.clamp(1, by_len);
    // Chunks a multiple of 16 tokens (a common block size); recount after rounding.
    let chunk = max_ctx.div_ceil(splits).next_multiple_of(16);
    (max_ctx.div_ceil(chunk), chunk)
}

/// The splits the default decode launch ([`AttnSplit::Auto`], the variant of [`attn_default`])
/// uses for `shape` over contexts up to `max_ctx` on `sms` SMs (`stream`: the device runs the
/// streaming kernel): what a CUDA graph recorded for such a step is keyed by. For a windowed
/// layer pass the tokens it reads, `min(max_ctx, window)`; `sm_smem` as [`split_smem`].
pub fn auto_splits(sms: usize, shape: &DecodeShape, max_ctx: usize, stream: bool, sm_smem: usize) -> usize {
    let vi = attn_default(shape, stream);
    let variant = if shape.fp8 { ATTN_FP8_VARIANTS[vi] } else { ATTN_VARIANTS[vi] };
    let (n_kv, hd) = (shape.n_kv_heads, shape.head_dim);
    let ctas = variant.ctas_per_row(shape.n_heads, n_kv, hd) * shape.rows;
    plan_splits(AttnSplit::Auto, ctas, max_ctx, sms, SplitTarget::for_variant(&variant, n_kv, hd, shape.fp8, sm_smem)).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_variants_name_their_kernels() {
        assert_eq!(ATTN_VARIANTS[0].kernel_name(128), "paged_attention_hd128_w4_u4_g4_p0");
        assert_eq!(ATTN_VARIANTS[6].kernel_name(16), "paged_attention_tc_hd16_w2_s4_g8");
        assert_eq!(ATTN_VARIANTS[6].label(), "tc_w2_s4_g8");
        assert_eq!(combine_kernel_name(64), "attention_combine_hd64");
        assert_eq!(ATTN_VARIANTS[10].kernel_name(128), "paged_attention_st_hd128_w8_s2_g8");
        assert_eq!(ATTN_VARIANTS[10].label(), "st_w8_s2_g8");
        // The tensor-core and streaming defaults exist for any group and cover a group of up to
        // 8 (16 beyond) in one CTA per KV head.
        for group in 1..=32 {
            for (vi, kind) in
                [(attn_tc_default(group), AttnKind::TensorCore), (attn_stream_default(group, false), AttnKind::Stream)]
            {
                let v = ATTN_VARIANTS[vi];
                assert_eq!(v.kind, kind);
                assert!(group <= 8 || v.max_group == 16, "group {group}: {v:?}");
            }
        }
    }

    #[test]
    fn tc_shared_memory_matches_the_documented_numbers() {
        let (s4g8, s5g8, s4g16) = (ATTN_VARIANTS[6], ATTN_VARIANTS[7], ATTN_VARIANTS[8]);
        // The head_dim 128 shapes measured by ptxas (attention.cu's Numbers): static.
        assert_eq!(tc_smem_bytes(&s4g8, 128, false), 34_816);
        assert_eq!(tc_smem_bytes(&s5g8, 128, false), 43_520);
        assert_eq!(tc_smem_bytes(&s4g16, 128, false), 34_816);
        for hd in [16, 32, 64, 128] {
            for v in ATTN_VARIANTS {
                assert_eq!(tc_dynamic_smem(&v, hd, false), 0, "{} at {hd}", v.label());
            }
            for v in ATTN_FP8_VARIANTS {
                assert_eq!(tc_dynamic_smem(&v, hd, true), 0, "FP8 {} at {hd}", v.label());
            }
        }
        // head_dim 256: every tensor-core shape goes dynamic, the register ones stay static.
        assert_eq!(tc_dynamic_smem(&s4g8, 256, false), 67_584);
        assert_eq!(tc_dynamic_smem(&s5g8, 256, false), 84_480);
        assert_eq!(tc_dynamic_smem(&s4g16, 256, false), 67_584);
        assert_eq!(tc_dynamic_smem(&ATTN_FP8_VARIANTS[0], 256, true), 52_224);
        assert_eq!(tc_dynamic_smem(&ATTN_FP8_VARIANTS[1], 256, true), 69_632);
        assert_eq!(tc_smem_bytes(&ATTN_FP8_VARIANTS[1], 128, true), 36_864);
        assert_eq!(tc_dynamic_smem(&ATTN_VARIANTS[0], 256, false), 0);
        for v in ATTN_VARIANTS.iter().chain(&ATTN_FP8_VARIANTS) {
            assert!(tc_smem_bytes(v, 256, true).max(tc_smem_bytes(v, 256, false)) <= 227 * 1024);
        }
    }

    #[test]
    fn split_plans_cover_the_context_and_fill_the_device() {
        // Batch 1, 8 KV heads, 2k context on 132 SMs: many splits of at least 64 tokens.
        let (s, c) = plan_splits(AttnSplit::Auto, 8, 2048, 132, SplitTarget::BF16);
        assert!(s >= 16 && c >= MIN_SPLIT_TOKENS && s * c >= 2048 && (s - 1) * c < 2048, "{s} × {c}");
        // A large batch already fills the device: no split.
        assert_eq!(plan_splits(AttnSplit::Auto, 256 * 8, 4096, 132, SplitTarget::BF16).0, 1);
        // Forced values, clamped by the context; every split but the last is non-empty.
        assert_eq!(
            plan_splits(AttnSplit::Fixed(1), 8, 100_000, 132, SplitTarget::BF16),
            (1, 100_000usize.next_multiple_of(16))
        );
        for ctx in [1usize, 15, 16, 17, 63, 64, 65, 1000, 4100, 131_072] {
            for f in [1usize, 2, 7, 64, 1000] {
                let (s, c) = plan_splits(AttnSplit::Fixed(f), 8, ctx, 132, SplitTarget::BF16);
                assert!(
                    (1..=MAX_SPLITS).contains(&s) && s * c >= ctx && (s - 1) * c < ctx,
                    "ctx {ctx} f {f}: {s} × {c}"
                );
                assert!(c.is_multiple_of(16));
            }
        }
    }

    #[test]
    fn auto_splits_count_the_default_variants_ctas() {
        let llama = |rows, fp8| DecodeShape { rows, n_heads: 32, n_kv_heads: 8, head_dim: 128, fp8 };
        // Without the streaming kernel (before sm_90): Llama-3.1-8B (32/8 heads: group 4, one
        // tensor-core CTA per KV head) at batch 1, 2k: the plan for 8 CTAs per split; at 12/1
        // heads (group 12: the 16-head variant) one CTA per row.
        assert_eq!(
            auto_splits(132, &llama(1, false), 2048, false, SM_SMEM),
            plan_splits(AttnSplit::Auto, 8, 2048, 132, SplitTarget::BF16).0
        );
        let g12 = DecodeShape { rows: 3, n_heads: 12, n_kv_heads: 1, head_dim: 128, fp8: false };
        assert_eq!(
            auto_splits(132, &g12, 4096, false, SM_SMEM),
            plan_splits(AttnSplit::Auto, 3, 4096, 132, SplitTarget::BF16).0
        );
        // A group of 32 takes two CTAs of 16 heads per KV head.
        assert_eq!(ATTN_VARIANTS[attn_tc_default(32)].ctas_per_row(64, 2, 128), 4);
        assert_eq!(auto_splits(132, &llama(512, false), 4096, false, SM_SMEM), 1, "a full batch needs no split");
        let no_kv = DecodeShape { n_kv_heads: 0, ..llama(1, false) };
        assert!(auto_splits(132, &no_kv, 100, true, SM_SMEM) >= 1, "no KV heads: still a plan (the launch refuses)");
        // The FP8 tensor-core kernel aims at two CTAs per SM, rounded up: 32 rows of 8 KV heads
        // at 8k split in two where the bf16 tensor-core kernel does not split; one row at 8k in
        // 33 (as bf16); a full batch is not split either way.
        assert_eq!(auto_splits(132, &llama(32, false), 8192, false, SM_SMEM), 1);
        assert_eq!(auto_splits(132, &llama(32, true), 8192, false, SM_SMEM), 2);
        assert_eq!(auto_splits(132, &llama(8, true), 4096, false, SM_SMEM), 5);
        assert_eq!(
            auto_splits(132, &llama(1, true), 8192, false, SM_SMEM),
            auto_splits(132, &llama(1, false), 8192, false, SM_SMEM)
        );
        assert_eq!(auto_splits(132, &llama(256, true), 1024, false, SM_SMEM), 1);
        // The FP8 streaming kernel's 3-stage ring (99,864 bytes) fits two CTAs per SM: 32 rows
        // at 8k split in 8.
        assert_eq!(auto_splits(132, &llama(32, true), 8192, true, SM_SMEM), 8);
        // With the streaming kernel (sm_90), whatever the batch: one CTA per row takes an SM
        // alone, so 32 rows at 8k split in 4 (128 CTAs), 64 rows in 2, 256 rows not at all, one
        // row in at most 64.
        // Below 8 rows (one wide CTA a row) the narrow variant, one KV head a CTA (six per SM).
        for rows in [1, 7, 8, 256] {
            for fp8 in [false, true] {
                let want = if rows < 8 { attn_stream_narrow(fp8) } else { attn_stream_default(4, fp8) };
                assert_eq!(attn_default(&llama(rows, fp8), true), want, "{rows} rows, fp8 {fp8}");
            }
            assert_eq!(attn_default(&llama(rows, false), false), attn_tc_default(4));
        }
        // A group of 12 has no narrow variant.
        assert_eq!(attn_default(&DecodeShape { rows: 1, ..g12 }, true), attn_stream_default(12, false));
        let narrow = ATTN_VARIANTS[attn_stream_narrow(false)];
        assert_eq!((narrow.ctas_per_row(32, 8, 128), narrow.stream_ctas_per_sm(8, 128, SM_SMEM)), (8, 6));
        assert_eq!(auto_splits(132, &llama(1, false), 8192, true, SM_SMEM), 64);
        assert_eq!(auto_splits(132, &llama(1, false), 2048, true, SM_SMEM), 32);
        assert_eq!(auto_splits(132, &llama(8, false), 4096, true, SM_SMEM), 16);
        assert_eq!(auto_splits(132, &llama(32, false), 8192, true, SM_SMEM), 4);
        assert_eq!(auto_splits(132, &llama(64, false), 8192, true, SM_SMEM), 2);
        assert_eq!(auto_splits(132, &llama(256, false), 1024, true, SM_SMEM), 1);
        // The carve-out follows the GEMMs around the launch: none up to the skinny GEMM's rows.
        assert_eq!((stream_carveout(1), stream_carveout(16)), (None, None));
        assert_eq!((stream_carveout(17), stream_carveout(256)), (Some(100), Some(100)));
    }

    #[test]
    fn streaming_ctas_fit_their_shared_memory() {
        let (s3, s2, w4) = (ATTN_VARIANTS[9], ATTN_VARIANTS[10], ATTN_VARIANTS[11]);
        // Llama-3.1-8B heads: every KV head in one CTA, rows of 8 × 128 × 2 + 16 = 2,064 bytes.
        assert_eq!(stream_kv_heads(&s3, 8, 128), 8);
        assert_eq!(stream_smem_bytes(&s3, 8, 128), 3 * 2 * 16 * 2064 + 24);
        assert_eq!(stream_smem_bytes(&s2, 8, 128), 132_112);
        assert_eq!((s2.stream_ctas_per_sm(8, 128, SM_SMEM), w4.stream_ctas_per_sm(8, 128, SM_SMEM)), (1, 2));
        assert_eq!((s2.ctas_per_row(32, 8, 128), s2.threads(8, 128)), (1, 256));
        assert_eq!((w4.ctas_per_row(32, 8, 128), w4.threads(8, 128)), (2, 128));
        // Gemma-3-12B (8 KV heads at 256): 4 a CTA (8 would take 263 KB at two stages).
        assert_eq!((stream_kv_heads(&s3, 8, 256), stream_kv_heads(&s2, 8, 256)), (4, 4));
        // SmolLM2-135M (3 KV heads at 64): one CTA; 6 KV heads under a cap of 4: 3 a CTA.
        assert_eq!((stream_kv_heads(&s2, 3, 64), stream_kv_heads(&w4, 6, 128)), (3, 3));
        // A group of 24 at 8 query heads a warp: three CTAs per KV-head set.
        assert_eq!(s2.ctas_per_row(48, 2, 128), 3);
        assert_eq!(stream_kv_heads(&ATTN_VARIANTS[6], 8, 128), 0, "not a streaming variant");
        for v in ATTN_VARIANTS.iter().filter(|v| v.kind == AttnKind::Stream) {
            for hd in ATTN_HEAD_DIMS {
                for nkv in 1..=16 {
                    let k = stream_kv_heads(v, nkv, hd);
                    assert!(k >= 1 && nkv.is_multiple_of(k), "{} {nkv} × {hd}: {k}", v.label());
                    assert!(stream_smem_bytes(v, k, hd) <= CTA_SMEM_LIMIT);
                }
            }
        }
    }
}
