//! The FP8 (E4M3) KV cache on the CPU reference backend (`--kv-cache-dtype fp8`).
//!
//! Accuracy is reported as figures, not asserted against tuned thresholds: for the golden
//! tiny models and the default model, the bf16-emulating backend with an FP8 cache against
//! the same backend with its bf16 cache, teacher-forced over 64 greedy tokens of the bf16 run:
//! mean and max |Δlogit| and how often the greedy (argmax) token agrees. Only loose sanity is
//! asserted (finite logits, agreement ≥ 50 %). Also: the pool holds 4× the blocks of the f32
//! cache (2× bf16) for the same budget, checkpoint scales are used and bad ones refused naming
//! the tensor, and a disaggregated FP8 hand-off over TCP gives exactly the unified FP8 tokens,
//! while a P/D dtype mismatch is refused.

mod common;

use baton_core::api::{EngineClient, EngineRequest};
use baton_core::kv_transfer::KvDtype;
use baton_engine::EngineConfig;
use baton_engine::backend::KvCacheShape;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::runner::ModelRunner;
use baton_formats::testing::{TinySpec, default_model_path, load_golden};
use baton_formats::{DType, FormatError, LoadFormat, LoadedModel, TensorView, WeightStore, load_model};
use common::relay::*;
use common::teacher_forced::{self, Figures, Seq};
use common::*;

/// FP8 KV vs bf16 KV, teacher-forced on the bf16 run's greedy tokens.
fn compare(model: &LoadedModel, prompt: &[u32], steps: usize) -> Figures {
    let store = model.weights.as_ref();
    let mut bf16 = Seq::new(model, store, KvCacheDtype::Auto, prompt.len() + steps);
    let mut fp8 = Seq::new(model, store, KvCacheDtype::Fp8E4M3, prompt.len() + steps);
    assert_eq!(fp8.runner.kv_dtype(), KvDtype::Fp8E4M3);
    teacher_forced::compare(prompt, steps, |t| bf16.feed(t), |t| fp8.feed(t))
}

fn report(name: &str, f: &Figures) {
    f.report("fp8-kv", name);
}

#[test]
fn fp8_kv_vs_bf16_on_the_golden_models() {
    // Gemma 2/3 (sliding windows, soft-caps) and gpt-oss (windows, sinks) through the FP8
    // cache's attention with its options.
    for name in ["llama", "qwen2", "tied", "qwen3", "gemma2", "gemma3_text", "gpt_oss"] {
        let (dir, golden) = load_golden(name).expect("golden fixture");
        let model = load_model(&dir, LoadFormat::Auto).expect("load fixture");
        let f = compare(&model, &golden.prompts[0].ids, 64);
        report(name, &f);
        // The FP8 cache really is used: its logits are not the bf16 cache's.
        assert!(f.max_abs > 0.0, "{name}: FP8 KV gave bit-identical logits");
    }
}

#[test]
fn fp8_kv_vs_bf16_on_the_default_model() {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run scripts/fetch-default-model.sh", path.display());
    let model = load_model(&path, LoadFormat::Auto).expect("load default model");
    let tok = model.tokenizer.as_ref().expect("tokenizer");
    let prompt = tok.encode("The capital of France is Paris. The capital of Italy is", false).expect("encode");
    report("SmolLM2-135M", &compare(&model, &prompt, 64));
}

#[test]
fn the_pool_holds_more_blocks_per_byte_with_fp8() {
    let shape =
        |dtype| KvCacheShape { num_layers: 32, num_blocks: 1, block_size: 16, num_kv_heads: 8, head_dim: 128, dtype };
    let budget = 10usize << 30;
    let (bf16, fp8) = (shape(KvDtype::BF16).blocks_in(budget), shape(KvDtype::Fp8E4M3).blocks_in(budget));
    // Llama-3.1-8B: 128 KiB of bf16 KV per token, 64 KiB in FP8.
    assert_eq!(shape(KvDtype::BF16).bytes_per_token(), 131_072);
    assert_eq!(shape(KvDtype::Fp8E4M3).bytes_per_token(), 65_536);
    assert_eq!((bf16, fp8), (5120, 10_240));
    // Through the engine: the same CPU budget holds 4× the f32 cache's blocks.
    let m = tiny(&TinySpec::llama());
    let cfg = EngineConfig { kv_cache_memory_bytes: 4 << 20, ..EngineConfig::default() };
    let f32_engine = engine(&m.model, cfg.clone());
    let fp8_engine = engine(&m.model, EngineConfig { kv_cache_dtype: KvCacheDtype::Fp8E4M3, ..cfg });
    let blocks = |e: &baton_engine::EngineHandle| e.info().num_blocks;
    assert_eq!(blocks(&fp8_engine), 4 * blocks(&f32_engine));
    assert_eq!(fp8_engine.kv_layout().dtype, KvDtype::Fp8E4M3);
    assert_eq!(f32_engine.kv_layout().dtype, KvDtype::F32);
    // bf16 storage is the CUDA backend's; the CPU backend refuses it at start, naming it.
    let err = baton_engine::start_engine(
        &m.model,
        baton_engine::DeviceSpec::Cpu,
        EngineConfig { kv_cache_dtype: KvCacheDtype::Bf16, num_threads: Some(1), ..EngineConfig::default() },
    )
    .err()
    .expect("bf16 refused on the CPU");
    assert!(err.to_string().contains("BF16"), "{err}");
    for e in [f32_engine, fp8_engine] {
        e.shutdown();
    }
}

/// A model's tensors plus one extra scalar tensor.
struct WithScale<'a> {
    inner: &'a dyn WeightStore,
    name: String,
    value: f32,
}

impl WeightStore for WithScale<'_> {
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        if name == self.name {
            return Ok(TensorView {
                name: name.to_string(),
                shape: vec![],
                dtype: DType::F32,
                bytes: self.value.to_le_bytes().to_vec().into(),
            });
        }
        self.inner.get(name)
    }
    fn names(&self) -> Vec<String> {
        let mut n = self.inner.names();
        n.push(self.name.clone());
        n
    }
}

#[test]
fn checkpoint_scales_are_used_and_bad_ones_refused_naming_the_tensor() {
    let m = tiny(&TinySpec::llama());
    let prompt = prompt(3, 20, m.model.config.vocab_size);
    let name = "model.layers.1.self_attn.v_scale".to_string();
    let with = |value| WithScale { inner: m.model.weights.as_ref(), name: name.clone(), value };
    let logits = |store: &dyn WeightStore| Seq::new(&m.model, store, KvCacheDtype::Fp8E4M3, 32).feed(&prompt);
    let plain = logits(m.model.weights.as_ref());
    assert_eq!(logits(&with(1.0)), plain, "a stored scale of 1.0 is the default");
    assert_ne!(logits(&with(1e-3)), plain, "a stored scale changes what the cache holds");
    for bad in [0.0, -2.0, f32::NAN, f32::INFINITY] {
        let store = with(bad);
        let mut r = ModelRunner::load(&m.model.config, &store, CpuBackend::new()).expect("load");
        let err = r.set_kv_cache_dtype(KvCacheDtype::Fp8E4M3, &store).expect_err("bad scale refused");
        assert!(err.to_string().contains(&name), "{bad}: {err}");
        // The bf16/f32 cache does not read the scales at all.
        r.set_kv_cache_dtype(KvCacheDtype::Auto, &store).expect("auto ignores the scales");
    }
}

#[test]
fn a_disaggregated_fp8_hand_off_matches_unified_fp8_and_a_dtype_mismatch_is_refused() {
    let m = tiny(&TinySpec::llama());
    let vocab = m.model.config.vocab_size;
    let cfg = EngineConfig { kv_cache_dtype: KvCacheDtype::Fp8E4M3, ..EngineConfig::default() };
    let unified = engine(&m.model, cfg.clone());
    let p = engine(&m.model, cfg.clone());
    let d = engine(&m.model, cfg);
    let f32_d = engine(&m.model, EngineConfig::default());
    let prompts: Vec<Vec<u32>> =
        [5usize, 16, 33, 70].iter().enumerate().map(|(i, &n)| prompt(90 + i as u64, n, vocab)).collect();
    let rt = rt();
    rt.block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
        relays_match_unified(&unified, &p, &d, &listener, &prompts).await;
        // P stores FP8, D f32: the hand-off is refused (naming the dtype) and D recomputes.
        let pr = &prompts[2];
        let err = refused_relay(&p, &f32_d, &listener, pr).await;
        assert!(err.contains("dtype") && err.contains("Fp8E4M3"), "{err}");
    });
    for e in [&unified, &p, &d, &f32_d] {
        assert_all_blocks_free(e);
    }
    for e in [unified, p, d, f32_d] {
        e.shutdown();
    }
}

/// A hand-off from `p` to `d` whose caches differ: returns the receiver's error (the sender's
/// appended), after D was told to recompute and both streams finished.
async fn refused_relay(
    p: &baton_engine::EngineHandle,
    d: &baton_engine::EngineHandle,
    listener: &TcpKvListener,
    prompt: &[u32],
) -> String {
    use baton_core::cluster_auth::ReservationToken;
    use baton_engine::kv_connector::{ExportVia, Links};
    use baton_engine::kv_transport::handoff::{receive_import, send_export};
    let deadline = std::time::Duration::from_secs(10);
    let addr = listener.local_addr().expect("addr");
    let (d_stream, table) = d.reserve_import(EngineRequest::new(prompt.to_vec(), greedy(12))).await.expect("reserve");
    let d_id = d_stream.request_id();
    let token = ReservationToken::random();
    let (p_stream, events) =
        p.submit_export(EngineRequest::new(prompt.to_vec(), greedy(12)), table, ExportVia::Host).expect("export");
    let sender = tokio::spawn(send_export(events, addr, token, p.kv_layout(), deadline, None, creds()));
    let pending = listener.accept().await.expect("accept");
    let links = std::sync::Arc::new(Links::default());
    let received = receive_import(pending, d, &links, deadline, admit_from(vec![(token, d_id)])).await;
    let Err(err) = received else { panic!("a hand-off between an FP8 and an f32 cache was accepted") };
    d.import_failed(d_id);
    let sent = sender.await.expect("join");
    let sent = sent.map(|_| ()).expect_err("the sender is refused too");
    let (p_out, d_out) = (collect(p_stream).await, collect(d_stream).await);
    assert_eq!(p_out.len(), 1);
    assert_eq!(tokens(&d_out).len(), 12, "D recomputed the prompt and decoded");
    format!("{err} / sender: {sent}")
}
