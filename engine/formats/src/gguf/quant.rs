//! ggml block quantizations Q8_0, Q4_0, Q4_1 and MXFP4: dequantization to f32 (parallel over
//! blocks with rayon) and the matching quantizers used by the GGUF writer. Block layouts
//! (32 elements each): Q8_0 = f16 d, 32 × i8 (x = d·q); Q4_0 = f16 d, 16 bytes of nibbles
//! (x = d·(q − 8)); Q4_1 = f16 d, f16 m, 16 bytes (x = d·q + m); MXFP4 = one e8m0 byte e,
//! 16 bytes of e2m1 codes (x = e2m1(q)·2^(e − 127), OCP MX: what gpt-oss checkpoints store).
//! In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high
//! nibble (llama.cpp's converter reorders the checkpoint's MXFP4 nibbles, which pair elements
//! 2j and 2j + 1, into this layout).

use half::{bf16, f16};
use rayon::prelude::*;

use super::reader::GgufType;
use crate::mxfp4::e2m1;

const QK: usize = 32;

/// Converts `bytes` of type `ty` (exactly a whole number of blocks) into f32 values.
pub fn dequantize(ty: GgufType, bytes: &[u8]) -> Vec<f32> {
    let blocks = bytes.len() / ty.block_bytes();
    let mut out = vec![0f32; blocks * ty.block_elems()];
    out.par_chunks_mut(ty.block_elems() * 4096)
        .zip(bytes.par_chunks(ty.block_bytes() * 4096))
        .for_each(|(o, b)| dequantize_serial(ty, b, o));
    out
}

fn dequantize_serial(ty: GgufType, bytes: &[u8], out: &mut [f32]) {
    let half_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match ty {
        GgufType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgufType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half_at(c, 0);
            }
        }
        GgufType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgufType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(34)) {
                let d = half_at(b, 0);
                for (x, &q) in o.iter_mut().zip(&b[2..]) {
                    *x = d * f32::from(q as i8);
                }
            }
        }
        GgufType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(18)) {
                let d = half_at(b, 0);
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[2..].iter().enumerate() {
                    lo[j] = d * (f32::from(q & 0x0f) - 8.0);
                    hi[j] = d * (f32::from(q >> 4) - 8.0);
                }
            }
        }
        GgufType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(20)) {
                let d = half_at(b, 0);
                let m = half_at(b, 2);
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[4..].iter().enumerate() {
                    lo[j] = d * f32::from(q & 0x0f) + m;
                    hi[j] = d * f32::from(q >> 4) + m;
                }
            }
        }
        GgufType::MXFP4 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(17)) {
                let d = e8m0(b[0]);
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[1..].iter().enumerate() {
                    lo[j] = d * e2m1(q & 0x0f);
                    hi[j] = d * e2m1(q >> 4);
                }
            }
        }
    }
}

/// The scale an e8m0 byte stands for, `2^(e − 127)` (255, e8m0's NaN, gives +inf here: the
/// store refuses such blocks before it dequantizes, [`mxfp4_nan_scale`]).
fn e8m0(e: u8) -> f32 {
    2f32.powi(i32::from(e) - 127)
}

/// The index of the first MXFP4 block of `bytes` whose scale is e8m0's NaN (255), if any.
pub fn mxfp4_nan_scale(bytes: &[u8]) -> Option<usize> {
    bytes.chunks_exact(17).position(|b| b[0] == 255)
}

/// Encodes `values` as `ty` (length must be a multiple of the block size for quantized types;
/// the caller checks). Rounding follows ggml's reference quantizers.
pub fn quantize(ty: GgufType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / ty.block_elems() * ty.block_bytes());
    match ty {
        GgufType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgufType::F16 => values.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgufType::BF16 => values.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        GgufType::Q8_0 => {
            for blk in values.chunks_exact(QK) {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        GgufType::Q4_0 => {
            for blk in values.chunks_exact(QK) {
                // The signed value of largest magnitude maps to -8, using the full range.
                let max = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                for j in 0..QK / 2 {
                    out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
                }
            }
        }
        GgufType::Q4_1 => {
            for blk in values.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                for j in 0..QK / 2 {
                    out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
                }
            }
        }
        GgufType::MXFP4 => {
            for blk in values.chunks_exact(QK) {
                // gguf-py's reference: the scale puts the block's largest magnitude in [4, 8)
                // (e2m1's top binade), each element takes the nearest code (the first on a tie).
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let e = if amax > 0.0 { (amax.log2().floor() as i32 - 2 + 127).clamp(0, 254) as u8 } else { 0 };
                let d = e8m0(e);
                let q = |v: f32| -> u8 {
                    (0u8..16).min_by(|&a, &b| (d * e2m1(a) - v).abs().total_cmp(&(d * e2m1(b) - v).abs())).unwrap_or(0)
                };
                out.push(e);
                for j in 0..QK / 2 {
                    out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_matches_llama_cpps_python_package() {
        // Two blocks quantized by gguf-py 0.19 (`gguf.quants.quantize(x, MXFP4)`): x[i] =
        // ((37i mod 23) − 11) · 0.173 for the first 32, then 31 zeros and 1e-3.
        let x: Vec<f32> = (0..32)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .chain(std::iter::repeat_n(0.0, 31))
            .chain([1e-3])
            .collect();
        let want: [u8; 34] = [
            125, 111, 196, 126, 55, 233, 111, 181, 253, 71, 224, 127, 149, 253, 87, 209, 127, 115, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 96,
        ];
        assert_eq!(quantize(GgufType::MXFP4, &x), want);
        // gguf-py's dequantization of those bytes (first eight, and the second block's last).
        let back = dequantize(GgufType::MXFP4, &want);
        assert_eq!(&back[..8], &[-1.5, 0.5, -1.0, 1.5, -0.125, -1.5, 0.75, -0.75]);
        assert_eq!(back[63], 0.000_976_562_5);
        assert!(back[32..63].iter().all(|&v| v == 0.0));
        assert_eq!(mxfp4_nan_scale(&want), None);
        let mut nan = want;
        nan[17] = 255;
        assert_eq!(mxfp4_nan_scale(&nan), Some(1));
    }
}
