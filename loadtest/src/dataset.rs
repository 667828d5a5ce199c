//! Building the list of requests to send: prompt text, its length in the
//! server's tokens, and the output length to ask for.
//!
//! Three sources: `random` (exact token lengths, as `vllm bench serve
//! --dataset-name random`), ShareGPT JSON, and a plain file of prompts. All are
//! deterministic for a seed. `input_tokens` is the length measured with the
//! server's tokenizer, or `None` when no tokenizer was available, in which
//! case the server's reported prompt length is used later.

use std::path::Path;

use futures::{StreamExt, TryStreamExt};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::config::DatasetConfig;
use crate::error::LoadtestError;
use crate::tokenizer::TextTokenizer;

/// How many prompts are measured through a tokenizer at once; matters only
/// for a remote tokenizer, where each measurement is an HTTP round trip.
const TOKENIZE_PARALLELISM: usize = 16;
/// Decode/encode rounds tried to hit an exact random-prompt length.
const MAX_LENGTH_ROUNDS: usize = 10;
/// vLLM's ShareGPT filters: drop tiny turns and over-long conversations.
const SHAREGPT_MIN_LEN: usize = 4;
const SHAREGPT_MAX_PROMPT: usize = 1024;
const SHAREGPT_MAX_TOTAL: usize = 2048;

/// One request to send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestSpec {
    /// The prompt (a completion prompt, or the single user message for chat).
    pub prompt: String,
    /// The prompt's length in the server's tokens, when it could be measured.
    pub input_tokens: Option<usize>,
    /// The number of tokens to generate.
    pub output_tokens: usize,
}

/// Builds `n` requests from `config`, deterministically for `seed`.
pub async fn load(
    config: &DatasetConfig,
    n: usize,
    seed: u64,
    tokenizer: Option<&TextTokenizer>,
) -> Result<Vec<RequestSpec>, LoadtestError> {
    match config {
        DatasetConfig::Random { input_len, output_len, range_ratio } => {
            let tok = tokenizer.ok_or_else(|| {
                LoadtestError::Config(
                    "the random dataset needs the server's tokenizer: pass --tokenizer \
                     path/to/tokenizer.json, or --tokenize-url of a server with /tokenize"
                        .into(),
                )
            })?;
            random(tok, n, seed, *input_len, *output_len, *range_ratio).await
        }
        DatasetConfig::Sharegpt { path, output_len } => sharegpt(path, n, seed, *output_len, tokenizer).await,
        DatasetConfig::Prompts { path, output_len } => prompts_file(path, n, *output_len, tokenizer).await,
    }
}

/// A length drawn uniformly from `[len·(1−r), len·(1+r)]`, at least 1.
fn sample_len(rng: &mut StdRng, len: usize, range_ratio: f64) -> usize {
    let lo = ((len as f64) * (1.0 - range_ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + range_ratio)).ceil().max(lo as f64) as usize;
    rng.random_range(lo..=hi)
}

async fn random(
    tok: &TextTokenizer,
    n: usize,
    seed: u64,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
) -> Result<Vec<RequestSpec>, LoadtestError> {
    let pool = tok.sample_pool().await?;
    let mut rng = StdRng::seed_from_u64(seed);
    let lengths: Vec<(usize, usize)> = (0..n)
        .map(|_| (sample_len(&mut rng, input_len, range_ratio), sample_len(&mut rng, output_len, range_ratio)))
        .collect();
    let pool = &pool;
    futures::stream::iter(lengths.into_iter().enumerate())
        .map(|(i, (in_len, out_len))| async move {
            // One RNG per prompt keeps prompt i the same whatever the
            // completion order of the concurrent tokenizer calls.
            let mut rng = StdRng::seed_from_u64(seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
            let (prompt, measured) = exact_prompt(tok, pool, in_len, &mut rng).await?;
            Ok::<_, LoadtestError>(RequestSpec { prompt, input_tokens: Some(measured), output_tokens: out_len })
        })
        .buffered(TOKENIZE_PARALLELISM)
        .try_collect()
        .await
}

/// Text that the tokenizer encodes to exactly `len` tokens (or, if the
/// tokenizer never settles, the closest found) and its measured length.
///
/// Random ids do not round-trip through text (neighbours merge or split), so
/// the text is re-encoded and trimmed or extended until it does.
async fn exact_prompt(
    tok: &TextTokenizer,
    pool: &[u32],
    len: usize,
    rng: &mut StdRng,
) -> Result<(String, usize), LoadtestError> {
    let mut ids: Vec<u32> = (0..len).map(|_| pool[rng.random_range(0..pool.len())]).collect();
    let mut best: Option<(String, usize)> = None;
    for _ in 0..MAX_LENGTH_ROUNDS {
        let text = tok.decode(&ids).await?;
        let measured = tok.encode(&text).await?;
        if measured.len() == len {
            return Ok((text, len));
        }
        let closer = best.as_ref().is_none_or(|(_, b)| measured.len().abs_diff(len) < b.abs_diff(len));
        if closer {
            best = Some((text, measured.len()));
        }
        ids = measured;
        if ids.len() > len {
            ids.truncate(len);
        } else {
            let missing = len - ids.len();
            ids.extend((0..missing).map(|_| pool[rng.random_range(0..pool.len())]));
        }
    }
    best.ok_or_else(|| LoadtestError::Tokenizer("could not build a prompt".into()))
}

#[derive(Deserialize)]
struct ShareGptEntry {
    #[serde(default)]
    conversations: Vec<ShareGptTurn>,
}

#[derive(Deserialize)]
struct ShareGptTurn {
    value: String,
}

async fn sharegpt(
    path: &Path,
    n: usize,
    seed: u64,
    output_len: Option<usize>,
    tokenizer: Option<&TextTokenizer>,
) -> Result<Vec<RequestSpec>, LoadtestError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadtestError::io(path, e))?;
    let entries: Vec<ShareGptEntry> = serde_json::from_str(&text).map_err(|e| LoadtestError::Dataset {
        path: path.to_path_buf(),
        message: format!("not a ShareGPT JSON array: {e}"),
    })?;
    let mut pairs: Vec<(String, String)> = entries
        .into_iter()
        .filter(|e| e.conversations.len() >= 2)
        .map(|mut e| {
            let completion = e.conversations.swap_remove(1).value;
            let prompt = e.conversations.swap_remove(0).value;
            (prompt, completion)
        })
        .collect();
    pairs.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut specs = Vec::with_capacity(n);
    match tokenizer {
        None => {
            let output_tokens = output_len.ok_or_else(|| {
                LoadtestError::Config(
                    "ShareGPT without a tokenizer needs --output-len (completion lengths \
                     cannot be measured)"
                        .into(),
                )
            })?;
            specs.extend(pairs.into_iter().take(n).map(|(prompt, _)| RequestSpec {
                prompt,
                input_tokens: None,
                output_tokens,
            }));
        }
        Some(tok) => {
            let mut measured = futures::stream::iter(pairs)
                .map(|(prompt, completion)| async move {
                    let p = tok.encode(&prompt).await?.len();
                    let c = match output_len {
                        Some(len) => len,
                        None => tok.encode(&completion).await?.len(),
                    };
                    Ok::<_, LoadtestError>((prompt, p, c))
                })
                .buffered(TOKENIZE_PARALLELISM);
            while specs.len() < n
                && let Some(item) = measured.next().await
            {
                let (prompt, p, c) = item?;
                let too_short = p < SHAREGPT_MIN_LEN || c < SHAREGPT_MIN_LEN;
                let too_long = p > SHAREGPT_MAX_PROMPT || p + c > SHAREGPT_MAX_TOTAL;
                if !too_short && !too_long {
                    specs.push(RequestSpec { prompt, input_tokens: Some(p), output_tokens: c });
                }
            }
        }
    }
    if specs.is_empty() {
        return Err(LoadtestError::Dataset {
            path: path.to_path_buf(),
            message: "no usable conversations (need a human turn followed by a reply, \
                      4..1024 prompt tokens, at most 2048 in all)"
                .into(),
        });
    }
    Ok(cycle_to(specs, n))
}

async fn prompts_file(
    path: &Path,
    n: usize,
    output_len: usize,
    tokenizer: Option<&TextTokenizer>,
) -> Result<Vec<RequestSpec>, LoadtestError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadtestError::io(path, e))?;
    let prompts: Vec<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty()).take(n).map(String::from).collect();
    if prompts.is_empty() {
        return Err(LoadtestError::Dataset {
            path: path.to_path_buf(),
            message: "no prompts (expected one prompt per non-empty line)".into(),
        });
    }
    let specs: Vec<RequestSpec> = futures::stream::iter(prompts)
        .map(|prompt| async move {
            let input_tokens = match tokenizer {
                Some(tok) => Some(tok.encode(&prompt).await?.len()),
                None => None,
            };
            Ok::<_, LoadtestError>(RequestSpec { prompt, input_tokens, output_tokens: output_len })
        })
        .buffered(TOKENIZE_PARALLELISM)
        .try_collect()
        .await?;
    Ok(cycle_to(specs, n))
}

/// Repeats `specs` in order until there are `n` (used when a file holds fewer
/// usable prompts than asked for).
fn cycle_to(specs: Vec<RequestSpec>, n: usize) -> Vec<RequestSpec> {
    if specs.len() >= n {
        return specs;
    }
    specs.iter().cycle().take(n).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_lengths_stay_in_range() {
        let mut rng = StdRng::seed_from_u64(3);
        let lens: Vec<usize> = (0..2000).map(|_| sample_len(&mut rng, 100, 0.2)).collect();
        assert!(lens.iter().all(|l| (80..=120).contains(l)));
        assert!(lens.contains(&80) && lens.contains(&120));
        let mut rng = StdRng::seed_from_u64(3);
        assert!((0..100).all(|_| sample_len(&mut rng, 7, 0.0) == 7));
    }

    #[test]
    fn cycling_repeats_in_order() {
        let spec = |p: &str| RequestSpec { prompt: p.into(), input_tokens: None, output_tokens: 1 };
        let out = cycle_to(vec![spec("a"), spec("b")], 5);
        let prompts: Vec<&str> = out.iter().map(|s| s.prompt.as_str()).collect();
        assert_eq!(prompts, ["a", "b", "a", "b", "a"]);
    }
}
