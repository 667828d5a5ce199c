//! Accepted connections with `TCP_NODELAY`, for every server this binary runs (HTTP and
//! gRPC, on `serve`, `router` and `worker`).
//!
//! Streamed tokens are small writes. With Nagle's algorithm on, the kernel holds each small
//! segment until the previous one is acknowledged, and the peer delays that acknowledgement
//! (up to 40 ms on Linux): tokens produced every few milliseconds then reach the client in
//! bursts. Neither `axum::serve` nor tonic's `serve_with_incoming` sets the option on
//! sockets they did not bind themselves, so every listener goes through here.
//!
//! gRPC servers also ping their clients (HTTP/2 keepalive, [`grpc_server`]) and their
//! sockets have TCP keepalive: a client that was stopped or partitioned away is noticed in
//! seconds and its streams are cancelled, which frees whatever they held (a worker's KV
//! reservation, a router's in-flight slot), instead of waiting for TCP to give up.

use axum::serve::ListenerExt;
use std::time::Duration;
use tokio::net::TcpListener;

/// HTTP/2 ping interval of the gRPC servers, and how long a ping may go unanswered.
pub const GRPC_KEEPALIVE: Duration = Duration::from_secs(10);
/// TCP keepalive idle time on accepted gRPC connections.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// A gRPC server builder with this binary's keepalive settings.
pub fn grpc_server() -> tonic::transport::Server {
    with_keepalive(tonic::transport::Server::builder())
}

/// `server` (e.g. a builder with TLS already configured) with this binary's keepalive
/// settings.
pub fn with_keepalive(server: tonic::transport::Server) -> tonic::transport::Server {
    server.http2_keepalive_interval(Some(GRPC_KEEPALIVE)).http2_keepalive_timeout(Some(GRPC_KEEPALIVE))
}

/// An HTTP listener whose accepted connections have `TCP_NODELAY` set.
pub fn http(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    listener.tap_io(|stream| {
        if let Err(e) = stream.set_nodelay(true) {
            // A latency defect, not a reason to refuse the peer.
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on an HTTP connection");
        }
    })
}

/// A gRPC incoming stream whose accepted connections have `TCP_NODELAY` and TCP keepalive.
pub fn grpc(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)).with_keepalive(Some(TCP_KEEPALIVE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tokio_stream::StreamExt;

    async fn bound() -> (TcpListener, std::net::SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let a = l.local_addr().expect("addr");
        (l, a)
    }

    #[tokio::test]
    async fn http_connections_have_nodelay() {
        let (l, addr) = bound().await;
        let mut l = http(l);
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (stream, _) = l.accept().await;
        assert!(stream.nodelay().expect("nodelay"));
    }

    #[tokio::test]
    async fn grpc_connections_have_nodelay() {
        let (l, addr) = bound().await;
        let mut incoming = grpc(l);
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let stream = incoming.next().await.expect("a connection").expect("accepted");
        assert!(stream.nodelay().expect("nodelay"));
    }

    #[tokio::test]
    async fn grpc_connections_have_tcp_keepalive() {
        let (l, addr) = bound().await;
        let mut incoming = grpc(l);
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let stream = incoming.next().await.expect("a connection").expect("accepted");
        let sock = socket2::SockRef::from(&stream);
        assert!(sock.keepalive().expect("keepalive"), "SO_KEEPALIVE is off");
    }
}
