//! The hub's tier 1: one write-ahead log for every device and stream, with group commit.
//!
//! This is Pravega's durable log applied to the hub: all blocks from all devices are appended
//! to one log, so the fsync rate depends on the load, not on the number of devices. One
//! writer thread drains every pending request and writes them with one `write`; a second,
//! committer thread makes everything written so far durable with one `fdatasync` and then
//! applies ONE catalog transaction ([`GroupCommit`]) that moves the durable marks, inserts the
//! block index rows, advances the per-stream hub offsets, and records the WAL end offset those
//! marks cover. Only then are the callers completed.
//!
//! # Pipelining
//!
//! The two threads overlap: while the committer fsyncs and commits group N, the writer already
//! writes group N+1 (at most [`PIPELINE_DEPTH`] groups ahead). Groups are committed in write
//! order, so the committed WAL end and the marks only move forward, and an acknowledgement
//! still follows both the fsync that covers its block and the catalog commit that records it.
//! A failure on either thread poisons the log (except a full disk, below): the failed group and
//! every group written after it fail, and nothing after the committed end survives recovery.
//!
//! # Files
//!
//! `wal/{first_offset:020}.wal`, where `first_offset` is the logical offset of the file's first
//! frame. Logical offsets count frame bytes across files (headers excluded), so the log is one
//! address space even when files roll or are evicted by tiering.
//!
//! ```text
//! file   := header frame*
//! header := magic "TRIBWAL\0" (8) | version u32 LE (4) | crc32c(magic..version) u32 LE (4)
//! frame  := len u32 LE | crc32c(payload) u32 LE | payload          (sync::segment framing)
//! payload:= entry header (56 bytes, below) | block (as in sync::block)
//! ```
//!
//! The entry header, little-endian: kind u8 (1 = block) | 3 reserved bytes | device u32 |
//! stream u32 | count u32 | epoch u64 | first_seq u64 | hub_offset_base u64 | ingest_ts i64 |
//! checksum u64 (`sync::protocol::checksum::range_checksum` of the block's records).
//!
//! # Recovery
//!
//! The catalog stores the WAL end offset covered by the committed marks. At open, every byte
//! after it is dropped: it was never acknowledged, and agents resend from the hub's marks. The
//! frames before it are scanned and must all be intact, or opening fails loudly: they were
//! fsynced and acknowledged, so damage there is a storage fault, not a torn tail. A crash at
//! any point therefore neither loses an acknowledged record nor keeps an unacknowledged one,
//! which would be a duplicate once resent.
//!
//! After a failed write or fsync the writer is poisoned: it fails every later request until
//! the hub is reopened and recovery has re-verified the log (a retried fsync may report
//! success with the data lost).
//!
//! # A full disk
//!
//! ENOSPC or EDQUOT from a `write` (a WAL frame or a new file's header) or from the catalog
//! commit (SQLite's `SQLITE_FULL`) does not poison: the bytes of the failed group are known, no
//! catalog mark covers them, and no fsync failed, so the page cache is not in doubt. Instead:
//!
//! - **write failed** (writer thread): the file is truncated back to where the group started,
//!   files the group rolled into are removed (one it rolled into right at its start stays,
//!   emptied, as the active file), and the stream offsets the group assigned are restored.
//!   Groups written before it are untouched and still commit.
//! - **catalog commit failed** (committer thread): SQLite rolled the transaction back. The
//!   committer fails these groups and every group that reaches it until the writer has
//!   rewound: the writer truncates the log to the committed end, reloads the committed stream
//!   offsets from the catalog, and sends a marker through the pipeline; the committer answers
//!   it once everything written before the rewind has failed.
//!
//! In both cases the failed requests complete with [`CommitError::DiskFull`] (their callers
//! roll back what they advanced for them), and afterwards every request already queued to the
//! writer fails too: it may continue a lane whose earlier block just failed, and committing it
//! would leave a hole. Requests queued later start from the rolled-back state. The writer then
//! refuses everything cheaply ([`WalStats::disk_full`], which ingest checks before decoding)
//! until a probe succeeds: after a backoff (doubling while retries fail, up to
//! [`DISK_FULL_BACKOFF_MAX`]) and once the file system shows [`DISK_FULL_RESUME_FREE_BYTES`]
//! free, writes resume on their own. No restart is needed, and committed data stays readable
//! throughout (reads need no space).

mod committer;
mod disk_full;
mod format;
mod reader;
mod recover;
mod writer;

pub use disk_full::{
    DISK_FULL_BACKOFF_INITIAL, DISK_FULL_BACKOFF_MAX, DISK_FULL_RESUME_FREE_BYTES, is_disk_full,
};
pub use format::{
    ENTRY_HEADER_LEN, EntryHeader, FrameError, FrameHeader, KIND_BLOCK, WAL_HEADER_LEN, WAL_MAGIC,
    WAL_VERSION, encode_frame, frame_len, list_wal_files, list_wal_files_in, verify_frame,
    wal_file_header, wal_file_path,
};
pub use reader::{WalReadError, WalReader};
pub use recover::{Recovered, WalOpenError, recover, recover_in};

use crate::catalog::{BacklogRow, Catalog, DeviceId, GapRow, StreamId};
use crate::storage::Storage;
use committer::Committer;
use recover::open_io;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use writer::Writer;

/// Counters the writer keeps for `/metrics` and the benchmarks.
#[derive(Debug, Default)]
pub struct WalStats {
    /// WAL `fdatasync` calls.
    pub fsyncs: AtomicU64,
    /// Group commits (catalog transactions that covered appends or gaps).
    pub group_commits: AtomicU64,
    /// Requests completed through group commits.
    pub group_commit_requests: AtomicU64,
    /// Blocks appended.
    pub entries: AtomicU64,
    /// Bytes appended (frames).
    pub bytes: AtomicU64,
    /// The committed logical end offset.
    pub committed_end: AtomicU64,
    /// Histogram of group-commit sizes: bucket i counts batches of at most 2^i requests
    /// (the last bucket is unbounded).
    pub batch_hist: [AtomicU64; BATCH_BUCKETS],
    /// Set once the writer is poisoned.
    pub poisoned: AtomicBool,
    /// Set while writes are refused because the disk is full; cleared by the writer's probe.
    pub disk_full: AtomicBool,
    /// Groups that failed (and were rolled back) because the disk was full.
    pub disk_full_failures: AtomicU64,
    /// Requests refused, without being written, while the disk was full.
    pub disk_full_refused: AtomicU64,
    /// Times writes resumed after a full disk.
    pub disk_full_resumed: AtomicU64,
    /// The last disk-full error (names the path); kept after the disk has space again.
    pub disk_full_error: Mutex<Option<CommitError>>,
    /// Set while tier 1 is out of file descriptors (an episode); cleared once a group was
    /// written again or the writer's probe got a descriptor.
    pub fd_exhausted: AtomicBool,
    /// Groups (and retries) that failed for EMFILE or ENFILE and were rolled back.
    pub fd_exhausted_failures: AtomicU64,
    /// The last out-of-descriptors error (names the path).
    pub fd_exhausted_error: Mutex<Option<CommitError>>,
}

/// Number of group-commit size histogram buckets (1, 2, 4, ... 2^14, +Inf).
pub const BATCH_BUCKETS: usize = 16;

impl WalStats {
    /// The error writes are refused with while the disk is full, `None` otherwise.
    pub fn disk_full(&self) -> Option<CommitError> {
        if !self.disk_full.load(Ordering::Acquire) {
            return None;
        }
        let last = self.disk_full_error.lock().expect("disk-full lock").clone();
        Some(last.unwrap_or_else(|| CommitError::DiskFull {
            path: PathBuf::new(),
            detail: "no space left".into(),
        }))
    }

    fn record_batch(&self, n: usize) {
        let bucket = (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize;
        self.batch_hist[bucket.min(BATCH_BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
        self.group_commits.fetch_add(1, Ordering::Relaxed);
        self.group_commit_requests
            .fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Why an append or gap did not become durable.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CommitError {
    #[error("the tier-1 log is poisoned after a storage failure; the hub must be restarted")]
    Poisoned,
    #[error("tier-1 write failed: {0}")]
    Io(String),
    #[error("catalog commit failed: {0}")]
    Catalog(String),
    #[error("the WAL writer has stopped")]
    Stopped,
    /// Tier 1 is over its budget (tier 2 down or behind); retry later. Set by tiering.
    #[error("tier 1 is full, retry later: {0}")]
    Full(String),
    /// The hub's disk (or quota) is full: nothing of the request was kept, and writes resume on
    /// their own once space is free; retry later.
    #[error("the hub's disk is full at {}: {detail}; retry later", path.display())]
    DiskFull { path: PathBuf, detail: String },
    /// The hub ran out of file descriptors (EMFILE, ENFILE) creating or syncing a WAL file:
    /// nothing of the request was kept, and writes resume on their own once descriptors are
    /// free again (`wal::disk_full`); retry later.
    #[error("the hub is out of file descriptors at {}: {detail}; retry later", path.display())]
    FdExhausted { path: PathBuf, detail: String },
    /// An earlier block of the same lane failed to commit after this one was checked, so this
    /// one was not written either; resend from the hub's durable mark.
    #[error("an earlier block of this lane failed to commit; resend from the durable mark")]
    EarlierFailed,
}

/// A block made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendDone {
    pub hub_offset_base: u64,
    pub last_seq: u64,
    pub ingest_ts: i64,
}

/// Completion callback: runs on the writer thread after the fsync and the catalog commit (or
/// the failure). It must be quick and must not block.
pub type Completion<T> = Box<dyn FnOnce(Result<T, CommitError>) + Send>;

/// A block to append.
pub struct AppendRequest {
    pub device: DeviceId,
    pub stream: StreamId,
    pub epoch: u64,
    pub first_seq: u64,
    pub count: u32,
    pub checksum: u64,
    pub min_ts: i64,
    pub max_ts: i64,
    /// The encoded block, already trimmed to the records above the mark.
    pub block: Vec<u8>,
    /// The routing key hashes of the block's records (merged streams route by them).
    pub key_hashes: crate::streams::BlockHashes,
    pub done: Completion<AppendDone>,
}

/// A gap to record, optionally moving the mark over it.
pub struct GapRequest {
    pub gap: GapRow,
    /// The new durable mark when the gap extends the contiguous prefix.
    pub new_mark: Option<u64>,
    pub done: Completion<()>,
}

pub(super) enum Request {
    Append(AppendRequest),
    Gap(GapRequest),
    Stop,
}

/// Metadata written with the next group commit rather than with its own fsync.
#[derive(Debug, Default)]
pub struct DeferredMeta {
    pub contacts: HashMap<DeviceId, i64>,
    pub backlogs: HashMap<(DeviceId, StreamId), BacklogRow>,
}

impl DeferredMeta {
    fn is_empty(&self) -> bool {
        self.contacts.is_empty() && self.backlogs.is_empty()
    }
}

/// Settings of the writer.
#[derive(Clone)]
pub struct WriterConfig {
    pub segment_bytes_max: u64,
    pub group_commit_linger: Duration,
    /// Fault injection for crash tests; `None` in production.
    pub faults: Option<FaultHook>,
    /// Called after each successful catalog commit, before the callers complete: the stream
    /// manager routes the blocks into segments and wakes readers.
    pub on_commit: Option<CommitHook>,
}

/// See [`WriterConfig::on_commit`].
pub type CommitHook = Arc<dyn Fn(&crate::streams::CommittedGroup) + Send + Sync>;

impl std::fmt::Debug for WriterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterConfig")
            .field("segment_bytes_max", &self.segment_bytes_max)
            .field("group_commit_linger", &self.group_commit_linger)
            .field("faults", &self.faults.is_some())
            .field("on_commit", &self.on_commit.is_some())
            .finish()
    }
}

/// A step of a group commit where a test can inject a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// Appending the batch's frames: half of the bytes reach the file, then the write fails
    /// (a torn write).
    Write,
    /// The WAL `fdatasync`: the bytes are written, the sync fails.
    Fsync,
    /// The catalog transaction, after the WAL fsync: the log holds the batch, the marks don't.
    CatalogCommit,
    /// Appending the batch's frames: half of the bytes reach the file, then the write fails
    /// with ENOSPC (a full disk, which is rolled back rather than poisoning).
    WriteNoSpace,
    /// The catalog transaction, after the WAL fsync, fails as SQLite does on a full disk.
    CatalogNoSpace,
}

/// Called at every [`FaultPoint`]; returning `true` makes that step fail.
pub type FaultHook = Arc<dyn Fn(FaultPoint) -> bool + Send + Sync>;

/// The handle producers use; cheap to clone.
#[derive(Clone)]
pub struct WalHandle {
    tx: mpsc::Sender<Request>,
    stats: Arc<WalStats>,
    deferred: Arc<Mutex<DeferredMeta>>,
}

impl std::fmt::Debug for WalHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalHandle").finish_non_exhaustive()
    }
}

impl WalHandle {
    /// Queues a block. `done` runs once it is durable and in the catalog, or has failed.
    pub fn append(&self, req: AppendRequest) {
        if let Err(req) = self.try_append(req) {
            (req.done)(Err(CommitError::Stopped));
        }
    }

    /// As [`WalHandle::append`], but hands the request back instead of running its `done`
    /// when the writer has stopped, so a caller may queue while holding a lock that `done`
    /// takes.
    pub fn try_append(&self, req: AppendRequest) -> Result<(), Box<AppendRequest>> {
        match self.tx.send(Request::Append(req)) {
            Ok(()) => Ok(()),
            Err(mpsc::SendError(Request::Append(req))) => Err(Box::new(req)),
            Err(mpsc::SendError(_)) => unreachable!("the request sent was an append"),
        }
    }

    /// Queues a gap. `done` runs once it is in the catalog, or has failed.
    pub fn gap(&self, req: GapRequest) {
        if let Err(req) = self.try_gap(req) {
            (req.done)(Err(CommitError::Stopped));
        }
    }

    /// As [`WalHandle::gap`], but hands the request back when the writer has stopped (see
    /// [`WalHandle::try_append`]).
    pub fn try_gap(&self, req: GapRequest) -> Result<(), GapRequest> {
        match self.tx.send(Request::Gap(req)) {
            Ok(()) => Ok(()),
            Err(mpsc::SendError(Request::Gap(req))) => Err(req),
            Err(mpsc::SendError(_)) => unreachable!("the request sent was a gap"),
        }
    }

    /// Asks the writer to finish what is queued before this call and exit. Requests queued
    /// later are dropped, which their callers see as [`CommitError::Stopped`].
    pub fn stop(&self) {
        let _ = self.tx.send(Request::Stop);
    }

    /// The writer's counters.
    pub fn stats(&self) -> &Arc<WalStats> {
        &self.stats
    }

    /// Metadata flushed with the next group commit (or within a second when idle).
    pub fn deferred(&self) -> &Arc<Mutex<DeferredMeta>> {
        &self.deferred
    }
}

/// Where the WAL keeps its files and how its threads pace themselves.
#[derive(Debug, Clone)]
pub struct WalEnv {
    pub storage: Arc<dyn Storage>,
    pub tuning: WalTuning,
}

/// The writer's timing. The defaults are the production values; simulations shorten them.
#[derive(Debug, Clone)]
pub struct WalTuning {
    /// How often the writer wakes without requests: to carry out a rewind the committer asked
    /// for and, while the disk is full, to probe for free space.
    pub writer_tick: Duration,
    /// How often an idle committer flushes deferred metadata (contacts, backlogs).
    pub idle_flush: Duration,
    pub disk_full_backoff_initial: Duration,
    pub disk_full_backoff_max: Duration,
    pub disk_full_resume_free_bytes: u64,
    /// Test-only mutations, to prove the crash simulation catches the bugs they introduce.
    #[cfg(feature = "fault-injection")]
    pub mutation: Mutation,
}

impl Default for WalTuning {
    fn default() -> WalTuning {
        WalTuning {
            writer_tick: Duration::from_millis(100),
            idle_flush: Duration::from_secs(1),
            disk_full_backoff_initial: DISK_FULL_BACKOFF_INITIAL,
            disk_full_backoff_max: DISK_FULL_BACKOFF_MAX,
            disk_full_resume_free_bytes: DISK_FULL_RESUME_FREE_BYTES,
            #[cfg(feature = "fault-injection")]
            mutation: Mutation::None,
        }
    }
}

/// A durability step left out on purpose (feature `fault-injection`, tests only).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    None,
    /// The roll does not fsync the WAL directory: a new file's entry may be lost.
    SkipRollDirSync,
    /// The committer does not fsync the WAL before the catalog commit.
    SkipCommitSync,
    /// Cutting off a group after a full disk, or rewinding, removes files without the
    /// directory fsync: a removed file may come back after a crash.
    SkipCutDirSync,
    /// EMFILE or ENFILE on a WAL roll poisons the log, as any other storage error did.
    FdExhaustionFatal,
}

impl WalTuning {
    /// Whether `m` is switched on.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn mutated(&self, m: Mutation) -> bool {
        self.mutation == m
    }

    /// Whether removals after a cut skip their directory fsync (a test-only mutation).
    pub(crate) fn skip_cut_dir_sync(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.mutated(Mutation::SkipCutDirSync);
        #[cfg(not(feature = "fault-injection"))]
        false
    }
}

/// Recovers the WAL in `dir` against the catalog and starts the writer thread, on
/// `env.storage` (`RealStorage` in production) with `env.tuning`.
///
/// `stream_offsets` are the next hub offsets per stream as committed in the catalog. The
/// thread stops when every [`WalHandle`] is dropped.
pub fn start_with(
    env: WalEnv,
    dir: &Path,
    catalog: Arc<Catalog>,
    stream_offsets: HashMap<StreamId, u64>,
    cfg: WriterConfig,
) -> Result<(WalHandle, std::thread::JoinHandle<()>), WalOpenError> {
    let committed_end = catalog
        .wal_committed_end()
        .map_err(|source| WalOpenError::Catalog { source })?;
    let rec = recover_in(&*env.storage, dir, committed_end)?;
    if rec.dropped_bytes > 0 {
        tracing::warn!(
            bytes = rec.dropped_bytes,
            committed_end,
            "dropped the unacknowledged WAL tail"
        );
    }
    let stats = Arc::new(WalStats::default());
    stats.committed_end.store(committed_end, Ordering::Relaxed);
    let deferred = Arc::new(Mutex::new(DeferredMeta::default()));
    let (tx, rx) = mpsc::channel();
    let (written_tx, written_rx) = mpsc::sync_channel(PIPELINE_DEPTH);
    let shared = Arc::new(disk_full::Shared::default());
    let committer = Committer::new(&env, &catalog, &cfg, &stats, &deferred, &shared, dir);
    let committer = std::thread::Builder::new()
        .name("wal-commit".into())
        .spawn(move || committer.run(written_rx))
        .map_err(open_io(dir))?;
    let link = writer::Link {
        stats: stats.clone(),
        shared,
        written: written_tx,
    };
    let writer = Writer::new(
        env,
        dir.to_path_buf(),
        rec,
        stream_offsets,
        cfg,
        catalog,
        link,
    );
    let join = std::thread::Builder::new()
        .name("wal-writer".into())
        .spawn(move || {
            writer.run(rx);
            // The writer dropped its end of the pipeline: the committer finishes what was
            // written and exits, so joining the writer waits for every completion.
            if committer.join().is_err() {
                tracing::error!("the WAL committer panicked");
            }
        })
        .map_err(open_io(dir))?;
    let handle = WalHandle {
        tx,
        stats,
        deferred,
    };
    Ok((handle, join))
}

/// Groups written but not yet fsynced and committed that the writer may run ahead by. One is
/// enough to overlap the next group's write with this one's fsync and catalog transaction;
/// a few more absorb jitter in the fsync time without holding much (metadata only: the
/// bytes are already in the file).
pub const PIPELINE_DEPTH: usize = 4;

/// A failed write: a full disk (rolled back) or anything else (poisons).
pub(super) fn write_error(path: &Path, e: std::io::Error) -> CommitError {
    if is_disk_full(&e) {
        CommitError::DiskFull {
            path: path.to_path_buf(),
            detail: e.to_string(),
        }
    } else {
        CommitError::Io(format!("{}: {e}", path.display()))
    }
}

/// Marks the log poisoned after a storage failure: every later request fails until the hub
/// is reopened and recovery has re-verified the log.
pub(super) fn poison(stats: &WalStats, e: &CommitError) {
    if !stats.poisoned.swap(true, Ordering::AcqRel) {
        tracing::error!(error = %e, "tier-1 group commit failed; the WAL is poisoned until restart");
    }
}

pub(super) fn fault(cfg: &WriterConfig, point: FaultPoint) -> bool {
    cfg.faults.as_ref().is_some_and(|f| f(point))
}

pub(super) fn request_bytes(r: &Request) -> usize {
    match r {
        Request::Append(a) => frame_len(a.block.len()),
        Request::Gap(_) | Request::Stop => 64,
    }
}

pub(super) fn fail(req: Request, e: CommitError) {
    match req {
        Request::Append(a) => (a.done)(Err(e)),
        Request::Gap(g) => (g.done)(Err(e)),
        Request::Stop => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_histogram_buckets() {
        let s = WalStats::default();
        for n in [1, 2, 3, 4, 5, 100, 1 << 20] {
            s.record_batch(n);
        }
        let counts: Vec<u64> = s
            .batch_hist
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        assert_eq!(counts[0], 1); // 1
        assert_eq!(counts[1], 1); // 2
        assert_eq!(counts[2], 2); // 3, 4
        assert_eq!(counts[3], 1); // 5
        assert_eq!(counts[7], 1); // 100
        assert_eq!(counts[BATCH_BUCKETS - 1], 1);
    }
}
