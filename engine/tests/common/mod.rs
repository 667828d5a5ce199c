//! Shared helpers for the engine's integration tests: tiny models written
//! through the real writers and loaded through the real loaders, and a
//! synchronous way to run requests to completion.

#![allow(dead_code)]

pub mod relay;
pub mod teacher_forced;

use baton_core::api::{EngineClient, EngineOutput, EngineRequest, FinishReason, OutputStream};
use baton_core::params::SamplingParams;
use baton_engine::{DeviceSpec, EngineConfig, EngineHandle, start_engine};
use baton_formats::testing::{TinySpec, write_hf_folder};
use baton_formats::{LoadFormat, LoadedModel, load_model};
use std::path::PathBuf;

/// A tiny model written to a fresh temp dir and loaded back.
pub struct TinyModel {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub model: LoadedModel,
}

pub fn tiny(spec: &TinySpec) -> TinyModel {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = write_hf_folder(dir.path(), spec).expect("write tiny model");
    let model = load_model(&path, LoadFormat::Auto).expect("load tiny model");
    TinyModel { dir, path, model }
}

pub fn engine(model: &LoadedModel, cfg: EngineConfig) -> EngineHandle {
    start_engine(model, DeviceSpec::Cpu, EngineConfig { num_threads: Some(2), ..cfg }).expect("start engine")
}

/// Collects a request's tokens until it finishes.
pub fn drain(mut s: OutputStream) -> (Vec<u32>, Vec<EngineOutput>, FinishReason) {
    let mut toks = Vec::new();
    let mut outs = Vec::new();
    while let Some(o) = s.blocking_next() {
        let o = o.expect("engine error");
        toks.extend_from_slice(&o.new_token_ids);
        let fin = o.finish_reason;
        outs.push(o);
        if let Some(f) = fin {
            return (toks, outs, f);
        }
    }
    panic!("stream ended without a finish reason");
}

pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::greedy() }
}

pub fn run(engine: &EngineHandle, prompt: &[u32], params: SamplingParams) -> Vec<u32> {
    let s = engine.submit(EngineRequest::new(prompt.to_vec(), params)).expect("submit");
    drain(s).0
}

/// Deterministic pseudo-random prompt of `len` tokens below `vocab`.
pub fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    baton_formats::testing::random_token_ids(seed, len, vocab)
}

/// Waits until the engine reports every KV block free (the no-leak invariant).
pub fn assert_all_blocks_free(engine: &EngineHandle) {
    for _ in 0..500 {
        let s = engine.stats();
        if s.num_used_blocks == 0 && s.num_running == 0 && s.num_waiting == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("blocks still in use: {:?}", engine.stats());
}

/// The golden fixture `name` (a tiny checkpoint transformers wrote) as it was written.
pub fn golden_model(name: &str) -> LoadedModel {
    let (dir, _) = baton_formats::testing::load_golden(name).expect("golden fixture");
    load_model(&dir, LoadFormat::Auto).expect("load golden fixture")
}

/// The Gemma golden fixture `name` made peaked, as a trained model is (the fixtures' logits
/// are nearly flat, top logprob ≈ −4): the final norm's scale `1 + w` multiplied by `factor`,
/// so the logits before the final soft-cap are `factor` times larger, and that soft-cap, where
/// the config has one, at the released Gemma 2's 30 (the fixture's 3 would flatten them again)
/// so that it still bends the larger logits.
pub fn peaked_gemma_fixture(name: &str, factor: f32) -> LoadedModel {
    let mut m = golden_model(name);
    if let Some(g) = m.config.gemma.as_mut()
        && g.final_logit_softcapping.is_some()
    {
        g.final_logit_softcapping = Some(30.0);
    }
    let norm = m.weights.get("model.norm.weight").expect("final norm").to_f32();
    let scaled: Vec<f32> = norm.iter().map(|w| factor * (1.0 + w) - 1.0).collect();
    m.weights = Box::new(Replaced { inner: m.weights, name: "model.norm.weight".into(), values: scaled });
    m
}

/// A golden fixture `name` whose final norm scales by a plain `w` (gpt-oss) made peaked:
/// `w` multiplied by `factor`, so the logits are `factor` times larger (as
/// [`peaked_gemma_fixture`] does for Gemma's `1 + w`).
pub fn peaked_fixture(name: &str, factor: f32) -> LoadedModel {
    let mut m = golden_model(name);
    assert!(m.config.gemma.is_none(), "{name}: Gemma's norms scale by 1 + w, see peaked_gemma_fixture");
    let norm = m.weights.get("model.norm.weight").expect("final norm").to_f32();
    let scaled: Vec<f32> = norm.iter().map(|w| factor * w).collect();
    m.weights = Box::new(Replaced { inner: m.weights, name: "model.norm.weight".into(), values: scaled });
    m
}

/// `m` with every tensor whose name ends in `suffix` (e.g. `v_proj.weight`) multiplied by
/// `factor`.
pub fn scaled_tensors(mut m: LoadedModel, suffix: &str, factor: f32) -> LoadedModel {
    for name in m.weights.names().into_iter().filter(|n| n.ends_with(suffix)) {
        let values: Vec<f32> = m.weights.get(&name).expect("tensor").to_f32().iter().map(|w| w * factor).collect();
        m.weights = Box::new(Replaced { inner: m.weights, name, values });
    }
    m
}

/// A weight store with one tensor's values replaced (f32, same shape).
struct Replaced {
    inner: Box<dyn baton_formats::WeightStore>,
    name: String,
    values: Vec<f32>,
}

impl baton_formats::WeightStore for Replaced {
    fn get(&self, name: &str) -> Result<baton_formats::TensorView<'_>, baton_formats::FormatError> {
        let view = self.inner.get(name)?;
        if name != self.name {
            return Ok(view);
        }
        let bytes = self.values.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        Ok(baton_formats::TensorView {
            name: view.name,
            shape: view.shape,
            dtype: baton_formats::DType::F32,
            bytes: bytes.into(),
        })
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
}
