//! A reference run and a variant (FP8 KV, FP8 weights, ...) fed the same tokens: the
//! reference's greedy token each step (teacher forcing), so every step compares logits over
//! the same context. The figures are what the accuracy reports print. [`Seq`] is one sequence
//! fed through a runner's paged cache, the usual side of such a comparison.

use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::kv_cache_dtype::KvCacheDtype;
use baton_engine::runner::ModelRunner;
use baton_formats::{LoadedModel, ModelConfig, WeightStore};

const BLOCK: usize = 16;

/// One sequence decoded step by step through a runner's paged cache (the bf16-emulating CPU
/// backend).
pub struct Seq {
    pub runner: ModelRunner<CpuBackend>,
    table: Vec<u32>,
    pos: usize,
}

impl Seq {
    pub fn new(model: &LoadedModel, store: &dyn WeightStore, dtype: KvCacheDtype, max_len: usize) -> Self {
        Self::with_config(&model.config, store, dtype, max_len)
    }

    /// [`Seq::new`] with a configuration of its own (e.g. with a weight quantization applied).
    pub fn with_config(cfg: &ModelConfig, store: &dyn WeightStore, dtype: KvCacheDtype, max_len: usize) -> Self {
        let mut runner = ModelRunner::load(cfg, store, CpuBackend::emulating_bf16()).expect("load model");
        runner.set_kv_cache_dtype(dtype, store).expect("kv dtype");
        let blocks = max_len.div_ceil(BLOCK);
        runner.alloc_kv_cache(blocks + 1, BLOCK).expect("kv cache");
        // Reversed, so the paging is exercised.
        Self { runner, table: (1..=blocks as u32).rev().collect(), pos: 0 }
    }

    /// With the FP8 scales calculated from the first prefill (`--calculate-kv-scales`).
    pub fn calibrated(mut self) -> Self {
        self.runner.calculate_kv_scales().expect("an FP8 cache calibrates");
        self
    }

    /// Moves on `n` positions whose KV was stored by other means (a received hand-off).
    pub fn skip(&mut self, n: usize) {
        self.pos += n;
    }

    /// Feeds `tokens`; returns the logits of the last one.
    pub fn feed(&mut self, tokens: &[u32]) -> Vec<f32> {
        let n = tokens.len();
        let batch = BatchLayout {
            tokens: tokens.to_vec(),
            positions: (self.pos..self.pos + n).collect(),
            seqs: vec![SeqLayout { row_start: 0, n_tokens: n, start_pos: self.pos, block_table: self.table.clone() }],
            logit_rows: vec![n - 1],
            pending: Vec::new(),
            prompt_logprobs: Vec::new(),
        };
        self.pos += n;
        self.runner.forward(&batch).expect("forward")
    }
}

/// Index of the largest value (the first on ties).
pub fn argmax(xs: &[f32]) -> u32 {
    xs.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

/// The comparison's figures over `steps` steps.
pub struct Figures {
    /// Mean |Δlogit| over every logit of every step.
    pub mean_abs: f64,
    /// Largest |Δlogit|.
    pub max_abs: f32,
    /// Steps whose greedy token agrees.
    pub agree: usize,
    /// Steps compared.
    pub steps: usize,
}

impl Figures {
    /// Prints the figures as `{tag} {name}: ...` and asserts only what must hold of any run:
    /// finite figures and greedy agreement on at least half the steps.
    pub fn report(&self, tag: &str, name: &str) {
        println!(
            "{tag} {name}: mean |Δlogit| {:.5}, max |Δlogit| {:.4}, greedy agreement {}/{} ({:.1} %)",
            self.mean_abs,
            self.max_abs,
            self.agree,
            self.steps,
            100.0 * self.agree as f64 / self.steps as f64
        );
        assert!(self.mean_abs.is_finite() && self.max_abs.is_finite());
        assert!(self.agree * 2 >= self.steps, "{name}: greedy agreement {}/{}", self.agree, self.steps);
    }
}

/// Feeds `prompt` to both, then `steps - 1` of the reference's greedy tokens; each `feed`
/// returns the logits of the last position it was given.
pub fn compare(
    prompt: &[u32],
    steps: usize,
    mut reference: impl FnMut(&[u32]) -> Vec<f32>,
    mut variant: impl FnMut(&[u32]) -> Vec<f32>,
) -> Figures {
    let (mut a, mut b) = (reference(prompt), variant(prompt));
    let (mut sum, mut n, mut max_abs, mut agree) = (0.0f64, 0usize, 0.0f32, 0usize);
    for step in 0..steps {
        assert!(a.iter().chain(&b).all(|x| x.is_finite()), "non-finite logits at step {step}");
        for (x, y) in a.iter().zip(&b) {
            let d = (x - y).abs();
            sum += f64::from(d);
            max_abs = max_abs.max(d);
        }
        n += a.len();
        let next = argmax(&a);
        agree += usize::from(argmax(&b) == next);
        if step + 1 < steps {
            a = reference(&[next]);
            b = variant(&[next]);
        }
    }
    Figures { mean_abs: sum / n as f64, max_abs, agree, steps }
}
