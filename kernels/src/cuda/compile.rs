//! Run-time compilation of the CUDA C sources with NVRTC, split into modules compiled in
//! parallel, with an on-disk cache of the compiled images.
//!
//! The sources are several translation units ([`Module`]s): one per `.cu` family, each
//! preceded by the shared prelude, and the templated families (decode attention, prefill
//! attention, skinny GEMM) cut further into one module per instantiation parameter (head_dim,
//! rows of x), so no single unit dominates the compile. Every source is embedded in the binary
//! with `include_str!`, so the binary needs no source tree. For an `sm_*` architecture NVRTC
//! emits a CUBIN (machine code: the driver loads it with no PTX JIT); for a `compute_*` one,
//! PTX. Modules missing from the cache are compiled on one thread each.
//!
//! The cache key of a module hashes its source text, the architecture, the flags and the NVRTC
//! version; an entry is written to a temporary name and renamed into place, so a concurrent
//! reader never sees a partial file. A cache entry that cannot be read, is not a CUBIN/PTX, or
//! that the driver refuses is compiled again (and rewritten, best effort); a cache that cannot
//! be written is bypassed (the cache is an optimisation, never a requirement).
//! [`build_cache`] fills a cache directory for an architecture without a GPU, so an image or a
//! carry can bring compiled kernels along.

use super::CudaError;
use super::fp8_linear::GEMV_FP8_VARIANTS;
use super::gemv::{GEMV_MAX_MS, GEMV_VARIANTS};
use super::paged_attention::ATTN_HEAD_DIMS;
use super::prefill::{PREFILL_HEAD_DIMS, PREFILL_WARPS, PREFILL_WG_HEAD_DIM};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// A family of kernel sources: one `.cu` file or a few small ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Row-wise and element-wise kernels and the utility kernels: every model's.
    Elementwise,
    /// RoPE + the KV write into a bf16 cache (rope_kv.cu's body, rope_kv_bf16.cu's entries):
    /// every model's. The RoPE kernels are three modules, one per cache kind and the
    /// calibration pass: whole, they were the longest module of a cold start (8.3 s of NVRTC on
    /// a fresh H200 machine).
    Rope,
    /// RoPE + the KV write into an FP8 cache (rope_kv_fp8.cu after rope_kv.cu).
    RopeFp8,
    /// The FP8 KV scale calibration passes (rope_kv_amax.cu after rope_kv.cu).
    RopeAmax,
    /// The mixture-of-experts kernels (routing, permutation, the grouped expert products):
    /// models with experts only.
    Moe,
    /// Decode attention with a window, soft-cap or sinks, any head_dim up to 256.
    AttentionExt,
    /// FP8 weights' dequantization and the per-row E4M3 quantization (fp8_linear.cu).
    Fp8,
    /// Sampling on the device, and prompt logprobs.
    Sampling,
    /// The skinny GEMM over bf16 weights, cut by rows of x and variant (the `GEMV_INSTANCE`
    /// lines).
    Gemv,
    /// The skinny GEMM over FP8 weights, cut by rows of x and variant (the `GEMV_FP8_INSTANCE`
    /// lines), after gemv.cu's loads, mma and epilogues without gemv.cu's instances: modules of
    /// their own, so that they compile beside the bf16 ones (a cold start waits for the longest).
    GemvFp8,
    /// Paged decode attention, cut by head_dim and by instance line (`ATT_VARIANTS(HD)`,
    /// `ATT_TC_VARIANTS(HD)`, `ATT_TC_FP8_VARIANTS(HD)`, `ATT_ST_VARIANTS(HD)`: [`ATTN_MODULES`]).
    Attention,
    /// Prefill flash attention, cut by head_dim (`PF_INSTANCE(HD, ..)`, `PF_WG_INSTANCE(HD, ..)`).
    Prefill,
}

impl Family {
    /// The family's `.cu` files, in order (the prelude goes before them).
    fn files(self) -> &'static [&'static str] {
        match self {
            Self::Elementwise => &[include_str!("../../cuda/elementwise.cu"), include_str!("../../cuda/util.cu")],
            Self::Rope => &[include_str!("../../cuda/rope_kv.cu"), include_str!("../../cuda/rope_kv_bf16.cu")],
            Self::RopeFp8 => &[include_str!("../../cuda/rope_kv.cu"), include_str!("../../cuda/rope_kv_fp8.cu")],
            Self::RopeAmax => &[include_str!("../../cuda/rope_kv.cu"), include_str!("../../cuda/rope_kv_amax.cu")],
            Self::Moe => &[
                include_str!("../../cuda/moe.cu"),
                include_str!("../../cuda/moe_skinny.cu"),
                include_str!("../../cuda/moe_router.cu"),
                include_str!("../../cuda/moe_gemm.cu"),
            ],
            Self::AttentionExt => &[include_str!("../../cuda/attention_ext.cu")],
            Self::Fp8 => &[include_str!("../../cuda/fp8_linear.cu")],
            Self::Sampling => &[include_str!("../../cuda/sampling.cu"), include_str!("../../cuda/prompt_logprobs.cu")],
            Self::Gemv => &[include_str!("../../cuda/gemv.cu")],
            Self::GemvFp8 => &[include_str!("../../cuda/gemv.cu"), include_str!("../../cuda/gemv_fp8.cu")],
            Self::Attention => &[
                include_str!("../../cuda/attention.cu"),
                include_str!("../../cuda/attention_tc_fp8.cu"),
                include_str!("../../cuda/attention_stream.cu"),
            ],
            Self::Prefill => &[include_str!("../../cuda/prefill.cu"), include_str!("../../cuda/prefill_wg.cu")],
        }
    }

    /// The macros whose top-level invocations instantiate the family's kernels, first argument
    /// the parameter a module keeps one value of; empty for families compiled whole.
    fn instance_macros(self) -> &'static [&'static str] {
        match self {
            Self::Elementwise
            | Self::Rope
            | Self::RopeFp8
            | Self::RopeAmax
            | Self::Moe
            | Self::AttentionExt
            | Self::Fp8
            | Self::Sampling => &[],
            Self::Gemv => &["GEMV_INSTANCE"],
            Self::GemvFp8 => &["GEMV_FP8_INSTANCE"],
            Self::Attention => &["ATT_VARIANTS", "ATT_TC_VARIANTS", "ATT_TC_FP8_VARIANTS", "ATT_ST_VARIANTS"],
            Self::Prefill => &["PF_INSTANCE", "PF_WG_INSTANCE"],
        }
    }

    /// Instance macros of another family's file that this family's modules leave out whole.
    fn dropped_macros(self) -> &'static [&'static str] {
        match self {
            Self::GemvFp8 => &["GEMV_INSTANCE"],
            _ => &[],
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Elementwise => "elementwise",
            Self::Rope => "rope_kv",
            Self::RopeFp8 => "rope_kv_fp8",
            Self::RopeAmax => "rope_kv_amax",
            Self::Moe => "moe",
            Self::AttentionExt => "attention_ext",
            Self::Fp8 => "fp8",
            Self::Sampling => "sampling",
            Self::Gemv => "gemv_m",
            Self::GemvFp8 => "gemv_fp8_m",
            Self::Attention => "attention_hd",
            Self::Prefill => "prefill_hd",
        }
    }
}

/// One translation unit: a family, for a cut family the one parameter value it instantiates
/// (head_dim, rows of x), and for a family cut by variant too (the skinny GEMMs) the one
/// instance line of that part it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Module {
    /// The sources.
    pub family: Family,
    /// The instantiation parameter this module keeps (`None`: the family is compiled whole).
    pub part: Option<usize>,
    /// Which of the part's top-level instance lines it keeps, counted in file order (`None`:
    /// all of them).
    pub variant: Option<usize>,
}

impl Module {
    /// A whole family.
    pub const fn whole(family: Family) -> Self {
        Self { family, part: None, variant: None }
    }

    /// One part of a cut family.
    pub const fn part(family: Family, part: usize) -> Self {
        Self { family, part: Some(part), variant: None }
    }

    /// One instance line, the `variant`-th of `part`'s, of a family cut by variant.
    pub const fn variant(family: Family, part: usize, variant: usize) -> Self {
        Self { family, part: Some(part), variant: Some(variant) }
    }

    /// A short name: `elementwise`, `attention_hd128`, `gemv_m8_v1`...
    pub fn name(&self) -> String {
        match (self.part, self.variant) {
            (Some(p), Some(v)) => format!("{}{p}_v{v}", self.family.label()),
            (Some(p), None) => format!("{}{p}", self.family.label()),
            _ => self.family.label().to_string(),
        }
    }

    /// The module's source: the prelude, then the family's files with only this part's (and
    /// variant's) top-level instance lines.
    pub fn source(&self) -> String {
        let mut out = String::with_capacity(64 << 10);
        out.push_str(PRELUDE);
        // This part's instance lines so far (the variant index of the next one).
        let mut seen = 0usize;
        for file in self.family.files() {
            out.push('\n');
            for line in file.lines() {
                if self.keeps(line, &mut seen) {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        out
    }

    /// Whether `line` stays in this module's source: every line except the top-level
    /// instances of another part or variant, and those of the macros the family drops.
    fn keeps(&self, line: &str, seen: &mut usize) -> bool {
        if instance_param(line, self.family.dropped_macros()).is_some() {
            return false;
        }
        let Some(part) = self.part else { return true };
        match instance_param(line, self.family.instance_macros()) {
            Some(p) if p == part => {
                let index = *seen;
                *seen += 1;
                self.variant.is_none_or(|v| v == index)
            }
            Some(_) => false,
            None => true,
        }
    }
}

/// The first argument of a top-level (unindented) invocation of one of `macros`, e.g. 128 for
/// `ATT_VARIANTS(128)` or `PF_INSTANCE(128, 8)`; `None` for any other line (the macros'
/// own definitions are `#define` lines).
fn instance_param(line: &str, macros: &[&str]) -> Option<usize> {
    macros.iter().find_map(|m| {
        let rest = line.strip_prefix(m)?.strip_prefix('(')?;
        let arg = rest.split([',', ')']).next()?;
        arg.trim().parse().ok()
    })
}

/// Modules per head_dim of decode attention: one per instance line of a head_dim, in file order
/// (`ATT_VARIANTS`: the register kernels and the combine; `ATT_TC_VARIANTS`; `ATT_TC_FP8_VARIANTS`;
/// `ATT_ST_VARIANTS`: the streaming kernels of both caches). Whole, head_dim 128's took 15 s of
/// NVRTC on a fresh machine, the longest module of a cold start.
pub(crate) const ATTN_MODULES: usize = 4;

/// Modules of prefill attention for `head_dim`: one per instance line, in file order (a
/// `PF_INSTANCE(HD, warps)` per CTA size of `PREFILL_WARPS`, then head_dim 128's
/// `PF_WG_INSTANCE`).
pub(crate) fn prefill_modules(head_dim: usize) -> usize {
    PREFILL_WARPS.len() + usize::from(head_dim == PREFILL_WG_HEAD_DIM)
}

/// Every module, in load order.
pub fn modules() -> Vec<Module> {
    let mut v = vec![
        Module::whole(Family::Elementwise),
        Module::whole(Family::Rope),
        Module::whole(Family::RopeFp8),
        Module::whole(Family::RopeAmax),
        Module::whole(Family::Moe),
        Module::whole(Family::AttentionExt),
        Module::whole(Family::Fp8),
        Module::whole(Family::Sampling),
    ];
    for (family, variants) in [(Family::Gemv, GEMV_VARIANTS.len()), (Family::GemvFp8, GEMV_FP8_VARIANTS.len())] {
        v.extend(GEMV_MAX_MS.iter().flat_map(|&m| (0..variants).map(move |i| Module::variant(family, m, i))));
    }
    v.extend(
        ATTN_HEAD_DIMS.iter().flat_map(|&hd| (0..ATTN_MODULES).map(move |i| Module::variant(Family::Attention, hd, i))),
    );
    v.extend(
        PREFILL_HEAD_DIMS
            .iter()
            .flat_map(|&hd| (0..prefill_modules(hd)).map(move |i| Module::variant(Family::Prefill, hd, i))),
    );
    v
}

/// Which kernel modules a device compiles and loads: every one (the default, for tests and
/// benchmarks that run any shape), or what one model runs. Every model gets the element-wise,
/// extended-attention, sampling and bf16 skinny-GEMM modules; the others are the large ones a
/// model may not touch: the experts' kernels, FP8 weights' kernels, and decode and prefill
/// attention per head_dim. A cold start compiles only what it loads, so it waits for less CPU
/// work (and a kernel of a module left out fails its launch with [`CudaError::NotLoaded`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelNeeds {
    /// The head_dims whose decode and prefill attention modules load; `None` for every one.
    /// (A head_dim without modules runs the extended attention, which is always loaded.)
    pub head_dims: Option<Vec<usize>>,
    /// The mixture-of-experts kernels.
    pub experts: bool,
    /// The FP8 weights' kernels: dequantization, quantization, the FP8 skinny GEMM.
    pub fp8_weights: bool,
}

impl Default for KernelNeeds {
    fn default() -> Self {
        Self::all()
    }
}

impl KernelNeeds {
    /// Every module.
    pub fn all() -> Self {
        Self { head_dims: None, experts: true, fp8_weights: true }
    }

    /// What a model with one `head_dim` runs, with or without experts and FP8 weights.
    pub fn model(head_dim: usize, experts: bool, fp8_weights: bool) -> Self {
        Self { head_dims: Some(vec![head_dim]), experts, fp8_weights }
    }

    /// Whether `module` loads.
    pub fn loads(&self, module: &Module) -> bool {
        let head_dim = |m: &Module| match (&self.head_dims, m.part) {
            (None, _) => true,
            (Some(dims), Some(hd)) => dims.contains(&hd),
            (Some(_), None) => false,
        };
        match module.family {
            Family::Elementwise
            | Family::Rope
            | Family::RopeFp8
            | Family::RopeAmax
            | Family::AttentionExt
            | Family::Sampling
            | Family::Gemv => true,
            Family::Moe => self.experts,
            Family::Fp8 | Family::GemvFp8 => self.fp8_weights,
            Family::Attention | Family::Prefill => head_dim(module),
        }
    }

    /// The modules that load, in [`modules`]' order.
    pub fn modules(&self) -> Vec<Module> {
        modules().into_iter().filter(|m| self.loads(m)).collect()
    }
}

/// NVRTC flags besides the architecture. Precise division and square root stay on; the
/// kernels call the fast intrinsics (`__expf`) explicitly where they want them.
const FLAGS: &[&str] = &["--std=c++17", "--device-as-default-execution-space"];

/// The NVRTC target of a device of compute capability `major.minor`: its exact machine code
/// (`sm_90a` on Hopper: the `a` targets unlock wgmma/setmaxnreg and run only on that chip).
pub fn device_arch(major: i32, minor: i32) -> String {
    if major >= 9 { format!("sm_{major}{minor}a") } else { format!("sm_{major}{minor}") }
}

/// What a compile produces for `arch`: machine code for `sm_*`, PTX for `compute_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// A CUBIN (ELF): loaded as is, no JIT.
    Cubin,
    /// PTX text: the driver compiles it at load.
    Ptx,
}

impl ImageKind {
    /// The kind NVRTC emits for `arch`, or an error naming an architecture it cannot target.
    pub fn for_arch(arch: &str) -> Result<Self, CudaError> {
        let digits = |s: &str| {
            let s = s.strip_suffix('a').unwrap_or(s);
            !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
        };
        match (arch.strip_prefix("sm_"), arch.strip_prefix("compute_")) {
            (Some(n), _) if digits(n) => Ok(Self::Cubin),
            (_, Some(n)) if digits(n) => Ok(Self::Ptx),
            _ => Err(CudaError::Compile(format!(
                "unknown architecture {arch:?} (expected sm_XY[a] for machine code or compute_XY[a] for PTX)"
            ))),
        }
    }

    fn extension(self) -> &'static str {
        match self {
            Self::Cubin => "cubin",
            Self::Ptx => "ptx",
        }
    }

    /// Whether `bytes` look like a complete image of this kind (a 64-bit ELF file long enough
    /// for the section headers its header places last; PTX text with no NUL), so a truncated
    /// or foreign cache file is compiled again rather than handed to the driver.
    fn plausible(self, bytes: &[u8]) -> bool {
        match self {
            Self::Cubin => elf_complete(bytes),
            Self::Ptx => !bytes.is_empty() && !bytes.contains(&0) && bytes.starts_with(b"//"),
        }
    }

    fn to_ptx(self, bytes: Vec<u8>) -> Result<Ptx, CudaError> {
        match self {
            Self::Cubin => Ok(Ptx::from_binary(bytes)),
            Self::Ptx => String::from_utf8(bytes)
                .map(Ptx::from_src)
                .map_err(|e| CudaError::Compile(format!("PTX is not UTF-8: {e}"))),
        }
    }
}

/// Whether `bytes` hold a little-endian ELF64 file whose section header table (`e_shoff`,
/// `e_shentsize`, `e_shnum`) ends within it.
fn elf_complete(bytes: &[u8]) -> bool {
    let (Some(shoff), Some(entsize), Some(num)) = (bytes.get(0x28..0x30), bytes.get(0x3A..0x3C), bytes.get(0x3C..0x3E))
    else {
        return false;
    };
    let word = |b: &[u8]| b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
    let end = word(shoff).saturating_add(word(entsize).saturating_mul(word(num)));
    bytes.starts_with(b"\x7fELF\x02\x01") && word(num) > 0 && end <= bytes.len() as u64
}

/// The NVRTC version, as part of every cache key.
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: the caller checked that NVRTC is loadable; the call only writes two ints.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("{major}.{minor} ({status:?})")
}

/// The cache key of a module's `src` for `arch` under NVRTC `nvrtc`.
pub(crate) fn cache_key(src: &str, arch: &str, nvrtc: &str) -> u128 {
    let mut text = String::with_capacity(src.len() + 128);
    text.push_str(src);
    text.push('\0');
    text.push_str(arch);
    text.push('\0');
    text.push_str(&FLAGS.join(" "));
    text.push('\0');
    text.push_str(nvrtc);
    xxhash_rust::xxh3::xxh3_128(text.as_bytes())
}

/// The cache file of `key` under `dir` (the module's name first, for people reading the
/// directory).
fn cache_file(dir: &Path, module: &Module, key: u128, kind: ImageKind) -> PathBuf {
    dir.join(format!("{}-{key:032x}.{}", module.name(), kind.extension()))
}

fn nvrtc_present() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } { Ok(()) } else { Err(CudaError::MissingLibrary("nvrtc")) }
}

/// Compiles `src` (named `name` in diagnostics) for `arch` to a CUBIN or PTX image. Needs
/// NVRTC only, no GPU. Thread-safe: each call has its own NVRTC program.
fn nvrtc_compile(src: &str, name: &str, arch: &str, kind: ImageKind) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    let nul = |what: &str| CudaError::Compile(format!("{what} holds a NUL byte"));
    let c_src = CString::new(src).map_err(|_| nul("the kernel source"))?;
    let c_name = CString::new(format!("{name}.cu")).map_err(|_| nul("the module name"))?;
    let err = |what: &str, e: result::NvrtcError| CudaError::Compile(format!("{name}: {what}: {e:?}"));
    let prog = result::create_program(&c_src, Some(&c_name)).map_err(|e| err("create", e))?;
    let mut options: Vec<String> = FLAGS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    // SAFETY: `prog` was created above from `c_src`/`c_name`, which outlive it, and is
    // destroyed exactly once, below, whatever the outcome.
    let out = unsafe {
        let compiled = result::compile_program(prog, &options).map_err(|e| {
            let log = result::get_program_log(prog)
                .map(|l| {
                    let bytes: Vec<u8> = l.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            CudaError::Compile(format!("{name}: {e:?}: {log}"))
        });
        let image = compiled.and_then(|()| match kind {
            ImageKind::Ptx => result::get_ptx(prog)
                .map(|p| p.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect())
                .map_err(|e| err("get PTX", e)),
            ImageKind::Cubin => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| err("CUBIN size", e))?;
                let mut buf = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()).result().map_err(|e| err("get CUBIN", e))?;
                Ok(buf)
            }
        });
        let destroyed = result::destroy_program(prog).map_err(|e| err("destroy", e));
        image.and_then(|i| destroyed.map(|()| i))
    }?;
    Ok(out)
}

/// Compiles one module for `arch` (see [`compile_all`]).
pub fn compile_module(module: &Module, arch: &str) -> Result<Vec<u8>, CudaError> {
    nvrtc_present()?;
    let kind = ImageKind::for_arch(arch)?;
    nvrtc_compile(&module.source(), &module.name(), arch, kind)
}

/// Compiles every module of `wanted` for `arch`, one thread each, and returns their images in
/// order with the milliseconds each took.
fn compile_parallel(wanted: &[(Module, String)], arch: &str) -> Vec<Result<(Vec<u8>, f64), CudaError>> {
    let kind = match ImageKind::for_arch(arch) {
        Ok(k) => k,
        Err(e) => return wanted.iter().map(|_| Err(CudaError::Compile(e.to_string()))).collect(),
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = wanted
            .iter()
            .map(|(m, src)| {
                s.spawn(move || {
                    let t0 = Instant::now();
                    nvrtc_compile(src, &m.name(), arch, kind).map(|img| (img, t0.elapsed().as_secs_f64() * 1e3))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(CudaError::Compile("a compile thread panicked".into()))))
            .collect()
    })
}

/// One module compiled by [`compile_all`].
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The module.
    pub module: Module,
    /// Its image: a CUBIN for `sm_*`, PTX for `compute_*`.
    pub image: Vec<u8>,
    /// Milliseconds NVRTC took (on its own thread).
    pub ms: f64,
}

/// Compiles every module for `arch` in parallel (no GPU needed).
pub fn compile_all(arch: &str) -> Result<Vec<Compiled>, CudaError> {
    compile_needed(arch, &KernelNeeds::all())
}

/// Compiles the modules `needs` loads for `arch` in parallel (no GPU needed): what a cold
/// start compiles.
pub fn compile_needed(arch: &str, needs: &KernelNeeds) -> Result<Vec<Compiled>, CudaError> {
    nvrtc_present()?;
    let wanted: Vec<(Module, String)> = needs.modules().into_iter().map(|m| (m, m.source())).collect();
    let images = compile_parallel(&wanted, arch);
    wanted
        .into_iter()
        .zip(images)
        .map(|((module, _), img)| img.map(|(image, ms)| Compiled { module, image, ms }))
        .collect()
}

/// The kernels the device loads from `module` that `image` (of `kind`) does not define: PTX
/// declares each as `.entry NAME(`, a CUBIN names it, NUL-terminated, in its string table.
pub fn missing_kernels(module: &Module, image: &[u8], kind: ImageKind) -> Vec<String> {
    let has = |needle: &[u8]| image.windows(needle.len()).any(|w| w == needle);
    super::kernel_table::kernel_modules()
        .into_iter()
        .filter(|(m, _)| m == module)
        .map(|(_, name)| name)
        .filter(|name| match kind {
            ImageKind::Ptx => !has(format!(".entry {name}(").as_bytes()),
            ImageKind::Cubin => !has(format!("{name}\0").as_bytes()),
        })
        .collect()
}

/// How one module was obtained.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleReport {
    /// The module's name (see [`Module::name`]).
    pub name: String,
    /// Whether it came from the cache (else NVRTC compiled it).
    pub from_cache: bool,
    /// Milliseconds: reading the cache entry, or compiling; then loading it into the context.
    pub ms: f64,
    /// Size of its image.
    pub bytes: usize,
}

/// A module's image for `arch`, from `cache_dir` where present and plausible.
struct Lookup {
    module: Module,
    src: String,
    key: u128,
    cached: Option<Vec<u8>>,
    read_ms: f64,
}

fn look_up(wanted: Vec<Module>, arch: &str, kind: ImageKind, cache_dir: Option<&Path>) -> Vec<Lookup> {
    let nvrtc = nvrtc_version();
    wanted
        .into_iter()
        .map(|module| {
            let src = module.source();
            let key = cache_key(&src, arch, &nvrtc);
            let t0 = Instant::now();
            let cached = cache_dir
                .and_then(|d| std::fs::read(cache_file(d, &module, key, kind)).ok())
                .filter(|b| kind.plausible(b));
            Lookup { module, src, key, cached, read_ms: t0.elapsed().as_secs_f64() * 1e3 }
        })
        .collect()
}

/// A module's image, from the cache or NVRTC.
struct Resolved {
    module: Module,
    image: Vec<u8>,
    from_cache: bool,
    /// Reading the cache entry, or compiling.
    ms: f64,
    key: u128,
}

/// Compiles the modules of `lookups` that the cache lacks, in parallel, writing each to
/// `cache_dir` (best effort); returns every module's image.
fn resolve(
    lookups: Vec<Lookup>,
    arch: &str,
    kind: ImageKind,
    cache_dir: Option<&Path>,
) -> Result<Vec<Resolved>, CudaError> {
    let missing: Vec<(Module, String)> =
        lookups.iter().filter(|l| l.cached.is_none()).map(|l| (l.module, l.src.clone())).collect();
    let mut compiled = compile_parallel(&missing, arch).into_iter();
    let mut out = Vec::with_capacity(lookups.len());
    for l in lookups {
        match l.cached {
            Some(image) => out.push(Resolved { module: l.module, image, from_cache: true, ms: l.read_ms, key: l.key }),
            None => {
                let (img, ms) =
                    compiled.next().unwrap_or_else(|| Err(CudaError::Compile("a module was not compiled".into())))?;
                if let Some(dir) = cache_dir {
                    // Best effort: a read-only or full disk must not stop the engine.
                    let _ = store(dir, &cache_file(dir, &l.module, l.key, kind), &img);
                }
                out.push(Resolved { module: l.module, image: img, from_cache: false, ms, key: l.key });
            }
        }
    }
    Ok(out)
}

/// Fills `dir` with every module compiled for `arch` (modules already there are kept), with
/// no GPU: what `baton kernels build` runs to ship compiled kernels with an image. Returns
/// a report per module.
pub fn build_cache(arch: &str, dir: &Path) -> Result<Vec<ModuleReport>, CudaError> {
    let kind = ImageKind::for_arch(arch)?;
    nvrtc_present()?;
    std::fs::create_dir_all(dir).map_err(|e| CudaError::Cache { path: dir.to_path_buf(), message: e.to_string() })?;
    let resolved = resolve(look_up(modules(), arch, kind, Some(dir)), arch, kind, Some(dir))?;
    let mut reports = Vec::with_capacity(resolved.len());
    for Resolved { module, image: img, from_cache, ms, key } in resolved {
        let path = cache_file(dir, &module, key, kind);
        if !path.is_file() {
            return Err(CudaError::Cache { path, message: "could not be written".into() });
        }
        let missing = missing_kernels(&module, &img, kind);
        if !missing.is_empty() {
            return Err(CudaError::Compile(format!("{} lacks kernel(s) the device loads: {missing:?}", module.name())));
        }
        reports.push(ModuleReport { name: module.name(), from_cache, ms, bytes: img.len() });
    }
    Ok(reports)
}

/// A module and its image loaded into a context.
pub(crate) type LoadedModule = (Module, Arc<CudaModule>);

/// Loads the modules `needs` names for `arch` into `ctx`, each from `cache_dir` when it holds
/// this exact build, the rest compiled in parallel (and cached). Returns the modules in
/// [`KernelNeeds::modules`]' order, each with a report.
pub(crate) fn load_modules(
    ctx: &Arc<CudaContext>,
    arch: &str,
    cache_dir: Option<&Path>,
    needs: &KernelNeeds,
) -> Result<(Vec<LoadedModule>, Vec<ModuleReport>), CudaError> {
    nvrtc_present()?;
    let kind = ImageKind::for_arch(arch)?;
    let resolved = resolve(look_up(needs.modules(), arch, kind, cache_dir), arch, kind, cache_dir)?;
    let mut loaded = Vec::with_capacity(resolved.len());
    let mut reports = Vec::with_capacity(resolved.len());
    for Resolved { module, image: img, from_cache, ms, key } in resolved {
        let t0 = Instant::now();
        let bytes = img.len();
        let (m, from_cache, ms) = match ctx.load_module(kind.to_ptx(img)?) {
            Ok(m) => (m, from_cache, ms),
            // A cached image the driver refuses (e.g. from another driver's toolchain) is
            // compiled again here, and replaces the entry.
            Err(_) if from_cache => {
                let t1 = Instant::now();
                let img = nvrtc_compile(&module.source(), &module.name(), arch, kind)?;
                if let Some(dir) = cache_dir {
                    let _ = store(dir, &cache_file(dir, &module, key, kind), &img);
                }
                (ctx.load_module(kind.to_ptx(img)?)?, false, t1.elapsed().as_secs_f64() * 1e3)
            }
            Err(e) => return Err(e.into()),
        };
        loaded.push((module, m));
        reports.push(ModuleReport {
            name: module.name(),
            from_cache,
            ms: ms + t0.elapsed().as_secs_f64() * 1e3,
            bytes,
        });
    }
    Ok((loaded, reports))
}

fn store(dir: &Path, path: &Path, image: &[u8]) -> Result<(), CudaError> {
    let err = |message: String| CudaError::Cache { path: dir.to_path_buf(), message };
    std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, image).map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn cache_key_depends_on_source_arch_and_is_stable() {
        let a = cache_key("x", "sm_90a", "13.0");
        assert_eq!(a, cache_key("x", "sm_90a", "13.0"));
        assert_ne!(a, cache_key("y", "sm_90a", "13.0"));
        assert_ne!(a, cache_key("x", "sm_80", "13.0"));
        assert_ne!(a, cache_key("x", "compute_90a", "13.0"), "PTX and CUBIN entries differ");
        assert_ne!(a, cache_key("x", "sm_90a", "13.1"));
    }

    #[test]
    fn every_module_has_its_own_key_and_file() {
        let keys: HashSet<u128> = modules().iter().map(|m| cache_key(&m.source(), "sm_90a", "13.0")).collect();
        assert_eq!(keys.len(), modules().len(), "two modules share a cache key");
        let m = Module::part(Family::Attention, 128);
        assert_eq!(m.name(), "attention_hd128");
        let f = cache_file(Path::new("/c"), &m, 0xab, ImageKind::Cubin);
        assert_eq!(f, Path::new("/c/attention_hd128-000000000000000000000000000000ab.cubin"));
    }

    #[test]
    fn architectures_pick_the_image_kind() {
        assert_eq!(device_arch(9, 0), "sm_90a");
        assert_eq!(device_arch(8, 9), "sm_89");
        assert_eq!(device_arch(10, 0), "sm_100a");
        assert_eq!(ImageKind::for_arch("sm_90a").expect("sm"), ImageKind::Cubin);
        assert_eq!(ImageKind::for_arch("sm_80").expect("sm"), ImageKind::Cubin);
        assert_eq!(ImageKind::for_arch("compute_90a").expect("compute"), ImageKind::Ptx);
        for bad in ["", "sm_", "90a", "sm_9x", "compute_", "hopper"] {
            assert!(ImageKind::for_arch(bad).is_err(), "{bad:?} accepted");
        }
        // A minimal ELF64 header: 2 section headers of 64 bytes at offset 64.
        let mut elf = vec![0u8; 192];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28] = 64;
        elf[0x3A] = 64;
        elf[0x3C] = 2;
        assert!(ImageKind::Cubin.plausible(&elf));
        assert!(!ImageKind::Cubin.plausible(&elf[..191]), "truncated");
        assert!(!ImageKind::Cubin.plausible(b"\x7fELF"), "truncated header");
        assert!(!ImageKind::Cubin.plausible(&[b'/'; 200]));
        assert!(ImageKind::Ptx.plausible(b"//\n// Generated by NVIDIA NVVM Compiler\n.version 9.0"));
        assert!(!ImageKind::Ptx.plausible(b"//\0"));
        assert!(!ImageKind::Ptx.plausible(b""));
    }

    #[test]
    fn instance_lines_are_recognised() {
        let att = Family::Attention.instance_macros();
        assert_eq!(instance_param("ATT_VARIANTS(128)", att), Some(128));
        assert_eq!(instance_param("ATT_TC_VARIANTS(16)", att), Some(16));
        assert_eq!(instance_param("PF_INSTANCE(64, 8)", Family::Prefill.instance_macros()), Some(64));
        assert_eq!(instance_param("GEMV_INSTANCE(16, 4, 8)", Family::Gemv.instance_macros()), Some(16));
        assert_eq!(instance_param("GEMV_FP8_INSTANCE(8, 8, 2)", Family::GemvFp8.instance_macros()), Some(8));
        assert_eq!(instance_param("GEMV_FP8_INSTANCE(8, 8, 2)", Family::Gemv.instance_macros()), None);
        assert_eq!(instance_param("#define GEMV_INSTANCE(MAXM, NW, U) \\", Family::Gemv.instance_macros()), None);
        // Definitions and indented uses inside a macro stay in every module.
        assert_eq!(instance_param("#define ATT_VARIANTS(HD)       \\", att), None);
        assert_eq!(instance_param("    ATT_INSTANCE(HD, 4, 4, 4, 0)  \\", att), None);
        assert_eq!(instance_param("ATT_VARIANTS_X(1)", att), None);
    }

    #[test]
    fn each_part_keeps_only_its_own_instances() {
        for (family, parts, mac) in [
            (Family::Attention, ATTN_HEAD_DIMS.to_vec(), "ATT_VARIANTS"),
            (Family::Attention, ATTN_HEAD_DIMS.to_vec(), "ATT_TC_VARIANTS"),
        ] {
            for &p in &parts {
                let src = Module::part(family, p).source();
                for &q in &parts {
                    let line = format!("\n{mac}({q})\n");
                    assert_eq!(src.contains(&line), p == q, "{mac}({q}) in the {p} module of {family:?}");
                }
            }
        }
        // The skinny GEMMs: one instance line a module, the variant-th of its rows of x.
        for (family, mac, variants) in [
            (Family::Gemv, "GEMV_INSTANCE(", GEMV_VARIANTS.len()),
            (Family::GemvFp8, "GEMV_FP8_INSTANCE(", GEMV_FP8_VARIANTS.len()),
        ] {
            let all: Vec<String> = Family::files(family)
                .iter()
                .flat_map(|f| f.lines())
                .filter(|l| l.starts_with(mac))
                .map(str::to_string)
                .collect();
            assert_eq!(all.len(), GEMV_MAX_MS.len() * variants, "{family:?}");
            for (pi, &p) in GEMV_MAX_MS.iter().enumerate() {
                for v in 0..variants {
                    let src = Module::variant(family, p, v).source();
                    let kept: Vec<&str> = src.lines().filter(|l| l.starts_with(mac)).collect();
                    assert_eq!(kept, [all[pi * variants + v].as_str()], "{family:?} m{p} v{v}");
                    assert!(kept[0].starts_with(&format!("{mac}{p},")));
                }
            }
        }
        for &hd in &PREFILL_HEAD_DIMS {
            let src = Module::part(Family::Prefill, hd).source();
            let count = src.lines().filter(|l| l.starts_with("PF_INSTANCE(")).count();
            assert_eq!(count, super::super::PREFILL_WARPS.len());
            assert!(
                src.lines()
                    .filter(|l| l.starts_with("PF_INSTANCE("))
                    .all(|l| l.starts_with(&format!("PF_INSTANCE({hd},")))
            );
        }
        // Whole families are their files verbatim after the prelude.
        let el = Module::whole(Family::Elementwise).source();
        assert!(el.starts_with(PRELUDE));
        assert!(el.contains("void embed_f32(") && el.contains("void fill_counter_bf16("));
        assert!(!el.contains("void rope_qkv_write_kv_bf16("));
        let rope = Module::whole(Family::Rope).source();
        assert!(rope.contains("void rope_qkv_write_kv_bf16(") && !rope.contains("void rope_write_kv_fp8("));
        assert!(Module::whole(Family::RopeFp8).source().contains("void rope_qkv_qknorm_write_kv_fp8("));
        assert!(Module::whole(Family::RopeAmax).source().contains("void rope_write_kv_amax("));
        // The experts', extended attention's and FP8 weights' kernels are modules of their own.
        assert!(!el.contains("void moe_route_f32(") && !el.contains("void fp8_dequant_bf16("));
        assert!(Module::whole(Family::Moe).source().contains("void moe_route_f32("));
        assert!(Module::whole(Family::AttentionExt).source().contains("void paged_attention_ext_d1("));
        assert!(Module::whole(Family::Fp8).source().contains("void fp8_dequant_bf16("));
    }

    #[test]
    fn modules_are_listed_once_and_cover_every_family() {
        let all = modules();
        let names: HashSet<String> = all.iter().map(Module::name).collect();
        assert_eq!(names.len(), all.len());
        let gemv = GEMV_MAX_MS.len() * (GEMV_VARIANTS.len() + GEMV_FP8_VARIANTS.len());
        let prefill = PREFILL_HEAD_DIMS.len() * PREFILL_WARPS.len() + 1;
        assert_eq!(all.len(), 8 + gemv + ATTN_MODULES * ATTN_HEAD_DIMS.len() + prefill);
        let families = [
            Family::Elementwise,
            Family::Rope,
            Family::RopeFp8,
            Family::RopeAmax,
            Family::Moe,
            Family::AttentionExt,
            Family::Fp8,
            Family::Sampling,
            Family::Gemv,
            Family::GemvFp8,
        ];
        for f in families.into_iter().chain([Family::Attention, Family::Prefill]) {
            assert!(all.iter().any(|m| m.family == f), "{f:?} has no module");
        }
        for m in &all {
            assert!(!m.source().contains("#include"), "{}: kernels must stay self-contained", m.name());
        }
    }

    #[test]
    fn a_model_loads_only_the_modules_it_runs() {
        let names = |n: &KernelNeeds| n.modules().iter().map(Module::name).collect::<Vec<_>>();
        assert_eq!(KernelNeeds::all().modules(), modules());
        assert_eq!(KernelNeeds::default(), KernelNeeds::all());
        // A dense bf16 model of head_dim 128 (Llama-3.1-8B).
        let dense = KernelNeeds::model(128, false, false);
        assert_eq!(
            names(&dense),
            [
                "elementwise",
                "rope_kv",
                "rope_kv_fp8",
                "rope_kv_amax",
                "attention_ext",
                "sampling",
                "gemv_m8_v0",
                "gemv_m8_v1",
                "gemv_m8_v2",
                "gemv_m8_v3",
                "gemv_m16_v0",
                "gemv_m16_v1",
                "gemv_m16_v2",
                "gemv_m16_v3",
                "attention_hd128_v0",
                "attention_hd128_v1",
                "attention_hd128_v2",
                "attention_hd128_v3",
                "prefill_hd128_v0",
                "prefill_hd128_v1",
                "prefill_hd128_v2"
            ]
        );
        // Experts and FP8 weights add their modules, and only those.
        let moe_fp8 = KernelNeeds::model(128, true, true);
        let extra: Vec<String> = names(&moe_fp8).into_iter().filter(|n| !names(&dense).contains(n)).collect();
        let fp8_gemv = (0..8).map(|i| format!("gemv_fp8_m{}_v{}", [8, 16][i / 4], i % 4));
        assert_eq!(extra, ["moe".to_string(), "fp8".to_string()].into_iter().chain(fp8_gemv).collect::<Vec<_>>());
        // Gemma-3's head_dim 256; a head_dim with no modules (Phi-3's 96) loads no attention module.
        assert!(names(&KernelNeeds::model(256, false, false)).contains(&"prefill_hd256_v1".to_string()));
        let odd = names(&KernelNeeds::model(96, false, false));
        assert!(odd.iter().all(|n| !n.starts_with("attention_hd") && !n.starts_with("prefill_hd")), "{odd:?}");
        assert!(odd.contains(&"attention_ext".to_string()), "the extended attention serves any head_dim");
    }

    /// The instance lists of the `.cu` files against the Rust variant tables (every module's
    /// instances together are the family's).
    #[test]
    fn instance_lists_match_the_variant_tables() {
        // Each family or part once (a part cut by variant as the whole part).
        let mut parts: Vec<Module> = Vec::new();
        for m in modules() {
            let whole_part = Module { variant: None, ..m };
            if !parts.contains(&whole_part) {
                parts.push(whole_part);
            }
        }
        let src: String = parts.iter().map(Module::source).collect::<Vec<_>>().join("\n");
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect::<Vec<_>>();
        use super::super::paged_attention::{ATTN_VARIANTS, AttnKind};
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .filter(|v| v.kind == AttnKind::Registers)
            .map(|v| format!("{}, {}, {}, {}", v.warps, v.unroll, v.max_group, u8::from(v.prefetch)))
            .collect();
        // Each attention module carries the (identical) macro definition once.
        assert_eq!(cuda, vec![rust; ATTN_HEAD_DIMS.len()].concat());
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_TC_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .skip_while(|v| v.kind == AttnKind::Registers)
            .take_while(|v| v.kind != AttnKind::Stream)
            .map(|v| {
                assert_eq!(v.kind, AttnKind::TensorCore, "register variants come first");
                format!("{}, {}, {}", v.warps, v.unroll, v.max_group)
            })
            .collect();
        assert_eq!(cuda, vec![rust; ATTN_HEAD_DIMS.len()].concat());
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_ST_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .skip_while(|v| v.kind != AttnKind::Stream)
            .map(|v| {
                assert_eq!(v.kind, AttnKind::Stream, "the streaming variants come last");
                format!("{}, {}, {}", v.warps, v.unroll, v.max_group)
            })
            .collect();
        assert_eq!(cuda, vec![rust; ATTN_HEAD_DIMS.len()].concat());
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_TC_FP8_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        let fp8_list = |kind: AttnKind| -> Vec<String> {
            super::super::paged_attention::ATTN_FP8_VARIANTS
                .iter()
                .filter(|v| v.kind == kind)
                .map(|v| format!("{}, {}, {}", v.warps, v.unroll, v.max_group))
                .collect()
        };
        assert_eq!(cuda, vec![fp8_list(AttnKind::TensorCore); ATTN_HEAD_DIMS.len()].concat());
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_ST_FP8_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        assert_eq!(cuda, vec![fp8_list(AttnKind::Stream); ATTN_HEAD_DIMS.len()].concat());
        // The FP8 table lists its tensor-core variants first.
        let kinds: Vec<AttnKind> = super::super::paged_attention::ATTN_FP8_VARIANTS.iter().map(|v| v.kind).collect();
        assert!(kinds.windows(2).all(|w| w[0] == w[1] || w[1] == AttnKind::Stream), "{kinds:?}");
        // The skinny GEMMs per family: the FP8 modules carry gemv.cu's macro definitions too.
        let of = |f: Family| -> String {
            modules().iter().filter(|m| m.family == f).map(Module::source).collect::<Vec<_>>().join("\n")
        };
        let (gemv, gemv_fp8) = (of(Family::Gemv), of(Family::GemvFp8));
        assert!(!gemv_fp8.lines().any(|l| l.starts_with("GEMV_INSTANCE(")), "the FP8 modules instantiate bf16 kernels");
        assert!(!gemv.contains("GEMV_FP8_"), "the bf16 modules hold FP8 kernels");
        // Each module's one instance line, in module order: every rows-of-x × variant.
        let instances = |src: &str, mac: &str| -> Vec<String> {
            src.lines().filter_map(|l| l.strip_prefix(mac)).map(|l| l.trim_end_matches(')').to_string()).collect()
        };
        let rows_variants = |variants: Vec<(u32, u32)>| -> Vec<String> {
            GEMV_MAX_MS.iter().flat_map(|m| variants.iter().map(move |(w, u)| format!("{m}, {w}, {u}"))).collect()
        };
        let rust = rows_variants(GEMV_VARIANTS.iter().map(|v| (v.warps, v.unroll)).collect());
        assert_eq!(instances(&gemv, "GEMV_INSTANCE("), rust);
        let rust = rows_variants(GEMV_FP8_VARIANTS.iter().map(|v| (v.warps, v.unroll)).collect());
        assert_eq!(instances(&gemv_fp8, "GEMV_FP8_INSTANCE("), rust);
        // The prefill instances: every head_dim × CTA size, in the function table's order.
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("PF_INSTANCE("))
            .map(|l| l.trim_end_matches(')').to_string())
            .collect();
        use super::super::prefill::PREFILL_WARPS;
        let rust: Vec<String> =
            PREFILL_HEAD_DIMS.iter().flat_map(|hd| PREFILL_WARPS.iter().map(move |w| format!("{hd}, {w}"))).collect();
        assert_eq!(cuda, rust);
    }
}
