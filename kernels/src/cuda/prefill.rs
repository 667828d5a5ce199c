//! Prefill attention on the tensor cores (`kernels/cuda/prefill.cu`), and the entry point
//! that routes a mixed batch between it and the decode kernel (`attention.cu`).
//!
//! Owns: the per-step prefill metadata ([`PrefillMeta`], filled by `StepMeta::set` and
//! uploaded there, never at launch, so a launch can be captured into a CUDA graph), the
//! launcher [`CudaDevice::prefill_attention`] and the router [`CudaDevice::attention_mixed`].
//!
//! Invariants:
//! - a sequence is *prefill* when its chunk has at least [`PREFILL_MIN_TOKENS`] rows; its rows
//!   are computed by the prefill kernel, every other row (decode) by the decode kernel;
//! - the prefill kernel handles GQA groups up to [`PREFILL_MAX_GROUP`] query heads per KV head
//!   and head_dim 16, 32, 64 or 128 ([`prefill_supported`]); other shapes go to the decode
//!   kernel for every row;
//! - it comes in two CTA sizes ([`PREFILL_WARPS`]): 4 warps (64 packed query rows, the
//!   default) and 8 warps (128 rows); [`CudaDevice::prefill_attention_variant`] picks one;
//! - the sequence list is ordered heaviest first (longest context), so the longest CTAs start
//!   first; the kernel enumerates its work items (query tiles of `64 / group` tokens) from it;
//! - decode rows reach the decode kernel through a second context-length array in which the
//!   prefill rows hold 0: the decode kernel already skips a row whose context is empty, so it
//!   needs no change. It writes zeros into those rows (an empty context's output), so the
//!   router always launches the prefill kernel *after* the decode kernel, on the same stream,
//!   and it overwrites them.

use super::ops::{Arg, ArgList, AttentionMeta, AttnSplit, KvGeometry, attn_default, check_attention_io, int};
use super::{CudaDevice, CudaError, shape_check};
use cudarc::driver::sys::CUfunction_attribute_enum as FuncAttr;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use half::bf16;

/// Fewest rows in a chunk for it to go to the prefill kernel (a 1-row chunk is a decode row).
pub const PREFILL_MIN_TOKENS: usize = 2;
/// Keys per KV tile; see prefill.cu.
const BN: usize = 64;
/// Warps per CTA of each compiled variant (16 packed query rows per warp: tokens × heads of
/// one GQA group), in the order of prefill.cu's instances.
pub const PREFILL_WARPS: [usize; 2] = [4, 8];
/// The variant [`CudaDevice::prefill_attention`] uses: 4 warps (three CTAs per SM at head_dim
/// 128, where the 8-warp CTA fits once). To be confirmed by cuda_bench's prefill section.
pub const PREFILL_DEFAULT_VARIANT: usize = 0;
/// Most query heads per KV head the router sends to the prefill kernel (the default
/// variant's tile rows: a group must fit one tile).
pub const PREFILL_MAX_GROUP: usize = 16 * PREFILL_WARPS[PREFILL_DEFAULT_VARIANT];
/// Head dims with a compiled prefill kernel, in the order of [`CudaDevice`]'s function table.
pub(super) const PREFILL_HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Dynamic shared memory of the prefill kernel for `head_dim`: 2 stages of K and V tiles of
/// `BN` rows, each row padded by 8 elements.
pub fn prefill_smem_bytes(head_dim: usize) -> usize {
    2 * 2 * BN * (head_dim + 8) * 2
}

/// Whether the prefill kernel handles this attention shape.
pub fn prefill_supported(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> bool {
    n_kv_heads > 0
        && n_heads.is_multiple_of(n_kv_heads)
        && n_heads / n_kv_heads <= PREFILL_MAX_GROUP
        && PREFILL_HEAD_DIMS.contains(&head_dim)
}

/// Loads the prefill kernels, `[head dim of PREFILL_HEAD_DIMS][variant of PREFILL_WARPS]`,
/// and raises each one's dynamic shared-memory limit (above the default 48 KiB at head_dim 128).
pub(super) fn load_funcs<E>(f: &impl Fn(&str) -> Result<CudaFunction, E>) -> Result<Vec<Vec<CudaFunction>>, CudaError>
where
    CudaError: From<E>,
{
    PREFILL_HEAD_DIMS
        .iter()
        .map(|&hd| {
            PREFILL_WARPS
                .iter()
                .map(|&w| {
                    let func = f(&format!("prefill_attention_hd{hd}_w{w}"))?;
                    let smem = prefill_smem_bytes(hd) as i32;
                    func.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)?;
                    // Three CTAs of 68 KiB per SM at head_dim 128 need the largest shared carve-out.
                    func.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)?;
                    Ok(func)
                })
                .collect()
        })
        .collect()
}

/// The host side of one step's routing, computed from the step's rows (no device needed).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct PrefillLists {
    /// Per prefill sequence `[row_start, n_tokens, start_pos, block-table offset]`,
    /// heaviest (longest context) first.
    pub seqs: Vec<[i32; 4]>,
    /// Per row: its context length for a decode row, 0 for a prefill row.
    pub decode_ctx: Vec<i32>,
    /// One past the last decode row (the decode kernel's grid covers rows `0..decode_rows_end`).
    pub decode_rows_end: usize,
    /// Longest context of a decode row.
    pub decode_max_ctx: usize,
    /// Largest `start_pos + n_tokens` of a prefill sequence.
    pub max_end: usize,
}

impl PrefillLists {
    /// Builds the lists from the rows' context lengths and block-table offsets (as
    /// `StepMeta::set` computed them) and the chunks `(row_start, n_tokens, start_pos)`.
    pub fn build(
        chunks: impl Iterator<Item = (usize, usize, usize)>,
        row_ctx: &[i32],
        row_bt: &[i32],
    ) -> Result<Self, CudaError> {
        const OP: &str = "prefill_meta";
        let mut out = PrefillLists { decode_ctx: row_ctx.to_vec(), ..Default::default() };
        for (row_start, n_tokens, start_pos) in chunks {
            if n_tokens < PREFILL_MIN_TOKENS {
                continue;
            }
            shape_check(OP, row_start + n_tokens <= row_ctx.len(), || {
                format!("rows {row_start}..{} outside {} rows", row_start + n_tokens, row_ctx.len())
            })?;
            out.seqs.push([int(OP, row_start)?, int(OP, n_tokens)?, int(OP, start_pos)?, row_bt[row_start]]);
            out.decode_ctx[row_start..row_start + n_tokens].fill(0);
            out.max_end = out.max_end.max(start_pos + n_tokens);
        }
        // Heaviest first; stable, so equal sequences keep batch order (reproducible grids).
        out.seqs.sort_by_key(|s| std::cmp::Reverse(s[1] as i64 + s[2] as i64));
        out.decode_rows_end = out.decode_ctx.iter().rposition(|&c| c > 0).map_or(0, |r| r + 1);
        out.decode_max_ctx = out.decode_ctx.iter().copied().max().unwrap_or(0).max(0) as usize;
        Ok(out)
    }

    /// Query tiles of `bm / group` tokens over every prefill sequence (`bm` packed rows per
    /// CTA): the kernel's grid height.
    pub fn items(&self, group: usize, bm: usize) -> usize {
        let tq = (bm / group.max(1)).max(1);
        self.seqs.iter().map(|s| (s[1] as usize).div_ceil(tq)).sum()
    }
}

/// The device side of [`PrefillLists`], part of `StepMeta`. Uploads happen only when the step
/// has prefill chunks (a decode-only step pays nothing), and the decode context array only
/// when it also has decode rows.
pub(crate) struct PrefillMeta {
    pub(super) lists: PrefillLists,
    /// `seqs` flattened, 4 ints per sequence.
    pub(super) seqs: CudaSlice<i32>,
    /// `decode_ctx`.
    pub(super) decode_ctx: CudaSlice<i32>,
}

impl PrefillMeta {
    pub(super) fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        Ok(Self { lists: PrefillLists::default(), seqs: dev.alloc(64)?, decode_ctx: dev.alloc(64)? })
    }

    /// Replaces the lists and uploads what the launches of this step will read.
    pub(super) fn fill(&mut self, dev: &CudaDevice, lists: PrefillLists) -> Result<(), CudaError> {
        self.lists = lists;
        if self.lists.seqs.is_empty() {
            return Ok(());
        }
        let flat: Vec<i32> = self.lists.seqs.iter().flatten().copied().collect();
        grow(dev, &mut self.seqs, flat.len())?;
        dev.upload_into(&flat, &mut self.seqs)?;
        if self.lists.decode_rows_end > 0 {
            let n = self.lists.decode_rows_end;
            grow(dev, &mut self.decode_ctx, n)?;
            dev.upload_into(&self.lists.decode_ctx[..n], &mut self.decode_ctx)?;
        }
        Ok(())
    }

    /// Whether the step has a chunk for the prefill kernel.
    pub(super) fn has_prefill(&self) -> bool {
        !self.lists.seqs.is_empty()
    }
}

fn grow(dev: &CudaDevice, buf: &mut CudaSlice<i32>, len: usize) -> Result<(), CudaError> {
    if buf.len() < len {
        *buf = dev.alloc(len.next_power_of_two())?;
    }
    Ok(())
}

/// `ceil(2^32 / block_size)`: the kernel's block index is `umulhi(position, magic)`, exact
/// while `position * block_size < 2^32`. Block size 1 is special-cased in the kernel (0 here).
fn block_magic(block_size: usize) -> u32 {
    if block_size <= 1 { 0 } else { (1u64 << 32).div_ceil(block_size as u64) as u32 }
}

/// Checks the launch shape that needs no device for the variant of `warps` warps; returns the
/// head-dim index and the grid height.
pub(super) fn check_prefill_shape(
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
        .ok_or_else(|| CudaError::Shape { op: OP, message: format!("head_dim {hd} has no prefill kernel") })?;
    shape_check(OP, geo.n_kv_heads > 0 && n_heads.is_multiple_of(geo.n_kv_heads), || {
        format!("{n_heads} query heads is not a multiple of {} KV heads", geo.n_kv_heads)
    })?;
    let group = n_heads / geo.n_kv_heads;
    shape_check(OP, group <= bm, || format!("a GQA group of {group} heads exceeds the tile's {bm} rows"))?;
    shape_check(OP, geo.n_kv_heads <= 65_535, || format!("{} KV heads exceed the grid", geo.n_kv_heads))?;
    shape_check(OP, (lists.max_end as u64) * (geo.block_size as u64) < 1u64 << 32, || {
        format!("positions up to {} with blocks of {} overflow the block index", lists.max_end, geo.block_size)
    })?;
    let items = lists.items(group, bm);
    shape_check(OP, items <= 65_535, || format!("{items} query tiles exceed the grid's y limit"))?;
    Ok((hd_idx, items))
}

impl CudaDevice {
    /// Causal attention of the step's prefill chunks only (sequences of at least
    /// [`PREFILL_MIN_TOKENS`] rows) on the tensor-core kernel; rows of other sequences are not
    /// touched. `q`/`out` are `rows × n_heads × head_dim`, the cache holds every row's own K/V.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention(
        &self,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        meta: &AttentionMeta,
        n_heads: usize,
        geo: KvGeometry,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        let v = PREFILL_DEFAULT_VARIANT;
        self.prefill_attention_variant(v, q, k_cache, v_cache, meta, n_heads, geo, scale, out)
    }

    /// [`CudaDevice::prefill_attention`] with the CTA of `PREFILL_WARPS[variant]` warps.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention_variant(
        &self,
        variant: usize,
        q: &CudaSlice<bf16>,
        k_cache: &CudaSlice<bf16>,
        v_cache: &CudaSlice<bf16>,
        meta: &AttentionMeta,
        n_heads: usize,
        geo: KvGeometry,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        const OP: &str = "prefill_attention";
        let lists = &meta.prefill.lists;
        let warps = *PREFILL_WARPS
            .get(variant)
            .ok_or_else(|| CudaError::Shape { op: OP, message: format!("no prefill variant {variant}") })?;
        let (hd_idx, items) = check_prefill_shape(lists, n_heads, geo, warps)?;
        check_attention_io(OP, q, out, k_cache, v_cache, meta, n_heads, geo)?;
        // The kernel takes the running max on unscaled scores, which needs scale > 0.
        shape_check(OP, scale > 0.0 && scale.is_finite(), || format!("softmax scale {scale} is not positive"))?;
        if items == 0 {
            return Ok(());
        }
        let func = self.funcs.prefill.get(hd_idx).and_then(|v| v.get(variant)).ok_or_else(|| CudaError::Shape {
            op: OP,
            message: format!("no prefill kernel loaded for head_dim {}", geo.head_dim),
        })?;
        let c = LaunchConfig {
            grid_dim: (geo.n_kv_heads as u32, items as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: prefill_smem_bytes(geo.head_dim) as u32,
        };
        self.run(
            func,
            c,
            &mut ArgList(vec![
                Arg::Bf(q),
                Arg::Bf(k_cache),
                Arg::Bf(v_cache),
                Arg::Bf(out),
                Arg::I32s(&meta.prefill.seqs),
                Arg::I(int(OP, lists.seqs.len())?),
                Arg::I32s(&meta.block_tables),
                Arg::I(int(OP, n_heads)?),
                Arg::I(int(OP, geo.n_kv_heads)?),
                Arg::I(int(OP, geo.block_size)?),
                // The kernel's parameter is unsigned: same 32 bits.
                Arg::I(block_magic(geo.block_size) as i32),
                Arg::F(scale * std::f32::consts::LOG2_E),
            ]),
        )
    }

    /// Attention of a mixed batch: prefill chunks on the tensor-core prefill kernel, decode
    /// rows on the decode kernel (only rows `0..` the last decode row are launched, and prefill
    /// rows among them exit at once). Falls back to [`CudaDevice::attention`] for every row when
    /// the step has no prefill chunk or the shape has no prefill kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_mixed(
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
        if !meta.prefill.has_prefill() || !prefill_supported(n_heads, geo.n_kv_heads, geo.head_dim) {
            return self.attention(q, k_cache, v_cache, meta, n_heads, geo, scale, out);
        }
        // Validate the prefill launch before enqueueing anything.
        check_prefill_shape(&meta.prefill.lists, n_heads, geo, PREFILL_WARPS[PREFILL_DEFAULT_VARIANT])?;
        if meta.prefill.lists.decode_rows_end > 0 {
            let v = attn_default(n_heads / geo.n_kv_heads);
            self.attention_launch(v, AttnSplit::Auto, q, k_cache, v_cache, meta, n_heads, geo, scale, out, true)?;
        }
        // After the decode kernel: it wrote zeros into the prefill rows (module doc).
        self.prefill_attention(q, k_cache, v_cache, meta, n_heads, geo, scale, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(block_size: usize, n_kv_heads: usize, head_dim: usize) -> KvGeometry {
        KvGeometry { num_blocks: 64, block_size, n_kv_heads, head_dim }
    }

    #[test]
    fn lists_route_rows_and_order_heaviest_first() {
        // rows 0..3 decode (ctx 5, 9, 1), rows 3..13 a 10-token chunk at 7, row 13 decode
        // (ctx 40), rows 14..114 a 100-token chunk from 0.
        let chunks = [(0, 1, 4), (1, 1, 8), (2, 1, 0), (3, 10, 7), (13, 1, 39), (14, 100, 0)];
        let mut ctx = vec![5, 9, 1];
        ctx.extend(8..18);
        ctx.push(40);
        ctx.extend(1..101);
        let bt: Vec<i32> = (0..ctx.len() as i32).map(|r| r * 3).collect();
        let l = PrefillLists::build(chunks.iter().copied(), &ctx, &bt).expect("lists");
        assert_eq!(l.seqs, vec![[14, 100, 0, 42], [3, 10, 7, 9]]);
        assert_eq!(l.decode_rows_end, 14);
        assert_eq!(l.decode_max_ctx, 40);
        assert_eq!(l.max_end, 100);
        assert!(l.decode_ctx[3..13].iter().all(|&c| c == 0) && l.decode_ctx[14..].iter().all(|&c| c == 0));
        assert_eq!(&l.decode_ctx[..3], &[5, 9, 1]);
        // Tiles of 64 / group tokens: group 4 → 16 tokens: 7 + 1 tiles; group 64 → 1 token.
        assert_eq!(l.items(4, 64), 7 + 1);
        assert_eq!(l.items(1, 64), 2 + 1);
        assert_eq!(l.items(64, 64), 110);
        // 128-row tiles: group 4 → 32 tokens.
        assert_eq!(l.items(4, 128), 4 + 1);
        // A decode-only step has nothing for the prefill kernel.
        let d = PrefillLists::build([(0, 1, 3)].into_iter(), &[4], &[0]).expect("lists");
        assert!(d.seqs.is_empty() && d.decode_rows_end == 1 && d.items(8, 64) == 0);
        // A chunk outside the rows is refused.
        assert!(PrefillLists::build([(0, 4, 0)].into_iter(), &[1, 2, 3], &[0, 0, 0]).is_err());
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
        assert!(!prefill_supported(128, 1, 128) && prefill_supported(64, 1, 16) && !prefill_supported(8, 3, 64));
    }

    #[test]
    fn block_magic_divides_exactly() {
        for bs in [2usize, 3, 5, 7, 16, 17, 31, 64, 100, 256, 1000] {
            let m = block_magic(bs) as u64;
            // Every position up to the launcher's bound (sampled densely near multiples).
            let limit = ((1u64 << 32) - 1) / bs as u64;
            let probes = (0..5000u64).chain((1..2000u64).flat_map(|k| {
                let b = k * (limit / 2000) / bs as u64 * bs as u64;
                [b.saturating_sub(1), b, b + 1]
            }));
            for p in probes.filter(|&p| p * (bs as u64) < 1 << 32) {
                assert_eq!((p * m) >> 32, p / bs as u64, "p {p} bs {bs}");
            }
        }
        assert_eq!(block_magic(1), 0);
    }
}
