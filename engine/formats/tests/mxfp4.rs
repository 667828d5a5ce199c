//! MXFP4 checkpoints through the safetensors store: the gpt_oss_mxfp4 fixture
//! (`scripts/golden/make_mxfp4.py`: gpt-oss's published layout, with edge-case groups) serves
//! each expert weight as exactly the tensor transformers holds after loading the same folder
//! (`dequantized.safetensors`), and bad MXFP4 data is refused naming the tensor.

use baton_formats::safetensors_store::SafetensorsStore;
use baton_formats::tensor::{DType, WeightStore};
use baton_formats::testing::golden_fixtures_dir;
use std::collections::HashMap;

const EXPERTS: [&str; 4] = [
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.experts.down_proj",
    "model.layers.1.mlp.experts.gate_up_proj",
    "model.layers.1.mlp.experts.down_proj",
];

fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
}

#[test]
fn mxfp4_experts_dequantize_to_what_transformers_loads() {
    let dir = golden_fixtures_dir().join("gpt_oss_mxfp4");
    let store = SafetensorsStore::open_files(&[dir.join("model.safetensors")]).expect("open the MXFP4 checkpoint");
    let reference = SafetensorsStore::open_files(&[dir.join("dequantized.safetensors")]).expect("open the reference");
    let names = store.names();
    for name in EXPERTS {
        assert!(names.contains(&name.to_owned()), "{name} is served");
        for part in ["_blocks", "_scales"] {
            assert!(!names.contains(&format!("{name}{part}")), "{name}{part} is not listed");
        }
        let got = store.get(name).expect("dequantize");
        let want = reference.get(name).expect("reference tensor");
        assert_eq!(got.dtype, DType::BF16);
        assert_eq!(got.shape, want.shape, "{name}: shape");
        assert_eq!(store.shape(name).expect("shape"), want.shape, "{name}: shape without reading");
        let want: Vec<f32> = want.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let got = bf16_values(&got.bytes);
        let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{name}: {differ} of {} values differ from transformers'", want.len());
    }
    // The forced edge cases are in there: ±6·8 = ±48, negative zeros, zeros at 2^-127.
    let gate_up = bf16_values(&store.get(EXPERTS[0]).expect("get").bytes);
    assert!(gate_up.contains(&48.0) && gate_up.contains(&-48.0), "the ±6 codes at scale 2^3");
    assert!(gate_up.iter().any(|v| *v == 0.0 && v.is_sign_negative()), "negative zero codes");
    // Tensors that were not quantized are served as stored.
    assert_eq!(store.get("model.layers.0.self_attn.sinks").expect("sinks").dtype, DType::F32);
}

/// Writes `tensors` (name → (dtype, shape, bytes)) to `dir/model.safetensors`.
fn write(dir: &std::path::Path, tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> std::path::PathBuf {
    let views: HashMap<String, safetensors::tensor::TensorView<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| ((*n).to_owned(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(&views, None, &path).expect("write");
    path
}

#[test]
fn bad_mxfp4_data_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let u8t = safetensors::Dtype::U8;
    // A NaN scale: refused when the tensor is read.
    let path = write(
        dir.path(),
        &[("w_blocks", u8t, vec![1, 2, 1, 16], vec![0x11; 32]), ("w_scales", u8t, vec![1, 2, 1], vec![127, 255])],
    );
    let store = SafetensorsStore::open_files(&[path]).expect("open");
    let err = store.get("w").expect_err("NaN scale");
    assert!(err.to_string().contains("\"w_scales\"") && err.to_string().contains("NaN"), "{err}");
    // Blocks and scales that do not fit each other: refused at open.
    let path = write(
        dir.path(),
        &[("w_blocks", u8t, vec![1, 2, 1, 16], vec![0x11; 32]), ("w_scales", u8t, vec![1, 3, 1], vec![127; 3])],
    );
    let err = SafetensorsStore::open_files(&[path]).expect_err("misfit shapes");
    assert!(err.to_string().contains("\"w\"") && err.to_string().contains("do not fit"), "{err}");
    // A lone u8 tensor is not MXFP4: it stays an unsupported dtype, named when read.
    let path = write(dir.path(), &[("w_blocks", u8t, vec![1, 2, 1, 16], vec![0x11; 32])]);
    let store = SafetensorsStore::open_files(&[path]).expect("open");
    assert!(store.get("w").is_err(), "no scales: no tensor w");
    let err = store.get("w_blocks").expect_err("u8");
    assert!(err.to_string().contains("w_blocks") && err.to_string().contains("U8"), "{err}");
}
