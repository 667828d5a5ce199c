//! The internal plane's gRPC security, for both ends: the router (registry server, worker
//! client) and the workers (worker server, registry client) share this one module. It is the
//! tonic glue of the protocol in [`baton_core::cluster_auth`].
//!
//! [`ClusterSecurity`] holds what a process proves and checks:
//! - with a cluster secret, every outgoing call is signed by [`CallSigner`] (a tonic
//!   interceptor adding `x-baton-auth`, see [`baton_core::cluster_auth`] for the protocol),
//!   and every service is wrapped in [`RequireClusterAuth`], which verifies the header
//!   against the method path of the HTTP/2 request before the service sees it and answers
//!   `UNAUTHENTICATED` otherwise; the caller's claimed identity is then available to the
//!   handler as a [`ClusterPeer`] request extension;
//! - with TLS ([`ClusterTls`]), servers present their certificate and require a client
//!   certificate from the same CA, and clients verify the server against the CA and present
//!   their own (mutual TLS). A URL given as `http://` is upgraded to `https://` whenever TLS
//!   is on, so a misconfigured URL cannot silently fall back to plain text.
//!
//! Invariant: without a secret nothing is signed or checked (loopback-only deployments and
//! tests); with one, no handler of a wrapped service runs for a call that did not verify.

use baton_core::cluster_auth::{AUTH_METADATA_KEY, CallVerifier, ClusterSecret, unix_millis};
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// PEM material for mutual TLS on the internal plane.
#[derive(Clone)]
pub struct ClusterTls {
    /// This process's certificate chain and key.
    pub identity: Identity,
    /// The CA that signs every cluster member's certificate.
    pub ca: Certificate,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls(<certificates>)")
    }
}

impl ClusterTls {
    /// From PEM bytes of the certificate chain, its private key and the CA certificate.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Self {
        Self { identity: Identity::from_pem(cert, key), ca: Certificate::from_pem(ca) }
    }
}

/// A URL the internal plane cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterUrlError {
    /// Not a URI with an `http`/`https` scheme and an authority.
    #[error("invalid URL {url}: {reason}")]
    Invalid {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// `https://` without TLS configured.
    #[error("{0} is https but this process has no TLS configuration (--tls-cert, --tls-key, --tls-ca)")]
    HttpsWithoutTls(String),
}

/// The identity a verified call claimed (set by [`RequireClusterAuth`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPeer(pub String);

/// What one process proves and checks on the internal plane.
#[derive(Clone, Debug)]
pub struct ClusterSecurity {
    secret: Option<ClusterSecret>,
    verifier: Option<Arc<CallVerifier>>,
    identity: String,
    tls: Option<ClusterTls>,
}

impl ClusterSecurity {
    /// Signs and checks with `secret` (when given) as `identity`, over `tls` (when given).
    pub fn new(secret: Option<ClusterSecret>, identity: impl Into<String>, tls: Option<ClusterTls>) -> Self {
        let verifier = secret.clone().map(|s| Arc::new(CallVerifier::new(s)));
        Self { secret, verifier, identity: identity.into(), tls }
    }

    /// No secret, no TLS (loopback deployments, tests).
    pub fn insecure(identity: impl Into<String>) -> Self {
        Self::new(None, identity, None)
    }

    /// The cluster secret, if any.
    pub fn secret(&self) -> Option<&ClusterSecret> {
        self.secret.as_ref()
    }

    /// The identity this process claims.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether the internal plane uses TLS.
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The scheme of this process's own URLs (`https` with TLS).
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// The interceptor signing this process's calls.
    pub fn signer(&self) -> CallSigner {
        CallSigner { secret: self.secret.clone(), identity: self.identity.clone() }
    }

    /// `url` with the scheme this process must use for it: `http://` becomes `https://`
    /// with TLS; `https://` without TLS is refused.
    pub fn normalize_url(&self, url: &str) -> Result<String, ClusterUrlError> {
        let invalid = |reason: &str| ClusterUrlError::Invalid { url: url.to_owned(), reason: reason.to_owned() };
        let (scheme, rest) = url.split_once("://").ok_or_else(|| invalid("expected http://HOST:PORT"))?;
        if rest.is_empty() {
            return Err(invalid("no host"));
        }
        match (scheme.to_ascii_lowercase().as_str(), self.tls.is_some()) {
            ("http", false) | ("https", true) => Ok(url.to_owned()),
            ("http", true) => Ok(format!("https://{rest}")),
            ("https", false) => Err(ClusterUrlError::HttpsWithoutTls(url.to_owned())),
            _ => Err(invalid("the scheme must be http or https")),
        }
    }

    /// An endpoint for a cluster peer at `url`, with TLS when configured.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, ClusterUrlError> {
        let url = self.normalize_url(url)?;
        let invalid = |e: &dyn std::fmt::Display| ClusterUrlError::Invalid { url: url.clone(), reason: e.to_string() };
        let endpoint = Endpoint::from_shared(url.clone()).map_err(|e| invalid(&e))?;
        match &self.tls {
            Some(tls) => endpoint
                .tls_config(ClientTlsConfig::new().ca_certificate(tls.ca.clone()).identity(tls.identity.clone()))
                .map_err(|e| invalid(&e)),
            None => Ok(endpoint),
        }
    }

    /// A signed client over `channel` (e.g. `WorkerClient::new(security.client(ch))`).
    pub fn client(&self, channel: Channel) -> SignedChannel {
        InterceptedService::new(channel, self.signer())
    }

    /// A server builder with TLS when configured.
    pub fn server(&self) -> Result<Server, tonic::transport::Error> {
        let builder = Server::builder();
        match &self.tls {
            Some(tls) => {
                builder.tls_config(ServerTlsConfig::new().identity(tls.identity.clone()).client_ca_root(tls.ca.clone()))
            }
            None => Ok(builder),
        }
    }

    /// `service`, refusing calls that do not verify (a pass-through without a secret).
    pub fn guard<S>(&self, service: S) -> RequireClusterAuth<S> {
        RequireClusterAuth { inner: service, verifier: self.verifier.clone() }
    }
}

/// A channel whose calls are signed.
pub type SignedChannel = InterceptedService<Channel, CallSigner>;

/// Client interceptor: adds `x-baton-auth` for the call's method (nothing without a secret).
#[derive(Clone, Debug)]
pub struct CallSigner {
    secret: Option<ClusterSecret>,
    identity: String,
}

impl tonic::service::Interceptor for CallSigner {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(secret) = &self.secret else { return Ok(request) };
        // Generated clients name the method of every call in this extension.
        let path = request
            .extensions()
            .get::<tonic::GrpcMethod<'static>>()
            .map(|m| format!("/{}/{}", m.service(), m.method()))
            .ok_or_else(|| tonic::Status::internal("cannot sign a call without its method name"))?;
        let value = secret.sign_call(&path, &self.identity, unix_millis());
        let value = value.parse().map_err(|_| tonic::Status::internal("the signed call header is not ASCII"))?;
        request.metadata_mut().insert(AUTH_METADATA_KEY, value);
        Ok(request)
    }
}

/// A gRPC service that runs only calls whose `x-baton-auth` verifies for their method path.
#[derive(Clone, Debug)]
pub struct RequireClusterAuth<S> {
    inner: S,
    verifier: Option<Arc<CallVerifier>>,
}

impl<S: NamedService> NamedService for RequireClusterAuth<S> {
    const NAME: &'static str = S::NAME;
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<http::Request<Body>> for RequireClusterAuth<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        if let Some(verifier) = &self.verifier {
            let header = request.headers().get(AUTH_METADATA_KEY).and_then(|v| v.to_str().ok());
            match verifier.verify(header, request.uri().path(), unix_millis()) {
                Ok(identity) => {
                    request.extensions_mut().insert(ClusterPeer(identity));
                }
                Err(e) => {
                    tracing::warn!(method = request.uri().path(), error = %e, "unauthenticated internal call refused");
                    let response = tonic::Status::unauthenticated(e.to_string()).into_http();
                    return Box::pin(async move { Ok(response) });
                }
            }
        }
        Box::pin(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes(b"a test secret of enough length").expect("secret")
    }

    #[test]
    fn urls_follow_the_tls_setting() {
        let plain = ClusterSecurity::new(Some(secret()), "router", None);
        assert_eq!(plain.normalize_url("http://10.0.0.1:5").as_deref(), Ok("http://10.0.0.1:5"));
        assert!(matches!(plain.normalize_url("https://h:1"), Err(ClusterUrlError::HttpsWithoutTls(_))));
        assert!(matches!(plain.normalize_url("h:1"), Err(ClusterUrlError::Invalid { .. })));
        assert!(matches!(plain.normalize_url("ftp://h:1"), Err(ClusterUrlError::Invalid { .. })));
        let tls = ClusterSecurity::new(None, "router", Some(ClusterTls::from_pem(b"c", b"k", b"ca")));
        assert_eq!(tls.normalize_url("http://h:1").as_deref(), Ok("https://h:1"), "never plain text with TLS on");
        assert_eq!(tls.normalize_url("https://h:1").as_deref(), Ok("https://h:1"));
        assert_eq!((plain.scheme(), tls.scheme()), ("http", "https"));
    }

    #[test]
    fn the_signer_signs_the_generated_method_path() {
        use tonic::service::Interceptor;
        let s = secret();
        let mut signer = ClusterSecurity::new(Some(s.clone()), "worker-1", None).signer();
        let mut r = tonic::Request::new(());
        r.extensions_mut().insert(tonic::GrpcMethod::new("baton.worker.v1.Worker", "Decode"));
        let r = signer.call(r).expect("signed");
        let header = r.metadata().get(AUTH_METADATA_KEY).and_then(|v| v.to_str().ok()).expect("header");
        let v = CallVerifier::new(s);
        assert_eq!(v.verify(Some(header), "/baton.worker.v1.Worker/Decode", unix_millis()).as_deref(), Ok("worker-1"));
        // Without the method name there is nothing to sign: refused rather than sent unsigned.
        assert!(signer.call(tonic::Request::new(())).is_err());
        // Without a secret, nothing is added.
        let mut open = ClusterSecurity::insecure("x").signer();
        assert!(open.call(tonic::Request::new(())).expect("open").metadata().get(AUTH_METADATA_KEY).is_none());
    }
}
