//! Decode steps replayed from CUDA graphs: the CUDA backend's side of
//! [`GraphReplay::replay_rows`](crate::backend::GraphReplay::replay_rows) and the calls after it.
//!
//! A pure decode step (one token per sequence, every row sampled) is padded to a bucket of
//! rows (1, 2, 4, then multiples of 8 up to [`GRAPH_MAX_ROWS`]); its launches, from the
//! embedding to the LM head, are recorded once per (bucket, attention splits) and replayed
//! afterwards, which removes ~12 launches per layer of host work and the gaps between them.
//!
//! Invariants:
//! - Everything a replay reads that changes per step (token ids, positions, cache slots,
//!   context lengths, block tables) is uploaded by [`CudaBackend::stage_replay`] into the
//!   backend's long-lived buffers before the launch; a recording contains no upload (the
//!   device refuses uploads and allocations while recording).
//! - A graph holds raw device pointers: graphs are dropped whenever the device's allocation
//!   generation moves (some buffer may have been replaced), and recorded only right after the
//!   same padded step ran op by op, so no buffer needs to grow while recording.
//! - Attention in a staged step uses exactly the key's split count ([`AttnSplit::Exact`]);
//!   the kernels cut each row's context themselves, so one graph serves any lengths. The key
//!   is planned for the longest context (what global layers read); a windowed layer
//!   (`AttentionOptions::window`) cuts the same number of splits over the `min(ctx, window)`
//!   tokens it reads, so its chunks are shorter (never under the kernels' least chunk) and
//!   splits past its window exit at once: any split count is correct for it.
//! - Padding rows write no KV (slot -1) and attend to nothing; their logits are never read.

use super::CudaBackend;
use crate::backend::{BackendError, BatchLayout, GraphReplay, ReplayStart};
use baton_kernels::cuda::{AttnSplit, DecodeShape, StepGraph, auto_splits};
use std::collections::{HashMap, HashSet};

/// Largest decode batch replayed from a graph; larger ones run op by op.
pub const GRAPH_MAX_ROWS: usize = 512;

/// Most attention splits a key may carry (the kernels' own limit).
const MAX_KEY_SPLITS: usize = 128;

/// The rows a pure decode step of `n` sequences is padded to.
pub fn graph_bucket(n: usize) -> Option<usize> {
    match n {
        0 => None,
        1 | 2 => Some(n),
        3 | 4 => Some(4),
        _ if n <= GRAPH_MAX_ROWS => Some(n.next_multiple_of(8)),
        _ => None,
    }
}

/// Whether `batch` is a step a graph can replay: one token per sequence, rows in sequence
/// order, every row sampled in order.
pub fn is_pure_decode(batch: &BatchLayout) -> bool {
    let n = batch.tokens.len();
    n > 0
        && batch.seqs.len() == n
        && batch.seqs.iter().enumerate().all(|(i, s)| s.n_tokens == 1 && s.row_start == i)
        && batch.logit_rows.iter().copied().eq(0..n)
}

/// A recording is specific to the padded rows and the attention grid's split count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub rows: usize,
    pub splits: usize,
}

/// The step [`CudaBackend::stage_replay`] staged.
#[derive(Debug, Clone, Copy)]
pub(super) struct Staged {
    pub key: GraphKey,
    /// Rows `real_rows..key.rows` are padding.
    pub real_rows: usize,
    /// Whether the launches are being recorded now.
    pub recording: bool,
}

/// Replay counters, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs recorded.
    pub recorded: u64,
    /// Steps replayed from a graph.
    pub replayed: u64,
    /// Recordings that failed (their shapes run op by op).
    pub failed: u64,
    /// Times every graph was dropped because a device buffer moved.
    pub invalidated: u64,
}

/// The backend's graphs and the staged step.
pub(super) struct GraphState {
    pub enabled: bool,
    graphs: HashMap<GraphKey, (StepGraph, usize)>,
    failed: HashSet<GraphKey>,
    /// The device's allocation generation the graphs were recorded at.
    generation: u64,
    pub staged: Option<Staged>,
    /// Vocabulary (embedding rows) and query heads seen by the op-by-op path: a replay needs
    /// both before its first recording (to check token ids and to key attention's splits).
    pub vocab: Option<usize>,
    pub n_heads: Option<usize>,
    pub stats: GraphStats,
}

impl GraphState {
    pub fn new() -> Self {
        Self {
            enabled: true,
            graphs: HashMap::new(),
            failed: HashSet::new(),
            generation: 0,
            staged: None,
            vocab: None,
            n_heads: None,
            stats: GraphStats::default(),
        }
    }

    /// Drops every graph if the device allocated since they were recorded.
    fn check_generation(&mut self, now: u64) {
        if now != self.generation {
            if !self.graphs.is_empty() {
                self.stats.invalidated += 1;
                tracing::debug!(graphs = self.graphs.len(), "device buffers moved: CUDA graphs dropped");
            }
            self.graphs.clear();
            self.generation = now;
        }
    }

    /// Graphs held now.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }
}

impl CudaBackend {
    /// Replays decode steps from CUDA graphs (`true`, the default) or runs every step op by
    /// op (`false`: vLLM's `--enforce-eager`). Switching drops the graphs.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.enabled = on;
        self.drop_graphs();
    }

    /// Forgets every recording (and every failed one): a switch changed what a step launches.
    pub(super) fn drop_graphs(&mut self) {
        self.graphs.graphs.clear();
        self.graphs.failed.clear();
    }

    /// Launches kernels with programmatic dependent launch (`true`, the default on Hopper) or
    /// plainly (`false`), for comparisons; see `CudaDevice::set_pdl`. Switching drops the
    /// graphs (they hold the old launches).
    pub fn set_pdl(&mut self, on: bool) {
        self.device().set_pdl(on);
        self.drop_graphs();
    }

    /// Sets how many bytes of its weights a skinny GEMM pulls into L2 before it waits for the
    /// previous kernel ([`baton_kernels::cuda::CudaDevice::set_gemv_l2_prefetch`]; for
    /// comparisons). Drops recorded graphs.
    pub fn set_gemv_l2_prefetch(&mut self, bytes: usize) {
        self.device().set_gemv_l2_prefetch(bytes);
        self.drop_graphs();
    }

    /// Replay counters so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    /// Graphs held now.
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }

    /// See [`GraphReplay::replay_rows`](crate::backend::GraphReplay::replay_rows).
    pub(super) fn graph_rows(&self, batch: &BatchLayout) -> Option<usize> {
        if !self.graphs.enabled || self.graphs.vocab.is_none() || self.graphs.n_heads.is_none() {
            return None;
        }
        if !is_pure_decode(batch) {
            return None;
        }
        graph_bucket(batch.tokens.len())
    }

    /// See [`GraphReplay::begin_replay`](crate::backend::GraphReplay::begin_replay).
    pub(super) fn stage_replay(&mut self, padded: &BatchLayout, real_rows: usize) -> Result<ReplayStart, BackendError> {
        let (Some(vocab), Some(n_heads)) = (self.graphs.vocab, self.graphs.n_heads) else {
            return Ok(ReplayStart::Eager);
        };
        let rows = padded.tokens.len();
        if real_rows == 0 || real_rows > rows || graph_bucket(real_rows) != Some(rows) {
            return Ok(ReplayStart::Eager);
        }
        let geo = self.geo()?;
        // Stage the per-step data first: it may grow a buffer, which the generation check
        // below then sees.
        self.graphs.staged = Some(Staged { key: GraphKey { rows, splits: 1 }, real_rows, recording: false });
        self.step_meta(padded)?;
        self.ids.stage(&self.dev, &padded.tokens, vocab, &padded.pending, Some(&self.sample_bufs))?;
        let fp8 = self.fp8.is_some();
        let shape = DecodeShape { rows, n_heads, n_kv_heads: geo.n_kv_heads, head_dim: geo.head_dim, fp8 };
        let auto = auto_splits(
            self.dev.sm_count(),
            &shape,
            self.meta.max_ctx(),
            self.dev.stream_attention(),
            self.dev.attention_split_smem(),
        );
        // Graphs are keyed by a power of two (few graphs as contexts grow), rounded down:
        // rounding 3 up to 4 at 32 rows of 8k cost 7 % of the step (more CTAs than the device
        // runs well at once), while fewer splits than `Auto` measured no slower.
        let key = GraphKey { rows, splits: prev_power_of_two(auto).min(MAX_KEY_SPLITS) };
        self.graphs.staged = Some(Staged { key, real_rows, recording: false });
        if self.graphs.failed.contains(&key) {
            self.graphs.staged = None;
            return Ok(ReplayStart::Eager);
        }
        self.graphs.check_generation(self.dev.alloc_generation());
        if let Some((graph, vocab_out)) = self.graphs.graphs.get(&key) {
            graph.launch()?;
            self.logit_shape = (rows, *vocab_out);
            self.graphs.stats.replayed += 1;
            return Ok(ReplayStart::Replayed);
        }
        Ok(ReplayStart::Record)
    }

    /// See [`GraphReplay::begin_recording`](crate::backend::GraphReplay::begin_recording).
    pub(super) fn start_recording(&mut self) -> Result<(), BackendError> {
        let staged = self.graphs.staged.as_mut().ok_or_else(|| BackendError::Device("no step is staged".into()))?;
        staged.recording = true;
        // The op-by-op pass may have replaced buffers that older graphs point to.
        self.graphs.check_generation(self.dev.alloc_generation());
        Ok(self.dev.begin_capture()?)
    }

    /// See [`GraphReplay::end_recording`](crate::backend::GraphReplay::end_recording).
    pub(super) fn stop_recording(&mut self, ok: bool) -> Result<(), BackendError> {
        let Some(staged) = self.graphs.staged else {
            self.dev.abort_capture();
            return Err(BackendError::Device("no step is staged".into()));
        };
        if let Some(s) = self.graphs.staged.as_mut() {
            s.recording = false;
        }
        if !ok {
            self.dev.abort_capture();
            self.graphs.failed.insert(staged.key);
            self.graphs.stats.failed += 1;
            return Ok(());
        }
        match self.dev.end_capture() {
            Ok(graph) => {
                // Recording allocates nothing (the device refuses), so the generation the
                // graph's pointers belong to is the current one.
                self.graphs.check_generation(self.dev.alloc_generation());
                self.graphs.graphs.insert(staged.key, (graph, self.logit_shape.1));
                self.graphs.stats.recorded += 1;
                tracing::debug!(
                    rows = staged.key.rows,
                    splits = staged.key.splits,
                    "decode step recorded as a CUDA graph"
                );
                Ok(())
            }
            Err(e) => {
                self.graphs.failed.insert(staged.key);
                self.graphs.stats.failed += 1;
                tracing::warn!(rows = staged.key.rows, error = %e, "recording a CUDA graph failed; this shape runs op by op");
                Ok(())
            }
        }
    }

    /// See [`GraphReplay::finish_replay`](crate::backend::GraphReplay::finish_replay).
    pub(super) fn unstage(&mut self) {
        if self.graphs.staged.take().is_some_and(|s| s.recording) {
            self.dev.abort_capture();
        }
    }

    /// The split policy for attention: the staged key's count during a staged step.
    pub(super) fn attention_policy(&self) -> AttnSplit {
        match self.graphs.staged {
            Some(s) => AttnSplit::Exact(s.key.splits),
            None => AttnSplit::Auto,
        }
    }
}

/// The largest power of two not above `n` (1 for 0).
fn prev_power_of_two(n: usize) -> usize {
    1 << n.max(1).ilog2()
}

/// The recordings behind the runner's replay path (the inherent methods above do the work).
impl GraphReplay for CudaBackend {
    fn replay_rows(&self, batch: &BatchLayout) -> Option<usize> {
        self.graph_rows(batch)
    }

    fn begin_replay(&mut self, padded: &BatchLayout, real_rows: usize) -> Result<ReplayStart, BackendError> {
        let started = self.stage_replay(padded, real_rows);
        if !matches!(started, Ok(ReplayStart::Record | ReplayStart::Replayed)) {
            self.graphs.staged = None;
        }
        started
    }

    fn begin_recording(&mut self) -> Result<(), BackendError> {
        self.start_recording()
    }

    fn end_recording(&mut self, ok: bool) -> Result<(), BackendError> {
        self.stop_recording(ok)
    }

    fn finish_replay(&mut self) {
        self.unstage();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqLayout;

    fn decode(n: usize) -> BatchLayout {
        BatchLayout {
            tokens: vec![5; n],
            positions: (0..n).map(|i| 10 + i).collect(),
            seqs: (0..n)
                .map(|i| SeqLayout { row_start: i, n_tokens: 1, start_pos: 10 + i, block_table: vec![i as u32] })
                .collect(),
            logit_rows: (0..n).collect(),
            pending: Vec::new(),
            prompt_logprobs: Vec::new(),
        }
    }

    #[test]
    fn graph_splits_round_down_to_a_power_of_two() {
        assert_eq!(
            [0, 1, 2, 3, 4, 5, 31, 32, 33, 99, 128].map(prev_power_of_two),
            [1, 1, 2, 2, 4, 4, 16, 32, 32, 64, 128]
        );
    }

    #[test]
    fn buckets_cover_every_batch_up_to_the_largest() {
        let mut last = 0;
        for n in 1..=GRAPH_MAX_ROWS {
            let b = graph_bucket(n).expect("bucket");
            assert!(b >= n && b >= last, "n {n} -> {b}");
            assert!(b - n < 8, "at most 7 padding rows, n {n} -> {b}");
            last = b;
        }
        assert_eq!(graph_bucket(0), None);
        assert_eq!(graph_bucket(GRAPH_MAX_ROWS + 1), None);
        assert_eq!([1, 2, 3, 5, 9].map(|n| graph_bucket(n).unwrap_or(0)), [1, 2, 4, 8, 16]);
    }

    #[test]
    fn only_pure_decode_steps_replay() {
        assert!(is_pure_decode(&decode(3)));
        let mut prefill = decode(2);
        prefill.tokens.push(7);
        prefill.positions.push(12);
        prefill.seqs[1].n_tokens = 2;
        prefill.logit_rows = vec![0, 2];
        assert!(!is_pure_decode(&prefill), "a prompt chunk");
        let mut unsampled = decode(3);
        unsampled.logit_rows = vec![0, 2];
        assert!(!is_pure_decode(&unsampled), "a row whose logits are not wanted");
        let mut reordered = decode(2);
        reordered.logit_rows = vec![1, 0];
        assert!(!is_pure_decode(&reordered), "logit rows out of order");
        assert!(!is_pure_decode(&BatchLayout::default()));
    }
}
