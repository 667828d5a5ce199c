//! The FP8 weight kernels against the CPU reference (`cpu::linear_fp8` with
//! `ActivationScale::None`, W8A16, on the bf16 inputs the kernel reads): the skinny W8A16 GEMM
//! (`Fp8GemvCall`, m = 1..16) and the dequantization to bf16 (`Fp8DequantCall`, checked
//! element for element against `Fp8Matrix::dequantize` rounded to bf16), for per-channel,
//! per-tensor and 128 × 128 block scales, at decode shapes and odd ones. Fresh random inputs
//! every run (the seed is printed); outputs poisoned with bf16 NaN before each launch.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use baton_kernels::cpu::{self, ActivationScale, Fp8Matrix};
use baton_kernels::cuda::{Fp8DequantCall, Fp8GemvCall, Fp8Weights, bf16, gemv_fp8_supports};
use common::{check, device, down, poisoned, rand_vec, rng, up};
use rand::Rng;
use rand::rngs::StdRng;

/// A random `n × k` FP8 matrix with `(row_block, col_block)` scales (`None`: per channel).
fn matrix(r: &mut StdRng, n: usize, k: usize, block: Option<(usize, usize)>) -> Fp8Matrix {
    let values = rand_vec(r, n * k, 0.05);
    let w = Fp8Matrix::quantize_per_channel(&values, n, k).expect("quantize");
    match block {
        None => w,
        Some((rb, cb)) => {
            let scales: Vec<f32> =
                (0..n.div_ceil(rb) * k.div_ceil(cb)).map(|_| r.random_range(0.5f32..2.0) * 1e-4).collect();
            Fp8Matrix::new(n, k, w.codes().to_vec(), scales, rb, cb).expect("block matrix")
        }
    }
}

#[test]
fn gpu_fp8_gemv_matches_the_w8a16_reference() {
    let dev = device();
    let mut r = rng("gpu_fp8_gemv_matches_the_w8a16_reference");
    for (n, k, block) in [
        (4096usize, 4096usize, None),
        (6144, 4096, Some((128, 128))),
        (1024, 14336, Some((128, 128))),
        (100, 96, Some((100, 96))), // per tensor, odd sizes
        (37, 64, Some((1, 48))),
    ] {
        let w = matrix(&mut r, n, k, block);
        let (_, cb) = w.block();
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        for m in [1usize, 3, 8, 9, 16] {
            assert!(gemv_fp8_supports(m, k, cb), "{m}×{k} cb {cb}");
            // bf16-exact inputs, as the kernel reads them.
            let x: Vec<f32> = rand_vec(&mut r, m * k, 1.0).iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
            let mut want = vec![0.0; m * n];
            cpu::linear_fp8(&x, &w, None, m, ActivationScale::None, &mut want).expect("reference");
            let mut out = poisoned(&dev, m * n);
            Fp8GemvCall { x: &up(&dev, &x), m, w: &dw, out: &mut out }.launch(&dev).expect("launch");
            check(&format!("gemv_fp8 m {m} n {n} k {k} {block:?}"), &down(&dev, &out, m * n), &want);
        }
    }
}

#[test]
fn gpu_fp8_dequant_matches_the_reference_exactly() {
    let dev = device();
    let mut r = rng("gpu_fp8_dequant_matches_the_reference_exactly");
    for (n, k, block) in [(512usize, 384usize, Some((128, 128))), (77, 200, None), (64, 64, Some((64, 64)))] {
        let w = matrix(&mut r, n, k, block);
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        let mut out = poisoned(&dev, n * k);
        Fp8DequantCall { w: &dw, out: &mut out }.launch(&dev).expect("launch");
        let got = down(&dev, &out, n * k);
        let want: Vec<f32> = w.dequantize().iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
        assert_eq!(got, want, "dequant {n}×{k} {block:?}");
    }
}
