//! Programmatic dependent launch (every kernel may start while the one before it finishes,
//! and waits for it inside) must change nothing but timing: the same steps with it on and off
//! give bit-identical logits, eager and from CUDA graphs, over prefill chunks, mixed batches
//! and decode steps. A missing wait would show as a race: logits that move from run to run.
//!
//! Named `gpu_*`: excluded from CI by name, and they FAIL when no GPU is present.

mod common;

use baton_engine::backend::cuda::CudaBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::runner::ModelRunner;
use baton_formats::testing::TinySpec;
use common::{prompt, tiny};

const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 24;

fn model(m: &baton_formats::LoadedModel, pdl: bool, graphs: bool) -> ModelRunner<CudaBackend> {
    let opts = baton_kernels::cuda::CudaOptions::default();
    let mut backend = CudaBackend::new(&opts).expect("open cuda:0");
    assert!(backend.device().pdl(), "PDL is on by default on this (Hopper) device");
    backend.set_pdl(pdl);
    assert_eq!(backend.device().pdl(), pdl);
    backend.set_graphs(graphs);
    let mut model = ModelRunner::load(&m.config, m.weights.as_ref(), backend).expect("load");
    model.alloc_kv_cache(16 * BLOCKS_PER_SEQ, BLOCK).expect("kv cache");
    model
}

fn table(slot: usize) -> Vec<u32> {
    ((slot * BLOCKS_PER_SEQ) as u32..((slot + 1) * BLOCKS_PER_SEQ) as u32).collect()
}

/// Prefills `prompts` in one mixed step, then decodes `steps` greedy tokens for all of them;
/// returns every step's logits.
fn run(model: &mut ModelRunner<CudaBackend>, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let vocab = model.config().vocab_size;
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut cached = vec![0usize; seqs.len()];
    let mut out = Vec::new();
    for _ in 0..=steps {
        let mut b = BatchLayout::default();
        for (i, s) in seqs.iter().enumerate() {
            let row_start = b.tokens.len();
            b.tokens.extend_from_slice(&s[cached[i]..]);
            b.positions.extend(cached[i]..s.len());
            b.seqs.push(SeqLayout {
                row_start,
                n_tokens: s.len() - cached[i],
                start_pos: cached[i],
                block_table: table(i),
            });
            b.logit_rows.push(b.tokens.len() - 1);
        }
        let logits = model.forward(&b).expect("step");
        for (i, s) in seqs.iter_mut().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let next = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(t, _)| t as u32);
            cached[i] = s.len();
            s.push(next);
        }
        out.push(logits);
    }
    out
}

#[test]
fn gpu_pdl_launches_give_bit_identical_steps() {
    for spec in [TinySpec::llama(), TinySpec::qwen2()] {
        let m = tiny(&spec);
        let vocab = m.model.config.vocab_size;
        let prompts: Vec<Vec<u32>> = (0..9).map(|i| prompt(40 + i, 1 + 23 * i as usize, vocab)).collect();
        for graphs in [false, true] {
            let with = run(&mut model(&m.model, true, graphs), &prompts, 24);
            let without = run(&mut model(&m.model, false, graphs), &prompts, 24);
            assert_eq!(with.len(), without.len());
            for (step, (a, b)) in with.iter().zip(&without).enumerate() {
                assert!(a.iter().all(|x| x.is_finite()), "{:?} step {step}: non-finite logits", spec.architecture);
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{:?}, graphs {graphs}, step {step}: logits differ with PDL on",
                    spec.architecture
                );
            }
        }
    }
}
