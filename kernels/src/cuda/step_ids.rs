//! The token ids a step embeds, on the device: uploaded from the host, or, for rows of a
//! step planned before the previous step's tokens reached the host, taken from where the
//! sampler left them.
//!
//! Invariants: every id is checked before it reaches the device (host ids against the
//! vocabulary, sampler picks by construction: the sampler only picks ids below it); every
//! upload happens in [`StepIds::stage`], never in a launch, so the embedding that reads the
//! ids can be recorded into a CUDA graph; the id buffer only grows.

use super::launch::{int, shape_check, shape_error};
use super::sampling::SampleBuffers;
use super::staging::{Direction, Staging};
use super::{CudaDevice, CudaError, CudaSlice};

/// A step's token ids on the device and their staging.
pub struct StepIds {
    ids: CudaSlice<u32>,
    up: Staging<u32>,
    /// `(row, sampler row)` pairs, flattened.
    pending: CudaSlice<i32>,
    pending_up: Staging<i32>,
    /// Host copy of the ids with pending rows zeroed (they are overwritten on the device).
    host: Vec<u32>,
    /// Which rows are pending.
    from_sampler: Vec<bool>,
    /// Ids the last successful [`StepIds::stage`] put on the device, and the vocabulary they
    /// were checked against (0 and 0 before the first, and after a refused one).
    staged: usize,
    vocab: usize,
}

impl StepIds {
    /// Small empty buffers.
    pub fn new(dev: &CudaDevice) -> Result<Self, CudaError> {
        Ok(Self {
            ids: dev.alloc(64)?,
            up: Staging::new(Direction::Up),
            pending: dev.alloc(64)?,
            pending_up: Staging::new(Direction::Up),
            host: Vec::new(),
            from_sampler: Vec::new(),
            staged: 0,
            vocab: 0,
        })
    }

    /// Rows the last [`StepIds::stage`] staged.
    pub fn rows(&self) -> usize {
        self.staged
    }

    /// The vocabulary every staged id is below.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The device ids of the last [`StepIds::stage`].
    pub fn ids(&self) -> &CudaSlice<u32> {
        &self.ids
    }

    /// Puts `tokens` on the device, except that each `(row, i)` of `pending` takes the token
    /// the last sampling launched on `sampled` picked for its row `i` (`tokens[row]` is
    /// ignored). Errors, before anything is enqueued: a host token outside `vocab`, a row
    /// outside `tokens`, a row named twice, an `i` past that sampling's rows, or rows pending
    /// without a `sampled`.
    pub fn stage(
        &mut self,
        dev: &CudaDevice,
        tokens: &[u32],
        vocab: usize,
        pending: &[(usize, usize)],
        sampled: Option<&SampleBuffers>,
    ) -> Result<(), CudaError> {
        const OP: &str = "embed";
        let picks = sampled.map_or(0, SampleBuffers::launched_rows);
        (self.staged, self.vocab) = (0, 0);
        self.from_sampler.clear();
        self.from_sampler.resize(tokens.len(), false);
        let mut flat = Vec::with_capacity(2 * pending.len());
        for &(row, i) in pending {
            shape_check(OP, row < tokens.len(), || format!("pending row {row} of {}", tokens.len()))?;
            shape_check(OP, i < picks, || format!("sampler row {i} of {picks} sampled"))?;
            shape_check(OP, !self.from_sampler[row], || format!("row {row} is pending twice"))?;
            self.from_sampler[row] = true;
            flat.extend([int(OP, row)?, int(OP, i)?]);
        }
        self.host.clear();
        for (&t, &pending) in tokens.iter().zip(&self.from_sampler) {
            if !pending && t as usize >= vocab {
                return Err(shape_error(OP, format!("token {t} outside a vocabulary of {vocab}")));
            }
            // A pending row's id is written on the device after the upload.
            self.host.push(if pending { 0 } else { t });
        }
        if tokens.is_empty() {
            (self.staged, self.vocab) = (0, vocab);
            return Ok(());
        }
        dev.grow(&mut self.ids, tokens.len())?;
        self.up.upload(dev, &self.host, &mut self.ids)?;
        if let (false, Some(sampled)) = (pending.is_empty(), sampled) {
            dev.grow(&mut self.pending, flat.len())?;
            self.pending_up.upload(dev, &flat, &mut self.pending)?;
            dev.take_sampled_ids(sampled, &self.pending, pending.len(), &mut self.ids)?;
        }
        (self.staged, self.vocab) = (tokens.len(), vocab);
        Ok(())
    }
}
