//! HTTP that holds under abuse: the accept loop, connection and request caps, header, body and
//! idle timeouts, the Host/Origin check and bounded body reads, shared by the agent's ingest
//! API and the hub's API.
//!
//! One source file serves both binaries: the hub compiles it as `core_hub::http_limits` (a
//! `#[path]` module), so the two servers cannot drift apart. It names nothing of either crate.
//!
//! What each limit does (the operator's view is in `docs/security.md`):
//! - `connections_max`: the accept loop takes a connection only with a free slot; beyond the cap
//!   it stops accepting, and new clients wait in the kernel's listen backlog.
//! - `requests_max`: requests handled at once ([`tower::limit::ConcurrencyLimit`]); more wait.
//! - `header_timeout`: a request head must be complete this long after its first byte.
//! - `idle_timeout`: a connection with no request in progress and no byte received for this
//!   long is closed. hyper's own header timer would also close idle keep-alive connections
//!   (it starts when the server waits for a head, not at the first byte), so the two are
//!   tracked here from the bytes read ([`Activity`]); hyper's timer stays as a backstop.
//! - `body_timeout`, `body_bytes_max`: [`read_body`] collects a body within one deadline and
//!   one size, after authorization has run (see the routers), so a refused request costs no
//!   body bytes. A `Content-Length` over the cap is refused before a byte is read.
//!   `Content-Encoding: gzip` bodies (Telegraf, Influx clients) are decompressed there, to at
//!   most `body_bytes_max` again (a larger result is 413, however small the compressed body),
//!   so handlers only see plain bodies; any other encoding is 415, except on a route behind
//!   [`read_body_snappy`], whose handler takes `Content-Encoding: snappy` as it came.
//! - Accept errors (EMFILE, ENFILE, aborted handshakes) are transient: counted, backed off,
//!   retried; they never end the server.
//! - [`check_host`]: a `Host` that names a host other than an IP literal, `localhost` or a name
//!   of `allowed_hosts` gets 403 (DNS rebinding needs a name that resolves to us), and so does an
//!   `Origin` that is neither this server's own origin nor an allowed host (a cross-origin
//!   simple POST from a web page).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;
use tower::ServiceExt;
use tower::limit::ConcurrencyLimit;

/// Default `http.header_timeout`.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `http.body_timeout`.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `http.idle_timeout`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// First pause after a failed `accept`; it doubles up to [`ACCEPT_BACKOFF_MAX`].
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// Longest pause after failed `accept`s in a row.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// The limits of one HTTP server, typed once from the `[http]` config keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpLimits {
    /// `http.header_timeout`: from a head's first byte to its end.
    pub header_timeout: Duration,
    /// `http.body_timeout`: from the end of the head to the end of the body.
    pub body_timeout: Duration,
    /// `http.idle_timeout`: no request in progress and no byte received.
    pub idle_timeout: Duration,
    /// `http.connections_max`: open connections.
    pub connections_max: usize,
    /// `http.requests_max`: requests handled at once.
    pub requests_max: usize,
    /// Largest request body (the agent's `http.body_bytes_max`).
    pub body_bytes_max: usize,
    /// `http.allowed_hosts`: names accepted in `Host` and `Origin` besides IP literals and
    /// `localhost`; `"*"` accepts any.
    pub allowed_hosts: Vec<String>,
}

impl HttpLimits {
    /// The defaults, with the given connection and request caps and body size.
    pub fn new(connections_max: usize, requests_max: usize, body_bytes_max: usize) -> Self {
        HttpLimits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            connections_max,
            requests_max,
            body_bytes_max,
            allowed_hosts: Vec::new(),
        }
    }
}

/// Counters of what the limits did, rendered on `/metrics`.
#[derive(Debug, Default)]
pub struct HttpStats {
    connections_open: AtomicU64,
    connections: AtomicU64,
    connections_waited: AtomicU64,
    accept_emfile: AtomicU64,
    accept_enfile: AtomicU64,
    accept_other: AtomicU64,
    header_timeouts: AtomicU64,
    idle_closed: AtomicU64,
    body_timeouts: AtomicU64,
    body_too_large: AtomicU64,
    host_refused: AtomicU64,
    origin_refused: AtomicU64,
    unauthorized: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl HttpStats {
    /// Counts a request refused for its token (the routers' authorization calls this).
    pub fn unauthorized(&self) {
        inc(&self.unauthorized);
    }

    /// Prometheus text, every name starting with `prefix` (e.g. `tributary_hub_http`).
    pub fn render(&self, prefix: &str) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, rows: &[(&str, u64)]| {
            out.push_str(&format!(
                "# HELP {prefix}_{name} {help}\n# TYPE {prefix}_{name} {kind}\n"
            ));
            for (labels, v) in rows {
                out.push_str(&format!("{prefix}_{name}{labels} {v}\n"));
            }
        };
        let open = get(&self.connections_open);
        one(
            "connections_open",
            "gauge",
            "Open HTTP connections.",
            &[("", open)],
        );
        let rows = [("", get(&self.connections))];
        one(
            "connections_total",
            "counter",
            "Accepted HTTP connections.",
            &rows,
        );
        let rows = [("", get(&self.connections_waited))];
        let help = "Times the accept loop waited for a free slot (http.connections_max).";
        one("connections_waited_total", "counter", help, &rows);
        let rows = [
            ("{kind=\"emfile\"}", get(&self.accept_emfile)),
            ("{kind=\"enfile\"}", get(&self.accept_enfile)),
            ("{kind=\"other\"}", get(&self.accept_other)),
        ];
        let help = "Failed accepts, retried after a pause (EMFILE: out of file descriptors).";
        one("accept_errors_total", "counter", help, &rows);
        let rows = [
            ("{limit=\"header_timeout\"}", get(&self.header_timeouts)),
            ("{limit=\"idle_timeout\"}", get(&self.idle_closed)),
            ("{limit=\"body_timeout\"}", get(&self.body_timeouts)),
            ("{limit=\"body_bytes_max\"}", get(&self.body_too_large)),
            ("{limit=\"host\"}", get(&self.host_refused)),
            ("{limit=\"origin\"}", get(&self.origin_refused)),
            ("{limit=\"token\"}", get(&self.unauthorized)),
        ];
        let help = "Connections closed or requests refused by an HTTP limit.";
        one("refused_total", "counter", help, &rows);
        out
    }
}

/// A server's limits and counters, shared by its accept loop and its router's layers.
#[derive(Debug)]
pub struct HttpGuard {
    pub limits: HttpLimits,
    pub stats: HttpStats,
    /// How this server spells an error body (JSON on the agent, text on the hub).
    error: fn(StatusCode, String) -> Response,
}

impl HttpGuard {
    /// A guard for `limits`, answering errors through `error`.
    pub fn new(limits: HttpLimits, error: fn(StatusCode, String) -> Response) -> Arc<Self> {
        Arc::new(HttpGuard {
            limits,
            stats: HttpStats::default(),
            error,
        })
    }

    fn refuse(&self, status: StatusCode, msg: String) -> Response {
        let mut r = (self.error)(status, msg);
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        r
    }
}

/// Serves `router` on `listener` under `guard`'s limits until `shutdown` resolves, then lets
/// open connections finish their requests. Accept errors never end it.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    guard: Arc<HttpGuard>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let service = ConcurrencyLimit::new(router, guard.limits.requests_max.max(1));
    // `acquire_many` at shutdown takes a u32.
    let slots = guard.limits.connections_max.clamp(1, u32::MAX as usize);
    let free = Arc::new(Semaphore::new(slots));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let Some(slot) = wait_slot(&free, &guard.stats, shutdown.as_mut()).await else {
            break;
        };
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = shutdown.as_mut() => break,
        };
        match accepted {
            Ok((stream, _peer)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                let conn =
                    serve_connection(stream, service.clone(), guard.clone(), stop_rx.clone());
                tokio::spawn(async move {
                    conn.await;
                    drop(slot);
                });
            }
            Err(e) => {
                drop(slot);
                accept_failed(&guard.stats, &e, backoff);
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = shutdown.as_mut() => break,
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection task holds a slot: all of them back means all connections are done.
    let _ = free.acquire_many(slots as u32).await;
    Ok(())
}

/// A free connection slot, or `None` once `shutdown` resolves.
async fn wait_slot(
    free: &Arc<Semaphore>,
    stats: &HttpStats,
    shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    if let Ok(slot) = free.clone().try_acquire_owned() {
        return Some(slot);
    }
    inc(&stats.connections_waited);
    tokio::select! {
        slot = free.clone().acquire_owned() => slot.ok(),
        () = shutdown => None,
    }
}

fn accept_failed(stats: &HttpStats, e: &io::Error, backoff: Duration) {
    let counter = match e.raw_os_error() {
        Some(libc::EMFILE) => &stats.accept_emfile,
        Some(libc::ENFILE) => &stats.accept_enfile,
        _ => &stats.accept_other,
    };
    // One line per streak of failures, not one per retry: the counter has the rest.
    if backoff == ACCEPT_BACKOFF_MIN {
        tracing::warn!(error = %e, "HTTP accept failed; retrying after a pause");
    }
    inc(counter);
}

/// Drives one connection until it ends, its head or idle timer expires, or the server stops.
async fn serve_connection(
    stream: TcpStream,
    service: ConcurrencyLimit<Router>,
    guard: Arc<HttpGuard>,
    mut stop: watch::Receiver<bool>,
) {
    let stats = &guard.stats;
    inc(&stats.connections);
    stats.connections_open.fetch_add(1, Ordering::Relaxed);
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        stream,
        activity: activity.clone(),
    });
    let limits = &guard.limits;
    let svc = hyper::service::service_fn({
        let activity = activity.clone();
        move |req: hyper::Request<hyper::body::Incoming>| {
            activity.request_started();
            let end = RequestEnd(activity.clone());
            let call = service.clone().oneshot(req.map(Body::new));
            async move {
                let response = call.await?;
                Ok::<_, Infallible>(response.map(|b| {
                    Body::new(Guarded {
                        inner: b,
                        _end: end,
                    })
                }))
            }
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        // A backstop only: `Activity` times heads from their first byte (see the module doc).
        .header_read_timeout(limits.header_timeout + limits.idle_timeout)
        .serve_connection(io, svc);
    let mut conn = std::pin::pin!(conn);
    let mut closing = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    if e.is_timeout() {
                        inc(&stats.header_timeouts);
                    }
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
                break;
            }
            expired = activity.expired(limits.header_timeout, limits.idle_timeout), if !closing => {
                inc(match expired {
                    Expired::Head => &stats.header_timeouts,
                    Expired::Idle => &stats.idle_closed,
                });
                break;
            }
            _ = stop.changed(), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    }
    stats.connections_open.fetch_sub(1, Ordering::Relaxed);
}

/// Which timer closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expired {
    Head,
    Idle,
}

/// What a connection has been doing, in ns since it opened: written by its reads and its
/// requests, watched by [`Activity::expired`].
#[derive(Debug)]
struct Activity {
    opened: Instant,
    last_ns: AtomicU64,
    /// When the pending head's first byte arrived; [`NONE`] when no head is pending.
    head_ns: AtomicU64,
    in_request: AtomicBool,
    changed: Notify,
}

const NONE: u64 = u64::MAX;

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            last_ns: AtomicU64::new(0),
            head_ns: AtomicU64::new(NONE),
            in_request: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_nanos()).unwrap_or(NONE - 1)
    }

    fn at(&self, ns: u64) -> Instant {
        self.opened + Duration::from_nanos(ns)
    }

    /// Bytes arrived: outside a request they start (or continue) a head.
    fn read(&self) {
        let now = self.now_ns();
        self.last_ns.store(now, Ordering::Relaxed);
        if !self.in_request.load(Ordering::Relaxed)
            && self
                .head_ns
                .compare_exchange(NONE, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.changed.notify_one();
        }
    }

    /// hyper parsed a head and called the service.
    fn request_started(&self) {
        self.in_request.store(true, Ordering::Relaxed);
        self.head_ns.store(NONE, Ordering::Relaxed);
        self.changed.notify_one();
    }

    /// The response body was sent in full or dropped.
    fn request_ended(&self) {
        self.last_ns.store(self.now_ns(), Ordering::Relaxed);
        self.in_request.store(false, Ordering::Relaxed);
        self.changed.notify_one();
    }

    /// Resolves when a pending head has taken `head` since its first byte, or the connection
    /// has been idle (no request, no byte) for `idle`. Never while a request is in progress.
    async fn expired(&self, head: Duration, idle: Duration) -> Expired {
        loop {
            let deadline = if self.in_request.load(Ordering::Relaxed) {
                None
            } else {
                match self.head_ns.load(Ordering::Relaxed) {
                    NONE => Some((
                        self.at(self.last_ns.load(Ordering::Relaxed)) + idle,
                        Expired::Idle,
                    )),
                    started => Some((self.at(started) + head, Expired::Head)),
                }
            };
            match deadline {
                Some((at, why)) if at <= Instant::now() => return why,
                Some((at, _)) => tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = self.changed.notified() => {}
                },
                None => self.changed.notified().await,
            }
        }
    }
}

/// Marks the end of a request when the response body is finished or dropped.
struct RequestEnd(Arc<Activity>);

impl Drop for RequestEnd {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

/// A response body that ends its request when it is dropped.
struct Guarded {
    inner: Body,
    _end: RequestEnd,
}

impl hyper::body::Body for Guarded {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A TCP stream that reports the bytes it reads to its connection's [`Activity`].
struct Tracked {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Middleware: 403 for a foreign `Host` or `Origin` (see the module doc). Put it outermost.
pub async fn check_host(State(guard): State<Arc<HttpGuard>>, req: Request, next: Next) -> Response {
    let allowed = &guard.limits.allowed_hosts;
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok());
    if let Some(host) = host
        && !host_allowed(host, allowed)
    {
        inc(&guard.stats.host_refused);
        let msg = format!(
            "Host {host:?} is not served here: use an IP address or localhost, or add the name \
             to http.allowed_hosts"
        );
        return guard.refuse(StatusCode::FORBIDDEN, msg);
    }
    if let Some(origin) = req.headers().get(header::ORIGIN)
        && !origin_allowed(origin.to_str().unwrap_or("null"), host, allowed)
    {
        inc(&guard.stats.origin_refused);
        let msg = format!(
            "cross-origin request from {origin:?} refused: add its host to http.allowed_hosts"
        );
        return guard.refuse(StatusCode::FORBIDDEN, msg);
    }
    next.run(req).await
}

/// `host` is a `Host` header value (`name`, `name:port`, `1.2.3.4:80`, `[::1]:80`).
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = strip_port(host);
    name.parse::<std::net::IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || name.to_ascii_lowercase().ends_with(".localhost")
        || allowed
            .iter()
            .any(|a| a == "*" || a.eq_ignore_ascii_case(name))
}

/// An `Origin` is allowed when it is this server's own origin (`http://<Host>`) or its host is
/// listed in `allowed` (IP literals and `localhost` are not enough here: a page on another
/// machine of the network has an IP origin too).
pub fn origin_allowed(origin: &str, host: Option<&str>, allowed: &[String]) -> bool {
    let Some(rest) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    if host.is_some_and(|h| h.eq_ignore_ascii_case(rest)) {
        return true;
    }
    let name = strip_port(rest);
    allowed
        .iter()
        .any(|a| a == "*" || a.eq_ignore_ascii_case(name))
}

fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Middleware: reads the whole body within `body_timeout` and `body_bytes_max` (408 or 413
/// otherwise, and the connection is closed) and hands the handler a complete one. Put it
/// inside the authorization layer, so a refused request costs no body bytes.
pub async fn read_body(State(guard): State<Arc<HttpGuard>>, req: Request, next: Next) -> Response {
    read_body_keeping(&guard, req, next, &[]).await
}

/// As [`read_body`], but a `Content-Encoding: snappy` body reaches the handler as it came,
/// header and all: for a route whose handler undoes snappy itself, under the same cap
/// (Prometheus remote write). Every other route refuses snappy with 415.
pub async fn read_body_snappy(
    State(guard): State<Arc<HttpGuard>>,
    req: Request,
    next: Next,
) -> Response {
    read_body_keeping(&guard, req, next, &["snappy"]).await
}

/// [`read_body`], passing the encodings in `keep` through untouched.
async fn read_body_keeping(guard: &HttpGuard, req: Request, next: Next, keep: &[&str]) -> Response {
    let max = guard.limits.body_bytes_max;
    let (parts, body) = req.into_parts();
    if content_length(&parts.headers).is_some_and(|n| n > max as u64) {
        return too_large(guard);
    }
    let limited = http_body_util::Limited::new(body, max);
    let bytes = match tokio::time::timeout(guard.limits.body_timeout, limited.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return too_large(guard),
        Ok(Err(e)) => {
            return guard.refuse(StatusCode::BAD_REQUEST, format!("reading the body: {e}"));
        }
        Err(_) => {
            inc(&guard.stats.body_timeouts);
            let msg = format!(
                "the body did not arrive within {:?} (http.body_timeout)",
                guard.limits.body_timeout
            );
            return guard.refuse(StatusCode::REQUEST_TIMEOUT, msg);
        }
    };
    let mut parts = parts;
    let bytes = match decode_content(&mut parts.headers, bytes, max, keep) {
        Ok(bytes) => bytes,
        Err(Refusal::TooLarge) => {
            inc(&guard.stats.body_too_large);
            let msg = format!(
                "the body decompresses to over {max} bytes (http.body_bytes_max): send smaller \
                 batches"
            );
            return guard.refuse(StatusCode::PAYLOAD_TOO_LARGE, msg);
        }
        Err(Refusal::Status(status, msg)) => return guard.refuse(status, msg),
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Why a body's `Content-Encoding` could not be undone.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The decoded body would exceed the cap.
    TooLarge,
    Status(StatusCode, String),
}

/// Undoes the body's `Content-Encoding` (none, `identity` or `gzip`, members concatenated as
/// `gzip` allows), reading at most `max` decoded bytes, and removes the header so the handler
/// sees a plain body. An encoding named in `keep` is left as it is, header and body, for the
/// handler to undo.
fn decode_content(
    headers: &mut HeaderMap,
    body: bytes::Bytes,
    max: usize,
    keep: &[&str],
) -> Result<bytes::Bytes, Refusal> {
    let Some(value) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(body);
    };
    let encoding = value.to_str().unwrap_or("").trim().to_ascii_lowercase();
    if keep.contains(&encoding.as_str()) {
        return Ok(body);
    }
    match encoding.as_str() {
        "" | "identity" => {}
        "gzip" | "x-gzip" => {
            use std::io::Read;
            let mut out = Vec::new();
            let mut decoder = flate2::read::MultiGzDecoder::new(&body[..]).take(max as u64 + 1);
            decoder.read_to_end(&mut out).map_err(|e| {
                Refusal::Status(
                    StatusCode::BAD_REQUEST,
                    format!("the body is not valid gzip (Content-Encoding: gzip): {e}"),
                )
            })?;
            if out.len() > max {
                return Err(Refusal::TooLarge);
            }
            headers.remove(header::CONTENT_ENCODING);
            headers.remove(header::CONTENT_LENGTH);
            return Ok(bytes::Bytes::from(out));
        }
        other => {
            return Err(Refusal::Status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Encoding {other:?} is not accepted: send gzip or no encoding"),
            ));
        }
    }
    headers.remove(header::CONTENT_ENCODING);
    Ok(body)
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn too_large(guard: &HttpGuard) -> Response {
    inc(&guard.stats.body_too_large);
    let msg = format!(
        "the body is over {} bytes (http.body_bytes_max): send smaller batches",
        guard.limits.body_bytes_max
    );
    guard.refuse(StatusCode::PAYLOAD_TOO_LARGE, msg)
}

/// A plain-text error body, for servers without their own error shape.
pub fn text_error(status: StatusCode, msg: String) -> Response {
    (status, format!("{msg}\n")).into_response()
}

/// Whether `headers` carry `Authorization: Bearer <t>` for one of `tokens`, compared without
/// an early exit so that timing does not reveal a matching prefix.
pub fn bearer_matches<'a>(headers: &HeaderMap, tokens: impl IntoIterator<Item = &'a str>) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(given) = given else {
        return false;
    };
    tokens.into_iter().fold(false, |hit, t| {
        hit | constant_time_eq(t.as_bytes(), given.as_bytes())
    })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gzip(data: &[u8]) -> bytes::Bytes {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(data).unwrap();
        bytes::Bytes::from(enc.finish().unwrap())
    }

    fn encoded(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, value.parse().unwrap());
        h.insert(header::CONTENT_LENGTH, "10".parse().unwrap());
        h
    }

    #[test]
    fn a_gzip_body_is_decoded_and_its_headers_removed() {
        let plain = b"{\"key\":\"k\",\"ts\":1,\"fields\":{\"v\":1}}\n".repeat(50);
        let mut h = encoded("gzip");
        let out = decode_content(&mut h, gzip(&plain), 1 << 20, &[]).unwrap();
        assert_eq!(&out[..], &plain[..]);
        assert!(h.get(header::CONTENT_ENCODING).is_none());
        assert!(h.get(header::CONTENT_LENGTH).is_none());
        // Concatenated members, as gzip allows, decode as one body.
        let mut two = gzip(b"a\n").to_vec();
        two.extend_from_slice(&gzip(b"b\n"));
        let out = decode_content(&mut encoded("GZIP"), two.into(), 1 << 20, &[]).unwrap();
        assert_eq!(&out[..], b"a\nb\n");
    }

    #[test]
    fn a_gzip_bomb_is_refused_at_the_body_cap() {
        // 64 MiB of zeros compress to about 64 KiB: the decoded cap decides, not the wire size.
        let bomb = gzip(&vec![0u8; 64 << 20]);
        assert!(bomb.len() < 1 << 20);
        let r = decode_content(&mut encoded("gzip"), bomb, 1 << 20, &[]);
        assert_eq!(r, Err(Refusal::TooLarge));
        // Exactly the cap passes.
        let r = decode_content(
            &mut encoded("gzip"),
            gzip(&vec![7u8; 1 << 20]),
            1 << 20,
            &[],
        );
        assert_eq!(r.map(|b| b.len()), Ok(1 << 20));
    }

    #[test]
    fn bad_gzip_and_unknown_encodings_are_named() {
        match decode_content(
            &mut encoded("gzip"),
            bytes::Bytes::from_static(b"plain"),
            1024,
            &[],
        ) {
            Err(Refusal::Status(StatusCode::BAD_REQUEST, msg)) => {
                assert!(msg.contains("not valid gzip"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        match decode_content(
            &mut encoded("br"),
            bytes::Bytes::from_static(b"x"),
            1024,
            &[],
        ) {
            Err(Refusal::Status(StatusCode::UNSUPPORTED_MEDIA_TYPE, msg)) => {
                assert!(msg.contains("\"br\"") && msg.contains("gzip"), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        let mut h = encoded("identity");
        let out = decode_content(&mut h, bytes::Bytes::from_static(b"x"), 1024, &[]).unwrap();
        assert_eq!(&out[..], b"x");
        assert!(h.get(header::CONTENT_ENCODING).is_none());
        let mut none = HeaderMap::new();
        assert_eq!(
            &decode_content(&mut none, bytes::Bytes::from_static(b"y"), 1024, &[]).unwrap()[..],
            b"y"
        );
    }

    #[test]
    fn snappy_passes_only_where_it_is_kept() {
        let body = bytes::Bytes::from_static(b"\x05\x10hello");
        match decode_content(&mut encoded("snappy"), body.clone(), 1024, &[]) {
            Err(Refusal::Status(StatusCode::UNSUPPORTED_MEDIA_TYPE, msg)) => {
                assert!(msg.contains("\"snappy\""), "{msg}")
            }
            other => panic!("{other:?}"),
        }
        let mut h = encoded("Snappy");
        let out = decode_content(&mut h, body.clone(), 1024, &["snappy"]).unwrap();
        assert_eq!(out, body);
        assert_eq!(h.get(header::CONTENT_ENCODING).unwrap(), "Snappy");
        assert!(h.get(header::CONTENT_LENGTH).is_some());
        // Keeping snappy changes nothing for gzip.
        let out = decode_content(&mut encoded("gzip"), gzip(b"a\n"), 1024, &["snappy"]).unwrap();
        assert_eq!(&out[..], b"a\n");
    }

    #[test]
    fn hosts() {
        let none: &[String] = &[];
        for ok in [
            "127.0.0.1:7401",
            "localhost",
            "LOCALHOST:80",
            "[::1]:7480",
            "10.1.2.3",
            "a.localhost",
        ] {
            assert!(host_allowed(ok, none), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:7401",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
        ] {
            assert!(!host_allowed(bad, none), "{bad}");
        }
        let named = ["hub.lan".to_string()];
        assert!(host_allowed("HUB.lan:7480", &named));
        assert!(host_allowed("anything", &["*".to_string()]));
    }

    #[test]
    fn origins() {
        let none: &[String] = &[];
        let host = Some("127.0.0.1:7480");
        assert!(origin_allowed("http://127.0.0.1:7480", host, none));
        assert!(!origin_allowed("http://127.0.0.1:3000", host, none));
        assert!(!origin_allowed("http://evil.example", host, none));
        assert!(!origin_allowed("null", host, none));
        assert!(!origin_allowed(
            "http://192.168.1.7",
            Some("192.168.1.5:7401"),
            none
        ));
        assert!(origin_allowed(
            "https://ops.lan:8443",
            host,
            &["ops.lan".to_string()]
        ));
    }

    #[test]
    fn bearer() {
        let mut h = HeaderMap::new();
        assert!(!bearer_matches(&h, ["0123456789abcdef"]));
        h.insert(
            header::AUTHORIZATION,
            "Bearer 0123456789abcdef".parse().unwrap(),
        );
        assert!(bearer_matches(&h, ["x", "0123456789abcdef"]));
        assert!(!bearer_matches(&h, ["0123456789abcdeX"]));
    }
}
