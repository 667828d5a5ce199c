//! Dequantization of ggml block formats against references computed here from the
//! format definitions, on seeded random blocks (random bytes, so every nibble value and
//! sign occurs), plus quantize→dequantize error bounds.

use baton_formats::gguf::GgufType;
use baton_formats::gguf::quant::{dequantize, quantize};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A random block: a finite f16 scale (and min) followed by random payload bytes.
fn random_blocks(rng: &mut StdRng, ty: GgufType, n_blocks: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n_blocks {
        let halves = if ty == GgufType::Q4_1 { 2 } else { 1 };
        for _ in 0..halves {
            let v: f32 = rng.random_range(-0.05..0.05);
            out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        for _ in 0..ty.block_bytes() - 2 * halves {
            out.push(rng.random());
        }
    }
    out
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from(b[i]) | (u16::from(b[i + 1]) << 8)).to_f32()
}

/// Element `k` of a block, straight from the ggml definitions.
fn reference(ty: GgufType, block: &[u8], k: usize) -> f32 {
    match ty {
        GgufType::Q8_0 => f16_at(block, 0) * f32::from(block[2 + k] as i8),
        GgufType::Q4_0 => {
            let byte = block[2 + k % 16];
            let q = if k < 16 { byte & 15 } else { byte >> 4 };
            f16_at(block, 0) * (i32::from(q) - 8) as f32
        }
        GgufType::Q4_1 => {
            let byte = block[4 + k % 16];
            let q = if k < 16 { byte & 15 } else { byte >> 4 };
            f16_at(block, 0) * f32::from(q) + f16_at(block, 2)
        }
        _ => unreachable!("only block types are tested here"),
    }
}

#[test]
fn dequantize_matches_first_principles_reference() {
    for (seed, ty) in [(11u64, GgufType::Q8_0), (12, GgufType::Q4_0), (13, GgufType::Q4_1)] {
        let mut rng = StdRng::seed_from_u64(seed);
        // Many blocks so the parallel chunking (4096 blocks per task) is crossed.
        let n_blocks = 9000;
        let bytes = random_blocks(&mut rng, ty, n_blocks);
        let got = dequantize(ty, &bytes);
        assert_eq!(got.len(), n_blocks * 32);
        let mut nonzero = 0;
        for (b, block) in bytes.chunks_exact(ty.block_bytes()).enumerate() {
            for k in 0..32 {
                let want = reference(ty, block, k);
                assert_eq!(got[b * 32 + k], want, "{ty:?} block {b} element {k}");
                nonzero += usize::from(want != 0.0);
            }
        }
        assert!(nonzero > n_blocks * 16, "{ty:?}: reference values are mostly zero");
    }
}

#[test]
fn quantize_roundtrip_error_is_within_half_a_step() {
    let mut rng = StdRng::seed_from_u64(21);
    let values: Vec<f32> = (0..32 * 64).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    for ty in [GgufType::Q8_0, GgufType::Q4_0, GgufType::Q4_1] {
        let q = quantize(ty, &values);
        assert_eq!(q.len(), 64 * ty.block_bytes());
        let back = dequantize(ty, &q);
        for (blk, (orig, got)) in values.chunks(32).zip(back.chunks(32)).enumerate() {
            let (lo, hi) = orig.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            let amax = lo.abs().max(hi.abs());
            let step = match ty {
                GgufType::Q8_0 => amax / 127.0,
                GgufType::Q4_0 => amax / 8.0,
                _ => (hi - lo) / 15.0,
            };
            for (o, g) in orig.iter().zip(got) {
                // Half a step plus f16 rounding of the scale (and min). Q4_0 spans
                // [-8d, 7d], so values near +amax may be a whole step off when the
                // largest magnitude is negative (as in ggml).
                let steps = if ty == GgufType::Q4_0 { 1.0 } else { 0.5 };
                let tol = steps * step + 2e-3 * amax;
                assert!((o - g).abs() <= tol, "{ty:?} block {blk}: {o} vs {g} (tol {tol})");
            }
        }
    }
}

#[test]
fn plain_float_types_roundtrip() {
    let mut rng = StdRng::seed_from_u64(31);
    let values: Vec<f32> = (0..1000).map(|_| rng.random_range(-4.0f32..4.0)).collect();
    assert_eq!(dequantize(GgufType::F32, &quantize(GgufType::F32, &values)), values);
    for (ty, rel) in [(GgufType::F16, 1e-3), (GgufType::BF16, 8e-3)] {
        let back = dequantize(ty, &quantize(ty, &values));
        for (a, b) in values.iter().zip(&back) {
            assert!((a - b).abs() <= rel * a.abs() + 1e-6, "{ty:?}: {a} vs {b}");
        }
    }
}
