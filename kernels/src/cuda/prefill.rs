//! The prefill kernel of `kernels/cuda/prefill.cu` (tensor-core flash attention over a step's
//! prompt chunks), described: its compiled variants, the shapes it takes, its shared memory,
//! and the per-step work lists that route rows between it and the decode kernel. Pure data
//! and rules, no device: the lists are uploaded by [`StepMeta`](super::StepMeta), the kernel
//! launched by [`AttentionCall`](super::AttentionCall).
//!
//! Invariants:
//! - a sequence is *prefill* when its chunk has at least [`PREFILL_MIN_TOKENS`] rows; its rows
//!   are computed by the prefill kernel, every other row (decode) by the decode kernel;
//! - the prefill kernel handles GQA groups up to [`PREFILL_MAX_GROUP`] query heads per KV head
//!   and head_dim 16, 32, 64, 128 or 256 ([`prefill_supported`]); other shapes go to the
//!   decode kernel for every row. At 256 (Gemma) two stages of 64-key K/V tiles take 132 KiB
//!   (bf16; 134 KiB FP8): one CTA per SM, and a thread's O (128 f32), Q fragments (64) and
//!   scores (32) fill its 255 registers (ptxas, NVRTC sm_90a: no stack for the plain bf16
//!   entry, 24-40 bytes for the FP8 and `_opt_` ones): a first
//!   version, measured against the decode kernel by `bench_cuda`'s TTFT lines; 32-key tiles
//!   or Q read from shared memory would free registers;
//! - it takes the window, soft-cap and sinks of `AttentionOptions` as the decode kernel does
//!   (prefill.cu: the KV loop starts at the window of the tile's first query), in separate
//!   `_opt_` entries: compiled into the plain ones, the option code cost registers (one CTA
//!   per SM fewer at head_dim 128);
//! - it comes in two CTA sizes ([`PREFILL_WARPS`]): 4 warps (64 packed query rows, the
//!   default) and 8 warps (128 rows);
//! - the sequence list is ordered heaviest first (longest context), so the longest CTAs start
//!   first; the kernel enumerates its work items (query tiles of `64 / group` tokens) from it;
//! - decode rows reach the decode kernel through a second context-length array in which the
//!   prefill rows hold 0: the decode kernel already skips a row whose context is empty, so it
//!   needs no change. It writes zeros into those rows (an empty context's output), so the
//!   router always launches the prefill kernel *after* the decode kernel, on the same stream,
//!   and it overwrites them.

use super::CudaError;
use super::launch::{int, shape_check};

/// Fewest rows in a chunk for it to go to the prefill kernel (a 1-row chunk is a decode row).
pub const PREFILL_MIN_TOKENS: usize = 2;
/// Keys per KV tile; see prefill.cu.
const BN: usize = 64;
/// Warps per CTA of each compiled variant (16 packed query rows per warp: tokens × heads of
/// one GQA group), in the order of prefill.cu's instances.
pub const PREFILL_WARPS: [usize; 2] = [4, 8];
/// The variant the mixed-batch router uses: 4 warps (three CTAs per SM at head_dim 128, where
/// the 8-warp CTA fits once). To be confirmed by cuda_bench's prefill section.
pub const PREFILL_DEFAULT_VARIANT: usize = 0;
/// Most query heads per KV head the router sends to the prefill kernel (the default
/// variant's tile rows: a group must fit one tile).
pub const PREFILL_MAX_GROUP: usize = 16 * PREFILL_WARPS[PREFILL_DEFAULT_VARIANT];
/// Head dims with a compiled prefill kernel, in the order of the device's function table.
pub(crate) const PREFILL_HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];

/// The variant index of the warpgroup-MMA kernel (`prefill_wg.cu`), after the
/// [`PREFILL_WARPS`] variants of the mma.sync kernel: one warpgroup (4 warps, 64 packed rows) a
/// CTA; Hopper (`sm_90a`) only, head_dim [`PREFILL_WG_HEAD_DIM`], a bf16 or FP8 cache, no
/// window, soft-cap or sinks ([`prefill_wg_supported`]).
pub const PREFILL_WGMMA: usize = PREFILL_WARPS.len();
/// Every prefill variant index: `0..PREFILL_VARIANTS`.
pub const PREFILL_VARIANTS: usize = PREFILL_WARPS.len() + 1;
/// The one head_dim the warpgroup kernel is compiled for.
pub const PREFILL_WG_HEAD_DIM: usize = 128;
/// Stages of the warpgroup kernel's K/V ring (`NS` in prefill_wg.cu).
const WG_STAGES: usize = 2;

/// Warps per CTA of prefill variant `variant` (`None` past [`PREFILL_VARIANTS`]).
pub fn prefill_variant_warps(variant: usize) -> Option<usize> {
    if variant == PREFILL_WGMMA { Some(4) } else { PREFILL_WARPS.get(variant).copied() }
}

/// Whether the warpgroup kernel computes this shape, given that the device runs it (`sm_90a`):
/// head_dim 128, no options, and a GQA group that fits its 64 rows (a bf16 or an FP8 cache).
pub fn prefill_wg_supported(n_heads: usize, n_kv_heads: usize, head_dim: usize, options: bool) -> bool {
    prefill_supported(n_heads, n_kv_heads, head_dim) && head_dim == PREFILL_WG_HEAD_DIM && !options
}

/// The warpgroup kernel's name for `head_dim` (`PF_WG_INSTANCE` in prefill_wg.cu), over an FP8
/// cache with `fp8`.
pub(crate) fn prefill_wg_kernel_name(head_dim: usize, fp8: bool) -> String {
    let cache = if fp8 { "fp8_" } else { "" };
    format!("prefill_attention_wg_{cache}hd{head_dim}")
}

/// Dynamic shared memory of the warpgroup kernel: its stages of K and V tiles of 64 keys × 256
/// bytes each (unpadded: the 128-byte swizzle spreads the banks); over an FP8 cache the stages
/// hold code rows (128 bytes) and one such bf16 K + V tile holds their conversion; plus 1,024
/// bytes so the tiles can start on the swizzle atoms' 1,024-byte boundary.
pub fn prefill_wg_smem_bytes(fp8: bool) -> usize {
    let tile = 2 * BN * PREFILL_WG_HEAD_DIM * 2;
    if fp8 { tile + WG_STAGES * tile / 2 + 1024 } else { WG_STAGES * tile + 1024 }
}

/// The kernel's name for `head_dim` and `warps` (`PF_INSTANCE` in prefill.cu); with `options`
/// the entry that computes a window, soft-cap and sinks (`prefill_attention_opt_*`: the plain
/// one compiles them out, keeping its registers).
pub(crate) fn prefill_kernel_name(head_dim: usize, warps: usize, options: bool) -> String {
    let opt = if options { "opt_" } else { "" };
    format!("prefill_attention_{opt}hd{head_dim}_w{warps}")
}

/// Dynamic shared memory of the prefill kernel for `head_dim`: 2 stages of K and V tiles of
/// `BN` rows, each row padded by 8 elements.
pub fn prefill_smem_bytes(head_dim: usize) -> usize {
    2 * 2 * BN * (head_dim + 8) * 2
}

/// Dynamic shared memory of the FP8-cache prefill kernel for `head_dim`: 2 stages of K and V
/// code rows of `head_dim + 16` bytes, plus one bf16 K and V tile (rows padded by 8 elements)
/// the codes are converted into.
pub fn prefill_fp8_smem_bytes(head_dim: usize) -> usize {
    2 * 2 * BN * (head_dim + 16) + 2 * BN * (head_dim + 8) * 2
}

/// The FP8-cache kernel's name for `head_dim` and `warps` (`PF_INSTANCE` in prefill.cu).
pub(crate) fn prefill_fp8_kernel_name(head_dim: usize, warps: usize, options: bool) -> String {
    let opt = if options { "opt_" } else { "" };
    format!("prefill_attention_fp8_{opt}hd{head_dim}_w{warps}")
}

/// Whether the prefill kernel handles this attention shape.
pub fn prefill_supported(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> bool {
    n_kv_heads > 0
        && n_heads.is_multiple_of(n_kv_heads)
        && n_heads / n_kv_heads <= PREFILL_MAX_GROUP
        && PREFILL_HEAD_DIMS.contains(&head_dim)
}

/// `ceil(2^32 / block_size)`: the kernel's block index is `umulhi(position, magic)`, exact
/// while `position * block_size < 2^32`. Block size 1 is special-cased in the kernel (0 here).
pub(crate) fn block_magic(block_size: usize) -> u32 {
    if block_size <= 1 { 0 } else { (1u64 << 32).div_ceil(block_size as u64) as u32 }
}

/// The host side of one step's routing, computed from the step's rows (no device needed).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct PrefillLists {
    /// Per prefill sequence `[row_start, n_tokens, start_pos, block-table offset]`,
    /// heaviest (longest context) first.
    pub seqs: Vec<[i32; 4]>,
    /// Per row: its context length for a decode row, 0 for a prefill row.
    pub decode_ctx: Vec<i32>,
    /// One past the last row that is not a prefill row: decode rows and padding rows (the
    /// decode kernel's grid covers rows `0..decode_rows_end`).
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
        let mut prefill_row = vec![false; row_ctx.len()];
        for (row_start, n_tokens, start_pos) in chunks {
            if n_tokens < PREFILL_MIN_TOKENS {
                continue;
            }
            shape_check(OP, row_start + n_tokens <= row_ctx.len(), || {
                format!("rows {row_start}..{} outside {} rows", row_start + n_tokens, row_ctx.len())
            })?;
            out.seqs.push([int(OP, row_start)?, int(OP, n_tokens)?, int(OP, start_pos)?, row_bt[row_start]]);
            out.decode_ctx[row_start..row_start + n_tokens].fill(0);
            prefill_row[row_start..row_start + n_tokens].fill(true);
            out.max_end = out.max_end.max(start_pos + n_tokens);
        }
        // Heaviest first; stable, so equal sequences keep batch order (reproducible grids).
        out.seqs.sort_by_key(|s| std::cmp::Reverse(s[1] as i64 + s[2] as i64));
        // Decode rows and padding rows (context 0, outside every chunk: the decode kernel
        // writes their zeros) are the decode launch's; trailing prefill rows are not.
        out.decode_rows_end = prefill_row.iter().rposition(|&p| !p).map_or(0, |r| r + 1);
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

#[cfg(test)]
mod tests {
    use super::*;

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
        // Padding rows after a chunk (context 0, no chunk) are the decode launch's: it writes
        // their zeros.
        let padded = PrefillLists::build([(0, 4, 0)].into_iter(), &[1, 2, 3, 4, 0, 0], &[0; 6]).expect("lists");
        assert_eq!((padded.decode_rows_end, padded.decode_max_ctx), (6, 0));
        // A decode-only step has nothing for the prefill kernel.
        let d = PrefillLists::build([(0, 1, 3)].into_iter(), &[4], &[0]).expect("lists");
        assert!(d.seqs.is_empty() && d.decode_rows_end == 1 && d.items(8, 64) == 0);
        // A chunk outside the rows is refused.
        assert!(PrefillLists::build([(0, 4, 0)].into_iter(), &[1, 2, 3], &[0, 0, 0]).is_err());
    }

    #[test]
    fn supported_shapes_and_names() {
        assert!(!prefill_supported(128, 1, 128) && prefill_supported(64, 1, 16) && !prefill_supported(8, 3, 64));
        assert!(!prefill_supported(8, 0, 64) && !prefill_supported(32, 8, 96));
        assert_eq!(prefill_kernel_name(128, 8, false), "prefill_attention_hd128_w8");
        assert_eq!(prefill_kernel_name(256, 4, true), "prefill_attention_opt_hd256_w4");
        assert_eq!(prefill_fp8_kernel_name(64, 8, true), "prefill_attention_fp8_opt_hd64_w8");
        // Three 4-warp CTAs per SM at head_dim 128 need 68 KiB each.
        assert_eq!(prefill_smem_bytes(128), 69_632);
        // Gemma's 256: one CTA per SM, within a CTA's 227 KiB either way.
        assert!(prefill_supported(16, 8, 256));
        assert_eq!((prefill_smem_bytes(256), prefill_fp8_smem_bytes(256)), (135_168, 137_216));
        assert!(prefill_fp8_smem_bytes(256) <= 227 * 1024);
        // The warpgroup kernel: three CTAs of 65 KiB per SM; head_dim 128, either cache, no
        // options.
        assert_eq!((prefill_wg_smem_bytes(false), prefill_wg_smem_bytes(true)), (66_560, 66_560));
        assert_eq!(prefill_wg_kernel_name(128, false), "prefill_attention_wg_hd128");
        assert_eq!(prefill_wg_kernel_name(128, true), "prefill_attention_wg_fp8_hd128");
        assert!(prefill_wg_supported(32, 8, 128, false));
        assert!(!prefill_wg_supported(32, 8, 64, false) && !prefill_wg_supported(32, 8, 128, true));
        assert!(!prefill_wg_supported(128, 1, 128, false));
        assert_eq!((prefill_variant_warps(0), prefill_variant_warps(PREFILL_WGMMA)), (Some(4), Some(4)));
        assert_eq!(prefill_variant_warps(PREFILL_VARIANTS), None);
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
