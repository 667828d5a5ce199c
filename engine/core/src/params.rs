//! Sampling parameters of one sequence, and their validation.
//!
//! These are the engine-level parameters: the HTTP/gRPC edges map their own
//! request shapes onto [`SamplingParams`] and call [`SamplingParams::validate`]
//! before submitting. A `SamplingParams` that passed validation never makes the
//! engine panic. `n` lives here because the frontend fans a request out into
//! `n` single-sequence engine requests (see [`SamplingParams::fan_out`]).

use serde::{Deserialize, Serialize};

use crate::structured::{GrammarSpec, MAX_CHOICES, MAX_GRAMMAR_BYTES};

/// Largest `n` (parallel samples) a request may ask for.
pub const MAX_N: usize = 128;
/// Largest number of top logprobs a request may ask for (OpenAI's limit is 20).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Largest number of stop strings. OpenAI allows 4 and vLLM has no cap; 64 is generous for
/// any real use while bounding the frontend's per-token matching work (every stop string is
/// searched in the held-back text after each token).
pub const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in bytes. The frontend holds back up to this many bytes of output
/// while a stop string may be starting, and searches them per token; 1 KiB is far longer
/// than any delimiter a client uses.
pub const MAX_STOP_STRING_BYTES: usize = 1024;
/// Most `logit_bias` entries, as OpenAI allows. Each entry is applied to its row on the
/// engine thread every step.
pub const MAX_LOGIT_BIAS: usize = 300;
/// Most `stop_token_ids`. They are checked against every sampled token (and suppressed
/// under `min_tokens`) on the engine thread every step; 1024 covers every special-token
/// set of the vocabularies Baton serves.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// How one sequence is sampled and when it stops.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Number of sequences the frontend generates for the request (each is its own engine request).
    pub n: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; 1 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` times the top probability; 0 disables it.
    pub min_p: f32,
    /// Multiplicative penalty (>0) on tokens seen in prompt or output; 1 disables it.
    pub repetition_penalty: f32,
    /// Additive penalty on tokens present in the output, in [-2, 2].
    pub presence_penalty: f32,
    /// Penalty per occurrence in the output, in [-2, 2].
    pub frequency_penalty: f32,
    /// Seed for reproducible sampling; `None` draws one from entropy at submit time.
    pub seed: Option<u64>,
    /// Stop strings; matched by the frontend's detokenizer across token boundaries.
    pub stop: Vec<String>,
    /// Token ids that end the sequence (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Whether the matched stop string is kept in the output text.
    pub include_stop_str_in_output: bool,
    /// Most tokens to generate; `None` means up to the context length.
    pub max_tokens: Option<usize>,
    /// EOS and stop tokens are suppressed until this many tokens were generated.
    pub min_tokens: usize,
    /// Do not stop at EOS.
    pub ignore_eos: bool,
    /// `Some(k)`: return the sampled token's logprob and the top `k` alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: also return every prompt token's logprob (given the tokens before it) and
    /// its top `k` alternatives, with the first output (vLLM's `prompt_logprobs`; the
    /// completions `echo` + `logprobs`). The prompt then skips the prefix cache.
    pub prompt_logprobs: Option<usize>,
    /// Additive biases on logits, applied before everything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// Whether detokenized text skips special tokens.
    pub skip_special_tokens: bool,
    /// What the output must match (structured outputs, forced tool calls); `None` is
    /// free text. The engine compiles it and masks every step's logits with it.
    pub structured: Option<GrammarSpec>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            max_tokens: None,
            min_tokens: 0,
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            skip_special_tokens: true,
            structured: None,
        }
    }
}

/// A parameter that failed validation. `param` is the OpenAI field name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    /// Name of the offending field as the client spelled it (e.g. `temperature`).
    pub param: &'static str,
    /// Human-readable explanation including the value received.
    pub message: String,
}

impl ParamError {
    /// Builds an error for `param`.
    pub fn new(param: &'static str, message: impl Into<String>) -> Self {
        Self { param, message: message.into() }
    }
}

fn check_range(param: &'static str, v: f32, lo: f32, hi: f32) -> Result<(), ParamError> {
    if !v.is_finite() || v < lo || v > hi {
        return Err(ParamError::new(param, format!("{param} must be in [{lo}, {hi}], got {v}")));
    }
    Ok(())
}

impl SamplingParams {
    /// Greedy decoding with everything else at its default.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks every field against its legal range. `vocab_size` bounds token ids.
    pub fn validate(&self, vocab_size: usize) -> Result<(), ParamError> {
        if self.n == 0 || self.n > MAX_N {
            return Err(ParamError::new("n", format!("n must be in [1, {MAX_N}], got {}", self.n)));
        }
        check_range("temperature", self.temperature, 0.0, 100.0)?;
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(ParamError::new("top_p", format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 || self.repetition_penalty > 100.0 {
            return Err(ParamError::new(
                "repetition_penalty",
                format!("repetition_penalty must be in (0, 100], got {}", self.repetition_penalty),
            ));
        }
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if let Some(m) = self.max_tokens
            && m == 0
        {
            return Err(ParamError::new("max_tokens", "max_tokens must be at least 1, got 0"));
        }
        if let Some(m) = self.max_tokens
            && self.min_tokens > m
        {
            return Err(ParamError::new(
                "min_tokens",
                format!("min_tokens ({}) must not exceed max_tokens ({m})", self.min_tokens),
            ));
        }
        if let Some(k) = self.logprobs
            && k > MAX_TOP_LOGPROBS
        {
            return Err(ParamError::new(
                "top_logprobs",
                format!("top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}"),
            ));
        }
        if let Some(k) = self.prompt_logprobs
            && k > MAX_TOP_LOGPROBS
        {
            return Err(ParamError::new(
                "prompt_logprobs",
                format!("prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}"),
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(ParamError::new(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings, got {}", self.stop.len()),
            ));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err(ParamError::new("stop", "stop strings must not be empty"));
        }
        if let Some(long) = self.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return Err(ParamError::new(
                "stop",
                format!("stop strings must be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}", long.len()),
            ));
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ParamError::new(
                "stop_token_ids",
                format!("at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {}", self.stop_token_ids.len()),
            ));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(ParamError::new(
                "logit_bias",
                format!("at most {MAX_LOGIT_BIAS} logit_bias entries, got {}", self.logit_bias.len()),
            ));
        }
        for &t in &self.stop_token_ids {
            if t as usize >= vocab_size {
                return Err(ParamError::new(
                    "stop_token_ids",
                    format!("token id {t} is outside the vocabulary (size {vocab_size})"),
                ));
            }
        }
        for &(t, b) in &self.logit_bias {
            if t as usize >= vocab_size {
                return Err(ParamError::new(
                    "logit_bias",
                    format!("token id {t} is outside the vocabulary (size {vocab_size})"),
                ));
            }
            check_range("logit_bias", b, -100.0, 100.0)?;
        }
        if let Some(spec) = &self.structured {
            check_grammar_spec(spec)?;
        }
        Ok(())
    }

    /// The parameters of the `n` single-sequence engine requests a request fans out into.
    /// Each child has `n = 1`; with a seed, child `i` gets `seed + i` so that the children differ
    /// but the whole request stays reproducible.
    pub fn fan_out(&self) -> Vec<SamplingParams> {
        (0..self.n)
            .map(|i| SamplingParams { n: 1, seed: self.seed.map(|s| s.wrapping_add(i as u64)), ..self.clone() })
            .collect()
    }
}

/// The size checks a [`GrammarSpec`] passes before anything compiles it. Whether it
/// compiles is the grammar engine's check; this bounds the work it is given.
fn check_grammar_spec(spec: &GrammarSpec) -> Result<(), ParamError> {
    const PARAM: &str = "structured_outputs";
    if spec.source_bytes() > MAX_GRAMMAR_BYTES {
        return Err(ParamError::new(
            PARAM,
            format!("the {} is {} bytes; at most {MAX_GRAMMAR_BYTES} are allowed", spec.kind(), spec.source_bytes()),
        ));
    }
    if let GrammarSpec::Choice(choices) = spec
        && (choices.is_empty() || choices.len() > MAX_CHOICES)
    {
        return Err(ParamError::new(
            PARAM,
            format!("a choice needs 1 to {MAX_CHOICES} alternatives, got {}", choices.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_name_their_param() {
        assert!(SamplingParams::default().validate(100).is_ok());
        let cases: Vec<(SamplingParams, &str)> = vec![
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
            (SamplingParams { n: 0, ..Default::default() }, "n"),
            (SamplingParams { n: MAX_N + 1, ..Default::default() }, "n"),
            (SamplingParams { max_tokens: Some(0), ..Default::default() }, "max_tokens"),
            (SamplingParams { min_tokens: 5, max_tokens: Some(2), ..Default::default() }, "min_tokens"),
            (SamplingParams { logprobs: Some(21), ..Default::default() }, "top_logprobs"),
            (SamplingParams { prompt_logprobs: Some(21), ..Default::default() }, "prompt_logprobs"),
            (SamplingParams { stop_token_ids: vec![100], ..Default::default() }, "stop_token_ids"),
            (SamplingParams { logit_bias: vec![(3, 200.0)], ..Default::default() }, "logit_bias"),
            (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
            (SamplingParams { presence_penalty: 3.0, ..Default::default() }, "presence_penalty"),
            (SamplingParams { stop: vec!["x".into(); MAX_STOP_STRINGS + 1], ..Default::default() }, "stop"),
            (SamplingParams { stop: vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)], ..Default::default() }, "stop"),
            (
                SamplingParams { stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1], ..Default::default() },
                "stop_token_ids",
            ),
            (SamplingParams { logit_bias: vec![(1, 0.5); MAX_LOGIT_BIAS + 1], ..Default::default() }, "logit_bias"),
            (
                SamplingParams { structured: Some(GrammarSpec::Choice(vec![])), ..Default::default() },
                "structured_outputs",
            ),
            (
                SamplingParams {
                    structured: Some(GrammarSpec::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1))),
                    ..Default::default()
                },
                "structured_outputs",
            ),
        ];
        for (p, name) in cases {
            let err = p.validate(100).expect_err(name);
            assert_eq!(err.param, name, "{err}");
        }
    }

    #[test]
    fn limits_are_inclusive() {
        let at_limit = SamplingParams {
            stop: vec!["s".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS],
            stop_token_ids: vec![7; MAX_STOP_TOKEN_IDS],
            logit_bias: vec![(3, 1.0); MAX_LOGIT_BIAS],
            ..Default::default()
        };
        assert_eq!(at_limit.validate(100), Ok(()));
    }

    #[test]
    fn fan_out_derives_distinct_seeds() {
        let p = SamplingParams { n: 3, seed: Some(7), ..Default::default() };
        let kids = p.fan_out();
        assert_eq!(kids.len(), 3);
        assert_eq!(kids.iter().map(|k| k.seed).collect::<Vec<_>>(), vec![Some(7), Some(8), Some(9)]);
        assert!(kids.iter().all(|k| k.n == 1));
    }
}
