//! Start-up benchmark: how long `baton serve --model DIR` takes from process start to
//! `/health` 200 for a safetensors checkpoint in the page cache, with and without a kernel
//! cache. Not a test: the lead runs it on the GPU machine (`scripts/gpu-cuda.sh startup`).
//!
//! 1. Writes a random bf16 checkpoint of a model config (default the Llama-3.1-8B shape),
//!    sharded like Hugging Face's (`model-0000i-of-0000n.safetensors` and
//!    `model.safetensors.index.json`), with `config.json`, a tokenizer (the test models' byte
//!    BPE, or copied from `--tokenizer-from DIR`) and its chat template: values drawn by the
//!    counter generator, shards written in parallel. An existing checkpoint of the same
//!    config in `--dir` is reused (`--rewrite` writes it again).
//! 2. Reads every shard once (parallel), so the page cache is warm.
//! 3. Starts `baton serve` and times process start to `/health` 200: first with an empty
//!    kernel cache (every module compiled), then with the cache that run filled, then, with
//!    `--shipped-cache DIR`, with a cache built elsewhere (`baton kernels build`). Each run's
//!    `startup phase` log lines (config/tokenizer, device, kernels, weights, KV cache, total)
//!    and `kernel module` lines are kept.
//! 4. Writes `--out` (default `<--out-dir, bench/results>/startup-<device>-<date>.json`): device, commit,
//!    command, checkpoint size, each run's time to healthy and phases, the targets.
//!
//! Usage: `bench_startup --baton PATH [--config FILE] [--dir DIR] [--shards N] [--device D]
//! [--tokenizer-from DIR] [--shipped-cache DIR] [--repeats N] [--out FILE | --out-dir DIR]
//! [--commit C] [--timeout-s S] [--rewrite] [-- EXTRA SERVE FLAGS...]`

use baton_formats::{DType, DUMMY_SEED, DUMMY_STD, DummyKind, DummyStore, ModelConfig, WeightStore};
use rayon::prelude::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The start-up targets (DESIGN.md §7).
const TARGET_PAGE_CACHE_S: f64 = 10.0;
const TARGET_NO_KERNEL_CACHE_S: f64 = 15.0;
/// Elements generated and written per task.
const WRITE_CHUNK: usize = 8 << 20;

struct Args {
    baton: PathBuf,
    config: PathBuf,
    dir: PathBuf,
    shards: usize,
    device: String,
    tokenizer_from: Option<PathBuf>,
    shipped_cache: Option<PathBuf>,
    repeats: usize,
    out: Option<PathBuf>,
    out_dir: PathBuf,
    commit: String,
    timeout: Duration,
    rewrite: bool,
    extra: Vec<String>,
}

fn usage(msg: &str) -> ! {
    eprintln!("bench_startup: {msg}");
    eprintln!(
        "usage: bench_startup --baton PATH [--config FILE] [--dir DIR] [--shards N] [--device D] [--tokenizer-from DIR] [--shipped-cache DIR] [--repeats N] [--out FILE | --out-dir DIR] [--commit C] [--timeout-s S] [--rewrite] [-- SERVE FLAGS]"
    );
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        baton: PathBuf::from("target/release/baton"),
        config: PathBuf::from("configs/models/llama-3.1-8b.json"),
        dir: std::env::temp_dir().join("baton-startup-model"),
        shards: 4,
        device: "cuda".into(),
        tokenizer_from: None,
        shipped_cache: None,
        repeats: 1,
        out: None,
        out_dir: PathBuf::from("bench/results"),
        commit: "unknown".into(),
        timeout: Duration::from_secs(180),
        rewrite: false,
        extra: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--baton" => a.baton = val().into(),
            "--config" => a.config = val().into(),
            "--dir" => a.dir = val().into(),
            "--shards" => a.shards = val().parse().unwrap_or_else(|_| usage("--shards: a number")),
            "--device" => a.device = val(),
            "--tokenizer-from" => a.tokenizer_from = Some(val().into()),
            "--shipped-cache" => a.shipped_cache = Some(val().into()),
            "--repeats" => a.repeats = val().parse().unwrap_or_else(|_| usage("--repeats: a number")),
            "--out" => a.out = Some(val().into()),
            "--out-dir" => a.out_dir = val().into(),
            "--commit" => a.commit = val(),
            "--timeout-s" => {
                a.timeout = Duration::from_secs(val().parse().unwrap_or_else(|_| usage("--timeout-s: seconds")))
            }
            "--rewrite" => a.rewrite = true,
            "--" => a.extra = it.by_ref().collect(),
            other => usage(&format!("unknown flag {other}")),
        }
    }
    a.shards = a.shards.max(1);
    a.repeats = a.repeats.max(1);
    a
}

/// Which shard each tensor goes to: in order, a new shard once the current one holds its
/// share of the bytes (as HF's `max_shard_size` does).
fn assign_shards(tensors: &[(String, Vec<usize>)], shards: usize) -> Vec<usize> {
    let bytes: Vec<usize> = tensors.iter().map(|(_, s)| s.iter().product::<usize>() * 2).collect();
    let share = bytes.iter().sum::<usize>().div_ceil(shards).max(1);
    let mut out = Vec::with_capacity(tensors.len());
    let (mut shard, mut filled) = (0, 0);
    for b in bytes {
        if filled > 0 && filled + b / 2 > share && shard + 1 < shards {
            shard += 1;
            filled = 0;
        }
        out.push(shard);
        filled += b;
    }
    out
}

fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Writes the checkpoint; returns its weight bytes and the seconds it took.
fn write_checkpoint(a: &Args, cfg: &ModelConfig, raw_config: &Value) -> std::io::Result<(u64, f64)> {
    let t0 = Instant::now();
    std::fs::create_dir_all(&a.dir)?;
    let tensors = cfg.expected_tensors();
    let shard_of = assign_shards(&tensors, a.shards);
    let n = shard_of.last().map_or(1, |&s| s + 1);
    let draws = DummyStore::new(cfg, DUMMY_SEED, DUMMY_STD, DType::BF16).with_kind(DummyKind::Counter);
    let mut weight_map = serde_json::Map::new();
    // Writing tasks: (shard, file offset, first element, elements, tensor name).
    let mut jobs: Vec<(usize, u64, usize, usize, String)> = Vec::new();
    let mut files = Vec::new();
    let mut total = 0u64;
    for s in 0..n {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut offset = 0usize;
        let mut entries = Vec::new();
        for ((name, shape), _) in tensors.iter().zip(&shard_of).filter(|(_, sh)| **sh == s) {
            let numel: usize = shape.iter().product();
            header.insert(
                name.clone(),
                json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + numel * 2]}),
            );
            weight_map.insert(name.clone(), json!(shard_name(s, n)));
            entries.push((offset, numel, name.clone()));
            offset += numel * 2;
        }
        let mut text = serde_json::to_string(&Value::Object(header)).map_err(std::io::Error::other)?;
        // The data starts 8-byte aligned, as safetensors writers pad the header.
        while !(8 + text.len()).is_multiple_of(8) {
            text.push(' ');
        }
        let path = a.dir.join(shard_name(s, n));
        let mut f = File::create(&path)?;
        f.write_all(&(text.len() as u64).to_le_bytes())?;
        f.write_all(text.as_bytes())?;
        let base = (8 + text.len()) as u64;
        f.set_len(base + offset as u64)?;
        total += offset as u64;
        for (off, numel, name) in entries {
            // Tasks of WRITE_CHUNK elements, so every core draws and writes.
            for start in (0..numel).step_by(WRITE_CHUNK) {
                jobs.push((s, base + (off + start * 2) as u64, start, WRITE_CHUNK.min(numel - start), name.clone()));
            }
        }
        files.push(f);
    }
    jobs.par_iter().try_for_each(|(s, at, start, len, name)| -> std::io::Result<()> {
        let init = draws.counter_init(name).ok_or_else(|| std::io::Error::other(format!("{name}: no draw")))?;
        let bytes: Vec<u8> =
            (*start..start + len).flat_map(|i| half::bf16::from_f32(init.value(i as u64)).to_le_bytes()).collect();
        files[*s].write_all_at(&bytes, *at)
    })?;
    files.par_iter().try_for_each(File::sync_all)?;
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(a.dir.join("model.safetensors.index.json"), serde_json::to_vec_pretty(&index)?)?;
    write_tokenizer(a, cfg)?;
    // Written last: its presence marks a complete checkpoint of this config.
    std::fs::write(a.dir.join("config.json"), serde_json::to_vec_pretty(raw_config)?)?;
    Ok((total, t0.elapsed().as_secs_f64()))
}

/// tokenizer.json and tokenizer_config.json: copied from `--tokenizer-from`, else the test
/// models' tokenizer (written by `baton_formats::testing`).
fn write_tokenizer(a: &Args, _cfg: &ModelConfig) -> std::io::Result<()> {
    let scratch;
    let from = match &a.tokenizer_from {
        Some(d) => d.clone(),
        None => {
            scratch = a.dir.join(".tokenizer");
            let spec = baton_formats::testing::TinySpec::tied();
            baton_formats::testing::write_hf_folder(&scratch, &spec).map_err(std::io::Error::other)?;
            scratch.clone()
        }
    };
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(from.join(f), a.dir.join(f))?;
    }
    if a.tokenizer_from.is_none() {
        std::fs::remove_dir_all(&from)?;
    }
    Ok(())
}

/// The shards of the checkpoint in `dir`.
fn shards(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    Ok(v)
}

/// Reads every shard once, in parallel 64 MiB pieces, so the page cache holds them; returns
/// the bytes and seconds.
fn warm_page_cache(dir: &Path) -> std::io::Result<(u64, f64)> {
    let t0 = Instant::now();
    let mut pieces = Vec::new();
    for p in shards(dir)? {
        let len = std::fs::metadata(&p)?.len();
        for at in (0..len).step_by(64 << 20) {
            pieces.push((p.clone(), at, (64u64 << 20).min(len - at)));
        }
    }
    let total = pieces
        .par_iter()
        .map(|(p, at, len)| -> std::io::Result<u64> {
            let f = File::open(p)?;
            let mut buf = vec![0u8; *len as usize];
            f.read_exact_at(&mut buf, *at)?;
            Ok(*len)
        })
        .sum::<std::io::Result<u64>>()?;
    Ok((total, t0.elapsed().as_secs_f64()))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(18000)
}

/// Whether `GET /health` on `port` answers 200.
fn healthy(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.1 200")
}

/// The `key=value` fields of a tracing line (values unquoted).
fn fields(line: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = line;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].rsplit([' ', '\t']).next().unwrap_or("").to_string();
        let after = &rest[eq + 1..];
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').unwrap_or(q.len());
            (q[..end].to_string(), &q[(end + 1).min(q.len())..])
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        if !key.is_empty() {
            out.insert(key, value);
        }
        rest = next;
    }
    out
}

/// One `baton serve` start: seconds to healthy, the phases and kernel modules it logged.
fn run_serve(a: &Args, name: &str, cache: &Path, log_dir: &Path) -> Result<Value, String> {
    let (port, grpc) = (free_port(), free_port());
    let log_path = log_dir.join(format!("startup-{name}.log"));
    let log = File::create(&log_path).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut child = Command::new(&a.baton)
        .arg("serve")
        .arg("--model")
        .arg(&a.dir)
        .args(["--device", &a.device, "--port", &port.to_string(), "--grpc-port", &grpc.to_string()])
        .arg("--kernel-cache-dir")
        .arg(cache)
        .args(&a.extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", a.baton.display()))?;
    let outcome = loop {
        if healthy(port) {
            break Ok(t0.elapsed().as_secs_f64());
        }
        if let Ok(Some(status)) = child.try_wait() {
            break Err(format!("baton serve exited with {status}"));
        }
        if t0.elapsed() > a.timeout {
            break Err(format!("not healthy after {} s", a.timeout.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let secs = outcome.map_err(|e| format!("{name}: {e}; log {}:\n{}", log_path.display(), tail(&text, 40)))?;
    let mut phases = serde_json::Map::new();
    let mut modules = Vec::new();
    let mut device = Value::Null;
    for line in text.lines() {
        let f = fields(line);
        if line.contains("startup phase") {
            let Some(phase) = f.get("phase") else { continue };
            if phase == "device" {
                device = f.get("device").map_or(Value::Null, |d| json!(d));
            }
            let mut entry = serde_json::Map::new();
            for (k, v) in &f {
                if k != "phase" {
                    entry.insert(k.clone(), v.parse::<f64>().map_or_else(|_| json!(v), |x| json!(x)));
                }
            }
            phases.insert(phase.clone(), Value::Object(entry));
        } else if line.contains("kernel module") {
            modules.push(json!({
                "module": f.get("module"),
                "from_cache": f.get("from_cache").map(|v| v == "true"),
                "ms": f.get("ms").and_then(|v| v.parse::<f64>().ok()),
            }));
        }
    }
    let phase_ms = |p: &str| phases.get(p).and_then(|v| v.get("ms")).and_then(Value::as_f64);
    println!(
        "{name:<18} healthy in {secs:6.2} s   kernels {:>6} ms  weights {:>6} ms ({} GB/s)  kv {:>5} ms  total(log) {:>6} ms",
        phase_ms("kernels").map_or("-".into(), |v| format!("{v:.0}")),
        phase_ms("weights").map_or("-".into(), |v| format!("{v:.0}")),
        phases.get("weights").and_then(|v| v.get("gb_per_s")).map_or("-".into(), |v| v.to_string()),
        phase_ms("kv_cache").map_or("-".into(), |v| format!("{v:.0}")),
        phase_ms("total").map_or("-".into(), |v| format!("{v:.0}")),
    );
    Ok(json!({
        "run": name,
        "healthy_s": secs,
        "device": device,
        "phases": phases,
        "kernel_modules": modules,
        "log": log_path,
    }))
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `YYYY-MM-DD` of now (UTC), from the days since the epoch (Howard Hinnant's civil_from_days).
fn today() -> String {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn main() {
    let a = parse_args();
    let started = Instant::now();
    let raw_text =
        std::fs::read_to_string(&a.config).unwrap_or_else(|e| usage(&format!("{}: {e}", a.config.display())));
    let raw_config: Value = serde_json::from_str(&raw_text).unwrap_or_else(|e| usage(&format!("config: {e}")));
    let cfg = ModelConfig::from_hf_file(&a.config).unwrap_or_else(|e| usage(&format!("config: {e}")));
    let reuse = !a.rewrite
        && std::fs::read(a.dir.join("config.json")).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            == Some(raw_config.clone());
    let (bytes, write_s) = if reuse {
        let bytes = shards(&a.dir).unwrap_or_default().iter().filter_map(|p| p.metadata().ok()).map(|m| m.len()).sum();
        println!("reusing the checkpoint in {} ({:.2} GB)", a.dir.display(), bytes as f64 / 1e9);
        (bytes, 0.0)
    } else {
        let _ = std::fs::remove_dir_all(&a.dir);
        match write_checkpoint(&a, &cfg, &raw_config) {
            Ok((b, s)) => {
                let written = shards(&a.dir).map_or(0, |v| v.len());
                println!("wrote {:.2} GB in {written} shard(s) to {} in {s:.1} s", b as f64 / 1e9, a.dir.display());
                (b, s)
            }
            Err(e) => {
                eprintln!("cannot write the checkpoint: {e}");
                std::process::exit(1);
            }
        }
    };
    let (read, warm_s) = warm_page_cache(&a.dir).unwrap_or_else(|e| {
        eprintln!("cannot read the checkpoint: {e}");
        std::process::exit(1)
    });
    println!("page cache warmed: {:.2} GB read in {warm_s:.1} s", read as f64 / 1e9);

    let work = a.dir.join(".bench");
    let _ = std::fs::remove_dir_all(&work);
    if let Err(e) = std::fs::create_dir_all(&work) {
        eprintln!("cannot create {}: {e}", work.display());
        std::process::exit(1);
    }
    let cache = work.join("kernels");
    let mut runs = Vec::new();
    let mut failed = false;
    let mut plan: Vec<(String, PathBuf)> = vec![("no_kernel_cache".into(), cache.clone())];
    for i in 0..a.repeats {
        let suffix = if a.repeats > 1 { format!("_{}", i + 1) } else { String::new() };
        plan.push((format!("kernel_cache{suffix}"), cache.clone()));
    }
    if let Some(shipped) = &a.shipped_cache {
        plan.push(("shipped_kernel_cache".into(), shipped.clone()));
    }
    for (name, dir) in &plan {
        match run_serve(&a, name, dir, &work) {
            Ok(r) => runs.push(r),
            Err(e) => {
                eprintln!("{e}");
                failed = true;
                runs.push(json!({"run": name, "error": e}));
            }
        }
    }
    let device = runs.iter().find_map(|r| r.get("device").and_then(Value::as_str).map(str::to_string));
    let device = device.unwrap_or_else(|| a.device.clone());
    let slug: String =
        device.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    let out = a.out.clone().unwrap_or_else(|| a.out_dir.join(format!("startup-{slug}-{}.json", today())));
    let command: Vec<String> = std::env::args().collect();
    let result = json!({
        "benchmark": "startup",
        "device": device,
        "commit": a.commit,
        "command": command.join(" "),
        "date": today(),
        "model": {
            "config": a.config,
            "weight_bytes": bytes,
            "shards": shards(&a.dir).map(|s| s.len()).unwrap_or(0),
            "dtype": "bf16",
            "written_s": write_s,
            "page_cache_warm_s": warm_s,
        },
        "targets": {"healthy_from_page_cache_s": TARGET_PAGE_CACHE_S, "healthy_no_kernel_cache_s": TARGET_NO_KERNEL_CACHE_S},
        "runs": runs,
        "bench_s": started.elapsed().as_secs_f64(),
    });
    if let Some(parent) = out.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    match serde_json::to_vec_pretty(&result).map(|b| std::fs::write(&out, b)) {
        Ok(Ok(())) => println!("wrote {}", out.display()),
        Ok(Err(e)) => eprintln!("cannot write {}: {e}", out.display()),
        Err(e) => eprintln!("cannot serialise the results: {e}"),
    }
    if failed {
        std::process::exit(1);
    }
}
