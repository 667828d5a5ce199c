//! The prompt-logprobs kernel (`kernels/cuda/prompt_logprobs.cu`) against its CPU reference
//! (`baton_kernels::cpu::prompt_logprob`) on fresh random logits (the seed is printed), with
//! the answer buffer poisoned before each launch so an unwritten word fails.
//!
//! These tests need a GPU: they are named `gpu_*`, excluded from CI by name, and FAIL (do not
//! skip) when no device can be opened. Run them with `scripts/gpu-tests.sh`.

mod common;

use baton_kernels::cpu;
use baton_kernels::cuda::{CudaSlice, PROMPT_LOGPROB_MAX_TOP, PROMPT_LOGPROB_OUT_WORDS};
use common::{device, rand_vec, rng};
use rand::Rng;

#[test]
fn gpu_prompt_logprobs_match_cpu() {
    let dev = device();
    let mut r = rng("prompt_logprobs");
    for &(vocab, rows, k) in &[(7usize, 3usize, 20usize), (1000, 257, 1), (32000, 9, 5), (128_256, 3, 20), (50, 4, 0)] {
        let mut logits = rand_vec(&mut r, rows * vocab, 8.0);
        // Ties, NaN, ±inf and a dead row: the kernel must sanitise and order like the CPU.
        for row in 0..rows {
            let base = row * vocab;
            logits[base + r.random_range(0..vocab)] = f32::NAN;
            let (a, b) = (r.random_range(0..vocab), r.random_range(0..vocab));
            logits[base + a] = logits[base + b];
        }
        if rows > 2 {
            logits[vocab] = f32::INFINITY;
            logits[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
        }
        let targets: Vec<u32> = (0..rows).map(|_| r.random_range(0..vocab as u32)).collect();
        let d_logits = dev.upload(&logits).expect("upload");
        let mut scratch: CudaSlice<u32> = dev.alloc(1).expect("alloc");
        // Poisoned and already large enough, so the launch writes into it.
        let mut out = dev.upload(&vec![u32::MAX; rows * PROMPT_LOGPROB_OUT_WORDS]).expect("poison");
        let got = dev.prompt_logprobs(&d_logits, vocab, &targets, k, &mut scratch, &mut out).expect("launch");
        assert_eq!(got.len(), rows);
        for (row, g) in got.iter().enumerate() {
            let want = cpu::prompt_logprob(&logits[row * vocab..(row + 1) * vocab], targets[row], k).expect("cpu");
            let what = format!("vocab {vocab} row {row} k {k}");
            let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-5 * b.abs().max(1.0);
            assert!(close(g.logprob, want.logprob), "{what}: logprob {} vs {}", g.logprob, want.logprob);
            assert_eq!(g.rank, want.rank, "{what}: rank");
            assert_eq!(g.top.len(), want.top.len(), "{what}: top count");
            for (j, (a, b)) in g.top.iter().zip(&want.top).enumerate() {
                assert_eq!(a.0, b.0, "{what}: top {j} id");
                assert!(close(a.1, b.1), "{what}: top {j} logprob {} vs {}", a.1, b.1);
            }
        }
        println!("vocab {vocab}, {rows} rows, k {k}: ok");
    }
}

#[test]
fn gpu_prompt_logprobs_refuse_bad_calls() {
    let dev = device();
    let logits = dev.upload(&[0.0f32; 20]).expect("upload");
    let mut scratch: CudaSlice<u32> = dev.alloc(1).expect("alloc");
    let mut out: CudaSlice<u32> = dev.alloc(1).expect("alloc");
    assert!(dev.prompt_logprobs(&logits, 10, &[10], 1, &mut scratch, &mut out).is_err(), "target outside");
    assert!(dev.prompt_logprobs(&logits, 10, &[1, 2, 3], 1, &mut scratch, &mut out).is_err(), "3 rows of 2");
    let too_many = PROMPT_LOGPROB_MAX_TOP + 1;
    assert!(dev.prompt_logprobs(&logits, 10, &[1], too_many, &mut scratch, &mut out).is_err(), "k too large");
    assert!(dev.prompt_logprobs(&logits, 10, &[], 1, &mut scratch, &mut out).expect("empty").is_empty());
}
