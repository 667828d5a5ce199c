//! The function handle of every kernel in the compiled module, looked up once when the device
//! opens, so a launch never searches by name.
//!
//! Invariants: [`KernelTable::load`] is the one list of kernel names: the device resolves it
//! against the module (a missing kernel fails `CudaDevice::open`, not a later launch), and
//! [`kernel_names`] runs the same list to check a compiled module offline (`cuda_compile`).
//! The templated kernels are indexed like their descriptions: attention
//! `[ATTN_HEAD_DIMS][ATTN_VARIANTS]`, prefill `[PREFILL_HEAD_DIMS][PREFILL_WARPS]`, gemv
//! `[GEMV_MAX_MS][GEMV_VARIANTS][GemvEpilogue]`, FP8 gemv `[GEMV_MAX_MS][GEMV_FP8_VARIANTS][Fp8Epilogue][Fp8Scaling]`.

use super::CudaError;
use super::attention_ext::ATTN_EXT_MAX_HEAD_DIM;
use super::fp8_linear::{Fp8Epilogue, Fp8Scaling, GEMV_FP8_VARIANTS};
use super::gemv::{GEMV_MAX_MS, GEMV_VARIANTS, GemvEpilogue};
use super::moe_skinny::{MOE_SKINNY_ACTS, MOE_SKINNY_VARIANTS, MoeSkinnyAct};
use super::paged_attention::{
    ATTN_FP8_VARIANTS, ATTN_HEAD_DIMS, ATTN_VARIANTS, AttnKind, AttnVariant, CTA_SMEM_LIMIT, combine_kernel_name,
    fp8_kernel_name, tc_dynamic_smem,
};
use super::prefill::{
    PREFILL_HEAD_DIMS, PREFILL_WARPS, PREFILL_WG_HEAD_DIM, prefill_fp8_kernel_name, prefill_fp8_smem_bytes,
    prefill_kernel_name, prefill_smem_bytes, prefill_wg_kernel_name, prefill_wg_smem_bytes,
};
use super::sources::{Family, KernelNeeds, Module};
use cudarc::driver::CudaFunction;
use cudarc::driver::sys::CUfunction_attribute_enum as FuncAttr;

/// One handle per kernel. `F` is [`CudaFunction`] on a device; [`kernel_names`] instantiates
/// it with `()` to list the names alone.
pub(crate) struct KernelTable<F = CudaFunction> {
    pub embed: F,
    pub rms_norm: F,
    pub add_rms_norm: F,
    /// The add + norm with the normalized rows quantized per token (FP8 W8A8 input).
    pub add_rms_norm_quant: F,
    pub silu_mul: F,
    pub bias_add: F,
    pub bias_add_f32: F,
    pub copy_cols: F,
    pub gather_rows_bf16: F,
    pub gather_rows_f32: F,
    pub bf16_to_f32: F,
    pub f32_to_bf16: F,
    pub rope_write_kv: F,
    pub rope_qkv_write_kv: F,
    pub rope_qknorm_write_kv: F,
    pub rope_qkv_qknorm_write_kv: F,
    /// The four RoPE + KV-write entries above writing an FP8 (E4M3) cache, in that order:
    /// split, fused, split with q/k norm, fused with q/k norm (rope_kv.cu `*_fp8`).
    pub rope_write_kv_fp8: [F; 4],
    /// The same four as FP8 KV scale calibration passes: the stored |k| and |v| maxima of a
    /// step's rows, nothing written (rope_kv.cu `*_amax`).
    pub rope_write_kv_amax: [F; 4],
    pub gelu_tanh_mul: F,
    pub softcap: F,
    pub scale_round: F,
    /// The experts' kernels, where loaded (use [`KernelTable::moe`]).
    pub moe: Option<MoeKernels<F>>,
    /// FP8 weights' kernels, where loaded (use [`KernelTable::fp8`]).
    pub fp8: Option<Fp8Kernels<F>>,
    /// Attention with window / soft-cap / sinks: `[ceil(head_dim / 32) - 1]` (attention_ext.cu).
    pub attention_ext: Vec<F>,
    /// [`Self::attention_ext`] over an FP8 (E4M3) cache: `[ceil(head_dim / 32) - 1]`.
    pub attention_ext_fp8: Vec<F>,
    /// Paged (decode) attention per head_dim of `ATTN_HEAD_DIMS`, where loaded (use
    /// [`KernelTable::attention`]).
    pub attention: Vec<Option<AttentionKernels<F>>>,
    /// Prefill flash attention per head_dim of `PREFILL_HEAD_DIMS`, where loaded (use
    /// [`KernelTable::prefill`]).
    pub prefill: Vec<Option<PrefillKernels<F>>>,
    /// Skinny GEMM: `[up to 8, up to 16 rows of x][variant of GEMV_VARIANTS]`, each
    /// `[epilogue of GemvEpilogue::ALL]`.
    pub gemv: [Vec<Vec<F>>; 2],
    /// Sampling, one CTA per row (sampling.cu).
    pub sample_rows: F,
    /// Sampled tokens into the next step's ids (sampling.cu).
    pub take_sampled_ids: F,
    /// Prompt logprobs, one CTA per row (prompt_logprobs.cu, in the sampling module).
    pub prompt_logprobs: F,
    /// Counter-generated random weights (util.cu): in bf16, and in f32.
    pub fill_counter: F,
    pub fill_counter_f32: F,
    /// A timed wait (util.cu).
    pub spin: F,
}

/// The mixture-of-experts kernels (the `moe` module).
pub(crate) struct MoeKernels<F = CudaFunction> {
    pub route: F,
    pub permute: F,
    pub grouped_gemv: F,
    /// The grouped expert product on the tensor cores (many entries per expert: prefill).
    pub grouped_gemm: F,
    /// Its wide-tiled version (moe_gemm.cu: experts with many entries).
    pub grouped_gemm_wide: F,
    pub unpermute: F,
    /// Routing and permutation in one CTA (decode-sized steps).
    pub route_permute: F,
    /// The grouped product over the experts in use on the tensor cores (moe_skinny.cu):
    /// `[activation of MOE_SKINNY_ACTS][variant of MOE_SKINNY_VARIANTS]`.
    pub skinny: [[F; 2]; 5],
    /// The router GEMV, routing and permutation in one launch (moe_router.cu, decode-sized steps).
    pub router_route_permute: F,
    /// gpt-oss's clamped SwiGLU.
    pub clamped_swiglu: F,
}

/// FP8 weights' kernels (the `fp8` module and the `gemv_fp8_m*` modules).
pub(crate) struct Fp8Kernels<F = CudaFunction> {
    /// FP8 weight dequantization to bf16 (fp8_linear.cu): any shape, and 16 weights a thread.
    pub dequant: F,
    pub dequant16: F,
    /// Per-row E4M3 quantization (fp8_linear.cu): of bf16 activations per token (the W8A8
    /// GEMM's input), and of f32 random weights per channel.
    pub quantize_rows_e4m3: F,
    pub quantize_rows_e4m3_f32: F,
    /// SiLU·mul with its bf16 rows also quantized per token (fp8_linear.cu: the W8A8 down
    /// projection's input).
    pub silu_mul_quant_e4m3: F,
    /// The W8A16 skinny GEMM (gemv_fp8.cu): `[up to 8, up to 16 rows of x per CTA][variant of
    /// GEMV_FP8_VARIANTS][epilogue of Fp8Epilogue::ALL]`, each `[scale of Fp8Scaling::ALL]`.
    pub gemv: [Vec<Vec<[F; 2]>>; 2],
}

/// Decode attention for one head_dim (an `attention_hd*` module).
pub(crate) struct AttentionKernels<F = CudaFunction> {
    /// Over a bf16 cache: `[variant of ATTN_VARIANTS]`.
    pub bf16: Vec<F>,
    /// Over an FP8 cache: `[variant of ATTN_FP8_VARIANTS]`.
    pub fp8: Vec<F>,
    /// The merge of split-attention partials (either cache type).
    pub combine: F,
}

/// Prefill flash attention for one head_dim (a `prefill_hd*` module), each `[variant of
/// PREFILL_WARPS]`.
pub(crate) struct PrefillKernels<F = CudaFunction> {
    pub bf16: Vec<F>,
    /// Over an FP8 cache.
    pub fp8: Vec<F>,
    /// With a window, soft-cap and sinks (`prefill_attention_opt_*`).
    pub bf16_opt: Vec<F>,
    /// Over an FP8 cache with a window, soft-cap and sinks.
    pub fp8_opt: Vec<F>,
    /// The warpgroup-MMA kernel over a bf16 and an FP8 cache (prefill_wg.cu, head_dim 128 only;
    /// its body is compiled for `sm_90a` only, see `CudaDevice::prefill_wgmma`).
    pub wg: Option<[F; 2]>,
}

impl<F> KernelTable<F> {
    /// Resolves the name of every kernel that `needs` loads with `f`, given the module that
    /// defines it.
    pub fn load<E>(needs: &KernelNeeds, mut f: impl FnMut(Module, &str) -> Result<F, E>) -> Result<Self, E> {
        let el = Module::whole(Family::Elementwise);
        let embed = f(el, "embed_f32")?;
        let rms_norm = f(el, "rms_norm_f32")?;
        let add_rms_norm = f(el, "add_rms_norm_f32")?;
        let add_rms_norm_quant = f(el, "add_rms_norm_quant_e4m3")?;
        let silu_mul = f(el, "silu_mul_bf16")?;
        let bias_add = f(el, "bias_add_bf16")?;
        let bias_add_f32 = f(el, "bias_add_f32")?;
        let copy_cols = f(el, "copy_cols_bf16")?;
        let gather_rows_bf16 = f(el, "gather_rows_bf16")?;
        let gather_rows_f32 = f(el, "gather_rows_f32")?;
        let bf16_to_f32 = f(el, "bf16_to_f32")?;
        let f32_to_bf16 = f(el, "f32_to_bf16")?;
        let rope = Module::whole(Family::Rope);
        let rope_write_kv = f(rope, "rope_write_kv_bf16")?;
        let rope_qkv_write_kv = f(rope, "rope_qkv_write_kv_bf16")?;
        let rope_qknorm_write_kv = f(rope, "rope_qknorm_write_kv_bf16")?;
        let rope_qkv_qknorm_write_kv = f(rope, "rope_qkv_qknorm_write_kv_bf16")?;
        let (rope_fp8, rope_amax) = (Module::whole(Family::RopeFp8), Module::whole(Family::RopeAmax));
        let rope_write_kv_fp8 = [
            f(rope_fp8, "rope_write_kv_fp8")?,
            f(rope_fp8, "rope_qkv_write_kv_fp8")?,
            f(rope_fp8, "rope_qknorm_write_kv_fp8")?,
            f(rope_fp8, "rope_qkv_qknorm_write_kv_fp8")?,
        ];
        let rope_write_kv_amax = [
            f(rope_amax, "rope_write_kv_amax")?,
            f(rope_amax, "rope_qkv_write_kv_amax")?,
            f(rope_amax, "rope_qknorm_write_kv_amax")?,
            f(rope_amax, "rope_qkv_qknorm_write_kv_amax")?,
        ];
        let gelu_tanh_mul = f(el, "gelu_tanh_mul_bf16")?;
        let softcap = f(el, "softcap_f32")?;
        let scale_round = f(el, "scale_round_bf16_f32")?;
        let ext = Module::whole(Family::AttentionExt);
        let attention_ext = (1..=ATTN_EXT_MAX_HEAD_DIM / 32)
            .map(|d| f(ext, &format!("paged_attention_ext_d{d}")))
            .collect::<Result<_, _>>()?;
        let attention_ext_fp8 = (1..=ATTN_EXT_MAX_HEAD_DIM / 32)
            .map(|d| f(ext, &format!("paged_attention_ext_fp8_d{d}")))
            .collect::<Result<_, _>>()?;
        let moe_module = Module::whole(Family::Moe);
        let moe = if needs.loads(&moe_module) { Some(MoeKernels::load(moe_module, &mut f)?) } else { None };
        let fp8 = if needs.loads(&Module::whole(Family::Fp8)) { Some(Fp8Kernels::load(&mut f)?) } else { None };
        let mut attention = Vec::with_capacity(ATTN_HEAD_DIMS.len());
        for hd in ATTN_HEAD_DIMS {
            let m = Module::part(Family::Attention, hd);
            attention.push(if needs.loads(&m) { Some(AttentionKernels::load(hd, &mut f)?) } else { None });
        }
        let mut prefill = Vec::with_capacity(PREFILL_HEAD_DIMS.len());
        for hd in PREFILL_HEAD_DIMS {
            let m = Module::part(Family::Prefill, hd);
            prefill.push(if needs.loads(&m) { Some(PrefillKernels::load(hd, &mut f)?) } else { None });
        }
        let mut gemv_for = |max_m: usize| -> Result<Vec<Vec<F>>, E> {
            let mut variants = Vec::with_capacity(GEMV_VARIANTS.len());
            for (i, v) in GEMV_VARIANTS.iter().enumerate() {
                let m = Module::variant(Family::Gemv, max_m, i);
                let funcs = GemvEpilogue::ALL.iter().map(|&e| f(m, &v.kernel_name(max_m, e)));
                variants.push(funcs.collect::<Result<Vec<F>, E>>()?);
            }
            Ok(variants)
        };
        let gemv = [gemv_for(GEMV_MAX_MS[0])?, gemv_for(GEMV_MAX_MS[1])?];
        let sampling = Module::whole(Family::Sampling);
        Ok(Self {
            embed,
            rms_norm,
            add_rms_norm,
            add_rms_norm_quant,
            silu_mul,
            bias_add,
            bias_add_f32,
            copy_cols,
            gather_rows_bf16,
            gather_rows_f32,
            bf16_to_f32,
            f32_to_bf16,
            rope_write_kv,
            rope_qkv_write_kv,
            rope_qknorm_write_kv,
            rope_qkv_qknorm_write_kv,
            rope_write_kv_fp8,
            rope_write_kv_amax,
            gelu_tanh_mul,
            softcap,
            scale_round,
            moe,
            fp8,
            attention_ext,
            attention_ext_fp8,
            attention,
            prefill,
            gemv,
            sample_rows: f(sampling, "sample_rows")?,
            take_sampled_ids: f(sampling, "take_sampled_ids")?,
            prompt_logprobs: f(sampling, "prompt_logprobs")?,
            fill_counter: f(el, "fill_counter_bf16")?,
            fill_counter_f32: f(el, "fill_counter_f32")?,
            spin: f(el, "spin_ns")?,
        })
    }
}

impl<F> MoeKernels<F> {
    fn load<E>(m: Module, f: &mut impl FnMut(Module, &str) -> Result<F, E>) -> Result<Self, E> {
        let mut skinny = |act: MoeSkinnyAct| -> Result<[F; 2], E> {
            Ok([f(m, &act.kernel_name(MOE_SKINNY_VARIANTS[0]))?, f(m, &act.kernel_name(MOE_SKINNY_VARIANTS[1]))?])
        };
        let skinny = [
            skinny(MOE_SKINNY_ACTS[0])?,
            skinny(MOE_SKINNY_ACTS[1])?,
            skinny(MOE_SKINNY_ACTS[2])?,
            skinny(MOE_SKINNY_ACTS[3])?,
            skinny(MOE_SKINNY_ACTS[4])?,
        ];
        Ok(Self {
            route: f(m, "moe_route_f32")?,
            permute: f(m, "moe_permute")?,
            grouped_gemv: f(m, "moe_grouped_gemv_bf16")?,
            grouped_gemm: f(m, "moe_grouped_gemm_bf16")?,
            grouped_gemm_wide: f(m, "moe_grouped_gemm_wide_bf16")?,
            unpermute: f(m, "moe_unpermute_bf16")?,
            route_permute: f(m, "moe_route_permute")?,
            skinny,
            router_route_permute: f(m, "moe_router_route_permute")?,
            clamped_swiglu: f(m, "clamped_swiglu_bf16")?,
        })
    }
}

impl<F> Fp8Kernels<F> {
    fn load<E>(f: &mut impl FnMut(Module, &str) -> Result<F, E>) -> Result<Self, E> {
        let m = Module::whole(Family::Fp8);
        let mut gemv_for = |max_m: usize| -> Result<Vec<Vec<[F; 2]>>, E> {
            let mut variants = Vec::with_capacity(GEMV_FP8_VARIANTS.len());
            for (i, v) in GEMV_FP8_VARIANTS.iter().enumerate() {
                let m = Module::variant(Family::GemvFp8, max_m, i);
                let mut epilogues = Vec::with_capacity(Fp8Epilogue::ALL.len());
                for e in Fp8Epilogue::ALL {
                    let [a, b] = Fp8Scaling::ALL.map(|s| v.fp8_kernel_name(max_m, s, e));
                    epilogues.push([f(m, &a)?, f(m, &b)?]);
                }
                variants.push(epilogues);
            }
            Ok(variants)
        };
        let gemv = [gemv_for(GEMV_MAX_MS[0])?, gemv_for(GEMV_MAX_MS[1])?];
        Ok(Self {
            dequant: f(m, "fp8_dequant_bf16")?,
            dequant16: f(m, "fp8_dequant16_bf16")?,
            quantize_rows_e4m3: f(m, "quantize_rows_e4m3")?,
            quantize_rows_e4m3_f32: f(m, "quantize_rows_e4m3_f32")?,
            silu_mul_quant_e4m3: f(m, "silu_mul_quant_e4m3")?,
            gemv,
        })
    }
}

impl<F> AttentionKernels<F> {
    fn load<E>(hd: usize, f: &mut impl FnMut(Module, &str) -> Result<F, E>) -> Result<Self, E> {
        // The module of each instance line (sources.rs's ATTN_MODULES, in file order).
        let module = |v: &AttnVariant| {
            let line = match (v.kind, v.fp8) {
                (AttnKind::Registers, _) => 0,
                (AttnKind::TensorCore, false) => 1,
                (AttnKind::TensorCore, true) => 2,
                (AttnKind::Stream, _) => 3,
            };
            Module::variant(Family::Attention, hd, line)
        };
        Ok(Self {
            bf16: ATTN_VARIANTS.iter().map(|v| f(module(v), &v.kernel_name(hd))).collect::<Result<_, _>>()?,
            fp8: ATTN_FP8_VARIANTS.iter().map(|v| f(module(v), &fp8_kernel_name(v, hd))).collect::<Result<_, _>>()?,
            combine: f(Module::variant(Family::Attention, hd, 0), &combine_kernel_name(hd))?,
        })
    }
}

impl<F> PrefillKernels<F> {
    fn load<E>(hd: usize, f: &mut impl FnMut(Module, &str) -> Result<F, E>) -> Result<Self, E> {
        // A module per instance line (sources.rs's prefill_modules): one per CTA size, then the
        // warpgroup kernel's.
        let mut each = |fp8: bool, opt: bool| -> Result<Vec<F>, E> {
            PREFILL_WARPS
                .iter()
                .enumerate()
                .map(|(i, &w)| {
                    let name = if fp8 { prefill_fp8_kernel_name(hd, w, opt) } else { prefill_kernel_name(hd, w, opt) };
                    f(Module::variant(Family::Prefill, hd, i), &name)
                })
                .collect()
        };
        let (bf16, fp8, bf16_opt, fp8_opt) =
            (each(false, false)?, each(true, false)?, each(false, true)?, each(true, true)?);
        let wg = if hd == PREFILL_WG_HEAD_DIM {
            let m = Module::variant(Family::Prefill, hd, PREFILL_WARPS.len());
            Some([f(m, &prefill_wg_kernel_name(hd, false))?, f(m, &prefill_wg_kernel_name(hd, true))?])
        } else {
            None
        };
        Ok(Self { bf16, fp8, bf16_opt, fp8_opt, wg })
    }
}

fn not_loaded(module: Module, what: &'static str) -> CudaError {
    CudaError::NotLoaded { module: module.name(), what }
}

impl<F> KernelTable<F> {
    /// The experts' kernels, or [`CudaError::NotLoaded`].
    pub fn moe(&self) -> Result<&MoeKernels<F>, CudaError> {
        self.moe.as_ref().ok_or_else(|| not_loaded(Module::whole(Family::Moe), "experts"))
    }

    /// FP8 weights' kernels, or [`CudaError::NotLoaded`].
    pub fn fp8(&self) -> Result<&Fp8Kernels<F>, CudaError> {
        self.fp8.as_ref().ok_or_else(|| not_loaded(Module::whole(Family::Fp8), "FP8 weights"))
    }

    /// Decode attention for `ATTN_HEAD_DIMS[hd_idx]`, or [`CudaError::NotLoaded`].
    pub fn attention(&self, hd_idx: usize) -> Result<&AttentionKernels<F>, CudaError> {
        self.attention.get(hd_idx).and_then(Option::as_ref).ok_or_else(|| {
            not_loaded(
                Module::part(Family::Attention, ATTN_HEAD_DIMS.get(hd_idx).copied().unwrap_or(0)),
                "this head_dim",
            )
        })
    }

    /// Prefill attention for `PREFILL_HEAD_DIMS[hd_idx]`, or [`CudaError::NotLoaded`].
    pub fn prefill(&self, hd_idx: usize) -> Result<&PrefillKernels<F>, CudaError> {
        self.prefill.get(hd_idx).and_then(Option::as_ref).ok_or_else(|| {
            not_loaded(
                Module::part(Family::Prefill, PREFILL_HEAD_DIMS.get(hd_idx).copied().unwrap_or(0)),
                "this head_dim",
            )
        })
    }
}

impl KernelTable<CudaFunction> {
    /// Sets the attributes some kernels need before their first launch: each prefill kernel's
    /// dynamic shared-memory limit (above the default 48 KiB at head_dim 128) and the largest
    /// shared-memory carve-out (three CTAs of 68 KiB per SM at head_dim 128); likewise for the
    /// decode kernel's tensor-core shapes that take dynamic shared memory (head_dim 256).
    ///
    /// The streaming decode shapes (sm_90 only: `hopper`) may take up to a CTA's limit of
    /// dynamic shared memory ([`CTA_SMEM_LIMIT`]; how much a launch takes depends on the KV
    /// heads, `stream_smem_bytes`); their carve-out is a launch attribute instead.
    pub fn prepare(&self, hopper: bool) -> Result<(), CudaError> {
        for (hd, att) in ATTN_HEAD_DIMS.iter().zip(&self.attention) {
            let Some(att) = att else { continue };
            let dynamic = |v: &AttnVariant| match v.kind {
                AttnKind::Stream if hopper => CTA_SMEM_LIMIT,
                AttnKind::Stream => 0,
                _ => tc_dynamic_smem(v, *hd, v.fp8),
            };
            let bf16 = ATTN_VARIANTS.iter().zip(&att.bf16).map(|(v, f)| (v, f, dynamic(v)));
            let fp8 = ATTN_FP8_VARIANTS.iter().zip(&att.fp8).map(|(v, f)| (v, f, dynamic(v)));
            for (v, func, bytes) in bf16.chain(fp8).filter(|(_, _, b)| *b > 0) {
                func.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
                // The streaming kernels' carve-out is chosen per launch (`stream_carveout`).
                if v.kind != AttnKind::Stream {
                    func.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)?;
                }
            }
        }
        for (hd, pf) in PREFILL_HEAD_DIMS.iter().zip(&self.prefill) {
            let Some(pf) = pf else { continue };
            let sized = pf.bf16.iter().chain(&pf.bf16_opt).map(|f| (f, prefill_smem_bytes(*hd)));
            let fp8_sized = pf.fp8.iter().chain(&pf.fp8_opt).map(|f| (f, prefill_fp8_smem_bytes(*hd)));
            let wg = pf
                .wg
                .iter()
                .flat_map(|[bf, fp8]| [(bf, prefill_wg_smem_bytes(false)), (fp8, prefill_wg_smem_bytes(true))]);
            for (func, bytes) in sized.chain(fp8_sized).chain(wg) {
                func.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
                func.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)?;
            }
        }
        Ok(())
    }
}

/// The name of every kernel the device loads, in load order: a compiled module must define
/// each one (the `cuda_compile` example checks the PTX with it).
pub fn kernel_names() -> Vec<String> {
    kernel_modules().into_iter().map(|(_, n)| n).collect()
}

/// Every kernel the device loads with the module that defines it, in load order.
pub fn kernel_modules() -> Vec<(Module, String)> {
    let mut names = Vec::new();
    let listed = KernelTable::<()>::load(&KernelNeeds::all(), |module, name| {
        names.push((module, name.to_string()));
        Ok::<(), std::convert::Infallible>(())
    });
    drop(listed);
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_kernel_is_listed_once() {
        let names = kernel_names();
        let unique: HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a kernel listed twice");
        // 12 plain kernels, 12 for the new architectures (q/k-norm RoPE ×2, GELU-tanh·mul,
        // soft-cap, Gemma's bf16-rounded embedding scale, MoE routing, permutation, grouped GEMV and GEMM,
        // un-permute, gpt-oss's clamped SwiGLU and f32 router bias), the fused MoE route +
        // permute, the fused router + route + permute, the wide grouped GEMM, and the skinny grouped product per activation
        // (plain, SiLU·mul, clamped SwiGLU, un-permute) and variant, the extended attention per
        // head dims a lane (8), 2 sampling kernels and prompt logprobs, 3 utility kernels (random weights in bf16 and
        // f32, the profiler's spin), per attention head_dim every variant and the
        // combine, per prefill head_dim both CTA sizes with and without options (and the warpgroup
        // kernel at head_dim 128), gemv per tile and variant every epilogue;
        // the FP8 KV cache's four RoPE + write entries, their four calibration (amax) passes,
        // and its extended attention per head dims a lane (8); FP8 weights' dequantization (2),
        // per-row quantization (bf16 activations, f32 weights), the add + norm + quantization of
        // the W8A8 input, SiLU·mul with its quantization, and skinny GEMM per tile, variant,
        // epilogue and scaling.
        let fp8 = 4
            + 4
            + ATTN_EXT_MAX_HEAD_DIM / 32
            + 6
            + GEMV_MAX_MS.len() * GEMV_FP8_VARIANTS.len() * Fp8Epilogue::ALL.len() * Fp8Scaling::ALL.len();
        // The FP8-cache decode variants and prefill kernels per head_dim.
        let templated = ATTN_HEAD_DIMS.len() * (ATTN_VARIANTS.len() + ATTN_FP8_VARIANTS.len() + 1)
            + 4 * PREFILL_HEAD_DIMS.len() * PREFILL_WARPS.len()
            + 2
            + GEMV_MAX_MS.len() * GEMV_VARIANTS.len() * GemvEpilogue::ALL.len();
        let moe_skinny = MOE_SKINNY_ACTS.len() * MOE_SKINNY_VARIANTS.len();
        assert_eq!(names.len(), 30 + 3 + moe_skinny + ATTN_EXT_MAX_HEAD_DIM / 32 + fp8 + templated);
        for n in [
            "embed_f32",
            "prompt_logprobs",
            "paged_attention_tc_hd128_w2_s4_g16",
            "prefill_attention_hd16_w8",
            "prefill_attention_wg_fp8_hd128",
            "gemv_m16_w8_u2_f32",
            "gemv_m8_w4_u4_silu",
            "gemv_fp8_m16_w8_u2_blk",
            "gemv_fp8_m8_w4_u4_row",
            "gemv_fp8_m8_w4_u4_row_silu",
            "gemv_fp8_m16_w8_u2_blk_gelu_tanh",
            "gemv_fp8_m16_w4_u4_row_rope",
            "gemv_fp8_m8_w8_u4_blk_rope_fp8",
            "rope_qkv_qknorm_write_kv_fp8",
            "rope_qkv_qknorm_write_kv_amax",
            "paged_attention_ext_fp8_d4",
            "paged_attention_tc_fp8_hd128_w2_s4_g16",
            "prefill_attention_fp8_hd64_w4",
            "moe_route_permute",
            "moe_skinny_silu_bf16_u4",
            "moe_skinny_bf16_u2",
            "moe_skinny_unpermute_bf16_u2",
            "moe_router_route_permute",
            "moe_grouped_gemm_wide_bf16",
            "prefill_attention_opt_hd256_w4",
            "prefill_attention_fp8_opt_hd128_w8",
        ] {
            assert!(unique.contains(&n.to_string()), "{n} missing");
        }
        // The plain kernels are defined verbatim in their module's source; a templated kernel's
        // module instantiates its parameter (`sources::tests` compares the instance lists with
        // the variant tables).
        for (module, n) in kernel_modules() {
            let src = module.source();
            match module.part {
                None => assert!(src.contains(&format!("void {n}(")), "{n} is not defined in {}", module.name()),
                Some(p) => {
                    let tag = match module.family {
                        Family::GemvFp8 => format!("gemv_fp8_m{p}_"),
                        Family::Gemv => format!("gemv_m{p}_"),
                        _ => format!("_hd{p}"),
                    };
                    assert!(n.contains(&tag), "{n} assigned to {}", module.name());
                    assert!(
                        src.lines().any(|l| l.contains(&format!("({p}")) && !l.starts_with(' ') && !l.starts_with('#')),
                        "{} instantiates nothing",
                        module.name()
                    );
                }
            }
        }
        // Every module serves at least one kernel.
        let used: HashSet<Module> = kernel_modules().into_iter().map(|(m, _)| m).collect();
        assert_eq!(used.len(), super::super::sources::modules().len());
    }

    /// A table loaded for one model asks only its modules for kernels, asks each of them for
    /// every kernel it serves, and names what it left out when asked for it.
    #[test]
    fn a_table_for_one_model_resolves_only_its_modules() {
        let needs = KernelNeeds::model(128, false, false);
        let mut asked: Vec<(Module, String)> = Vec::new();
        let table = KernelTable::<()>::load(&needs, |m, n| {
            asked.push((m, n.to_string()));
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap_or_else(|e| match e {});
        let loaded: HashSet<Module> = needs.modules().into_iter().collect();
        assert!(asked.iter().all(|(m, _)| loaded.contains(m)), "asked a module that is not loaded");
        let expected: Vec<(Module, String)> =
            kernel_modules().into_iter().filter(|(m, _)| loaded.contains(m)).collect();
        assert_eq!(asked, expected, "every kernel of a loaded module, in the full table's order");
        let hd128 = ATTN_HEAD_DIMS.iter().position(|&d| d == 128).expect("128");
        assert!(table.attention(hd128).is_ok() && table.prefill(hd128).is_ok());
        assert!(table.prefill(hd128).is_ok_and(|p| p.wg.is_some()), "the warpgroup kernel is head_dim 128's");
        let message = |r: Result<(), CudaError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            message(table.moe().map(|_| ())),
            "kernel module moe is not loaded on this device (it was opened without experts)"
        );
        assert!(message(table.fp8().map(|_| ())).contains("fp8 is not loaded"));
        let hd64 = ATTN_HEAD_DIMS.iter().position(|&d| d == 64).expect("64");
        assert!(message(table.attention(hd64).map(|_| ())).contains("attention_hd64 is not loaded"));
        assert!(message(table.prefill(hd64).map(|_| ())).contains("prefill_hd64 is not loaded"));
        assert!(table.attention(ATTN_HEAD_DIMS.len()).is_err(), "an index past the table");
    }
}
