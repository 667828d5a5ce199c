//! Planning a KV-cache hand-off from a prefill worker to a decode worker.
//!
//! Both sides describe their cache with a [`KvLayout`]; a hand-off is refused
//! unless the layouts match exactly ([`KvLayout::check_compatible`] names
//! every field that differs). [`plan_transfer`] is a pure function: given the
//! sender's and receiver's block tables for the prompt, it says which blocks
//! move, per layer, merged into runs that are contiguous on both sides so a
//! transport can move each run with one copy (or one NCCL send/recv). Blocks
//! the receiver already holds (a prefix-cache hit on D) are skipped.
//!
//! Invariants of a plan: runs are in logical order, never overlap, cover
//! exactly the logical blocks `skip_blocks .. ceil(num_tokens / block_size)`,
//! and every layer has the same runs (the cache layout is the same per layer).

use crate::block_manager::BlockId;
use serde::{Deserialize, Serialize};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvDtype {
    /// 32-bit float (CPU backend).
    F32,
    /// bfloat16 (CUDA backend).
    BF16,
    /// IEEE half.
    F16,
    /// FP8 E4M3 codes, each a value divided by its layer's K or V scale (`--kv-cache-dtype
    /// fp8`). The scales travel with each layer's codes; a receiver with other scales adopts
    /// or requantizes (the engine's `KvAccess::import_kv_blocks`).
    Fp8E4M3,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::BF16 | KvDtype::F16 => 2,
            KvDtype::Fp8E4M3 => 1,
        }
    }
}

/// The geometry of one worker's paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers.
    pub num_layers: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Element type.
    pub dtype: KvDtype,
}

/// Two workers' caches cannot exchange blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV layouts are incompatible: {}", mismatches.join(", "))]
pub struct LayoutMismatch {
    /// One entry per differing field, e.g. `block_size 16 vs 32`.
    pub mismatches: Vec<String>,
}

impl KvLayout {
    /// Bytes of K (or of V) in one block of one layer.
    pub fn bytes_per_block(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim * self.dtype.size()
    }

    /// Ok when `other` has exactly the same geometry and dtype.
    pub fn check_compatible(&self, other: &KvLayout) -> Result<(), LayoutMismatch> {
        let mut mismatches = Vec::new();
        let mut cmp = |name: &str, a: String, b: String| {
            if a != b {
                mismatches.push(format!("{name} {a} vs {b}"));
            }
        };
        cmp("dtype", format!("{:?}", self.dtype), format!("{:?}", other.dtype));
        cmp("block_size", self.block_size.to_string(), other.block_size.to_string());
        cmp("num_layers", self.num_layers.to_string(), other.num_layers.to_string());
        cmp("num_kv_heads", self.num_kv_heads.to_string(), other.num_kv_heads.to_string());
        cmp("head_dim", self.head_dim.to_string(), other.head_dim.to_string());
        if mismatches.is_empty() { Ok(()) } else { Err(LayoutMismatch { mismatches }) }
    }
}

/// A run of `len` blocks contiguous on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRun {
    /// First logical block of the run (index into the block tables).
    pub logical_start: usize,
    /// First physical block on the sender.
    pub src_start: BlockId,
    /// First physical block on the receiver.
    pub dst_start: BlockId,
    /// Blocks in the run.
    pub len: usize,
}

/// What moves for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    /// Runs, in logical order; identical for every layer.
    pub runs: Vec<BlockRun>,
    /// Layers to move (all of them, streamed in order 0..num_layers).
    pub num_layers: usize,
    /// Bytes per layer (K and V together).
    pub bytes_per_layer: usize,
    /// Tokens of the prompt whose KV the plan covers (its last block may be partly filled).
    pub num_tokens: usize,
}

impl TransferPlan {
    /// Bytes over all layers.
    pub fn total_bytes(&self) -> usize {
        self.bytes_per_layer * self.num_layers
    }

    /// Blocks moved per layer.
    pub fn num_blocks(&self) -> usize {
        self.runs.iter().map(|r| r.len).sum()
    }
}

/// A hand-off that cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A block table does not cover the tokens to move.
    #[error("the {side} block table has {have} blocks but {need} are needed for {num_tokens} tokens")]
    TableTooShort {
        /// "sender" or "receiver".
        side: &'static str,
        /// Blocks in the table.
        have: usize,
        /// Blocks needed.
        need: usize,
        /// Tokens to move.
        num_tokens: usize,
    },
    /// The receiver claims to hold more blocks than exist.
    #[error("skip_blocks {skip} exceeds the {need} blocks of the prompt")]
    SkipTooLarge {
        /// Blocks the receiver already holds.
        skip: usize,
        /// Blocks covering the tokens.
        need: usize,
    },
    /// The same physical block appears twice in one table.
    #[error("the {side} block table repeats block {block}")]
    DuplicateBlock {
        /// "sender" or "receiver".
        side: &'static str,
        /// The repeated block.
        block: BlockId,
    },
}

fn check_unique(side: &'static str, table: &[BlockId]) -> Result<(), PlanError> {
    let mut seen = std::collections::HashSet::with_capacity(table.len());
    for &b in table {
        if !seen.insert(b) {
            return Err(PlanError::DuplicateBlock { side, block: b });
        }
    }
    Ok(())
}

/// Plans moving the KV of the first `num_tokens` tokens from `src_table` (sender) to
/// `dst_table` (receiver), skipping the first `skip_blocks` logical blocks, which the
/// receiver already holds. A partially filled last block moves whole.
pub fn plan_transfer(
    layout: &KvLayout,
    src_table: &[BlockId],
    dst_table: &[BlockId],
    num_tokens: usize,
    skip_blocks: usize,
) -> Result<TransferPlan, PlanError> {
    let need = num_tokens.div_ceil(layout.block_size.max(1));
    for (side, table) in [("sender", src_table), ("receiver", dst_table)] {
        if table.len() < need {
            return Err(PlanError::TableTooShort { side, have: table.len(), need, num_tokens });
        }
        check_unique(side, &table[..need])?;
    }
    if skip_blocks > need {
        return Err(PlanError::SkipTooLarge { skip: skip_blocks, need });
    }
    let mut runs: Vec<BlockRun> = Vec::new();
    for i in skip_blocks..need {
        let (s, d) = (src_table[i], dst_table[i]);
        match runs.last_mut() {
            Some(r) if r.src_start as usize + r.len == s as usize && r.dst_start as usize + r.len == d as usize => {
                r.len += 1
            }
            _ => runs.push(BlockRun { logical_start: i, src_start: s, dst_start: d, len: 1 }),
        }
    }
    let blocks: usize = runs.iter().map(|r| r.len).sum();
    Ok(TransferPlan {
        runs,
        num_layers: layout.num_layers,
        bytes_per_layer: 2 * blocks * layout.bytes_per_block(),
        num_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { num_layers: 4, block_size: 16, num_kv_heads: 2, head_dim: 64, dtype: KvDtype::BF16 }
    }

    fn run(l: usize, s: BlockId, d: BlockId, len: usize) -> BlockRun {
        BlockRun { logical_start: l, src_start: s, dst_start: d, len }
    }

    #[test]
    fn plans_table() {
        struct Case {
            name: &'static str,
            src: Vec<BlockId>,
            dst: Vec<BlockId>,
            tokens: usize,
            skip: usize,
            want: Vec<BlockRun>,
        }
        let cases = vec![
            Case {
                name: "one partial block",
                src: vec![7],
                dst: vec![3],
                tokens: 5,
                skip: 0,
                want: vec![run(0, 7, 3, 1)],
            },
            Case {
                name: "contiguous on both sides merges",
                src: vec![10, 11, 12],
                dst: vec![4, 5, 6],
                tokens: 48,
                skip: 0,
                want: vec![run(0, 10, 4, 3)],
            },
            Case {
                name: "contiguous on one side only splits",
                src: vec![10, 11, 12],
                dst: vec![4, 9, 10],
                tokens: 40,
                skip: 0,
                want: vec![run(0, 10, 4, 1), run(1, 11, 9, 2)],
            },
            Case {
                name: "prefix held by the receiver is skipped",
                src: vec![1, 2, 3, 4],
                dst: vec![20, 21, 22, 23],
                tokens: 60,
                skip: 2,
                want: vec![run(2, 3, 22, 2)],
            },
            Case {
                name: "extra table entries beyond the tokens are ignored",
                src: vec![5, 6, 99],
                dst: vec![8, 9, 1],
                tokens: 32,
                skip: 0,
                want: vec![run(0, 5, 8, 2)],
            },
            Case {
                name: "everything already held",
                src: vec![1, 2],
                dst: vec![3, 4],
                tokens: 32,
                skip: 2,
                want: vec![],
            },
            Case {
                name: "descending physical order never merges",
                src: vec![9, 8, 7],
                dst: vec![3, 2, 1],
                tokens: 33,
                skip: 0,
                want: vec![run(0, 9, 3, 1), run(1, 8, 2, 1), run(2, 7, 1, 1)],
            },
        ];
        for c in cases {
            let p = plan_transfer(&layout(), &c.src, &c.dst, c.tokens, c.skip)
                .unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert_eq!(p.runs, c.want, "{}", c.name);
            let blocks: usize = c.want.iter().map(|r| r.len).sum();
            assert_eq!(p.bytes_per_layer, 2 * blocks * 16 * 2 * 64 * 2, "{}", c.name);
            assert_eq!(p.total_bytes(), p.bytes_per_layer * 4, "{}", c.name);
            assert_eq!(p.num_tokens, c.tokens, "{}", c.name);
        }
    }

    #[test]
    fn refuses_bad_tables() {
        let l = layout();
        assert_eq!(
            plan_transfer(&l, &[1], &[2, 3], 17, 0),
            Err(PlanError::TableTooShort { side: "sender", have: 1, need: 2, num_tokens: 17 })
        );
        assert_eq!(
            plan_transfer(&l, &[1, 2], &[3], 17, 0),
            Err(PlanError::TableTooShort { side: "receiver", have: 1, need: 2, num_tokens: 17 })
        );
        assert_eq!(plan_transfer(&l, &[1, 2], &[3, 4], 17, 3), Err(PlanError::SkipTooLarge { skip: 3, need: 2 }));
        assert_eq!(
            plan_transfer(&l, &[1, 1], &[3, 4], 17, 0),
            Err(PlanError::DuplicateBlock { side: "sender", block: 1 })
        );
    }

    #[test]
    fn layout_mismatch_names_every_field() {
        let a = layout();
        assert!(a.check_compatible(&a).is_ok());
        let b = KvLayout { block_size: 32, head_dim: 128, dtype: KvDtype::F32, ..a };
        let err = a.check_compatible(&b).expect_err("must differ");
        let msg = err.to_string();
        assert_eq!(err.mismatches.len(), 3, "{msg}");
        assert!(
            msg.contains("block_size 16 vs 32")
                && msg.contains("head_dim 64 vs 128")
                && msg.contains("dtype BF16 vs F32"),
            "{msg}"
        );
        // An FP8 cache and a bf16 one cannot exchange blocks, even of the same geometry, and
        // an FP8 block is half the bytes.
        let fp8 = KvLayout { dtype: KvDtype::Fp8E4M3, ..a };
        let msg = a.check_compatible(&fp8).expect_err("dtype differs").to_string();
        assert!(msg.contains("dtype BF16 vs Fp8E4M3"), "{msg}");
        assert_eq!(fp8.bytes_per_block() * 2, a.bytes_per_block());
    }
}
