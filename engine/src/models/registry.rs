//! The registry: which implementation serves each model family. A checkpoint names its
//! family by HF `architectures[0]` / `model_type` or GGUF `general.architecture`;
//! `baton_formats::Architecture::from_name` resolves those names while the config is parsed
//! (an unknown name is refused there, listing [`baton_formats::Architecture::ALL`]), and
//! [`build_architecture`] builds the family's [`Architecture`] over a backend.
//!
//! Invariant: every family the parser accepts has exactly one entry in [`REGISTRY`]
//! (checked by a test), so a config that parsed always has a builder.

use super::gemma::Gemma;
use super::gpt_oss::GptOss;
use super::llama::Llama;
use super::{Architecture, ModelLoadError, WeightLoader};
use crate::backend::Backend;
use baton_formats::{Architecture as Family, ModelConfig};

/// The implementations under `models/`, one per file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Implementation {
    /// [`Llama`]: the Llama layout with optional q/k/v (and o_proj) biases, optional
    /// per-head q/k norm (Qwen3) and routed experts in place of dense MLPs (Qwen3-MoE,
    /// Mixtral; the block is `models/moe.rs`).
    Llama,
    /// [`Gemma`]: Gemma 2 and Gemma 3 (text).
    Gemma,
    /// [`GptOss`]: gpt-oss (sinks, alternating windows, YaRN, experts with biases and the
    /// clamped SwiGLU).
    GptOss,
}

impl Implementation {
    /// Builds this implementation from `cfg`'s weights.
    fn build<B: Backend>(
        self,
        cfg: &ModelConfig,
        w: &mut WeightLoader<'_>,
        b: &mut B,
    ) -> Result<Box<dyn Architecture<B>>, ModelLoadError> {
        match self {
            Self::Llama => Ok(Box::new(Llama::load(cfg, w, b)?)),
            Self::Gemma => Ok(Box::new(Gemma::load(cfg, w, b)?)),
            Self::GptOss => Ok(Box::new(GptOss::load(cfg, w, b)?)),
        }
    }
}

/// One registered family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// The family (its HF and GGUF names are `Family::model_type`, `hf_class`, `gguf_name`).
    pub family: Family,
    /// The implementation that serves it.
    pub implementation: Implementation,
}

/// Every family Baton serves.
pub const REGISTRY: &[Registration] = &[
    Registration { family: Family::Llama, implementation: Implementation::Llama },
    Registration { family: Family::Mistral, implementation: Implementation::Llama },
    Registration { family: Family::Qwen2, implementation: Implementation::Llama },
    Registration { family: Family::Qwen3, implementation: Implementation::Llama },
    Registration { family: Family::Qwen3Moe, implementation: Implementation::Llama },
    Registration { family: Family::Mixtral, implementation: Implementation::Llama },
    Registration { family: Family::Gemma2, implementation: Implementation::Gemma },
    Registration { family: Family::Gemma3Text, implementation: Implementation::Gemma },
    Registration { family: Family::Phi3, implementation: Implementation::Llama },
    Registration { family: Family::GptOss, implementation: Implementation::GptOss },
];

/// The registration of `family`, if any.
pub fn registration(family: Family) -> Option<&'static Registration> {
    REGISTRY.iter().find(|r| r.family == family)
}

/// Builds `cfg`'s architecture, reading its tensors through `w` into `b`.
pub fn build_architecture<B: Backend>(
    cfg: &ModelConfig,
    w: &mut WeightLoader<'_>,
    b: &mut B,
) -> Result<Box<dyn Architecture<B>>, ModelLoadError> {
    let reg = registration(cfg.architecture).ok_or_else(|| ModelLoadError::Unsupported {
        architecture: cfg.architecture.model_type(),
        device: b.device_name(),
        what: format!("no implementation is registered (supported: {})", Family::supported_list()),
    })?;
    reg.implementation.build(cfg, w, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::models::{AttentionKind, LayerSpec, MlpKind};
    use baton_formats::LayerType;
    use baton_formats::testing::TinySpec;

    #[test]
    fn every_parsed_family_has_exactly_one_registration() {
        for family in Family::ALL {
            assert_eq!(REGISTRY.iter().filter(|r| r.family == family).count(), 1, "{family:?}");
        }
        assert_eq!(REGISTRY.len(), Family::ALL.len());
    }

    #[test]
    fn hf_and_gguf_names_resolve_to_registered_families() {
        for (name, family) in [
            ("LlamaForCausalLM", Family::Llama),
            ("llama", Family::Llama),
            ("MistralForCausalLM", Family::Mistral),
            ("mistral", Family::Mistral),
            ("Qwen2ForCausalLM", Family::Qwen2),
            ("qwen2", Family::Qwen2),
            ("Qwen3ForCausalLM", Family::Qwen3),
            ("qwen3", Family::Qwen3),
            ("Qwen3MoeForCausalLM", Family::Qwen3Moe),
            ("qwen3_moe", Family::Qwen3Moe),
            ("MixtralForCausalLM", Family::Mixtral),
            ("mixtral", Family::Mixtral),
            ("Gemma2ForCausalLM", Family::Gemma2),
            ("gemma2", Family::Gemma2),
            ("Gemma3ForCausalLM", Family::Gemma3Text),
            ("gemma3_text", Family::Gemma3Text),
            ("GptOssForCausalLM", Family::GptOss),
            ("gpt_oss", Family::GptOss),
        ] {
            let got = Family::from_name(name).and_then(registration).map(|r| r.family);
            assert_eq!(got, Some(family), "{name}");
        }
        assert_eq!(Family::from_name("GPT2LMHeadModel"), None);
    }

    fn build_on(spec: &TinySpec, mut b: CpuBackend) -> Result<Box<dyn Architecture<CpuBackend>>, ModelLoadError> {
        let cfg = spec.config();
        let store = spec.weights();
        build_architecture(&cfg, &mut WeightLoader::new(&store), &mut b)
    }

    #[test]
    fn a_backend_without_an_op_a_model_needs_refuses_it_at_load() {
        // Qwen3 needs the per-head q/k norm; a backend without it refuses the model by name.
        let err = build_on(&TinySpec::qwen3(), CpuBackend::without_optional_ops()).err().expect("refused");
        let msg = err.to_string();
        assert!(matches!(err, ModelLoadError::Unsupported { architecture: "qwen3", .. }), "{msg}");
        assert!(msg.contains("per-head RMSNorm") && msg.contains("cpu"), "{msg}");
        // Llama needs none, and Qwen3 loads where the op exists.
        build_on(&TinySpec::llama(), CpuBackend::without_optional_ops()).expect("llama needs no optional op");
        let qwen3 = build_on(&TinySpec::qwen3(), CpuBackend::new()).expect("qwen3 on the CPU");
        assert!(qwen3.layers().iter().all(|l| l.qk_norm && l.head_dim == 32));
    }

    #[test]
    fn a_backend_without_the_moe_op_refuses_moe_models_at_load() {
        for (spec, name) in [(TinySpec::mixtral(), "mixtral"), (TinySpec::qwen3_moe(), "qwen3_moe")] {
            let mut b = CpuBackend::new();
            // Qwen3-MoE also needs the q/k norm: only the MoE op is missing here.
            let err = build_on(&spec, CpuBackend::without_optional_ops()).err().expect("refused");
            let msg = err.to_string();
            assert!(matches!(err, ModelLoadError::Unsupported { architecture, .. } if architecture == name), "{msg}");
            if spec.architecture == baton_formats::Architecture::Mixtral {
                assert!(msg.contains("mixture-of-experts MLP") && msg.contains("layer 0"), "{msg}");
            }
            let model = build_architecture(&spec.config(), &mut WeightLoader::new(&spec.weights()), &mut b)
                .expect("loads where the op exists");
            // Qwen3-MoE's middle layer is in mlp_only_layers: dense; every other layer routes.
            let moe: Vec<bool> = model.layers().iter().map(|l| matches!(l.mlp, MlpKind::Moe { .. })).collect();
            let want = if name == "mixtral" { vec![true, true] } else { vec![true, false, true] };
            assert_eq!(moe, want, "{name}");
        }
    }

    #[test]
    fn gpt_oss_loads_its_fixture_and_is_refused_by_a_backend_without_sinks() {
        let (dir, _) = baton_formats::testing::load_golden("gpt_oss").expect("fixture");
        let model = baton_formats::load_model(&dir, baton_formats::LoadFormat::Auto).expect("load");
        let build =
            |b: &mut CpuBackend| build_architecture(&model.config, &mut WeightLoader::new(model.weights.as_ref()), b);
        let err = build(&mut CpuBackend::without_optional_ops()).err().expect("refused");
        let msg = err.to_string();
        assert!(matches!(err, ModelLoadError::Unsupported { architecture: "gpt_oss", .. }), "{msg}");
        assert!(msg.contains("sinks"), "{msg}");
        let arch = build(&mut CpuBackend::new()).expect("gpt-oss on the CPU");
        let kinds: Vec<AttentionKind> = arch.layers().iter().map(|l| l.attention).collect();
        assert_eq!(kinds, [AttentionKind::SlidingWindow { window: 16 }, AttentionKind::Full]);
        assert!(arch.layers().iter().all(|l| matches!(l.mlp, MlpKind::Moe { num_experts: 4, .. })));
        // YaRN's attention factor, 0.1 · ln(32) + 1, is on the rotary table the layers use.
        let table = arch.layers()[0].rope.table(32).expect("table");
        assert!((table.attention_factor() - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-6, "{}", table.attention_factor());
    }

    #[test]
    fn layer_specs_follow_the_config() {
        let mut cfg = TinySpec::qwen3().config();
        cfg.layer_types = vec![LayerType::Full, LayerType::Sliding];
        cfg.sliding_window = Some(512);
        let specs = LayerSpec::from_config(&cfg);
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].attention, AttentionKind::Full);
        assert_eq!(specs[1].attention, AttentionKind::SlidingWindow { window: 512 });
        assert!(specs[1].attends_fully_up_to(512) && !specs[1].attends_fully_up_to(513));
        // A window shorter than the served context: the layer attends within it (windowed
        // attention, an optional op the CPU backend has).
        cfg.sliding_window = Some(64);
        let specs = LayerSpec::from_config(&cfg);
        assert!(!specs[1].attends_fully_up_to(cfg.max_position_embeddings));
        let store = TinySpec::qwen3().weights();
        build_architecture(&cfg, &mut WeightLoader::new(&store), &mut CpuBackend::new()).expect("windowed layer");
        // So is RoPE that differs between layer types (one rotary table).
        cfg.sliding_window = Some(512);
        cfg.sliding_rope = Some(baton_formats::RopeParameters { theta: 10.0, scaling: None });
        let err =
            build_architecture(&cfg, &mut WeightLoader::new(&store), &mut CpuBackend::new()).err().expect("refused");
        assert!(err.to_string().contains("RoPE"), "{err}");
    }
}
