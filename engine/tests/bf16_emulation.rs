//! The CPU backend's bf16 emulation (the reference a bf16 GPU run is compared with): what it
//! stores is bf16-representable, its logits are not rounded, and it moves the logits of the exact backend by bf16-sized
//! amounts only.

mod common;

use baton_engine::backend::KvIo;
use baton_engine::backend::cpu::CpuBackend;
use baton_engine::backend::{BatchLayout, SeqLayout};
use baton_engine::runner::ModelRunner;
use baton_formats::testing::TinySpec;
use common::{prompt, tiny};

fn one_prompt_batch(tokens: Vec<u32>) -> BatchLayout {
    let n = tokens.len();
    BatchLayout {
        positions: (0..n).collect(),
        seqs: vec![SeqLayout {
            row_start: 0,
            n_tokens: n,
            start_pos: 0,
            block_table: (0..n.div_ceil(16) as u32).collect(),
        }],
        logit_rows: vec![n - 1],
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
        tokens,
    }
}

fn is_bf16(x: f32) -> bool {
    half::bf16::from_f32(x).to_f32() == x
}

#[test]
fn emulated_bf16_storage_is_bf16_and_close_to_exact() {
    let m = tiny(&TinySpec::llama());
    let cfg = &m.model.config;
    let batch = one_prompt_batch(prompt(77, 40, cfg.vocab_size));
    let mut logits = Vec::new();
    let mut kv_bits_ok = Vec::new();
    for backend in [CpuBackend::new(), CpuBackend::emulating_bf16()] {
        let mut model = ModelRunner::load(cfg, m.model.weights.as_ref(), backend).expect("load");
        model.alloc_kv_cache(8, 16).expect("kv");
        logits.push(model.forward(&batch).expect("forward"));
        let (k, v) = model.backend_mut().read_kv_blocks(1, &[0, 1, 2]).expect("read kv");
        let vals: Vec<f32> =
            k.chunks_exact(4).chain(v.chunks_exact(4)).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert!(vals.iter().any(|&x| x != 0.0), "the KV cache holds the prompt");
        kv_bits_ok.push(vals.iter().filter(|&&x| !is_bf16(x)).count());
    }
    assert!(kv_bits_ok[0] > 0, "the exact backend keeps f32 KV (else this test proves nothing)");
    assert_eq!(kv_bits_ok[1], 0, "the emulating backend stores only bf16 values");
    // The logits themselves stay f32, as the CUDA backend's f32-output LM head writes them.
    assert!(logits[1].iter().any(|&x| !is_bf16(x)), "the emulating backend rounded the logits to bf16");
    let diff = logits[0].iter().zip(&logits[1]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(diff > 0.0, "bf16 rounding must change the logits somewhere");
    assert!(diff < 0.1, "bf16 rounding moved a logit by {diff}");
}
