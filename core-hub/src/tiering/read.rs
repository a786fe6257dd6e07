//! Read-through: reading a stream from an offset that tier 1 no longer holds.
//!
//! Offsets below the stream's `evicted_end` come from committed tier-2 chunks, found through
//! the catalog's chunk rows (no listing), with read-ahead: while one chunk is being consumed
//! the next [`READ_AHEAD`] are fetched and decoded in the background. Once the position
//! reaches a chunk that tier 1 still fully holds (or the end of the committed chunks), reading
//! hands over to tier 1 ([`crate::read::read_records`]). Both tiers are addressed by stream
//! offset and chunks cover contiguous offset ranges, so the hand-over has no gap and no
//! duplicate.
//!
//! Differences a reader can see between the tiers: a record from tier 2 lists its fields in
//! the stream's column order rather than the producer's, and its `ingest_ts` has microsecond
//! precision.

use super::Tiering;
use super::store::{self, ChunkRow};
use crate::catalog::{CatalogError, StreamId};
use crate::read::{ReadError, ReadPage, ReadRecord};
use std::collections::VecDeque;
use std::sync::Arc;
use thiserror::Error;
use tier::TierRecord;

/// Chunks fetched ahead of the one being read.
pub const READ_AHEAD: usize = 2;

/// Why a read-through failed.
#[derive(Debug, Error)]
pub enum ReadThroughError {
    #[error("unknown stream `{0}`")]
    UnknownStream(String),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("tier 1: {0}")]
    Tier1(#[from] ReadError),
    #[error("tier 2: {0}")]
    Tier2(#[from] tier::GetError),
    #[error(
        "tier 2 has no committed chunk at offset {offset} of `{stream}`, below the tier-1 start {evicted_end}"
    )]
    Missing {
        stream: String,
        offset: u64,
        evicted_end: u64,
    },
}

type Fetch = tokio::task::JoinHandle<Result<Vec<TierRecord>, tier::GetError>>;

/// A cursor over one stream (optionally one segment) that reads tier 2, then tier 1.
pub struct TierReader {
    tiering: Arc<Tiering>,
    stream: String,
    sid: StreamId,
    segment: Option<u64>,
    next: u64,
    /// Reading stops before this offset ([`TierReader::until`]).
    end: u64,
    /// The chunk being consumed (for a whole-stream read, every chunk of one plan range,
    /// merged in offset order; the row then spans them): its row and its remaining records
    /// with their segments.
    current: Option<(ChunkRow, VecDeque<(u64, TierRecord)>)>,
    /// Chunks being fetched, in offset order.
    ahead: VecDeque<(ChunkRow, Fetch)>,
}

impl std::fmt::Debug for TierReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierReader")
            .field("stream", &self.stream)
            .field("segment", &self.segment)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl Drop for TierReader {
    fn drop(&mut self) {
        for (_, f) in self.ahead.drain(..) {
            f.abort();
        }
    }
}

fn to_read_record(r: TierRecord, segment: u64) -> ReadRecord {
    ReadRecord {
        segment: crate::streams::graph::SegmentId::try_from(segment).unwrap_or(0),
        device: r.device,
        epoch: r.epoch,
        seq: r.seq,
        key: r.key,
        ts: r.ts_ns,
        fields: r.fields,
        offset: r.offset,
        ingest_ts: r.ingest_ts_ns,
    }
}

impl TierReader {
    /// A reader of `stream` from stream offset `from`. `segment` restricts tier-2 reads to
    /// one segment's chunks (merged streams); `None` reads every segment.
    pub fn new(
        tiering: Arc<Tiering>,
        stream: &str,
        segment: Option<u64>,
        from: u64,
    ) -> Result<TierReader, ReadThroughError> {
        let sid = tiering
            .hub()
            .lookup_stream(stream)
            .ok_or_else(|| ReadThroughError::UnknownStream(stream.to_string()))?;
        Ok(TierReader {
            tiering,
            stream: stream.to_string(),
            sid,
            segment,
            next: from,
            end: u64::MAX,
            current: None,
            ahead: VecDeque::new(),
        })
    }

    /// Stops reading before offset `end`: pages hold only records below it, and a page
    /// reaching it is the last (an empty page then). Readers that go on in tier 1 themselves
    /// bound the reader by the tier-1 start this way.
    pub fn until(mut self, end: u64) -> TierReader {
        self.end = end;
        self
    }

    /// The offset the next record will have at least.
    pub fn position(&self) -> u64 {
        self.next
    }

    fn fetch(&self, ch: &ChunkRow) -> Fetch {
        let store = self.tiering.store().clone();
        let path = ch.path.clone();
        tokio::spawn(async move { store.read_chunk(&path).await })
    }

    /// Up to `limit` records from the current position; an empty page means the reader is
    /// at the end of what is committed.
    pub async fn next_page(&mut self, limit: usize) -> Result<ReadPage, ReadThroughError> {
        let mut records = Vec::new();
        while records.len() < limit && self.next < self.end {
            let st = store::state(self.tiering.hub().catalog(), self.sid)?;
            // Retention removed everything below tier2_start from both tiers.
            self.next = self.next.max(st.tier2_start);
            if self.next >= st.evicted_end && self.current.is_none() {
                let hub = self.tiering.hub().clone();
                let (stream, from, n) = (self.stream.clone(), self.next, limit - records.len());
                let page = tokio::task::spawn_blocking(move || {
                    crate::read::read_records(&hub, &stream, from, n)
                })
                .await
                .map_err(|e| ReadThroughError::Missing {
                    stream: format!("{}: reader task failed: {e}", self.stream),
                    offset: from,
                    evicted_end: st.evicted_end,
                })??;
                let end = self.end;
                self.next = page.next.min(end);
                records.extend(page.records.into_iter().filter(|r| r.offset < end));
                break;
            }
            if !self.fill_current(st.evicted_end).await? {
                continue;
            }
            let (row, recs) = self.current.as_mut().expect("filled");
            while records.len() < limit {
                if recs.front().is_some_and(|(_, r)| r.offset >= self.end) {
                    self.next = self.next.max(self.end);
                    break;
                }
                let Some((seg, r)) = recs.pop_front() else {
                    break;
                };
                if r.offset >= self.next {
                    self.next = r.offset + 1;
                    records.push(to_read_record(r, seg));
                }
            }
            if recs.is_empty() {
                self.next = self.next.max(row.end_offset);
                self.current = None;
            }
        }
        for r in &records {
            self.next = self.next.max(r.offset + 1);
        }
        Ok(ReadPage {
            records,
            next: self.next,
        })
    }

    /// Makes `current` the chunk holding `next`, starting read-ahead. Returns `false` when
    /// the position moved instead (an empty chunk, or a hole left by retention).
    async fn fill_current(&mut self, evicted_end: u64) -> Result<bool, ReadThroughError> {
        if self.current.is_some() {
            return Ok(true);
        }
        // Drop read-ahead that the position has passed.
        while self
            .ahead
            .front()
            .is_some_and(|(c, _)| c.end_offset <= self.next)
        {
            if let Some((_, f)) = self.ahead.pop_front() {
                f.abort();
            }
        }
        let want = READ_AHEAD + 1;
        // A plan range yields one chunk per segment, over overlapping offsets: a whole-stream
        // read takes all chunks of a range together (grouped by `range_first`).
        let query = if self.segment.is_some() { want } else { 1024 };
        let mut rows = store::committed_chunks_from(
            self.tiering.hub().catalog(),
            self.sid,
            self.segment,
            self.next,
            query,
        )?;
        if self.segment.is_none() {
            let mut ranges: Vec<u64> = Vec::new();
            rows.retain(|r| {
                if !ranges.contains(&r.range_first) {
                    if ranges.len() >= want {
                        return false;
                    }
                    ranges.push(r.range_first);
                }
                true
            });
        }
        let Some(first) = rows.first().cloned() else {
            if self.segment.is_some() {
                // Every offset below evicted_end is tiered: this segment has nothing more
                // there (it was sealed, or merged away).
                self.next = self.next.max(evicted_end);
                return Ok(false);
            }
            return Err(ReadThroughError::Missing {
                stream: self.stream.clone(),
                offset: self.next,
                evicted_end,
            });
        };
        if first.first_offset > self.next {
            // Offsets in between belong to other segments (segment reads) or were deleted.
            self.next = first.first_offset;
            if self.next >= evicted_end {
                return Ok(false);
            }
        }
        for r in &rows {
            if !self.ahead.iter().any(|(c, _)| c.path == r.path) {
                let f = self.fetch(r);
                self.ahead.push_back((r.clone(), f));
            }
        }
        let group: Vec<ChunkRow> = if self.segment.is_some() {
            vec![first.clone()]
        } else {
            rows.iter()
                .filter(|r| r.range_first == first.range_first)
                .cloned()
                .collect()
        };
        let mut row = first.clone();
        let mut recs: Vec<(u64, TierRecord)> = Vec::new();
        for ch in &group {
            let Some(pos) = self.ahead.iter().position(|(c, _)| c.path == ch.path) else {
                return Ok(false);
            };
            let (ch, fetch) = self.ahead.remove(pos).expect("position is valid");
            let got = match fetch.await {
                Ok(r) => r?,
                Err(e) => {
                    return Err(ReadThroughError::Missing {
                        stream: format!("{}: fetch task failed: {e}", self.stream),
                        offset: self.next,
                        evicted_end,
                    });
                }
            };
            row.first_offset = row.first_offset.min(ch.first_offset);
            row.end_offset = row.end_offset.max(ch.end_offset);
            recs.extend(got.into_iter().map(|r| (ch.segment, r)));
        }
        if group.len() > 1 {
            recs.sort_by_key(|(_, r)| r.offset);
        }
        if recs.is_empty() {
            self.next = self.next.max(row.end_offset);
            return Ok(false);
        }
        self.current = Some((row, recs.into()));
        Ok(true)
    }
}

/// Reads up to `limit` records of `stream` (one `segment`, or all) from offset `from`,
/// through tier 2 where tier 1 no longer holds them. One-shot form of [`TierReader`].
pub async fn read_from(
    tiering: &Arc<Tiering>,
    stream: &str,
    segment: Option<u64>,
    from: u64,
    limit: usize,
) -> Result<ReadPage, ReadThroughError> {
    TierReader::new(tiering.clone(), stream, segment, from)?
        .next_page(limit)
        .await
}
