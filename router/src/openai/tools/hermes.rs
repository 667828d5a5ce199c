//! `hermes`: calls as JSON objects between `<tool_call>` and `</tool_call>` (Hermes 2/3,
//! Qwen2.5, Qwen3, and most models trained on the Hermes function-calling format):
//!
//! ```text
//! Let me check.
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! Text outside the blocks is content, without the whitespace that separates it from a
//! call. A block whose object never gets a name (not JSON, no `name`) stays in the content,
//! markers included, so nothing the model wrote is lost.

use super::json_scan::skip_ws;
use super::output::{ParsedCall, ParsedOutput, content_segment, object_call, without_partial};

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";
const ARGS: &[&str] = &["arguments", "parameters"];

/// Splits `text` (see [`super::output`] for the streaming contract) into content and calls.
pub fn parse(text: &str, done: bool, out: &mut ParsedOutput) {
    let mut pos = 0;
    let mut after_call = false;
    loop {
        let Some(found) = text[pos..].find(START) else {
            out.content.push_str(content_segment(&text[pos..], done, &[START], after_call));
            return;
        };
        let block = pos + found;
        let before = &text[pos..block];
        let body_start = block + START.len();
        let (body_end, closed) = match text[body_start..].find(END) {
            Some(e) => (body_start + e, true),
            None => (body_start + without_partial(&text[body_start..], done, &[END]).len(), false),
        };
        let body = &text[..body_end];
        let at = skip_ws(body.as_bytes(), body_start);
        let name = match body.as_bytes().get(at) {
            Some(b'{') => {
                let call = object_call(body, at, ARGS);
                call.name.map(|name| ParsedCall { name, arguments: call.arguments })
            }
            _ => None,
        };
        let block_end = if closed { body_end + END.len() } else { text.len() };
        match name {
            Some(call) => {
                out.content.push_str(content_segment(before, false, &[], after_call));
                out.calls.push(call);
                after_call = true;
            }
            None if closed || done || (body_end > at && body.as_bytes()[at] != b'{') => {
                // Not a call after all: the block is content, as written.
                out.content.push_str(if after_call { before.trim_start() } else { before });
                out.content.push_str(&text[block..block_end]);
                after_call = false;
            }
            None => {
                out.content.push_str(content_segment(before, false, &[], after_call));
                return;
            }
        }
        if !closed {
            return;
        }
        pos = block_end;
    }
}
