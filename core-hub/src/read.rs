//! Reading committed records from the WAL through the block index, and the NDJSON format.
//!
//! A stream's records are found through the catalog's block index (stream, hub offset) and
//! read from the WAL frame each row points at, so reading never scans the log. Every frame is
//! checked against its index row after reading (checksum, device, epoch, seqs, offsets): the
//! pair of the checks the writer made before writing. Readers only read below the stream's
//! readable end, which the stream manager publishes once a commit is routed into segments
//! (see [`crate::streams`]).
//!
//! [`read_records`] is the paging reader behind `from=<hub offset>`; [`scan`] / [`scan_in`]
//! is the loop every reader shares (records API, [`crate::streams::reader::StreamReader`],
//! reader groups, `core-hub read`); the NDJSON line format ([`write_ndjson_line`]) is the
//! stable surface.
//!
//! Read-through: once tiering evicted WAL files, offsets below the stream's tier-1 start
//! (`evicted_end`) are read from tier 2 inside the same loop (the block rows stay in the
//! index, their files are gone), filtered exactly like tier-1 records, and reading continues
//! in tier 1 at that offset. Both tiers serve the same fields: tier-1 records leave out the
//! internal fields tier 2 never stores ([`crate::tiering::is_tiered_field`]). Blocks the scrubber quarantined are skipped, and so is a block that
//! does not decode within the hub's limits: it is quarantined on the spot (`crate::poison`).
//!
//! Bounds ([`ReadState`], `[read]` in the config): a page holds at most as many records as its
//! caller asks for and stops before its records' decoded size ([`ReadRecord::decoded_bytes`])
//! would pass `read.page_bytes_max` (its [`PageLimit`]), but always holds at least one record.
//! The offset it returns is that of the first record it did not examine, so the next page
//! starts exactly there: nothing is skipped or repeated. The block cache is bounded by
//! `read.cache_bytes_max`, follow responses by `read.follows_max` and
//! `read.follow_buffer_bytes_max` (`crate::streams::api`).

use crate::catalog::BlockRow;
use crate::ingest::Hub;
use crate::streams::reader::DecodedBlock;
use crate::streams::{Graph, SegmentId, StreamSnapshot, key_point};
use crate::wal::{KIND_BLOCK, WalReadError};
use serde::Serialize;
use serde::ser::SerializeMap;
use std::sync::Arc;
use sync::record::{Record, Value};
use thiserror::Error;

/// Most blocks fetched from the index per query.
const INDEX_PAGE_BLOCKS: usize = 256;

/// How much one page may hold: `records`, and records whose decoded size stays within
/// `bytes` (`None`: the hub's `read.page_bytes_max`). A page always holds at least one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLimit {
    pub records: usize,
    pub bytes: Option<u64>,
}

impl From<usize> for PageLimit {
    fn from(records: usize) -> Self {
        PageLimit {
            records,
            bytes: None,
        }
    }
}

/// The room left in a page being filled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Room {
    records_max: usize,
    bytes_max: u64,
    taken: usize,
    bytes: u64,
    /// A record was left for the next page because it did not fit.
    cut_by_bytes: bool,
}

impl Room {
    pub(crate) fn new(limit: PageLimit, default_bytes: u64) -> Room {
        Room {
            records_max: limit.records,
            bytes_max: limit.bytes.unwrap_or(default_bytes),
            taken: 0,
            bytes: 0,
            cut_by_bytes: false,
        }
    }

    /// Whether a record of `size` decoded bytes goes in (the first one always does).
    pub(crate) fn fits(&self, size: u64) -> bool {
        self.taken == 0
            || self.bytes.saturating_add(size) <= self.bytes_max
            || mutation::page_bound_off()
    }

    pub(crate) fn take(&mut self, size: u64) {
        self.taken += 1;
        self.bytes = self.bytes.saturating_add(size);
    }

    pub(crate) fn full(&self) -> bool {
        self.taken >= self.records_max || self.bytes >= self.bytes_max
    }

    /// The same page's remaining room, as a limit for a sub-reader.
    pub(crate) fn left(&self) -> PageLimit {
        PageLimit {
            records: self.records_max.saturating_sub(self.taken),
            bytes: Some(self.bytes_max.saturating_sub(self.bytes)),
        }
    }
}

/// Test-only mutation switch (cargo feature `fault-injection`, never in a release build):
/// with the page bound off, pages take records past `read.page_bytes_max` (up to their record
/// limit), so that `core-hub/tests/read_bounds_mutation.rs` can show the page tests catch it.
/// Process-wide: only that one-test binary turns it on.
pub mod mutation {
    #[cfg(feature = "fault-injection")]
    static OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Turns the page byte bound off (`true`) or on again.
    #[cfg(feature = "fault-injection")]
    pub fn set_page_bound_off(off: bool) {
        OFF.store(off, std::sync::atomic::Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn page_bound_off() -> bool {
        #[cfg(feature = "fault-injection")]
        {
            OFF.load(std::sync::atomic::Ordering::Relaxed)
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            false
        }
    }
}

/// The decoded size a record counts in a page: as `sync::decoded` counts it in a block, plus
/// the device name each read record carries, over the fields readers get ([`reader_fields`]),
/// so a record counts the same read from either tier.
pub fn record_bytes(device: &str, r: &Record) -> u64 {
    parts_bytes(device, &r.key, &r.fields) + tags_bytes(&r.tags)
}

/// What a record's tags count in a page, as `sync::decoded` counts them in a block.
pub fn tags_bytes(tags: &[(String, String)]) -> u64 {
    let per_tag =
        |(n, v): &(String, String)| sync::decoded::TAG_OVERHEAD_BYTES + (n.len() + v.len()) as u64;
    tags.iter().map(per_tag).sum()
}

/// [`record_bytes`] of a record given by its parts.
pub fn parts_bytes(device: &str, key: &str, fields: &[(String, Value)]) -> u64 {
    let fields: u64 = fields
        .iter()
        .filter(|(n, _)| crate::tiering::is_tiered_field(n))
        .map(|(n, v)| {
            sync::decoded::FIELD_OVERHEAD_BYTES + (n.len() + sync::decoded::payload_len(v)) as u64
        })
        .sum();
    sync::decoded::RECORD_OVERHEAD_BYTES + (key.len() + device.len()) as u64 + fields
}

/// The `[read]` bounds and the counters behind their metrics, one per hub (held by the
/// stream manager).
#[derive(Debug, Default)]
pub struct ReadState {
    pub config: crate::config::ReadConfig,
    /// Follow responses open now.
    pub follows_active: std::sync::atomic::AtomicU64,
    /// Follow requests refused at `read.follows_max`.
    pub follows_refused: std::sync::atomic::AtomicU64,
    /// Follow responses ended because their client took nothing for the stall timeout.
    pub follows_dropped: std::sync::atomic::AtomicU64,
    /// NDJSON bytes queued in follow responses, not yet taken by the HTTP server.
    pub follow_buffered_bytes: std::sync::atomic::AtomicU64,
    /// Pages cut short by `read.page_bytes_max`.
    pub pages_cut_by_bytes: std::sync::atomic::AtomicU64,
    /// `true` once the hub is shutting down: every follow response then ends with its
    /// shutdown line (`crate::streams::api`), so the HTTP server's drain is bounded.
    shutting_down: tokio::sync::watch::Sender<bool>,
}

impl ReadState {
    pub fn new(config: crate::config::ReadConfig) -> ReadState {
        ReadState {
            config,
            ..ReadState::default()
        }
    }

    /// Ends every follow response, open or opened from now on.
    pub fn shut_down(&self) {
        self.shutting_down.send_replace(true);
    }

    /// Resolves to `true` once [`ReadState::shut_down`] was called (a follow response selects
    /// on it beside its waits).
    pub fn shutdown_signal(&self) -> tokio::sync::watch::Receiver<bool> {
        self.shutting_down.subscribe()
    }
}

/// The `tributary_hub_read_*` series.
pub fn render_metrics(out: &mut String, hub: &Hub) {
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let st = hub.streams().read_state();
    let cache = hub.streams().cache();
    let series: [(&str, &str, &str, u64); 8] = [
        (
            "tributary_hub_read_cache_bytes",
            "gauge",
            "Decoded bytes held by the readers' block cache (read.cache_bytes_max).",
            cache.bytes(),
        ),
        (
            "tributary_hub_read_cache_blocks",
            "gauge",
            "Blocks held by the readers' block cache.",
            cache.len() as u64,
        ),
        (
            "tributary_hub_read_cache_bytes_max",
            "gauge",
            "The block cache's bound, read.cache_bytes_max.",
            st.config.cache_bytes_max,
        ),
        (
            "tributary_hub_read_follows_active",
            "gauge",
            "Follow responses open now (read.follows_max).",
            st.follows_active.load(Relaxed),
        ),
        (
            "tributary_hub_read_follows_refused_total",
            "counter",
            "Follow requests refused with 503 at read.follows_max.",
            st.follows_refused.load(Relaxed),
        ),
        (
            "tributary_hub_read_follows_dropped_total",
            "counter",
            "Follow responses ended because their client took nothing for read.follow_stall_timeout.",
            st.follows_dropped.load(Relaxed),
        ),
        (
            "tributary_hub_read_follow_buffered_bytes",
            "gauge",
            "NDJSON bytes queued in follow responses (each at most read.follow_buffer_bytes_max).",
            st.follow_buffered_bytes.load(Relaxed),
        ),
        (
            "tributary_hub_read_pages_cut_by_bytes_total",
            "counter",
            "Reader pages that stopped at read.page_bytes_max.",
            st.pages_cut_by_bytes.load(Relaxed),
        ),
    ];
    for (name, kind, help, v) in series {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
}

/// Why a read failed.
#[derive(Debug, Error)]
pub enum ReadError {
    #[error("unknown stream `{0}`")]
    UnknownStream(String),
    #[error("catalog: {0}")]
    Catalog(#[from] crate::catalog::CatalogError),
    #[error(transparent)]
    Wal(#[from] WalReadError),
    #[error("block at hub offset {offset} does not match its index row: {what}")]
    Mismatch { offset: u64, what: String },
    #[error("bad stream cut: {0}")]
    Cut(crate::streams::cut::CutError),
    /// The block does not decode within the limits and was quarantined; readers skip it.
    #[error(transparent)]
    Poison(#[from] crate::poison::Poison),
    #[error("{0}")]
    Internal(String),
}

/// One record as readers see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadRecord {
    pub device: String,
    pub epoch: u64,
    pub seq: u64,
    pub key: String,
    /// The record's tags, in the producer's order (from tier 1) or the stream's column order
    /// (from tier 2).
    pub tags: Vec<(String, String)>,
    pub ts: i64,
    pub fields: Vec<(String, Value)>,
    /// The hub offset within the stream.
    pub offset: u64,
    /// Hub ingest time (ns), monotonic across the log.
    pub ingest_ts: i64,
    /// The segment the record belongs to.
    pub segment: SegmentId,
}

impl ReadRecord {
    /// The decoded size this record counts in a page ([`record_bytes`]).
    pub fn decoded_bytes(&self) -> u64 {
        parts_bytes(&self.device, &self.key, &self.fields) + tags_bytes(&self.tags)
    }
}

/// A page of records and where the next page starts.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadPage {
    pub records: Vec<ReadRecord>,
    /// The hub offset to pass as `from` for the next page.
    pub next: u64,
}

/// Reads up to `limit` records of `stream` with hub offset >= `from`, below its readable end,
/// within `read.page_bytes_max` (see [`read_records_with`]).
pub fn read_records(
    hub: &Hub,
    stream: &str,
    from: u64,
    limit: usize,
) -> Result<ReadPage, ReadError> {
    read_records_with(hub, stream, from, limit.into())
}

/// As [`read_records`], within `limit`; `next` is where the next page starts exactly.
pub fn read_records_with(
    hub: &Hub,
    stream: &str,
    from: u64,
    limit: PageLimit,
) -> Result<ReadPage, ReadError> {
    let sid = hub
        .lookup_stream(stream)
        .ok_or_else(|| ReadError::UnknownStream(stream.to_string()))?;
    let snap = hub
        .streams()
        .snapshot(sid)
        .map_err(|e| ReadError::Internal(e.to_string()))?;
    let mut records = Vec::new();
    let next = scan(
        hub,
        &snap,
        from,
        snap.end,
        limit,
        |_, _, _, _, _| true,
        &mut records,
    )?;
    Ok(ReadPage { records, next })
}

/// Visits the records of `snap`'s stream with offsets in `[from, to)` (clamped to the
/// readable end) in offset order, pushing those `accept(graph, segment, offset, point,
/// record)` keeps, until `limit` is reached (records, or their decoded bytes). Returns the
/// offset after the last one examined: the first offset the next page must look at.
pub fn scan(
    hub: &Hub,
    snap: &StreamSnapshot,
    from: u64,
    to: u64,
    limit: impl Into<PageLimit>,
    accept: impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> Result<u64, ReadError> {
    scan_in(hub, snap, None, from, to, limit, accept, out)
}

/// As [`scan`]; `segment` is a hint that `accept` keeps only that segment's records, so
/// tier-2 reads fetch only its chunks (a reader group's segment reads).
///
/// Offsets below the stream's tier-1 start (`evicted_end`, once tiering evicted WAL files)
/// are read from tier 2 ([`crate::tiering::read::TierReader`], with read-ahead) and filtered
/// exactly like tier-1 records (graph location, then `accept`); reading hands over to tier 1
/// at that offset. A tier-1 block that fails to load because eviction removed its file while
/// this reader held its index row is read again through tier 2.
#[allow(clippy::too_many_arguments)]
pub fn scan_in(
    hub: &Hub,
    snap: &StreamSnapshot,
    segment: Option<SegmentId>,
    from: u64,
    to: u64,
    limit: impl Into<PageLimit>,
    mut accept: impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> Result<u64, ReadError> {
    let to = to.min(snap.end);
    let default_bytes = hub.streams().read_state().config.page_bytes_max;
    let mut room = Room::new(limit.into(), default_bytes);
    let mut next = from;
    let result = scan_steps(
        hub,
        snap,
        segment,
        &mut next,
        to,
        &mut room,
        &mut accept,
        out,
    );
    if room.cut_by_bytes {
        let st = hub.streams().read_state();
        st.pages_cut_by_bytes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    result.map(|()| next)
}

/// The body of [`scan_in`]: tier 2 below the tier-1 start, then tier 1, until `room` is full
/// or `to` is reached. `*next` is always the first offset not examined yet.
#[allow(clippy::too_many_arguments)]
fn scan_steps(
    hub: &Hub,
    snap: &StreamSnapshot,
    segment: Option<SegmentId>,
    next: &mut u64,
    to: u64,
    room: &mut Room,
    accept: &mut impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> Result<(), ReadError> {
    let tiering = hub.streams().tiering();
    while *next < to && !room.full() {
        let tier1_start = match &tiering {
            Some(_) => crate::tiering::store::state(hub.catalog(), snap.stream)?.evicted_end,
            None => 0,
        };
        if *next < tier1_start {
            let t = tiering.clone().expect("tier-1 start is 0 without tiering");
            let bound = tier1_start.min(to);
            let moved = scan_tier2(t, snap, segment, *next, bound, room, accept, out)?;
            if room.cut_by_bytes || room.full() {
                *next = moved;
                return Ok(());
            }
            if moved <= *next {
                return Err(ReadError::Internal(format!(
                    "tier 2 read of stream {} made no progress at offset {}",
                    snap.stream, *next
                )));
            }
            *next = moved;
            continue;
        }
        match scan_tier1(hub, snap, next, to, room, accept, out) {
            Ok(()) => return Ok(()),
            Err(e) => {
                // Eviction may have removed the file after the index rows were fetched: the
                // records are in tier 2 now, read them there.
                let evicted = match &tiering {
                    Some(_) => {
                        crate::tiering::store::state(hub.catalog(), snap.stream)?.evicted_end
                    }
                    None => 0,
                };
                if matches!(e, ReadError::Wal(_)) && *next < evicted {
                    continue;
                }
                return Err(e);
            }
        }
    }
    Ok(())
}

/// The tier-1 part of [`scan_in`]: from `*next` (at or past the tier-1 start) through the
/// block index and the WAL. `*next` stays the offset after the last record examined, also
/// when an error interrupts, and a record that does not fit the page is not examined.
fn scan_tier1(
    hub: &Hub,
    snap: &StreamSnapshot,
    next: &mut u64,
    to: u64,
    room: &mut Room,
    accept: &mut impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> Result<(), ReadError> {
    let graph = &snap.graph;
    while *next < to && !room.full() {
        let rows = hub
            .catalog()
            .blocks_from(snap.stream, *next, INDEX_PAGE_BLOCKS)?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            if row.hub_offset_base >= to {
                *next = to;
                return Ok(());
            }
            // The scrubber found this block damaged: skip it, serve the rest of the stream.
            if crate::scrub::is_quarantined(hub, row) {
                *next = (*next).max((row.hub_offset_base + row.count()).min(to));
                continue;
            }
            let b = match load_block(hub, row) {
                // Quarantined just now: skipped like the scrubber's finds.
                Err(ReadError::Poison(_)) => {
                    *next = (*next).max((row.hub_offset_base + row.count()).min(to));
                    continue;
                }
                other => other?,
            };
            if !scan_block(&b, row, graph, next, to, room, accept, out) {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// The records of one loaded block from `*next` on. Returns `false` once the page is done
/// (full, or `to` reached).
#[allow(clippy::too_many_arguments)]
fn scan_block(
    b: &DecodedBlock,
    row: &BlockRow,
    graph: &Graph,
    next: &mut u64,
    to: u64,
    room: &mut Room,
    accept: &mut impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> bool {
    let first = next.saturating_sub(row.hub_offset_base) as usize;
    for i in first..b.records.len() {
        let o = row.hub_offset_base + i as u64;
        if o >= to {
            *next = to;
            return false;
        }
        let (p, r) = (b.points[i], &b.records[i]);
        let size = record_bytes(&b.device, r);
        if !room.fits(size) {
            // Not examined: the next page starts with it.
            room.cut_by_bytes = true;
            *next = o;
            return false;
        }
        *next = o + 1;
        let seg = graph.locate(o, p);
        if accept(graph, seg, o, p, r) {
            room.take(size);
            out.push(ReadRecord {
                device: b.device.clone(),
                epoch: row.epoch,
                seq: row.first_seq + i as u64,
                key: r.key.clone(),
                tags: r.tags.clone(),
                ts: r.ts,
                fields: reader_fields(&r.fields),
                offset: o,
                ingest_ts: b.ingest_ts,
                segment: seg,
            });
            if room.full() {
                return false;
            }
        }
    }
    true
}

/// The fields of a tier-1 record that readers see: those tier 2 keeps
/// ([`crate::tiering::is_tiered_field`]), so a record reads the same from either tier. The
/// agent's bookkeeping fields (`_mqtt_digest`, `_idempotency`) stay in the WAL, which is where
/// the hub's own uses of them read them.
fn reader_fields(fields: &[(String, Value)]) -> Vec<(String, Value)> {
    fields
        .iter()
        .filter(|(name, _)| crate::tiering::is_tiered_field(name))
        .cloned()
        .collect()
}

/// Tier-2 records fetched per [`crate::tiering::read::TierReader`] page.
const TIER2_PAGE: usize = 4096;

/// The tier-2 part of [`scan_in`]: offsets `[from, bound)`, all below the tier-1 start.
/// Returns the offset after the last record examined (`bound` once it is exhausted).
#[allow(clippy::too_many_arguments)]
fn scan_tier2(
    tiering: Arc<crate::tiering::Tiering>,
    snap: &StreamSnapshot,
    segment: Option<SegmentId>,
    from: u64,
    bound: u64,
    room: &mut Room,
    accept: &mut impl FnMut(&Graph, SegmentId, u64, u32, &Record) -> bool,
    out: &mut Vec<ReadRecord>,
) -> Result<u64, ReadError> {
    let name = tiering
        .hub()
        .stream_name(snap.stream)
        .ok_or_else(|| ReadError::UnknownStream(format!("#{}", snap.stream)))?;
    let graph = &snap.graph;
    let mut next = from;
    let mut reader =
        crate::tiering::read::TierReader::new(tiering, &name, segment.map(u64::from), from)
            .map_err(|e| ReadError::Internal(format!("tier 2: {e}")))?
            .until(bound);
    while next < bound && !room.full() {
        let left = room.left();
        let page_limit = PageLimit {
            records: TIER2_PAGE,
            // A page of tier-2 records needs room for at least one, whatever is left.
            bytes: left.bytes.map(|b| b.max(1)),
        };
        let page = block_on_tier2(reader.next_page_with(page_limit))
            .map_err(|e| ReadError::Internal(format!("tier 2: {e}")))?;
        let position = reader.position();
        if page.records.is_empty() {
            // Nothing committed past here below the tier-1 start (a segment's chunks end,
            // or retention removed the range): the bound is reached.
            return Ok(bound.max(next));
        }
        for tr in page.records {
            let o = tr.offset;
            if o >= bound {
                return Ok(bound);
            }
            if o < next {
                continue;
            }
            let r = Record {
                tags: Vec::new(),
                key: tr.key,
                ts: tr.ts,
                fields: tr.fields,
            };
            let size = record_bytes(&tr.device, &r);
            if !room.fits(size) {
                room.cut_by_bytes = true;
                return Ok(o);
            }
            next = o + 1;
            let p = key_point(&r.key);
            let seg = graph.locate(o, p);
            if accept(graph, seg, o, p, &r) {
                room.take(size);
                out.push(ReadRecord {
                    device: tr.device,
                    epoch: tr.epoch,
                    seq: tr.seq,
                    key: r.key,
                    tags: r.tags,
                    ts: r.ts,
                    fields: r.fields,
                    offset: o,
                    ingest_ts: tr.ingest_ts,
                    segment: seg,
                });
                if room.full() {
                    return Ok(next);
                }
            }
        }
        // A segment read skips offsets of other segments: they hold nothing for it.
        next = next.max(position.min(bound));
    }
    Ok(next.min(bound).max(from))
}

/// Runs a tier-2 read to completion from synchronous code, whatever the calling context
/// (a blocking thread, a plain thread, or a runtime worker): on a fresh thread, on a small
/// runtime of its own, so it never blocks the caller's runtime from driving it.
fn block_on_tier2<F>(fut: F) -> F::Output
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    let rt = RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tier2-read")
            .enable_all()
            .build()
            .expect("tier-2 read runtime")
    });
    std::thread::scope(|s| {
        s.spawn(|| rt.block_on(fut))
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// The decoded, verified block of `row`, through the stream manager's cache.
pub fn load_block(hub: &Hub, row: &BlockRow) -> Result<Arc<DecodedBlock>, ReadError> {
    let cache = hub.streams().cache();
    let key = (row.wal_file, row.wal_pos);
    if let Some(b) = cache.get(key) {
        return Ok(b);
    }
    let (entry, block) = hub.wal_reader().read(row)?;
    let mismatch = |what: String| ReadError::Mismatch {
        offset: row.hub_offset_base,
        what,
    };
    let same = entry.kind == KIND_BLOCK
        && entry.device == row.device
        && entry.stream == row.stream
        && entry.epoch == row.epoch
        && entry.first_seq == row.first_seq
        && u64::from(entry.count) == row.count()
        && entry.hub_offset_base == row.hub_offset_base;
    if !same {
        return Err(mismatch(format!("entry header {entry:?}")));
    }
    // A block that does not decode within the limits is quarantined, never decoded.
    let decoded = crate::poison::decode_stored(hub, row, &block)?;
    if decoded.header.first_seq != row.first_seq || decoded.records.len() as u64 != row.count() {
        return Err(mismatch("block header differs from the entry".into()));
    }
    let device = hub
        .device_name(row.device)
        .unwrap_or_else(|| format!("#{}", row.device));
    let points = decoded.records.iter().map(|r| key_point(&r.key)).collect();
    let b = Arc::new(DecodedBlock {
        row: row.clone(),
        device,
        ingest_ts: entry.ingest_ts,
        records: decoded.records,
        points,
    });
    cache.put(key, b.clone());
    Ok(b)
}

/// The NDJSON shape of a record.
///
/// `{"device","epoch","seq","key","tags":{name: value},"ts","fields":{name: value},"offset",
/// "ingest_ts","segment"}`, `tags` only when the record has any. Field
/// values: f64 and i64 as JSON numbers (a non-finite f64 as `null`), bool, string, and bytes
/// as an array of numbers 0..=255. Fields keep the producer's order.
#[derive(Serialize)]
struct Line<'a> {
    device: &'a str,
    #[serde(with = "sync::epoch::serde_hex")]
    epoch: u64,
    seq: u64,
    key: &'a str,
    #[serde(skip_serializing_if = "Tags::is_empty")]
    tags: Tags<'a>,
    ts: i64,
    fields: Fields<'a>,
    offset: u64,
    ingest_ts: i64,
    segment: SegmentId,
}

struct Fields<'a>(&'a [(String, Value)]);

struct Tags<'a>(&'a [(String, String)]);

impl Tags<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for Tags<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in self.0 {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

impl Serialize for Fields<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, value) in self.0 {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

/// Appends `r` as one NDJSON line (with its newline) to `out`.
pub fn write_ndjson_line(r: &ReadRecord, out: &mut Vec<u8>) {
    let line = Line {
        device: &r.device,
        epoch: r.epoch,
        seq: r.seq,
        key: &r.key,
        tags: Tags(&r.tags),
        ts: r.ts,
        fields: Fields(&r.fields),
        offset: r.offset,
        ingest_ts: r.ingest_ts,
        segment: r.segment,
    };
    serde_json::to_writer(&mut *out, &line).expect("serialising to a Vec cannot fail");
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndjson_line_shape() {
        let r = ReadRecord {
            tags: Vec::new(),
            device: "d1".into(),
            epoch: 2,
            seq: 3,
            key: "k/1".into(),
            ts: -4,
            fields: vec![
                ("z".into(), Value::F64(1.5)),
                ("a".into(), Value::I64(-7)),
                ("b".into(), Value::Bool(true)),
                ("s".into(), Value::Str("x\"y".into())),
                ("raw".into(), Value::Bytes(vec![0, 255])),
                ("nan".into(), Value::F64(f64::NAN)),
            ],
            offset: 9,
            ingest_ts: 10,
            segment: 4,
        };
        let mut out = Vec::new();
        write_ndjson_line(&r, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            concat!(
                r#"{"device":"d1","epoch":"0000000000000002","seq":3,"key":"k/1","ts":-4,"#,
                r#""fields":{"z":1.5,"a":-7,"b":true,"s":"x\"y","raw":[0,255],"nan":null},"offset":9,"ingest_ts":10,"segment":4}"#,
                "\n"
            )
        );
    }
}
