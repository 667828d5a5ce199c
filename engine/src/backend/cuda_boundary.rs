//! The CUDA backend's branch boundary ([`Backend::branch_boundary`]): for decode-sized batches
//! over bf16 weights, two skinny-GEMM launches instead of three ops. The ending projection adds
//! its output to the residual stream in its epilogue and leaves each row's per-CTA sums of
//! squares in `norm_stats` ([`ResidualLinearCall`]); the next projection normalizes the
//! residual on its loads ([`NormLinearCall`]), so the RMSNorm kernel's launch goes.
//!
//! Invariants: the fused route updates `residual` exactly as the unfused one (the same bf16
//! rounding of the projection, the same f32 add) and its `out` differs only where the row's
//! `1 / rms`, summed in another order, lands on the other side of a bf16 rounding; every case
//! it does not cover (more rows than the skinny GEMM takes, FP8 weights, a bias on the ending
//! projection, a GELU gate, the switch off) runs [`branch_boundary_unfused`], except one:
//! decode-sized FP8 boundaries stay unfused on purpose (the same fusion in the FP8 skinny GEMM,
//! c686c61..00d922e, reverted, made Llama-3.1-8B's b = 1 step 3.5–16 % slower and b = 8 up to
//! 71 %; BENCHMARKS.md, session 16; so did storing the norm from the FP8 residual product's
//! last CTA, d37392f, reverted: +1-9 %, session 24): there the norm stays a kernel, and only
//! the qkv product takes the RoPE and KV write in the FP8 skinny GEMM's epilogue
//! ([`Fp8RopeGemvCall`], the same bits as the product + RoPE kernel). A prefill-sized boundary into an FP8 per-token
//! (W8A8) projection has the norm kernel quantize its rows for the FP8 GEMM
//! ([`AddRmsNormQuantCall`]) instead of storing them for the quantization kernel to re-read:
//! the same codes, so the same bits. Its gated activation likewise quantizes its rows for the
//! W8A8 down projection that reads them next ([`SiluMulQuantCall`], `BranchBoundary::then`):
//! the codes wait in `fp8_act`, tagged with the activation buffer ([`ActCodes`]), and that
//! product takes them instead of quantizing the stored rows again (`linear_fp8`).

use super::{ActCodes, CudaBackend, CudaBuf, CudaMat, CudaRes, arch_ops, gemv_applies, kerr, record_mark};
use crate::backend::{
    Backend, BackendError, BoundaryRope, BoundaryScratch, BranchBoundary, Gate, GateAct, branch_boundary_unfused,
    check_boundary, end_branch_and_norm, gate_activation, rope_after,
};
use baton_kernels::cuda::{
    AddRmsNormQuantCall, BiasAddCall, CudaError, CudaSlice, Fp8RopeGemvCall, Fp8W8A8QuantizedCall, GEMV_KERNEL_MAX_M,
    NormInput, NormLinearCall, NormLinearOut, NormRopeCall, ResidualLinearCall, RopeCache, RopeOut, SiluMulQuantCall,
    W8A8_MIN_M, norm_quant_supports, norm_rope_supports, norm_stat_parts, w8a8_supports,
};

impl CudaBackend {
    /// [`Backend::branch_boundary`] on this device.
    pub(super) fn branch_boundary_cuda(
        &mut self,
        mut s: BranchBoundary<'_, Self>,
        residual: &mut CudaRes,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        check_boundary(&s)?;
        // Every route but the RoPE epilogue's runs the RoPE + KV write after the product.
        let rope = s.rope.take();
        let (m, width) = (s.m, s.w.rows);
        let kind = match s.gate {
            None => Some(NormLinearOut::Plain { n: s.next.rows }),
            Some(g) if g.act == GateAct::Silu && s.next.rows == 2 * g.d && self.fuse_gate => {
                Some(NormLinearOut::GatedSilu { d: g.d })
            }
            Some(_) => None,
        };
        let fusable = self.fuse_norm
            && s.bias.is_none()
            && s.w.fp8.is_none()
            && s.next.fp8.is_none()
            && s.next.cols == width
            && gemv_applies(self.gemv, m, s.w.cols)
            && gemv_applies(self.gemv, m, width);
        let Some(kind) = kind.filter(|_| fusable) else {
            if self.w8a8_input_fusable(&s) {
                self.branch_boundary_w8a8(s, residual, scratch, out)?;
                return rope.map_or(Ok(()), |r| rope_after(self, r, out));
            }
            return match rope {
                Some(r) if self.fp8_rope_takes(&s, &r)? => self.branch_boundary_fp8_rope(s, residual, scratch, r),
                rope => {
                    branch_boundary_unfused(self, s, residual, scratch, out)?;
                    rope.map_or(Ok(()), |r| rope_after(self, r, out))
                }
            };
        };
        check_shapes(&s, residual)?;
        // The RoPE epilogue's, or the one run after the product.
        let (epilogue_rope, rope) = match rope {
            Some(r) if matches!(kind, NormLinearOut::Plain { .. }) && self.rope_epilogue_takes(&s, &r)? => {
                (Some(r), None)
            }
            other => (None, other),
        };
        let cols = match kind {
            NormLinearOut::Plain { n } => n,
            NormLinearOut::GatedSilu { d } => d,
        };
        // The bias left for its own kernel: none where the RoPE epilogue adds it.
        let bias_after = s.next_bias.filter(|_| epilogue_rope.is_none());
        if let Some(b) = s.next_bias.filter(|b| b.len != cols) {
            return Err(kerr("branch_boundary", format!("bias has {} values for {cols} outputs", b.len)));
        }
        let mut stats = self.take_norm_stats(width)?;
        self.ensure(out, m * cols)?;
        record_mark(&self.dev, &mut self.profile, s.labels.0);
        let end = ResidualLinearCall {
            x: &s.x.data,
            m,
            k: s.w.cols,
            w: &s.w.data,
            n: width,
            residual: &mut residual.data,
            stats: &mut stats,
            variant: None,
        };
        let launched = end.launch(&self.dev).map_err(BackendError::from).and_then(|()| {
            record_mark(&self.dev, &mut self.profile, s.labels.1);
            if let Some(r) = epilogue_rope {
                return self.norm_rope(&s, residual, &stats, r);
            }
            let next = NormLinearCall {
                input: NormInput { residual: &residual.data, stats: &stats, norm: &s.norm.data, eps: s.eps },
                m,
                k: width,
                w: &s.next.data,
                kind,
                out: &mut out.data,
                variant: None,
            };
            Ok(next.launch(&self.dev)?)
        });
        self.norm_stats = Some(stats);
        launched?;
        self.norm_fusions.0 += 1;
        // (No bias and no rope left when the epilogue took the RoPE.)
        if let Some(b) = bias_after {
            BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n: cols }.launch(&self.dev)?;
        }
        rope.map_or(Ok(()), |r| rope_after(self, r, out))
    }

    /// The fused norm's sums of squares for a residual `width` wide, taken from the backend
    /// (put back after the launches): sized once for the most rows a skinny GEMM takes, so a
    /// recorded graph's pointer stays.
    pub(super) fn take_norm_stats(&mut self, width: usize) -> Result<CudaSlice<f32>, BackendError> {
        let need = GEMV_KERNEL_MAX_M * norm_stat_parts(width);
        Ok(match self.norm_stats.take() {
            Some(b) if b.len() >= need => b,
            _ => self.dev.alloc(need)?,
        })
    }

    /// Whether the qkv product of a boundary also takes `r`'s RoPE and KV write in its epilogue
    /// ([`NormRopeCall`], [`Fp8RopeGemvCall`]): the switch on, no qkv bias (over FP8 weights, a
    /// bias of the projection's rows), the full rotation and no q/k norm
    /// (a [`BoundaryRope`] never carries one), a head the kernel takes, the projection exactly
    /// `[q; k; v]` of the cache's heads, and no FP8 scale calibration pending for the layer
    /// (that pass reads the rotated rows first). Builds the step's metadata.
    fn rope_epilogue_takes(
        &mut self,
        s: &BranchBoundary<'_, Self>,
        r: &BoundaryRope<'_, Self>,
    ) -> Result<bool, BackendError> {
        // A qkv bias (Qwen2) rides in the epilogue over FP8 weights only: over bf16 weights the
        // epilogue with the bias made Qwen2.5-7B's b = 4-8 steps 1-3 % slower than the product +
        // bias + RoPE kernels (1.5 % faster at b = 1; H200, bench-cuda-rope-bias-call{D,E}-*),
        // over FP8 weights 1.4-2 % faster at b = 1 and 8 (call D). Not explained.
        let bias_rides = match s.next_bias {
            None => true,
            Some(b) => s.next.fp8.is_some() && b.len == s.next.rows,
        };
        if !self.fuse_rope || !bias_rides || r.batch.tokens.len() != s.m {
            return Ok(false);
        }
        let geo = self.geo()?;
        let (hd, kvw) = (geo.head_dim, geo.n_kv_heads * geo.head_dim);
        let calibrating = self.fp8.as_ref().is_some_and(|f| f.calibrate.get(r.layer).copied().unwrap_or(false));
        let takes = norm_rope_supports(hd)
            && self.rotary_dim.is_none_or(|d| d == hd)
            && r.widths == (r.n_heads * hd, kvw, kvw)
            && s.next.rows == r.n_heads * hd + 2 * kvw
            && !calibrating;
        if takes {
            self.rope_epilogue_seen = true;
            self.step_meta(r.batch)?;
        }
        Ok(takes)
    }

    /// The qkv product with RoPE and the KV write in its epilogue: rotated q into `r.q`, k and v
    /// into layer `r.layer`'s cache (bf16, or FP8 with the layer's scales).
    fn norm_rope(
        &mut self,
        s: &BranchBoundary<'_, Self>,
        residual: &CudaRes,
        stats: &CudaSlice<f32>,
        r: BoundaryRope<'_, Self>,
    ) -> Result<(), BackendError> {
        let input = NormInput { residual: &residual.data, stats, norm: &s.norm.data, eps: s.eps };
        let (m, k, w) = (s.m, s.w.rows, &s.next.data);
        self.launch_rope_epilogue(r, m, s.next_bias, |dev, rope| {
            NormRopeCall { input, m, k, w, rope, variant: None }.launch(dev)
        })
    }

    /// Where `r`'s RoPE epilogue writes for `m` rows ([`RopeOut`]: `r.q`, sized here, and layer
    /// `r.layer`'s cache, bf16 or FP8 with the layer's scales), with the qkv `bias` it adds,
    /// handed to `launch` with the device.
    fn launch_rope_epilogue(
        &mut self,
        r: BoundaryRope<'_, Self>,
        m: usize,
        bias: Option<&CudaBuf>,
        launch: impl FnOnce(&baton_kernels::cuda::CudaDevice, RopeOut<'_>) -> Result<(), CudaError>,
    ) -> Result<(), BackendError> {
        let geo = self.geo()?;
        self.ensure(r.q, m * r.widths.0)?;
        let inv_freq = arch_ops::inv_freq_for(&self.arch, self.inv_freq.as_ref(), r.layer)?;
        let missing = || BackendError::Device(format!("layer {} has no KV cache", r.layer));
        let cache = match self.fp8.as_mut() {
            Some(fp8) => {
                let scale = *fp8.scales.get(r.layer).ok_or_else(missing)?;
                let k_shift = fp8.k_shift.get(r.layer).and_then(|(_, d)| d.as_ref());
                let (k, v) = fp8.layers.get_mut(r.layer).ok_or_else(missing)?;
                RopeCache::Fp8 { k, v, k_scale: scale.k, v_scale: scale.v, k_shift }
            }
            None => {
                let (k, v) = self.kv.get_mut(r.layer).ok_or_else(missing)?;
                RopeCache::Bf16 { k, v }
            }
        };
        let rope = RopeOut {
            n_heads: r.n_heads,
            q_out: &mut r.q.data,
            cache,
            meta: &self.meta,
            inv_freq,
            bias: bias.map(|b| &b.data),
            attention_factor: self.rope_attention_factor,
            geo,
        };
        Ok(launch(&self.dev, rope)?)
    }

    /// Whether the unfused boundary into an FP8 qkv projection takes `r`'s RoPE and KV write in
    /// the FP8 skinny GEMM's epilogue ([`Fp8RopeGemvCall`]): the product is the skinny kernel's
    /// (as `linear_fp8` would route it), ungated, and [`Self::rope_epilogue_takes`] holds.
    fn fp8_rope_takes(
        &mut self,
        s: &BranchBoundary<'_, Self>,
        r: &BoundaryRope<'_, Self>,
    ) -> Result<bool, BackendError> {
        match &s.next.fp8 {
            Some(f) if s.gate.is_none() && self.fp8_skinny_takes(f, s.m) => self.rope_epilogue_takes(s, r),
            _ => Ok(false),
        }
    }

    /// The unfused boundary's three ops with the last one, the FP8 qkv product, taking the RoPE
    /// and KV write in its epilogue: the ending projection, the residual add + norm into
    /// `scratch.hidden`, then [`Fp8RopeGemvCall`] (`out` is not written: the qkv rows are never
    /// stored).
    fn branch_boundary_fp8_rope(
        &mut self,
        s: BranchBoundary<'_, Self>,
        residual: &mut CudaRes,
        scratch: BoundaryScratch<'_, Self>,
        r: BoundaryRope<'_, Self>,
    ) -> Result<(), BackendError> {
        let Some(f) = s.next.fp8.as_ref() else {
            return Err(kerr("branch_boundary", "the RoPE epilogue over FP8 weights needs an FP8 qkv matrix".into()));
        };
        end_branch_and_norm(self, &s, residual, scratch.proj, scratch.hidden)?;
        let (x, m, w) = (&scratch.hidden.data, s.m, &f.w);
        self.launch_rope_epilogue(r, m, s.next_bias, |dev, rope| {
            Fp8RopeGemvCall { x, m, w, rope, variant: None }.launch(dev)
        })?;
        self.fp8_rope_epilogues += 1;
        Ok(())
    }

    /// Whether a prefill-sized boundary into an FP8 per-token (W8A8) projection takes the add +
    /// norm + quantization kernel ([`AddRmsNormQuantCall`]): the batch past the skinny kernel,
    /// cuBLASLt's FP8 GEMM in use, and a row the kernel holds.
    fn w8a8_input_fusable(&self, s: &BranchBoundary<'_, Self>) -> bool {
        let Some(f) = &s.next.fp8 else { return false };
        self.fuse_norm
            && self.w8a8
            && f.per_token
            && s.m >= W8A8_MIN_M
            && s.next.cols == s.w.rows
            && norm_quant_supports(s.w.rows)
            && w8a8_supports(&self.dev, &f.w)
            && !(s.gate.is_some() && s.next_bias.is_some())
    }

    /// The boundary of a prefill-sized batch into a W8A8 projection: the ending projection as
    /// [`Backend::linear`] runs it, then the residual add and the norm with the normalized rows
    /// quantized per token in the same kernel (the bf16 rows are never stored nor re-read), then
    /// cuBLASLt's FP8 GEMM on those codes (and, gated, the activation kernel). The codes and
    /// scales are the ones `linear_fp8` would make from the stored rows, so `out` is the same
    /// bits. Where cuBLASLt refuses the FP8 GEMM, W8A8 is switched off (as `linear_fp8` does)
    /// and the norm is recomputed from the updated residual into `hidden` for the fallback.
    fn branch_boundary_w8a8(
        &mut self,
        s: BranchBoundary<'_, Self>,
        residual: &mut CudaRes,
        scratch: BoundaryScratch<'_, Self>,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let (m, width) = (s.m, s.w.rows);
        let Some(next) = s.next.fp8.as_ref() else { return branch_boundary_unfused(self, s, residual, scratch, out) };
        let n = next.w.rows;
        // Every check before anything is enqueued.
        check_shapes(&s, residual)?;
        match (s.gate, s.next_bias) {
            (Some(g), _) if n != 2 * g.d => {
                return Err(kerr("branch_boundary", format!("{n} gated rows for an intermediate size of {}", g.d)));
            }
            (None, Some(b)) if b.len != n => {
                return Err(kerr("branch_boundary", format!("bias has {} values for {n} outputs", b.len)));
            }
            _ => {}
        }
        record_mark(&self.dev, &mut self.profile, s.labels.0);
        self.linear(s.x, m, s.w, s.bias, scratch.proj)?;
        let (mut xq, mut xs) = self.take_fp8_act(m, width)?;
        // The GEMM's output: `out`, or the `[gate | up]` scratch before the activation.
        let dst = if s.gate.is_some() { &mut *scratch.gate_up } else { &mut *out };
        self.ensure(dst, m * n)?;
        record_mark(&self.dev, &mut self.profile, "norm");
        let norm = AddRmsNormQuantCall {
            residual: &mut residual.data,
            x: &scratch.proj.data,
            weight: &s.norm.data,
            rows: m,
            dim: width,
            eps: s.eps,
            codes: &mut xq,
            scales: &mut xs,
        };
        let product = norm.launch(&self.dev).and_then(|()| {
            record_mark(&self.dev, &mut self.profile, s.labels.1);
            Fp8W8A8QuantizedCall { xq: &xq, xs: &xs, m, w: &next.w, out: &mut dst.data }.launch(&self.dev)
        });
        self.fp8_act = Some((xq, xs));
        match product {
            Ok(()) => {}
            Err(CudaError::BlasLt(message)) => {
                // Nothing of the GEMM was enqueued; the residual holds the sum already.
                tracing::warn!(%message, "cuBLASLt refused the FP8 (W8A8) GEMM: dequantizing instead from now on");
                self.w8a8 = false;
                self.rms_norm(residual, s.norm, s.eps, scratch.hidden)?;
                return match s.gate {
                    None => self.linear(scratch.hidden, m, s.next, s.next_bias, out),
                    Some(gate) => self.gated_linear(scratch.hidden, m, s.next, gate, scratch.gate_up, out),
                };
            }
            Err(e) => return Err(e.into()),
        }
        match s.gate {
            None => match s.next_bias {
                Some(b) => Ok(BiasAddCall { x: &mut out.data, bias: &b.data, rows: m, n }.launch(&self.dev)?),
                None => Ok(()),
            },
            Some(g) if s.then.is_some_and(|d| self.w8a8_takes_gated(d, g)) => {
                // The activation kernel also quantizes its rows for the down projection that
                // reads them next (`BranchBoundary::then`), which then skips its quantization.
                record_mark(&self.dev, &mut self.profile, "silu_mul");
                self.ensure(out, m * g.d)?;
                let (mut xq, mut xs) = self.take_fp8_act(m, g.d)?;
                let call = SiluMulQuantCall {
                    gate_up: &scratch.gate_up.data,
                    m,
                    d: g.d,
                    act: &mut out.data,
                    codes: &mut xq,
                    scales: &mut xs,
                };
                let launched = call.launch(&self.dev);
                self.fp8_act = Some((xq, xs));
                launched?;
                self.act_codes = Some(ActCodes::of(out, m, g.d));
                Ok(())
            }
            Some(g) => gate_activation(self, g, scratch.gate_up, out),
        }
    }

    /// Whether the W8A8 boundary's activation kernel quantizes its rows for `down`: a SiLU gate,
    /// and `down` a per-token FP8 matrix of `g.d` columns that cuBLASLt's FP8 GEMM takes.
    fn w8a8_takes_gated(&self, down: &CudaMat, g: Gate) -> bool {
        let Some(f) = &down.fp8 else { return false };
        self.w8a8
            && g.act == GateAct::Silu
            && f.per_token
            && down.cols == g.d
            && g.d.is_multiple_of(8)
            && w8a8_supports(&self.dev, &f.w)
    }
}

/// The shapes both fused routes need before anything is enqueued: `x` holds `m` rows of the
/// ending projection's input, the residual exactly `m` rows of its output.
fn check_shapes(s: &BranchBoundary<'_, CudaBackend>, residual: &CudaRes) -> Result<(), BackendError> {
    let (m, width) = (s.m, s.w.rows);
    if s.x.len < m * s.w.cols || residual.len != m * width {
        let message = format!("x {}, residual {} for {m} rows of {}→{width}", s.x.len, residual.len, s.w.cols);
        return Err(kerr("branch_boundary", message));
    }
    Ok(())
}
