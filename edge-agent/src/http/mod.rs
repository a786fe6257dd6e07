//! The agent's local HTTP API (axum): record ingest, `/healthz`, `/metrics` and `/v1/status`.
//!
//! - `POST /v1/streams/{stream}/records`: NDJSON (`application/x-ndjson`, `application/json`) or
//!   line protocol (`text/plain`). The whole body is one atomic batch; the answer comes only after
//!   it is durable under the configured fsync policy, with the seq range it received:
//!   `{"stream","epoch","first_seq","last_seq","count"}` (`epoch` as 16 hex digits, a string,
//!   as in all the agent's and the hub's JSON; seqs are numbers). Errors are JSON
//!   `{"error": ...}`, with `line` and `column` when they point into the body: 400 malformed or
//!   empty, 401 bad token, 404 unknown stream, 413 body over `http.body_bytes_max` (also once
//!   a `Content-Encoding: gzip` body is decompressed), 415 content type or encoding, 503 (with `Retry-After` when the disk budget is full under `on_full = "block"`) when
//!   the log cannot take the batch now.
//!   A stream with `filters` runs them before sequencing; the answer's `count` is what was
//!   stored (`count: 0`, `first_seq: 0`, `last_seq: 0` when every record was filtered out). A
//!   derived stream (`source_stream`) takes no posts: 409.
//!   With an `Idempotency-Key` header, a retried batch (same key, same body) gets the original
//!   answer (and `Idempotency-Replayed: true`) and stores nothing, also after any crash (the
//!   key is stored in the batch's last record); the same key with another body gets 422, and a
//!   retry while the first request runs gets 409. A field named `_idempotency` in a body is
//!   refused (400). Every 503 says in `"may_be_stored"` whether the batch may have been stored
//!   (storage failed during the write): then retry with the same key after the agent restarted.
//!   Retention and limits: `idempotency.rs`. The Influx writes and Prometheus remote write
//!   take the same header through the same path (`ingest_idempotent`): a replay is 204 with
//!   `Idempotency-Replayed: true`, the refusals are the ones above.
//! - `POST /api/v1/write` (cargo feature `prometheus`): Prometheus remote write 1.0, from
//!   Prometheus or Grafana Alloy, into the stream of `?stream=NAME` or else one named
//!   `prometheus` (404 naming it when it is not declared). The snappy-compressed
//!   `WriteRequest` becomes one record per sample: field = metric name (f64), tags = the other
//!   labels, key = `sync::record::key_from_tags` of the tags, ts = ms × 1,000,000; staleness
//!   markers, native histograms and exemplars are dropped and counted, other NaN/±Inf stored
//!   ([`prom_write`]). 204 once the batch is durable; 400 for a body that does not decode or a
//!   bad series (Prometheus does not retry a 4xx), 413 when it would decompress to over
//!   `http.body_bytes_max` (checked before allocating), 415 for another content type or
//!   encoding, 503 (with `Retry-After`) as above. Only this route takes
//!   `Content-Encoding: snappy` ([`limits::read_body_snappy`]). Its end-to-end test runs
//!   Debian's `prometheus` (`apt-get install prometheus`).
//! - `GET /healthz` (liveness): `ok`, or 503 with the reason (the log is poisoned, or an MQTT
//!   source's subscriptions are not all granted yet). A link down does not fail it: restarting
//!   the agent cannot bring a hub back.
//! - `GET /readyz` (readiness): what `/healthz` checks, and also 503 once the link to the hub
//!   has been down longer than `hub.link_down_unready_after`, naming the reason
//!   ([`status::readiness`]).
//! - `GET /metrics`: Prometheus text.
//! - `GET /v1/status`: [`StatusReport`] as JSON.
//!
//! When `http.token` is set, ingest and `/v1/status` require `Authorization: Bearer <token>`;
//! `/healthz` and `/metrics` stay open for probes and scrapers and reveal no data. The token is
//! checked on the head, before a byte of the body is read; every route is behind the Host/Origin
//! check, the timeouts and the caps of [`limits`] (`http.header_timeout` ... `http.allowed_hosts`).

pub mod client;
pub mod idempotency;
pub mod influx;
pub mod ingest;
pub mod limits;
#[cfg(feature = "prometheus")]
pub mod prom_write;
pub mod status;

pub use ingest::{BodyError, BodyFormat, Ingest, now_ns, parse_body};
pub use status::{LinkState, StatusReport, StreamReport};

use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
#[cfg(feature = "prometheus")]
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use crate::config::{EdgeConfig, fsync_name};
use crate::log::{AppendError, LogHandle, OnFull};
use crate::metrics::{Limits, Metrics};

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    pub ingest: Ingest,
    token: Option<String>,
    /// `http.influx_streams`: Influx `db`/`bucket` names mapped to streams.
    influx_streams: std::collections::BTreeMap<String, String>,
    body_bytes_max: usize,
    /// The HTTP limits and their counters (`limits.rs`), shared with the accept loop.
    pub guard: Arc<limits::HttpGuard>,
    /// Mutation check: read the body before the token check, as the API once did. Read when
    /// the router is built.
    #[cfg(feature = "fault-injection")]
    pub body_before_token: std::sync::atomic::AtomicBool,
    limits: Limits,
    fsync: String,
    on_full: String,
    /// Set by the replicator; `NotConfigured` without a `[hub]`.
    pub link: RwLock<LinkState>,
    /// The replicator's counters, once it runs; rendered on `/metrics`.
    pub replication: std::sync::OnceLock<Arc<crate::replicator::LinkStatus>>,
    /// Readiness and counters of the configured sources (MQTT).
    pub sources: Arc<crate::sources::SourcesState>,
    /// `hub.link_down_unready_after`; `None` without a `[hub]`.
    link_down_unready_after: Option<Duration>,
}

impl AppState {
    /// State for an agent configured by `cfg`, appending to `log`.
    pub fn new(cfg: &EdgeConfig, log: LogHandle) -> Arc<Self> {
        let local = cfg.streams.iter().filter(|s| !s.replicate);
        let metrics = Arc::new(
            Metrics::new(cfg.streams.iter().map(|s| s.name.as_str()))
                .with_local_streams(local.map(|s| s.name.as_str())),
        );
        let link = if cfg.hub.is_some() {
            LinkState::Down
        } else {
            LinkState::NotConfigured
        };
        Arc::new(AppState {
            ingest: Ingest::with_streams(log, metrics, &cfg.streams),
            token: cfg.http.token.clone(),
            influx_streams: cfg.http.influx_streams.clone(),
            guard: limits::HttpGuard::new(cfg.http.limits.clone(), error),
            #[cfg(feature = "fault-injection")]
            body_before_token: std::sync::atomic::AtomicBool::new(false),
            body_bytes_max: cfg.http.body_bytes_max,
            limits: Limits {
                disk_bytes_max: cfg.storage.disk_bytes_max,
            },
            fsync: fsync_name(&cfg.storage.fsync),
            on_full: on_full_name(cfg.storage.on_full).to_owned(),
            link: RwLock::new(link),
            replication: std::sync::OnceLock::new(),
            sources: Arc::new(crate::sources::SourcesState::new(cfg)),
            link_down_unready_after: cfg.hub.as_ref().map(|h| h.link_down_unready_after),
        })
    }

    /// The current status report.
    pub fn status_report(&self) -> StatusReport {
        let link = *self.link.read().unwrap_or_else(|e| e.into_inner());
        let mut report = StatusReport::new(
            &self.ingest.log().status(),
            link,
            &self.fsync,
            &self.on_full,
            self.limits.disk_bytes_max,
            now_ns(),
        )
        .with_local_streams(|s| self.ingest.metrics().is_local(s));
        report.filters = self.ingest.metrics().filter_reports();
        let now = status::now_ms();
        if let Some(link) = self.replication.get() {
            report.link_detail = Some(link.state().detail(now));
            let refused = link.refused_streams();
            report.refused_streams = refused.iter().map(|r| r.detail(now)).collect();
        }
        report.sources = self.sources.reports();
        report
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        constant_time_eq(given.as_bytes(), token.as_bytes())
    }
}

/// The config spelling of an `OnFull`.
pub fn on_full_name(p: OnFull) -> &'static str {
    match p {
        OnFull::DropOldest => "drop-oldest",
        OnFull::Block => "block",
    }
}

/// The API's routes.
pub fn router(app: Arc<AppState>) -> Router {
    let read_body = middleware::from_fn_with_state(app.guard.clone(), limits::read_body);
    let token = middleware::from_fn_with_state(app.clone(), require_token);
    let routes = Router::new()
        .route("/v1/streams/{stream}/records", post(post_records))
        .route("/write", post(post_influx_v1))
        .route("/api/v2/write", post(post_influx_v2))
        .route("/v1/status", get(get_status));
    #[cfg(feature = "fault-injection")]
    let body_first = app
        .body_before_token
        .load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(feature = "fault-injection"))]
    let body_first = false;
    // The token is checked before a byte of the body is read (`limits::read_body`).
    let protected = if body_first {
        routes.route_layer(token.clone()).route_layer(read_body)
    } else {
        routes.route_layer(read_body).route_layer(token.clone())
    };
    #[cfg(feature = "prometheus")]
    let protected = {
        // Its own body layer: the snappy body reaches the handler as it came.
        let read_snappy =
            middleware::from_fn_with_state(app.guard.clone(), limits::read_body_snappy);
        let write = Router::new().route(prom_write::PATH, post(post_prom_write));
        protected.merge(if body_first {
            write.route_layer(token).route_layer(read_snappy)
        } else {
            write.route_layer(read_snappy).route_layer(token)
        })
    };
    finish(protected, app)
}

/// The open routes and the layers around every route.
fn finish(protected: Router<Arc<AppState>>, app: Arc<AppState>) -> Router {
    let guard = app.guard.clone();
    protected
        .route("/healthz", get(get_healthz))
        .route("/readyz", get(get_readyz))
        .route("/metrics", get(get_metrics))
        .layer(DefaultBodyLimit::max(app.body_bytes_max))
        .layer(middleware::from_fn_with_state(guard, limits::check_host))
        .layer(middleware::from_fn_with_state(app.clone(), count_answers))
        .with_state(app)
}

/// Serves the API on `listener` under the `[http]` limits until `shutdown` resolves, then lets
/// in-flight requests finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    limits::serve(listener, router(app.clone()), app.guard.clone(), shutdown).await
}

/// 401 before the body is read when `http.token` is set and the request lacks it.
async fn require_token(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if app.authorized(request.headers()) {
        return next.run(request).await;
    }
    app.guard.stats.unauthorized();
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "missing or wrong bearer token (http.token)",
    );
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

async fn count_answers(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    app.ingest
        .metrics()
        .http_answered(response.status().as_u16());
    response
}

/// A JSON error body: `{"error": message}`.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

async fn post_records(
    State(app): State<Arc<AppState>>,
    Path(stream): Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if !app.authorized(&headers) {
        let mut r = error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (http.token)",
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    if let Some(r) = refuse_stream(&app, &stream) {
        return r;
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let Some(format) = BodyFormat::from_content_type(content_type) else {
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "content type {content_type:?} is not accepted: use {}",
                ingest::ACCEPTED_CONTENT_TYPES
            ),
        );
    };
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body is over {} bytes (http.body_bytes_max): send smaller batches",
                    app.body_bytes_max
                ),
            );
        }
        Err(e) => return error(e.status(), e.body_text()),
    };
    let opts = match app.ingest.request_options(query.as_deref(), now_ns()) {
        Ok(o) => o,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    if let Some(key) = headers.get("idempotency-key") {
        return post_idempotent(&app, &stream, key, content_type, format, &body, &opts).await;
    }
    let records = match ingest::parse_body_with(format, &stream, &body, &opts) {
        Ok(r) => r,
        Err(e) => return body_error(&e),
    };
    match app.ingest.ingest(&stream, records).await {
        Ok(ack) => axum::Json(json!({
            "stream": ack.stream,
            "epoch": sync::epoch::format(ack.epoch),
            "first_seq": ack.first_seq,
            "last_seq": ack.last_seq,
            "count": ingest::stored_count(&ack),
        }))
        .into_response(),
        Err(e) => append_error(&e),
    }
}

async fn post_influx_v1(
    State(app): State<Arc<AppState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    post_influx(&app, influx::Api::V1, query.as_deref(), &headers, body).await
}

async fn post_influx_v2(
    State(app): State<Arc<AppState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    post_influx(&app, influx::Api::V2, query.as_deref(), &headers, body).await
}

/// An Influx write (see [`influx`]): 204 once the batch is durable.
async fn post_influx(
    app: &AppState,
    api: influx::Api,
    query: Option<&str>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    use influx::influx_error as fail;
    let q = match influx::parse_query(api, query) {
        Ok(q) => q,
        Err(e) => return fail(StatusCode::BAD_REQUEST, "invalid", &e, None),
    };
    if let Some(token) = &app.token {
        let given = influx::given_token(headers, &q).unwrap_or("");
        if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
            let msg = "missing or wrong token (http.token): send Authorization: Token <token>";
            return fail(StatusCode::UNAUTHORIZED, "unauthorized", msg, None);
        }
    }
    let stream = influx::stream_of(&q.target, &app.influx_streams);
    if !app
        .ingest
        .log()
        .config()
        .streams
        .iter()
        .any(|s| s == stream)
    {
        let msg = format!(
            "{:?} names the stream {stream:?}, which is not declared: add it as a [[streams]] \
             entry, or map the name to a stream in http.influx_streams",
            q.target
        );
        return fail(StatusCode::NOT_FOUND, "not found", &msg, None);
    }
    if app.ingest.derived_from(stream).is_some() {
        let msg = format!("stream {stream:?} is derived by filters and takes no writes");
        return fail(StatusCode::CONFLICT, "conflict", &msg, None);
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => return fail(e.status(), "invalid", &e.body_text(), None),
    };
    let Ok(text) = std::str::from_utf8(&body) else {
        return fail(
            StatusCode::BAD_REQUEST,
            "invalid",
            "the body is not UTF-8",
            None,
        );
    };
    let mut opts = app
        .ingest
        .request_options(None, now_ns())
        .expect("no query, no error");
    opts.ts_unit = q.precision;
    let records = match influx::parse_body(text, &opts) {
        Ok(r) => r,
        Err(e) => return fail(StatusCode::BAD_REQUEST, "invalid", &e.message, Some(e.line)),
    };
    if let Some((i, field)) = ingest::first_reserved(&records) {
        let msg = format!("record {i}: field names starting with `_` are reserved: {field:?}");
        return fail(StatusCode::BAD_REQUEST, "invalid", &msg, None);
    }
    if let Some(key) = headers.get("idempotency-key") {
        // The precision is part of the batch: the same lines at another precision are another
        // batch.
        let digest = ingest::body_digest(&influx::digest_label(q.precision), &body);
        return match ingest_idempotent(app, stream, key, digest, || Ok(records)).await {
            Ok(answer) => no_content(answer.replayed),
            Err(r) => r,
        };
    }
    match app.ingest.ingest(stream, records).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => append_error(&e),
    }
}

/// 404 for a stream the config does not declare, 409 for a derived one; `None` for a stream
/// that takes records.
fn refuse_stream(app: &AppState, stream: &str) -> Option<Response> {
    if !app
        .ingest
        .log()
        .config()
        .streams
        .iter()
        .any(|s| s == stream)
    {
        return Some(error(
            StatusCode::NOT_FOUND,
            format!(
                "unknown stream {stream:?}: declare it as a [[streams]] entry in the agent's config"
            ),
        ));
    }
    if let Some(source) = app.ingest.derived_from(stream) {
        return Some(error(
            StatusCode::CONFLICT,
            format!(
                "stream {stream:?} is derived from {source:?} by its filters and takes no records \
                 directly: post to /v1/streams/{source}/records"
            ),
        ));
    }
    None
}

/// Prometheus remote write: 204 once the batch is durable (decoding and mapping:
/// `prom_write.rs`).
#[cfg(feature = "prometheus")]
async fn post_prom_write(
    State(app): State<Arc<AppState>>,
    query: Result<axum::extract::Query<std::collections::HashMap<String, String>>, QueryRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let refused = |e: prom_write::WriteError| {
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
        error(status, e.to_string())
    };
    let Ok(axum::extract::Query(query)) = query else {
        return error(StatusCode::BAD_REQUEST, "the query string does not decode");
    };
    let stream = match prom_write::stream_from_query(&query) {
        Ok(s) => s,
        Err(e) => return refused(e),
    };
    if let Some(r) = refuse_stream(&app, &stream) {
        return r;
    }
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let checked =
        prom_write::check_headers(text(header::CONTENT_TYPE), text(header::CONTENT_ENCODING));
    if let Err(e) = checked {
        return refused(e);
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    let batch = match prom_write::decode(&body, app.body_bytes_max) {
        Ok(b) => b,
        Err(e) => return refused(e),
    };
    if let Some(key) = headers.get("idempotency-key") {
        let digest = ingest::body_digest(prom_write::CONTENT_TYPE, &body);
        let records = || Ok(batch.records);
        return match ingest_idempotent(&app, &stream, key, digest, records).await {
            Ok(answer) => {
                if !answer.replayed {
                    app.ingest.metrics().prom_dropped(&stream, batch.dropped);
                }
                no_content(answer.replayed)
            }
            Err(r) => r,
        };
    }
    app.ingest.metrics().prom_dropped(&stream, batch.dropped);
    match app.ingest.ingest(&stream, batch.records).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => append_error(&e),
    }
}

/// A batch with an `Idempotency-Key`: see `idempotency.rs` for the semantics and retention.
async fn post_idempotent(
    app: &AppState,
    stream: &str,
    key: &HeaderValue,
    content_type: &str,
    format: BodyFormat,
    body: &[u8],
    opts: &sync::parse::ParseOptions,
) -> Response {
    let digest = ingest::body_digest(content_type, body);
    let parse = || {
        ingest::parse_body_with(format, stream, body, opts).map_err(|e| Box::new(body_error(&e)))
    };
    let answer = match ingest_idempotent(app, stream, key, digest, parse).await {
        Ok(answer) => answer,
        Err(r) => return r,
    };
    let mut r = axum::Json(json!({
        "stream": answer.stream,
        "epoch": sync::epoch::format(answer.epoch),
        "first_seq": answer.first_seq,
        "last_seq": answer.last_seq,
        "count": answer.count,
    }))
    .into_response();
    if answer.replayed {
        r.headers_mut()
            .insert("idempotency-replayed", HeaderValue::from_static("true"));
    }
    r
}

/// The keyed path every write route shares (the native records route, the Influx writes and
/// Prometheus remote write): the stored answer for a retried key and body (nothing is
/// appended), or the claim, the records of `records` (called only for a new key) and their
/// append with the key record. `Err` is the response to send: 400 bad key, 409 in progress,
/// 422 the key with another body, 503 saying whether the batch may be stored, or the refusal
/// of `records`.
async fn ingest_idempotent(
    app: &AppState,
    stream: &str,
    key: &HeaderValue,
    digest: u64,
    records: impl FnOnce() -> Result<Vec<sync::Record>, Box<Response>>,
) -> Result<idempotency::BatchAnswer, Response> {
    use ingest::{IdempotencyError, IdempotentStart};
    let Ok(key) = key.to_str() else {
        return Err(idempotency_error(IdempotencyError::BadKey));
    };
    let claim = match app.ingest.begin_idempotent(stream, key, digest).await {
        Err(e) => return Err(idempotency_error(e)),
        Ok(IdempotentStart::Replay(answer)) => return Ok(answer),
        Ok(IdempotentStart::Claimed(claim)) => claim,
    };
    let records = records().map_err(|r| *r)?;
    // Its own task: a client that disconnects must not cut the work between the append and
    // the cache write.
    let ingest = app.ingest.clone();
    let task = tokio::spawn(async move { ingest.ingest_claimed(claim, records).await });
    match task.await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(idempotency_error(e)),
        Err(e) => Err(idempotency_error(IdempotencyError::MaybeStored(
            AppendError::Storage(format!("the request task failed: {e}")),
        ))),
    }
}

/// The answer to a keyed write that failed.
fn idempotency_error(e: ingest::IdempotencyError) -> Response {
    use ingest::IdempotencyError;
    match e {
        IdempotencyError::BadKey => error(StatusCode::BAD_REQUEST, e.to_string()),
        IdempotencyError::InProgress => error(StatusCode::CONFLICT, e.to_string()),
        IdempotencyError::BodyMismatch => error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()),
        IdempotencyError::Append(e) => append_error(&e),
        IdempotencyError::Store { .. }
        | IdempotencyError::Scan { .. }
        | IdempotencyError::MaybeStored(_)
        | IdempotencyError::EarlierMaybeStored => unavailable(&e.to_string(), e.may_be_stored()),
    }
}

/// 204 for a write route, with `Idempotency-Replayed: true` when the answer was replayed.
fn no_content(replayed: bool) -> Response {
    let mut r = StatusCode::NO_CONTENT.into_response();
    if replayed {
        r.headers_mut()
            .insert("idempotency-replayed", HeaderValue::from_static("true"));
    }
    r
}

fn body_error(e: &BodyError) -> Response {
    let mut body = json!({ "error": e.to_string() });
    if let Some((line, column)) = e.position() {
        body["line"] = line.into();
        body["column"] = column.into();
    }
    if let BodyError::Parse(p) = e {
        body["expected"] = p.expected.clone().into();
        body["found"] = p.found.clone().into();
    }
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

fn append_error(e: &AppendError) -> Response {
    match e {
        AppendError::UnknownStream(_) => error(StatusCode::NOT_FOUND, e.to_string()),
        AppendError::EmptyBatch | AppendError::BadKey { .. } => {
            error(StatusCode::BAD_REQUEST, e.to_string())
        }
        AppendError::RecordTooLarge { .. }
        | AppendError::TooManyFields { .. }
        | AppendError::Unsealable { .. } => error(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
        AppendError::Full { retry_after } => {
            let mut r = unavailable(
                "the disk budget (storage.disk_bytes_max) is full and storage.on_full = \"block\": \
                 retry after the hub has taken the backlog, or raise the budget",
                false,
            );
            r.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(*retry_after)),
            );
            r
        }
        AppendError::Poisoned(_) => unavailable(
            &format!(
                "{e}; check the disk, then restart the agent (it re-verifies the log at start-up)"
            ),
            false,
        ),
        AppendError::Storage(_) => unavailable(
            &format!(
                "{e}; the batch may be stored (without an Idempotency-Key a retry may store it \
                 twice); check the disk, then restart the agent (it re-verifies the log at \
                 start-up)"
            ),
            true,
        ),
        AppendError::Closed => unavailable(
            "the agent is shutting down; the batch may be stored (without an Idempotency-Key a \
             retry may store it twice)",
            true,
        ),
    }
}

/// A 503 saying whether the batch may nevertheless have been stored:
/// `{"error": message, "may_be_stored": bool}`.
fn unavailable(message: &str, may_be_stored: bool) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(json!({ "error": message, "may_be_stored": may_be_stored })),
    )
        .into_response()
}

/// `Retry-After` in whole seconds, at least 1.
fn retry_after_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0).max(u64::from(d.is_zero()))
}

async fn get_status(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if !app.authorized(&headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (http.token)",
        );
    }
    axum::Json(app.status_report()).into_response()
}

async fn get_healthz(State(app): State<Arc<AppState>>) -> Response {
    match app.ingest.log().status().poisoned {
        None if !app.sources.ready() => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: {}\n",
                app.sources.not_ready_reason().unwrap_or_default()
            ),
        )
            .into_response(),
        None => (StatusCode::OK, "ok\n").into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("poisoned: the local log refuses writes after a storage failure: {why}\n"),
        )
            .into_response(),
    }
}

async fn get_readyz(State(app): State<Arc<AppState>>) -> Response {
    let health = get_healthz(State(app.clone())).await;
    if health.status() != StatusCode::OK {
        return health;
    }
    let link = app.replication.get().map(|l| l.state());
    match status::readiness(link.as_ref(), app.link_down_unready_after, status::now_ms()) {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn get_metrics(State(app): State<Arc<AppState>>) -> Response {
    let status = app.ingest.log().status();
    let mut text = app.ingest.metrics().render(&status, &app.limits, now_ns());
    text.push_str(&app.sources.render());
    if let Some(link) = app.replication.get() {
        text.push_str(&link.render());
    }
    text.push_str(&app.guard.stats.render("tributary_edge_http"));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Compares secrets without an early exit, so timing does not reveal a matching prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1500)), 2);
    }

    #[test]
    fn tokens_compare_exactly() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
