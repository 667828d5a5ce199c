//! `llama3_json`: Llama 3.1–3.3's JSON tool calls. The whole answer is one or more objects
//! `{"name": ..., "parameters": {...}}` separated by `;`, optionally after the
//! `<|python_tag|>` token:
//!
//! ```text
//! <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
//! ```
//!
//! An answer that does not start with `{` (after the tag and whitespace) is plain content,
//! and so is one whose first object turns out not to be a call. Text after the last call
//! that is not another call is content too.

use super::json_scan::skip_ws;
use super::output::{ParsedOutput, call_list, without_partial};

const TAG: &str = "<|python_tag|>";
const ARGS: &[&str] = &["parameters", "arguments"];

/// Splits `text` (see [`super::output`] for the streaming contract) into content and calls.
pub fn parse(text: &str, done: bool, out: &mut ParsedOutput) {
    if !done && TAG.starts_with(text) {
        return;
    }
    let start = if text.starts_with(TAG) { TAG.len() } else { 0 };
    let at = skip_ws(text.as_bytes(), start);
    match text.as_bytes().get(at) {
        None if done => out.content.push_str(text),
        None => {}
        Some(b'{') => {
            let list = call_list(text, at, b';', None, ARGS);
            if list.calls.is_empty() {
                // Only a first object that closes (or breaks) without a name decides.
                if list.broken || done {
                    out.content.push_str(text);
                }
                return;
            }
            out.calls.extend(list.calls);
            if list.broken {
                let rest = without_partial(&text[list.end..], done, &[]);
                out.content.push_str(if done { rest } else { rest.trim_end() });
            }
        }
        Some(_) => out.content.push_str(without_partial(text, done, &[TAG])),
    }
}
