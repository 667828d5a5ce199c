//! Authentication of Baton's internal plane: the shared cluster secret and what is proved
//! with it. Pure functions over bytes and clocks given as arguments; the gRPC glue lives in
//! `baton_proto::cluster_auth` and the KV handshake in `baton_engine::kv_transport::tcp`.
//!
//! # The protocol
//!
//! Every process of one cluster (router and workers) reads the same secret (at least
//! [`MIN_SECRET_LEN`] bytes) from `--cluster-secret-file`. The secret never travels: each
//! party proves knowledge of it with HMAC-SHA256 tags, always over
//! `purpose ‖ part₁ ‖ part₂ ‖ …`, where every part is length-prefixed (u64 LE) so that no
//! two different part lists hash alike, and the purpose ([`Purpose`]) separates the
//! domains so that a tag made for one use is never valid for another.
//!
//! - **gRPC calls** (registry, worker service): the caller sends the metadata
//!   `x-baton-auth: v1:<unix ms>:<nonce>:<identity>:<tag>` ([`ClusterSecret::sign_call`]),
//!   the tag covering the timestamp, a fresh 128-bit random nonce, the identity the caller
//!   claims and the gRPC method path (`/package.Service/Method`). The callee
//!   ([`CallVerifier`]) checks the tag in constant time, that the timestamp is within
//!   ±[`CALL_WINDOW`] of its own clock, and that the nonce was not seen within that window
//!   (a bounded [`ReplayCache`]): a captured header replayed later, or sent to another
//!   method, is refused. The tag does not cover the message body (an interceptor never sees
//!   it): against an on-path attacker who can rewrite a call in flight use TLS
//!   (`--tls-cert/--tls-key/--tls-ca`) as well.
//! - **KV hand-offs** (TCP): a challenge-response. The receiver sends a fresh random
//!   [`KvChallenge`] as soon as it accepts the connection; the sender answers with
//!   `HMAC(purpose = kv-handshake, nonce, handshake bytes)` ([`ClusterSecret::kv_proof`]).
//!   A proof is only valid for the one connection whose nonce it covers, so a recorded
//!   handshake replayed on a new connection fails.
//!
//! Identities are claims, not proofs: every holder of the secret can claim any identity.
//! The secret separates the cluster from everyone else; identities (worker instances,
//! [`ReservationToken`]s) keep members from stepping on each other by mistake or from a
//! leaked id.
//!
//! Invariants: tags are compared only through `hmac`'s constant-time `verify_slice`;
//! [`ApiKeyDigest`] compares SHA-256 digests in constant time, so neither the key nor its
//! length leaks through timing; the replay cache never forgets a nonce before its token's
//! timestamp has left the window, and never grows past its capacity (it refuses instead).

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::time::Duration;
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// The shortest secret accepted.
pub const MIN_SECRET_LEN: usize = 16;

/// How far a call's timestamp may be from the callee's clock, either way.
pub const CALL_WINDOW: Duration = Duration::from_secs(30);

/// Default capacity of a [`ReplayCache`]: calls accepted per [`CALL_WINDOW`] before new
/// ones are refused (about 60 bytes each at most).
pub const DEFAULT_REPLAY_CAPACITY: usize = 1 << 19;

/// The metadata key of a signed gRPC call.
pub const AUTH_METADATA_KEY: &str = "x-baton-auth";

/// Bytes of a KV handshake nonce.
pub const KV_NONCE_LEN: usize = 32;

/// Bytes of a tag or proof.
pub const TAG_LEN: usize = 32;

/// What a tag is for; part of every tagged message, so tags of one kind never pass as
/// another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A gRPC call on the internal plane.
    GrpcCall,
    /// The sender's answer to a KV listener's challenge.
    KvHandshake,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::GrpcCall => b"baton/v1/grpc-call",
            Purpose::KvHandshake => b"baton/v1/kv-handshake",
        }
    }
}

/// A secret that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Shorter than [`MIN_SECRET_LEN`] (after trimming the trailing newline).
    #[error(
        "the cluster secret is {len} bytes; at least {MIN_SECRET_LEN} are required (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
    )]
    TooShort {
        /// Its length.
        len: usize,
    },
}

/// The shared secret of one cluster. Its `Debug` output never shows the bytes.
#[derive(Clone)]
pub struct ClusterSecret {
    key: Vec<u8>,
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClusterSecret(<{} bytes>)", self.key.len())
    }
}

impl PartialEq for ClusterSecret {
    fn eq(&self, other: &Self) -> bool {
        self.key.ct_eq(&other.key).into()
    }
}

fn mac_over(key: &[u8], purpose: Purpose, parts: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length; this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC takes any key"));
    let label = purpose.label();
    mac.update(&(label.len() as u64).to_le_bytes());
    mac.update(label);
    for p in parts {
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac
}

impl ClusterSecret {
    /// The secret from a file's contents: a trailing newline (`\n` or `\r\n`, as editors and
    /// `echo` leave) is not part of it; shorter than [`MIN_SECRET_LEN`] is refused.
    pub fn from_bytes(raw: &[u8]) -> Result<Self, SecretError> {
        let mut key = raw;
        while let [rest @ .., b'\n' | b'\r'] = key {
            key = rest;
        }
        if key.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort { len: key.len() });
        }
        Ok(Self { key: key.to_vec() })
    }

    /// HMAC-SHA256 of `parts` for `purpose`.
    pub fn tag(&self, purpose: Purpose, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        mac_over(&self.key, purpose, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` for `purpose` (constant time).
    pub fn verify(&self, purpose: Purpose, parts: &[&[u8]], tag: &[u8]) -> bool {
        mac_over(&self.key, purpose, parts).verify_slice(tag).is_ok()
    }

    /// The `x-baton-auth` value for a call of `method` (`/package.Service/Method`) by
    /// `identity` at `now_ms` (Unix milliseconds), with a fresh nonce.
    pub fn sign_call(&self, method: &str, identity: &str, now_ms: u64) -> String {
        let nonce: [u8; 16] = rand::random();
        self.sign_call_with_nonce(method, identity, now_ms, nonce)
    }

    fn sign_call_with_nonce(&self, method: &str, identity: &str, now_ms: u64, nonce: [u8; 16]) -> String {
        let ts = now_ms.to_string();
        let tag = self.tag(Purpose::GrpcCall, &[b"v1", ts.as_bytes(), &nonce, identity.as_bytes(), method.as_bytes()]);
        format!("v1:{ts}:{}:{identity}:{}", hex::encode(nonce), hex::encode(tag))
    }

    /// The sender's answer to a KV listener's `challenge` for the handshake `hello` (the
    /// exact bytes it sends).
    pub fn kv_proof(&self, challenge: &KvChallenge, hello: &[u8]) -> [u8; TAG_LEN] {
        self.tag(Purpose::KvHandshake, &[&challenge.0, hello])
    }

    /// Whether `proof` answers `challenge` for `hello` (constant time).
    pub fn verify_kv_proof(&self, challenge: &KvChallenge, hello: &[u8], proof: &[u8]) -> bool {
        self.verify(Purpose::KvHandshake, &[&challenge.0, hello], proof)
    }
}

/// Whether `identity` may be claimed in a call header: 1 to 64 of `[A-Za-z0-9._-]`.
pub fn valid_identity(identity: &str) -> bool {
    (1..=64).contains(&identity.len())
        && identity.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A KV listener's fresh random challenge for one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvChallenge(pub [u8; KV_NONCE_LEN]);

impl KvChallenge {
    /// A fresh random challenge.
    pub fn random() -> Self {
        Self(rand::random())
    }
}

/// Why a signed call was refused. The messages name the problem without helping a guesser.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallAuthError {
    /// No `x-baton-auth` metadata.
    #[error("missing x-baton-auth: this endpoint needs the cluster secret (--cluster-secret-file)")]
    Missing,
    /// Not of the form `v1:<ts>:<nonce>:<identity>:<tag>`.
    #[error("malformed x-baton-auth")]
    Malformed,
    /// The tag does not verify (another secret, another method, or tampered).
    #[error("x-baton-auth does not verify: is --cluster-secret-file the same file on every process?")]
    BadTag,
    /// The timestamp is outside the window (clock skew, or an old captured header).
    #[error("x-baton-auth is {skew_ms} ms away from this clock (window ±{window_ms} ms): check the clocks")]
    Stale {
        /// Signed distance in milliseconds (positive: from the future).
        skew_ms: i64,
        /// The window in milliseconds.
        window_ms: u64,
    },
    /// The nonce was already used within the window.
    #[error("x-baton-auth was already used (a replay)")]
    Replayed,
    /// The replay cache is full of live nonces: refused rather than forgetting one early.
    #[error("too many authenticated calls within the replay window; retry shortly")]
    CacheFull,
}

/// Nonces of accepted calls until their timestamps leave the window.
///
/// Entries are kept in insertion order with the time at which they may go (timestamp +
/// window); pruning pops from the front only entries whose time has passed, so an entry is
/// never dropped early. When `capacity` live entries exist, new calls are refused
/// ([`CallAuthError::CacheFull`]); only calls with a valid tag ever reach the cache, so
/// only a holder of the secret can fill it.
#[derive(Debug)]
pub struct ReplayCache {
    seen: HashSet<[u8; 16]>,
    order: VecDeque<(u64, [u8; 16])>,
    capacity: usize,
}

impl ReplayCache {
    /// An empty cache of at most `capacity` nonces.
    pub fn new(capacity: usize) -> Self {
        Self { seen: HashSet::new(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// Nonces held now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    fn prune(&mut self, now_ms: u64) {
        while let Some(&(until, nonce)) = self.order.front() {
            // A token is accepted up to and including `until`: keep its nonce until then.
            if until >= now_ms {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&nonce);
        }
    }

    /// Records `nonce`, valid until `until_ms`; refuses one already held.
    pub fn insert(&mut self, nonce: [u8; 16], until_ms: u64, now_ms: u64) -> Result<(), CallAuthError> {
        self.prune(now_ms);
        if self.seen.contains(&nonce) {
            return Err(CallAuthError::Replayed);
        }
        if self.seen.len() >= self.capacity {
            return Err(CallAuthError::CacheFull);
        }
        self.seen.insert(nonce);
        self.order.push_back((until_ms, nonce));
        Ok(())
    }
}

/// Checks signed calls: tag, clock window and replays.
#[derive(Debug)]
pub struct CallVerifier {
    secret: ClusterSecret,
    window: Duration,
    cache: std::sync::Mutex<ReplayCache>,
}

impl CallVerifier {
    /// A verifier with the default window and replay capacity.
    pub fn new(secret: ClusterSecret) -> Self {
        Self::with_limits(secret, CALL_WINDOW, DEFAULT_REPLAY_CAPACITY)
    }

    /// A verifier with an explicit window and replay capacity.
    pub fn with_limits(secret: ClusterSecret, window: Duration, capacity: usize) -> Self {
        Self { secret, window, cache: std::sync::Mutex::new(ReplayCache::new(capacity)) }
    }

    /// Checks the `x-baton-auth` value `header` of a call of `method` at `now_ms`; returns
    /// the identity the caller claimed.
    pub fn verify(&self, header: Option<&str>, method: &str, now_ms: u64) -> Result<String, CallAuthError> {
        let header = header.ok_or(CallAuthError::Missing)?;
        let parts: Vec<&str> = header.split(':').collect();
        let [version, ts, nonce, identity, tag] = parts.as_slice() else {
            return Err(CallAuthError::Malformed);
        };
        if *version != "v1" || !valid_identity(identity) {
            return Err(CallAuthError::Malformed);
        }
        let ts_ms: u64 = ts.parse().map_err(|_| CallAuthError::Malformed)?;
        let nonce: [u8; 16] =
            hex::decode(nonce).ok().and_then(|n| n.try_into().ok()).ok_or(CallAuthError::Malformed)?;
        let tag = hex::decode(tag).map_err(|_| CallAuthError::Malformed)?;
        let parts: [&[u8]; 5] = [b"v1", ts.as_bytes(), &nonce, identity.as_bytes(), method.as_bytes()];
        if !self.secret.verify(Purpose::GrpcCall, &parts, &tag) {
            return Err(CallAuthError::BadTag);
        }
        let window_ms = self.window.as_millis() as u64;
        let skew_ms = ts_ms as i128 - now_ms as i128;
        if skew_ms.unsigned_abs() > u128::from(window_ms) {
            let skew_ms = skew_ms.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
            return Err(CallAuthError::Stale { skew_ms, window_ms });
        }
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        cache.insert(nonce, ts_ms.saturating_add(window_ms), now_ms)?;
        Ok((*identity).to_owned())
    }

    /// Nonces held in the replay cache now.
    pub fn cached_nonces(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }
}

/// The current Unix time in milliseconds (0 before 1970).
pub fn unix_millis() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// An unguessable, 128-bit name of a decode worker's KV reservation. The decode worker
/// issues it, the router passes it to the one prefill worker it picked, and the KV
/// handshake must present it; the engine's own request ids stay internal.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReservationToken(pub [u8; 16]);

impl ReservationToken {
    /// A fresh random token.
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// From its 16 wire bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// Lower-case hex, for logs and JSON.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for ReservationToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only a prefix: enough to match log lines, not enough to use.
        write!(f, "ReservationToken({}…)", &self.to_hex()[..8])
    }
}

impl fmt::Display for ReservationToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}…", &self.to_hex()[..8])
    }
}

impl serde::Serialize for ReservationToken {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for ReservationToken {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        hex::decode(s.as_ref())
            .ok()
            .and_then(|b| Self::from_slice(&b))
            .ok_or_else(|| serde::de::Error::custom("a reservation token is 32 hex digits"))
    }
}

/// An API key held as its SHA-256 digest, compared in constant time: the comparison takes
/// the same time whatever the presented key's length or content.
#[derive(Clone)]
pub struct ApiKeyDigest([u8; 32]);

impl fmt::Debug for ApiKeyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKeyDigest(<redacted>)")
    }
}

impl ApiKeyDigest {
    /// The digest of `key`.
    pub fn new(key: &str) -> Self {
        Self(Sha256::digest(key.as_bytes()).into())
    }

    /// Whether `presented` is the key.
    pub fn matches(&self, presented: &str) -> bool {
        let d: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        d.ct_eq(&self.0).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes(b"0123456789abcdef-cluster\n").expect("secret")
    }

    #[test]
    fn secrets_trim_the_trailing_newline_and_refuse_short_ones() {
        let a = ClusterSecret::from_bytes(b"0123456789abcdef\r\n").expect("16 bytes");
        let b = ClusterSecret::from_bytes(b"0123456789abcdef").expect("16 bytes");
        assert_eq!(a, b);
        assert_eq!(ClusterSecret::from_bytes(b"0123456789abcde\n"), Err(SecretError::TooShort { len: 15 }));
        assert_eq!(ClusterSecret::from_bytes(b"\n\n"), Err(SecretError::TooShort { len: 0 }));
        assert!(!format!("{a:?}").contains("0123"), "Debug must not show the secret");
    }

    #[test]
    fn tags_are_domain_separated_and_length_prefixed() {
        let s = secret();
        let t = s.tag(Purpose::GrpcCall, &[b"ab", b"c"]);
        assert!(s.verify(Purpose::GrpcCall, &[b"ab", b"c"], &t));
        assert!(!s.verify(Purpose::GrpcCall, &[b"a", b"bc"], &t), "part boundaries matter");
        assert!(!s.verify(Purpose::KvHandshake, &[b"ab", b"c"], &t), "purposes do not mix");
        assert!(!s.verify(Purpose::GrpcCall, &[b"ab", b"c"], &t[..31]), "truncated tags fail");
        let other = ClusterSecret::from_bytes(b"another secret of 32 bytes......").expect("secret");
        assert!(!other.verify(Purpose::GrpcCall, &[b"ab", b"c"], &t));
    }

    #[test]
    fn signed_calls_verify_once_for_their_method_within_the_window() {
        let s = secret();
        let v = CallVerifier::new(s.clone());
        let now = 1_700_000_000_000;
        let h = s.sign_call("/baton.worker.v1.Worker/Decode", "router", now);
        assert_eq!(v.verify(Some(&h), "/baton.worker.v1.Worker/Decode", now + 5).as_deref(), Ok("router"));
        assert_eq!(v.verify(Some(&h), "/baton.worker.v1.Worker/Decode", now + 6), Err(CallAuthError::Replayed));
        let h = s.sign_call("/baton.worker.v1.Worker/Decode", "router", now);
        assert_eq!(v.verify(Some(&h), "/baton.worker.v1.Worker/Prefill", now), Err(CallAuthError::BadTag));
        let h = s.sign_call("/m", "router", now - 31_000);
        assert!(matches!(v.verify(Some(&h), "/m", now), Err(CallAuthError::Stale { skew_ms: -31_000, .. })));
        let h = s.sign_call("/m", "router", now + 31_000);
        assert!(matches!(v.verify(Some(&h), "/m", now), Err(CallAuthError::Stale { .. })));
        assert_eq!(v.verify(None, "/m", now), Err(CallAuthError::Missing));
        for bad in ["", "v1:1:2:3", "v2:1:00:r:00", "v1:x:00000000000000000000000000000000:r:00", "v1:1:00:r:zz"] {
            assert_eq!(v.verify(Some(bad), "/m", now), Err(CallAuthError::Malformed), "{bad}");
        }
        // Another secret's header, and a tampered identity, do not verify.
        let other = ClusterSecret::from_bytes(b"another secret of 32 bytes......").expect("secret");
        assert_eq!(v.verify(Some(&other.sign_call("/m", "router", now)), "/m", now), Err(CallAuthError::BadTag));
        let h = s.sign_call("/m", "worker-a", now).replace("worker-a", "worker-b");
        assert_eq!(v.verify(Some(&h), "/m", now), Err(CallAuthError::BadTag));
    }

    #[test]
    fn the_replay_cache_forgets_only_after_the_window_and_refuses_when_full() {
        let s = secret();
        let v = CallVerifier::with_limits(s.clone(), Duration::from_secs(30), 2);
        let now = 1_000_000;
        let nonce = [7u8; 16];
        let h = s.sign_call_with_nonce("/m", "r", now, nonce);
        assert!(v.verify(Some(&h), "/m", now).is_ok());
        // Still refused at the last moment of the window; and afterwards stale, not replayable.
        assert_eq!(v.verify(Some(&h), "/m", now + 30_000), Err(CallAuthError::Replayed));
        assert!(matches!(v.verify(Some(&h), "/m", now + 30_001), Err(CallAuthError::Stale { .. })));
        assert!(v.verify(Some(&s.sign_call("/m", "r", now)), "/m", now).is_ok());
        assert_eq!(v.verify(Some(&s.sign_call("/m", "r", now)), "/m", now), Err(CallAuthError::CacheFull));
        // Once the first ones' window passed, room again.
        assert!(v.verify(Some(&s.sign_call("/m", "r", now + 30_001)), "/m", now + 30_001).is_ok());
        assert_eq!(v.cached_nonces(), 1);
    }

    #[test]
    fn kv_proofs_bind_the_challenge_and_the_handshake() {
        let s = secret();
        let c = KvChallenge::random();
        let p = s.kv_proof(&c, b"hello");
        assert!(s.verify_kv_proof(&c, b"hello", &p));
        assert!(!s.verify_kv_proof(&KvChallenge::random(), b"hello", &p), "a proof is for one connection");
        assert!(!s.verify_kv_proof(&c, b"hellO", &p), "a proof is for one handshake");
        assert!(!s.verify_kv_proof(&c, b"hello", &[0; TAG_LEN]));
    }

    #[test]
    fn reservation_tokens_round_trip_and_do_not_print_whole() {
        let t = ReservationToken::random();
        assert_ne!(t, ReservationToken::random());
        let hex = t.to_hex();
        assert_eq!(hex.len(), 32);
        assert_eq!(ReservationToken::from_slice(&hex::decode(&hex).expect("hex")), Some(t));
        assert!(!format!("{t:?} {t}").contains(&hex), "logs show a prefix only");
        assert_eq!(ReservationToken::from_slice(&[1, 2, 3]), None);
    }

    #[test]
    fn api_key_digests_match_only_the_key() {
        let k = ApiKeyDigest::new("sekret");
        assert!(k.matches("sekret"));
        for bad in ["", "sekre", "sekret2", "SEKRET"] {
            assert!(!k.matches(bad), "{bad}");
        }
        assert!(!format!("{k:?}").contains("sekret"));
    }

    #[test]
    fn identities_are_restricted_to_header_safe_names() {
        assert!(valid_identity("router") && valid_identity("0f3a-worker_1.x"));
        assert!(!valid_identity("") && !valid_identity("a:b") && !valid_identity(&"x".repeat(65)));
    }
}
