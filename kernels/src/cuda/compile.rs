//! Run-time compilation of the kernel modules ([`Module`], cut in `sources.rs`) with NVRTC,
//! in parallel, with an on-disk cache of the compiled images.
//!
//! For an `sm_*` architecture NVRTC emits a CUBIN (machine code: the driver loads it with no
//! PTX JIT); for a `compute_*` one, PTX. Modules missing from the cache are compiled on one
//! thread each.
//!
//! The cache key of a module hashes its source text, the architecture, the flags and the NVRTC
//! version; an entry is written to a temporary name and renamed into place, so a concurrent
//! reader never sees a partial file. A cache entry that cannot be read, is not a CUBIN/PTX, or
//! that the driver refuses is compiled again (and rewritten, best effort); a cache that cannot
//! be written is bypassed (the cache is an optimisation, never a requirement).
//! [`build_cache`] fills a cache directory for an architecture without a GPU, so an image or a
//! carry can bring compiled kernels along.

use super::CudaError;
use super::sources::{KernelNeeds, Module, modules};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

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
    use super::super::sources::Family;
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
}
