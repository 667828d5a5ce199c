//! The long soak: a 2P2D CPU cluster (real `baton` processes on loopback, a tiny random model)
//! under random load with workers killed and restarted, sampled every minute. Writes a JSON
//! report (per sample and process: KV blocks in use when idle, work in flight, runtime tasks,
//! RSS, file descriptors and sockets; then the growth from the first sample to the last) and
//! exits non-zero on any leak or growth.
//!
//! ```sh
//! cargo build -p baton && cargo run -p baton --example soak -- --minutes 30 --out soak.json
//! ```

#[path = "../tests/common/cluster.rs"]
#[allow(dead_code)] // The harness serves the tests too; the soak uses part of it.
mod cluster;
#[path = "../tests/common/soak.rs"]
mod soak;

use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;

/// Soak a 2P2D CPU cluster and report resource growth.
#[derive(Debug, Parser)]
struct Args {
    /// Load time in minutes.
    #[arg(long, default_value_t = 30)]
    minutes: u64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 60)]
    sample_every_s: u64,
    /// Seconds between worker kills (each killed worker restarts 3 s later).
    #[arg(long, default_value_t = 300)]
    kill_every_s: u64,
    /// Concurrent client loops.
    #[arg(long, default_value_t = 6)]
    clients: usize,
    /// The `baton` binary [default: next to this example's own directory, i.e. target/<profile>/baton]
    #[arg(long)]
    baton: Option<PathBuf>,
    /// Where the JSON report goes.
    #[arg(long, default_value = "soak-report.json")]
    out: PathBuf,
    /// Seed of the load's randomness.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let exe = match args.baton {
        Some(p) => p,
        None => {
            let me = std::env::current_exe()?;
            let profile_dir = me.parent().and_then(|examples| examples.parent());
            profile_dir.map(|d| d.join("baton")).ok_or_else(|| anyhow::anyhow!("pass --baton"))?
        }
    };
    anyhow::ensure!(exe.exists(), "{} does not exist: build it (cargo build -p baton) or pass --baton", exe.display());
    let config = soak::SoakConfig {
        exe,
        duration: Duration::from_secs(args.minutes * 60),
        sample_every: Duration::from_secs(args.sample_every_s),
        clients: args.clients,
        kill_every: Duration::from_secs(args.kill_every_s),
        seed: args.seed,
    };
    let report = soak::run(&config).await;
    std::fs::write(&args.out, serde_json::to_string_pretty(&report.json)?)?;
    println!("report written to {}", args.out.display());
    if report.failures.is_empty() {
        println!("passed: no growth, nothing left behind");
        Ok(())
    } else {
        anyhow::bail!("the soak failed:\n{}", report.failures.join("\n"))
    }
}
