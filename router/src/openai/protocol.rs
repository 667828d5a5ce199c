//! OpenAI (and vLLM-extension) JSON shapes: request bodies as clients send them and response
//! bodies exactly as OpenAI and vLLM return them.
//!
//! Requests are deliberately loose in their numeric types (`i64`/`f64` instead of `u32`/`f32`)
//! so that a negative `max_tokens` or an absurd `n` reaches validation and gets an error that
//! names the parameter, rather than a generic deserialization failure. serde skips fields these
//! structs lack, so every body is first checked by [`super::fields`], which refuses each field
//! Baton does not honour (OpenAI and vLLM would ignore it). Nothing here validates; see
//! [`super::params`].
//!
//! A generation body is parsed three times: into the endpoint's struct, into
//! [`SamplingFields`] and into [`StructuredFields`].

use super::tools::choice::{ToolChoiceIn, ToolIn};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopField {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage` and no choices before `[DONE]`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling fields shared by both generation endpoints, as sent by the client. Parsed from
/// the same body as the endpoint's own struct (rather than `#[serde(flatten)]`, which would
/// lose the field path in type errors).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Number of choices to generate.
    pub n: Option<i64>,
    /// Softmax temperature; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus sampling mass.
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens; 0 or -1 disables (vLLM).
    pub top_k: Option<i64>,
    /// Minimum probability relative to the most likely token.
    pub min_p: Option<f64>,
    /// Multiplicative penalty on repeated tokens (vLLM).
    pub repetition_penalty: Option<f64>,
    /// Additive penalty on tokens already present.
    pub presence_penalty: Option<f64>,
    /// Penalty per occurrence.
    pub frequency_penalty: Option<f64>,
    /// Seed for reproducible sampling.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopField>,
    /// Token ids that end the sequence (vLLM).
    pub stop_token_ids: Option<Vec<i64>>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Suppress EOS/stop tokens until this many were generated (vLLM).
    pub min_tokens: Option<i64>,
    /// Keep generating past EOS (vLLM).
    pub ignore_eos: Option<bool>,
    /// Token id (as a string, as OpenAI sends it) to additive bias.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// Keep the matched stop string in the output (vLLM).
    pub include_stop_str_in_output: Option<bool>,
    /// Skip special tokens when detokenizing (vLLM).
    pub skip_special_tokens: Option<bool>,
    /// Stream the response as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// The model to use; must be the served model when given.
    pub model: Option<String>,
    /// Return each prompt token's logprob and this many alternatives (vLLM).
    pub prompt_logprobs: Option<i64>,
}

/// Output constraints shared by both generation endpoints (see [`super::structured`]).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<Value>,
    /// vLLM: a JSON Schema (object or JSON text).
    pub guided_json: Option<Value>,
    /// vLLM: a regular expression.
    pub guided_regex: Option<String>,
    /// vLLM: a list of strings.
    pub guided_choice: Option<Value>,
    /// vLLM: a context-free grammar (llguidance's Lark dialect).
    pub guided_grammar: Option<String>,
    /// vLLM's current form: `{json | regex | choice | grammar | json_object}`.
    pub structured_outputs: Option<Value>,
}

/// A chat message's content: a string or a list of typed parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts; only `text` parts are supported.
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// `text` (others, e.g. `image_url`, are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// One message of a chat request.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text; `null` is allowed for assistant messages.
    pub content: Option<MessageContent>,
    /// The calls an assistant message made.
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// A tool call in an assistant message of the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolCallIn {
    /// The call's id (echoed by the `tool` message that answers it).
    pub id: Option<String>,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// What was called.
    pub function: FunctionCallIn,
}

/// The function of a [`ToolCallIn`].
#[derive(Debug, Clone, Deserialize)]
pub struct FunctionCallIn {
    /// The function's name.
    pub name: String,
    /// The arguments: JSON text (as OpenAI sends them) or a JSON object.
    pub arguments: Value,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessageIn>,
    /// Return log-probabilities of the output tokens.
    pub logprobs: Option<bool>,
    /// How many alternatives to return per token (needs `logprobs: true`).
    pub top_logprobs: Option<i64>,
    /// Newer alias of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// End the prompt with the assistant turn header (vLLM; default true).
    pub add_generation_prompt: Option<bool>,
    /// Functions the model may call.
    pub tools: Option<Vec<ToolIn>>,
    /// `none`, `auto`, `required` or a named function.
    pub tool_choice: Option<ToolChoiceIn>,
    /// `false`: at most one call per answer.
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template (vLLM), e.g. `enable_thinking`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// `prompt` of a completions request.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<i64>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<i64>>),
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: PromptField,
    /// Return the top `k` log-probabilities per token.
    pub logprobs: Option<i64>,
    /// Prepend the prompt to the completion text.
    pub echo: Option<bool>,
    /// Tokenize text prompts with special tokens such as BOS (vLLM; default true).
    pub add_special_tokens: Option<bool>,
    /// Unsupported; refused when set to something else than `n`.
    pub best_of: Option<i64>,
    /// Unsupported; refused when non-empty.
    pub suffix: Option<String>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens (counted once per prompt, not per choice).
    pub prompt_tokens: usize,
    /// Generated tokens over all choices.
    pub completion_tokens: usize,
    /// The sum of both.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage from prompt and completion counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// One alternative in a chat `top_logprobs` list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
}

/// One generated token in chat logprobs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
    /// The most likely alternatives at this position.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// `choices[].logprobs` of chat responses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// `choices[].logprobs` of completions responses (the legacy format).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// Text of each token.
    pub tokens: Vec<String>,
    /// Log-probability of each token.
    pub token_logprobs: Vec<Option<f32>>,
    /// Top alternatives at each position, text to log-probability.
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// The assistant message of a non-streaming chat choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text; `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// The thinking before the answer (with `--reasoning-parser`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The calls the model made.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A tool call of a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    /// `call_...`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCallOut,
}

/// The function of a [`ToolCallOut`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCallOut {
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// One tool call's news in a streaming delta: `id`, `type` and `name` on its first delta,
/// then argument fragments.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDeltaOut {
    /// Position of the call in the choice's calls.
    pub index: usize,
    /// `call_...`, first delta only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, first delta only.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Name (first delta) and argument text.
    pub function: FunctionDeltaOut,
}

/// The function part of a [`ToolCallDeltaOut`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDeltaOut {
    /// The name, first delta only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// New argument text.
    pub arguments: String,
}

/// One choice of a non-streaming chat response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    /// Position among the `n` choices.
    pub index: usize,
    /// The generated message.
    pub message: AssistantMessage,
    /// Present when logprobs were requested.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `abort`.
    pub finish_reason: Option<&'static str>,
    /// The stop string or token id that ended the choice (vLLM).
    pub stop_reason: Option<StopReason>,
}

/// What stopped a choice (vLLM's `stop_reason`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    /// A stop string matched.
    Text(String),
    /// A stop token id (other than EOS) was generated.
    Token(u32),
}

/// `object: chat.completion`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// One per `n`.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// vLLM's `prompt_logprobs` (of the one prompt), when requested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// The `delta` of a streaming chat chunk.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    /// `assistant` in the first chunk of each choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning text (with `--reasoning-parser`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// New tool calls and argument fragments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDeltaOut>>,
}

/// One choice of a streaming chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    /// Position among the `n` choices.
    pub index: usize,
    /// What is new.
    pub delta: ChatDelta,
    /// Logprobs of the tokens behind this delta.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last chunk of the choice.
    pub finish_reason: Option<&'static str>,
    /// The stop string or token id that ended the choice (vLLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
}

/// `object: chat.completion.chunk`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionChunk {
    /// Same for all chunks of a response.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Choices with news (empty in the final usage chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// `null` on content chunks when usage was requested; counts on the final chunk.
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// The `usage` field of streaming chunks: absent unless `include_usage`, then `null` on every
/// chunk but the last.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UsageField {
    /// Not serialized.
    Absent,
    /// Serialized as `null`.
    Null,
    /// Serialized as the counts.
    Counts(Usage),
}

impl UsageField {
    /// Whether the field is left out.
    pub fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Absent | UsageField::Null => s.serialize_none(),
            UsageField::Counts(u) => u.serialize(s),
        }
    }
}

/// One choice of a completions response or chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    /// `prompt_index * n + sample_index`.
    pub index: usize,
    /// Generated text (with the prompt in front when `echo`).
    pub text: String,
    /// Present when logprobs were requested.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop`, `length` or `abort` at the end, else `null`.
    pub finish_reason: Option<&'static str>,
    /// The stop string or token id that ended the choice (vLLM).
    pub stop_reason: Option<StopReason>,
    /// vLLM's `prompt_logprobs`, when requested (in the first chunk of a stream).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// One candidate of a vLLM prompt-logprobs entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VllmLogprob {
    /// Its log-probability.
    pub logprob: f32,
    /// Its rank in the vocabulary at that position (1 = most likely).
    pub rank: u32,
    /// The token decoded on its own.
    pub decoded_token: String,
}

/// vLLM's `prompt_logprobs`: one entry per prompt token, the first `null`, each a map from
/// token id (as a string) to its logprob, holding the prompt token and its top alternatives.
pub type PromptLogprobs = Vec<Option<BTreeMap<String, VllmLogprob>>>;

/// `object: text_completion` (both the response and the streaming chunks).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-...`.
    pub id: String,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Choices (with news, when streaming).
    pub choices: Vec<CompletionChoice>,
    /// Counts in the response; `null`/absent in chunks as for chat.
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    /// The served model name.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds when the server started.
    pub created: u64,
    /// Always `baton`.
    pub owned_by: &'static str,
    /// Where the model was loaded from (vLLM).
    pub root: String,
    /// Always `null` (vLLM).
    pub parent: Option<String>,
    /// Context length (vLLM).
    pub max_model_len: usize,
}

/// `GET /v1/models` response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The served models.
    pub data: Vec<ModelCard>,
}

/// `POST /tokenize` body (vLLM): either `prompt` or `messages`.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    /// Must match the served model when given.
    pub model: Option<String>,
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// Chat messages to template and tokenize.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Add BOS etc. (default true for `prompt`, false for `messages`).
    pub add_special_tokens: Option<bool>,
    /// With `messages`: end with the assistant header (default true).
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's vocabulary string.
    pub return_token_strs: Option<bool>,
}

/// `POST /tokenize` response (vLLM).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenizeResponse {
    /// Number of tokens.
    pub count: usize,
    /// The model's context length.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Vocabulary strings when requested, else `null`.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize` body (vLLM).
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    /// Must match the served model when given.
    pub model: Option<String>,
    /// Token ids to decode.
    pub tokens: Vec<i64>,
}

/// `POST /detokenize` response (vLLM).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DetokenizeResponse {
    /// The decoded text.
    pub prompt: String,
}
