//! The tiering tables in the hub catalog: chunk plans, the per-stream field registry, the
//! per-stream tier state, and the integrity of uploaded objects (their size and crc32c, and
//! the quarantine of damaged ones, see `crate::scrub`).
//!
//! Chunk boundaries are written here (state `planned`) BEFORE anything is uploaded, so a
//! restart re-uploads exactly the same records to exactly the same object name. A chunk moves
//! to `committed` only after its object was verified and its manifest written; the stream's
//! `tiered_end` moves in the same transaction as the chunk rows of a plan range, together
//! with the `tiered_seq` of every lane the range touched.
//!
//! Offsets are stream offsets (dense per stream). All u64 values are stored bit-cast to i64
//! like the rest of the catalog.

use crate::catalog::{Catalog, CatalogError, DeviceId, StreamId};
use rusqlite::{OptionalExtension, params};
use tier::{ColumnSpec, ValueKind};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tier_chunks (
    stream INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    first_offset INTEGER NOT NULL,
    end_offset INTEGER NOT NULL,
    -- the plan range (stream offsets) this chunk belongs to; every segment's chunk of one
    -- range shares it, and the range is tiered once all of them are committed
    range_first INTEGER NOT NULL,
    state INTEGER NOT NULL,
    path TEXT NOT NULL,
    rows INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    ingest_ts_min INTEGER NOT NULL DEFAULT 0,
    ingest_ts_max INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (stream, segment, first_offset)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tier_chunks_by_state ON tier_chunks (state, stream, first_offset);
CREATE TABLE IF NOT EXISTS tier_fields (
    stream INTEGER NOT NULL,
    ordinal INTEGER NOT NULL,
    name TEXT NOT NULL,
    field TEXT NOT NULL,
    kind TEXT NOT NULL,
    PRIMARY KEY (stream, ordinal)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tier_state (
    stream INTEGER PRIMARY KEY,
    -- offsets below planned_end are in chunk rows
    planned_end INTEGER NOT NULL DEFAULT 0,
    -- offsets below tiered_end are in committed chunks
    tiered_end INTEGER NOT NULL DEFAULT 0,
    -- offsets below evicted_end are no longer in tier 1 (read them from tier 2)
    evicted_end INTEGER NOT NULL DEFAULT 0,
    -- offsets below tier2_start were deleted from tier 2 by retention
    tier2_start INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tier_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- what an uploaded chunk object must look like: its size and the crc32c of its bytes,
-- recorded at upload (and at repair); read-through and the tier-2 scrub compare against it
CREATE TABLE IF NOT EXISTS tier_objects (
    stream INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    first_offset INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    crc32c INTEGER NOT NULL,
    PRIMARY KEY (stream, segment, first_offset)
) WITHOUT ROWID;
-- chunk objects found damaged (state 1: quarantined, not served) or repaired (state 2)
CREATE TABLE IF NOT EXISTS tier_quarantine (
    stream INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    first_offset INTEGER NOT NULL,
    end_offset INTEGER NOT NULL,
    path TEXT NOT NULL,
    what TEXT NOT NULL,
    found_ns INTEGER NOT NULL,
    state INTEGER NOT NULL,
    -- 1 once the damaged bytes were moved to _tributary/quarantine/ (out of streams/)
    moved INTEGER NOT NULL DEFAULT 0,
    repaired_ns INTEGER,
    PRIMARY KEY (stream, segment, first_offset)
) WITHOUT ROWID;
";

/// Chunk states.
pub const PLANNED: i64 = 0;
/// Uploaded and verified, manifest not yet committed.
pub const UPLOADED: i64 = 1;
/// Manifest written and catalog committed: the chunk counts as tiered.
pub const COMMITTED: i64 = 2;

/// Key in `tier_meta`: the first logical offset of the oldest WAL file kept. Files below it
/// were evicted (a crash between the catalog update and the unlink leaves them to delete).
pub const META_TIER1_FLOOR: &str = "tier1_floor";

fn i(v: u64) -> i64 {
    v as i64
}
fn u(v: i64) -> u64 {
    v as u64
}

/// One chunk row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRow {
    pub stream: StreamId,
    pub segment: u64,
    pub first_offset: u64,
    pub end_offset: u64,
    pub range_first: u64,
    pub state: i64,
    pub path: String,
    pub rows: u64,
    pub bytes: u64,
    pub ingest_ts_min: i64,
    pub ingest_ts_max: i64,
}

/// A stream's tier state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierState {
    pub planned_end: u64,
    pub tiered_end: u64,
    pub evicted_end: u64,
    pub tier2_start: u64,
}

/// Creates the tables (idempotent), and adds `tier_chunks.committed_ns` to catalogs made
/// before it existed (their chunks keep 0: commit time unknown).
pub fn init(cat: &Catalog) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        c.execute_batch(SCHEMA)?;
        let has: bool = c
            .prepare("SELECT 1 FROM pragma_table_info('tier_chunks') WHERE name = 'committed_ns'")?
            .exists([])?;
        if !has {
            c.execute_batch(
                "ALTER TABLE tier_chunks ADD COLUMN committed_ns INTEGER NOT NULL DEFAULT 0",
            )?;
        }
        c.execute_batch(
            "CREATE INDEX IF NOT EXISTS tier_chunks_by_commit ON tier_chunks (committed_ns)",
        )
    })?;
    Ok(())
}

fn chunk_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ChunkRow> {
    Ok(ChunkRow {
        stream: r.get::<_, i64>(0)? as StreamId,
        segment: u(r.get(1)?),
        first_offset: u(r.get(2)?),
        end_offset: u(r.get(3)?),
        range_first: u(r.get(4)?),
        state: r.get(5)?,
        path: r.get(6)?,
        rows: u(r.get(7)?),
        bytes: u(r.get(8)?),
        ingest_ts_min: r.get(9)?,
        ingest_ts_max: r.get(10)?,
    })
}

const CHUNK_COLS: &str = "stream, segment, first_offset, end_offset, range_first, state, path, rows, bytes, ingest_ts_min, ingest_ts_max";

/// The tier state of `stream` (zeros when unknown).
pub fn state(cat: &Catalog, stream: StreamId) -> Result<TierState, CatalogError> {
    let s = cat.with_read_conn(|c| {
        c.query_row(
            "SELECT planned_end, tiered_end, evicted_end, tier2_start FROM tier_state WHERE stream = ?1",
            [i64::from(stream)],
            |r| {
                Ok(TierState {
                    planned_end: u(r.get(0)?),
                    tiered_end: u(r.get(1)?),
                    evicted_end: u(r.get(2)?),
                    tier2_start: u(r.get(3)?),
                })
            },
        )
        .optional()
    })?;
    Ok(s.unwrap_or_default())
}

/// Writes the chunks of one plan range and moves `planned_end` to `end`, atomically.
pub fn insert_plan(
    cat: &Catalog,
    stream: StreamId,
    chunks: &[ChunkRow],
    end: u64,
) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        let tx = c.transaction()?;
        {
            let mut st = tx.prepare_cached(&format!(
                "INSERT OR REPLACE INTO tier_chunks ({CHUNK_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
            ))?;
            for ch in chunks {
                st.execute(params![
                    i64::from(ch.stream),
                    i(ch.segment),
                    i(ch.first_offset),
                    i(ch.end_offset),
                    i(ch.range_first),
                    ch.state,
                    ch.path,
                    i(ch.rows),
                    i(ch.bytes),
                    ch.ingest_ts_min,
                    ch.ingest_ts_max
                ])?;
            }
            tx.execute(
                "INSERT INTO tier_state (stream, planned_end) VALUES (?1, ?2)
                 ON CONFLICT (stream) DO UPDATE SET planned_end = max(planned_end, excluded.planned_end)",
                params![i64::from(stream), i(end)],
            )?;
        }
        tx.commit()
    })?;
    Ok(())
}

/// Every chunk not yet committed, in (stream, first_offset) order.
pub fn pending_chunks(cat: &Catalog) -> Result<Vec<ChunkRow>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare(&format!(
            "SELECT {CHUNK_COLS} FROM tier_chunks WHERE state < ?1 ORDER BY stream, range_first, segment"
        ))?;
        let rows = st.query_map([COMMITTED], chunk_row)?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// Marks one chunk uploaded (verified in tier 2, manifest not committed yet).
pub fn set_uploaded(
    cat: &Catalog,
    ch: &ChunkRow,
    rows: u64,
    bytes: u64,
) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        c.execute(
            "UPDATE tier_chunks SET state = max(state, ?4), rows = ?5, bytes = ?6
             WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3",
            params![
                i64::from(ch.stream),
                i(ch.segment),
                i(ch.first_offset),
                UPLOADED,
                i(rows),
                i(bytes)
            ],
        )
    })?;
    Ok(())
}

/// Committed chunks of `stream` (and `segment`, if given) whose range ends after `from`,
/// in offset order, at most `limit`.
pub fn committed_chunks_from(
    cat: &Catalog,
    stream: StreamId,
    segment: Option<u64>,
    from: u64,
    limit: usize,
) -> Result<Vec<ChunkRow>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare_cached(&format!(
            "SELECT {CHUNK_COLS} FROM tier_chunks
             WHERE stream = ?1 AND state = ?2 AND end_offset > ?3 AND (?4 IS NULL OR segment = ?4)
             ORDER BY first_offset, segment LIMIT ?5"
        ))?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = st.query_map(
            params![i64::from(stream), COMMITTED, i(from), segment.map(i), limit],
            chunk_row,
        )?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// Every committed chunk of `stream`, oldest first.
pub fn committed_chunks(cat: &Catalog, stream: StreamId) -> Result<Vec<ChunkRow>, CatalogError> {
    committed_chunks_from(cat, stream, None, 0, usize::MAX)
}

/// The field registry of `stream`, as stored: column specs in column order. A kind this
/// build does not know is skipped (it cannot have been written by it).
pub fn fields(cat: &Catalog, stream: StreamId) -> Result<Vec<ColumnSpec>, CatalogError> {
    let rows: Vec<(String, String, String)> = cat.with_read_conn(|c| {
        let mut st = c.prepare_cached(
            "SELECT name, field, kind FROM tier_fields WHERE stream = ?1 ORDER BY ordinal",
        )?;
        let rows = st.query_map([i64::from(stream)], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
        rows.collect::<Result<Vec<_>, _>>()
    })?;
    Ok(rows
        .into_iter()
        .filter_map(|(name, field, kind)| {
            let kind = ValueKind::ALL.into_iter().find(|k| k.suffix() == kind)?;
            Some(ColumnSpec { name, field, kind })
        })
        .collect())
}

/// What committing one plan range changes.
#[derive(Debug, Clone, Default)]
pub struct RangeCommit {
    pub stream: StreamId,
    /// The chunks of the range, with their final rows/bytes.
    pub chunks: Vec<ChunkRow>,
    /// The new `tiered_end` (the range's end).
    pub tiered_end: u64,
    /// The whole field registry after this range (new entries inserted, widened kinds updated).
    pub fields: Vec<ColumnSpec>,
    /// Lanes touched: `(device, epoch, highest seq in the range)`.
    pub lanes: Vec<(DeviceId, u64, u64)>,
    /// Wall time of the commit (ns), kept per chunk: the tier-2 scrub after a restart checks
    /// the chunks committed last before the stop first.
    pub committed_ns: i64,
}

/// Commits a plan range: chunk rows committed, field registry, `tiered_end`, and `tiered_seq`
/// of every lane it touched, in one transaction. Returns the lanes whose `tiered_seq` moved.
///
/// A lane's `tiered_seq` becomes the highest seq it has in the range, or its durable mark when
/// no block of the lane lies beyond the range (so trailing gaps count as tiered too). Ranges
/// commit in offset order, so every lower seq of the lane is already tiered.
pub fn commit_range(
    cat: &Catalog,
    rc: &RangeCommit,
) -> Result<Vec<(DeviceId, u64, u64)>, CatalogError> {
    cat.with_write_conn(|c| {
        let tx = c.transaction()?;
        let mut moved = Vec::new();
        {
            let mut st = tx.prepare_cached(
                "UPDATE tier_chunks SET state = ?4, rows = ?5, bytes = ?6, ingest_ts_min = ?7, ingest_ts_max = ?8,
                 committed_ns = ?9
                 WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3",
            )?;
            for ch in &rc.chunks {
                st.execute(params![
                    i64::from(ch.stream),
                    i(ch.segment),
                    i(ch.first_offset),
                    COMMITTED,
                    i(ch.rows),
                    i(ch.bytes),
                    ch.ingest_ts_min,
                    ch.ingest_ts_max,
                    rc.committed_ns
                ])?;
            }
            let mut st = tx.prepare_cached(
                // A column keeps its ordinal and name; its kind may widen (INT64 to DOUBLE).
                "INSERT INTO tier_fields (stream, ordinal, name, field, kind) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (stream, ordinal) DO UPDATE SET kind = excluded.kind",
            )?;
            for (n, spec) in rc.fields.iter().enumerate() {
                st.execute(params![
                    i64::from(rc.stream),
                    n as i64,
                    spec.name,
                    spec.field,
                    spec.kind.suffix()
                ])?;
            }
            tx.execute(
                "INSERT INTO tier_state (stream, planned_end, tiered_end) VALUES (?1, ?2, ?2)
                 ON CONFLICT (stream) DO UPDATE SET tiered_end = max(tiered_end, excluded.tiered_end)",
                params![i64::from(rc.stream), i(rc.tiered_end)],
            )?;
            let mut later = tx.prepare_cached(
                "SELECT 1 FROM blocks WHERE device = ?1 AND stream = ?2 AND epoch = ?3 AND first_seq > ?4 LIMIT 1",
            )?;
            let mut durable = tx.prepare_cached(
                "SELECT durable_seq, tiered_seq FROM marks WHERE device = ?1 AND epoch = ?2 AND stream = ?3",
            )?;
            let mut set = tx.prepare_cached(
                "UPDATE marks SET tiered_seq = max(tiered_seq, ?4) WHERE device = ?1 AND epoch = ?2 AND stream = ?3",
            )?;
            for &(d, epoch, seq) in &rc.lanes {
                let key = params![i64::from(d), i64::from(rc.stream), i(epoch), i(seq)];
                let beyond = later.query_row(key, |_| Ok(())).optional()?.is_some();
                let Some((mark, old)) = durable
                    .query_row(params![i64::from(d), i(epoch), i64::from(rc.stream)], |r| {
                        Ok((u(r.get(0)?), u(r.get(1)?)))
                    })
                    .optional()?
                else {
                    continue;
                };
                let tiered = if beyond { seq } else { mark.max(seq) };
                if tiered > old {
                    set.execute(params![i64::from(d), i(epoch), i64::from(rc.stream), i(tiered)])?;
                    moved.push((d, epoch, tiered));
                }
            }
        }
        tx.commit()?;
        Ok::<_, rusqlite::Error>(moved)
    })
    .map_err(CatalogError::from)
}

/// Moves `evicted_end` of streams forward and the tier-1 floor to `floor`, atomically.
pub fn record_eviction(
    cat: &Catalog,
    ends: &[(StreamId, u64)],
    floor: u64,
) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        let tx = c.transaction()?;
        {
            let mut st = tx.prepare_cached(
                "INSERT INTO tier_state (stream, evicted_end) VALUES (?1, ?2)
                 ON CONFLICT (stream) DO UPDATE SET evicted_end = max(evicted_end, excluded.evicted_end)",
            )?;
            for &(s, end) in ends {
                st.execute(params![i64::from(s), i(end)])?;
            }
            tx.execute(
                "INSERT INTO tier_meta (key, value) VALUES (?1, ?2)
                 ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
                params![META_TIER1_FLOOR, i(floor)],
            )?;
        }
        tx.commit()
    })?;
    Ok(())
}

/// The first logical offset of the oldest WAL file kept (0 before any eviction).
pub fn tier1_floor(cat: &Catalog) -> Result<u64, CatalogError> {
    let v: Option<i64> = cat.with_read_conn(|c| {
        c.query_row(
            "SELECT value FROM tier_meta WHERE key = ?1",
            [META_TIER1_FLOOR],
            |r| r.get(0),
        )
        .optional()
    })?;
    Ok(v.map_or(0, u))
}

/// Removes committed chunks of `stream` below `new_start` (tier-2 retention), after their
/// objects were deleted, and moves `tier2_start`.
pub fn drop_chunks_below(
    cat: &Catalog,
    stream: StreamId,
    new_start: u64,
) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        let tx = c.transaction()?;
        tx.execute(
            "DELETE FROM tier_chunks WHERE stream = ?1 AND state = ?2 AND end_offset <= ?3",
            params![i64::from(stream), COMMITTED, i(new_start)],
        )?;
        // Checks and quarantine entries of deleted chunks go with them.
        tx.execute(
            "DELETE FROM tier_objects WHERE stream = ?1 AND first_offset < ?2
             AND NOT EXISTS (SELECT 1 FROM tier_chunks c WHERE c.stream = tier_objects.stream
                 AND c.segment = tier_objects.segment AND c.first_offset = tier_objects.first_offset)",
            params![i64::from(stream), i(new_start)],
        )?;
        tx.execute(
            "DELETE FROM tier_quarantine WHERE stream = ?1 AND end_offset <= ?2",
            params![i64::from(stream), i(new_start)],
        )?;
        tx.execute(
            "INSERT INTO tier_state (stream, tier2_start) VALUES (?1, ?2)
             ON CONFLICT (stream) DO UPDATE SET tier2_start = max(tier2_start, excluded.tier2_start)",
            params![i64::from(stream), i(new_start)],
        )?;
        tx.commit()
    })?;
    Ok(())
}

/// Every stream with tier state.
pub fn streams_with_state(cat: &Catalog) -> Result<Vec<(StreamId, TierState)>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare(
            "SELECT stream, planned_end, tiered_end, evicted_end, tier2_start FROM tier_state ORDER BY stream",
        )?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as StreamId,
                TierState {
                    planned_end: u(r.get(1)?),
                    tiered_end: u(r.get(2)?),
                    evicted_end: u(r.get(3)?),
                    tier2_start: u(r.get(4)?),
                },
            ))
        })?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// Restores a stream's tier state wholesale (catalog rebuild from tier 2).
pub fn restore_state(cat: &Catalog, stream: StreamId, st: TierState) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        c.execute(
            "INSERT OR REPLACE INTO tier_state (stream, planned_end, tiered_end, evicted_end, tier2_start)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                i64::from(stream),
                i(st.planned_end),
                i(st.tiered_end),
                i(st.evicted_end),
                i(st.tier2_start)
            ],
        )
    })?;
    Ok(())
}

/// What an uploaded chunk object must look like (recorded at upload and at repair).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectCheck {
    pub bytes: u64,
    pub crc32c: u32,
}

impl ObjectCheck {
    /// The check of `bytes` as uploaded.
    pub fn of(bytes: &[u8]) -> ObjectCheck {
        ObjectCheck {
            bytes: bytes.len() as u64,
            crc32c: crc32c::crc32c(bytes),
        }
    }

    /// Why `bytes` (as read back) differ from this check, if they do.
    pub fn mismatch(&self, bytes: &[u8]) -> Option<String> {
        if bytes.len() as u64 != self.bytes {
            return Some(format!(
                "size {} bytes, {} expected (truncated or replaced)",
                bytes.len(),
                self.bytes
            ));
        }
        let crc = crc32c::crc32c(bytes);
        (crc != self.crc32c).then(|| {
            format!(
                "crc32c {crc:#010x}, {:#010x} expected (bit rot)",
                self.crc32c
            )
        })
    }
}

/// Records the check of a chunk object (upload or repair) and its size in the chunk row.
pub fn set_object_check(
    cat: &Catalog,
    stream: StreamId,
    segment: u64,
    first_offset: u64,
    check: ObjectCheck,
) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        let tx = c.transaction()?;
        tx.execute(
            "INSERT OR REPLACE INTO tier_objects (stream, segment, first_offset, bytes, crc32c)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                i64::from(stream),
                i(segment),
                i(first_offset),
                i(check.bytes),
                i64::from(check.crc32c)
            ],
        )?;
        tx.execute(
            "UPDATE tier_chunks SET bytes = ?4 WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3",
            params![
                i64::from(stream),
                i(segment),
                i(first_offset),
                i(check.bytes)
            ],
        )?;
        tx.commit()
    })?;
    Ok(())
}

/// The recorded check of a chunk object; `None` for objects uploaded before checks existed.
pub fn object_check(
    cat: &Catalog,
    stream: StreamId,
    segment: u64,
    first_offset: u64,
) -> Result<Option<ObjectCheck>, CatalogError> {
    let r = cat.with_read_conn(|c| {
        c.prepare_cached(
            "SELECT bytes, crc32c FROM tier_objects WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3",
        )?
        .query_row(
            params![i64::from(stream), i(segment), i(first_offset)],
            |r| {
                Ok(ObjectCheck {
                    bytes: u(r.get(0)?),
                    crc32c: r.get::<_, i64>(1)? as u32,
                })
            },
        )
        .optional()
    })?;
    Ok(r)
}

/// Quarantine states.
pub const QUARANTINED: i64 = 1;
/// Re-uploaded from tier 1 and verified: served again.
pub const REPAIRED: i64 = 2;

/// A chunk object found damaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineRow {
    pub stream: StreamId,
    pub segment: u64,
    pub first_offset: u64,
    pub end_offset: u64,
    pub path: String,
    pub what: String,
    pub found_ns: i64,
    pub state: i64,
    pub moved: bool,
    pub repaired_ns: Option<i64>,
}

const QUARANTINE_COLS: &str =
    "stream, segment, first_offset, end_offset, path, what, found_ns, state, moved, repaired_ns";

fn quarantine_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<QuarantineRow> {
    Ok(QuarantineRow {
        stream: r.get::<_, i64>(0)? as StreamId,
        segment: u(r.get(1)?),
        first_offset: u(r.get(2)?),
        end_offset: u(r.get(3)?),
        path: r.get(4)?,
        what: r.get(5)?,
        found_ns: r.get(6)?,
        state: r.get(7)?,
        moved: r.get::<_, i64>(8)? != 0,
        repaired_ns: r.get(9)?,
    })
}

/// Quarantines `ch` (readers skip it from now on). Returns `true` when it was not already
/// quarantined (a new finding: report it).
pub fn quarantine_chunk(
    cat: &Catalog,
    ch: &ChunkRow,
    what: &str,
    now_ns: i64,
) -> Result<bool, CatalogError> {
    let n = cat.with_write_conn(|c| {
        c.execute(
            &format!(
                "INSERT INTO tier_quarantine ({QUARANTINE_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0, NULL)
                 ON CONFLICT (stream, segment, first_offset) DO UPDATE SET
                     state = excluded.state, what = excluded.what, found_ns = excluded.found_ns,
                     path = excluded.path, moved = 0, repaired_ns = NULL
                 WHERE tier_quarantine.state != excluded.state"
            ),
            params![
                i64::from(ch.stream),
                i(ch.segment),
                i(ch.first_offset),
                i(ch.end_offset),
                ch.path,
                what,
                now_ns,
                QUARANTINED
            ],
        )
    })?;
    Ok(n > 0)
}

/// Records that the damaged bytes of a quarantined chunk were moved out of `streams/`.
pub fn set_quarantine_moved(cat: &Catalog, q: &QuarantineRow) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        c.execute(
            "UPDATE tier_quarantine SET moved = 1 WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3",
            params![i64::from(q.stream), i(q.segment), i(q.first_offset)],
        )
    })?;
    Ok(())
}

/// Marks a quarantined chunk repaired (served again).
pub fn set_repaired(cat: &Catalog, q: &QuarantineRow, now_ns: i64) -> Result<(), CatalogError> {
    cat.with_write_conn(|c| {
        c.execute(
            "UPDATE tier_quarantine SET state = ?4, repaired_ns = ?5
             WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3",
            params![
                i64::from(q.stream),
                i(q.segment),
                i(q.first_offset),
                REPAIRED,
                now_ns
            ],
        )
    })?;
    Ok(())
}

/// Every quarantine entry (both states), oldest finding first.
pub fn quarantine_list(cat: &Catalog) -> Result<Vec<QuarantineRow>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare_cached(&format!(
            "SELECT {QUARANTINE_COLS} FROM tier_quarantine ORDER BY found_ns, stream, first_offset, segment"
        ))?;
        let rows = st.query_map([], quarantine_row)?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// The chunks of `stream` quarantined now, as `(segment, first_offset)`.
pub fn quarantined_in(cat: &Catalog, stream: StreamId) -> Result<Vec<(u64, u64)>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare_cached(
            "SELECT segment, first_offset FROM tier_quarantine WHERE stream = ?1 AND state = ?2",
        )?;
        let rows = st.query_map(params![i64::from(stream), QUARANTINED], |r| {
            Ok((u(r.get(0)?), u(r.get(1)?)))
        })?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// Committed chunks of `stream` after `(first_offset, segment)` in that order (exclusive;
/// `None` from the start), at most `limit`: the tier-2 scrub's walk.
pub fn committed_chunks_after(
    cat: &Catalog,
    stream: StreamId,
    after: Option<(u64, u64)>,
    limit: usize,
) -> Result<Vec<ChunkRow>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare_cached(&format!(
            "SELECT {CHUNK_COLS} FROM tier_chunks
             WHERE stream = ?1 AND state = ?2 AND (?3 IS NULL OR (first_offset, segment) > (?3, ?4))
             ORDER BY first_offset, segment LIMIT ?5"
        ))?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let (f, s) = after.map_or((None, 0), |(f, s)| (Some(i(f)), i(s)));
        let rows = st.query_map(
            params![i64::from(stream), COMMITTED, f, s, limit],
            chunk_row,
        )?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// The newest commit time recorded for any chunk (`None`: none recorded, e.g. a catalog
/// whose chunks were all committed before commit times were kept).
pub fn last_commit_ns(cat: &Catalog) -> Result<Option<i64>, CatalogError> {
    cat.with_read_conn(|c| {
        c.query_row(
            "SELECT max(committed_ns) FROM tier_chunks WHERE state = ?1 AND committed_ns > 0",
            [COMMITTED],
            |r| r.get::<_, Option<i64>>(0),
        )
    })
    .map_err(CatalogError::from)
}

/// Committed chunks of every stream committed at or after `since_ns` (and with a recorded
/// commit time), newest first, at most `limit`, continuing below `before` (the
/// `(committed_ns, stream, segment, first_offset)` of the last one of the previous page).
pub fn committed_since(
    cat: &Catalog,
    since_ns: i64,
    before: Option<(i64, StreamId, u64, u64)>,
    limit: usize,
) -> Result<Vec<(i64, ChunkRow)>, CatalogError> {
    cat.with_read_conn(|c| {
        let mut st = c.prepare_cached(&format!(
            "SELECT {CHUNK_COLS}, committed_ns FROM tier_chunks
             WHERE state = ?1 AND committed_ns > 0 AND committed_ns >= ?2
               AND (?3 IS NULL OR (committed_ns, stream, segment, first_offset) < (?3, ?4, ?5, ?6))
             ORDER BY committed_ns DESC, stream DESC, segment DESC, first_offset DESC LIMIT ?7"
        ))?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let (t, sid, seg, off) = match before {
            Some((t, sid, seg, off)) => (Some(t), i64::from(sid), i(seg), i(off)),
            None => (None, 0, 0, 0),
        };
        let rows = st.query_map(params![COMMITTED, since_ns, t, sid, seg, off, limit], |r| {
            Ok((r.get::<_, i64>(11)?, chunk_row(r)?))
        })?;
        rows.collect::<Result<Vec<_>, _>>()
    })
    .map_err(CatalogError::from)
}

/// One committed chunk row, if it (still) exists.
pub fn committed_chunk(
    cat: &Catalog,
    stream: StreamId,
    segment: u64,
    first_offset: u64,
) -> Result<Option<ChunkRow>, CatalogError> {
    cat.with_read_conn(|c| {
        c.prepare_cached(&format!(
            "SELECT {CHUNK_COLS} FROM tier_chunks WHERE stream = ?1 AND segment = ?2 AND first_offset = ?3 AND state = ?4"
        ))?
        .query_row(
            params![i64::from(stream), i(segment), i(first_offset), COMMITTED],
            chunk_row,
        )
        .optional()
    })
    .map_err(CatalogError::from)
}

/// Version of the `block_ranges` entry of a manifest's `extra`.
pub const BLOCK_RANGES_VERSION: u64 = 1;

/// The committed block ranges of `stream` with offsets in `[first, end)`, for the first
/// manifest of a plan range (`extra.block_ranges`): per `(device, epoch)` lane, a string of
/// `first_seq,last_seq,checksum,hub_offset_base,ingest_ts,min_ts,max_ts` per block, the
/// blocks separated by `;` (compact: manifests are pretty-printed JSON, and a range holds
/// thousands of blocks).
/// `core-hub recover --from-tier2` restores them as dedupe ranges, so a resent old range is
/// compared exactly as before the loss. The checksums are the ones the hub stored at ingest:
/// they cannot be recomputed from the Parquet rows, which do not keep the producer's field
/// order that the checksum covers.
pub fn block_ranges_json(
    cat: &Catalog,
    stream: StreamId,
    first: u64,
    end: u64,
    device_name: &dyn Fn(DeviceId) -> Option<String>,
) -> Result<serde_json::Value, CatalogError> {
    use std::fmt::Write as _;
    let mut lanes: std::collections::BTreeMap<(DeviceId, u64), String> =
        std::collections::BTreeMap::new();
    let mut from = first;
    'pages: while from < end {
        let rows = cat.blocks_from(stream, from, 1024)?;
        if rows.is_empty() {
            break;
        }
        for b in &rows {
            if b.hub_offset_base >= end {
                break 'pages;
            }
            from = b.hub_offset_base + b.count();
            let lane = lanes.entry((b.device, b.epoch)).or_default();
            if !lane.is_empty() {
                lane.push(';');
            }
            let _ = write!(
                lane,
                "{},{},{},{},{},{},{}",
                b.first_seq,
                b.last_seq,
                b.checksum,
                b.hub_offset_base,
                b.ingest_ts,
                b.min_ts,
                b.max_ts
            );
        }
    }
    let lanes: Vec<serde_json::Value> = lanes
        .into_iter()
        .map(|((d, epoch), blocks)| {
            serde_json::json!({
                "device": device_name(d).unwrap_or_else(|| format!("#{d}")),
                "epoch": epoch,
                "blocks": blocks,
            })
        })
        .collect();
    Ok(serde_json::json!({ "v": BLOCK_RANGES_VERSION, "lanes": lanes }))
}
