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

use crate::catalog::{BacklogRow, BlockRow, Catalog, DeviceId, GapRow, GroupCommit, StreamId};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use sync::segment::{FRAME_BYTES_MAX, FRAME_HEADER_LEN};
use thiserror::Error;

/// Magic bytes at the start of every WAL file.
pub const WAL_MAGIC: [u8; 8] = *b"TRIBWAL\0";
/// The WAL file version written by this build.
pub const WAL_VERSION: u32 = 1;
/// Size of the WAL file header.
pub const WAL_HEADER_LEN: usize = WAL_MAGIC.len() + 4 + 4;
const _: () = assert!(WAL_HEADER_LEN == 16);

/// Entry kind: a committed block.
pub const KIND_BLOCK: u8 = 1;

const OFF_KIND: usize = 0;
const OFF_DEVICE: usize = OFF_KIND + 4;
const OFF_STREAM: usize = OFF_DEVICE + 4;
const OFF_COUNT: usize = OFF_STREAM + 4;
const OFF_EPOCH: usize = OFF_COUNT + 4;
const OFF_FIRST_SEQ: usize = OFF_EPOCH + 8;
const OFF_HUB_OFFSET: usize = OFF_FIRST_SEQ + 8;
const OFF_INGEST_TS: usize = OFF_HUB_OFFSET + 8;
const OFF_CHECKSUM: usize = OFF_INGEST_TS + 8;
/// Size of the entry header that precedes each block in a frame.
pub const ENTRY_HEADER_LEN: usize = OFF_CHECKSUM + 8;
const _: () = assert!(ENTRY_HEADER_LEN == 56);

/// A batch stops collecting once it holds this many bytes.
const BATCH_BYTES_MAX: usize = 64 << 20;
/// A batch stops collecting once it holds this many requests.
const BATCH_REQUESTS_MAX: usize = 8192;
/// How often an idle writer flushes deferred metadata (contacts, backlogs).
const IDLE_FLUSH: Duration = Duration::from_secs(1);
/// How often the writer wakes without requests: to carry out a rewind the committer asked for
/// and, while the disk is full, to probe for free space.
const WRITER_TICK: Duration = Duration::from_millis(100);
/// The wait after a disk-full failure before writes are tried again.
pub const DISK_FULL_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
/// The longest wait between retries while the disk stays full (the wait doubles per retry
/// that fails before anything committed).
pub const DISK_FULL_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Free bytes the WAL's file system must report before writes resume after a full disk
/// (quotas do not show in `statvfs`; the backoff bounds the retries there).
pub const DISK_FULL_RESUME_FREE_BYTES: u64 = 1 << 20;

/// The entry header of a WAL frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryHeader {
    pub kind: u8,
    pub device: DeviceId,
    pub stream: StreamId,
    pub count: u32,
    pub epoch: u64,
    pub first_seq: u64,
    pub hub_offset_base: u64,
    pub ingest_ts: i64,
    pub checksum: u64,
}

impl EntryHeader {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; ENTRY_HEADER_LEN] {
        let mut b = [0u8; ENTRY_HEADER_LEN];
        b[OFF_KIND] = self.kind;
        b[OFF_DEVICE..OFF_STREAM].copy_from_slice(&self.device.to_le_bytes());
        b[OFF_STREAM..OFF_COUNT].copy_from_slice(&self.stream.to_le_bytes());
        b[OFF_COUNT..OFF_EPOCH].copy_from_slice(&self.count.to_le_bytes());
        b[OFF_EPOCH..OFF_FIRST_SEQ].copy_from_slice(&self.epoch.to_le_bytes());
        b[OFF_FIRST_SEQ..OFF_HUB_OFFSET].copy_from_slice(&self.first_seq.to_le_bytes());
        b[OFF_HUB_OFFSET..OFF_INGEST_TS].copy_from_slice(&self.hub_offset_base.to_le_bytes());
        b[OFF_INGEST_TS..OFF_CHECKSUM].copy_from_slice(&self.ingest_ts.to_le_bytes());
        b[OFF_CHECKSUM..OFF_CHECKSUM + 8].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Parses a header; `None` if `b` is too short.
    pub fn decode(b: &[u8]) -> Option<EntryHeader> {
        let b = b.get(..ENTRY_HEADER_LEN)?;
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        Some(EntryHeader {
            kind: b[OFF_KIND],
            device: u32_at(OFF_DEVICE),
            stream: u32_at(OFF_STREAM),
            count: u32_at(OFF_COUNT),
            epoch: u64_at(OFF_EPOCH),
            first_seq: u64_at(OFF_FIRST_SEQ),
            hub_offset_base: u64_at(OFF_HUB_OFFSET),
            ingest_ts: u64_at(OFF_INGEST_TS) as i64,
            checksum: u64_at(OFF_CHECKSUM),
        })
    }
}

/// The header every WAL file starts with.
pub fn wal_file_header() -> [u8; WAL_HEADER_LEN] {
    let mut h = [0u8; WAL_HEADER_LEN];
    h[..8].copy_from_slice(&WAL_MAGIC);
    h[8..12].copy_from_slice(&WAL_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

fn header_ok(h: &[u8]) -> bool {
    h.len() >= WAL_HEADER_LEN && h[..WAL_HEADER_LEN] == wal_file_header()
}

/// The path of the WAL file whose first logical offset is `first`.
pub fn wal_file_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:020}.wal"))
}

/// The WAL files in `dir`, by first logical offset.
pub fn list_wal_files(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(".wal") else {
            continue;
        };
        if stem.len() == 20
            && let Ok(first) = stem.parse::<u64>()
        {
            out.push(first);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Why the WAL could not be opened.
#[derive(Debug, Error)]
pub enum WalOpenError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the catalog says the WAL holds {committed_end} bytes, but {what}")]
    Missing { committed_end: u64, what: String },
    #[error("{path}: committed WAL data is damaged at byte {pos}: {what}")]
    Corrupt {
        path: PathBuf,
        pos: u64,
        what: String,
    },
}

fn open_io(path: &Path) -> impl FnOnce(std::io::Error) -> WalOpenError + '_ {
    move |source| WalOpenError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What recovery found.
#[derive(Debug)]
pub struct Recovered {
    /// The active file, positioned at its end.
    pub file: File,
    pub first: u64,
    /// Length of the active file in bytes, header included.
    pub len: u64,
    /// Uncommitted bytes dropped from the tail.
    pub dropped_bytes: u64,
}

/// Brings `dir` back to exactly the `committed_end` logical bytes the catalog covers.
pub fn recover(dir: &Path, committed_end: u64) -> Result<Recovered, WalOpenError> {
    std::fs::create_dir_all(dir).map_err(open_io(dir))?;
    let files = list_wal_files(dir).map_err(open_io(dir))?;
    let Some(idx) = files.iter().rposition(|&f| f <= committed_end) else {
        if committed_end != 0 {
            let what = "no WAL file covers that offset".to_string();
            return Err(WalOpenError::Missing {
                committed_end,
                what,
            });
        }
        return create_active(dir, 0, files.iter().map(|&f| wal_file_path(dir, f)));
    };
    let first = files[idx];
    let mut dropped = 0;
    for &later in &files[idx + 1..] {
        let path = wal_file_path(dir, later);
        dropped += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(&path).map_err(open_io(&path))?;
    }
    let path = wal_file_path(dir, first);
    let need = WAL_HEADER_LEN as u64 + (committed_end - first);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(open_io(&path))?;
    let len = file.metadata().map_err(open_io(&path))?.len();
    if len < need {
        let what = format!(
            "{} holds only {} of its {} committed bytes",
            path.display(),
            len,
            need
        );
        return Err(WalOpenError::Missing {
            committed_end,
            what,
        });
    }
    let mut header = [0u8; WAL_HEADER_LEN];
    file.read_exact(&mut header).map_err(open_io(&path))?;
    if !header_ok(&header) {
        if need != WAL_HEADER_LEN as u64 {
            return Err(WalOpenError::Corrupt {
                path,
                pos: 0,
                what: "bad WAL file header".into(),
            });
        }
        // A file rolled just before a crash, holding nothing committed: rewrite its header.
        file.write_all_at(&wal_file_header(), 0)
            .map_err(open_io(&path))?;
    }
    if len > need {
        dropped += len - need;
        file.set_len(need).map_err(open_io(&path))?;
    }
    file.sync_all().map_err(open_io(&path))?;
    sync_dir(dir).map_err(open_io(dir))?;
    verify_frames(&path, &mut file, need)?;
    file.seek(SeekFrom::Start(need)).map_err(open_io(&path))?;
    Ok(Recovered {
        file,
        first,
        len: need,
        dropped_bytes: dropped,
    })
}

/// Cuts the log back to `committed_end` while the hub runs, after a catalog commit failed for
/// a full disk: later files are removed and the active one is truncated. Unlike [`recover`]
/// it neither fsyncs nor re-verifies: no fsync failed, the bytes before the end are the
/// committed ones, and the bytes cut are past the committed end, where recovery drops them
/// anyway should the cut not survive a crash.
fn rewind(dir: &Path, committed_end: u64) -> Result<Recovered, WalOpenError> {
    let files = list_wal_files(dir).map_err(open_io(dir))?;
    let Some(idx) = files.iter().rposition(|&f| f <= committed_end) else {
        let what = "no WAL file covers that offset".to_string();
        return Err(WalOpenError::Missing {
            committed_end,
            what,
        });
    };
    let first = files[idx];
    let mut dropped = 0;
    for &later in &files[idx + 1..] {
        let path = wal_file_path(dir, later);
        dropped += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(&path).map_err(open_io(&path))?;
    }
    let path = wal_file_path(dir, first);
    let need = WAL_HEADER_LEN as u64 + (committed_end - first);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(open_io(&path))?;
    let len = file.metadata().map_err(open_io(&path))?.len();
    if len < need {
        let what = format!("{} holds only {len} of its {need} bytes", path.display());
        return Err(WalOpenError::Missing {
            committed_end,
            what,
        });
    }
    if len > need {
        dropped += len - need;
        file.set_len(need).map_err(open_io(&path))?;
    }
    file.seek(SeekFrom::Start(need)).map_err(open_io(&path))?;
    Ok(Recovered {
        file,
        first,
        len: need,
        dropped_bytes: dropped,
    })
}

fn create_active(
    dir: &Path,
    first: u64,
    stale: impl Iterator<Item = PathBuf>,
) -> Result<Recovered, WalOpenError> {
    let mut dropped = 0;
    for path in stale {
        dropped += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(&path).map_err(open_io(&path))?;
    }
    let path = wal_file_path(dir, first);
    let file = new_wal_file(&path).map_err(open_io(&path))?;
    sync_dir(dir).map_err(open_io(dir))?;
    Ok(Recovered {
        file,
        first,
        len: WAL_HEADER_LEN as u64,
        dropped_bytes: dropped,
    })
}

/// Creates a WAL file holding just its header, fsynced. The caller syncs the directory.
fn new_wal_file(path: &Path) -> std::io::Result<File> {
    let file = create_wal_file(path)?;
    file.sync_all()?;
    Ok(file)
}

/// Creates a WAL file holding just its header, not yet synced: a failure here is a write
/// failure (possibly a full disk), not an fsync failure.
fn create_wal_file(path: &Path) -> std::io::Result<File> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    file.write_all(&wal_file_header())?;
    Ok(file)
}

/// Opens a WAL file (one a failed group rolled into) and empties it down to a valid header,
/// positioned at its end. The header is rewritten only if its creation was cut short.
fn empty_wal_file(path: &Path) -> std::io::Result<File> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let mut header = [0u8; WAL_HEADER_LEN];
    let intact = file.read_exact(&mut header).is_ok() && header_ok(&header);
    if !intact {
        file.set_len(0)?;
        file.write_all_at(&wal_file_header(), 0)?;
    }
    file.set_len(WAL_HEADER_LEN as u64)?;
    file.seek(SeekFrom::Start(WAL_HEADER_LEN as u64))?;
    Ok(file)
}

/// Whether a write failed only because the file system (or a quota) is full. Such a write
/// can be undone by truncating; any other error leaves the file in an unknown state.
pub fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

/// Bytes available to unprivileged writers on the file system holding `dir`.
#[allow(unsafe_code)]
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain old data; all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Checks every frame in `[header, end)` of the active file, streaming.
fn verify_frames(path: &Path, file: &mut File, end: u64) -> Result<(), WalOpenError> {
    file.seek(SeekFrom::Start(WAL_HEADER_LEN as u64))
        .map_err(open_io(path))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, &*file);
    let mut pos = WAL_HEADER_LEN as u64;
    let mut payload = Vec::new();
    let corrupt = |pos: u64, what: &str| WalOpenError::Corrupt {
        path: path.to_path_buf(),
        pos,
        what: what.into(),
    };
    while pos < end {
        let mut fh = [0u8; FRAME_HEADER_LEN];
        reader
            .read_exact(&mut fh)
            .map_err(|_| corrupt(pos, "short frame header"))?;
        let len = u32::from_le_bytes(fh[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(fh[4..].try_into().expect("4 bytes"));
        let frame_end = pos + (FRAME_HEADER_LEN as u64) + u64::from(len);
        if len < ENTRY_HEADER_LEN as u32 || len > FRAME_BYTES_MAX || frame_end > end {
            return Err(corrupt(pos, "bad frame length"));
        }
        payload.resize(len as usize, 0);
        reader
            .read_exact(&mut payload)
            .map_err(|_| corrupt(pos, "short frame"))?;
        if crc32c::crc32c(&payload) != crc {
            return Err(corrupt(pos, "frame checksum mismatch"));
        }
        pos = frame_end;
    }
    Ok(())
}

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

enum Request {
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

/// Recovers the WAL in `dir` against the catalog and starts the writer thread.
///
/// `stream_offsets` are the next hub offsets per stream as committed in the catalog. The
/// thread stops when every [`WalHandle`] is dropped.
pub fn start(
    dir: &Path,
    catalog: Arc<Catalog>,
    stream_offsets: HashMap<StreamId, u64>,
    cfg: WriterConfig,
) -> Result<(WalHandle, std::thread::JoinHandle<()>), WalOpenError> {
    let committed_end = catalog
        .wal_committed_end()
        .map_err(|e| WalOpenError::Missing {
            committed_end: 0,
            what: format!("the catalog cannot be read: {e}"),
        })?;
    let rec = recover(dir, committed_end)?;
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
    let shared = Arc::new(Shared::default());
    let committer = Committer {
        catalog: catalog.clone(),
        cfg: cfg.clone(),
        stats: stats.clone(),
        deferred: deferred.clone(),
        shared: shared.clone(),
        data_dir: dir.parent().unwrap_or(dir).to_path_buf(),
    };
    let committer = std::thread::Builder::new()
        .name("wal-commit".into())
        .spawn(move || committer.run(written_rx))
        .map_err(open_io(dir))?;
    let writer = Writer {
        dir: dir.to_path_buf(),
        file: Arc::new(rec.file),
        file_first: rec.first,
        file_len: rec.len,
        next_offset: stream_offsets,
        cfg,
        stats: stats.clone(),
        last_ingest_ts: 0,
        written: written_tx,
        routed: Vec::new(),
        catalog,
        shared,
        created: Vec::new(),
        group_offsets: HashMap::new(),
        stop_seen: false,
    };
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
    Ok((
        WalHandle {
            tx,
            stats,
            deferred,
        },
        join,
    ))
}

/// Groups written but not yet fsynced and committed that the writer may run ahead by. One is
/// enough to overlap the next group's write with this one's fsync and catalog transaction;
/// a few more absorb jitter in the fsync time without holding much (metadata only: the
/// bytes are already in the file).
pub const PIPELINE_DEPTH: usize = 4;

/// What the writer and the committer share to get through a full disk.
#[derive(Debug, Default)]
struct Shared {
    /// Set by the committer after a catalog commit failed for a full disk: the writer must cut
    /// the log back to the committed end before it writes anything else. Cleared by the
    /// committer when the writer's [`Piped::Rewound`] marker reaches it.
    rewind: AtomicBool,
    /// When writes may be tried again.
    full: Mutex<FullState>,
}

/// The retry schedule while the disk is full.
#[derive(Debug, Default)]
struct FullState {
    backoff: Duration,
    retry_at: Option<Instant>,
    /// `group_commits` when writes last resumed: failing again before anything committed
    /// means the disk is still full, and the wait doubles.
    commits_at_resume: u64,
}

/// Enters (or stays in) the disk-full state after `e`: writes are refused until the writer's
/// probe finds space again after the backoff.
fn enter_disk_full(stats: &WalStats, shared: &Shared, e: &CommitError) {
    stats.disk_full_failures.fetch_add(1, Ordering::Relaxed);
    *stats.disk_full_error.lock().expect("disk-full lock") = Some(e.clone());
    let mut f = shared.full.lock().expect("disk-full state lock");
    if stats.disk_full.load(Ordering::Acquire) {
        // Another group in flight failed too; the schedule is already set.
        return;
    }
    let commits = stats.group_commits.load(Ordering::Relaxed);
    f.backoff = if f.backoff.is_zero() || commits != f.commits_at_resume {
        DISK_FULL_BACKOFF_INITIAL
    } else {
        (f.backoff * 2).min(DISK_FULL_BACKOFF_MAX)
    };
    f.retry_at = Some(Instant::now() + f.backoff);
    stats.disk_full.store(true, Ordering::Release);
    tracing::error!(
        error = %e,
        retry_in = ?f.backoff,
        "tier-1 disk full: the failed group was rolled back; refusing writes until space is free"
    );
}

/// Writes groups into the log, in order, and hands them to the [`Committer`].
///
/// The write of group N+1 overlaps with the fsync and the catalog commit of group N. Nothing
/// is acknowledged here: a group's callers complete only after the committer's fsync that
/// covers it and its catalog transaction, so the acknowledgement rule is unchanged.
struct Writer {
    dir: PathBuf,
    /// Shared with the committer, which fsyncs through it.
    file: Arc<File>,
    file_first: u64,
    file_len: u64,
    next_offset: HashMap<StreamId, u64>,
    cfg: WriterConfig,
    stats: Arc<WalStats>,
    last_ingest_ts: i64,
    written: mpsc::SyncSender<Piped>,
    /// Blocks of the group being written, for [`WriterConfig::on_commit`].
    routed: Vec<crate::streams::CommittedBlock>,
    /// Read for the committed stream offsets when the log is cut back to the committed end.
    catalog: Arc<Catalog>,
    shared: Arc<Shared>,
    /// WAL files the group being written rolled into (removed if it fails for a full disk).
    created: Vec<PathBuf>,
    /// The next offset of each stream before the group being written assigned any.
    group_offsets: HashMap<StreamId, u64>,
    /// A stop request was drained while failing queued requests.
    stop_seen: bool,
}

/// Where the group being written started, to cut it off again.
struct GroupStart {
    file: Arc<File>,
    file_first: u64,
    file_len: u64,
}

/// What travels from the writer to the committer.
enum Piped {
    /// A group in the file.
    Group(Box<Written>),
    /// The writer has cut the log back to the committed end (after the committer asked); the
    /// committer acknowledges once every group before this marker has failed.
    Rewound(mpsc::Sender<()>),
}

/// A group in the file, on its way to durability.
struct Written {
    /// The catalog rows of the group (marks, blocks, offsets, the WAL end it reaches).
    g: GroupCommit,
    dones: Vec<Done>,
    requests: usize,
    /// The file to fsync, `None` when the group wrote nothing (gaps only).
    file: Option<Arc<File>>,
    /// Set when writing failed: the group fails, and so does everything after it.
    error: Option<CommitError>,
    /// The group's blocks for [`WriterConfig::on_commit`].
    routed: Vec<crate::streams::CommittedBlock>,
}

/// Makes written groups durable: one `fdatasync` for every group queued behind it, then one
/// catalog transaction for all of them, then the completions, in write order.
struct Committer {
    catalog: Arc<Catalog>,
    cfg: WriterConfig,
    stats: Arc<WalStats>,
    deferred: Arc<Mutex<DeferredMeta>>,
    shared: Arc<Shared>,
    /// Named in disk-full errors of the catalog, which lives there.
    data_dir: PathBuf,
}

/// A completion waiting for its batch's outcome.
enum Done {
    Append(Completion<AppendDone>, AppendDone),
    Gap(Completion<()>),
}

impl Done {
    fn finish(self, result: Result<(), CommitError>) {
        match (self, result) {
            (Done::Append(f, d), Ok(())) => f(Ok(d)),
            (Done::Append(f, _), Err(e)) => f(Err(e)),
            (Done::Gap(f), r) => f(r),
        }
    }
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Request>) {
        while !self.stop_seen {
            let first = match rx.recv_timeout(WRITER_TICK) {
                Ok(Request::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(r) => r,
                Err(RecvTimeoutError::Timeout) => {
                    self.tick(&rx);
                    continue;
                }
            };
            let (batch, stop) = self.collect(first, &rx);
            self.write(batch, &rx);
            if stop {
                break;
            }
        }
    }

    /// Idle work: a rewind the committer asked for, and the disk-full probe.
    fn tick(&mut self, rx: &mpsc::Receiver<Request>) {
        if self.shared.rewind.load(Ordering::Acquire) {
            self.rewind_to_committed(Vec::new(), rx);
        }
        self.probe();
    }

    /// Ends the disk-full state once the backoff has passed and the file system shows space.
    /// The next groups are the real test: if they fail again, the wait doubles.
    fn probe(&mut self) {
        if !self.stats.disk_full.load(Ordering::Acquire)
            || self.stats.poisoned.load(Ordering::Acquire)
            || self.shared.rewind.load(Ordering::Acquire)
        {
            return;
        }
        let mut f = self.shared.full.lock().expect("disk-full state lock");
        if f.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let free = free_bytes(&self.dir);
        if free.is_some_and(|b| b < DISK_FULL_RESUME_FREE_BYTES) {
            return;
        }
        f.commits_at_resume = self.stats.group_commits.load(Ordering::Relaxed);
        self.stats.disk_full.store(false, Ordering::Release);
        self.stats.disk_full_resumed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            free_bytes = ?free,
            dir = %self.dir.display(),
            "the WAL's file system has space again; tier-1 writes resume"
        );
    }

    /// Gathers what is queued, waiting up to the linger for more after the first request.
    /// Returns the batch and whether a stop request ended it.
    fn collect(&self, first: Request, rx: &mpsc::Receiver<Request>) -> (Vec<Request>, bool) {
        let deadline = Instant::now() + self.cfg.group_commit_linger;
        let mut bytes = request_bytes(&first);
        let mut batch = vec![first];
        while bytes < BATCH_BYTES_MAX && batch.len() < BATCH_REQUESTS_MAX {
            let next = match rx.try_recv() {
                Ok(r) => r,
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    match rx.recv_timeout(deadline - now) {
                        Ok(r) => r,
                        Err(_) => break,
                    }
                }
            };
            if matches!(next, Request::Stop) {
                return (batch, true);
            }
            bytes += request_bytes(&next);
            batch.push(next);
        }
        (batch, false)
    }

    /// Writes one group and queues it for the committer (waiting while the pipeline is full).
    fn write(&mut self, batch: Vec<Request>, rx: &mpsc::Receiver<Request>) {
        let requests = batch.len();
        if self.stats.poisoned.load(Ordering::Acquire) {
            for req in batch {
                fail(req, CommitError::Poisoned);
            }
            return;
        }
        if self.shared.rewind.load(Ordering::Acquire) {
            self.rewind_to_committed(batch, rx);
            return;
        }
        if let Some(e) = self.stats.disk_full() {
            self.fail_and_drain(batch, e, rx);
            return;
        }
        let ingest_ts = self.ingest_ts();
        let mut g = GroupCommit::default();
        let mut dones = Vec::with_capacity(requests);
        let start = GroupStart {
            file: self.file.clone(),
            file_first: self.file_first,
            file_len: self.file_len,
        };
        self.created.clear();
        self.group_offsets.clear();
        let mut pending = batch.into_iter();
        let written = self.write_batch(&mut pending, ingest_ts, &mut g, &mut dones);
        let (file, error) = match written {
            Ok(true) => (Some(self.file.clone()), None),
            Ok(false) => (None, None),
            Err(e @ CommitError::DiskFull { .. }) => {
                self.undo_group(start, dones, pending.collect(), e, rx);
                return;
            }
            Err(e) => {
                // Nothing after a failed write may be acknowledged: the file's tail is unknown.
                poison(&self.stats, &e);
                for req in pending {
                    fail(req, e.clone());
                }
                (None, Some(e))
            }
        };
        let w = Written {
            g,
            dones,
            requests,
            file,
            error,
            routed: std::mem::take(&mut self.routed),
        };
        if let Err(mpsc::SendError(Piped::Group(w))) = self.written.send(Piped::Group(Box::new(w)))
        {
            for done in w.dones {
                done.finish(Err(CommitError::Stopped));
            }
        }
    }

    /// Cuts off a group whose write failed for a full disk, fails its requests and everything
    /// queued behind them, and starts refusing writes. Groups written before it are intact.
    fn undo_group(
        &mut self,
        start: GroupStart,
        dones: Vec<Done>,
        rest: Vec<Request>,
        e: CommitError,
        rx: &mpsc::Receiver<Request>,
    ) {
        self.routed.clear();
        if let Err(io) = self.cut_group(start) {
            // The tail could not be cut: it is unknown again, as after any failed write.
            let fatal = CommitError::Io(format!("cutting off a group after a full disk: {io}"));
            poison(&self.stats, &fatal);
        } else {
            enter_disk_full(&self.stats, &self.shared, &e);
        }
        for done in dones {
            done.finish(Err(e.clone()));
        }
        self.fail_and_drain(rest, e, rx);
    }

    /// Truncates the log to where the group started, removes the files it rolled into, and
    /// restores the stream offsets it assigned.
    ///
    /// A file the group rolled into right where it started holds nothing older, and it stays
    /// (emptied) as the active file: the file before it ends at or before the committed end,
    /// so tiering may already have evicted it, and it must not become active again. Any other
    /// rolled-into file starts past the group's start, which is past the committed end, so
    /// the group's first file was never evictable and is active again.
    fn cut_group(&mut self, start: GroupStart) -> std::io::Result<()> {
        let cut_at = start.file_first + start.file_len - WAL_HEADER_LEN as u64;
        let keep = wal_file_path(&self.dir, cut_at);
        let created = std::mem::take(&mut self.created);
        for path in created.iter().filter(|p| **p != keep) {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        if created.contains(&keep) {
            self.file = Arc::new(empty_wal_file(&keep)?);
            self.file_first = cut_at;
            self.file_len = WAL_HEADER_LEN as u64;
        } else {
            start.file.set_len(start.file_len)?;
            (&*start.file).seek(SeekFrom::Start(start.file_len))?;
            self.file = start.file;
            self.file_first = start.file_first;
            self.file_len = start.file_len;
        }
        for (stream, next) in self.group_offsets.drain() {
            self.next_offset.insert(stream, next);
        }
        Ok(())
    }

    /// Fails `reqs`, then every request already queued: one may continue a lane whose earlier
    /// block just failed, and writing it would leave a hole.
    ///
    /// Ingest queues a lane's request under the lane's lock right after checking it against
    /// the lane's accepted mark, and a failure's callback rolls that mark back under the same
    /// lock. So a request that depends on a failed one was queued before that callback
    /// returned, and this drain, which runs after every callback of the failed requests (here,
    /// or on the committer before it acknowledged the rewind marker), finds it. Its own
    /// callback runs before the next `try_recv`, so requests depending on it are found too.
    fn fail_and_drain(&mut self, reqs: Vec<Request>, e: CommitError, rx: &mpsc::Receiver<Request>) {
        let mut refused = 0u64;
        for req in reqs {
            refused += 1;
            fail(req, e.clone());
        }
        loop {
            match rx.try_recv() {
                Ok(Request::Stop) => self.stop_seen = true,
                Ok(req) => {
                    refused += 1;
                    fail(req, e.clone());
                }
                Err(_) => break,
            }
        }
        self.stats
            .disk_full_refused
            .fetch_add(refused, Ordering::Relaxed);
    }

    /// Cuts the log back to the committed end after a catalog commit failed for a full disk:
    /// fails `batch`, rewinds the files and the stream offsets, waits until the committer has
    /// failed every group written before the rewind, then fails what is queued.
    fn rewind_to_committed(&mut self, batch: Vec<Request>, rx: &mpsc::Receiver<Request>) {
        let e = self
            .stats
            .disk_full_error
            .lock()
            .expect("disk-full lock")
            .clone()
            .unwrap_or_else(|| CommitError::DiskFull {
                path: self.dir.clone(),
                detail: "no space left".into(),
            });
        for req in batch {
            fail(req, e.clone());
        }
        self.routed.clear();
        if let Err(why) = self.rewind_files() {
            let fatal = CommitError::Io(format!("rewinding the WAL after a full disk: {why}"));
            poison(&self.stats, &fatal);
        }
        let (ack_tx, ack_rx) = mpsc::channel();
        if self.written.send(Piped::Rewound(ack_tx)).is_ok() {
            let _ = ack_rx.recv();
        }
        self.fail_and_drain(Vec::new(), e, rx);
    }

    fn rewind_files(&mut self) -> Result<(), String> {
        // The committer commits nothing while a rewind is pending, so this end is final.
        let end = self.stats.committed_end.load(Ordering::Acquire);
        let streams = self.catalog.streams().map_err(|e| e.to_string())?;
        let rec = rewind(&self.dir, end).map_err(|e| e.to_string())?;
        if rec.dropped_bytes > 0 {
            tracing::warn!(
                bytes = rec.dropped_bytes,
                committed_end = end,
                "cut the uncommitted WAL tail after a full disk"
            );
        }
        self.file = Arc::new(rec.file);
        self.file_first = rec.first;
        self.file_len = rec.len;
        self.next_offset = streams.into_iter().map(|s| (s.id, s.next_offset)).collect();
        Ok(())
    }

    /// Hub ingest time for a batch: wall clock, but never moving backwards.
    fn ingest_ts(&mut self) -> i64 {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        self.last_ingest_ts = now.max(self.last_ingest_ts);
        self.last_ingest_ts
    }

    /// Writes every request's frame, rolling files as needed, without the fsync (the
    /// committer's). Returns whether any bytes were written. On an error, the requests not yet
    /// turned into `dones` are left in `batch`.
    fn write_batch(
        &mut self,
        batch: &mut std::vec::IntoIter<Request>,
        ingest_ts: i64,
        g: &mut GroupCommit,
        dones: &mut Vec<Done>,
    ) -> Result<bool, CommitError> {
        let bytes: usize = batch.as_slice().iter().map(request_bytes).sum();
        let mut buf: Vec<u8> =
            Vec::with_capacity(bytes.min(BATCH_BYTES_MAX + FRAME_BYTES_MAX as usize));
        let mut marks: HashMap<(DeviceId, u64, StreamId), u64> = HashMap::new();
        let mut touched_streams = Vec::new();
        let mut wrote = false;
        for req in batch.by_ref() {
            match req {
                Request::Append(a) => {
                    let frame_len = (FRAME_HEADER_LEN + ENTRY_HEADER_LEN + a.block.len()) as u64;
                    let pending = self.file_len + buf.len() as u64;
                    if pending > WAL_HEADER_LEN as u64
                        && pending + frame_len > self.cfg.segment_bytes_max
                    {
                        wrote |= !buf.is_empty();
                        if let Err(e) = self.flush(&mut buf).and_then(|()| self.roll()) {
                            (a.done)(Err(e.clone()));
                            return Err(e);
                        }
                    }
                    let next = self.next_offset.entry(a.stream).or_insert(0);
                    let base = *next;
                    *next += u64::from(a.count);
                    self.group_offsets.entry(a.stream).or_insert(base);
                    touched_streams.push(a.stream);
                    let last_seq = a.first_seq + u64::from(a.count) - 1;
                    let header = EntryHeader {
                        kind: KIND_BLOCK,
                        device: a.device,
                        stream: a.stream,
                        count: a.count,
                        epoch: a.epoch,
                        first_seq: a.first_seq,
                        hub_offset_base: base,
                        ingest_ts,
                        checksum: a.checksum,
                    };
                    let wal_pos = self.file_len + buf.len() as u64;
                    let entry = header.encode();
                    // The frame is built in place: header, entry header, block, with the
                    // checksum over the payload computed from its two parts (no extra copy).
                    let payload_len = ENTRY_HEADER_LEN + a.block.len();
                    let crc = crc32c::crc32c_append(crc32c::crc32c(&entry), &a.block);
                    buf.extend_from_slice(&(payload_len as u32).to_le_bytes());
                    buf.extend_from_slice(&crc.to_le_bytes());
                    buf.extend_from_slice(&entry);
                    buf.extend_from_slice(&a.block);
                    g.blocks.push(BlockRow {
                        device: a.device,
                        epoch: a.epoch,
                        stream: a.stream,
                        first_seq: a.first_seq,
                        last_seq,
                        checksum: a.checksum,
                        hub_offset_base: base,
                        wal_file: self.file_first,
                        wal_pos,
                        frame_len: (FRAME_HEADER_LEN + payload_len) as u32,
                        ingest_ts,
                        min_ts: a.min_ts,
                        max_ts: a.max_ts,
                        // An empty summary (no records) has no range to skip by.
                        key_hash_min: (!a.key_hashes.buckets.is_empty())
                            .then_some(a.key_hashes.min),
                        key_hash_max: (!a.key_hashes.buckets.is_empty())
                            .then_some(a.key_hashes.max),
                    });
                    self.routed.push(crate::streams::CommittedBlock {
                        stream: a.stream,
                        hub_offset_base: base,
                        count: a.count,
                        bytes: a.block.len() as u64,
                        ingest_ts,
                        min_ts: a.min_ts,
                        max_ts: a.max_ts,
                        hashes: a.key_hashes,
                    });
                    let mark = marks
                        .entry((a.device, a.epoch, a.stream))
                        .or_insert(last_seq);
                    *mark = (*mark).max(last_seq);
                    self.stats.entries.fetch_add(1, Ordering::Relaxed);
                    let done = AppendDone {
                        hub_offset_base: base,
                        last_seq,
                        ingest_ts,
                    };
                    dones.push(Done::Append(a.done, done));
                }
                Request::Gap(gr) => {
                    if let Some(m) = gr.new_mark {
                        let key = (gr.gap.device, gr.gap.epoch, gr.gap.stream);
                        let mark = marks.entry(key).or_insert(m);
                        *mark = (*mark).max(m);
                    }
                    g.gaps.push(gr.gap);
                    dones.push(Done::Gap(gr.done));
                }
                Request::Stop => unreachable!("collect never batches a stop request"),
            }
        }
        wrote |= !buf.is_empty();
        self.flush(&mut buf)?;
        g.marks = marks
            .into_iter()
            .map(|((d, e, s), m)| (d, e, s, m))
            .collect();
        touched_streams.sort_unstable();
        touched_streams.dedup();
        g.stream_offsets = touched_streams
            .into_iter()
            .map(|s| (s, self.next_offset[&s]))
            .collect();
        g.wal_end = Some(self.logical_end());
        Ok(wrote)
    }

    fn logical_end(&self) -> u64 {
        self.file_first + self.file_len - WAL_HEADER_LEN as u64
    }

    /// Appends `buf` to the active file (no fsync).
    fn flush(&mut self, buf: &mut Vec<u8>) -> Result<(), CommitError> {
        if buf.is_empty() {
            return Ok(());
        }
        if fault(&self.cfg, FaultPoint::Write) {
            let _ = (&*self.file).write_all(&buf[..buf.len() / 2]);
            return Err(CommitError::Io("injected torn write".into()));
        }
        let path = wal_file_path(&self.dir, self.file_first);
        if fault(&self.cfg, FaultPoint::WriteNoSpace) {
            let _ = (&*self.file).write_all(&buf[..buf.len() / 2]);
            let e = std::io::Error::from(std::io::ErrorKind::StorageFull);
            return Err(write_error(&path, e));
        }
        (&*self.file)
            .write_all(buf)
            .map_err(|e| write_error(&path, e))?;
        self.file_len += buf.len() as u64;
        self.stats
            .bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        buf.clear();
        Ok(())
    }

    /// Seals the active file (fsync) and starts the next one at the current logical end.
    /// The committer may still fsync the old file for groups written before the roll; that
    /// second fsync finds nothing left to flush.
    fn roll(&mut self) -> Result<(), CommitError> {
        let io = |e: std::io::Error| CommitError::Io(e.to_string());
        self.file.sync_data().map_err(io)?;
        self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        let first = self.logical_end();
        let path = wal_file_path(&self.dir, first);
        // Recorded first: a failed creation may still leave the file behind.
        self.created.push(path.clone());
        let file = create_wal_file(&path).map_err(|e| write_error(&path, e))?;
        file.sync_all().map_err(io)?;
        sync_dir(&self.dir).map_err(io)?;
        self.file = Arc::new(file);
        self.file_first = first;
        self.file_len = WAL_HEADER_LEN as u64;
        Ok(())
    }
}

impl Committer {
    fn run(self, rx: mpsc::Receiver<Piped>) {
        loop {
            let first = match rx.recv_timeout(IDLE_FLUSH) {
                Ok(w) => w,
                Err(RecvTimeoutError::Timeout) => {
                    self.flush_deferred();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            // Everything queued behind the first group is in the file already: one fsync
            // and one catalog transaction cover them all.
            let mut items = vec![first];
            while let Ok(w) = rx.try_recv() {
                items.push(w);
            }
            self.commit(items);
        }
        self.flush_deferred();
    }

    /// Commits the groups between rewind markers; acknowledges each marker once every group
    /// before it is done with.
    fn commit(&self, items: Vec<Piped>) {
        let mut run = Vec::with_capacity(items.len());
        for item in items {
            match item {
                Piped::Group(w) => run.push(*w),
                Piped::Rewound(ack) => {
                    self.commit_run(std::mem::take(&mut run));
                    self.shared.rewind.store(false, Ordering::Release);
                    let _ = ack.send(());
                }
            }
        }
        self.commit_run(run);
    }

    /// Commits the groups before the first failed one, and fails the rest. While a rewind is
    /// pending, every group fails: it was written after a group whose catalog commit failed,
    /// and its bytes are being cut off.
    fn commit_run(&self, mut groups: Vec<Written>) {
        if groups.is_empty() {
            return;
        }
        if self.shared.rewind.load(Ordering::Acquire) {
            let e = self.disk_full_error();
            for w in groups {
                for done in w.dones {
                    done.finish(Err(e.clone()));
                }
            }
            return;
        }
        let failed_at = groups
            .iter()
            .position(|w| w.error.is_some())
            .unwrap_or(groups.len());
        let failed = groups.split_off(failed_at);
        let mut result = Ok(());
        if !groups.is_empty() {
            result = self.commit_ok(groups);
        }
        for w in failed {
            let e = match (&result, w.error) {
                (Ok(()), Some(e)) => e,
                _ => CommitError::Poisoned,
            };
            result = Err(CommitError::Poisoned);
            for done in w.dones {
                done.finish(Err(e.clone()));
            }
        }
    }

    fn disk_full_error(&self) -> CommitError {
        self.stats
            .disk_full_error
            .lock()
            .expect("disk-full lock")
            .clone()
            .unwrap_or_else(|| CommitError::DiskFull {
                path: self.data_dir.clone(),
                detail: "no space left".into(),
            })
    }

    /// Fsync, catalog transaction, completions. Returns the outcome the callers saw.
    fn commit_ok(&self, groups: Vec<Written>) -> Result<(), CommitError> {
        let requests: usize = groups.iter().map(|w| w.requests).sum();
        let mut g = GroupCommit::default();
        let mut dones = Vec::with_capacity(requests);
        let mut files: Vec<Arc<File>> = Vec::new();
        let mut routed = Vec::new();
        for w in groups {
            // Groups are merged in write order: later marks and offsets come later, and the
            // catalog keeps the maximum mark, so nothing moves backwards.
            g.blocks.extend(w.g.blocks);
            g.marks.extend(w.g.marks);
            g.stream_offsets.extend(w.g.stream_offsets);
            g.gaps.extend(w.g.gaps);
            g.wal_end = w.g.wal_end.or(g.wal_end);
            dones.extend(w.dones);
            routed.extend(w.routed);
            if let Some(f) = w.file
                && !files.iter().any(|x| Arc::ptr_eq(x, &f))
            {
                files.push(f);
            }
        }
        let result = if self.stats.poisoned.load(Ordering::Acquire) {
            Err(CommitError::Poisoned)
        } else {
            self.sync(&files).and_then(|()| {
                self.take_deferred(&mut g);
                if fault(&self.cfg, FaultPoint::CatalogCommit) {
                    return Err(CommitError::Catalog("injected fault".into()));
                }
                if fault(&self.cfg, FaultPoint::CatalogNoSpace) {
                    return Err(CommitError::DiskFull {
                        path: self.data_dir.clone(),
                        detail: "catalog: database or disk is full (injected)".into(),
                    });
                }
                self.catalog
                    .commit_group(&g)
                    .map_err(|e| self.catalog_error(&e))
            })
        };
        match &result {
            Err(CommitError::Poisoned) => {}
            // SQLite rolled the transaction back; the metadata goes with a later commit.
            Err(CommitError::DiskFull { .. }) => self.restore_deferred(g),
            Err(e) => poison(&self.stats, e),
            Ok(()) => {
                self.stats.record_batch(requests);
                if let Some(end) = g.wal_end {
                    self.stats.committed_end.store(end, Ordering::Release);
                }
                // Readers see the blocks from here on; producers are acked after that.
                if let Some(hook) = &self.cfg.on_commit
                    && !routed.is_empty()
                {
                    hook(&crate::streams::CommittedGroup { blocks: routed });
                }
            }
        }
        if let Err(e @ CommitError::DiskFull { .. }) = &result {
            // The rewind first: the writer checks it before the disk-full state, so it drains
            // its queue only after the marker's acknowledgement, which comes after the
            // callbacks below (see `Writer::fail_and_drain` for why the order matters). Set
            // before the callbacks so their callers already see the disk-full state.
            self.shared.rewind.store(true, Ordering::Release);
            enter_disk_full(&self.stats, &self.shared, e);
        }
        for done in dones {
            done.finish(result.clone());
        }
        result
    }

    /// A catalog failure: SQLite's `SQLITE_FULL` (ENOSPC or EDQUOT while writing its log) is
    /// a full disk, rolled back; anything else poisons.
    fn catalog_error(&self, e: &crate::catalog::CatalogError) -> CommitError {
        let full = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<rusqlite::Error>())
            .and_then(rusqlite::Error::sqlite_error_code)
            .is_some_and(|c| c == rusqlite::ErrorCode::DiskFull);
        if full {
            CommitError::DiskFull {
                path: self.data_dir.clone(),
                detail: e.to_string(),
            }
        } else {
            CommitError::Catalog(e.to_string())
        }
    }

    /// Makes the written groups durable: one `fdatasync` per file they touched.
    fn sync(&self, files: &[Arc<File>]) -> Result<(), CommitError> {
        for f in files {
            if fault(&self.cfg, FaultPoint::Fsync) {
                return Err(CommitError::Io("injected fsync fault".into()));
            }
            f.sync_data().map_err(|e| CommitError::Io(e.to_string()))?;
            self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn take_deferred(&self, g: &mut GroupCommit) {
        let mut d = self.deferred.lock().expect("deferred lock");
        g.contacts.extend(d.contacts.drain());
        g.backlogs.extend(d.backlogs.drain().map(|(_, b)| b));
    }

    /// Puts back the metadata of a failed commit, unless newer values arrived meanwhile.
    fn restore_deferred(&self, g: GroupCommit) {
        let mut d = self.deferred.lock().expect("deferred lock");
        for (device, at) in g.contacts {
            d.contacts.entry(device).or_insert(at);
        }
        for b in g.backlogs {
            d.backlogs.entry((b.device, b.stream)).or_insert(b);
        }
    }

    fn flush_deferred(&self) {
        // While the disk is full the commit would only fail again; the metadata waits.
        if self.stats.poisoned.load(Ordering::Acquire)
            || self.stats.disk_full.load(Ordering::Acquire)
            || self.deferred.lock().expect("deferred lock").is_empty()
        {
            return;
        }
        let mut g = GroupCommit::default();
        self.take_deferred(&mut g);
        if let Err(e) = self.catalog.commit_group(&g) {
            tracing::warn!(error = %e, "could not store device contacts and backlogs");
            if matches!(self.catalog_error(&e), CommitError::DiskFull { .. }) {
                self.restore_deferred(g);
            }
        }
    }
}

/// A failed write: a full disk (rolled back) or anything else (poisons).
fn write_error(path: &Path, e: std::io::Error) -> CommitError {
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
fn poison(stats: &WalStats, e: &CommitError) {
    if !stats.poisoned.swap(true, Ordering::AcqRel) {
        tracing::error!(error = %e, "tier-1 group commit failed; the WAL is poisoned until restart");
    }
}

fn fault(cfg: &WriterConfig, point: FaultPoint) -> bool {
    cfg.faults.as_ref().is_some_and(|f| f(point))
}

fn request_bytes(r: &Request) -> usize {
    match r {
        Request::Append(a) => a.block.len() + FRAME_HEADER_LEN + ENTRY_HEADER_LEN,
        Request::Gap(_) | Request::Stop => 64,
    }
}

fn fail(req: Request, e: CommitError) {
    match req {
        Request::Append(a) => (a.done)(Err(e)),
        Request::Gap(g) => (g.done)(Err(e)),
        Request::Stop => {}
    }
}

/// Why a committed frame could not be read back.
#[derive(Debug, Error)]
pub enum WalReadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: frame at {pos} is damaged: {what}")]
    Corrupt {
        path: PathBuf,
        pos: u64,
        what: &'static str,
    },
}

/// Reads committed frames by position. Safe to use while the writer appends: it only reads
/// ranges the catalog says are committed, and WAL files are append-only.
#[derive(Debug)]
pub struct WalReader {
    dir: PathBuf,
    files: Mutex<HashMap<u64, Arc<File>>>,
}

/// Open file handles kept by a reader.
const READER_FILES_MAX: usize = 64;

impl WalReader {
    /// A reader over `dir`.
    pub fn new(dir: &Path) -> WalReader {
        WalReader {
            dir: dir.to_path_buf(),
            files: Mutex::new(HashMap::new()),
        }
    }

    fn file(&self, first: u64) -> Result<Arc<File>, WalReadError> {
        let mut files = self.files.lock().expect("reader files lock");
        if let Some(f) = files.get(&first) {
            return Ok(f.clone());
        }
        let path = wal_file_path(&self.dir, first);
        let f = Arc::new(File::open(&path).map_err(|source| WalReadError::Io { path, source })?);
        if files.len() >= READER_FILES_MAX {
            files.clear();
        }
        files.insert(first, f.clone());
        Ok(f)
    }

    /// Drops a cached handle, e.g. after tiering removed the file.
    pub fn forget(&self, first: u64) {
        self.files.lock().expect("reader files lock").remove(&first);
    }

    /// Reads and verifies the frame of `row`, returning its entry header and block bytes.
    pub fn read(&self, row: &BlockRow) -> Result<(EntryHeader, Vec<u8>), WalReadError> {
        self.read_at(row.wal_file, row.wal_pos, row.frame_len)
    }

    /// Reads and verifies the frame at `pos` in WAL file `first`.
    pub fn read_at(
        &self,
        first: u64,
        pos: u64,
        frame_len: u32,
    ) -> Result<(EntryHeader, Vec<u8>), WalReadError> {
        let file = self.file(first)?;
        let path = || wal_file_path(&self.dir, first);
        let mut buf = vec![0u8; frame_len as usize];
        file.read_exact_at(&mut buf, pos)
            .map_err(|source| WalReadError::Io {
                path: path(),
                source,
            })?;
        let corrupt = |what| WalReadError::Corrupt {
            path: path(),
            pos,
            what,
        };
        if buf.len() < FRAME_HEADER_LEN + ENTRY_HEADER_LEN {
            return Err(corrupt("frame shorter than its headers"));
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
        if len + FRAME_HEADER_LEN != buf.len() {
            return Err(corrupt("frame length differs from the index"));
        }
        let payload = &buf[FRAME_HEADER_LEN..];
        if crc32c::crc32c(payload) != crc {
            return Err(corrupt("frame checksum mismatch"));
        }
        let header = EntryHeader::decode(payload).ok_or_else(|| corrupt("short entry header"))?;
        Ok((header, payload[ENTRY_HEADER_LEN..].to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_header_round_trips() {
        let h = EntryHeader {
            kind: KIND_BLOCK,
            device: 7,
            stream: 9,
            count: 3,
            epoch: u64::MAX,
            first_seq: 11,
            hub_offset_base: 1 << 40,
            ingest_ts: -5,
            checksum: 0xdead_beef_0bad_f00d,
        };
        assert_eq!(EntryHeader::decode(&h.encode()), Some(h));
        assert_eq!(EntryHeader::decode(&[0u8; 10]), None);
    }

    #[test]
    fn recovery_truncates_to_the_committed_end() {
        let dir = tempfile::tempdir().unwrap();
        let rec = recover(dir.path(), 0).unwrap();
        assert_eq!(rec.len, WAL_HEADER_LEN as u64);
        drop(rec);
        // Uncommitted garbage after the committed end (0) is dropped, and a later file too.
        let path = wal_file_path(dir.path(), 0);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[1, 2, 3, 4, 5]).unwrap();
        std::fs::write(wal_file_path(dir.path(), 5), wal_file_header()).unwrap();
        let rec = recover(dir.path(), 0).unwrap();
        assert_eq!(rec.dropped_bytes, 5 + WAL_HEADER_LEN as u64);
        assert_eq!(list_wal_files(dir.path()).unwrap(), vec![0]);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            WAL_HEADER_LEN as u64
        );
    }

    #[test]
    fn recovery_refuses_missing_committed_bytes() {
        let dir = tempfile::tempdir().unwrap();
        drop(recover(dir.path(), 0).unwrap());
        assert!(matches!(
            recover(dir.path(), 100),
            Err(WalOpenError::Missing { .. })
        ));
    }

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
