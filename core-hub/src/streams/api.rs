//! HTTP routes of merged streams (mounted by `crate::api::router` under the reader token).
//!
//! - `GET /v1/streams/{s}/records?from=start|<hub offset>|<RFC 3339>|<cut>&limit=N&key=K&follow=true`:
//!   NDJSON, one record per line in hub offset order, each with its `segment` and `offset`.
//!   `from=<RFC 3339>` is hub ingest time. Without `follow`, one page: the headers
//!   `x-tributary-next-offset` (a hub offset) and `x-tributary-next-cut` (a cut, exact after a
//!   cut or key start) say where the next page starts; an empty page means caught up. A page
//!   also stops before its records' decoded size passes `read.page_bytes_max` (it always holds
//!   one record), and the next page starts exactly after it. With `follow=true` the response
//!   never ends: records are pushed as they commit, at most `read.follow_buffer_bytes_max`
//!   queued for the client; a client that takes nothing for `read.follow_stall_timeout` is
//!   cut off (logged, `tributary_hub_read_follows_dropped_total`). At most `read.follows_max`
//!   follow responses are open at once: the next gets 503 with a JSON error naming the limit.
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
use crate::api_error::{codes, error, error_with, internal};
use crate::ingest::Hub;
use crate::read::{PageLimit, ReadError, write_ndjson_line};
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The response header with the next page's cut.
pub const NEXT_CUT_HEADER: &str = "x-tributary-next-cut";
/// The response header with a group batch's positions.
pub const POSITIONS_HEADER: &str = "x-tributary-positions";
/// Longest `wait_ms` of a group poll.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// Records per chunk of a follow response.
const FOLLOW_CHUNK: usize = 2000;
/// Chunks of a follow response's buffer: each holds about a quarter of
/// `read.follow_buffer_bytes_max`.
const FOLLOW_CHUNKS_BUFFERED: u64 = 4;

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
        ReadError::UnknownStream(s) => error(
            StatusCode::NOT_FOUND,
            codes::UNKNOWN_STREAM,
            format!("unknown stream `{s}`"),
        ),
        ReadError::Cut(c) => error(
            StatusCode::BAD_REQUEST,
            codes::BAD_CUT,
            format!("bad stream cut: {c}"),
        ),
        other => internal(other),
    }
}

fn group_error(e: GroupError) -> Response {
    match e {
        GroupError::UnknownGroup(_) => error(StatusCode::NOT_FOUND, codes::UNKNOWN_GROUP, e),
        GroupError::ReaderGone(_) => error(StatusCode::CONFLICT, codes::READER_GONE, e),
        GroupError::BadName(_) => error(StatusCode::BAD_REQUEST, codes::BAD_NAME, e),
        GroupError::Read(r) => read_error(r),
        GroupError::Catalog(_) => internal(e),
    }
}

fn parse_start(from: Option<&str>) -> Result<Start, Response> {
    Start::parse(from.unwrap_or("start")).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            codes::BAD_REQUEST,
            format!("from: {e}"),
        )
    })
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
    // The slot is taken before anything is opened, so a refused follow costs nothing.
    let slot = match follow.then(|| FollowSlot::take(&hub)).transpose() {
        Ok(slot) => slot,
        Err(refused) => return refused,
    };
    let h = hub.clone();
    let opened =
        tokio::task::spawn_blocking(move || StreamReader::open(h, &stream, start, q.key)).await;
    let mut reader = match opened {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return read_error(e),
        Err(e) => return internal(e),
    };
    if let Some(slot) = slot {
        return follow_response(reader, limit, slot);
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
        Err(e) => return internal(e),
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

/// A follow response's place under `read.follows_max`, given back when the response ends.
struct FollowSlot(Arc<Hub>);

impl FollowSlot {
    /// A slot, or the 503 that names the limit.
    fn take(hub: &Arc<Hub>) -> Result<FollowSlot, Response> {
        let st = hub.streams().read_state();
        let max = u64::from(st.config.follows_max);
        let before = st.follows_active.fetch_add(1, Ordering::AcqRel);
        if before < max {
            return Ok(FollowSlot(hub.clone()));
        }
        st.follows_active.fetch_sub(1, Ordering::AcqRel);
        st.follows_refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            follows_max = max,
            "follow request refused: read.follows_max follow responses are open"
        );
        let mut resp = error_with(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::FOLLOWS_MAX,
            format!("too many follow readers: {max} are open (read.follows_max)"),
            serde_json::json!({ "limit": "read.follows_max", "max": max }),
        );
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        Err(resp)
    }
}

impl Drop for FollowSlot {
    fn drop(&mut self) {
        let st = self.0.streams().read_state();
        st.follows_active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One NDJSON chunk queued for a follow client, holding its share of the client's buffer
/// (`read.follow_buffer_bytes_max`) until the HTTP server takes it.
struct Queued {
    bytes: Vec<u8>,
    counted: u64,
    hub: Arc<Hub>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Queued {
    fn drop(&mut self) {
        let st = self.hub.streams().read_state();
        st.follow_buffered_bytes
            .fetch_sub(self.counted, Ordering::Relaxed);
    }
}

/// What a follow response's producer hands its body: queued chunks, and how it ended. The
/// producer can empty it (a stalled client's chunks are freed at once, not when the
/// connection finally goes), which a channel would not allow.
#[derive(Default)]
struct Outbox {
    state: std::sync::Mutex<OutboxState>,
    /// Something was queued, or the follow ended.
    ready: tokio::sync::Notify,
    /// The body was dropped: the client went away.
    gone: tokio::sync::Notify,
}

#[derive(Default)]
struct OutboxState {
    queue: std::collections::VecDeque<Queued>,
    /// `Some(None)`: ended normally; `Some(Some(why))`: ended with an error for the client.
    end: Option<Option<String>>,
    /// The last line of a follow ended by the hub's shutdown ([`shutdown_line`]), sent after
    /// the queue; it is a few bytes, outside the client's buffer bound.
    tail: Option<Vec<u8>>,
    gone: bool,
}

impl Outbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, q: Queued) {
        self.lock().queue.push_back(q);
        self.ready.notify_one();
    }

    /// Ends the follow normally, with `line` as its last line after what is queued.
    fn end_with_line(&self, line: Vec<u8>) {
        self.lock().tail = Some(line);
        self.end(None);
    }

    /// Ends the follow; `failed` drops whatever is still queued and fails the response.
    fn end(&self, failed: Option<String>) {
        let mut st = self.lock();
        if failed.is_some() {
            st.queue.clear();
        }
        st.end.get_or_insert(failed);
        drop(st);
        self.ready.notify_one();
    }

    fn is_gone(&self) -> bool {
        self.lock().gone
    }

    /// The next item for the body: a chunk, the error that ends it, or `None` at its end.
    async fn next(&self) -> Option<Result<Vec<u8>, std::io::Error>> {
        loop {
            let ready = self.ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            {
                let mut st = self.lock();
                if let Some(mut q) = st.queue.pop_front() {
                    // The chunk leaves the buffer here: its permit and count go with `q`.
                    return Some(Ok(std::mem::take(&mut q.bytes)));
                }
                match st.end.take() {
                    Some(Some(why)) => {
                        st.end = Some(None);
                        return Some(Err(std::io::Error::other(why)));
                    }
                    Some(None) => {
                        st.end = Some(None);
                        return st.tail.take().map(Ok);
                    }
                    None => {}
                }
            }
            ready.await;
        }
    }
}

/// The body's handle on the outbox; dropping it (the client went away) tells the producer.
struct BodyEnd(Arc<Outbox>);

impl Drop for BodyEnd {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.gone = true;
        st.queue.clear();
        drop(st);
        self.0.gone.notify_one();
    }
}

/// The last line of a follow response the hub ended because it is shutting down, so that a
/// client can tell it from a lost connection and resume at `next_offset` (a `from=`):
/// `{"end":"hub_shutting_down","code":"HUB_SHUTTING_DOWN","error":..,"next_offset":N}`.
/// Record lines never carry `end`.
pub fn shutdown_line(next_offset: u64) -> Vec<u8> {
    let line = serde_json::json!({
        "end": "hub_shutting_down",
        "code": codes::HUB_SHUTTING_DOWN,
        "error": "the hub is shutting down; reconnect and resume from next_offset",
        "next_offset": next_offset,
    });
    let mut out = serde_json::to_vec(&line).expect("a JSON value serializes");
    out.push(b'\n');
    out
}

/// Streams records as they commit until the client goes away (or `limit` records). At most
/// `read.follow_buffer_bytes_max` of NDJSON waits for the client (plus the chunk the server
/// is writing); a client that takes nothing for `read.follow_stall_timeout` is cut off.
fn follow_response(reader: StreamReader, limit: Option<usize>, slot: FollowSlot) -> Response {
    let outbox = Arc::new(Outbox::default());
    tokio::spawn(follow_task(reader, limit, slot, outbox.clone()));
    let stream = futures_util::stream::unfold(BodyEnd(outbox), |end| async move {
        let item = end.0.next().await?;
        Some((item, end))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp
}

/// The producer of a follow response: reads chunks bounded in bytes, and waits for buffer
/// room before queueing each (back-pressure), up to the stall timeout.
async fn follow_task(
    mut reader: StreamReader,
    limit: Option<usize>,
    slot: FollowSlot,
    outbox: Arc<Outbox>,
) {
    let hub = slot.0.clone();
    let cfg = hub.streams().read_state().config;
    let buffer = Arc::new(tokio::sync::Semaphore::new(
        usize::try_from(cfg.follow_buffer_bytes_max).unwrap_or(usize::MAX >> 4),
    ));
    let chunk_bytes = (cfg.follow_buffer_bytes_max / FOLLOW_CHUNKS_BUFFERED).max(1);
    let mut shutdown = hub.streams().read_state().shutdown_signal();
    let mut left = limit.unwrap_or(usize::MAX);
    while left > 0 {
        if outbox.is_gone() {
            return;
        }
        if *shutdown.borrow() {
            return outbox.end_with_line(shutdown_line(reader.position()));
        }
        if !reader.has_more() {
            tokio::select! {
                _ = reader.wait(Duration::from_secs(1)) => {}
                _ = shutdown.changed() => {}
            }
            continue;
        }
        let before = reader.position();
        let page = PageLimit {
            records: left.min(FOLLOW_CHUNK),
            bytes: Some(chunk_bytes),
        };
        let read = tokio::task::spawn_blocking(move || {
            let r = reader.read_with(page);
            (reader, r)
        })
        .await;
        let Ok((r, result)) = read else { return };
        reader = r;
        let records = match result {
            Ok(records) => records,
            Err(e) => return outbox.end(Some(e.to_string())),
        };
        if records.is_empty() {
            continue;
        }
        left = left.saturating_sub(records.len());
        let mut chunk = Vec::with_capacity(records.len() * 160);
        for r in &records {
            write_ndjson_line(r, &mut chunk);
        }
        drop(records);
        let queued = tokio::select! {
            q = queue_chunk(&hub, &buffer, chunk, &outbox, &cfg, reader.stream()) => q,
            // Not queued: the client resumes at its first record.
            _ = shutdown.wait_for(|s| *s) => {
                return outbox.end_with_line(shutdown_line(before));
            }
        };
        match queued {
            Some(q) => outbox.push(q),
            None => return,
        }
    }
    outbox.end(None);
    drop(slot);
}

/// Waits for room for `chunk` in the client's buffer. `None` when the client went away, or
/// took nothing for the stall timeout: then what is queued is freed and the response fails.
async fn queue_chunk(
    hub: &Arc<Hub>,
    buffer: &Arc<tokio::sync::Semaphore>,
    chunk: Vec<u8>,
    outbox: &Outbox,
    cfg: &crate::config::ReadConfig,
    stream: crate::catalog::StreamId,
) -> Option<Queued> {
    let st = hub.streams().read_state();
    let counted = (chunk.len() as u64).min(cfg.follow_buffer_bytes_max);
    let permits = u32::try_from(counted).unwrap_or(u32::MAX);
    let acquire = buffer.clone().acquire_many_owned(permits);
    let gone = outbox.gone.notified();
    if outbox.is_gone() {
        return None;
    }
    let permit = tokio::select! {
        p = tokio::time::timeout(cfg.follow_stall_timeout, acquire) => p,
        () = gone => return None,
    };
    let Ok(Ok(permit)) = permit else {
        st.follows_dropped.fetch_add(1, Ordering::Relaxed);
        let queued = cfg.follow_buffer_bytes_max - buffer.available_permits() as u64;
        tracing::warn!(
            stream,
            queued_bytes = queued,
            stall = %humantime::format_duration(cfg.follow_stall_timeout),
            "follow client took nothing for read.follow_stall_timeout with its buffer full (read.follow_buffer_bytes_max); ending its response"
        );
        outbox.end(Some(
            "follow client too slow: nothing taken for read.follow_stall_timeout".into(),
        ));
        return None;
    };
    st.follow_buffered_bytes
        .fetch_add(counted, Ordering::Relaxed);
    Some(Queued {
        bytes: chunk,
        counted,
        hub: hub.clone(),
        _permit: permit,
    })
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
        Err(e) => internal(e),
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
        Err(e) => return internal(e),
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
        Err(e) => internal(e),
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
        Err(e) => return internal(e),
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
        Some(None) => {
            return error(
                StatusCode::BAD_REQUEST,
                codes::BAD_REQUEST,
                "checkpoint must be S:O,S:O",
            );
        }
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
        Err(e) => return internal(e),
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
        return error(
            StatusCode::BAD_REQUEST,
            codes::BAD_REQUEST,
            "positions must be S:O,S:O",
        );
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
        Err(e) => internal(e),
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
