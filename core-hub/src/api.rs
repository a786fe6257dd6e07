//! The hub's HTTP API (axum): health, metrics, and the minimal reader API.
//!
//! - `GET /healthz`: `ok`, or 503 with the reason while the tier-1 log is poisoned or its disk
//!   is full (naming the path). Always open. Quarantined
//!   tier-1 blocks and tier-2 objects are listed after the `ok` ([`crate::scrub::health_detail`]).
//! - `GET /metrics`: Prometheus text ([`crate::metrics`]). Always open.
//! - `GET /v1/streams`: JSON list of streams with their next hub offset (= records committed).
//! - `GET /v1/streams/{s}/records?from=start|<hub offset>|<RFC 3339>|<cut>&limit=N&key=K&follow=true`:
//!   NDJSON, one committed record per line in hub offset order (see
//!   [`crate::read::write_ndjson_line`]). The response header `x-tributary-next-offset` is the
//!   `from` of the next page; an empty page means the reader is caught up. `limit` defaults to
//!   10000 and is capped at 100000. Served by [`crate::streams::api`], with the segment,
//!   cut and reader-group routes.
//! - `GET /v1/devices`: JSON list of devices: last contact, marks, fence, backlog, gaps.
//! - `POST /v1/devices/{id}/retire` (`?undo=true` reverses it): takes a scrapped device out
//!   of every completeness answer, watermark and gauge ([`crate::completeness`]).
//! - `GET /v1/streams/{s}`: one stream: records, ingest rates, the segment graph with its rates
//!   and policy ([`crate::streams::api::segments_info`]), and its completeness summary.
//! - `GET /v1/streams/{s}/completeness?from=&to=`: `complete` | `owed` | `complete_with_gaps`
//!   for event times `[from, to]` (RFC 3339 UTC or ns; `from` defaults to the beginning, `to`
//!   is required). See `docs/completeness.md`.
//! - `GET /`: the operator status page ([`crate::status`]).
//!
//! When `http.reader_tokens` is set, every `/v1/` route and `/` need `Authorization: Bearer
//! <token>` (`/` also takes `?token=` so that a browser can open it).

use crate::completeness::{CompletenessConfig, CompletenessError, Tracker, parse_time};
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
    tokens: Arc<Vec<String>>,
    tracker: Arc<Tracker>,
}

/// Builds the router with the default `[completeness]` settings. `reader_tokens` empty means
/// the reader API is open.
pub fn router(hub: Arc<Hub>, reader_tokens: Vec<String>) -> Router {
    router_with(hub, reader_tokens, CompletenessConfig::default())
}

/// Builds the router.
pub fn router_with(
    hub: Arc<Hub>,
    reader_tokens: Vec<String>,
    completeness: CompletenessConfig,
) -> Router {
    let state = AppState {
        hub,
        tokens: Arc::new(reader_tokens),
        tracker: Arc::new(Tracker::new(completeness)),
    };
    let v1 = Router::new()
        .route("/", get(status_page))
        .route("/v1/streams", get(streams))
        .merge(crate::streams::api::routes(state.hub.clone()))
        .route("/v1/streams/{stream}", get(stream_detail))
        .route("/v1/streams/{stream}/completeness", get(completeness_route))
        .route("/v1/devices", get(devices))
        .route("/v1/devices/{device}/retire", post(retire))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .merge(v1)
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn require_token(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if st.tokens.is_empty()
        || bearer_ok(req.headers(), &st.tokens)
        || (req.uri().path() == "/" && query_token_ok(req.uri().query(), &st.tokens))
    {
        return next.run(req).await;
    }
    let mut resp = (
        StatusCode::UNAUTHORIZED,
        "a reader bearer token is required\n",
    )
        .into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

fn bearer_ok(headers: &HeaderMap, tokens: &[String]) -> bool {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some(given) = value.strip_prefix("Bearer ") else {
        return false;
    };
    tokens
        .iter()
        .any(|t| constant_time_eq(t.as_bytes(), given.trim().as_bytes()))
}

/// `?token=` on the status page, for browsers.
fn query_token_ok(query: Option<&str>, tokens: &[String]) -> bool {
    query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter_map(|kv| kv.strip_prefix("token="))
        .any(|given| {
            tokens
                .iter()
                .any(|t| constant_time_eq(t.as_bytes(), given.as_bytes()))
        })
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
    for line in crate::scrub::health_detail() {
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
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
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
    pub retired: bool,
    pub marks: Vec<MarkInfo>,
    pub backlog: Vec<BacklogInfo>,
    pub gaps: Vec<GapInfo>,
}

/// A durable mark in `GET /v1/devices`.
#[derive(Debug, Serialize, Deserialize)]
pub struct MarkInfo {
    pub stream: String,
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
    let mut out = Vec::new();
    for d in cat.devices()? {
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
            id: d.name,
            last_contact_ns: d.last_contact_ns,
            fenced: d.fence_reason,
            retired: d.retired,
            marks: marks.collect(),
            backlog: backlog.collect(),
            gaps: gaps.collect(),
        });
    }
    Ok(out)
}

fn internal(msg: String) -> Response {
    tracing::error!(error = %msg, "HTTP API error");
    (StatusCode::INTERNAL_SERVER_ERROR, format!("{msg}\n")).into_response()
}

async fn status_page(State(st): State<AppState>) -> Response {
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
        Ok(None) => (
            StatusCode::NOT_FOUND,
            format!("unknown stream `{stream}`\n"),
        )
            .into_response(),
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
    let bad = |msg: String| (StatusCode::BAD_REQUEST, format!("{msg}\n")).into_response();
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
    match tokio::task::spawn_blocking(move || tracker.query(&hub, &stream, from, to)).await {
        Ok(Ok(answer)) => axum::Json(answer).into_response(),
        Ok(Err(CompletenessError::UnknownStream(s))) => {
            (StatusCode::NOT_FOUND, format!("unknown stream `{s}`\n")).into_response()
        }
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
        Ok(Ok(false)) => (
            StatusCode::NOT_FOUND,
            format!("unknown device `{device}`\n"),
        )
            .into_response(),
        Ok(Err(e)) => internal(e.to_string()),
        Err(e) => internal(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        let tokens = vec!["0123456789abcdef".to_string()];
        let mut h = HeaderMap::new();
        assert!(!bearer_ok(&h, &tokens));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer 0123456789abcdef"),
        );
        assert!(bearer_ok(&h, &tokens));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer 0123456789abcdeX"),
        );
        assert!(!bearer_ok(&h, &tokens));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic 0123456789abcdef"),
        );
        assert!(!bearer_ok(&h, &tokens));
    }
}
