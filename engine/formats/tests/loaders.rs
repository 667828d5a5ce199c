//! Every loader path on tiny models written by `baton_formats::testing`: HF folders
//! (single and sharded), GGUF in every supported tensor type (v2 and v3), dummy weights,
//! and HF-vs-GGUF tensor equality after llama.cpp's Q/K un-permutation.

use std::path::Path;

use baton_formats::testing::{TinySpec, write_gguf, write_hf_folder};
use baton_formats::{
    Architecture, DType, GgufType, LayerType, LoadFormat, LoadedModel, ModelConfig, RopeScaling, WeightStore,
    load_model,
};

fn load(path: &Path, format: LoadFormat) -> LoadedModel {
    load_model(path, format).expect("model loads")
}

fn assert_complete(m: &LoadedModel) {
    for (name, shape) in m.config.expected_tensors() {
        let t = m.weights.get(&name).expect("expected tensor present");
        assert_eq!(t.shape, shape, "{name}");
        assert_eq!(t.bytes.len(), t.numel() * t.dtype.size(), "{name}");
    }
}

#[test]
fn hf_folder_loads_every_preset_with_exact_weights() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (name, spec) in [
        ("llama", TinySpec::llama()),
        ("qwen2", TinySpec::qwen2()),
        ("tied", TinySpec::tied()),
        ("qwen3_moe", TinySpec::qwen3_moe()),
        ("mixtral", TinySpec::mixtral()),
    ] {
        let dir = write_hf_folder(&tmp.path().join(name), &spec).expect("write");
        let m = load(&dir, LoadFormat::Auto);
        assert_eq!(m.config, spec.config(), "{name}");
        assert_complete(&m);
        assert_eq!(m.weights.names().contains(&"lm_head.weight".to_string()), !spec.tie_embeddings);
        let has_bias = m.weights.get("model.layers.0.self_attn.q_proj.bias").is_ok();
        assert_eq!(has_bias, spec.attention_bias, "{name}");
        // The weights are exactly the spec's seeded values, borrowed from the map as f32.
        let store = spec.weights();
        for (t, _) in spec.config().expected_tensors() {
            let v = m.weights.get(&t).expect("tensor");
            assert_eq!(v.dtype, DType::F32);
            assert!(matches!(v.bytes, std::borrow::Cow::Borrowed(_)), "{t} should borrow from the mmap");
            assert_eq!(v.to_f32(), store.values(&t).expect("values"), "{name}: {t}");
        }
        let tok = m.tokenizer.as_ref().expect("tokenizer");
        assert_eq!(tok.vocab_size(), spec.vocab_size);
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        let ct = m.chat_template.as_ref().expect("chat template");
        let text = ct.render(&[baton_formats::ChatMessage::new("user", "hi")], true).expect("render");
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(m.generation.eos_token_ids, vec![2]);
        assert_eq!(m.generation.bos_token_id, Some(0));
    }
}

#[test]
fn norms_are_near_one_and_linears_are_small() {
    let spec = TinySpec::llama();
    let store = spec.weights();
    let norm = store.values("model.norm.weight").expect("norm");
    let mean = norm.iter().sum::<f32>() / norm.len() as f32;
    assert!((mean - 1.0).abs() < 0.05, "norm mean {mean}");
    let q = store.values("model.layers.1.self_attn.q_proj.weight").expect("q");
    let var = q.iter().map(|v| v * v).sum::<f32>() / q.len() as f32;
    let std = var.sqrt();
    assert!((std - spec.init_std).abs() < 0.1 * spec.init_std, "q std {std}");
    // Different tensors and different seeds give different values.
    let k = store.values("model.layers.1.self_attn.k_proj.weight").expect("k");
    assert_ne!(q[..k.len()], k[..]);
    let other = TinySpec { seed: 99, ..spec }.weights();
    assert_ne!(other.values("model.norm.weight").expect("norm"), norm);
}

fn compare_stores(hf: &dyn WeightStore, gg: &dyn WeightStore, config: &ModelConfig, rel_tol: f32, label: &str) {
    for (name, shape) in config.expected_tensors() {
        let a = hf.get(&name).expect("hf tensor").to_f32();
        let t = gg.get(&name).expect("gguf tensor");
        assert_eq!(t.shape, shape, "{label} {name}");
        let b = t.to_f32();
        if rel_tol == 0.0 {
            assert_eq!(a, b, "{label} {name}");
            continue;
        }
        let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = a.iter().map(|x| x * x).sum();
        let rel = (num / den).sqrt();
        assert!(rel < rel_tol, "{label} {name}: relative error {rel} >= {rel_tol}");
    }
}

#[test]
fn gguf_matches_hf_folder_for_every_tensor_type() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (name, spec) in [("llama", TinySpec::llama()), ("qwen2", TinySpec::qwen2()), ("tied", TinySpec::tied())] {
        let hf = load(&write_hf_folder(&tmp.path().join(name), &spec).expect("hf"), LoadFormat::Safetensors);
        // Relative L2 error bounds: 4-bit quantization of Gaussian weights is ~10-15%.
        for (ty, tol) in [
            (GgufType::F32, 0.0),
            (GgufType::F16, 1e-3),
            (GgufType::BF16, 5e-3),
            (GgufType::Q8_0, 1e-2),
            (GgufType::Q4_0, 0.2),
            (GgufType::Q4_1, 0.15),
        ] {
            let path = tmp.path().join(format!("{name}-{ty:?}.gguf"));
            write_gguf(&path, &spec, ty).expect("write gguf");
            let gg = load(&path, LoadFormat::Auto);
            let mut want = spec.config();
            if want.architecture == Architecture::Mistral {
                want.architecture = Architecture::Llama;
            }
            assert_eq!(gg.config, want, "{name} {ty:?}");
            assert_complete(&gg);
            compare_stores(hf.weights.as_ref(), gg.weights.as_ref(), &hf.config, tol, &format!("{name} {ty:?}"));
        }
    }
}

#[test]
fn gguf_q_and_k_are_really_permuted_on_disk() {
    // Guards against a writer and reader that both skip the permutation: the raw GGUF
    // rows of attn_q must differ from HF order, and match llama.cpp's interleaving.
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::llama();
    let path = write_gguf(&tmp.path().join("m.gguf"), &spec, GgufType::F32).expect("write");
    let file = baton_formats::gguf::GgufFile::open(&path).expect("open");
    let info = file.tensor("blk.0.attn_k.weight").expect("attn_k").clone();
    let raw = baton_formats::tensor::TensorView {
        name: info.name.clone(),
        shape: info.hf_shape(),
        dtype: DType::F32,
        bytes: std::borrow::Cow::Borrowed(file.tensor_bytes(&info, GgufType::F32).expect("bytes")),
    }
    .to_f32();
    let hf = spec.weights().values("model.layers.0.self_attn.k_proj.weight").expect("k");
    let (h, hd) = (spec.hidden_size, spec.hidden_size / spec.num_heads);
    assert_ne!(raw, hf);
    for head in 0..spec.num_kv_heads {
        for i in 0..hd / 2 {
            for half in 0..2 {
                let g = head * hd + 2 * i + half;
                let f = head * hd + half * hd / 2 + i;
                assert_eq!(raw[g * h..(g + 1) * h], hf[f * h..(f + 1) * h]);
            }
        }
    }
}

#[test]
fn gguf_version_2_loads() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::llama();
    let path = tmp.path().join("v2.gguf");
    baton_formats::testing::gguf_writer(&spec, GgufType::Q8_0).expect("writer").write_version(&path, 2).expect("write");
    let m = load(&path, LoadFormat::Gguf);
    assert_eq!(m.config.num_hidden_layers, 2);
    assert_complete(&m);
}

#[test]
fn gguf_restores_llama3_and_linear_rope_scaling() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::tied();
    let m = load(&write_gguf(&tmp.path().join("a.gguf"), &spec, GgufType::F16).expect("w"), LoadFormat::Gguf);
    assert_eq!(m.config.rope_scaling, spec.rope_scaling);
    let linear = TinySpec { rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }), ..TinySpec::llama() };
    let m = load(&write_gguf(&tmp.path().join("b.gguf"), &linear, GgufType::F16).expect("w"), LoadFormat::Gguf);
    assert_eq!(m.config.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
}

#[test]
fn sharded_safetensors_with_index_loads() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::qwen2();
    let dir = write_hf_folder(&tmp.path().join("m"), &spec).expect("write");
    // Re-shard: layer tensors in shard 2, everything else in shard 1.
    let single = load(&dir, LoadFormat::Safetensors);
    type Shard = Vec<(String, Vec<usize>, Vec<u8>)>;
    let mut shards: [Shard; 2] = [Vec::new(), Vec::new()];
    for (name, shape) in spec.config().expected_tensors() {
        let t = single.weights.get(&name).expect("tensor");
        shards[usize::from(name.starts_with("model.layers."))].push((name, shape, t.bytes.to_vec()));
    }
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<_> = shard
            .iter()
            .map(|(n, s, b)| {
                weight_map.insert(n.clone(), serde_json::json!(file));
                (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).expect("view"))
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).expect("write shard");
    }
    std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .expect("index");
    drop(single);
    let sharded = load(&dir, LoadFormat::Auto);
    compare_stores(spec.weights().as_store(), sharded.weights.as_ref(), &spec.config(), 0.0, "sharded");
}

trait AsStore {
    fn as_store(&self) -> &dyn WeightStore;
}

impl AsStore for baton_formats::DummyStore {
    fn as_store(&self) -> &dyn WeightStore {
        self
    }
}

#[test]
fn dummy_weights_for_the_8b_config_are_lazy_and_seeded() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/llama-3.1-8b.json");
    let m = load(&path, LoadFormat::Dummy);
    let c = &m.config;
    assert_eq!((c.hidden_size, c.num_hidden_layers, c.vocab_size), (4096, 32, 128256));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (32, 8, 128));
    assert_eq!(c.intermediate_size, 14336);
    assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor: 8.0, .. })));
    assert!(!c.tie_word_embeddings);
    assert_eq!(m.weights.names().len(), c.expected_tensors().len());
    assert_eq!(m.weights.shape("model.embed_tokens.weight").expect("shape"), vec![128256, 4096]);
    let t = m.weights.get("model.layers.31.self_attn.k_proj.weight").expect("k");
    assert_eq!(t.shape, vec![1024, 4096]);
    assert_eq!(t.dtype, DType::BF16);
    let v = t.to_f32();
    let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.002, "std {std}");
    let again = m.weights.get("model.layers.31.self_attn.k_proj.weight").expect("k");
    assert_eq!(t.bytes, again.bytes, "dummy weights are deterministic");
    let norm = m.weights.get("model.layers.0.input_layernorm.weight").expect("norm").to_f32();
    assert!(norm.iter().all(|x| (x - 1.0).abs() < 0.1));
}

#[test]
fn dummy_accepts_a_folder_and_keeps_its_tokenizer() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = write_hf_folder(&tmp.path().join("m"), &TinySpec::llama()).expect("write");
    let m = load(&dir, LoadFormat::Dummy);
    assert_eq!(m.config, TinySpec::llama().config());
    assert!(m.tokenizer.is_some());
    assert!(m.chat_template.is_some());
    assert_complete(&m);
}

#[test]
fn load_format_parses() {
    assert_eq!("auto".parse::<LoadFormat>().expect("auto"), LoadFormat::Auto);
    assert_eq!("GGUF".parse::<LoadFormat>().expect("gguf"), LoadFormat::Gguf);
    assert_eq!("safetensors".parse::<LoadFormat>().expect("st"), LoadFormat::Safetensors);
    assert_eq!("dummy".parse::<LoadFormat>().expect("dummy"), LoadFormat::Dummy);
    let err = "pickle".parse::<LoadFormat>().expect_err("unknown");
    assert!(err.to_string().contains("pickle"), "{err}");
}

#[test]
fn golden_fixtures_are_in_sync_with_their_specs() {
    let root = baton_formats::testing::golden_fixtures_dir();
    for (name, spec) in TinySpec::golden_set() {
        let m = load(&root.join(name), LoadFormat::Auto);
        assert_eq!(m.config, spec.config(), "{name}: regenerate with the write_tiny_models example");
        let store = spec.weights();
        for (t, _) in spec.config().expected_tensors() {
            let got = m.weights.get(&t).expect("tensor").to_f32();
            assert_eq!(got, store.values(&t).expect("values"), "{name}: {t} differs from the generator");
        }
        let (_, golden) = baton_formats::testing::load_golden(name).expect("golden.json");
        assert_eq!(golden.model, name);
        assert_eq!(golden.prompts.len(), 4);
        for p in &golden.prompts {
            assert_eq!(p.last_logits.len(), spec.vocab_size);
            assert!(p.last_logits.iter().all(|x| x.is_finite()));
            assert_eq!(p.greedy.len(), 16);
            assert!(p.ids.iter().chain(&p.greedy).all(|&i| (i as usize) < spec.vocab_size));
            assert!(p.greedy_min_gap > 1e-3, "{name}: greedy run has a near tie");
        }
        let tok = m.tokenizer.as_ref().expect("tokenizer");
        assert_eq!(tok.vocab_size(), spec.vocab_size);
        let text = "Hello world 123 你好 😀";
        assert_eq!(tok.decode(&tok.encode(text, false).expect("encode"), false).expect("decode"), text);
    }
}

#[test]
fn mistral_with_explicit_head_dim_roundtrips_through_both_formats() {
    // head_dim 24 != hidden / heads (16): q is [144, 64], o is [64, 144]; 6 heads, 3 kv heads.
    let spec = TinySpec {
        architecture: Architecture::Mistral,
        num_heads: 6,
        num_kv_heads: 3,
        head_dim: Some(24),
        seed: 7,
        ..TinySpec::llama()
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf = load(&write_hf_folder(&tmp.path().join("m"), &spec).expect("hf"), LoadFormat::Auto);
    assert_eq!(hf.config, spec.config());
    assert_eq!(hf.config.architecture, Architecture::Mistral);
    assert_eq!(hf.weights.shape("model.layers.0.self_attn.q_proj.weight").expect("q"), vec![144, 64]);
    assert_eq!(hf.weights.shape("model.layers.0.self_attn.o_proj.weight").expect("o"), vec![64, 144]);
    let path = write_gguf(&tmp.path().join("m.gguf"), &spec, GgufType::F32).expect("gguf");
    let gg = load(&path, LoadFormat::Gguf);
    // GGUF has no separate Mistral architecture: llama.cpp files say "llama".
    assert_eq!(gg.config.architecture, Architecture::Llama);
    assert_eq!(gg.config.head_dim, 24);
    compare_stores(hf.weights.as_ref(), gg.weights.as_ref(), &hf.config, 0.0, "mistral");
}

#[test]
fn transformers_v5_rope_parameters_are_understood() {
    let v = serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": true, "eos_token_id": [1, 2], "bos_token_id": 0
    });
    let c = ModelConfig::from_hf_json(&v, Path::new("config.json")).expect("parse");
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.num_key_value_heads, 1);
    assert_eq!(c.eos_token_ids, vec![1, 2]);
    assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor: 32.0, .. })));
    // The config's own JSON round-trips.
    assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json(), Path::new("x")).expect("reparse"), c);
}

#[test]
fn an_active_sliding_window_marks_its_layers_and_keeps_the_context() {
    // Every family attends within its window on sliding layers, so the context stays the
    // declared one; which layers slide follows each family's rule.
    let base = |extra: serde_json::Value| {
        let mut v = serde_json::json!({
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300,
            "max_position_embeddings": 32768
        });
        for (k, x) in extra.as_object().expect("object") {
            v[k] = x.clone();
        }
        let c = ModelConfig::from_hf_json(&v, Path::new("config.json")).expect("parse");
        assert_eq!(c.max_position_embeddings, 32768, "{extra}: the window must not cap the context");
        let sliding: Vec<usize> = (0..4).filter(|&i| c.layer_types[i] == baton_formats::LayerType::Sliding).collect();
        (c.sliding_window, sliding)
    };
    use serde_json::json;
    assert_eq!(base(json!({"model_type": "mistral", "sliding_window": 4096})), (Some(4096), vec![0, 1, 2, 3]));
    assert_eq!(base(json!({"model_type": "mistral", "sliding_window": null})), (None, vec![]));
    // Qwen2: only with use_sliding_window, and only from layer max_window_layers on.
    assert_eq!(
        base(json!({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": false})),
        (None, vec![])
    );
    assert_eq!(
        base(
            json!({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": true, "max_window_layers": 4})
        ),
        (None, vec![])
    );
    assert_eq!(
        base(
            json!({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": true, "max_window_layers": 2})
        ),
        (Some(4096), vec![2, 3])
    );
    // transformers 5's layer_types says which layers are windowed.
    let full = json!(["full_attention", "full_attention", "full_attention", "full_attention"]);
    let one = json!(["full_attention", "full_attention", "full_attention", "sliding_attention"]);
    assert_eq!(base(json!({"model_type": "mistral", "sliding_window": 4096, "layer_types": full})), (None, vec![]));
    assert_eq!(base(json!({"model_type": "llama", "sliding_window": 4096, "layer_types": one})), (Some(4096), vec![3]));
}

#[test]
fn dummy_get_in_every_dtype_matches_its_f32_values() {
    let spec = TinySpec::qwen2();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        // 2048 x 64 embedding: larger than one generation chunk (65536 elements).
        let config = ModelConfig { vocab_size: 2048, ..spec.config() };
        let store = baton_formats::DummyStore::new(&config, 5, 0.05, dtype);
        let name = "model.embed_tokens.weight";
        let want = store.values(name).expect("values");
        let got = store.get(name).expect("get");
        assert_eq!(got.dtype, dtype);
        let rel = if dtype == DType::F32 { 0.0 } else { 8e-3 };
        for (a, b) in want.iter().zip(got.to_f32()) {
            assert!((a - b).abs() <= rel * a.abs() + 1e-7, "{dtype:?}: {a} vs {b}");
        }
        assert!(store.get("model.layers.9.mlp.up_proj.weight").is_err());
    }
}

#[test]
fn model_info_matches_the_full_load_for_every_format() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::tied();
    let dir = write_hf_folder(&tmp.path().join("m"), &spec).expect("hf");
    let gguf = write_gguf(&tmp.path().join("m.gguf"), &spec, GgufType::Q4_1).expect("gguf");
    for (path, format) in
        [(dir.clone(), LoadFormat::Auto), (gguf, LoadFormat::Auto), (dir.join("config.json"), LoadFormat::Dummy)]
    {
        let info = baton_formats::load_model_info(&path, format).expect("info");
        let full = load(&path, format);
        assert_eq!(info.config, full.config);
        assert_eq!(info.generation, full.generation);
        assert_eq!(info.tokenizer.is_some(), full.tokenizer.is_some());
        if let (Some(a), Some(b)) = (&info.tokenizer, &full.tokenizer) {
            assert_eq!(a.encode("hi there 42", true).expect("a"), b.encode("hi there 42", true).expect("b"));
        }
        assert_eq!(info.chat_template.is_some(), full.chat_template.is_some());
    }
}

#[test]
fn every_model_config_under_configs_loads_as_dummy_weights() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/models") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let m = load(&path, LoadFormat::Dummy);
            assert_eq!(m.weights.names().len(), m.config.expected_tensors().len(), "{}", path.display());
            // Benchmark shapes use the real vocabulary of their family.
            let name = path.file_name().and_then(|f| f.to_str()).unwrap_or_default();
            let vocab = match name {
                n if n.starts_with("llama-3") => 128_256,
                n if n.starts_with("qwen3-") => 151_936,
                n if n.starts_with("qwen2.5-") => 152_064,
                n if n.starts_with("gemma-3-") => 262_208,
                other => panic!("{other}: which model's vocabulary does this shape use?"),
            };
            assert_eq!(m.config.vocab_size, vocab, "{}: benchmark shapes use the real vocabulary", path.display());
            n += 1;
        }
    }
    assert!(n >= 2, "expected the 8B and 1B configs, found {n}");
}

#[test]
fn counter_dummy_weights_are_pure_uniform_draws_with_the_asked_mean_and_std() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/llama-3.1-8b.json");
    let m = load(&path, LoadFormat::Dummy);
    let name = "model.layers.3.mlp.down_proj.weight";
    let init = m.weights.counter_init(name).expect("--load-format dummy draws with the counter generator");
    let t = m.weights.get(name).expect("down").to_f32();
    // `get` serves exactly the draws (rounded to the store's bf16).
    for (i, &x) in t.iter().enumerate().step_by(997) {
        assert_eq!(x, half::bf16::from_f32(init.value(i as u64)).to_f32(), "element {i}");
    }
    let mean = t.iter().map(|&x| f64::from(x)).sum::<f64>() / t.len() as f64;
    let std = (t.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / t.len() as f64).sqrt();
    assert!(mean.abs() < 1e-4 && (std - 0.02).abs() < 5e-4, "mean {mean} std {std}");
    assert!(t.iter().all(|x| x.abs() <= 0.02 * 3f32.sqrt() * 1.01), "uniform on ±std·√3");
    // Norms centre on one; other tensors get other keys; unknown names draw nothing.
    let norm = m.weights.counter_init("model.layers.3.input_layernorm.weight").expect("norm");
    assert_eq!(norm.mean, 1.0);
    assert_ne!(norm.key, init.key);
    assert!(m.weights.counter_init("model.layers.99.mlp.down_proj.weight").is_none());
    // The test models keep their normal generator (their golden fixtures depend on it).
    let tiny = TinySpec::qwen2().weights();
    assert!(tiny.counter_init("model.embed_tokens.weight").is_none());
}

/// The Gemma-3-12B text shape the sliding-window benchmark runs (`bench_cuda --config
/// configs/models/gemma-3-12b.json`): 5 sliding layers of 1,024 tokens to each full one, the
/// local and global RoPE, Gemma's score scale and tied embeddings.
#[test]
fn the_gemma_3_12b_config_parses_with_its_windows() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/gemma-3-12b.json");
    let m = load(&path, LoadFormat::Dummy);
    let c = &m.config;
    assert_eq!(c.architecture, Architecture::Gemma3Text);
    assert_eq!((c.hidden_size, c.num_hidden_layers, c.vocab_size), (3840, 48, 262_208));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (16, 8, 256));
    assert_eq!(c.intermediate_size, 15_360);
    assert_eq!(c.sliding_window, Some(1024));
    let full: Vec<usize> = (0..48).filter(|&i| c.layer_types[i] == LayerType::Full).collect();
    assert_eq!(full, (0..8).map(|k| 6 * k + 5).collect::<Vec<_>>(), "every sixth layer is global");
    assert!(c.tie_word_embeddings);
    let g = c.gemma.expect("gemma options");
    assert_eq!(g.query_pre_attn_scalar, 256.0);
    assert_eq!((g.attn_logit_softcapping, g.final_logit_softcapping), (None, None));
    let global = c.rope_for(LayerType::Full);
    assert_eq!(global.theta, 1e6);
    assert!(matches!(global.scaling, Some(RopeScaling::Linear { factor: 8.0 })));
    let local = c.rope_for(LayerType::Sliding);
    assert_eq!((local.theta, local.scaling), (10_000.0, None));
    assert_eq!(m.weights.names().len(), c.expected_tensors().len());
}
