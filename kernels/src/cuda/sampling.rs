//! The launcher of `kernels/cuda/sampling.cu`: sampling rows of f32 logits that are already
//! on the device, so only a few hundred bytes per row come back to the host.
//!
//! This crate does not know the request types: a row arrives as a [`DeviceRow`] (the
//! per-token ops of steps 2–5 and the scalars of steps 6–8 of `baton_core::sampling`,
//! compiled by `baton_core::sampling::plan_row`) and leaves as a [`DeviceSample`].
//!
//! A sampling is launched ([`CudaDevice::sample_rows_launch`]) and collected
//! ([`CudaDevice::sample_rows_collect`]) separately: the rows go up and the answers come down
//! through page-locked staging, so between the two the host is free, and the picks stay on
//! the device for a step planned before they are known ([`super::StepIds::stage`]).
//!
//! Invariants: everything the kernel indexes with (logit rows, op ids, op ranges, top
//! counts, top_k) is checked here before the launch, so a bad row is a
//! [`CudaError::Shape`], never an out-of-bounds access; the logits of sampled rows are
//! overwritten (sanitised and processed in place); the buffers only grow; the answers of
//! the last launch stay in the device buffer until the next launch.

use super::launch::{Args, cfg, shape_check, shape_error};
use super::staging::{Direction, Staging};
use super::{CudaDevice, CudaError};
use cudarc::driver::CudaSlice;

/// Most top logprobs a row can ask for (OpenAI's limit; `SAMPLE_MAX_TOP` in sampling.cu).
pub const SAMPLE_MAX_TOP: usize = 20;
/// Largest vocabulary the kernel handles: its inverse-CDF block sums live in shared memory
/// (`MAX_CDF_BLOCKS * CDF_BLOCK` in sampling.cu).
pub const SAMPLE_MAX_VOCAB: usize = 4096 * 64;

const THREADS: u32 = 1024;
const ROW_WORDS: usize = 10;
const OUT_WORDS: usize = 4 + 2 * SAMPLE_MAX_TOP;

/// What one op does to one logit (see `baton_core::sampling::TokenOpKind`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceOpKind {
    /// `x + value`.
    Bias,
    /// `-inf`.
    Mask,
    /// `x / value` when `x > 0`, else `x * value`.
    Repetition,
    /// `x - value`.
    Subtract,
}

/// One op on one token of a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceOp {
    /// The token id (must be below the vocabulary).
    pub id: u32,
    /// What it does.
    pub kind: DeviceOpKind,
    /// Its operand (unused by `Mask`).
    pub value: f32,
}

/// One row to sample.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRow<'a> {
    /// Which row of the logits matrix.
    pub logit_row: usize,
    /// Ops sorted by id, each id's ops in pipeline order.
    pub ops: &'a [DeviceOp],
    /// The token is the processed argmax.
    pub greedy: bool,
    /// Temperature; positive and finite unless `greedy`.
    pub temperature: f32,
    /// top_k, 0 when off; otherwise below the vocabulary.
    pub top_k: usize,
    /// top_p, `>= 1` when off.
    pub top_p: f32,
    /// min_p floor on weights, 0 when off.
    pub min_p: f32,
    /// `Some(k)`: the token's raw logprob and the `k <= SAMPLE_MAX_TOP` best raw entries.
    pub logprobs: Option<usize>,
    /// The draw's uniform number in `[0, 1)`.
    pub u: f64,
    /// Step 5b: the ids a grammar allows (ids outside it get `-inf` after the ops); `None`
    /// when the row is unconstrained.
    pub allowed: Option<DeviceMask<'a>>,
}

/// A grammar's allowed ids for one row: bit `id % 32` of `words[id / 32]`, for ids below
/// `len` (ids at or past `len` are not allowed).
#[derive(Debug, Clone, Copy)]
pub struct DeviceMask<'a> {
    /// The packed bits, at least `len.div_ceil(32)` words.
    pub words: &'a [u32],
    /// How many ids the mask covers.
    pub len: usize,
}

/// The kernel's answer for one row.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSample {
    /// The sampled token.
    pub token: u32,
    /// Its raw logprob (0 unless the row asked for logprobs).
    pub logprob: f32,
    /// The best raw entries as `(id, logprob)`, most likely first, ties by lower id.
    pub top: Vec<(u32, f32)>,
}

/// Device buffers and host staging reused by every sampling.
pub struct SampleBuffers {
    rows: CudaSlice<u32>,
    us: CudaSlice<f64>,
    ops: CudaSlice<u32>,
    op_raw: CudaSlice<f32>,
    masks: CudaSlice<u32>,
    out: CudaSlice<u32>,
    rows_up: Staging<u32>,
    masks_up: Staging<u32>,
    us_up: Staging<f64>,
    ops_up: Staging<u32>,
    out_down: Staging<u32>,
    /// Rows of the last launch (their answers are in `out`).
    launched: usize,
    /// Whether the last launch's answers were collected.
    collected: bool,
}

impl SampleBuffers {
    /// Small initial buffers on `dev`; they grow to the largest batch seen.
    pub fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        Ok(Self {
            rows: dev.alloc(ROW_WORDS * 64)?,
            us: dev.alloc(64)?,
            ops: dev.alloc(3 * 1024)?,
            op_raw: dev.alloc(1024)?,
            masks: dev.alloc(1)?,
            out: dev.alloc(OUT_WORDS * 64)?,
            rows_up: Staging::new(Direction::Up),
            masks_up: Staging::new(Direction::Up),
            us_up: Staging::new(Direction::Up),
            ops_up: Staging::new(Direction::Up),
            out_down: Staging::new(Direction::Down),
            launched: 0,
            collected: true,
        })
    }

    /// Rows of the last launch; their picks are what [`super::StepIds::stage`] can take.
    pub fn launched_rows(&self) -> usize {
        self.launched
    }
}

fn word(op: &'static str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| shape_error(op, format!("{v} does not fit 32 bits")))
}

/// Checks one row against the logits it samples from.
fn check_row(row: &DeviceRow<'_>, n_logit_rows: usize, vocab: usize) -> Result<(), CudaError> {
    const OP: &str = "sample_rows";
    shape_check(OP, row.logit_row < n_logit_rows, || format!("logit row {} of {n_logit_rows}", row.logit_row))?;
    shape_check(OP, row.ops.iter().all(|o| (o.id as usize) < vocab), || format!("an op id is outside {vocab}"))?;
    shape_check(OP, row.ops.windows(2).all(|w| w[0].id <= w[1].id), || "ops are not sorted by id".into())?;
    shape_check(OP, row.top_k < vocab, || format!("top_k {} with a vocabulary of {vocab}", row.top_k))?;
    shape_check(OP, row.logprobs.is_none_or(|k| k <= SAMPLE_MAX_TOP && k <= vocab), || {
        format!("{:?} top logprobs (at most {SAMPLE_MAX_TOP})", row.logprobs)
    })?;
    let t = row.temperature;
    shape_check(OP, row.greedy || (t > 0.0 && t.is_finite()), || format!("temperature {t} for a random draw"))?;
    shape_check(OP, (0.0..1.0).contains(&row.u), || format!("uniform {} outside [0, 1)", row.u))?;
    shape_check(OP, row.allowed.is_none_or(|m| m.words.len() >= m.len.div_ceil(32)), || {
        "a grammar mask has fewer words than its length needs".into()
    })
}

impl CudaDevice {
    /// Samples `rows` from the `n_logit_rows × vocab` f32 matrix `logits` (row-major) and
    /// returns one answer per row, in order. Rewrites the sampled rows of `logits`.
    /// Synchronizes with the stream (the answers are downloaded).
    pub fn sample_rows(
        &self,
        logits: &mut CudaSlice<f32>,
        n_logit_rows: usize,
        vocab: usize,
        rows: &[DeviceRow<'_>],
        bufs: &mut SampleBuffers,
    ) -> Result<Vec<DeviceSample>, CudaError> {
        self.sample_rows_launch(logits, n_logit_rows, vocab, rows, bufs)?;
        self.sample_rows_collect(bufs)
    }

    /// Enqueues [`CudaDevice::sample_rows`]'s work and the download of its answers, and
    /// returns without waiting; [`CudaDevice::sample_rows_collect`] returns the answers.
    pub fn sample_rows_launch(
        &self,
        logits: &mut CudaSlice<f32>,
        n_logit_rows: usize,
        vocab: usize,
        rows: &[DeviceRow<'_>],
        bufs: &mut SampleBuffers,
    ) -> Result<(), CudaError> {
        const OP: &str = "sample_rows";
        shape_check(OP, (1..=SAMPLE_MAX_VOCAB).contains(&vocab), || {
            format!("vocabulary {vocab} (the kernel handles 1..={SAMPLE_MAX_VOCAB})")
        })?;
        shape_check(OP, logits.len() >= n_logit_rows * vocab, || {
            format!("logits has {} values, needs {n_logit_rows}×{vocab}", logits.len())
        })?;
        shape_check(OP, vocab <= i32::MAX as usize && rows.len() <= u16::MAX as usize, || "too large".into())?;
        bufs.launched = 0;
        bufs.collected = false;
        if rows.is_empty() {
            return bufs.out_down.download_async(self, &bufs.out, 0);
        }
        let mut words = Vec::with_capacity(rows.len() * ROW_WORDS);
        let mut us = Vec::with_capacity(rows.len());
        let mut ops = Vec::new();
        let mut masks: Vec<u32> = Vec::new();
        for row in rows {
            check_row(row, n_logit_rows, vocab)?;
            // Only the words the kernel can read: ids below both the mask's length and the row.
            let (mask_at, mask_len) = match row.allowed {
                Some(m) => {
                    let len = m.len.min(vocab);
                    let at = masks.len();
                    masks.extend_from_slice(&m.words[..len.div_ceil(32)]);
                    (at, len)
                }
                None => (0, 0),
            };
            let start = ops.len() / 3;
            for op in row.ops {
                let kind = match op.kind {
                    DeviceOpKind::Bias => 0,
                    DeviceOpKind::Mask => 1,
                    DeviceOpKind::Repetition => 2,
                    DeviceOpKind::Subtract => 3,
                };
                ops.extend([op.id, kind, op.value.to_bits()]);
            }
            let end = ops.len() / 3;
            let top = row.logprobs.unwrap_or(0);
            let flags = u32::from(row.greedy)
                | (u32::from(row.logprobs.is_some()) << 1)
                | (u32::from(row.allowed.is_some()) << 2)
                | (word(OP, top)? << 8);
            words.extend([
                word(OP, row.logit_row)?,
                word(OP, start)?,
                word(OP, end)?,
                flags,
                row.temperature.to_bits(),
                word(OP, row.top_k)?,
                row.top_p.to_bits(),
                row.min_p.to_bits(),
                word(OP, mask_at)?,
                word(OP, mask_len)?,
            ]);
            us.push(row.u);
        }
        let n_ops = ops.len() / 3;
        shape_check(OP, n_ops <= i32::MAX as usize, || format!("{n_ops} ops"))?;
        // Sampling is never recorded into a CUDA graph, so its buffers may move without
        // invalidating the decode graphs (the penalty lists grow as generations get longer).
        self.grow_outside_graphs(&mut bufs.rows, words.len())?;
        self.grow_outside_graphs(&mut bufs.us, us.len())?;
        self.grow_outside_graphs(&mut bufs.ops, ops.len().max(1))?;
        self.grow_outside_graphs(&mut bufs.op_raw, n_ops.max(1))?;
        self.grow_outside_graphs(&mut bufs.masks, masks.len().max(1))?;
        self.grow_outside_graphs(&mut bufs.out, rows.len() * OUT_WORDS)?;
        bufs.rows_up.upload(self, &words, &mut bufs.rows)?;
        bufs.us_up.upload(self, &us, &mut bufs.us)?;
        bufs.ops_up.upload(self, &ops, &mut bufs.ops)?;
        if !masks.is_empty() {
            bufs.masks_up.upload(self, &masks, &mut bufs.masks)?;
        }
        let grid = cfg((rows.len() as u32, 1, 1), THREADS);
        let args = Args::new(OP)
            .buf(&*logits)
            .i32(vocab as i32)
            .buf(&bufs.rows)
            .buf(&bufs.us)
            .buf(&bufs.ops)
            .buf(&bufs.op_raw)
            .buf(&bufs.masks)
            .buf(&bufs.out);
        // SAFETY: every row's logit row, op ids and op range, top_k, top count and mask
        // range (offset + len.div_ceil(32) words, len <= vocab) were checked or built above
        // against `logits` and the uploaded buffers, which are large enough.
        unsafe { args.launch(self, &self.kernels.sample_rows, grid) }?;
        bufs.out_down.download_async(self, &bufs.out, rows.len() * OUT_WORDS)?;
        bufs.launched = rows.len();
        Ok(())
    }

    /// Waits for the last [`CudaDevice::sample_rows_launch`] and returns one answer per row,
    /// in order (and any fault of the work enqueued before it). A launch is collected once.
    pub fn sample_rows_collect(&self, bufs: &mut SampleBuffers) -> Result<Vec<DeviceSample>, CudaError> {
        shape_check("sample_rows_collect", !bufs.collected, || "no sampling launched since the last collect".into())?;
        bufs.collected = true;
        Ok(bufs.out_down.wait()?.chunks_exact(OUT_WORDS).map(decode).collect())
    }

    /// `ids[row] = the token the last launch picked for its row i`, for each `(row, i)` pair
    /// of `pending` (2 ints each, already on the device, `n` pairs), checked by the caller.
    pub(crate) fn take_sampled_ids(
        &self,
        bufs: &SampleBuffers,
        pending: &CudaSlice<i32>,
        n: usize,
        ids: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        shape_check("take_sampled_ids", pending.len() >= 2 * n && n <= i32::MAX as usize, || {
            format!("{n} pairs in {} ints", pending.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let grid = cfg((n.div_ceil(256) as u32, 1, 1), 256);
        let args = Args::new("take_sampled_ids").buf(&bufs.out).buf(pending).i32(n as i32).buf(&*ids);
        // SAFETY: the caller checked every row against `ids` and every i against the last
        // launch's rows, whose answers `out` holds.
        unsafe { args.launch(self, &self.kernels.take_sampled_ids, grid) }?;
        Ok(())
    }
}

/// One row of the kernel's output words.
fn decode(o: &[u32]) -> DeviceSample {
    let n = (o[2] as usize).min(SAMPLE_MAX_TOP);
    let top = (0..n).map(|j| (o[4 + j], f32::from_bits(o[4 + SAMPLE_MAX_TOP + j]))).collect();
    DeviceSample { token: o[0], logprob: f32::from_bits(o[1]), top }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ops: &[DeviceOp]) -> DeviceRow<'_> {
        DeviceRow {
            logit_row: 0,
            ops,
            greedy: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logprobs: Some(5),
            u: 0.5,
            allowed: None,
        }
    }

    #[test]
    fn rows_are_checked_before_launch() {
        let ok = [
            DeviceOp { id: 1, kind: DeviceOpKind::Bias, value: 1.0 },
            DeviceOp { id: 3, kind: DeviceOpKind::Mask, value: 0.0 },
        ];
        assert!(check_row(&row(&ok), 1, 10).is_ok());
        assert!(check_row(&row(&ok), 1, 3).is_err(), "op id 3 outside a vocabulary of 3");
        assert!(check_row(&DeviceRow { logit_row: 1, ..row(&ok) }, 1, 10).is_err());
        let unsorted = [ok[1], ok[0]];
        assert!(check_row(&row(&unsorted), 1, 10).is_err());
        assert!(check_row(&DeviceRow { top_k: 10, ..row(&ok) }, 1, 10).is_err());
        assert!(check_row(&DeviceRow { logprobs: Some(21), ..row(&ok) }, 1, 100).is_err());
        assert!(check_row(&DeviceRow { temperature: 0.0, ..row(&ok) }, 1, 10).is_err());
        assert!(check_row(&DeviceRow { temperature: 0.0, greedy: true, ..row(&ok) }, 1, 10).is_ok());
        assert!(check_row(&DeviceRow { u: 1.0, ..row(&ok) }, 1, 10).is_err());
        let short = DeviceMask { words: &[1], len: 33 };
        assert!(check_row(&DeviceRow { allowed: Some(short), ..row(&ok) }, 1, 10).is_err());
        let fits = DeviceMask { words: &[1, 0], len: 33 };
        assert!(check_row(&DeviceRow { allowed: Some(fits), ..row(&ok) }, 1, 10).is_ok());
    }

    #[test]
    fn output_words_decode() {
        let mut o = vec![0u32; OUT_WORDS];
        o[0] = 42;
        o[1] = (-1.5f32).to_bits();
        o[2] = 2;
        o[4] = 7;
        o[5] = 42;
        o[4 + SAMPLE_MAX_TOP] = (-0.5f32).to_bits();
        o[5 + SAMPLE_MAX_TOP] = (-1.5f32).to_bits();
        assert_eq!(decode(&o), DeviceSample { token: 42, logprob: -1.5, top: vec![(7, -0.5), (42, -1.5)] });
    }
}
