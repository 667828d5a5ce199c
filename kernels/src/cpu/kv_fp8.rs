//! The FP8 (E4M3) paged KV cache on the CPU: the reference the CUDA FP8 kernels are
//! checked against.
//!
//! Same layout as the f32 cache ([`super::KvLayerRef`]: `[num_blocks][block_size]
//! [n_kv_heads][head_dim]`), one byte per element: the E4M3 code of `value / scale`, with
//! one scale for a layer's K and one for its V ([`super::fp8`]). Keys may be stored smoothed:
//! `e4m3((k - shift) / scale)` with one shift per (KV head, dim) for the whole layer
//! ([`Fp8KvLayerMut::k_shift`]). Attention reads them unshifted: every score of a query
//! then moves by the same `q · shift`, which a softmax does not see (exactly so only without
//! soft-caps and sinks; the engine's `kv_k_smoothing` decides where). Writing quantizes;
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
    /// Subtracted from every key before the division, one value per (KV head, dim)
    /// (`n_kv_heads × head_dim`); empty for none.
    pub k_shift: &'a [f32],
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Quantizes the chunk's new keys and values (`n_tokens × n_kv_heads × head_dim` each) into
/// their slots: `e4m3((k - k_shift) / k_scale)`, `e4m3(v / v_scale)`.
pub fn write_kv_fp8(
    k_new: &[f32],
    v_new: &[f32],
    span: SeqSpan<'_>,
    cache: &mut Fp8KvLayerMut<'_>,
) -> Result<(), KernelError> {
    let stride = cache.n_kv_heads * cache.head_dim;
    check(
        "write_kv_fp8",
        k_new.len() == span.n_tokens * stride
            && v_new.len() == k_new.len()
            && cache.k.len() == cache.v.len()
            && (cache.k_shift.is_empty() || cache.k_shift.len() == stride),
        || {
            format!(
                "k_new {} v_new {} values for {} tokens of stride {stride}, k_shift {}",
                k_new.len(),
                v_new.len(),
                span.n_tokens,
                cache.k_shift.len()
            )
        },
    )?;
    let mut shifted = vec![0.0f32; if cache.k_shift.is_empty() { 0 } else { stride }];
    for t in 0..span.n_tokens {
        let off = slot_offset(span.block_table, span.start_pos + t, cache.block_size, stride, cache.k.len())?;
        let rows = t * stride..(t + 1) * stride;
        let k_row = &k_new[rows.clone()];
        let k_row = if shifted.is_empty() {
            k_row
        } else {
            for ((d, &k), &m) in shifted.iter_mut().zip(k_row).zip(cache.k_shift) {
                *d = k - m;
            }
            &shifted
        };
        quantize_e4m3(k_row, cache.k_scale, &mut cache.k[off..off + stride]);
        quantize_e4m3(&v_new[rows], cache.v_scale, &mut cache.v[off..off + stride]);
    }
    Ok(())
}

/// Re-expresses key codes written as `e4m3((k - from_shift) / from_scale)` as codes of
/// `(to_scale, to_shift)`, in place: `e4m3((decode(code) × from_scale + from_shift - to_shift)
/// / to_scale)`. `codes` is whole rows of `stride` values (the cache's `n_kv_heads × head_dim`),
/// each shift `stride` long or empty (none). Used where keys written under another cache's
/// smoothing are stored under this cache's; a byte table when the shifts are equal.
pub fn requantize_keys_e4m3(
    codes: &mut [u8],
    stride: usize,
    (from_scale, from_shift): (f32, &[f32]),
    (to_scale, to_shift): (f32, &[f32]),
) -> Result<(), KernelError> {
    let ok_shift = |s: &[f32]| s.is_empty() || s.len() == stride;
    check(
        "requantize_keys_e4m3",
        stride > 0 && codes.len().is_multiple_of(stride) && ok_shift(from_shift) && ok_shift(to_shift),
        || format!("{} codes in rows of {stride}, shifts of {} and {}", codes.len(), from_shift.len(), to_shift.len()),
    )?;
    let at = |s: &[f32], i: usize| s.get(i).copied().unwrap_or(0.0);
    if (0..stride).all(|i| at(from_shift, i) == at(to_shift, i)) {
        requantize_e4m3(codes, from_scale, to_scale);
        return Ok(());
    }
    // Per value, the offset moves the code by a different amount in each channel.
    let offset: Vec<f32> = (0..stride).map(|i| at(from_shift, i) - at(to_shift, i)).collect();
    for row in codes.chunks_mut(stride) {
        for (c, &o) in row.iter_mut().zip(&offset) {
            *c = e4m3_from_f32((e4m3_to_f32(*c) * from_scale + o) / to_scale);
        }
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
            k_shift: &[],
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
        let mut c8 = Fp8KvLayerMut {
            k: &mut kc,
            v: &mut vc,
            k_scale,
            v_scale,
            k_shift: &[],
            block_size: bs,
            n_kv_heads: kvh,
            head_dim: hd,
        };
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

    #[test]
    fn shifted_keys_are_codes_of_key_minus_shift_and_requantize_between_shifts() {
        let (bs, kvh, hd) = (2, 1, 2);
        let shift = [1.5f32, -4.0];
        let (mut kc, mut vc) = (vec![0xAAu8; 2 * bs * kvh * hd], vec![0xAAu8; 2 * bs * kvh * hd]);
        let mut cache = Fp8KvLayerMut {
            k: &mut kc,
            v: &mut vc,
            k_scale: 0.25,
            v_scale: 2.0,
            k_shift: &shift,
            block_size: bs,
            n_kv_heads: kvh,
            head_dim: hd,
        };
        let k_new = [2.0f32, -3.0, 1.0, -5.5, 10.0, 0.0];
        let v_new = [8.0f32, 4.0, -2.0, 1.0, 0.5, -0.25];
        let span = SeqSpan { start_pos: 0, n_tokens: 3, block_table: &[1, 0] };
        write_kv_fp8(&k_new, &v_new, span, &mut cache).expect("write");
        // A shift of the wrong length is refused.
        cache.k_shift = &shift[..1];
        assert!(write_kv_fp8(&k_new, &v_new, span, &mut cache).is_err());
        let code = |x: f32, s: f32| e4m3_from_f32(x / s);
        // Tokens 0, 1 in block 1 (bytes 4..8), token 2 in block 0 (bytes 0..2).
        assert_eq!(kc[4..8], [code(0.5, 0.25), code(1.0, 0.25), code(-0.5, 0.25), code(-1.5, 0.25)]);
        assert_eq!(kc[0..2], [code(8.5, 0.25), code(4.0, 0.25)]);
        assert_eq!(vc[4..6], [code(8.0, 2.0), code(4.0, 2.0)], "values are never shifted");
        assert!(kc[2..4].iter().all(|&b| b == 0xAA));

        // Requantizing into another shift and scale: decode with the old, encode with the new.
        let mut codes = kc[4..8].to_vec();
        let to_shift = [0.5f32, 1.0];
        requantize_keys_e4m3(&mut codes, 2, (0.25, &shift), (0.5, &to_shift)).expect("requantize");
        let want: Vec<u8> = kc[4..8]
            .iter()
            .enumerate()
            .map(|(i, &c)| code(e4m3_to_f32(c) * 0.25 + shift[i % 2] - to_shift[i % 2], 0.5))
            .collect();
        assert_eq!(codes, want);
        // Into no shift; and equal shifts fall back to the scale-only table.
        let mut plain = kc[4..8].to_vec();
        requantize_keys_e4m3(&mut plain, 2, (0.25, &shift), (0.25, &[])).expect("requantize");
        assert_eq!(plain.iter().map(|&c| e4m3_to_f32(c) * 0.25).collect::<Vec<_>>(), [2.0, -3.0, 1.0, -5.5]);
        let mut same = kc[4..8].to_vec();
        requantize_keys_e4m3(&mut same, 2, (0.25, &shift), (0.25, &shift)).expect("requantize");
        assert_eq!(same, kc[4..8]);
        assert!(requantize_keys_e4m3(&mut same, 3, (0.25, &shift), (0.25, &shift)).is_err(), "rows of 3");
    }

    #[test]
    fn a_common_key_shift_leaves_softmax_attention_unchanged_but_not_a_soft_capped_one() {
        // The premise of key smoothing: q · (k - μ) = q · k - q · μ moves every score of a
        // query by the same amount. With a soft-cap (tanh) it does not.
        let mut rng = StdRng::seed_from_u64(5);
        let (bs, kvh, nh, hd) = (4, 2, 4, 8);
        let total = 11;
        let table = [2u32, 0, 1];
        let stride = kvh * hd;
        let k: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-2.0..2.0)).collect();
        let v: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mu: Vec<f32> = (0..stride).map(|_| rng.random_range(-6.0..6.0)).collect();
        let shifted: Vec<f32> = k.iter().enumerate().map(|(i, x)| x - mu[i % stride]).collect();
        let q: Vec<f32> = (0..3 * nh * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
        let run = |keys: &[f32], extras: AttnExtras<'_>| {
            let len = 3 * bs * stride;
            let (mut kf, mut vf) = (vec![f32::NAN; len], vec![f32::NAN; len]);
            let span = |s, n| SeqSpan { start_pos: s, n_tokens: n, block_table: &table };
            let mut c = KvLayerMut { k: &mut kf, v: &mut vf, block_size: bs, n_kv_heads: kvh, head_dim: hd };
            write_kv(keys, &v, span(0, total), &mut c).expect("write");
            let dense = KvLayerRef { k: &kf, v: &vf, block_size: bs, n_kv_heads: kvh, head_dim: hd };
            let mut out = vec![f32::NAN; q.len()];
            paged_attention_ext(&q, nh, 0.35, span(total - 3, 3), dense, extras, &mut out).expect("attention");
            out
        };
        let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let window = AttnExtras { window: Some(5), softcap: None, sinks: None };
        for extras in [AttnExtras::default(), window] {
            let d = max_diff(&run(&k, extras), &run(&shifted, extras));
            assert!(d < 1e-5, "plain or windowed softmax: {d}");
        }
        let capped = AttnExtras { window: None, softcap: Some(2.0), sinks: None };
        let d = max_diff(&run(&k, capped), &run(&shifted, capped));
        assert!(d > 1e-2, "a soft-capped softmax sees the shift: {d}");
    }
}
