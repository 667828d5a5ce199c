//! The internal plane's security settings of `baton router` and `baton worker`: resolving
//! `--cluster-secret-file`, `--insecure-cluster` and `--tls-cert/--tls-key/--tls-ca` (flag >
//! `BATON_*` env > config table), and loading them at start into a
//! [`ClusterSecurity`] (the protocol is in `baton_core::cluster_auth`, the gRPC glue in
//! `baton_proto::cluster_auth`).
//!
//! Start-up rules (each refusal names the fix):
//! - the secret file must be readable and hold at least 16 bytes (a trailing newline is not
//!   part of the secret);
//! - a process that binds a non-loopback address needs a secret, unless `--insecure-cluster`
//!   says an operator chose otherwise (loopback-only deployments and tests need none);
//! - the three TLS files go together.

use baton_core::cluster_auth::{ClusterSecret, SecretError};
use baton_proto::{ClusterSecurity, ClusterTls};
use serde::Deserialize;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Security keys of a `[router]` or `[worker]` table (the flags' names).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecurityFile {
    /// See `--cluster-secret-file`.
    pub cluster_secret_file: Option<PathBuf>,
    /// See `--insecure-cluster`.
    pub insecure_cluster: Option<bool>,
    /// See `--tls-cert`.
    pub tls_cert: Option<PathBuf>,
    /// See `--tls-key`.
    pub tls_key: Option<PathBuf>,
    /// See `--tls-ca`.
    pub tls_ca: Option<PathBuf>,
}

/// The config-table keys of [`SecurityFile`].
pub const SECURITY_KEYS: [&str; 5] = ["cluster_secret_file", "insecure_cluster", "tls_cert", "tls_key", "tls_ca"];

/// Resolved security settings (paths, not yet read).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SecuritySettings {
    /// The cluster secret's file.
    pub cluster_secret_file: Option<PathBuf>,
    /// Bind a non-loopback address without a secret anyway.
    pub insecure_cluster: bool,
    /// TLS files: certificate chain, key, CA.
    pub tls: Option<TlsFiles>,
}

/// The three PEM files of mutual TLS.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    /// This process's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The cluster's CA.
    pub ca: PathBuf,
}

/// A security setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// Some of the TLS files are missing.
    #[error("--tls-cert, --tls-key and --tls-ca go together; missing: {0}")]
    PartialTls(String),
    /// A file cannot be read.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The secret is unusable.
    #[error("cluster secret file {path}: {source}")]
    Secret {
        /// Its path.
        path: PathBuf,
        /// Why.
        source: SecretError,
    },
    /// A non-loopback bind without a secret.
    #[error(
        "refusing to bind {host} without a cluster secret: anyone who can reach {what} could join or call this cluster. \
         Pass --cluster-secret-file FILE (the same file on the router and every worker, e.g. made with \
         `head -c 32 /dev/urandom | base64 > FILE`), bind 127.0.0.1, or pass --insecure-cluster to accept the risk"
    )]
    InsecureBind {
        /// The bind address.
        host: String,
        /// What would be exposed.
        what: &'static str,
    },
}

/// Merges flags/env (`args`) over a config table's keys.
pub fn resolve(args: &crate::cli::SecurityArgs, file: &SecurityFile) -> Result<SecuritySettings, SecurityError> {
    let pick = |a: &Option<PathBuf>, f: &Option<PathBuf>| a.clone().or_else(|| f.clone());
    let (cert, key, ca) =
        (pick(&args.tls_cert, &file.tls_cert), pick(&args.tls_key, &file.tls_key), pick(&args.tls_ca, &file.tls_ca));
    let tls = match (cert, key, ca) {
        (None, None, None) => None,
        (Some(cert), Some(key), Some(ca)) => Some(TlsFiles { cert, key, ca }),
        (cert, key, ca) => {
            let missing: Vec<&str> =
                [(cert.is_none(), "--tls-cert"), (key.is_none(), "--tls-key"), (ca.is_none(), "--tls-ca")]
                    .into_iter()
                    .filter_map(|(m, name)| m.then_some(name))
                    .collect();
            return Err(SecurityError::PartialTls(missing.join(", ")));
        }
    };
    Ok(SecuritySettings {
        cluster_secret_file: pick(&args.cluster_secret_file, &file.cluster_secret_file),
        insecure_cluster: args.insecure_cluster.or(file.insecure_cluster).unwrap_or(false),
        tls,
    })
}

/// Whether binding `host` only listens on this machine.
pub fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|source| SecurityError::Read { what, path: path.to_owned(), source })
}

/// Reads the secret and TLS files and checks the bind rule; `identity` is what this
/// process claims (the router, or a worker's instance), `host` its bind address and `what`
/// names its internal endpoints for the refusal message.
pub fn load(
    s: &SecuritySettings,
    identity: &str,
    host: &str,
    what: &'static str,
) -> Result<ClusterSecurity, SecurityError> {
    let secret = match &s.cluster_secret_file {
        Some(path) => {
            warn_if_readable_by_others(path);
            let bytes = read("cluster secret file", path)?;
            Some(
                ClusterSecret::from_bytes(&bytes)
                    .map_err(|source| SecurityError::Secret { path: path.clone(), source })?,
            )
        }
        None => None,
    };
    if secret.is_none() && !is_loopback(host) {
        if !s.insecure_cluster {
            return Err(SecurityError::InsecureBind { host: host.to_owned(), what });
        }
        tracing::warn!(host, "--insecure-cluster: the internal plane is open to anyone who can reach it");
    }
    let tls = match &s.tls {
        Some(f) => Some(ClusterTls::from_pem(
            &read("TLS certificate", &f.cert)?,
            &read("TLS key", &f.key)?,
            &read("TLS CA certificate", &f.ca)?,
        )),
        None => None,
    };
    tracing::info!(cluster_secret = secret.is_some(), tls = tls.is_some(), "internal plane security");
    Ok(ClusterSecurity::new(secret, identity, tls))
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(path = %path.display(), "the cluster secret file is readable by other users; chmod 600 it");
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::SecurityArgs;

    #[test]
    fn loopback_hosts() {
        for h in ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "10.0.0.5", "example.com", ""] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn non_loopback_binds_need_a_secret_or_the_insecure_flag() {
        let dir = tempfile::tempdir().expect("dir");
        let none = SecuritySettings::default();
        let err = load(&none, "router", "0.0.0.0", "the registry").expect_err("refused");
        assert!(err.to_string().contains("--cluster-secret-file") && err.to_string().contains("--insecure-cluster"));
        assert!(load(&none, "router", "127.0.0.1", "x").is_ok(), "loopback needs no secret");
        let insecure = SecuritySettings { insecure_cluster: true, ..Default::default() };
        assert!(load(&insecure, "router", "0.0.0.0", "x").is_ok());
        let path = dir.path().join("secret");
        std::fs::write(&path, "0123456789abcdef0123\n").expect("write");
        let with = SecuritySettings { cluster_secret_file: Some(path.clone()), ..Default::default() };
        let sec = load(&with, "router", "0.0.0.0", "x").expect("a secret allows any bind");
        assert!(sec.secret().is_some());
        std::fs::write(&path, "short\n").expect("write");
        let err = load(&with, "router", "127.0.0.1", "x").expect_err("too short");
        assert!(err.to_string().contains("at least 16"), "{err}");
        let missing = SecuritySettings { cluster_secret_file: Some(dir.path().join("nope")), ..Default::default() };
        let err = load(&missing, "router", "127.0.0.1", "x").expect_err("missing");
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn tls_files_go_together() {
        let args = SecurityArgs { tls_cert: Some("c".into()), ..Default::default() };
        let err =
            resolve(&args, &SecurityFile { tls_ca: Some("a".into()), ..Default::default() }).expect_err("partial");
        assert_eq!(err.to_string(), "--tls-cert, --tls-key and --tls-ca go together; missing: --tls-key");
        let file = SecurityFile { tls_key: Some("k".into()), tls_ca: Some("a".into()), ..Default::default() };
        let s = resolve(&args, &file).expect("complete");
        assert_eq!(s.tls, Some(TlsFiles { cert: "c".into(), key: "k".into(), ca: "a".into() }));
        let s = resolve(&SecurityArgs { insecure_cluster: Some(true), ..Default::default() }, &SecurityFile::default())
            .expect("ok");
        assert!(s.insecure_cluster && s.tls.is_none());
    }
}
