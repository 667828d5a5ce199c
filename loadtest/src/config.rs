//! The configuration of one run, as plain serialisable data.
//!
//! The CLI ([`crate::cli`]) builds a [`RunConfig`]; tests and other tools build
//! one directly. It is written verbatim into the results JSON so a result
//! always says how it was produced. [`RunConfig::validate`] rejects
//! combinations that cannot run, before anything is sent.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::LoadtestError;

/// A request arrival rate in requests per second; `inf` sends all at once.
///
/// Serialised as a number, or as the string `"inf"` because JSON has no
/// infinity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate(f64);

impl Rate {
    /// Every request is sent at time zero.
    pub const INFINITE: Rate = Rate(f64::INFINITY);

    /// A finite positive rate; `None` for zero, negative or NaN.
    pub fn per_second(rate: f64) -> Option<Rate> {
        (rate > 0.0).then_some(Rate(rate))
    }

    /// Requests per second (`f64::INFINITY` for [`Rate::INFINITE`]).
    pub fn value(self) -> f64 {
        self.0
    }

    /// Whether all requests are sent at once.
    pub fn is_infinite(self) -> bool {
        self.0.is_infinite()
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_infinite() { write!(f, "inf") } else { write!(f, "{}", self.0) }
    }
}

impl FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("inf") || s.eq_ignore_ascii_case("infinity") {
            return Ok(Rate::INFINITE);
        }
        let value: f64 = s.parse().map_err(|_| format!("`{s}` is not a rate (a positive number or `inf`)"))?;
        if value.is_infinite() && value > 0.0 {
            return Ok(Rate::INFINITE);
        }
        Rate::per_second(value).ok_or_else(|| format!("rate must be positive, got `{s}`"))
    }
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum RateRepr {
    Number(f64),
    Text(String),
}

impl Serialize for Rate {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.is_infinite() {
            RateRepr::Text("inf".into()).serialize(serializer)
        } else {
            RateRepr::Number(self.0).serialize(serializer)
        }
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match RateRepr::deserialize(deserializer)? {
            RateRepr::Number(v) => {
                Rate::per_second(v).ok_or_else(|| serde::de::Error::custom(format!("rate must be positive, got {v}")))
            }
            RateRepr::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Which API the requests go through. All of them stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// OpenAI `POST /v1/completions` with SSE.
    Openai,
    /// OpenAI `POST /v1/chat/completions` with SSE.
    OpenaiChat,
    /// Baton's gRPC `Generate` server stream.
    Grpc,
}

/// Where prompts and their requested output lengths come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DatasetConfig {
    /// Random prompts of exact token lengths, measured with the server's
    /// tokenizer.
    Random {
        /// Mean input length in tokens.
        input_len: usize,
        /// Mean output length in tokens.
        output_len: usize,
        /// Lengths are drawn uniformly from `[len·(1−r), len·(1+r)]`.
        range_ratio: f64,
    },
    /// A ShareGPT-format JSON file (first human turn is the prompt, the
    /// following turn's length is the output length).
    Sharegpt {
        /// The JSON file.
        path: PathBuf,
        /// Overrides the output length taken from the conversation.
        output_len: Option<usize>,
    },
    /// A text file with one prompt per non-empty line.
    Prompts {
        /// The text file.
        path: PathBuf,
        /// Output length of every request.
        output_len: usize,
    },
}

/// Service-level objectives for goodput, in milliseconds. A request is "good"
/// when it meets all of the ones that are set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token limit.
    pub ttft_ms: Option<f64>,
    /// Time per output token limit.
    pub tpot_ms: Option<f64>,
    /// End-to-end latency limit.
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Whether no objective is set (goodput is then not reported).
    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2el_ms.is_none()
    }
}

impl FromStr for Slo {
    type Err = String;

    /// Parses `ttft:MS tpot:MS e2el:MS` (any subset, space or comma separated).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut slo = Slo::default();
        for part in s.split([' ', ',']).filter(|p| !p.is_empty()) {
            let (name, value) = part.split_once(':').ok_or_else(|| format!("goodput term `{part}` is not NAME:MS"))?;
            let ms: f64 = value
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("goodput term `{part}`: `{value}` is not a positive number of ms"))?;
            let slot = match name {
                "ttft" => &mut slo.ttft_ms,
                "tpot" => &mut slo.tpot_ms,
                "e2el" => &mut slo.e2el_ms,
                other => return Err(format!("unknown goodput metric `{other}` (use ttft, tpot, e2el)")),
            };
            *slot = Some(ms);
        }
        if slo.is_empty() {
            return Err("goodput needs at least one of ttft:MS tpot:MS e2el:MS".into());
        }
        Ok(slo)
    }
}

/// Everything one run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// The API used.
    pub backend: BackendKind,
    /// Server address, e.g. `http://127.0.0.1:8000` (gRPC: `http://127.0.0.1:50051`).
    pub base_url: String,
    /// Model name sent in OpenAI requests; asked from `/v1/models` when unset.
    pub model: Option<String>,
    /// Local `tokenizer.json` used to build exact-length prompts.
    pub tokenizer: Option<PathBuf>,
    /// HTTP server whose `/tokenize` and `/detokenize` are used when no local
    /// tokenizer is given; defaults to `base_url` for the OpenAI backends.
    pub tokenize_url: Option<String>,
    /// The prompts.
    pub dataset: DatasetConfig,
    /// Number of timed requests (with `duration_s`, the size of the prompt
    /// pool that is cycled through).
    pub num_prompts: usize,
    /// Run for this many seconds instead of a fixed number of requests.
    pub duration_s: Option<f64>,
    /// Mean arrival rate.
    pub request_rate: Rate,
    /// Gamma shape of the arrival gaps: 1 is Poisson, below 1 burstier.
    pub burstiness: f64,
    /// At most this many requests in flight.
    pub max_concurrency: Option<usize>,
    /// Requests sent before the timed run and not counted.
    pub warmup: usize,
    /// Seed of the arrival schedule and the prompts.
    pub seed: u64,
    /// Goodput objectives.
    pub goodput: Slo,
    /// Send `ignore_eos` and `min_tokens` so outputs have the requested length.
    pub ignore_eos: bool,
    /// Sampling temperature sent with every request.
    pub temperature: f64,
    /// Per-request timeout in seconds (none when unset).
    pub request_timeout_s: Option<f64>,
    /// Fields merged into every OpenAI request body, overriding the ones the load tester
    /// sets (e.g. `response_format`); the gRPC backend takes none.
    #[serde(default)]
    pub extra_body: serde_json::Map<String, serde_json::Value>,
    /// Draw a progress bar on stderr.
    pub show_progress: bool,
}

impl RunConfig {
    /// A configuration with the usual defaults for the given target and data.
    pub fn new(backend: BackendKind, base_url: impl Into<String>, dataset: DatasetConfig) -> Self {
        Self {
            backend,
            base_url: base_url.into(),
            model: None,
            tokenizer: None,
            tokenize_url: None,
            dataset,
            num_prompts: 1000,
            duration_s: None,
            request_rate: Rate::INFINITE,
            burstiness: 1.0,
            max_concurrency: None,
            warmup: 0,
            seed: 0,
            goodput: Slo::default(),
            ignore_eos: true,
            temperature: 0.0,
            request_timeout_s: None,
            extra_body: serde_json::Map::new(),
            show_progress: false,
        }
    }

    /// Rejects configurations that cannot run, with a message naming the flag.
    pub fn validate(&self) -> Result<(), LoadtestError> {
        let bad = |m: &str| Err(LoadtestError::Config(m.to_string()));
        if self.num_prompts == 0 {
            return bad("--num-prompts must be at least 1");
        }
        if !(self.burstiness.is_finite() && self.burstiness > 0.0) {
            return bad("--burstiness must be a positive number");
        }
        if self.max_concurrency == Some(0) {
            return bad("--max-concurrency must be at least 1");
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0) {
                return bad("--duration must be a positive number of seconds");
            }
            if self.request_rate.is_infinite() && self.max_concurrency.is_none() {
                return bad("--duration with --request-rate inf needs --max-concurrency");
            }
        }
        if let Some(t) = self.request_timeout_s
            && !(t.is_finite() && t > 0.0)
        {
            return bad("--request-timeout must be a positive number of seconds");
        }
        if self.backend == BackendKind::Grpc && !self.extra_body.is_empty() {
            return bad("--extra-body applies to the OpenAI backends only, not --backend grpc");
        }
        if !self.base_url.starts_with("http://") && !self.base_url.starts_with("https://") {
            return bad("--base-url must start with http:// or https://");
        }
        match &self.dataset {
            DatasetConfig::Random { input_len, output_len, range_ratio } => {
                if *input_len == 0 || *output_len == 0 {
                    return bad("--input-len and --output-len must be at least 1");
                }
                if !(0.0..1.0).contains(range_ratio) {
                    return bad("--range-ratio must be in [0, 1)");
                }
            }
            DatasetConfig::Prompts { output_len, .. } if *output_len == 0 => {
                return bad("--output-len must be at least 1");
            }
            DatasetConfig::Sharegpt { output_len: Some(0), .. } => return bad("--output-len must be at least 1"),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_parses_numbers_and_inf() {
        assert_eq!("2.5".parse::<Rate>().map(Rate::value), Ok(2.5));
        assert!("inf".parse::<Rate>().map(Rate::is_infinite).unwrap_or(false));
        assert!("0".parse::<Rate>().is_err());
        assert!("-1".parse::<Rate>().is_err());
        assert!("fast".parse::<Rate>().is_err());
    }

    #[test]
    fn rate_round_trips_through_json() {
        for rate in [Rate::INFINITE, Rate(3.0)] {
            let json = serde_json::to_string(&rate).expect("serialise");
            let back: Rate = serde_json::from_str(&json).expect("deserialise");
            assert_eq!(back, rate);
        }
        assert_eq!(serde_json::to_string(&Rate::INFINITE).expect("json"), "\"inf\"");
    }

    #[test]
    fn slo_parses_all_terms_and_rejects_bad_ones() {
        let slo: Slo = "ttft:200 tpot:50,e2el:3000".parse().expect("valid");
        assert_eq!(slo.ttft_ms, Some(200.0));
        assert_eq!(slo.tpot_ms, Some(50.0));
        assert_eq!(slo.e2el_ms, Some(3000.0));
        assert!("ttft".parse::<Slo>().is_err());
        assert!("ttft:abc".parse::<Slo>().is_err());
        assert!("ttft:-5".parse::<Slo>().is_err());
        assert!("itl:5".parse::<Slo>().is_err());
        assert!("".parse::<Slo>().is_err());
    }

    fn random() -> DatasetConfig {
        DatasetConfig::Random { input_len: 10, output_len: 10, range_ratio: 0.0 }
    }

    #[test]
    fn validate_rejects_unrunnable_configs() {
        let ok = RunConfig::new(BackendKind::Openai, "http://x:1", random());
        assert!(ok.validate().is_ok());
        let mut c = ok.clone();
        c.duration_s = Some(5.0);
        assert!(matches!(c.validate(), Err(LoadtestError::Config(m)) if m.contains("--max-concurrency")));
        c.max_concurrency = Some(4);
        assert!(c.validate().is_ok());
        let mut c = ok.clone();
        c.num_prompts = 0;
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.base_url = "localhost:8000".into();
        assert!(c.validate().is_err());
        let mut c = ok;
        c.dataset = DatasetConfig::Random { input_len: 10, output_len: 10, range_ratio: 1.5 };
        assert!(c.validate().is_err());
    }
}
