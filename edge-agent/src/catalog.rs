//! The agent's SQLite catalog (rusqlite, bundled): epochs, segments, acknowledgements and gap
//! markers.
//!
//! The catalog is an index and a place for acknowledgements, never the only copy of anything the
//! log needs to stay correct: epochs and gap markers are also written, fsynced, into small
//! CRC-framed files through [`crate::storage::Storage`] (`epochs.log`, `streams/*/gaps.log`), and
//! segments are found by listing the stream directories. So a missing or corrupt `catalog.db`
//! is moved aside and rebuilt at open with the same epoch; only the acknowledgements are lost,
//! and the hub sends them again when the agent reconnects.
//!
//! The catalog goes through the real file system (SQLite does its own IO), not through the
//! `Storage` trait. Tests on `MemStorage` point it at a temporary directory or at an in-memory
//! database.

use rusqlite::{Connection, OptionalExtension, params};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};
use thiserror::Error;

/// Where the catalog lives.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CatalogLocation {
    /// `data_dir/catalog.db`.
    #[default]
    InDataDir,
    /// An explicit file, for tests whose data lives in a `MemStorage`.
    Path(PathBuf),
    /// An in-memory database: lost at every open, so every open rebuilds. For tests.
    Memory,
}

/// Why the catalog could not be used.
#[derive(Debug, Error)]
pub enum CatalogError {
    #[error("catalog {path}: {source}")]
    Sqlite {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error("catalog {path}: {what}")]
    Invalid { path: String, what: String },
    #[error("catalog {path}: moving the corrupt file aside failed: {source}")]
    MoveAside {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// One segment as the catalog records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRow {
    pub stream: String,
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub bytes: u64,
}

/// One gap marker as the catalog records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GapRow {
    pub stream: String,
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    /// `dropped` or `corrupt`.
    pub reason: String,
    pub records: u64,
}

/// What happened when the catalog was opened.
#[derive(Debug, Clone, Default)]
pub struct CatalogOpen {
    /// The catalog did not exist, or was corrupt, and was created empty.
    pub created: bool,
    /// Where a corrupt catalog was moved to.
    pub moved_aside: Option<PathBuf>,
    /// Why it was considered corrupt.
    pub corrupt_reason: Option<String>,
}

/// An open catalog.
#[derive(Debug)]
pub struct Catalog {
    conn: Connection,
    name: String,
}

const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS epochs (ord INTEGER PRIMARY KEY, epoch INTEGER NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS segments (
    stream TEXT NOT NULL, epoch INTEGER NOT NULL, first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL, bytes INTEGER NOT NULL,
    PRIMARY KEY (stream, epoch, first_seq));
CREATE TABLE IF NOT EXISTS acks (
    stream TEXT NOT NULL, epoch INTEGER NOT NULL,
    durable_seq INTEGER NOT NULL, tiered_seq INTEGER NOT NULL,
    PRIMARY KEY (stream, epoch));
CREATE TABLE IF NOT EXISTS gaps (
    stream TEXT NOT NULL, epoch INTEGER NOT NULL, first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL, reason TEXT NOT NULL, records INTEGER NOT NULL,
    PRIMARY KEY (stream, epoch, first_seq));
";

// SQLite integers are i64; seqs and epochs are u64 stored bit-for-bit.
fn to_sql(v: u64) -> i64 {
    v as i64
}
fn from_sql(v: i64) -> u64 {
    v as u64
}

impl Catalog {
    /// Opens the catalog, moving a corrupt one aside (`catalog.db.corrupt-<unix secs>`) and
    /// starting empty. Fails only if even a fresh catalog cannot be created.
    pub fn open(path: Option<&Path>) -> Result<(Catalog, CatalogOpen), CatalogError> {
        let Some(path) = path else {
            let conn = Connection::open_in_memory().map_err(|e| sql_err(":memory:", e))?;
            let cat = Catalog {
                conn,
                name: ":memory:".into(),
            };
            cat.init()?;
            return Ok((
                cat,
                CatalogOpen {
                    created: true,
                    ..CatalogOpen::default()
                },
            ));
        };
        let existed = path.exists();
        let mut info = CatalogOpen {
            created: !existed,
            ..CatalogOpen::default()
        };
        if existed {
            match Catalog::open_checked(path) {
                Ok(cat) => return Ok((cat, info)),
                Err(reason) => {
                    info.moved_aside = Some(move_aside(path)?);
                    info.corrupt_reason = Some(reason);
                    info.created = true;
                }
            }
        }
        let cat = Catalog::open_checked(path).map_err(|what| CatalogError::Invalid {
            path: path.display().to_string(),
            what,
        })?;
        Ok((cat, info))
    }

    fn open_checked(path: &Path) -> Result<Catalog, String> {
        let name = path.display().to_string();
        let conn = Connection::open(path).map_err(|e| e.to_string())?;
        let cat = Catalog { conn, name };
        let mode: String = cat
            .conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(|e| e.to_string())?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("could not enable WAL mode (got {mode})"));
        }
        let check: String = cat
            .conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .map_err(|e| e.to_string())?;
        if check != "ok" {
            return Err(format!("integrity_check: {check}"));
        }
        cat.init().map_err(|e| e.to_string())?;
        Ok(cat)
    }

    fn init(&self) -> Result<(), CatalogError> {
        self.conn
            .execute_batch("PRAGMA synchronous=NORMAL;")
            .map_err(|e| self.err(e))?;
        self.conn.execute_batch(SCHEMA).map_err(|e| self.err(e))?;
        let v: Option<i64> = self
            .conn
            .query_row(
                "SELECT value FROM meta WHERE key='schema_version'",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| self.err(e))?;
        match v {
            None => {
                self.conn
                    .execute(
                        "INSERT INTO meta(key, value) VALUES ('schema_version', ?1)",
                        [SCHEMA_VERSION],
                    )
                    .map_err(|e| self.err(e))?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(other) => {
                return Err(CatalogError::Invalid {
                    path: self.name.clone(),
                    what: format!("schema version {other}, this build knows {SCHEMA_VERSION}"),
                });
            }
        }
        Ok(())
    }

    fn err(&self, e: rusqlite::Error) -> CatalogError {
        sql_err(&self.name, e)
    }

    /// Epochs in the order they were minted; the last is current.
    pub fn epochs(&self) -> Result<Vec<u64>, CatalogError> {
        let mut st = self
            .conn
            .prepare("SELECT epoch FROM epochs ORDER BY ord")
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([], |r| r.get::<_, i64>(0))
            .map_err(|e| self.err(e))?;
        rows.map(|r| r.map(from_sql).map_err(|e| self.err(e)))
            .collect()
    }

    /// Replaces the epoch history.
    pub fn replace_epochs(&mut self, epochs: &[u64]) -> Result<(), CatalogError> {
        let tx = self
            .conn
            .transaction()
            .map_err(|e| sql_err(&self.name, e))?;
        tx.execute("DELETE FROM epochs", [])
            .map_err(|e| sql_err(&self.name, e))?;
        for (i, e) in epochs.iter().enumerate() {
            tx.execute(
                "INSERT INTO epochs(ord, epoch) VALUES (?1, ?2)",
                params![i as i64, to_sql(*e)],
            )
            .map_err(|e| sql_err(&self.name, e))?;
        }
        tx.commit().map_err(|e| sql_err(&self.name, e))
    }

    /// Replaces the segment list with what recovery found on disk.
    pub fn replace_segments(&mut self, rows: &[SegmentRow]) -> Result<(), CatalogError> {
        let tx = self
            .conn
            .transaction()
            .map_err(|e| sql_err(&self.name, e))?;
        tx.execute("DELETE FROM segments", [])
            .map_err(|e| sql_err(&self.name, e))?;
        for r in rows {
            tx.execute(
                "INSERT OR REPLACE INTO segments(stream, epoch, first_seq, last_seq, bytes) VALUES (?1,?2,?3,?4,?5)",
                params![r.stream, to_sql(r.epoch), to_sql(r.first_seq), to_sql(r.last_seq), to_sql(r.bytes)],
            )
            .map_err(|e| sql_err(&self.name, e))?;
        }
        tx.commit().map_err(|e| sql_err(&self.name, e))
    }

    /// Records (or updates) one segment.
    pub fn upsert_segment(&self, r: &SegmentRow) -> Result<(), CatalogError> {
        self.conn
            .execute(
                "INSERT OR REPLACE INTO segments(stream, epoch, first_seq, last_seq, bytes) VALUES (?1,?2,?3,?4,?5)",
                params![r.stream, to_sql(r.epoch), to_sql(r.first_seq), to_sql(r.last_seq), to_sql(r.bytes)],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Forgets one segment.
    pub fn remove_segment(
        &self,
        stream: &str,
        epoch: u64,
        first_seq: u64,
    ) -> Result<(), CatalogError> {
        self.conn
            .execute(
                "DELETE FROM segments WHERE stream=?1 AND epoch=?2 AND first_seq=?3",
                params![stream, to_sql(epoch), to_sql(first_seq)],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The segments the catalog knows of.
    pub fn segments(&self) -> Result<Vec<SegmentRow>, CatalogError> {
        let mut st = self
            .conn
            .prepare("SELECT stream, epoch, first_seq, last_seq, bytes FROM segments ORDER BY stream, epoch, first_seq")
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([], |r| {
                Ok(SegmentRow {
                    stream: r.get(0)?,
                    epoch: from_sql(r.get(1)?),
                    first_seq: from_sql(r.get(2)?),
                    last_seq: from_sql(r.get(3)?),
                    bytes: from_sql(r.get(4)?),
                })
            })
            .map_err(|e| self.err(e))?;
        rows.map(|r| r.map_err(|e| self.err(e))).collect()
    }

    /// Every stored acknowledgement: `(stream, epoch, durable_seq, tiered_seq)`.
    pub fn acks(&self) -> Result<Vec<(String, u64, u64, u64)>, CatalogError> {
        let mut st = self
            .conn
            .prepare("SELECT stream, epoch, durable_seq, tiered_seq FROM acks")
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    from_sql(r.get(1)?),
                    from_sql(r.get(2)?),
                    from_sql(r.get(3)?),
                ))
            })
            .map_err(|e| self.err(e))?;
        rows.map(|r| r.map_err(|e| self.err(e))).collect()
    }

    /// Stores several acknowledgements in one transaction.
    pub fn set_acks(&mut self, acks: &[(String, u64, u64, u64)]) -> Result<(), CatalogError> {
        let tx = self
            .conn
            .transaction()
            .map_err(|e| sql_err(&self.name, e))?;
        for (stream, epoch, durable, tiered) in acks {
            tx.execute(
                "INSERT OR REPLACE INTO acks(stream, epoch, durable_seq, tiered_seq) VALUES (?1,?2,?3,?4)",
                params![stream, to_sql(*epoch), to_sql(*durable), to_sql(*tiered)],
            )
            .map_err(|e| sql_err(&self.name, e))?;
        }
        tx.commit().map_err(|e| sql_err(&self.name, e))
    }

    /// Replaces the gap markers mirrored from the streams' `gaps.log` files.
    pub fn replace_gaps(&mut self, rows: &[GapRow]) -> Result<(), CatalogError> {
        let tx = self
            .conn
            .transaction()
            .map_err(|e| sql_err(&self.name, e))?;
        tx.execute("DELETE FROM gaps", [])
            .map_err(|e| sql_err(&self.name, e))?;
        for g in rows {
            insert_gap(&tx, g).map_err(|e| sql_err(&self.name, e))?;
        }
        tx.commit().map_err(|e| sql_err(&self.name, e))
    }

    /// Records one gap marker.
    pub fn add_gap(&self, g: &GapRow) -> Result<(), CatalogError> {
        insert_gap(&self.conn, g).map_err(|e| self.err(e))
    }

    /// Every gap marker.
    pub fn gaps(&self) -> Result<Vec<GapRow>, CatalogError> {
        let mut st = self
            .conn
            .prepare("SELECT stream, epoch, first_seq, last_seq, reason, records FROM gaps ORDER BY stream, epoch, first_seq")
            .map_err(|e| self.err(e))?;
        let rows = st
            .query_map([], |r| {
                Ok(GapRow {
                    stream: r.get(0)?,
                    epoch: from_sql(r.get(1)?),
                    first_seq: from_sql(r.get(2)?),
                    last_seq: from_sql(r.get(3)?),
                    reason: r.get(4)?,
                    records: from_sql(r.get(5)?),
                })
            })
            .map_err(|e| self.err(e))?;
        rows.map(|r| r.map_err(|e| self.err(e))).collect()
    }
}

fn insert_gap(conn: &Connection, g: &GapRow) -> Result<(), rusqlite::Error> {
    conn.execute(
        "INSERT OR REPLACE INTO gaps(stream, epoch, first_seq, last_seq, reason, records) VALUES (?1,?2,?3,?4,?5,?6)",
        params![g.stream, to_sql(g.epoch), to_sql(g.first_seq), to_sql(g.last_seq), g.reason, to_sql(g.records)],
    )?;
    Ok(())
}

fn sql_err(name: &str, source: rusqlite::Error) -> CatalogError {
    CatalogError::Sqlite {
        path: name.to_string(),
        source,
    }
}

/// Renames a corrupt catalog (and its WAL and shared-memory files) out of the way.
fn move_aside(path: &Path) -> Result<PathBuf, CatalogError> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut n = 0u32;
    let target = loop {
        let suffix = if n == 0 {
            format!("corrupt-{ts}")
        } else {
            format!("corrupt-{ts}-{n}")
        };
        let t = sibling(path, &suffix);
        if !t.exists() {
            break t;
        }
        n += 1;
    };
    let err = |source| CatalogError::MoveAside {
        path: path.display().to_string(),
        source,
    };
    std::fs::rename(path, &target).map_err(err)?;
    for side in ["-wal", "-shm"] {
        let p = PathBuf::from(format!("{}{side}", path.display()));
        if p.exists() {
            std::fs::rename(&p, format!("{}{side}", target.display())).map_err(err)?;
        }
    }
    Ok(target)
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}.{suffix}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("catalog.db");
        std::fs::write(&p, vec![0xAB; 8192]).unwrap();
        let (cat, info) = Catalog::open(Some(&p)).unwrap();
        assert!(info.created);
        assert!(info.moved_aside.as_ref().unwrap().exists());
        assert!(cat.epochs().unwrap().is_empty());
    }

    #[test]
    fn round_trips_rows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("catalog.db");
        {
            let (mut cat, info) = Catalog::open(Some(&p)).unwrap();
            assert!(info.created);
            cat.replace_epochs(&[u64::MAX, 7]).unwrap();
            cat.set_acks(&[("s".into(), u64::MAX, 5, 3)]).unwrap();
        }
        let (cat, info) = Catalog::open(Some(&p)).unwrap();
        assert!(!info.created);
        assert_eq!(cat.epochs().unwrap(), vec![u64::MAX, 7]);
        assert_eq!(cat.acks().unwrap(), vec![("s".to_string(), u64::MAX, 5, 3)]);
    }
}
