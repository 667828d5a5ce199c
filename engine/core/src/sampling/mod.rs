//! The sampler: the CPU reference that turns one row of logits into the next
//! token. The CUDA backend implements the same pipeline and must give the same
//! tokens for the same seed wherever floating-point rounding allows, so every step
//! is defined exactly here.
//!
//! Pipeline for one row `x` (vocabulary `V`), in this order:
//!
//! 0. **Sanitise**: NaN becomes `-inf`, `+inf` becomes `f32::MAX`, so no later step
//!    produces NaN. The argmax of this raw row (lowest id among ties) is kept as the
//!    fallback token.
//! 1. **Logprobs** (when `params.logprobs` is `Some(k)`): the log-softmax of the raw
//!    row, before any processing (vLLM's `raw_logprobs`): the sampled token's
//!    logprob plus the `k` most likely tokens, ties by lower id ([`LogSoftmax`],
//!    [`top_entries`]).
//! 2. **logit_bias**: `x[id] += bias` per entry.
//! 3. **min_tokens**: while `output_token_ids.len() < min_tokens`, the EOS ids
//!    (unless `ignore_eos`, when EOS ends nothing) and `stop_token_ids` get `-inf`.
//! 4. **repetition_penalty** `r` (HF/vLLM), once per distinct token of prompt ∪
//!    output: `x / r` if `x > 0`, else `x * r`.
//! 5. **frequency/presence** (OpenAI), per token generated `c > 0` times:
//!    `x -= frequency * c + presence`.
//!
//!    5b. **Grammar mask** (when the context carries `allowed`, a [`TokenMask`] from
//!    the sequence's structured-output grammar): every id the mask does not allow
//!    gets `-inf`. Steps 2–5b alone are [`process_logits`].
//! 6. **Greedy** (`params.is_greedy()`, or a temperature that is not a positive
//!    finite number): the argmax of the processed row, ties to the lowest id. Done.
//! 7. **Weights** ([`truncated_weights`]), with `m` the processed maximum:
//!    `w = exp((x - m) / T)` (so the argmax weighs exactly 1); then top_k keeps
//!    `w >= ` the k-th largest weight (ties kept); top_p ranks tokens by weight
//!    descending, id ascending, and keeps a token iff the weight ranked before it is
//!    `< top_p * sum(w)` (the first always stays); min_p keeps `w >= min_p`. Removed
//!    tokens get weight 0.
//! 8. **Draw**: `u = uniform(seed, position)` with `position = output_token_ids.len()`
//!    ([`random_bits`] documents the SplitMix64 formula); the token is the first id,
//!    in ascending order, whose running weight sum exceeds `u * sum(w)`
//!    ([`draw_inverse_cdf`]).
//!
//! If processing leaves every logit at `-inf`, the token is the raw argmax of
//! step 0, taken among the allowed ids when there is a mask (so a grammar always
//! wins over `min_tokens`; a mask that allows nothing falls back to the plain raw
//! argmax, and the engine then fails that sequence's grammar). Sums are f64; the exponential is a polynomial within a few ulp that
//! flushes weights below 1e-38 to 0. A draw depends only on the row, the sequence's
//! own history and `(seed, position)`, never on the rest of the batch, so a preempted
//! and recomputed sequence continues identically. Token ids outside the row (in bias
//! lists, stop lists, histories) are ignored; no input makes this module panic.
//!
//! [`plan_row`] compiles steps 2–5 of one row into per-token ops plus the scalars of
//! steps 6–8, which is what a device sampler executes ([`apply_ops`] is its CPU check).

mod logprobs;
mod penalties;
mod plan;
mod rng;
mod row_ops;
mod truncation;

pub use logprobs::{LogSoftmax, prompt_logprob, top_entries};
pub use plan::{RowPlan, TokenOp, TokenOpKind, apply_ops, plan_row};
pub use rng::{random_bits, uniform};
pub use truncation::{draw_inverse_cdf, truncated_weights};

use crate::api::TokenLogprob;
use crate::params::SamplingParams;
use crate::structured::TokenMask;

/// Everything the sampler needs to know about one sequence besides its logits.
#[derive(Debug, Clone, Copy)]
pub struct SamplingContext<'a> {
    /// The sequence's sampling parameters.
    pub params: &'a SamplingParams,
    /// Prompt tokens (the repetition penalty covers them).
    pub prompt_token_ids: &'a [u32],
    /// Tokens generated so far by this sequence; its length is the draw position.
    pub output_token_ids: &'a [u32],
    /// The model's EOS ids (held back by min_tokens unless `ignore_eos`).
    pub eos_token_ids: &'a [u32],
    /// Always set: the engine draws one when `params.seed` is `None`.
    pub seed: u64,
    /// The tokens the sequence's grammar allows at this step (step 5b); `None` when the
    /// sequence is unconstrained.
    pub allowed: Option<&'a TokenMask>,
}

/// The token chosen for one row.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The next token.
    pub token_id: u32,
    /// Its raw logprob and the top alternatives, when `params.logprobs` asked for them.
    pub logprobs: Option<TokenLogprob>,
}

/// Picks the next token from one row of logits (see the module doc for the exact
/// pipeline). Overwrites `logits` with intermediate values. An empty row yields
/// token 0.
pub fn sample(logits: &mut [f32], ctx: &SamplingContext<'_>) -> Sampled {
    let mut raw_argmax = sanitize_row(logits);
    if let Some(mask) = ctx.allowed {
        raw_argmax = masked_argmax(logits, mask).unwrap_or(raw_argmax);
    }
    let raw_logprobs = ctx.params.logprobs.map(|k| RawLogprobs::of(logits, k));
    penalties::apply_penalties(logits, ctx);
    if let Some(mask) = ctx.allowed {
        apply_mask(logits, mask);
    }
    let token = choose(logits, ctx).unwrap_or(raw_argmax);
    Sampled { token_id: token as u32, logprobs: raw_logprobs.map(|raw| raw.for_token(token)) }
}

/// Samples every row of a row-major `rows × vocab` matrix, row `i` with `ctxs[i]`.
/// Rows are independent: the result equals calling [`sample`] on each row, whatever
/// the batch's order or size. Large batches are spread over scoped threads (up to
/// the machine's parallelism). A context whose row is missing from `logits` (a caller
/// bug) is sampled from an empty row.
pub fn sample_batch(logits: &mut [f32], vocab: usize, ctxs: &[SamplingContext<'_>]) -> Vec<Sampled> {
    let mut rows: Vec<Option<&mut [f32]>> =
        if vocab == 0 { Vec::new() } else { logits.chunks_exact_mut(vocab).map(Some).collect() };
    rows.resize_with(ctxs.len(), || None);
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(ctxs.len().saturating_mul(vocab) / MIN_LOGITS_PER_THREAD)
        .min(ctxs.len());
    if threads <= 1 {
        return sample_rows(&mut rows, ctxs);
    }
    let per_thread = ctxs.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let workers: Vec<_> = rows
            .chunks_mut(per_thread)
            .zip(ctxs.chunks(per_thread))
            .map(|(rows, ctxs)| scope.spawn(move || sample_rows(rows, ctxs)))
            .collect();
        let mut out = Vec::with_capacity(ctxs.len());
        for worker in workers {
            match worker.join() {
                Ok(part) => out.extend(part),
                // Sampling does not panic; if it ever did, the bug surfaces here unchanged.
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        out
    })
}

/// Below this many logits per thread, spawning costs more than it saves (about a
/// millisecond of sampling work per thread).
const MIN_LOGITS_PER_THREAD: usize = 1 << 20;

/// Samples `rows[i]` with `ctxs[i]`; a missing row is sampled as an empty one.
fn sample_rows(rows: &mut [Option<&mut [f32]>], ctxs: &[SamplingContext<'_>]) -> Vec<Sampled> {
    rows.iter_mut()
        .zip(ctxs)
        .map(|(row, ctx)| match row {
            Some(row) => sample(row, ctx),
            None => sample(&mut [], ctx),
        })
        .collect()
}

/// Steps 0 and 2–5b alone: the processed logits that greedy decoding takes the argmax
/// of and that [`truncated_weights`] starts from. For testing other implementations.
pub fn process_logits(logits: &mut [f32], ctx: &SamplingContext<'_>) {
    sanitize_row(logits);
    penalties::apply_penalties(logits, ctx);
    if let Some(mask) = ctx.allowed {
        apply_mask(logits, mask);
    }
}

/// Step 5b: every id `mask` does not allow gets `-inf` (ids past the mask's length too).
pub fn apply_mask(row: &mut [f32], mask: &TokenMask) {
    for (id, x) in row.iter_mut().enumerate() {
        if !mask.allows(id as u32) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// The argmax of a sanitised row among the ids `mask` allows (lowest id among ties);
/// `None` when the mask allows no id of the row.
fn masked_argmax(row: &[f32], mask: &TokenMask) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (id, &x) in row.iter().enumerate() {
        if mask.allows(id as u32) && best.is_none_or(|(_, b)| x > b) {
            best = Some((id, x));
        }
    }
    best.map(|(id, _)| id)
}

/// Steps 6–8 on a processed row; `None` when every logit is `-inf`.
fn choose(row: &mut [f32], ctx: &SamplingContext<'_>) -> Option<usize> {
    let params = ctx.params;
    let t = params.temperature;
    if params.is_greedy() || !(t > 0.0 && t.is_finite()) {
        return row_ops::argmax(row).map(|(id, _)| id);
    }
    let argmax = truncated_weights(row, params)?;
    let u = uniform(ctx.seed, ctx.output_token_ids.len() as u64);
    Some(draw_inverse_cdf(row, u).unwrap_or(argmax))
}

/// NaN becomes `-inf` and `+inf` becomes `f32::MAX`: the one rule every step applies
/// to the values it produces, so comparisons and sums never see NaN.
fn sanitize(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x.min(f32::MAX) }
}

/// Sanitises a raw row in place and returns its argmax (lowest id among ties; 0 when
/// the row is empty or entirely `-inf`).
fn sanitize_row(row: &mut [f32]) -> usize {
    for x in row.iter_mut() {
        *x = sanitize(*x);
    }
    row_ops::argmax(row).map_or(0, |(id, _)| id)
}

/// What step 1 keeps of the raw row so the logprobs survive processing.
struct RawLogprobs {
    softmax: LogSoftmax,
    top: Vec<(u32, f32)>,
    /// The raw row: processing overwrites `logits`, and the token is not known yet.
    raw: Vec<f32>,
}

impl RawLogprobs {
    fn of(row: &[f32], k: usize) -> Self {
        Self { softmax: LogSoftmax::of(row), top: top_entries(row, k), raw: row.to_vec() }
    }

    fn for_token(self, token: usize) -> TokenLogprob {
        let raw = self.raw.get(token).copied().unwrap_or(f32::NEG_INFINITY);
        TokenLogprob {
            token_id: token as u32,
            logprob: self.softmax.logprob(raw),
            top: self.top.iter().map(|&(id, x)| (id, self.softmax.logprob(x))).collect(),
        }
    }
}
