//! The 3-minute soak in CI: a 2P2D CPU cluster under random load (disconnects, stop strings,
//! `n > 1`) with a worker killed and restarted, sampled every minute; it fails when blocks or
//! work are left behind, when requests fail away from the kill, or when tasks, descriptors or
//! RSS grow. The same soak runs for 30 minutes as `cargo run --example soak`.

#[path = "common/cluster.rs"]
#[allow(dead_code)] // The harness serves several test binaries; this one uses part of it.
mod cluster;
#[path = "common/soak.rs"]
mod soak;

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_three_minutes_without_growth() {
    let config = soak::SoakConfig {
        exe: env!("CARGO_BIN_EXE_baton").into(),
        duration: Duration::from_secs(180),
        sample_every: Duration::from_secs(60),
        clients: 6,
        kill_every: Duration::from_secs(60),
        seed: 7,
    };
    let report = soak::run(&config).await;
    let json = serde_json::to_string_pretty(&report.json).expect("json");
    assert!(report.failures.is_empty(), "the soak failed: {:#?}\n{json}", report.failures);
    let samples = report.json["samples"].as_array().map_or(0, Vec::len);
    assert_eq!(samples, 3, "{json}");
    assert!(report.json["kills"].as_u64() >= Some(1), "no worker was killed: {json}");
}
