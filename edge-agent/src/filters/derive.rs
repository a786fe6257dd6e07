//! Derived streams: a runner per `[[streams]]` entry with `source_stream`, which reads the
//! source stream's durable records back from the local log, runs the stream's filter pipeline
//! and appends what comes out to the derived stream, exactly once across crashes.
//!
//! # Exactly once
//!
//! The runner's position is `(epoch, seq)`: the last source record it has consumed. Its
//! progress file, `data_dir/derived/{stream}.progress`, holds
//! - `committed`: a position and the pipeline's state after consuming it, such that every output
//!   of the source up to that position is stored in the derived stream and none after it;
//! - `pending` (or null): the position and state after the next output batch, with that batch's
//!   record count, a digest of its records, and the derived stream's tail `(epoch, last seq)`
//!   before it.
//!
//! A batch with outputs goes: write the progress file with `pending` (tmp file, fsync, rename,
//! fsync the directory), then append the batch to the derived stream (one atomic batch: all or
//! nothing across a crash), wait until it is durable, and only then read further. At start-up
//! the pending batch is resolved before anything else is appended: it landed when the derived
//! stream's tail moved past `tail_before` and its last `count` records have the stored digest;
//! then the runner continues from `pending`, else from `committed`, replaying the source from
//! there. The pipeline is deterministic (outputs depend only on the records in order), so a
//! replay reproduces exactly the outputs that were not stored. The resolved position is written
//! back at once. A kill at any point therefore neither loses nor repeats an output, and a
//! window is emitted exactly once.
//!
//! Consuming source records that produce no output moves the position in memory only; it is
//! written (as a new `committed`, with a fresh snapshot) at most every [`PERSIST_EVERY`]. After
//! a crash those records are simply consumed again, which emits nothing again.
//!
//! Only the runner writes to a derived stream: the config refuses sources that target one and
//! the HTTP API answers 409. The runner drops the `_idempotency` field of source records (a
//! keyed batch's key record, see `crate::http::idempotency`) before its filters see them.
//!
//! # Source retention
//!
//! A local source stream (`replicate = false`) is freed through the log's acknowledgement marks:
//! once every derived stream of the source has committed a position, and that position is older
//! than the source's `retention`, it is recorded as acknowledged and the log deletes the
//! segments it covers. So the records a runner may have to replay are never deleted.
//!
//! # Limits
//!
//! - Changing a derived stream's `filters` discards the stored pipeline state (its fingerprint no
//!   longer matches): open windows start empty at the committed position, with a warning.
//! - The landed check compares contents: if the hub made the agent move the derived stream to a
//!   new epoch (rekey) between writing `pending` and appending, and the records moved end with
//!   exactly the pending batch's records, the batch is taken as landed.
//! - A replicated source stream is freed by the hub's acknowledgements, not by the runner; if
//!   the runner lags behind tiering by more than the log holds, it skips what was deleted.
//! - A corrupt progress file (its checksum fails: the disk, not a crash) stops the runner with
//!   an error; move the file aside to restart from the oldest held source record.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value as Json, json};
use sync::Record;
use sync::block::{DecodeLimits, decode_block};
use thiserror::Error;

use super::{Pipeline, fnv1a, record_to_json};
use crate::config::{EdgeConfig, StreamConfig};
use crate::http::Ingest;
use crate::log::{AppendError, LogHandle};

/// How often a position that produced no output is written to the progress file.
pub const PERSIST_EVERY: Duration = Duration::from_secs(1);
/// How many bytes of source blocks one step reads (at least one block).
const CHUNK_BYTES: usize = 1 << 20;
/// The progress file's first line, followed by the crc32c of the JSON body.
const MAGIC: &str = "tributary-derive-progress v1 crc32c=";

/// A position in a stream: the last consumed `(epoch, seq)`; `(0, 0)` before the first record.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pos {
    pub epoch: u64,
    pub seq: u64,
}

impl std::fmt::Display for Pos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.epoch, self.seq)
    }
}

/// Why a runner could not start or persist its progress.
#[derive(Debug, Error)]
pub enum DeriveError {
    #[error("derived stream {stream:?}: filters: {message}")]
    Compile { stream: String, message: String },
    #[error("progress file {path}: {message}")]
    Progress { path: PathBuf, message: String },
    #[error("derived stream {stream:?}: reading the log: {message}")]
    Read { stream: String, message: String },
}

/// A committed position and the pipeline state after it.
#[derive(Debug, Clone, PartialEq)]
struct Committed {
    pos: Pos,
    state: Json,
}

/// An output batch that is written to the progress file before it is appended.
#[derive(Debug, Clone, PartialEq)]
struct Pending {
    pos: Pos,
    state: Json,
    count: u64,
    digest: u64,
    tail_before: Pos,
}

/// The progress file's content.
#[derive(Debug, Clone, PartialEq)]
struct Progress {
    committed: Committed,
    pending: Option<Pending>,
}

fn pos_json(p: Pos) -> Json {
    json!({ "epoch": p.epoch, "seq": p.seq })
}

fn pos_from(v: &Json) -> Option<Pos> {
    Some(Pos {
        epoch: v.get("epoch")?.as_u64()?,
        seq: v.get("seq")?.as_u64()?,
    })
}

impl Progress {
    fn to_json(&self) -> Json {
        json!({
            "committed": { "pos": pos_json(self.committed.pos), "state": self.committed.state },
            "pending": self.pending.as_ref().map(|p| json!({
                "pos": pos_json(p.pos),
                "state": p.state,
                "count": p.count,
                "digest": format!("{:016x}", p.digest),
                "tail_before": pos_json(p.tail_before),
            })),
        })
    }

    fn from_json(v: &Json) -> Option<Progress> {
        let c = v.get("committed")?;
        let committed = Committed {
            pos: pos_from(c.get("pos")?)?,
            state: c.get("state")?.clone(),
        };
        let pending = match v.get("pending")? {
            Json::Null => None,
            p => Some(Pending {
                pos: pos_from(p.get("pos")?)?,
                state: p.get("state")?.clone(),
                count: p.get("count")?.as_u64()?,
                digest: u64::from_str_radix(p.get("digest")?.as_str()?, 16).ok()?,
                tail_before: pos_from(p.get("tail_before")?)?,
            }),
        };
        Some(Progress { committed, pending })
    }
}

/// Where a derived stream's progress lives.
pub fn progress_path(data_dir: &Path, stream: &str) -> PathBuf {
    data_dir.join("derived").join(format!("{stream}.progress"))
}

/// Reads a progress file; `Ok(None)` when there is none yet.
fn read_progress(path: &Path) -> Result<Option<Progress>, DeriveError> {
    let bad = |message: String| DeriveError::Progress {
        path: path.to_owned(),
        message,
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
    };
    let (head, body) = text
        .split_once('\n')
        .ok_or_else(|| bad("no header line".into()))?;
    let crc = head
        .strip_prefix(MAGIC)
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| bad(format!("unknown header {head:?}")))?;
    if crc32c::crc32c(body.as_bytes()) != crc {
        return Err(bad(
            "checksum mismatch (corrupted on disk): move the file aside to restart the stream \
             from the oldest held source record"
                .into(),
        ));
    }
    let json: Json = serde_json::from_str(body).map_err(|e| bad(e.to_string()))?;
    Progress::from_json(&json)
        .map(Some)
        .ok_or_else(|| bad("malformed content".into()))
}

/// Replaces the progress file atomically: tmp file, fsync, rename, fsync the directory.
fn write_progress(path: &Path, p: &Progress) -> Result<(), DeriveError> {
    use std::io::Write as _;
    let io = |e: std::io::Error| DeriveError::Progress {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let body = p.to_json().to_string();
    let tmp = path.with_extension("progress.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(format!("{MAGIC}{:08x}\n", crc32c::crc32c(body.as_bytes())).as_bytes())
        .map_err(io)?;
    f.write_all(body.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io)
}

/// A digest of a batch's records, to recognise it in the derived stream after a crash.
pub fn batch_digest(records: &[Record]) -> u64 {
    let mut bytes = Vec::new();
    for r in records {
        bytes.extend_from_slice(record_to_json(r).to_string().as_bytes());
        bytes.push(b'\n');
    }
    fnv1a(&bytes)
}

/// Durable records of `stream` in `epoch` with seqs in `after+1..=last`, in order.
pub fn read_records(
    log: &LogHandle,
    stream: &str,
    epoch: u64,
    after: u64,
    last: u64,
) -> Result<Vec<Record>, String> {
    let mut out = Vec::new();
    let mut cursor = after;
    while cursor < last {
        let blocks = log
            .read_blocks(stream, epoch, cursor, CHUNK_BYTES)
            .map_err(|e| e.to_string())?;
        if blocks.is_empty() {
            break;
        }
        for b in blocks {
            let block =
                decode_block(&b.bytes, &DecodeLimits::default()).map_err(|e| e.to_string())?;
            let first = block.header.first_seq;
            for (i, r) in block.records.into_iter().enumerate() {
                let seq = first + i as u64;
                if seq > cursor && seq <= last {
                    out.push(r);
                }
            }
            cursor = cursor.max(b.header.last_seq());
        }
    }
    Ok(out)
}

/// The newest durable record position of `stream`, `(0, 0)` when it holds none.
fn tail(log: &LogHandle, stream: &str) -> Pos {
    log.epochs_held(stream)
        .last()
        .map_or(Pos::default(), |&(epoch, _, last)| Pos { epoch, seq: last })
}

/// Frees a local source stream's records once every derived stream has committed past them and
/// they are older than the retention. Shared by the runners of one source.
#[derive(Debug)]
pub struct SourceRetention {
    log: LogHandle,
    source: String,
    retention: Duration,
    inner: Mutex<RetentionInner>,
}

#[derive(Debug)]
struct RetentionInner {
    /// Each consumer's committed position; `None` until it reported one.
    marks: HashMap<String, Option<Pos>>,
    /// Minimum positions over time, oldest first, at most one per second.
    history: VecDeque<(Instant, Pos)>,
}

impl SourceRetention {
    fn new(log: LogHandle, source: &str, retention: Duration, consumers: &[String]) -> Self {
        SourceRetention {
            log,
            source: source.to_owned(),
            retention,
            inner: Mutex::new(RetentionInner {
                marks: consumers.iter().map(|c| (c.clone(), None)).collect(),
                history: VecDeque::new(),
            }),
        }
    }

    /// `consumer` has committed `pos`.
    fn update(&self, consumer: &str, pos: Pos) {
        let now = Instant::now();
        let ack = {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            g.marks.insert(consumer.to_owned(), Some(pos));
            let min = g.marks.values().copied().collect::<Option<Vec<Pos>>>();
            if let Some(min) = min.and_then(|m| m.into_iter().min()) {
                let fresh = g.history.back().is_none_or(|(t, p)| {
                    *p != min && now.duration_since(*t) >= Duration::from_secs(1)
                });
                if fresh {
                    g.history.push_back((now, min));
                }
            }
            let mut ack = None;
            while let Some(&(t, p)) = g.history.front() {
                if now.duration_since(t) < self.retention {
                    break;
                }
                ack = Some(p);
                g.history.pop_front();
            }
            ack
        };
        if let Some(p) = ack {
            for (epoch, _, last) in self.log.epochs_held(&self.source) {
                let upto = match epoch.cmp(&p.epoch) {
                    std::cmp::Ordering::Less => last,
                    std::cmp::Ordering::Equal => p.seq,
                    std::cmp::Ordering::Greater => break,
                };
                let _ = self.log.set_acked(&self.source, epoch, upto, upto);
            }
        }
    }
}

/// One derived stream's runner.
pub struct Runner {
    ingest: Ingest,
    derived: String,
    source: String,
    pipeline: Pipeline,
    path: PathBuf,
    retention: Option<Arc<SourceRetention>>,
    committed: Committed,
    pos: Pos,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("derived", &self.derived)
            .field("source", &self.source)
            .field("pos", &self.pos)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// Compiles the pipeline, reads the progress file and resolves a pending batch (blocking
    /// file IO: call it off the async threads). The resolved position is persisted before this
    /// returns, so nothing is appended before the landed check is final.
    pub fn open(
        ingest: Ingest,
        stream: &StreamConfig,
        retention: Option<Arc<SourceRetention>>,
    ) -> Result<Runner, DeriveError> {
        let source = stream.source_stream.clone().unwrap_or_default();
        let mut pipeline = Pipeline::compile(&stream.filters)
            .map(|p| p.with_idle_close(stream.idle_close))
            .map_err(|e| DeriveError::Compile {
                stream: stream.name.clone(),
                message: e.to_string(),
            })?;
        let path = progress_path(&ingest.log().config().data_dir, &stream.name);
        let fresh = Committed {
            pos: Pos::default(),
            state: pipeline.snapshot(),
        };
        let committed = match read_progress(&path)? {
            None => fresh,
            Some(Progress { committed, pending }) => {
                let resolved = match pending {
                    Some(p) if landed(ingest.log(), &stream.name, &p)? => {
                        tracing::info!(stream = %stream.name, seq = p.pos.seq, "derived: the pending batch is stored; continuing after it");
                        Committed {
                            pos: p.pos,
                            state: p.state,
                        }
                    }
                    Some(p) => {
                        tracing::info!(stream = %stream.name, from = committed.pos.seq, upto = p.pos.seq, "derived: the pending batch was not stored; replaying the source");
                        committed
                    }
                    None => committed,
                };
                match pipeline.restore(&resolved.state) {
                    Ok(()) => resolved,
                    Err(e) => {
                        tracing::warn!(stream = %stream.name, error = %e, "derived: pipeline state not restored (filters changed?): open windows start empty");
                        pipeline = Pipeline::compile(&stream.filters)
                            .map(|p| p.with_idle_close(stream.idle_close))
                            .map_err(|e| DeriveError::Compile {
                                stream: stream.name.clone(),
                                message: e.to_string(),
                            })?;
                        Committed {
                            pos: resolved.pos,
                            state: pipeline.snapshot(),
                        }
                    }
                }
            }
        };
        write_progress(
            &path,
            &Progress {
                committed: committed.clone(),
                pending: None,
            },
        )?;
        ingest
            .metrics()
            .register_filter(&stream.name, pipeline.stats().clone());
        if let Some(r) = &retention {
            r.update(&stream.name, committed.pos);
        }
        let runner = Runner {
            ingest,
            derived: stream.name.clone(),
            source,
            pipeline,
            path,
            retention,
            pos: committed.pos,
            committed,
        };
        runner.publish();
        Ok(runner)
    }

    /// The last consumed source position.
    pub fn position(&self) -> Pos {
        self.pos
    }

    /// Shows the position on `/metrics` and `/v1/status`.
    fn publish(&self) {
        self.pipeline
            .stats()
            .consumed_seq
            .store(self.pos.seq, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reads the next chunk of durable source records after `self.pos`: the records and the
    /// position after them.
    fn read_chunk(&self) -> Result<Option<(Vec<Record>, Pos)>, DeriveError> {
        let log = self.ingest.log();
        let err = |message: String| DeriveError::Read {
            stream: self.derived.clone(),
            message,
        };
        for (epoch, _first, last) in log.epochs_held(&self.source) {
            if epoch < self.pos.epoch {
                continue;
            }
            let after = if epoch == self.pos.epoch {
                self.pos.seq
            } else {
                0
            };
            if last <= after {
                continue;
            }
            let blocks = log
                .read_blocks(&self.source, epoch, after, CHUNK_BYTES)
                .map_err(|e| err(e.to_string()))?;
            let mut records = Vec::new();
            let mut end = after;
            for b in blocks {
                let block = decode_block(&b.bytes, &DecodeLimits::default())
                    .map_err(|e| err(e.to_string()))?;
                let first = block.header.first_seq;
                for (i, r) in block.records.into_iter().enumerate() {
                    if first + i as u64 > after {
                        records.push(r);
                    }
                }
                end = end.max(b.header.last_seq());
            }
            if end > after {
                // A keyed batch's key record belongs to the source stream's answers only.
                crate::http::idempotency::strip_key_fields(&mut records);
                return Ok(Some((records, Pos { epoch, seq: end })));
            }
        }
        Ok(None)
    }

    /// Persists progress off the async threads.
    async fn persist(&self, p: Progress) -> Result<(), DeriveError> {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || write_progress(&path, &p))
            .await
            .map_err(|e| DeriveError::Progress {
                path: self.path.clone(),
                message: e.to_string(),
            })?
    }

    /// The outputs the log can store: one over `ingest.fields_per_record_max` (a stage that
    /// adds fields) would be refused on every retry and stall the stream, so it is left out,
    /// logged with the reason. Deterministic, so a replay after a crash leaves out the same.
    fn storable(&self, out: Vec<Record>) -> Vec<Record> {
        let max = self.ingest.log().config().fields_per_record_max;
        let before = out.len();
        let mut first_error = None;
        let kept: Vec<Record> = out
            .into_iter()
            .enumerate()
            .filter(|(i, r)| match crate::log::sealable(*i, r, max) {
                Ok(()) => true,
                Err(e) => {
                    first_error.get_or_insert(e);
                    false
                }
            })
            .map(|(_, r)| r)
            .collect();
        if let Some(e) = first_error {
            let dropped = before - kept.len();
            tracing::warn!(stream = %self.derived, dropped, error = %e, "derived: outputs the log cannot store are left out");
        }
        kept
    }

    /// One step: consumes the next chunk, appending its outputs. `Ok(false)` when there was
    /// nothing to read. An append that fails is retried with the same batch (its pending entry
    /// stays valid) until it succeeds or the log closes (`Err`).
    pub async fn step(&mut self) -> Result<bool, StepError> {
        let Some((records, next)) = self.read_chunk()? else {
            return Ok(false);
        };
        let out = self.pipeline.run(records);
        let out = self.storable(out);
        if out.is_empty() {
            self.pos = next;
            self.publish();
            return Ok(true);
        }
        self.store(out, next).await?;
        Ok(true)
    }

    /// Closes the intervals of quiet keys (`super::idle`) and stores what they emit like a
    /// step's outputs, at the current position: the pending entry carries the state with
    /// those intervals closed, so after a crash they are either stored and closed, or open
    /// again and closed by a later tick. `Ok(false)` when nothing was due.
    pub async fn close_idle(&mut self) -> Result<bool, StepError> {
        let out = self.pipeline.close_idle();
        let out = self.storable(out);
        if out.is_empty() {
            return Ok(false);
        }
        self.store(out, self.pos).await?;
        Ok(true)
    }

    /// Appends `out`, the outputs of the source records up to `next`, as one batch behind a
    /// pending entry (see the module docs), then commits `next`.
    async fn store(&mut self, out: Vec<Record>, next: Pos) -> Result<(), StepError> {
        let pending = Pending {
            pos: next,
            state: self.pipeline.snapshot(),
            count: out.len() as u64,
            digest: batch_digest(&out),
            tail_before: tail(self.ingest.log(), &self.derived),
        };
        self.persist(Progress {
            committed: self.committed.clone(),
            pending: Some(pending.clone()),
        })
        .await?;
        let mut backoff = Duration::from_millis(10);
        loop {
            match self.ingest.ingest(&self.derived, out.clone()).await {
                Ok(_) => break,
                Err(AppendError::Closed) => return Err(StepError::Closed),
                Err(e) => {
                    tracing::warn!(stream = %self.derived, error = %e, "derived: append failed; retrying the same batch");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        self.committed = Committed {
            pos: pending.pos,
            state: pending.state,
        };
        self.pos = next;
        self.publish();
        if let Some(r) = &self.retention {
            r.update(&self.derived, self.pos);
        }
        Ok(())
    }

    /// Writes the in-memory position as committed when it moved without output.
    pub async fn checkpoint(&mut self) -> Result<(), DeriveError> {
        if self.pos == self.committed.pos {
            if let Some(r) = &self.retention {
                r.update(&self.derived, self.pos);
            }
            return Ok(());
        }
        let committed = Committed {
            pos: self.pos,
            state: self.pipeline.snapshot(),
        };
        self.persist(Progress {
            committed: committed.clone(),
            pending: None,
        })
        .await?;
        self.committed = committed;
        if let Some(r) = &self.retention {
            r.update(&self.derived, self.pos);
        }
        Ok(())
    }

    /// Runs until the log shuts down: consumes whatever is durable, then waits for more.
    pub async fn run(mut self) {
        let mut durable = self.ingest.log().durable_watch();
        let mut last_checkpoint = Instant::now();
        let mut last_idle = Instant::now();
        let mut backoff = Duration::from_millis(100);
        loop {
            // Quiet keys are closed once per tick even while the source stays busy with
            // other keys.
            if last_idle.elapsed() >= super::idle::IDLE_TICK {
                last_idle = Instant::now();
                match self.close_idle().await {
                    Ok(_) => {}
                    Err(StepError::Closed) => return,
                    Err(StepError::Derive(e)) => {
                        tracing::warn!(stream = %self.derived, error = %e, "derived: closing idle intervals failed; retrying");
                    }
                }
            }
            match self.step().await {
                Ok(true) => {
                    backoff = Duration::from_millis(100);
                    if last_checkpoint.elapsed() >= PERSIST_EVERY {
                        if let Err(e) = self.checkpoint().await {
                            tracing::warn!(stream = %self.derived, error = %e, "derived: checkpoint failed");
                        }
                        last_checkpoint = Instant::now();
                    }
                    continue;
                }
                Ok(false) => {}
                Err(StepError::Closed) => return,
                Err(StepError::Derive(e)) => {
                    // A read or progress failure: nothing was appended for this chunk; retry.
                    tracing::warn!(stream = %self.derived, error = %e, "derived: step failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                    continue;
                }
            }
            if last_checkpoint.elapsed() >= PERSIST_EVERY {
                if let Err(e) = self.checkpoint().await {
                    tracing::warn!(stream = %self.derived, error = %e, "derived: checkpoint failed");
                }
                last_checkpoint = Instant::now();
            }
            tokio::select! {
                changed = durable.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(PERSIST_EVERY.min(super::idle::IDLE_TICK)) => {}
            }
        }
    }
}

/// Why a runner step stopped.
#[derive(Debug, Error)]
pub enum StepError {
    #[error(transparent)]
    Derive(#[from] DeriveError),
    #[error("the local log is shut down")]
    Closed,
}

/// True when the pending batch is the derived stream's tail.
fn landed(log: &LogHandle, stream: &str, p: &Pending) -> Result<bool, DeriveError> {
    let now = tail(log, stream);
    if now == p.tail_before || now.seq < p.count {
        return Ok(false);
    }
    let records =
        read_records(log, stream, now.epoch, now.seq - p.count, now.seq).map_err(|message| {
            DeriveError::Read {
                stream: stream.to_owned(),
                message,
            }
        })?;
    Ok(records.len() as u64 == p.count && batch_digest(&records) == p.digest)
}

/// Opens a runner for every derived stream and spawns it on the current runtime. Runners that
/// cannot start are logged and left out; the rest of the agent keeps running.
pub async fn spawn_all(cfg: &EdgeConfig, ingest: Ingest) -> Vec<tokio::task::JoinHandle<()>> {
    let mut handles = vec![tokio::spawn(close_idle_plain(ingest.clone()))];
    let mut retention: HashMap<String, Arc<SourceRetention>> = HashMap::new();
    for s in &cfg.streams {
        if s.replicate || s.is_derived() {
            continue;
        }
        let consumers: Vec<String> = cfg
            .streams
            .iter()
            .filter(|d| d.source_stream.as_deref() == Some(s.name.as_str()))
            .map(|d| d.name.clone())
            .collect();
        if !consumers.is_empty() {
            retention.insert(
                s.name.clone(),
                Arc::new(SourceRetention::new(
                    ingest.log().clone(),
                    &s.name,
                    s.retention,
                    &consumers,
                )),
            );
        }
    }
    for s in cfg.streams.iter().filter(|s| s.is_derived()) {
        let r = s
            .source_stream
            .as_ref()
            .and_then(|src| retention.get(src).cloned());
        let (ingest, stream) = (ingest.clone(), s.clone());
        let opened = tokio::task::spawn_blocking(move || Runner::open(ingest, &stream, r)).await;
        match opened {
            Ok(Ok(runner)) => {
                tracing::info!(stream = %s.name, source = %crate::logging::Maybe(s.source_stream.as_ref()), position = %runner.position(), "derived stream running");
                handles.push(tokio::spawn(runner.run()));
            }
            Ok(Err(e)) => {
                tracing::error!(stream = %s.name, error = %e, "derived stream not started")
            }
            Err(e) => tracing::error!(stream = %s.name, error = %e, "derived stream not started"),
        }
    }
    handles
}

/// Closes the idle intervals of plain streams' pipelines once per [`super::idle::IDLE_TICK`]
/// until the log shuts down (derived streams' runners close their own).
async fn close_idle_plain(ingest: Ingest) {
    let mut tick = tokio::time::interval(super::idle::IDLE_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if ingest.close_idle_intervals().await.is_err() {
            return;
        }
    }
}
