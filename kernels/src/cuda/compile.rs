//! Run-time compilation of the CUDA C sources with NVRTC, with an on-disk PTX cache.
//!
//! The module is one translation unit: the shared prelude followed by every `.cu` file, all
//! embedded in the binary with `include_str!` so the binary needs no source tree. The cache
//! key hashes that text, the architecture, the flags and the NVRTC version; a cache entry is
//! written to a temporary name and renamed into place, so a concurrent reader never sees a
//! partial file. A cache that cannot be read or written is bypassed with a warning-free
//! fallback to compiling (the cache is an optimisation, never a requirement).

use super::CudaError;
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The whole module's source, in dependency order.
pub(crate) fn module_source() -> String {
    [
        include_str!("../../cuda/prelude.cuh"),
        include_str!("../../cuda/elementwise.cu"),
        include_str!("../../cuda/rope_kv.cu"),
        include_str!("../../cuda/attention.cu"),
        include_str!("../../cuda/gemv.cu"),
        include_str!("../../cuda/prefill.cu"),
        include_str!("../../cuda/sampling.cu"),
        include_str!("../../cuda/util.cu"),
    ]
    .join("\n")
}

/// NVRTC flags besides the architecture. Precise division and square root stay on; the
/// kernels call the fast intrinsics (`__expf`) explicitly where they want them.
const FLAGS: &[&str] = &["--std=c++17", "--device-as-default-execution-space"];

fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: the caller checked that NVRTC is loadable; the call only writes two ints.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    format!("{major}.{minor} ({status:?})")
}

fn cache_key(src: &str, arch: &str, nvrtc: &str) -> u128 {
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

/// Compiles the module for `arch` (e.g. `compute_90a`) to PTX without touching a GPU: NVRTC
/// alone is enough, so this also checks the sources on a machine with no device.
pub fn compile_ptx(arch: &str) -> Result<String, CudaError> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::MissingLibrary("nvrtc"));
    }
    let mut options: Vec<String> = FLAGS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    let opts = CompileOptions { options, name: Some("baton_kernels.cu".into()), ..Default::default() };
    let ptx = compile_ptx_with_opts(module_source(), opts).map_err(|e| CudaError::Compile(describe(&e)))?;
    Ok(ptx.to_src())
}

/// Loads the module for `arch` into `ctx`, from `cache_dir` when it holds this exact build.
/// Returns the module and whether it came from the cache.
pub(crate) fn load_module(
    ctx: &Arc<CudaContext>,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<(Arc<CudaModule>, bool), CudaError> {
    // SAFETY: only tries to dlopen the library (nvrtc_version below needs it loaded).
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::MissingLibrary("nvrtc"));
    }
    let src = module_source();
    let key = cache_key(&src, arch, &nvrtc_version());
    if let Some(dir) = cache_dir {
        let path = cache_file(dir, key);
        if let Ok(ptx) = std::fs::read_to_string(&path)
            && !ptx.is_empty()
            && !ptx.contains('\0')
        {
            return Ok((ctx.load_module(Ptx::from_src(ptx))?, true));
        }
    }
    let text = compile_ptx(arch)?;
    if let Some(dir) = cache_dir {
        // Best effort: a read-only or full disk must not stop the engine.
        let _ = store(dir, key, &text);
    }
    Ok((ctx.load_module(Ptx::from_src(text))?, false))
}

/// The kernel cache file for `key` under `dir`.
fn cache_file(dir: &Path, key: u128) -> PathBuf {
    dir.join(format!("{key:032x}.ptx"))
}

fn describe(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

fn store(dir: &Path, key: u128, ptx: &str) -> Result<(), CudaError> {
    let err = |message: String| CudaError::Cache { path: dir.to_path_buf(), message };
    std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    let tmp = dir.join(format!(".{key:032x}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, ptx).map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, cache_file(dir, key)).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_source_arch_and_is_stable() {
        let a = cache_key("x", "compute_90a", "13.0");
        assert_eq!(a, cache_key("x", "compute_90a", "13.0"));
        assert_ne!(a, cache_key("y", "compute_90a", "13.0"));
        assert_ne!(a, cache_key("x", "compute_80", "13.0"));
        assert_ne!(a, cache_key("x", "compute_90a", "13.1"));
    }

    #[test]
    fn module_source_holds_every_kernel() {
        let src = module_source();
        for k in [
            "embed_f32",
            "rms_norm_f32",
            "add_rms_norm_f32",
            "gather_rows_f32",
            "silu_mul_bf16",
            "bias_add_bf16",
            "copy_cols_bf16",
            "gather_rows_bf16",
            "bf16_to_f32",
            "f32_to_bf16",
            "rope_write_kv_bf16",
            "rope_qkv_write_kv_bf16",
            "sample_rows",
        ] {
            assert!(src.contains(&format!("void {k}(")), "{k} missing");
        }
        for hd in [16, 32, 64, 128] {
            assert!(src.contains(&format!("ATT_VARIANTS({hd})")));
        }
        // The Rust table and the CUDA instantiations list the same variants, in order.
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        use super::super::paged_attention::{ATTN_VARIANTS, AttnKind};
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .filter(|v| v.kind == AttnKind::Registers)
            .map(|v| format!("{}, {}, {}, {}", v.warps, v.unroll, v.max_group, u8::from(v.prefetch)))
            .collect();
        assert_eq!(cuda, rust);
        // The tensor-core variants (warps, stages, heads per CTA), after the register ones.
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ATT_TC_INSTANCE(HD, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .skip_while(|v| v.kind == AttnKind::Registers)
            .map(|v| {
                assert_eq!(v.kind, AttnKind::TensorCore, "register variants come first");
                format!("{}, {}, {}", v.warps, v.unroll, v.max_group)
            })
            .collect();
        assert_eq!(cuda, rust);
        for hd in [16, 32, 64, 128] {
            assert!(src.contains(&format!("ATT_TC_VARIANTS({hd})")));
        }
        // The same for the gemv variants, instantiated for up to 8 and up to 16 rows.
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("GEMV_INSTANCE(MAXM, "))
            .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
            .collect();
        let rust: Vec<String> =
            super::super::GEMV_VARIANTS.iter().map(|v| format!("{}, {}", v.warps, v.unroll)).collect();
        assert_eq!(cuda, rust);
        for max_m in [8, 16] {
            assert!(src.contains(&format!("GEMV_VARIANTS({max_m})")));
        }
        // The prefill instances: every head_dim × CTA size, in the function table's order.
        let cuda: Vec<String> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("PF_INSTANCE("))
            .map(|l| l.trim_end_matches(')').to_string())
            .collect();
        use super::super::prefill::{PREFILL_HEAD_DIMS, PREFILL_WARPS};
        let rust: Vec<String> =
            PREFILL_HEAD_DIMS.iter().flat_map(|hd| PREFILL_WARPS.iter().map(move |w| format!("{hd}, {w}"))).collect();
        assert_eq!(cuda, rust);
        assert!(!src.contains("#include"), "kernels must stay self-contained");
    }
}
