//! Prompt logprobs on the CUDA backend (computed on the device by `prompt_logprobs.cu`)
//! against the CPU backend emulating its bf16 storage, through `start_engine` on the tiny test
//! models: every entry's logprob within `TOL` nats, the same token scored, the same number of
//! alternatives, and the top alternative the same wherever the CPU's top two are not a near
//! tie. Long prompts cover several LM-head slices; a chunked-prefill engine covers chunks.
//!
//! Named `gpu_*`: excluded from CI by name, and they FAIL when no GPU is present.

mod common;

use baton_core::api::{EngineClient, EngineRequest, PromptLogprob};
use baton_core::params::SamplingParams;
use baton_engine::runner::PROMPT_LOGPROB_SLICE;
use baton_engine::{DeviceSpec, EngineConfig, EngineHandle, start_engine};
use baton_formats::testing::TinySpec;
use common::{drain, prompt, tiny};

/// Largest logprob difference between the bf16-emulating CPU and the GPU (nats).
const TOL: f32 = 0.03;

fn start(model: &baton_formats::LoadedModel, device: DeviceSpec, chunk: usize) -> EngineHandle {
    let cfg = EngineConfig {
        num_threads: Some(2),
        num_kv_blocks: Some(256),
        max_model_len: Some(512),
        max_num_batched_tokens: chunk,
        max_num_seqs: 16,
        cpu_emulates_bf16: device == DeviceSpec::Cpu,
        ..EngineConfig::default()
    };
    start_engine(model, device, cfg).unwrap_or_else(|e| panic!("start on {device}: {e}"))
}

fn prompt_logprobs(engine: &EngineHandle, prompts: &[Vec<u32>]) -> Vec<Vec<Option<PromptLogprob>>> {
    let params = SamplingParams { max_tokens: Some(2), prompt_logprobs: Some(5), ..SamplingParams::greedy() };
    let streams: Vec<_> =
        prompts.iter().map(|p| engine.submit(EngineRequest::new(p.clone(), params.clone())).expect("submit")).collect();
    streams.into_iter().map(|s| drain(s).1[0].prompt_logprobs.clone()).collect()
}

#[test]
fn gpu_prompt_logprobs_match_the_bf16_cpu_reference() {
    for (name, spec) in [("llama", TinySpec::llama()), ("qwen2", TinySpec::qwen2()), ("tied", TinySpec::tied())] {
        let m = tiny(&spec);
        let vocab = m.model.config.vocab_size;
        let prompts: Vec<Vec<u32>> = [2usize, 17, 64, PROMPT_LOGPROB_SLICE + 30]
            .iter()
            .enumerate()
            .map(|(i, &l)| prompt(i as u64 + 71, l, vocab))
            .collect();
        let cpu = prompt_logprobs(&start(&m.model, DeviceSpec::Cpu, 512), &prompts);
        for chunk in [512, 48] {
            let gpu = prompt_logprobs(&start(&m.model, DeviceSpec::Cuda(0), chunk), &prompts);
            let mut worst = 0.0f32;
            for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
                let what = format!("{name} chunk {chunk} prompt {i}");
                assert_eq!(c.len(), prompts[i].len(), "{what}: cpu entries");
                assert_eq!(g.len(), prompts[i].len(), "{what}: gpu entries");
                assert!(c[0].is_none() && g[0].is_none(), "{what}: entry 0");
                for (j, (c, g)) in c.iter().zip(g).enumerate().skip(1) {
                    let (c, g) = (c.as_ref().expect("cpu entry"), g.as_ref().expect("gpu entry"));
                    assert_eq!(c.token_id, g.token_id, "{what} entry {j}: token");
                    let d = (c.logprob - g.logprob).abs();
                    worst = worst.max(d);
                    assert!(d < TOL, "{what} entry {j}: cpu {} gpu {}", c.logprob, g.logprob);
                    assert_eq!(c.top.len(), 5, "{what} entry {j}");
                    assert_eq!(g.top.len(), 5, "{what} entry {j}");
                    if c.top[0].1 - c.top[1].1 > TOL {
                        assert_eq!(c.top[0].0, g.top[0].0, "{what} entry {j}: top token");
                    }
                }
            }
            println!("{name} chunk {chunk}: worst prompt-logprob difference {worst:.2e}");
        }
    }
}
