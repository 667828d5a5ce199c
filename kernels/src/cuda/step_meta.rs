//! Per-step metadata on the device: each row's position, cache slot, context length and
//! block-table offset, the block tables, the split-attention partials and the prefill work
//! lists, validated on the host and uploaded once per batch layout; and the paged cache's
//! geometry ([`KvGeometry`]) the kernels read it against.
//!
//! Invariants: every upload happens in [`StepMeta::set_padded`], never in a launch (launches
//! may be recorded into a CUDA graph), through page-locked staging (`staging.rs`), so the
//! host does not wait for the copies; buffers only grow, so after the largest step they keep
//! their addresses; rows past the real ones (a graph bucket's padding) carry position 0,
//! slot -1 and context 0.

use super::launch::{int, shape_check, shape_error};
use super::prefill::PrefillLists;
use super::staging::{Direction, Staging};
use super::{CudaDevice, CudaError};
use cudarc::driver::CudaSlice;

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

/// Where one sequence's chunk sits in the batch and in the paged cache (host side).
#[derive(Debug, Clone, Copy)]
pub struct HostSeq<'a> {
    /// First activation row of the chunk.
    pub row_start: usize,
    /// Rows in the chunk.
    pub n_tokens: usize,
    /// Tokens already cached before the chunk.
    pub start_pos: usize,
    /// Physical block of each logical block.
    pub block_table: &'a [u32],
}

/// Per-row metadata of one step for the KV write and the attention kernels, validated on
/// the host and kept on the device. Its buffers grow and are reused across steps.
pub struct StepMeta {
    pub(crate) rows: usize,
    pub(crate) block_size: usize,
    pub(crate) num_blocks: usize,
    pub(crate) positions: CudaSlice<i32>,
    pub(crate) slots: CudaSlice<i64>,
    pub(crate) row_ctx: CudaSlice<i32>,
    pub(crate) row_bt: CudaSlice<i32>,
    pub(crate) block_tables: CudaSlice<i32>,
    /// Longest context of any row.
    pub(crate) max_ctx: usize,
    /// Split-attention partials: `rows × heads × splits × head_dim` outputs and
    /// `rows × heads × splits × 2` (max, sum), grown on demand.
    pub(crate) part_o: CudaSlice<f32>,
    pub(crate) part_ml: CudaSlice<f32>,
    host: HostMeta,
    up: MetaStaging,
    /// The routing of prefill chunks and decode rows (see `prefill.rs`).
    pub(crate) prefill: PrefillMeta,
}

/// Host staging for [`StepMeta`]: positions, slots, context lengths, block-table offsets, tables.
#[derive(Default)]
struct HostMeta(Vec<i32>, Vec<i64>, Vec<i32>, Vec<i32>, Vec<i32>);

/// Page-locked staging of the [`HostMeta`] vectors, in the same order.
struct MetaStaging(Staging<i32>, Staging<i64>, Staging<i32>, Staging<i32>, Staging<i32>);

impl MetaStaging {
    fn new() -> Self {
        let up = || Staging::new(Direction::Up);
        Self(up(), Staging::new(Direction::Up), up(), up(), up())
    }
}

/// The metadata the KV write needs (an alias kept for the launcher's signature).
pub type KvWriteMeta = StepMeta;
/// The metadata attention needs.
pub type AttentionMeta = StepMeta;

impl StepMeta {
    /// Empty metadata with small buffers.
    pub fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        Ok(Self {
            rows: 0,
            block_size: 0,
            num_blocks: 0,
            positions: dev.alloc(64)?,
            slots: dev.alloc(64)?,
            row_ctx: dev.alloc(64)?,
            row_bt: dev.alloc(64)?,
            block_tables: dev.alloc(64)?,
            max_ctx: 0,
            part_o: dev.alloc(64)?,
            part_ml: dev.alloc(64)?,
            host: Default::default(),
            up: MetaStaging::new(),
            prefill: PrefillMeta::new(dev)?,
        })
    }

    /// Rows described.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Refuses a launch over a cache this metadata was not built for (another block size, or
    /// fewer blocks than the tables may name).
    pub(crate) fn check_geometry(&self, op: &'static str, geo: &KvGeometry) -> Result<(), CudaError> {
        shape_check(op, self.block_size == geo.block_size && self.num_blocks <= geo.num_blocks, || {
            "metadata built for another cache geometry".into()
        })
    }

    /// Longest context of any row.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// Fills the metadata for a batch of `n_rows` rows made of `seqs`, over a cache of
    /// `num_blocks` blocks of `block_size` tokens. Every row must belong to exactly one
    /// sequence and every block table must cover its chunk with valid block ids.
    pub fn set(
        &mut self,
        dev: &CudaDevice,
        seqs: &[HostSeq<'_>],
        n_rows: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<(), CudaError> {
        self.set_padded(dev, seqs, n_rows, n_rows, block_size, num_blocks)
    }

    /// [`StepMeta::set`] for a batch padded to `padded_rows` rows (a CUDA-graph bucket): rows
    /// `n_rows..padded_rows` belong to no sequence, write no KV (slot -1) and attend to nothing
    /// (context 0, output zeros).
    pub fn set_padded(
        &mut self,
        dev: &CudaDevice,
        seqs: &[HostSeq<'_>],
        n_rows: usize,
        padded_rows: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "step_meta";
        shape_check(OP, block_size > 0, || "block_size is 0".into())?;
        shape_check(OP, padded_rows >= n_rows, || format!("{padded_rows} padded rows for {n_rows} rows"))?;
        let HostMeta(pos, slots, ctx, bt_off, tables) = &mut self.host;
        pos.clear();
        pos.resize(n_rows, -1);
        slots.clear();
        slots.resize(n_rows, 0);
        ctx.clear();
        ctx.resize(n_rows, 0);
        bt_off.clear();
        bt_off.resize(n_rows, 0);
        tables.clear();
        for s in seqs {
            let end = s.start_pos + s.n_tokens;
            shape_check(OP, s.row_start + s.n_tokens <= n_rows, || {
                format!("rows {}..{} outside a batch of {n_rows}", s.row_start, s.row_start + s.n_tokens)
            })?;
            shape_check(OP, s.block_table.len() * block_size >= end, || {
                format!("block table covers {} tokens, need {end}", s.block_table.len() * block_size)
            })?;
            if let Some(&b) = s.block_table.iter().find(|&&b| b as usize >= num_blocks) {
                return Err(shape_error(OP, format!("block {b} outside a pool of {num_blocks}")));
            }
            let off = int(OP, tables.len())?;
            tables.extend(s.block_table.iter().map(|&b| b as i32));
            for t in 0..s.n_tokens {
                let r = s.row_start + t;
                shape_check(OP, pos[r] < 0, || format!("row {r} belongs to two sequences"))?;
                let p = s.start_pos + t;
                pos[r] = int(OP, p)?;
                slots[r] = (s.block_table[p / block_size] as usize * block_size + p % block_size) as i64;
                ctx[r] = int(OP, p + 1)?;
                bt_off[r] = off;
            }
        }
        if let Some(r) = pos.iter().position(|&p| p < 0) {
            return Err(shape_error(OP, format!("row {r} belongs to no sequence")));
        }
        if tables.is_empty() {
            tables.push(0);
        }
        pos.resize(padded_rows, 0);
        slots.resize(padded_rows, -1);
        ctx.resize(padded_rows, 0);
        bt_off.resize(padded_rows, 0);
        dev.grow(&mut self.positions, padded_rows)?;
        dev.grow(&mut self.slots, padded_rows)?;
        dev.grow(&mut self.row_ctx, padded_rows)?;
        dev.grow(&mut self.row_bt, padded_rows)?;
        dev.grow(&mut self.block_tables, tables.len())?;
        let up = &mut self.up;
        up.0.upload(dev, pos, &mut self.positions)?;
        up.1.upload(dev, slots, &mut self.slots)?;
        up.2.upload(dev, ctx, &mut self.row_ctx)?;
        up.3.upload(dev, bt_off, &mut self.row_bt)?;
        up.4.upload(dev, tables, &mut self.block_tables)?;
        self.max_ctx = ctx.iter().copied().max().unwrap_or(0).max(0) as usize;
        let lists = PrefillLists::build(seqs.iter().map(|s| (s.row_start, s.n_tokens, s.start_pos)), ctx, bt_off)?;
        self.prefill.fill(dev, lists)?;
        self.rows = padded_rows;
        self.block_size = block_size;
        self.num_blocks = num_blocks;
        Ok(())
    }
}

/// The device side of [`PrefillLists`], part of [`StepMeta`]. Uploads happen only when the step
/// has prefill chunks (a decode-only step pays nothing), and the decode context array only
/// when it also has decode rows.
pub(crate) struct PrefillMeta {
    pub(crate) lists: PrefillLists,
    /// `seqs` flattened, 4 ints per sequence.
    pub(crate) seqs: CudaSlice<i32>,
    /// `decode_ctx`.
    pub(crate) decode_ctx: CudaSlice<i32>,
}

impl PrefillMeta {
    fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        Ok(Self { lists: PrefillLists::default(), seqs: dev.alloc(64)?, decode_ctx: dev.alloc(64)? })
    }

    /// Replaces the lists and uploads what the launches of this step will read.
    fn fill(&mut self, dev: &CudaDevice, lists: PrefillLists) -> Result<(), CudaError> {
        self.lists = lists;
        if self.lists.seqs.is_empty() {
            return Ok(());
        }
        let flat: Vec<i32> = self.lists.seqs.iter().flatten().copied().collect();
        dev.grow(&mut self.seqs, flat.len())?;
        dev.upload_into(&flat, &mut self.seqs)?;
        if self.lists.decode_rows_end > 0 {
            let n = self.lists.decode_rows_end;
            dev.grow(&mut self.decode_ctx, n)?;
            dev.upload_into(&self.lists.decode_ctx[..n], &mut self.decode_ctx)?;
        }
        Ok(())
    }

    /// Whether the step has a chunk for the prefill kernel.
    pub(crate) fn has_prefill(&self) -> bool {
        !self.lists.seqs.is_empty()
    }
}
