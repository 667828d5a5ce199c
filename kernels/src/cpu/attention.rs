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

fn slot_offset(
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
    let stride = kvh * hd;
    // Resolve every position's slot once; all heads and queries share it.
    let offsets: Vec<usize> = (0..total)
        .map(|p| slot_offset(span.block_table, p, cache.block_size, stride, cache.k.len()))
        .collect::<Result<_, _>>()?;
    let group = n_heads / kvh;
    out.par_chunks_mut(hd).enumerate().for_each(|(row, o)| {
        let t = row / n_heads;
        let h = row % n_heads;
        let kv_off = (h / group) * hd;
        let qv = &q[row * hd..(row + 1) * hd];
        let mut m = f32::NEG_INFINITY;
        let mut l = 0.0f32;
        let mut acc = vec![0.0f32; hd];
        for &off in &offsets[..span.start_pos + t + 1] {
            let kr = &cache.k[off + kv_off..off + kv_off + hd];
            let s = qv.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale;
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
        for (dst, a) in o.iter_mut().zip(&acc) {
            *dst = a / l;
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
