//! Reading merged streams: from the start, an offset, a hub ingest time or a cut; once or
//! following the readable end.
//!
//! A [`StreamReader`] reads the whole stream in hub offset order, which keeps every key's
//! order (a key lives in one segment at a time, and a successor's records all come after its
//! predecessors' in offset order), and tags each record with its segment. Reader groups read
//! segment by segment instead ([`crate::read::scan`] with a segment filter). Both decode each
//! WAL block once through the shared [`BlockCache`], since readers near the tail all want the
//! same few blocks; the cache is bounded by the blocks' decoded size (`read.cache_bytes_max`).
//!
//! `from=TIME` is hub ingest time, which is monotonic along the log: the first record whose
//! block was committed at or after TIME. Event-time selection (the producer's `ts`) belongs to
//! SQL over the Parquet tier.

use super::cut::{Cut, CutError, CutFilter};
use super::{StreamSnapshot, StreamsError};
use crate::catalog::{BlockRow, StreamId};
use crate::ingest::Hub;
use crate::read::{PageLimit, ReadError, ReadRecord, scan};
use rusqlite::{OptionalExtension, params};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use sync::record::Record;
use thiserror::Error;
use tokio::sync::watch;

/// One WAL block, verified and decoded, with each record's hash point.
#[derive(Debug)]
pub struct DecodedBlock {
    pub row: BlockRow,
    pub device: String,
    pub ingest_ts: i64,
    pub records: Vec<Record>,
    pub points: Vec<u32>,
}

impl DecodedBlock {
    /// The memory this block counts in the cache: its records' decoded size
    /// (`sync::decoded`), their hash points, its device name and a fixed overhead.
    pub fn cached_bytes(&self) -> u64 {
        const FIXED: u64 = 256;
        sync::decoded::records_bytes(&self.records)
            + 4 * self.points.len() as u64
            + self.device.len() as u64
            + FIXED
    }
}

/// Blocks by `(wal_file, wal_pos)` with their sizes, and their insertion order.
#[derive(Debug, Default)]
struct CacheMap {
    blocks: HashMap<(u64, u64), (Arc<DecodedBlock>, u64)>,
    order: VecDeque<(u64, u64)>,
    bytes: u64,
}

/// A FIFO cache of decoded blocks keyed by WAL position, bounded by their decoded size
/// (`read.cache_bytes_max`). A block larger than the whole bound is never cached.
#[derive(Debug)]
pub struct BlockCache {
    bytes_max: u64,
    inner: Mutex<CacheMap>,
}

impl BlockCache {
    pub fn new(bytes_max: u64) -> BlockCache {
        BlockCache {
            bytes_max,
            inner: Mutex::new(CacheMap::default()),
        }
    }

    /// The cached block at `(wal_file, wal_pos)`.
    pub fn get(&self, key: (u64, u64)) -> Option<Arc<DecodedBlock>> {
        let g = self.inner.lock().expect("cache lock");
        g.blocks.get(&key).map(|(b, _)| b.clone())
    }

    /// Caches a block, evicting the oldest until the cache is within its bound.
    pub fn put(&self, key: (u64, u64), b: Arc<DecodedBlock>) {
        let size = b.cached_bytes();
        if size > self.bytes_max {
            return;
        }
        let mut g = self.inner.lock().expect("cache lock");
        match g.blocks.insert(key, (b, size)) {
            Some((_, old)) => g.bytes -= old,
            None => g.order.push_back(key),
        }
        g.bytes += size;
        while g.bytes > self.bytes_max {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some((_, n)) = g.blocks.remove(&old) {
                g.bytes -= n;
            }
        }
        assert!(
            g.bytes <= self.bytes_max,
            "the block cache stays within its bound"
        );
        assert_eq!(
            g.blocks.len(),
            g.order.len(),
            "every cached block is in the order"
        );
    }

    /// Decoded bytes held now (at most `read.cache_bytes_max`).
    pub fn bytes(&self) -> u64 {
        self.inner.lock().expect("cache lock").bytes
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("cache lock").blocks.len()
    }

    /// Whether the cache holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound, `read.cache_bytes_max`.
    pub fn bytes_max(&self) -> u64 {
        self.bytes_max
    }
}

/// Where a reader starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    Beginning,
    /// A hub offset (the paging `from` of the records endpoint).
    Offset(u64),
    /// Hub ingest time, ns since the Unix epoch.
    Time(i64),
    Cut(Cut),
}

/// Why a `from` value is not a start.
#[derive(Debug, Error)]
pub enum StartError {
    #[error("from=`{0}` is not `start`, a hub offset, an RFC 3339 time or a stream cut")]
    Unrecognised(String),
    #[error("from=`{0}`: {1}")]
    BadCut(String, CutError),
}

impl Start {
    /// Parses `start`, a hub offset, an RFC 3339 time (hub ingest time) or a cut token.
    pub fn parse(s: &str) -> Result<Start, StartError> {
        if s.is_empty() || s == "start" {
            return Ok(Start::Beginning);
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            return s
                .parse()
                .map(Start::Offset)
                .map_err(|_| StartError::Unrecognised(s.into()));
        }
        if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
            return t
                .timestamp_nanos_opt()
                .map(Start::Time)
                .ok_or_else(|| StartError::Unrecognised(s.into()));
        }
        if s.starts_with('A') {
            return Cut::parse(s)
                .map(Start::Cut)
                .map_err(|e| StartError::BadCut(s.into(), e));
        }
        Err(StartError::Unrecognised(s.into()))
    }
}

/// The first offset whose block was committed at or after `ts` (hub ingest time), or `end`.
/// Ingest time never decreases along a stream, so this is a binary search over the block
/// index: a few indexed lookups, no scan.
pub fn offset_at_time(hub: &Hub, sid: StreamId, ts: i64, end: u64) -> Result<u64, ReadError> {
    let (mut lo, mut hi) = (0u64, end);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let block = hub.catalog().with_read_conn(|c| {
            c.query_row(
                "SELECT hub_offset_base, count, ingest_ts FROM blocks
                 WHERE stream = ?1 AND hub_offset_base <= ?2 ORDER BY hub_offset_base DESC LIMIT 1",
                params![i64::from(sid), mid as i64],
                |r| {
                    Ok((
                        r.get::<_, i64>(0)? as u64,
                        r.get::<_, i64>(1)? as u64,
                        r.get::<_, i64>(2)?,
                    ))
                },
            )
            .optional()
        });
        let block = block.map_err(crate::catalog::CatalogError::from)?;
        let Some((base, count, its)) = block else {
            // Below the first indexed block (evicted history): start there.
            lo = mid + 1;
            continue;
        };
        if its >= ts {
            hi = base;
        } else {
            lo = base + count;
        }
    }
    Ok(lo.min(end))
}

/// Reads one stream in hub offset order from a start, optionally only one key.
#[derive(Debug)]
pub struct StreamReader {
    hub: Arc<Hub>,
    sid: StreamId,
    next: u64,
    filter: Option<CutFilter>,
    key: Option<String>,
    rx: watch::Receiver<Arc<StreamSnapshot>>,
}

impl StreamReader {
    /// A reader of `stream` from `start`; `key` keeps only that routing key's records.
    pub fn open(
        hub: Arc<Hub>,
        stream: &str,
        start: Start,
        key: Option<String>,
    ) -> Result<StreamReader, ReadError> {
        let sid = hub
            .lookup_stream(stream)
            .ok_or_else(|| ReadError::UnknownStream(stream.to_string()))?;
        let rx = hub.streams().subscribe(sid).map_err(streams_err)?;
        let snap = rx.borrow().clone();
        let (next, filter) = match start {
            Start::Beginning => (0, None),
            Start::Offset(o) => (o, None),
            Start::Time(ts) => (offset_at_time(&hub, sid, ts, snap.end)?, None),
            Start::Cut(cut) => {
                cut.check(sid, &snap.graph).map_err(ReadError::Cut)?;
                (cut.min_offset(&snap.graph), Some(CutFilter::new(cut)))
            }
        };
        Ok(StreamReader {
            hub,
            sid,
            next,
            filter,
            key,
            rx,
        })
    }

    /// The stream id.
    pub fn stream(&self) -> StreamId {
        self.sid
    }

    /// The next hub offset the reader will look at.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// A cut holding the reader's position: reading from it yields exactly what this reader
    /// has not returned yet.
    pub fn cut(&mut self) -> Cut {
        let snap = self.rx.borrow().clone();
        match &mut self.filter {
            Some(f) => f.advanced(&snap.graph, self.next),
            None => Cut::at_offset(self.sid, &snap.graph, self.next),
        }
    }

    /// Up to `limit` records after the position, up to the readable end, within
    /// `read.page_bytes_max` (blocking I/O: call from a blocking thread in async code).
    pub fn read(&mut self, limit: usize) -> Result<Vec<ReadRecord>, ReadError> {
        self.read_with(limit.into())
    }

    /// As [`StreamReader::read`], within `limit` (records and decoded bytes); the position
    /// moves to the first record not returned, so the next read continues exactly there.
    pub fn read_with(&mut self, limit: PageLimit) -> Result<Vec<ReadRecord>, ReadError> {
        let snap = self.rx.borrow().clone();
        let mut out = Vec::new();
        let key = self.key.as_deref();
        let filter = &mut self.filter;
        self.next = scan(
            &self.hub,
            &snap,
            self.next,
            snap.end,
            limit,
            |g, seg, o, _p, r| {
                key.is_none_or(|k| r.key == k) && filter.as_mut().is_none_or(|f| f.after(g, seg, o))
            },
            &mut out,
        )?;
        Ok(out)
    }

    /// Whether records past the position are readable now.
    pub fn has_more(&self) -> bool {
        self.rx.borrow().end > self.next
    }

    /// Waits until the readable end moves past the position, up to `timeout`. Returns whether
    /// there is more to read.
    pub async fn wait(&mut self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.has_more() {
                return true;
            }
            match tokio::time::timeout_at(deadline, self.rx.changed()).await {
                Ok(Ok(())) => continue,
                _ => return self.has_more(),
            }
        }
    }
}

fn streams_err(e: StreamsError) -> ReadError {
    match e {
        StreamsError::Catalog(c) => ReadError::Catalog(c),
        other => ReadError::Internal(other.to_string()),
    }
}
