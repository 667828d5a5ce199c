//! The `baton` binary: parses the command line, sets up logging, and runs a subcommand
//! (`serve`, `router`, `worker`, `client grpc`). Everything else lives in the library crates.

mod cli;
mod client;
mod engine_watch;
mod kernels;
mod listeners;
mod model;
mod router;
mod serve;
mod settings;
mod shutdown;
mod worker;

use clap::Parser;
use cli::{Cli, ClientCommand, Command, KernelsCommand};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    // Start-up phases are timed from here (`startup phase phase=total` in the log).
    let started = std::time::Instant::now();
    let cli = Cli::parse();
    // NVLink SHARP (NVLS) multicast must stay off on the machines Baton's NCCL links run on;
    // an operator's explicit setting wins. Set here, before any thread or NCCL call exists.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: single-threaded at this point: no runtime, engine or logger thread started yet.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    // RUST_LOG overrides the default level; read here, at the edge.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only on a terminal: logs piped to files or collectors stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::Serve(args) => {
            let settings = settings::serve(&args)?;
            runtime.block_on(serve::run(settings, started))
        }
        Command::Router(args) => {
            let settings = settings::router(&args)?;
            runtime.block_on(router::run(settings))
        }
        Command::Worker(args) => {
            let settings = settings::worker(&args)?;
            runtime.block_on(worker::run(settings, started))
        }
        Command::Client(ClientCommand::Grpc(args)) => runtime.block_on(client::run(args)),
        Command::Kernels(KernelsCommand::Build(args)) => kernels::build(&args),
    }
}
