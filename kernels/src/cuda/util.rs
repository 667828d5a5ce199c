//! Launchers for `kernels/cuda/util.cu`: random weights drawn on the device, and a timed
//! spin for the step profiler.

use super::{CudaDevice, CudaError, shape_check};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

impl CudaDevice {
    /// Fills `out[offset .. offset + n]` with elements `0..n` of the counter generator with
    /// `key`, `mean` and `amp` (see `baton_formats::CounterInit`), rounded to bf16: the values
    /// the host would draw, bit for bit.
    pub fn fill_counter(
        &self,
        out: &mut CudaSlice<bf16>,
        offset: usize,
        n: usize,
        init: (u64, f32, f32),
    ) -> Result<(), CudaError> {
        shape_check("fill_counter", offset.checked_add(n).is_some_and(|end| end <= out.len()), || {
            format!("{n} values at {offset} into a buffer of {}", out.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let (key, mean, amp) = init;
        let count = n as i64;
        let blocks = n.div_ceil(256).min(65_535) as u32;
        let mut view = out.slice_mut(offset..offset + n);
        let mut b = self.stream.launch_builder(&self.funcs.fill_counter);
        b.arg(&mut view).arg(&count).arg(&key).arg(&mean).arg(&amp);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the kernel writes elements 0..count of the view, which holds exactly n.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Enqueues a one-thread kernel that waits `ns` nanoseconds: the profiler queues a whole
    /// step behind it, so its kernels then run back to back as they would from a graph.
    pub fn spin(&self, ns: u64) -> Result<(), CudaError> {
        let ns = i64::try_from(ns).unwrap_or(i64::MAX);
        let mut b = self.stream.launch_builder(&self.funcs.spin);
        b.arg(&ns);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the kernel reads only its argument.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
