//! The FP8 weight kernels against the CPU reference (`cpu::linear_fp8` with
//! `ActivationScale::None`, W8A16, on the bf16 inputs the kernel reads): the skinny tensor-core
//! GEMM (`Fp8GemvCall`, every m in 1..=16, more rows of x in several CTAs per weight tile up to
//! 64, every compiled variant), its E4M3 → bf16 conversion code by code (exact: one-hot rows of
//! x pick single weights), and the dequantization to bf16 (`Fp8DequantCall`, checked element
//! for element against `Fp8Matrix::dequantize` rounded to bf16), for per-channel, per-tensor,
//! 128 × 128 and odd block scales, at the Llama-3.1-8B projection shapes scaled down and at odd
//! ones. The W8A8 path for more rows (`Fp8W8A8Call`: per-token activation quantization, checked
//! code for code against `cpu::quantize_rows_per_token`'s rule, then cuBLASLt's FP8 GEMM with
//! outer-vector scales) against `cpu::linear_fp8` with `ActivationScale::PerToken`; the add +
//! norm + quantization kernel (`AddRmsNormQuantCall`) bit for bit against `AddRmsNormCall` then
//! `QuantizeRowsCall`, and `Fp8W8A8QuantizedCall` on its codes bit for bit against
//! `Fp8W8A8Call` on the stored rows. Weights are random E4M3 codes over every non-NaN value (subnormals and zeros
//! included). Fresh random inputs every run (the seed is printed); outputs poisoned with bf16
//! NaN before each launch.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened.

mod common;

use baton_kernels::cpu::fp8::{e4m3_from_f32, e4m3_to_f32};
use baton_kernels::cpu::{self, ActivationScale, Fp8Matrix};
use baton_kernels::cuda::{
    AddRmsNormCall, AddRmsNormQuantCall, CudaError, Fp8DequantCall, Fp8GemvCall, Fp8Scaling, Fp8W8A8Call,
    Fp8W8A8QuantizedCall, Fp8Weights, GEMV_FP8_MAX_M, GEMV_FP8_VARIANTS, NORM_QUANT_MAX_DIM, QuantRows,
    QuantizeRowsCall, SiluMulCall, SiluMulQuantCall, bf16, gemv_fp8_scaling, gemv_fp8_supports, w8a8_supports,
};
use common::{check, device, down, poisoned, rand_vec, rng, up};
use rand::Rng;
use rand::rngs::StdRng;

/// A random E4M3 code that is not NaN (0x7F, 0xFF).
fn code(r: &mut StdRng) -> u8 {
    loop {
        let c: u8 = r.random();
        if c & 0x7f != 0x7f {
            return c;
        }
    }
}

/// A random `n × k` FP8 matrix with `(row_block, col_block)` scales (`None`: per channel).
fn matrix(r: &mut StdRng, n: usize, k: usize, block: Option<(usize, usize)>) -> Fp8Matrix {
    let (rb, cb) = block.unwrap_or((1, k));
    let codes: Vec<u8> = (0..n * k).map(|_| code(r)).collect();
    let scales: Vec<f32> = (0..n.div_ceil(rb) * k.div_ceil(cb)).map(|_| r.random_range(0.5f32..2.0) * 1e-3).collect();
    Fp8Matrix::new(n, k, codes, scales, rb, cb).expect("matrix")
}

/// Rows of x the product tests run: every m the one-CTA tiles take, then several CTAs a tile.
fn rows_to_test() -> Vec<usize> {
    let mut ms: Vec<usize> = (1..=16).collect();
    ms.extend([17, 24, 33, GEMV_FP8_MAX_M]);
    ms
}

#[test]
fn gpu_fp8_gemv_matches_the_w8a16_reference() {
    let dev = device();
    let mut r = rng("gpu_fp8_gemv_matches_the_w8a16_reference");
    for (what, n, k, block) in [
        // The Llama-3.1-8B projections scaled down by 8 (n and k), per channel and 128 × 128.
        ("qkv/8", 768usize, 512usize, None),
        ("o/8", 512, 512, Some((128, 128))),
        ("gate_up/8", 3584, 512, None),
        ("down/8", 512, 1792, Some((128, 128))),
        // Full-length rows: many batches per warp.
        ("down k", 48, 14336, Some((128, 128))),
        ("o k", 64, 4096, None),
        // Per tensor at odd sizes (n not a multiple of 16, k not of 64).
        ("tensor", 100, 400, Some((100, 400))),
        // 128 × 128 blocks with a partial last block (400 = 3 × 128 + 16) and a partial row tile.
        ("block partial", 37, 400, Some((128, 128))),
        // Row blocks that split a 16-row tile (rows g and g + 8 in different blocks).
        ("rb 24 blocked", 72, 256, Some((24, 64))),
        ("rb 24 row", 40, 208, Some((24, 208))),
        // A column block wider than k (one block over the row).
        ("cb > k", 33, 80, Some((1, 4096))),
    ] {
        let w = matrix(&mut r, n, k, block);
        let (_, cb) = w.block();
        let scaling = gemv_fp8_scaling(k, cb).expect("a skinny scale layout");
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        for m in rows_to_test() {
            assert!(gemv_fp8_supports(m, k, cb), "{m}×{k} cb {cb}");
            let x = rand_vec(&mut r, m * k, 1.0);
            let mut want = vec![0.0; m * n];
            cpu::linear_fp8(&x, &w, None, m, ActivationScale::None, &mut want).expect("reference");
            let dx = up(&dev, &x);
            for (vi, v) in GEMV_FP8_VARIANTS.iter().enumerate() {
                let mut out = poisoned(&dev, m * n);
                Fp8GemvCall { x: &dx, m, w: &dw, out: &mut out, variant: Some(vi) }.launch(&dev).expect("launch");
                let label =
                    format!("gemv_fp8 {what} m {m} n {n} k {k} {block:?} {scaling:?} w{}_u{}", v.warps, v.unroll);
                check(&label, &down(&dev, &out, m * n), &want);
            }
        }
    }
}

#[test]
fn gpu_fp8_gemv_converts_every_code_exactly() {
    // One-hot rows of x pick single weights: out[i][row] = e4m3(code[row][col_i]) · scale(row),
    // exact in bf16 with power-of-two scales. The picked columns hold every non-NaN code several
    // times over (16 columns × 64 rows per round), and sit in different chunk positions per
    // round; both scale layouts and every variant and tile size run.
    let dev = device();
    let mut r = rng("gpu_fp8_gemv_converts_every_code_exactly");
    let (n, k) = (64usize, 1024usize);
    for (round, (rb, cb)) in [(1usize, k), (16, 128), (64, 256), (1, 64)].into_iter().enumerate() {
        let mut codes: Vec<u8> = (0..n * k).map(|_| code(&mut r)).collect();
        let mut cols: Vec<usize> = Vec::new();
        while cols.len() < 16 {
            let c = r.random_range(0..k);
            if !cols.contains(&c) {
                cols.push(c);
            }
        }
        for row in 0..n {
            for (i, &c) in cols.iter().enumerate() {
                let v = ((row * 16 + i + round * 5) % 256) as u8;
                codes[row * k + c] = if v & 0x7f == 0x7f { 0 } else { v };
            }
        }
        let scales: Vec<f32> = (0..n.div_ceil(rb) * k.div_ceil(cb)).map(|_| 2f32.powi(r.random_range(-3..3))).collect();
        let w = Fp8Matrix::new(n, k, codes, scales, rb, cb).expect("matrix");
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        for m in [8usize, 16] {
            let mut x = vec![0.0f32; m * k];
            for i in 0..m {
                x[i * k + cols[i]] = 1.0;
            }
            let want: Vec<f32> = (0..m)
                .flat_map(|i| (0..n).map(move |row| (i, row)))
                .map(|(i, row)| e4m3_to_f32(w.codes()[row * k + cols[i]]) * w.scale_at(row, cols[i]))
                .collect();
            let dx = up(&dev, &x);
            for vi in 0..GEMV_FP8_VARIANTS.len() {
                let mut out = poisoned(&dev, m * n);
                Fp8GemvCall { x: &dx, m, w: &dw, out: &mut out, variant: Some(vi) }.launch(&dev).expect("launch");
                let got = down(&dev, &out, m * n);
                for (j, (g, e)) in got.iter().zip(&want).enumerate() {
                    let (i, row) = (j / n, j % n);
                    let c = w.codes()[row * k + cols[i]];
                    assert_eq!(g, e, "code {c:#04x} (row {row}, x row {i}), m {m}, blocks {rb}×{cb}, variant {vi}");
                }
            }
        }
        assert_eq!(gemv_fp8_scaling(k, cb), Some(if cb >= k { Fp8Scaling::Row } else { Fp8Scaling::Block }));
    }
}

#[test]
fn gpu_fp8_dequant_matches_the_reference_exactly() {
    let dev = device();
    let mut r = rng("gpu_fp8_dequant_matches_the_reference_exactly");
    for (n, k, block) in [
        (512usize, 384usize, Some((128, 128))),
        (77, 200, None),
        (64, 64, Some((64, 64))),
        (40, 208, Some((24, 48))),
        (9, 7, Some((2, 3))),
    ] {
        let w = matrix(&mut r, n, k, block);
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        let mut out = poisoned(&dev, n * k);
        Fp8DequantCall { w: &dw, out: &mut out }.launch(&dev).expect("launch");
        let got = down(&dev, &out, n * k);
        let want: Vec<f32> = w.dequantize().iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
        assert_eq!(got, want, "dequant {n}×{k} {block:?}");
    }
}

#[test]
fn gpu_fp8_weight_quantization_of_f32_rows_is_quantize_per_channel() {
    // The per-channel rule of random weights quantized on the device: f32 rows (not rounded to
    // bf16), placed at row0 of a larger matrix whose other rows stay as they were.
    let dev = device();
    let mut r = rng("gpu_fp8_weight_quantization_of_f32_rows_is_quantize_per_channel");
    for (m, k, amp, row0) in [(7usize, 4096usize, 0.02f32, 3usize), (130, 1000, 3.0, 0), (3, 24, 900.0, 1)] {
        let mut x: Vec<f32> = (0..m * k).map(|_| r.random_range(-amp..amp)).collect();
        // A row of zeros (scale 1), and a row with one value far past the rest.
        x[..k].iter_mut().for_each(|v| *v = 0.0);
        x[k + 1] = 1e4;
        let (total, poison) = (row0 + m + 2, 0x7fu8);
        let mut codes = dev.upload(&vec![poison; total * k]).expect("poisoned codes");
        let mut scales = dev.upload(&vec![f32::NAN; total]).expect("poisoned scales");
        let xd = dev.upload(&x).expect("x");
        QuantizeRowsCall { x: QuantRows::F32(&xd), m, k, codes: &mut codes, scales: &mut scales, row0 }
            .launch(&dev)
            .expect("launch");
        let (got_codes, got_scales) =
            (dev.download(&codes, total * k).expect("codes"), dev.download(&scales, total).expect("s"));
        let want = Fp8Matrix::quantize_per_channel(&x, m, k).expect("reference");
        let rows = row0..row0 + m;
        assert_eq!(&got_codes[rows.start * k..rows.end * k], want.codes(), "codes ({m}×{k} at row {row0})");
        assert_eq!(
            got_scales[rows.clone()].iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            want.scales().iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
            "scales ({m}×{k} at row {row0})"
        );
        assert!(got_codes[..rows.start * k].iter().chain(&got_codes[rows.end * k..]).all(|&c| c == poison));
        assert!(got_scales[..rows.start].iter().chain(&got_scales[rows.end..]).all(|s| s.is_nan()));
    }
}

#[test]
fn gpu_fp8_activation_quantization_matches_the_per_token_rule() {
    let dev = device();
    let mut r = rng("gpu_fp8_activation_quantization_matches_the_per_token_rule");
    for (m, k, amp) in [(5usize, 4096usize, 3.0f32), (130, 1000, 0.02), (3, 24, 900.0), (2, 14336, 1.0)] {
        let mut x = rand_vec(&mut r, m * k, amp);
        // A row of zeros (scale 1) and a row with one value past 448 · a small scale.
        x[..k].iter_mut().for_each(|v| *v = 0.0);
        if m > 2 {
            x[k + 1] = bf16::from_f32(1e4).to_f32();
        }
        let mut codes = dev.upload(&vec![0x7fu8; m * k]).expect("poisoned codes");
        let mut scales = dev.upload(&vec![f32::NAN; m]).expect("poisoned scales");
        QuantizeRowsCall { x: QuantRows::Bf16(&up(&dev, &x)), m, k, codes: &mut codes, scales: &mut scales, row0: 0 }
            .launch(&dev)
            .expect("launch");
        let (got_codes, got_scales) =
            (dev.download(&codes, m * k).expect("codes"), dev.download(&scales, m).expect("s"));
        for (row, xr) in x.chunks(k).enumerate() {
            let amax = xr.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let s = if amax > 0.0 && amax.is_finite() { amax / 448.0 } else { 1.0 };
            assert_eq!(got_scales[row].to_bits(), s.to_bits(), "scale of row {row} ({m}×{k})");
            for (c, v) in xr.iter().enumerate() {
                assert_eq!(got_codes[row * k + c], e4m3_from_f32(v / s), "code ({row}, {c}) of {v} / {s} ({m}×{k})");
            }
        }
    }
}

#[test]
fn gpu_fp8_w8a8_matches_the_per_token_reference() {
    let dev = device();
    let mut r = rng("gpu_fp8_w8a8_matches_the_per_token_reference");
    for (what, n, k, block) in [
        ("qkv/8 per channel", 768usize, 512usize, None),
        ("down/8 per channel", 512, 1792, None),
        ("per tensor", 1024, 4096, Some((1024, 4096))),
        ("row blocks of 24", 48, 208, Some((24, 208))),
    ] {
        let w = matrix(&mut r, n, k, block);
        let dw = Fp8Weights::upload(&dev, &w).expect("upload");
        assert!(w8a8_supports(&dev, &dw), "{what}: W8A8 takes row-constant scales");
        // With cuBLASLt's fast FP8 accumulation and without: both within the reference's tolerance.
        for (m, fast) in [GEMV_FP8_MAX_M + 1, 128, 300].into_iter().flat_map(|m| [(m, false), (m, true)]) {
            dev.set_lt_fp8_fast_accum(fast).expect("fast accumulation switch");
            let x = rand_vec(&mut r, m * k, 1.0);
            let mut want = vec![0.0; m * n];
            cpu::linear_fp8(&x, &w, None, m, ActivationScale::PerToken, &mut want).expect("reference");
            let mut xq = dev.alloc::<u8>(m * k).expect("codes");
            let mut xs = dev.alloc::<f32>(m).expect("scales");
            let mut out = poisoned(&dev, m * n);
            Fp8W8A8Call { x: &up(&dev, &x), m, w: &dw, xq: &mut xq, xs: &mut xs, out: &mut out }
                .launch(&dev)
                .unwrap_or_else(|e| panic!("{what}: W8A8 launch ({m}×{k} · {n}×{k}): {e}"));
            check(&format!("w8a8 {what} m {m} n {n} k {k} fast accumulation {fast}"), &down(&dev, &out, m * n), &want);
        }
    }
    dev.set_lt_fp8_fast_accum(false).expect("fast accumulation switch");
    // 128 × 128 blocks are not row-constant: refused before anything runs.
    let w = matrix(&mut r, 256, 512, Some((128, 128)));
    let dw = Fp8Weights::upload(&dev, &w).expect("upload");
    assert!(!w8a8_supports(&dev, &dw));
    let (mut xq, mut xs, mut out) =
        (dev.alloc::<u8>(512).expect("c"), dev.alloc::<f32>(1).expect("s"), poisoned(&dev, 256));
    let x = up(&dev, &rand_vec(&mut r, 512, 1.0));
    let e = Fp8W8A8Call { x: &x, m: 1, w: &dw, xq: &mut xq, xs: &mut xs, out: &mut out }.launch(&dev);
    assert!(matches!(e, Err(CudaError::Shape { .. })), "{e:?}");
}

/// The W8A8 input made by the norm kernel (`AddRmsNormQuantCall`: the residual add, the norm,
/// and the normalized rows quantized per token without storing them) against the two launches
/// it replaces (`AddRmsNormCall`, then `QuantizeRowsCall` on its bf16 rows): residual, codes and
/// scales bit for bit, at widths from 16 to 8,192 (one to many values a thread, a partial last
/// chunk), a zero row (scale 1) and rows of large values; then the GEMM on those codes
/// (`Fp8W8A8QuantizedCall`) against `Fp8W8A8Call` on the stored rows, bit for bit. Refusals: a
/// width off a multiple of 4 or past the registers, short codes.
#[test]
fn gpu_fp8_norm_quantization_is_the_norm_then_the_quantization() {
    let dev = device();
    let mut r = rng("gpu_fp8_norm_quantization_is_the_norm_then_the_quantization");
    for (rows, dim) in [(37usize, 4096usize), (19, 8192), (5, 16), (3, 1000), (64, 2048)] {
        let mut res = rand_vec(&mut r, rows * dim, 3.0);
        // Row 1: the residual and x cancel to zero (a zero normalized row: scale 1).
        let x = {
            let mut x = rand_vec(&mut r, rows * dim, 2.0);
            if rows > 2 {
                for j in 0..dim {
                    x[dim + j] = 0.0;
                    res[dim + j] = 0.0;
                }
                // Row 2: large values (the norm makes them ordinary; the weights scale them).
                for v in &mut res[2 * dim..3 * dim] {
                    *v *= 1e4;
                }
            }
            x
        };
        let w = rand_vec(&mut r, dim, 40.0);
        let (xd, wd) = (up(&dev, &x), up(&dev, &w));
        let eps = 1e-5;
        // The two launches.
        let mut res_a = dev.upload(&res).expect("residual");
        let mut hidden = poisoned(&dev, rows * dim);
        AddRmsNormCall { residual: &mut res_a, x: &xd, weight: &wd, rows, dim, eps, out: &mut hidden }
            .launch(&dev)
            .expect("add_rms_norm");
        let mut codes_a = dev.upload(&vec![0x7fu8; rows * dim]).expect("codes");
        let mut scales_a = dev.upload(&vec![f32::NAN; rows]).expect("scales");
        QuantizeRowsCall {
            x: QuantRows::Bf16(&hidden),
            m: rows,
            k: dim,
            codes: &mut codes_a,
            scales: &mut scales_a,
            row0: 0,
        }
        .launch(&dev)
        .expect("quantize");
        // The fused one.
        let mut res_b = dev.upload(&res).expect("residual");
        let mut codes_b = dev.upload(&vec![0x7fu8; rows * dim + 64]).expect("codes");
        let mut scales_b = dev.upload(&vec![f32::NAN; rows + 4]).expect("scales");
        let call = AddRmsNormQuantCall {
            residual: &mut res_b,
            x: &xd,
            weight: &wd,
            rows,
            dim,
            eps,
            codes: &mut codes_b,
            scales: &mut scales_b,
        };
        call.launch(&dev).expect("add_rms_norm_quant");
        let what = format!("rows {rows} dim {dim}");
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let (ra, rb) = (dev.download(&res_a, rows * dim).expect("dl"), dev.download(&res_b, rows * dim).expect("dl"));
        assert_eq!(bits(ra), bits(rb), "{what}: residual differs");
        let (ca, cb) =
            (dev.download(&codes_a, rows * dim).expect("dl"), dev.download(&codes_b, rows * dim + 64).expect("dl"));
        assert_eq!(ca[..], cb[..rows * dim], "{what}: codes differ");
        assert!(cb[rows * dim..].iter().all(|&c| c == 0x7f), "{what}: codes written past the rows");
        let (sa, sb) = (dev.download(&scales_a, rows).expect("dl"), dev.download(&scales_b, rows + 4).expect("dl"));
        assert_eq!(bits(sa.clone()), bits(sb[..rows].to_vec()), "{what}: scales differ");
        assert!(sb[rows..].iter().all(|v| v.is_nan()), "{what}: scales written past the rows");
        if rows > 2 {
            assert_eq!(sa[1], 1.0, "{what}: a zero row's scale is 1");
        }
        // The GEMM on the fused codes against Fp8W8A8Call on the stored rows.
        let n = 48;
        let wm = matrix(&mut r, n, dim, None);
        let dw = Fp8Weights::upload(&dev, &wm).expect("upload");
        if rows >= 17 && w8a8_supports(&dev, &dw) {
            let (mut xq, mut xs) = (dev.alloc::<u8>(rows * dim).expect("xq"), dev.alloc::<f32>(rows).expect("xs"));
            let mut want = poisoned(&dev, rows * n);
            Fp8W8A8Call { x: &hidden, m: rows, w: &dw, xq: &mut xq, xs: &mut xs, out: &mut want }
                .launch(&dev)
                .expect("w8a8");
            let mut got = poisoned(&dev, rows * n);
            Fp8W8A8QuantizedCall { xq: &codes_b, xs: &scales_b, m: rows, w: &dw, out: &mut got }
                .launch(&dev)
                .expect("w8a8 quantized");
            let (g, w) = (down(&dev, &got, rows * n), down(&dev, &want, rows * n));
            assert!(g.iter().all(|v| v.is_finite()), "{what}: unwritten GEMM output");
            assert_eq!(bits(g), bits(w), "{what}: the GEMM on the fused codes differs");
        }
    }
    // Refusals.
    let (rows, dim) = (2usize, 4098usize);
    let mut res = dev.upload(&vec![0f32; rows * dim]).expect("res");
    let xd = up(&dev, &vec![0.0; rows * dim]);
    let wd = up(&dev, &vec![1.0; dim]);
    let mut codes = dev.upload(&vec![0u8; rows * dim]).expect("codes");
    let mut scales = dev.upload(&vec![0f32; rows]).expect("scales");
    let mut call = |dim: usize, codes_len: usize| {
        let mut short = dev.upload(&vec![0u8; codes_len]).expect("codes");
        let c = if codes_len == 0 { &mut codes } else { &mut short };
        AddRmsNormQuantCall {
            residual: &mut res,
            x: &xd,
            weight: &wd,
            rows: 1,
            dim,
            eps: 1e-5,
            codes: c,
            scales: &mut scales,
        }
        .launch(&dev)
    };
    assert!(call(dim, 0).is_err(), "a width off a multiple of 4 accepted");
    assert!(call(NORM_QUANT_MAX_DIM + 4, 0).is_err(), "a width past the registers accepted");
    assert!(call(4096, 100).is_err(), "short codes accepted");
}

/// SiLU·mul with its quantization (`SiluMulQuantCall`) writes the act `SiluMulCall` writes and
/// the codes and scales `QuantizeRowsCall` makes of it, bit for bit; a zero row gets scale 1
/// and large products saturate nothing (the scale follows the row's amax).
#[test]
fn gpu_fp8_silu_mul_quantization_is_the_activation_then_the_quantization() {
    let dev = device();
    let mut r = rng("gpu_fp8_silu_mul_quantization_is_the_activation_then_the_quantization");
    for (rows, d) in [(37usize, 14336usize), (19, 1024), (5, 8), (3, 1000), (64, 2048)] {
        let mut gu = rand_vec(&mut r, rows * 2 * d, 4.0);
        if rows > 2 {
            // Row 1: up is zero (a zero row); row 2: large gates and ups.
            gu[2 * d + d..4 * d].fill(0.0);
            for v in &mut gu[4 * d..6 * d] {
                *v *= 300.0;
            }
        }
        let gud = up(&dev, &gu);
        let mut act_a = poisoned(&dev, rows * d);
        SiluMulCall { gate_up: &gud, rows, d, out: &mut act_a }.launch(&dev).expect("silu_mul");
        let mut codes_a = dev.upload(&vec![0x7fu8; rows * d]).expect("codes");
        let mut scales_a = dev.upload(&vec![f32::NAN; rows]).expect("scales");
        let quant = QuantizeRowsCall {
            x: QuantRows::Bf16(&act_a),
            m: rows,
            k: d,
            codes: &mut codes_a,
            scales: &mut scales_a,
            row0: 0,
        };
        quant.launch(&dev).expect("quantize");
        let mut act_b = poisoned(&dev, rows * d + 8);
        let mut codes_b = dev.upload(&vec![0x7fu8; rows * d + 64]).expect("codes");
        let mut scales_b = dev.upload(&vec![f32::NAN; rows + 4]).expect("scales");
        let fused =
            SiluMulQuantCall { gate_up: &gud, m: rows, d, act: &mut act_b, codes: &mut codes_b, scales: &mut scales_b };
        fused.launch(&dev).expect("silu_mul_quant");
        let what = format!("rows {rows} d {d}");
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        let (aa, ab) = (down(&dev, &act_a, rows * d), down(&dev, &act_b, rows * d + 8));
        assert_eq!(bits(aa), bits(ab[..rows * d].to_vec()), "{what}: act differs");
        assert!(ab[rows * d..].iter().all(|v| v.is_nan()), "{what}: act written past the rows");
        let (ca, cb) =
            (dev.download(&codes_a, rows * d).expect("dl"), dev.download(&codes_b, rows * d + 64).expect("dl"));
        assert_eq!(ca[..], cb[..rows * d], "{what}: codes differ");
        assert!(cb[rows * d..].iter().all(|&c| c == 0x7f), "{what}: codes written past the rows");
        let (sa, sb) = (dev.download(&scales_a, rows).expect("dl"), dev.download(&scales_b, rows + 4).expect("dl"));
        assert_eq!(bits(sa.clone()), bits(sb[..rows].to_vec()), "{what}: scales differ");
        assert!(sb[rows..].iter().all(|v| v.is_nan()), "{what}: scales written past the rows");
        assert!(sa.iter().all(|s| s.is_finite() && *s > 0.0), "{what}: scales {sa:?}");
        if rows > 2 {
            assert_eq!(sa[1], 1.0, "{what}: a zero row's scale is 1");
        }
    }
    // A width the kernel does not read in whole pieces is refused, naming it.
    let gud = up(&dev, &[1.0; 2 * 12]);
    let (mut a, mut c, mut s) = (poisoned(&dev, 12), dev.alloc::<u8>(12).expect("c"), dev.alloc::<f32>(1).expect("s"));
    let err = SiluMulQuantCall { gate_up: &gud, m: 1, d: 12, act: &mut a, codes: &mut c, scales: &mut s }.launch(&dev);
    assert!(err.err().map(|e| e.to_string()).unwrap_or_default().contains("d = 12"), "d = 12 refused");
}
