//! Shared harness of the end-to-end tests with real `baton` processes on loopback: the
//! cluster harness ([`cluster`], shared with the soak program) run with the test binary's
//! `baton`, `baton serve` as the reference a cluster must match, and the cluster-secret and
//! TLS files the security tests pass.
#![allow(dead_code)] // Each test binary uses a different part of it.

pub mod cluster;

pub use cluster::*;
use std::path::{Path, PathBuf};

/// The `baton` binary under test.
pub fn baton() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_baton"))
}

impl Proc {
    /// [`Proc::spawn_exe`] with the test binary's `baton`.
    pub fn spawn(dir: &Path, tag: &str, args: &[String]) -> Proc {
        Self::spawn_exe(baton(), dir, tag, args)
    }
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
    let mut serve = Proc::spawn(dir, "serve", &args);
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

/// Writes a fresh random cluster secret (as `base64 > FILE` would: text and a newline) into
/// `dir` and returns its path.
pub fn secret_file(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let bytes: [u8; 24] = rand::random();
    let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(&path, format!("{text}\n")).expect("write the secret");
    path
}

/// Writes a CA and one certificate for `localhost`/`127.0.0.1` signed by it (for server and
/// client use) into `dir`; returns the `--tls-cert/--tls-key/--tls-ca` flags.
pub fn tls_flags(dir: &Path) -> Vec<String> {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    ca.distinguished_name.push(rcgen::DnType::CommonName, "baton test CA");
    let ca_cert = ca.self_signed(&ca_key).expect("CA cert");
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).expect("params");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &Issuer::new(ca, &ca_key)).expect("cert");
    let write = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).expect("write PEM");
        p.display().to_string()
    };
    vec![
        "--tls-cert".into(),
        write("node.pem", cert.pem()),
        "--tls-key".into(),
        write("node.key", key.serialize_pem()),
        "--tls-ca".into(),
        write("ca.pem", ca_cert.pem()),
    ]
}
