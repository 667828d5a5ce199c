//! Sizing the CUDA KV cache from free device memory (`gpu_memory_utilization`).
//!
//! The workspaces grow to their largest size on the first step of that size, so free memory
//! is read after a profiling step: one prefill of `max_num_batched_tokens` rows with
//! `max(max_num_seqs, PROMPT_LOGPROB_SLICE)` logit rows (the LM head's largest output), over a
//! temporary cache just large enough for it. The pool then gets `free − (1 − utilization) ×
//! total` bytes; the temporary cache is released first.

use crate::backend::{BatchLayout, SeqLayout, cuda::CudaBackend};
use crate::runner::ModelRunner;
use crate::{EngineConfig, EngineStartError};

/// Returns `config` with `num_kv_blocks` set from free device memory, unless it was set.
pub(crate) fn size_from_free_memory(
    llama: &mut ModelRunner<CudaBackend>,
    config: &EngineConfig,
) -> Result<EngineConfig, EngineStartError> {
    if config.num_kv_blocks.is_some() {
        return Ok(config.clone());
    }
    let util = config.gpu_memory_utilization;
    if !(util > 0.0 && util <= 1.0) {
        return Err(EngineStartError::Config(format!("gpu_memory_utilization must be in (0, 1], got {util}")));
    }
    let bs = config.block_size;
    let rows = config.max_num_batched_tokens.max(1);
    let blocks = rows.div_ceil(bs);
    // Profiling step: every workspace reaches the size of the largest step.
    llama.alloc_kv_cache(blocks, bs)?;
    // The LM head's largest output: a step's sampling rows, or a slice of prompt-logprob rows.
    let logit_rows = config.max_num_seqs.max(crate::runner::PROMPT_LOGPROB_SLICE).clamp(1, rows);
    let batch = BatchLayout {
        tokens: (0..rows).map(|i| (i % llama.config().vocab_size) as u32).collect(),
        positions: (0..rows).collect(),
        seqs: vec![SeqLayout { row_start: 0, n_tokens: rows, start_pos: 0, block_table: (0..blocks as u32).collect() }],
        logit_rows: (rows - logit_rows..rows).collect(),
        pending: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    llama.forward(&batch)?;
    // Release the temporary pool before measuring.
    llama.alloc_kv_cache(0, bs)?;
    let (free, total) = llama.backend().device().mem_info().map_err(crate::backend::BackendError::from)?;
    let reserve = ((1.0 - util as f64) * total as f64) as usize;
    let shape = llama.kv_shape(1, bs);
    let per_block = shape.bytes_per_token() * bs;
    let budget = free.saturating_sub(reserve);
    let num_blocks = shape.blocks_in(budget);
    tracing::info!(
        free_gib = free as f64 / (1u64 << 30) as f64,
        total_gib = total as f64 / (1u64 << 30) as f64,
        gpu_memory_utilization = util,
        kv_cache_gib = (num_blocks * per_block) as f64 / (1u64 << 30) as f64,
        num_blocks,
        "KV cache sized from free GPU memory"
    );
    Ok(EngineConfig { num_kv_blocks: Some(num_blocks), ..config.clone() })
}
