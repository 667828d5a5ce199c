//! The residual product that stores the next RMSNorm's output itself ([`NormOut`]: the grid's
//! last CTA normalizes the rows), over bf16 weights ([`ResidualLinearCall`] with `norm_out`) and
//! FP8 weights ([`Fp8ResidualNormGemvCall`]), against the two launches it replaces with the same
//! skinny-GEMM variant: the plain product ([`LinearCall`] / [`Fp8GemvCall`]) then
//! [`AddRmsNormCall`]. On fresh random inputs (the seed is printed), for every compiled variant,
//! per-channel and 128 × 128 block FP8 scales, rows 1..=16:
//! - the residual stream bit for bit (the same rounding of the product, the same f32 add);
//! - the norm's output within one bf16 step of the norm kernel's, element by element, and in at
//!   most a tenth of the elements (`1 / rms` is summed in another order);
//! - the norm's output against a host f64 RMSNorm of the downloaded residual (the bf16 check);
//! - NaN-poisoned outputs past their end, and stats poisoned, so a stray or missing write fails;
//! - one counter for every launch of the test, checked back at 0 after each: a launch that
//!   left it elsewhere would keep the next launch's last CTA from knowing it is last, and its
//!   output would stay poisoned;
//! - the refusals: more than 16 rows, a width off a multiple of 8, a short output.
//!
//! Needs a GPU: named `gpu_*`, excluded from CI by name, and FAILS (does not skip) when no
//! device can be opened.

mod common;

use baton_kernels::cpu::Fp8Matrix;
use baton_kernels::cuda::{
    AddRmsNormCall, CudaDevice, CudaSlice, Fp8GemvCall, Fp8ResidualNormGemvCall, Fp8Weights, GEMV_FP8_VARIANTS,
    GEMV_KERNEL_MAX_M, GEMV_VARIANTS, LinearCall, LinearKernel, NormOut, ResidualLinearCall, bf16, norm_stat_parts,
};
use common::{check, device, down, poisoned, rand_vec, rng, up};
use rand::Rng;
use rand::rngs::StdRng;

const EPS: f32 = 1e-5;

/// Poisoned values past each output's end.
const SPARE: usize = 64;

/// The weights of one case.
enum Weights {
    Bf16(CudaSlice<bf16>),
    Fp8(Fp8Weights),
}

/// One case on the device: `x` (m × k), the projection (width × k), the residual (m × width) and
/// the norm weight.
struct Case<'a> {
    m: usize,
    k: usize,
    width: usize,
    x: CudaSlice<bf16>,
    w: &'a Weights,
    residual: Vec<f32>,
    norm: CudaSlice<bf16>,
}

impl Case<'_> {
    /// The product then the add + norm kernel: (residual after, hidden).
    fn unfused(&self, dev: &CudaDevice, variant: Option<usize>) -> (Vec<f32>, Vec<f32>) {
        let (m, k, width) = (self.m, self.k, self.width);
        let mut proj = poisoned(dev, m * width);
        match self.w {
            Weights::Bf16(w) => {
                let kernel = LinearKernel::Gemv { variant };
                LinearCall { x: &self.x, m, k, w, n: width, out: &mut proj, kernel }.launch(dev)
            }
            Weights::Fp8(w) => Fp8GemvCall { x: &self.x, m, w, out: &mut proj, variant }.launch(dev),
        }
        .expect("product");
        let mut res = dev.upload(&self.residual).expect("upload residual");
        let mut hidden = poisoned(dev, m * width);
        let call = AddRmsNormCall {
            residual: &mut res,
            x: &proj,
            weight: &self.norm,
            rows: m,
            dim: width,
            eps: EPS,
            out: &mut hidden,
        };
        call.launch(dev).expect("add_rms_norm");
        (dev.download(&res, m * width).expect("residual"), down(dev, &hidden, m * width))
    }

    /// The one launch: (residual after, hidden with SPARE poisoned values past its end).
    fn fused(&self, dev: &CudaDevice, variant: Option<usize>, counter: &mut CudaSlice<u32>) -> (Vec<f32>, Vec<f32>) {
        let (m, k, width) = (self.m, self.k, self.width);
        let mut res = dev.upload(&self.residual).expect("upload residual");
        let mut stats = dev.upload(&vec![f32::NAN; m * norm_stat_parts(width)]).expect("stats");
        let mut hidden = poisoned(dev, m * width + SPARE);
        let norm_out = NormOut { norm: &self.norm, eps: EPS, hidden: &mut hidden, counter };
        let (x, residual, stats) = (&self.x, &mut res, &mut stats);
        match self.w {
            Weights::Bf16(w) => {
                let norm_out = Some(norm_out);
                ResidualLinearCall { x, m, k, w, n: width, residual, stats, norm_out, variant }.launch(dev)
            }
            Weights::Fp8(w) => Fp8ResidualNormGemvCall { x, m, w, residual, stats, norm_out, variant }.launch(dev),
        }
        .expect("fused residual product");
        (dev.download(&res, m * width).expect("residual"), down(dev, &hidden, m * width + SPARE))
    }
}

/// One bf16 step (2^-7 relative, a little more than the rounding's 2^-8) at `v`'s magnitude.
fn bf16_step(v: f32) -> f32 {
    v.abs().max(1e-6) / 128.0
}

/// A random `n × k` FP8 matrix over every finite code, `(row_block, col_block)` scales.
fn fp8_matrix(r: &mut StdRng, n: usize, k: usize, (rb, cb): (usize, usize)) -> Fp8Matrix {
    let codes: Vec<u8> = (0..n * k)
        .map(|_| {
            loop {
                let c: u8 = r.random();
                if c & 0x7f != 0x7f {
                    break c;
                }
            }
        })
        .collect();
    let scales: Vec<f32> = (0..n.div_ceil(rb) * k.div_ceil(cb)).map(|_| r.random_range(0.5f32..2.0) * 1e-3).collect();
    Fp8Matrix::new(n, k, codes, scales, rb, cb).expect("matrix")
}

/// The host's RMSNorm of `res`'s rows (f64), for the bf16 check.
fn host_norm(res: &[f32], norm: &[f32], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(res.len());
    for row in res.chunks_exact(width) {
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / width as f64;
        let inv = 1.0 / (ms + EPS as f64).sqrt();
        out.extend(row.iter().zip(norm).map(|(v, w)| (*v as f64 * inv * *w as f64) as f32));
    }
    out
}

fn compare(what: &str, case: &Case<'_>, fused: (Vec<f32>, Vec<f32>), unfused: (Vec<f32>, Vec<f32>), norm: &[f32]) {
    let (m, width) = (case.m, case.width);
    let ((res, hidden), (want_res, want_hidden)) = (fused, unfused);
    let res_differ = res.iter().zip(&want_res).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(res_differ, 0, "{what}: {res_differ} residual values differ from the unfused add");
    assert!(hidden[m * width..].iter().all(|v| v.is_nan()), "{what}: wrote past m × width");
    let hidden = &hidden[..m * width];
    assert!(hidden.iter().all(|v| v.is_finite()), "{what}: unwritten (the counter?) or non-finite norm output");
    let mut differ = 0;
    for (i, (a, b)) in hidden.iter().zip(&want_hidden).enumerate() {
        if a.to_bits() != b.to_bits() {
            differ += 1;
            assert!(
                (a - b).abs() <= bf16_step(a.abs().max(b.abs())),
                "{what}: hidden[{i}] {a} vs the norm kernel's {b}"
            );
        }
    }
    assert!(differ * 10 <= hidden.len().max(10), "{what}: {differ} of {} norm outputs differ", hidden.len());
    check(what, hidden, &host_norm(&want_res, norm, width));
}

#[test]
fn gpu_residual_product_with_the_norm_output_equals_the_product_then_the_norm() {
    let dev = device();
    let mut r = rng("norm_out");
    let mut counter = dev.upload(&[0u32]).expect("counter");
    // (k, width): Llama-3.1-8B's o_proj and down, a width that is not a multiple of a CTA's 16
    // columns (264) with a partial last k batch (192 of FP8's 64-code steps; 136 for bf16), tiny.
    let shapes = [(4096usize, 4096usize), (14336, 4096), (192, 264), (64, 8)];
    // FP8 scale layouts: per channel, 128 × 128 blocks (when k allows).
    for (k, width) in shapes {
        // The weights once a shape: bf16 (k = 136 for the partial batch), FP8 per channel and in
        // 128 × 128 blocks where k and the width allow.
        let bf16_k = if k == 192 { 136 } else { k };
        let mut weights = vec![(
            "bf16".to_string(),
            bf16_k,
            Weights::Bf16(up(&dev, &rand_vec(&mut r, width * bf16_k, 1.0 / (bf16_k as f32).sqrt()))),
        )];
        let mut blocks = vec![(1, k)];
        if k.is_multiple_of(128) && width >= 128 {
            blocks.push((128, 128));
        }
        for block in blocks {
            let w = Fp8Weights::upload(&dev, &fp8_matrix(&mut r, width, k, block)).expect("upload");
            weights.push((format!("fp8 {block:?}"), k, Weights::Fp8(w)));
        }
        for m in [1usize, 3, 8, 9, GEMV_KERNEL_MAX_M] {
            let residual = rand_vec(&mut r, m * width, 2.0);
            let norm = rand_vec(&mut r, width, 1.5);
            for (kind, k, w) in &weights {
                let case = Case {
                    m,
                    k: *k,
                    width,
                    x: up(&dev, &rand_vec(&mut r, m * k, 1.0)),
                    w,
                    residual: residual.clone(),
                    norm: up(&dev, &norm),
                };
                let n_variants = match w {
                    Weights::Bf16(_) => GEMV_VARIANTS.len(),
                    Weights::Fp8(_) => GEMV_FP8_VARIANTS.len(),
                };
                for variant in (0..n_variants).map(Some).chain([None]) {
                    let what = format!("{kind} k={k} width={width} m={m} variant {variant:?}");
                    let fused = case.fused(&dev, variant, &mut counter);
                    let left = dev.download(&counter, 1).expect("counter")[0];
                    assert_eq!(left, 0, "{what}: the counter was left at {left}");
                    compare(&what, &case, fused, case.unfused(&dev, variant), &norm);
                }
            }
        }
    }

    // Refusals, made before anything is enqueued.
    let (k, width) = (256usize, 64usize);
    let m_max = GEMV_KERNEL_MAX_M + 1;
    let x = up(&dev, &rand_vec(&mut r, m_max * k, 1.0));
    let norm = up(&dev, &rand_vec(&mut r, width + 8, 1.0));
    let w = up(&dev, &rand_vec(&mut r, (width + 4) * k, 0.05));
    let fp8 = Fp8Weights::upload(&dev, &fp8_matrix(&mut r, width, k, (1, k))).expect("upload");
    let fp8_odd = Fp8Weights::upload(&dev, &fp8_matrix(&mut r, width + 4, k, (1, k))).expect("upload");
    let mut res = dev.upload(&vec![1.0f32; m_max * (width + 4)]).expect("residual");
    let mut stats = dev.upload(&vec![0.0f32; m_max * norm_stat_parts(width + 4)]).expect("stats");
    let mut hidden = poisoned(&dev, m_max * (width + 4));
    let mut short = poisoned(&dev, width - 1);
    for (what, m, n, which) in [
        ("17 rows", m_max, width, false),
        ("a width off a multiple of 8", 1, width + 4, false),
        ("a short hidden", 1, width, true),
    ] {
        let hidden = if which { &mut short } else { &mut hidden };
        let norm_out = Some(NormOut { norm: &norm, eps: EPS, hidden, counter: &mut counter });
        let call = ResidualLinearCall {
            x: &x,
            m,
            k,
            w: &w,
            n,
            residual: &mut res,
            stats: &mut stats,
            norm_out,
            variant: None,
        };
        assert!(call.launch(&dev).is_err(), "bf16: {what} accepted");
    }
    for (what, m, wm) in [("17 rows", m_max, &fp8), ("a width off a multiple of 8", 1, &fp8_odd)] {
        let norm_out = NormOut { norm: &norm, eps: EPS, hidden: &mut hidden, counter: &mut counter };
        let call =
            Fp8ResidualNormGemvCall { x: &x, m, w: wm, residual: &mut res, stats: &mut stats, norm_out, variant: None };
        assert!(call.launch(&dev).is_err(), "fp8: {what} accepted");
    }
    assert!(down(&dev, &hidden, m_max * (width + 4)).iter().all(|v| v.is_nan()), "a refused launch wrote something");
    assert_eq!(dev.download(&counter, 1).expect("counter")[0], 0, "a refused launch moved the counter");
}
