//! Which cuBLASLt algorithm configurations a shape is timed over ([`LtSearch`]): the heuristic's
//! first few (what [`super::lt::LtGemm`] has always timed), those with split-K variants added,
//! or every configuration the library accepts (ids × tiles × stages × split-K × swizzle ×
//! custom options), for benchmarks.
//!
//! Why split-K matters here. A decode product of 32-256 rows is a short, wide GEMM: in cuBLAS's
//! column-major view its M is the weights' rows (4,096 for the o projection) and its N the
//! batch. A 128 × 64 tile gives 32 CTAs at N = 64, a quarter of an H100's 132 SMs, so unless
//! the reduction is split, three quarters of the SMs never pull weights. The heuristic's first
//! picks are not always split.
//!
//! Invariants: every configuration returned passed `cublasLtMatmulAlgoCheck` for the plan's
//! descriptors and needs at most the workspace given; the heuristic's own results come first
//! and in its order, so index 0 is always the heuristic's first choice.

use super::CudaError;
use cudarc::cublaslt::sys;

/// A configuration's workspace limit and the descriptors it is checked against.
pub(super) struct LtDescs {
    pub handle: sys::cublasLtHandle_t,
    pub desc: sys::cublasLtMatmulDesc_t,
    pub a: sys::cublasLtMatrixLayout_t,
    pub b: sys::cublasLtMatrixLayout_t,
    pub d: sys::cublasLtMatrixLayout_t,
    pub workspace: usize,
}

/// The configurations a shape's algorithm is chosen among.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LtSearch {
    /// The heuristic's first `n` results.
    Heuristic(usize),
    /// The heuristic's first `n`, each also with the split-K counts [`SPLIT_K`] under every
    /// reduction scheme it supports.
    SplitK(usize),
    /// The heuristic's first 16, then every configuration of every algorithm id, up to `n` in
    /// all.
    Exhaustive(usize),
}

impl std::fmt::Display for LtSearch {
    /// `heuristic12`, `splitk12`, `exhaustive1500`: how benchmarks name a search.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Heuristic(n) => write!(f, "heuristic{n}"),
            Self::SplitK(n) => write!(f, "splitk{n}"),
            Self::Exhaustive(n) => write!(f, "exhaustive{n}"),
        }
    }
}

/// Split-K counts tried beside each heuristic result ([`LtSearch::SplitK`]) and in the
/// exhaustive search.
pub const SPLIT_K: [u32; 6] = [2, 3, 4, 6, 8, 12];

/// What one configuration is, read back from cuBLASLt (for benchmark tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LtAlgoInfo {
    /// `CUBLASLT_ALGO_CONFIG_ID`.
    pub id: u32,
    /// `CUBLASLT_ALGO_CONFIG_TILE_ID` (`cublasLtMatmulTile_t`).
    pub tile: u32,
    /// `CUBLASLT_ALGO_CONFIG_STAGES_ID`.
    pub stages: u32,
    /// `CUBLASLT_ALGO_CONFIG_SPLITK_NUM` (1: not split).
    pub split_k: u32,
    /// `CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME`.
    pub reduction: u32,
    /// `CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING`.
    pub swizzle: u32,
    /// `CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION`.
    pub custom: u32,
    /// `CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID`.
    pub cluster: u32,
    /// Workspace bytes it needs.
    pub workspace: usize,
    /// Whether the heuristic returned it (else a variant or an enumerated configuration).
    pub heuristic: bool,
}

impl std::fmt::Display for LtAlgoInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "id{} tile{} st{} sk{} red{} sw{} c{} cl{}{}",
            self.id,
            self.tile,
            self.stages,
            self.split_k,
            self.reduction,
            self.swizzle,
            self.custom,
            self.cluster,
            if self.heuristic { " (heur)" } else { "" }
        )
    }
}

type Algo = sys::cublasLtMatmulAlgo_t;
type Found = sys::cublasLtMatmulHeuristicResult_t;
use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
use sys::cublasLtMatmulAlgoConfigAttributes_t as Cfg;

fn lt_err(what: &str, e: sys::cublasStatus_t) -> CudaError {
    CudaError::BlasLt(format!("{what}: {e:?}"))
}

/// A 32-bit configuration attribute of `algo` (0 when the library does not report it).
fn config(algo: &Algo, attr: Cfg) -> u32 {
    let mut v = 0u32;
    let mut written = 0usize;
    // SAFETY: `algo` is an initialized algorithm; the buffer is 4 bytes, as the attribute.
    let _ =
        unsafe { sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, (&mut v as *mut u32).cast(), 4, &mut written) };
    v
}

fn set_config(algo: &mut Algo, attr: Cfg, v: u32) -> Result<(), CudaError> {
    // SAFETY: as `config`; the value is copied by the call.
    unsafe { sys::cublasLtMatmulAlgoConfigSetAttribute(algo, attr, (&v as *const u32).cast(), 4) }
        .result()
        .map_err(|e| lt_err("cublasLtMatmulAlgoConfigSetAttribute", e.0))
}

/// A 32-bit capability of `algo` (0 when not reported).
fn cap(algo: &Algo, attr: Cap) -> u32 {
    let mut v = 0u32;
    let mut written = 0usize;
    // SAFETY: as `config`.
    let _ = unsafe { sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, (&mut v as *mut u32).cast(), 4, &mut written) };
    v
}

/// A capability that is an array of 32-bit ids (tiles, stages); empty when none is reported.
fn cap_ids(algo: &Algo, attr: Cap) -> Vec<u32> {
    let mut bytes = 0usize;
    // SAFETY: a null buffer of size 0 asks only for the size.
    let _ = unsafe { sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, std::ptr::null_mut(), 0, &mut bytes) };
    let mut ids = vec![0u32; bytes / 4];
    if ids.is_empty() {
        return ids;
    }
    let mut written = 0usize;
    // SAFETY: the buffer holds `bytes` bytes.
    let ok = unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(algo, attr, ids.as_mut_ptr().cast(), ids.len() * 4, &mut written)
    };
    if ok != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Vec::new();
    }
    ids.truncate(written / 4);
    ids
}

/// The configuration read back from `found`.
pub(super) fn describe(found: &Found, heuristic: bool) -> LtAlgoInfo {
    let a = &found.algo;
    LtAlgoInfo {
        id: config(a, Cfg::CUBLASLT_ALGO_CONFIG_ID),
        tile: config(a, Cfg::CUBLASLT_ALGO_CONFIG_TILE_ID),
        stages: config(a, Cfg::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        split_k: config(a, Cfg::CUBLASLT_ALGO_CONFIG_SPLITK_NUM).max(1),
        reduction: config(a, Cfg::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
        swizzle: config(a, Cfg::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        custom: config(a, Cfg::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
        cluster: config(a, Cfg::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        workspace: found.workspaceSize,
        heuristic,
    }
}

/// `algo` checked against the descriptors: its result (workspace, waves) when the library
/// accepts it within the workspace limit.
fn check(d: &LtDescs, algo: &Algo) -> Option<Found> {
    // SAFETY: a plain C struct of integers and bytes, for which all zeros is valid.
    let mut found: Found = unsafe { std::mem::zeroed() };
    // SAFETY: every descriptor is live; `found` is written by the call.
    let status = unsafe { sys::cublasLtMatmulAlgoCheck(d.handle, d.desc, d.a, d.b, d.d, d.d, algo, &mut found) };
    if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        || found.state != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        || found.workspaceSize > d.workspace
    {
        return None;
    }
    found.algo = *algo;
    Some(found)
}

/// The heuristic's first `n` results that it marks usable.
pub(super) fn heuristic(d: &LtDescs, n: usize) -> Result<Vec<Found>, CudaError> {
    use cudarc::cublaslt::result;
    let pref = result::create_matmul_pref().map_err(|e| CudaError::BlasLt(format!("{e:?}")))?;
    let ws = d.workspace;
    // SAFETY: a plain C struct of integers and bytes, for which all zeros is valid.
    let zero: Found = unsafe { std::mem::zeroed() };
    let mut found = vec![zero; n.max(1)];
    let mut count = 0i32;
    // SAFETY: every descriptor is live; `found` holds `n` results.
    let status = unsafe {
        result::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws as *const usize).cast(),
            std::mem::size_of::<usize>(),
        )
        .and_then(|()| {
            sys::cublasLtMatmulAlgoGetHeuristic(
                d.handle,
                d.desc,
                d.a,
                d.b,
                d.d,
                d.d,
                pref,
                found.len() as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()
        })
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { result::destroy_matmul_pref(pref) };
    status.map_err(|e| CudaError::BlasLt(format!("{e:?}")))?;
    Ok(found
        .into_iter()
        .take(count.max(0) as usize)
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .collect())
}

/// Reduction schemes to pair with a split-K count: each bit of the algorithm's mask (or the
/// default, 0, when it reports none).
fn reductions(algo: &Algo) -> Vec<u32> {
    let mask = cap(algo, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
    let bits: Vec<u32> = [1u32, 2, 4].into_iter().filter(|b| mask & b != 0).collect();
    if bits.is_empty() { vec![0] } else { bits }
}

/// `base` with each split-K count of [`SPLIT_K`] under each reduction scheme, those the library
/// accepts.
fn split_variants(d: &LtDescs, base: &Algo, out: &mut Vec<Found>, limit: usize) {
    if cap(base, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) == 0 {
        return;
    }
    for red in reductions(base) {
        for sk in SPLIT_K {
            if out.len() >= limit {
                return;
            }
            let mut a = *base;
            if set_config(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, sk).is_err()
                || set_config(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, red).is_err()
            {
                continue;
            }
            if let Some(f) = check(d, &a) {
                out.push(f);
            }
        }
    }
}

/// The configurations `search` asks for, the heuristic's first (in its order) before the rest;
/// `types` = (compute, scale, A, B, C, D) for the algorithm ids of the exhaustive search.
pub(super) fn candidates(
    d: &LtDescs,
    search: LtSearch,
    types: (sys::cublasComputeType_t, sys::cudaDataType, sys::cudaDataType, sys::cudaDataType, sys::cudaDataType),
) -> Result<Vec<(Found, bool)>, CudaError> {
    let n = match search {
        LtSearch::Heuristic(n) | LtSearch::SplitK(n) => n,
        LtSearch::Exhaustive(_) => 16,
    };
    let heur = heuristic(d, n)?;
    let mut out: Vec<(Found, bool)> = heur.iter().map(|f| (*f, true)).collect();
    match search {
        LtSearch::Heuristic(_) => {}
        LtSearch::SplitK(_) => {
            let mut extra = Vec::new();
            for f in &heur {
                // Only unsplit results are bases: a split one's variants are other counts of
                // the same kernel, which its unsplit sibling (if any) covers.
                if config(&f.algo, Cfg::CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1 {
                    split_variants(d, &f.algo, &mut extra, usize::MAX);
                }
            }
            out.extend(extra.into_iter().map(|f| (f, false)));
        }
        LtSearch::Exhaustive(limit) => {
            let mut extra = Vec::new();
            exhaustive(d, types, &mut extra, limit.saturating_sub(out.len()))?;
            out.extend(extra.into_iter().map(|f| (f, false)));
        }
    }
    Ok(out)
}

/// Every configuration of every algorithm id (up to `limit`), as NVIDIA's auto-tuning sample
/// walks them: tiles × stages × custom options × swizzle, each unsplit and split.
fn exhaustive(
    d: &LtDescs,
    (compute, scale, ab, c, dt): (
        sys::cublasComputeType_t,
        sys::cudaDataType,
        sys::cudaDataType,
        sys::cudaDataType,
        sys::cudaDataType,
    ),
    out: &mut Vec<Found>,
    limit: usize,
) -> Result<(), CudaError> {
    let mut ids = vec![0i32; 256];
    let mut count = 0i32;
    // SAFETY: `ids` holds 256 ids.
    unsafe {
        sys::cublasLtMatmulAlgoGetIds(
            d.handle,
            compute,
            scale,
            ab,
            ab,
            c,
            dt,
            ids.len() as i32,
            ids.as_mut_ptr(),
            &mut count,
        )
    }
    .result()
    .map_err(|e| lt_err("cublasLtMatmulAlgoGetIds", e.0))?;
    ids.truncate(count.max(0) as usize);
    for id in ids {
        // SAFETY: all zeros is a valid value of the opaque struct, which Init overwrites.
        let mut base: Algo = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is written by the call.
        let ok = unsafe { sys::cublasLtMatmulAlgoInit(d.handle, compute, scale, ab, ab, c, dt, id, &mut base) };
        if ok != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            continue;
        }
        let tiles = or_undefined(cap_ids(&base, Cap::CUBLASLT_ALGO_CAP_TILE_IDS));
        let stages = or_undefined(cap_ids(&base, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS));
        let customs = cap(&base, Cap::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX);
        let swizzles = cap(&base, Cap::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT);
        for &tile in &tiles {
            for &st in &stages {
                for custom in 0..=customs {
                    for sw in 0..=swizzles {
                        if out.len() >= limit {
                            return Ok(());
                        }
                        let mut a = base;
                        let set = set_config(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_TILE_ID, tile)
                            .and_then(|()| set_config(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_STAGES_ID, st))
                            .and_then(|()| set_config(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, custom))
                            .and_then(|()| set_config(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, sw));
                        if set.is_err() {
                            continue;
                        }
                        if let Some(f) = check(d, &a) {
                            out.push(f);
                            split_variants(d, &a, out, limit);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// `ids`, or the one "undefined" id (0: the library's own choice) when none is reported.
fn or_undefined(ids: Vec<u32>) -> Vec<u32> {
    if ids.is_empty() { vec![0] } else { ids }
}
