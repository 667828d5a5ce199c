//! `openai`: gpt-oss's harmony format. The answer is a run of messages, each a header and a
//! body; the channel in the header says what the body is, and a `to=functions.NAME`
//! recipient makes it a tool call whose body is the JSON arguments:
//!
//! ```text
//! <|channel|>analysis<|message|>The user wants the weather.<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! ```
//!
//! `analysis` bodies are reasoning, `final` (and `commentary` without a recipient, a preamble)
//! bodies are content. Recipients other than `functions.*` (gpt-oss's built-in browser and
//! python tools) are not served, and their messages are dropped. All markers are special
//! tokens, so requests are detokenized with `skip_special_tokens: false`.

use super::output::{ParsedCall, ParsedOutput, without_partial};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
/// What ends a body (`<|start|>` when a message ends without an end token).
const ENDS: &[&str] = &["<|end|>", "<|call|>", "<|return|>", START];
const FUNCTIONS: &str = "functions.";

/// The word after `key` in a header, up to whitespace or the next token.
fn header_word<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header.find(key)? + key.len();
    let rest = &header[at..];
    Some(&rest[..rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len())])
}

/// Splits `text` (see [`super::output`] for the streaming contract) into reasoning, content
/// and calls.
pub fn parse(text: &str, done: bool, out: &mut ParsedOutput) {
    // Not harmony at all (unless it may still become `<|`): plain content.
    let may_open = text.starts_with("<|") || (!done && "<|".starts_with(text));
    if !may_open {
        out.content.push_str(text);
        return;
    }
    let mut pos = 0;
    loop {
        let Some(m) = text[pos..].find(MESSAGE) else {
            if pos == 0 && done {
                out.content.push_str(text);
            }
            return;
        };
        let header = &text[pos..pos + m];
        let body_start = pos + m + MESSAGE.len();
        let end = ENDS.iter().filter_map(|e| text[body_start..].find(e).map(|at| (body_start + at, *e))).min();
        let body = match end {
            Some((at, _)) => &text[body_start..at],
            None => without_partial(&text[body_start..], done, ENDS),
        };
        let recipient = header_word(header, "to=");
        match (recipient, header_word(header, CHANNEL)) {
            (Some(r), _) => {
                if let Some(name) = r.strip_prefix(FUNCTIONS).filter(|n| !n.is_empty()) {
                    // The name is final once the header is; the arguments grow (trailing
                    // whitespace is held back, and dropped at the end).
                    out.calls.push(ParsedCall { name: name.to_owned(), arguments: body.trim().to_owned() });
                }
            }
            (None, Some("analysis")) => out.reasoning.push_str(body),
            (None, _) => out.content.push_str(body),
        }
        match end {
            Some((at, START)) => pos = at,
            Some((at, token)) => pos = at + token.len(),
            None => return,
        }
    }
}
