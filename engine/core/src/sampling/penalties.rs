//! Steps 2–5 of the pipeline: the logit processors that run before the
//! greedy/random split. Each touches only the token ids it names, so a row of
//! 128k logits costs time proportional to the prompt and output, not the vocabulary
//! (apart from one vocabulary-sized bitmap for the repetition penalty).
//!
//! Invariants: ids outside the row are ignored, never indexed; every value a
//! processor writes is sanitised (NaN becomes `-inf`, `+inf` becomes `f32::MAX`),
//! so the row stays free of NaN and `+inf` for the steps after it.

use super::{SamplingContext, sanitize};

/// Applies steps 2–5 in order to a sanitised row: logit bias, the min_tokens
/// block, the repetition penalty, then the frequency and presence penalties.
pub(super) fn apply_penalties(row: &mut [f32], ctx: &SamplingContext<'_>) {
    apply_logit_bias(row, ctx);
    apply_min_tokens(row, ctx);
    apply_repetition_penalty(row, ctx);
    apply_frequency_presence(row, ctx);
}

/// Step 2: `row[id] += bias` for each `(id, bias)` pair; repeated ids add up.
fn apply_logit_bias(row: &mut [f32], ctx: &SamplingContext<'_>) {
    for &(id, bias) in &ctx.params.logit_bias {
        if let Some(x) = row.get_mut(id as usize) {
            *x = sanitize(*x + bias);
        }
    }
}

/// Step 3: while fewer than `min_tokens` tokens were generated, the tokens that would
/// end the sequence get `-inf`: `stop_token_ids`, and the EOS ids unless `ignore_eos`
/// (then EOS does not end the sequence, so there is nothing to hold back).
fn apply_min_tokens(row: &mut [f32], ctx: &SamplingContext<'_>) {
    if ctx.output_token_ids.len() >= ctx.params.min_tokens {
        return;
    }
    let eos: &[u32] = if ctx.params.ignore_eos { &[] } else { ctx.eos_token_ids };
    for &id in eos.iter().chain(&ctx.params.stop_token_ids) {
        if let Some(x) = row.get_mut(id as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// Step 4 (HF/vLLM): every distinct token of prompt ∪ output is penalised once:
/// `x / penalty` when `x > 0`, else `x * penalty`.
fn apply_repetition_penalty(row: &mut [f32], ctx: &SamplingContext<'_>) {
    let penalty = ctx.params.repetition_penalty;
    if penalty == 1.0 {
        return;
    }
    let mut seen = vec![0u64; row.len().div_ceil(64)];
    for &id in ctx.prompt_token_ids.iter().chain(ctx.output_token_ids) {
        let id = id as usize;
        let (Some(word), Some(x)) = (seen.get_mut(id / 64), row.get_mut(id)) else {
            continue;
        };
        let bit = 1u64 << (id % 64);
        if *word & bit != 0 {
            continue;
        }
        *word |= bit;
        *x = sanitize(if *x > 0.0 { *x / penalty } else { *x * penalty });
    }
}

/// Step 5 (OpenAI): for each token generated `count > 0` times,
/// `x -= frequency_penalty * count + presence_penalty`. The prompt does not count.
fn apply_frequency_presence(row: &mut [f32], ctx: &SamplingContext<'_>) {
    let (freq, presence) = (ctx.params.frequency_penalty, ctx.params.presence_penalty);
    if (freq == 0.0 && presence == 0.0) || ctx.output_token_ids.is_empty() {
        return;
    }
    let mut sorted = ctx.output_token_ids.to_vec();
    sorted.sort_unstable();
    for run in sorted.chunk_by(|a, b| a == b) {
        if let Some(x) = row.get_mut(run[0] as usize) {
            *x = sanitize(*x - (freq * run.len() as f32 + presence));
        }
    }
}
