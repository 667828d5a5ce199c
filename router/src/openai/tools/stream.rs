//! Streaming: turns successive parses of a growing text into deltas (new reasoning, new
//! content, new calls and argument fragments).
//!
//! Each push re-parses the text so far ([`super::OutputParser::parse`]) and sends what grew
//! since the last push. The parsers' contract ([`super::output`]) makes every result an
//! extension of the one before, so the deltas add up to exactly the non-streaming result;
//! were a parser ever to break it, the diff sends nothing rather than something wrong.
//! Re-parsing is linear in the output, which is bounded by `max_tokens`.

use super::OutputParser;

/// New output of one call since the last delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallDelta {
    /// Position of the call in the choice's `tool_calls`.
    pub index: usize,
    /// The function name, on the call's first delta only.
    pub name: Option<String>,
    /// New argument text.
    pub arguments: String,
}

/// What one push produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutputDelta {
    /// New reasoning text.
    pub reasoning: String,
    /// New content text.
    pub content: String,
    /// New calls and argument fragments.
    pub calls: Vec<CallDelta>,
}

impl OutputDelta {
    /// Nothing new.
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }
}

/// The incremental form of an [`OutputParser`] for one choice.
#[derive(Debug, Clone)]
pub struct StreamingParser {
    parser: OutputParser,
    text: String,
    sent_reasoning: usize,
    sent_content: usize,
    /// Argument bytes sent per call.
    sent_calls: Vec<usize>,
}

fn grown<'a>(now: &'a str, sent: &mut usize) -> &'a str {
    match now.get(*sent..) {
        Some(new) => {
            *sent = now.len();
            new
        }
        None => "",
    }
}

impl StreamingParser {
    /// A parser for a choice that has produced nothing yet.
    pub fn new(parser: OutputParser) -> Self {
        Self { parser, text: String::new(), sent_reasoning: 0, sent_content: 0, sent_calls: Vec::new() }
    }

    /// Feeds new text.
    pub fn push(&mut self, text: &str) -> OutputDelta {
        self.text.push_str(text);
        self.diff(false)
    }

    /// Ends the output: releases whatever was held back.
    pub fn finish(&mut self) -> OutputDelta {
        self.diff(true)
    }

    /// Whether any call was sent.
    pub fn made_calls(&self) -> bool {
        !self.sent_calls.is_empty()
    }

    fn diff(&mut self, done: bool) -> OutputDelta {
        let parsed = self.parser.parse(&self.text, done);
        let mut delta = OutputDelta {
            reasoning: grown(&parsed.reasoning, &mut self.sent_reasoning).to_owned(),
            content: grown(&parsed.content, &mut self.sent_content).to_owned(),
            calls: Vec::new(),
        };
        for (index, call) in parsed.calls.into_iter().enumerate() {
            let name = match self.sent_calls.get(index) {
                Some(_) => None,
                None => {
                    self.sent_calls.push(0);
                    Some(call.name)
                }
            };
            let Some(sent) = self.sent_calls.get_mut(index) else { continue };
            let arguments = grown(&call.arguments, sent).to_owned();
            if name.is_some() || !arguments.is_empty() {
                delta.calls.push(CallDelta { index, name, arguments });
            }
        }
        delta
    }
}
