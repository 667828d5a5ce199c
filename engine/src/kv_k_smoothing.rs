//! Key smoothing for the FP8 KV cache (`--kv-k-smoothing`, `auto` by default): each layer's
//! keys are stored less one shift vector, the layer's mean key.
//!
//! **Why.** E4M3 keeps three mantissa bits, so a stored key's rounding error grows with its
//! magnitude, and keys carry large offsets shared by every token (a channel of one head whose
//! value barely changes with the token). Storing `k - μ` (`baton_kernels::cpu::write_kv_fp8`,
//! the CUDA `kv_put_key`) rounds only what varies. Attention reads the stored value as the
//! key, unchanged: every score of a query moves by the same `q · μ`, which a softmax does not
//! see, so in exact arithmetic the output is the same and no attention kernel changes. That
//! holds only where the softmax is over `q · k` alone: a soft-cap (a tanh of each score) or a
//! sink logit (a column that does not move) sees the shift, so those models keep unshifted
//! keys ([`crate::models::Architecture::key_shift_blocker`]). SageAttention smooths keys
//! the same way before its INT8 `q · k`.
//!
//! **Where μ comes from.** At start-up, before anything is served, one prefill of a fixed text
//! ([`CALIBRATION_TEXT`]) runs into the empty FP8 cache with no shift ([`calibrate`]); μ is
//! the mean of its stored keys per (KV head, dim), decoded from the codes (so any backend
//! measures it the same way). The same text on the same model gives the same μ on every
//! worker, and nothing depends on what users send first.
//!
//! **Where in the context.** After RoPE, a rotated pair's mean turns with the position at the
//! pair's frequency ω, so a mean measured over the text's first few hundred positions is not
//! the mean at position 5,000. Each pair's measured mean is scaled by `c = max(0, sin θ / θ)`,
//! θ = ω × the served positions past the text ([`spread_over_positions`]). Among shifts along
//! the measured mean, `c = sin θ / θ` minimizes the key offset's square averaged over those
//! positions (RoPE is relative, so the text placed further on has its keys turned by the
//! offset); clamping at 0 keeps the offset at the text's own positions no larger than
//! unshifted. The low frequencies, where models put their large key offsets, keep almost all
//! of it, the fast pairs none, and dims RoPE passes through all of it. Measured on SmolLM2-135M
//! (`engine/examples/perplexity.rs`, 2,048 tokens, KL to the bf16 cache 0.0180 unshifted):
//! 0.0109 with the shift for 8,192 positions, 0.0092 for 2,048; the unscaled mean gave 0.0107,
//! and the mean averaged with its turn over the positions (the full rotation average) 0.0229 at
//! 8,192, worse than no shift, because it fits the far positions at the near ones' expense.
//!
//! Invariants: a layer's shift is set only while no key a later step reads is stored under
//! another shift: at start-up, before the first request; or, on a decode worker, adopted from
//! the first hand-off's sender before the worker has run a step
//! ([`crate::runner::ModelRunner`] as the connector's `KvAccess`). A hand-off whose sender used
//! another shift is requantized into this worker's (`baton_kernels::cpu::requantize_keys_e4m3`).
//! Every shift is finite and `n_kv_heads × head_dim` long, or empty (none).

use crate::backend::{Backend, BackendError, BatchLayout, SeqLayout};
use crate::kv_connector::KvAccess;
use crate::runner::ModelRunner;
use baton_core::kv_transfer::KvDtype;
use std::str::FromStr;

/// The start-up calibration text: the opening of chapter III of *Around the World in Eighty
/// Days* (public domain; the source is described in `bench/data/README.md`). The perplexity
/// figure (`engine/examples/perplexity.rs`) is taken over chapters I and II, so the shift is
/// never measured on the text it is judged on.
pub const CALIBRATION_TEXT: &str = include_str!("../data/kv-k-shift-calibration.txt");

/// The fewest calibration tokens a mean is taken over; with fewer, keys stay unshifted.
pub const MIN_TOKENS: usize = 64;

/// Tokens per step of the calibration prefill (each later chunk attends to the cached ones).
const CHUNK: usize = 256;

/// What `--kv-k-smoothing` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvKSmoothing {
    /// Shift the keys of an FP8 cache wherever the model's attention cannot see the shift
    /// (and say in the log where it can, and why the keys stay unshifted).
    #[default]
    Auto,
    /// Never shift (keys stored as vLLM stores them).
    Off,
}

/// A `--kv-k-smoothing` value that is neither `auto` nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid --kv-k-smoothing '{0}': expected auto or off")]
pub struct ParseKvKSmoothingError(pub String);

impl FromStr for KvKSmoothing {
    type Err = ParseKvKSmoothingError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "off" => Ok(Self::Off),
            _ => Err(ParseKvKSmoothingError(s.to_string())),
        }
    }
}

impl std::fmt::Display for KvKSmoothing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Off => "off",
        })
    }
}

/// Config files spell it as the flag does (`kv_k_smoothing = "off"`).
impl<'de> serde::Deserialize<'de> for KvKSmoothing {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What [`calibrate`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Smoothing {
    /// Every layer's keys are stored less its shift.
    Shifted {
        /// Calibration tokens the means were taken over.
        tokens: usize,
        /// ‖shift‖ over ‖mean at the text's own positions‖, over every layer: how much of the
        /// measured offset the spread over the served positions keeps.
        retained: f32,
        /// The largest |shift| over every layer.
        max_abs: f32,
    },
    /// The keys stay unshifted, for this reason.
    Unshifted(String),
}

/// Ok when `shift` is empty or `stride` finite values, else a device error naming the layer.
pub fn check_shift(layer: usize, shift: &[f32], stride: usize) -> Result<(), BackendError> {
    if !shift.is_empty() && shift.len() != stride {
        return Err(BackendError::Device(format!(
            "layer {layer}'s FP8 key shift has {} values; the cache's keys have {stride}",
            shift.len()
        )));
    }
    if let Some((i, x)) = shift.iter().enumerate().find(|(_, x)| !x.is_finite()) {
        return Err(BackendError::Device(format!("layer {layer}'s FP8 key shift has {x} at {i}")));
    }
    Ok(())
}

/// `mean` (per (KV head, dim), heads of `head_dim`, measured at the text's own positions)
/// scaled for contexts up to `span` positions past them: dims `d < 2 × inv_freq.len()` rotate
/// in pairs `(p, p + inv_freq.len())` at `inv_freq[p]` (the layout every RoPE kernel here
/// uses), and a pair's mean is scaled by `max(0, sin θ / θ)`, `θ = ω span`; the dims past them
/// pass through RoPE and keep their mean (see the module doc for why this factor).
pub fn spread_over_positions(mean: &mut [f32], inv_freq: &[f64], head_dim: usize, span: f64) {
    let half = inv_freq.len();
    if head_dim == 0 || 2 * half > head_dim {
        return;
    }
    for head in mean.chunks_exact_mut(head_dim) {
        for (p, &w) in inv_freq.iter().enumerate() {
            let theta = w * span;
            if theta.abs() < 1e-12 {
                continue;
            }
            let c = (theta.sin() / theta).max(0.0) as f32;
            head[p] *= c;
            head[p + half] *= c;
        }
    }
}

/// The mean of `n_tokens` rows of key codes (`stride` a row) decoded at `k_scale`, per
/// channel, or `None` when a code is NaN.
pub fn mean_keys(codes: &[u8], n_tokens: usize, stride: usize, k_scale: f32) -> Option<Vec<f32>> {
    if n_tokens == 0 || codes.len() < n_tokens * stride {
        return None;
    }
    let mut sum = vec![0.0f64; stride];
    for row in codes[..n_tokens * stride].chunks_exact(stride) {
        for (s, &c) in sum.iter_mut().zip(row) {
            *s += baton_kernels::cpu::fp8::e4m3_to_f32(c) as f64;
        }
    }
    let mean: Vec<f32> = sum.iter().map(|s| (s / n_tokens as f64 * k_scale as f64) as f32).collect();
    mean.iter().all(|m| m.is_finite()).then_some(mean)
}

/// Measures and sets every layer's key shift (see the module doc): a prefill of `tokens`
/// (the first `max_len` and what `num_blocks` blocks of `block_size` hold) into blocks
/// `0..`, with no shift, then each layer's mean stored key, spread over the positions up to
/// `max_len` ([`spread_over_positions`]).
/// Call it right after the cache is allocated, before anything is served and before
/// `--calculate-kv-scales` arms: the blocks it writes are free again afterwards, and its
/// prefill must not calibrate scales. A cache that is not FP8, a model whose attention sees
/// the shift, or too short a text leaves every shift empty and says why.
pub fn calibrate<B: Backend>(
    runner: &mut ModelRunner<B>,
    tokens: &[u32],
    (num_blocks, block_size): (usize, usize),
    max_len: usize,
) -> Result<Smoothing, BackendError> {
    if runner.kv_dtype() != KvDtype::Fp8E4M3 {
        return Ok(Smoothing::Unshifted("the KV cache is not FP8".into()));
    }
    if let Some(why) = runner.key_shift_blocker() {
        return Ok(Smoothing::Unshifted(format!("the model's attention would see the shift: {why}")));
    }
    let n = tokens.len().min(max_len).min(num_blocks * block_size);
    if n < MIN_TOKENS {
        return Ok(Smoothing::Unshifted(format!(
            "{n} calibration tokens fit (at most {max_len} a sequence, {num_blocks} blocks); {MIN_TOKENS} are needed"
        )));
    }
    let layers = runner.num_layers();
    for layer in 0..layers {
        runner.set_kv_k_shift(layer, &[])?;
    }
    let blocks: Vec<u32> = (0..n.div_ceil(block_size) as u32).collect();
    for start in (0..n).step_by(CHUNK) {
        let len = CHUNK.min(n - start);
        let batch = BatchLayout {
            tokens: tokens[start..start + len].to_vec(),
            positions: (start..start + len).collect(),
            seqs: vec![SeqLayout { row_start: 0, n_tokens: len, start_pos: start, block_table: blocks.clone() }],
            logit_rows: vec![len - 1],
            pending: Vec::new(),
            prompt_logprobs: Vec::new(),
        };
        runner.forward(&batch)?;
    }
    let (head_dim, kv_heads) = runner.key_geometry();
    let stride = kv_heads * head_dim;
    let scales = runner.kv_scales();
    let mut shifts = Vec::with_capacity(layers);
    let (mut measured, mut kept) = (0.0f64, 0.0f64);
    let span = max_len.saturating_sub(n) as f64;
    for layer in 0..layers {
        let (k, _) = runner.read_kv_blocks(layer, &blocks)?;
        let k_scale = scales.get(layer).map_or(1.0, |s| s.k);
        let Some(mut mean) = mean_keys(&k, n, stride, k_scale) else {
            return Ok(Smoothing::Unshifted(format!("layer {layer}'s calibration keys hold a NaN")));
        };
        measured += mean.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
        spread_over_positions(&mut mean, runner.key_rope(layer)?.inv_freq(), head_dim, span);
        kept += mean.iter().map(|&x| (x as f64).powi(2)).sum::<f64>();
        shifts.push(mean);
    }
    let max_abs = shifts.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
    for (layer, shift) in shifts.iter().enumerate() {
        runner.set_kv_k_shift(layer, shift)?;
    }
    runner.forget_written_keys();
    let retained = if measured > 0.0 { (kept / measured).sqrt() as f32 } else { 0.0 };
    Ok(Smoothing::Shifted { tokens: n, retained, max_abs })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rotated_pair_keeps_sinc_of_its_turn_and_pass_through_dims_keep_all() {
        // head_dim 6, rotary over the first 4 dims: pairs (0, 2) at ω = 0.01 and (1, 3) at
        // 1e-6; dims 4 and 5 pass through. Two heads.
        let inv_freq = [0.01, 1e-6];
        let one = [1.0f32, 2.0, -0.5, 3.0, 7.0, -7.0];
        let mut mean: Vec<f32> = one.iter().chain(&one).copied().collect();
        spread_over_positions(&mut mean, &inv_freq, 6, 200.0);
        // θ = 2 for the fast pair: sin 2 / 2 ≈ 0.4546; θ = 2e-4 for the slow one: ≈ 1.
        let c = 2f32.sin() / 2.0;
        for h in 0..2 {
            let got = &mean[h * 6..(h + 1) * 6];
            assert!((got[0] - c).abs() < 1e-6 && (got[2] + 0.5 * c).abs() < 1e-6, "{got:?}");
            assert!((got[1] - 2.0).abs() < 1e-6 && (got[3] - 3.0).abs() < 1e-6, "{got:?}");
            assert_eq!(got[4..], [7.0, -7.0], "pass-through dims");
        }
        // Past θ = π the factor would be negative: 0.
        let mut far = one.to_vec();
        spread_over_positions(&mut far, &inv_freq, 6, 400.0);
        assert_eq!((far[0], far[2]), (0.0, 0.0));
        // The factor is the one that minimizes the mean square of R(Pω)·m - c·m over P in
        // [0, span] (the shifted offset, averaged over the positions), for m along one axis.
        let theta = 2.0f64;
        let mse = |c: f64| {
            (0..=10_000).map(|i| (theta * i as f64 / 1e4).cos()).map(|x| 1.0 - 2.0 * c * x).sum::<f64>() / 10_001.0
                + c * c
        };
        let best = theta.sin() / theta;
        assert!(mse(best) < mse(best + 0.01) && mse(best) < mse(best - 0.01));
        // No span: nothing turns.
        let mut same = one.to_vec();
        spread_over_positions(&mut same, &inv_freq, 6, 0.0);
        assert_eq!(same, one);
    }

    #[test]
    fn the_mean_key_is_decoded_per_channel_and_nan_refuses() {
        use baton_kernels::cpu::fp8::e4m3_from_f32;
        let rows = [[1.0f32, -2.0], [3.0, -2.0], [2.0, 4.0]];
        let codes: Vec<u8> = rows.iter().flatten().map(|&x| e4m3_from_f32(x / 0.5)).collect();
        assert_eq!(mean_keys(&codes, 3, 2, 0.5), Some(vec![2.0, 0.0]));
        assert_eq!(mean_keys(&codes, 2, 2, 0.5), Some(vec![2.0, -2.0]), "only the first n rows");
        assert_eq!(mean_keys(&codes, 4, 2, 0.5), None, "more rows than codes");
        let mut nan = codes.clone();
        nan[3] = 0x7F;
        assert_eq!(mean_keys(&nan, 3, 2, 0.5), None);
    }

    #[test]
    fn shifts_are_empty_or_finite_and_one_value_a_key_channel() {
        assert!(check_shift(0, &[], 4).is_ok());
        assert!(check_shift(0, &[0.5; 4], 4).is_ok());
        let err = check_shift(3, &[0.5; 3], 4).expect_err("wrong length").to_string();
        assert!(err.contains("layer 3") && err.contains("3 values"), "{err}");
        let err = check_shift(1, &[0.0, f32::NAN, 0.0, 0.0], 4).expect_err("NaN").to_string();
        assert!(err.contains("layer 1") && err.contains("NaN"), "{err}");
    }

    #[test]
    fn the_flag_is_auto_or_off() {
        assert_eq!("auto".parse::<KvKSmoothing>(), Ok(KvKSmoothing::Auto));
        assert_eq!(" OFF ".parse::<KvKSmoothing>(), Ok(KvKSmoothing::Off));
        let err = "on".parse::<KvKSmoothing>().expect_err("on is not a value").to_string();
        assert!(err.contains("'on'") && err.contains("auto or off"), "{err}");
        assert_eq!(KvKSmoothing::default().to_string(), "auto");
    }
}
