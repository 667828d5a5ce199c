//! `mistral`: Mistral's `[TOOL_CALLS]` token followed either by a JSON list of calls (tokenizer
//! versions before v11) or, from v11, by `name[ARGS]{...}` (or `name{...}`), repeated with
//! another `[TOOL_CALLS]` per call:
//!
//! ```text
//! [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
//! [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}
//! ```
//!
//! Text before the first `[TOOL_CALLS]` is content. `[TOOL_CALLS]` is a special token, so a
//! request with tools is detokenized with `skip_special_tokens: false`. Tool territory that
//! yields no call is given back as content when the output ends.

use super::json_scan::{Scan, scan_value, skip_ws};
use super::output::{ParsedCall, ParsedOutput, call_list, content_segment, without_partial};

const MARKER: &str = "[TOOL_CALLS]";
const ARGS_MARKER: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";
const ARGS: &[&str] = &["arguments", "parameters"];

/// Splits `text` (see [`super::output`] for the streaming contract) into content and calls.
pub fn parse(text: &str, done: bool, out: &mut ParsedOutput) {
    let Some(first) = text.find(MARKER) else {
        out.content.push_str(content_segment(text, done, &[MARKER], false));
        return;
    };
    let before = &text[..first];
    let calls_before = out.calls.len();
    let at = skip_ws(text.as_bytes(), first + MARKER.len());
    let rest_at = if text.as_bytes().get(at) == Some(&b'[') && !text[at..].starts_with(ARGS_MARKER) {
        let list = call_list(text, at + 1, b',', Some(b']'), ARGS);
        out.calls.extend(list.calls);
        (list.closed || list.broken).then_some(list.end)
    } else {
        named_calls(text, first, done, out)
    };
    if out.calls.len() == calls_before {
        // Nothing resolved (yet): all of it is content if the output ends this way.
        let decided = rest_at.is_some() || done;
        out.content.push_str(if decided { text } else { content_segment(before, false, &[], false) });
        return;
    }
    out.content.push_str(content_segment(before, false, &[], false));
    if let Some(rest) = rest_at {
        out.content.push_str(content_segment(&text[rest..], done, &[MARKER], true));
    }
}

/// The v11 form from the marker at `pos`; returns where the text after the last call starts,
/// once known.
fn named_calls(text: &str, mut pos: usize, done: bool, out: &mut ParsedOutput) -> Option<usize> {
    let s = text.as_bytes();
    let ident = |c: char| c.is_alphanumeric() || matches!(c, '_' | '-' | '.');
    loop {
        let name_start = skip_ws(s, pos + MARKER.len());
        let name_end = name_start + text[name_start..].find(|c: char| !ident(c)).unwrap_or(text.len() - name_start);
        let name = &text[name_start..name_end];
        let mut i = name_end;
        if text[i..].starts_with(CALL_ID) {
            i += CALL_ID.len();
            i += text[i..].find(|c: char| !c.is_alphanumeric()).unwrap_or(text.len() - i);
        }
        if text[i..].starts_with(ARGS_MARKER) {
            i += ARGS_MARKER.len();
        }
        i = skip_ws(s, i);
        let may_grow = i == text.len() || ARGS_MARKER.starts_with(&text[i..]) || CALL_ID.starts_with(&text[i..]);
        if may_grow && !done {
            return None;
        }
        if name.is_empty() || s.get(i) != Some(&b'{') {
            return Some(pos);
        }
        let (arguments, end) = match scan_value(s, i) {
            Scan::Done(e) => (&text[i..e], Some(e)),
            Scan::Incomplete | Scan::Invalid => (&text[i..], None),
        };
        out.calls.push(ParsedCall { name: name.to_owned(), arguments: arguments.to_owned() });
        let end = end?;
        let next = skip_ws(s, end);
        if text[next..].starts_with(MARKER) {
            pos = next;
        } else if !done && without_partial(&text[next..], false, &[MARKER]).is_empty() {
            return None;
        } else {
            return Some(end);
        }
    }
}
