//! Mapping of OpenAI/vLLM request fields onto engine [`SamplingParams`].
//!
//! Integer fields arrive as `i64` so that negative values are reported here with the field's
//! name; range checks that the engine's [`SamplingParams::validate`] already performs (float
//! ranges, vocabulary bounds) are left to it, so each rule lives in one place.

use super::protocol::SamplingFields;
use crate::error::FrontendError;
use baton_core::params::{MAX_N, MAX_TOP_LOGPROBS, SamplingParams};

/// Endpoint-specific inputs to [`sampling_params`].
#[derive(Debug, Clone, Copy, Default)]
pub struct EndpointParams {
    /// The max-tokens value and the name the client used for it
    /// (`max_tokens` or `max_completion_tokens`).
    pub max_tokens: Option<(&'static str, i64)>,
    /// Used when the client gave no max tokens (`None`: up to the context length).
    pub default_max_tokens: Option<usize>,
    /// Top-logprobs count, already validated by the endpoint, when logprobs are requested.
    pub logprobs: Option<usize>,
}

/// A non-negative count named `param`.
pub fn count(param: &'static str, value: i64) -> Result<usize, FrontendError> {
    usize::try_from(value)
        .map_err(|_| FrontendError::invalid(param, format!("{param} must be non-negative, got {value}")))
}

/// A top-logprobs count in `0..=MAX_TOP_LOGPROBS` named `param`.
pub fn top_logprobs(param: &'static str, value: i64) -> Result<usize, FrontendError> {
    match usize::try_from(value) {
        Ok(k) if k <= MAX_TOP_LOGPROBS => Ok(k),
        _ => Err(FrontendError::invalid(param, format!("{param} must be in [0, {MAX_TOP_LOGPROBS}], got {value}"))),
    }
}

fn token_id(param: &'static str, value: i64) -> Result<u32, FrontendError> {
    u32::try_from(value).map_err(|_| FrontendError::invalid(param, format!("{param}: {value} is not a valid token id")))
}

/// Engine sampling parameters for a request's fields. Only shape and sign are checked here;
/// ranges are checked by [`SamplingParams::validate`] when the request is prepared.
pub fn sampling_params(fields: &SamplingFields, endpoint: EndpointParams) -> Result<SamplingParams, FrontendError> {
    let defaults = SamplingParams::default();
    let n = match fields.n {
        None => 1,
        Some(v) => match usize::try_from(v) {
            Ok(n) if (1..=MAX_N).contains(&n) => n,
            _ => return Err(FrontendError::invalid("n", format!("n must be in [1, {MAX_N}], got {v}"))),
        },
    };
    let max_tokens = match endpoint.max_tokens {
        None => endpoint.default_max_tokens,
        Some((param, v)) if v < 1 => {
            return Err(FrontendError::invalid(param, format!("{param} must be at least 1, got {v}")));
        }
        Some((param, v)) => Some(count(param, v)?),
    };
    let top_k = match fields.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(v) if v < 0 => {
            return Err(FrontendError::invalid("top_k", format!("top_k must be -1 (disabled) or at least 1, got {v}")));
        }
        Some(v) => count("top_k", v)?,
    };
    let stop_token_ids = fields
        .stop_token_ids
        .iter()
        .flatten()
        .map(|&t| token_id("stop_token_ids", t))
        .collect::<Result<Vec<_>, _>>()?;
    let mut logit_bias = Vec::new();
    for (key, &bias) in fields.logit_bias.iter().flatten() {
        let id = key.trim().parse::<u32>().map_err(|_| {
            FrontendError::invalid("logit_bias", format!("logit_bias keys must be token ids, got {key:?}"))
        })?;
        logit_bias.push((id, bias as f32));
    }
    Ok(SamplingParams {
        n,
        temperature: fields.temperature.map_or(defaults.temperature, |v| v as f32),
        top_p: fields.top_p.map_or(defaults.top_p, |v| v as f32),
        top_k,
        min_p: fields.min_p.map_or(defaults.min_p, |v| v as f32),
        repetition_penalty: fields.repetition_penalty.map_or(defaults.repetition_penalty, |v| v as f32),
        presence_penalty: fields.presence_penalty.map_or(defaults.presence_penalty, |v| v as f32),
        frequency_penalty: fields.frequency_penalty.map_or(defaults.frequency_penalty, |v| v as f32),
        // Negative seeds are accepted (as by vLLM) and reinterpreted bit for bit.
        seed: fields.seed.map(|s| s as u64),
        stop: fields.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids,
        include_stop_str_in_output: fields.include_stop_str_in_output.unwrap_or(false),
        max_tokens,
        min_tokens: fields.min_tokens.map(|v| count("min_tokens", v)).transpose()?.unwrap_or(0),
        ignore_eos: fields.ignore_eos.unwrap_or(false),
        logprobs: endpoint.logprobs,
        prompt_logprobs: fields.prompt_logprobs.map(|k| top_logprobs("prompt_logprobs", k)).transpose()?,
        logit_bias,
        skip_special_tokens: fields.skip_special_tokens.unwrap_or(true),
        structured: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::protocol::StopField;
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).expect("fields")
    }

    #[test]
    fn maps_every_field() {
        let f = fields(
            r#"{"n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": -0.4,
                "seed": -1, "stop": "x", "stop_token_ids": [3], "min_tokens": 2, "ignore_eos": true,
                "logit_bias": {"7": -100, " 9": 5.5}, "include_stop_str_in_output": true,
                "skip_special_tokens": false}"#,
        );
        let p = sampling_params(
            &f,
            EndpointParams { max_tokens: Some(("max_tokens", 10)), default_max_tokens: Some(16), logprobs: Some(3) },
        )
        .expect("valid");
        assert_eq!(p.n, 2);
        assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p), (0.5, 0.9, 5, 0.1));
        assert_eq!((p.repetition_penalty, p.presence_penalty, p.frequency_penalty), (1.2, 0.3, -0.4));
        assert_eq!(p.seed, Some(u64::MAX));
        assert_eq!(p.stop, vec!["x".to_owned()]);
        assert_eq!(p.stop_token_ids, vec![3]);
        assert_eq!((p.max_tokens, p.min_tokens, p.logprobs), (Some(10), 2, Some(3)));
        assert!(p.ignore_eos && p.include_stop_str_in_output && !p.skip_special_tokens);
        assert_eq!(p.logit_bias, vec![(9, 5.5), (7, -100.0)]);
        assert!(matches!(StopField::One("a".into()).into_vec().as_slice(), [s] if s == "a"));
    }

    #[test]
    fn defaults_and_top_k_minus_one() {
        let p = sampling_params(
            &fields(r#"{"top_k": -1}"#),
            EndpointParams { default_max_tokens: Some(16), ..Default::default() },
        )
        .expect("valid");
        assert_eq!(p.top_k, 0);
        assert_eq!(p.max_tokens, Some(16));
        assert_eq!(p.n, 1);
        assert!(p.skip_special_tokens);
    }

    #[test]
    fn bad_values_name_their_param() {
        let ep = EndpointParams::default();
        let cases = [
            (r#"{"n": 0}"#, ep, "n"),
            (r#"{"n": -3}"#, ep, "n"),
            (r#"{"n": 100000}"#, ep, "n"),
            (r#"{"top_k": -5}"#, ep, "top_k"),
            (r#"{"min_tokens": -1}"#, ep, "min_tokens"),
            (r#"{"stop_token_ids": [-1]}"#, ep, "stop_token_ids"),
            (r#"{"logit_bias": {"abc": 1}}"#, ep, "logit_bias"),
            ("{}", EndpointParams { max_tokens: Some(("max_tokens", -1)), ..ep }, "max_tokens"),
            ("{}", EndpointParams { max_tokens: Some(("max_completion_tokens", 0)), ..ep }, "max_completion_tokens"),
        ];
        for (json, ep, param) in cases {
            let err = sampling_params(&fields(json), ep).expect_err(json);
            assert_eq!(err.param(), Some(param), "{json}: {err}");
        }
        assert_eq!(top_logprobs("logprobs", 21).expect_err("21").param(), Some("logprobs"));
        assert_eq!(top_logprobs("top_logprobs", -1).expect_err("-1").param(), Some("top_logprobs"));
        assert_eq!(top_logprobs("logprobs", 20).expect("20"), 20);
    }
}
