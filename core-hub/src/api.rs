//! The hub's HTTP API (axum): health, metrics, and the minimal reader API.
//!
//! - `GET /healthz`: `ok`, or 503 once the tier-1 log is poisoned. Always open.
//! - `GET /metrics`: Prometheus text ([`crate::metrics`]). Always open.
//! - `GET /v1/streams`: JSON list of streams with their next hub offset (= records committed).
//! - `GET /v1/streams/{s}/records?from=start|<hub offset>&limit=N`: NDJSON, one committed
//!   record per line in hub offset order (see [`crate::read::write_ndjson_line`]). The response
//!   header `x-tributary-next-offset` is the `from` of the next page; an empty page means the
//!   reader is caught up. `limit` defaults to 10000 and is capped at 100000.
//! - `GET /v1/devices`: JSON list of devices: last contact, marks, fence, backlog, gaps.
//!
//! When `http.reader_tokens` is set, every `/v1/` route needs `Authorization: Bearer <token>`.

use crate::ingest::Hub;
use crate::read::{ReadError, read_records, write_ndjson_line};
use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
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
}

/// Builds the router. `reader_tokens` empty means the reader API is open.
pub fn router(hub: Arc<Hub>, reader_tokens: Vec<String>) -> Router {
    let state = AppState {
        hub,
        tokens: Arc::new(reader_tokens),
    };
    let v1 = Router::new()
        .route("/v1/streams", get(streams))
        .route("/v1/streams/{stream}/records", get(records))
        .route("/v1/devices", get(devices))
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
    if st.tokens.is_empty() || bearer_ok(req.headers(), &st.tokens) {
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

/// Compares without an early exit, so response timing does not reveal a token prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn healthz(State(st): State<AppState>) -> Response {
    if st
        .hub
        .wal_stats()
        .poisoned
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        return (StatusCode::SERVICE_UNAVAILABLE, "tier-1 log poisoned\n").into_response();
    }
    "ok\n".into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    let hub = st.hub.clone();
    match tokio::task::spawn_blocking(move || crate::metrics::render(&hub)).await {
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

#[derive(Debug, Deserialize)]
struct RecordsQuery {
    from: Option<String>,
    limit: Option<usize>,
}

async fn records(
    State(st): State<AppState>,
    Path(stream): Path<String>,
    Query(q): Query<RecordsQuery>,
) -> Response {
    let from = match q.from.as_deref() {
        None | Some("start") => 0,
        Some(s) => match s.parse::<u64>() {
            Ok(n) => n,
            Err(_) => {
                let msg = format!("from=`{s}` is not supported: use `start` or a hub offset\n");
                return (StatusCode::BAD_REQUEST, msg).into_response();
            }
        },
    };
    let limit = q
        .limit
        .unwrap_or(RECORDS_LIMIT_DEFAULT)
        .clamp(1, RECORDS_LIMIT_MAX);
    let hub = st.hub.clone();
    let task = tokio::task::spawn_blocking(move || read_records(&hub, &stream, from, limit));
    let page = match task.await {
        Ok(Ok(page)) => page,
        Ok(Err(ReadError::UnknownStream(s))) => {
            return (StatusCode::NOT_FOUND, format!("unknown stream `{s}`\n")).into_response();
        }
        Ok(Err(e)) => return internal(e.to_string()),
        Err(e) => return internal(e.to_string()),
    };
    let mut body = Vec::with_capacity(page.records.len() * 128);
    for r in &page.records {
        write_ndjson_line(r, &mut body);
    }
    let next = HeaderValue::from_str(&page.next.to_string()).expect("digits are a valid header");
    let mut resp = ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response();
    resp.headers_mut().insert(NEXT_OFFSET_HEADER, next);
    resp
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
