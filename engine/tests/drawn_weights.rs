//! Random weights drawn by the counter generator (`--load-format dummy`): a backend that draws
//! them itself (`Backend::random_mat`, the CUDA backend on the device) must end up with the
//! very weights the store would have handed out.
//!
//! `gpu_*` tests need a GPU: excluded from CI by name, and they FAIL when none is present.

use baton_engine::backend::BatchLayout;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::runner::ModelRunner;
use baton_formats::testing::TinySpec;
use baton_formats::{CounterInit, DType, DummyKind, DummyStore, FormatError, TensorView, WeightStore};

/// A store that serves the same tensors but never lets the engine draw them: every tensor
/// goes through `get` and `upload_mat`.
struct ReadOnly(DummyStore);

impl WeightStore for ReadOnly {
    fn get(&self, name: &str) -> Result<TensorView<'_>, FormatError> {
        self.0.get(name)
    }
    fn names(&self) -> Vec<String> {
        self.0.names()
    }
    fn shape(&self, name: &str) -> Result<Vec<usize>, FormatError> {
        self.0.shape(name)
    }
}

fn store(spec: &TinySpec) -> DummyStore {
    DummyStore::new(&spec.config(), 11, 0.05, DType::F32).with_kind(DummyKind::Counter)
}

fn prefill(tokens: &[u32]) -> BatchLayout {
    BatchLayout {
        tokens: tokens.to_vec(),
        positions: (0..tokens.len()).collect(),
        seqs: vec![baton_engine::backend::SeqLayout {
            row_start: 0,
            n_tokens: tokens.len(),
            start_pos: 0,
            block_table: (0..4).collect(),
        }],
        logit_rows: vec![tokens.len() - 1],
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    }
}

fn logits<B: baton_engine::backend::Backend>(spec: &TinySpec, store: &dyn WeightStore, backend: B) -> Vec<f32> {
    let cfg = spec.config();
    let mut m = ModelRunner::load(&cfg, store, backend).expect("load");
    m.alloc_kv_cache(4, 16).expect("kv");
    let tokens: Vec<u32> = (0..20).map(|i| (i * 37 % cfg.vocab_size) as u32).collect();
    m.forward(&prefill(&tokens)).expect("forward")
}

#[test]
fn drawn_weights_equal_the_weights_the_store_serves() {
    for spec in [TinySpec::llama(), TinySpec::qwen2(), TinySpec::tied()] {
        let drawn = logits(&spec, &store(&spec), CpuBackend::new());
        let read = logits(&spec, &ReadOnly(store(&spec)), CpuBackend::new());
        assert_eq!(drawn, read, "{:?}", spec.architecture);
        assert!(drawn.iter().all(|x| x.is_finite()) && drawn.iter().any(|&x| x != drawn[0]));
    }
}

#[test]
fn gpu_counter_draws_on_the_device_are_the_host_draws_bit_for_bit() {
    let dev = baton_kernels::cuda::CudaDevice::open(&Default::default()).expect("a CUDA device");
    for (key, mean, std) in [(0u64, 0.0f32, 0.02f32), (u64::MAX, 1.0, 0.01), (0x1234_5678_9abc_def0, -0.5, 3.0)] {
        let init = CounterInit::uniform(key, mean, std);
        let n = 1_000_003;
        // Poisoned first: every element must be written.
        let mut buf = dev.upload(&vec![half::bf16::NAN; n + 10]).expect("upload");
        dev.fill_counter(&mut buf, 5, n, (init.key, init.mean, init.amp)).expect("fill");
        let got = dev.download(&buf, n + 10).expect("download");
        assert!(got[..5].iter().chain(&got[n + 5..]).all(|x| x.is_nan()), "wrote outside its range");
        for (i, g) in got[5..n + 5].iter().enumerate() {
            assert_eq!(g.to_bits(), half::bf16::from_f32(init.value(i as u64)).to_bits(), "element {i} of key {key:x}");
        }
    }
}

#[test]
fn gpu_drawn_model_matches_the_cpu_model_of_the_same_weights() {
    let opts = baton_kernels::cuda::CudaOptions::default();
    for spec in [TinySpec::llama(), TinySpec::qwen2(), TinySpec::tied()] {
        let cuda = baton_engine::backend::cuda::CudaBackend::new(&opts).expect("a CUDA device");
        let gpu = logits(&spec, &store(&spec), cuda);
        let cpu = logits(&spec, &ReadOnly(store(&spec)), CpuBackend::emulating_bf16());
        let num: f32 = gpu.iter().zip(&cpu).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f32 = cpu.iter().map(|b| b * b).sum();
        let rel = (num / den).sqrt();
        assert!(rel < 2e-2, "{:?}: relative logit error {rel}", spec.architecture);
    }
}
