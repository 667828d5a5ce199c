//! ggml block quantizations Q8_0, Q4_0 and Q4_1: dequantization to f32 (parallel over
//! blocks with rayon) and the matching quantizers used by the GGUF writer. Block layouts
//! (32 elements each): Q8_0 = f16 d, 32 × i8 (x = d·q); Q4_0 = f16 d, 16 bytes of nibbles
//! (x = d·(q − 8)); Q4_1 = f16 d, f16 m, 16 bytes (x = d·q + m). In a 4-bit block, byte j
//! holds element j in its low nibble and element j + 16 in its high nibble.

use half::{bf16, f16};
use rayon::prelude::*;

use super::reader::GgufType;

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
    }
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
    }
    out
}
