//! What is measured for one request, and how.
//!
//! A [`Stopwatch`] starts right before the request is sent; the backend calls
//! [`Stopwatch::content`] for every chunk that carries generated content and
//! [`Stopwatch::usage`] when the server reports token counts. Only content
//! chunks are timed: role-only deltas, empty keep-alive chunks and the final
//! usage chunk do not count as tokens arriving. [`Stopwatch::finish`] turns
//! the observations into a [`RequestRecord`] with vLLM's definitions.

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Token counts reported by the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens, when reported.
    pub prompt_tokens: Option<u64>,
    /// Generated tokens.
    pub completion_tokens: u64,
}

/// Timing observations of one in-flight request.
#[derive(Debug)]
pub struct Stopwatch {
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    /// The first chunk that ended a choice (for a response whose tokens had no text).
    finish: Option<Instant>,
    itl_s: Vec<f64>,
    chunks: u64,
    /// Tokens counted from chunks that carry token ids (gRPC), exact.
    chunk_tokens: Option<u64>,
    text: String,
    usage: Option<Usage>,
}

impl Stopwatch {
    /// Starts timing now.
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
            first: None,
            last: None,
            finish: None,
            itl_s: Vec::new(),
            chunks: 0,
            chunk_tokens: None,
            text: String::new(),
            usage: None,
        }
    }

    /// When the request was sent.
    pub fn started_at(&self) -> Instant {
        self.start
    }

    /// A chunk with generated content arrived now. `token_ids` is the number of
    /// tokens in it when the protocol says so (gRPC), `None` otherwise.
    pub fn content(&mut self, text: &str, token_ids: Option<usize>) {
        let now = Instant::now();
        if let Some(last) = self.last {
            self.itl_s.push((now - last).as_secs_f64());
        } else {
            self.first = Some(now);
        }
        self.last = Some(now);
        self.chunks += 1;
        if let Some(n) = token_ids {
            *self.chunk_tokens.get_or_insert(0) += n as u64;
        }
        self.text.push_str(text);
    }

    /// A chunk arrived that only ends a choice (its `finish_reason`, no token).
    pub fn finish_chunk(&mut self) {
        self.finish.get_or_insert_with(Instant::now);
    }

    /// The server reported token counts; the last report wins.
    pub fn usage(&mut self, usage: Usage) {
        self.usage = Some(usage);
    }

    /// The text generated so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Completes the record. `error` is the failure, if any; `estimate` counts
    /// output tokens from the text when the server gave no count. The caller
    /// fills in `requested_output_tokens`.
    pub fn finish(
        self,
        index: usize,
        run_start: Instant,
        scheduled_s: f64,
        input_tokens: Option<usize>,
        error: Option<String>,
        estimate: impl FnOnce(&str) -> Option<usize>,
    ) -> RequestRecord {
        let end = Instant::now();
        let offset = |t: Instant| t.saturating_duration_since(run_start).as_secs_f64();
        // A completed response whose tokens all had empty text (the server counted them but
        // sent no text) is a success with empty text, as in vLLM's benchmark, timed to the
        // chunk that ended it; one with no tokens at all is a failure.
        let tokens_reported = self.usage.is_some_and(|u| u.completion_tokens > 0);
        let first = self.first.or(if tokens_reported { self.finish } else { None });
        let error =
            error.or_else(|| first.is_none().then(|| "no content received (the server sent no tokens)".to_string()));
        let (output_tokens, estimated) = match (self.usage, self.chunk_tokens) {
            (Some(u), _) => (u.completion_tokens, false),
            (None, Some(n)) => (n, false),
            (None, None) => match estimate(&self.text) {
                Some(n) => (n as u64, true),
                None => (self.chunks, true),
            },
        };
        let input_tokens = input_tokens.map(|n| n as u64).or_else(|| self.usage.and_then(|u| u.prompt_tokens));
        RequestRecord {
            index,
            scheduled_s,
            start_s: offset(self.start),
            end_s: offset(end),
            success: error.is_none(),
            error,
            input_tokens: input_tokens.unwrap_or(0),
            output_tokens,
            requested_output_tokens: 0,
            output_tokens_estimated: estimated,
            ttft_s: first.map(|f| (f - self.start).as_secs_f64()),
            latency_s: (end - self.start).as_secs_f64(),
            itl_s: self.itl_s,
        }
    }
}

/// The measurements of one timed request, as written to the results JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the run (0-based, warmup excluded).
    pub index: usize,
    /// Planned arrival, seconds from the start of the run.
    pub scheduled_s: f64,
    /// Actual send (after waiting for a concurrency slot), seconds from start.
    pub start_s: f64,
    /// When the response ended, seconds from start.
    pub end_s: f64,
    /// Whether the request completed without error.
    pub success: bool,
    /// The error, for a failed request.
    pub error: Option<String>,
    /// Prompt tokens (measured, else as reported by the server, else 0).
    pub input_tokens: u64,
    /// Generated tokens (from the server's usage when available).
    pub output_tokens: u64,
    /// Tokens asked for (`max_tokens`).
    #[serde(default)]
    pub requested_output_tokens: u64,
    /// Whether `output_tokens` was estimated because the server sent no count.
    pub output_tokens_estimated: bool,
    /// Time to first content chunk, seconds.
    pub ttft_s: Option<f64>,
    /// End-to-end latency, seconds.
    pub latency_s: f64,
    /// Every gap between consecutive content chunks, seconds.
    pub itl_s: Vec<f64>,
}

impl RequestRecord {
    /// Time per output token after the first: (latency − TTFT) / (tokens − 1).
    /// `None` for fewer than two tokens or no TTFT.
    pub fn tpot_s(&self) -> Option<f64> {
        let ttft = self.ttft_s?;
        (self.output_tokens > 1).then(|| (self.latency_s - ttft) / (self.output_tokens - 1) as f64)
    }

    /// Send offsets of each content chunk, seconds from the start of the run.
    pub fn chunk_times_s(&self) -> Vec<f64> {
        let Some(ttft) = self.ttft_s else {
            return Vec::new();
        };
        let mut t = self.start_s + ttft;
        let mut out = Vec::with_capacity(self.itl_s.len() + 1);
        out.push(t);
        for gap in &self.itl_s {
            t += gap;
            out.push(t);
        }
        out
    }
}

/// `s` cut to at most `max` characters, marked when cut, for error messages.
pub fn truncate(s: &str, max: usize) -> String {
    let s = s.trim();
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ttft: Option<f64>, latency: f64, tokens: u64) -> RequestRecord {
        RequestRecord {
            index: 0,
            scheduled_s: 0.0,
            start_s: 1.0,
            end_s: 1.0 + latency,
            success: true,
            error: None,
            input_tokens: 3,
            output_tokens: tokens,
            requested_output_tokens: tokens,
            output_tokens_estimated: false,
            ttft_s: ttft,
            latency_s: latency,
            itl_s: vec![0.1, 0.2],
        }
    }

    #[test]
    fn tpot_follows_vllm_definition() {
        let r = record(Some(0.5), 1.5, 11);
        assert!((r.tpot_s().expect("defined") - 0.1).abs() < 1e-12);
        assert_eq!(record(Some(0.5), 1.5, 1).tpot_s(), None);
        assert_eq!(record(None, 1.5, 5).tpot_s(), None);
    }

    #[test]
    fn chunk_times_accumulate_gaps() {
        let times = record(Some(0.5), 1.0, 3).chunk_times_s();
        let want = [1.5, 1.6, 1.8];
        assert_eq!(times.len(), 3);
        assert!(times.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12));
    }

    #[test]
    fn stopwatch_prefers_usage_then_token_ids_then_estimate() {
        let t0 = Instant::now();
        let mut w = Stopwatch::start();
        w.content("a", None);
        w.content("b", None);
        w.usage(Usage { prompt_tokens: Some(9), completion_tokens: 7 });
        let r = w.finish(0, t0, 0.0, None, None, |_| Some(100));
        assert_eq!((r.output_tokens, r.output_tokens_estimated), (7, false));
        assert_eq!(r.input_tokens, 9);
        assert_eq!(r.itl_s.len(), 1);
        assert!(r.success);

        let mut w = Stopwatch::start();
        w.content("ab", Some(2));
        let r = w.finish(0, t0, 0.0, Some(4), None, |_| Some(100));
        assert_eq!((r.output_tokens, r.output_tokens_estimated), (2, false));
        assert_eq!(r.input_tokens, 4);

        let mut w = Stopwatch::start();
        w.content("a b c", None);
        let r = w.finish(0, t0, 0.0, None, None, |t| Some(t.split(' ').count()));
        assert_eq!((r.output_tokens, r.output_tokens_estimated), (3, true));
        let mut w = Stopwatch::start();
        w.content("a b c", None);
        let r = w.finish(0, t0, 0.0, None, None, |_| None);
        assert_eq!((r.output_tokens, r.output_tokens_estimated), (1, true));
    }

    #[test]
    fn no_content_is_a_failure() {
        let r = Stopwatch::start().finish(0, Instant::now(), 0.0, None, None, |_| None);
        assert!(!r.success);
        assert!(r.error.as_deref().unwrap_or("").contains("no content"));
        assert_eq!(r.ttft_s, None);
    }

    #[test]
    fn truncate_marks_cut_text() {
        assert_eq!(truncate("hello", 10), "hello");
        assert_eq!(truncate("héllo world", 5), "héllo…");
    }
}
