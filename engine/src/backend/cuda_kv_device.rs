//! The CUDA backend's [`KvDeviceAccess`]: its compute stream, new transfer streams, and one
//! layer's K and V caches for a device-to-device KV connector (the NCCL link in
//! `kv_transport::nccl` sends from and receives into them directly, with no staging).

use super::CudaBackend;
use crate::backend::{BackendError, KvDeviceAccess, LayerCache};
use cudarc::driver::CudaStream;
use std::sync::Arc;

impl KvDeviceAccess for CudaBackend {
    fn compute_stream(&self) -> Arc<CudaStream> {
        self.dev.stream().clone()
    }

    fn new_transfer_stream(&self) -> Result<Arc<CudaStream>, BackendError> {
        self.dev
            .stream()
            .context()
            .new_stream()
            .map_err(|e| BackendError::Device(format!("creating a transfer stream: {e}")))
    }

    fn layer_cache(&mut self, layer: usize, runs: &[(usize, usize)]) -> Result<LayerCache<'_>, BackendError> {
        if self.fp8.is_some() {
            // The NCCL link sends bf16 layer slices; FP8 caches go over TCP (host staging).
            return Err(BackendError::Device("the device-to-device KV link does not move an FP8 cache yet".into()));
        }
        if layer >= self.kv.len() {
            return Err(BackendError::Device(format!("layer {layer} has no KV cache")));
        }
        let last: Vec<u32> = runs
            .iter()
            .filter(|r| r.1 > 0)
            .map(|&(s, n)| s.checked_add(n - 1).and_then(|b| u32::try_from(b).ok()).unwrap_or(u32::MAX))
            .collect();
        let block_len = self.kv_block_len(&last)?;
        let (k, v) = &mut self.kv[layer];
        Ok(LayerCache { k, v, block_len })
    }
}
