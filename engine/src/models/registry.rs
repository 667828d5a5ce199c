//! The registry: which implementation serves each model family. A checkpoint names its
//! family by HF `architectures[0]` / `model_type` or GGUF `general.architecture`;
//! `baton_formats::Architecture::from_name` resolves those names while the config is parsed
//! (an unknown name is refused there, listing [`baton_formats::Architecture::ALL`]), and
//! [`build_architecture`] builds the family's [`Architecture`] over a backend.
//!
//! Invariant: every family the parser accepts has exactly one entry in [`REGISTRY`]
//! (checked by a test), so a config that parsed always has a builder.

use super::llama::Llama;
use super::{Architecture, ModelLoadError, WeightLoader};
use crate::backend::Backend;
use baton_formats::{Architecture as Family, ModelConfig};

/// The implementations under `models/`, one per file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Implementation {
    /// [`Llama`]: the Llama layout with optional q/k/v biases.
    Llama,
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
        ] {
            let got = Family::from_name(name).and_then(registration).map(|r| r.family);
            assert_eq!(got, Some(family), "{name}");
        }
        assert_eq!(Family::from_name("GPT2LMHeadModel"), None);
    }
}
