//! Disaggregation benchmark on two GPUs (a benchmark program, not a test): the prefill engine
//! on `cuda:0`, the decode engine on `cuda:1`, a unified engine on `cuda:0` for reference,
//! all with random weights of a real architecture (`--load-format dummy`).
//!
//! Figures, each next to its ceiling or anchor measured in the same run:
//! - NCCL's plain send/recv bandwidth GPU0 → GPU1 (1 GiB; the transfer ceiling);
//! - for prompts of 512 / 2,048 / 8,192 tokens (prefix caching off, no chunking):
//!   - unified TTFT (submit → first token);
//!   - disaggregated TTFT as the client sees it (reservation on D + prefill on P → P's first
//!     token), over NCCL and over TCP;
//!   - the exposed hand-off: from P's first token to D holding the KV with that token (what a
//!     decode step on D waits for), and the hand-off's bytes ÷ its whole duration;
//!   - D's second token (the relay really continues on D);
//!   - the transfer alone: a repeated prompt is a prefix-cache hit on P (one token computed),
//!     so its hand-off (connect → acknowledgement) is nearly all data movement; bytes ÷ that
//!     time against the NCCL ceiling;
//! - the NCCL transport by itself, without engines or control messages: the backends' own
//!   per-layer grouped sends and receives between two paged KV caches of the model's shape
//!   (every layer of a prompt back to back, host-timed to the transfer stream's completion as
//!   the ceiling is), with the prompt's blocks in one contiguous run and with every block its
//!   own run (the worst case of a fragmented cache).
//!
//! `--transport-only` measures the ceiling and the transport alone and skips the engines.
//! Usage: `bench_relay --config configs/models/llama-3.2-1b.json --out OUT.json [--commit C]
//! [--lens 512,2048,8192] [--reps 3]`.

use baton_core::api::{EngineClient, EngineRequest, OutputStream};
use baton_core::cluster_auth::ReservationToken;
use baton_core::params::SamplingParams;
use baton_engine::kv_connector::{ExportVia, HandoffGate, Link, LinkComm, Links};
use baton_engine::kv_transport::KvCredentials;
use baton_engine::kv_transport::handoff::{LinkSend, Received, receive_import, send_export, setup_link};
use baton_engine::kv_transport::nccl::{CudaComm, new_id};
use baton_engine::kv_transport::tcp::TcpKvListener;
use baton_engine::{DeviceSpec, EngineConfig, EngineHandle, start_engine};
use baton_formats::{LoadFormat, load_model};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_relay: {e}");
        std::process::exit(1);
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// NCCL send/recv of `bytes` from GPU 0 to GPU 1, median of `reps` after 2 warm-ups (GB/s).
fn raw_nccl(bytes: usize, reps: usize) -> Res<f64> {
    let id = new_id()?;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let mut handles = Vec::new();
    for rank in 0..2usize {
        let (id, barrier) = (id.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<f64>, String> {
            let ctx = cudarc::driver::CudaContext::new(rank).map_err(|e| e.to_string())?;
            let stream = ctx.new_stream().map_err(|e| e.to_string())?;
            let mut buf = stream.alloc_zeros::<u8>(bytes).map_err(|e| e.to_string())?;
            let mut raw = [0 as core::ffi::c_char; 128];
            for (r, b) in raw.iter_mut().zip(&id) {
                *r = *b as core::ffi::c_char;
            }
            let comm =
                cudarc::nccl::safe::Comm::from_rank(stream.clone(), rank, 2, cudarc::nccl::safe::Id::uninit(raw))
                    .map_err(|e| format!("{e:?}"))?;
            let peer = 1 - rank as i32;
            let mut times = Vec::new();
            for i in 0..reps + 2 {
                barrier.wait();
                let t = Instant::now();
                if rank == 0 {
                    comm.send(&buf, peer).map_err(|e| format!("{e:?}"))?;
                } else {
                    comm.recv(&mut buf, peer).map_err(|e| format!("{e:?}"))?;
                }
                stream.synchronize().map_err(|e| e.to_string())?;
                if i >= 2 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            Ok(times)
        }));
    }
    let mut recv_times = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let times = h.join().map_err(|_| "an NCCL thread panicked")??;
        if rank == 1 {
            recv_times = times;
        }
    }
    Ok(bytes as f64 / median(recv_times) / 1e9)
}

/// The NCCL transport alone: a prompt of `tokens` tokens moves GPU 0 → GPU 1 as the hand-off
/// moves it (`LinkComm::send` / `recv` per layer between paged caches), every layer
/// back to back; median seconds over `reps` after 2 warm-ups, per block layout
/// (`contiguous`: one run; else one run per block).
fn nccl_transport(cfg: &baton_formats::ModelConfig, tokens: usize, contiguous: bool, reps: usize) -> Res<f64> {
    use baton_engine::backend::cuda::CudaBackend;
    use baton_engine::backend::{Backend, KvCacheShape, KvDeviceAccess};
    let blocks = tokens.div_ceil(16);
    let runs: Vec<(usize, usize)> = if contiguous { vec![(0, blocks)] } else { (0..blocks).map(|b| (b, 1)).collect() };
    let shape = KvCacheShape {
        num_layers: cfg.num_hidden_layers,
        num_blocks: blocks,
        block_size: 16,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        dtype: baton_core::kv_transfer::KvDtype::BF16,
    };
    let id = new_id()?;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let mut handles = Vec::new();
    for rank in 0..2usize {
        let (id, barrier, runs) = (id.clone(), barrier.clone(), runs.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<f64>, String> {
            let opts = baton_kernels::cuda::CudaOptions { ordinal: rank, cache_dir: None, ..Default::default() };
            let mut backend = CudaBackend::new(&opts).map_err(|e| e.to_string())?;
            backend.alloc_kv_cache(shape).map_err(|e| e.to_string())?;
            let stream = backend.new_transfer_stream().map_err(|e| e.to_string())?;
            let mut comm = CudaComm::join(stream.clone(), &id, rank).map_err(|e| e.to_string())?;
            let mut times = Vec::new();
            for i in 0..reps + 2 {
                barrier.wait();
                let t = Instant::now();
                for layer in 0..shape.num_layers {
                    if rank == 0 {
                        comm.send(&mut backend, layer, &runs).map_err(|e| e.to_string())?;
                    } else {
                        comm.recv(&mut backend, layer, &runs, true).map_err(|e| e.to_string())?;
                    }
                }
                stream.synchronize().map_err(|e| e.to_string())?;
                if i >= 2 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            Ok(times)
        }));
    }
    let mut recv_times = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let times = h.join().map_err(|_| "an NCCL thread panicked")??;
        if rank == 1 {
            recv_times = times;
        }
    }
    Ok(median(recv_times))
}

async fn first(s: &mut OutputStream) -> Res<Instant> {
    match s.next().await {
        Some(Ok(_)) => Ok(Instant::now()),
        Some(Err(e)) => Err(e.to_string().into()),
        None => Err("the stream ended".into()),
    }
}

struct Relayed {
    ttft: f64,
    exposed: f64,
    second: f64,
    bytes: usize,
    handoff: f64,
}

async fn relay_once(
    p: &EngineHandle,
    d: &EngineHandle,
    listener: &TcpKvListener,
    d_links: &Arc<Links>,
    link: Option<&(String, Arc<Link>)>,
    prompt: Vec<u32>,
    params: &SamplingParams,
) -> Res<Relayed> {
    let addr = listener.local_addr()?;
    let t0 = Instant::now();
    let (mut d_stream, table) = d.reserve_import(EngineRequest::new(prompt.clone(), params.clone())).await?;
    let d_id = d_stream.request_id();
    let token = ReservationToken::random();
    let name = link.map(|(n, l)| LinkSend { name: n.clone(), link: l.clone(), gate: HandoffGate::new() });
    let via = match &name {
        Some(s) => ExportVia::Link { link: s.link.clone(), gate: s.gate.clone() },
        None => ExportVia::Host,
    };
    let (mut p_stream, events) = p.submit_export(EngineRequest::new(prompt, params.clone()), table, via)?;
    let creds = KvCredentials { secret: None, identity: "bench-prefill".into() };
    let sender = tokio::spawn(send_export(events, addr, token, p.kv_layout(), Duration::from_secs(60), name, creds));
    let pending = listener.accept().await?;
    let d2 = d.clone();
    let links = d_links.clone();
    let receiver = tokio::spawn(async move {
        let admit = |t: &ReservationToken, _: &str| if *t == token { Ok(d_id) } else { Err("unknown".into()) };
        receive_import(pending, &d2, &links, Duration::from_secs(60), admit).await
    });
    let t_first = first(&mut p_stream).await?;
    let t_kv = first(&mut d_stream).await?;
    let t_second = first(&mut d_stream).await?;
    let report = sender.await??;
    match receiver.await? {
        Ok(Received::Import { .. }) => {}
        Ok(other) => return Err(format!("unexpected {other:?}").into()),
        Err(e) => return Err(e.to_string().into()),
    }
    Ok(Relayed {
        ttft: (t_first - t0).as_secs_f64(),
        exposed: t_kv.saturating_duration_since(t_first).as_secs_f64(),
        second: (t_second - t0).as_secs_f64(),
        bytes: report.bytes,
        handoff: report.elapsed.as_secs_f64(),
    })
}

/// Fails instead of hanging when one relay takes more than 30 s.
async fn bounded<T>(f: impl std::future::Future<Output = Res<T>>) -> Res<T> {
    tokio::time::timeout(Duration::from_secs(30), f).await.map_err(|_| "timed out after 30 s")?
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let config = flag(&args, "--config").ok_or("--config PATH is required")?;
    let out = flag(&args, "--out").unwrap_or_else(|| "bench-relay.json".into());
    let commit = flag(&args, "--commit").unwrap_or_default();
    let reps: usize = flag(&args, "--reps").unwrap_or_else(|| "3".into()).parse()?;
    let lens: Vec<usize> = flag(&args, "--lens")
        .unwrap_or_else(|| "512,2048,8192".into())
        .split(',')
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let mut table = String::new();

    let nccl_gbs = raw_nccl(1 << 30, 5)?;
    writeln!(table, "NCCL send/recv GPU0->GPU1, 1 GiB: {nccl_gbs:.1} GB/s")?;
    println!("{table}");

    let model_cfg = baton_formats::load_model_info(std::path::Path::new(&config), LoadFormat::Dummy)?.config;
    let kv_per_token = 2 * model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * model_cfg.head_dim * 2;
    let mut transport = Vec::new();
    for &len in &lens {
        for contiguous in [true, false] {
            let secs = nccl_transport(&model_cfg, len, contiguous, reps.max(5))?;
            let bytes = len.div_ceil(16) * 16 * kv_per_token;
            let gbs = bytes as f64 / secs / 1e9;
            let layout = if contiguous { "one run" } else { "one run per block" };
            let line = format!(
                "NCCL transport alone, {len} tokens ({:.0} MiB), {layout}: {:.3} ms, {gbs:.1} GB/s = {:.1}% of the ceiling",
                bytes as f64 / (1 << 20) as f64,
                secs * 1e3,
                100.0 * gbs / nccl_gbs
            );
            println!("{line}");
            writeln!(table, "{line}")?;
            transport.push(format!(
                "{{\"tokens\": {len}, \"contiguous\": {contiguous}, \"bytes\": {bytes}, \"ms\": {:.4}, \"gb_per_s\": {gbs:.2}, \"frac_of_ceiling\": {:.4}}}",
                secs * 1e3,
                gbs / nccl_gbs
            ));
        }
    }
    if args.iter().any(|a| a == "--transport-only") {
        let json = format!(
            "{{\"name\": \"nccl-transport\", \"commit\": \"{commit}\", \"command\": \"{}\", \"model\": \"{config}\", \"nccl_send_recv_gb_per_s\": {nccl_gbs:.2}, \"transport\": [{}]}}\n",
            args.join(" "),
            transport.join(", ")
        );
        std::fs::write(&out, json)?;
        println!("{table}");
        return Ok(());
    }

    let t = Instant::now();
    let model = load_model(std::path::Path::new(&config), LoadFormat::Dummy)?;
    println!("loaded {config} in {:.1}s", t.elapsed().as_secs_f64());
    let longest = lens.iter().copied().max().unwrap_or(512);
    let cfg = EngineConfig {
        num_kv_blocks: Some((longest + 64).div_ceil(16) * 4),
        max_model_len: Some(longest + 64),
        max_num_batched_tokens: longest,
        max_num_seqs: 8,
        enable_prefix_caching: false,
        ..EngineConfig::default()
    };
    let unified = start_engine(&model, DeviceSpec::Cuda(0), cfg.clone())?;
    // The prefill engine caches prefixes, so a repeated prompt re-sends all its KV while
    // computing one token: that hand-off isolates the transfer (see `cached` below).
    let p = start_engine(&model, DeviceSpec::Cuda(0), EngineConfig { enable_prefix_caching: true, ..cfg.clone() })?;
    let d = start_engine(&model, DeviceSpec::Cuda(1), cfg)?;
    let vocab = model.config.vocab_size as u64;
    let params = SamplingParams { max_tokens: Some(2), ignore_eos: true, ..SamplingParams::greedy() };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?;
    let mut rows = Vec::new();
    rt.block_on(async {
        let listener = TcpKvListener::bind("127.0.0.1:0".parse()?).await?;
        let d_links = Arc::new(Links::default());
        let stream = p.transfer_stream().await?;
        let offer = tokio::spawn(setup_link(
            listener.local_addr()?,
            p.kv_layout(),
            Duration::from_secs(60),
            "bench".into(),
            stream,
            KvCredentials { secret: None, identity: "bench-prefill".into() },
        ));
        let pending = listener.accept().await?;
        let admit = |_: &ReservationToken, _: &str| Err("no reservations here".to_owned());
        receive_import(pending, &d, &d_links, Duration::from_secs(60), admit).await.map_err(|e| e.to_string())?;
        let link = ("bench".to_string(), Arc::new(bounded(async { Ok(offer.await??) }).await?));
        println!("NCCL link ready");
        let mut seed = 1u64;
        let mut prompt = |len: usize| -> Vec<u32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 33) % vocab) as u32
                })
                .collect()
        };
        for &len in &lens {
            // Warm up every path at this length (kernel compiles, workspace growth).
            let mut s = unified.submit(EngineRequest::new(prompt(len), params.clone()))?;
            first(&mut s).await?;
            bounded(relay_once(&p, &d, &listener, &d_links, Some(&link), prompt(len), &params)).await?;
            bounded(relay_once(&p, &d, &listener, &d_links, None, prompt(len), &params)).await?;
            let mut uni = Vec::new();
            let (mut nccl, mut tcp) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let t0 = Instant::now();
                let mut s = unified.submit(EngineRequest::new(prompt(len), params.clone()))?;
                uni.push((first(&mut s).await? - t0).as_secs_f64());
                drop(s);
                nccl.push(bounded(relay_once(&p, &d, &listener, &d_links, Some(&link), prompt(len), &params)).await?);
                tcp.push(bounded(relay_once(&p, &d, &listener, &d_links, None, prompt(len), &params)).await?);
            }
            // Transfer alone: the same prompt twice; the second prefill is a prefix-cache hit
            // (one token computed), so its hand-off is nearly all data movement.
            let mut cached = Vec::new();
            for _ in 0..reps {
                let pr = prompt(len);
                bounded(relay_once(&p, &d, &listener, &d_links, Some(&link), pr.clone(), &params)).await?;
                cached.push(bounded(relay_once(&p, &d, &listener, &d_links, Some(&link), pr, &params)).await?);
            }
            rows.push((len, median(uni), nccl, tcp, cached));
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    let mut json_rows = Vec::new();
    writeln!(
        table,
        "{:>6} {:>10} | {:>10} {:>9} {:>9} {:>9} | {:>10} {:>9} {:>9} | {:>12}",
        "len", "unified", "nccl ttft", "vs uni", "exposed", "GB/s", "tcp ttft", "exposed", "GB/s", "cached GB/s"
    )?;
    for (len, uni, nccl, tcp, cached) in &rows {
        let m = |v: &[Relayed], f: fn(&Relayed) -> f64| median(v.iter().map(f).collect());
        let gbs = |v: &[Relayed]| median(v.iter().map(|r| r.bytes as f64 / r.handoff / 1e9).collect());
        let (nt, ne, ns) = (m(nccl, |r| r.ttft), m(nccl, |r| r.exposed), m(nccl, |r| r.second));
        let (tt, te, ts) = (m(tcp, |r| r.ttft), m(tcp, |r| r.exposed), m(tcp, |r| r.second));
        writeln!(
            table,
            "{len:>6} {:>8.2}ms | {:>8.2}ms {:>8.1}% {:>7.2}ms {:>9.1} | {:>8.2}ms {:>7.2}ms {:>9.2} | {:>12.1}",
            uni * 1e3,
            nt * 1e3,
            (nt / uni - 1.0) * 100.0,
            ne * 1e3,
            gbs(nccl),
            tt * 1e3,
            te * 1e3,
            gbs(tcp),
            gbs(cached)
        )?;
        json_rows.push(format!(
            "{{\"prompt_tokens\": {len}, \"unified_ttft_ms\": {:.3}, \"nccl\": {{\"ttft_ms\": {:.3}, \"ttft_vs_unified\": {:.4}, \"exposed_handoff_ms\": {:.3}, \"second_token_ms\": {:.3}, \"kv_bytes\": {}, \"handoff_gb_per_s\": {:.2}}}, \"tcp\": {{\"ttft_ms\": {:.3}, \"exposed_handoff_ms\": {:.3}, \"second_token_ms\": {:.3}, \"handoff_gb_per_s\": {:.3}}}, \"cached_prompt_handoff\": {{\"gb_per_s\": {:.2}, \"ms\": {:.3}, \"vs_nccl_ceiling\": {:.4}}}}}",
            uni * 1e3,
            nt * 1e3,
            nt / uni,
            ne * 1e3,
            ns * 1e3,
            nccl.first().map_or(0, |r| r.bytes),
            gbs(nccl),
            tt * 1e3,
            te * 1e3,
            ts * 1e3,
            gbs(tcp),
            gbs(cached),
            m(cached, |r| r.handoff) * 1e3,
            gbs(cached) / nccl_gbs
        ));
    }
    let device = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_owned())
        .unwrap_or_default();
    let json = format!(
        "{{\"name\": \"disagg-relay\", \"device\": \"2x {device}\", \"commit\": \"{commit}\", \"command\": \"{}\", \"model\": \"{config}\", \"nccl_send_recv_gb_per_s\": {nccl_gbs:.2}, \"rows\": [{}]}}\n",
        args.join(" "),
        json_rows.join(", ")
    );
    std::fs::write(&out, json)?;
    println!("{table}");
    for e in [unified, p, d] {
        e.shutdown();
    }
    Ok(())
}
