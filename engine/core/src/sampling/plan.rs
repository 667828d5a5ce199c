//! One row's sampling compiled for a device sampler: the sparse steps 2–5 of the
//! pipeline as a list of per-token ops, plus the scalars of steps 6–8 and the draw's
//! uniform number, so a GPU kernel needs neither the request nor its history.
//!
//! Why a list of ops is exact: every processor of steps 2–5 reads and writes only the
//! logit of the one id it names, so ops on different ids commute, and sorting the ops
//! stably by id keeps, for each id, the pipeline's own order (bias entries in list
//! order, then the min_tokens mask, the repetition penalty, the frequency/presence
//! subtraction). Applying a row's ops in that order with the same f32 operations gives
//! bit for bit what [`super::process_logits`] gives ([`apply_ops`] is that reference,
//! and the tests check it on random rows).
//!
//! Invariants: ops name only ids `< vocab`; ops of one id are contiguous and in
//! pipeline order; the scalars are normalised so that a device sampler needs no
//! knowledge of the defaults (`top_k == 0`, `top_p >= 1`, `min_p == 0` mean "off").

use super::{SamplingContext, sanitize, uniform};
use crate::structured::TokenMask;

/// What one op does to the logit `x` of its token (each result is sanitised).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TokenOpKind {
    /// Step 2, `logit_bias`: `x + bias`.
    Bias(f32),
    /// Step 3, `min_tokens`: `-inf`.
    Mask,
    /// Step 4, repetition penalty `r`: `x / r` when `x > 0`, else `x * r`.
    Repetition(f32),
    /// Step 5, frequency/presence: `x - (frequency * count + presence)` (the value given).
    Subtract(f32),
}

/// One op on one token id.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenOp {
    /// The token it touches (always inside the row).
    pub id: u32,
    /// What it does.
    pub kind: TokenOpKind,
}

impl TokenOp {
    /// The op applied to one sanitised logit, exactly as the CPU processors compute it.
    pub fn apply(&self, x: f32) -> f32 {
        match self.kind {
            TokenOpKind::Bias(b) => sanitize(x + b),
            TokenOpKind::Mask => f32::NEG_INFINITY,
            TokenOpKind::Repetition(r) => sanitize(if x > 0.0 { x / r } else { x * r }),
            TokenOpKind::Subtract(s) => sanitize(x - s),
        }
    }
}

/// Everything a device sampler needs for one row (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct RowPlan {
    /// Steps 2–5, sorted by id, each id's ops in pipeline order.
    pub ops: Vec<TokenOp>,
    /// Step 6 applies: the token is the processed argmax.
    pub greedy: bool,
    /// Temperature (positive and finite whenever `greedy` is false).
    pub temperature: f32,
    /// top_k, 0 when off (also when `>= vocab`, where it removes nothing).
    pub top_k: usize,
    /// top_p, `>= 1` when off.
    pub top_p: f32,
    /// The min_p floor on weights (already capped at 1), 0 when off.
    pub min_p: f32,
    /// `Some(k)`: the sampled token's raw logprob and the `k` best raw entries
    /// (`k` capped at the vocabulary).
    pub logprobs: Option<usize>,
    /// The draw's `uniform(seed, position)`.
    pub u: f64,
    /// Step 5b: the grammar's allowed tokens, applied after the ops (ids the mask does
    /// not allow get `-inf`); `None` when unconstrained. Cheap to clone.
    pub allowed: Option<TokenMask>,
}

/// Compiles the sampling of one row of `vocab` logits for `ctx`.
pub fn plan_row(ctx: &SamplingContext<'_>, vocab: usize) -> RowPlan {
    let params = ctx.params;
    let in_row = |id: u32| (id as usize) < vocab;
    let mut ops = Vec::new();
    for &(id, bias) in params.logit_bias.iter().filter(|(id, _)| in_row(*id)) {
        ops.push(TokenOp { id, kind: TokenOpKind::Bias(bias) });
    }
    if ctx.output_token_ids.len() < params.min_tokens {
        let eos: &[u32] = if params.ignore_eos { &[] } else { ctx.eos_token_ids };
        let mut masked: Vec<u32> = eos.iter().chain(&params.stop_token_ids).copied().filter(|&id| in_row(id)).collect();
        // Masking twice is masking once.
        masked.sort_unstable();
        masked.dedup();
        ops.extend(masked.into_iter().map(|id| TokenOp { id, kind: TokenOpKind::Mask }));
    }
    let penalty = params.repetition_penalty;
    if penalty != 1.0 {
        let mut seen: Vec<u32> =
            ctx.prompt_token_ids.iter().chain(ctx.output_token_ids).copied().filter(|&id| in_row(id)).collect();
        seen.sort_unstable();
        seen.dedup();
        ops.extend(seen.into_iter().map(|id| TokenOp { id, kind: TokenOpKind::Repetition(penalty) }));
    }
    let (freq, presence) = (params.frequency_penalty, params.presence_penalty);
    if (freq != 0.0 || presence != 0.0) && !ctx.output_token_ids.is_empty() {
        let mut sorted = ctx.output_token_ids.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b).filter(|run| in_row(run[0])) {
            // The same f32 expression as the CPU processor, so the value is bit-equal.
            let sub = freq * run.len() as f32 + presence;
            ops.push(TokenOp { id: run[0], kind: TokenOpKind::Subtract(sub) });
        }
    }
    // Stable: the ops of one id keep their pipeline order.
    ops.sort_by_key(|op| op.id);
    let t = params.temperature;
    let greedy = params.is_greedy() || !(t > 0.0 && t.is_finite());
    RowPlan {
        ops,
        greedy,
        temperature: t,
        top_k: if params.top_k > 0 && params.top_k < vocab { params.top_k } else { 0 },
        top_p: if params.top_p < 1.0 { params.top_p } else { 1.0 },
        min_p: if params.min_p > 0.0 { params.min_p.min(1.0) } else { 0.0 },
        logprobs: params.logprobs.map(|k| k.min(vocab)),
        u: uniform(ctx.seed, ctx.output_token_ids.len() as u64),
        allowed: ctx.allowed.cloned(),
    }
}

/// Sanitises a raw row and applies a plan's ops: bit-equal to [`super::process_logits`]
/// for the context the plan was built from. The CPU reference for device samplers.
pub fn apply_ops(row: &mut [f32], ops: &[TokenOp]) {
    for x in row.iter_mut() {
        *x = sanitize(*x);
    }
    for op in ops {
        if let Some(x) = row.get_mut(op.id as usize) {
            *x = op.apply(*x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::process_logits;
    use super::*;
    use crate::params::SamplingParams;

    /// A small xorshift generator: the tests need no external crate.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn bits(row: &[f32]) -> Vec<u32> {
        row.iter().map(|x| x.to_bits()).collect()
    }

    fn random_row(rng: &mut Rng, vocab: usize) -> Vec<f32> {
        (0..vocab)
            .map(|_| match rng.below(40) {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => 0.0,
                4 => -0.0,
                5 => f32::MAX,
                _ => (rng.unit() - 0.5) * 30.0,
            })
            .collect()
    }

    fn ids(rng: &mut Rng, max_n: u64, vocab: usize) -> Vec<u32> {
        // A few ids past the row's end: they must be ignored.
        let n = rng.below(max_n + 1);
        (0..n).map(|_| rng.below(vocab as u64 + 3) as u32).collect()
    }

    #[test]
    fn ops_reproduce_process_logits_bit_for_bit() {
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        for round in 0..400 {
            let vocab = 1 + rng.below(300) as usize;
            let mut params = SamplingParams {
                temperature: rng.unit() * 2.0,
                repetition_penalty: if rng.below(3) == 0 { 1.0 } else { 0.2 + rng.unit() * 3.0 },
                frequency_penalty: if rng.below(3) == 0 { 0.0 } else { (rng.unit() - 0.5) * 4.0 },
                presence_penalty: if rng.below(3) == 0 { 0.0 } else { (rng.unit() - 0.5) * 4.0 },
                min_tokens: rng.below(6) as usize,
                ignore_eos: rng.below(2) == 0,
                ..SamplingParams::default()
            };
            params.stop_token_ids = ids(&mut rng, 3, vocab);
            params.logit_bias = ids(&mut rng, 7, vocab)
                .into_iter()
                .map(|id| (id, if rng.below(5) == 0 { f32::MAX } else { (rng.unit() - 0.5) * 200.0 }))
                .collect();
            // Repeated bias ids add up in list order.
            if let Some(&first) = params.logit_bias.first() {
                params.logit_bias.push(first);
            }
            let prompt = ids(&mut rng, 39, vocab);
            let output = ids(&mut rng, 11, vocab);
            let eos = ids(&mut rng, 2, vocab);
            let ctx = SamplingContext {
                params: &params,
                prompt_token_ids: &prompt,
                output_token_ids: &output,
                eos_token_ids: &eos,
                seed: round,
                allowed: None,
            };
            let raw = random_row(&mut rng, vocab);
            let mut want = raw.clone();
            process_logits(&mut want, &ctx);
            let plan = plan_row(&ctx, vocab);
            assert!(plan.ops.iter().all(|op| (op.id as usize) < vocab), "round {round}");
            assert!(plan.ops.windows(2).all(|w| w[0].id <= w[1].id), "round {round}");
            let mut got = raw.clone();
            apply_ops(&mut got, &plan.ops);
            assert_eq!(bits(&got), bits(&want), "round {round}");
            assert_eq!(plan.u, uniform(round, output.len() as u64));
        }
    }

    #[test]
    fn scalars_are_normalised() {
        let ctx_for = |p: &SamplingParams| {
            plan_row(
                &SamplingContext {
                    params: p,
                    prompt_token_ids: &[],
                    output_token_ids: &[1, 2],
                    eos_token_ids: &[],
                    seed: 9,
                    allowed: None,
                },
                100,
            )
        };
        let p = SamplingParams { temperature: 0.7, top_k: 100, top_p: 1.0, min_p: 3.0, ..SamplingParams::default() };
        let plan = ctx_for(&p);
        assert!(!plan.greedy);
        assert_eq!((plan.top_k, plan.top_p, plan.min_p), (0, 1.0, 1.0));
        let p = SamplingParams { temperature: 0.7, top_k: 5, top_p: 0.9, logprobs: Some(500), ..p };
        let plan = ctx_for(&p);
        assert_eq!((plan.top_k, plan.top_p, plan.logprobs), (5, 0.9, Some(100)));
        assert_eq!(plan.u, uniform(9, 2));
        assert!(ctx_for(&SamplingParams::greedy()).greedy);
        assert!(ctx_for(&SamplingParams { temperature: 1.0, top_k: 1, ..SamplingParams::default() }).greedy);
        assert!(ctx_for(&SamplingParams { temperature: f32::INFINITY, ..SamplingParams::default() }).greedy);
    }

    #[test]
    fn edge_cases() {
        // Out-of-range ids vanish; empty lists give no ops.
        let p = SamplingParams {
            logit_bias: vec![(7, 1.0), (1000, 2.0)],
            repetition_penalty: 1.5,
            min_tokens: 3,
            stop_token_ids: vec![999],
            ..SamplingParams::default()
        };
        let ctx = SamplingContext {
            params: &p,
            prompt_token_ids: &[3, 3, 500],
            output_token_ids: &[],
            eos_token_ids: &[9, 9],
            seed: 0,
            allowed: None,
        };
        let plan = plan_row(&ctx, 10);
        assert_eq!(
            plan.ops,
            vec![
                TokenOp { id: 3, kind: TokenOpKind::Repetition(1.5) },
                TokenOp { id: 7, kind: TokenOpKind::Bias(1.0) },
                TokenOp { id: 9, kind: TokenOpKind::Mask },
            ]
        );
        let plain = SamplingParams::default();
        let ctx = SamplingContext {
            params: &plain,
            prompt_token_ids: &[1, 2],
            output_token_ids: &[4],
            eos_token_ids: &[0],
            seed: 0,
            allowed: None,
        };
        assert!(plan_row(&ctx, 10).ops.is_empty());
        // A row that processing leaves all -inf: every op is a mask.
        let p = SamplingParams { min_tokens: 1, stop_token_ids: vec![0, 1, 2], ..SamplingParams::default() };
        let ctx = SamplingContext {
            params: &p,
            prompt_token_ids: &[],
            output_token_ids: &[],
            eos_token_ids: &[],
            seed: 0,
            allowed: None,
        };
        let mut row = vec![1.0, 2.0, 3.0];
        apply_ops(&mut row, &plan_row(&ctx, 3).ops);
        assert!(row.iter().all(|&x| x == f32::NEG_INFINITY));
        // An empty row yields no ops at all.
        assert!(plan_row(&ctx, 0).ops.is_empty());
    }
}
