//! The accept loop: hyper HTTP/1.1 connections with a cap on open connections (in all and per
//! client address), a header deadline that is also the keep-alive idle limit, a stalled-write
//! limit, and a shutdown that waits for running responses no longer than the grace period.
//!
//! axum's own `serve` has none of these: there one connection that never finished its headers
//! kept the process alive after SIGTERM, and ~20,000 half-open connections starved real clients.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

use super::config::HttpSection;

/// Open connections, in all and per client address.
#[derive(Default)]
struct Counts {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// A connection counted in `Counts` until dropped.
struct Slot {
    counts: Arc<Mutex<Counts>>,
    ip: IpAddr,
}

impl Slot {
    fn take(counts: &Arc<Mutex<Counts>>, ip: IpAddr, limits: &HttpSection) -> Result<Slot, &'static str> {
        let mut c = counts.lock();
        if c.total >= limits.max_connections {
            return Err("the server has too many open connections");
        }
        let mine = c.per_ip.entry(ip).or_insert(0);
        if *mine >= limits.max_connections_per_ip {
            return Err("too many open connections from this address");
        }
        *mine += 1;
        c.total += 1;
        Ok(Slot { counts: counts.clone(), ip })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.counts.lock();
        c.total -= 1;
        if let Some(n) = c.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_ip.remove(&self.ip);
            }
        }
    }
}

/// A refusal written without waiting (the socket's send buffer takes it), then the close.
fn refuse(stream: TcpStream, why: &str) {
    let body = serde_json::json!({"error": {"message": why, "type": "server_error", "param": null,
        "code": "too_many_connections"}})
    .to_string();
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(msg.as_bytes());
}

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets open
/// responses finish for up to `grace`, and drops whatever is still open.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpSection,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let counts = Arc::new(Mutex::new(Counts::default()));
    let graceful = GracefulShutdown::new();
    let header_timeout = Duration::from_millis(limits.header_timeout_ms);
    let write_timeout = Duration::from_millis(limits.write_timeout_ms);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer): (TcpStream, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let slot = match Slot::take(&counts, peer.ip(), &limits) {
            Ok(s) => s,
            Err(why) => {
                refuse(stream, why);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .keep_alive(true)
            // One buffer per write, so `ServerIo` sees hyper's own error responses whole.
            .writev(false);
        let io = TokioIo::new(ServerIo::new(stream, write_timeout));
        let conn = http.serve_connection(io, TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace + Duration::from_secs(1)) => {
            tracing::warn!("connections still open {grace:?} after shutdown began; closing them");
        }
    }
}

/// The TCP stream as hyper sees it: a write that stalls past the deadline fails the
/// connection, and hyper's own bodiless error answers (400 / 408 / 413 / 414 / 431 for requests
/// it cannot parse) get an OpenAI-shaped JSON body like every other error.
struct ServerIo {
    inner: TcpStream,
    write_timeout: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
    /// A rewritten error response still being written, and the length to report for it.
    rewrite: Option<(Vec<u8>, usize, usize)>,
}

impl ServerIo {
    fn new(inner: TcpStream, write_timeout: Duration) -> ServerIo {
        ServerIo { inner, write_timeout, stalled: None, rewrite: None }
    }

    /// `Pending` from the socket: fail once it has been pending for `write_timeout`.
    fn stall(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let d = self.write_timeout;
        let sleep = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(d)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "client stopped reading"))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn write_raw(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Pending => self.stall(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

/// hyper's answer to a request it could not parse, given a JSON error body; None for any other
/// write. Our own responses always carry a body, so a bodiless 4xx head is hyper's.
fn with_error_body(head: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(head).ok()?;
    let rest = text.strip_prefix("HTTP/1.1 ")?;
    let status: u16 = rest.get(..3)?.parse().ok()?;
    let (message, code) = match status {
        400 => ("the request is not valid HTTP/1.1", "bad_request"),
        408 => ("the request was not received in time", "request_timeout"),
        413 => ("the request is too large", "request_too_large"),
        414 => ("the request URI is too long", "uri_too_long"),
        431 => ("the request's headers are too large", "headers_too_large"),
        _ => return None,
    };
    if !text.ends_with("\r\n\r\n") || !text.to_ascii_lowercase().contains("\r\ncontent-length: 0\r\n") {
        return None;
    }
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error",
        "param": null, "code": code}})
    .to_string();
    let mut out = String::with_capacity(text.len() + body.len() + 64);
    for line in text.trim_end_matches("\r\n").split("\r\n") {
        if !line.to_ascii_lowercase().starts_with("content-length:") {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()));
    Some(out.into_bytes())
}

impl AsyncRead for ServerIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ServerIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.rewrite.is_none()
            && buf.len() < 1024
            && let Some(bytes) = with_error_body(buf)
        {
            this.rewrite = Some((bytes, 0, buf.len()));
        }
        // Drive a rewritten answer out whole, then report the original buffer as written.
        while let Some((bytes, done, reported)) = this.rewrite.take() {
            if done == bytes.len() {
                return Poll::Ready(Ok(reported));
            }
            match this.write_raw(cx, &bytes[done..]) {
                Poll::Pending => {
                    this.rewrite = Some((bytes, done, reported));
                    return Poll::Pending;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => this.rewrite = Some((bytes, done + n, reported)),
            }
        }
        this.write_raw(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_bodiless_errors_get_json_bodies() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(with_error_body(head).expect("rewritten")).expect("utf8");
        let (h, body) = out.split_once("\r\n\r\n").expect("head");
        assert!(h.starts_with("HTTP/1.1 431") && h.contains("content-type: application/json"), "{h}");
        assert!(h.contains(&format!("content-length: {}", body.len())), "{h}");
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["error"]["code"], "headers_too_large");
        // Our own responses (with bodies) and other statuses are left alone.
        assert!(with_error_body(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 52\r\n\r\n").is_none());
        assert!(with_error_body(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
    }
}
