//! The CUDA backend's host-staged KV block I/O ([`KvIo`]): one layer's K and V blocks copied
//! to and from host bytes for the TCP hand-off, run by run of consecutive block ids. The
//! element type is the cache's (bf16 codes, or e4m3 bytes through cuda_kv_fp8.rs). Also the
//! benchmarks' random fill of the whole cache ([`CudaBackend::fill_kv_random`]).
//!
//! Invariants: every block id is checked against the pool before any copy; both directions
//! synchronize before returning (the host buffers are the caller's, or freed on return).

use super::{CudaBackend, driver_error, kerr};
use crate::backend::{Backend, BackendError, KvIo};
use baton_kernels::cuda::{CudaError, CudaSlice, CudaStream};
use half::bf16;
use std::sync::Arc;

impl KvIo for CudaBackend {
    fn read_kv_blocks(&mut self, layer: usize, blocks: &[u32]) -> Result<(Vec<u8>, Vec<u8>), BackendError> {
        let block_len = self.kv_block_len(blocks)?;
        if self.fp8.is_some() {
            return self.read_fp8_blocks(layer, blocks, block_len);
        }
        let (kc, vc) =
            self.kv.get(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        let mut k = vec![bf16::ZERO; blocks.len() * block_len];
        let mut v = vec![bf16::ZERO; blocks.len() * block_len];
        let stream = self.dev.stream();
        let mut at = 0;
        for (start, len) in crate::kv_connector::block_runs(blocks) {
            let src = start * block_len..(start + len) * block_len;
            let dst = at..at + len * block_len;
            stream.memcpy_dtoh(&kc.slice(src.clone()), &mut k[dst.clone()]).map_err(driver_error)?;
            stream.memcpy_dtoh(&vc.slice(src), &mut v[dst]).map_err(driver_error)?;
            at += len * block_len;
        }
        stream.synchronize().map_err(driver_error)?;
        let bytes = |x: Vec<bf16>| x.into_iter().flat_map(|e| e.to_bits().to_ne_bytes()).collect::<Vec<u8>>();
        Ok((bytes(k), bytes(v)))
    }

    fn write_kv_blocks(&mut self, layer: usize, blocks: &[u32], k: &[u8], v: &[u8]) -> Result<(), BackendError> {
        let block_len = self.kv_block_len(blocks)?;
        let want = blocks.len() * block_len * self.kv_dtype().size();
        if k.len() != want || v.len() != want {
            return Err(kerr(
                "write_kv_blocks",
                format!("{} blocks need {want} bytes each of K and V, got {} and {}", blocks.len(), k.len(), v.len()),
            ));
        }
        if self.fp8.is_some() {
            return self.write_fp8_blocks(layer, blocks, block_len, k, v);
        }
        let elems = |b: &[u8]| {
            b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]]))).collect::<Vec<bf16>>()
        };
        let (kh, vh) = (elems(k), elems(v));
        let stream = self.dev.stream().clone();
        let (kc, vc) =
            self.kv.get_mut(layer).ok_or_else(|| BackendError::Device(format!("layer {layer} has no KV cache")))?;
        let mut at = 0;
        for (start, len) in crate::kv_connector::block_runs(blocks) {
            let dst = start * block_len..(start + len) * block_len;
            let src = at..at + len * block_len;
            stream.memcpy_htod(&kh[src.clone()], &mut kc.slice_mut(dst.clone())).map_err(driver_error)?;
            stream.memcpy_htod(&vh[src], &mut vc.slice_mut(dst)).map_err(driver_error)?;
            at += len * block_len;
        }
        // The host staging vectors are freed on return: wait for the copies to read them.
        stream.synchronize().map_err(driver_error)
    }
}

impl CudaBackend {
    /// Fills every layer's K and V cache with random values (benchmarks time decode over a
    /// context without computing it; never zeros, which can time faster): bf16 in [-1, 1], or
    /// for an FP8 cache E4M3 codes of magnitude below 1 (no NaN code).
    pub fn fill_kv_random(&mut self, seed: u64) -> Result<(), BackendError> {
        let tile_len = 1usize << 22;
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let stream = self.dev.stream().clone();
        if let Some(fp8) = self.fp8.as_mut() {
            // Sign, and an exponent field below 7 (|value| < 1 at scale 1).
            let codes: Vec<u8> = (0..tile_len).map(|_| (next() >> 40) as u8 & 0xb7).collect();
            let tile = self.dev.upload(&codes)?;
            for (k, v) in fp8.layers.iter_mut() {
                for buf in [k, v] {
                    tile_copy(&stream, &tile, buf)?;
                }
            }
        } else {
            let values: Vec<bf16> =
                (0..tile_len).map(|_| bf16::from_f32((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)).collect();
            let tile = self.dev.upload(&values)?;
            for (k, v) in self.kv.iter_mut() {
                for buf in [k, v] {
                    tile_copy(&stream, &tile, buf)?;
                }
            }
        }
        Ok(self.dev.synchronize()?)
    }

    /// Elements per block of one layer's K (or V), after checking every block id is in the pool.
    pub(super) fn kv_block_len(&self, blocks: &[u32]) -> Result<usize, BackendError> {
        let geo = self.geo()?;
        if let Some(bad) = blocks.iter().find(|&&b| b as usize >= geo.num_blocks) {
            return Err(kerr("kv_blocks", format!("block {bad} is outside the pool of {}", geo.num_blocks)));
        }
        Ok(geo.block_size * geo.n_kv_heads * geo.head_dim)
    }
}

/// Copies `tile` over `buf` repeatedly until `buf` is full (the last copy may be partial).
fn tile_copy<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    tile: &CudaSlice<T>,
    buf: &mut CudaSlice<T>,
) -> Result<(), BackendError> {
    let mut off = 0;
    while off < buf.len() {
        let len = tile.len().min(buf.len() - off);
        let mut dst = buf.slice_mut(off..off + len);
        stream.memcpy_dtod(&tile.slice(..len), &mut dst).map_err(CudaError::from)?;
        off += len;
    }
    Ok(())
}
