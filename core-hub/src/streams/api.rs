//! HTTP routes of merged streams (mounted by `crate::api::router` under the reader token).
//!
//! - `GET /v1/streams/{s}/records?from=start|<hub offset>|<RFC 3339>|<cut>&limit=N&key=K&follow=true`:
//!   NDJSON, one record per line in hub offset order, each with its `segment` and `offset`.
//!   `from=<RFC 3339>` is hub ingest time. Without `follow`, one page: the headers
//!   `x-tributary-next-offset` (a hub offset) and `x-tributary-next-cut` (a cut, exact after a
//!   cut or key start) say where the next page starts; an empty page means caught up. With
//!   `follow=true` the response never ends: records are pushed as they commit.
//! - `GET /v1/streams/{s}/segments`: the segment graph, the readable end, rates and policy.
//! - `GET /v1/streams/{s}/cut[?group=G]`: a cut at the readable end (or a group's checkpoints).
//! - `PUT /v1/streams/{s}/groups/{g}?from=..&session_timeout_ms=..`: create a reader group.
//! - `GET /v1/streams/{s}/groups/{g}`: its readers, assignments, frontier and cut.
//! - `GET /v1/streams/{s}/groups/{g}/readers/{r}/records?max=N&wait_ms=W&checkpoint=S:O,..`:
//!   a heartbeat and a batch (NDJSON); `checkpoint` first acknowledges the previous batch. The
//!   header `x-tributary-positions` (`S:O,..`) is what to checkpoint once the batch is handled.
//!   The group is created from `from` (default `start`) if it does not exist.
//! - `POST /v1/streams/{s}/groups/{g}/readers/{r}/checkpoint?positions=S:O,..`
//! - `DELETE /v1/streams/{s}/groups/{g}/readers/{r}`: leave now (else the session times out).

// Handlers return ready responses as their errors (the axum idiom); their size does not matter
// on this path.
#![allow(clippy::result_large_err)]

use super::SegmentId;
use super::group::{DEFAULT_SESSION_TIMEOUT, GroupError};
use super::reader::{Start, StreamReader};
use crate::ingest::Hub;
use crate::read::{ReadError, write_ndjson_line};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The response header with the next page's cut.
pub const NEXT_CUT_HEADER: &str = "x-tributary-next-cut";
/// The response header with a group batch's positions.
pub const POSITIONS_HEADER: &str = "x-tributary-positions";
/// Longest `wait_ms` of a group poll.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// Records per chunk of a follow response.
const FOLLOW_CHUNK: usize = 2000;

/// The routes, with their own state; mount with `Router::merge`.
pub fn routes<S: Clone + Send + Sync + 'static>(hub: Arc<Hub>) -> Router<S> {
    Router::new()
        .route("/v1/streams/{stream}/records", get(records))
        .route("/v1/streams/{stream}/segments", get(segments))
        .route("/v1/streams/{stream}/cut", get(cut))
        .route(
            "/v1/streams/{stream}/groups/{group}",
            get(group_status).put(group_create),
        )
        .route(
            "/v1/streams/{stream}/groups/{group}/readers/{reader}/records",
            get(group_poll),
        )
        .route(
            "/v1/streams/{stream}/groups/{group}/readers/{reader}/checkpoint",
            post(group_checkpoint),
        )
        .route(
            "/v1/streams/{stream}/groups/{group}/readers/{reader}",
            axum::routing::delete(group_leave),
        )
        .with_state(hub)
}

fn text(status: StatusCode, msg: impl std::fmt::Display) -> Response {
    (status, format!("{msg}\n")).into_response()
}

fn read_error(e: ReadError) -> Response {
    match e {
        ReadError::UnknownStream(s) => text(StatusCode::NOT_FOUND, format!("unknown stream `{s}`")),
        ReadError::Cut(c) => text(StatusCode::BAD_REQUEST, format!("bad stream cut: {c}")),
        other => {
            tracing::error!(error = %other, "HTTP API read error");
            text(StatusCode::INTERNAL_SERVER_ERROR, other)
        }
    }
}

fn group_error(e: GroupError) -> Response {
    match e {
        GroupError::UnknownGroup(_) => text(StatusCode::NOT_FOUND, e),
        GroupError::ReaderGone(_) => text(StatusCode::CONFLICT, e),
        GroupError::BadName(_) => text(StatusCode::BAD_REQUEST, e),
        GroupError::Read(r) => read_error(r),
        GroupError::Catalog(_) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

fn parse_start(from: Option<&str>) -> Result<Start, Response> {
    Start::parse(from.unwrap_or("start")).map_err(|e| text(StatusCode::BAD_REQUEST, e))
}

fn ndjson(body: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

#[derive(Debug, Deserialize)]
struct RecordsQuery {
    from: Option<String>,
    limit: Option<usize>,
    follow: Option<bool>,
    key: Option<String>,
}

async fn records(
    State(hub): State<Arc<Hub>>,
    Path(stream): Path<String>,
    Query(q): Query<RecordsQuery>,
) -> Response {
    let start = match parse_start(q.from.as_deref()) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let follow = q.follow.unwrap_or(false);
    let limit = q.limit.map(|l| l.max(1));
    let h = hub.clone();
    let opened =
        tokio::task::spawn_blocking(move || StreamReader::open(h, &stream, start, q.key)).await;
    let mut reader = match opened {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return read_error(e),
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    if follow {
        return follow_response(reader, limit);
    }
    let limit = limit
        .unwrap_or(crate::api::RECORDS_LIMIT_DEFAULT)
        .min(crate::api::RECORDS_LIMIT_MAX);
    let page = tokio::task::spawn_blocking(move || {
        let r = reader.read(limit);
        r.map(|records| (records, reader.position(), reader.cut()))
    })
    .await;
    let (records, next, cut) = match page {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return read_error(e),
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    let mut body = Vec::with_capacity(records.len() * 160);
    for r in &records {
        write_ndjson_line(r, &mut body);
    }
    let mut resp = ndjson(body);
    let h = resp.headers_mut();
    h.insert(
        crate::api::NEXT_OFFSET_HEADER,
        HeaderValue::from_str(&next.to_string()).expect("digits"),
    );
    h.insert(
        NEXT_CUT_HEADER,
        HeaderValue::from_str(&cut.token()).expect("base64url"),
    );
    resp
}

/// Streams records as they commit until the client goes away (or `limit` records).
fn follow_response(mut reader: StreamReader, limit: Option<usize>) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(4);
    tokio::spawn(async move {
        let mut left = limit.unwrap_or(usize::MAX);
        while left > 0 {
            if !reader.has_more() {
                if tx.is_closed() {
                    return;
                }
                reader.wait(Duration::from_secs(1)).await;
                continue;
            }
            let n = left.min(FOLLOW_CHUNK);
            let read = tokio::task::spawn_blocking(move || {
                let r = reader.read(n);
                (reader, r)
            })
            .await;
            let Ok((r, result)) = read else { return };
            reader = r;
            let records = match result {
                Ok(records) => records,
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
            };
            if records.is_empty() {
                continue;
            }
            left = left.saturating_sub(records.len());
            let mut chunk = Vec::with_capacity(records.len() * 160);
            for r in &records {
                write_ndjson_line(r, &mut chunk);
            }
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp
}

/// `GET /v1/streams/{s}/segments`.
#[derive(Debug, Serialize)]
pub struct SegmentsInfo {
    pub stream: String,
    /// The readable end: records committed and routed.
    pub end: u64,
    pub segments: Vec<super::Segment>,
    pub rates: Vec<super::scaler::SegmentRate>,
    pub policy: Option<PolicyInfo>,
    pub groups: Vec<String>,
}

/// The scaling policy in [`SegmentsInfo`].
#[derive(Debug, Serialize)]
pub struct PolicyInfo {
    pub target_records_per_s: Option<u64>,
    pub target_bytes_per_s: Option<u64>,
    pub window_ms: u64,
    pub min_segments: u32,
    pub max_segments: u32,
}

/// The graph, rates and policy of `stream` (also for the stream detail page).
pub fn segments_info(hub: &Hub, stream: &str) -> Result<SegmentsInfo, ReadError> {
    let sid = hub
        .lookup_stream(stream)
        .ok_or_else(|| ReadError::UnknownStream(stream.to_string()))?;
    let m = hub.streams();
    let snap = m
        .snapshot(sid)
        .map_err(|e| ReadError::Internal(e.to_string()))?;
    let (rates, policy) = m
        .rates(sid)
        .map_err(|e| ReadError::Internal(e.to_string()))?;
    Ok(SegmentsInfo {
        stream: stream.to_string(),
        end: snap.end,
        segments: snap.graph.segments().to_vec(),
        rates,
        policy: policy.map(|p| PolicyInfo {
            target_records_per_s: p.target_records_per_s,
            target_bytes_per_s: p.target_bytes_per_s,
            window_ms: p.window.as_millis() as u64,
            min_segments: p.min_segments,
            max_segments: p.max_segments,
        }),
        groups: m.groups().list(sid),
    })
}

async fn segments(State(hub): State<Arc<Hub>>, Path(stream): Path<String>) -> Response {
    match tokio::task::spawn_blocking(move || segments_info(&hub, &stream)).await {
        Ok(Ok(info)) => axum::Json(info).into_response(),
        Ok(Err(e)) => read_error(e),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

#[derive(Debug, Deserialize)]
struct CutQuery {
    group: Option<String>,
}

/// `GET /v1/streams/{s}/cut`.
#[derive(Debug, Serialize, Deserialize)]
pub struct CutInfo {
    pub cut: String,
    /// The readable end when the cut was taken.
    pub offset: u64,
}

async fn cut(
    State(hub): State<Arc<Hub>>,
    Path(stream): Path<String>,
    Query(q): Query<CutQuery>,
) -> Response {
    let Some(sid) = hub.lookup_stream(&stream) else {
        return read_error(ReadError::UnknownStream(stream));
    };
    let m = hub.streams();
    let snap = match m.snapshot(sid) {
        Ok(s) => s,
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    let cut = match q.group {
        Some(g) => match m.groups().cut(sid, &g, &snap.graph) {
            Ok(c) => c,
            Err(e) => return group_error(e),
        },
        None => super::Cut::at_offset(sid, &snap.graph, snap.end),
    };
    axum::Json(CutInfo {
        cut: cut.token(),
        offset: snap.end,
    })
    .into_response()
}

#[derive(Debug, Deserialize)]
struct CreateQuery {
    from: Option<String>,
    session_timeout_ms: Option<u64>,
}

fn ensure_group(
    hub: &Hub,
    stream: &str,
    group: &str,
    q: &CreateQuery,
) -> Result<(u32, bool), Response> {
    let sid = hub
        .lookup_stream(stream)
        .ok_or_else(|| read_error(ReadError::UnknownStream(stream.to_string())))?;
    let start = parse_start(q.from.as_deref())?;
    let timeout = q
        .session_timeout_ms
        .map_or(DEFAULT_SESSION_TIMEOUT, Duration::from_millis)
        .max(Duration::from_millis(10));
    let created = hub
        .streams()
        .groups()
        .create(hub, sid, group, &start, timeout)
        .map_err(group_error)?;
    Ok((sid, created))
}

async fn group_create(
    State(hub): State<Arc<Hub>>,
    Path((stream, group)): Path<(String, String)>,
    Query(q): Query<CreateQuery>,
) -> Response {
    let r = tokio::task::spawn_blocking(move || ensure_group(&hub, &stream, &group, &q)).await;
    match r {
        Ok(Ok((_, true))) => text(StatusCode::CREATED, "created"),
        Ok(Ok((_, false))) => text(StatusCode::OK, "exists"),
        Ok(Err(resp)) => resp,
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn group_status(
    State(hub): State<Arc<Hub>>,
    Path((stream, group)): Path<(String, String)>,
) -> Response {
    let Some(sid) = hub.lookup_stream(&stream) else {
        return read_error(ReadError::UnknownStream(stream));
    };
    let snap = match hub.streams().snapshot(sid) {
        Ok(s) => s,
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    match hub.streams().groups().status(sid, &group, &snap.graph) {
        Ok(s) => axum::Json(s).into_response(),
        Err(e) => group_error(e),
    }
}

/// Parses `S:O,S:O` positions.
pub fn parse_positions(s: &str) -> Option<BTreeMap<SegmentId, u64>> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (a, b) = p.split_once(':')?;
            Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
        })
        .collect()
}

/// Formats positions as `S:O,S:O`.
pub fn format_positions(p: &BTreeMap<SegmentId, u64>) -> String {
    p.iter()
        .map(|(s, o)| format!("{s}:{o}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[derive(Debug, Deserialize)]
struct PollQuery {
    max: Option<usize>,
    wait_ms: Option<u64>,
    checkpoint: Option<String>,
    from: Option<String>,
    session_timeout_ms: Option<u64>,
}

async fn group_poll(
    State(hub): State<Arc<Hub>>,
    Path((stream, group, reader)): Path<(String, String, String)>,
    Query(q): Query<PollQuery>,
) -> Response {
    let create = CreateQuery {
        from: q.from.clone(),
        session_timeout_ms: q.session_timeout_ms,
    };
    let checkpoint = match q.checkpoint.as_deref().map(parse_positions) {
        Some(None) => return text(StatusCode::BAD_REQUEST, "checkpoint must be S:O,S:O"),
        Some(Some(p)) => Some(p),
        None => None,
    };
    let h = hub.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let (sid, _) = ensure_group(&h, &stream, &group, &create)?;
        let r = h
            .streams()
            .groups()
            .session_or_join(&h, sid, &group, &reader)
            .map_err(group_error)?;
        if let Some(p) = &checkpoint {
            r.checkpoint(p).map_err(group_error)?;
        }
        Ok::<_, Response>(r)
    })
    .await;
    let reader = match joined {
        Ok(Ok(r)) => r,
        Ok(Err(resp)) => return resp,
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    let max = q
        .max
        .unwrap_or(1000)
        .clamp(1, crate::api::RECORDS_LIMIT_MAX);
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0)).min(WAIT_MAX);
    let batch = match reader.poll(max, wait).await {
        Ok(b) => b,
        Err(e) => return group_error(e),
    };
    let mut body = Vec::with_capacity(batch.records.len() * 160);
    for r in &batch.records {
        write_ndjson_line(r, &mut body);
    }
    let mut resp = ndjson(body);
    if let Ok(v) = HeaderValue::from_str(&format_positions(&batch.positions)) {
        resp.headers_mut().insert(POSITIONS_HEADER, v);
    }
    resp
}

#[derive(Debug, Deserialize)]
struct CheckpointQuery {
    positions: String,
}

async fn group_checkpoint(
    State(hub): State<Arc<Hub>>,
    Path((stream, group, reader)): Path<(String, String, String)>,
    Query(q): Query<CheckpointQuery>,
) -> Response {
    let Some(positions) = parse_positions(&q.positions) else {
        return text(StatusCode::BAD_REQUEST, "positions must be S:O,S:O");
    };
    let r = tokio::task::spawn_blocking(move || {
        let sid = hub
            .lookup_stream(&stream)
            .ok_or_else(|| read_error(ReadError::UnknownStream(stream.clone())))?;
        let r = hub
            .streams()
            .groups()
            .session_or_join(&hub, sid, &group, &reader)
            .map_err(group_error)?;
        r.checkpoint(&positions).map_err(group_error)
    })
    .await;
    match r {
        Ok(Ok(())) => text(StatusCode::OK, "ok"),
        Ok(Err(resp)) => resp,
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

async fn group_leave(
    State(hub): State<Arc<Hub>>,
    Path((stream, group, reader)): Path<(String, String, String)>,
) -> Response {
    let Some(sid) = hub.lookup_stream(&stream) else {
        return read_error(ReadError::UnknownStream(stream));
    };
    match hub
        .streams()
        .groups()
        .session_or_join(&hub, sid, &group, &reader)
    {
        Ok(r) => {
            r.leave();
            text(StatusCode::OK, "left")
        }
        Err(e) => group_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip() {
        let p: BTreeMap<SegmentId, u64> = [(0, 5), (3, 1 << 40)].into_iter().collect();
        assert_eq!(parse_positions(&format_positions(&p)), Some(p));
        assert_eq!(parse_positions(""), Some(BTreeMap::new()));
        assert_eq!(parse_positions("1:x"), None);
        assert_eq!(parse_positions("12"), None);
    }
}
