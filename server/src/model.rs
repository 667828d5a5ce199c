//! Reading a served model's files at start-up (`serve` and `worker`): off the async runtime,
//! timed as the `config_tokenizer` start-up phase.

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
