//! The hub's HTTP API (axum): health, metrics, and the minimal reader API.
//!
//! - `GET /healthz`: `ok`, or 503 with the reason while the tier-1 log is poisoned or its disk
//!   is full (naming the path). Always open. Quarantined
//!   tier-1 blocks and tier-2 objects are listed after the `ok` ([`crate::scrub::health_detail`]).
//! - `GET /metrics`: Prometheus text ([`crate::metrics`], and the HTTP limits' counters).
//! - `GET /v1/streams`: JSON list of streams with their next hub offset (= records committed).
//! - `GET /v1/streams/{s}/records?from=start|<hub offset>|<RFC 3339>|<cut>&limit=N&key=K&follow=true`:
//!   NDJSON, one committed record per line in hub offset order (see
//!   [`crate::read::write_ndjson_line`]). The response header `x-tributary-next-offset` is the
//!   `from` of the next page; an empty page means the reader is caught up. `limit` defaults to
//!   10000 and is capped at 100000; a page also stops before `read.page_bytes_max` of decoded
//!   records (never empty), and `follow=true` is capped by `read.follows_max` (503, JSON).
//!   Served by [`crate::streams::api`], with the segment, cut and reader-group routes.
//! - `GET /v1/devices`: JSON list of devices: last contact, marks, fence, revocation (the
//!   rule, and where and when the hub refused the device, [`crate::refusals`]), backlog, gaps.
//! - `POST /v1/devices/{id}/retire` (`?undo=true` reverses it): takes a scrapped device out
//!   of every completeness answer, watermark and gauge ([`crate::completeness`]).
//! - `GET /v1/streams/{s}`: one stream: records, ingest rates, the segment graph with its rates
//!   and policy ([`crate::streams::api::segments_info`]), and its completeness summary.
//! - `GET /v1/streams/{s}/completeness?from=&to=`: `complete` | `owed` | `complete_with_gaps`
//!   for event times `[from, to)`, half-open as everywhere (RFC 3339 or ns; `from` defaults to
//!   the beginning, `to` is required). See `docs/completeness.md`.
//! - `GET /`: the operator status page ([`crate::status`]).
//!
//! Tokens (`Authorization: Bearer <token>`), checked before a byte of a body is read:
//! - `http.reader_tokens`: every `/v1/` read route, the reader-group routes, and the status
//!   page's data. `GET /` without any token answers a sign-in page that shows nothing of the
//!   fleet ([`crate::status::login`]): it keeps the token in the tab's `sessionStorage` and
//!   fetches `/` with it. `/` also takes `?token=` (kept for scripts; it ends up in browser
//!   history). An admin token also reads.
//! - `http.admin_tokens`: mutations (`POST /v1/devices/{id}/retire`). Once any reader or admin
//!   token is configured, a mutation needs an admin token: without one configured, mutations are
//!   refused (403) rather than left to the reader tokens.
//! - `http.metrics_token`: `/metrics` (an admin token also works). Without it, `/metrics` needs a
//!   reader token when reader tokens are set (it names every device), and is open otherwise.
//! - `/healthz` is always open.
//!
//! Every error is a JSON body `{"error": .., "code": ..}` ([`crate::api_error`]); `/healthz`
//! stays plain text for probes.
//!
//! With no token configured at all, everything is open to clients that pass the Host/Origin
//! check ([`crate::http_limits::check_host`]): a web page cannot post here across origins.

use crate::api_error::{self, codes, error};
use crate::completeness::{CompletenessConfig, CompletenessError, Tracker, parse_time};
use crate::config::HttpConfig;
use crate::http_limits::{self, HttpGuard, bearer_matches};
use crate::ingest::Hub;
use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Default records per page.
pub const RECORDS_LIMIT_DEFAULT: usize = 10_000;
/// Largest records page.
pub const RECORDS_LIMIT_MAX: usize = 100_000;
/// The response header carrying the next page's `from`.
pub const NEXT_OFFSET_HEADER: &str = "x-tributary-next-offset";

#[derive(Clone)]
struct AppState {
    hub: Arc<Hub>,
    tokens: Arc<Tokens>,
    tracker: Arc<Tracker>,
    guard: Arc<HttpGuard>,
}

/// The configured tokens, by what they open.
#[derive(Debug, Default)]
struct Tokens {
    reader: Vec<String>,
    admin: Vec<String>,
    metrics: Option<String>,
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Metrics,
    Reader,
    Admin,
}

impl Tokens {
    fn none(&self) -> bool {
        self.reader.is_empty() && self.admin.is_empty()
    }

    /// `Ok` when `headers` (or, on `/`, `query`) may use a route that needs `role`.
    fn check(&self, role: Role, headers: &HeaderMap, query: Option<&str>) -> Result<(), Refusal> {
        let admin = || bearer_matches(headers, self.admin.iter().map(String::as_str));
        let reader = || admin() || bearer_matches(headers, self.reader.iter().map(String::as_str));
        let ok = match role {
            Role::Metrics => match &self.metrics {
                Some(m) => admin() || bearer_matches(headers, [m.as_str()]),
                None => self.none() || reader(),
            },
            Role::Reader => self.none() || reader() || query.is_some_and(|q| self.query_ok(q)),
            Role::Admin if self.none() => true,
            Role::Admin if self.admin.is_empty() => return Err(Refusal::NoAdminToken),
            Role::Admin => admin(),
        };
        if ok {
            Ok(())
        } else {
            Err(Refusal::Token(role))
        }
    }

    /// `?token=` on the status page, for browsers.
    fn query_ok(&self, query: &str) -> bool {
        let tokens = || self.reader.iter().chain(&self.admin);
        query
            .split('&')
            .filter_map(|kv| kv.strip_prefix("token="))
            .any(|given| tokens().any(|t| constant_time_eq(t.as_bytes(), given.as_bytes())))
    }
}

/// Why a request was refused before its handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Token(Role),
    NoAdminToken,
}

/// Builds the router with the default `[completeness]` settings. `reader_tokens` empty means
/// the reader API is open.
pub fn router(hub: Arc<Hub>, reader_tokens: Vec<String>) -> Router {
    router_with(hub, reader_tokens, CompletenessConfig::default())
}

/// Builds the router with reader tokens only and the default HTTP limits.
pub fn router_with(
    hub: Arc<Hub>,
    reader_tokens: Vec<String>,
    completeness: CompletenessConfig,
) -> Router {
    let http = HttpConfig {
        reader_tokens,
        ..HttpConfig::default()
    };
    let guard = guard(&http);
    router_for(hub, &http, completeness, guard)
}

/// The limits and counters of the API server configured by `http`; pass the same guard to
/// [`router_for`] and [`serve_with`].
pub fn guard(http: &HttpConfig) -> Arc<HttpGuard> {
    HttpGuard::new(http.limits.clone(), api_error::guard_error)
}

/// Builds the router: tokens from `http`, limits and counters from `guard`.
pub fn router_for(
    hub: Arc<Hub>,
    http: &HttpConfig,
    completeness: CompletenessConfig,
    guard: Arc<HttpGuard>,
) -> Router {
    let state = AppState {
        hub,
        tokens: Arc::new(Tokens {
            reader: http.reader_tokens.clone(),
            admin: http.admin_tokens.clone(),
            metrics: http.metrics_token.clone(),
        }),
        tracker: Arc::new(Tracker::new(completeness)),
        guard: guard.clone(),
    };
    let reader = Router::new()
        .route("/v1/streams", get(streams))
        .merge(crate::streams::api::routes(state.hub.clone()))
        .merge(crate::republish::api::routes(state.hub.clone()))
        .route("/v1/streams/{stream}", get(stream_detail))
        .route("/v1/streams/{stream}/completeness", get(completeness_route))
        .route("/v1/devices", get(devices));
    let admin = Router::new().route("/v1/devices/{device}/retire", post(retire));
    let scrape = Router::new().route("/metrics", get(metrics));
    // Every error of these routes leaves as JSON ([`api_error`]); `/healthz` stays the
    // probes' plain `ok` or reason.
    // The status page checks its token itself: without one it is the sign-in page.
    let page = Router::new().route("/", get(status_entry)).route(
        "/status-login.js",
        get(|| async { crate::status::login::script() }),
    );
    let api = Router::new()
        .merge(page)
        .merge(protect(scrape, &state, Role::Metrics))
        .merge(protect(reader, &state, Role::Reader))
        .merge(protect(admin, &state, Role::Admin))
        .fallback(no_route)
        .layer(middleware::from_fn(api_error::json_errors));
    Router::new()
        .route("/healthz", get(healthz))
        .merge(api)
        .layer(middleware::from_fn_with_state(
            guard,
            http_limits::check_host,
        ))
        .with_state(state)
}

/// `routes` behind the token check for `role`, which runs before the body is read.
fn protect(routes: Router<AppState>, state: &AppState, role: Role) -> Router<AppState> {
    routes
        .route_layer(middleware::from_fn_with_state(
            state.guard.clone(),
            http_limits::read_body,
        ))
        .route_layer(middleware::from_fn_with_state(
            (state.clone(), role),
            require_token,
        ))
}

/// Serves `router` on `listener` with the default HTTP limits until `shutdown` completes.
/// The accept loop's counters are not those on the router's `/metrics`: use [`serve_with`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let guard = guard(&HttpConfig::default());
    serve_with(listener, router, guard, shutdown).await
}

/// Serves `router` on `listener` under `guard`'s limits until `shutdown` completes.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    guard: Arc<HttpGuard>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    http_limits::serve(listener, router, guard, shutdown).await
}

/// How long shutdown waits for the HTTP responses still open once every follow response
/// was ended: a client that takes nothing does not hold the hub (and its `hub.lock`) longer.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The HTTP API's part of a shutdown, once the server's own shutdown future resolved: ends
/// every follow response with its shutdown line ([`crate::streams::api::shutdown_line`]), then
/// waits up to [`SHUTDOWN_GRACE`] for the server to finish its connections.
pub async fn shut_down(
    hub: &Hub,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
) -> std::io::Result<()> {
    hub.streams().read_state().shut_down();
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(Ok(done)) => done,
        Ok(Err(join)) => Err(std::io::Error::other(join)),
        Err(_) => {
            tracing::warn!(
                grace_s = SHUTDOWN_GRACE.as_secs(),
                "HTTP responses still open after the shutdown grace; closing them"
            );
            Ok(())
        }
    }
}

async fn require_token(
    State((st, role)): State<(AppState, Role)>,
    req: Request,
    next: Next,
) -> Response {
    match st.tokens.check(role, req.headers(), None) {
        Ok(()) => next.run(req).await,
        Err(r) => refused(&st, r),
    }
}

/// The answer to a request refused for its token.
fn refused(st: &AppState, refusal: Refusal) -> Response {
    st.guard.stats.unauthorized();
    let (status, code, msg) = match refusal {
        Refusal::NoAdminToken => (
            StatusCode::FORBIDDEN,
            codes::ADMIN_TOKEN_NOT_CONFIGURED,
            "this is a mutation, and no admin token is configured: set http.admin_tokens",
        ),
        Refusal::Token(Role::Admin) => (
            StatusCode::UNAUTHORIZED,
            codes::ADMIN_TOKEN_REQUIRED,
            "an admin bearer token (http.admin_tokens) is required",
        ),
        Refusal::Token(Role::Metrics) => (
            StatusCode::UNAUTHORIZED,
            codes::METRICS_TOKEN_REQUIRED,
            "a metrics (or reader) bearer token is required",
        ),
        Refusal::Token(Role::Reader) => (
            StatusCode::UNAUTHORIZED,
            codes::TOKEN_REQUIRED,
            "a reader bearer token (http.reader_tokens) is required",
        ),
    };
    let mut resp = error(status, code, msg);
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Compares without an early exit, so response timing does not reveal a token prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn healthz(State(st): State<AppState>) -> Response {
    if let Err(why) = st.hub.health() {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response();
    }
    let mut body = String::from("ok\n");
    for line in crate::scrub::health_detail(&st.hub) {
        body.push_str(&line);
        body.push('\n');
    }
    body.into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    let (hub, tracker) = (st.hub.clone(), st.tracker.clone());
    match tokio::task::spawn_blocking(move || crate::metrics::render_with(&hub, Some(&tracker)))
        .await
    {
        Ok(mut text) => {
            text.push_str(&st.guard.stats.render("tributary_hub_http"));
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
        }
        Err(e) => internal(e.to_string()),
    }
}

/// A stream in `GET /v1/streams`.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StreamInfo {
    pub name: String,
    /// The next hub offset; hub offsets start at 0, so this is also the record count.
    pub next_offset: u64,
    pub records: u64,
}

async fn streams(State(st): State<AppState>) -> Response {
    match st.hub.catalog().streams() {
        Ok(rows) => {
            let list: Vec<StreamInfo> = rows
                .into_iter()
                .map(|s| StreamInfo {
                    name: s.name,
                    next_offset: s.next_offset,
                    records: s.next_offset,
                })
                .collect();
            axum::Json(list).into_response()
        }
        Err(e) => internal(e.to_string()),
    }
}

/// A device in `GET /v1/devices`.
#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub id: String,
    /// Last contact, ns since the Unix epoch.
    pub last_contact_ns: Option<i64>,
    pub fenced: Option<String>,
    /// Why the hub refuses the device, when a revocation does.
    #[serde(default)]
    pub revoked: Option<RevokedInfo>,
    pub retired: bool,
    pub marks: Vec<MarkInfo>,
    pub backlog: Vec<BacklogInfo>,
    pub gaps: Vec<GapInfo>,
}

/// Why a device is revoked, in `GET /v1/devices`.
#[derive(Debug, Serialize, Deserialize)]
pub struct RevokedInfo {
    /// In words: where and when it was refused, and the rule.
    pub reason: String,
    /// The revocation list line that revokes it, and its text.
    pub line: usize,
    pub rule: String,
    /// Where the hub last refused it: `handshake`, `session_start` or `live_session`; `None`
    /// for a device the list revokes as a whole that has not tried since.
    pub refused_at: Option<String>,
    /// The refused certificate's serial (normalised).
    pub serial: Option<String>,
    /// The first and the latest refusal under this rule, ns since the Unix epoch.
    pub first_refused_ns: Option<i64>,
    pub last_refused_ns: Option<i64>,
}

impl RevokedInfo {
    fn of(r: crate::pki::Revoked) -> RevokedInfo {
        let reason = r.reason();
        let refusal = r.refusal.as_ref();
        RevokedInfo {
            reason,
            line: r.rule.line,
            rule: r.rule.text,
            refused_at: refusal.map(|f| f.at.name().to_string()),
            serial: refusal.map(|f| f.serial.clone()),
            first_refused_ns: refusal.map(|f| f.first_ns),
            last_refused_ns: refusal.map(|f| f.last_ns),
        }
    }
}

/// A durable mark in `GET /v1/devices`.
#[derive(Debug, Serialize, Deserialize)]
pub struct MarkInfo {
    pub stream: String,
    /// 16 hex digits ([`sync::epoch`]).
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub durable_seq: u64,
    pub tiered_seq: u64,
}

/// A backlog report in `GET /v1/devices`.
#[derive(Debug, Serialize, Deserialize)]
pub struct BacklogInfo {
    pub stream: String,
    pub reported_at_ns: i64,
    pub blocks: u64,
    pub bytes: u64,
    pub oldest_unsent_ts: Option<i64>,
    pub last_seq: u64,
}

/// A reported gap in `GET /v1/devices`.
#[derive(Debug, Serialize, Deserialize)]
pub struct GapInfo {
    pub stream: String,
    /// 16 hex digits ([`sync::epoch`]).
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub reason: String,
}

async fn devices(State(st): State<AppState>) -> Response {
    let hub = st.hub.clone();
    match tokio::task::spawn_blocking(move || device_list(&hub)).await {
        Ok(Ok(list)) => axum::Json(list).into_response(),
        Ok(Err(e)) => internal(e.to_string()),
        Err(e) => internal(e.to_string()),
    }
}

fn device_list(hub: &Hub) -> Result<Vec<DeviceInfo>, crate::catalog::CatalogError> {
    let cat = hub.catalog();
    let name = |id| hub.stream_name(id).unwrap_or_default();
    let revoked = |device: &str| hub.stats().revocation.revoked(device).map(RevokedInfo::of);
    let devices = cat.devices()?;
    let strangers = crate::refusals::uncatalogued(hub, &devices);
    let mut out = Vec::new();
    for d in devices {
        let marks = cat.marks_of(d.id)?.into_iter().map(|m| MarkInfo {
            stream: name(m.stream),
            epoch: m.epoch,
            durable_seq: m.durable_seq,
            tiered_seq: m.tiered_seq,
        });
        let backlog = cat.backlog_of(d.id)?.into_iter().map(|b| BacklogInfo {
            stream: name(b.stream),
            reported_at_ns: b.reported_at_ns,
            blocks: b.blocks,
            bytes: b.bytes,
            oldest_unsent_ts: b.oldest_unsent_ts,
            last_seq: b.last_seq,
        });
        let gaps = cat.gaps_of(d.id)?.into_iter().map(|g| GapInfo {
            stream: name(g.stream),
            epoch: g.epoch,
            first_seq: g.first_seq,
            last_seq: g.last_seq,
            reason: g.reason,
        });
        out.push(DeviceInfo {
            revoked: revoked(&d.name),
            id: d.name,
            last_contact_ns: d.last_contact_ns,
            fenced: d.fence_reason,
            retired: d.retired,
            marks: marks.collect(),
            backlog: backlog.collect(),
            gaps: gaps.collect(),
        });
    }
    // Refused before any session of theirs started: no catalog row, but shut out all the same.
    for id in strangers {
        out.push(DeviceInfo {
            revoked: revoked(&id),
            id,
            last_contact_ns: None,
            fenced: None,
            retired: false,
            marks: Vec::new(),
            backlog: Vec::new(),
            gaps: Vec::new(),
        });
    }
    Ok(out)
}

fn internal(msg: String) -> Response {
    api_error::internal(msg)
}

/// An unknown route: JSON like every other API error.
async fn no_route(req: Request) -> Response {
    let what = format!("{} {}", req.method(), req.uri().path());
    error(
        StatusCode::NOT_FOUND,
        codes::NOT_FOUND,
        format!("no such route: {what}"),
    )
}

/// `GET /`: the status page for a reader token (header, or `?token=`); without any token
/// while tokens are set, the sign-in page ([`crate::status::login`]); a wrong bearer token
/// is refused (401), so the sign-in page's script can tell.
async fn status_entry(State(st): State<AppState>, req: Request) -> Response {
    match st
        .tokens
        .check(Role::Reader, req.headers(), req.uri().query())
    {
        Ok(()) => status_page(st).await,
        Err(r) if req.headers().contains_key(header::AUTHORIZATION) => refused(&st, r),
        Err(_) => crate::status::login::page(),
    }
}

async fn status_page(st: AppState) -> Response {
    let (hub, tracker) = (st.hub.clone(), st.tracker.clone());
    match tokio::task::spawn_blocking(move || crate::status::render(&hub, &tracker)).await {
        Ok(html) => axum::response::Html(html).into_response(),
        Err(e) => internal(e.to_string()),
    }
}

/// `GET /v1/streams/{s}`.
#[derive(Debug, Serialize)]
pub struct StreamDetail {
    pub name: String,
    pub next_offset: u64,
    pub records: u64,
    pub rates: crate::status::Rates,
    /// The segment graph, its rates and policy; `null` with `segments_error` when unavailable.
    pub segments: Option<crate::streams::api::SegmentsInfo>,
    pub segments_error: Option<String>,
    pub completeness: Option<crate::completeness::StreamSummary>,
}

fn stream_detail_of(hub: &Hub, tracker: &Tracker, stream: &str) -> Option<StreamDetail> {
    let row = hub
        .catalog()
        .streams()
        .ok()?
        .into_iter()
        .find(|s| s.name == stream)?;
    let (segments, segments_error) = match crate::streams::api::segments_info(hub, stream) {
        Ok(info) => (Some(info), None),
        Err(e) => (None, Some(e.to_string())),
    };
    Some(StreamDetail {
        rates: crate::status::stream_rates(hub, stream),
        segments,
        segments_error,
        completeness: tracker.summary(hub, stream).ok(),
        name: row.name,
        next_offset: row.next_offset,
        records: row.next_offset,
    })
}

async fn stream_detail(State(st): State<AppState>, Path(stream): Path<String>) -> Response {
    let (hub, tracker) = (st.hub.clone(), st.tracker.clone());
    let s = stream.clone();
    match tokio::task::spawn_blocking(move || stream_detail_of(&hub, &tracker, &s)).await {
        Ok(Some(d)) => axum::Json(d).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            codes::UNKNOWN_STREAM,
            format!("unknown stream `{stream}`"),
        ),
        Err(e) => internal(e.to_string()),
    }
}

#[derive(Debug, Deserialize)]
struct RangeQuery {
    from: Option<String>,
    to: Option<String>,
}

async fn completeness_route(
    State(st): State<AppState>,
    Path(stream): Path<String>,
    Query(q): Query<RangeQuery>,
) -> Response {
    let bad = |msg: String| error(StatusCode::BAD_REQUEST, codes::BAD_TIME, msg);
    let from = match q.from.as_deref().map(parse_time).transpose() {
        Ok(v) => v.unwrap_or(i64::MIN),
        Err(e) => return bad(format!("from: {e}")),
    };
    let to = match q.to.as_deref().map(parse_time) {
        Some(Ok(v)) => v,
        Some(Err(e)) => return bad(format!("to: {e}")),
        None => return bad("`to` is required (RFC 3339 or ns since the Unix epoch)".into()),
    };
    let (hub, tracker) = (st.hub.clone(), st.tracker.clone());
    // The window is half-open, `[from, to)`, as for export and read; the tracker's is
    // inclusive, so it is asked about `[from, to - 1]` (times are integer ns).
    let ask = move || {
        let mut answer = tracker.query(&hub, &stream, from, to.saturating_sub(1))?;
        answer.to_ns = to;
        Ok(answer)
    };
    match tokio::task::spawn_blocking(ask).await {
        Ok(Ok(answer)) => axum::Json(answer).into_response(),
        Ok(Err(CompletenessError::UnknownStream(s))) => error(
            StatusCode::NOT_FOUND,
            codes::UNKNOWN_STREAM,
            format!("unknown stream `{s}`"),
        ),
        Ok(Err(e @ (CompletenessError::BadTime(_) | CompletenessError::EmptyRange))) => {
            bad(e.to_string())
        }
        Ok(Err(e)) => internal(e.to_string()),
        Err(e) => internal(e.to_string()),
    }
}

#[derive(Debug, Deserialize)]
struct RetireQuery {
    undo: Option<bool>,
}

/// The answer of `POST /v1/devices/{id}/retire`.
#[derive(Debug, Serialize, Deserialize)]
pub struct RetireAnswer {
    pub device: String,
    pub retired: bool,
}

async fn retire(
    State(st): State<AppState>,
    Path(device): Path<String>,
    Query(q): Query<RetireQuery>,
) -> Response {
    let retired = !q.undo.unwrap_or(false);
    let hub = st.hub.clone();
    let d = device.clone();
    match tokio::task::spawn_blocking(move || crate::completeness::set_retired(&hub, &d, retired))
        .await
    {
        Ok(Ok(true)) => {
            tracing::info!(%device, retired, "device retirement changed");
            axum::Json(RetireAnswer { device, retired }).into_response()
        }
        Ok(Ok(false)) => error(
            StatusCode::NOT_FOUND,
            codes::UNKNOWN_DEVICE,
            format!("unknown device `{device}`"),
        ),
        Ok(Err(e)) => internal(e.to_string()),
        Err(e) => internal(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const READER: &str = "reader-0123456789";
    const ADMIN: &str = "admin-0123456789a";
    const METRICS: &str = "metrics-012345678";

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = HeaderValue::from_str(&format!("Bearer {token}")).unwrap();
        h.insert(header::AUTHORIZATION, v);
        h
    }

    fn tokens(admin: bool, metrics: bool) -> Tokens {
        Tokens {
            reader: vec![READER.into()],
            admin: if admin {
                vec![ADMIN.into()]
            } else {
                Vec::new()
            },
            metrics: metrics.then(|| METRICS.into()),
        }
    }

    #[test]
    fn readers_read_and_admins_mutate() {
        let t = tokens(true, true);
        let none = HeaderMap::new();
        assert!(t.check(Role::Reader, &bearer(READER), None).is_ok());
        assert!(t.check(Role::Reader, &bearer(ADMIN), None).is_ok());
        assert!(
            t.check(Role::Reader, &none, Some("token=reader-0123456789"))
                .is_ok()
        );
        assert_eq!(
            t.check(Role::Reader, &none, None),
            Err(Refusal::Token(Role::Reader))
        );
        assert_eq!(
            t.check(Role::Admin, &bearer(READER), None),
            Err(Refusal::Token(Role::Admin))
        );
        assert!(t.check(Role::Admin, &bearer(ADMIN), None).is_ok());
        assert!(t.check(Role::Metrics, &bearer(METRICS), None).is_ok());
        assert!(t.check(Role::Metrics, &bearer(READER), None).is_err());
        assert!(t.check(Role::Reader, &bearer(METRICS), None).is_err());
    }

    #[test]
    fn reader_tokens_alone_close_mutations_and_metrics() {
        let t = tokens(false, false);
        assert_eq!(
            t.check(Role::Admin, &bearer(READER), None),
            Err(Refusal::NoAdminToken)
        );
        assert!(t.check(Role::Metrics, &HeaderMap::new(), None).is_err());
        assert!(t.check(Role::Metrics, &bearer(READER), None).is_ok());
        let open = Tokens::default();
        for role in [Role::Reader, Role::Admin, Role::Metrics] {
            assert!(open.check(role, &HeaderMap::new(), None).is_ok());
        }
    }
}
