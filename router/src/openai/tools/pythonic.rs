//! `pythonic`: calls written as a Python list of function calls with keyword arguments
//! (Llama 3.2/4, ToolACE and other models trained on that format), optionally wrapped in
//! `<|python_start|>` ... `<|python_end|>`:
//!
//! ```text
//! [get_weather(city='Paris', days=3), get_time(zone="CET", exact=True)]
//! ```
//!
//! Arguments are Python literals (strings, numbers, `True`/`False`/`None`, lists, tuples,
//! dicts) and become a JSON object. Since the JSON is a translation, not the model's own text,
//! a call is emitted whole once its `)` is read. An output that does not start with `[` is
//! content, and so is a list whose first element is not a well-formed call.

use super::output::{ParsedCall, ParsedOutput, content_segment, without_partial};
use serde_json::{Number, Value};

const START: &str = "<|python_start|>";
const END: &str = "<|python_end|>";
/// Deepest literal nesting accepted (bounds the recursion).
const MAX_DEPTH: usize = 64;

enum Lit<T> {
    Done(T, usize),
    Incomplete,
    Invalid,
}

use Lit::{Done, Incomplete, Invalid};

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

fn ident(text: &str, i: usize) -> Lit<&str> {
    let len = text[i..].find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.')).unwrap_or(text.len() - i);
    match (len, i + len == text.len()) {
        (_, true) => Incomplete,
        (0, false) => Invalid,
        (_, false) => Done(&text[i..i + len], i + len),
    }
}

fn string(text: &str, i: usize, quote: char) -> Lit<Value> {
    let mut out = String::new();
    let mut chars = text[i + 1..].char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            c if c == quote => return Done(Value::String(out), i + 1 + k + 1),
            '\\' => {
                let Some((_, e)) = chars.next() else { return Incomplete };
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    'u' | 'x' => {
                        let digits = if e == 'u' { 4 } else { 2 };
                        let hex: String = chars.by_ref().take(digits).map(|(_, c)| c).collect();
                        if hex.len() < digits {
                            return Incomplete;
                        }
                        match u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                            Some(c) => out.push(c),
                            None => return Invalid,
                        }
                    }
                    other => out.push(other),
                }
            }
            '\n' => return Invalid,
            c => out.push(c),
        }
    }
    Incomplete
}

fn number(text: &str, i: usize) -> Lit<Value> {
    let len = text[i..]
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '-' | '+' | '.' | 'e' | 'E' | '_')))
        .unwrap_or(text.len() - i);
    if i + len == text.len() {
        return Incomplete;
    }
    let digits = text[i..i + len].replace('_', "");
    let value = match digits.parse::<i64>() {
        Ok(n) => Some(Number::from(n)),
        Err(_) => digits.parse::<f64>().ok().and_then(Number::from_f64),
    };
    value.map_or(Invalid, |n| Done(Value::Number(n), i + len))
}

/// Items up to `close`, each parsed by `item`.
fn items<T>(text: &str, mut i: usize, close: u8, mut item: impl FnMut(usize) -> Lit<T>) -> Lit<Vec<T>> {
    let s = text.as_bytes();
    let mut out = Vec::new();
    loop {
        i = skip_ws(s, i);
        match s.get(i) {
            None => return Incomplete,
            Some(&c) if c == close => return Done(out, i + 1),
            _ => {}
        }
        match item(i) {
            Done(v, e) => {
                out.push(v);
                i = skip_ws(s, e);
            }
            Incomplete => return Incomplete,
            Invalid => return Invalid,
        }
        match s.get(i) {
            None => return Incomplete,
            Some(b',') => i += 1,
            Some(&c) if c == close => return Done(out, i + 1),
            Some(_) => return Invalid,
        }
    }
}

fn literal(text: &str, i: usize, depth: usize) -> Lit<Value> {
    if depth > MAX_DEPTH {
        return Invalid;
    }
    let s = text.as_bytes();
    let Some(&c) = s.get(i) else { return Incomplete };
    match c {
        b'\'' | b'"' => string(text, i, c as char),
        b'-' | b'+' | b'.' | b'0'..=b'9' => number(text, i),
        b'[' | b'(' => {
            let close = if c == b'[' { b']' } else { b')' };
            match items(text, i + 1, close, |j| literal(text, j, depth + 1)) {
                Done(v, e) => Done(Value::Array(v), e),
                Incomplete => Incomplete,
                Invalid => Invalid,
            }
        }
        b'{' => {
            let entry = |j: usize| -> Lit<(String, Value)> {
                let (key, e) = match literal(text, j, depth + 1) {
                    Done(Value::String(k), e) => (k, e),
                    Done(other, e) => (other.to_string(), e),
                    Incomplete => return Incomplete,
                    Invalid => return Invalid,
                };
                let e = skip_ws(s, e);
                match s.get(e) {
                    None => return Incomplete,
                    Some(b':') => {}
                    Some(_) => return Invalid,
                }
                match literal(text, skip_ws(s, e + 1), depth + 1) {
                    Done(v, e) => Done((key, v), e),
                    Incomplete => Incomplete,
                    Invalid => Invalid,
                }
            };
            match items(text, i + 1, b'}', entry) {
                Done(entries, e) => Done(Value::Object(entries.into_iter().collect()), e),
                Incomplete => Incomplete,
                Invalid => Invalid,
            }
        }
        _ => match ident(text, i) {
            Done("True", e) => Done(Value::Bool(true), e),
            Done("False", e) => Done(Value::Bool(false), e),
            Done("None", e) => Done(Value::Null, e),
            Done(..) | Invalid => Invalid,
            Incomplete if ["True", "False", "None"].iter().any(|w| w.starts_with(&text[i..])) => Incomplete,
            Incomplete => Invalid,
        },
    }
}

/// One `name(k=v, ...)` at `i`.
fn call(text: &str, i: usize) -> Lit<ParsedCall> {
    let s = text.as_bytes();
    let (name, e) = match ident(text, i) {
        Done(n, e) => (n, e),
        Incomplete => return Incomplete,
        Invalid => return Invalid,
    };
    let e = skip_ws(s, e);
    match s.get(e) {
        None => return Incomplete,
        Some(b'(') => {}
        Some(_) => return Invalid,
    }
    let kwarg = |j: usize| -> Lit<(String, Value)> {
        let (key, k) = match ident(text, j) {
            Done(k, e) => (k.to_owned(), skip_ws(s, e)),
            Incomplete => return Incomplete,
            Invalid => return Invalid,
        };
        match s.get(k) {
            None => return Incomplete,
            Some(b'=') => {}
            Some(_) => return Invalid,
        }
        match literal(text, skip_ws(s, k + 1), 0) {
            Done(v, e) => Done((key, v), e),
            Incomplete => Incomplete,
            Invalid => Invalid,
        }
    };
    match items(text, e + 1, b')', kwarg) {
        Done(args, e) => {
            // In the model's order, whatever order serde_json's maps keep.
            let members: Vec<String> = args.iter().map(|(k, v)| format!("{}:{v}", Value::from(k.as_str()))).collect();
            let arguments = format!("{{{}}}", members.join(","));
            Done(ParsedCall { name: name.to_owned(), arguments }, e)
        }
        Incomplete => Incomplete,
        Invalid => Invalid,
    }
}

/// Splits `text` (see [`super::output`] for the streaming contract) into content and calls.
pub fn parse(text: &str, done: bool, out: &mut ParsedOutput) {
    if !done && START.starts_with(text) {
        return;
    }
    let s = text.as_bytes();
    let start = if text.starts_with(START) { START.len() } else { 0 };
    let at = skip_ws(s, start);
    match s.get(at) {
        None if done => return out.content.push_str(text),
        None => return,
        Some(b'[') => {}
        Some(_) => return out.content.push_str(without_partial(text, done, &[START])),
    }
    // The calls, then where the text after them starts (`None` while the list is open).
    let mut i = at + 1;
    let mut calls = Vec::new();
    let rest = loop {
        i = skip_ws(s, i);
        if s.get(i) == Some(&b']') {
            break Some(i + 1);
        }
        match call(text, i) {
            Done(c, e) => {
                calls.push(c);
                i = skip_ws(s, e);
                match s.get(i) {
                    Some(b',') => i += 1,
                    Some(b']') => break Some(i + 1),
                    Some(_) => break Some(i),
                    None if done => break Some(i),
                    None => break None,
                }
            }
            Invalid => break Some(i),
            Incomplete if done => break Some(i),
            Incomplete => break None,
        }
    };
    if calls.is_empty() {
        if rest.is_some() {
            out.content.push_str(text);
        }
        return;
    }
    out.calls.extend(calls);
    if let Some(rest) = rest {
        let tail = &text[rest..];
        let tail = tail.trim_start().strip_prefix(END).unwrap_or(tail);
        out.content.push_str(content_segment(tail, done, &[END], true));
    }
}
