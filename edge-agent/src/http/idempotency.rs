//! Idempotency keys on `POST /v1/streams/{stream}/records`, durable in the same fsync as the
//! batch they answer.
//!
//! # The key record
//!
//! A batch sent with an `Idempotency-Key` goes through [`Ingest::begin_idempotent`] and
//! [`Ingest::ingest_claimed`]. After the stream's filters ran, the batch's **last record** gets
//! the reserved string field [`KEY_FIELD`] (`_idempotency`), holding a [`KeyTag`]: format
//! version, body digest, the batch's record count, the agent's clock when it was stored, and the
//! key (`"1 <digest:016x> <count> <created_ns> <key>"`). The field is written, fsynced and
//! recovered with the batch itself, and a batch is whole or absent after a crash (recovery drops
//! an incomplete multi-block batch), so the key is in the log exactly when the whole batch is:
//! there is no window in which the batch is durable and its key is not. The original answer
//! follows from the log: the last record's `(epoch, seq)` and the count give
//! `(epoch, last_seq - count + 1, last_seq, count)`.
//!
//! Producers cannot forge one: a body whose records carry a field named `_idempotency` is
//! refused with 400 (`parse_body`), and records from other sources lose such a field before
//! they are filtered ([`Ingest::ingest`]). The field is replicated with the record like
//! `_mqtt_digest`, as bookkeeping: the hub's reads and tier 2 leave both out.
//!
//! # The cache: `data_dir/idempotency.db`
//!
//! SQLite (WAL, `synchronous = FULL`), a cache of the log, never the only copy of a stored
//! key: rows `(stream, key) -> (body digest, epoch, first_seq, last_seq, count, created_ns)`,
//! written after the batch is durable, and per stream a watermark `(epoch, seq)` such that every
//! keyed batch at or below it has its row. Before the first keyed request on a stream after a
//! start, the log above the watermark is read back and the keys found are added (an existing
//! row wins); then the watermark moves to the log's end. At run time the watermark moves after
//! a row is written, when no other keyed request on the stream is being served and none ended in
//! an unknown outcome since the start. So after any crash the keys are known again, and a
//! restart reads only what was appended since the last quiet moment (the first keyed request
//! on the stream waits for that read). If the file is unreadable it is moved aside
//! (`idempotency.db.corrupt-<ns>`); missing, it is rebuilt from the whole log.
//!
//! # Answers
//!
//! A retry with the same key and body gets the stored answer (`Idempotency-Replayed: true`) and
//! stores nothing; the same key with another body is refused (422); a retry while the first
//! request is still being served is refused (409). An append whose outcome is unknown (storage
//! failed during the write, or the log shut down while it waited) answers
//! [`IdempotencyError::MaybeStored`]; the key is then refused with the same answer until the
//! agent restarts, and after the restart a retry gets the original seqs if the batch was
//! stored, or stores it now. The work of a claimed key runs to its end even when the client
//! disconnects, so a dropped connection never leaves a stored batch without its row.
//!
//! Retention: a key is kept for [`IDEMPOTENCY_RETENTION`] (24 hours, by the agent's clock at
//! store time) and among the newest [`IDEMPOTENCY_KEYS_MAX`] (100,000) keys, whichever ends
//! first; older keys are forgotten and a retry with them appends again. A key also goes when
//! the log deletes the segment holding it while its row is not cached (after a crash).
//!
//! Limits:
//! - A batch the filters reduce to zero records leaves nothing in the log; its key lives only
//!   in the cache, written before the answer. If the agent dies between the filters and that
//!   write, a retry runs the filters again (their window state was lost with the process) and
//!   may store records then: at most once, never twice.
//! - If the hub makes the agent move a batch to a new epoch (rekey) and the cache lost its row,
//!   the rebuilt answer names the batch's new `(epoch, seqs)`.
//! - A block that fails verification while keys are read back ends that epoch's scan with a
//!   warning; keys in or after it (in that epoch) are not rebuilt.
//! - The field costs one string per keyed batch in the log.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use sync::block::{DecodeLimits, decode_block};
use sync::{Record, Value};
use thiserror::Error;

use super::ingest::{Ingest, now_ns, stored_count};
use crate::log::{AppendAck, AppendError, LogHandle, ReadError};

/// The reserved field of a keyed batch's last record (see the module docs).
pub const KEY_FIELD: &str = "_idempotency";
/// How long an idempotency key is remembered.
pub const IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// How many idempotency keys are remembered at most (the newest).
pub const IDEMPOTENCY_KEYS_MAX: u64 = 100_000;
/// Longest accepted idempotency key, in bytes.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 255;
/// Prune old keys once per this many stored keys.
const PRUNE_EVERY: u64 = 1_000;
/// Bytes of blocks read at once while keys are read back from the log.
const SCAN_CHUNK_BYTES: usize = 4 << 20;
/// The version written first in a [`KeyTag`].
const TAG_VERSION: &str = "1";

/// What the key record of a batch holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTag {
    pub key: String,
    pub body_digest: u64,
    /// Records of the batch, this one last.
    pub count: u64,
    /// The agent's clock when the batch was appended, for retention.
    pub created_ns: i64,
}

impl KeyTag {
    /// The field value: `"1 <digest:016x> <count> <created_ns> <key>"` (the key last: it may
    /// hold spaces).
    pub fn encode(&self) -> String {
        format!(
            "{TAG_VERSION} {:016x} {} {} {}",
            self.body_digest, self.count, self.created_ns, self.key
        )
    }

    /// Parses [`KeyTag::encode`]'s output; `None` for anything else.
    pub fn decode(text: &str) -> Option<KeyTag> {
        let mut parts = text.splitn(5, ' ');
        if parts.next()? != TAG_VERSION {
            return None;
        }
        let body_digest = u64::from_str_radix(parts.next()?, 16).ok()?;
        let count = parts.next()?.parse().ok().filter(|c| *c > 0)?;
        let created_ns = parts.next()?.parse().ok()?;
        let key = parts.next().filter(|k| valid_key(k))?.to_owned();
        Some(KeyTag {
            key,
            body_digest,
            count,
            created_ns,
        })
    }

    /// The tag on `r`, if it carries one.
    pub fn of(r: &Record) -> Option<KeyTag> {
        r.fields.iter().find_map(|(n, v)| match (n.as_str(), v) {
            (KEY_FIELD, Value::Str(s)) => KeyTag::decode(s),
            _ => None,
        })
    }
}

/// True for keys of 1 to [`IDEMPOTENCY_KEY_BYTES_MAX`] printable ASCII characters.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= IDEMPOTENCY_KEY_BYTES_MAX
        && key.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
}

/// Removes the reserved field from records that did not come through a keyed request.
pub fn strip_key_fields(records: &mut [Record]) {
    for r in records {
        if r.fields.iter().any(|(n, _)| n == KEY_FIELD) {
            r.fields.retain(|(n, _)| n != KEY_FIELD);
        }
    }
}

/// FNV-1a 64 of a request body, to tell a retry from a different batch under the same key.
/// Stable across builds: it is stored in the log.
pub fn body_digest(content_type: &str, body: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in content_type.as_bytes().iter().chain(&[0xff]).chain(body) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The answer to one stored batch, as the HTTP API returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchAnswer {
    pub stream: String,
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub count: u64,
    /// True when this answer was stored earlier and is replayed for a retried key.
    pub replayed: bool,
}

/// What [`Ingest::begin_idempotent`] found.
#[derive(Debug)]
pub enum IdempotentStart {
    /// The key was answered before: here is that answer; store nothing.
    Replay(BatchAnswer),
    /// The key is new: append with [`Ingest::ingest_claimed`].
    Claimed(KeyClaim),
}

/// A key being served by one request. Dropping it frees the key, so a retry after a refused
/// append tries again.
#[derive(Debug)]
pub struct KeyClaim {
    keys: std::sync::Arc<KeyStore>,
    stream: String,
    key: String,
    body_digest: u64,
}

impl KeyClaim {
    pub fn stream(&self) -> &str {
        &self.stream
    }
}

impl Drop for KeyClaim {
    fn drop(&mut self) {
        lock(&self.keys.inflight).remove(&(self.stream.clone(), self.key.clone()));
    }
}

/// Why an idempotent ingest failed.
#[derive(Debug, Error)]
pub enum IdempotencyError {
    #[error(
        "the Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_BYTES_MAX} printable ASCII characters"
    )]
    BadKey,
    #[error("a request with this Idempotency-Key is still being served: retry after it answered")]
    InProgress,
    #[error(
        "this Idempotency-Key was used before with a different body: use a new key for a new batch"
    )]
    BodyMismatch,
    #[error("the idempotency key store ({path}) failed: {message}")]
    Store { path: String, message: String },
    #[error("reading idempotency keys back from the log of {stream:?} failed: {source}")]
    Scan {
        stream: String,
        #[source]
        source: ReadError,
    },
    /// The batch was refused; nothing of it is stored.
    #[error(transparent)]
    Append(#[from] AppendError),
    /// The append failed in a way that may have stored the batch.
    #[error(
        "{0}; the batch may be stored: retry with the same Idempotency-Key after the agent has \
         restarted (it then answers with the original seqs if the batch was stored, and stores \
         it otherwise)"
    )]
    MaybeStored(#[source] AppendError),
    /// An earlier request with this key ended in [`IdempotencyError::MaybeStored`].
    #[error(
        "an earlier request with this Idempotency-Key failed while its batch was being written, \
         so the batch may be stored: retry with the same Idempotency-Key after the agent has \
         restarted (it then answers with the original seqs if the batch was stored, and stores \
         it otherwise)"
    )]
    EarlierMaybeStored,
}

impl IdempotencyError {
    /// True when the batch of this request (or of an earlier one with the key) may be stored.
    pub fn may_be_stored(&self) -> bool {
        matches!(
            self,
            IdempotencyError::MaybeStored(_) | IdempotencyError::EarlierMaybeStored
        )
    }
}

/// True when an append that returned `e` may nevertheless have stored its batch.
pub fn outcome_unknown(e: &AppendError) -> bool {
    // Storage: written, maybe durable, when the write or fsync failed. Closed: the writer went
    // away while the batch may have been queued or written. The others refuse before writing.
    matches!(e, AppendError::Storage(_) | AppendError::Closed)
}

/// Test-only switches for mutation checks and for simulating a kill at a chosen point.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Default)]
pub struct FaultSwitches {
    /// Stop writing the key record into the batch: only the cache keeps keys, as before keys
    /// were carried in the log. The suite must fail with this on.
    pub key_record_off: std::sync::atomic::AtomicBool,
    /// The process "dies" after the batch is durable and before the cache row is written: the
    /// row is not written and the answer is still returned, for the test to crash and reopen.
    pub skip_cache_write: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The cache of keys, and the in-memory state of the keys being served.
pub(crate) struct KeyStore {
    path: PathBuf,
    conn: Mutex<Option<Connection>>,
    inflight: Mutex<HashSet<(String, String)>>,
    /// Keys whose request ended with an unknown outcome, refused until restart.
    unknown: Mutex<HashSet<(String, String)>>,
    /// Streams whose watermark must not move until restart (an unknown outcome, or a row that
    /// could not be written).
    dirty: Mutex<HashSet<String>>,
    /// Streams whose log was read back into the cache since start.
    reconciled: HashMap<String, tokio::sync::OnceCell<()>>,
    stored: std::sync::atomic::AtomicU64,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: FaultSwitches,
}

impl std::fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// One cached key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Row {
    body_digest: u64,
    epoch: u64,
    first_seq: u64,
    last_seq: u64,
    count: u64,
    created_ns: i64,
}

const SCHEMA: &str = "PRAGMA journal_mode = WAL;
     PRAGMA synchronous = FULL;
     CREATE TABLE IF NOT EXISTS idempotency_keys (
         stream TEXT NOT NULL,
         key TEXT NOT NULL,
         body_digest INTEGER NOT NULL,
         epoch INTEGER NOT NULL,
         first_seq INTEGER NOT NULL,
         last_seq INTEGER NOT NULL,
         count INTEGER NOT NULL,
         created_ns INTEGER NOT NULL,
         PRIMARY KEY (stream, key)
     );
     CREATE INDEX IF NOT EXISTS idempotency_keys_created
         ON idempotency_keys (created_ns);
     CREATE TABLE IF NOT EXISTS idempotency_scanned (
         stream TEXT PRIMARY KEY,
         epoch INTEGER NOT NULL,
         seq INTEGER NOT NULL
     );";

impl KeyStore {
    pub(crate) fn new(path: PathBuf, streams: &[String]) -> Self {
        KeyStore {
            path,
            conn: Mutex::new(None),
            inflight: Mutex::new(HashSet::new()),
            unknown: Mutex::new(HashSet::new()),
            dirty: Mutex::new(HashSet::new()),
            reconciled: streams
                .iter()
                .map(|s| (s.clone(), tokio::sync::OnceCell::new()))
                .collect(),
            stored: std::sync::atomic::AtomicU64::new(0),
            #[cfg(feature = "fault-injection")]
            faults: FaultSwitches::default(),
        }
    }

    fn err(&self, e: impl std::fmt::Display) -> IdempotencyError {
        IdempotencyError::Store {
            path: self.path.display().to_string(),
            message: e.to_string(),
        }
    }

    /// Runs `f` on the open connection, opening it first if needed.
    fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T, IdempotencyError> {
        let mut guard = lock(&self.conn);
        if guard.is_none() {
            *guard = Some(self.open()?);
        }
        let conn = guard.as_mut().ok_or_else(|| self.err("not open"))?;
        f(conn).map_err(|e| self.err(e))
    }

    /// Opens the cache; one that cannot be opened is moved aside and started anew (the log
    /// holds every key it held).
    fn open(&self) -> Result<Connection, IdempotencyError> {
        let attempt = || -> rusqlite::Result<Connection> {
            let conn = Connection::open(&self.path)?;
            conn.execute_batch(SCHEMA)?;
            prune(&conn, now_ns())?;
            Ok(conn)
        };
        match attempt() {
            Ok(c) => Ok(c),
            Err(e) => {
                let aside = self.path.with_extension(format!("db.corrupt-{}", now_ns()));
                tracing::warn!(path = %self.path.display(), error = %e, aside = %aside.display(),
                    "idempotency key cache unreadable: moved aside, rebuilding it from the log");
                std::fs::rename(&self.path, &aside).map_err(|e| self.err(e))?;
                for ext in ["db-wal", "db-shm"] {
                    let _ = std::fs::remove_file(self.path.with_extension(ext));
                }
                attempt().map_err(|e| self.err(e))
            }
        }
    }

    fn lookup(&self, stream: &str, key: &str) -> Result<Option<Row>, IdempotencyError> {
        self.with(|c| {
            c.query_row(
                "SELECT body_digest, epoch, first_seq, last_seq, count, created_ns
                 FROM idempotency_keys WHERE stream = ?1 AND key = ?2",
                params![stream, key],
                |r| {
                    Ok(Row {
                        body_digest: r.get::<_, i64>(0)? as u64,
                        epoch: r.get::<_, i64>(1)? as u64,
                        first_seq: r.get::<_, i64>(2)? as u64,
                        last_seq: r.get::<_, i64>(3)? as u64,
                        count: r.get::<_, i64>(4)? as u64,
                        created_ns: r.get(5)?,
                    })
                },
            )
            .optional()
        })
    }
}

fn insert(c: &Connection, or: &str, stream: &str, key: &str, row: &Row) -> rusqlite::Result<()> {
    c.execute(
        &format!(
            "INSERT OR {or} INTO idempotency_keys
             (stream, key, body_digest, epoch, first_seq, last_seq, count, created_ns)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
        ),
        params![
            stream,
            key,
            row.body_digest as i64,
            row.epoch as i64,
            row.first_seq as i64,
            row.last_seq as i64,
            row.count as i64,
            row.created_ns
        ],
    )?;
    Ok(())
}

/// Moves `stream`'s watermark forward to `(epoch, seq)`; never back.
fn advance_watermark(c: &Connection, stream: &str, epoch: u64, seq: u64) -> rusqlite::Result<()> {
    c.execute(
        "INSERT INTO idempotency_scanned (stream, epoch, seq) VALUES (?1, ?2, ?3)
         ON CONFLICT (stream) DO UPDATE SET epoch = excluded.epoch, seq = excluded.seq
         WHERE (excluded.epoch, excluded.seq) > (epoch, seq)",
        params![stream, epoch as i64, seq as i64],
    )?;
    Ok(())
}

fn watermark(c: &Connection, stream: &str) -> rusqlite::Result<Option<(u64, u64)>> {
    c.query_row(
        "SELECT epoch, seq FROM idempotency_scanned WHERE stream = ?1",
        params![stream],
        |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
    )
    .optional()
}

/// Forgets keys past the retention or beyond the newest `IDEMPOTENCY_KEYS_MAX`.
fn prune(conn: &Connection, now: i64) -> rusqlite::Result<()> {
    let oldest = now.saturating_sub(IDEMPOTENCY_RETENTION.as_nanos() as i64);
    conn.execute(
        "DELETE FROM idempotency_keys WHERE created_ns < ?1",
        params![oldest],
    )?;
    conn.execute(
        "DELETE FROM idempotency_keys WHERE rowid NOT IN
             (SELECT rowid FROM idempotency_keys ORDER BY created_ns DESC LIMIT ?1)",
        params![IDEMPOTENCY_KEYS_MAX as i64],
    )?;
    Ok(())
}

/// A key found in the log: the stream's key, its row.
type Found = (String, Row);

/// Reads the key records of `(stream, epoch)` with seqs in `after+1..=last`. Returns the last
/// seq read; a block that fails verification ends the scan there with a warning.
fn scan_epoch(
    log: &LogHandle,
    stream: &str,
    epoch: u64,
    (after, last): (u64, u64),
    found: &mut Vec<Found>,
) -> Result<u64, ReadError> {
    let mut cursor = after;
    while cursor < last {
        let blocks = match log.read_blocks(stream, epoch, cursor, SCAN_CHUNK_BYTES) {
            Ok(b) => b,
            Err(e @ ReadError::Corrupt { .. }) => {
                tracing::warn!(stream, epoch = format_args!("{epoch:016x}"), error = %e, "idempotency keys after this block are not rebuilt");
                return Ok(last);
            }
            Err(e) => return Err(e),
        };
        let Some(end) = blocks.last().map(|b| b.header.last_seq()) else {
            break;
        };
        for b in &blocks {
            let block = match decode_block(&b.bytes, &DecodeLimits::default()) {
                Ok(block) => block,
                Err(e) => {
                    tracing::warn!(stream, epoch = format_args!("{epoch:016x}"), error = %e, "idempotency keys after this block are not rebuilt");
                    return Ok(last);
                }
            };
            let first = block.header.first_seq;
            for (i, r) in block.records.iter().enumerate() {
                let seq = first + i as u64;
                let Some(tag) = KeyTag::of(r).filter(|_| seq > cursor && seq <= last) else {
                    continue;
                };
                let row = Row {
                    body_digest: tag.body_digest,
                    epoch,
                    first_seq: (seq + 1).saturating_sub(tag.count).max(1),
                    last_seq: seq,
                    count: tag.count,
                    created_ns: tag.created_ns,
                };
                found.push((tag.key, row));
            }
        }
        if end <= cursor {
            break;
        }
        cursor = end;
    }
    Ok(cursor.max(last))
}

/// Reads `stream`'s log above the cache's watermark and adds the keys found (a cached row
/// wins), then moves the watermark to the end read. Blocking. Returns the keys found.
fn reconcile(log: &LogHandle, keys: &KeyStore, stream: &str) -> Result<usize, IdempotencyError> {
    let from = keys.with(|c| watermark(c, stream))?;
    let mut found = Vec::new();
    let mut end = from;
    for (epoch, first, last) in log.epochs_held(stream) {
        let after = match from {
            Some((e, _)) if e > epoch => continue,
            Some((e, s)) if e == epoch => s.max(first.saturating_sub(1)),
            _ => first.saturating_sub(1),
        };
        let read_to = if after < last {
            scan_epoch(log, stream, epoch, (after, last), &mut found).map_err(|source| {
                IdempotencyError::Scan {
                    stream: stream.to_owned(),
                    source,
                }
            })?
        } else {
            after
        };
        end = end.max(Some((epoch, read_to)));
    }
    let n = found.len();
    keys.with(|c| {
        let tx = c.transaction()?;
        for (key, row) in &found {
            insert(&tx, "IGNORE", stream, key, row)?;
        }
        if let Some((epoch, seq)) = end {
            advance_watermark(&tx, stream, epoch, seq)?;
        }
        prune(&tx, now_ns())?;
        tx.commit()
    })?;
    let at = |m: Option<(u64, u64)>| m.map_or("none".to_string(), |(e, s)| format!("{e}:{s}"));
    tracing::info!(stream, keys = n, from = %at(from), to = %at(end), "idempotency keys read back from the log");
    Ok(n)
}

impl Ingest {
    /// Looks `key` up for `stream`: the stored answer of an earlier request, or a claim on the
    /// key for this one. `body_digest` (see [`body_digest`]) tells a retry from a reuse. The
    /// first call on a stream after start reads the stream's keys back from the log.
    pub async fn begin_idempotent(
        &self,
        stream: &str,
        key: &str,
        body_digest: u64,
    ) -> Result<IdempotentStart, IdempotencyError> {
        if !valid_key(key) {
            return Err(IdempotencyError::BadKey);
        }
        self.reconcile(stream).await?;
        let id = (stream.to_owned(), key.to_owned());
        if lock(&self.keys.unknown).contains(&id) {
            return Err(IdempotencyError::EarlierMaybeStored);
        }
        if !lock(&self.keys.inflight).insert(id) {
            return Err(IdempotencyError::InProgress);
        }
        // From here the claim frees the key on every early return.
        let claim = KeyClaim {
            keys: self.keys.clone(),
            stream: stream.to_owned(),
            key: key.to_owned(),
            body_digest,
        };
        let keys = self.keys.clone();
        let (s, k) = (stream.to_owned(), key.to_owned());
        let found = tokio::task::spawn_blocking(move || keys.lookup(&s, &k))
            .await
            .map_err(|e| self.keys.err(e))??;
        match found {
            None => Ok(IdempotentStart::Claimed(claim)),
            Some(row) if row.body_digest != body_digest => Err(IdempotencyError::BodyMismatch),
            Some(row) => Ok(IdempotentStart::Replay(BatchAnswer {
                stream: stream.to_owned(),
                epoch: row.epoch,
                first_seq: row.first_seq,
                last_seq: row.last_seq,
                count: row.count,
                replayed: true,
            })),
        }
    }

    /// Reads `stream`'s keys back from the log into the cache, once per start. Called by the
    /// first keyed request; the binary may call it at start-up.
    pub async fn reconcile(&self, stream: &str) -> Result<(), IdempotencyError> {
        let Some(cell) = self.keys.reconciled.get(stream) else {
            return Err(AppendError::UnknownStream(stream.to_owned()).into());
        };
        cell.get_or_try_init(|| {
            let (log, keys, s) = (self.log().clone(), self.keys.clone(), stream.to_owned());
            async move {
                tokio::task::spawn_blocking(move || reconcile(&log, &keys, &s).map(|_| ()))
                    .await
                    .map_err(|e| self.keys.err(e))?
            }
        })
        .await
        .map(|_| ())
    }

    /// Filters and appends the batch of a claimed key with its key record on the last record,
    /// then caches the answer. If caching fails, the batch is still stored and the answer
    /// still given: the key is in the log, and the next start reads it back.
    pub async fn ingest_claimed(
        &self,
        claim: KeyClaim,
        mut records: Vec<Record>,
    ) -> Result<BatchAnswer, IdempotencyError> {
        strip_key_fields(&mut records);
        let records = self.run_filters(&claim.stream, records);
        let created_ns = now_ns();
        let ack = if records.is_empty() {
            self.filtered_out_ack(&claim.stream)
        } else {
            self.append_keyed(&claim, records, created_ns).await?
        };
        let answer = BatchAnswer {
            stream: ack.stream.clone(),
            epoch: ack.epoch,
            first_seq: ack.first_seq,
            last_seq: ack.last_seq,
            count: stored_count(&ack),
            replayed: false,
        };
        #[cfg(feature = "fault-injection")]
        if self
            .keys
            .faults
            .skip_cache_write
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Ok(answer);
        }
        let row = Row {
            body_digest: claim.body_digest,
            epoch: answer.epoch,
            first_seq: answer.first_seq,
            last_seq: answer.last_seq,
            count: answer.count,
            created_ns,
        };
        let (log, keys) = (self.log().clone(), self.keys.clone());
        let cached = tokio::task::spawn_blocking(move || cache_answer(&log, &claim, &row, &keys))
            .await
            .map_err(|e| self.keys.err(e))
            .and_then(|r| r);
        if let Err(e) = cached {
            tracing::warn!(error = %e, "idempotency key not cached; it is in the log and is read back at the next start");
        }
        Ok(answer)
    }

    /// Appends `records` with the key record on the last one. An unknown outcome marks the
    /// key (refused until restart) and the stream (its watermark stays).
    async fn append_keyed(
        &self,
        claim: &KeyClaim,
        mut records: Vec<Record>,
        created_ns: i64,
    ) -> Result<AppendAck, IdempotencyError> {
        let tag = KeyTag {
            key: claim.key.clone(),
            body_digest: claim.body_digest,
            count: records.len() as u64,
            created_ns,
        };
        #[cfg(feature = "fault-injection")]
        let tagged = !self
            .keys
            .faults
            .key_record_off
            .load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "fault-injection"))]
        let tagged = true;
        if let (Some(last), true) = (records.last_mut(), tagged) {
            last.fields
                .push((KEY_FIELD.to_owned(), Value::Str(tag.encode())));
        }
        match self.append_counted(&claim.stream, records).await {
            Ok(ack) => Ok(ack),
            Err(e) if outcome_unknown(&e) => {
                lock(&self.keys.dirty).insert(claim.stream.clone());
                lock(&self.keys.unknown).insert((claim.stream.clone(), claim.key.clone()));
                Err(IdempotencyError::MaybeStored(e))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The test-only switches of this agent's keys.
    #[cfg(feature = "fault-injection")]
    pub fn fault_switches(&self) -> &FaultSwitches {
        &self.keys.faults
    }
}

/// Writes a claimed key's row, then moves the watermark to the log's end when no other keyed
/// request on the stream is being served. Blocking.
fn cache_answer(
    log: &LogHandle,
    claim: &KeyClaim,
    row: &Row,
    keys: &KeyStore,
) -> Result<(), IdempotencyError> {
    let n = keys
        .stored
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    let written = keys.with(|c| {
        insert(c, "REPLACE", &claim.stream, &claim.key, row)?;
        if n.is_multiple_of(PRUNE_EVERY) {
            prune(c, now_ns())?;
        }
        Ok(())
    });
    if written.is_err() {
        lock(&keys.dirty).insert(claim.stream.clone());
        return written;
    }
    // The tail is read before the others are checked: a request that claims after the check
    // appends after the tail, and one that ended before it has written its row.
    let Some((epoch, _, tail)) = log.epochs_held(&claim.stream).last().copied() else {
        return Ok(());
    };
    let others = lock(&keys.inflight)
        .iter()
        .any(|(s, k)| *s == claim.stream && *k != claim.key);
    if others || lock(&keys.dirty).contains(&claim.stream) {
        return Ok(());
    }
    keys.with(|c| advance_watermark(c, &claim.stream, epoch, tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        let tag = KeyTag {
            key: "order 17/a".into(),
            body_digest: 0xdead_beef_0000_0001,
            count: 3,
            created_ns: 1_700_000_000_000_000_000,
        };
        let text = tag.encode();
        assert_eq!(text, "1 deadbeef00000001 3 1700000000000000000 order 17/a");
        assert_eq!(KeyTag::decode(&text), Some(tag));
        for bad in [
            "",
            "2 deadbeef00000001 3 1 k",
            "1 xyz 3 1 k",
            "1 00 0 1 k",
            "1 00 3 1",
            "1 00 3 1 ",
        ] {
            assert_eq!(KeyTag::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn unknown_outcomes() {
        assert!(outcome_unknown(&AppendError::Storage("eio".into())));
        assert!(outcome_unknown(&AppendError::Closed));
        assert!(!outcome_unknown(&AppendError::Poisoned("eio".into())));
        assert!(!outcome_unknown(&AppendError::EmptyBatch));
    }
}
