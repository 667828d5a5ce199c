//! Gemma 2 and Gemma 3 (text) `config.json`s: the fixtures transformers 5 wrote, the same
//! models in transformers 4's keys (`rope_local_base_freq`, `sliding_window_pattern`, no
//! `layer_types`), transformers' defaults where keys are absent, and the refusals (the
//! multimodal Gemma 3, other activations, bidirectional attention).

use std::path::Path;

use baton_formats::{
    Architecture, FormatError, GemmaOptions, LayerType, ModelConfig, RopeParameters, RopeScaling,
    testing::golden_fixtures_dir,
};
use serde_json::{Value, json};

fn parse(v: &Value) -> Result<ModelConfig, FormatError> {
    ModelConfig::from_hf_json(v, Path::new("config.json"))
}

fn fixture(name: &str) -> (Value, ModelConfig) {
    let path = golden_fixtures_dir().join(name).join("config.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    (v, ModelConfig::from_hf_file(&path).expect(name))
}

/// `v` with `edits` merged in (a `null` value removes the key).
fn edit(v: &Value, edits: Value) -> Value {
    let mut v = v.clone();
    for (k, x) in edits.as_object().expect("object") {
        match x {
            Value::Null => {
                v.as_object_mut().expect("object").remove(k);
            }
            _ => v[k] = x.clone(),
        }
    }
    v
}

fn unsupported(v: &Value) -> String {
    match parse(v) {
        Err(e @ FormatError::Unsupported { .. }) => e.to_string(),
        other => panic!("expected an unsupported-option error, got {other:?}"),
    }
}

#[test]
fn gemma2_fixture_parses_with_alternating_windows_and_soft_caps() {
    let (_, c) = fixture("gemma2");
    assert_eq!(c.architecture, Architecture::Gemma2);
    use LayerType::{Full, Sliding};
    assert_eq!(c.layer_types, vec![Sliding, Full, Sliding, Full]);
    assert_eq!(c.sliding_window, Some(16));
    // The window is implemented: the context is not capped at it.
    assert_eq!(c.max_position_embeddings, 512);
    assert_eq!(
        c.gemma,
        Some(GemmaOptions {
            query_pre_attn_scalar: 24.0,
            attn_logit_softcapping: Some(2.0),
            final_logit_softcapping: Some(3.0)
        })
    );
    assert!((c.gemma.expect("gemma").attention_scale() - 24f32.powf(-0.5)).abs() < 1e-7);
    assert!(!c.qk_norm() && c.sliding_rope.is_none());
    let names: Vec<String> = c.expected_tensors().into_iter().map(|t| t.0).collect();
    for n in ["pre_feedforward_layernorm", "post_feedforward_layernorm", "post_attention_layernorm"] {
        assert!(names.contains(&format!("model.layers.3.{n}.weight")), "{n}: {names:?}");
    }
}

#[test]
fn gemma2_in_transformers_4_keys_alternates_and_soft_caps_by_default() {
    let (v, c5) = fixture("gemma2");
    // transformers 4: no layer_types (layer 0 slides, then every other), rope_theta, and the
    // soft-caps absent (transformers' defaults are 50 and 30).
    let v4 = edit(
        &v,
        json!({"layer_types": null, "rope_parameters": null, "rope_theta": 10000.0, "dtype": null,
               "torch_dtype": "float32", "attn_logit_softcapping": null, "final_logit_softcapping": null,
               "hidden_act": "gelu_pytorch_tanh"}),
    );
    let c4 = parse(&v4).expect("transformers 4 gemma2");
    assert_eq!(c4.layer_types, c5.layer_types);
    assert_eq!((c4.rope(), c4.sliding_rope), (c5.rope(), None));
    let g = c4.gemma.expect("gemma options");
    assert_eq!((g.attn_logit_softcapping, g.final_logit_softcapping), (Some(50.0), Some(30.0)));
    // An explicit null switches soft-capping off.
    let mut null_cap = v.clone();
    null_cap["attn_logit_softcapping"] = Value::Null;
    let off = parse(&null_cap).expect("null cap");
    let off = off.gemma.expect("gemma");
    assert_eq!((off.attn_logit_softcapping, off.final_logit_softcapping), (None, Some(3.0)));
    // A null window: every layer attends fully.
    let mut no_window = v.clone();
    no_window["sliding_window"] = Value::Null;
    let full = parse(&no_window).expect("no window");
    assert_eq!(full.layer_types, vec![LayerType::Full; 4]);
    assert_eq!(full.sliding_window, None);
}

#[test]
fn gemma3_text_fixture_parses_with_local_rope_and_q_k_norm() {
    let (_, c) = fixture("gemma3_text");
    assert_eq!(c.architecture, Architecture::Gemma3Text);
    let mut want = vec![LayerType::Sliding; 5];
    want.push(LayerType::Full);
    assert_eq!(c.layer_types, want);
    assert_eq!(c.rope(), RopeParameters { theta: 1.0e6, scaling: Some(RopeScaling::Linear { factor: 8.0 }) });
    assert_eq!(c.rope_for(LayerType::Sliding), RopeParameters { theta: 10000.0, scaling: None });
    assert!(c.qk_norm());
    let g = c.gemma.expect("gemma options");
    assert_eq!((g.query_pre_attn_scalar, g.attn_logit_softcapping, g.final_logit_softcapping), (24.0, None, None));
    let names: Vec<String> = c.expected_tensors().into_iter().map(|t| t.0).collect();
    assert!(names.contains(&"model.layers.5.self_attn.q_norm.weight".to_string()), "{names:?}");
}

#[test]
fn gemma3_text_in_transformers_4_keys_is_the_same_model() {
    let (v, c5) = fixture("gemma3_text");
    let v4 = edit(
        &v,
        json!({"layer_types": null, "_sliding_window_pattern": null, "sliding_window_pattern": 6,
               "rope_parameters": null, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    );
    let c4 = parse(&v4).expect("transformers 4 gemma3_text");
    assert_eq!(c4, c5);
    // The local base defaults to 10000; a pattern of 2 alternates (global every 2nd layer).
    let v4b = edit(&v4, json!({"rope_local_base_freq": null, "sliding_window_pattern": 2}));
    let c = parse(&v4b).expect("pattern 2");
    assert_eq!(c.rope_for(LayerType::Sliding).theta, 10000.0);
    assert_eq!(c.layer_types[..2], [LayerType::Sliding, LayerType::Full]);
    // A round trip through to_hf_json keeps the model.
    assert_eq!(parse(&c5.to_hf_json()).expect("round trip"), c5);
    let (_, g2) = fixture("gemma2");
    assert_eq!(parse(&g2.to_hf_json()).expect("round trip"), g2);
}

#[test]
fn what_gemma_does_not_implement_is_refused_by_name() {
    let (v, _) = fixture("gemma3_text");
    // The multimodal model, by model_type or by class.
    for mm in [
        json!({"model_type": "gemma3"}),
        json!({"model_type": null, "architectures": ["Gemma3ForConditionalGeneration"]}),
    ] {
        let msg = unsupported(&edit(&v, mm));
        assert!(msg.contains("multimodal") && msg.contains("gemma3_text"), "{msg}");
    }
    let msg = unsupported(&edit(&v, json!({"hidden_activation": "silu"})));
    assert!(msg.contains("hidden_activation \"silu\"") && msg.contains("gelu_pytorch_tanh"), "{msg}");
    let msg = unsupported(&edit(&v, json!({"use_bidirectional_attention": true})));
    assert!(msg.contains("use_bidirectional_attention"), "{msg}");
    assert!(parse(&edit(&v, json!({"final_logit_softcapping": -1.0}))).is_err());
    // Gemma's activation is still refused for the Llama family.
    let (g2, _) = fixture("gemma2");
    let msg = unsupported(&edit(&g2, json!({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})));
    assert!(msg.contains("gelu_pytorch_tanh"), "{msg}");
}
