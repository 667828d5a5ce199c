//! The shared-memory carve-out (an SM's split of its 256 KiB between L1 and shared memory) that
//! the kernel launches ask for, and the rule that picks it for a decode step.
//!
//! Why it matters: an SM changes its split only once it has drained, so under programmatic
//! dependent launch a kernel whose split differs from the previous kernel's cannot start on an
//! SM until that SM is empty, and the overlap PDL buys is lost. Left to the driver, one
//! Llama-3.1-8B decode layer at one row changes split five times (ncu, H200, session 26: the
//! skinny GEMMs 32 KiB of shared memory, the residual products 64 KiB, the streaming attention
//! 228 KiB, its combine 32 KiB). Asking every launch of a small decode step for one split
//! ([`STEP_CARVEOUT_PERCENT`]) removes those drains; the split must leave the skinny GEMMs their
//! L1 (at 60 % and above they lose 8-50 %: their loads in flight need it) and the attention
//! kernel room for its rings, whose CTAs the split rule then plans in that share
//! (`paged_attention::split_smem`).
//!
//! Invariants: a carve-out is a hint about timing only; no choice here changes what a kernel
//! computes, except that planning attention's splits in the pinned share changes the split
//! count, and with it how the f32 partial sums are grouped (a function of the step's shape
//! alone, so a replayed graph runs what it recorded). The per-step rule is a function of the
//! step's padded shape, so every recording for one graph key carries the same carve-out.
//! cuBLAS's launches are not ours and keep their own.

use super::paged_attention::{DecodeShape, attn_default, attn_stream_narrow};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The carve-out, in percent of the SM's largest shared memory, that every launch of a decode
/// step whose attention takes the narrow streaming variant asks for ([`step_carveout`]).
///
/// Measured on an H200 (session 26, `bench_cuda --carveout`, alternated in one process, calls
/// B-D): against each launch's own choice, 50 % on every launch with attention's splits planned
/// in it gave Llama-3.1-8B bf16 −1.7 % (1 × 128), −11.0 % (1 × 4k), −3.6 % (1 × 8k), −5.4 %
/// (2 × 1k), −10.6 % (4 × 1k), −0.3 % (2 × 4k, 4 × 4k); FP8 weights + KV −2.9 to −3.6 % at one
/// and two rows; Gemma-3-12B −6.6 to −8.1 % at one row; Qwen3-30B-A3B −0.2 % at one row, −2.4 %
/// at four. 40 % measured alike; 60 % and above slowed every shape (the skinny GEMMs' L1).
pub const STEP_CARVEOUT_PERCENT: u32 = 50;

/// The carve-out every launch of a decode step of `shape` asks for under
/// [`CarveoutPolicy::PerStep`]: [`STEP_CARVEOUT_PERCENT`] when its attention takes the narrow
/// streaming variant (`stream`: the device runs the streaming kernel), else `None` (each
/// launch's own). At 8 rows and more (the wide variant, Llama-3.1-8B) the same pin measured
/// +1 to +5 %, so it is not taken there. `decode_only`: every sequence of the step has one new
/// token (prefill chunks are not measured under a pin).
pub fn step_carveout(shape: &DecodeShape, stream: bool, decode_only: bool) -> Option<u32> {
    let narrow = stream && attn_default(shape, true) == attn_stream_narrow(shape.fp8);
    (decode_only && narrow).then_some(STEP_CARVEOUT_PERCENT)
}

/// Carve-outs the launches ask for, in percent of the SM's largest shared memory (`None`: no
/// pin).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CarveoutPins {
    /// Every launch without a choice of its own: all but decode attention's.
    pub others: Option<u32>,
    /// Decode attention's launches, over their own choice (`stream_carveout`).
    pub attention: Option<u32>,
    /// Whether decode attention's splits are planned in its pinned share rather than the
    /// SM's whole.
    pub split_by_pin: bool,
}

/// How a device's launches get their carve-out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CarveoutPolicy {
    /// The default: the backend sets each step's pins from its shape ([`step_carveout`]).
    PerStep,
    /// These pins on every launch, whatever the step (for comparisons).
    Fixed(CarveoutPins),
}

/// A device's carve-out state: the policy and the pins now in force.
#[derive(Debug)]
pub(crate) struct CarveoutState {
    per_step: AtomicBool,
    /// Percents; negative: no pin.
    others: AtomicI32,
    attention: AtomicI32,
    split_by_pin: AtomicBool,
}

fn code(pin: Option<u32>) -> i32 {
    pin.map_or(-1, |p| p.min(100) as i32)
}

fn decode(v: i32) -> Option<u32> {
    u32::try_from(v).ok()
}

impl CarveoutState {
    /// [`CarveoutPolicy::PerStep`], no pins yet.
    pub fn new() -> Self {
        Self {
            per_step: AtomicBool::new(true),
            others: AtomicI32::new(-1),
            attention: AtomicI32::new(-1),
            split_by_pin: AtomicBool::new(false),
        }
    }

    /// The pins now in force.
    pub fn pins(&self) -> CarveoutPins {
        CarveoutPins {
            others: decode(self.others.load(Ordering::Relaxed)),
            attention: decode(self.attention.load(Ordering::Relaxed)),
            split_by_pin: self.split_by_pin.load(Ordering::Relaxed),
        }
    }

    fn store(&self, pins: CarveoutPins) {
        self.others.store(code(pins.others), Ordering::Relaxed);
        self.attention.store(code(pins.attention), Ordering::Relaxed);
        self.split_by_pin.store(pins.split_by_pin, Ordering::Relaxed);
    }

    /// Sets the policy (per step: no pins until the next step sets them).
    pub fn set_policy(&self, policy: CarveoutPolicy) {
        match policy {
            CarveoutPolicy::PerStep => {
                self.per_step.store(true, Ordering::Relaxed);
                self.store(CarveoutPins::default());
            }
            CarveoutPolicy::Fixed(pins) => {
                self.per_step.store(false, Ordering::Relaxed);
                self.store(pins);
            }
        }
    }

    /// Under [`CarveoutPolicy::PerStep`], pins `pin` on every launch (attention's splits planned
    /// in it); ignored under a fixed policy.
    pub fn set_step(&self, pin: Option<u32>) {
        if self.per_step.load(Ordering::Relaxed) {
            self.store(CarveoutPins { others: pin, attention: pin, split_by_pin: pin.is_some() });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(rows: usize, fp8: bool) -> DecodeShape {
        DecodeShape { rows, n_heads: 32, n_kv_heads: 8, head_dim: 128, fp8 }
    }

    #[test]
    fn small_decode_steps_on_the_narrow_kernel_take_the_pin() {
        for fp8 in [false, true] {
            for rows in [1, 2, 4] {
                assert_eq!(step_carveout(&llama(rows, fp8), true, true), Some(STEP_CARVEOUT_PERCENT), "{rows} rows");
            }
            // The wide variant (8 rows and more), prefill chunks, and the tensor-core kernel
            // keep each launch's own choice.
            assert_eq!(step_carveout(&llama(8, fp8), true, true), None);
            assert_eq!(step_carveout(&llama(256, fp8), true, true), None);
            assert_eq!(step_carveout(&llama(1, fp8), true, false), None);
            assert_eq!(step_carveout(&llama(1, fp8), false, true), None);
        }
    }

    #[test]
    fn a_fixed_policy_ignores_the_step_rule() {
        let s = CarveoutState::new();
        s.set_step(Some(50));
        assert_eq!(s.pins(), CarveoutPins { others: Some(50), attention: Some(50), split_by_pin: true });
        s.set_step(None);
        assert_eq!(s.pins(), CarveoutPins::default());
        let fixed = CarveoutPins { others: Some(40), attention: None, split_by_pin: false };
        s.set_policy(CarveoutPolicy::Fixed(fixed));
        s.set_step(Some(50));
        assert_eq!(s.pins(), fixed);
        s.set_policy(CarveoutPolicy::Fixed(CarveoutPins { others: Some(250), ..fixed }));
        assert_eq!(s.pins().others, Some(100), "a percent above 100 is 100");
        s.set_policy(CarveoutPolicy::PerStep);
        assert_eq!(s.pins(), CarveoutPins::default());
        s.set_step(Some(50));
        assert_eq!(s.pins().attention, Some(50));
    }
}
