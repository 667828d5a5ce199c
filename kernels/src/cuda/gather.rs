//! Row gathers (elementwise.cu): the embedding lookup [`EmbedCall`] (bf16 table rows widened
//! into the f32 residual stream) and [`GatherRowsCall`] (activation or residual rows picked
//! by index).
//!
//! Invariants: every row index a kernel follows was checked on the host: token ids by
//! [`StepIds::stage`] against the vocabulary the embedding is launched with, gathered rows
//! here before they are uploaded; one CTA per output row.

use super::launch::{Args, Elem, THREADS, int, need, per_row, row_threads, shape_check, shape_error};
use super::{CudaDevice, CudaError, CudaSlice, StepIds};
use cudarc::driver::CudaFunction;
use half::bf16;

/// `out[i] = table[ids[i]]` widened to f32 for the rows staged in `ids` (`table` is
/// `vocab × dim` bf16). Nothing is uploaded, so the launch can be recorded into a CUDA graph.
pub struct EmbedCall<'a> {
    /// The step's ids, staged by [`StepIds::stage`] against a vocabulary of at most `vocab`.
    pub ids: &'a StepIds,
    /// `vocab × dim` bf16.
    pub table: &'a CudaSlice<bf16>,
    /// Rows of `table`.
    pub vocab: usize,
    /// Row width.
    pub dim: usize,
    /// `ids.rows() × dim` f32: the residual stream.
    pub out: &'a mut CudaSlice<f32>,
}

impl EmbedCall<'_> {
    /// Checks the sizes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "embed";
        let n = self.ids.rows();
        need(OP, "table", self.table, self.vocab * self.dim)?;
        need(OP, "out", self.out, n * self.dim)?;
        need(OP, "ids", self.ids.ids(), n)?;
        if n == 0 {
            return Ok(());
        }
        shape_check(OP, self.ids.vocab() <= self.vocab, || {
            format!("ids checked against a vocabulary of {}, the table has {} rows", self.ids.vocab(), self.vocab)
        })?;
        // Four elements per thread (elementwise.cu): a row in one pass.
        let grid = per_row(OP, n, row_threads(self.dim, 4))?;
        let args = Args::new(OP).buf(self.ids.ids()).buf(self.table).buf(self.out).int(self.dim)?;
        // SAFETY: every staged id is below `vocab` (StepIds), so each CTA reads one table row
        // inside `vocab × dim` and writes its own row of `out`, checked above.
        unsafe { args.launch(dev, &dev.kernels.embed, grid) }
    }
}

/// `dst[i] = src[rows[i]]` for rows of width `width` (`src` has `src_rows` rows); `T` is
/// bf16 (activations) or f32 (the residual stream). The row ids go up through `scratch`
/// (grown as needed), so this launch cannot be recorded into a CUDA graph.
pub struct GatherRowsCall<'a, T> {
    /// `src_rows × width`.
    pub src: &'a CudaSlice<T>,
    /// Rows of `src`.
    pub src_rows: usize,
    /// Row width.
    pub width: usize,
    /// The rows to pick, each below `src_rows`.
    pub rows: &'a [usize],
    /// Device buffer for the row ids.
    pub scratch: &'a mut CudaSlice<i32>,
    /// `rows.len() × width`.
    pub dst: &'a mut CudaSlice<T>,
}

impl GatherRowsCall<'_, bf16> {
    /// Checks the rows and sizes, uploads the row ids and enqueues `gather_rows_bf16`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        gather(self, dev, "gather_rows", &dev.kernels.gather_rows_bf16)
    }
}

impl GatherRowsCall<'_, f32> {
    /// Checks the rows and sizes, uploads the row ids and enqueues `gather_rows_f32`.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        gather(self, dev, "gather_rows_f32", &dev.kernels.gather_rows_f32)
    }
}

/// The launch both element types share.
fn gather<T: Elem>(
    call: GatherRowsCall<'_, T>,
    dev: &CudaDevice,
    op: &'static str,
    func: &CudaFunction,
) -> Result<(), CudaError> {
    let (src_rows, w, rows) = (call.src_rows, call.width, call.rows);
    if let Some(r) = rows.iter().find(|&&r| r >= src_rows) {
        return Err(shape_error(op, format!("row {r} outside {src_rows} rows")));
    }
    need(op, "src", call.src, src_rows * w)?;
    need(op, "dst", call.dst, rows.len() * w)?;
    if rows.is_empty() || w == 0 {
        return Ok(());
    }
    let ids = rows.iter().map(|&r| int(op, r)).collect::<Result<Vec<_>, _>>()?;
    dev.grow(call.scratch, ids.len())?;
    dev.upload_into(&ids, call.scratch)?;
    let grid = per_row(op, rows.len(), THREADS)?;
    let args = Args::new(op).buf(call.src).buf(&*call.scratch).buf(call.dst).int(w)?;
    // SAFETY: every uploaded row id is below `src_rows`, `src` holds `src_rows × width`
    // and `dst` one row per id, checked above.
    unsafe { args.launch(dev, func, grid) }
}
