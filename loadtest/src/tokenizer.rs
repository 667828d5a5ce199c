//! Token counting with the server's own tokenizer.
//!
//! Exact prompt lengths only mean something in the server's tokens, so the
//! tokenizer is either the model's local `tokenizer.json` or the server's
//! `/tokenize` and `/detokenize` endpoints (vLLM's request and response
//! shapes). Special tokens are never added when counting: a prompt of N tokens
//! is N tokens of text, and the server may add BOS on top as it would for any
//! client.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::json;

use crate::error::LoadtestError;

/// English text tokenized once through a remote tokenizer to get a pool of
/// ordinary token ids, since a remote tokenizer does not list its vocabulary.
const CORPUS: &str = "the quick brown fox jumps over the lazy dog while a small \
river runs past an old mill where people meet every morning to talk about \
weather markets music history science travel food family work and the many \
small things that fill a long day in a quiet town near green hills and wide \
fields under a bright sky with birds trees stones roads bridges houses windows \
doors gardens books letters numbers colors stories questions answers ideas";

/// A tokenizer that prompts are measured with.
pub enum TextTokenizer {
    /// A `tokenizer.json` loaded in process.
    Local(Arc<tokenizers::Tokenizer>),
    /// The server's `/tokenize` and `/detokenize`.
    Remote {
        /// Shared HTTP client.
        client: reqwest::Client,
        /// Base URL without trailing slash, e.g. `http://127.0.0.1:8000`.
        base_url: String,
        /// Model name sent along, as vLLM's endpoints accept one.
        model: Option<String>,
    },
}

#[derive(Deserialize)]
struct TokenizeResponse {
    tokens: Vec<u32>,
}

#[derive(Deserialize)]
struct DetokenizeResponse {
    prompt: String,
}

impl TextTokenizer {
    /// Loads a local `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, LoadtestError> {
        let tok = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| LoadtestError::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self::Local(Arc::new(tok)))
    }

    /// Uses the tokenizer endpoints of the server at `base_url`.
    pub fn remote(client: reqwest::Client, base_url: &str, model: Option<String>) -> Self {
        Self::Remote { client, base_url: base_url.trim_end_matches('/').to_string(), model }
    }

    /// The in-process tokenizer, if this is one; used to estimate output
    /// lengths without a network round trip.
    pub fn local(&self) -> Option<Arc<tokenizers::Tokenizer>> {
        match self {
            Self::Local(tok) => Some(Arc::clone(tok)),
            Self::Remote { .. } => None,
        }
    }

    /// Token ids of `text`, without special tokens.
    pub async fn encode(&self, text: &str) -> Result<Vec<u32>, LoadtestError> {
        match self {
            Self::Local(tok) => tok
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| LoadtestError::Tokenizer(e.to_string())),
            Self::Remote { client, base_url, model } => {
                let body = json!({"model": model, "prompt": text, "add_special_tokens": false});
                let resp: TokenizeResponse = post_json(client, &format!("{base_url}/tokenize"), &body).await?;
                Ok(resp.tokens)
            }
        }
    }

    /// Text of `ids`.
    pub async fn decode(&self, ids: &[u32]) -> Result<String, LoadtestError> {
        match self {
            Self::Local(tok) => tok.decode(ids, false).map_err(|e| LoadtestError::Tokenizer(e.to_string())),
            Self::Remote { client, base_url, model } => {
                let body = json!({"model": model, "tokens": ids});
                let resp: DetokenizeResponse = post_json(client, &format!("{base_url}/detokenize"), &body).await?;
                Ok(resp.prompt)
            }
        }
    }

    /// Ordinary (non-special) token ids to draw random prompts from, sorted so
    /// that a seed gives the same prompts every time.
    pub async fn sample_pool(&self) -> Result<Vec<u32>, LoadtestError> {
        let mut ids: Vec<u32> = match self {
            Self::Local(tok) => local_pool(tok),
            Self::Remote { .. } => self.encode(CORPUS).await?,
        };
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() {
            return Err(LoadtestError::Tokenizer("the tokenizer has no ordinary tokens to build prompts from".into()));
        }
        Ok(ids)
    }
}

/// At most this many vocabulary entries are checked for the local pool, which
/// bounds start-up time on 100k+ vocabularies.
const MAX_POOL_CANDIDATES: usize = 20_000;

/// Non-special vocabulary ids that survive a decode/encode round trip on
/// their own (unknown-token markers and partial byte sequences do not, and
/// would keep random prompts from settling on an exact length).
fn local_pool(tok: &tokenizers::Tokenizer) -> Vec<u32> {
    let special: HashSet<u32> = tok.get_added_tokens_decoder().into_keys().collect();
    let mut ids: Vec<u32> = tok.get_vocab(false).into_values().filter(|id| !special.contains(id)).collect();
    ids.sort_unstable();
    let stride = ids.len().div_ceil(MAX_POOL_CANDIDATES).max(1);
    let round_trips = |id: u32| {
        tok.decode(&[id], false)
            .ok()
            .and_then(|text| tok.encode(text.as_str(), false).ok())
            .is_some_and(|e| e.get_ids() == [id])
    };
    let stable: Vec<u32> = ids.iter().step_by(stride).copied().filter(|&id| round_trips(id)).collect();
    if stable.is_empty() { ids } else { stable }
}

async fn post_json<T: serde::de::DeserializeOwned>(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<T, LoadtestError> {
    let resp =
        client.post(url).json(body).send().await.map_err(|e| LoadtestError::Tokenizer(format!("POST {url}: {e}")))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| LoadtestError::Tokenizer(format!("POST {url}: {e}")))?;
    if !status.is_success() {
        return Err(LoadtestError::Tokenizer(format!(
            "POST {url}: HTTP {status}: {}",
            crate::record::truncate(&text, 300)
        )));
    }
    serde_json::from_str(&text).map_err(|e| LoadtestError::Tokenizer(format!("POST {url}: unexpected response: {e}")))
}
