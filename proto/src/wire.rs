//! Conversions between the engine's plain data (`baton-core`) and the worker-internal
//! protobuf messages (`baton.worker.v1`): sampling parameters, grammars, engine outputs, KV
//! layouts, and the status a worker answers for a grammar that does not compile. Used on both
//! ends: the router encodes requests and decodes events, the worker does the opposite.
//!
//! Invariant: decoding is total: a malformed message becomes a [`WireError`], never a panic.

use crate::worker as pb;
use baton_core::api::{EngineOutput, FinishReason, PromptLogprob, TokenLogprob};
use baton_core::kv_transfer::{KvDtype, KvLayout};
use baton_core::params::SamplingParams;
use baton_core::structured::GrammarSpec;

/// A worker message that does not decode into engine data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed worker message: {0}")]
pub struct WireError(pub String);

/// Engine parameters → wire (the router's side).
pub fn sampling_to_wire(p: &SamplingParams) -> pb::Sampling {
    pb::Sampling {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u32,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        stop_token_ids: p.stop_token_ids.clone(),
        max_tokens: p.max_tokens.map(|m| m as u32),
        min_tokens: p.min_tokens as u32,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs.map(|k| k as u32),
        logit_bias: p.logit_bias.iter().map(|&(token_id, bias)| pb::LogitBias { token_id, bias }).collect(),
        structured: p.structured.as_ref().map(grammar_to_wire),
        prompt_logprobs: p.prompt_logprobs.map(|k| k as u32),
    }
}

/// A grammar spec → wire.
pub fn grammar_to_wire(g: &GrammarSpec) -> pb::Grammar {
    use pb::grammar::Kind;
    let kind = match g {
        GrammarSpec::JsonObject => Kind::JsonObject(pb::JsonObject {}),
        GrammarSpec::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        GrammarSpec::Regex(s) => Kind::Regex(s.clone()),
        GrammarSpec::Choice(c) => Kind::Choice(pb::Choices { choices: c.clone() }),
        GrammarSpec::Lark(s) => Kind::Lark(s.clone()),
    };
    pb::Grammar { kind: Some(kind) }
}

/// Wire → grammar spec; a grammar with no kind is malformed (the sizes are the engine's to
/// check, with every other parameter).
pub fn grammar_from_wire(g: pb::Grammar) -> Result<GrammarSpec, WireError> {
    use pb::grammar::Kind;
    Ok(match g.kind.ok_or_else(|| WireError("a grammar with no kind".into()))? {
        Kind::JsonObject(pb::JsonObject {}) => GrammarSpec::JsonObject,
        Kind::JsonSchema(s) => GrammarSpec::JsonSchema(s),
        Kind::Regex(s) => GrammarSpec::Regex(s),
        Kind::Choice(c) => GrammarSpec::Choice(c.choices),
        Kind::Lark(s) => GrammarSpec::Lark(s),
    })
}

/// Wire → engine parameters (the worker's side). Stop strings stay with the router, which
/// detokenizes; the worker's engine validates the rest as for any request.
pub fn sampling_from_wire(p: Option<pb::Sampling>) -> Result<SamplingParams, WireError> {
    let p = p.ok_or_else(|| WireError("the request has no sampling parameters".into()))?;
    Ok(SamplingParams {
        n: 1,
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as usize,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        stop: Vec::new(),
        stop_token_ids: p.stop_token_ids,
        include_stop_str_in_output: false,
        max_tokens: p.max_tokens.map(|m| m as usize),
        min_tokens: p.min_tokens as usize,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs.map(|k| k as usize),
        prompt_logprobs: p.prompt_logprobs.map(|k| k as usize),
        logit_bias: p.logit_bias.into_iter().map(|b| (b.token_id, b.bias)).collect(),
        skip_special_tokens: true,
        structured: p.structured.map(grammar_from_wire).transpose()?,
    })
}

/// Metadata key of a worker's INVALID_ARGUMENT status for a grammar that does not compile:
/// its value is the spec kind, the status message the compiler's reason.
pub const GRAMMAR_KIND_METADATA: &str = "baton-invalid-grammar";

/// The request's own fault carried by a worker's status, when it is one: a grammar that
/// does not compile (the router checked everything else before sending).
pub fn invalid_grammar_of(status: &tonic::Status) -> Option<baton_core::api::EngineError> {
    if status.code() != tonic::Code::InvalidArgument {
        return None;
    }
    let kind = status.metadata().get(GRAMMAR_KIND_METADATA)?.to_str().ok()?.to_owned();
    Some(baton_core::api::EngineError::InvalidGrammar { kind, message: status.message().to_owned() })
}

/// One engine output → the `tokens` event, its first token at output position `index`.
pub fn output_to_wire(o: &EngineOutput, index: usize) -> pb::Tokens {
    pb::Tokens {
        index: index as u32,
        token_ids: o.new_token_ids.clone(),
        logprobs: o
            .logprobs
            .iter()
            .map(|l| pb::TokenLogprob { token_id: l.token_id, logprob: l.logprob, top: top_to_wire(&l.top) })
            .collect(),
        finish_reason: o.finish_reason.map(|f| f.as_openai_str().to_owned()).unwrap_or_default(),
        stop_token: o.stop_token,
        num_prompt_tokens: o.num_prompt_tokens as u32,
        num_cached_tokens: o.num_cached_tokens as u32,
        prompt_logprobs: o.prompt_logprobs.iter().map(prompt_logprob_to_wire).collect(),
    }
}

fn top_to_wire(top: &[(u32, f32)]) -> Vec<pb::TopLogprob> {
    top.iter().map(|&(token_id, logprob)| pb::TopLogprob { token_id, logprob }).collect()
}

fn prompt_logprob_to_wire(p: &Option<PromptLogprob>) -> pb::PromptLogprob {
    match p {
        None => pb::PromptLogprob::default(),
        Some(p) => pb::PromptLogprob {
            present: true,
            token_id: p.token_id,
            logprob: p.logprob,
            rank: p.rank,
            top: top_to_wire(&p.top),
        },
    }
}

fn prompt_logprob_from_wire(p: pb::PromptLogprob) -> Option<PromptLogprob> {
    p.present.then(|| PromptLogprob {
        token_id: p.token_id,
        logprob: p.logprob,
        rank: p.rank,
        top: p.top.into_iter().map(|x| (x.token_id, x.logprob)).collect(),
    })
}

/// The `tokens` event → (output position of its first token, engine output).
pub fn output_from_wire(t: pb::Tokens) -> Result<(usize, EngineOutput), WireError> {
    let finish_reason = match t.finish_reason.as_str() {
        "" => None,
        "stop" => Some(FinishReason::Stop),
        "length" => Some(FinishReason::Length),
        "abort" => Some(FinishReason::Abort),
        other => return Err(WireError(format!("unknown finish reason {other:?}"))),
    };
    if !t.logprobs.is_empty() && t.logprobs.len() != t.token_ids.len() {
        return Err(WireError(format!("{} logprobs for {} tokens", t.logprobs.len(), t.token_ids.len())));
    }
    if !t.prompt_logprobs.is_empty() && t.prompt_logprobs.len() != t.num_prompt_tokens as usize {
        return Err(WireError(format!(
            "{} prompt logprobs for {} prompt tokens",
            t.prompt_logprobs.len(),
            t.num_prompt_tokens
        )));
    }
    let out = EngineOutput {
        new_token_ids: t.token_ids,
        logprobs: t
            .logprobs
            .into_iter()
            .map(|l| TokenLogprob {
                token_id: l.token_id,
                logprob: l.logprob,
                top: l.top.into_iter().map(|x| (x.token_id, x.logprob)).collect(),
            })
            .collect(),
        finish_reason,
        stop_token: t.stop_token,
        num_prompt_tokens: t.num_prompt_tokens as usize,
        num_cached_tokens: t.num_cached_tokens as usize,
        prompt_logprobs: t.prompt_logprobs.into_iter().map(prompt_logprob_from_wire).collect(),
    };
    Ok((t.index as usize, out))
}

/// KV layout → wire.
pub fn layout_to_wire(l: &KvLayout) -> pb::KvLayout {
    pb::KvLayout {
        num_layers: l.num_layers as u32,
        block_size: l.block_size as u32,
        num_kv_heads: l.num_kv_heads as u32,
        head_dim: l.head_dim as u32,
        dtype: match l.dtype {
            KvDtype::F32 => "f32",
            KvDtype::BF16 => "bf16",
            KvDtype::F16 => "f16",
            KvDtype::Fp8E4M3 => "fp8_e4m3",
        }
        .to_owned(),
    }
}

/// Wire → KV layout.
pub fn layout_from_wire(l: &pb::KvLayout) -> Result<KvLayout, WireError> {
    let dtype = match l.dtype.as_str() {
        "f32" => KvDtype::F32,
        "bf16" => KvDtype::BF16,
        "f16" => KvDtype::F16,
        "fp8_e4m3" => KvDtype::Fp8E4M3,
        other => return Err(WireError(format!("unknown KV dtype {other:?}"))),
    };
    if l.block_size == 0 || l.num_layers == 0 {
        return Err(WireError("a KV layout with zero layers or a zero block size".into()));
    }
    Ok(KvLayout {
        num_layers: l.num_layers as usize,
        block_size: l.block_size as usize,
        num_kv_heads: l.num_kv_heads as usize,
        head_dim: l.head_dim as usize,
        dtype,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_round_trips_except_the_router_only_fields() {
        let p = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            min_p: 0.05,
            repetition_penalty: 1.1,
            presence_penalty: 0.5,
            frequency_penalty: -0.5,
            seed: Some(99),
            stop_token_ids: vec![7, 8],
            max_tokens: Some(33),
            min_tokens: 2,
            ignore_eos: true,
            logprobs: Some(4),
            prompt_logprobs: Some(0),
            logit_bias: vec![(5, -100.0), (6, 2.5)],
            ..SamplingParams::default()
        };
        let back = sampling_from_wire(Some(sampling_to_wire(&p))).expect("decodes");
        assert_eq!(back, p);
        assert!(sampling_from_wire(None).is_err());
    }

    #[test]
    fn grammars_round_trip_and_a_grammar_without_a_kind_is_an_error() {
        for g in [
            GrammarSpec::JsonObject,
            GrammarSpec::JsonSchema(r#"{"type":"integer"}"#.into()),
            GrammarSpec::Regex("a+".into()),
            GrammarSpec::Choice(vec!["x".into(), String::new()]),
            GrammarSpec::Lark("start: \"y\"".into()),
        ] {
            let p = SamplingParams { structured: Some(g), ..SamplingParams::default() };
            assert_eq!(sampling_from_wire(Some(sampling_to_wire(&p))).expect("decodes"), p);
        }
        let mut bad = sampling_to_wire(&SamplingParams::default());
        bad.structured = Some(pb::Grammar { kind: None });
        assert!(sampling_from_wire(Some(bad)).is_err());
    }

    #[test]
    fn outputs_round_trip_and_bad_ones_are_errors() {
        let o = EngineOutput {
            new_token_ids: vec![11],
            logprobs: vec![TokenLogprob { token_id: 11, logprob: -0.25, top: vec![(11, -0.25), (3, -2.0)] }],
            finish_reason: Some(FinishReason::Length),
            stop_token: None,
            num_prompt_tokens: 3,
            num_cached_tokens: 0,
            prompt_logprobs: vec![
                None,
                Some(PromptLogprob { token_id: 4, logprob: -1.5, rank: 2, top: vec![(9, -0.5)] }),
                Some(PromptLogprob { token_id: 8, logprob: -0.1, rank: 1, top: vec![] }),
            ],
        };
        assert_eq!(output_from_wire(output_to_wire(&o, 5)).expect("decodes"), (5, o.clone()));
        let plain = EngineOutput { prompt_logprobs: Vec::new(), ..o.clone() };
        assert_eq!(output_from_wire(output_to_wire(&plain, 1)).expect("decodes"), (1, plain));
        let mut bad = output_to_wire(&o, 0);
        bad.prompt_logprobs.pop();
        assert!(output_from_wire(bad).is_err(), "prompt logprobs must cover the prompt");
        let mut bad = output_to_wire(&o, 0);
        bad.finish_reason = "exploded".into();
        assert!(output_from_wire(bad).is_err());
        let mut bad = output_to_wire(&o, 0);
        bad.token_ids.push(12);
        assert!(output_from_wire(bad).is_err());
    }

    #[test]
    fn only_grammar_statuses_are_invalid_grammars() {
        let mut s = tonic::Status::invalid_argument("unclosed group");
        assert_eq!(invalid_grammar_of(&s), None);
        s.metadata_mut().insert(GRAMMAR_KIND_METADATA, "regex".parse().expect("ascii"));
        assert_eq!(
            invalid_grammar_of(&s),
            Some(baton_core::api::EngineError::InvalidGrammar {
                kind: "regex".into(),
                message: "unclosed group".into()
            })
        );
        let mut other = tonic::Status::internal("x");
        other.metadata_mut().insert(GRAMMAR_KIND_METADATA, "regex".parse().expect("ascii"));
        assert_eq!(invalid_grammar_of(&other), None);
    }

    #[test]
    fn layouts_round_trip() {
        let l = KvLayout { num_layers: 2, block_size: 16, num_kv_heads: 4, head_dim: 64, dtype: KvDtype::BF16 };
        assert_eq!(layout_from_wire(&layout_to_wire(&l)).expect("decodes"), l);
        let fp8 = KvLayout { dtype: KvDtype::Fp8E4M3, ..l };
        assert_eq!(layout_to_wire(&fp8).dtype, "fp8_e4m3");
        assert_eq!(layout_from_wire(&layout_to_wire(&fp8)).expect("decodes"), fp8);
        let mut bad = layout_to_wire(&l);
        bad.dtype = "int4".into();
        assert!(layout_from_wire(&bad).is_err());
    }
}
