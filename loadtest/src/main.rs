//! The `baton-loadtest` binary: parses flags, runs, prints the summary.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = baton_loadtest::cli::Cli::parse();
    let text = baton_loadtest::cli::execute(&cli).await?;
    print!("{text}");
    Ok(())
}
