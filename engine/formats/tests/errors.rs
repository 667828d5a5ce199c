//! Every bad model file gives a clear `FormatError` naming the file and the problem:
//! missing tensor, wrong shape, unsupported architecture/dtype/type/tokenizer, truncated
//! safetensors, bad GGUF magic/version, truncated GGUF, inconsistent configs.

use std::path::{Path, PathBuf};

use baton_formats::gguf::GgufValue;
use baton_formats::testing::{TinySpec, gguf_writer, write_gguf, write_hf_folder};
use baton_formats::{FormatError, GgufType, LoadFormat, ModelConfig, load_model};

fn hf_dir(tmp: &Path) -> PathBuf {
    write_hf_folder(&tmp.join("m"), &TinySpec::llama()).expect("write")
}

fn load_err(path: &Path, format: LoadFormat) -> FormatError {
    load_model(path, format).expect_err("load must fail")
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("read")).expect("json");
    f(&mut v);
    std::fs::write(&p, v.to_string()).expect("write");
}

/// Rewrites model.safetensors with `f` applied to the (name, dtype, shape, bytes) list.
fn edit_tensors(dir: &Path, f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut list: Vec<_> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    f(&mut list);
    let views: Vec<_> = list
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &p).expect("write");
}

#[test]
fn missing_tensor_is_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_dir(tmp.path());
    edit_tensors(&dir, |l| l.retain(|(n, ..)| n != "model.layers.1.mlp.up_proj.weight"));
    let err = load_err(&dir, LoadFormat::Auto);
    assert!(
        matches!(err, FormatError::MissingTensor { ref name, .. } if name == "model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );
    assert!(err.to_string().contains(&dir.display().to_string()), "{err}");
}

#[test]
fn shape_mismatch_is_reported_with_both_shapes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_dir(tmp.path());
    edit_config(&dir, |v| v["intermediate_size"] = serde_json::json!(96));
    let err = load_err(&dir, LoadFormat::Safetensors);
    let msg = err.to_string();
    assert!(matches!(err, FormatError::ShapeMismatch { .. }), "{msg}");
    assert!(msg.contains("[96, 64]") && msg.contains("[128, 64]"), "{msg}");
}

#[test]
fn unsupported_architecture_is_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_dir(tmp.path());
    edit_config(&dir, |v| {
        v["model_type"] = serde_json::json!("gpt_neox");
        v["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    });
    let err = load_err(&dir, LoadFormat::Auto);
    assert!(err.to_string().contains("gpt_neox") && err.to_string().contains("config.json"), "{err}");

    let path = tmp.path().join("falcon.gguf");
    let mut w = gguf_writer(&TinySpec::llama(), GgufType::F32).expect("writer");
    w.add_meta("general.architecture", GgufValue::String("falcon".into()));
    w.write(&path).expect("write");
    let err = load_err(&path, LoadFormat::Auto);
    assert!(matches!(err, FormatError::UnsupportedArchitecture { ref name, .. } if name == "falcon"), "{err}");
}

#[test]
fn mixture_of_experts_gguf_options_baton_does_not_compute_are_refused_by_name() {
    // An expert layout Baton does not map (llama.cpp's `qwen2moe`), shared experts, sigmoid
    // gating, a routed scaling factor, and a `qwen3moe` file without its expert count.
    let tmp = tempfile::tempdir().expect("tmp");
    let cases: [(&str, &str, GgufValue, &str); 4] = [
        ("qwen2moe", "qwen2moe.expert_count", GgufValue::U32(8), "qwen2moe.expert_count 8"),
        ("qwen3moe", "qwen3moe.expert_shared_count", GgufValue::U32(1), "qwen3moe.expert_shared_count 1"),
        ("qwen3moe", "qwen3moe.expert_gating_func", GgufValue::U32(2), "qwen3moe.expert_gating_func 2"),
        ("qwen3moe", "qwen3moe.expert_weights_scale", GgufValue::F32(2.5), "qwen3moe.expert_weights_scale 2.5"),
    ];
    for (i, (arch, key, value, named)) in cases.into_iter().enumerate() {
        let path = tmp.path().join(format!("{i}.gguf"));
        let mut w = gguf_writer(&TinySpec::qwen3_moe(), GgufType::F32).expect("writer");
        w.add_meta("general.architecture", GgufValue::String(arch.into()));
        w.add_meta(&format!("{arch}.expert_count"), GgufValue::U32(8));
        w.add_meta(key, value);
        w.write(&path).expect("write");
        let err = load_err(&path, LoadFormat::Auto);
        let msg = err.to_string();
        assert!(matches!(err, FormatError::Unsupported { .. }), "{arch} {key}: {msg}");
        assert!(msg.contains(named), "{arch} {key}: {msg}");
    }
    let path = tmp.path().join("no-count.gguf");
    let mut w = gguf_writer(&TinySpec::qwen3_moe(), GgufType::F32).expect("writer");
    w.add_meta("qwen3moe.expert_count", GgufValue::U32(0));
    w.write(&path).expect("write");
    let msg = load_err(&path, LoadFormat::Auto).to_string();
    assert!(msg.contains("missing metadata qwen3moe.expert_count"), "{msg}");
}

#[test]
fn unsupported_safetensors_dtype_is_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_dir(tmp.path());
    edit_tensors(&dir, |l| {
        for t in l.iter_mut().filter(|t| t.0 == "model.norm.weight") {
            t.1 = safetensors::Dtype::I32;
        }
    });
    let err = load_err(&dir, LoadFormat::Auto);
    let msg = err.to_string();
    assert!(
        matches!(err, FormatError::Unsupported { .. }) && msg.contains("model.norm.weight") && msg.contains("I32"),
        "{msg}"
    );
}

#[test]
fn truncated_safetensors_is_detected() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_dir(tmp.path());
    let p = dir.join("model.safetensors");
    let len = std::fs::metadata(&p).expect("meta").len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).expect("open");
    f.set_len(len - 100).expect("truncate");
    let err = load_err(&dir, LoadFormat::Auto);
    assert!(matches!(err, FormatError::Safetensors { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    // A file cut inside its header is caught too.
    f.set_len(5).expect("truncate");
    assert!(matches!(load_err(&dir, LoadFormat::Auto), FormatError::Safetensors { .. }));
}

fn gguf_bytes(tmp: &Path) -> (PathBuf, Vec<u8>) {
    let p = write_gguf(&tmp.join("m.gguf"), &TinySpec::llama(), GgufType::Q4_0).expect("write");
    let b = std::fs::read(&p).expect("read");
    (p, b)
}

#[test]
fn bad_gguf_magic_and_versions_are_rejected() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (p, b) = gguf_bytes(tmp.path());
    let mut bad = b.clone();
    bad[..4].copy_from_slice(b"GGML");
    std::fs::write(&p, &bad).expect("write");
    let err = load_err(&p, LoadFormat::Gguf);
    assert!(err.to_string().contains("bad magic") && err.to_string().contains("m.gguf"), "{err}");
    for (v, needle) in [(1u32, "version 1"), (4, "version 4"), (3u32.swap_bytes(), "big-endian")] {
        let mut bad = b.clone();
        bad[4..8].copy_from_slice(&v.to_le_bytes());
        std::fs::write(&p, &bad).expect("write");
        let err = load_err(&p, LoadFormat::Gguf);
        assert!(matches!(err, FormatError::Gguf { .. }) && err.to_string().contains(needle), "{err}");
    }
}

#[test]
fn truncated_gguf_is_detected_at_every_cut() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (p, b) = gguf_bytes(tmp.path());
    // Cuts in the header, the metadata, the tensor infos and the tensor data.
    for cut in [3, 10, 30, 200, b.len() / 3, b.len() / 2, b.len() - 64] {
        std::fs::write(&p, &b[..cut]).expect("write");
        let err = load_err(&p, LoadFormat::Gguf);
        assert!(matches!(err, FormatError::Gguf { .. }), "cut {cut}: {err}");
        assert!(err.to_string().contains("m.gguf"), "{err}");
    }
}

#[test]
fn corrupt_gguf_counts_do_not_allocate_or_panic() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (p, b) = gguf_bytes(tmp.path());
    let mut bad = b.clone();
    bad[16..24].copy_from_slice(&u64::MAX.to_le_bytes()); // metadata count
    std::fs::write(&p, &bad).expect("write");
    assert!(matches!(load_err(&p, LoadFormat::Gguf), FormatError::Gguf { .. }));
    let mut bad = b;
    bad[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes()); // tensor count
    std::fs::write(&p, &bad).expect("write");
    assert!(matches!(load_err(&p, LoadFormat::Gguf), FormatError::Gguf { .. }));
}

#[test]
fn unsupported_gguf_tensor_type_is_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (p, mut b) = gguf_bytes(tmp.path());
    // Patch the type id of blk.0.ffn_up.weight (after its 2 dims) to Q6_K (14).
    let name = b"blk.0.ffn_up.weight";
    let at = b.windows(name.len()).position(|w| w == name).expect("tensor info");
    let ty_at = at + name.len() + 4 + 16;
    b[ty_at..ty_at + 4].copy_from_slice(&14u32.to_le_bytes());
    std::fs::write(&p, &b).expect("write");
    let err = load_err(&p, LoadFormat::Gguf);
    let msg = err.to_string();
    assert!(matches!(err, FormatError::Unsupported { .. }) && msg.contains("Q6_K") && msg.contains("ffn_up"), "{msg}");
}

#[test]
fn gguf_missing_tensor_and_unknown_tokenizer_model() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec::llama();
    // A vocabulary kind llama.cpp writes that Baton does not read (WordPiece) is refused by name.
    let p = tmp.path().join("bert.gguf");
    let mut w = gguf_writer(&spec, GgufType::F16).expect("writer");
    w.add_meta("tokenizer.ggml.model", GgufValue::String("bert".into()));
    w.write(&p).expect("write");
    let err = load_err(&p, LoadFormat::Gguf);
    assert!(matches!(err, FormatError::Unsupported { .. }) && err.to_string().contains("\"bert\""), "{err}");
    // A SentencePiece (`llama`) vocabulary without its scores is refused naming them.
    let p = tmp.path().join("spm.gguf");
    let mut w = gguf_writer(&spec, GgufType::F16).expect("writer");
    w.add_meta("tokenizer.ggml.model", GgufValue::String("llama".into()));
    w.write(&p).expect("write");
    let err = load_err(&p, LoadFormat::Gguf);
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");

    // One layer more in the metadata than in the tensors.
    let p = tmp.path().join("short.gguf");
    let mut w = gguf_writer(&spec, GgufType::F16).expect("writer");
    w.add_meta("llama.block_count", GgufValue::U32(3));
    w.write(&p).expect("write");
    let err = load_err(&p, LoadFormat::Gguf);
    assert!(matches!(err, FormatError::MissingTensor { ref name, .. } if name.starts_with("model.layers.2.")), "{err}");
}

#[test]
fn missing_files_are_named() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let nowhere = tmp.path().join("nope");
    let err = load_err(&nowhere, LoadFormat::Auto);
    assert!(err.to_string().contains("nope"), "{err}");
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let err = load_err(&empty, LoadFormat::Safetensors);
    assert!(err.to_string().contains("config.json"), "{err}");
    let err = load_err(&tmp.path().join("x.json"), LoadFormat::Dummy);
    assert!(matches!(err, FormatError::Io { .. }), "{err}");
    std::fs::write(tmp.path().join("x.json"), "{ not json").expect("write");
    let err = load_err(&tmp.path().join("x.json"), LoadFormat::Dummy);
    assert!(matches!(err, FormatError::Json { .. }), "{err}");
}

#[test]
fn config_validation_catches_inconsistencies() {
    let good = TinySpec::llama().config();
    good.validate().expect("valid");
    let cases: Vec<(ModelConfig, &str)> = vec![
        (ModelConfig { num_key_value_heads: 3, ..good.clone() }, "multiple"),
        (ModelConfig { head_dim: 15, ..good.clone() }, "even"),
        (ModelConfig { hidden_size: 0, ..good.clone() }, "hidden_size"),
        (ModelConfig { rms_norm_eps: 0.0, ..good.clone() }, "rms_norm_eps"),
        (ModelConfig { rope_theta: f32::NAN, ..good.clone() }, "rope_theta"),
        (ModelConfig { eos_token_ids: vec![100_000], ..good.clone() }, "100000"),
        (
            ModelConfig { rope_scaling: Some(baton_formats::RopeScaling::Linear { factor: -1.0 }), ..good.clone() },
            "factor",
        ),
    ];
    for (cfg, needle) in cases {
        let err = cfg.validate().expect_err("invalid");
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_dir(tmp.path());
    // YaRN is implemented; an option of it that is not is refused at load, naming it.
    edit_config(&dir, |v| {
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 1.0})
    });
    let err = load_err(&dir, LoadFormat::Auto);
    assert!(err.to_string().contains("yarn option \"extrapolation_factor\""), "{err}");
}

#[test]
fn absurd_sizes_are_errors_not_allocations() {
    let big = ModelConfig { vocab_size: 1 << 40, ..TinySpec::llama().config() };
    let err = big.validate().expect_err("too large");
    assert!(err.to_string().contains("implausibly large"), "{err}");

    let tmp = tempfile::tempdir().expect("tempdir");
    let (p, mut b) = gguf_bytes(tmp.path());
    let name = b"blk.0.ffn_up.weight";
    let at = b.windows(name.len()).position(|w| w == name).expect("tensor info") + name.len() + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    b[at + 8..at + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&p, &b).expect("write");
    let err = load_err(&p, LoadFormat::Gguf);
    assert!(matches!(err, FormatError::Gguf { .. }) && err.to_string().contains("ffn_up"), "{err}");
}
