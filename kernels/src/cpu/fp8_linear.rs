//! FP8 weight matrices and the CPU reference of a linear over one: the product the CUDA FP8
//! kernels are checked against.
//!
//! An [`Fp8Matrix`] is `rows × cols` E4M3 codes with f32 scales, one per block of
//! `row_block × col_block` elements (`scales[⌈rows/row_block⌉][⌈cols/col_block⌉]`): per
//! tensor is one block of the whole matrix, per channel `1 × cols`, DeepSeek-style `128 × 128`.
//! The value of element (r, c) is `e4m3(code) × scale(r, c)`.
//!
//! [`linear_fp8`] with [`ActivationScale::PerToken`] quantizes each input row dynamically
//! (scale `amax(row) / 448`, 1 for a zero row, codes rounded as the hardware's satfinite
//! conversion does) and multiplies the dequantized values exactly in f32; with
//! [`ActivationScale::None`] (weights-only, W8A16) the input is used as is.
//!
//! Invariants: `codes.len() == rows × cols`, `scales.len()` as above, every block size ≥ 1.

use super::fp8::{E4M3_MAX, e4m3_from_f32, e4m3_to_f32};
use super::{KernelError, linear};

/// A `rows × cols` FP8 E4M3 weight matrix with block scales (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Matrix {
    rows: usize,
    cols: usize,
    codes: Vec<u8>,
    scales: Vec<f32>,
    row_block: usize,
    col_block: usize,
}

/// How the activations entering an FP8 linear are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationScale {
    /// Not at all (W8A16).
    None,
    /// Dynamically per row: `amax(row) / 448`.
    PerToken,
}

fn err(message: String) -> KernelError {
    KernelError { op: "fp8_matrix", message }
}

impl Fp8Matrix {
    /// A matrix from its codes and `⌈rows/row_block⌉ × ⌈cols/col_block⌉` scales.
    pub fn new(
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
        row_block: usize,
        col_block: usize,
    ) -> Result<Self, KernelError> {
        if row_block == 0 || col_block == 0 {
            return Err(err(format!("block {row_block}×{col_block} must be positive")));
        }
        if codes.len() != rows * cols {
            return Err(err(format!("{} codes for a {rows}×{cols} matrix", codes.len())));
        }
        let want = rows.div_ceil(row_block) * cols.div_ceil(col_block);
        if scales.len() != want {
            return Err(err(format!("{} scales, want {want} for {row_block}×{col_block} blocks", scales.len())));
        }
        Ok(Self { rows, cols, codes, scales, row_block, col_block })
    }

    /// Quantizes a `rows × cols` f32 matrix per output row (the at-load path): scale =
    /// `amax(row) / 448` (1 for a zero row), code = E4M3 of `value / scale`.
    pub fn quantize_per_channel(values: &[f32], rows: usize, cols: usize) -> Result<Self, KernelError> {
        if values.len() != rows * cols {
            return Err(err(format!("{} values for a {rows}×{cols} matrix", values.len())));
        }
        let mut codes = vec![0u8; rows * cols];
        let mut scales = vec![1.0f32; rows];
        if cols > 0 {
            // Rows in parallel (each row's result depends on that row alone): an 8B checkpoint
            // quantized here row after row took a minute.
            use rayon::prelude::*;
            values.par_chunks_exact(cols).zip(codes.par_chunks_exact_mut(cols)).zip(scales.par_iter_mut()).for_each(
                |((row, dst), scale)| {
                    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    if amax > 0.0 && amax.is_finite() {
                        *scale = amax / E4M3_MAX;
                    }
                    for (d, v) in dst.iter_mut().zip(row) {
                        *d = e4m3_from_f32(v / *scale);
                    }
                },
            );
        }
        Self::new(rows, cols, codes, scales, 1, cols.max(1))
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The E4M3 codes, row-major.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// The block scales, row-major over blocks.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// `(row_block, col_block)`.
    pub fn block(&self) -> (usize, usize) {
        (self.row_block, self.col_block)
    }

    /// The scale of element (`row`, `col`).
    pub fn scale_at(&self, row: usize, col: usize) -> f32 {
        self.scales[(row / self.row_block) * self.cols.div_ceil(self.col_block) + col / self.col_block]
    }

    /// The same values with one scale row per matrix row (`row_block` 1): what stacking
    /// matrices whose row blocks do not line up needs.
    pub fn per_row(&self) -> Self {
        let per_row = self.cols.div_ceil(self.col_block);
        let scales = (0..self.rows)
            .flat_map(|r| (0..per_row).map(move |b| (r, b)))
            .map(|(r, b)| self.scale_at(r, b * self.col_block));
        Self { scales: scales.collect(), row_block: 1, ..self.clone() }
    }

    /// `parts` stacked by rows (a fused `[q; k; v]`). Their column counts and column blocks
    /// must agree; row blocks are kept where every part but the last fills whole blocks,
    /// else each part is expanded to one scale row per matrix row.
    pub fn stack(parts: &[Fp8Matrix]) -> Result<Self, KernelError> {
        let Some(first) = parts.first() else { return Err(err("nothing to stack".into())) };
        let (cols, col_block) = (first.cols, first.col_block);
        if let Some(p) = parts.iter().find(|p| p.cols != cols || p.col_block != col_block) {
            return Err(err(format!(
                "cannot stack {}×{} (column block {}) under {}×{cols} (column block {col_block})",
                p.rows, p.cols, p.col_block, first.rows
            )));
        }
        if parts.len() == 1 {
            return Ok(first.clone());
        }
        let row_block = first.row_block;
        let aligned = parts.iter().all(|p| p.row_block == row_block)
            && parts[..parts.len() - 1].iter().all(|p| p.rows % row_block == 0);
        let parts: Vec<Fp8Matrix> =
            if aligned { parts.to_vec() } else { parts.iter().map(Fp8Matrix::per_row).collect() };
        let rows = parts.iter().map(|p| p.rows).sum();
        let codes = parts.iter().flat_map(|p| p.codes.iter().copied()).collect();
        let scales = parts.iter().flat_map(|p| p.scales.iter().copied()).collect();
        Self::new(rows, cols, codes, scales, parts[0].row_block, col_block)
    }

    /// The values the codes stand for, `e4m3(code) × scale` in f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.codes.len());
        if self.cols == 0 {
            return out;
        }
        for (r, row) in self.codes.chunks_exact(self.cols).enumerate() {
            out.extend(row.iter().enumerate().map(|(c, &code)| e4m3_to_f32(code) * self.scale_at(r, c)));
        }
        out
    }
}

/// Replaces each row of `x` (width `k`) by its dynamic per-token FP8 quantization, dequantized:
/// `e4m3(x / s) × s` with `s = amax(row) / 448` (1 for an all-zero row).
pub fn quantize_rows_per_token(x: &mut [f32], k: usize) {
    if k == 0 {
        return;
    }
    for row in x.chunks_exact_mut(k) {
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 && amax.is_finite() { amax / E4M3_MAX } else { 1.0 };
        for v in row.iter_mut() {
            *v = e4m3_to_f32(e4m3_from_f32(*v / s)) * s;
        }
    }
}

/// `out = q(x) · W_dqᵀ (+ bias)` for `m` rows: `W_dq` the dequantized `w`, `q` the activation
/// quantization `act` (see the module docs); f32 throughout.
pub fn linear_fp8(
    x: &[f32],
    w: &Fp8Matrix,
    bias: Option<&[f32]>,
    m: usize,
    act: ActivationScale,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let k = w.cols;
    if x.len() != m * k {
        return Err(KernelError { op: "linear_fp8", message: format!("x has {} values, want {m}×{k}", x.len()) });
    }
    let mut xq = x.to_vec();
    if act == ActivationScale::PerToken {
        quantize_rows_per_token(&mut xq, k);
    }
    linear(&xq, &w.dequantize(), bias, m, k, w.rows, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_scales_apply_per_block_and_partial_blocks() {
        // 3×5 with 2×3 blocks: 2×2 scales, the last row and columns partial.
        let codes = vec![0x38u8; 15]; // every code is 1.0
        let w = Fp8Matrix::new(3, 5, codes, vec![1.0, 2.0, 3.0, 4.0], 2, 3).expect("valid");
        let d = w.dequantize();
        assert_eq!(&d[0..5], &[1.0, 1.0, 1.0, 2.0, 2.0]);
        assert_eq!(&d[5..10], &[1.0, 1.0, 1.0, 2.0, 2.0]);
        assert_eq!(&d[10..15], &[3.0, 3.0, 3.0, 4.0, 4.0]);
        assert_eq!(w.per_row().dequantize(), d);
        assert!(Fp8Matrix::new(3, 5, vec![0; 15], vec![1.0; 3], 2, 3).is_err());
        assert!(Fp8Matrix::new(3, 5, vec![0; 14], vec![1.0; 4], 2, 3).is_err());
    }

    #[test]
    fn stacking_keeps_aligned_blocks_and_expands_the_rest() {
        let a = Fp8Matrix::new(2, 4, vec![0x38; 8], vec![1.0, 2.0], 2, 2).expect("a");
        let b = Fp8Matrix::new(1, 4, vec![0x40; 4], vec![3.0, 4.0], 2, 2).expect("b");
        let s = Fp8Matrix::stack(&[a.clone(), b.clone()]).expect("aligned");
        assert_eq!(s.block(), (2, 2));
        let mut want = a.dequantize();
        want.extend(b.dequantize());
        assert_eq!(s.dequantize(), want);
        // b first: its one row does not fill a block, so both expand to per-row scales.
        let s = Fp8Matrix::stack(&[b.clone(), a.clone()]).expect("expanded");
        assert_eq!(s.block(), (1, 2));
        let mut want = b.dequantize();
        want.extend(a.dequantize());
        assert_eq!(s.dequantize(), want);
        let c = Fp8Matrix::new(1, 4, vec![0; 4], vec![1.0], 1, 4).expect("c");
        assert!(Fp8Matrix::stack(&[a, c]).is_err(), "column blocks differ");
    }

    #[test]
    fn per_channel_quantization_round_trips_within_e4m3_precision() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.013).collect();
        let w = Fp8Matrix::quantize_per_channel(&values, 4, 16).expect("quantized");
        for (r, row) in values.chunks(16).enumerate() {
            let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(w.scales()[r], amax / 448.0);
            // The largest magnitude maps onto ±448 exactly.
            assert!(w.codes()[r * 16..(r + 1) * 16].iter().any(|&c| c & 0x7F == 0x7E));
        }
        for (d, v) in w.dequantize().iter().zip(&values) {
            // 3 mantissa bits: relative error at most 2⁻⁴ (normal range).
            assert!((d - v).abs() <= v.abs() / 16.0 + 1e-6, "{d} vs {v}");
        }
    }

    #[test]
    fn per_token_activation_quantization_matches_e4m3_of_the_scaled_row() {
        let mut x = vec![448.0, -1.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0];
        quantize_rows_per_token(&mut x, 4);
        // Row 0: scale 1, so each value is its own e4m3 rounding.
        assert_eq!(&x[..4], &[448.0, -1.0, e4m3_to_f32(e4m3_from_f32(0.3)), 0.0]);
        assert_eq!(&x[4..], &[0.0; 4], "a zero row stays zero");
        let w = Fp8Matrix::new(1, 4, vec![0x38; 4], vec![0.5], 1, 4).expect("w");
        let mut out = [f32::NAN];
        linear_fp8(&[2.0, 2.0, 2.0, 2.0], &w, Some(&[1.0]), 1, ActivationScale::PerToken, &mut out).expect("ok");
        assert_eq!(out, [5.0]);
    }
}
