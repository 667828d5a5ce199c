//! Random weights drawn by the counter generator (`--load-format dummy`): a backend that draws
//! them itself (`Backend::random_mat`, the CUDA backend on the device) must end up with the
//! very weights the store would have handed out. Under `--quantization fp8` the projections are
//! drawn and quantized per channel by the backend (`Backend::random_mat_fp8`, on the device for
//! CUDA): the same codes and scales as the store's f32 values quantized at load.
//!
//! `gpu_*` tests need a GPU: excluded from CI by name, and they FAIL when none is present.

use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{Backend, BatchLayout, counter_fp8};
use baton_engine::runner::ModelRunner;
use baton_engine::weight_quantization::WeightQuantization;
use baton_formats::testing::TinySpec;
use baton_formats::{CounterInit, DType, DummyKind, DummyStore, FormatError, TensorView, WeightStore};
use baton_kernels::cpu::ActivationScale;

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

fn logits<B: Backend>(spec: &TinySpec, store: &dyn WeightStore, backend: B) -> Vec<f32> {
    logits_with(spec, WeightQuantization::None, store, backend)
}

/// [`logits`] with the weights quantized as `q` says.
fn logits_with<B: Backend>(spec: &TinySpec, q: WeightQuantization, store: &dyn WeightStore, backend: B) -> Vec<f32> {
    let mut cfg = spec.config();
    q.apply(&mut cfg);
    let mut m = ModelRunner::load(&cfg, store, backend).expect("load");
    m.alloc_kv_cache(4, 16).expect("kv");
    let tokens: Vec<u32> = (0..20).map(|i| (i * 37 % cfg.vocab_size) as u32).collect();
    m.forward(&prefill(&tokens)).expect("forward")
}

/// A CUDA backend on device 0, its compiled kernels cached across the tests of a run (the GPU
/// tests here open several).
fn cuda_backend() -> baton_engine::backend::cuda::CudaBackend {
    let cache = std::env::temp_dir().join("baton-gpu-test-kernels");
    let opts = baton_kernels::cuda::CudaOptions { ordinal: 0, cache_dir: Some(cache), ..Default::default() };
    baton_engine::backend::cuda::CudaBackend::new(&opts).expect("a CUDA device")
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
fn drawn_fp8_weights_equal_the_stored_weights_quantized_at_load() {
    for spec in [TinySpec::llama(), TinySpec::qwen2(), TinySpec::tied()] {
        let drawn = logits_with(&spec, WeightQuantization::Fp8, &store(&spec), CpuBackend::new());
        let read = logits_with(&spec, WeightQuantization::Fp8, &ReadOnly(store(&spec)), CpuBackend::new());
        let bf16 = logits(&spec, &store(&spec), CpuBackend::new());
        assert_eq!(drawn, read, "{:?}", spec.architecture);
        assert_ne!(drawn, bf16, "{:?}: FP8 changed nothing (not quantized?)", spec.architecture);
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
    for spec in [TinySpec::llama(), TinySpec::qwen2(), TinySpec::tied()] {
        let gpu = logits(&spec, &store(&spec), cuda_backend());
        let cpu = logits(&spec, &ReadOnly(store(&spec)), CpuBackend::emulating_bf16());
        let num: f32 = gpu.iter().zip(&cpu).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f32 = cpu.iter().map(|b| b * b).sum();
        let rel = (num / den).sqrt();
        assert!(rel < 2e-2, "{:?}: relative logit error {rel}", spec.architecture);
    }
}

/// `n` counter draws with fresh keys and distributions (a clock-seeded generator, its seed
/// printed): means 0 or in ±0.5, standard deviations from 0.001 to 3.
fn fresh_inits(test: &str, n: usize) -> Vec<CounterInit> {
    use rand::{Rng, SeedableRng};
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
    println!("{test}: seed {seed}");
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let mean = if r.random_bool(0.5) { 0.0 } else { r.random_range(-0.5f32..0.5) };
            CounterInit::uniform(r.random(), mean, 0.001 * 3000f32.powf(r.random_range(0.0f32..1.0)))
        })
        .collect()
}

#[test]
fn gpu_fp8_weights_drawn_on_the_device_are_the_host_quantization_bit_for_bit() {
    let mut cuda = cuda_backend();
    let i = fresh_inits("gpu_fp8_weights_drawn_on_the_device_are_the_host_quantization_bit_for_bit", 10);
    // Every case draws fresh keys, so memory a kernel failed to write cannot hold the right
    // codes by chance from an earlier case.
    let cases: Vec<(Vec<(usize, CounterInit)>, usize)> = vec![
        // A fused [q; k; v], a fused [gate; up] (k = 1000: a row shorter than a CTA's step of
        // 256 threads × 8 values), Llama-3.1-8B's o projection.
        (vec![(256, i[0]), (64, i[1]), (64, i[2])], 256),
        (vec![(688, i[3]), (688, i[4])], 1000),
        (vec![(4096, i[5])], 4096),
        // One part past the 2^26-value draw chunk: two chunks, the second of 32 rows.
        (vec![(16_416, i[6])], 4096),
        // A constant part (std 0: every code ±448 or 0) and a part of zeros (scale 1).
        (vec![(3, CounterInit::uniform(i[7].key, 0.25, 0.0)), (5, CounterInit::uniform(i[8].key, 0.0, 0.0))], 24),
        // Columns off a multiple of 8: the host's path behind the same call.
        (vec![(7, i[9])], 36),
    ];
    for (parts, cols) in &cases {
        let rows: usize = parts.iter().map(|p| p.0).sum();
        let want = counter_fp8(parts, *cols).expect("host quantization");
        let mat = cuda.random_mat_fp8(parts, *cols, ActivationScale::PerToken).expect("device quantization");
        let w = mat.fp8_weights().expect("an FP8 matrix");
        assert_eq!((w.rows, w.cols, w.row_block, w.col_block), (rows, *cols, 1, *cols));
        let dev = cuda.device();
        let codes = dev.download(&w.codes, rows * cols).expect("codes");
        let scales = dev.download(&w.scales, rows).expect("scales");
        let what = format!("{rows}×{cols} in {} parts", parts.len());
        if let Some(at) = codes.iter().zip(want.codes()).position(|(a, b)| a != b) {
            panic!("{what}: code {at} (row {}) is {:#04x}, host {:#04x}", at / cols, codes[at], want.codes()[at]);
        }
        let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scales), bits(want.scales()), "{what}: scales");
    }
}

#[test]
fn gpu_fp8_dummy_model_quantized_on_the_device_matches_the_host_quantized_one() {
    for spec in [TinySpec::llama(), TinySpec::qwen2(), TinySpec::tied()] {
        // Drawn: every tensor on the device, the projections quantized there. Read: the store's
        // f32 values uploaded, the projections quantized on the host at load.
        let drawn = logits_with(&spec, WeightQuantization::Fp8, &store(&spec), cuda_backend());
        let read = logits_with(&spec, WeightQuantization::Fp8, &ReadOnly(store(&spec)), cuda_backend());
        let bf16 = logits(&spec, &store(&spec), cuda_backend());
        assert!(drawn.iter().all(|x| x.is_finite()), "{:?}: non-finite logits", spec.architecture);
        assert!(
            drawn.iter().zip(&read).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{:?}: logits differ, max |Δ| {}",
            spec.architecture,
            drawn.iter().zip(&read).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
        );
        assert_ne!(drawn, bf16, "{:?}: FP8 changed nothing (not quantized?)", spec.architecture);
    }
}
