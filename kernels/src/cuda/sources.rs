//! The CUDA C sources cut into translation units ([`Module`]s), and which of them a model
//! loads ([`KernelNeeds`]).
//!
//! One module per `.cu` family, each preceded by the shared prelude; the templated families
//! (decode attention, prefill attention, skinny GEMM) are cut further into one module per
//! instantiation parameter (head_dim, rows of x) and per instance line, so no single unit
//! dominates a cold start's NVRTC time. Every source is embedded with `include_str!`, so the
//! binary needs no source tree. Invariant: the modules of a family together instantiate
//! exactly the family's instance lines, each once, and those lines match the Rust variant
//! tables (the tests below compare them); `compile.rs` turns modules into images.

use super::fp8_linear::GEMV_FP8_VARIANTS;
use super::gemv::{GEMV_MAX_MS, GEMV_VARIANTS};
use super::paged_attention::ATTN_HEAD_DIMS;
use super::prefill::{PREFILL_HEAD_DIMS, PREFILL_WARPS, PREFILL_WG_HEAD_DIM};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

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
        // The arguments of every `prefix...)` instance line, a macro's continuation trimmed.
        let instance_args = |src: &str, prefix: &str| -> Vec<String> {
            src.lines()
                .filter_map(|l| l.trim().strip_prefix(prefix))
                .map(|l| l.trim_end_matches(['\\', ' ', ')']).to_string())
                .collect()
        };
        let cuda = instance_args(&src, "ATT_INSTANCE(HD, ");
        use super::super::paged_attention::{ATTN_VARIANTS, AttnKind};
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .filter(|v| v.kind == AttnKind::Registers)
            .map(|v| format!("{}, {}, {}, {}", v.warps, v.unroll, v.max_group, u8::from(v.prefetch)))
            .collect();
        // Each attention module carries the (identical) macro definition once.
        assert_eq!(cuda, vec![rust; ATTN_HEAD_DIMS.len()].concat());
        let cuda = instance_args(&src, "ATT_TC_INSTANCE(HD, ");
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
        let cuda = instance_args(&src, "ATT_ST_INSTANCE(HD, ");
        let rust: Vec<String> = ATTN_VARIANTS
            .iter()
            .skip_while(|v| v.kind != AttnKind::Stream)
            .map(|v| {
                assert_eq!(v.kind, AttnKind::Stream, "the streaming variants come last");
                format!("{}, {}, {}", v.warps, v.unroll, v.max_group)
            })
            .collect();
        assert_eq!(cuda, vec![rust; ATTN_HEAD_DIMS.len()].concat());
        let cuda = instance_args(&src, "ATT_TC_FP8_INSTANCE(HD, ");
        let fp8_list = |kind: AttnKind| -> Vec<String> {
            super::super::paged_attention::ATTN_FP8_VARIANTS
                .iter()
                .filter(|v| v.kind == kind)
                .map(|v| format!("{}, {}, {}", v.warps, v.unroll, v.max_group))
                .collect()
        };
        assert_eq!(cuda, vec![fp8_list(AttnKind::TensorCore); ATTN_HEAD_DIMS.len()].concat());
        let cuda = instance_args(&src, "ATT_ST_FP8_INSTANCE(HD, ");
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
        let cuda = instance_args(&src, "PF_INSTANCE(");
        use super::super::prefill::PREFILL_WARPS;
        let rust: Vec<String> =
            PREFILL_HEAD_DIMS.iter().flat_map(|hd| PREFILL_WARPS.iter().map(move |w| format!("{hd}, {w}"))).collect();
        assert_eq!(cuda, rust);
    }
}
