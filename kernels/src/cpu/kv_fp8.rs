//! The FP8 (E4M3) paged KV cache on the CPU: the reference the CUDA FP8 kernels are
//! checked against.
//!
//! Same layout as the f32 cache ([`super::KvLayerRef`]: `[num_blocks][block_size]
//! [n_kv_heads][head_dim]`), one byte per element: the E4M3 code of `value / scale`, with
//! one scale for a layer's K and one for its V ([`super::fp8`]). Writing quantizes;
//! attention dequantizes (`code × scale`) what it reads and is otherwise exactly
//! [`super::paged_attention_ext`]: the sequence's blocks are dequantized into a contiguous
//! f32 copy, which the f32 kernel reads through an identity block table. That is the same
//! arithmetic as dequantizing inside the kernel, at the cost of one pass over the context.

use super::attention::slot_offset;
use super::fp8::{dequantize_e4m3, e4m3_from_f32, e4m3_to_f32, quantize_e4m3};
use super::{AttnExtras, KernelError, KvLayerRef, SeqSpan, check, paged_attention_ext};

/// Geometry, scales and read access to one layer's FP8 cache.
#[derive(Debug, Clone, Copy)]
pub struct Fp8KvLayerRef<'a> {
    /// Key codes, `[num_blocks][block_size][n_kv_heads][head_dim]`.
    pub k: &'a [u8],
    /// Value codes, same layout.
    pub v: &'a [u8],
    /// What a key code is multiplied by when read.
    pub k_scale: f32,
    /// What a value code is multiplied by when read.
    pub v_scale: f32,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Geometry, scales and write access to one layer's FP8 cache.
#[derive(Debug)]
pub struct Fp8KvLayerMut<'a> {
    /// Key codes, `[num_blocks][block_size][n_kv_heads][head_dim]`.
    pub k: &'a mut [u8],
    /// Value codes, same layout.
    pub v: &'a mut [u8],
    /// What a key is divided by before it is rounded to E4M3.
    pub k_scale: f32,
    /// What a value is divided by before it is rounded to E4M3.
    pub v_scale: f32,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Quantizes the chunk's new keys and values (`n_tokens × n_kv_heads × head_dim` each) into
/// their slots: `e4m3(k / k_scale)`, `e4m3(v / v_scale)`.
pub fn write_kv_fp8(
    k_new: &[f32],
    v_new: &[f32],
    span: SeqSpan<'_>,
    cache: &mut Fp8KvLayerMut<'_>,
) -> Result<(), KernelError> {
    let stride = cache.n_kv_heads * cache.head_dim;
    check(
        "write_kv_fp8",
        k_new.len() == span.n_tokens * stride && v_new.len() == k_new.len() && cache.k.len() == cache.v.len(),
        || {
            format!(
                "k_new {} v_new {} values for {} tokens of stride {stride}",
                k_new.len(),
                v_new.len(),
                span.n_tokens
            )
        },
    )?;
    for t in 0..span.n_tokens {
        let off = slot_offset(span.block_table, span.start_pos + t, cache.block_size, stride, cache.k.len())?;
        let rows = t * stride..(t + 1) * stride;
        quantize_e4m3(&k_new[rows.clone()], cache.k_scale, &mut cache.k[off..off + stride]);
        quantize_e4m3(&v_new[rows], cache.v_scale, &mut cache.v[off..off + stride]);
    }
    Ok(())
}

/// The largest magnitude in `xs` (0 when empty), NaN when any value is NaN: the reduction a
/// KV scale calibration takes over a step's new K or V (the reference of the CUDA
/// `*_kv_amax` kernels, which propagate NaN the same way).
pub fn abs_max(xs: &[f32]) -> f32 {
    xs.iter().fold(0.0f32, |m, &x| if m.is_nan() || x.is_nan() { f32::NAN } else { m.max(x.abs()) })
}

/// Re-expresses E4M3 codes written with scale `from` as codes of scale `to`, in place:
/// `e4m3(decode(code) × from / to)` (a second rounding, saturating at ±448). Used where KV
/// written under another cache's scales is stored under this cache's. Identity when the
/// scales are equal.
pub fn requantize_e4m3(codes: &mut [u8], from: f32, to: f32) {
    if from == to {
        return;
    }
    let table: Vec<u8> = (0..=255u8).map(|c| e4m3_from_f32(e4m3_to_f32(c) * from / to)).collect();
    for c in codes {
        *c = table[*c as usize];
    }
}

/// [`paged_attention_ext`] over an FP8 cache: every key and value it reads is its code
/// times the layer's scale.
pub fn paged_attention_fp8(
    q: &[f32],
    n_heads: usize,
    scale: f32,
    span: SeqSpan<'_>,
    cache: Fp8KvLayerRef<'_>,
    extras: AttnExtras<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let total = span.start_pos + span.n_tokens;
    let bs = cache.block_size;
    check("paged_attention_fp8", bs > 0 && span.block_table.len() * bs >= total, || {
        format!("block table covers {} tokens, need {total}", span.block_table.len() * bs)
    })?;
    let block_len = bs * cache.n_kv_heads * cache.head_dim;
    let used = total.div_ceil(bs);
    let mut k = vec![0.0f32; used * block_len];
    let mut v = vec![0.0f32; used * block_len];
    for (i, &b) in span.block_table[..used].iter().enumerate() {
        let src = b as usize * block_len..(b as usize + 1) * block_len;
        let (ks, vs) = match (cache.k.get(src.clone()), cache.v.get(src)) {
            (Some(ks), Some(vs)) => (ks, vs),
            _ => {
                return Err(KernelError {
                    op: "paged_attention_fp8",
                    message: format!("block {b} is outside the cache"),
                });
            }
        };
        dequantize_e4m3(ks, cache.k_scale, &mut k[i * block_len..(i + 1) * block_len]);
        dequantize_e4m3(vs, cache.v_scale, &mut v[i * block_len..(i + 1) * block_len]);
    }
    let identity: Vec<u32> = (0..used as u32).collect();
    let dense = KvLayerRef { k: &k, v: &v, block_size: bs, n_kv_heads: cache.n_kv_heads, head_dim: cache.head_dim };
    let span = SeqSpan { block_table: &identity, ..span };
    paged_attention_ext(q, n_heads, scale, span, dense, extras, out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn abs_max_propagates_nan_and_requantize_rescales() {
        use super::*;
        assert_eq!(abs_max(&[]), 0.0);
        assert_eq!(abs_max(&[1.0, -3.5, 2.0]), 3.5);
        assert!(abs_max(&[1.0, f32::NAN, 2.0]).is_nan());
        assert!(abs_max(&[f32::NAN, 9.0]).is_nan());
        assert_eq!(abs_max(&[f32::NEG_INFINITY, 1.0]), f32::INFINITY);
        let xs = [0.02f32, -1.5, 3.0, 100.0];
        let mut codes = vec![0u8; 4];
        quantize_e4m3(&xs, 0.5, &mut codes);
        requantize_e4m3(&mut codes, 0.5, 0.25);
        let mut want = vec![0u8; 4];
        let once: Vec<f32> = xs.iter().map(|&x| e4m3_to_f32(e4m3_from_f32(x / 0.5)) * 0.5).collect();
        quantize_e4m3(&once, 0.25, &mut want);
        assert_eq!(codes, want, "decode with the old scale, encode with the new");
        let before = codes.clone();
        requantize_e4m3(&mut codes, 0.7, 0.7);
        assert_eq!(codes, before);
    }

    use super::*;
    use crate::cpu::fp8::{e4m3_from_f32, e4m3_to_f32};
    use crate::cpu::{KvLayerMut, write_kv};
    use rand::{Rng, SeedableRng, rngs::StdRng};

    #[test]
    fn writes_codes_of_value_over_scale_into_the_paged_slots() {
        let (bs, kvh, hd) = (2, 1, 2);
        let mut kc = vec![0xAAu8; 3 * bs * kvh * hd];
        let mut vc = vec![0xAAu8; 3 * bs * kvh * hd];
        let mut cache = Fp8KvLayerMut {
            k: &mut kc,
            v: &mut vc,
            k_scale: 0.5,
            v_scale: 4.0,
            block_size: bs,
            n_kv_heads: kvh,
            head_dim: hd,
        };
        // Positions 1..4 of a sequence whose blocks are [2, 0]: slots (2,1), (0,0), (0,1), i.e.
        // bytes 10..12, 0..2 and 2..4 (a block is 2 tokens × 2 values).
        let k_new = [1.0f32, -2.0, 3.0, 1000.0, 0.01, 0.0];
        let v_new = [8.0f32, 4.0, -2.0, 1.0, 0.5, -0.25];
        write_kv_fp8(&k_new, &v_new, SeqSpan { start_pos: 1, n_tokens: 3, block_table: &[2, 0] }, &mut cache)
            .expect("write");
        // A table too short for the chunk is an error, not a panic.
        let err = write_kv_fp8(&k_new, &v_new, SeqSpan { start_pos: 4, n_tokens: 3, block_table: &[2, 0] }, &mut cache);
        assert!(err.is_err());
        let code = |x: f32, s: f32| e4m3_from_f32(x / s);
        assert_eq!(kc[10..12], [code(1.0, 0.5), code(-2.0, 0.5)]);
        assert_eq!(kc[0..4], [code(3.0, 0.5), 0x7E, code(0.01, 0.5), 0x00], "1000 / 0.5 saturates to 448");
        assert_eq!(vc[10..12], [code(8.0, 4.0), code(4.0, 4.0)]);
        assert!(kc[4..10].iter().all(|&b| b == 0xAA), "untouched slots keep their bytes");
        assert_eq!(e4m3_to_f32(kc[0]) * 0.5, 3.0);
    }

    #[test]
    fn attention_equals_the_f32_kernel_over_dequantized_values() {
        // The reference performs the quantization itself: each K/V is rounded to e4m3 at its
        // scale and back, written into an f32 cache, and read by the f32 kernel.
        let mut rng = StdRng::seed_from_u64(17);
        let (bs, kvh, nh, hd, nblocks) = (4, 2, 4, 8, 6);
        let (start, n_q) = (5, 4);
        let total = start + n_q;
        let table = [4u32, 1, 5];
        let (k_scale, v_scale) = (0.05f32, 0.02f32);
        let stride = kvh * hd;
        let len = nblocks * bs * stride;
        // Values well past 448 × scale, so saturation is exercised too.
        let k: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-30.0..30.0)).collect();
        let v: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-12.0..12.0)).collect();
        let q: Vec<f32> = (0..n_q * nh * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (mut kc, mut vc) = (vec![0u8; len], vec![0u8; len]);
        let (mut kf, mut vf) = (vec![f32::NAN; len], vec![f32::NAN; len]);
        let span = |s, n| SeqSpan { start_pos: s, n_tokens: n, block_table: &table };
        let round = |xs: &[f32], s: f32| xs.iter().map(|x| e4m3_to_f32(e4m3_from_f32(x / s)) * s).collect::<Vec<_>>();
        let mut c8 =
            Fp8KvLayerMut { k: &mut kc, v: &mut vc, k_scale, v_scale, block_size: bs, n_kv_heads: kvh, head_dim: hd };
        write_kv_fp8(&k, &v, span(0, total), &mut c8).expect("fp8 write");
        let mut cf = KvLayerMut { k: &mut kf, v: &mut vf, block_size: bs, n_kv_heads: kvh, head_dim: hd };
        write_kv(&round(&k, k_scale), &round(&v, v_scale), span(0, total), &mut cf).expect("f32 write");
        assert!(k.iter().any(|x| x.abs() > 448.0 * k_scale), "some keys saturate");
        for extras in [AttnExtras::default(), AttnExtras { window: Some(3), softcap: Some(5.0), sinks: None }] {
            let mut want = vec![f32::NAN; q.len()];
            let dense = KvLayerRef { k: &kf, v: &vf, block_size: bs, n_kv_heads: kvh, head_dim: hd };
            paged_attention_ext(&q, nh, 0.3, span(start, n_q), dense, extras, &mut want).expect("f32 attention");
            let mut got = vec![f32::NAN; q.len()];
            let c = Fp8KvLayerRef { k: &kc, v: &vc, k_scale, v_scale, block_size: bs, n_kv_heads: kvh, head_dim: hd };
            paged_attention_fp8(&q, nh, 0.3, span(start, n_q), c, extras, &mut got).expect("fp8 attention");
            assert_eq!(got, want);
        }
        // A block id past the pool is refused.
        let c = Fp8KvLayerRef { k: &kc, v: &vc, k_scale, v_scale, block_size: bs, n_kv_heads: kvh, head_dim: hd };
        let bad = SeqSpan { start_pos: start, n_tokens: n_q, block_table: &[4, 1, 99] };
        assert!(paged_attention_fp8(&q, nh, 0.3, bad, c, AttnExtras::default(), &mut vec![0.0; q.len()]).is_err());
    }
}
