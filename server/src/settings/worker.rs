//! `baton worker` settings ([`WorkerSettings`]), with the same layering as `serve`: flag >
//! `BATON_*` env > the config file's `[worker]` table > default.
//!
//! A worker is a `serve` without the OpenAI API: its `[worker]` table takes every `[serve]`
//! key (model, device, engine knobs; `port` is its `/health`+`/metrics` port and `grpc_port`
//! its Worker service's, both 0 = any free port by default) plus `role`, `router`,
//! `kv_port`, `advertise_host`, `kv_deadline_ms`, `kv_transfer_timeout_ms` and `kv_transport`, and the internal plane's
//! security keys ([`super::security`]). Unknown keys are errors.

use super::error::{ConfigError, SettingsError, invalid};
use super::security::{SECURITY_KEYS, SecurityFile, SecuritySettings};
use super::serve::{ServeFile, ServeSettings, resolve};
use crate::cli::WorkerArgs;
use baton_proto::Role;
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;

/// Everything `baton worker` needs beyond the engine settings it shares with `serve`.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSettings {
    /// Model, device, engine knobs, bind host; `port` is the HTTP port (/health, /metrics)
    /// and `grpc_port` the Worker service's.
    pub serve: ServeSettings,
    /// Which pool it joins.
    pub role: Role,
    /// The router's registry endpoint, e.g. `http://127.0.0.1:50100`.
    pub router: String,
    /// TCP port of the KV listener (0: any free port).
    pub kv_port: u16,
    /// Host the router and peers use to reach this worker (default: the bind host).
    pub advertise_host: Option<String>,
    /// Longest a received hand-off may stall between frames.
    pub kv_deadline: Duration,
    /// How long a KV link may stall before it is aborted (its hand-offs recompute).
    pub kv_transfer_timeout: Duration,
    /// How this worker sends KV as a prefill worker (decode workers accept both).
    pub kv_transport: KvTransportKind,
    /// Cluster secret and TLS of the internal plane.
    pub security: SecuritySettings,
    /// Fault injection (hidden flags), for the failure tests.
    pub chaos: Chaos,
}

/// How a prefill worker moves KV to decode workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvTransportKind {
    /// Host-staged over TCP (any device, any host).
    #[default]
    Tcp,
    /// GPU to GPU over NCCL, TCP only for control (CUDA on both sides).
    Nccl,
}

/// Fault injection: make this worker process die at a precise point, as a crashed or
/// killed worker would. Off unless a hidden flag sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Chaos {
    /// Exit after sending this many KV layers (prefill side).
    pub exit_after_kv_layers: Option<usize>,
    /// Exit after streaming this many tokens.
    pub exit_after_tokens: Option<usize>,
}

/// The worker-only keys of a `[worker]` table.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerOwn {
    role: Option<String>,
    router: Option<String>,
    kv_port: Option<u16>,
    advertise_host: Option<String>,
    kv_deadline_ms: Option<u64>,
    kv_transfer_timeout_ms: Option<u64>,
    kv_transport: Option<String>,
}

const WORKER_KEYS: [&str; 7] =
    ["role", "router", "kv_port", "advertise_host", "kv_deadline_ms", "kv_transfer_timeout_ms", "kv_transport"];

fn split_table(table: &toml::Table, keys: &[&str]) -> (toml::Table, toml::Table) {
    table.clone().into_iter().partition(|(k, _)| keys.contains(&k.as_str()))
}

/// Resolves `baton worker` settings from flags/env and a `[worker]` table (`path` names the
/// file in errors).
pub fn worker_settings(args: &WorkerArgs, table: &toml::Table, path: &Path) -> Result<WorkerSettings, SettingsError> {
    let (own, rest) = split_table(table, &WORKER_KEYS);
    let (security, rest) = split_table(&rest, &SECURITY_KEYS);
    let parse_err =
        |e: toml::de::Error| ConfigError::Parse { path: path.to_owned(), message: format!("[worker]: {e}") };
    let own: WorkerOwn = own.try_into().map_err(parse_err)?;
    let security: SecurityFile = security.try_into().map_err(parse_err)?;
    let mut serve_file: ServeFile = rest.try_into().map_err(parse_err)?;
    // Workers register their real addresses, so any free port is a fine default.
    serve_file.port = serve_file.port.or(Some(0));
    serve_file.grpc_port = serve_file.grpc_port.or(Some(0));
    let role = match args.role.clone().or(own.role).as_deref() {
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some("unified") => Role::Unified,
        Some(other) => return Err(invalid("role", format!("{other:?}: expected prefill, decode or unified"))),
        None => return Err(invalid("role", "required: --role prefill|decode|unified")),
    };
    let router = args
        .router
        .clone()
        .or(own.router)
        .ok_or_else(|| invalid("router", "required: --router http://HOST:PORT (the router's registry port)"))?;
    let router = if router.contains("://") { router } else { format!("http://{router}") };
    Ok(WorkerSettings {
        serve: resolve(&args.serve, &serve_file),
        role,
        router,
        kv_port: args.kv_port.or(own.kv_port).unwrap_or(0),
        advertise_host: args.advertise_host.clone().or(own.advertise_host),
        kv_deadline: Duration::from_millis(args.kv_deadline_ms.or(own.kv_deadline_ms).unwrap_or(10_000)),
        kv_transfer_timeout: match args.kv_transfer_timeout_ms.or(own.kv_transfer_timeout_ms) {
            Some(0) => return Err(invalid("kv_transfer_timeout_ms", "must be at least 1 ms")),
            Some(ms) => Duration::from_millis(ms),
            None => baton_engine::kv_connector::DEFAULT_TRANSFER_TIMEOUT,
        },
        kv_transport: match args.kv_transport.clone().or(own.kv_transport).as_deref().unwrap_or("tcp") {
            "tcp" => KvTransportKind::Tcp,
            "nccl" => KvTransportKind::Nccl,
            other => return Err(invalid("kv_transport", format!("{other:?}: expected tcp or nccl"))),
        },
        security: super::security::resolve(&args.security, &security)?,
        chaos: Chaos {
            exit_after_kv_layers: args.chaos_exit_after_kv_layers,
            exit_after_tokens: args.chaos_exit_after_tokens,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn worker_args(argv: &[&str]) -> WorkerArgs {
        let mut full = vec!["baton", "worker"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            Command::Worker(a) => *a,
            other => panic!("not worker: {other:?}"),
        }
    }

    #[test]
    fn worker_tables_take_serve_keys_plus_their_own_and_reject_typos() {
        let table: toml::Table = toml::from_str(
            "role = \"decode\"\nrouter = \"127.0.0.1:50100\"\nmax_num_seqs = 8\ndevice = \"cpu\"\nkv_port = 6000\n",
        )
        .expect("toml");
        let s = worker_settings(&worker_args(&[]), &table, Path::new("w.toml")).expect("valid");
        assert_eq!(s.role, Role::Decode);
        assert_eq!(s.router, "http://127.0.0.1:50100");
        assert_eq!((s.serve.max_num_seqs, s.serve.device.as_str(), s.kv_port), (Some(8), "cpu", 6000));
        assert_eq!((s.serve.port, s.serve.grpc_port), (0, 0), "free ports by default");
        let s = worker_settings(&worker_args(&["--role", "prefill", "--port", "9100"]), &table, Path::new("w.toml"))
            .expect("valid");
        assert_eq!((s.role, s.serve.port), (Role::Prefill, 9100));
        let typo: toml::Table = toml::from_str("rol = \"decode\"\n").expect("toml");
        let err = worker_settings(&worker_args(&["--router", "x:1"]), &typo, Path::new("w.toml")).expect_err("typo");
        assert!(err.to_string().contains("rol"), "{err}");
        let err = worker_settings(&worker_args(&["--router", "x:1"]), &toml::Table::new(), Path::new("w.toml"))
            .expect_err("no role");
        assert!(err.to_string().contains("--role"), "{err}");
    }

    #[test]
    fn the_kv_transfer_timeout_layers_like_every_key_and_refuses_zero() {
        let table: toml::Table =
            toml::from_str("role = \"decode\"\nrouter = \"x:1\"\nkv_transfer_timeout_ms = 5000\n").expect("toml");
        let s = worker_settings(&worker_args(&[]), &table, Path::new("w.toml")).expect("valid");
        assert_eq!(s.kv_transfer_timeout, Duration::from_millis(5000));
        let s = worker_settings(&worker_args(&["--kv-transfer-timeout-ms", "750"]), &table, Path::new("w.toml"))
            .expect("valid");
        assert_eq!(s.kv_transfer_timeout, Duration::from_millis(750), "the flag wins over the file");
        let s = worker_settings(
            &worker_args(&["--role", "decode", "--router", "x:1"]),
            &toml::Table::new(),
            Path::new("w.toml"),
        )
        .expect("valid");
        assert_eq!(s.kv_transfer_timeout, baton_engine::kv_connector::DEFAULT_TRANSFER_TIMEOUT);
        let err = worker_settings(&worker_args(&["--kv-transfer-timeout-ms", "0"]), &table, Path::new("w.toml"))
            .expect_err("zero");
        assert!(err.to_string().contains("kv_transfer_timeout_ms"), "{err}");
    }
}
