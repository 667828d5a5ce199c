//! `export_hf`: a tiny random GGUF model (every quant type the test writer has) exported as a
//! HF folder loads back through Baton's safetensors loader with every tensor bit-identical
//! to the GGUF-dequantized one, the same config, tokenizer, template and stop ids; Q/K rows
//! come out in HF order; bf16 export rounds exactly; and the output-folder policy
//! (refuse non-empty unless forced, stale shards removed, bad paths) holds.

use std::path::Path;

use baton_formats::export::hf_config_json;
use baton_formats::testing::{TinySpec, write_gguf};
use baton_formats::{
    DType, ExportDType, ExportOptions, FormatError, GgufType, LoadFormat, LoadedModel, export_hf, load_model,
};

fn load(path: &Path) -> LoadedModel {
    load_model(path, LoadFormat::Auto).expect("model loads")
}

fn gguf_model(dir: &Path, spec: &TinySpec, ty: GgufType) -> LoadedModel {
    load(&write_gguf(&dir.join(format!("m-{ty:?}.gguf")), spec, ty).expect("write gguf"))
}

fn rel_rms(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

#[test]
fn exported_gguf_reloads_bit_identical_with_same_config_and_tokenizer() {
    for spec in [TinySpec::llama(), TinySpec::qwen2(), TinySpec::tied()] {
        for ty in [
            GgufType::F32,
            GgufType::F16,
            GgufType::BF16,
            GgufType::Q8_0,
            GgufType::Q4_1,
            GgufType::Q4_0,
            GgufType::MXFP4,
        ] {
            let tmp = tempfile::tempdir().expect("tmp");
            let src = gguf_model(tmp.path(), &spec, ty);
            let out = tmp.path().join("hf");
            let summary = export_hf(&src, &out, &ExportOptions::default()).expect("export");
            let what = format!("{:?} {ty:?}", spec.architecture);
            let expected = src.config.expected_tensors();
            assert_eq!(summary.tensors, expected.len(), "{what}");
            assert!(summary.tokenizer, "{what}: GGUF tokenizer exported");

            let back = load(&out);
            assert_eq!(back.config, src.config, "{what}: config round-trips");
            let mut names = back.weights.names();
            let mut want: Vec<String> = expected.iter().map(|(n, _)| n.clone()).collect();
            names.sort();
            want.sort();
            assert_eq!(names, want, "{what}: exactly the tensors the engine uses");

            let truth = spec.weights();
            for (name, shape) in &expected {
                let a = src.weights.get(name).expect("gguf tensor");
                let b = back.weights.get(name).expect("exported tensor");
                assert_eq!(b.dtype, DType::F32, "{what} {name}");
                assert_eq!(&b.shape, shape, "{what} {name}");
                let (av, bv) = (a.to_f32(), b.to_f32());
                assert!(
                    av.iter().zip(&bv).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{what} {name}: exported values differ from the GGUF loader's"
                );
                // Against the spec's HF-order weights: exact for lossless types, within
                // quantization noise otherwise. A Q/K row permutation left in place would be
                // off by the weights' own magnitude (relative error ~1.4).
                let t = truth.values(name).expect("spec tensor");
                let err = rel_rms(&bv, &t);
                let limit = match ty {
                    GgufType::F32 => 0.0,
                    GgufType::F16 => 1e-3,
                    // 8 mantissa bits: relative rms error ~2^-9.
                    GgufType::BF16 => 4e-3,
                    GgufType::Q8_0 => 0.02,
                    GgufType::Q4_0 | GgufType::Q4_1 => 0.2,
                    // e2m1 codes (eight magnitudes) under a power-of-two scale.
                    GgufType::MXFP4 => 0.3,
                };
                assert!(err <= limit, "{what} {name}: relative error {err} against the HF-order weights");
            }

            let (ta, tb) = (src.tokenizer.as_ref().expect("tok"), back.tokenizer.as_ref().expect("exported tok"));
            for text in ["hello world 123", "<|im_start|>user\nthe quick brown fox<|im_end|>"] {
                assert_eq!(tb.encode(text, false).expect("enc"), ta.encode(text, false).expect("enc"), "{what}");
            }
            assert_eq!(tb.vocab_size(), ta.vocab_size());
            assert_eq!((tb.bos_token(), tb.eos_token()), (ta.bos_token(), ta.eos_token()), "{what}");
            assert_eq!(
                back.chat_template.as_ref().map(|t| t.source().to_string()),
                src.chat_template.as_ref().map(|t| t.source().to_string()),
                "{what}: chat template"
            );
            assert_eq!(back.generation.eos_token_ids, src.generation.eos_token_ids, "{what}");
            assert_eq!(back.generation.bos_token_id, src.generation.bos_token_id, "{what}");
        }
    }
}

#[test]
fn config_json_has_every_field_transformers_needs() {
    let spec = TinySpec::tied();
    let tmp = tempfile::tempdir().expect("tmp");
    let src = gguf_model(tmp.path(), &spec, GgufType::Q4_1);
    let out = tmp.path().join("hf");
    export_hf(&src, &out, &ExportOptions { dtype: ExportDType::BF16, force: false }).expect("export");
    let text = std::fs::read_to_string(out.join("config.json")).expect("config.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v, hf_config_json(&src.config, ExportDType::BF16));
    assert_eq!(v["architectures"][0], "LlamaForCausalLM");
    assert_eq!(v["torch_dtype"], "bfloat16");
    assert_eq!(v["tie_word_embeddings"], true);
    assert_eq!(v["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(v["rope_scaling"]["factor"], 8.0);
    assert_eq!(v["rope_theta"], 500000.0);
    assert_eq!(v["rms_norm_eps"], 1e-5);
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert!(v[key].is_u64(), "config.json {key} = {}", v[key]);
    }
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("generation_config.json")).expect("gen")).expect("json");
    assert_eq!(g["eos_token_id"], serde_json::json!([2]));
    assert_eq!(g["do_sample"], false);
}

#[test]
fn bf16_export_is_the_round_to_nearest_even_of_the_loaded_weights() {
    let spec = TinySpec::llama();
    let tmp = tempfile::tempdir().expect("tmp");
    let src = gguf_model(tmp.path(), &spec, GgufType::Q8_0);
    let out = tmp.path().join("hf");
    let s = export_hf(&src, &out, &ExportOptions { dtype: ExportDType::BF16, force: false }).expect("export");
    let back = load(&out);
    let numel: usize = src.config.expected_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(s.tensor_bytes, 2 * numel as u64);
    for (name, _) in src.config.expected_tensors() {
        let b = back.weights.get(&name).expect("tensor");
        assert_eq!(b.dtype, DType::BF16, "{name}");
        let want: Vec<u16> =
            src.weights.get(&name).expect("src").to_f32().iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        let got: Vec<u16> = b.bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn non_empty_folder_is_refused_unless_forced_and_force_removes_stale_shards() {
    let spec = TinySpec::llama();
    let tmp = tempfile::tempdir().expect("tmp");
    let src = gguf_model(tmp.path(), &spec, GgufType::Q4_1);
    let out = tmp.path().join("hf");
    std::fs::create_dir_all(&out).expect("mkdir");
    std::fs::write(out.join("notes.txt"), "keep me").expect("write");
    std::fs::write(out.join("model-00001-of-00002.safetensors"), "stale").expect("write");

    let err = export_hf(&src, &out, &ExportOptions::default()).expect_err("non-empty folder refused");
    assert!(matches!(&err, FormatError::InvalidArgument(m) if m.contains("--force")), "{err}");
    assert!(!out.join("model.safetensors").exists(), "nothing written on refusal");
    assert_eq!(std::fs::read_to_string(out.join("model-00001-of-00002.safetensors")).expect("read"), "stale");

    export_hf(&src, &out, &ExportOptions { force: true, ..ExportOptions::default() }).expect("forced export");
    assert!(!out.join("model-00001-of-00002.safetensors").exists(), "stale shard removed");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).expect("read"), "keep me");
    let left: Vec<_> = std::fs::read_dir(&out).expect("ls").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(left.len(), 6, "exported files plus notes.txt, no temporary file left: {left:?}");
    let back = load(&out);
    assert_eq!(back.config, src.config);

    // Forcing again over a complete export rewrites it in place.
    export_hf(&src, &out, &ExportOptions { force: true, ..ExportOptions::default() }).expect("second forced export");
    assert_eq!(load(&out).weights.names().len(), src.config.expected_tensors().len());
}

#[test]
fn bad_output_paths_are_errors_naming_the_path() {
    let spec = TinySpec::llama();
    let tmp = tempfile::tempdir().expect("tmp");
    let src = gguf_model(tmp.path(), &spec, GgufType::F16);
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "x").expect("write");

    // The output path is a file.
    let err = export_hf(&src, &file, &ExportOptions { force: true, ..ExportOptions::default() }).expect_err("file");
    assert!(err.to_string().contains("not a folder"), "{err}");
    // Its parent is a file, so the folder cannot be created (unwritable even for root).
    let under = file.join("sub");
    let err = export_hf(&src, &under, &ExportOptions::default()).expect_err("parent is a file");
    assert!(matches!(&err, FormatError::Io { path, .. } if path == &under), "{err}");
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused_before_writing() {
    let spec = TinySpec::llama();
    let tmp = tempfile::tempdir().expect("tmp");
    let mut src = gguf_model(tmp.path(), &spec, GgufType::F32);
    // Weights of a model with a wider MLP than the config says.
    let wider = TinySpec { intermediate_size: spec.intermediate_size * 2, ..spec.clone() };
    src.weights = Box::new(wider.weights());
    let out = tmp.path().join("hf");
    let err = export_hf(&src, &out, &ExportOptions::default()).expect_err("shape mismatch");
    assert!(matches!(&err, FormatError::ShapeMismatch { name, .. } if name.contains("mlp")), "{err}");
    assert_eq!(std::fs::read_dir(&out).expect("ls").count(), 0, "nothing written");
}
