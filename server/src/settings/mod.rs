//! Settings of every subcommand, each resolved from three layers: command-line flags and
//! `BATON_*` environment variables (both handled by clap in [`crate::cli`]), a TOML file
//! (`--config`, [`file`]), and defaults. Precedence: flag > env > file > default.
//!
//! One module per subcommand beside the config code that resolves it: [`serve`] (also the
//! engine configuration, shared with workers), [`router`], [`worker`], and [`security`] (the
//! internal plane's, shared by router and worker); [`error`] names what can go wrong.
//!
//! Invariant (the import graph is a DAG): these modules depend on [`crate::cli`] and on each
//! other only downward (`file` → `serve`, `router`; `router`, `worker` → `serve`, `security`,
//! `error`); the runners (`crate::serve`, `crate::router`, `crate::worker`) consume settings
//! and nothing here imports a runner.

pub mod error;
pub mod file;
pub mod router;
pub mod security;
pub mod serve;
pub mod worker;

use crate::cli::{RouterArgs, ServeArgs, WorkerArgs};
use baton_router::openai::tools::ToolCallParser;
use baton_router::openai::tools::choice::ToolConfig;
use error::{ConfigError, SettingsError};
use file::ConfigFile;

/// Loads `--config` (if any) and resolves `baton serve`'s settings.
pub fn serve(args: &ServeArgs) -> Result<serve::ServeSettings, ConfigError> {
    let file = ConfigFile::load_optional(args.config.as_deref())?;
    Ok(serve::resolve(args, &file.serve))
}

/// Loads `--config` (if any) and resolves `baton router`'s settings.
pub fn router(args: &RouterArgs) -> Result<router::RouterSettings, SettingsError> {
    let file = ConfigFile::load_optional(args.config.as_deref())?;
    router::router_settings(args, &file.router)
}

/// Loads `--config` (if any) and resolves `baton worker`'s settings.
pub fn worker(args: &WorkerArgs) -> Result<worker::WorkerSettings, SettingsError> {
    let path = args.serve.config.clone().unwrap_or_default();
    let file = ConfigFile::load_optional(args.serve.config.as_deref())?;
    worker::worker_settings(args, &file.worker, &path)
}

/// Refuses `--enable-auto-tool-choice` without a `--tool-call-parser` (as vLLM does): the
/// server could not read the calls it lets the model make.
pub fn check_tool_config(tools: &ToolConfig) -> Result<(), String> {
    if tools.enable_auto_tool_choice && tools.tool_call_parser.is_none() {
        let names: Vec<&str> = ToolCallParser::ALL.iter().map(|(n, _)| *n).collect();
        return Err(format!("--enable-auto-tool-choice needs --tool-call-parser (one of: {})", names.join(", ")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::router::router_settings;
    use super::worker::worker_settings;
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;
    use std::path::{Path, PathBuf};

    fn router_args(argv: &[&str]) -> RouterArgs {
        let mut full = vec!["baton", "router"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            Command::Router(a) => *a,
            other => panic!("not router: {other:?}"),
        }
    }

    fn worker_args(argv: &[&str]) -> WorkerArgs {
        let mut full = vec!["baton", "worker"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full).expect("parses").command {
            Command::Worker(a) => *a,
            other => panic!("not worker: {other:?}"),
        }
    }

    fn configs() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
    }

    #[test]
    fn example_cluster_configs_parse_and_resolve() {
        for (name, policy, prefill, decode) in
            [("1p1d.toml", "least_loaded", 1, 1), ("2p2d.toml", "prefix_aware", 2, 2)]
        {
            let path = configs().join(name);
            let file = ConfigFile::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
            let r = router_settings(&router_args(&[]), &file.router).expect("router settings");
            assert_eq!(r.policy, policy, "{name}");
            assert_eq!((r.cluster.min_prefill_workers, r.cluster.min_decode_workers), (prefill, decode), "{name}");
            for role in ["prefill", "decode"] {
                let w = worker_settings(&worker_args(&["--role", role]), &file.worker, &path).expect("worker settings");
                assert_eq!(w.role.as_str(), role);
                assert_eq!(
                    w.router,
                    format!("http://127.0.0.1:{}", r.registry_port),
                    "{name}: workers find the router"
                );
            }
        }
    }

    #[test]
    fn both_tables_take_the_security_keys() {
        let text = "[router]\ncluster_secret_file = \"/s\"\ntls_cert = \"c\"\ntls_key = \"k\"\ntls_ca = \"a\"\n\
                    [worker]\nrole = \"decode\"\nrouter = \"x:1\"\ncluster_secret_file = \"/s\"\ninsecure_cluster = true\n";
        let file = ConfigFile::parse(text, Path::new("s.toml")).expect("parses");
        let r = router_settings(&router_args(&[]), &file.router).expect("router");
        assert_eq!(r.security.cluster_secret_file, Some(PathBuf::from("/s")));
        assert!(r.security.tls.is_some() && !r.security.insecure_cluster);
        let r = router_settings(&router_args(&["--cluster-secret-file", "/flag"]), &file.router).expect("router");
        assert_eq!(r.security.cluster_secret_file, Some(PathBuf::from("/flag")), "the flag wins");
        let w = worker_settings(&worker_args(&[]), &file.worker, Path::new("s.toml")).expect("worker");
        assert_eq!(w.security.cluster_secret_file, Some(PathBuf::from("/s")));
        assert!(w.security.insecure_cluster && w.security.tls.is_none());
        let partial: toml::Table =
            toml::from_str("role = \"decode\"\nrouter = \"x:1\"\ntls_cert = \"c\"\n").expect("toml");
        let err = worker_settings(&worker_args(&[]), &partial, Path::new("s.toml")).expect_err("partial TLS");
        assert!(err.to_string().contains("--tls-key, --tls-ca"), "{err}");
    }
}
