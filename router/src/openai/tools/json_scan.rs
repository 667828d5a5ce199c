//! Scanning JSON that may still be arriving: where a value ends, or that it has not ended yet.
//!
//! Tool-call parsers read the model's text while it streams, so they must tell "this JSON is
//! incomplete" (wait for more) from "this JSON is wrong" (give up on it). Nothing here builds
//! values: the parsers keep the model's own bytes for `arguments`, so what a client
//! reassembles from streamed fragments is exactly what a non-streaming response carries.
//!
//! Invariant: on a prefix of a text, [`scan_value`] answers either the same end as on the whole
//! text, or [`Scan::Incomplete`]; it never calls a prefix of a valid value invalid.

/// Deepest nesting scanned; deeper input is [`Scan::Invalid`] (bounds the recursion).
const MAX_DEPTH: usize = 128;

/// What scanning found at a position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// A complete value ending (exclusive) at this byte offset.
    Done(usize),
    /// The text ends inside the value.
    Incomplete,
    /// Not JSON.
    Invalid,
}

/// The first offset at or after `i` that is not JSON whitespace.
pub fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && matches!(s[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// Scans the JSON value starting at `i` (no leading whitespace). A number that runs to the end
/// of the text is [`Scan::Incomplete`], since more digits may follow.
pub fn scan_value(s: &[u8], i: usize) -> Scan {
    value(s, i, 0)
}

fn value(s: &[u8], i: usize, depth: usize) -> Scan {
    if depth > MAX_DEPTH {
        return Scan::Invalid;
    }
    let Some(&c) = s.get(i) else { return Scan::Incomplete };
    match c {
        b'"' => string(s, i),
        b'{' => container(s, i, depth, b'}', true),
        b'[' => container(s, i, depth, b']', false),
        b't' => literal(s, i, b"true"),
        b'f' => literal(s, i, b"false"),
        b'n' => literal(s, i, b"null"),
        b'-' | b'0'..=b'9' => number(s, i),
        _ => Scan::Invalid,
    }
}

fn literal(s: &[u8], i: usize, word: &[u8]) -> Scan {
    let rest = &s[i..];
    if rest.len() >= word.len() {
        if &rest[..word.len()] == word { Scan::Done(i + word.len()) } else { Scan::Invalid }
    } else if word.starts_with(rest) {
        Scan::Incomplete
    } else {
        Scan::Invalid
    }
}

fn number(s: &[u8], i: usize) -> Scan {
    let mut j = i;
    while j < s.len() && matches!(s[j], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
        j += 1;
    }
    if j == s.len() {
        return Scan::Incomplete;
    }
    // The characters are right; let serde judge the shape (e.g. `1.2.3`, `--1`).
    match std::str::from_utf8(&s[i..j]).ok().and_then(|t| t.parse::<serde_json::Number>().ok()) {
        Some(_) => Scan::Done(j),
        None => Scan::Invalid,
    }
}

/// Scans a string starting at the `"` at `i`.
pub fn string(s: &[u8], i: usize) -> Scan {
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            b'"' => return Scan::Done(j + 1),
            b'\\' => j += 2,
            c if c < 0x20 => return Scan::Invalid,
            _ => j += 1,
        }
    }
    Scan::Incomplete
}

fn container(s: &[u8], i: usize, depth: usize, close: u8, object: bool) -> Scan {
    let mut j = skip_ws(s, i + 1);
    match s.get(j) {
        None => return Scan::Incomplete,
        Some(&c) if c == close => return Scan::Done(j + 1),
        _ => {}
    }
    loop {
        if object {
            match s.get(j) {
                None => return Scan::Incomplete,
                Some(b'"') => {}
                Some(_) => return Scan::Invalid,
            }
            j = match string(s, j) {
                Scan::Done(e) => skip_ws(s, e),
                other => return other,
            };
            match s.get(j) {
                None => return Scan::Incomplete,
                Some(b':') => j = skip_ws(s, j + 1),
                Some(_) => return Scan::Invalid,
            }
        }
        j = match value(s, j, depth + 1) {
            Scan::Done(e) => skip_ws(s, e),
            other => return other,
        };
        match s.get(j) {
            None => return Scan::Incomplete,
            Some(b',') => j = skip_ws(s, j + 1),
            Some(&c) if c == close => return Scan::Done(j + 1),
            Some(_) => return Scan::Invalid,
        }
    }
}

/// One `"key": value` of an object being scanned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The decoded key.
    pub key: String,
    /// Where the value starts.
    pub start: usize,
    /// Where it ends, or `None` while the text ends inside it.
    pub end: Option<usize>,
}

/// An object scanned as far as the text goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObjectScan {
    /// The members whose key is complete, in order (the last may have an unfinished value).
    pub members: Vec<Member>,
    /// Just past the closing `}`, once the object is complete.
    pub end: Option<usize>,
    /// The text is not (a prefix of) a JSON object.
    pub invalid: bool,
}

impl ObjectScan {
    /// The member named `key`.
    pub fn get(&self, key: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.key == key)
    }
}

/// Scans the object starting at the `{` at `i`, member by member, as far as the text goes.
pub fn scan_object(s: &[u8], i: usize) -> ObjectScan {
    let mut out = ObjectScan::default();
    if s.get(i) != Some(&b'{') {
        out.invalid = true;
        return out;
    }
    let mut j = skip_ws(s, i + 1);
    if s.get(j) == Some(&b'}') {
        out.end = Some(j + 1);
        return out;
    }
    loop {
        match s.get(j) {
            None => return out,
            Some(b'"') => {}
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
        let key_end = match string(s, j) {
            Scan::Done(e) => e,
            Scan::Incomplete => return out,
            Scan::Invalid => {
                out.invalid = true;
                return out;
            }
        };
        let Some(key) = decode_string(&s[j..key_end]) else {
            out.invalid = true;
            return out;
        };
        j = skip_ws(s, key_end);
        match s.get(j) {
            None => return out,
            Some(b':') => j = skip_ws(s, j + 1),
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
        if j == s.len() {
            return out;
        }
        match value(s, j, 1) {
            Scan::Done(e) => {
                out.members.push(Member { key, start: j, end: Some(e) });
                j = skip_ws(s, e);
            }
            Scan::Incomplete => {
                out.members.push(Member { key, start: j, end: None });
                return out;
            }
            Scan::Invalid => {
                // Kept, open-ended: callers that stream the value's raw text have already
                // sent what came before the fault, so the value keeps growing to the end.
                out.members.push(Member { key, start: j, end: None });
                out.invalid = true;
                return out;
            }
        }
        match s.get(j) {
            None => return out,
            Some(b',') => j = skip_ws(s, j + 1),
            Some(b'}') => {
                out.end = Some(j + 1);
                return out;
            }
            Some(_) => {
                out.invalid = true;
                return out;
            }
        }
    }
}

/// The text of a complete JSON string literal (quotes included), decoded.
pub fn decode_string(literal: &[u8]) -> Option<String> {
    serde_json::from_slice(literal).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_values_end_where_serde_says() {
        let cases = [
            r#"{"a": [1, -2.5e3, true, null, "x\"y\\"], "b": {}}"#,
            "[]",
            r#""\u00e9""#,
            "false",
            r#"{"nested": {"deep": [[[{"k": "v"}]]]}}"#,
        ];
        for case in cases {
            let text = format!("{case} tail");
            assert_eq!(scan_value(text.as_bytes(), 0), Scan::Done(case.len()), "{case}");
            serde_json::from_str::<serde_json::Value>(case).expect("valid");
            // Every proper prefix is incomplete, never invalid.
            for cut in 1..case.len() {
                if case.is_char_boundary(cut) {
                    assert_eq!(scan_value(&case.as_bytes()[..cut], 0), Scan::Incomplete, "{case} at {cut}");
                }
            }
        }
    }

    #[test]
    fn wrong_json_is_invalid() {
        for bad in ["{a: 1}", "[1 2]", "tru e", "{\"a\" 1}", "--1,", "[1,]", "{\"a\":1,}", "\"a\nb\""] {
            assert_eq!(scan_value(bad.as_bytes(), 0), Scan::Invalid, "{bad}");
        }
        let deep = "[".repeat(MAX_DEPTH + 5);
        assert_eq!(scan_value(deep.as_bytes(), 0), Scan::Invalid);
    }

    #[test]
    fn objects_scan_member_by_member() {
        let s = br#"{"name": "f", "arguments": {"x": [1, 2"#;
        let o = scan_object(s, 0);
        assert!(!o.invalid && o.end.is_none());
        let name = o.get("name").expect("name");
        assert_eq!(&s[name.start..name.end.expect("end")], br#""f""#);
        let args = o.get("arguments").expect("arguments");
        assert_eq!((args.end, &s[args.start..]), (None, &br#"{"x": [1, 2"#[..]));
        let s = br#"{"a" : 1 , "b":"c" }x"#;
        let o = scan_object(s, 0);
        assert_eq!(o.end, Some(s.len() - 1));
        assert_eq!(o.members.len(), 2);
        assert!(scan_object(br#"{"a" 1}"#, 0).invalid);
        assert!(scan_object(b"[1]", 0).invalid);
        assert_eq!(scan_object(b"{ }", 0).end, Some(3));
        assert_eq!(decode_string(br#""a\nb""#).as_deref(), Some("a\nb"));
    }
}
