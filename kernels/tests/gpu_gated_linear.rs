//! The fused gated projection ([`GatedLinearCall`]: the skinny GEMM with SiLU·mul or
//! GELU-tanh·mul in its epilogue) against the unfused pair it replaces ([`LinearCall`] with
//! the same variant, then [`SiluMulCall`] / [`GeluTanhMulCall`]): bit for bit, on fresh random
//! inputs (the seed is printed), outputs poisoned (NaN) so an unwritten element fails, and
//! against the CPU reference (f64 product rounded to bf16, then `cpu::silu_mul` /
//! `cpu::gelu_tanh_mul`) within bf16 storage error. The same over FP8 weights
//! ([`Fp8GatedGemvCall`] against [`Fp8GemvCall`] then the activation kernel, bit for bit): per
//! channel, per tensor and block scales (row blocks that put a tile's gate and up rows, or its
//! rows g and g + 8, in different blocks), every variant, 1 to 64 rows (several CTAs a weight
//! tile past 16), random E4M3 codes over every non-NaN value.
//!
//! Needs a GPU: named `gpu_*`, excluded from CI by name, and FAILS (does not skip) when no
//! device can be opened.

mod common;

use baton_kernels::cpu::{self, Fp8Matrix};
use baton_kernels::cuda::{
    CudaDevice, CudaSlice, Fp8GatedGemvCall, Fp8GemvCall, Fp8Weights, GEMV_FP8_MAX_M, GEMV_FP8_VARIANTS,
    GEMV_KERNEL_MAX_M, GEMV_VARIANTS, GatedAct, GatedLinearCall, GeluTanhMulCall, LinearCall, LinearKernel,
    SiluMulCall, bf16,
};
use common::{check, device, down, poisoned, rand_vec, rng, up};
use rand::Rng;

/// `x · wᵀ` in f64, rounded to bf16 as the unfused product stores it.
fn gemm_bf16(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            let s = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
            out[i * n + j] = bf16::from_f64(s).to_f32();
        }
    }
    out
}

#[test]
fn gpu_gated_linear_equals_linear_then_activation() {
    let dev = device();
    let mut r = rng("gated_linear");
    // d not a multiple of the 8 columns of a CTA (257, 33, 7), k with a partial last batch
    // (4104, 136, 8), and the 8B shape's own (4096 → 14336) once at one and 16 rows.
    let shapes = [(4096usize, 1000usize), (4104, 257), (136, 33), (8, 7), (2048, 768)];
    let mut cases: Vec<(usize, usize, usize)> =
        shapes.iter().flat_map(|&(k, d)| [1usize, 3, 8, 9, GEMV_KERNEL_MAX_M].map(|m| (m, k, d))).collect();
    cases.extend([(1, 4096, 14336), (GEMV_KERNEL_MAX_M, 4096, 14336)]);
    for (m, k, d) in cases {
        let x = rand_vec(&mut r, m * k, 1.0);
        // Gate values around ±3 so SiLU and GELU see their curved parts.
        let w = rand_vec(&mut r, 2 * d * k, 3.0 / (k as f32).sqrt());
        let (xd, wd) = (up(&dev, &x), up(&dev, &w));
        let x = down(&dev, &xd, m * k);
        let w = down(&dev, &wd, 2 * d * k);
        let gate_up = gemm_bf16(&x, &w, m, k, 2 * d);
        let spare = 64;
        for act in [GatedAct::Silu, GatedAct::GeluTanh] {
            let mut want = vec![0.0f32; m * d];
            match act {
                GatedAct::Silu => cpu::silu_mul(&gate_up, &mut want, d).expect("cpu silu_mul"),
                GatedAct::GeluTanh => cpu::gelu_tanh_mul(&gate_up, &mut want, d).expect("cpu gelu_tanh_mul"),
            }
            for (vi, v) in GEMV_VARIANTS.iter().enumerate() {
                let what = format!("gated {act:?} {v:?} m={m} k={k} d={d}");
                let mut fused = poisoned(&dev, m * d + spare);
                let call = GatedLinearCall { x: &xd, m, k, w: &wd, d, act, out: &mut fused, variant: Some(vi) };
                call.launch(&dev).expect("gated_linear");
                let got = down(&dev, &fused, m * d + spare);
                assert!(got[m * d..].iter().all(|v| v.is_nan()), "{what}: wrote past m × d");

                let mut prod = poisoned(&dev, m * 2 * d);
                let kernel = LinearKernel::Gemv { variant: Some(vi) };
                LinearCall { x: &xd, m, k, w: &wd, n: 2 * d, out: &mut prod, kernel }.launch(&dev).expect("gemv");
                let mut unfused = poisoned(&dev, m * d);
                match act {
                    GatedAct::Silu => SiluMulCall { gate_up: &prod, rows: m, d, out: &mut unfused }.launch(&dev),
                    GatedAct::GeluTanh => {
                        GeluTanhMulCall { gate_up: &prod, rows: m, d, out: &mut unfused }.launch(&dev)
                    }
                }
                .expect("activation");
                let want_bits = down(&dev, &unfused, m * d);
                let differ = got[..m * d].iter().zip(&want_bits).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{what}: {differ} of {} outputs differ from the unfused pair", m * d);
                check(&what, &got[..m * d], &want);
            }
            // The default variant is the unfused product's default for 2d rows: same bits.
            let mut fused = poisoned(&dev, m * d);
            GatedLinearCall { x: &xd, m, k, w: &wd, d, act, out: &mut fused, variant: None }
                .launch(&dev)
                .expect("gated_linear default");
            let mut prod = poisoned(&dev, m * 2 * d);
            LinearCall { x: &xd, m, k, w: &wd, n: 2 * d, out: &mut prod, kernel: LinearKernel::GEMV }
                .launch(&dev)
                .expect("gemv default");
            let mut unfused = poisoned(&dev, m * d);
            match act {
                GatedAct::Silu => SiluMulCall { gate_up: &prod, rows: m, d, out: &mut unfused }.launch(&dev),
                GatedAct::GeluTanh => GeluTanhMulCall { gate_up: &prod, rows: m, d, out: &mut unfused }.launch(&dev),
            }
            .expect("activation");
            let (a, b) = (down(&dev, &fused, m * d), down(&dev, &unfused, m * d));
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "default variant {act:?} m={m} k={k} d={d} differs from the unfused default"
            );
        }
    }

    // Refusals: too many rows, k off a multiple of 8, short weights or output, a bad variant;
    // m = 0 is a no-op.
    let (k, d) = (4096usize, 64usize);
    let xd = up(&dev, &rand_vec(&mut r, (GEMV_KERNEL_MAX_M + 1) * k, 1.0));
    let wd = up(&dev, &rand_vec(&mut r, 2 * d * k, 0.05));
    let mut out = poisoned(&dev, (GEMV_KERNEL_MAX_M + 1) * d);
    let act = GatedAct::Silu;
    let call = |m: usize, k: usize, d: usize, variant: Option<usize>, out: &mut _| {
        GatedLinearCall { x: &xd, m, k, w: &wd, d, act, out, variant }.launch(&dev)
    };
    assert!(call(GEMV_KERNEL_MAX_M + 1, k, d, None, &mut out).is_err(), "m > GEMV_KERNEL_MAX_M accepted");
    assert!(call(1, 4092, d, None, &mut out).is_err(), "k % 8 != 0 accepted");
    assert!(call(1, k, d + 1, None, &mut out).is_err(), "weights shorter than 2d × k accepted");
    assert!(call(1, k, d, Some(GEMV_VARIANTS.len()), &mut out).is_err(), "bad variant accepted");
    let mut short = poisoned(&dev, d - 1);
    assert!(call(1, k, d, None, &mut short).is_err(), "short output accepted");
    call(0, k, d, None, &mut out).expect("m = 0 is a no-op");
    assert!(down(&dev, &out, d).iter().all(|v| v.is_nan()), "m = 0 wrote something");
}

/// The activation kernel over stored `[gate | up]` rows.
fn activation(dev: &CudaDevice, act: GatedAct, gate_up: &CudaSlice<bf16>, m: usize, d: usize) -> CudaSlice<bf16> {
    let mut out = poisoned(dev, m * d);
    match act {
        GatedAct::Silu => SiluMulCall { gate_up, rows: m, d, out: &mut out }.launch(dev),
        GatedAct::GeluTanh => GeluTanhMulCall { gate_up, rows: m, d, out: &mut out }.launch(dev),
    }
    .expect("activation");
    out
}

#[test]
fn gpu_fp8_gated_gemv_equals_fp8_gemv_then_activation() {
    let dev = device();
    let mut r = rng("fp8_gated_gemv");
    // (k, d, (row block, column block)): per channel, 128 × 128 blocks, 24-row blocks (a tile's
    // gate rows and up rows, and its rows g and g + 8, in different blocks), one scale for the
    // whole matrix; d not a multiple of a CTA's 8 columns; the 8B shape at 1 and 16 rows.
    let shapes = [
        (512usize, 1000usize, None),
        (1024, 257, Some((128, 128))),
        (256, 33, Some((24, 64))),
        (208, 40, Some((80, 208))),
        (4096, 14336, None),
    ];
    for (k, d, block) in shapes {
        let (rb, cb) = block.unwrap_or((1, k));
        let codes: Vec<u8> =
            (0..2 * d * k).map(|_| r.random::<u8>()).map(|c| if c & 0x7f == 0x7f { 0 } else { c }).collect();
        let scales: Vec<f32> =
            (0..(2 * d).div_ceil(rb) * k.div_ceil(cb)).map(|_| r.random_range(0.5f32..2.0) * 1e-3).collect();
        let w = Fp8Matrix::new(2 * d, k, codes, scales, rb, cb).expect("matrix");
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        let rows: &[usize] = if d == 14336 { &[1, 16] } else { &[1, 5, 8, 16, 17, 40, GEMV_FP8_MAX_M] };
        for &m in rows {
            let xd = up(&dev, &rand_vec(&mut r, m * k, 1.0));
            for act in [GatedAct::Silu, GatedAct::GeluTanh] {
                for vi in (0..GEMV_FP8_VARIANTS.len()).map(Some).chain([None]) {
                    let what = format!("FP8 gated {act:?} variant {vi:?} m={m} k={k} d={d} blocks {rb}×{cb}");
                    let mut gate_up = poisoned(&dev, m * 2 * d);
                    Fp8GemvCall { x: &xd, m, w: &dw, out: &mut gate_up, variant: vi }.launch(&dev).expect("gemv_fp8");
                    let want = down(&dev, &activation(&dev, act, &gate_up, m, d), m * d);
                    assert!(want.iter().all(|v| !v.is_nan()), "{what}: the unfused pair left NaN");
                    let spare = 64;
                    let mut fused = poisoned(&dev, m * d + spare);
                    Fp8GatedGemvCall { x: &xd, m, w: &dw, d, act, out: &mut fused, variant: vi }
                        .launch(&dev)
                        .expect("gated_gemv_fp8");
                    let got = down(&dev, &fused, m * d + spare);
                    assert!(got[m * d..].iter().all(|v| v.is_nan()), "{what}: wrote past m × d");
                    let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    assert_eq!(differ, 0, "{what}: {differ} of {} outputs differ from the unfused pair", m * d);
                }
            }
        }
        println!("FP8 gated k={k} d={d} blocks {rb}×{cb}: bit-identical to the unfused pair");
    }

    // Refusals: weights that are not 2d rows, a short output, a bad variant; nothing written.
    let (k, d) = (256usize, 32usize);
    let codes = vec![0x38u8; 2 * d * k];
    let w = Fp8Matrix::new(2 * d, k, codes, vec![1.0; 2 * d], 1, k).expect("matrix");
    let dw = Fp8Weights::upload(&dev, &w).expect("upload");
    let xd = up(&dev, &rand_vec(&mut r, k, 1.0));
    let mut out = poisoned(&dev, d);
    let call = |d: usize, variant: Option<usize>, out: &mut CudaSlice<bf16>| {
        Fp8GatedGemvCall { x: &xd, m: 1, w: &dw, d, act: GatedAct::Silu, out, variant }.launch(&dev)
    };
    let e = call(d + 1, None, &mut out).expect_err("2d + 2 rows for d + 1");
    assert!(format!("{e}").contains("intermediate size"), "{e}");
    assert!(call(d, Some(GEMV_FP8_VARIANTS.len()), &mut out).is_err(), "bad variant accepted");
    let mut short = poisoned(&dev, d - 1);
    assert!(call(d, None, &mut short).is_err(), "short output accepted");
    assert!(down(&dev, &out, d).iter().all(|v| v.is_nan()), "a refused call wrote");
}
