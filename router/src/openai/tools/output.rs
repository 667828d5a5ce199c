//! What a model's output text splits into: reasoning, content and tool calls
//! ([`ParsedOutput`]), and the helpers every format parser shares.
//!
//! Every parser is a pure function `(text so far, done) -> ParsedOutput`. The contract that
//! makes streaming exact: for any prefix `p` of a text `t`, each field of `parse(p, false)` is
//! a prefix of the same field of `parse(t, true)` (and `parse(t, false)`), and the calls of
//! `parse(p, false)` are a prefix of the calls of `parse(t, _)` with each call's name final and
//! its arguments a prefix of the final arguments. So a parser holds back text that could
//! still turn out to be a marker (or whitespace that could still be dropped beside one) until
//! it knows, and a call appears only once its name is complete. [`super::stream`] turns
//! successive results into deltas; the tests feed every format's recorded outputs split at
//! every character and check that the deltas add up to the whole-text result.

use super::json_scan::{decode_string, scan_object, skip_ws};

/// One tool call the model made.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedCall {
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text, as the model wrote them.
    pub arguments: String,
}

/// A model output, split.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedOutput {
    /// Thinking text (`reasoning_content`).
    pub reasoning: String,
    /// The answer text (`content`).
    pub content: String,
    /// Tool calls, in order.
    pub calls: Vec<ParsedCall>,
}

/// Length of the longest proper prefix of `marker` that `text` ends with: text that must be
/// held back because the rest of the marker may follow.
pub fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| marker.is_char_boundary(n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// `text` without a trailing partial `marker` (only while more text may come).
pub fn without_partial<'a>(text: &'a str, done: bool, markers: &[&str]) -> &'a str {
    if done {
        return text;
    }
    let cut = markers.iter().map(|m| partial_marker(text, m)).max().unwrap_or(0);
    &text[..text.len() - cut]
}

/// Content text before a marker or at the end: drops a partial marker and, while more may
/// come, trailing whitespace (it is dropped if a tool call follows); with `after_call`,
/// drops leading whitespace too (what separates calls is not content).
pub fn content_segment<'a>(text: &'a str, done: bool, markers: &[&str], after_call: bool) -> &'a str {
    let mut seg = without_partial(text, done, markers);
    if !done {
        seg = seg.trim_end();
    }
    if after_call { seg.trim_start() } else { seg }
}

/// A JSON tool-call object (`{"name": ..., "arguments"|"parameters": ...}`) as far as it goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObjectCall {
    /// The name, once its string is complete.
    pub name: Option<String>,
    /// The arguments' raw text so far (`{}` when the object closed without them).
    pub arguments: String,
    /// Just past the object's `}`.
    pub end: Option<usize>,
    /// Not a JSON object.
    pub invalid: bool,
}

/// Reads the call object starting at the `{` at `start` of `text`; `args_keys` are the keys
/// that may hold the arguments.
pub fn object_call(text: &str, start: usize, args_keys: &[&str]) -> ObjectCall {
    let s = text.as_bytes();
    let scan = scan_object(s, start);
    let name = scan.get("name").and_then(|m| m.end.map(|e| (m.start, e))).and_then(|(a, b)| decode_string(&s[a..b]));
    let arguments = match args_keys.iter().find_map(|k| scan.get(k)) {
        Some(m) => text[m.start..m.end.unwrap_or(text.len())].to_owned(),
        None if scan.end.is_some() => "{}".to_owned(),
        None => String::new(),
    };
    ObjectCall { name, arguments, end: scan.end, invalid: scan.invalid }
}

/// A sequence of call objects separated by whitespace and `separator` (`;` for llama3_json,
/// `,` inside an array) from `start`, up to `close` (an array's `]`) when given.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CallList {
    /// Objects with a name so far.
    pub calls: Vec<ParsedCall>,
    /// Where parsing stopped: the end of the list, or of the text.
    pub end: usize,
    /// The list (or one of its objects) is not the expected shape; `end` is where that was seen.
    pub broken: bool,
    /// The list ended (its `close`, or the end of the text for an open list that is done).
    pub closed: bool,
}

/// Parses call objects from `start` (just past an opening bracket, or at the first object).
pub fn call_list(text: &str, start: usize, separator: u8, close: Option<u8>, args_keys: &[&str]) -> CallList {
    let s = text.as_bytes();
    let mut out = CallList { end: start, ..Default::default() };
    let mut i = skip_ws(s, start);
    let mut first = true;
    loop {
        out.end = i;
        match s.get(i) {
            None => return out,
            Some(&c) if Some(c) == close => {
                out.end = i + 1;
                out.closed = true;
                return out;
            }
            Some(&c) if c == separator && !first => i = skip_ws(s, i + 1),
            Some(b'{') => {}
            Some(_) => {
                out.broken = true;
                return out;
            }
        }
        if s.get(i) != Some(&b'{') {
            out.broken = i < s.len();
            return out;
        }
        let call = object_call(text, i, args_keys);
        match call.name {
            Some(name) => out.calls.push(ParsedCall { name, arguments: call.arguments }),
            None if call.invalid || call.end.is_some() => {
                out.end = i;
                out.broken = true;
                return out;
            }
            None => {}
        }
        if call.invalid {
            out.broken = true;
            out.end = s.len();
            return out;
        }
        match call.end {
            Some(e) => i = skip_ws(s, e),
            None => {
                out.end = s.len();
                return out;
            }
        }
        first = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_markers_are_held_back() {
        assert_eq!(partial_marker("abc <tool_", "<tool_call>"), 6);
        assert_eq!(partial_marker("abc <tool_call>", "<tool_call>"), 0);
        assert_eq!(partial_marker("<", "<tool_call>"), 1);
        assert_eq!(without_partial("x [TOOL", false, &["[TOOL_CALLS]", "<|"]), "x ");
        assert_eq!(without_partial("x [TOOL", true, &["[TOOL_CALLS]"]), "x [TOOL");
        assert_eq!(content_segment(" a \n", false, &[], true), "a");
        assert_eq!(content_segment(" a \n", true, &[], false), " a \n");
    }

    #[test]
    fn call_objects_and_lists() {
        let text = r#"{"name": "f", "parameters": {"a": 1}}; {"arguments": {}, "name": "g"}"#;
        let list = call_list(text, 0, b';', None, &["arguments", "parameters"]);
        assert_eq!(list.calls.len(), 2);
        assert_eq!(list.calls[0], ParsedCall { name: "f".into(), arguments: r#"{"a": 1}"#.into() });
        assert_eq!(list.calls[1].arguments, "{}");
        assert!(!list.broken);
        let c = object_call(r#"{"name": "f"}"#, 0, &["arguments"]);
        assert_eq!((c.name.as_deref(), c.arguments.as_str()), (Some("f"), "{}"));
        let c = object_call(r#"{"name": "f", "arguments": {"a": tru"#, 0, &["arguments"]);
        assert_eq!(c.arguments, r#"{"a": tru"#);
        let list = call_list(r#"[{"name": "f", "parameters": {}}, {"name": "g""#, 1, b',', Some(b']'), &["parameters"]);
        assert_eq!(list.calls.len(), 2);
        assert!(!list.closed && !list.broken);
        let list = call_list(r#"[{"x": 1}]"#, 1, b',', Some(b']'), &["parameters"]);
        assert!(list.broken && list.calls.is_empty());
    }
}
