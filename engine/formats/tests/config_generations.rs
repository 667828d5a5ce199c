//! `config.json` of both transformers generations: transformers 4 (`rope_theta`,
//! `rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`, flat or nested per
//! layer type, `dtype`, `layer_types`) parse to the same model, and options that change the
//! math and are not implemented are refused, naming the option.

use std::path::Path;

use baton_formats::{
    Architecture, ConfigDType, FormatError, GptOssOptions, LayerType, ModelConfig, RopeParameters, RopeScaling,
    testing::golden_fixtures_dir,
};
use serde_json::{Value, json};

/// A small Llama config with `extra` merged in (a `null` value removes the key).
fn config(extra: Value) -> Value {
    let mut v = json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "max_position_embeddings": 32768, "hidden_act": "silu"
    });
    for (k, x) in extra.as_object().expect("object") {
        match x {
            Value::Null => {
                v.as_object_mut().expect("object").remove(k);
            }
            _ => v[k] = x.clone(),
        }
    }
    v
}

fn parse(v: &Value) -> Result<ModelConfig, FormatError> {
    ModelConfig::from_hf_json(v, Path::new("config.json"))
}

/// The message of the refusal of `v`, which must be an unsupported-option error.
fn refused(v: &Value) -> String {
    match parse(v) {
        Err(e @ FormatError::Unsupported { .. }) => e.to_string(),
        other => panic!("expected an unsupported-option error, got {other:?}"),
    }
}

const LLAMA3: RopeScaling = RopeScaling::Llama3 {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
};

#[test]
fn both_generations_parse_to_the_same_model() {
    let v4 = config(json!({
        "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    }));
    let v5 = config(json!({
        "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    }));
    let (a, b) = (parse(&v4).expect("v4"), parse(&v5).expect("v5"));
    assert_eq!(a, b);
    assert_eq!(a.rope(), RopeParameters { theta: 500000.0, scaling: Some(LLAMA3) });
    assert_eq!(baton_formats::declared_dtype(&v5, Path::new("c")).expect("dtype"), Some(ConfigDType::BF16));
    assert_eq!(a.layer_types, vec![LayerType::Full; 4]);
    // The legacy `type` key of rope_scaling, and linear scaling.
    let legacy = parse(&config(json!({"rope_scaling": {"type": "linear", "factor": 2.0}}))).expect("legacy type");
    assert_eq!(legacy.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    assert_eq!(legacy.rope_theta, 10000.0);
    // transformers 5 wins where a file carries both (it is what transformers 5 reads).
    let both =
        parse(&config(json!({"rope_theta": 1.0e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0e6}})))
            .expect("both");
    assert_eq!(both.rope_theta, 1.0e6);
}

#[test]
fn nested_rope_parameters_are_read_per_layer_type() {
    let types = json!(["sliding_attention", "full_attention", "sliding_attention", "full_attention"]);
    let nested = |sliding: Value| {
        config(json!({
            "sliding_window": 64, "layer_types": types,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1.0e6},
                                "sliding_attention": sliding}
        }))
    };
    let c = parse(&nested(json!({"rope_type": "default", "rope_theta": 1.0e4}))).expect("nested");
    assert_eq!(c.rope_theta, 1.0e6);
    assert_eq!(c.sliding_rope, Some(RopeParameters { theta: 1.0e4, scaling: None }));
    assert_eq!(c.rope_for(LayerType::Sliding).theta, 1.0e4);
    assert_eq!(c.rope_for(LayerType::Full).theta, 1.0e6);
    assert_eq!(c.layer_types, vec![LayerType::Sliding, LayerType::Full, LayerType::Sliding, LayerType::Full]);
    assert_eq!(c.sliding_window, Some(64));
    // Windowed layers attend within their window: the context is the declared one.
    assert_eq!(c.max_position_embeddings, 32768);
    // The same parameters for both kinds: nothing separate to keep.
    let same = parse(&nested(json!({"rope_type": "default", "rope_theta": 1.0e6}))).expect("same");
    assert_eq!(same.sliding_rope, None);
    // A nested scaling is read too, and an unknown one refused naming where it is.
    let scaled = parse(&nested(json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 1.0e4}))).expect("scaled");
    assert_eq!(scaled.sliding_rope.and_then(|r| r.scaling), Some(RopeScaling::Linear { factor: 4.0 }));
    let msg = refused(&nested(json!({"rope_type": "longrope", "rope_theta": 1.0e4})));
    assert!(msg.contains("rope_parameters.sliding_attention") && msg.contains("longrope"), "{msg}");
    // A layer type Baton does not know, as a rope_parameters key.
    let msg = refused(&config(json!({"rope_parameters": {"full_attention": {"rope_theta": 1.0e4},
                                                          "chunked_attention": {"rope_theta": 1.0e4}}})));
    assert!(msg.contains("chunked_attention"), "{msg}");
}

#[test]
fn unknown_rope_types_are_refused_in_every_form() {
    for (v, name) in [
        (config(json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}})), "dynamic"),
        (config(json!({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}})), "mrope"),
        (config(json!({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0e4}})), "dynamic"),
    ] {
        let msg = refused(&v);
        assert!(msg.contains(name) && msg.contains("rope_type"), "{msg}");
    }
    // A known type with a parameter missing is a config error naming the parameter.
    let err = parse(&config(json!({"rope_parameters": {"rope_type": "linear"}}))).expect_err("no factor");
    assert!(err.to_string().contains("rope_parameters.factor"), "{err}");
    // LongRoPE (legacy name `su`) without its original context is a config error naming it.
    let err =
        parse(&config(json!({"rope_parameters": {"rope_type": "su", "short_factor": [1.0], "long_factor": [1.0]}})))
            .expect_err("no original_max_position_embeddings");
    assert!(err.to_string().contains("original_max_position_embeddings"), "{err}");
}

#[test]
fn options_that_change_the_math_are_refused_by_name() {
    for (extra, needle) in [
        (json!({"hidden_act": "gelu_pytorch_tanh"}), "hidden_act \"gelu_pytorch_tanh\""),
        (json!({"hidden_activation": "gelu"}), "hidden_activation \"gelu\""),
        (json!({"mlp_bias": true}), "mlp_bias"),
        (json!({"quantization_config": {"quant_method": "gptq"}}), "quant_method \"gptq\""),
        // MXFP4 is implemented for gpt-oss's experts only.
        (json!({"quantization_config": {"quant_method": "mxfp4"}}), "quantization_config (quant_method \"mxfp4\""),
        (json!({"final_logit_softcapping": 30.0}), "final_logit_softcapping"),
        (json!({"attn_logit_softcapping": 50.0}), "attn_logit_softcapping"),
        (
            json!({"rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1.0e4, "partial_rotary_factor": 0.25},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1.0e4}}}),
            "rope_parameters.full_attention.partial_rotary_factor 0.25 (per layer type)",
        ),
        (
            json!({"rope_parameters": {
                "full_attention": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}}),
            "rope_parameters.full_attention rope_type \"longrope\" per layer type",
        ),
        (
            json!({"original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope",
                "short_factor": [1.0], "long_factor": [1.0], "short_mscale": 1.2}}),
            "longrope short_mscale 1.2",
        ),
        (
            json!({"layer_types": ["full_attention", "linear_attention", "full_attention", "full_attention"]}),
            "layer_types entry \"linear_attention\"",
        ),
        (json!({"dtype": "float8_e4m3fn"}), "dtype \"float8_e4m3fn\""),
    ] {
        let msg = refused(&config(extra.clone()));
        assert!(msg.contains(needle), "{extra}: {msg}");
    }
    // What does not change the math, or is the implemented value, parses.
    for extra in [
        json!({"hidden_act": "swish"}),
        json!({"hidden_act": null}),
        json!({"partial_rotary_factor": 1.0}),
        json!({"partial_rotary_factor": 0.5}),
        json!({"quantization_config": null, "final_logit_softcapping": null}),
        json!({"pretraining_tp": 2, "attention_dropout": 0.1}),
    ] {
        parse(&config(extra.clone())).unwrap_or_else(|e| panic!("{extra}: {e}"));
    }
    // A layer_types list of the wrong length is a config error.
    let err = parse(&config(json!({"layer_types": ["full_attention"]}))).expect_err("short layer_types");
    assert!(err.to_string().contains("layer_types has 1 entries for 4 layers"), "{err}");
}

#[test]
fn dtype_comes_from_either_key() {
    let d = |extra: Value| {
        let v = config(extra);
        parse(&v).expect("parse");
        baton_formats::declared_dtype(&v, Path::new("config.json")).expect("dtype")
    };
    assert_eq!(d(json!({"torch_dtype": "float16"})), Some(ConfigDType::F16));
    assert_eq!(d(json!({"dtype": "float32"})), Some(ConfigDType::F32));
    assert_eq!(d(json!({"dtype": "bfloat16", "torch_dtype": "float32"})), Some(ConfigDType::BF16));
    assert_eq!(d(json!({"torch_dtype": "auto"})), None);
    assert_eq!(d(json!({})), None);
}

#[test]
fn qwen3_configs_parse_with_q_k_norm_and_their_own_head_dim() {
    // Written by transformers 5's save_pretrained (rope_parameters, dtype, layer_types).
    let dir = golden_fixtures_dir().join("qwen3");
    let c = ModelConfig::from_hf_file(&dir.join("config.json")).expect("qwen3 fixture");
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert_eq!((c.head_dim, c.hidden_size, c.num_attention_heads), (32, 64, 4));
    assert_eq!(c.rope_theta, 1.0e6);
    assert!(c.qk_norm() && !c.attention_bias && !c.o_proj_bias() && !c.tie_word_embeddings);
    let names: Vec<String> = c.expected_tensors().into_iter().map(|t| t.0).collect();
    assert!(names.contains(&"model.layers.1.self_attn.q_norm.weight".to_string()), "{names:?}");
    assert!(names.contains(&"model.layers.1.self_attn.k_norm.weight".to_string()), "{names:?}");
    let tied = ModelConfig::from_hf_file(&golden_fixtures_dir().join("qwen3_tied/config.json")).expect("tied");
    assert!(tied.tie_word_embeddings);
    // `attention_bias` covers o_proj in Qwen3 and Llama, not in Qwen2 (q/k/v only).
    let bias = |model_type: &str| {
        let c = parse(&config(json!({"model_type": model_type, "attention_bias": true}))).expect("parse");
        c.expected_tensors().into_iter().any(|t| t.0 == "model.layers.0.self_attn.o_proj.bias")
    };
    assert!(bias("qwen3") && bias("llama") && !bias("qwen2") && !bias("mistral"));
    // Qwen3's sliding window follows Qwen2's rule (only with use_sliding_window).
    let windowed = |on: bool| {
        parse(&config(json!({"model_type": "qwen3", "sliding_window": 128, "use_sliding_window": on,
                              "max_window_layers": 2})))
        .expect("parse")
    };
    assert_eq!(windowed(false).max_position_embeddings, 32768);
    assert_eq!(windowed(false).sliding_window, None);
    let on = windowed(true);
    assert_eq!((on.max_position_embeddings, on.sliding_window), (32768, Some(128)));
    assert_eq!(on.layer_types, vec![LayerType::Full, LayerType::Full, LayerType::Sliding, LayerType::Sliding]);
}

#[test]
fn unknown_architectures_list_every_supported_one() {
    let msg = parse(&config(json!({"model_type": "gpt2"}))).expect_err("gpt2").to_string();
    for a in Architecture::ALL {
        assert!(msg.contains(a.model_type()) && msg.contains(a.hf_class()), "{msg}");
    }
    assert!(msg.contains("\"gpt2\""), "{msg}");
}

#[test]
fn moe_configs_parse_their_experts_and_sparse_layers() {
    // Both written by transformers 5 (which names Qwen3-MoE's expert count num_local_experts).
    let dir = golden_fixtures_dir();
    let q = ModelConfig::from_hf_file(&dir.join("qwen3_moe/config.json")).expect("qwen3_moe fixture");
    assert_eq!(q.architecture, Architecture::Qwen3Moe);
    assert!(q.qk_norm());
    let m = q.moe.clone().expect("experts");
    assert_eq!((m.num_experts, m.experts_per_token, m.intermediate_size), (8, 2, 32));
    assert!(m.norm_topk_prob);
    assert_eq!((m.decoder_sparse_step, m.mlp_only_layers.clone()), (2, vec![3]));
    // Sparse every second layer, except layer 3 (mlp_only_layers): only layer 1.
    assert_eq!((0..4).map(|i| q.is_moe_layer(i)).collect::<Vec<_>>(), [false, true, false, false]);
    let names: Vec<String> = q.expected_tensors().into_iter().map(|t| t.0).collect();
    for n in ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight"] {
        assert!(names.iter().any(|x| x == n), "{n} missing");
    }
    assert!(names.iter().any(|x| x == "model.layers.3.mlp.gate_proj.weight"), "layer 3 is dense");
    assert!(!names.iter().any(|x| x == "model.layers.1.mlp.gate_proj.weight"), "layer 1 is sparse");
    // transformers 4's key for the expert count, and the defaults of the optional keys.
    let v4 = parse(&config(json!({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1,
                                  "moe_intermediate_size": 16})))
    .expect("transformers 4 keys");
    let m4 = v4.moe.clone().expect("experts");
    assert_eq!((m4.num_experts, m4.decoder_sparse_step, m4.norm_topk_prob), (4, 1, false));
    assert!((0..4).all(|i| v4.is_moe_layer(i)));
    assert_ne!(v4.fingerprint(), ModelConfig { moe: None, ..v4.clone() }.fingerprint());

    let x = ModelConfig::from_hf_file(&dir.join("mixtral/config.json")).expect("mixtral fixture");
    assert_eq!(x.architecture, Architecture::Mixtral);
    assert_eq!(x.head_dim, 24);
    let mx = x.moe.clone().expect("experts");
    assert_eq!((mx.num_experts, mx.experts_per_token, mx.intermediate_size, mx.norm_topk_prob), (8, 2, 32, true));
    assert!(x.is_moe_layer(0) && x.is_moe_layer(1));
    let names: Vec<String> = x.expected_tensors().into_iter().map(|t| t.0).collect();
    for n in ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight"] {
        assert!(names.iter().any(|x| x == n), "{n} missing");
    }
    // Mixtral's sliding window is Mistral's: every layer, the context not capped.
    let windowed = parse(&config(json!({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                                         "sliding_window": 256})))
    .expect("windowed mixtral");
    assert_eq!(windowed.max_position_embeddings, 32768);
    assert_eq!(windowed.sliding_window, Some(256));
    assert!(windowed.layer_types.iter().all(|t| *t == LayerType::Sliding));
}

#[test]
fn moe_configs_with_inconsistent_or_unimplemented_expert_options_are_refused() {
    let qwen3_moe = |extra: Value| {
        let mut v = config(json!({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 16}));
        for (k, x) in extra.as_object().expect("object") {
            v[k] = x.clone();
        }
        v
    };
    assert!(parse(&qwen3_moe(json!({}))).is_ok());
    // Options that change the math and are not implemented: refused, named.
    for (extra, name) in [
        (json!({"shared_expert_intermediate_size": 64}), "shared_expert_intermediate_size"),
        (json!({"n_shared_experts": 1}), "n_shared_experts"),
        (json!({"routed_scaling_factor": 2.5}), "routed_scaling_factor"),
        (json!({"n_group": 4}), "n_group"),
        (json!({"topk_group": 2}), "topk_group"),
        (json!({"scoring_func": "sigmoid"}), "scoring_func"),
        (json!({"first_k_dense_replace": 1}), "first_k_dense_replace"),
    ] {
        let msg = refused(&qwen3_moe(extra));
        assert!(msg.contains(name), "{msg}");
    }
    // Their no-op values, and the training-only options, are accepted.
    for extra in [
        json!({"shared_expert_intermediate_size": 0, "routed_scaling_factor": 1.0, "n_group": 1,
               "scoring_func": "softmax"}),
        json!({"router_aux_loss_coef": 0.01, "output_router_logits": true, "router_jitter_noise": 0.1}),
    ] {
        parse(&qwen3_moe(extra.clone())).unwrap_or_else(|e| panic!("{extra}: {e}"));
    }
    // Inconsistent expert fields: a config error naming the field.
    for (extra, name) in [
        (json!({"num_experts_per_tok": 9}), "num_experts_per_tok"),
        (json!({"num_experts_per_tok": 0}), "num_experts_per_tok"),
        (json!({"num_experts": 0}), "num_experts"),
        (json!({"moe_intermediate_size": 0}), "intermediate size"),
        (json!({"decoder_sparse_step": 0}), "decoder_sparse_step"),
        (json!({"mlp_only_layers": [4]}), "mlp_only_layers"),
        (json!({"mlp_only_layers": ["one"]}), "mlp_only_layers"),
    ] {
        let msg = parse(&qwen3_moe(extra.clone())).expect_err("refused").to_string();
        assert!(msg.contains(name), "{extra}: {msg}");
    }
    let mut no_k = qwen3_moe(json!({}));
    no_k.as_object_mut().expect("object").remove("num_experts_per_tok");
    assert!(parse(&no_k).expect_err("refused").to_string().contains("num_experts_per_tok"));
}

/// Phi-3 / Phi-4-mini as transformers wrote them: fused checkpoint tensors, partial rotary,
/// LongRoPE with both lists and the attention factor transformers derives; the served context
/// picks the list, and the fingerprint tells the two apart (P and D must rotate alike).
#[test]
fn phi3_configs_parse_with_longrope_and_partial_rotary() {
    for (name, rot) in [("phi3", 16usize), ("phi4_mini", 12)] {
        let c = ModelConfig::from_hf_file(&golden_fixtures_dir().join(name).join("config.json")).expect(name);
        assert_eq!(c.architecture, Architecture::Phi3);
        assert_eq!((c.head_dim, c.rotary_dim()), (16, rot), "{name}");
        assert!(c.expected_tensors().iter().any(|(n, _)| n.ends_with("self_attn.qkv_proj.weight")));
        assert!(c.expected_tensors().iter().any(|(n, _)| n.ends_with("mlp.gate_up_proj.weight")));
        let l = c.longrope.clone().expect("longrope");
        assert_eq!(l.original_max_position_embeddings, 36);
        assert_eq!((l.short_factor.len(), l.long_factor.len()), (rot / 2, rot / 2));
        // sqrt(1 + ln(144 / 36) / ln(36))
        assert!((l.attention_factor - (1.0f32 + 4.0f32.ln() / 36.0f32.ln()).sqrt()).abs() < 1e-6);
        assert!(l.use_long, "the model's own context (144) is past the original (36)");
        let short = c.with_served_context(36);
        assert!(!short.longrope.as_ref().expect("longrope").use_long);
        assert_eq!(short.longrope.as_ref().expect("longrope").factors(), &l.short_factor[..]);
        assert_ne!(short.fingerprint(), c.fingerprint());
    }
    // A factor list of the wrong length, and a rotation of no dims, are config errors.
    let bad = config(json!({"original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope",
        "short_factor": [1.0, 2.0], "long_factor": [1.0, 2.0]}}));
    let err = parse(&bad).expect_err("factor lists of 2 for 8 frequencies");
    assert!(err.to_string().contains("short_factor has 2 entries (need 8"), "{err}");
    let err = parse(&config(json!({"partial_rotary_factor": 0.05}))).expect_err("no rotary dims");
    assert!(err.to_string().contains("partial_rotary_factor 0.05 gives 0 rotary dims"), "{err}");
}

/// The gpt_oss fixture's `config.json` (transformers 5.23 wrote it: flat `rope_parameters`
/// with YaRN, `layer_types`, `dtype`).
fn gpt_oss_v5() -> Value {
    let path = golden_fixtures_dir().join("gpt_oss/config.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("read the gpt_oss config")).expect("json")
}

/// `v` with `extra` merged in (a `null` value removes the key).
fn merged(mut v: Value, extra: Value) -> Value {
    for (k, x) in extra.as_object().expect("object") {
        match x {
            Value::Null => {
                v.as_object_mut().expect("object").remove(k);
            }
            _ => v[k] = x.clone(),
        }
    }
    v
}

const GPT_OSS_YARN: RopeScaling = RopeScaling::Yarn {
    factor: 32.0,
    original_max_position_embeddings: 4096,
    beta_fast: 32.0,
    beta_slow: 1.0,
    truncate: false,
    attention_factor: None,
};

#[test]
fn gpt_oss_configs_of_both_generations_parse_to_the_same_model() {
    let v5 = parse(&gpt_oss_v5()).expect("the transformers 5 config");
    assert_eq!(v5.architecture, Architecture::GptOss);
    assert_eq!((v5.rope_theta, v5.rope_scaling, v5.sliding_rope), (150000.0, Some(GPT_OSS_YARN), None));
    assert_eq!(v5.layer_types, [LayerType::Sliding, LayerType::Full]);
    assert_eq!(v5.sliding_window, Some(16));
    // gpt-oss implements its window: the context is not capped at it.
    assert_eq!(v5.max_position_embeddings, 131072);
    assert!(v5.attention_bias && v5.o_proj_bias());
    assert_eq!(v5.gpt_oss, Some(GptOssOptions { swiglu_alpha: 1.702, swiglu_limit: 7.0 }));
    let moe = v5.moe.as_ref().expect("experts");
    assert_eq!((moe.num_experts, moe.experts_per_token, moe.intermediate_size), (4, 2, 32));
    assert!(moe.norm_topk_prob && (0..2).all(|l| v5.is_moe_layer(l)));
    // transformers 4.55 (the first with gpt-oss): `rope_theta` + `rope_scaling`, `torch_dtype`,
    // no `layer_types` (alternating, sliding first).
    let v4 = merged(
        gpt_oss_v5(),
        json!({"rope_parameters": null, "layer_types": null, "dtype": null, "torch_dtype": "bfloat16",
               "rope_theta": 150000.0,
               "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "original_max_position_embeddings": 4096, "truncate": false}}),
    );
    assert_eq!(parse(&v4).expect("the transformers 4 config"), v5);
    // transformers 5 nested per layer type, the same parameters for both types.
    let yarn = gpt_oss_v5()["rope_parameters"].clone();
    let nested =
        merged(gpt_oss_v5(), json!({"rope_parameters": {"full_attention": yarn.clone(), "sliding_attention": yarn}}));
    assert_eq!(parse(&nested).expect("nested rope_parameters"), v5);
    // The YaRN defaults: beta_fast 32, beta_slow 1, truncate true; the original context from
    // the top level when the config has one there (transformers' standardization).
    let defaults = merged(
        gpt_oss_v5(),
        json!({"original_max_position_embeddings": 2048,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0}}),
    );
    let want = RopeScaling::Yarn {
        factor: 8.0,
        original_max_position_embeddings: 2048,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: None,
    };
    assert_eq!(parse(&defaults).expect("yarn defaults").rope_scaling, Some(want));
    // DeepSeek's mscale pair gives the attention factor: get_mscale(8, 1) / get_mscale(8, 0.5).
    let mscale = merged(
        gpt_oss_v5(),
        json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
               "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    );
    let Some(RopeScaling::Yarn { attention_factor: Some(a), .. }) = parse(&mscale).expect("mscale").rope_scaling else {
        panic!("no attention factor")
    };
    let m = |x: f64| 0.1 * x * 8f64.ln() + 1.0;
    assert!((f64::from(a) - m(1.0) / m(0.5)).abs() < 1e-6, "{a}");
    // An explicit one wins.
    let given = merged(
        gpt_oss_v5(),
        json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
               "original_max_position_embeddings": 4096, "attention_factor": 1.25, "mscale": 1.0}}),
    );
    assert!(matches!(
        parse(&given).expect("attention_factor").rope_scaling,
        Some(RopeScaling::Yarn { attention_factor: Some(1.25), .. })
    ));
}

#[test]
fn gpt_oss_mxfp4_is_accepted_and_other_quantizations_and_yarn_options_are_refused() {
    let mxfp4 = golden_fixtures_dir().join("gpt_oss_mxfp4/config.json");
    let cfg = ModelConfig::from_hf_file(&mxfp4).expect("the MXFP4 config parses");
    assert_eq!(cfg, parse(&gpt_oss_v5()).expect("the f32 config"), "MXFP4 changes only the storage");
    for (extra, needle) in [
        (json!({"quantization_config": {"quant_method": "gptq"}}), "quant_method \"gptq\""),
        (json!({"quantization_config": {"bits": 4}}), "quant_method \"unknown\""),
        (
            json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0,
                   "original_max_position_embeddings": 4096, "extrapolation_factor": 1.0}}),
            "rope_parameters yarn option \"extrapolation_factor\"",
        ),
        (
            json!({"rope_parameters": {
                "full_attention": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0,
                                   "original_max_position_embeddings": 4096},
                "sliding_attention": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "low_freq_factor": 1.0}}}),
            "rope_parameters.sliding_attention yarn option \"low_freq_factor\"",
        ),
    ] {
        let msg = refused(&merged(gpt_oss_v5(), extra.clone()));
        assert!(msg.contains(needle), "{extra}: {msg}");
    }
    // Missing or mistyped YaRN parameters are config errors naming them.
    for (rope, needle) in [
        (json!({"rope_type": "yarn", "rope_theta": 1.5e5}), "rope_parameters.factor is missing"),
        (json!({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}), "rope_parameters.truncate must be a boolean"),
        (json!({"rope_type": "yarn", "factor": -4.0}), "yarn rope scaling needs factor"),
    ] {
        let err = parse(&merged(gpt_oss_v5(), json!({"rope_parameters": rope}))).expect_err("refused");
        assert!(err.to_string().contains(needle), "{err}");
    }
    // The swiglu options must be positive numbers.
    let err = parse(&merged(gpt_oss_v5(), json!({"swiglu_limit": 0.0}))).expect_err("limit 0");
    assert!(err.to_string().contains("swiglu_limit"), "{err}");
}

#[test]
fn gpt_oss_expected_tensors_name_sinks_router_bias_and_fused_experts() {
    let cfg = parse(&gpt_oss_v5()).expect("config");
    let tensors: std::collections::HashMap<String, Vec<usize>> = cfg.expected_tensors().into_iter().collect();
    let l = "model.layers.1";
    for (name, shape) in [
        (format!("{l}.self_attn.sinks"), vec![4]),
        (format!("{l}.self_attn.o_proj.bias"), vec![64]),
        (format!("{l}.mlp.router.weight"), vec![4, 64]),
        (format!("{l}.mlp.router.bias"), vec![4]),
        (format!("{l}.mlp.experts.gate_up_proj"), vec![4, 64, 64]),
        (format!("{l}.mlp.experts.gate_up_proj_bias"), vec![4, 64]),
        (format!("{l}.mlp.experts.down_proj"), vec![4, 32, 64]),
        (format!("{l}.mlp.experts.down_proj_bias"), vec![4, 64]),
    ] {
        assert_eq!(tensors.get(&name), Some(&shape), "{name}");
    }
    assert!(!tensors.keys().any(|n| n.contains("experts.0.")), "no per-expert tensors");
    // Exactly the fixture's tensors (the checker the loaders run).
    let store = baton_formats::SafetensorsStore::open_dir(&golden_fixtures_dir().join("gpt_oss")).expect("open");
    baton_formats::check_tensors(&store, &cfg, Path::new("gpt_oss")).expect("every expected tensor is there");
}
