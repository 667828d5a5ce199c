//! Page-locked host staging for the copies every step makes: the step metadata, the token
//! ids and the sampler's rows go up through it, the sampler's answers come down through it.
//!
//! From pageable memory the driver first copies into a buffer of its own, and a download
//! blocks the host until the data has arrived; from page-locked memory both are DMA
//! transfers that run in stream order while the host goes on. That is what lets the engine
//! plan the next step while the device runs this one.
//!
//! Invariants: a [`Staging`] buffer is touched by the host only after the copy that last
//! used it has finished (an event recorded after each copy is waited on first), so a copy
//! still in flight never reads half-written data or loses its answer; buffers only grow
//! (power-of-two lengths); copies are refused while a CUDA graph is being recorded.

use super::launch::shape_check;
use super::{CudaDevice, CudaError};
use cudarc::driver::sys::{CU_MEMHOSTALLOC_WRITECOMBINED, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

/// Which way a staging buffer's data goes; write-combined memory is fast for the device to
/// read and very slow for the host to read, so only uploads use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    Up,
    Down,
}

/// A page-locked host buffer and the event of the last copy that used it.
pub(crate) struct Staging<T> {
    dir: Direction,
    buf: Option<PinnedHostSlice<T>>,
    /// Recorded on the stream right after the last copy from or into `buf`.
    last_copy: Option<CudaEvent>,
    /// Elements the last download brought.
    len: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy> Staging<T> {
    /// An empty buffer (nothing is allocated until the first copy).
    pub fn new(dir: Direction) -> Self {
        Self { dir, buf: None, last_copy: None, len: 0 }
    }

    /// The buffer, at least `len` long, once its last copy has finished.
    fn ready(&mut self, dev: &CudaDevice, len: usize) -> Result<&mut [T], CudaError> {
        if let Some(e) = &self.last_copy {
            e.synchronize()?;
        }
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            let flags = if self.dir == Direction::Up { CU_MEMHOSTALLOC_WRITECOMBINED } else { 0 };
            // SAFETY: the contents are unspecified; every reader of the buffer reads only what
            // a copy or the host wrote first.
            self.buf = Some(unsafe { dev.ctx.alloc_pinned_with_flags::<T>(len.max(1).next_power_of_two(), flags) }?);
        }
        match self.buf.as_mut() {
            Some(b) => Ok(&mut b.as_mut_slice()?[..len]),
            None => Err(CudaError::Shape { op: "staging", message: "no buffer".into() }),
        }
    }

    /// Records the event that the next host access waits for.
    fn mark_copy(&mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        if self.last_copy.is_none() {
            self.last_copy = Some(dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?);
        }
        if let Some(e) = &self.last_copy {
            e.record(&dev.stream)?;
        }
        Ok(())
    }

    /// Copies `data` into the start of `dst` through this buffer; returns before the copy ran.
    pub fn upload(&mut self, dev: &CudaDevice, data: &[T], dst: &mut CudaSlice<T>) -> Result<(), CudaError> {
        dev.not_capturing("uploading")?;
        shape_check("upload", dst.len() >= data.len(), || {
            format!("{} values into a buffer of {}", data.len(), dst.len())
        })?;
        if data.is_empty() {
            return Ok(());
        }
        let host = self.ready(dev, data.len())?;
        host.copy_from_slice(data);
        let mut view = dst.slice_mut(..data.len());
        // The source is page-locked, so this is a DMA in stream order; `mark_copy` keeps the
        // host from rewriting it before then.
        dev.stream.memcpy_htod(&*host, &mut view)?;
        self.mark_copy(dev)
    }

    /// Starts copying the first `len` elements of `src` here; [`Staging::wait`] returns them.
    pub fn download_async(&mut self, dev: &CudaDevice, src: &CudaSlice<T>, len: usize) -> Result<(), CudaError> {
        dev.not_capturing("downloading")?;
        shape_check("download", src.len() >= len, || format!("{len} values from a buffer of {}", src.len()))?;
        let host = self.ready(dev, len)?;
        if len > 0 {
            dev.stream.memcpy_dtoh(&src.slice(..len), host)?;
        }
        self.len = len;
        self.mark_copy(dev)
    }

    /// Waits for the last [`Staging::download_async`] and returns what it brought (reports any
    /// fault of the work enqueued before it).
    pub fn wait(&mut self) -> Result<&[T], CudaError> {
        if let Some(e) = &self.last_copy {
            e.synchronize()?;
        }
        match self.buf.as_ref() {
            Some(b) => Ok(&b.as_slice()?[..self.len]),
            None => Ok(&[]),
        }
    }
}
