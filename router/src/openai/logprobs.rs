//! Engine logprobs rendered in OpenAI's two formats: chat (`content[]` with token, logprob,
//! bytes and `top_logprobs`) and legacy completions (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`).
//!
//! A token's text is the token decoded on its own, as OpenAI and vLLM show it; a token that is
//! only part of a UTF-8 character therefore shows the replacement character, while `bytes`
//! carries the decoded text's bytes.

use super::protocol::{
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprobs, VllmLogprob,
};
use crate::text::TextCodec;
use baton_core::api::{PromptLogprob, TokenLogprob};
use std::collections::BTreeMap;

/// Chat-format logprobs of `tokens`.
pub fn chat_logprobs(codec: &TextCodec, tokens: &[TokenLogprob]) -> ChatLogprobs {
    let content = tokens
        .iter()
        .map(|lp| {
            let token = codec.token_text(lp.token_id);
            let top_logprobs = lp
                .top
                .iter()
                .map(|&(id, logprob)| {
                    let token = codec.token_text(id);
                    ChatTopLogprob { bytes: token.as_bytes().to_vec(), token, logprob }
                })
                .collect();
            ChatTokenLogprob { bytes: token.as_bytes().to_vec(), token, logprob: lp.logprob, top_logprobs }
        })
        .collect();
    ChatLogprobs { content }
}

/// Builds completions-format logprobs incrementally, tracking each token's character offset
/// in the choice's text.
#[derive(Debug, Clone, Default)]
pub struct CompletionLogprobsBuilder {
    offset: usize,
}

impl CompletionLogprobsBuilder {
    /// Offsets start after `prefix_chars` characters (the echoed prompt, if any).
    pub fn starting_at(prefix_chars: usize) -> Self {
        Self { offset: prefix_chars }
    }

    /// Legacy-format logprobs of the prompt `prompt` (`echo` with `logprobs`), `entries[i]`
    /// scoring `prompt[i]`: a token without an entry (the first) has `null` logprob and
    /// alternatives, as OpenAI returns it.
    pub fn push_prompt(
        &mut self,
        codec: &TextCodec,
        prompt: &[u32],
        entries: &[Option<PromptLogprob>],
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (i, &id) in prompt.iter().enumerate() {
            let token = codec.token_text(id);
            out.text_offset.push(self.offset);
            self.offset += token.chars().count();
            out.tokens.push(token);
            match entries.get(i).and_then(Option::as_ref) {
                Some(lp) => {
                    out.token_logprobs.push(Some(lp.logprob));
                    let top = lp.top.iter().map(|&(id, logprob)| (codec.token_text(id), logprob)).collect();
                    out.top_logprobs.push(Some(top));
                }
                None => {
                    out.token_logprobs.push(None);
                    out.top_logprobs.push(None);
                }
            }
        }
        out
    }

    /// Logprobs of the next `tokens`, continuing the offsets of earlier calls.
    pub fn push(&mut self, codec: &TextCodec, tokens: &[TokenLogprob]) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for lp in tokens {
            let token = codec.token_text(lp.token_id);
            out.text_offset.push(self.offset);
            self.offset += token.chars().count();
            out.token_logprobs.push(Some(lp.logprob));
            let top: BTreeMap<String, f32> =
                lp.top.iter().map(|&(id, logprob)| (codec.token_text(id), logprob)).collect();
            out.top_logprobs.push(Some(top));
            out.tokens.push(token);
        }
        out
    }
}

/// vLLM's `prompt_logprobs` of `entries` (one per prompt token): each entry maps the prompt
/// token and its top alternatives, by id, to logprob, rank and text.
pub fn vllm_prompt_logprobs(codec: &TextCodec, entries: &[Option<PromptLogprob>]) -> PromptLogprobs {
    entries
        .iter()
        .map(|entry| {
            entry.as_ref().map(|lp| {
                let mut map: BTreeMap<String, VllmLogprob> = lp
                    .top
                    .iter()
                    .enumerate()
                    .map(|(i, &(id, logprob))| {
                        let entry = VllmLogprob { logprob, rank: i as u32 + 1, decoded_token: codec.token_text(id) };
                        (id.to_string(), entry)
                    })
                    .collect();
                let own =
                    VllmLogprob { logprob: lp.logprob, rank: lp.rank, decoded_token: codec.token_text(lp.token_id) };
                map.insert(lp.token_id.to_string(), own);
                map
            })
        })
        .collect()
}

/// Appends `more` to `acc` (non-streaming responses collect the streamed pieces).
pub fn extend_completion_logprobs(acc: &mut CompletionLogprobs, more: CompletionLogprobs) {
    acc.tokens.extend(more.tokens);
    acc.token_logprobs.extend(more.token_logprobs);
    acc.top_logprobs.extend(more.top_logprobs);
    acc.text_offset.extend(more.text_offset);
}
