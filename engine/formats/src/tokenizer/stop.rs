//! Stop strings over a stream of text deltas. Text that could be the start of a stop string
//! is held back until the next delta decides it, so a stop split across tokens is still
//! found and never partially emitted. Matching is on the concatenated stream: the earliest
//! match wins (the longest stop on a tie).

use crate::error::FormatError;

/// What may be sent to the client after one delta.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that is final now.
    pub text: String,
    /// A stop string matched; nothing after it will be emitted.
    pub stopped: bool,
    /// Which stop string matched (index into the list given to [`StopMatcher::new`]).
    pub matched: Option<usize>,
}

/// Finds stop strings across delta boundaries.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    include_stop: bool,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; with `include_stop`, the emitted text ends with the stop
    /// string itself. An empty stop string is an error.
    pub fn new(stops: &[String], include_stop: bool) -> Result<Self, FormatError> {
        if stops.iter().any(String::is_empty) {
            return Err(FormatError::InvalidArgument("stop strings must not be empty".into()));
        }
        Ok(Self { stops: stops.to_vec(), include_stop, held: String::new(), stopped: false })
    }

    /// Whether a stop string has matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Consumes one delta.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped {
            return StopOutput { text: String::new(), stopped: true, matched: None };
        }
        self.held.push_str(delta);
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|p| (p, std::cmp::Reverse(s.len()), i)))
            .min();
        if let Some((pos, std::cmp::Reverse(len), i)) = found {
            let end = if self.include_stop { pos + len } else { pos };
            let text = self.held[..end].to_string();
            self.held.clear();
            self.stopped = true;
            return StopOutput { text, stopped: true, matched: Some(i) };
        }
        let keep = self.partial_suffix_len();
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutput { text, stopped: false, matched: None }
    }

    /// Ends the stream: returns the held-back text (it did not turn into a stop).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        self.held
            .char_indices()
            .map(|(i, _)| &self.held[i..])
            .find(|suffix| self.stops.iter().any(|s| s.len() > suffix.len() && s.starts_with(suffix)))
            .map_or(0, str::len)
    }
}
