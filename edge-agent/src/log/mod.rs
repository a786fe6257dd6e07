//! The edge agent's durable local log: per-stream sequence numbers, sealed blocks in segment
//! files, group commit, crash recovery, a disk budget and retention.
//!
//! # How it works
//!
//! - **One writer thread** owns every segment file. Producers call [`LogHandle::append`] (or
//!   [`LogHandle::append_blocking`]); the batch goes through a bounded channel
//!   (`queue_batches_max`) with a oneshot reply. The writer drains everything queued, assigns
//!   seqs per `(epoch, stream)` without gaps, and stages the records into the stream's pending
//!   block.
//! - **Sealing.** A pending block is sealed (`sync::block::encode_block_with`, zstd) when it
//!   reaches `block_records_max` or `block_bytes_max`, when it is older than `block_linger`, or
//!   whenever an fsync is about to happen (so every waiting producer is covered). A producer
//!   batch never spans blocks unless it alone exceeds the limits; then every block of it but the
//!   last carries `FLAG_BATCH_CONTINUES` and every block but the first `FLAG_BATCH_CONTINUED`,
//!   and recovery drops every batch missing its head or its tail, so a batch is all or nothing.
//! - **Writing.** Sealed blocks are framed (`sync::segment::frame_header`) into one reusable
//!   buffer per stream and written with one `append` per segment, preceded after each fsync by a
//!   sync mark holding the file length that fsync made durable. Segments are
//!   `data_dir/streams/{stream}/{epoch:016x}-{first_seq:020}.seg`; at `segment_bytes_max` the
//!   writer rolls: fsync the old file, create the new one with `segment_header()`, fsync it,
//!   fsync the directory.
//! - **Durability.** [`FsyncPolicy::Always`] is group commit: every batch drained in one loop
//!   iteration shares one fsync per dirty file. [`FsyncPolicy::Interval`] fsyncs at most every
//!   interval and producers wait for it. [`FsyncPolicy::Never`] answers after the write and is
//!   unsafe: a power cut loses acknowledged data. Replies are sent only after the fsync; then
//!   the durable seqs are published (read by [`LogHandle::read_blocks`], which never returns a
//!   block that is not durable) and [`LogHandle::durable_watch`] is bumped.
//! - **Poisoning.** Any failed write or fsync poisons the log: the failing batches get the IO
//!   error, every later append gets [`AppendError::Poisoned`]. A retried fsync may report
//!   success with the data lost, so only a reopen, which re-verifies everything, clears it.
//! - **Recovery** ([`Log::open`]) scans every segment with `sync::segment::scan` and checks
//!   every block with `verify_block`. A fault in the last segment of an epoch that no later sync
//!   mark proves durable was never durable (a torn or unwritten tail of the last fsync group,
//!   holes followed by later frames of that group included): truncated, bytes and records
//!   reported, no gap marker. A fault in a sealed segment, or one a later mark proves durable, is
//!   corruption: the bad bytes are copied to `data_dir/quarantine/`, their seq range (from the
//!   neighbouring blocks) becomes a `Corrupt` gap marker, and the segment is rewritten without
//!   them (tmp file, fsync, rename, fsync dir). A segment whose header is unreadable is moved to
//!   quarantine whole. Every incomplete batch is dropped: truncated if its end never reached the
//!   disk, quarantined as `Corrupt` otherwise (modules `durability`, `batches`). Recovered
//!   tails are fsynced before anything is published as durable. The agent always starts.
//! - **Epochs.** A random u64 (below 2^62) minted when the data directory is first used; every
//!   later epoch is random but above all earlier ones (and above the hub's `epoch_min` when it
//!   asks for one), so epochs sort in minting order. Kept in `data_dir/epochs.log` (CRC-framed
//!   entries, fsynced; the last is current) and mirrored in the catalog.
//!   [`LogHandle::mint_epoch`] / [`LogHandle::mint_epoch_rekey`] start a new one; seqs restart
//!   at 1 in it, and older epochs stay readable.
//! - **Gap markers** are kept in `streams/{stream}/gaps.log` (CRC-framed, fsynced before the
//!   data they describe is deleted) and mirrored in the catalog, so they survive catalog loss.
//! - **Catalog** (`crate::catalog`): SQLite at `data_dir/catalog.db` (WAL). It holds epochs,
//!   segments, acknowledgements and gap markers, and is rebuilt from the files above if missing
//!   or corrupt; only acknowledgements are lost then (the hub repeats them).
//! - **Disk budget** (`disk_bytes_max`, over segment bytes). [`OnFull::DropOldest`] deletes
//!   whole segments, each time a stream's oldest (write order, so a stream only ever loses a
//!   prefix; among streams the one with the oldest event time), never an active one and never
//!   one holding blocks not yet durable, after writing and fsyncing their exact seq ranges as
//!   `Dropped` gap markers. If power is lost between the marker and the delete, recovery
//!   finishes the delete. Usage stays within the budget when the budget holds one active
//!   segment per stream (which cannot be dropped) plus two sealed ones: `crate::config` refuses
//!   a smaller budget (`BUDGET_SPARE_SEGMENTS`) and derives the segment size from the budget
//!   unless it is configured. Below that, or while writes not yet fsynced span more than a
//!   segment, usage can pass the budget by up to the active segments.
//!   [`OnFull::Block`] answers [`AppendError::Full`] at once when a batch would not fit (a
//!   conservative check on uncompressed sizes); nothing stored is touched.
//! - **Counters** in [`LogStatus`]: `dropped_records` and `dropped_gaps` are summed from the
//!   `Dropped` gap markers, which are permanent, so they survive restarts; `dropped_blocks`
//!   and `quarantined_blocks` count since open.
//! - **Retention.** A segment is deleted once the hub's `tiered_seq` covers its every block
//!   ([`LogHandle::set_acked`]); `durable_seq` alone frees nothing. Records moved to a newer
//!   epoch by [`LogHandle::mint_epoch_rekey`] count as covered once their copy is durable; the
//!   move is recorded in `gaps.log` (after the copy, so a mark never hides uncopied records).
//! - **Not here:** exclusive use of the data directory is the binary's job (`cli::lock`); two
//!   writers on one directory would corrupt it. The catalog goes through the real file system,
//!   not through [`Storage`]; nothing correctness-critical lives only there.
//! - **Tests:** `tests/crash_sim.rs` (seeded power loss on `MemStorage`), `tests/log_*.rs`.

mod batches;
mod durability;
mod index;
mod markers;
mod recovery;
pub mod switches;
mod writer;

pub use index::{Gap, GapReason, LogStatus, StoredBlock, StreamStatus};
pub use writer::cut_for;

use crate::catalog::{Catalog, CatalogError, CatalogLocation};
use crate::storage::Storage;
use index::Shared;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use sync::Record;
use thiserror::Error;
use tokio::sync::{oneshot, watch};

/// When the writer fsyncs, and so when producers are answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Group commit: every batch drained together shares one fsync.
    Always,
    /// At most one fsync per interval; producers wait for the one that covers them.
    Interval(Duration),
    /// Never fsync; producers are answered after the write. Unsafe: a power cut loses
    /// acknowledged records. For benchmarks and throwaway data only.
    Never,
}

/// What to do when the disk budget is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFull {
    /// Drop the oldest whole segments, recording their seq ranges as gap markers first.
    DropOldest,
    /// Refuse new batches with [`AppendError::Full`]; keep everything stored.
    Block,
}

/// The default `ingest.fields_per_record_max`.
pub const FIELDS_PER_RECORD_DEFAULT: usize = 1000;
/// Fields the agent's own sources may add to a record on top of a producer's (`_topic`,
/// `_mqtt_digest`, `_idempotency`, with room to spare).
pub const AGENT_FIELDS_MAX: usize = 8;
/// The highest `ingest.fields_per_record_max`: one record, with the agent's fields, must fit the
/// columnar format's column limit.
pub const FIELDS_PER_RECORD_LIMIT: usize = sync::columnar::COLUMNS_MAX - AGENT_FIELDS_MAX;

/// The log's configuration. Libraries take this struct; binaries build it from `edge.toml`.
#[derive(Debug, Clone)]
pub struct LogConfig {
    pub data_dir: PathBuf,
    /// Configured stream names: `[A-Za-z0-9_.-]{1,64}`.
    pub streams: Vec<String>,
    pub fsync: FsyncPolicy,
    pub segment_bytes_max: u64,
    pub block_records_max: usize,
    /// Approximate, from `Record::approx_bytes`.
    pub block_bytes_max: usize,
    /// Seal a partial block once it is this old (it is always sealed before an fsync).
    pub block_linger: Duration,
    pub block_version: u8,
    /// zstd level for block bodies.
    pub zstd_level: i32,
    /// Budget over segment bytes.
    pub disk_bytes_max: u64,
    pub on_full: OnFull,
    /// Bound of the producer -> writer channel, in batches.
    pub queue_batches_max: usize,
    /// `ingest.fields_per_record_max`: a batch with a record over it (not counting up to
    /// [`AGENT_FIELDS_MAX`] of the agent's own `_` fields) is refused whole with
    /// [`AppendError::TooManyFields`].
    pub fields_per_record_max: usize,
    /// Where the SQLite catalog lives.
    pub catalog: CatalogLocation,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            data_dir: PathBuf::new(),
            streams: Vec::new(),
            fsync: FsyncPolicy::Interval(Duration::from_millis(10)),
            segment_bytes_max: 64 << 20,
            block_records_max: 4096,
            block_bytes_max: 1 << 20,
            block_linger: Duration::from_millis(2),
            block_version: sync::block::VERSION_ROWS,
            zstd_level: 1,
            disk_bytes_max: 2 << 30,
            on_full: OnFull::DropOldest,
            queue_batches_max: 1024,
            fields_per_record_max: FIELDS_PER_RECORD_DEFAULT,
            catalog: CatalogLocation::InDataDir,
        }
    }
}

/// The answer to a successful append: the seqs the batch received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendAck {
    pub stream: String,
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
}

/// Why an append was refused. Nothing of a refused batch is stored.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum AppendError {
    #[error("unknown stream {0:?}")]
    UnknownStream(String),
    #[error("empty batch: nothing to append")]
    EmptyBatch,
    #[error("a record of {bytes} bytes exceeds the {max}-byte record limit")]
    RecordTooLarge { bytes: usize, max: usize },
    #[error(
        "record {index} of the batch has {fields} fields, more than ingest.fields_per_record_max ({max})"
    )]
    TooManyFields {
        index: usize,
        fields: usize,
        max: usize,
    },
    #[error("record {index} of the batch cannot be sealed: {why}")]
    Unsealable { index: usize, why: String },
    #[error("record {index} of the batch has the key {key:?}, which the hub refuses: {why}")]
    BadKey {
        index: usize,
        key: String,
        why: &'static str,
    },
    #[error("disk budget reached (on_full = block): retry after {retry_after:?}")]
    Full { retry_after: Duration },
    #[error("storage failed while writing this batch: {0}")]
    Storage(String),
    #[error(
        "the local log is poisoned after a storage failure and refuses writes until reopened: {0}"
    )]
    Poisoned(String),
    #[error("the local log is shut down")]
    Closed,
}

/// Whether record `index` of a batch can be stored: at most `fields_max` fields (not counting
/// up to [`AGENT_FIELDS_MAX`] of the agent's own `_` fields), and a key and field names within
/// the block format's maxima, tags the hub accepts ([`sync::record::tags_problem`]), and a key the hub accepts ([`sync::record::key_problem`]: a
/// bad key would have the hub refuse the whole block, so it is refused here, alone). What
/// [`LogHandle::append`] checks for every record.
pub fn sealable(index: usize, r: &Record, fields_max: usize) -> Result<(), AppendError> {
    if let Some(why) = sync::record::key_problem(&r.key) {
        return Err(AppendError::BadKey {
            index,
            // A hostile key could be huge; the error only needs to identify it.
            key: r.key.chars().take(120).collect(),
            why,
        });
    }
    if let Some(why) = sync::record::tags_problem(&r.tags) {
        return Err(AppendError::Unsealable { index, why });
    }
    let own = r.fields.iter().filter(|(n, _)| n.starts_with('_')).count();
    let fields = r.fields.len() - own;
    if fields > fields_max || own > AGENT_FIELDS_MAX {
        return Err(AppendError::TooManyFields {
            index,
            fields,
            max: fields_max,
        });
    }
    let names = r.fields.iter().map(|(n, _)| n.len());
    let long = std::iter::once(("key", r.key.len(), sync::parse::KEY_BYTES_MAX))
        .chain(names.map(|n| ("field name", n, sync::parse::FIELD_NAME_BYTES_MAX)))
        .find(|(_, len, max)| len > max);
    if let Some((what, len, max)) = long {
        let why = format!("a {what} of {len} bytes, more than the format allows ({max})");
        return Err(AppendError::Unsealable { index, why });
    }
    Ok(())
}

/// Why [`LogHandle::read_blocks`] failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("unknown stream {0:?}")]
    UnknownStream(String),
    #[error("reading {path}: {error}")]
    Io { path: PathBuf, error: String },
    #[error("block at {path}:{offset} failed verification: {error}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        error: String,
    },
}

/// Why [`LogHandle::set_acked`] failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum AckError {
    #[error("unknown stream {0:?}")]
    UnknownStream(String),
    #[error("the local log is shut down")]
    Closed,
}

/// Why [`LogHandle::mint_epoch`] failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum MintError {
    #[error("the local log is poisoned: {0}")]
    Poisoned(String),
    #[error("storing the new epoch failed: {0}")]
    Storage(String),
    #[error("no epoch at or above {0} is left")]
    EpochSpace(u64),
    #[error("unknown stream {0:?}")]
    UnknownStream(String),
    #[error("moving records into the new epoch failed: {0}")]
    Rekey(String),
    #[error("the local log is shut down")]
    Closed,
}

/// Why the log could not be opened.
#[derive(Debug, Error)]
pub enum OpenError {
    #[error("invalid log configuration: {0}")]
    Config(String),
    #[error("{op} {path}: {source}")]
    Storage {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("starting the writer thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// What recovery found and did at open. Also logged with `tracing`.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    /// The current epoch after open.
    pub epoch: u64,
    /// True when a new epoch was minted at open (fresh data directory, or ambiguous history).
    pub epoch_minted: bool,
    /// Bytes removed from torn tails (and incomplete trailing batches, and empty torn segments).
    pub truncated_bytes: u64,
    /// Records removed with them (those whose block header was still readable).
    pub truncated_records: u64,
    /// Holes followed by valid frames that recovery found to be never durable (part of the
    /// unsynced tail) and truncated, rather than taking them for corruption.
    pub holes_never_durable: u64,
    /// Files written to `data_dir/quarantine/`, and why.
    pub quarantined: Vec<(PathBuf, String)>,
    /// The catalog was missing or corrupt and was rebuilt from the segment files.
    pub catalog_rebuilt: bool,
    /// Where a corrupt catalog was moved.
    pub catalog_moved_aside: Option<PathBuf>,
    /// Segments, blocks and records found.
    pub segments: usize,
    pub blocks: usize,
    pub records: u64,
}

/// Opens logs.
#[derive(Debug)]
pub struct Log;

impl Log {
    /// Recovers the data directory and starts the writer thread.
    pub fn open(
        cfg: LogConfig,
        storage: Arc<dyn Storage>,
    ) -> Result<(LogHandle, RecoveryReport), OpenError> {
        validate(&cfg)?;
        let catalog_path = match &cfg.catalog {
            CatalogLocation::InDataDir => Some(cfg.data_dir.join("catalog.db")),
            CatalogLocation::Path(p) => Some(p.clone()),
            CatalogLocation::Memory => None,
        };
        if catalog_path.is_some() && cfg.catalog == CatalogLocation::InDataDir {
            std::fs::create_dir_all(&cfg.data_dir).map_err(|source| OpenError::Storage {
                op: "create_dir_all",
                path: cfg.data_dir.clone(),
                source,
            })?;
        }
        let (catalog, cat_open) = Catalog::open(catalog_path.as_deref())?;
        let rec = recovery::recover(&cfg, storage.as_ref(), catalog, cat_open)?;
        let report = rec.report.clone();
        recovery::log_report(&report);
        let (tx, rx) = mpsc::sync_channel(cfg.queue_batches_max);
        let shared = Arc::new(Shared::new(storage.clone(), rec.state));
        let stream_ids: HashMap<String, usize> = cfg
            .streams
            .iter()
            .enumerate()
            .map(|(i, s)| (s.clone(), i))
            .collect();
        let w = writer::Writer::new(cfg.clone(), shared.clone(), rec.catalog, rec.writer_streams);
        let thread = std::thread::Builder::new()
            .name("tributary-log-writer".into())
            .spawn(move || w.run(rx))
            .map_err(OpenError::Thread)?;
        let inner = HandleInner {
            tx,
            shared,
            stream_ids,
            cfg,
            thread: Mutex::new(Some(thread)),
        };
        Ok((
            LogHandle {
                inner: Arc::new(inner),
            },
            report,
        ))
    }
}

fn validate(cfg: &LogConfig) -> Result<(), OpenError> {
    let bad = |s: String| Err(OpenError::Config(s));
    if cfg.data_dir.as_os_str().is_empty() {
        return bad("data_dir is empty".into());
    }
    if cfg.streams.is_empty() {
        return bad("no streams configured".into());
    }
    for (i, s) in cfg.streams.iter().enumerate() {
        if !valid_stream_name(s) {
            return bad(format!(
                "stream name {s:?} must match [A-Za-z0-9_.-]{{1,64}}"
            ));
        }
        if s == "." || s == ".." {
            return bad(format!("stream name {s:?} is reserved"));
        }
        if cfg.streams[..i].contains(s) {
            return bad(format!("stream {s:?} is configured twice"));
        }
    }
    if cfg.segment_bytes_max < 1024 {
        return bad(format!(
            "segment_bytes_max {} is below 1024",
            cfg.segment_bytes_max
        ));
    }
    if cfg.block_records_max == 0 || cfg.block_records_max > 1 << 20 {
        return bad(format!(
            "block_records_max {} must be in 1..=1048576",
            cfg.block_records_max
        ));
    }
    if cfg.block_bytes_max == 0 || cfg.block_bytes_max > 64 << 20 {
        return bad(format!(
            "block_bytes_max {} must be in 1..=64MiB",
            cfg.block_bytes_max
        ));
    }
    if cfg.queue_batches_max == 0 {
        return bad("queue_batches_max must be at least 1".into());
    }
    if cfg.block_version != sync::block::VERSION_ROWS
        && cfg.block_version != sync::block::VERSION_COLUMNAR
    {
        return bad(format!("block_version {} is not 1 or 2", cfg.block_version));
    }
    if let FsyncPolicy::Interval(d) = cfg.fsync
        && d.is_zero()
    {
        return bad("fsync interval must be above zero (use Always)".into());
    }
    Ok(())
}

/// True for names matching `[A-Za-z0-9_.-]{1,64}`.
pub fn valid_stream_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
}

/// The largest single record accepted (approximate bytes), well under the frame limit.
pub const RECORD_BYTES_MAX: usize = 16 << 20;

/// Why a refused block could not be quarantined.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum QuarantineError {
    #[error("unknown stream {0:?}")]
    UnknownStream(String),
    #[error(
        "no stored block of {stream} epoch {epoch:016x} lies within seqs {first_seq}..={last_seq}"
    )]
    NotHeld {
        stream: String,
        epoch: u64,
        first_seq: u64,
        last_seq: u64,
    },
    #[error("quarantining a refused block: {0}")]
    Io(String),
    #[error("the log is closed")]
    Closed,
}

/// Messages to the writer thread.
pub(crate) enum Msg {
    Append {
        stream: usize,
        records: Vec<Record>,
        reply: oneshot::Sender<Result<AppendAck, AppendError>>,
    },
    /// Acks changed: persist them and run retention.
    Wake,
    /// The hub refused these seqs for good: quarantine their blocks, record a gap.
    Quarantine {
        stream: usize,
        epoch: u64,
        first_seq: u64,
        last_seq: u64,
        why: String,
        reply: mpsc::Sender<Result<PathBuf, QuarantineError>>,
    },
    /// Mint an epoch `>= epoch_min`, then move `(stream index, old epoch, from_seq)` records.
    Mint {
        epoch_min: u64,
        rekey: Vec<(usize, u64, u64)>,
        reply: mpsc::Sender<Result<u64, MintError>>,
    },
    Shutdown(mpsc::Sender<()>),
}

#[derive(Debug)]
struct HandleInner {
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
    stream_ids: HashMap<String, usize>,
    cfg: LogConfig,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Append {
                stream, records, ..
            } => write!(f, "Append(stream {stream}, {} records)", records.len()),
            Msg::Wake => f.write_str("Wake"),
            Msg::Quarantine {
                stream,
                first_seq,
                last_seq,
                ..
            } => write!(f, "Quarantine({stream}, {first_seq}..={last_seq})"),
            Msg::Mint {
                epoch_min, rekey, ..
            } => write!(f, "Mint(>= {epoch_min}, {} rekeys)", rekey.len()),
            Msg::Shutdown(_) => f.write_str("Shutdown"),
        }
    }
}

impl HandleInner {
    fn shutdown(&self) {
        let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        let (tx, rx) = mpsc::channel();
        if self.tx.send(Msg::Shutdown(tx)).is_ok() {
            // The writer answers after its final flush; a dropped sender means it already exited.
            let _ = rx.recv();
        }
        if thread.join().is_err() {
            tracing::error!("the log writer thread panicked");
        }
    }
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A cheap, cloneable handle to an open log. The log shuts down when the last handle drops.
#[derive(Debug, Clone)]
pub struct LogHandle {
    inner: Arc<HandleInner>,
}

impl LogHandle {
    fn precheck(&self, stream: &str, records: &[Record]) -> Result<usize, AppendError> {
        let id = *self
            .inner
            .stream_ids
            .get(stream)
            .ok_or_else(|| AppendError::UnknownStream(stream.to_string()))?;
        if records.is_empty() {
            return Err(AppendError::EmptyBatch);
        }
        if let Some(msg) = self.inner.shared.poisoned() {
            return Err(AppendError::Poisoned(msg));
        }
        if let Some(big) = records
            .iter()
            .map(Record::approx_bytes)
            .find(|b| *b > RECORD_BYTES_MAX)
        {
            return Err(AppendError::RecordTooLarge {
                bytes: big,
                max: RECORD_BYTES_MAX,
            });
        }
        self.check_sealable(records)?;
        Ok(id)
    }

    /// Refuses a batch the writer could not seal: a record over the field limit, or a key or
    /// field name over the block format's maxima. With this check, sealing (which cuts blocks
    /// at the columnar limits) cannot fail on the batch's content, so a bad batch fails alone
    /// and never poisons the log.
    fn check_sealable(&self, records: &[Record]) -> Result<(), AppendError> {
        let max = self.inner.cfg.fields_per_record_max;
        records
            .iter()
            .enumerate()
            .try_for_each(|(index, r)| sealable(index, r, max))
    }

    /// Appends one batch atomically; resolves once it is durable under the fsync policy.
    pub async fn append(
        &self,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<AppendAck, AppendError> {
        let id = self.precheck(stream, &records)?;
        let (reply, rx) = oneshot::channel();
        let mut msg = Msg::Append {
            stream: id,
            records,
            reply,
        };
        loop {
            // Register for "queue has room" before retrying, so a wakeup cannot be missed.
            let notified = self.inner.shared.queue_space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.inner.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) => {
                    msg = m;
                    notified.await;
                }
                Err(TrySendError::Disconnected(_)) => return Err(AppendError::Closed),
            }
        }
        rx.await.map_err(|_| AppendError::Closed)?
    }

    /// As [`LogHandle::append`], blocking the calling thread. Do not call from async code.
    pub fn append_blocking(
        &self,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<AppendAck, AppendError> {
        let id = self.precheck(stream, &records)?;
        let (reply, rx) = oneshot::channel();
        self.inner
            .tx
            .send(Msg::Append {
                stream: id,
                records,
                reply,
            })
            .map_err(|_| AppendError::Closed)?;
        rx.blocking_recv().map_err(|_| AppendError::Closed)?
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.inner.shared.epoch()
    }

    /// A counter bumped after every fsync (or, under `Never`, write) that made new blocks durable.
    pub fn durable_watch(&self) -> watch::Receiver<u64> {
        self.inner.shared.durable_tx.subscribe()
    }

    /// Durable blocks of `(stream, epoch)` in seq order, starting with the block that holds
    /// `after_seq + 1` (or the next one held, if that seq is in a gap), up to about `bytes_max`
    /// bytes but always at least one block when there is one.
    pub fn read_blocks(
        &self,
        stream: &str,
        epoch: u64,
        after_seq: u64,
        bytes_max: usize,
    ) -> Result<Vec<StoredBlock>, ReadError> {
        self.inner
            .shared
            .read_blocks(stream, epoch, after_seq, bytes_max)
    }

    /// Records the hub's acknowledgements for `(stream, epoch)`. Marks only move forward.
    /// Persisted to the catalog by the writer (batched); segments fully covered by
    /// `tiered_seq` are then deleted.
    pub fn set_acked(
        &self,
        stream: &str,
        epoch: u64,
        durable_seq: u64,
        tiered_seq: u64,
    ) -> Result<(), AckError> {
        if !self.inner.stream_ids.contains_key(stream) {
            return Err(AckError::UnknownStream(stream.to_string()));
        }
        self.inner
            .shared
            .set_acked(stream, epoch, durable_seq, tiered_seq);
        match self.inner.tx.try_send(Msg::Wake) {
            // A full queue means the writer is busy and will see the dirty acks on its next pass.
            Ok(()) | Err(TrySendError::Full(_)) => Ok(()),
            Err(TrySendError::Disconnected(_)) => Err(AckError::Closed),
        }
    }

    /// Quarantines the stored blocks of `(stream, epoch)` within `first_seq..=last_seq`, which
    /// the hub refused for good, and records the range as a `Refused` gap marker (both
    /// fsynced, the copy first): the blocks are never shipped again and the range is reported
    /// to the hub as a gap. Returns the quarantine file. Blocks the calling thread briefly.
    pub fn quarantine_refused(
        &self,
        stream: &str,
        epoch: u64,
        first_seq: u64,
        last_seq: u64,
        why: &str,
    ) -> Result<PathBuf, QuarantineError> {
        let id = *self
            .inner
            .stream_ids
            .get(stream)
            .ok_or_else(|| QuarantineError::UnknownStream(stream.to_string()))?;
        let (reply, rx) = mpsc::channel();
        self.inner
            .tx
            .send(Msg::Quarantine {
                stream: id,
                epoch,
                first_seq,
                last_seq,
                why: why.to_string(),
                reply,
            })
            .map_err(|_| QuarantineError::Closed)?;
        rx.recv().map_err(|_| QuarantineError::Closed)?
    }

    /// Gap markers of a stream, in epoch then seq order.
    pub fn gaps(&self, stream: &str) -> Vec<Gap> {
        self.inner.shared.gaps(stream)
    }

    /// A snapshot of every stream's state.
    pub fn status(&self) -> LogStatus {
        self.inner.shared.status(&self.inner.cfg.streams)
    }

    /// `(epoch, first seq held, last durable seq held)` for every epoch with data in `stream`,
    /// oldest epoch first.
    pub fn epochs_held(&self, stream: &str) -> Vec<(u64, u64, u64)> {
        self.inner.shared.epochs_held(stream)
    }

    /// Starts a new epoch for new appends: random, and above every epoch used before, so epochs
    /// also sort in minting order. Pending data of the old epoch is flushed and fsynced first;
    /// the new epoch is persisted before it is used; seqs start at 1 in it. Blocks the calling
    /// thread briefly (call it from `spawn_blocking` in async code).
    pub fn mint_epoch(&self) -> Result<u64, MintError> {
        self.mint_with(0, Vec::new())
    }

    /// As [`LogHandle::mint_epoch`], with the new epoch `>= epoch_min` (the hub's view), and
    /// first moving every held record of each `rekey` lane with `seq >= from_seq` into the new
    /// epoch, in order, before any new data (the hub holds other data under those seqs). The
    /// copies of one stream are written as one batch (all or nothing across a crash) and fsynced
    /// before this returns; the moved records then no longer count as backlog of their old lane,
    /// are not announced by [`LogHandle::epochs_held`], and retention may delete them.
    pub fn mint_epoch_rekey(
        &self,
        epoch_min: u64,
        rekey: &[sync::protocol::Rekey],
    ) -> Result<u64, MintError> {
        let mut moves = Vec::with_capacity(rekey.len());
        for r in rekey {
            let id = *self
                .inner
                .stream_ids
                .get(&r.stream)
                .ok_or_else(|| MintError::UnknownStream(r.stream.clone()))?;
            moves.push((id, r.epoch, r.from_seq.max(1)));
        }
        self.mint_with(epoch_min, moves)
    }

    fn mint_with(&self, epoch_min: u64, rekey: Vec<(usize, u64, u64)>) -> Result<u64, MintError> {
        let (reply, rx) = mpsc::channel();
        self.inner
            .tx
            .send(Msg::Mint {
                epoch_min,
                rekey,
                reply,
            })
            .map_err(|_| MintError::Closed)?;
        rx.recv().map_err(|_| MintError::Closed)?
    }

    /// Flushes, fsyncs and stops the writer. Later appends fail with [`AppendError::Closed`].
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }

    /// The configuration the log was opened with.
    pub fn config(&self) -> &LogConfig {
        &self.inner.cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_names() {
        assert!(valid_stream_name("telemetry"));
        assert!(valid_stream_name("a.b-c_D9"));
        assert!(!valid_stream_name(""));
        assert!(!valid_stream_name("a/b"));
        assert!(!valid_stream_name(&"x".repeat(65)));
    }
}
