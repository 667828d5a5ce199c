//! An incremental Server-Sent Events decoder.
//!
//! Bytes arrive in arbitrary pieces (an event may be split anywhere, even
//! inside a UTF-8 sequence), so the decoder buffers until a blank line ends an
//! event and then yields that event's `data` (multiple `data:` lines joined
//! with `\n`, per the SSE spec). Comments and other fields are ignored.

/// Buffers SSE bytes and yields complete events' data.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
}

impl SseDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds received bytes and returns the data of every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            if let Some(data) = event_data(&String::from_utf8_lossy(&raw)) {
                events.push(data);
            }
        }
        events
    }

    /// Whether undelivered bytes remain (an event cut off by the stream end).
    pub fn has_partial_event(&self) -> bool {
        self.buf.iter().any(|b| !b.is_ascii_whitespace())
    }
}

/// Position and length of the first blank-line separator.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    (0..buf.len()).find_map(|i| {
        let rest = &buf[i..];
        if rest.starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if rest.starts_with(b"\n\n") || rest.starts_with(b"\r\r") {
            Some((i, 2))
        } else {
            None
        }
    })
}

fn event_data(raw: &str) -> Option<String> {
    let mut data: Option<String> = None;
    for line in raw.lines() {
        let Some(value) = line.strip_prefix("data:") else {
            continue;
        };
        let value = value.strip_prefix(' ').unwrap_or(value);
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(value);
            }
            None => data = Some(value.to_string()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_are_reassembled() {
        let stream = "data: {\"a\":1}\n\n: comment\n\ndata: é\r\n\r\nevent: x\ndata: l1\ndata: l2\n\ndata: [DONE]\n\n";
        let bytes = stream.as_bytes();
        for split in 0..bytes.len() {
            let mut d = SseDecoder::new();
            let mut out = d.push(&bytes[..split]);
            out.extend(d.push(&bytes[split..]));
            assert_eq!(out, ["{\"a\":1}", "é", "l1\nl2", "[DONE]"], "split at {split}");
            assert!(!d.has_partial_event());
        }
    }

    #[test]
    fn cut_off_event_is_reported() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: {\"a\"").is_empty());
        assert!(d.has_partial_event());
    }
}
