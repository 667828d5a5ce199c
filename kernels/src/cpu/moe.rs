//! Mixture-of-experts plumbing around the expert GEMMs: routing (each token's top-k experts
//! and their weights), the permutation that groups the token-expert assignments by expert,
//! the grouped expert linear layer over that grouping, and the un-permute that sums each
//! token's expert outputs with its weights (plus an optional shared expert's output).
//!
//! Terms: `rows` tokens, `n_experts` experts, `k` experts per token. An *assignment* is one
//! (token, choice) pair, indexed `a = row · k + j`; `ids[a]` is its expert and `weights[a]`
//! its routing weight. The permutation orders assignments by expert, and within an expert by
//! assignment index (stable, so the order is a pure function of `ids`).
//!
//! Routing covers the published routers:
//! - softmax over all experts, top-k, renormalised over the k (Mixtral; Qwen3-MoE with
//!   `norm_topk_prob`; gpt-oss, whose top-k-then-softmax is the same function) or not
//!   (Qwen2-MoE, Qwen3-MoE without `norm_topk_prob`);
//! - sigmoid scores, top-k, optionally renormalised (DeepSeek-V3-style scoring, without its
//!   expert groups or selection bias).
//!
//! Ties in the top-k go to the lower expert index.

use super::{KernelError, check};
use rayon::prelude::*;

/// How router logits become expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeScoring {
    /// `softmax(logits)` over all experts.
    Softmax,
    /// `sigmoid(logit)` per expert.
    Sigmoid,
}

/// One router's configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeRouting {
    /// Experts per token (`num_experts_per_tok`), 1 ≤ k ≤ experts.
    pub k: usize,
    /// Scores from logits.
    pub scoring: MoeScoring,
    /// Divide the k chosen scores by their sum (`norm_topk_prob`; always for Mixtral/gpt-oss).
    pub renormalize: bool,
    /// Multiplies the final weights (`routed_scaling_factor`; 1 for most models).
    pub scale: f32,
}

/// Each row's top-k experts and weights: `logits` is `rows × n_experts`; `ids` and `weights`
/// are `rows × k`, best expert first.
pub fn moe_route(
    logits: &[f32],
    n_experts: usize,
    routing: MoeRouting,
    ids: &mut [u32],
    weights: &mut [f32],
) -> Result<(), KernelError> {
    let k = routing.k;
    check("moe_route", n_experts > 0 && logits.len().is_multiple_of(n_experts), || {
        format!("{} logits are not rows of {n_experts} experts", logits.len())
    })?;
    let rows = logits.len() / n_experts;
    check("moe_route", (1..=n_experts).contains(&k), || format!("k = {k} with {n_experts} experts"))?;
    check("moe_route", ids.len() == rows * k && weights.len() == rows * k, || {
        format!("ids {} and weights {} for {rows} rows × k {k}", ids.len(), weights.len())
    })?;
    ids.par_chunks_mut(k).zip(weights.par_chunks_mut(k)).zip(logits.par_chunks(n_experts)).for_each(
        |((id, w), row)| {
            let scores: Vec<f64> = match routing.scoring {
                MoeScoring::Softmax => {
                    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                    let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
                    let s: f64 = e.iter().sum();
                    e.iter().map(|v| v / s).collect()
                }
                MoeScoring::Sigmoid => row.iter().map(|&v| 1.0 / (1.0 + (-(v as f64)).exp())).collect(),
            };
            let mut order: Vec<usize> = (0..n_experts).collect();
            // Higher score first, lower index on ties (a stable sort keeps index order).
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
            let chosen = &order[..k];
            let sum: f64 = chosen.iter().map(|&e| scores[e]).sum();
            let norm = if routing.renormalize { sum } else { 1.0 };
            for (j, &e) in chosen.iter().enumerate() {
                id[j] = e as u32;
                w[j] = (scores[e] / norm * routing.scale as f64) as f32;
            }
        },
    );
    Ok(())
}

/// The assignments grouped by expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoePermutation {
    /// `n_experts + 1` prefix offsets: expert `e`'s assignments are `order[offsets[e]..offsets[e + 1]]`.
    pub offsets: Vec<u32>,
    /// Assignment indices (`row · k + j`) in expert order; the token of entry `p` is `order[p] / k`.
    pub order: Vec<u32>,
    /// The inverse: assignment `a` sits at `order` position `position[a]`.
    pub position: Vec<u32>,
}

/// Groups the assignments `ids` (`rows × k`, any k) by expert, stably.
pub fn moe_permute(ids: &[u32], n_experts: usize) -> Result<MoePermutation, KernelError> {
    check("moe_permute", ids.iter().all(|&e| (e as usize) < n_experts), || {
        format!("an expert id is not below {n_experts}")
    })?;
    check("moe_permute", u32::try_from(ids.len()).is_ok(), || format!("{} assignments", ids.len()))?;
    let mut offsets = vec![0u32; n_experts + 1];
    for &e in ids {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..n_experts {
        offsets[e + 1] += offsets[e];
    }
    let mut cursor = offsets.clone();
    let mut order = vec![0u32; ids.len()];
    let mut position = vec![0u32; ids.len()];
    for (a, &e) in ids.iter().enumerate() {
        let p = cursor[e as usize];
        cursor[e as usize] += 1;
        order[p as usize] = a as u32;
        position[a] = p;
    }
    Ok(MoePermutation { offsets, order, position })
}

/// Which rows of `x` the grouped linear layer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeRows {
    /// One row per token: entry `p` reads token `order[p] / k` (the first projection, straight
    /// from the hidden states, no gathered copy).
    PerToken,
    /// One row per permuted entry: entry `p` reads row `p` (the second projection, over the
    /// first one's activated output).
    Permuted,
}

/// All experts' weights of one projection: `w` is `n_experts × n × d`, each expert's `n × d`
/// matrix in the HF `[out, in]` layout.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// The values.
    pub w: &'a [f32],
    /// Output width.
    pub n: usize,
    /// Input width.
    pub d: usize,
    /// Each expert's bias, `n_experts × n` (gpt-oss); `None` for none.
    pub bias: Option<&'a [f32]>,
}

/// The grouped expert linear layer: `out[p] = x[src(p)] · w[e]ᵀ` for every permuted entry `p`
/// of expert `e`, `src` as [`MoeRows`] says. `out` is `entries × n`.
pub fn moe_grouped_linear(
    x: &[f32],
    rows: MoeRows,
    w: ExpertWeights<'_>,
    perm: &MoePermutation,
    k: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n_experts = perm.offsets.len().saturating_sub(1);
    let entries = perm.order.len();
    let ExpertWeights { w, n, d, bias } = w;
    check("moe_grouped_linear", d > 0 && n > 0 && k > 0 && w.len() == n_experts * n * d, || {
        format!("w has {} values for {n_experts} experts × {n} × {d} (k = {k})", w.len())
    })?;
    check("moe_grouped_linear", bias.is_none_or(|b| b.len() == n_experts * n), || {
        format!("bias is not {n_experts} experts × {n}")
    })?;
    let x_rows = if rows == MoeRows::Permuted { entries } else { entries / k };
    check("moe_grouped_linear", x.len() == x_rows * d && out.len() == entries * n, || {
        format!("x {} values (want {x_rows} × {d}), out {} (want {entries} × {n})", x.len(), out.len())
    })?;
    let expert_of: Vec<usize> =
        (0..n_experts).flat_map(|e| std::iter::repeat_n(e, (perm.offsets[e + 1] - perm.offsets[e]) as usize)).collect();
    out.par_chunks_mut(n).enumerate().for_each(|(p, o)| {
        let src = if rows == MoeRows::Permuted { p } else { perm.order[p] as usize / k };
        let xr = &x[src * d..(src + 1) * d];
        let we = &w[expert_of[p] * n * d..(expert_of[p] + 1) * n * d];
        for (c, oc) in o.iter_mut().enumerate() {
            let b = bias.map_or(0.0, |b| b[expert_of[p] * n + c] as f64);
            *oc = (b + xr.iter().zip(&we[c * d..(c + 1) * d]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()) as f32;
        }
    });
    Ok(())
}

/// `out[r] = Σ_j weights[r·k + j] · expert_out[position[r·k + j]] (+ shared[r])`: each token's
/// expert outputs (`expert_out` is `rows·k × d` in permuted order) summed with its routing
/// weights, plus the shared expert's output when there is one. `out` is `rows × d`.
pub fn moe_unpermute(
    expert_out: &[f32],
    d: usize,
    perm: &MoePermutation,
    weights: &[f32],
    k: usize,
    shared: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let entries = perm.position.len();
    check("moe_unpermute", d > 0 && k > 0 && entries.is_multiple_of(k) && weights.len() == entries, || {
        format!("{entries} assignments, {} weights, k = {k}", weights.len())
    })?;
    let rows = entries / k;
    check("moe_unpermute", expert_out.len() == entries * d && out.len() == rows * d, || {
        format!("expert_out {} values (want {entries} × {d}), out {} (want {rows} × {d})", expert_out.len(), out.len())
    })?;
    check("moe_unpermute", shared.is_none_or(|s| s.len() == rows * d), || "shared output is not rows × d".into())?;
    out.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
        for (i, oi) in o.iter_mut().enumerate() {
            let mut acc = shared.map_or(0.0, |s| s[r * d + i] as f64);
            for j in 0..k {
                let p = perm.position[r * k + j] as usize;
                acc += weights[r * k + j] as f64 * expert_out[p * d + i] as f64;
            }
            *oi = acc as f32;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(logits: &[f32], e: usize, routing: MoeRouting) -> (Vec<u32>, Vec<f32>) {
        let rows = logits.len() / e;
        let (mut ids, mut w) = (vec![u32::MAX; rows * routing.k], vec![f32::NAN; rows * routing.k]);
        moe_route(logits, e, routing, &mut ids, &mut w).unwrap();
        (ids, w)
    }

    #[test]
    fn softmax_routing_picks_the_top_k_and_renormalizes_when_asked() {
        let logits = [0.5f32, 2.0, -1.0, 1.0, /* row 1 */ 3.0, 3.0, 0.0, -2.0];
        let soft = MoeRouting { k: 2, scoring: MoeScoring::Softmax, renormalize: false, scale: 1.0 };
        let (ids, w) = route(&logits, 4, soft);
        // Row 1 ties experts 0 and 1: the lower index first.
        assert_eq!(ids, [1, 3, 0, 1]);
        let z: f64 = logits[..4].iter().map(|v| (*v as f64).exp()).sum();
        assert!((w[0] as f64 - 2f64.exp() / z).abs() < 1e-6);
        assert!((w[1] as f64 - 1f64.exp() / z).abs() < 1e-6);
        // Renormalized: softmax over the chosen logits alone (Mixtral's and gpt-oss's form), scaled.
        let (ids2, w2) = route(&logits, 4, MoeRouting { renormalize: true, scale: 2.5, ..soft });
        assert_eq!(ids2, ids);
        let s = 2f64.exp() + 1f64.exp();
        assert!((w2[0] as f64 - 2.5 * 2f64.exp() / s).abs() < 1e-6);
        assert!((w2[2] - 1.25).abs() < 1e-6 && (w2[3] - 1.25).abs() < 1e-6);
    }

    #[test]
    fn a_row_of_nan_logits_gets_in_range_ids_and_nan_weights() {
        // An overflowed activation must not send an assignment to no expert (the CUDA
        // permutation could not place it); its output is NaN, as its input was.
        for scoring in [MoeScoring::Softmax, MoeScoring::Sigmoid] {
            let r = MoeRouting { k: 2, scoring, renormalize: true, scale: 1.0 };
            let (ids, w) = route(&[f32::NAN; 8], 4, r);
            assert!(ids.iter().all(|&e| e < 4) && w.iter().all(|x| x.is_nan()), "{scoring:?}: {ids:?} {w:?}");
        }
    }

    #[test]
    fn sigmoid_routing_scores_each_expert_alone() {
        let logits = [0.0f32, -1.0, 4.0, 1.0];
        let r = MoeRouting { k: 3, scoring: MoeScoring::Sigmoid, renormalize: false, scale: 1.0 };
        let (ids, w) = route(&logits, 4, r);
        assert_eq!(ids, [2, 3, 0]);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        for (j, x) in [4.0, 1.0, 0.0].iter().enumerate() {
            assert!((w[j] as f64 - sig(*x)).abs() < 1e-6);
        }
        let (_, wn) = route(&logits, 4, MoeRouting { renormalize: true, ..r });
        assert!((wn.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let bad = MoeRouting { k: 5, ..r };
        assert!(moe_route(&logits, 4, bad, &mut [0; 5], &mut [0.0; 5]).is_err());
    }

    #[test]
    fn permutation_groups_by_expert_stably_and_inverts() {
        // 4 tokens, k = 2, 3 experts (expert 1 unused).
        let ids = [2u32, 0, 0, 2, 2, 0, 0, 2];
        let p = moe_permute(&ids, 3).unwrap();
        assert_eq!(p.offsets, [0, 4, 4, 8]);
        assert_eq!(p.order, [1, 2, 5, 6, 0, 3, 4, 7]);
        for (a, &pos) in p.position.iter().enumerate() {
            assert_eq!(p.order[pos as usize] as usize, a);
        }
        assert!(moe_permute(&[3], 3).is_err());
    }

    #[test]
    fn grouped_linear_and_unpermute_equal_the_per_token_loop() {
        // 3 tokens, k = 2, 3 experts, d = 4 in, n = 2 out.
        let (rows, k, ne, d, n) = (3usize, 2usize, 3usize, 4usize, 2usize);
        let x: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.31).sin()).collect();
        let w: Vec<f32> = (0..ne * n * d).map(|i| (i as f32 * 0.17).cos()).collect();
        let ids = [1u32, 0, 1, 2, 0, 1];
        let weights = [0.75f32, 0.25, 0.5, 0.5, 0.9, 0.1];
        let shared: Vec<f32> = (0..rows * n).map(|i| i as f32).collect();
        let p = moe_permute(&ids, ne).unwrap();
        let mut y = vec![f32::NAN; rows * k * n];
        moe_grouped_linear(&x, MoeRows::PerToken, ExpertWeights { w: &w, n, d, bias: None }, &p, k, &mut y).unwrap();
        let mut out = vec![f32::NAN; rows * n];
        moe_unpermute(&y, n, &p, &weights, k, Some(&shared), &mut out).unwrap();
        for r in 0..rows {
            for c in 0..n {
                let mut want = shared[r * n + c] as f64;
                for j in 0..k {
                    let e = ids[r * k + j] as usize;
                    let dot: f64 = (0..d).map(|i| x[r * d + i] as f64 * w[(e * n + c) * d + i] as f64).sum();
                    want += weights[r * k + j] as f64 * dot;
                }
                assert!((out[r * n + c] as f64 - want).abs() < 1e-5, "row {r} col {c}");
            }
        }
        // Already permuted input: the second projection reads row p for entry p.
        let mut y2 = vec![f32::NAN; rows * k * n];
        let xp: Vec<f32> =
            p.order.iter().flat_map(|&a| x[(a as usize / k) * d..(a as usize / k + 1) * d].to_vec()).collect();
        moe_grouped_linear(&xp, MoeRows::Permuted, ExpertWeights { w: &w, n, d, bias: None }, &p, k, &mut y2).unwrap();
        assert_eq!(y2, y);
        // With a bias: every entry of expert e gains bias[e].
        let bias: Vec<f32> = (0..ne * n).map(|i| i as f32 * 0.5).collect();
        let mut yb = vec![f32::NAN; rows * k * n];
        let wb = ExpertWeights { w: &w, n, d, bias: Some(&bias) };
        moe_grouped_linear(&x, MoeRows::PerToken, wb, &p, k, &mut yb).unwrap();
        for e in 0..ne {
            for q in p.offsets[e] as usize..p.offsets[e + 1] as usize {
                for c in 0..n {
                    assert!((yb[q * n + c] - y[q * n + c] - bias[e * n + c]).abs() < 1e-5);
                }
            }
        }
        assert!(moe_unpermute(&y, n, &p, &weights[..5], k, None, &mut out).is_err());
    }
}
