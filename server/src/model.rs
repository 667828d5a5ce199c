//! Reading a served model's files at start-up (`serve` and `worker`): off the async runtime,
//! timed as the `config_tokenizer` start-up phase; and the model's cluster identity as served
//! ([`served_fingerprint`]), which the router and its workers compute alike.

use anyhow::Context;
use baton_formats::LoadFormat;

/// Reads the model's files (config, tokenizer, chat template, weight headers) off the async
/// runtime, logging the `config_tokenizer` start-up phase.
pub async fn load_model(path: &std::path::Path, format: LoadFormat) -> anyhow::Result<baton_formats::LoadedModel> {
    let t0 = std::time::Instant::now();
    let owned = path.to_path_buf();
    let model = tokio::task::spawn_blocking(move || baton_formats::load_model(&owned, format))
        .await
        .context("model loading panicked")?
        .with_context(|| format!("cannot load model {}", path.display()))?;
    baton_engine::log_phase("config_tokenizer", t0);
    Ok(model)
}

/// The fingerprint a worker registers with and the router compares against
/// ([`baton_formats::ModelConfig::fingerprint`]) for `cfg` served with a `max_model_len`
/// context and `--quantization quantization`: two processes agree exactly when their weights
/// and shapes give the same KV for the same prompt.
pub fn served_fingerprint(
    cfg: &baton_formats::ModelConfig,
    max_model_len: usize,
    quantization: baton_engine::weight_quantization::WeightQuantization,
) -> String {
    let mut served = cfg.with_served_context(max_model_len);
    quantization.apply(&mut served);
    served.fingerprint()
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_engine::weight_quantization::WeightQuantization;

    #[test]
    fn at_load_fp8_changes_the_fingerprint_and_a_checkpoints_own_scheme_wins() {
        let cfg = baton_formats::testing::TinySpec::llama().config();
        let len = cfg.max_position_embeddings;
        let plain = served_fingerprint(&cfg, len, WeightQuantization::None);
        let fp8 = served_fingerprint(&cfg, len, WeightQuantization::Fp8);
        assert_ne!(plain, fp8, "a bf16 worker and an FP8 one must not pair up");
        assert!(fp8.contains("fp8-atload-channel"), "{fp8}");
        assert_eq!(fp8, served_fingerprint(&cfg, len, WeightQuantization::Fp8), "deterministic");
        // A checkpoint that is FP8 already keeps its scheme whatever the flag says.
        let mut ckpt = cfg.clone();
        WeightQuantization::Fp8.apply(&mut ckpt);
        assert_eq!(served_fingerprint(&ckpt, len, WeightQuantization::None), fp8);
    }
}
