//! gpt-oss GGUF files as llama.cpp's converter writes them (`scripts/golden/make_gguf_gpt_oss.py`:
//! llama.cpp's `gguf` package writing the golden gpt-oss checkpoints, MXFP4 experts repacked,
//! float experts fused) load to the same config and, tensor for tensor, the same bits as the
//! HF checkpoints they came from. The engine-level test (`engine/tests/golden.rs`) runs them
//! against transformers' logits.

use std::path::{Path, PathBuf};

use baton_formats::config::{Architecture, LayerType, RopeScaling};
use baton_formats::gguf::{GgufFile, GgufType, GgufValue, GgufWriter};
use baton_formats::testing::golden_checkpoint_copy;
use baton_formats::{LoadFormat, LoadedModel, load_model};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name)
}

/// The HF checkpoint `name` without its reference files (`gpt_oss_mxfp4`'s experts then come
/// from the MXFP4 blocks).
fn hf(name: &str, tmp: &Path) -> LoadedModel {
    let dir = golden_checkpoint_copy(name, tmp).expect("copy the checkpoint");
    load_model(&dir, LoadFormat::Auto).expect("load the HF checkpoint")
}

fn assert_same_tensors(gguf: &LoadedModel, hf: &LoadedModel, what: &str) {
    let expected = hf.config.expected_tensors();
    assert!(expected.iter().any(|(n, _)| n.ends_with("gate_up_proj")), "{what}: expert tensors expected");
    for (name, shape) in expected {
        let a = gguf.weights.get(&name).unwrap_or_else(|e| panic!("{what}: GGUF lacks {name}: {e}"));
        let b = hf.weights.get(&name).expect("HF tensor");
        assert_eq!(a.shape, shape, "{what}: {name} shape");
        assert_eq!(a.to_f32(), b.to_f32(), "{what}: {name} differs");
    }
}

#[test]
fn gpt_oss_gguf_config_matches_the_checkpoint() {
    let tmp = tempfile::tempdir().expect("tmp");
    let g = load_model(&fixture("gpt_oss_mxfp4.gguf"), LoadFormat::Auto).expect("load the GGUF");
    let h = hf("gpt_oss_mxfp4", tmp.path());
    let (a, b) = (&g.config, &h.config);
    assert_eq!(a.architecture, Architecture::GptOss);
    assert_eq!(a.moe, b.moe, "routing");
    assert_eq!(a.gpt_oss, b.gpt_oss, "clamped SwiGLU");
    assert_eq!(a.layer_types, vec![LayerType::Sliding, LayerType::Full]);
    assert_eq!((a.layer_types.clone(), a.sliding_window), (b.layer_types.clone(), b.sliding_window), "window");
    assert_eq!(a.rope_scaling, b.rope_scaling, "YaRN");
    assert!(matches!(a.rope_scaling, Some(RopeScaling::Yarn { truncate: false, factor: 32.0, .. })));
    assert_eq!((a.rope_theta, a.head_dim, a.attention_bias), (b.rope_theta, b.head_dim, b.attention_bias));
    assert_eq!((a.hidden_size, a.intermediate_size, a.vocab_size), (b.hidden_size, b.intermediate_size, b.vocab_size));
    assert_eq!((a.num_attention_heads, a.num_key_value_heads), (b.num_attention_heads, b.num_key_value_heads));
    assert_eq!(a.tie_word_embeddings, b.tie_word_embeddings);
    let tok = g.tokenizer.as_ref().expect("the GGUF's tokenizer");
    let want = h.tokenizer.as_ref().expect("tokenizer.json");
    for text in ["hello world 12345", "Sinks and windows."] {
        assert_eq!(tok.encode(text, false).expect("encode"), want.encode(text, false).expect("encode"), "{text:?}");
    }
}

#[test]
fn mxfp4_gguf_experts_equal_the_checkpoints_bit_for_bit() {
    // Split gate/up experts in MXFP4 (the converter's repacking): every tensor, the experts'
    // interleaved gate/up and transposed down included, equals the HF MXFP4 path's.
    let tmp = tempfile::tempdir().expect("tmp");
    let g = load_model(&fixture("gpt_oss_mxfp4.gguf"), LoadFormat::Auto).expect("load the GGUF");
    assert_same_tensors(&g, &hf("gpt_oss_mxfp4", tmp.path()), "MXFP4, split gate/up");
}

#[test]
fn fused_f32_gguf_experts_equal_the_checkpoints_bit_for_bit() {
    // Fused `ffn_gate_up_exps` (gate rows, then up rows) in F32.
    let tmp = tempfile::tempdir().expect("tmp");
    let g = load_model(&fixture("gpt_oss_fused_f32.gguf"), LoadFormat::Auto).expect("load the GGUF");
    assert_same_tensors(&g, &hf("gpt_oss", tmp.path()), "F32, fused gate/up");
}

/// The MXFP4 fixture rewritten without metadata key `drop`, with `extra` added, and with one
/// MXFP4 block's scale set to e8m0's NaN when `nan_scale`.
fn rewritten(dst: &Path, drop: &str, extra: Option<(&str, GgufValue)>, nan_scale: bool) -> PathBuf {
    let src = GgufFile::open(&fixture("gpt_oss_mxfp4.gguf")).expect("open");
    let mut w = GgufWriter::new();
    let mut keys: Vec<_> = src.metadata.iter().filter(|(k, _)| k.as_str() != drop).collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in keys {
        w.add_meta(k, v.clone());
    }
    if let Some((k, v)) = extra {
        w.add_meta(k, v);
    }
    for t in &src.tensors {
        let ty = GgufType::from_id(t.ggml_type).expect("type");
        let mut bytes = src.tensor_bytes(t, ty).expect("bytes").to_vec();
        if nan_scale && t.name == "blk.1.ffn_down_exps.weight" {
            bytes[17 * 3] = 255;
        }
        w.add_raw_tensor(&t.name, &t.dims, ty, bytes);
    }
    let path = dst.join(format!("edited-{drop}-{nan_scale}.gguf"));
    w.write(&path).expect("write");
    path
}

#[test]
fn gpt_oss_gguf_refusals_name_the_problem() {
    let tmp = tempfile::tempdir().expect("tmp");
    // The control: the rewrite itself changes nothing the reader checks.
    load_model(&rewritten(tmp.path(), "", None, false), LoadFormat::Auto).expect("the unedited rewrite loads");
    let ext = Some(("gpt-oss.rope.scaling.yarn_ext_factor", GgufValue::F32(2.0)));
    let cases = [
        ("no expert count", "gpt-oss.expert_count", None, false, "gpt-oss.expert_count"),
        ("an extrapolation factor", "", ext, false, "gpt-oss.rope.scaling.yarn_ext_factor 2"),
        ("no YaRN factor", "gpt-oss.rope.scaling.factor", None, false, "gpt-oss.rope.scaling.factor"),
        ("a NaN scale", "", None, true, "\"blk.1.ffn_down_exps.weight\": MXFP4 block 3 has the NaN scale"),
    ];
    for (what, drop, extra, nan, needle) in cases {
        let err = load_model(&rewritten(tmp.path(), drop, extra, nan), LoadFormat::Auto)
            .err()
            .unwrap_or_else(|| panic!("{what}: loaded"))
            .to_string();
        assert!(err.contains(needle), "{what}: {err}");
    }
}
