//! Recording a sequence of launches on the device's stream as a CUDA graph, and replaying it.
//!
//! A graph freezes every launch's arguments, device pointers included, at recording time.
//! So the recorded launches must read all per-step data (token ids, positions, slots, block
//! tables) from device buffers that are refilled before each replay, and no buffer a graph
//! uses may be freed or reallocated afterwards. Two guards enforce that here:
//!
//! - while recording, [`CudaDevice`] refuses to allocate, upload or download
//!   ([`CudaError::Capture`]): any such call inside a recording is a bug in the caller's
//!   staging, and the recording is abandoned instead of producing a graph with a dangling
//!   host pointer or a graph-owned allocation;
//! - every allocation bumps [`CudaDevice::alloc_generation`]; a caller keeps the generation a
//!   graph was recorded at and drops the graph once it changes (some buffer may have moved).
//!
//! Recording uses the thread-local capture mode, so other threads (an NCCL transfer thread)
//! may keep making calls that are illegal during a global capture.

use super::{CudaDevice, CudaError};
use cudarc::driver::sys;
use std::sync::atomic::Ordering;

/// A recorded, instantiated sequence of launches on one device's stream.
pub struct StepGraph {
    graph: cudarc::driver::CudaGraph,
}

// SAFETY: a graph is only ever used by the one thread that owns the backend at a time
// (moving it between threads is sequential access, which the CUDA docs allow; concurrent
// access is what they forbid, and `StepGraph` is not `Sync`).
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Enqueues the recorded launches on the device's stream.
    pub fn launch(&self) -> Result<(), CudaError> {
        Ok(self.graph.launch()?)
    }
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

impl CudaDevice {
    /// Starts recording the launches enqueued on this device's stream by this thread; they do
    /// not run. End with [`CudaDevice::end_capture`] (or [`CudaDevice::abort_capture`] after a
    /// failure) before anything else touches the stream.
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        if self.capturing.swap(true, Ordering::SeqCst) {
            return Err(CudaError::Capture("a recording is already in progress".into()));
        }
        if let Err(e) = self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
            self.capturing.store(false, Ordering::SeqCst);
            return Err(e.into());
        }
        Ok(())
    }

    /// Ends the recording and instantiates it.
    pub fn end_capture(&self) -> Result<StepGraph, CudaError> {
        let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        self.capturing.store(false, Ordering::SeqCst);
        match ended? {
            Some(graph) => Ok(StepGraph { graph }),
            None => Err(CudaError::Capture("the recording holds no work".into())),
        }
    }

    /// Ends a recording whose launches failed part-way, discarding what was recorded, so the
    /// stream is usable again.
    pub fn abort_capture(&self) {
        if self.capturing.load(Ordering::SeqCst) {
            // The graph (if any) is dropped: destroyed, never launched.
            let _ = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
            self.capturing.store(false, Ordering::SeqCst);
        }
    }
}
