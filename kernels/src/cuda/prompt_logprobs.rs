//! The launcher of `kernels/cuda/prompt_logprobs.cu`: for each of the first rows of the f32
//! logits already on the device, the raw logprob and rank of one target token and the row's
//! top entries. Only [`PROMPT_LOGPROB_OUT_WORDS`] words per row come back to the host.
//!
//! Invariants: the targets, the top count and the logits' size are checked before the launch,
//! so a bad call is a [`CudaError::Shape`], never an out-of-bounds access; the logits are only
//! read.

use super::launch::{Args, cfg, need, shape_check};
use super::{CudaDevice, CudaError};
use cudarc::driver::CudaSlice;

/// Most top entries a row can ask for (`PL_MAX_TOP` in prompt_logprobs.cu).
pub const PROMPT_LOGPROB_MAX_TOP: usize = 20;
/// Words of one row's answer (`PL_OUT_WORDS`).
pub const PROMPT_LOGPROB_OUT_WORDS: usize = 4 + 2 * PROMPT_LOGPROB_MAX_TOP;
const THREADS: u32 = 512;

/// One row's answer (see [`crate::cpu::prompt_logprob`], its reference).
#[derive(Debug, Clone, PartialEq)]
pub struct RowLogprob {
    /// The target's raw log-probability.
    pub logprob: f32,
    /// 1 + the number of entries above the target.
    pub rank: u32,
    /// The best entries as `(id, logprob)`, most likely first, ties by lower id.
    pub top: Vec<(u32, f32)>,
}

/// Scores `targets[r]` under row `r` of `logits`, for `r < targets.len()`.
pub struct PromptLogprobsCall<'a> {
    /// At least `targets.len() × vocab` f32 logits, row-major.
    pub logits: &'a CudaSlice<f32>,
    /// Row width.
    pub vocab: usize,
    /// One target token per row, each below `vocab`, on the device.
    pub targets: &'a CudaSlice<u32>,
    /// Rows to score (at most `targets.len()`).
    pub rows: usize,
    /// Top entries per row, at most [`PROMPT_LOGPROB_MAX_TOP`].
    pub k: usize,
    /// At least `rows × PROMPT_LOGPROB_OUT_WORDS` words for the answers.
    pub out: &'a mut CudaSlice<u32>,
}

impl PromptLogprobsCall<'_> {
    /// Checks the sizes and enqueues the kernel. The caller checked every target below
    /// `vocab` (they are on the device already; see [`CudaDevice::prompt_logprobs`]).
    fn launch_checked(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "prompt_logprobs";
        shape_check(OP, self.vocab > 0 && self.vocab <= i32::MAX as usize, || format!("vocabulary {}", self.vocab))?;
        shape_check(OP, self.k <= PROMPT_LOGPROB_MAX_TOP, || {
            format!("{} top entries (at most {PROMPT_LOGPROB_MAX_TOP})", self.k)
        })?;
        shape_check(OP, self.rows <= u16::MAX as usize, || format!("{} rows in one launch", self.rows))?;
        need(OP, "logits", self.logits, self.rows * self.vocab)?;
        need(OP, "targets", self.targets, self.rows)?;
        need(OP, "out", self.out, self.rows * PROMPT_LOGPROB_OUT_WORDS)?;
        if self.rows == 0 {
            return Ok(());
        }
        let grid = cfg((self.rows as u32, 1, 1), THREADS);
        let args =
            Args::new(OP).buf(self.logits).i32(self.vocab as i32).buf(self.targets).i32(self.k as i32).buf(&*self.out);
        // SAFETY: row r < rows reads logits[r * vocab .. (r + 1) * vocab] (checked above),
        // targets[r] (checked, each below vocab by the caller) and writes out's row r.
        unsafe { args.launch(dev, &dev.kernels.prompt_logprobs, grid) }
    }
}

impl CudaDevice {
    /// Scores `targets[r]` under row `r` of the `targets.len() × vocab` f32 `logits` with the
    /// `k` best entries of each row, and returns one answer per row, in order. `scratch` and
    /// `out` are grown as needed. Synchronizes with the stream (the answers are downloaded).
    pub fn prompt_logprobs(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        targets: &[u32],
        k: usize,
        scratch: &mut CudaSlice<u32>,
        out: &mut CudaSlice<u32>,
    ) -> Result<Vec<RowLogprob>, CudaError> {
        const OP: &str = "prompt_logprobs";
        if let Some(t) = targets.iter().find(|&&t| t as usize >= vocab) {
            return Err(super::launch::shape_error(OP, format!("target {t} outside a vocabulary of {vocab}")));
        }
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        // Never recorded into a CUDA graph (it downloads), so its buffers may move.
        self.grow_outside_graphs(scratch, targets.len())?;
        self.grow_outside_graphs(out, targets.len() * PROMPT_LOGPROB_OUT_WORDS)?;
        self.upload_into(targets, scratch)?;
        PromptLogprobsCall { logits, vocab, targets: scratch, rows: targets.len(), k, out }.launch_checked(self)?;
        let words = self.download(out, targets.len() * PROMPT_LOGPROB_OUT_WORDS)?;
        Ok(words.chunks_exact(PROMPT_LOGPROB_OUT_WORDS).map(decode).collect())
    }
}

/// One row of the kernel's output words.
fn decode(o: &[u32]) -> RowLogprob {
    let n = (o[2] as usize).min(PROMPT_LOGPROB_MAX_TOP);
    let top = (0..n).map(|j| (o[4 + j], f32::from_bits(o[4 + PROMPT_LOGPROB_MAX_TOP + j]))).collect();
    RowLogprob { logprob: f32::from_bits(o[0]), rank: o[1], top }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_words_decode() {
        let mut o = vec![0u32; PROMPT_LOGPROB_OUT_WORDS];
        o[0] = (-2.5f32).to_bits();
        o[1] = 4;
        o[2] = 2;
        o[4] = 9;
        o[5] = 3;
        o[4 + PROMPT_LOGPROB_MAX_TOP] = (-0.25f32).to_bits();
        o[5 + PROMPT_LOGPROB_MAX_TOP] = (-1.0f32).to_bits();
        assert_eq!(decode(&o), RowLogprob { logprob: -2.5, rank: 4, top: vec![(9, -0.25), (3, -1.0)] });
    }
}
