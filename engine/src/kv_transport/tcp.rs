//! The TCP KV transport: host-staged layer frames over one connection per hand-off.
//!
//! Wire format: as soon as it accepts, the receiver sends the 4-byte magic `BKV5` and a
//! 32-byte random challenge; the sender checks the magic, answers with the magic, then
//! frames of `kind: u8, len: u64 LE, payload`. Sender → receiver: `HELLO` (a 32-byte proof,
//! then the JSON [`Handshake`]), one `LAYER` per layer in order (`layer: u32, k_len: u64, seq: u64,
//! k_scale: f32, v_scale: f32`, for an FP8 cache `n_kv_heads × head_dim` f32 of key shift, then
//! K and V bytes; `seq` orders NCCL receives, see `nccl`; the scales are the FP8 scales the
//! codes were written with, both 0 for a cache that is not FP8, anything else not finite and
//! positive refused; the key shift is the one the keys were stored less, all zero for none, a
//! value that is not finite refused; see `crate::kv_k_smoothing`), `DONE` (JSON
//! [`TransferTrailer`]: the first token).
//! Receiver → sender: `ACCEPT` or `REFUSE` (reason text) after `HELLO`, and
//! `ACCEPT` after `DONE` once every layer is stored (or `REFUSE` when the trailer is bad).
//!
//! Authentication: the proof is `HMAC(cluster secret, challenge ‖ handshake JSON)`
//! (`baton_core::cluster_auth`; zeros from a sender without a secret). A listener with a
//! secret checks it before it parses anything else and answers a wrong one with `REFUSE`
//! and a closed connection ([`TransportError::Unauthenticated`]): nothing reaches the
//! engine. The challenge is fresh per connection, so a recorded handshake replayed on a new
//! connection fails. The stream is not encrypted (no TLS on this channel): the proof
//! authenticates the peer that opened the connection, and the layer frames that follow
//! travel in clear over that TCP connection; run the KV network where on-path attackers
//! cannot reach it (as NCCL's own traffic requires too).
//!
//! Nothing the peer declares is trusted: a frame's declared length is checked before its
//! body is read (a `LAYER` frame must be exactly what the accepted handshake implies, a
//! control frame at most a few KiB, the `HELLO` at most [`MAX_HELLO`]); control frames are
//! read as their bytes arrive, so a declared length costs nothing until it is sent; a layer
//! past the layout's last is refused; sizes are computed with checked arithmetic. The
//! handshake is read within the hello deadline, every later read within the hand-off's.
//! The order on the receiver is: proof (before the handshake is even parsed), layout, the
//! sizes the handshake declares, then the caller's admission (the reservation's own checks).

use super::{Handshake, LayerFrame, TransportError};
use crate::kv_cache_dtype::{KvCoding, KvScale};
use crate::relay::TransferTrailer;
use baton_core::cluster_auth::{ClusterSecret, KV_NONCE_LEN, KvChallenge, TAG_LEN};
use baton_core::kv_transfer::KvLayout;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bumped with every wire change, so mismatched builds refuse each other at once.
const MAGIC: &[u8; 4] = b"BKV5";
const HELLO: u8 = 1;
const ACCEPT: u8 = 2;
const REFUSE: u8 = 3;
const LAYER: u8 = 4;
const DONE: u8 = 5;
/// Largest `HELLO`: room for tens of thousands of block runs (a long prompt in a fragmented
/// pool), far below what a hostile peer could make us hold per connection otherwise.
pub const MAX_HELLO: u64 = 2 << 20;
/// Largest `ACCEPT`/`REFUSE` (a reason text) and `DONE` (the trailer: a token and at most
/// 20 logprobs, as JSON).
const MAX_CONTROL_FRAME: u64 = 64 << 10;
/// Control frames are read in pieces of at most this much, as their bytes arrive.
const READ_CHUNK: usize = 64 << 10;
/// Bytes before K and V in a `LAYER` frame.
const LAYER_HEAD: usize = 28;

async fn with_deadline<T>(
    d: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    tokio::time::timeout(d, f).await.map_err(|_| TransportError::Timeout(d, what))?
}

async fn write_frame(s: &mut TcpStream, kind: u8, parts: &[&[u8]]) -> Result<(), TransportError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut head = [0u8; 9];
    head[0] = kind;
    head[1..].copy_from_slice(&(len as u64).to_le_bytes());
    s.write_all(&head).await?;
    for p in parts {
        s.write_all(p).await?;
    }
    s.flush().await?;
    Ok(())
}

/// A frame's kind and declared length.
async fn read_head(s: &mut TcpStream) -> Result<(u8, u64), TransportError> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head).await?;
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&head[1..]);
    Ok((head[0], u64::from_le_bytes(len_bytes)))
}

/// Reads a body of `len` declared bytes, refused above `max_len` before anything is read;
/// the buffer grows as the bytes arrive.
async fn read_body(s: &mut TcpStream, len: u64, max_len: u64) -> Result<Vec<u8>, TransportError> {
    if len > max_len {
        return Err(TransportError::Protocol(format!("frame of {len} bytes exceeds the limit of {max_len}")));
    }
    let want = usize::try_from(len).map_err(|_| TransportError::Protocol(format!("frame of {len} bytes")))?;
    let mut buf = Vec::with_capacity(want.min(READ_CHUNK));
    let got = (&mut *s).take(len).read_to_end(&mut buf).await?;
    if got != want {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok(buf)
}

async fn read_frame(s: &mut TcpStream, max_len: u64) -> Result<(u8, Vec<u8>), TransportError> {
    let (kind, len) = read_head(s).await?;
    Ok((kind, read_body(s, len, max_len).await?))
}

/// The sending side of one hand-off.
pub struct TcpKvSender {
    stream: TcpStream,
    hs: Handshake,
    deadline: Duration,
    next_layer: usize,
}

/// Reads the receiver's magic and challenge.
async fn read_challenge(stream: &mut TcpStream) -> Result<KvChallenge, TransportError> {
    let mut buf = [0u8; 4 + KV_NONCE_LEN];
    stream.read_exact(&mut buf).await?;
    if &buf[..4] != MAGIC {
        return Err(TransportError::Protocol(
            "bad magic from the receiver: not a Baton KV listener of this version".into(),
        ));
    }
    let mut nonce = [0u8; KV_NONCE_LEN];
    nonce.copy_from_slice(&buf[4..]);
    Ok(KvChallenge(nonce))
}

impl TcpKvSender {
    /// Connects, answers the receiver's challenge with the handshake and its proof (made
    /// with `secret`, when given), and waits for the receiver to accept it.
    pub async fn connect(
        addr: SocketAddr,
        hs: Handshake,
        deadline: Duration,
        secret: Option<&ClusterSecret>,
    ) -> Result<Self, TransportError> {
        let mut stream = with_deadline(deadline, "connect", async { Ok(TcpStream::connect(addr).await?) }).await?;
        stream.set_nodelay(true)?;
        let challenge = with_deadline(deadline, "the receiver's challenge", read_challenge(&mut stream)).await?;
        let hello = serde_json::to_vec(&hs).map_err(|e| TransportError::Protocol(e.to_string()))?;
        let proof = secret.map_or([0; TAG_LEN], |s| s.kv_proof(&challenge, &hello));
        stream.write_all(MAGIC).await?;
        write_frame(&mut stream, HELLO, &[&proof, &hello]).await?;
        let (kind, body) =
            with_deadline(deadline, "the handshake answer", read_frame(&mut stream, MAX_CONTROL_FRAME)).await?;
        match kind {
            ACCEPT => Ok(Self { stream, hs, deadline, next_layer: 0 }),
            REFUSE => Err(TransportError::Refused(String::from_utf8_lossy(&body).into_owned())),
            k => Err(TransportError::Protocol(format!("unexpected frame kind {k} after HELLO"))),
        }
    }

    /// Sends the next layer; layers must go in order and match the handshake's sizes.
    pub async fn send_layer(&mut self, frame: &LayerFrame) -> Result<(), TransportError> {
        if frame.layer != self.next_layer || frame.layer >= self.hs.layout.num_layers {
            return Err(TransportError::Protocol(format!(
                "layer {} sent out of order (expected {})",
                frame.layer, self.next_layer
            )));
        }
        let want = self.hs.frame_half();
        if frame.k.len() != want || frame.v.len() != want {
            return Err(TransportError::Protocol(format!(
                "layer {} has {}+{} bytes, the handshake promised {want}+{want}",
                frame.layer,
                frame.k.len(),
                frame.v.len()
            )));
        }
        let shift = frame.coding.as_ref().map_or(&[][..], |c| &c.k_shift[..]);
        let values = self.hs.frame_shift_values();
        if !shift.is_empty() && shift.len() != values {
            return Err(TransportError::Protocol(format!(
                "layer {} has a key shift of {} values; this layout's frames carry {values}",
                frame.layer,
                shift.len()
            )));
        }
        let mut head = vec![0u8; LAYER_HEAD + 4 * values];
        head[..4].copy_from_slice(&(frame.layer as u32).to_le_bytes());
        head[4..12].copy_from_slice(&(frame.k.len() as u64).to_le_bytes());
        head[12..20].copy_from_slice(&frame.seq.to_le_bytes());
        let (ks, vs) = frame.coding.as_ref().map_or((0.0f32, 0.0f32), |c| (c.scale.k, c.scale.v));
        head[20..24].copy_from_slice(&ks.to_le_bytes());
        head[24..28].copy_from_slice(&vs.to_le_bytes());
        for (dst, x) in head[LAYER_HEAD..].chunks_exact_mut(4).zip(shift) {
            dst.copy_from_slice(&x.to_le_bytes());
        }
        let d = self.deadline;
        with_deadline(d, "sending a layer", write_frame(&mut self.stream, LAYER, &[&head, &frame.k, &frame.v])).await?;
        self.next_layer += 1;
        Ok(())
    }

    /// Ends the hand-off with the first token; returns once the receiver confirmed every
    /// layer is stored.
    pub async fn finish(mut self, trailer: &TransferTrailer) -> Result<(), TransportError> {
        if self.next_layer != self.hs.layout.num_layers {
            return Err(TransportError::Protocol(format!(
                "finish after {} of {} layers",
                self.next_layer, self.hs.layout.num_layers
            )));
        }
        let body = serde_json::to_vec(trailer).map_err(|e| TransportError::Protocol(e.to_string()))?;
        with_deadline(self.deadline, "sending the trailer", write_frame(&mut self.stream, DONE, &[&body])).await?;
        let (kind, body) =
            with_deadline(self.deadline, "the final acknowledgement", read_frame(&mut self.stream, MAX_CONTROL_FRAME))
                .await?;
        match kind {
            ACCEPT => Ok(()),
            REFUSE => Err(TransportError::Refused(String::from_utf8_lossy(&body).into_owned())),
            k => Err(TransportError::Protocol(format!("unexpected frame kind {k} after DONE"))),
        }
    }
}

/// Listens for incoming hand-offs.
pub struct TcpKvListener {
    listener: TcpListener,
    secret: Option<ClusterSecret>,
}

impl TcpKvListener {
    /// Binds to `addr` (port 0 picks a free port). Without [`TcpKvListener::with_secret`]
    /// any sender is admitted.
    pub async fn bind(addr: SocketAddr) -> Result<Self, TransportError> {
        Ok(Self { listener: TcpListener::bind(addr).await?, secret: None })
    }

    /// Admits only senders that prove `secret` (none: any sender).
    pub fn with_secret(self, secret: Option<ClusterSecret>) -> Self {
        Self { secret, ..self }
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        Ok(self.listener.local_addr()?)
    }

    /// Accepts one connection. Read its handshake with [`PendingHandoff::handshake`],
    /// preferably on its own task so a slow peer cannot hold up the next one.
    pub async fn accept(&self) -> Result<PendingHandoff, TransportError> {
        let (stream, _) = self.listener.accept().await?;
        stream.set_nodelay(true)?;
        Ok(PendingHandoff { stream, secret: self.secret.clone(), hello_deadline: None })
    }
}

/// A connection whose handshake has not been read yet.
pub struct PendingHandoff {
    stream: TcpStream,
    secret: Option<ClusterSecret>,
    hello_deadline: Option<Duration>,
}

impl PendingHandoff {
    /// Reads the handshake within `d` (instead of the hand-off's deadline): an honest sender
    /// answers the challenge as soon as it connects, so a connection that stays silent is
    /// dropped early.
    pub fn with_hello_deadline(mut self, d: Duration) -> Self {
        self.hello_deadline = Some(d);
        self
    }

    /// Challenges the sender, reads the handshake and checks its proof (with a secret) and
    /// then `layout`, then asks `admit` (e.g. "is this reservation still waiting for its KV
    /// here, from this sender?"). A wrong proof is refused as
    /// [`TransportError::Unauthenticated`] before the handshake is parsed; a mismatch is
    /// refused (the sender gets the reason) and returned as [`TransportError::Incompatible`];
    /// a refusal by `admit` as [`TransportError::Refused`]. Sizes the handshake declares
    /// are checked (with checked arithmetic) before `admit` runs.
    pub async fn handshake(
        self,
        layout: &KvLayout,
        deadline: Duration,
        admit: impl AsyncFnOnce(&Handshake) -> Result<(), String>,
    ) -> Result<IncomingTransfer, TransportError> {
        let mut stream = self.stream;
        let challenge = KvChallenge::random();
        let hello_deadline = self.hello_deadline.map_or(deadline, |d| d.min(deadline));
        let body = with_deadline(hello_deadline, "the handshake", async {
            stream.write_all(MAGIC).await?;
            stream.write_all(&challenge.0).await?;
            stream.flush().await?;
            let mut magic = [0u8; 4];
            stream.read_exact(&mut magic).await?;
            if &magic != MAGIC {
                return Err(TransportError::Protocol("bad magic: not a Baton KV stream".into()));
            }
            let (kind, body) = read_frame(&mut stream, MAX_HELLO).await?;
            if kind != HELLO || body.len() < TAG_LEN {
                return Err(TransportError::Protocol(format!("expected HELLO, got frame kind {kind}")));
            }
            Ok(body)
        })
        .await?;
        let (proof, hello) = body.split_at(TAG_LEN);
        if let Some(secret) = &self.secret
            && !secret.verify_kv_proof(&challenge, hello, proof)
        {
            // Best effort: the sender learns why; the connection closes either way.
            let _ = with_deadline(
                deadline,
                "the refusal",
                write_frame(&mut stream, REFUSE, &[b"cluster authentication failed"]),
            )
            .await;
            return Err(TransportError::Unauthenticated);
        }
        let hs: Handshake =
            serde_json::from_slice(hello).map_err(|e| TransportError::Protocol(format!("bad handshake: {e}")))?;
        if let Err(m) = layout.check_compatible(&hs.layout) {
            write_frame(&mut stream, REFUSE, &[m.to_string().as_bytes()]).await?;
            return Err(m.into());
        }
        // K bytes per layer of the runs, and the layer frame that carries K and V: checked
        // arithmetic, the peer picks these numbers.
        let need = hs
            .runs
            .iter()
            .try_fold(0usize, |n, r| n.checked_add(r.len))
            .and_then(|b| b.checked_mul(layout.bytes_per_block()));
        let frame_len = hs
            .frame_half()
            .checked_mul(2)
            .and_then(|kv| kv.checked_add(LAYER_HEAD))
            .and_then(|n| n.checked_add(hs.frame_shift_values().checked_mul(4)?));
        let (Some(frame_len), true) = (frame_len, need == Some(hs.bytes_per_layer_half)) else {
            let need = need.map_or_else(|| "more than can be counted".to_owned(), |n| n.to_string());
            let msg =
                format!("handshake promises {} bytes of K per layer, its runs need {need}", hs.bytes_per_layer_half);
            write_frame(&mut stream, REFUSE, &[msg.as_bytes()]).await?;
            return Err(TransportError::Protocol(msg));
        };
        if let Err(reason) = admit(&hs).await {
            write_frame(&mut stream, REFUSE, &[reason.as_bytes()]).await?;
            return Err(TransportError::Refused(reason));
        }
        write_frame(&mut stream, ACCEPT, &[]).await?;
        Ok(IncomingTransfer { stream, hs, deadline, next_layer: 0, frame_len: frame_len as u64 })
    }
}

/// What [`IncomingTransfer::next`] read.
#[derive(Debug, Clone, PartialEq)]
pub enum Incoming {
    /// The next layer, in order.
    Layer(LayerFrame),
    /// Every layer arrived; this is the first token. Acknowledge with
    /// [`IncomingTransfer::acknowledge`] once the layers are stored.
    Done(TransferTrailer),
}

/// The receiving side of one accepted hand-off.
pub struct IncomingTransfer {
    stream: TcpStream,
    hs: Handshake,
    deadline: Duration,
    next_layer: usize,
    /// Exact length of every `LAYER` frame (checked when the handshake was accepted).
    frame_len: u64,
}

impl IncomingTransfer {
    /// What is being received.
    pub fn handshake(&self) -> &Handshake {
        &self.hs
    }

    /// The next layer, or the trailer once the sender said DONE after the last layer (the
    /// sender is then told every layer is stored).
    pub async fn next(&mut self) -> Result<Incoming, TransportError> {
        let half = self.hs.frame_half();
        let shift_values = self.hs.frame_shift_values();
        let (num_layers, frame_len) = (self.hs.layout.num_layers, self.frame_len);
        let next_layer = self.next_layer;
        let stream = &mut self.stream;
        // Layer frames are exactly `frame_len` long and only `num_layers` of them come; the
        // trailer is small JSON. Both are known before the body is read.
        let (kind, body) = with_deadline(self.deadline, "the next layer", async move {
            let (kind, len) = read_head(stream).await?;
            let max = match kind {
                LAYER if next_layer >= num_layers => {
                    return Err(TransportError::Protocol(format!(
                        "a layer frame after the last of {num_layers} layers"
                    )));
                }
                LAYER if len != frame_len => {
                    return Err(TransportError::Protocol(format!("layer frame of {len} bytes, expected {frame_len}")));
                }
                LAYER => frame_len,
                _ => MAX_CONTROL_FRAME,
            };
            Ok((kind, read_body(stream, len, max).await?))
        })
        .await?;
        match kind {
            LAYER => {
                let mut lb = [0u8; 4];
                lb.copy_from_slice(&body[..4]);
                let layer = u32::from_le_bytes(lb) as usize;
                if layer != self.next_layer {
                    return Err(TransportError::Protocol(format!("got layer {layer}, expected {}", self.next_layer)));
                }
                self.next_layer += 1;
                let mut sb = [0u8; 8];
                sb.copy_from_slice(&body[12..20]);
                let f32_at = |at: usize| f32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]);
                let scale = frame_scale(f32_at(20), f32_at(24))
                    .map_err(|e| TransportError::Protocol(format!("layer {layer}: {e}")))?;
                let shift: Vec<f32> = (0..shift_values).map(|i| f32_at(LAYER_HEAD + 4 * i)).collect();
                let coding =
                    frame_coding(scale, shift).map_err(|e| TransportError::Protocol(format!("layer {layer}: {e}")))?;
                let data = LAYER_HEAD + 4 * shift_values;
                Ok(Incoming::Layer(LayerFrame {
                    layer,
                    k: body[data..data + half].to_vec(),
                    v: body[data + half..].to_vec(),
                    seq: u64::from_le_bytes(sb),
                    coding,
                }))
            }
            DONE => {
                if self.next_layer != self.hs.layout.num_layers {
                    let msg = format!("DONE after {} of {} layers", self.next_layer, self.hs.layout.num_layers);
                    write_frame(&mut self.stream, REFUSE, &[msg.as_bytes()]).await?;
                    return Err(TransportError::Protocol(msg));
                }
                let trailer: TransferTrailer =
                    serde_json::from_slice(&body).map_err(|e| TransportError::Protocol(format!("bad trailer: {e}")))?;
                Ok(Incoming::Done(trailer))
            }
            k => Err(TransportError::Protocol(format!("unexpected frame kind {k} during the transfer"))),
        }
    }
}

impl IncomingTransfer {
    /// Tells the sender every layer is stored (after [`Incoming::Done`]).
    pub async fn acknowledge(mut self) -> Result<(), TransportError> {
        write_frame(&mut self.stream, ACCEPT, &[]).await
    }

    /// Tells the sender the hand-off is refused, with `reason` (e.g. a bad trailer).
    pub async fn refuse(mut self, reason: &str) -> Result<(), TransportError> {
        write_frame(&mut self.stream, REFUSE, &[reason.as_bytes()]).await
    }
}

/// A layer frame's scales as sent: both 0 for none (a cache that is not FP8), else both
/// finite and positive (an FP8 cache's; see `crate::kv_cache_dtype`).
fn frame_scale(k: f32, v: f32) -> Result<Option<KvScale>, String> {
    let ok = |x: f32| x.is_finite() && x > 0.0;
    match (k, v) {
        (0.0, 0.0) => Ok(None),
        (k, v) if ok(k) && ok(v) => Ok(Some(KvScale { k, v })),
        (k, v) => Err(format!("FP8 scales k {k}, v {v}: each must be finite and positive (or both 0: none)")),
    }
}

/// A layer frame's coding from its scales and key-shift values: none without scales (a
/// shift is then refused unless all zero), an empty shift for all zeros, a value that is not
/// finite refused.
fn frame_coding(scale: Option<KvScale>, shift: Vec<f32>) -> Result<Option<KvCoding>, String> {
    if let Some((i, x)) = shift.iter().enumerate().find(|(_, x)| !x.is_finite()) {
        return Err(format!("key shift value {i} is {x}"));
    }
    let none = shift.iter().all(|&x| x == 0.0);
    match scale {
        Some(scale) => Ok(Some(KvCoding { scale, k_shift: if none { Vec::new() } else { shift } })),
        None if none => Ok(None),
        None => Err("a key shift without FP8 scales".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_core::cluster_auth::ReservationToken;
    use baton_core::kv_transfer::{KvDtype, plan_transfer};

    fn layout() -> KvLayout {
        KvLayout { num_layers: 3, block_size: 4, num_kv_heads: 2, head_dim: 8, dtype: KvDtype::F32 }
    }

    fn token() -> ReservationToken {
        ReservationToken([42; 16])
    }

    fn handshake(l: KvLayout) -> Handshake {
        let plan = plan_transfer(&l, &[4, 5, 9], &[0, 1, 2], 10, 0).expect("plan");
        Handshake {
            layout: l,
            sender: "prefill-a".into(),
            reservation: Some(token()),
            num_tokens: 10,
            runs: plan.runs,
            bytes_per_layer_half: plan.bytes_per_layer / 2,
            nccl: None,
        }
    }

    fn frame(layer: usize, half: usize, seed: u8) -> LayerFrame {
        let k = (0..half).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add(layer as u8)).collect();
        let v = (0..half).map(|i| (i as u8).wrapping_mul(17).wrapping_add(seed ^ 0x5a)).collect();
        LayerFrame {
            layer,
            k,
            v,
            seq: layer as u64 + 100,
            coding: (layer % 2 == 1).then(|| KvCoding { scale: KvScale { k: 0.25, v: 3.5 }, k_shift: Vec::new() }),
        }
    }

    fn trailer() -> TransferTrailer {
        TransferTrailer {
            first_token: 1234,
            logprobs: Some(baton_core::api::TokenLogprob { token_id: 1234, logprob: -0.5, top: vec![(1234, -0.5)] }),
        }
    }

    async fn handshake_of(
        listener: &TcpKvListener,
        l: &KvLayout,
        deadline: Duration,
    ) -> Result<IncomingTransfer, TransportError> {
        listener.accept().await?.handshake(l, deadline, async |_| Ok(())).await
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    #[test]
    fn layers_arrive_intact_and_in_order() {
        rt().block_on(async {
            let l = layout();
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let hs = handshake(l);
            let half = hs.bytes_per_layer_half;
            let sent: Vec<LayerFrame> = (0..3).map(|i| frame(i, half, 7)).collect();
            let to_send = sent.clone();
            let sender = tokio::spawn(async move {
                let mut s = TcpKvSender::connect(addr, hs, Duration::from_secs(5), None).await?;
                for f in &to_send {
                    s.send_layer(f).await?;
                }
                s.finish(&trailer()).await
            });
            let pending = listener.accept().await.expect("accept");
            let mut incoming =
                pending.handshake(&l, Duration::from_secs(5), async |_| Ok(())).await.expect("handshake");
            assert_eq!(incoming.handshake().reservation, Some(token()));
            assert_eq!(incoming.handshake().sender, "prefill-a");
            let mut got = Vec::new();
            let done = loop {
                match incoming.next().await.expect("frame") {
                    Incoming::Layer(f) => got.push(f),
                    Incoming::Done(t) => break t,
                }
            };
            assert_eq!(got, sent);
            assert_eq!(done, trailer());
            incoming.acknowledge().await.expect("ack");
            sender.await.expect("join").expect("sender finished");
        });
    }

    #[test]
    fn mismatched_layout_is_refused_on_both_sides() {
        rt().block_on(async {
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let theirs = KvLayout { block_size: 8, ..layout() };
            let hs = Handshake { layout: theirs, ..handshake(layout()) };
            let sender =
                tokio::spawn(
                    async move { TcpKvSender::connect(addr, hs, Duration::from_secs(5), None).await.map(|_| ()) },
                );
            let err = handshake_of(&listener, &layout(), Duration::from_secs(5)).await.err().expect("refused");
            assert!(matches!(err, TransportError::Incompatible(_)), "{err}");
            match sender.await.expect("join") {
                Err(TransportError::Refused(msg)) => assert!(msg.contains("block_size 4 vs 8"), "{msg}"),
                other => panic!("sender should be refused, got {:?}", other.map(|_| "ok")),
            }
        });
    }

    #[test]
    fn a_stalled_sender_times_out_instead_of_hanging() {
        rt().block_on(async {
            let l = layout();
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let hs = handshake(l);
            let half = hs.bytes_per_layer_half;
            let sender = tokio::spawn(async move {
                let mut s = TcpKvSender::connect(addr, hs, Duration::from_secs(5), None).await.expect("connect");
                s.send_layer(&frame(0, half, 1)).await.expect("layer 0");
                // Then stall, holding the connection open until the test aborts this task.
                std::future::pending::<()>().await;
                drop(s);
            });
            let mut incoming = handshake_of(&listener, &l, Duration::from_millis(300)).await.expect("accept");
            assert!(matches!(incoming.next().await.expect("layer 0"), Incoming::Layer(_)));
            let t = std::time::Instant::now();
            let err = incoming.next().await.expect_err("must time out");
            assert!(matches!(err, TransportError::Timeout(_, _)), "{err}");
            assert!(t.elapsed() < Duration::from_secs(2));
            sender.abort();
        });
    }

    #[test]
    fn a_dead_sender_is_an_error_not_a_hang() {
        rt().block_on(async {
            let l = layout();
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let hs = handshake(l);
            let half = hs.bytes_per_layer_half;
            let sender = tokio::spawn(async move {
                let mut s = TcpKvSender::connect(addr, hs, Duration::from_secs(5), None).await.expect("connect");
                s.send_layer(&frame(0, half, 1)).await.expect("layer 0");
                drop(s); // the prefill worker dies mid-transfer
            });
            let mut incoming = handshake_of(&listener, &l, Duration::from_secs(5)).await.expect("accept");
            sender.await.expect("join");
            assert!(matches!(incoming.next().await.expect("layer 0"), Incoming::Layer(_)));
            let err = incoming.next().await.expect_err("must fail");
            assert!(matches!(err, TransportError::Io(_)), "{err}");
        });
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        rt().block_on(async {
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let client = tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.expect("write");
                s
            });
            let err = handshake_of(&listener, &layout(), Duration::from_secs(5)).await.err().expect("refused");
            assert!(matches!(err, TransportError::Protocol(_)), "{err}");
            drop(client.await);
        });
    }

    #[test]
    fn a_hand_off_the_receiver_does_not_expect_is_refused_with_its_reason() {
        rt().block_on(async {
            let l = layout();
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let hs = handshake(l);
            let sender =
                tokio::spawn(
                    async move { TcpKvSender::connect(addr, hs, Duration::from_secs(5), None).await.map(|_| ()) },
                );
            let pending = listener.accept().await.expect("accept");
            let err = pending
                .handshake(&l, Duration::from_secs(5), async |hs: &Handshake| {
                    Err(format!("reservation {:?} of {} is not waiting here", hs.reservation, hs.sender))
                })
                .await
                .err()
                .expect("refused");
            assert!(matches!(err, TransportError::Refused(_)), "{err}");
            match sender.await.expect("join") {
                Err(TransportError::Refused(msg)) => assert!(msg.contains("of prefill-a is not waiting"), "{msg}"),
                other => panic!("sender should be refused, got {:?}", other.map(|_| "ok")),
            }
        });
    }

    fn secret(text: &[u8]) -> ClusterSecret {
        ClusterSecret::from_bytes(text).expect("secret")
    }

    /// Connects to a listener with a secret: the sender's secret decides.
    async fn offer(sender_secret: Option<ClusterSecret>) -> (Result<(), TransportError>, TransportError) {
        let l = layout();
        let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind")
            .with_secret(Some(secret(b"the cluster secret, 32 bytes...")));
        let addr = listener.local_addr().expect("addr");
        let hs = handshake(l);
        let sender = tokio::spawn(async move {
            TcpKvSender::connect(addr, hs, Duration::from_secs(5), sender_secret.as_ref()).await.map(|_| ())
        });
        let admitted = std::sync::atomic::AtomicBool::new(false);
        let err = listener
            .accept()
            .await
            .expect("accept")
            .handshake(&l, Duration::from_secs(5), async |_| {
                admitted.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok(())
            })
            .await
            .err()
            .unwrap_or(TransportError::Protocol("accepted".into()));
        assert!(
            !admitted.load(std::sync::atomic::Ordering::SeqCst) || !matches!(err, TransportError::Unauthenticated),
            "an unauthenticated sender must never reach admission"
        );
        (sender.await.expect("join"), err)
    }

    #[test]
    fn a_listener_with_a_secret_admits_only_senders_that_prove_it() {
        rt().block_on(async {
            let (sent, got) = offer(Some(secret(b"the cluster secret, 32 bytes..."))).await;
            assert!(sent.is_ok() && matches!(got, TransportError::Protocol(ref m) if m == "accepted"), "{got}");
            for wrong in [None, Some(secret(b"another secret of the same size"))] {
                let (sent, got) = offer(wrong).await;
                assert!(matches!(got, TransportError::Unauthenticated), "{got}");
                match sent {
                    Err(TransportError::Refused(m)) => assert!(m.contains("authentication"), "{m}"),
                    other => panic!("the sender must be refused, got {:?}", other.map(|_| "ok")),
                }
            }
        });
    }

    #[test]
    fn a_replayed_handshake_is_refused_on_a_new_connection() {
        rt().block_on(async {
            let s = secret(b"the cluster secret, 32 bytes...");
            let l = layout();
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr"))
                .await
                .expect("bind")
                .with_secret(Some(s.clone()));
            let addr = listener.local_addr().expect("addr");
            let hello = serde_json::to_vec(&handshake(l)).expect("json");
            // A legitimate sender's bytes on its connection, recorded...
            let recorded = {
                let mut c = TcpStream::connect(addr).await.expect("connect");
                let pending = listener.accept().await.expect("accept");
                let accept = tokio::spawn(async move {
                    pending.handshake(&l, Duration::from_secs(5), async |_| Ok(())).await.map(|_| ())
                });
                let challenge = read_challenge(&mut c).await.expect("challenge");
                let proof = s.kv_proof(&challenge, &hello);
                c.write_all(MAGIC).await.expect("magic");
                write_frame(&mut c, HELLO, &[&proof, &hello]).await.expect("hello");
                accept.await.expect("join").expect("the original is accepted");
                proof
            };
            // ...and replayed on a new connection, which has a fresh challenge.
            let mut c = TcpStream::connect(addr).await.expect("connect");
            let pending = listener.accept().await.expect("accept");
            let accept = tokio::spawn(async move {
                pending.handshake(&l, Duration::from_secs(5), async |_| Ok(())).await.map(|_| ())
            });
            let _fresh = read_challenge(&mut c).await.expect("challenge");
            c.write_all(MAGIC).await.expect("magic");
            write_frame(&mut c, HELLO, &[&recorded, &hello]).await.expect("hello");
            let err = accept.await.expect("join").expect_err("a replay is refused");
            assert!(matches!(err, TransportError::Unauthenticated), "{err}");
            // The connection is closed after the refusal.
            let (kind, _) = read_frame(&mut c, MAX_CONTROL_FRAME).await.expect("refusal");
            assert_eq!(kind, REFUSE);
            let mut rest = Vec::new();
            assert_eq!(c.read_to_end(&mut rest).await.expect("eof"), 0, "closed");
        });
    }

    #[test]
    fn declared_lengths_over_the_limits_are_refused_before_reading() {
        rt().block_on(async {
            let listener = TcpKvListener::bind("127.0.0.1:0".parse().expect("addr")).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            // A HELLO declaring a terabyte, and nothing after it: refused at once, not timed out.
            let client = tokio::spawn(async move {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                s.write_all(MAGIC).await.expect("magic");
                let mut head = vec![HELLO];
                head.extend_from_slice(&(1u64 << 40).to_le_bytes());
                s.write_all(&head).await.expect("head");
                s
            });
            let t = std::time::Instant::now();
            let err = handshake_of(&listener, &layout(), Duration::from_secs(5)).await.err().expect("refused");
            assert!(matches!(&err, TransportError::Protocol(m) if m.contains("exceeds")), "{err}");
            assert!(t.elapsed() < Duration::from_secs(2));
            drop(client.await);
        });
    }

    #[test]
    fn layer_frame_scales_are_none_or_finite_and_positive() {
        assert_eq!(frame_scale(0.0, 0.0), Ok(None));
        assert_eq!(frame_scale(0.5, 3.0), Ok(Some(KvScale { k: 0.5, v: 3.0 })));
        for (k, v) in [(0.0, 1.0), (1.0, 0.0), (f32::NAN, 1.0), (1.0, f32::INFINITY), (-1.0, 1.0), (1.0, -0.0)] {
            assert!(frame_scale(k, v).is_err(), "{k} {v}");
        }
    }
}
