//! Test support for the disaggregated end-to-end tests: the cluster harness ([`cluster`]) with
//! the test binary's `baton`, and `baton serve` as the reference a cluster must match.
#![allow(dead_code)] // Each test binary uses a different part of it.

pub mod cluster;

pub use cluster::*;
use std::path::Path;

/// The `baton` binary under test.
pub fn baton() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_baton"))
}

impl Cluster {
    /// [`Cluster::start_exe`] with the test binary's `baton`.
    pub async fn start(
        dir: &Path,
        model: &Path,
        config: &str,
        router_flags: &[&str],
        extra_p: &[Vec<&str>],
        extra_d: &[Vec<&str>],
    ) -> Cluster {
        Self::start_exe(baton(), dir, model, config, router_flags, extra_p, extra_d).await
    }
}

/// The greedy outputs `baton serve` gives for `ps` (the reference a cluster must match).
pub async fn reference(dir: &Path, model: &Path, ps: &[Vec<u32>]) -> Vec<(String, Vec<f64>)> {
    let mut args: Vec<String> = vec!["serve".into(), "--grpc-port".into(), "0".into()];
    args.extend(model_args(model));
    let mut serve = Proc::spawn_exe(baton(), dir, "serve", &args);
    let http = reqwest::Client::new();
    serve.wait_healthy(&http).await;
    let mut out = Vec::new();
    for p in ps {
        let r = complete(&http, &serve.http, p, false).await;
        assert_same(&complete(&http, &serve.http, p, true).await, &r, "serve: streaming vs not");
        out.push(r);
    }
    out
}
