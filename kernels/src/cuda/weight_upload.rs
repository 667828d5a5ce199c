//! Weights from host memory (typically a safetensors memory map) to the device at page-cache
//! speed: [`WeightUploader`] streams stored tensors through a small ring of page-locked
//! buffers, filled by parallel threads and copied to the device asynchronously while the next
//! buffer fills.
//!
//! Why: a pageable host-to-device copy of an f32 vector converted on one thread ran at
//! 0.33 GB/s; reading the page cache is bound by page faults and one core's copy rate, which
//! parallel threads multiply, and a DMA from page-locked memory runs at the link's rate in
//! stream order while the host goes on.
//!
//! The unit of work is a *stack*: tensors whose elements, concatenated, are one device matrix
//! (the fused `[q; k; v]` and `[gate; up]` included), so each tensor lands straight in its
//! slice of the matrix. A stack is cut into chunks of at most one ring buffer
//! ([`plan_chunks`]); each chunk is converted to bf16 (a plain copy for bf16 sources; f16 and
//! f32 rounded exactly as `half::bf16::from_f32` rounds, as the f32 upload path does) by
//! rayon's threads into the next buffer ([`fill_bf16`]), then copied to the device.
//!
//! Invariants: a ring buffer is written by the host only after the copy that last read it has
//! finished (an event recorded after each copy is waited on first), and is freed only after
//! that too; copies are enqueued on the device's one stream, so kernels that later read the
//! weights are ordered after them; uploads are refused while a CUDA graph is being recorded.

use super::launch::shape_check;
use super::{CudaDevice, CudaError};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;
use std::time::Instant;

/// Element type of stored weight bytes (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostDType {
    /// bfloat16: copied as is.
    Bf16,
    /// IEEE binary16: widened to f32, rounded to bf16.
    F16,
    /// IEEE binary32: rounded to bf16.
    F32,
}

impl HostDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

/// One stored tensor: `bytes` holds whole little-endian elements of `dtype`.
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    /// The elements, e.g. a slice of a memory-mapped file.
    pub bytes: &'a [u8],
    /// Their type.
    pub dtype: HostDType,
}

impl HostTensor<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Elements per ring buffer by default: 32 Mi bf16 = 64 MiB.
pub const DEFAULT_SLOT_ELEMS: usize = 32 << 20;
/// Ring buffers by default: while one is filled, up to three copies are in flight.
pub const DEFAULT_SLOTS: usize = 4;
/// Elements one thread converts at a time (1 MiB of bf16): big enough that a task's cost is
/// the copy, small enough that a buffer spreads over every core.
const FILL_PIECE: usize = 512 << 10;

/// What the uploads so far cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UploadStats {
    /// Bytes read from the host tensors.
    pub bytes_read: u64,
    /// bf16 bytes copied to the device.
    pub bytes_uploaded: u64,
    /// Host-to-device copies enqueued.
    pub copies: u64,
    /// Seconds the host spent filling ring buffers (reading and converting, all threads
    /// together in wall time).
    pub fill_s: f64,
    /// Seconds the host waited for copies: for a buffer to come free, and at the end.
    pub wait_s: f64,
}

/// The chunks of a stack of `total` elements for a ring of `slots` buffers of `slot_len`
/// elements, starting at buffer `first_slot`: `(buffer, element range)` in order, every range
/// at most `slot_len` long, together covering `0..total` exactly once, buffers taken round
/// robin.
pub fn plan_chunks(total: usize, slot_len: usize, first_slot: usize, slots: usize) -> Vec<(usize, Range<usize>)> {
    let slot_len = slot_len.max(1);
    let slots = slots.max(1);
    (0..total.div_ceil(slot_len))
        .map(|i| ((first_slot + i) % slots, i * slot_len..((i + 1) * slot_len).min(total)))
        .collect()
}

/// Writes elements `first..first + out.len()` of the concatenation of `parts`, converted to
/// bf16, into `out`, on rayon's threads. Panics (a caller bug) if the parts hold fewer.
pub fn fill_bf16(parts: &[HostTensor<'_>], first: usize, out: &mut [bf16]) {
    // starts[i]: index of part i's first element in the concatenation.
    let mut starts = Vec::with_capacity(parts.len() + 1);
    let mut acc = 0usize;
    for p in parts {
        starts.push(acc);
        acc += p.len();
    }
    starts.push(acc);
    assert!(first + out.len() <= acc, "fill_bf16: {}..{} of {acc} elements", first, first + out.len());
    out.par_chunks_mut(FILL_PIECE).enumerate().for_each(|(c, piece)| {
        let mut at = first + c * FILL_PIECE;
        let mut done = 0;
        // The last part starting at or before `at` (skipping empty parts).
        let mut part = starts.partition_point(|&s| s <= at).saturating_sub(1);
        while done < piece.len() {
            while starts[part + 1] <= at {
                part += 1;
            }
            let offset = at - starts[part];
            let n = (starts[part + 1] - at).min(piece.len() - done);
            convert(&parts[part], offset, &mut piece[done..done + n]);
            done += n;
            at += n;
        }
    });
}

/// Elements `offset..offset + out.len()` of `t`, converted to bf16.
fn convert(t: &HostTensor<'_>, offset: usize, out: &mut [bf16]) {
    let size = t.dtype.size();
    let src = &t.bytes[offset * size..(offset + out.len()) * size];
    match t.dtype {
        HostDType::Bf16 => {
            if cfg!(target_endian = "little") {
                // Little-endian bf16 bytes are the elements themselves: one memcpy (from an
                // unaligned source, hence bytes).
                let dst: &mut [u8] = bytemuck::cast_slice_mut(out);
                dst.copy_from_slice(src);
            } else {
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]);
                }
            }
        }
        HostDType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32());
            }
        }
        HostDType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
    }
}

/// One page-locked ring buffer and the event of the copy that last read it.
struct Slot {
    buf: PinnedHostSlice<bf16>,
    copied: CudaEvent,
}

impl Drop for Slot {
    fn drop(&mut self) {
        // A copy may still read the buffer: it is freed (by `buf`'s drop, after this) only
        // once that copy has finished.
        let _ = self.copied.synchronize();
    }
}

/// Streams weight stacks to the device through a ring of page-locked buffers (see the module
/// docs). Buffers are allocated on first use, each no larger than the largest chunk it has
/// carried, and freed by [`WeightUploader::finish`] (or on drop).
pub struct WeightUploader {
    slot_len: usize,
    slots: Vec<Option<Slot>>,
    next: usize,
    stats: UploadStats,
}

impl Default for WeightUploader {
    fn default() -> Self {
        Self::new(DEFAULT_SLOT_ELEMS, DEFAULT_SLOTS)
    }
}

impl WeightUploader {
    /// A ring of `slots` buffers of `slot_len` bf16 elements (nothing allocated yet).
    pub fn new(slot_len: usize, slots: usize) -> Self {
        Self {
            slot_len: slot_len.max(1),
            slots: (0..slots.max(1)).map(|_| None).collect(),
            next: 0,
            stats: Default::default(),
        }
    }

    /// Ring buffer `i`, at least `len` long, once the copy that last read it has finished.
    fn slot(&mut self, dev: &CudaDevice, i: usize, len: usize) -> Result<&mut Slot, CudaError> {
        let t0 = Instant::now();
        if let Some(s) = &self.slots[i] {
            s.copied.synchronize()?;
        }
        self.stats.wait_s += t0.elapsed().as_secs_f64();
        if self.slots[i].as_ref().is_none_or(|s| s.buf.len() < len) {
            // Drop the old buffer (its copy is done) before taking a larger one.
            self.slots[i] = None;
            let cap = len.next_power_of_two().min(self.slot_len).max(len);
            // SAFETY: the contents are unspecified; the host writes every element a copy reads
            // (`fill_bf16` covers the chunk) before that copy is enqueued.
            let buf = unsafe { dev.ctx.alloc_pinned_with_flags::<bf16>(cap, 0) }?;
            let copied = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
            self.slots[i] = Some(Slot { buf, copied });
        }
        self.slots[i].as_mut().ok_or_else(|| CudaError::Shape { op: "upload_weights", message: "no buffer".into() })
    }

    /// Enqueues copying the concatenation of `parts`, as bf16, into the start of `dst`;
    /// returns once the last chunk's copy is enqueued (the host tensors may then go: every
    /// byte was read into page-locked memory).
    pub fn upload(
        &mut self,
        dev: &CudaDevice,
        parts: &[HostTensor<'_>],
        dst: &mut CudaSlice<bf16>,
    ) -> Result<(), CudaError> {
        dev.not_capturing("uploading")?;
        for p in parts {
            shape_check("upload_weights", p.bytes.len().is_multiple_of(p.dtype.size()), || {
                format!("{} bytes is not whole {:?} elements", p.bytes.len(), p.dtype)
            })?;
        }
        let total: usize = parts.iter().map(HostTensor::len).sum();
        shape_check("upload_weights", dst.len() >= total, || format!("{total} values into a buffer of {}", dst.len()))?;
        let plan = plan_chunks(total, self.slot_len, self.next, self.slots.len());
        for (i, range) in plan {
            let stream = dev.stream.clone();
            let slot = self.slot(dev, i, range.len())?;
            let host = &mut slot.buf.as_mut_slice()?[..range.len()];
            let t0 = Instant::now();
            fill_bf16(parts, range.start, host);
            let fill_s = t0.elapsed().as_secs_f64();
            let mut view = dst.slice_mut(range.clone());
            // The source is page-locked: a DMA in stream order; `copied` keeps the host from
            // rewriting or freeing the buffer before it ran.
            stream.memcpy_htod(&*host, &mut view)?;
            slot.copied.record(&stream)?;
            self.stats.fill_s += fill_s;
            self.stats.copies += 1;
            self.stats.bytes_uploaded += (range.len() * 2) as u64;
            self.next = (i + 1) % self.slots.len();
        }
        self.stats.bytes_read += parts.iter().map(|p| p.bytes.len() as u64).sum::<u64>();
        Ok(())
    }

    /// Waits for every copy, frees the ring and returns what the uploads cost.
    pub fn finish(&mut self, dev: &CudaDevice) -> Result<UploadStats, CudaError> {
        let t0 = Instant::now();
        dev.synchronize()?;
        self.slots.iter_mut().for_each(|s| *s = None);
        self.stats.wait_s += t0.elapsed().as_secs_f64();
        Ok(self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_bytes<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }

    #[test]
    fn chunks_cover_the_stack_once_round_robin() {
        assert!(plan_chunks(0, 8, 0, 4).is_empty());
        assert_eq!(plan_chunks(5, 8, 2, 4), vec![(2, 0..5)]);
        assert_eq!(plan_chunks(16, 8, 3, 4), vec![(3, 0..8), (0, 8..16)]);
        let p = plan_chunks(100, 7, 1, 3);
        assert_eq!(p.len(), 15);
        let mut at = 0;
        for (k, (slot, r)) in p.iter().enumerate() {
            assert_eq!(*slot, (1 + k) % 3);
            assert_eq!(r.start, at);
            assert!(r.len() <= 7 && !r.is_empty());
            at = r.end;
        }
        assert_eq!(at, 100);
    }

    /// Every dtype, parts crossing piece boundaries, empty parts, every offset class: the
    /// result equals the f32 path (to f32, then `bf16::from_f32`), bit for bit.
    #[test]
    fn fill_matches_the_f32_path_across_parts_and_pieces() {
        let n_a = FILL_PIECE + 37;
        let a: Vec<f32> = (0..n_a).map(|i| (i as f32 * 0.37).sin() * 3.0 + 1e-3).collect();
        let b: Vec<f16> = (0..1001).map(|i| f16::from_f32(i as f32 * -0.011)).collect();
        let c: Vec<bf16> = (0..2 * FILL_PIECE + 5).map(|i| bf16::from_f32((i as f32).sqrt())).collect();
        let special = [f32::NAN, f32::INFINITY, -0.0, 1.0e-40, 3.0e38, 1.0 + 1.0 / 256.0]; // the last: a tie, rounds to even
        let a_bytes = le_bytes(&a, |x| x.to_le_bytes().to_vec());
        let b_bytes = le_bytes(&b, |x| x.to_le_bytes().to_vec());
        let c_bytes = le_bytes(&c, |x| x.to_le_bytes().to_vec());
        let s_bytes = le_bytes(&special, |x| x.to_le_bytes().to_vec());
        let parts = [
            HostTensor { bytes: &a_bytes, dtype: HostDType::F32 },
            HostTensor { bytes: &[], dtype: HostDType::Bf16 },
            HostTensor { bytes: &b_bytes, dtype: HostDType::F16 },
            HostTensor { bytes: &c_bytes, dtype: HostDType::Bf16 },
            HostTensor { bytes: &s_bytes, dtype: HostDType::F32 },
        ];
        let want: Vec<bf16> = a
            .iter()
            .copied()
            .chain(b.iter().map(|x| x.to_f32()))
            .chain(c.iter().map(|x| x.to_f32()))
            .chain(special.iter().copied())
            .map(bf16::from_f32)
            .collect();
        let total: usize = parts.iter().map(HostTensor::len).sum();
        assert_eq!(total, want.len());
        for (first, len) in [(0, total), (1, total - 1), (n_a - 3, 1010), (n_a + 1001, c.len()), (total - 6, 6), (5, 0)]
        {
            let mut out = vec![bf16::from_f32(-7.0); len];
            fill_bf16(&parts, first, &mut out);
            let same = out.iter().zip(&want[first..first + len]).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "fill {first}..{}", first + len);
        }
    }

    #[test]
    #[should_panic(expected = "fill_bf16")]
    fn fill_past_the_parts_is_a_bug() {
        let bytes = [0u8; 8];
        let mut out = vec![bf16::ZERO; 5];
        fill_bf16(&[HostTensor { bytes: &bytes, dtype: HostDType::Bf16 }], 0, &mut out);
    }

    #[test]
    fn host_tensor_lengths() {
        let bytes = [0u8; 12];
        assert_eq!(HostTensor { bytes: &bytes, dtype: HostDType::F32 }.len(), 3);
        assert_eq!(HostTensor { bytes: &bytes, dtype: HostDType::F16 }.len(), 6);
        assert!(HostTensor { bytes: &[], dtype: HostDType::Bf16 }.is_empty());
    }
}
