//! Paged KV cache writes and paged attention for mixed batches.
//!
//! One layer's cache is two flat arrays (K and V) laid out as
//! `[num_blocks][block_size][n_kv_heads][head_dim]`. A sequence's token at
//! position `p` lives in block `block_table[p / block_size]`, slot
//! `p % block_size`. A scheduled chunk of a sequence covers positions
//! `start_pos .. start_pos + n_tokens`; its queries attend causally to every
//! cached position up to their own, so prefill chunks over a cached prefix and
//! single-token decode rows are the same case. GQA: query head `h` reads KV
//! head `h / (n_heads / n_kv_heads)`. Scores and softmax are in f32 with a
//! running max (online softmax) so any context length fits in registers.

use super::{KernelError, check};
use rayon::prelude::*;

/// Where one sequence's chunk sits in the paged cache.
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan<'a> {
    /// Tokens already in the cache before this chunk.
    pub start_pos: usize,
    /// Tokens in this chunk.
    pub n_tokens: usize,
    /// Physical block of each logical block; covers `start_pos + n_tokens` tokens.
    pub block_table: &'a [u32],
}

/// Geometry plus read access to one layer's cache.
#[derive(Debug, Clone, Copy)]
pub struct KvLayerRef<'a> {
    /// Keys, `[num_blocks][block_size][n_kv_heads][head_dim]`.
    pub k: &'a [f32],
    /// Values, same layout.
    pub v: &'a [f32],
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Geometry plus write access to one layer's cache.
#[derive(Debug)]
pub struct KvLayerMut<'a> {
    /// Keys, `[num_blocks][block_size][n_kv_heads][head_dim]`.
    pub k: &'a mut [f32],
    /// Values, same layout.
    pub v: &'a mut [f32],
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

pub(crate) fn slot_offset(
    block_table: &[u32],
    pos: usize,
    block_size: usize,
    token_stride: usize,
    cache_len: usize,
) -> Result<usize, KernelError> {
    let logical = pos / block_size;
    let block = *block_table.get(logical).ok_or_else(|| KernelError {
        op: "paged_kv",
        message: format!("position {pos} needs logical block {logical} but the block table has {}", block_table.len()),
    })? as usize;
    let off = (block * block_size + pos % block_size) * token_stride;
    check("paged_kv", off + token_stride <= cache_len, || format!("block {block} is outside the cache"))?;
    Ok(off)
}

/// Writes the chunk's new keys and values (`n_tokens × n_kv_heads × head_dim` each) into their slots.
pub fn write_kv(
    k_new: &[f32],
    v_new: &[f32],
    span: SeqSpan<'_>,
    cache: &mut KvLayerMut<'_>,
) -> Result<(), KernelError> {
    let stride = cache.n_kv_heads * cache.head_dim;
    check(
        "write_kv",
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
        cache.k[off..off + stride].copy_from_slice(&k_new[t * stride..(t + 1) * stride]);
        cache.v[off..off + stride].copy_from_slice(&v_new[t * stride..(t + 1) * stride]);
    }
    Ok(())
}

/// What some architectures add to plain causal attention (Gemma 2/3, Mistral, gpt-oss,
/// Phi-3). The default adds nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnExtras<'a> {
    /// Sliding window: the query at position `p` sees keys `j` with `p - window < j <= p`
    /// (transformers' convention: the window counts the query itself). `None`: the whole
    /// causal context.
    pub window: Option<usize>,
    /// Logit soft-capping (Gemma 2 `attn_logit_softcapping`): each scaled score `s` becomes
    /// `cap · tanh(s / cap)` before the softmax.
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss), one logit per query head: an extra softmax column with no
    /// value, so it only adds `exp(sink)` to the denominator. Compared with the scaled scores.
    pub sinks: Option<&'a [f32]>,
}

/// Causal attention of the chunk's queries (`n_tokens × n_heads × head_dim`) over the
/// cache (which must already hold the chunk's own K/V). Writes `out` in the same layout.
pub fn paged_attention(
    q: &[f32],
    n_heads: usize,
    scale: f32,
    span: SeqSpan<'_>,
    cache: KvLayerRef<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    paged_attention_ext(q, n_heads, scale, span, cache, AttnExtras::default(), out)
}

/// [`paged_attention`] with a sliding window, logit soft-capping and attention sinks
/// ([`AttnExtras`]). Keys outside the window are never read.
pub fn paged_attention_ext(
    q: &[f32],
    n_heads: usize,
    scale: f32,
    span: SeqSpan<'_>,
    cache: KvLayerRef<'_>,
    extras: AttnExtras<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let hd = cache.head_dim;
    let kvh = cache.n_kv_heads;
    check("paged_attention", kvh > 0 && n_heads.is_multiple_of(kvh), || {
        format!("{n_heads} query heads is not a multiple of {kvh} KV heads")
    })?;
    check("paged_attention", q.len() == span.n_tokens * n_heads * hd && out.len() == q.len(), || {
        format!("q {} / out {} values for {} tokens × {n_heads} heads × {hd}", q.len(), out.len(), span.n_tokens)
    })?;
    let total = span.start_pos + span.n_tokens;
    check("paged_attention", span.block_table.len() * cache.block_size >= total, || {
        format!("block table covers {} tokens, need {total}", span.block_table.len() * cache.block_size)
    })?;
    check("paged_attention", extras.window != Some(0), || "a sliding window of 0 tokens".into())?;
    check("paged_attention", extras.softcap.is_none_or(|c| c.is_finite() && c > 0.0), || {
        format!("soft-cap {:?} is not > 0", extras.softcap)
    })?;
    check("paged_attention", extras.sinks.is_none_or(|s| s.len() == n_heads), || {
        format!("{} sinks for {n_heads} heads", extras.sinks.map_or(0, <[f32]>::len))
    })?;
    let stride = kvh * hd;
    // Resolve the slots of every position some query can see once; all heads and queries
    // share them. Positions before the first query's window are never looked up.
    let first = extras.window.map_or(0, |w| (span.start_pos + 1).saturating_sub(w));
    let offsets: Vec<usize> = (first..total)
        .map(|p| slot_offset(span.block_table, p, cache.block_size, stride, cache.k.len()))
        .collect::<Result<_, _>>()?;
    let group = n_heads / kvh;
    out.par_chunks_mut(hd).enumerate().for_each(|(row, o)| {
        let t = row / n_heads;
        let h = row % n_heads;
        let kv_off = (h / group) * hd;
        let qv = &q[row * hd..(row + 1) * hd];
        let pos = span.start_pos + t;
        let lo = extras.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let mut m = f32::NEG_INFINITY;
        let mut l = 0.0f32;
        let mut acc = vec![0.0f32; hd];
        for &off in &offsets[lo - first..pos + 1 - first] {
            let kr = &cache.k[off + kv_off..off + kv_off + hd];
            let mut s = qv.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale;
            if let Some(cap) = extras.softcap {
                s = cap * (s / cap).tanh();
            }
            let vr = &cache.v[off + kv_off..off + kv_off + hd];
            if s > m {
                let c = (m - s).exp();
                l = l * c + 1.0;
                for (a, &v) in acc.iter_mut().zip(vr) {
                    *a = *a * c + v;
                }
                m = s;
            } else {
                let p = (s - m).exp();
                l += p;
                for (a, &v) in acc.iter_mut().zip(vr) {
                    *a += p * v;
                }
            }
        }
        // The sink's column: exp(sink - m) more in the denominator (f64: a sink far above
        // every score must not overflow into inf/inf).
        let denom = match extras.sinks {
            Some(sinks) => l as f64 + ((sinks[h] - m) as f64).exp(),
            None => l as f64,
        };
        for (dst, a) in o.iter_mut().zip(&acc) {
            *dst = (*a as f64 / denom) as f32;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    /// Dense causal attention in f64 over contiguous K/V, the reference.
    fn dense(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n_q: usize,
        start: usize,
        nh: usize,
        kvh: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f64> {
        let mut out = vec![0.0; n_q * nh * hd];
        for t in 0..n_q {
            for h in 0..nh {
                let kh = h / (nh / kvh);
                let ctx = start + t + 1;
                let scores: Vec<f64> = (0..ctx)
                    .map(|p| {
                        (0..hd)
                            .map(|d| q[(t * nh + h) * hd + d] as f64 * k[(p * kvh + kh) * hd + d] as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    out[(t * nh + h) * hd + d] = (0..ctx).map(|p| e[p] / z * v[(p * kvh + kh) * hd + d] as f64).sum();
                }
            }
        }
        out
    }

    #[test]
    fn paged_matches_dense_for_prefix_plus_chunk() {
        let mut rng = StdRng::seed_from_u64(5);
        for &(start, n_q, nh, kvh, hd, bs) in &[
            (0usize, 5usize, 4usize, 2usize, 8usize, 4usize),
            (13, 3, 6, 2, 16, 4),
            (30, 1, 4, 4, 64, 16),
            (7, 9, 9, 3, 64, 16),
        ] {
            let total = start + n_q;
            let n_blocks_needed = total.div_ceil(bs);
            let num_blocks = n_blocks_needed + 3;
            // A shuffled block table, so logical and physical order differ.
            let mut table: Vec<u32> = (0..num_blocks as u32).collect();
            for i in (1..table.len()).rev() {
                let j = rng.random_range(0..=i);
                table.swap(i, j);
            }
            table.truncate(n_blocks_needed);
            let stride = kvh * hd;
            let k: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-1.0..1.0)).collect();
            let q: Vec<f32> = (0..n_q * nh * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut kc = vec![f32::NAN; num_blocks * bs * stride];
            let mut vc = vec![f32::NAN; num_blocks * bs * stride];
            let mut layer = KvLayerMut { k: &mut kc, v: &mut vc, block_size: bs, n_kv_heads: kvh, head_dim: hd };
            // Prefix first, then the chunk, as the engine does across steps.
            write_kv(
                &k[..start * stride],
                &v[..start * stride],
                SeqSpan { start_pos: 0, n_tokens: start, block_table: &table },
                &mut layer,
            )
            .unwrap();
            write_kv(
                &k[start * stride..],
                &v[start * stride..],
                SeqSpan { start_pos: start, n_tokens: n_q, block_table: &table },
                &mut layer,
            )
            .unwrap();
            let scale = 1.0 / (hd as f32).sqrt();
            let mut out = vec![f32::NAN; q.len()];
            let span = SeqSpan { start_pos: start, n_tokens: n_q, block_table: &table };
            paged_attention(
                &q,
                nh,
                scale,
                span,
                KvLayerRef { k: &kc, v: &vc, block_size: bs, n_kv_heads: kvh, head_dim: hd },
                &mut out,
            )
            .unwrap();
            let want = dense(&q, &k, &v, n_q, start, nh, kvh, hd, scale);
            let err: f64 = out.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt();
            let norm: f64 = want.iter().map(|b| b * b).sum::<f64>().sqrt();
            assert!(err / norm < 1e-5, "case start={start} n_q={n_q}: rel err {}", err / norm);
        }
    }

    /// Window, soft-cap and sinks against a dense f64 evaluation of their definitions, over a
    /// prefix plus a chunk longer than the window; the default extras equal `paged_attention`.
    #[test]
    fn extras_match_their_definitions() {
        let mut rng = StdRng::seed_from_u64(11);
        let (start, n_q, nh, kvh, hd, bs) = (21usize, 9usize, 4usize, 2usize, 8usize, 4usize);
        let total = start + n_q;
        let num_blocks = total.div_ceil(bs) + 2;
        let mut table: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, rng.random_range(0..=i));
        }
        let stride = kvh * hd;
        let k: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-2.0..2.0)).collect();
        let v: Vec<f32> = (0..total * stride).map(|_| rng.random_range(-1.0..1.0)).collect();
        let q: Vec<f32> = (0..n_q * nh * hd).map(|_| rng.random_range(-2.0..2.0)).collect();
        let sinks: Vec<f32> = (0..nh).map(|_| rng.random_range(-1.0..3.0)).collect();
        let mut kc = vec![f32::NAN; num_blocks * bs * stride];
        let mut vc = vec![f32::NAN; num_blocks * bs * stride];
        let mut layer = KvLayerMut { k: &mut kc, v: &mut vc, block_size: bs, n_kv_heads: kvh, head_dim: hd };
        let all = SeqSpan { start_pos: 0, n_tokens: total, block_table: &table };
        write_kv(&k, &v, all, &mut layer).unwrap();
        let span = SeqSpan { start_pos: start, n_tokens: n_q, block_table: &table };
        let cache = KvLayerRef { k: &kc, v: &vc, block_size: bs, n_kv_heads: kvh, head_dim: hd };
        let scale = 0.3f32;
        let run = |extras: AttnExtras<'_>| {
            let mut out = vec![f32::NAN; q.len()];
            paged_attention_ext(&q, nh, scale, span, cache, extras, &mut out).unwrap();
            out
        };
        let dense = |window: Option<usize>, cap: Option<f64>, sink: bool| -> Vec<f64> {
            let mut out = vec![0.0; q.len()];
            for t in 0..n_q {
                let pos = start + t;
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in 0..nh {
                    let kh = h / (nh / kvh);
                    let score = |p: usize| {
                        let s = (0..hd)
                            .map(|d| q[(t * nh + h) * hd + d] as f64 * k[(p * kvh + kh) * hd + d] as f64)
                            .sum::<f64>()
                            * scale as f64;
                        cap.map_or(s, |c| c * (s / c).tanh())
                    };
                    let e: Vec<f64> = (lo..=pos).map(|p| score(p).exp()).collect();
                    let z = e.iter().sum::<f64>() + if sink { (sinks[h] as f64).exp() } else { 0.0 };
                    for d in 0..hd {
                        out[(t * nh + h) * hd + d] =
                            (lo..=pos).map(|p| e[p - lo] / z * v[(p * kvh + kh) * hd + d] as f64).sum();
                    }
                }
            }
            out
        };
        let rel = |a: &[f32], b: &[f64]| {
            let err: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum::<f64>().sqrt();
            err / b.iter().map(|y| y * y).sum::<f64>().sqrt()
        };
        let plain = run(AttnExtras::default());
        let mut want = vec![f32::NAN; q.len()];
        paged_attention(&q, nh, scale, span, cache, &mut want).unwrap();
        assert_eq!(plain, want);
        for (window, cap, sink) in
            [(Some(5), None, false), (None, Some(1.5f32), false), (None, None, true), (Some(7), Some(0.8), true)]
        {
            let got = run(AttnExtras { window, softcap: cap, sinks: sink.then_some(&sinks[..]) });
            let e = rel(&got, &dense(window, cap.map(f64::from), sink));
            assert!(e < 1e-5, "window {window:?} cap {cap:?} sink {sink}: rel err {e}");
            assert!(rel(&got, &dense(None, None, false)) > 1e-3, "{window:?} {cap:?} {sink} changed nothing");
        }
        // A window of one token returns each query's own V.
        let own = run(AttnExtras { window: Some(1), ..Default::default() });
        for t in 0..n_q {
            for h in 0..nh {
                let kh = h / (nh / kvh);
                let want = &v[((start + t) * kvh + kh) * hd..((start + t) * kvh + kh + 1) * hd];
                assert_eq!(&own[(t * nh + h) * hd..(t * nh + h + 1) * hd], want);
            }
        }
        let bad = AttnExtras { window: Some(0), ..Default::default() };
        assert!(paged_attention_ext(&q, nh, scale, span, cache, bad, &mut vec![0.0; q.len()]).is_err());
        let bad = AttnExtras { sinks: Some(&sinks[..2]), ..Default::default() };
        assert!(paged_attention_ext(&q, nh, scale, span, cache, bad, &mut vec![0.0; q.len()]).is_err());
    }

    #[test]
    fn short_block_table_is_an_error() {
        let kc = vec![0.0f32; 4 * 4 * 8];
        let q = vec![0.5f32; 8];
        let mut out = vec![0.0; 8];
        let span = SeqSpan { start_pos: 4, n_tokens: 1, block_table: &[0] };
        let r = paged_attention(
            &q,
            1,
            1.0,
            span,
            KvLayerRef { k: &kc, v: &kc, block_size: 4, n_kv_heads: 1, head_dim: 8 },
            &mut out,
        );
        assert!(r.is_err());
    }
}
