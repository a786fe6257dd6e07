//! The hub catalog: a SQLite database beside the tier-1 WAL.
//!
//! It holds what must survive a restart and be queried: devices and their fencing, streams and
//! their next hub offset, the durable marks per `(device, epoch, stream)`, one row per committed
//! block (its seq range, content checksum, hub offsets and WAL position), the WAL end offset the
//! marks cover, and the gaps and backlogs devices report.
//!
//! The group-commit writer (`wal`) applies one [`GroupCommit`] per WAL fsync in one transaction,
//! so the marks, the block index and the WAL end always move together. SQLite runs in WAL mode
//! with `synchronous=FULL`: a committed transaction survives power loss.
//!
//! SQLite integers are signed; u64 values (seqs, offsets) are stored bit-cast to i64 and cast
//! back, which round-trips every value.

use rusqlite::{Connection, OptionalExtension, params};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;
use thiserror::Error;

/// Interned device id.
pub type DeviceId = u32;
/// Interned stream id.
pub type StreamId = u32;

/// A catalog operation failed.
#[derive(Debug, Error)]
#[error("catalog: {0}")]
pub struct CatalogError(#[from] rusqlite::Error);

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS devices (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    fenced INTEGER NOT NULL DEFAULT 0,
    fence_reason TEXT,
    last_contact_ns INTEGER,
    retired INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS streams (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    next_offset INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS marks (
    device INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    stream INTEGER NOT NULL,
    durable_seq INTEGER NOT NULL,
    tiered_seq INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (device, epoch, stream)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocks (
    id INTEGER PRIMARY KEY,
    device INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    stream INTEGER NOT NULL,
    first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL,
    count INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    hub_offset_base INTEGER NOT NULL,
    wal_file INTEGER NOT NULL,
    wal_pos INTEGER NOT NULL,
    frame_len INTEGER NOT NULL,
    ingest_ts INTEGER NOT NULL,
    min_ts INTEGER NOT NULL,
    max_ts INTEGER NOT NULL,
    key_hash_min INTEGER,
    key_hash_max INTEGER
);
CREATE INDEX IF NOT EXISTS blocks_by_origin ON blocks (device, stream, epoch, first_seq);
CREATE INDEX IF NOT EXISTS blocks_by_offset ON blocks (stream, hub_offset_base);
CREATE INDEX IF NOT EXISTS blocks_by_wal_file ON blocks (wal_file);
CREATE TABLE IF NOT EXISTS wal_state (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    committed_end INTEGER NOT NULL
);
INSERT OR IGNORE INTO wal_state (id, committed_end) VALUES (1, 0);
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY,
    device INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    stream INTEGER NOT NULL,
    first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL,
    reason TEXT NOT NULL,
    reported_at_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS backlog (
    device INTEGER NOT NULL,
    stream INTEGER NOT NULL,
    reported_at_ns INTEGER NOT NULL,
    blocks INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    oldest_unsent_ts INTEGER,
    last_seq INTEGER NOT NULL,
    PRIMARY KEY (device, stream)
) WITHOUT ROWID;
-- the field names (columns) each stream holds, registered at ingest before a block with a
-- new one is queued (ingest.columns_per_stream_max is checked against it), and the device
-- that brought each (ingest.columns_per_device_max; NULL for fields registered before it was
-- recorded, see `add_field_origin`)
CREATE TABLE IF NOT EXISTS stream_fields (
    stream INTEGER NOT NULL,
    field TEXT NOT NULL,
    device INTEGER,
    PRIMARY KEY (stream, field)
) WITHOUT ROWID;
INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', 1);
";

/// One committed block: a dedupe range and an index row over the WAL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRow {
    pub device: DeviceId,
    pub epoch: u64,
    pub stream: StreamId,
    pub first_seq: u64,
    pub last_seq: u64,
    /// `sync::protocol::checksum::range_checksum` of the records as committed.
    pub checksum: u64,
    /// Hub offset of the block's first record within its stream.
    pub hub_offset_base: u64,
    /// The WAL file (its first logical offset) and the frame's byte position in that file.
    pub wal_file: u64,
    pub wal_pos: u64,
    pub frame_len: u32,
    pub ingest_ts: i64,
    pub min_ts: i64,
    pub max_ts: i64,
    /// Smallest and largest key hash point (`streams::hash::key_point`) of the block's
    /// records, so a segment reader can skip blocks outside its hash range. `None` for rows
    /// written before the hub filled them (and for a block without records).
    pub key_hash_min: Option<u32>,
    pub key_hash_max: Option<u32>,
}

impl BlockRow {
    /// Number of records.
    pub fn count(&self) -> u64 {
        self.last_seq - self.first_seq + 1
    }
}

/// A durable mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkRow {
    pub device: DeviceId,
    pub epoch: u64,
    pub stream: StreamId,
    pub durable_seq: u64,
    pub tiered_seq: u64,
}

/// A gap a device reported: seqs it dropped and will never send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapRow {
    pub device: DeviceId,
    pub epoch: u64,
    pub stream: StreamId,
    pub first_seq: u64,
    pub last_seq: u64,
    pub reason: String,
    pub reported_at_ns: i64,
}

/// The latest backlog a device reported for one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BacklogRow {
    pub device: DeviceId,
    pub stream: StreamId,
    pub reported_at_ns: i64,
    pub blocks: u64,
    pub bytes: u64,
    /// Event time of the oldest record not yet sent, if any.
    pub oldest_unsent_ts: Option<i64>,
    /// The highest seq the device holds.
    pub last_seq: u64,
}

/// A device as the catalog knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRow {
    pub id: DeviceId,
    pub name: String,
    pub fence_reason: Option<String>,
    pub last_contact_ns: Option<i64>,
    pub retired: bool,
}

/// A stream as the catalog knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRow {
    pub id: StreamId,
    pub name: String,
    pub next_offset: u64,
}

/// Everything one group commit changes, applied in one transaction.
#[derive(Debug, Clone, Default)]
pub struct GroupCommit {
    pub blocks: Vec<BlockRow>,
    /// New durable marks; a mark never moves backwards.
    pub marks: Vec<(DeviceId, u64, StreamId, u64)>,
    /// New next hub offsets per stream.
    pub stream_offsets: Vec<(StreamId, u64)>,
    pub gaps: Vec<GapRow>,
    pub contacts: Vec<(DeviceId, i64)>,
    pub backlogs: Vec<BacklogRow>,
    /// The WAL end offset covered by this commit; `None` leaves it unchanged.
    pub wal_end: Option<u64>,
}

/// The catalog: one connection for writes, one for reads (SQLite WAL mode lets them overlap).
#[derive(Debug)]
pub struct Catalog {
    write: Mutex<Connection>,
    read: Mutex<Connection>,
}

fn i(v: u64) -> i64 {
    v as i64
}
fn u(v: i64) -> u64 {
    v as u64
}

fn open_conn(path: &Path) -> Result<Connection, CatalogError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    Ok(conn)
}

/// A catalog from before fields recorded their device gets the column (empty for old rows).
fn add_field_origin(c: &Connection) -> Result<(), CatalogError> {
    let has: bool = c.query_row(
        "SELECT EXISTS (SELECT 1 FROM pragma_table_info('stream_fields') WHERE name = 'device')",
        [],
        |r| r.get(0),
    )?;
    if !has {
        c.execute("ALTER TABLE stream_fields ADD COLUMN device INTEGER", [])?;
    }
    Ok(())
}

impl Catalog {
    /// Opens (creating if needed) the catalog at `path`.
    pub fn open(path: &Path) -> Result<Catalog, CatalogError> {
        let write = open_conn(path)?;
        write.execute_batch(SCHEMA)?;
        add_field_origin(&write)?;
        let read = open_conn(path)?;
        Ok(Catalog {
            write: Mutex::new(write),
            read: Mutex::new(read),
        })
    }

    fn w(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.write.lock().expect("catalog write lock")
    }

    fn r(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.read.lock().expect("catalog read lock")
    }

    /// Runs `f` on the write connection. Modules that keep their own tables in the catalog
    /// (segments, reader groups, tier-2 chunks) create and change them through this, so the
    /// catalog stays one SQLite file with one writer.
    pub fn with_write_conn<R>(&self, f: impl FnOnce(&mut Connection) -> R) -> R {
        f(&mut self.w())
    }

    /// Runs `f` on the read connection (see [`Catalog::with_write_conn`]).
    pub fn with_read_conn<R>(&self, f: impl FnOnce(&mut Connection) -> R) -> R {
        f(&mut self.r())
    }

    /// The id of device `name`, creating it on first sight.
    pub fn intern_device(&self, name: &str) -> Result<DeviceId, CatalogError> {
        let c = self.w();
        c.execute("INSERT OR IGNORE INTO devices (name) VALUES (?1)", [name])?;
        let id: i64 = c.query_row("SELECT id FROM devices WHERE name = ?1", [name], |r| {
            r.get(0)
        })?;
        Ok(id as DeviceId)
    }

    /// The id of stream `name`, creating it on first sight.
    pub fn intern_stream(&self, name: &str) -> Result<StreamId, CatalogError> {
        let c = self.w();
        c.execute("INSERT OR IGNORE INTO streams (name) VALUES (?1)", [name])?;
        let id: i64 = c.query_row("SELECT id FROM streams WHERE name = ?1", [name], |r| {
            r.get(0)
        })?;
        Ok(id as StreamId)
    }

    /// Every device.
    pub fn devices(&self) -> Result<Vec<DeviceRow>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare("SELECT id, name, fenced, fence_reason, last_contact_ns, retired FROM devices ORDER BY name")?;
        let rows = st.query_map([], |r| {
            let fenced: i64 = r.get(2)?;
            let reason: Option<String> = r.get(3)?;
            Ok(DeviceRow {
                id: r.get::<_, i64>(0)? as DeviceId,
                name: r.get(1)?,
                fence_reason: if fenced != 0 {
                    Some(reason.unwrap_or_default())
                } else {
                    None
                },
                last_contact_ns: r.get(4)?,
                retired: r.get::<_, i64>(5)? != 0,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every stream.
    pub fn streams(&self) -> Result<Vec<StreamRow>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare("SELECT id, name, next_offset FROM streams ORDER BY name")?;
        let rows = st.query_map([], |r| {
            Ok(StreamRow {
                id: r.get::<_, i64>(0)? as StreamId,
                name: r.get(1)?,
                next_offset: u(r.get(2)?),
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every durable mark.
    pub fn all_marks(&self) -> Result<Vec<MarkRow>, CatalogError> {
        self.query_marks(
            "SELECT device, epoch, stream, durable_seq, tiered_seq FROM marks",
            [],
        )
    }

    /// The durable marks of one device.
    pub fn marks_of(&self, device: DeviceId) -> Result<Vec<MarkRow>, CatalogError> {
        self.query_marks(
            "SELECT device, epoch, stream, durable_seq, tiered_seq FROM marks WHERE device = ?1 ORDER BY stream, epoch",
            [i64::from(device)],
        )
    }

    fn query_marks<P: rusqlite::Params>(
        &self,
        sql: &str,
        p: P,
    ) -> Result<Vec<MarkRow>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare(sql)?;
        let rows = st.query_map(p, |r| {
            Ok(MarkRow {
                device: r.get::<_, i64>(0)? as DeviceId,
                epoch: u(r.get(1)?),
                stream: r.get::<_, i64>(2)? as StreamId,
                durable_seq: u(r.get(3)?),
                tiered_seq: u(r.get(4)?),
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The tier-2 mark of one key (0 when unknown).
    pub fn tiered_seq(
        &self,
        device: DeviceId,
        epoch: u64,
        stream: StreamId,
    ) -> Result<u64, CatalogError> {
        let c = self.r();
        let v: Option<i64> = c
            .query_row(
                "SELECT tiered_seq FROM marks WHERE device = ?1 AND epoch = ?2 AND stream = ?3",
                params![i64::from(device), i(epoch), i64::from(stream)],
                |r| r.get(0),
            )
            .optional()?;
        Ok(v.map_or(0, u))
    }

    /// Moves the tier-2 mark of one key forward (the tiering issue calls this).
    pub fn set_tiered_seq(
        &self,
        device: DeviceId,
        epoch: u64,
        stream: StreamId,
        tiered: u64,
    ) -> Result<(), CatalogError> {
        self.w().execute(
            "UPDATE marks SET tiered_seq = max(tiered_seq, ?4) WHERE device = ?1 AND epoch = ?2 AND stream = ?3",
            params![i64::from(device), i(epoch), i64::from(stream), i(tiered)],
        )?;
        Ok(())
    }

    /// The WAL end offset the committed marks cover.
    pub fn wal_committed_end(&self) -> Result<u64, CatalogError> {
        let c = self.r();
        Ok(u(c.query_row(
            "SELECT committed_end FROM wal_state WHERE id = 1",
            [],
            |r| r.get(0),
        )?))
    }

    /// Committed ranges `(first, last, checksum)` lying entirely within `[lo, hi]`.
    pub fn contained_ranges(
        &self,
        device: DeviceId,
        epoch: u64,
        stream: StreamId,
        lo: u64,
        hi: u64,
    ) -> Result<Vec<(u64, u64, u64)>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare_cached(
            "SELECT first_seq, last_seq, checksum FROM blocks
             WHERE device = ?1 AND stream = ?2 AND epoch = ?3 AND first_seq >= ?4 AND first_seq <= ?5 AND last_seq <= ?5
             ORDER BY first_seq",
        )?;
        let p = params![i64::from(device), i64::from(stream), i(epoch), i(lo), i(hi)];
        let rows = st.query_map(p, |r| Ok((u(r.get(0)?), u(r.get(1)?), u(r.get(2)?))))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Committed ranges `(first, last, checksum)` with `last >= from`, earliest first, at most `limit`.
    pub fn ranges_from(
        &self,
        device: DeviceId,
        epoch: u64,
        stream: StreamId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, u64, u64)>, CatalogError> {
        let c = self.r();
        // Ranges of one key never overlap, so the range holding `from` is the last one starting
        // at or before it; start the scan there.
        let start: Option<i64> = c
            .query_row(
                "SELECT first_seq FROM blocks WHERE device = ?1 AND stream = ?2 AND epoch = ?3 AND first_seq <= ?4
                 ORDER BY first_seq DESC LIMIT 1",
                params![i64::from(device), i64::from(stream), i(epoch), i(from)],
                |r| r.get(0),
            )
            .optional()?;
        let mut st = c.prepare_cached(
            "SELECT first_seq, last_seq, checksum FROM blocks
             WHERE device = ?1 AND stream = ?2 AND epoch = ?3 AND first_seq >= ?4 AND last_seq >= ?5
             ORDER BY first_seq LIMIT ?6",
        )?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let p = params![
            i64::from(device),
            i64::from(stream),
            i(epoch),
            start.unwrap_or(0),
            i(from),
            limit
        ];
        let rows = st.query_map(p, |r| Ok((u(r.get(0)?), u(r.get(1)?), u(r.get(2)?))))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The committed range ending exactly at `last`, if any.
    pub fn range_ending_at(
        &self,
        device: DeviceId,
        epoch: u64,
        stream: StreamId,
        last: u64,
    ) -> Result<Option<(u64, u64, u64)>, CatalogError> {
        let c = self.r();
        let row = c
            .query_row(
                "SELECT first_seq, last_seq, checksum FROM blocks
                 WHERE device = ?1 AND stream = ?2 AND epoch = ?3 AND first_seq <= ?4
                 ORDER BY first_seq DESC LIMIT 1",
                params![i64::from(device), i64::from(stream), i(epoch), i(last)],
                |r| Ok((u(r.get(0)?), u(r.get(1)?), u(r.get(2)?))),
            )
            .optional()?;
        Ok(row.filter(|&(_, l, _)| l == last))
    }

    /// Up to `limit` blocks of `stream` whose records end after hub offset `from`, in offset order.
    pub fn blocks_from(
        &self,
        stream: StreamId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<BlockRow>, CatalogError> {
        let c = self.r();
        // The block holding `from` is the last one starting at or before it; every later
        // block starts after it. Two index range scans, no table scan.
        let start: Option<i64> = c
            .query_row(
                "SELECT hub_offset_base FROM blocks WHERE stream = ?1 AND hub_offset_base <= ?2
                 ORDER BY hub_offset_base DESC LIMIT 1",
                params![i64::from(stream), i(from)],
                |r| r.get(0),
            )
            .optional()?;
        let start = start.unwrap_or(0);
        let mut st = c.prepare_cached(
            "SELECT device, epoch, stream, first_seq, last_seq, checksum, hub_offset_base, wal_file, wal_pos,
                    frame_len, ingest_ts, min_ts, max_ts, key_hash_min, key_hash_max
             FROM blocks WHERE stream = ?1 AND hub_offset_base >= ?2 ORDER BY hub_offset_base LIMIT ?3",
        )?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = st.query_map(params![i64::from(stream), start, limit], block_row)?;
        let rows: Vec<BlockRow> = rows.collect::<Result<_, _>>()?;
        Ok(rows
            .into_iter()
            .filter(|b| b.hub_offset_base + b.count() > from)
            .collect())
    }

    /// Block rows stored in one WAL file (for tiering and eviction).
    pub fn blocks_in_wal_file(&self, wal_file: u64) -> Result<Vec<BlockRow>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare(
            "SELECT device, epoch, stream, first_seq, last_seq, checksum, hub_offset_base, wal_file, wal_pos,
                    frame_len, ingest_ts, min_ts, max_ts, key_hash_min, key_hash_max
             FROM blocks WHERE wal_file = ?1 ORDER BY wal_pos",
        )?;
        let rows = st.query_map([i(wal_file)], block_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Marks or clears the fence on a device.
    pub fn set_fenced(&self, device: DeviceId, reason: Option<&str>) -> Result<(), CatalogError> {
        self.w().execute(
            "UPDATE devices SET fenced = ?2, fence_reason = ?3 WHERE id = ?1",
            params![i64::from(device), i64::from(reason.is_some()), reason],
        )?;
        Ok(())
    }

    /// The latest backlog reports of a device.
    pub fn backlog_of(&self, device: DeviceId) -> Result<Vec<BacklogRow>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare(
            "SELECT device, stream, reported_at_ns, blocks, bytes, oldest_unsent_ts, last_seq FROM backlog
             WHERE device = ?1 ORDER BY stream",
        )?;
        let rows = st.query_map([i64::from(device)], |r| {
            Ok(BacklogRow {
                device: r.get::<_, i64>(0)? as DeviceId,
                stream: r.get::<_, i64>(1)? as StreamId,
                reported_at_ns: r.get(2)?,
                blocks: u(r.get(3)?),
                bytes: u(r.get(4)?),
                oldest_unsent_ts: r.get(5)?,
                last_seq: u(r.get(6)?),
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every `(device, stream)` with a backlog report: the streams a device holds state in
    /// besides its lanes (the per-device stream quota counts both).
    pub fn backlog_streams(&self) -> Result<Vec<(DeviceId, StreamId)>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare("SELECT device, stream FROM backlog")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as DeviceId,
                r.get::<_, i64>(1)? as StreamId,
            ))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Registers field names `device` brought to `stream` (those already registered are
    /// ignored: a field belongs to the device that brought it first).
    pub fn register_fields(
        &self,
        stream: StreamId,
        device: DeviceId,
        fields: &[&str],
    ) -> Result<(), CatalogError> {
        let mut c = self.w();
        let tx = c.transaction()?;
        {
            let mut st = tx.prepare_cached(
                "INSERT OR IGNORE INTO stream_fields (stream, field, device) VALUES (?1, ?2, ?3)",
            )?;
            for f in fields {
                st.execute(rusqlite::params![i64::from(stream), f, i64::from(device)])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Every registered `(stream, field, device that brought it)`. A catalog from before the
    /// registry existed gets it filled from tier 2's field registry first (the fields already
    /// tiered, of no device).
    pub fn stream_fields(&self) -> Result<Vec<(StreamId, String, Option<DeviceId>)>, CatalogError> {
        {
            let c = self.w();
            let tiered: bool = c.query_row(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tier_fields')",
                [],
                |r| r.get(0),
            )?;
            if tiered {
                c.execute(
                    "INSERT OR IGNORE INTO stream_fields (stream, field) SELECT DISTINCT stream, field FROM tier_fields",
                    [],
                )?;
            }
        }
        let c = self.r();
        let mut st = c.prepare("SELECT stream, field, device FROM stream_fields")?;
        let rows = st.query_map([], |r| {
            let device = r.get::<_, Option<i64>>(2)?.map(|d| d as DeviceId);
            Ok((r.get::<_, i64>(0)? as StreamId, r.get(1)?, device))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// How many gaps every device reported, together (seeds `tributary_hub_gaps_total` at
    /// start, so the counter does not read 0 after a restart).
    pub fn gaps_count(&self) -> Result<u64, CatalogError> {
        let c = self.r();
        let n: i64 = c.query_row("SELECT count(*) FROM gaps", [], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// The gaps a device reported.
    pub fn gaps_of(&self, device: DeviceId) -> Result<Vec<GapRow>, CatalogError> {
        let c = self.r();
        let mut st = c.prepare(
            "SELECT device, epoch, stream, first_seq, last_seq, reason, reported_at_ns FROM gaps
             WHERE device = ?1 ORDER BY stream, epoch, first_seq",
        )?;
        let rows = st.query_map([i64::from(device)], |r| {
            Ok(GapRow {
                device: r.get::<_, i64>(0)? as DeviceId,
                epoch: u(r.get(1)?),
                stream: r.get::<_, i64>(2)? as StreamId,
                first_seq: u(r.get(3)?),
                last_seq: u(r.get(4)?),
                reason: r.get(5)?,
                reported_at_ns: r.get(6)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Applies one group commit atomically.
    pub fn commit_group(&self, g: &GroupCommit) -> Result<(), CatalogError> {
        let mut c = self.w();
        let tx = c.transaction()?;
        insert_blocks(&tx, &g.blocks)?;
        {
            let mut st = tx.prepare_cached(
                "INSERT INTO marks (device, epoch, stream, durable_seq) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (device, epoch, stream) DO UPDATE SET durable_seq = max(durable_seq, excluded.durable_seq)",
            )?;
            for &(d, e, s, seq) in &g.marks {
                st.execute(params![i64::from(d), i(e), i64::from(s), i(seq)])?;
            }
            let mut st = tx.prepare_cached("UPDATE streams SET next_offset = ?2 WHERE id = ?1")?;
            for &(s, next) in &g.stream_offsets {
                st.execute(params![i64::from(s), i(next)])?;
            }
        }
        insert_metadata(&tx, g)?;
        if let Some(end) = g.wal_end {
            tx.execute(
                "UPDATE wal_state SET committed_end = ?1 WHERE id = 1",
                [i(end)],
            )?;
        }
        tx.commit()?;
        Ok(())
    }
}

fn block_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<BlockRow> {
    Ok(BlockRow {
        device: r.get::<_, i64>(0)? as DeviceId,
        epoch: u(r.get(1)?),
        stream: r.get::<_, i64>(2)? as StreamId,
        first_seq: u(r.get(3)?),
        last_seq: u(r.get(4)?),
        checksum: u(r.get(5)?),
        hub_offset_base: u(r.get(6)?),
        wal_file: u(r.get(7)?),
        wal_pos: u(r.get(8)?),
        frame_len: r.get::<_, i64>(9)? as u32,
        ingest_ts: r.get(10)?,
        min_ts: r.get(11)?,
        max_ts: r.get(12)?,
        key_hash_min: hash_point(r.get(13)?),
        key_hash_max: hash_point(r.get(14)?),
    })
}

/// A stored hash point; anything outside `u32` (never written) reads as unknown.
fn hash_point(v: Option<i64>) -> Option<u32> {
    v.and_then(|v| u32::try_from(v).ok())
}

fn insert_blocks(tx: &rusqlite::Transaction<'_>, blocks: &[BlockRow]) -> Result<(), CatalogError> {
    let mut st = tx.prepare_cached(
        "INSERT INTO blocks (device, epoch, stream, first_seq, last_seq, count, checksum, hub_offset_base,
                             wal_file, wal_pos, frame_len, ingest_ts, min_ts, max_ts,
                             key_hash_min, key_hash_max)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
    )?;
    for b in blocks {
        st.execute(params![
            i64::from(b.device),
            i(b.epoch),
            i64::from(b.stream),
            i(b.first_seq),
            i(b.last_seq),
            i(b.count()),
            i(b.checksum),
            i(b.hub_offset_base),
            i(b.wal_file),
            i(b.wal_pos),
            i64::from(b.frame_len),
            b.ingest_ts,
            b.min_ts,
            b.max_ts,
            b.key_hash_min.map(i64::from),
            b.key_hash_max.map(i64::from)
        ])?;
    }
    Ok(())
}

fn insert_metadata(tx: &rusqlite::Transaction<'_>, g: &GroupCommit) -> Result<(), CatalogError> {
    let mut st = tx.prepare_cached(
        "INSERT INTO gaps (device, epoch, stream, first_seq, last_seq, reason, reported_at_ns)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?;
    for gap in &g.gaps {
        st.execute(params![
            i64::from(gap.device),
            i(gap.epoch),
            i64::from(gap.stream),
            i(gap.first_seq),
            i(gap.last_seq),
            gap.reason,
            gap.reported_at_ns
        ])?;
    }
    let mut st = tx.prepare_cached(
        "UPDATE devices SET last_contact_ns = max(coalesce(last_contact_ns, ?2), ?2) WHERE id = ?1",
    )?;
    for &(d, ns) in &g.contacts {
        st.execute(params![i64::from(d), ns])?;
    }
    let mut st = tx.prepare_cached(
        "INSERT OR REPLACE INTO backlog (device, stream, reported_at_ns, blocks, bytes, oldest_unsent_ts, last_seq)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?;
    for b in &g.backlogs {
        st.execute(params![
            i64::from(b.device),
            i64::from(b.stream),
            b.reported_at_ns,
            i(b.blocks),
            i(b.bytes),
            b.oldest_unsent_ts,
            i(b.last_seq)
        ])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(device: DeviceId, stream: StreamId, first: u64, last: u64, base: u64) -> BlockRow {
        BlockRow {
            device,
            epoch: 1,
            stream,
            first_seq: first,
            last_seq: last,
            checksum: 7,
            hub_offset_base: base,
            wal_file: 0,
            wal_pos: 16,
            frame_len: 100,
            ingest_ts: 1,
            min_ts: 1,
            max_ts: 2,
            key_hash_min: (first > 1).then_some(7),
            key_hash_max: (first > 1).then_some(u32::MAX),
        }
    }

    #[test]
    fn group_commit_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let cat = Catalog::open(&dir.path().join("c.sqlite")).unwrap();
        let d = cat.intern_device("truck-1").unwrap();
        assert_eq!(cat.intern_device("truck-1").unwrap(), d);
        let s = cat.intern_stream("telemetry").unwrap();
        let g = GroupCommit {
            blocks: vec![row(d, s, 1, 10, 0), row(d, s, 11, 20, 10)],
            marks: vec![(d, 1, s, 20)],
            stream_offsets: vec![(s, 20)],
            wal_end: Some(500),
            ..GroupCommit::default()
        };
        cat.commit_group(&g).unwrap();
        // A mark never moves back.
        cat.commit_group(&GroupCommit {
            marks: vec![(d, 1, s, 5)],
            ..GroupCommit::default()
        })
        .unwrap();
        assert_eq!(cat.marks_of(d).unwrap()[0].durable_seq, 20);
        assert_eq!(cat.wal_committed_end().unwrap(), 500);
        assert_eq!(cat.streams().unwrap()[0].next_offset, 20);
        assert_eq!(cat.contained_ranges(d, 1, s, 1, 20).unwrap().len(), 2);
        assert_eq!(
            cat.contained_ranges(d, 1, s, 5, 20).unwrap(),
            vec![(11, 20, 7)]
        );
        let from = cat.blocks_from(s, 15, 10).unwrap();
        assert_eq!(from.len(), 1);
        assert_eq!(from[0].first_seq, 11);
        let all = cat.blocks_from(s, 0, 10).unwrap();
        assert_eq!(all.len(), 2);
        // Hash ranges round-trip, the full u32 range included; unknown stays unknown.
        assert_eq!((all[0].key_hash_min, all[0].key_hash_max), (None, None));
        assert_eq!(
            (all[1].key_hash_min, all[1].key_hash_max),
            (Some(7), Some(u32::MAX))
        );
        assert!(cat.blocks_from(s, 20, 10).unwrap().is_empty());
        assert_eq!(cat.tiered_seq(d, 1, s).unwrap(), 0);
        cat.set_tiered_seq(d, 1, s, 12).unwrap();
        cat.set_tiered_seq(d, 1, s, 3).unwrap();
        assert_eq!(cat.tiered_seq(d, 1, s).unwrap(), 12);
        cat.set_fenced(d, Some("conflict")).unwrap();
        assert_eq!(
            cat.devices().unwrap()[0].fence_reason.as_deref(),
            Some("conflict")
        );
    }
}
