//! The skinny FP8 (W8A16) GEMM with the decode step's next op in its epilogue: the gated MLP
//! projection with its activation ([`Fp8GatedGemvCall`]) and the qkv projection with RoPE and
//! the KV write ([`Fp8RopeGemvCall`]). Each is one launch where the FP8 path had two: the plain
//! product ([`Fp8GemvCall`](super::Fp8GemvCall)) storing its rows, then the activation kernel or
//! RoPE + KV write kernel reading them back.
//!
//! Invariants: each writes bit for bit what the two launches store (gemv_fp8.cu scales each sum
//! by its own weight row's scale and rounds it to bf16 as the plain product stores it, then
//! applies the activation kernel's or the RoPE kernel's own formula); the variant is the plain
//! product's for the same matrix; every check is made before anything is enqueued. x is bf16:
//! the norm before these products stays a kernel of its own.

use super::fp8_linear::{Fp8Epilogue, Fp8Weights, fp8_gemv_plan};
use super::gemv::GEMV_ROWS_PER_CTA;
use super::launch::{Args, need, shape_check};
use super::norm_rope::RopeOut;
use super::{CudaDevice, CudaError, CudaSlice, GatedAct};
use half::bf16;

/// `out = act(x · W_gateᵀ) · (x · W_upᵀ)` over an FP8 `[gate; up]` matrix (`2d × k`).
pub struct Fp8GatedGemvCall<'a> {
    /// `m × k` bf16.
    pub x: &'a CudaSlice<bf16>,
    /// Rows of x (as [`Fp8GemvCall`](super::Fp8GemvCall) takes them).
    pub m: usize,
    /// The `[gate; up]` weights, `2d` rows.
    pub w: &'a Fp8Weights,
    /// The intermediate size: columns of the output.
    pub d: usize,
    /// The activation on the gate.
    pub act: GatedAct,
    /// `m × d` bf16.
    pub out: &'a mut CudaSlice<bf16>,
    /// Index in [`GEMV_FP8_VARIANTS`](super::GEMV_FP8_VARIANTS), or `None` for the plain
    /// product's default.
    pub variant: Option<usize>,
}

impl Fp8GatedGemvCall<'_> {
    /// Checks the shapes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "gated_gemv_fp8";
        let Self { x, m, w, d, act, out, variant } = self;
        shape_check(OP, w.rows == 2 * d, || format!("{} weight rows for an intermediate size of {d}", w.rows))?;
        let epilogue = match act {
            GatedAct::Silu => Fp8Epilogue::Silu,
            GatedAct::GeluTanh => Fp8Epilogue::GeluTanh,
        };
        // A tile is 8 gate rows and their 8 up rows.
        let plan = fp8_gemv_plan(dev, OP, x, m, w, epilogue, d.div_ceil(GEMV_ROWS_PER_CTA / 2), variant)?;
        need(OP, "out", out, m * d)?;
        let Some(plan) = plan else { return Ok(()) };
        let args = plan.tail(Args::new(OP).buf(x).buf(&w.codes).buf(&w.scales).buf(out), m, d, w)?;
        // SAFETY: tile j reads gate rows 8j.. (clamped to d - 1) and the up rows d + those, over k
        // codes, their scales, and rows of x clamped to m - 1; it writes out[i][c] for i < m,
        // c < d only: all sizes checked above (k % 16 == 0: 16-byte code rows).
        unsafe { args.launch(dev, plan.func, plan.grid) }
    }
}

/// `qkv = x · W_dqᵀ` over the FP8 `[q; k; v]` matrix, then RoPE on q and k at each row's
/// position, written as [`RopeOut`] says; the qkv rows are never stored.
pub struct Fp8RopeGemvCall<'a> {
    /// `m × k` bf16: the normalized activation.
    pub x: &'a CudaSlice<bf16>,
    /// Rows: the step's rows (`rope.meta`'s).
    pub m: usize,
    /// The fused projection, [`RopeOut::rows`] rows.
    pub w: &'a Fp8Weights,
    /// Where the epilogue writes.
    pub rope: RopeOut<'a>,
    /// Index in [`GEMV_FP8_VARIANTS`](super::GEMV_FP8_VARIANTS), or `None` for the plain
    /// product's default.
    pub variant: Option<usize>,
}

impl Fp8RopeGemvCall<'_> {
    /// Checks the shapes and enqueues the kernel.
    pub fn launch(self, dev: &CudaDevice) -> Result<(), CudaError> {
        const OP: &str = "rope_gemv_fp8";
        let Self { x, m, w, rope, variant } = self;
        let n = rope.rows();
        shape_check(OP, w.rows == n, || format!("{} weight rows for {n} q, k and v rows", w.rows))?;
        let (fp8_cache, scales) = rope.check(OP, m)?;
        let epilogue = if fp8_cache { Fp8Epilogue::RopeFp8 } else { Fp8Epilogue::Rope };
        let Some(plan) = fp8_gemv_plan(dev, OP, x, m, w, epilogue, n / GEMV_ROWS_PER_CTA, variant)? else {
            return Ok(());
        };
        let args = rope.push(Args::new(OP).buf(x).buf(&w.codes).buf(&w.scales), scales)?;
        let args = plan.tail(args, m, n, w)?;
        // SAFETY: n is a multiple of 16 (head_dim is: RopeOut::check), so every tile's 16 weight
        // rows exist; x holds m × k, the codes n × k and their scales (fp8_gemv_plan); q_out,
        // inv_freq and the cache were checked by RopeOut::check, and the metadata has m rows
        // validated against this cache's geometry, so each slot the epilogue writes lies in the
        // layer's cache.
        unsafe { args.launch(dev, plan.func, plan.grid) }
    }
}
