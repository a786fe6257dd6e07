//! The one front door for records entering the agent, and the HTTP body decoding in front of it.
//!
//! Every source (the HTTP API, MQTT, the sensor sources) hands whole batches to
//! [`Ingest::ingest`], which runs the stream's filter pipeline (when it has `filters`), appends
//! what comes out to the local log, waits for durability and counts the outcome for `/metrics`.
//! Keeping this in one place means a source can never forget to count or to filter.
//!
//! A plain stream's pipeline runs here, under a mutex, before sequencing. Its window and
//! interval state lives in memory only: a restart loses open windows, and when producers race,
//! their batches may be stored in another order than the pipeline saw them. For exactly-once
//! windows, filter in a derived stream instead (`crate::filters::derive`), which reads its
//! input back from the log.
//!
//! # Idempotency keys
//!
//! A batch sent with an `Idempotency-Key` goes through [`Ingest::begin_idempotent`] and
//! [`Ingest::ingest_claimed`]: the first time, the batch is appended and, once it is durable,
//! its answer (epoch and seq range) is stored under `(stream, key)` in `data_dir/idempotency.db`
//! (SQLite, WAL, `synchronous = FULL`). A retry with the same key and the same body gets the
//! stored answer and stores nothing; the same key with another body is refused. A retry while
//! the first request is still running is refused too (the client retries later).
//!
//! Retention: a key is kept for [`IDEMPOTENCY_RETENTION`] (24 hours) and among the newest
//! [`IDEMPOTENCY_KEYS_MAX`] (100,000) keys, whichever ends first; older keys are forgotten and a
//! retry with them appends again. Keys survive restarts.
//!
//! Limit: the key is stored after the batch is durable, not atomically with it. If the agent
//! dies between the two (a few milliseconds), the batch is stored but the key is not, and a
//! retry appends the batch a second time. Only failed appends and that window lead to a fresh
//! append; an answered request is always replayed.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};
use thiserror::Error;

use sync::Record;
use sync::parse::{ParseError, ParseOptions, parse_line_protocol, parse_ndjson_with};

use crate::config::StreamConfig;
use crate::filters::Pipeline;
use crate::log::{AppendAck, AppendError, LogHandle};
use crate::metrics::Metrics;

/// Appends batches to the log and counts them. Cheap to clone.
#[derive(Clone)]
pub struct Ingest {
    log: LogHandle,
    metrics: Arc<Metrics>,
    keys: Arc<KeyStore>,
    /// Pipelines of plain streams with `filters`.
    pipelines: Arc<HashMap<String, Mutex<Pipeline>>>,
    /// Derived streams and their source: they take no records from here.
    derived: Arc<HashMap<String, String>>,
}

/// The number of records an [`AppendAck`] covers (0 for a batch filtered out entirely).
pub fn stored_count(ack: &AppendAck) -> u64 {
    if ack.first_seq == 0 {
        0
    } else {
        ack.last_seq + 1 - ack.first_seq
    }
}

/// How long an idempotency key is remembered.
pub const IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// How many idempotency keys are remembered at most (the newest).
pub const IDEMPOTENCY_KEYS_MAX: u64 = 100_000;
/// Longest accepted idempotency key, in bytes.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 255;
/// Prune old keys once per this many stored keys.
const PRUNE_EVERY: u64 = 1_000;

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

/// A key being served by one request. Dropping it without storing frees the key, so a retry
/// after a failed append tries again.
#[derive(Debug)]
pub struct KeyClaim {
    keys: Arc<KeyStore>,
    stream: String,
    key: String,
    body_digest: u64,
}

impl Drop for KeyClaim {
    fn drop(&mut self) {
        self.keys
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.stream.clone(), self.key.clone()));
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
    #[error(transparent)]
    Append(#[from] AppendError),
}

/// Idempotency keys in `data_dir/idempotency.db`, opened on first use.
struct KeyStore {
    path: PathBuf,
    conn: Mutex<Option<Connection>>,
    inflight: Mutex<HashSet<(String, String)>>,
    stored: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl KeyStore {
    fn err(&self, e: impl std::fmt::Display) -> IdempotencyError {
        IdempotencyError::Store {
            path: self.path.display().to_string(),
            message: e.to_string(),
        }
    }

    /// Runs `f` on the open connection, opening it first if needed.
    fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, IdempotencyError> {
        let mut guard = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let conn = Connection::open(&self.path).map_err(|e| self.err(e))?;
            conn.execute_batch(
                "PRAGMA journal_mode = WAL;
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
                     ON idempotency_keys (created_ns);",
            )
            .map_err(|e| self.err(e))?;
            prune(&conn, now_ns()).map_err(|e| self.err(e))?;
            *guard = Some(conn);
        }
        let conn = guard.as_ref().ok_or_else(|| self.err("not open"))?;
        f(conn).map_err(|e| self.err(e))
    }
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

/// FNV-1a 64 of a request body, to tell a retry from a different batch under the same key.
pub fn body_digest(content_type: &str, body: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in content_type.as_bytes().iter().chain(&[0xff]).chain(body) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest").finish_non_exhaustive()
    }
}

impl Ingest {
    pub fn new(log: LogHandle, metrics: Arc<Metrics>) -> Self {
        let keys = Arc::new(KeyStore {
            path: log.config().data_dir.join("idempotency.db"),
            conn: Mutex::new(None),
            inflight: Mutex::new(HashSet::new()),
            stored: std::sync::atomic::AtomicU64::new(0),
        });
        Ingest {
            log,
            metrics,
            keys,
            pipelines: Arc::default(),
            derived: Arc::default(),
        }
    }

    /// As [`Ingest::new`], running the `filters` of plain streams before sequencing and refusing
    /// derived streams. The config was validated, so every pipeline compiles; one that does not
    /// (a bug) is left out with an error logged rather than taking the agent down.
    pub fn with_streams(log: LogHandle, metrics: Arc<Metrics>, streams: &[StreamConfig]) -> Self {
        let mut ingest = Ingest::new(log, metrics);
        let mut pipelines = HashMap::new();
        let mut derived = HashMap::new();
        for s in streams {
            if let Some(src) = &s.source_stream {
                derived.insert(s.name.clone(), src.clone());
                continue;
            }
            if s.filters.is_empty() {
                continue;
            }
            match Pipeline::compile(&s.filters) {
                Ok(p) => {
                    ingest.metrics.register_filter(&s.name, p.stats().clone());
                    pipelines.insert(s.name.clone(), Mutex::new(p));
                }
                Err(e) => tracing::error!(stream = %s.name, error = %e, "filters not compiled"),
            }
        }
        ingest.pipelines = Arc::new(pipelines);
        ingest.derived = Arc::new(derived);
        ingest
    }

    /// The source of `stream` when it is a derived stream.
    pub fn derived_from(&self, stream: &str) -> Option<&str> {
        self.derived.get(stream).map(String::as_str)
    }

    /// Looks `key` up for `stream`: the stored answer of an earlier request, or a claim on the
    /// key for this one. `body_digest` (see [`body_digest`]) tells a retry from a reuse.
    pub async fn begin_idempotent(
        &self,
        stream: &str,
        key: &str,
        body_digest: u64,
    ) -> Result<IdempotentStart, IdempotencyError> {
        if key.is_empty()
            || key.len() > IDEMPOTENCY_KEY_BYTES_MAX
            || !key.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
        {
            return Err(IdempotencyError::BadKey);
        }
        let id = (stream.to_owned(), key.to_owned());
        if !self
            .keys
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id)
        {
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
        let found = tokio::task::spawn_blocking(move || {
            keys.with(|c| {
                c.query_row(
                    "SELECT body_digest, epoch, first_seq, last_seq, count
                     FROM idempotency_keys WHERE stream = ?1 AND key = ?2",
                    params![s, k],
                    |r| {
                        Ok((
                            r.get::<_, i64>(0)?,
                            r.get::<_, i64>(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, i64>(3)?,
                            r.get::<_, i64>(4)?,
                        ))
                    },
                )
                .optional()
            })
        })
        .await
        .map_err(|e| self.keys.err(e))??;
        match found {
            None => Ok(IdempotentStart::Claimed(claim)),
            Some((digest, ..)) if digest as u64 != body_digest => {
                Err(IdempotencyError::BodyMismatch)
            }
            Some((_, epoch, first_seq, last_seq, count)) => {
                Ok(IdempotentStart::Replay(BatchAnswer {
                    stream: stream.to_owned(),
                    epoch: epoch as u64,
                    first_seq: first_seq as u64,
                    last_seq: last_seq as u64,
                    count: count as u64,
                    replayed: true,
                }))
            }
        }
    }

    /// Appends the batch of a claimed key and, once it is durable, stores the answer under the
    /// key. If storing the key fails, the batch is still stored and the answer still given (a
    /// retry would then append again; the failure is logged).
    pub async fn ingest_claimed(
        &self,
        claim: KeyClaim,
        records: Vec<Record>,
    ) -> Result<BatchAnswer, IdempotencyError> {
        let ack = self.ingest(&claim.stream, records).await?;
        let answer = BatchAnswer {
            stream: ack.stream.clone(),
            epoch: ack.epoch,
            first_seq: ack.first_seq,
            last_seq: ack.last_seq,
            count: stored_count(&ack),
            replayed: false,
        };
        let keys = self.keys.clone();
        let row = answer.clone();
        let (s, k, digest) = (claim.stream.clone(), claim.key.clone(), claim.body_digest);
        let stored = tokio::task::spawn_blocking(move || {
            let n = keys
                .stored
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            keys.with(|c| {
                let now = now_ns();
                c.execute(
                    "INSERT OR REPLACE INTO idempotency_keys
                     (stream, key, body_digest, epoch, first_seq, last_seq, count, created_ns)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                    params![
                        s,
                        k,
                        digest as i64,
                        row.epoch as i64,
                        row.first_seq as i64,
                        row.last_seq as i64,
                        row.count as i64,
                        now
                    ],
                )?;
                if n.is_multiple_of(PRUNE_EVERY) {
                    prune(c, now)?;
                }
                Ok(())
            })
        })
        .await
        .map_err(|e| self.keys.err(e))
        .and_then(|r| r);
        if let Err(e) = stored {
            tracing::warn!(error = %e, "idempotency key not stored; a retry with it would append again");
        }
        drop(claim);
        Ok(answer)
    }

    /// Runs `stream`'s filters over `records`, then appends what comes out as one atomic batch;
    /// resolves once it is durable. When the filters drop everything, nothing is appended and
    /// the ack has `first_seq == last_seq == 0`.
    pub async fn ingest(
        &self,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<AppendAck, AppendError> {
        let records = match self.pipelines.get(stream) {
            Some(p) if !records.is_empty() => {
                let out = p.lock().unwrap_or_else(|e| e.into_inner()).run(records);
                if out.is_empty() {
                    return Ok(AppendAck {
                        stream: stream.to_owned(),
                        epoch: self.log.epoch(),
                        first_seq: 0,
                        last_seq: 0,
                    });
                }
                out
            }
            _ => records,
        };
        let count = records.len() as u64;
        let implausible = records
            .iter()
            .filter(|r| implausible_ts(r.ts, now_ns()))
            .count() as u64;
        let result = self.log.append(stream, records).await;
        match &result {
            Ok(_) => {
                self.metrics.appended(stream, count);
                if implausible > 0 {
                    self.metrics.implausible_ts(stream, implausible);
                }
            }
            Err(e) => self.metrics.append_failed(stream, e),
        }
        result
    }

    /// The log records are appended to.
    pub fn log(&self) -> &LogHandle {
        &self.log
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// How a request body encodes records, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// `application/x-ndjson`, `application/json`, `application/jsonl`.
    Ndjson,
    /// `text/plain`: InfluxDB line protocol, as Telegraf sends it.
    LineProtocol,
}

/// The content types the ingest endpoint accepts, for error messages.
pub const ACCEPTED_CONTENT_TYPES: &str =
    "application/x-ndjson or application/json (NDJSON), text/plain (line protocol)";

impl BodyFormat {
    /// Maps a `Content-Type` header (parameters such as `charset` ignored).
    pub fn from_content_type(value: &str) -> Option<Self> {
        let media = value
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match media.as_str() {
            "application/x-ndjson"
            | "application/json"
            | "application/jsonl"
            | "application/ndjson" => Some(BodyFormat::Ndjson),
            "text/plain" => Some(BodyFormat::LineProtocol),
            _ => None,
        }
    }
}

/// Why a body could not be turned into records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// Not UTF-8: names the line holding the first bad byte.
    NotUtf8 {
        line: usize,
    },
    Parse(ParseError),
    /// A line-protocol record written to another measurement than the URL's stream.
    WrongMeasurement {
        line: usize,
        measurement: String,
        stream: String,
    },
    /// Only blank or comment lines.
    Empty,
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::NotUtf8 { line } => write!(f, "line {line}: the body is not valid UTF-8"),
            BodyError::Parse(e) => write!(f, "{e}"),
            BodyError::WrongMeasurement {
                line,
                measurement,
                stream,
            } => write!(
                f,
                "line {line}: measurement {measurement:?} does not match the stream {stream:?} \
                 in the URL: post it to /v1/streams/{measurement}/records"
            ),
            BodyError::Empty => write!(f, "the body holds no records"),
        }
    }
}

impl BodyError {
    /// The 1-based line and column the error points at, when it points at one.
    pub fn position(&self) -> Option<(usize, usize)> {
        match self {
            BodyError::NotUtf8 { line } | BodyError::WrongMeasurement { line, .. } => {
                Some((*line, 1))
            }
            BodyError::Parse(e) => Some((e.line, e.column)),
            BodyError::Empty => None,
        }
    }
}

/// Decodes a request body for `stream`. Records without a timestamp get `default_ts`.
pub fn parse_body(
    format: BodyFormat,
    stream: &str,
    body: &[u8],
    default_ts: i64,
) -> Result<Vec<Record>, BodyError> {
    let text = std::str::from_utf8(body).map_err(|e| BodyError::NotUtf8 {
        line: 1 + body[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count(),
    })?;
    let opts = ParseOptions {
        default_ts: Some(default_ts),
    };
    let records = match format {
        BodyFormat::Ndjson => parse_ndjson_with(text, &opts).map_err(BodyError::Parse)?,
        BodyFormat::LineProtocol => {
            let lines = parse_line_protocol(text, &opts).map_err(BodyError::Parse)?;
            if let Some(bad) = lines.iter().find(|l| l.measurement != stream) {
                let line = measurement_line(text, &bad.measurement).unwrap_or(1);
                return Err(BodyError::WrongMeasurement {
                    line,
                    measurement: bad.measurement.clone(),
                    stream: stream.to_owned(),
                });
            }
            lines.into_iter().map(|l| l.record).collect()
        }
    };
    if records.is_empty() {
        return Err(BodyError::Empty);
    }
    Ok(records)
}

/// The 1-based number of the first line written to `measurement`, for error messages.
fn measurement_line(text: &str, measurement: &str) -> Option<usize> {
    text.lines()
        .position(|line| {
            let line = line.trim_start();
            !line.starts_with('#')
                && line
                    .strip_prefix(measurement)
                    .is_some_and(|rest| rest.starts_with([',', ' ']))
        })
        .map(|i| i + 1)
}

/// Now, in nanoseconds since the Unix epoch: the timestamp of records sent without one.
pub fn now_ns() -> i64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// How far ahead of the agent's clock an event time may be before it counts as implausible.
pub const TS_FUTURE_SLACK_NS: i64 = 86_400_000_000_000;

/// Event time is stored as given; sequence order, never time, decides order and dedupe. A time
/// before this binary was built, or more than a day ahead of the clock, is counted on
/// `/metrics` so that a device with a bad clock is visible.
pub fn implausible_ts(ts: i64, now_ns: i64) -> bool {
    let built_ns = crate::link::BUILD_UNIX
        .parse::<i64>()
        .unwrap_or(0)
        .saturating_mul(1_000_000_000);
    // A clock behind the build time is itself wrong; judge the future against the later of the two.
    ts < built_ns || ts > now_ns.max(built_ns).saturating_add(TS_FUTURE_SLACK_NS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types() {
        let cases = [
            ("application/x-ndjson", Some(BodyFormat::Ndjson)),
            ("application/json; charset=utf-8", Some(BodyFormat::Ndjson)),
            ("Application/X-NDJSON", Some(BodyFormat::Ndjson)),
            ("text/plain; charset=utf-8", Some(BodyFormat::LineProtocol)),
            ("text/csv", None),
            ("", None),
        ];
        for (ct, want) in cases {
            assert_eq!(BodyFormat::from_content_type(ct), want, "{ct}");
        }
    }

    #[test]
    fn bodies() {
        let ok = br#"{"key":"a","ts":1,"fields":{"x":1}}"#;
        assert_eq!(parse_body(BodyFormat::Ndjson, "s", ok, 0).unwrap().len(), 1);
        let no_ts = br#"{"key":"a","fields":{"x":1}}"#;
        assert_eq!(
            parse_body(BodyFormat::Ndjson, "s", no_ts, 42).unwrap()[0].ts,
            42
        );
        assert_eq!(
            parse_body(BodyFormat::Ndjson, "s", b"\n\n", 0),
            Err(BodyError::Empty)
        );
        let bad = parse_body(BodyFormat::Ndjson, "s", b"{\"key\":\"a\"}\n{", 0).unwrap_err();
        assert!(bad.position().is_some());
        let not_utf8 = parse_body(BodyFormat::Ndjson, "s", b"{}\n\xff", 0).unwrap_err();
        assert_eq!(not_utf8, BodyError::NotUtf8 { line: 2 });
        let lp = b"# c\ns,dev=a x=1 5\nother,dev=b x=2 6\n";
        let e = parse_body(BodyFormat::LineProtocol, "s", lp, 0).unwrap_err();
        assert_eq!(e.position(), Some((3, 1)), "{e}");
        let recs = parse_body(BodyFormat::LineProtocol, "s", b"s,dev=a x=1 5\n", 0).unwrap();
        assert_eq!(recs[0].key, "a");
    }
}
