//! Launchers for `kernels/cuda/util.cu`, which are not part of a model step: random weights
//! drawn on the device ([`CudaDevice::fill_counter`] in bf16, [`CudaDevice::fill_counter_f32`]
//! as drawn) and a timed spin for the step profiler ([`CudaDevice::spin`]).

use super::launch::{Args, Elem, cfg, grid_stride, shape_check};
use super::{CudaDevice, CudaError};
use cudarc::driver::{CudaFunction, CudaSlice};
use half::bf16;

impl CudaDevice {
    /// Fills `out[offset .. offset + n]` with elements `0..n` of the counter generator with
    /// `init = (key, mean, amp)` (see `baton_formats::CounterInit`), rounded to bf16: the
    /// values the host would draw, bit for bit.
    pub fn fill_counter(
        &self,
        out: &mut CudaSlice<bf16>,
        offset: usize,
        n: usize,
        init: (u64, f32, f32),
    ) -> Result<(), CudaError> {
        self.fill(&self.kernels.fill_counter, out, offset, 0, n, init)
    }

    /// Fills `out[.. n]` with elements `first .. first + n` of the counter generator (as
    /// [`Self::fill_counter`]) in f32, unrounded: the host's draws bit for bit (what quantizing
    /// random weights as the host does needs).
    pub fn fill_counter_f32(
        &self,
        out: &mut CudaSlice<f32>,
        first: usize,
        n: usize,
        init: (u64, f32, f32),
    ) -> Result<(), CudaError> {
        self.fill(&self.kernels.fill_counter_f32, out, 0, first, n, init)
    }

    /// Either fill kernel (they differ only in the element type they write).
    fn fill<T: Elem>(
        &self,
        func: &CudaFunction,
        out: &mut CudaSlice<T>,
        offset: usize,
        first: usize,
        n: usize,
        init: (u64, f32, f32),
    ) -> Result<(), CudaError> {
        const OP: &str = "fill_counter";
        shape_check(OP, offset.checked_add(n).is_some_and(|end| end <= out.len()), || {
            format!("{n} values at {offset} into a buffer of {}", out.len())
        })?;
        shape_check(OP, first.checked_add(n).is_some_and(|end| end < i64::MAX as usize), || {
            format!("elements {first} + {n} of the draw overflow its 64-bit index")
        })?;
        if n == 0 {
            return Ok(());
        }
        let (key, mean, amp) = init;
        let args = Args::new(OP).buf(out).long(offset)?.long(first)?.long(n)?.u64(key).f32(mean).f32(amp);
        // SAFETY: the kernel writes out[offset + i] for i < n, inside `out` (checked above), and
        // reads nothing.
        unsafe { args.launch(self, func, grid_stride(n)) }
    }

    /// Enqueues a one-thread kernel that waits `ns` nanoseconds: the profiler queues a whole
    /// step behind it, so the step's kernels then run back to back as from a graph.
    pub fn spin(&self, ns: u64) -> Result<(), CudaError> {
        let args = Args::new("spin").long(usize::try_from(ns).unwrap_or(usize::MAX).min(i64::MAX as usize))?;
        // SAFETY: the kernel reads only its argument.
        unsafe { args.launch(self, &self.kernels.spin, cfg((1, 1, 1), 32)) }
    }
}
