//! FP8 checkpoints (fixtures written by scripts/golden/make_fp8.py from the formats' public
//! descriptions) through the real loader: each format's weights dequantize bit for bit to what
//! torch computes, and bad scales are refused at load naming the tensor.

use std::path::{Path, PathBuf};

use baton_formats::{
    ActivationQuant, DType, Fp8ScaleLayout, LoadFormat, QuantSource, SafetensorsStore, WeightStore, load_model,
    read_fp8_weight,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fp8").join(name)
}

#[test]
fn each_fp8_format_loads_and_dequantizes_as_torch_does() {
    let cases = [
        (
            "block",
            QuantSource::HfFp8,
            Fp8ScaleLayout::Block { rows: 32, cols: 48 },
            ActivationQuant::DynamicPerToken,
            14,
        ),
        ("tensor", QuantSource::HfFp8, Fp8ScaleLayout::PerTensor, ActivationQuant::DynamicPerToken, 14),
        ("ct", QuantSource::CompressedTensors, Fp8ScaleLayout::PerChannel, ActivationQuant::DynamicPerToken, 13),
    ];
    for (name, source, layout, activations, count) in cases {
        let dir = fixture(name);
        let model = load_model(&dir, LoadFormat::Auto).expect("loads");
        let q = model.config.quantization.clone().expect("quantized");
        assert_eq!((&q.source, q.layout, q.activations), (&source, layout, activations), "{name}");
        let reference =
            SafetensorsStore::open_files(&[dir.join("reference/dequantized.safetensors")]).expect("reference");
        let mut checked = 0;
        for wname in reference.names() {
            let want = reference.get(&wname).expect("reference tensor");
            let [rows, cols] = want.shape[..] else { panic!("{wname} is not a matrix") };
            assert!(!q.skips(&wname), "{name}: {wname}");
            let w = read_fp8_weight(model.weights.as_ref(), &q, &wname, rows, cols, &dir).expect("fp8 weight");
            let got = w.dequantize();
            let want = want.to_f32();
            assert_eq!(got.len(), want.len());
            for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), r.to_bits(), "{name} {wname}[{i}]: {g} vs torch {r}");
            }
            checked += 1;
        }
        assert_eq!(checked, count, "{name}");
        // What stays unquantized is stored as it was (and read as such).
        assert_eq!(model.weights.get("lm_head.weight").expect("lm head").dtype, DType::F32);
    }
    let ct = load_model(&fixture("ct"), LoadFormat::Auto).expect("loads");
    let q = ct.config.quantization.expect("quantized");
    assert!(q.skips("model.layers.1.mlp.down_proj.weight") && !q.skips("model.layers.0.mlp.down_proj.weight"));
    assert_eq!(ct.weights.get("model.layers.1.mlp.down_proj.weight").expect("kept").dtype, DType::F32);
}

/// A replacement tensor: dtype, shape, bytes.
type Replacement = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// A copy of fixture `name` in a temp dir whose tensor `target` is replaced by `(dtype, shape, bytes)`
/// (or removed with `None`), and whose config.json is rewritten by `edit_config`.
fn altered(
    name: &str,
    target: &str,
    replacement: Option<Replacement>,
    edit_config: impl Fn(&mut serde_json::Value),
) -> tempfile::TempDir {
    let src = fixture(name);
    let tmp = tempfile::tempdir().expect("tempdir");
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).expect("copy");
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("config")).expect("json");
    edit_config(&mut config);
    std::fs::write(tmp.path().join("config.json"), config.to_string()).expect("write config");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    tensors.retain(|t| t.0 != target);
    if let Some((dtype, shape, data)) = replacement {
        tensors.push((target.to_string(), dtype, shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).expect("write");
    tmp
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn bad_fp8_scales_are_refused_at_load_naming_the_tensor() {
    use safetensors::Dtype;
    let q = "model.layers.0.self_attn.q_proj.weight";
    let block_scale = format!("{q}_scale_inv");
    let channel_scale = format!("{q}_scale");
    // block: q_proj is 64×64 with [32, 48] blocks: 2×2 scales.
    let cases: Vec<(&str, String, Option<Replacement>, &str)> = vec![
        ("block", block_scale.clone(), Some((Dtype::F32, vec![2, 2], f32_bytes(&[1.0, f32::NAN, 1.0, 1.0]))), "NaN"),
        ("block", block_scale.clone(), Some((Dtype::F32, vec![2, 2], f32_bytes(&[1.0, 1.0, 0.0, 1.0]))), "holds 0"),
        ("block", block_scale.clone(), Some((Dtype::F32, vec![2, 2], f32_bytes(&[1.0, -2.0, 1.0, 1.0]))), "holds -2"),
        ("block", block_scale.clone(), Some((Dtype::F32, vec![1, 4], f32_bytes(&[1.0; 4]))), "expected"),
        ("block", block_scale.clone(), None, "missing tensor"),
        ("tensor", channel_scale.clone(), Some((Dtype::F32, vec![], f32_bytes(&[f32::INFINITY]))), "inf"),
        ("tensor", channel_scale.clone(), Some((Dtype::F32, vec![2], f32_bytes(&[1.0, 1.0]))), "expected"),
        ("ct", channel_scale.clone(), Some((Dtype::F32, vec![64, 1], f32_bytes(&[0.0; 64]))), "holds 0"),
        ("ct", channel_scale.clone(), Some((Dtype::F32, vec![32, 1], f32_bytes(&[1.0; 32]))), "expected"),
        ("ct", channel_scale.clone(), Some((Dtype::F8_E4M3, vec![64, 1], vec![0x38; 64])), "expected a float"),
    ];
    for (name, target, replacement, needle) in cases {
        let tmp = altered(name, &target, replacement, |_| {});
        let err = load_model(tmp.path(), LoadFormat::Auto).expect_err("refused").to_string();
        assert!(err.contains(&format!("{target:?}")) && err.contains(needle), "{name} {target} {needle}: {err}");
    }
}

#[test]
fn fp8_tensors_the_config_does_not_quantize_are_refused_by_name() {
    let q = "model.layers.0.self_attn.q_proj.weight";
    // No quantization_config at all.
    let tmp = altered("ct", "", None, |c| {
        c.as_object_mut().expect("object").remove("quantization_config");
    });
    let err = load_model(tmp.path(), LoadFormat::Auto).expect_err("refused").to_string();
    assert!(err.contains("F8_E4M3") && err.contains("no quantization_config"), "{err}");
    // The module is in `ignore` but stored as FP8.
    let tmp = altered("ct", "", None, |c| {
        c["quantization_config"]["ignore"] = serde_json::json!(["lm_head", "model.layers.0.self_attn.q_proj"]);
    });
    let err = load_model(tmp.path(), LoadFormat::Auto).expect_err("refused").to_string();
    assert!(err.contains(&format!("{q:?}")) && err.contains("unquantized"), "{err}");
    // A static activation scheme is refused naming its key.
    let tmp = altered("tensor", "", None, |c| c["quantization_config"]["activation_scheme"] = "static".into());
    let err = load_model(tmp.path(), LoadFormat::Auto).expect_err("refused").to_string();
    assert!(err.contains("activation_scheme"), "{err}");
}
