//! The command line: `baton-loadtest [RUN FLAGS]` for a run or a sweep, and
//! `baton-loadtest compare A.json B.json`. Flag names follow `vllm bench
//! serve` where one exists, so commands translate directly.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::compare;
use crate::config::{BackendKind, DatasetConfig, Rate, RunConfig, Slo};
use crate::error::LoadtestError;
use crate::report;
use crate::runner::{self, RunResult};

/// Load generator measuring TTFT, TPOT, ITL, throughput and goodput of an
/// OpenAI-compatible server or Baton's gRPC API.
#[derive(Debug, Parser)]
#[command(name = "baton-loadtest", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// A subcommand; without one, a load test is run.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags of a load test run.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Subcommands other than running a load test.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print every figure of two results files and the ratio B/A.
    Compare {
        /// Baseline results JSON (A).
        a: PathBuf,
        /// Results JSON to compare with it (B).
        b: PathBuf,
    },
}

/// Which prompts to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatasetName {
    /// Random prompts of exact token lengths.
    Random,
    /// ShareGPT JSON (`--dataset-path`).
    Sharegpt,
    /// One prompt per line (`--dataset-path`).
    Prompts,
}

/// Flags of a load test run.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// API to use (all stream).
    #[arg(long, value_enum, default_value = "openai")]
    pub backend: BackendKind,
    /// Server address (gRPC: the gRPC port).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Model name for OpenAI requests (default: first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Local tokenizer.json of the served model, for exact prompt lengths.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// HTTP server with /tokenize and /detokenize (default: --base-url for
    /// OpenAI backends).
    #[arg(long)]
    pub tokenize_url: Option<String>,
    /// Prompt source.
    #[arg(long, value_enum, default_value = "random")]
    pub dataset: DatasetName,
    /// File for --dataset sharegpt or prompts.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Input length in tokens (random dataset).
    #[arg(long, default_value_t = 1024)]
    pub input_len: usize,
    /// Output length in tokens (default 128; for ShareGPT, overrides the
    /// conversation's reply length).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Lengths drawn uniformly from [len·(1−r), len·(1+r)] (random dataset).
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Number of timed requests (with --duration: size of the prompt pool).
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Run for this many seconds instead of --num-prompts requests.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Mean arrival rate in requests/s, or `inf` to send all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: Rate,
    /// Gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 steadier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests sent first and not counted.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Seed for the arrival schedule and the prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run once per rate (comma-separated, e.g. `1,2,4,inf`), one row each.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub sweep: Vec<Rate>,
    /// Goodput SLOs in ms, e.g. `--goodput ttft:200 tpot:50 e2el:5000`.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Do not send ignore_eos/min_tokens (for servers that reject them).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Fail a request that takes longer than this many seconds.
    #[arg(long)]
    pub request_timeout: Option<f64>,
    /// A JSON object merged into every request body (as `vllm bench serve --extra-body`),
    /// e.g. `'{"response_format": {"type": "json_object"}}'`.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Write config, per-request records and summary as JSON (a sweep writes
    /// one file per rate: NAME-rateR.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write charts: `.html` (embedded SVG) or `.png`.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

const DEFAULT_OUTPUT_LEN: usize = 128;

impl RunArgs {
    /// The run configuration these flags describe.
    pub fn to_config(&self) -> Result<RunConfig, LoadtestError> {
        let need_path = |name: &str| {
            self.dataset_path
                .clone()
                .ok_or_else(|| LoadtestError::Config(format!("--dataset {name} needs --dataset-path FILE")))
        };
        let dataset = match self.dataset {
            DatasetName::Random => DatasetConfig::Random {
                input_len: self.input_len,
                output_len: self.output_len.unwrap_or(DEFAULT_OUTPUT_LEN),
                range_ratio: self.range_ratio,
            },
            DatasetName::Sharegpt => {
                DatasetConfig::Sharegpt { path: need_path("sharegpt")?, output_len: self.output_len }
            }
            DatasetName::Prompts => DatasetConfig::Prompts {
                path: need_path("prompts")?,
                output_len: self.output_len.unwrap_or(DEFAULT_OUTPUT_LEN),
            },
        };
        let goodput = if self.goodput.is_empty() {
            Slo::default()
        } else {
            self.goodput.join(" ").parse::<Slo>().map_err(|e| LoadtestError::Config(format!("--goodput: {e}")))?
        };
        let config = RunConfig {
            backend: self.backend,
            base_url: self.base_url.clone(),
            model: self.model.clone(),
            tokenizer: self.tokenizer.clone(),
            tokenize_url: self.tokenize_url.clone(),
            dataset,
            num_prompts: self.num_prompts,
            duration_s: self.duration,
            request_rate: self.request_rate,
            burstiness: self.burstiness,
            max_concurrency: self.max_concurrency,
            warmup: self.warmup,
            seed: self.seed,
            goodput,
            ignore_eos: !self.no_ignore_eos,
            temperature: self.temperature,
            request_timeout_s: self.request_timeout,
            extra_body: match &self.extra_body {
                None => serde_json::Map::new(),
                Some(text) => match serde_json::from_str(text) {
                    Ok(serde_json::Value::Object(fields)) => fields,
                    Ok(_) => return Err(LoadtestError::Config("--extra-body must be a JSON object".into())),
                    Err(e) => return Err(LoadtestError::Config(format!("--extra-body is not valid JSON: {e}"))),
                },
            },
            show_progress: !self.no_progress,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Runs what the command line asks for and returns what to print.
pub async fn execute(cli: &Cli) -> Result<String, LoadtestError> {
    if let Some(Command::Compare { a, b }) = &cli.command {
        return compare::compare_files(a, b);
    }
    let args = &cli.run;
    let config = args.to_config()?;
    if args.sweep.is_empty() {
        let result = runner::run(&config).await?;
        write_outputs(&result, args.out.as_deref(), args.report.as_deref())?;
        return Ok(report::summary_table(&result));
    }
    let results = runner::sweep(&config, &args.sweep).await?;
    for result in &results {
        let rate = result.config.request_rate;
        let out = args.out.as_deref().map(|p| runner::per_rate_path(p, rate));
        let rep = args.report.as_deref().map(|p| runner::per_rate_path(p, rate));
        write_outputs(result, out.as_deref(), rep.as_deref())?;
    }
    Ok(report::sweep_table(&results))
}

fn write_outputs(
    result: &RunResult,
    out: Option<&std::path::Path>,
    report_path: Option<&std::path::Path>,
) -> Result<(), LoadtestError> {
    if let Some(path) = out {
        result.save(path)?;
    }
    if let Some(path) = report_path {
        report::write_report(result, path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("baton-loadtest").chain(args.iter().copied()))
    }

    #[test]
    fn full_flag_set_builds_config() {
        let cli = parse(&[
            "--backend",
            "openai-chat",
            "--base-url",
            "http://h:1",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--range-ratio",
            "0.25",
            "--request-rate",
            "4",
            "--burstiness",
            "0.5",
            "--max-concurrency",
            "3",
            "--goodput",
            "ttft:200",
            "tpot:50",
            "--seed",
            "9",
            "--num-prompts",
            "20",
        ])
        .expect("valid flags");
        let c = cli.run.to_config().expect("valid config");
        assert_eq!(c.backend, BackendKind::OpenaiChat);
        assert_eq!(c.request_rate, Rate::per_second(4.0).expect("rate"));
        assert_eq!(c.max_concurrency, Some(3));
        assert_eq!(c.goodput.ttft_ms, Some(200.0));
        assert_eq!(c.goodput.tpot_ms, Some(50.0));
        assert_eq!(c.dataset, DatasetConfig::Random { input_len: 32, output_len: 8, range_ratio: 0.25 });
    }

    #[test]
    fn sweep_and_compare_parse() {
        let cli = parse(&["--sweep", "1,2.5,inf"]).expect("valid sweep");
        assert_eq!(cli.run.sweep.len(), 3);
        assert!(cli.run.sweep[2].is_infinite());
        let cli = parse(&["compare", "a.json", "b.json"]).expect("valid compare");
        assert!(matches!(cli.command, Some(Command::Compare { .. })));
    }

    #[test]
    fn bad_flags_are_rejected_clearly() {
        assert!(parse(&["--request-rate", "fast"]).is_err());
        assert!(parse(&["--backend", "carrier-pigeon"]).is_err());
        assert!(parse(&["--num-prompts", "-3"]).is_err());
        let err = parse(&["--goodput", "latency:5"]).expect("parses").run.to_config();
        assert!(matches!(err, Err(LoadtestError::Config(m)) if m.contains("unknown goodput metric")));
        let err = parse(&["--dataset", "sharegpt"]).expect("parses").run.to_config();
        assert!(matches!(err, Err(LoadtestError::Config(m)) if m.contains("--dataset-path")));
        let err = parse(&["--duration", "10"]).expect("parses").run.to_config();
        assert!(matches!(err, Err(LoadtestError::Config(m)) if m.contains("--max-concurrency")));
        for (body, why) in [("[1]", "must be a JSON object"), ("{nope", "not valid JSON")] {
            let err = parse(&["--extra-body", body]).expect("parses").run.to_config();
            assert!(matches!(&err, Err(LoadtestError::Config(m)) if m.contains(why)), "{err:?}");
        }
        let err = parse(&["--backend", "grpc", "--extra-body", "{\"a\": 1}"]).expect("parses").run.to_config();
        assert!(matches!(err, Err(LoadtestError::Config(m)) if m.contains("OpenAI backends only")));
        let ok = parse(&["--extra-body", "{\"guided_choice\": [\"a\"]}"]).expect("parses").run.to_config();
        assert_eq!(ok.expect("valid").extra_body["guided_choice"], serde_json::json!(["a"]));
    }
}
