//! Calls the grammar forced: `tool_choice: "required"` and a named `tool_choice`.
//!
//! - `required`: the output is a JSON list of `{"name": ..., "parameters": {...}}`, one
//!   entry per call (vLLM's shape; the grammar in [`super::choice`] enforces it).
//! - named: the whole output is the arguments of that one function.
//!
//! Both read the model's text as written, so streamed argument fragments add up to exactly
//! the non-streaming arguments.

use super::json_scan::skip_ws;
use super::output::{ParsedCall, ParsedOutput, call_list};

/// `required`: the calls in a JSON list.
pub fn parse_required(text: &str, out: &mut ParsedOutput) {
    let at = skip_ws(text.as_bytes(), 0);
    if text.as_bytes().get(at) == Some(&b'[') {
        out.calls.extend(call_list(text, at + 1, b',', Some(b']'), &["parameters", "arguments"]).calls);
    }
}

/// A named tool choice: all of the output is `name`'s arguments.
/// Trailing whitespace is held back while streaming and dropped at the end.
pub fn parse_named(name: &str, text: &str, out: &mut ParsedOutput) {
    out.calls.push(ParsedCall { name: name.to_owned(), arguments: text.trim().to_owned() });
}
