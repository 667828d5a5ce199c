//! The CUDA backend's launch switches, statistics and step profiler: what benchmarks and tests
//! turn and read; and the one switch the backend turns itself, each step's carve-out. Every
//! switch keeps the results (bit for bit, or within the rounding its doc names) and only moves
//! timing; one that changes recorded launches drops the graphs.

use super::CudaBackend;
use crate::backend::{BackendError, BatchLayout};
use baton_kernels::cuda::{CarveoutPolicy, CudaDevice, CudaError, DecodeShape, KvGeometry, step_carveout};

impl CudaBackend {
    /// Sends small-batch GEMMs to the skinny-GEMM kernel (`true`, the default) or every GEMM
    /// to cuBLAS (`false`: for benchmarks and comparisons).
    pub fn set_gemv(&mut self, on: bool) {
        self.gemv = on;
    }

    /// Fuses the gated MLP's activation into the skinny GEMM where it applies (`true`, the
    /// default) or runs the product and the activation kernel (`false`: for benchmarks and
    /// comparisons; the outputs are the same bits). Drops recorded graphs.
    pub fn set_fused_gate(&mut self, on: bool) {
        self.fuse_gate = on;
        self.drop_graphs();
    }

    /// Fuses the RMSNorm between two residual branches into the skinny GEMMs on either side
    /// where it applies, and has it quantize its rows for a W8A8 projection at prefill (`true`,
    /// the default), or runs the projection, the norm and the next projection (`false`: for
    /// benchmarks and comparisons). Drops recorded graphs.
    pub fn set_fused_norm(&mut self, on: bool) {
        self.fuse_norm = on;
        self.drop_graphs();
    }

    /// Which of a MoE layer's two norms the fused norm (`set_fused_norm`) takes into the
    /// products around it (`None`, the default: neither): for comparisons. Drops recorded
    /// graphs.
    pub fn set_moe_norm_fusion(&mut self, fusion: Option<super::MoeNormFusion>) {
        self.moe_norm_fusion = fusion;
        self.drop_graphs();
    }

    /// Rotates q and k and writes the KV cache in the epilogue of a fused boundary's qkv
    /// product (`true`, the default) or in the RoPE kernel after it (`false`: for benchmarks and
    /// comparisons; the same bits either way). Drops recorded graphs.
    pub fn set_fused_rope(&mut self, on: bool) {
        self.fuse_rope = on;
        self.rope_epilogue_seen = false;
        self.drop_graphs();
    }

    /// Lets the default decode attention take the streaming kernel (`true`, the default on
    /// sm_90) or keeps it on the tensor-core kernel
    /// ([`baton_kernels::cuda::CudaDevice::set_stream_attention`]; for comparisons). Drops
    /// recorded graphs.
    pub fn set_stream_attention(&mut self, on: bool) {
        self.device().set_stream_attention(on);
        self.drop_graphs();
    }

    /// Sets the carve-out of the step about to run from its padded shape
    /// ([`baton_kernels::cuda::step_carveout`]; ignored under a fixed policy), on models whose
    /// qkv product carries RoPE in its epilogue (the Llama family; FP8 Qwen2) only: where RoPE is
    /// a kernel of its own (q/k norms: Qwen3, Qwen3-MoE, Gemma 3; bf16 Qwen2's bias) the pin
    /// measured mixed (H200, session 26, call E: Qwen3-8B 4 × 1k +2.3 %, Qwen2.5-7B 4 × 1k
    /// +1.6 %, Qwen3-30B-A3B one row +0.6 to +1.2 %, though Gemma-3-12B one row −4.5 %), not
    /// explained. That is known once a decode step ran the epilogue (layer 1 of the first
    /// one), as are the heads (the first attention): until then no pin is set, and a step's
    /// first launches run under the previous step's pins, a matter of timing only (a graph's
    /// attention runs its key's splits whatever the pins).
    pub(super) fn set_step_carveout(&self, batch: &BatchLayout, geo: KvGeometry) {
        let pin = self.graphs.n_heads.filter(|_| self.rope_epilogue_seen).and_then(|n_heads| {
            let shape = DecodeShape {
                rows: batch.tokens.len(),
                n_heads,
                n_kv_heads: geo.n_kv_heads,
                head_dim: geo.head_dim,
                fp8: self.fp8.is_some(),
            };
            let decode_only = batch.seqs.iter().all(|s| s.n_tokens == 1);
            step_carveout(&shape, self.dev.stream_attention(), decode_only)
        });
        self.dev.set_step_carveout(pin);
    }

    /// How the kernel launches get their shared-memory carve-out: per step from its shape
    /// (the default, `baton_kernels::cuda::step_carveout`) or fixed pins
    /// ([`baton_kernels::cuda::CudaDevice::set_carveout_policy`]; for comparisons, the same bits
    /// either way, except that attention's splits planned in a pinned share change the split
    /// count and so the f32 sums' grouping). Drops recorded graphs.
    pub fn set_carveout_policy(&mut self, policy: CarveoutPolicy) {
        self.device().set_carveout_policy(policy);
        self.drop_graphs();
    }

    /// Sets the rows from which RoPE + KV-write launches group several heads into a CTA
    /// ([`baton_kernels::cuda::CudaDevice::set_rope_grouped_min_rows`]; for comparisons, the
    /// same bits either way). Drops recorded graphs.
    pub fn set_rope_grouped_min_rows(&mut self, rows: usize) {
        self.device().set_rope_grouped_min_rows(rows);
        self.drop_graphs();
    }

    /// Runs cuBLASLt's FP8 products with fast accumulation (the default) or not
    /// ([`baton_kernels::cuda::CudaDevice::set_lt_fp8_fast_accum`]; for comparisons). Drops
    /// recorded graphs.
    pub fn set_lt_fp8_fast_accum(&mut self, on: bool) -> Result<(), BackendError> {
        self.device().set_lt_fp8_fast_accum(on)?;
        self.drop_graphs();
        Ok(())
    }

    /// Which cuBLASLt configurations each product shape is timed over
    /// ([`baton_kernels::cuda::CudaDevice::set_lt_search`]; for comparisons). Every shape is
    /// timed again at its next eager call; drops recorded graphs.
    pub fn set_lt_search(&mut self, search: baton_kernels::cuda::LtSearch) -> Result<(), BackendError> {
        self.device().set_lt_search(search)?;
        self.drop_graphs();
        Ok(())
    }

    /// Times cuBLASLt's candidates behind an L2 flush or not
    /// ([`baton_kernels::cuda::CudaDevice::set_lt_flushed_timing`]; for comparisons). Every
    /// shape is timed again at its next eager call; drops recorded graphs.
    pub fn set_lt_flushed_timing(&mut self, on: bool) -> Result<(), BackendError> {
        self.device().set_lt_flushed_timing(on)?;
        self.drop_graphs();
        Ok(())
    }

    /// Whether FP8 products past the skinny kernel run on cuBLASLt's FP8 GEMM (W8A8): true until
    /// cuBLASLt refuses one (then they dequantize, see `linear_fp8`).
    pub fn w8a8_active(&self) -> bool {
        self.w8a8
    }

    /// How many W8A8 products so far took their input's per-token codes from the op that wrote
    /// it (SiLU·mul quantizing for the down projection) instead of quantizing it themselves.
    pub fn w8a8_handoffs(&self) -> u64 {
        self.handoffs
    }

    /// How many ops so far ran with their norms fused into the products around them
    /// (`set_fused_norm`): `(dense branch boundaries, MoE branches)`
    /// ([`Backend::branch_boundary`](crate::backend::Backend::branch_boundary),
    /// [`Backend::moe_branch`](crate::backend::Backend::moe_branch)). Counted at launch on the
    /// host, so a replayed graph counts once, when it was captured.
    pub fn norm_fusions(&self) -> (u64, u64) {
        self.norm_fusions
    }

    /// How many FP8 skinny products so far were launched with the next op in their epilogue
    /// instead of storing their rows for it: `(gated activation, RoPE + the KV write)`. Counted
    /// at launch on the host, so a replayed graph counts once, when it was captured.
    pub fn fp8_fused_epilogues(&self) -> (u64, u64) {
        (self.fp8_gated_epilogues, self.fp8_rope_epilogues)
    }

    /// Sends prefill chunks to the tensor-core prefill kernel (`true`, the default) or every
    /// attention row to the decode kernel (`false`: for benchmarks and comparisons).
    pub fn set_prefill_kernel(&mut self, on: bool) {
        self.prefill_kernel = on;
    }

    /// Sends the prefill chunks of a shape it computes to the warpgroup-MMA prefill kernel
    /// (`true`, the default on Hopper) or to the mma.sync one (`false`: for comparisons); see
    /// `CudaDevice::set_prefill_wgmma`. Drops recorded graphs.
    pub fn set_prefill_wgmma(&mut self, on: bool) {
        self.dev.set_prefill_wgmma(on);
        self.drop_graphs();
    }

    /// Whether the warpgroup-MMA prefill kernel can run on this device.
    pub fn prefill_wgmma_capable(&self) -> bool {
        self.dev.prefill_wgmma_capable()
    }

    /// Starts profiling the ops enqueued from now on: a spin of `spin_ns` nanoseconds goes
    /// first, so the host can queue the whole step behind it and its kernels then run back
    /// to back (as from a graph); every [`Backend::mark`] records an event. Profile eager
    /// steps only (graphs off).
    pub fn profile_begin(&mut self, spin_ns: u64) -> Result<(), BackendError> {
        self.dev.spin(spin_ns)?;
        self.profile = Some(Vec::new());
        Ok(())
    }

    /// Ends the profile: waits for the device and returns, for each mark, its label and the
    /// milliseconds until the next mark (the last mark closes the profile and gets none).
    pub fn profile_end(&mut self) -> Result<Vec<(&'static str, f64)>, BackendError> {
        let events = self.profile.take().unwrap_or_default();
        self.dev.synchronize()?;
        let mut out = Vec::with_capacity(events.len());
        for w in events.windows(2) {
            let ms = w[0].1.elapsed_ms(&w[1].1).map_err(|e| BackendError::from(CudaError::from(e)))?;
            out.push((w[0].0, f64::from(ms)));
        }
        Ok(out)
    }

    /// The underlying device (for tests and benchmarks).
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }
}
