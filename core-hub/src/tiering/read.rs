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
//!
//! # Damaged objects
//!
//! Every fetched object is compared with the size and crc32c recorded at upload
//! ([`store::ObjectCheck`]) before it is decoded. A mismatch (bit rot, truncation), a file that
//! no longer decodes, or an object gone while its chunk row is committed is read once more (a
//! repair may have just replaced it); if it is still bad, the chunk is quarantined
//! (`crate::scrub::report_tier2_damage`: catalog, error log with the object name, metrics,
//! and the tier-2 scrubber is woken to move it aside and repair it from tier 1 if it can).
//! The reader then **skips** the chunk's records and goes on: no corrupt row is ever served,
//! the reader never stalls on a damaged object, and the skipped range is reported to the
//! caller ([`TierReader::gaps`]), in the log and in `tributary_hub_tier2_*` metrics. Chunks
//! already quarantined are skipped the same way without being fetched.

use super::Tiering;
use super::store::{self, ChunkRow};
use crate::catalog::{CatalogError, StreamId};
use crate::read::{PageLimit, ReadError, ReadPage, ReadRecord, Room};
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

/// A fetched chunk object: its records, or why its bytes cannot be trusted.
#[derive(Debug)]
pub(crate) enum Fetched {
    Records(Vec<TierRecord>),
    Damaged(String),
}

type Fetch = tokio::task::JoinHandle<Result<Fetched, tier::GetError>>;

/// A chunk a reader skipped because its object is damaged (quarantined): its records are
/// not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedChunk {
    pub path: String,
    pub segment: u64,
    pub first_offset: u64,
    pub end_offset: u64,
    /// Rows the chunk held (from the catalog).
    pub rows: u64,
}

/// Reads `path` and checks it against `check` (size and crc32c) before decoding it. A
/// mismatch or a decode failure is `Damaged`, not an error: the object is there but wrong.
pub(crate) async fn fetch_verified(
    store: &tier::Tier2,
    path: &str,
    check: Option<store::ObjectCheck>,
) -> Result<Fetched, tier::GetError> {
    let bytes = store.get(path).await?;
    if let Some(what) = check.and_then(|c| c.mismatch(&bytes)) {
        return Ok(Fetched::Damaged(what));
    }
    match tokio::task::spawn_blocking(move || tier::decode_chunk(bytes)).await {
        Ok(Ok(records)) => Ok(Fetched::Records(records)),
        Ok(Err(e)) => Ok(Fetched::Damaged(format!("does not decode: {e}"))),
        Err(join) => Err(tier::GetError::Decode {
            path: path.to_owned(),
            source: tier::DecodeError::Metadata(format!("decoder task failed: {join}")),
        }),
    }
}

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
    /// Damaged chunks skipped so far.
    gaps: Vec<SkippedChunk>,
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
        tags: r.tags,
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
            gaps: Vec::new(),
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

    /// The damaged chunks this reader skipped (their records were not served), in the order
    /// met.
    pub fn gaps(&self) -> &[SkippedChunk] {
        &self.gaps
    }

    fn fetch(&self, ch: &ChunkRow) -> Result<Fetch, ReadThroughError> {
        let store = self.tiering.store().clone();
        let path = ch.path.clone();
        let check = store::object_check(
            self.tiering.hub().catalog(),
            ch.stream,
            ch.segment,
            ch.first_offset,
        )?;
        Ok(tokio::spawn(async move {
            fetch_verified(&store, &path, check).await
        }))
    }

    /// Records a skipped damaged chunk (once per reader).
    fn skip(&mut self, ch: &ChunkRow) {
        if self.gaps.iter().any(|g| g.path == ch.path) {
            return;
        }
        tracing::warn!(
            stream = %self.stream, path = %ch.path, first_offset = ch.first_offset,
            end_offset = ch.end_offset, rows = ch.rows,
            "skipping a quarantined tier-2 chunk: its records are not served"
        );
        crate::scrub::note_tier2_records_skipped(self.tiering.hub(), ch.rows);
        self.gaps.push(SkippedChunk {
            path: ch.path.clone(),
            segment: ch.segment,
            first_offset: ch.first_offset,
            end_offset: ch.end_offset,
            rows: ch.rows,
        });
    }

    /// A fetched chunk looked damaged: reads it once more against the current check (a repair
    /// may have replaced it, or the read itself was bad), and quarantines it if it still is.
    /// `Some(records)` when the second read is good.
    async fn confirm_damage(
        &self,
        ch: &ChunkRow,
        what: String,
    ) -> Result<Option<Vec<TierRecord>>, ReadThroughError> {
        let cat = self.tiering.hub().catalog();
        let check = store::object_check(cat, ch.stream, ch.segment, ch.first_offset)?;
        let what = match fetch_verified(self.tiering.store(), &ch.path, check).await {
            Ok(Fetched::Records(r)) => return Ok(Some(r)),
            Ok(Fetched::Damaged(w)) => w,
            Err(tier::GetError::NotFound { .. }) => {
                if store::committed_chunk(cat, ch.stream, ch.segment, ch.first_offset)?.is_none() {
                    // Retention deleted it meanwhile: a hole, not damage.
                    return Ok(Some(Vec::new()));
                }
                format!("object missing ({what})")
            }
            Err(e) => return Err(e.into()),
        };
        crate::scrub::report_tier2_damage(&self.tiering, ch, &what)?;
        Ok(None)
    }

    /// Up to `limit` records from the current position, within `read.page_bytes_max`; an
    /// empty page means the reader is at the end of what is committed.
    pub async fn next_page(&mut self, limit: usize) -> Result<ReadPage, ReadThroughError> {
        self.next_page_with(limit.into()).await
    }

    /// As [`TierReader::next_page`], within `limit` (records and decoded bytes, see
    /// [`crate::read::PageLimit`]). A record that does not fit stays for the next page, so
    /// pages continue exactly; a page always holds at least one record when there is one.
    pub async fn next_page_with(&mut self, limit: PageLimit) -> Result<ReadPage, ReadThroughError> {
        let default_bytes = self
            .tiering
            .hub()
            .streams()
            .read_state()
            .config
            .page_bytes_max;
        let mut room = Room::new(limit, default_bytes);
        let mut records = Vec::new();
        while !room.full() && self.next < self.end {
            let st = store::state(self.tiering.hub().catalog(), self.sid)?;
            // Retention removed everything below tier2_start from both tiers.
            self.next = self.next.max(st.tier2_start);
            if self.next >= st.evicted_end && self.current.is_none() {
                let hub = self.tiering.hub().clone();
                let (stream, from, left) = (self.stream.clone(), self.next, room.left());
                let page = tokio::task::spawn_blocking(move || {
                    crate::read::read_records_with(&hub, &stream, from, left)
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
            while !room.full() {
                if recs.front().is_some_and(|(_, r)| r.offset >= self.end) {
                    self.next = self.next.max(self.end);
                    break;
                }
                let Some((_, r)) = recs.front() else {
                    break;
                };
                if r.offset < self.next {
                    recs.pop_front();
                    continue;
                }
                let size = crate::read::parts_bytes(&r.device, &r.key, &r.fields)
                    + crate::read::tags_bytes(&r.tags);
                if !room.fits(size) {
                    // Left for the next page, which starts at its offset.
                    self.next = r.offset;
                    return Ok(ReadPage {
                        records,
                        next: self.next,
                    });
                }
                let (seg, r) = recs.pop_front().expect("a front record");
                self.next = r.offset + 1;
                room.take(size);
                records.push(to_read_record(r, seg));
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
        let quarantined = store::quarantined_in(self.tiering.hub().catalog(), self.sid)?;
        let is_quarantined = |r: &ChunkRow| quarantined.contains(&(r.segment, r.first_offset));
        for r in &rows {
            if !is_quarantined(r) && !self.ahead.iter().any(|(c, _)| c.path == r.path) {
                let f = self.fetch(r)?;
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
            row.first_offset = row.first_offset.min(ch.first_offset);
            row.end_offset = row.end_offset.max(ch.end_offset);
            if is_quarantined(ch) {
                self.skip(ch);
                continue;
            }
            let Some(pos) = self.ahead.iter().position(|(c, _)| c.path == ch.path) else {
                return Ok(false);
            };
            let (ch, fetch) = self.ahead.remove(pos).expect("position is valid");
            let fetched = match fetch.await {
                Ok(Ok(f)) => f,
                Ok(Err(tier::GetError::NotFound { .. })) => {
                    Fetched::Damaged("object missing".into())
                }
                Ok(Err(e)) => return Err(e.into()),
                Err(e) => {
                    return Err(ReadThroughError::Missing {
                        stream: format!("{}: fetch task failed: {e}", self.stream),
                        offset: self.next,
                        evicted_end,
                    });
                }
            };
            let got = match fetched {
                Fetched::Records(r) => r,
                Fetched::Damaged(what) => match self.confirm_damage(&ch, what).await? {
                    Some(r) => r,
                    None => {
                        self.skip(&ch);
                        continue;
                    }
                },
            };
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
