//! Driving a run: warmup, the timed arrival schedule, concurrency limit, and
//! collecting one record per request.
//!
//! Arrivals follow [`ArrivalSchedule`]; a request that arrives while
//! `max_concurrency` requests are in flight waits (first come, first served)
//! and its timings start when it is actually sent, as in vLLM. With a
//! duration, no request is sent after the deadline, and those in flight are
//! allowed to finish and are counted. The benchmark duration runs from the
//! start of the schedule until the last response ends.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::arrival::ArrivalSchedule;
use crate::backends::{Backend, RequestError};
use crate::config::{BackendKind, DatasetConfig, Rate, RunConfig};
use crate::dataset::{self, RequestSpec};
use crate::error::LoadtestError;
use crate::metrics::{RunShape, Summary};
use crate::record::{RequestRecord, Stopwatch};
use crate::tokenizer::TextTokenizer;

/// Everything a results JSON holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Always `baton-loadtest`.
    pub tool: String,
    /// The crate version that produced it.
    pub version: String,
    /// When the timed run started (RFC 3339, UTC).
    pub started_at: String,
    /// The model the requests were sent for, when known.
    pub model: Option<String>,
    /// How the run was configured.
    pub config: RunConfig,
    /// Aggregate figures.
    pub summary: Summary,
    /// One record per timed request, in send order.
    pub records: Vec<RequestRecord>,
}

impl RunResult {
    /// Reads a results JSON written by [`RunResult::save`].
    pub fn load(path: &std::path::Path) -> Result<Self, LoadtestError> {
        let text = std::fs::read_to_string(path).map_err(|e| LoadtestError::io(path, e))?;
        serde_json::from_str(&text).map_err(|source| LoadtestError::Json { path: path.to_path_buf(), source })
    }

    /// Writes the results as pretty JSON.
    pub fn save(&self, path: &std::path::Path) -> Result<(), LoadtestError> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|source| LoadtestError::Json { path: path.to_path_buf(), source })?;
        std::fs::write(path, text).map_err(|e| LoadtestError::io(path, e))
    }
}

/// A connected backend and the prepared prompts, reusable across runs (a
/// sweep runs every rate on the same prompts). Cheap to clone.
#[derive(Clone)]
pub struct Target {
    backend: Backend,
    specs: Arc<Vec<RequestSpec>>,
    estimator: Option<Arc<tokenizers::Tokenizer>>,
}

impl Target {
    /// Connects to the server and builds the prompts for `config`.
    pub async fn prepare(config: &RunConfig) -> Result<Self, LoadtestError> {
        config.validate()?;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(usize::MAX)
            .build()
            .map_err(|e| LoadtestError::Server(format!("HTTP client: {e}")))?;
        // A bad local tokenizer file is reported before any network call.
        let local = config.tokenizer.as_deref().map(TextTokenizer::from_file).transpose()?;
        let backend = Backend::connect(config, client.clone()).await?;
        let tokenizer = match local {
            Some(tok) => Some(tok),
            None => choose_tokenizer(config, client, backend.model()),
        };
        let specs = dataset::load(&config.dataset, config.num_prompts, config.seed, tokenizer.as_ref()).await?;
        Ok(Self { backend, specs: Arc::new(specs), estimator: tokenizer.and_then(|t| t.local()) })
    }

    /// The prompts that will be sent, in order.
    pub fn requests(&self) -> &[RequestSpec] {
        &self.specs
    }

    /// Runs warmup and the timed run described by `config` (its backend and
    /// dataset fields are those this target was prepared with).
    pub async fn execute(&self, config: &RunConfig) -> Result<RunResult, LoadtestError> {
        config.validate()?;
        self.warmup(config).await?;
        let started_at = chrono::Utc::now().to_rfc3339();
        let (records, duration_s) = self.timed_run(config).await?;
        let summary = Summary::compute(
            &records,
            duration_s,
            RunShape {
                request_rate: config.request_rate,
                burstiness: config.burstiness,
                max_concurrency: config.max_concurrency,
                slo: config.goodput,
            },
        );
        Ok(RunResult {
            tool: "baton-loadtest".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            started_at,
            model: self.backend.model().map(String::from),
            config: config.clone(),
            summary,
            records,
        })
    }

    async fn warmup(&self, config: &RunConfig) -> Result<(), LoadtestError> {
        if config.warmup == 0 {
            return Ok(());
        }
        let start = Instant::now();
        let parallel = config.max_concurrency.unwrap_or(config.warmup).min(config.warmup);
        let records: Vec<RequestRecord> = futures::stream::iter(0..config.warmup)
            .map(|i| self.send_one(config, i, start, 0.0))
            .buffer_unordered(parallel)
            .collect()
            .await;
        if records.iter().all(|r| !r.success) {
            let first_error = records.iter().find_map(|r| r.error.clone()).unwrap_or_else(|| "unknown error".into());
            return Err(LoadtestError::Warmup { count: records.len(), first_error });
        }
        Ok(())
    }

    async fn timed_run(&self, config: &RunConfig) -> Result<(Vec<RequestRecord>, f64), LoadtestError> {
        let mut schedule = ArrivalSchedule::new(config.request_rate, config.burstiness, config.seed)?;
        let slots = Arc::new(Semaphore::new(config.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS)));
        let progress = progress_bar(config);

        let run_start = Instant::now();
        let deadline = config.duration_s.map(|d| run_start + Duration::from_secs_f64(d));
        let mut tasks = JoinSet::new();
        for index in 0.. {
            if config.duration_s.is_none() && index >= config.num_prompts {
                break;
            }
            let Some(offset) = schedule.next() else { break };
            if config.duration_s.is_some_and(|d| offset >= d) {
                break;
            }
            tokio::time::sleep_until((run_start + Duration::from_secs_f64(offset)).into()).await;
            let permit = Arc::clone(&slots)
                .acquire_owned()
                .await
                .map_err(|e| LoadtestError::Internal(format!("concurrency limiter: {e}")))?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let this = self.clone();
            let config = config.clone();
            let progress = progress.clone();
            tasks.spawn(async move {
                let record = this.send_one(&config, index, run_start, offset).await;
                drop(permit);
                progress.inc(1);
                record
            });
        }
        let mut records = Vec::with_capacity(tasks.len());
        while let Some(done) = tasks.join_next().await {
            records.push(done.map_err(|e| LoadtestError::Internal(format!("request task: {e}")))?);
        }
        let duration_s = run_start.elapsed().as_secs_f64();
        progress.finish_and_clear();
        records.sort_by_key(|r| r.index);
        Ok((records, duration_s))
    }

    async fn send_one(&self, config: &RunConfig, index: usize, run_start: Instant, scheduled_s: f64) -> RequestRecord {
        let spec = &self.specs[index % self.specs.len()];
        let mut watch = Stopwatch::start();
        let sent = self.backend.send(spec, &mut watch);
        let result = match config.request_timeout_s {
            Some(limit) => tokio::time::timeout(Duration::from_secs_f64(limit), sent)
                .await
                .unwrap_or(Err(RequestError::Timeout(limit))),
            None => sent.await,
        };
        let estimator = self.estimator.as_deref();
        let mut record = watch.finish(
            index,
            run_start,
            scheduled_s,
            spec.input_tokens,
            result.err().map(|e| e.to_string()),
            |text| estimator.and_then(|t| t.encode(text, false).ok()).map(|e| e.len()),
        );
        record.requested_output_tokens = spec.output_tokens as u64;
        record
    }
}

/// The remote tokenizer prompts are measured with when no local file is
/// given: an explicit tokenize URL, else (for datasets that need one, over
/// OpenAI) the target server itself.
fn choose_tokenizer(config: &RunConfig, client: reqwest::Client, model: Option<&str>) -> Option<TextTokenizer> {
    let model = model.map(String::from);
    if let Some(url) = &config.tokenize_url {
        return Some(TextTokenizer::remote(client, url, model));
    }
    let needs_one = !matches!(config.dataset, DatasetConfig::Prompts { .. });
    let over_http = config.backend != BackendKind::Grpc;
    (needs_one && over_http).then(|| TextTokenizer::remote(client, &config.base_url, model))
}

fn progress_bar(config: &RunConfig) -> ProgressBar {
    if !config.show_progress {
        return ProgressBar::hidden();
    }
    let (bar, template) = match config.duration_s {
        Some(_) => (ProgressBar::new_spinner(), "{spinner} {elapsed_precise} {pos} requests done"),
        None => (
            ProgressBar::new(config.num_prompts as u64),
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests (eta {eta})",
        ),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Connects, prepares prompts and performs one run.
pub async fn run(config: &RunConfig) -> Result<RunResult, LoadtestError> {
    Target::prepare(config).await?.execute(config).await
}

/// Runs the same prompts at each rate in turn, one result per rate.
pub async fn sweep(config: &RunConfig, rates: &[Rate]) -> Result<Vec<RunResult>, LoadtestError> {
    let target = Target::prepare(config).await?;
    let mut results = Vec::with_capacity(rates.len());
    for &rate in rates {
        let mut config = config.clone();
        config.request_rate = rate;
        results.push(target.execute(&config).await?);
    }
    Ok(results)
}

/// `results.json` → `results-rate4.json` for one rate of a sweep.
pub fn per_rate_path(path: &std::path::Path, rate: Rate) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}-rate{rate}.{}", ext.to_string_lossy()),
        None => format!("{stem}-rate{rate}"),
    };
    path.with_file_name(name)
}
