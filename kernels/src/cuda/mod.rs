//! The CUDA kernels: CUDA C sources under `kernels/cuda/`, compiled at run time with NVRTC
//! for the device's architecture, and typed launchers over `cudarc` device slices.
//!
//! Nothing here needs a CUDA toolkit at build time: `cudarc` loads the driver, NVRTC and
//! cuBLAS dynamically when a [`CudaDevice`] is opened. The sources form several modules
//! ([`modules`]: one per `.cu` family, the templated ones cut by head_dim or rows), compiled in
//! parallel to machine code (CUBIN) for the device's exact architecture and cached on disk in
//! the directory the caller passes (never read from the environment here), keyed by a hash of
//! the module's source, the target architecture, the NVRTC flags and the NVRTC version, so a
//! source edit, another GPU or another flag never reuses a stale module. [`build_cache`]
//! fills such a directory without a GPU (`baton kernels build`), to ship compiled kernels.
//!
//! Invariants: one [`CudaDevice`] owns one context and one stream; every launcher enqueues
//! on that stream, validates its sizes against the slices before launching and returns a
//! [`CudaError`] (never panics); storage is bf16 (the residual stream and the logits f32),
//! arithmetic f32.
//!
//! # Layers
//!
//! Each module imports only from the ones above it in this list (no circles):
//!
//! 1. **launch** (`error.rs`, `launch.rs`): [`CudaError`], the checks every launcher makes
//!    (`need`, `int`, `shape_check`), the grid helpers (`cfg`, `grid_for`, `per_row`,
//!    `grid_stride`), the argument builder `Args` and its `unsafe` `launch`. No CUDA state.
//! 2. **kernel descriptions** (`paged_attention.rs`, `prefill.rs`, `gemv.rs`): for each
//!    templated kernel, its compiled variants in the order of the `.cu` instance lists, their
//!    names, the rule that picks one, the shapes it takes. Pure functions, unit-tested here.
//!    `carveout.rs` likewise holds the rule for the shared-memory carve-out a decode step's
//!    launches ask for ([`step_carveout`], [`CarveoutPolicy`]). `sources.rs` cuts the sources
//!    into modules ([`Module`]) and says which a model loads ([`KernelNeeds`]); `compile.rs`
//!    compiles and caches them; `kernel_table.rs` resolves every name once (the only list of
//!    names).
//! 3. **device** (`device.rs`, `graph.rs`, `staging.rs`, `weight_upload.rs`): [`CudaDevice`]
//!    (context, stream, cuBLAS, the kernel table, memory), graph capture, page-locked staging,
//!    and [`WeightUploader`] (stored weights through a page-locked ring at page-cache speed).
//! 4. **per-step state** (`step_meta.rs`, `sampling.rs`, `step_ids.rs`): [`StepMeta`]
//!    (positions, slots, block tables, the prefill work lists), the sampler's buffers and
//!    launch, [`StepIds`] (the ids a step embeds, some taken from the sampler's picks). All
//!    uploads happen here, never in a launch, so launches can be recorded into a graph.
//! 5. **kernel families**, one call struct per kernel (or per set of kernels sharing their
//!    operands), every operand a named field and one `launch(self, &CudaDevice)`:
//!    `norm.rs` ([`RmsNormCall`], [`AddRmsNormCall`]), `elementwise.rs` ([`SiluMulCall`],
//!    [`GeluTanhMulCall`], [`SoftcapCall`], [`BiasAddCall`], [`BiasAddF32Call`], [`CopyColsCall`], [`CastCall`]),
//!    `gather.rs` ([`EmbedCall`], [`GatherRowsCall`]), `rope.rs` ([`RopeKvCall`], with
//!    [`QkNorm`]), `attention.rs` ([`AttentionCall`]: decode, prefill or mixed),
//!    `attention_ext.rs` ([`AttentionExtCall`]: sliding window, soft-cap, sinks, head_dim ≤ 256), `linear.rs`
//!    ([`LinearCall`]: cuBLAS or the skinny GEMM), `moe.rs` ([`MoeRouteCall`],
//!    [`MoePermuteCall`], [`MoeRoutePermuteCall`], [`MoeGroupedGemvCall`], [`MoeUnpermuteCall`],
//!    [`ClampedSwigluCall`]), `moe_skinny.rs` ([`MoeGateUpActCall`], [`MoeDownUnpermuteCall`]:
//!    the decode-sized grouped product over the experts in use, with the activation or the
//!    un-permute fused), `moe_router.rs` ([`MoeRouterCall`]: router, routing and permutation
//!    in one launch for decode-sized steps).
//!
//! # Adding a kernel
//!
//! 1. Write it in `kernels/cuda/` (a new file goes into a [`Family`] in `sources.rs`, or
//!    makes a new one); keep it self-contained (no headers beyond the prelude). A templated
//!    kernel gets an instance list, mirrored by a variant table in its description module with
//!    a unit test in `sources.rs` comparing the two (see `ATTN_VARIANTS`, `GEMV_VARIANTS`);
//!    a family cut into parts names its top-level instance macros in `Family::instance_macros`.
//! 2. Add its handle to `KernelTable` (field + one line in `load`, naming its module);
//!    `CudaDevice::open` then fails if the module lacks it, and `cargo run -p baton-kernels
//!    --example cuda_compile` checks every module defines its names without a GPU.
//! 3. Write the launcher in its family module (or a new one): a call struct with `pub` fields
//!    and `///` on each (shape and dtype), and a `launch` that checks every size with `need`/
//!    `shape_check` *before* enqueueing, returns early on empty work, builds `Args` in the
//!    kernel's parameter order and calls `unsafe { args.launch(..) }` with a `SAFETY` comment
//!    saying which checks make every access in bounds. Variants and options (a new epilogue,
//!    a split policy) are fields of the call, not new functions.
//! 4. Give it a CPU reference in `crate::cpu` (the CPU backend runs it too).
//! 5. Add a `gpu_*` test in `kernels/tests/` on fresh random inputs (seed printed), output
//!    poisoned with NaN before the launch, compared with `common::check` (‖out − ref‖ / ‖ref‖
//!    < 1e-2 in bf16, 1e-5 in f32), plus its refusals; and a CPU unit test of whatever its
//!    description module decides without a device.

mod attention;
mod attention_ext;
mod carveout;
mod compile;
mod device;
mod elementwise;
mod error;
mod fp8_fused;
mod fp8_linear;
mod fp8_w8a8;
mod gather;
mod gemv;
mod graph;
mod kernel_table;
mod launch;
mod linear;
mod lt;
mod lt_search;
mod moe;
mod moe_router;
mod moe_skinny;
mod norm;
mod norm_linear;
mod norm_rope;
mod paged_attention;
mod prefill;
mod prompt_logprobs;
mod rope;
mod sampling;
mod sources;
mod staging;
mod step_ids;
mod step_meta;
mod util;
mod weight_upload;

pub use attention::{AttentionCall, AttentionOptions, AttnKernel, KvCacheRef, attention_supports};
pub use attention_ext::{ATTN_EXT_MAX_HEAD_DIM, AttentionExtCall, AttentionExtFp8Call};
pub use carveout::{CarveoutPins, CarveoutPolicy, STEP_CARVEOUT_PERCENT, step_carveout};
pub use compile::{
    Compiled, ImageKind, ModuleReport, build_cache, compile_all, compile_module, compile_needed, device_arch,
    missing_kernels,
};
pub use cudarc::driver::{CudaSlice, CudaStream};
pub use device::{CudaDevice, CudaOptions, driver_present};
pub use elementwise::{
    BiasAddCall, BiasAddF32Call, CastCall, CopyColsCall, GeluTanhMulCall, ScaleRoundCall, SiluMulCall, SoftcapCall,
};
pub use error::CudaError;
pub use fp8_fused::{Fp8GatedGemvCall, Fp8RopeGemvCall};
pub use fp8_linear::{
    Fp8DequantCall, Fp8Epilogue, Fp8GemvCall, Fp8Scaling, Fp8Weights, GEMV_FP8_MAX_M, GEMV_FP8_VARIANTS,
    gemv_fp8_default, gemv_fp8_scaling, gemv_fp8_supports,
};
pub use fp8_w8a8::{
    Fp8W8A8Call, Fp8W8A8QuantizedCall, QuantRows, QuantizeRowsCall, SiluMulQuantCall, W8A8_MIN_M, w8a8_supports,
};
pub use gather::{EmbedCall, GatherRowsCall};
pub use gemv::{GEMV_KERNEL_MAX_M, GEMV_VARIANTS, GemvEpilogue, GemvVariant, gemv_default, gemv_supports};
pub use graph::StepGraph;
pub use half::bf16;
pub use kernel_table::{kernel_modules, kernel_names};
pub use linear::{GatedAct, GatedLinearCall, LinearCall, LinearKernel};
pub use lt::{CANDIDATES, DEFAULT_SEARCH, LtChoice, LtProbe, LtShape};
pub use lt_search::{LtAlgoInfo, LtSearch, SPLIT_K};
pub use moe::{
    ClampedSwigluCall, MOE_MAX_EXPERTS, MOE_MAX_K, MOE_ROUTE_PERMUTE_MAX_ROWS, MoeExpertKernel, MoeGroupedGemvCall,
    MoePermuteCall, MoeRouteCall, MoeRoutePermuteCall, MoeUnpermuteCall, moe_gemm_preferred, moe_gemm_wide_preferred,
};
pub use moe_router::{MOE_ROUTER_MAX_ROWS, MoeRouterCall};
pub use moe_skinny::{
    MOE_UNPERMUTE_RESID_MAX_ROWS, MoeDownOut, MoeDownUnpermuteCall, MoeGateUpActCall, MoeGatedAct,
    moe_unpermute_counters,
};
pub use norm::{AddRmsNormCall, AddRmsNormQuantCall, NORM_QUANT_MAX_DIM, RmsNormCall, norm_quant_supports};
pub use norm_linear::{NormInput, NormLinearCall, NormLinearOut, NormRouterCall, ResidualLinearCall, norm_stat_parts};
pub use norm_rope::{NormRopeCall, RopeCache, RopeOut, norm_rope_supports};
pub use paged_attention::{
    ATTN_FP8_VARIANTS, ATTN_VARIANTS, AttnKind, AttnSplit, AttnVariant, DecodeShape, STREAM_WIDE_MIN_CTAS, SplitTarget,
    attn_default, attn_fp8_default, attn_stream_default, attn_stream_narrow, attn_tc_default, auto_splits, plan_splits,
    stream_carveout, stream_kv_heads,
};
pub use prefill::{
    PREFILL_DEFAULT_VARIANT, PREFILL_MAX_GROUP, PREFILL_MIN_TOKENS, PREFILL_VARIANTS, PREFILL_WARPS, PREFILL_WGMMA,
    prefill_smem_bytes, prefill_supported, prefill_variant_warps, prefill_wg_supported,
};
pub use prompt_logprobs::{PROMPT_LOGPROB_MAX_TOP, PROMPT_LOGPROB_OUT_WORDS, PromptLogprobsCall, RowLogprob};
pub use rope::{QkNorm, RopeExtras, RopeInput, RopeKvAmaxCall, RopeKvCall, RopeKvFp8Call};
pub use sampling::{
    DeviceMask, DeviceOp, DeviceOpKind, DeviceRow, DeviceSample, SAMPLE_MAX_TOP, SAMPLE_MAX_VOCAB, SampleBuffers,
};
pub use sources::{Family, KernelNeeds, Module, modules};
pub use step_ids::StepIds;
pub use weight_upload::{
    DEFAULT_SLOT_ELEMS, DEFAULT_SLOTS, HostDType, HostTensor, UploadStats, WeightUploader, fill_bf16, plan_chunks,
};

pub use step_meta::{AttentionMeta, HostSeq, KvGeometry, KvWriteMeta, StepMeta};
