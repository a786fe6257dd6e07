//! Hub ingest: everything the QUIC server needs except QUIC itself.
//!
//! [`Hub::commit_block`] takes one block from an authenticated device and either makes it
//! durable in tier 1 or says why not. The cheap checks run first, so a bad peer costs little:
//!
//! 1. authorize: the device must not be fenced, and the stream name must be
//!    `[A-Za-z0-9_.-]{1,64}` (no path tricks), configured (if `[[streams]]` lists any) and on
//!    the device's allow-list (if it has one);
//! 2. verify the block's size and checksums ([`sync::block::verify_block`]) without
//!    decompressing;
//! 3. reserve the memory to decompress it from the global ingest budget, decompress it and
//!    compute its decoded size on a blocking thread (a zstd bomb stops at the declared size;
//!    a block whose records would exceed `ingest.block_decoded_bytes_max` is refused as
//!    `decoded_too_large`), reserve the records' decoded size too, then decode it;
//! 4. check its seqs against the mark of `(device, epoch, stream)`: a block at or below it is a
//!    duplicate, and its content is compared with the committed checksums of the ranges it
//!    covers (a mismatch fences the device and raises the alarm); a block straddling it is
//!    trimmed to the records above it and re-encoded; a block starting past `mark + 1` is out
//!    of order;
//! 5. append it to the WAL and wait for the group commit (fsync + catalog transaction).
//!
//! Conflicts are detected for every committed range lying entirely within the resent block
//! (the normal case: edge blocks are immutable, and a trimmed block's stored range is a suffix
//! of the original). Ranges that only partly overlap it cannot be compared here; the protocol
//! receiver compares those as consecutive blocks arrive (`sync::protocol::receiver`).
//!
//! Seqs start at 1 in every `(device, epoch, stream)`; a mark of 0 means nothing is committed.
//!
//! # Pipelining
//!
//! The check in step 4 runs against the *accepted* mark: the highest seq queued to the WAL,
//! durable or not. [`Hub::submit_block`] returns as soon as a block is queued, with a
//! [`PendingCommit`] to await durability; a driver pipelines one stream by submitting its
//! blocks one after another, in seq order, and awaiting the acks concurrently. Queued blocks
//! commit in queue order. (Independent `commit_block` futures for one stream would race for
//! the queue and may see `out_of_order`.) Calls for one `(device, epoch, stream)` are
//! serialized by a per-key async lock; different keys run in parallel.
//!
//! # Memory
//!
//! Every call reserves [`block_cost`] bytes (the block, its decompressed body and its records'
//! exact decoded size, `sync::decoded`) from one semaphore sized by
//! `ingest.memory_bytes_max` before building any record, and holds them until the block is
//! durable, so the
//! hub's ingest memory is bounded for any number of devices: callers wait (admission control)
//! when it is spent. Size each connection's receive window so that the sum over the expected
//! concurrently *active* connections stays within the budget, e.g.
//! `window = max(block_bytes_max, memory_bytes_max / active_connections_expected)`. Bytes a
//! driver holds before calling `commit_block` (frame reassembly) are its own to bound; it can
//! use [`Hub::memory`] to reserve them from the same budget.

use crate::catalog::{BacklogRow, Catalog, CatalogError, DeviceId, GapRow, StreamId};
use crate::config::{HubConfig, StreamPolicy, valid_device_id, valid_stream_name};
use crate::wal::{
    self, AppendDone, AppendRequest, CommitError, GapRequest, WalHandle, WalOpenError, WalReader,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;
use sync::block::{self, BlockError, BlockHeader, DecodeLimits, EncodeOptions};
use sync::record::Record;
use thiserror::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};

mod keys;
pub mod quotas;

pub use keys::{key_in_device, key_problem};

/// The budget semaphore counts this many bytes per permit, so budgets above 4 GiB fit.
pub const MEMORY_PERMIT_BYTES: u64 = 1024;

/// The environment variable of the test-only mutation switch, see [`dedupe_disabled`].
#[cfg(feature = "fault-injection")]
pub const DISABLE_DEDUPE_ENV: &str = "TRIBUTARY_TEST_HUB_DISABLE_DEDUPE";

/// Test-only mutation switch (`TRIBUTARY_TEST_HUB_DISABLE_DEDUPE=1`): the hub reports marks of
/// 0 in the handshake, so devices resend what it holds, and stores resent blocks again instead
/// of dropping them. It exists so that CI proves the ledger checker catches duplicates
/// (`tests/tests/mutation.rs`); the hub says so loudly when it is on. Only builds with the
/// `fault-injection` feature read the variable; in any other build this is a constant `false`
/// and neither the variable's name nor the code behind it is in the binary.
#[inline]
pub fn dedupe_disabled() -> bool {
    #[cfg(feature = "fault-injection")]
    {
        static DISABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DISABLED.get_or_init(|| std::env::var(DISABLE_DEDUPE_ENV).is_ok_and(|v| v == "1"))
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        false
    }
}

/// Why the hub could not open.
#[derive(Debug, Error)]
pub enum OpenError {
    #[error("cannot create {path}: {source}")]
    DataDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error(transparent)]
    Wal(#[from] WalOpenError),
    #[error("{0} is locked: another hub is running on this data directory")]
    Locked(std::path::PathBuf),
    #[error("merged streams: {0}")]
    Streams(#[from] crate::streams::StreamsError),
}

/// Why a block (or gap) was not accepted.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum IngestError {
    #[error("device is fenced: {0}")]
    Fenced(String),
    #[error("invalid device id")]
    BadDeviceId,
    #[error("invalid stream name `{0}`: use [A-Za-z0-9_.-]{{1,64}}")]
    BadStreamName(String),
    #[error("device may not write stream `{0}`")]
    Unauthorized(String),
    /// The stream admits only keys starting with `{device}/` (`keys_prefixed_by_device`); the
    /// whole block is refused. On the wire this is `UNAUTHORIZED_STREAM`: the device may not
    /// write this content to the stream, and the message names the stream first.
    #[error("stream `{stream}` accepts only keys starting with \"{prefix}\"; key {key:?} does not")]
    ForbiddenKey {
        stream: String,
        key: String,
        prefix: String,
    },
    /// A record key with an empty, `.` or `..` segment, or a NUL or control character
    /// (`ingest::keys`). On the wire this is `UNAUTHORIZED_STREAM`, like a forbidden key.
    #[error("stream `{stream}` refuses key {key:?}: {why}")]
    BadKey {
        stream: String,
        key: String,
        why: &'static str,
    },
    /// A record whose tags break the rule of `sync::record::tags_problem` (empty or repeated
    /// names, empty values, NUL, too many). On the wire this is `UNAUTHORIZED_STREAM`, like a
    /// bad key.
    #[error("stream `{stream}` refuses the tags of the record with key {key:?}: {why}")]
    BadTags {
        stream: String,
        key: String,
        why: String,
    },
    /// New state (a stream, epoch or lane of the device, or columns of the stream) beyond a
    /// per-device state quota (`ingest::quotas`); nothing was created. On the wire this is
    /// `QUOTA_EXCEEDED`, naming the stream first.
    #[error("stream `{stream}` refused: it would exceed {key} = {max}")]
    QuotaExceeded {
        stream: String,
        key: &'static str,
        max: u32,
    },
    #[error("block of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    #[error("bad block: {0}")]
    BadBlock(String),
    /// The block's records would take more than `ingest.block_decoded_bytes_max` once decoded.
    /// On the wire this is `DECODED_TOO_LARGE`.
    #[error("block decodes to {size} bytes of records, more than the {limit}-byte limit")]
    DecodedTooLarge { size: u64, limit: u64 },
    #[error("seq 0 is reserved and seqs end at SEQ_MAX (2^63 - 2); seqs start at 1")]
    ReservedSeq,
    #[error("bad gap range {first}..={last}")]
    BadGap { first: u64, last: u64 },
    #[error("block out of order: expected seq {expected} next")]
    OutOfOrder { expected: u64 },
    #[error(
        "seqs {first_seq}..={last_seq} were committed with different content; the device is fenced"
    )]
    Conflict { first_seq: u64, last_seq: u64 },
    #[error("tier 1 unavailable: {0}")]
    Unavailable(CommitError),
    #[error("catalog: {0}")]
    Catalog(String),
    #[error("internal: {0}")]
    Internal(String),
}

impl IngestError {
    /// A stable short code for logs, metrics and the wire; never reused for another meaning.
    pub fn code(&self) -> &'static str {
        match self {
            IngestError::Fenced(_) => "fenced",
            IngestError::BadDeviceId => "bad_device_id",
            IngestError::BadStreamName(_) => "bad_stream_name",
            IngestError::Unauthorized(_) => "unauthorized",
            IngestError::ForbiddenKey { .. } => "forbidden_key",
            IngestError::BadKey { .. } => "bad_key",
            IngestError::BadTags { .. } => "bad_tags",
            IngestError::QuotaExceeded { .. } => "quota_exceeded",
            IngestError::TooLarge { .. } => "too_large",
            IngestError::BadBlock(_) => "bad_block",
            IngestError::DecodedTooLarge { .. } => "decoded_too_large",
            IngestError::ReservedSeq => "reserved_seq",
            IngestError::BadGap { .. } => "bad_gap",
            IngestError::OutOfOrder { .. } => "out_of_order",
            IngestError::Conflict { .. } => "conflict",
            IngestError::Unavailable(_) => "unavailable",
            IngestError::Catalog(_) => "catalog",
            IngestError::Internal(_) => "internal",
        }
    }

    /// Whether the peer sent something it should not have; the driver disconnects it.
    /// The others (`unavailable`, `catalog`, `internal`) are the hub's own trouble.
    pub fn is_peer_fault(&self) -> bool {
        !matches!(
            self,
            IngestError::Unavailable(_) | IngestError::Catalog(_) | IngestError::Internal(_)
        )
    }
}

impl From<CatalogError> for IngestError {
    /// SQLite's `SQLITE_FULL` (the catalog could not grow its log) is the hub's full disk,
    /// which clears by itself: the device keeps its data and retries (`STORAGE_FULL`).
    fn from(e: CatalogError) -> Self {
        let full = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<rusqlite::Error>())
            .and_then(rusqlite::Error::sqlite_error_code)
            .is_some_and(|c| c == rusqlite::ErrorCode::DiskFull);
        if full {
            IngestError::Unavailable(CommitError::DiskFull {
                path: std::path::PathBuf::from("the catalog"),
                detail: e.to_string(),
            })
        } else {
            IngestError::Catalog(e.to_string())
        }
    }
}

/// What happened to a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// Appended and durable. `trimmed` records at or below the old mark were skipped.
    Committed {
        durable_seq: u64,
        hub_offset_base: u64,
        trimmed: u32,
    },
    /// Everything in it was already durable; the ack is idempotent.
    Duplicate { durable_seq: u64 },
}

impl CommitOutcome {
    /// The durable mark to acknowledge.
    pub fn durable_seq(&self) -> u64 {
        match *self {
            CommitOutcome::Committed { durable_seq, .. }
            | CommitOutcome::Duplicate { durable_seq } => durable_seq,
        }
    }
}

/// A durable mark as reported to a device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Mark {
    pub stream: String,
    pub epoch: u64,
    pub durable_seq: u64,
    pub tiered_seq: u64,
}

/// A device's backlog for one stream, as the agent reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BacklogReport {
    pub blocks: u64,
    pub bytes: u64,
    /// Event time (ns) of the oldest record not yet sent.
    pub oldest_unsent_ts: Option<i64>,
    /// The highest seq the device holds.
    pub last_seq: u64,
}

/// Ingest counters for `/metrics`.
#[derive(Debug, Default)]
pub struct IngestStats {
    pub blocks_committed: AtomicU64,
    pub records_committed: AtomicU64,
    pub bytes_committed: AtomicU64,
    pub duplicates: AtomicU64,
    pub trimmed_blocks: AtomicU64,
    pub conflicts: AtomicU64,
    pub rejected: AtomicU64,
    pub gaps: AtomicU64,
    /// Blocks refused because their records would exceed `ingest.block_decoded_bytes_max`.
    pub decoded_too_large: AtomicU64,
    /// Stored blocks a reader found over the limits or undecodable, and quarantined
    /// (`crate::poison`).
    pub stored_quarantined: AtomicU64,
    /// Reads of stored blocks refused for the same reasons, quarantined or not.
    pub stored_refused: AtomicU64,
    /// The revocation list in force and the sessions it closed (`crate::server`).
    pub revocation: crate::pki::RevocationStats,
    /// Per-connection limits that tripped (`crate::server`).
    pub connections: crate::server::ConnStats,
    /// Devices with at least one live QUIC connection now, kept by the server's per-device
    /// connection slots.
    pub devices_connected: Arc<AtomicU64>,
}

/// The content checksum of consecutive records starting at `first_seq`: the protocol's
/// [`sync::protocol::checksum::range_checksum`], independent of block version and compression,
/// and additive over splits of a range. The hub stores it per committed block range.
pub fn content_checksum(first_seq: u64, records: &[Record]) -> u64 {
    sync::protocol::checksum::range_checksum(first_seq, records)
}

/// Bytes of ingest memory a block uses before its records are built: the owned copy and the
/// decompressed body. Reserved before decompressing it.
pub fn sizing_cost(block_len: usize, h: &BlockHeader) -> u64 {
    block_len as u64 + u64::from(h.raw_len)
}

/// Bytes of ingest memory a block uses while it is decoded and queued: [`sizing_cost`] plus
/// its records' exact decoded size (`sync::block::SizedBlock::decoded_bytes`).
pub fn block_cost(block_len: usize, h: &BlockHeader, decoded_bytes: u64) -> u64 {
    sizing_cost(block_len, h) + decoded_bytes
}

/// The durable state of one key, published to waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Durable {
    seq: u64,
    /// Bumped by every roll-back of the key (see [`KeyCell::roll_back`]).
    rollbacks: u64,
    /// The accepted mark right after the latest roll-back: seqs above it were abandoned.
    floor: u64,
}

/// Seq bookkeeping of one `(device, epoch, stream)`.
#[derive(Debug)]
struct KeyState {
    /// Highest seq durable in tier 1 and the catalog.
    durable: u64,
    /// Highest seq queued to the WAL (>= durable).
    accepted: u64,
    /// Queued, not yet durable ranges `(first, last, checksum)`, in seq order.
    pending: VecDeque<(u64, u64, u64)>,
    /// Roll-backs so far; a waiter on a queued range fails when one abandons its seq.
    rollbacks: u64,
    /// The highest seq ever accepted (not lowered by roll-backs): a block past `accepted + 1`
    /// but within `high + 1` continues abandoned seqs (a retry is due), not a protocol error.
    high: u64,
}

impl KeyState {
    /// The error for a block or gap starting at `first`, past `accepted + 1`.
    fn ahead_error(&self, first: u64) -> IngestError {
        if first <= self.high + 1 {
            IngestError::Unavailable(CommitError::EarlierFailed)
        } else {
            IngestError::OutOfOrder {
                expected: self.accepted + 1,
            }
        }
    }
}

#[derive(Debug)]
struct KeyCell {
    /// Serializes the check-and-queue step of one key across concurrent calls.
    order: tokio::sync::Mutex<()>,
    state: Mutex<KeyState>,
    durable_tx: watch::Sender<Durable>,
}

impl KeyCell {
    fn new(durable: u64) -> Arc<KeyCell> {
        let state = KeyState {
            durable,
            accepted: durable,
            pending: VecDeque::new(),
            rollbacks: 0,
            high: durable,
        };
        let (durable_tx, _) = watch::channel(Durable {
            seq: durable,
            rollbacks: 0,
            floor: durable,
        });
        Arc::new(KeyCell {
            order: tokio::sync::Mutex::new(()),
            state: Mutex::new(state),
            durable_tx,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, KeyState> {
        self.state.lock().expect("key state lock")
    }

    /// Runs on the WAL committer thread after the catalog commit.
    fn mark_durable(&self, last: u64) {
        let mut s = self.lock();
        s.durable = s.durable.max(last);
        let durable = s.durable;
        while s.pending.front().is_some_and(|&(_, l, _)| l <= durable) {
            s.pending.pop_front();
        }
        // Published under the lock, so a racing roll-back cannot publish out of order.
        self.durable_tx.send_modify(|d| d.seq = d.seq.max(durable));
    }

    /// Abandons the queued seqs from `first` on: their commit failed (a full disk, or a
    /// poisoned log), so nothing at or above `first` will become durable from what is queued,
    /// and the next block accepted for this key must start at `first` again. Runs on the WAL
    /// threads, before the writer drains what is queued (see `wal::Writer::fail_and_drain`).
    fn roll_back(&self, first: u64) {
        let mut s = self.lock();
        let floor = first.saturating_sub(1).max(s.durable);
        s.accepted = s.accepted.min(floor);
        s.pending.retain(|&(f, _, _)| f < first);
        s.rollbacks += 1;
        let (rollbacks, floor) = (s.rollbacks, s.accepted);
        self.durable_tx.send_modify(|d| {
            d.rollbacks = rollbacks;
            d.floor = floor;
        });
    }

    /// Waits until `seq` is durable, returning the durable mark. `rollbacks` is the key's roll-back
    /// count when `seq` was found accepted: a later roll-back below `seq` fails the wait.
    async fn wait_durable(&self, seq: u64, rollbacks: u64) -> Result<u64, IngestError> {
        let mut rx = self.durable_tx.subscribe();
        let d = *rx
            .wait_for(|d| d.seq >= seq || (d.rollbacks != rollbacks && d.floor < seq))
            .await
            .map_err(|_| IngestError::Unavailable(CommitError::Stopped))?;
        if d.seq >= seq {
            Ok(d.seq)
        } else {
            Err(IngestError::Unavailable(CommitError::EarlierFailed))
        }
    }
}

/// Interned names, cached from the catalog.
#[derive(Debug, Default)]
struct Names {
    devices: HashMap<String, DeviceId>,
    device_names: HashMap<DeviceId, String>,
    streams: HashMap<String, StreamId>,
    stream_names: HashMap<StreamId, String>,
}

/// The hub: catalog, WAL writer and ingest state. Share it behind an `Arc`.
pub struct Hub {
    policy: StreamPolicy,
    limits: DecodeLimits,
    data_dir: std::path::PathBuf,
    block_bytes_max: usize,
    catalog: Arc<Catalog>,
    wal: WalHandle,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    reader: WalReader,
    /// What tier 1 and a local tier 2 are stored on (`RealStorage` unless opened with
    /// [`Hub::open_on`]).
    storage: Arc<dyn crate::storage::Storage>,
    memory: Arc<Semaphore>,
    memory_permits: u32,
    names: RwLock<Names>,
    keys: Mutex<HashMap<(DeviceId, u64, StreamId), Arc<KeyCell>>>,
    fenced: RwLock<HashMap<String, String>>,
    stats: Arc<IngestStats>,
    /// Per-device state quotas (`ingest::quotas`), counted from the catalog at open.
    quotas: quotas::Quotas,
    /// `metrics.device_series_max`.
    device_series_max: usize,
    /// Decoded record buffers for reuse.
    record_pool: Arc<RecordPool>,
    /// Merged streams: segment graphs, readable ends, reader groups.
    streams: Arc<crate::streams::StreamManager>,
    /// Set by tiering: refuses new blocks while tier 1 is over its budget (see [`AdmissionGate`]).
    admission: RwLock<Option<AdmissionGate>>,
    /// Bumped whenever tiering moved some lane's `tiered_seq` (see [`Hub::follow_tiering`]), so
    /// each device connection can push the new mark to an idle agent (issue 7).
    tiered_changed: Arc<watch::Sender<u64>>,
    /// Tiering's counters, for `/metrics`; set once tiering is open (see `main.rs`).
    tier_stats: std::sync::OnceLock<Arc<crate::tiering::TierStats>>,
    /// This hub's tier-1 quarantine (what its readers skip) and scrub counters.
    tier1_scrub: crate::scrub::Tier1Scrub,
    /// This hub's tier-2 scrub counters and quarantined objects.
    tier2_scrub: crate::scrub::Tier2Scrub,
    /// Start-up readiness (`/healthz`): not ready while `core-hub run` opens tier 2.
    startup: crate::status::Startup,
    /// Held for the hub's lifetime: two hubs on one WAL would corrupt it.
    _lock: std::fs::File,
}

/// Returns why new blocks must wait (tier 1 over budget while tier 2 is down or behind), or
/// `None` to admit them. Installed by `tiering`; refused blocks fail with the retryable
/// [`IngestError::Unavailable`], so agents back off and resend, and nothing is dropped.
pub type AdmissionGate = Arc<dyn Fn() -> Option<String> + Send + Sync>;

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").finish_non_exhaustive()
    }
}

/// The records of a block from `first` on, prepared off the async threads.
struct Decoded {
    epoch: u64,
    first: u64,
    version: u8,
    flags: u8,
    records: PooledRecords,
    /// `content_checksum(first, records)`.
    checksum: u64,
    /// Encoded bytes holding exactly `records`, if available (else they are re-encoded).
    block: Option<Vec<u8>>,
}

/// Record buffers kept for reuse: decoding a block into records that already own their strings
/// (`sync::block::decode_block_into`) avoids nearly all of the allocator work, which is most of
/// the cost of a large block. Bounded by [`RECORD_POOL_BUFFERS`] buffers of at most
/// [`RECORD_POOL_RECORDS_MAX`] records each (a few catch-up blocks' worth of decoded records).
#[derive(Debug, Default)]
pub struct RecordPool {
    free: Mutex<Vec<Vec<Record>>>,
}

/// Buffers a [`RecordPool`] keeps.
pub const RECORD_POOL_BUFFERS: usize = 4;
/// Largest buffer (in records) a [`RecordPool`] keeps.
pub const RECORD_POOL_RECORDS_MAX: usize = 2 * sync::columnar::OFFLINE_BLOCK_RECORDS;

impl RecordPool {
    /// A buffer to decode into (empty if none is free). Its records are stale: decode over them.
    pub fn take(&self) -> Vec<Record> {
        self.free
            .lock()
            .expect("record pool lock")
            .pop()
            .unwrap_or_default()
    }

    /// Returns a buffer; dropped instead when the pool is full or the buffer too large.
    pub fn put(&self, v: Vec<Record>) {
        if v.capacity() == 0 || v.capacity() > RECORD_POOL_RECORDS_MAX {
            return;
        }
        let mut free = self.free.lock().expect("record pool lock");
        if free.len() < RECORD_POOL_BUFFERS {
            free.push(v);
        }
    }
}

/// Decoded records that go back to their pool when dropped.
struct PooledRecords {
    v: Vec<Record>,
    pool: Arc<RecordPool>,
}

impl std::ops::Deref for PooledRecords {
    type Target = Vec<Record>;
    fn deref(&self) -> &Vec<Record> {
        &self.v
    }
}

impl Drop for PooledRecords {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.v));
    }
}

impl Decoded {
    fn last(&self) -> u64 {
        self.first + self.records.len() as u64 - 1
    }
}

/// What step 4 decided.
enum Plan {
    /// Already accepted; `rollbacks` is the key's roll-back count when that was checked.
    Duplicate {
        last: u64,
        rollbacks: u64,
    },
    Append(Append),
}

/// What [`Hub::queue_gap`] did.
enum GapQueued {
    /// The gap's seqs were accepted already; wait for them with this roll-back count.
    Already {
        rollbacks: u64,
    },
    Queued(oneshot::Receiver<Result<(), CommitError>>),
}

/// A block ready for the WAL.
struct Append {
    block: Vec<u8>,
    /// Routing key hashes of the records, for the stream manager.
    key_hashes: crate::streams::BlockHashes,
    first: u64,
    count: u32,
    checksum: u64,
    min_ts: i64,
    max_ts: i64,
    trimmed: u32,
}

/// A block checked and queued (or found to be a duplicate); [`PendingCommit::wait`] resolves
/// once it is durable. Dropping it does not cancel the commit.
#[must_use = "a submitted block is acknowledged only after `wait`"]
pub struct PendingCommit {
    stats: Arc<IngestStats>,
    wait: Wait,
}

enum Wait {
    Duplicate {
        cell: Arc<KeyCell>,
        last: u64,
        rollbacks: u64,
    },
    Append {
        rx: oneshot::Receiver<Result<AppendDone, CommitError>>,
        count: u32,
        bytes: u64,
        trimmed: u32,
        /// The ingest memory stays reserved until the block is durable.
        _permit: OwnedSemaphorePermit,
    },
}

impl std::fmt::Debug for PendingCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingCommit").finish_non_exhaustive()
    }
}

impl PendingCommit {
    /// Waits until the block is durable (fsync + catalog commit).
    pub async fn wait(self) -> Result<CommitOutcome, IngestError> {
        let stats = self.stats;
        let result = match self.wait {
            Wait::Duplicate {
                cell,
                last,
                rollbacks,
            } => cell
                .wait_durable(last, rollbacks)
                .await
                .map(|durable_seq| CommitOutcome::Duplicate { durable_seq }),
            Wait::Append {
                rx,
                count,
                bytes,
                trimmed,
                _permit,
            } => {
                let done = rx
                    .await
                    .unwrap_or(Err(CommitError::Stopped))
                    .map_err(IngestError::Unavailable);
                done.map(|done| {
                    stats.blocks_committed.fetch_add(1, Ordering::Relaxed);
                    stats
                        .records_committed
                        .fetch_add(u64::from(count), Ordering::Relaxed);
                    stats.bytes_committed.fetch_add(bytes, Ordering::Relaxed);
                    if trimmed > 0 {
                        stats.trimmed_blocks.fetch_add(1, Ordering::Relaxed);
                    }
                    CommitOutcome::Committed {
                        durable_seq: done.last_seq,
                        hub_offset_base: done.hub_offset_base,
                        trimmed,
                    }
                })
            }
        };
        if result.is_err() {
            stats.rejected.fetch_add(1, Ordering::Relaxed);
        }
        result
    }
}

/// A block the protocol receiver already verified and decoded (`CommitItem::Block`).
#[derive(Debug, Clone)]
pub struct VerifiedBlock {
    pub header: BlockHeader,
    /// The block as received.
    pub block: Vec<u8>,
    /// Records at or below this seq are not to be committed.
    pub skip_through: u64,
    /// The records from `max(header.first_seq, skip_through + 1)` to the block's end.
    pub records: Vec<Record>,
    /// `content_checksum` of `records` as the protocol receiver already computed it (its
    /// `CommitItem::Block` range checksum), so the records are not hashed twice; `None`
    /// computes it here.
    pub checksum: Option<u64>,
}

impl Hub {
    /// Opens the catalog, recovers the WAL against it, and starts the writer.
    pub fn open(cfg: &HubConfig) -> Result<Arc<Hub>, OpenError> {
        Self::open_with_faults(cfg, None)
    }

    /// As [`Hub::open`], with a fault-injection hook in the WAL writer (crash tests).
    pub fn open_with_faults(
        cfg: &HubConfig,
        faults: Option<wal::FaultHook>,
    ) -> Result<Arc<Hub>, OpenError> {
        let env = wal::WalEnv {
            storage: crate::storage::RealStorage::shared(),
            tuning: wal::WalTuning::default(),
        };
        Self::open_on(cfg, env, faults)
    }

    /// As [`Hub::open_with_faults`], with tier 1 (the WAL, its reader) and a `file://` tier 2
    /// on `env.storage` (`MemStorage` in the crash simulations) and the WAL paced by
    /// `env.tuning`. The catalog and the data directory's lock stay on real files.
    pub fn open_on(
        cfg: &HubConfig,
        env: wal::WalEnv,
        faults: Option<wal::FaultHook>,
    ) -> Result<Arc<Hub>, OpenError> {
        #[cfg(feature = "fault-injection")]
        if dedupe_disabled() {
            tracing::error!(
                "{DISABLE_DEDUPE_ENV}=1: DEDUPLICATION IS OFF, resent blocks are stored twice (test-only mutation switch)"
            );
        }
        let data_dir_err = |source| OpenError::DataDir {
            path: cfg.data_dir.clone(),
            source,
        };
        crate::storage::create_dir_durable(&cfg.data_dir).map_err(data_dir_err)?;
        let lock = lock_data_dir(&cfg.data_dir)?;
        // Readers skip what an earlier run quarantined from the first read on.
        let tier1_scrub = crate::scrub::Tier1Scrub::load(&cfg.data_dir);
        let catalog = Arc::new(Catalog::open(&cfg.catalog_path())?);
        // SQLite syncs the catalog's contents, not its directory entries (the database and its
        // `-wal` file): they are made durable here, before anything is committed into them.
        std::fs::File::open(&cfg.data_dir)
            .and_then(|d| d.sync_all())
            .map_err(data_dir_err)?;
        let streams = catalog.streams()?;
        let offsets = streams.iter().map(|s| (s.id, s.next_offset)).collect();
        // Before the writer starts, so the readable ends it loads are the committed ends.
        let streams_mgr =
            crate::streams::StreamManager::open(catalog.clone(), &cfg.streams, &cfg.read)?;
        let writer_cfg = wal::WriterConfig {
            segment_bytes_max: cfg.wal.segment_bytes_max,
            group_commit_linger: cfg.wal.group_commit_linger,
            faults,
            on_commit: Some(Arc::new({
                let streams = streams_mgr.clone();
                move |g: &crate::streams::CommittedGroup| streams.on_commit(g)
            })),
        };
        let storage = env.storage.clone();
        let (wal, join) =
            wal::start_with(env, &cfg.wal_dir(), catalog.clone(), offsets, writer_cfg)?;
        let mut names = Names::default();
        for s in streams {
            names.streams.insert(s.name.clone(), s.id);
            names.stream_names.insert(s.id, s.name);
        }
        let mut fenced = HashMap::new();
        for d in catalog.devices()? {
            if let Some(reason) = &d.fence_reason {
                fenced.insert(d.name.clone(), reason.clone());
            }
            names.devices.insert(d.name.clone(), d.id);
            names.device_names.insert(d.id, d.name);
        }
        let keys = catalog
            .all_marks()?
            .into_iter()
            .map(|m| ((m.device, m.epoch, m.stream), KeyCell::new(m.durable_seq)))
            .collect();
        let quotas = quotas::load(&catalog, &names, cfg.ingest.state)?;
        // Counters of what the catalog holds start from it, not from 0, after a restart.
        let stats = IngestStats::default();
        stats.gaps.store(catalog.gaps_count()?, Ordering::Relaxed);
        let memory_permits = u32::try_from(cfg.ingest.memory_bytes_max / MEMORY_PERMIT_BYTES)
            .unwrap_or(u32::MAX)
            .max(1);
        Ok(Arc::new(Hub {
            policy: cfg.streams.clone(),
            limits: cfg.decode_limits(),
            data_dir: cfg.data_dir.clone(),
            block_bytes_max: cfg.ingest.block_bytes_max as usize,
            catalog,
            wal,
            writer: Mutex::new(Some(join)),
            reader: WalReader::with_storage(storage.clone(), &cfg.wal_dir()),
            storage,
            memory: Arc::new(Semaphore::new(memory_permits as usize)),
            memory_permits,
            names: RwLock::new(names),
            keys: Mutex::new(keys),
            fenced: RwLock::new(fenced),
            stats: Arc::new(stats),
            quotas,
            device_series_max: cfg.metrics.device_series_max,
            record_pool: Arc::new(RecordPool::default()),
            admission: RwLock::new(None),
            tiered_changed: Arc::new(watch::channel(0).0),
            tier_stats: std::sync::OnceLock::new(),
            streams: streams_mgr,
            tier1_scrub,
            tier2_scrub: crate::scrub::Tier2Scrub::default(),
            startup: crate::status::Startup::default(),
            _lock: lock,
        }))
    }

    /// Start-up readiness, which `/healthz` reports first ([`Hub::health`]).
    pub fn startup(&self) -> &crate::status::Startup {
        &self.startup
    }

    /// This hub's tier-1 quarantine and scrub counters (never shared with another hub).
    pub fn tier1_scrub(&self) -> &crate::scrub::Tier1Scrub {
        &self.tier1_scrub
    }

    /// This hub's tier-2 scrub counters and quarantined objects (never shared with another hub).
    pub fn tier2_scrub(&self) -> &crate::scrub::Tier2Scrub {
        &self.tier2_scrub
    }

    /// The durable marks of `device`, for the handshake.
    pub fn marks(&self, device: &str) -> Vec<Mark> {
        let Some(id) = self
            .names
            .read()
            .expect("names lock")
            .devices
            .get(device)
            .copied()
        else {
            return Vec::new();
        };
        let rows = match self.catalog.marks_of(id) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = %e, device, "cannot read marks");
                return Vec::new();
            }
        };
        rows.into_iter()
            .map(|m| Mark {
                stream: self.stream_name(m.stream).unwrap_or_default(),
                epoch: m.epoch,
                // The mutation switch forgets the marks, so devices resend everything.
                durable_seq: if dedupe_disabled() { 0 } else { m.durable_seq },
                tiered_seq: m.tiered_seq,
            })
            .collect()
    }

    /// The tier-2 mark of `(device, stream, epoch)`: 0 until tiering reports one.
    pub fn tiered_seq(&self, device: &str, stream: &str, epoch: u64) -> u64 {
        let names = self.names.read().expect("names lock");
        let (Some(&d), Some(&s)) = (names.devices.get(device), names.streams.get(stream)) else {
            return 0;
        };
        drop(names);
        self.catalog.tiered_seq(d, epoch, s).unwrap_or_else(|e| {
            tracing::error!(error = %e, device, stream, "cannot read tiered_seq");
            0
        })
    }

    /// The highest epoch the hub has seen from `device` (0 if none).
    pub fn epoch_max(&self, device: &str) -> u64 {
        self.marks(device)
            .iter()
            .map(|m| m.epoch)
            .max()
            .unwrap_or(0)
    }

    /// Stored checksums of committed ranges of `(device, stream, epoch)` with
    /// `last_seq >= from`, earliest first, at most `limit`, plus the range ending at the durable
    /// mark (what the protocol receiver asks for in `MarksQuery`). Empty for unknown names.
    pub fn range_checksums(
        &self,
        device: &str,
        stream: &str,
        epoch: u64,
        from: u64,
        limit: usize,
    ) -> Result<Vec<sync::protocol::RangeChecksum>, IngestError> {
        let names = self.names.read().expect("names lock");
        let (Some(&d), Some(&s)) = (names.devices.get(device), names.streams.get(stream)) else {
            return Ok(Vec::new());
        };
        drop(names);
        let mut ranges = self.catalog.ranges_from(d, epoch, s, from, limit)?;
        let durable = self
            .keys
            .lock()
            .expect("keys lock")
            .get(&(d, epoch, s))
            .map(|c| c.lock().durable);
        if let Some(mark) = durable.filter(|&m| m > 0)
            && !ranges.iter().any(|&(_, l, _)| l == mark)
            && let Some(r) = self.catalog.range_ending_at(d, epoch, s, mark)?
        {
            ranges.push(r);
        }
        let to_range = |(first_seq, last_seq, checksum)| sync::protocol::RangeChecksum {
            first_seq,
            last_seq,
            checksum,
        };
        Ok(ranges.into_iter().map(to_range).collect())
    }

    /// The fence reason, if `device` is fenced.
    pub fn is_fenced(&self, device: &str) -> Option<String> {
        self.fenced
            .read()
            .expect("fenced lock")
            .get(device)
            .cloned()
    }

    /// Fences `device`: every later block is refused until an operator clears it. Every path
    /// that fences comes through here, so the alarm is logged the same way whichever finds it.
    pub fn fence(&self, device: &str, reason: &str) {
        tracing::error!(
            device,
            reason,
            alarm = "device_fenced",
            "ALARM: device fenced"
        );
        self.fenced
            .write()
            .expect("fenced lock")
            .insert(device.to_string(), reason.to_string());
        match self.device_id(device) {
            Ok(id) => {
                if let Err(e) = self.catalog.set_fenced(id, Some(reason)) {
                    tracing::error!(error = %e, device, "cannot persist the fence");
                }
            }
            Err(e) => tracing::error!(error = %e, device, "cannot persist the fence"),
        }
    }

    /// Clears the fence on `device` (operator action).
    pub fn unfence(&self, device: &str) -> Result<(), IngestError> {
        let id = self.device_id(device)?;
        self.catalog.set_fenced(id, None)?;
        self.fenced.write().expect("fenced lock").remove(device);
        Ok(())
    }

    /// Records that `device` was heard from now. Stored with the next group commit.
    pub fn touch(&self, device: &str) {
        let Ok(id) = self.device_id(device) else {
            return;
        };
        let now = now_ns();
        self.wal
            .deferred()
            .lock()
            .expect("deferred lock")
            .contacts
            .insert(id, now);
    }

    /// Stores the latest backlog `device` reported for `stream`.
    pub fn record_backlog(
        &self,
        device: &str,
        stream: &str,
        report: BacklogReport,
    ) -> Result<(), IngestError> {
        self.authorize(device, stream)?;
        self.admit_stream_quota(device, stream)?;
        let (d, s) = (self.device_id(device)?, self.stream_id(stream)?);
        let row = BacklogRow {
            device: d,
            stream: s,
            reported_at_ns: now_ns(),
            blocks: report.blocks,
            bytes: report.bytes,
            oldest_unsent_ts: report.oldest_unsent_ts,
            last_seq: report.last_seq,
        };
        let mut deferred = self.wal.deferred().lock().expect("deferred lock");
        deferred.backlogs.insert((d, s), row);
        deferred.contacts.insert(d, now_ns());
        Ok(())
    }

    /// Records a gap `first..=last` the device reported for `(stream, epoch)`.
    ///
    /// The gap is clipped against the mark: seqs the hub holds never show as lost. When it
    /// starts at `mark + 1` the mark moves over it (those seqs will never arrive). Returns the
    /// durable mark afterwards.
    pub async fn record_gap(
        &self,
        device: &str,
        stream: &str,
        epoch: u64,
        first: u64,
        last: u64,
        reason: &str,
    ) -> Result<u64, IngestError> {
        self.admit(device, stream)?;
        // Past SEQ_MAX, `last + 1` (the next expected seq) would wrap and the catalog's signed
        // integers would not hold the mark.
        if first == 0 || first > last || last > sync::protocol::receiver::SEQ_MAX {
            return Err(IngestError::BadGap { first, last });
        }
        self.admit_lane_quota(device, stream, epoch)?;
        let (d, s) = (self.device_id(device)?, self.stream_id(stream)?);
        let cell = self.cell(d, epoch, s);
        let order = cell.order.lock().await;
        let rx = match self.queue_gap(&cell, (d, epoch, s), first, last, reason)? {
            GapQueued::Already { rollbacks } => {
                drop(order);
                return cell.wait_durable(last, rollbacks).await;
            }
            GapQueued::Queued(rx) => rx,
        };
        drop(order);
        self.stats.gaps.fetch_add(1, Ordering::Relaxed);
        rx.await
            .map_err(|_| IngestError::Unavailable(CommitError::Stopped))?
            .map_err(IngestError::Unavailable)?;
        Ok(last)
    }

    /// Checks a gap against the accepted mark and queues it, under the key's state lock (see
    /// [`Hub::enqueue`]).
    fn queue_gap(
        &self,
        cell: &Arc<KeyCell>,
        (d, epoch, s): (DeviceId, u64, StreamId),
        first: u64,
        last: u64,
        reason: &str,
    ) -> Result<GapQueued, IngestError> {
        let (tx, rx) = oneshot::channel();
        let mut st = cell.lock();
        let accepted = st.accepted;
        if last <= accepted {
            let rollbacks = st.rollbacks;
            return Ok(GapQueued::Already { rollbacks });
        }
        if first > accepted + 1 {
            return Err(st.ahead_error(first));
        }
        let gap_first = first.max(accepted + 1);
        let gap = GapRow {
            device: d,
            epoch,
            stream: s,
            first_seq: gap_first,
            last_seq: last,
            reason: reason.to_string(),
            reported_at_ns: now_ns(),
        };
        let done_cell = cell.clone();
        let done = Box::new(move |r: Result<(), CommitError>| {
            match &r {
                Ok(()) => done_cell.mark_durable(last),
                Err(_) => done_cell.roll_back(gap_first),
            }
            let _ = tx.send(r);
        });
        st.accepted = last;
        st.high = st.high.max(last);
        let unsent = self
            .wal
            .try_gap(GapRequest {
                gap,
                new_mark: Some(last),
                done,
            })
            .err();
        drop(st);
        if let Some(req) = unsent {
            (req.done)(Err(CommitError::Stopped));
        }
        Ok(GapQueued::Queued(rx))
    }

    /// Commits one block from `device` to `stream`; see the module docs for the steps.
    /// Equivalent to [`Hub::submit_block`] followed by [`PendingCommit::wait`].
    pub async fn commit_block(
        &self,
        device: &str,
        stream: &str,
        block: &[u8],
    ) -> Result<CommitOutcome, IngestError> {
        match self.submit_block(device, stream, block).await {
            Ok(pending) => pending.wait().await,
            Err(e) => Err(e),
        }
    }

    /// Steps 1 to 4 and the queueing of step 5: returns once the block is checked and queued
    /// to the WAL (or found to be a duplicate). Await [`PendingCommit::wait`] for durability.
    ///
    /// This is how a driver pipelines one stream: submit blocks one after another, in seq
    /// order, and wait for their durability concurrently.
    pub async fn submit_block(
        &self,
        device: &str,
        stream: &str,
        block: &[u8],
    ) -> Result<PendingCommit, IngestError> {
        let result = async {
            self.admit(device, stream)?;
            let header = self.verify(block)?;
            let (sized, permit) = self.size_and_reserve(block, &header).await?;
            let decoded = self.decode(block, sized).await?;
            self.submit_decoded(device, stream, decoded, permit).await
        }
        .await;
        self.count_rejection(device, stream, result)
    }

    /// Commits a block the protocol receiver already verified, decoded and trimmed
    /// (`sync::protocol::CommitItem::Block`), without decoding it again. The seq checks of
    /// step 4 still run here, against the hub-wide mark: another connection of the same device
    /// may have moved it.
    pub async fn commit_verified(
        &self,
        device: &str,
        stream: &str,
        vb: VerifiedBlock,
    ) -> Result<CommitOutcome, IngestError> {
        match self.submit_verified(device, stream, vb).await {
            Ok(pending) => pending.wait().await,
            Err(e) => Err(e),
        }
    }

    /// As [`Hub::submit_block`], for a block the protocol receiver already verified.
    pub async fn submit_verified(
        &self,
        device: &str,
        stream: &str,
        vb: VerifiedBlock,
    ) -> Result<PendingCommit, IngestError> {
        self.submit_verified_charged(device, stream, vb, None).await
    }

    /// As [`Hub::submit_verified`], with the share of the ingest budget the caller already
    /// holds for this block (the QUIC driver's decode charge). It is kept until the block is
    /// durable when it covers the block's cost, so the block is never charged twice and a
    /// driver never waits for memory while holding it.
    pub async fn submit_verified_charged(
        &self,
        device: &str,
        stream: &str,
        vb: VerifiedBlock,
        held: Option<OwnedSemaphorePermit>,
    ) -> Result<PendingCommit, IngestError> {
        let result = async {
            self.admit(device, stream)?;
            let first = vb.header.first_seq.max(vb.skip_through.saturating_add(1));
            let expected = vb.header.last_seq().checked_sub(first).map(|n| n + 1);
            if vb.header.first_seq == 0 || vb.header.last_seq() > sync::protocol::receiver::SEQ_MAX
            {
                return Err(IngestError::ReservedSeq);
            }
            if expected != Some(vb.records.len() as u64) {
                let msg = format!(
                    "{} records for seqs {first}..={}",
                    vb.records.len(),
                    vb.header.last_seq()
                );
                return Err(IngestError::Internal(msg));
            }
            // The records are built already: charge what they take, not what the body says.
            let records = sync::decoded::records_bytes(&vb.records);
            let cost = vb.block.len() as u64 + records;
            let permit = match held {
                Some(p) if p.num_permits() >= self.permits_for(cost) as usize => p,
                other => {
                    drop(other);
                    self.reserve(cost).await?
                }
            };
            let untrimmed = first == vb.header.first_seq;
            let decoded = Decoded {
                epoch: vb.header.epoch,
                first,
                version: vb.header.version,
                flags: vb.header.flags,
                checksum: vb
                    .checksum
                    .unwrap_or_else(|| content_checksum(first, &vb.records)),
                records: PooledRecords {
                    v: vb.records,
                    pool: self.record_pool.clone(),
                },
                block: untrimmed.then_some(vb.block),
            };
            self.submit_decoded(device, stream, decoded, permit).await
        }
        .await;
        self.count_rejection(device, stream, result)
    }

    fn count_rejection<T>(
        &self,
        device: &str,
        stream: &str,
        result: Result<T, IngestError>,
    ) -> Result<T, IngestError> {
        if let Err(e) = &result {
            self.stats.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(device, stream, code = e.code(), error = %e, "block rejected");
        }
        result
    }

    /// Step 4 and the queueing of step 5, for decoded records.
    async fn submit_decoded(
        &self,
        device: &str,
        stream: &str,
        dec: Decoded,
        permit: OwnedSemaphorePermit,
    ) -> Result<PendingCommit, IngestError> {
        self.check_keys(device, stream, &dec.records)?;
        // Quotas before anything is created for the lane (its stream, its key cell).
        self.admit_lane_quota(device, stream, dec.epoch)?;
        let (d, s) = (self.device_id(device)?, self.stream_id(stream)?);
        self.admit_columns_quota((device, d), (stream, s), &dec.records)?;
        let epoch = dec.epoch;
        let cell = self.cell(d, epoch, s);
        let _order = cell.order.lock().await;
        let stats = self.stats.clone();
        match self.plan(device, d, s, &cell, dec).await? {
            Plan::Duplicate { last, rollbacks } => {
                stats.duplicates.fetch_add(1, Ordering::Relaxed);
                Ok(PendingCommit {
                    stats,
                    wait: Wait::Duplicate {
                        cell: cell.clone(),
                        last,
                        rollbacks,
                    },
                })
            }
            Plan::Append(a) => {
                let (count, bytes, trimmed) = (a.count, a.block.len() as u64, a.trimmed);
                let rx = self.enqueue(&cell, d, s, epoch, a)?;
                Ok(PendingCommit {
                    stats,
                    wait: Wait::Append {
                        rx,
                        count,
                        bytes,
                        trimmed,
                        _permit: permit,
                    },
                })
            }
        }
    }

    /// Steps that need no decoding: identity, fencing, stream name, allow-list.
    fn admit(&self, device: &str, stream: &str) -> Result<(), IngestError> {
        if !valid_device_id(device) {
            return Err(IngestError::BadDeviceId);
        }
        if let Some(reason) = self.is_fenced(device) {
            return Err(IngestError::Fenced(reason));
        }
        if self.wal.stats().poisoned.load(Ordering::Relaxed) {
            return Err(IngestError::Unavailable(CommitError::Poisoned));
        }
        // Refused before any decoding while the disk is full: cheap, and retryable.
        if let Some(e) = self.storage_unavailable() {
            return Err(IngestError::Unavailable(e));
        }
        self.authorize(device, stream)
    }

    /// Why tier 1 takes no writes right now, if it does not: the disk is full, or tier 1 is
    /// over its budget (tiering's admission gate). Both clear on their own; callers refuse
    /// cheaply and the agents retry soon (`STORAGE_FULL`).
    pub fn storage_unavailable(&self) -> Option<CommitError> {
        if let Some(e) = self.wal.stats().disk_full() {
            self.wal
                .stats()
                .disk_full_refused
                .fetch_add(1, Ordering::Relaxed);
            return Some(e);
        }
        let gate = self.admission.read().expect("admission lock").clone();
        gate.and_then(|g| g()).map(CommitError::Full)
    }

    /// A receiver that changes whenever tiering moved some lane's `tiered_seq`. Connections
    /// subscribe at once, before tiering may even be open, so none misses a later change.
    pub fn subscribe_tiered(&self) -> watch::Receiver<u64> {
        self.tiered_changed.subscribe()
    }

    /// Relays tiering's change signal (`Tiering::subscribe_tiered`) to [`Hub::subscribe_tiered`]
    /// until tiering drops its sender. Must run inside a tokio runtime.
    pub fn follow_tiering(&self, mut from: watch::Receiver<u64>) -> tokio::task::JoinHandle<()> {
        let to = self.tiered_changed.clone();
        tokio::spawn(async move {
            while from.changed().await.is_ok() {
                to.send_modify(|g| *g = g.wrapping_add(1));
            }
        })
    }

    /// Registers tiering's counters so `/metrics` exports them; later calls are ignored.
    pub fn set_tier_stats(&self, stats: Arc<crate::tiering::TierStats>) {
        let _ = self.tier_stats.set(stats);
    }

    /// Tiering's counters, once tiering is running.
    pub fn tier_stats(&self) -> Option<&Arc<crate::tiering::TierStats>> {
        self.tier_stats.get()
    }

    /// Installs (or with `None` removes) the admission gate tiering uses to push back.
    pub fn set_admission_gate(&self, gate: Option<AdmissionGate>) {
        *self.admission.write().expect("admission lock") = gate;
    }

    /// Whether `device` may write `stream`: a valid, configured name on its allow-list.
    pub fn authorize(&self, device: &str, stream: &str) -> Result<(), IngestError> {
        if !valid_stream_name(stream) {
            return Err(IngestError::BadStreamName(
                stream.chars().take(80).collect(),
            ));
        }
        if !self.policy.allows(device, stream) {
            return Err(IngestError::Unauthorized(stream.to_string()));
        }
        Ok(())
    }

    /// Step 1: size and checksums, without decompressing.
    fn verify(&self, block: &[u8]) -> Result<BlockHeader, IngestError> {
        if block.len() > self.block_bytes_max {
            return Err(IngestError::TooLarge {
                len: block.len(),
                limit: self.block_bytes_max,
            });
        }
        let header = block::verify_block(block, &self.limits)
            .map_err(|e| IngestError::BadBlock(e.to_string()))?;
        if header.first_seq == 0 || header.last_seq() > sync::protocol::receiver::SEQ_MAX {
            return Err(IngestError::ReservedSeq);
        }
        Ok(header)
    }

    /// Reserves `bytes` of the ingest budget, waiting while it is spent.
    pub(crate) async fn reserve(&self, bytes: u64) -> Result<OwnedSemaphorePermit, IngestError> {
        let permits = self.permits_for(bytes);
        self.memory
            .clone()
            .acquire_many_owned(permits)
            .await
            .map_err(|_| IngestError::Internal("ingest budget closed".into()))
    }

    /// Step 3a: reserves the block's [`sizing_cost`], decompresses and sizes it on a blocking
    /// thread, then reserves its records' decoded size as well. When the budget cannot grow
    /// at once, the sizing reservation and the body are let go and the whole [`block_cost`] is
    /// awaited, then the block sized again: holding part of the budget while waiting for more
    /// could deadlock concurrent blocks.
    async fn size_and_reserve(
        &self,
        block: &[u8],
        header: &BlockHeader,
    ) -> Result<(block::SizedBlock, OwnedSemaphorePermit), IngestError> {
        let mut permit = self.reserve(sizing_cost(block.len(), header)).await?;
        let sized = self.size(block).await?;
        let cost = block_cost(block.len(), header, sized.decoded_bytes());
        let held = permit.num_permits() as u32;
        let total = self.permits_for(cost);
        if held >= total {
            return Ok((sized, permit));
        }
        match self.memory.clone().try_acquire_many_owned(total - held) {
            Ok(more) => {
                permit.merge(more);
                Ok((sized, permit))
            }
            Err(_) => {
                drop((permit, sized));
                let permit = self.reserve(cost).await?;
                Ok((self.size(block).await?, permit))
            }
        }
    }

    /// Permits covering `bytes`, at least one and at most the whole budget.
    pub(crate) fn permits_for(&self, bytes: u64) -> u32 {
        bytes
            .div_ceil(MEMORY_PERMIT_BYTES)
            .clamp(1, u64::from(self.memory_permits)) as u32
    }

    /// Decompresses and sizes a block on a blocking thread; a block over the decoded-size
    /// limit is [`IngestError::DecodedTooLarge`] and counted.
    async fn size(&self, block: &[u8]) -> Result<block::SizedBlock, IngestError> {
        let owned = block.to_vec();
        let limits = self.limits;
        let sized = tokio::task::spawn_blocking(move || block::size_block(&owned, &limits))
            .await
            .map_err(|e| IngestError::Internal(e.to_string()))?;
        sized.map_err(|e| match e {
            BlockError::DecodedTooLarge { size, limit } => {
                self.stats.decoded_too_large.fetch_add(1, Ordering::Relaxed);
                IngestError::DecodedTooLarge { size, limit }
            }
            other => IngestError::BadBlock(other.to_string()),
        })
    }

    /// Step 3b: build the records of a sized block on a blocking thread.
    async fn decode(&self, block: &[u8], sized: block::SizedBlock) -> Result<Decoded, IngestError> {
        let owned = block.to_vec();
        let pool = self.record_pool.clone();
        let task = tokio::task::spawn_blocking(move || {
            let mut records = PooledRecords {
                v: pool.take(),
                pool,
            };
            let h = sized.decode_into(&mut records.v)?;
            let checksum = content_checksum(h.first_seq, &records);
            Ok::<_, BlockError>(Decoded {
                epoch: h.epoch,
                first: h.first_seq,
                version: h.version,
                flags: h.flags,
                records,
                checksum,
                block: Some(owned),
            })
        });
        task.await
            .map_err(|e| IngestError::Internal(e.to_string()))?
            .map_err(|e| IngestError::BadBlock(e.to_string()))
    }

    /// Step 4: dedupe, conflict check and trimming against the accepted mark.
    async fn plan(
        &self,
        device: &str,
        d: DeviceId,
        s: StreamId,
        cell: &Arc<KeyCell>,
        dec: Decoded,
    ) -> Result<Plan, IngestError> {
        let (first, last) = (dec.first, dec.last());
        // Snapshot the pending ranges before querying the catalog: a range enters the catalog
        // before it leaves `pending`, so this order never misses one.
        let (accepted, pending, rollbacks) = {
            let st = cell.lock();
            if first > st.accepted + 1 {
                return Err(st.ahead_error(first));
            }
            (st.accepted, st.pending.clone(), st.rollbacks)
        };
        // The mutation switch stores a resent block again, whole, under its own seqs.
        let mutated = dedupe_disabled() && first <= accepted;
        if first <= accepted && !mutated {
            self.check_conflicts(device, d, s, &dec, accepted, &pending)?;
        }
        if last <= accepted && !mutated {
            return Ok(Plan::Duplicate { last, rollbacks });
        }
        let skip = if mutated {
            0
        } else {
            (accepted + 1 - first) as usize
        };
        match dec.block {
            Some(block) if skip == 0 => Ok(Plan::Append(Append {
                key_hashes: crate::streams::BlockHashes::of_keys(
                    dec.records.iter().map(|r| r.key.as_str()),
                ),
                min_ts: dec.records.iter().map(|r| r.ts).min().unwrap_or(0),
                max_ts: dec.records.iter().map(|r| r.ts).max().unwrap_or(0),
                block,
                first,
                count: dec.records.len() as u32,
                checksum: dec.checksum,
                trimmed: 0,
            })),
            _ => self.reencode(dec, skip).await,
        }
    }

    /// Compares every committed or pending range that lies within the overlap with this block.
    fn check_conflicts(
        &self,
        device: &str,
        d: DeviceId,
        s: StreamId,
        dec: &Decoded,
        accepted: u64,
        pending: &VecDeque<(u64, u64, u64)>,
    ) -> Result<(), IngestError> {
        let (first, last) = (dec.first, dec.last());
        let hi = last.min(accepted);
        let mut ranges: Vec<(u64, u64, u64)> = pending
            .iter()
            .copied()
            .filter(|&(f, l, _)| f >= first && l <= hi)
            .collect();
        ranges.extend(self.catalog.contained_ranges(d, dec.epoch, s, first, hi)?);
        for (f, l, checksum) in ranges {
            let slice = &dec.records[(f - first) as usize..=(l - first) as usize];
            if content_checksum(f, slice) != checksum {
                self.stats.conflicts.fetch_add(1, Ordering::Relaxed);
                let stream = self.stream_name(s).unwrap_or_default();
                let reason = format!(
                    "conflicting content for stream {stream} epoch {} seqs {f}..={l}",
                    dec.epoch
                );
                self.fence(device, &reason);
                return Err(IngestError::Conflict {
                    first_seq: f,
                    last_seq: l,
                });
            }
        }
        Ok(())
    }

    /// Encodes the records after the first `skip` as a new block, on a blocking thread.
    async fn reencode(&self, dec: Decoded, skip: usize) -> Result<Plan, IngestError> {
        let task = tokio::task::spawn_blocking(move || {
            let kept = &dec.records[skip..];
            let first = dec.first + skip as u64;
            let opts = EncodeOptions {
                version: dec.version,
                flags: dec.flags,
                ..EncodeOptions::default()
            };
            let block = block::encode_block_with(&opts, dec.epoch, first, kept)?;
            Ok::<_, block::EncodeError>(Append {
                block,
                first,
                count: kept.len() as u32,
                checksum: content_checksum(first, kept),
                key_hashes: crate::streams::BlockHashes::of_keys(
                    kept.iter().map(|r| r.key.as_str()),
                ),
                min_ts: kept.iter().map(|r| r.ts).min().unwrap_or(0),
                max_ts: kept.iter().map(|r| r.ts).max().unwrap_or(0),
                trimmed: skip as u32,
            })
        });
        let append = task
            .await
            .map_err(|e| IngestError::Internal(e.to_string()))?
            .map_err(|e| IngestError::Internal(format!("re-encoding a trimmed block: {e}")))?;
        Ok(Plan::Append(append))
    }

    /// Step 5: queues the block to the WAL and advances the accepted mark.
    ///
    /// The check against the accepted mark and the queueing happen under the key's state
    /// lock, the same lock a failed commit's roll-back takes: either the roll-back comes first
    /// and this block (which continues the abandoned seqs) is refused here, or the block is
    /// queued before the roll-back runs, and the WAL writer, which drains its queue after the
    /// roll-backs of a failed group, fails it too. Either way no block is committed past a
    /// hole.
    fn enqueue(
        &self,
        cell: &Arc<KeyCell>,
        device: DeviceId,
        stream: StreamId,
        epoch: u64,
        a: Append,
    ) -> Result<oneshot::Receiver<Result<AppendDone, CommitError>>, IngestError> {
        let last = a.first + u64::from(a.count) - 1;
        let (first, checksum) = (a.first, a.checksum);
        let (tx, rx) = oneshot::channel();
        let done_cell = cell.clone();
        let done = Box::new(move |r: Result<AppendDone, CommitError>| {
            match &r {
                Ok(done) => done_cell.mark_durable(done.last_seq),
                Err(_) => done_cell.roll_back(first),
            }
            let _ = tx.send(r);
        });
        let req = AppendRequest {
            device,
            stream,
            epoch,
            first_seq: a.first,
            count: a.count,
            checksum: a.checksum,
            min_ts: a.min_ts,
            max_ts: a.max_ts,
            block: a.block,
            key_hashes: a.key_hashes,
            done,
        };
        let mut st = cell.lock();
        if first != st.accepted + 1 && !dedupe_disabled() {
            // A failed commit rolled this key back after `plan` checked the block.
            return Err(IngestError::Unavailable(CommitError::EarlierFailed));
        }
        st.accepted = st.accepted.max(last);
        st.high = st.high.max(last);
        st.pending.push_back((first, last, checksum));
        let unsent = self.wal.try_append(req).err();
        drop(st);
        if let Some(req) = unsent {
            (req.done)(Err(CommitError::Stopped));
        }
        Ok(rx)
    }

    fn cell(&self, d: DeviceId, epoch: u64, s: StreamId) -> Arc<KeyCell> {
        let mut keys = self.keys.lock().expect("keys lock");
        keys.entry((d, epoch, s))
            .or_insert_with(|| KeyCell::new(0))
            .clone()
    }

    /// The interned id of a device, creating it on first sight.
    pub fn device_id(&self, device: &str) -> Result<DeviceId, IngestError> {
        if let Some(&id) = self.names.read().expect("names lock").devices.get(device) {
            return Ok(id);
        }
        if !valid_device_id(device) {
            return Err(IngestError::BadDeviceId);
        }
        let id = self.catalog.intern_device(device)?;
        let mut names = self.names.write().expect("names lock");
        names.devices.insert(device.to_string(), id);
        names.device_names.insert(id, device.to_string());
        Ok(id)
    }

    /// The interned id of a stream, creating it on first sight.
    pub fn stream_id(&self, stream: &str) -> Result<StreamId, IngestError> {
        if let Some(&id) = self.names.read().expect("names lock").streams.get(stream) {
            return Ok(id);
        }
        if !valid_stream_name(stream) {
            return Err(IngestError::BadStreamName(
                stream.chars().take(80).collect(),
            ));
        }
        let id = self.catalog.intern_stream(stream)?;
        let mut names = self.names.write().expect("names lock");
        names.streams.insert(stream.to_string(), id);
        names.stream_names.insert(id, stream.to_string());
        Ok(id)
    }

    /// A known stream's id, without creating it.
    pub fn lookup_stream(&self, stream: &str) -> Option<StreamId> {
        self.names
            .read()
            .expect("names lock")
            .streams
            .get(stream)
            .copied()
    }

    /// The name of a device id.
    pub fn device_name(&self, id: DeviceId) -> Option<String> {
        self.names
            .read()
            .expect("names lock")
            .device_names
            .get(&id)
            .cloned()
    }

    /// The name of a stream id.
    pub fn stream_name(&self, id: StreamId) -> Option<String> {
        self.names
            .read()
            .expect("names lock")
            .stream_names
            .get(&id)
            .cloned()
    }

    /// The catalog, for the API and tools.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// Merged streams: segments, readable ends, cuts and reader groups.
    pub fn streams(&self) -> &Arc<crate::streams::StreamManager> {
        &self.streams
    }

    /// What tier 1 and a local tier 2 are stored on.
    pub fn storage(&self) -> &Arc<dyn crate::storage::Storage> {
        &self.storage
    }

    /// The WAL reader.
    pub fn wal_reader(&self) -> &WalReader {
        &self.reader
    }

    /// The WAL writer's counters.
    pub fn wal_stats(&self) -> &Arc<wal::WalStats> {
        self.wal.stats()
    }

    /// Why tier 1 cannot take writes right now, for `/healthz`: a poisoned log (until a
    /// restart) or a full disk (until space is free again; the message names the path).
    pub fn health(&self) -> Result<(), String> {
        if let Some(why) = self.startup.why_not_ready() {
            return Err(format!("starting: {why}"));
        }
        let stats = self.wal.stats();
        if stats.poisoned.load(Ordering::Relaxed) {
            return Err("tier-1 log poisoned after a storage failure; restart the hub".into());
        }
        if let Some(e) = stats.fd_exhausted() {
            return Err(format!(
                "tier-1 out of file descriptors, writes retried with backoff: {e}"
            ));
        }
        match stats.disk_full() {
            Some(e) => Err(format!(
                "tier-1 disk full, writes refused until space is free: {e}"
            )),
            None => Ok(()),
        }
    }

    /// Record buffers for decoding blocks; records handed to [`Hub::submit_verified`] return
    /// here once the block is planned.
    pub fn record_pool(&self) -> &Arc<RecordPool> {
        &self.record_pool
    }

    /// Ingest counters.
    pub fn stats(&self) -> &IngestStats {
        &self.stats
    }

    /// `metrics.device_series_max`: devices `/metrics` lists by name.
    pub fn device_series_max(&self) -> usize {
        self.device_series_max
    }

    /// The global ingest memory budget (permits of [`MEMORY_PERMIT_BYTES`] bytes). A driver
    /// may reserve from it for bytes it buffers before calling `commit_block`.
    pub fn memory(&self) -> &Arc<Semaphore> {
        &self.memory
    }

    /// Ingest memory currently reserved, in bytes.
    pub fn memory_in_use_bytes(&self) -> u64 {
        let free = self.memory.available_permits() as u64;
        (u64::from(self.memory_permits) - free.min(u64::from(self.memory_permits)))
            * MEMORY_PERMIT_BYTES
    }

    /// The decode limits in force.
    pub fn decode_limits(&self) -> DecodeLimits {
        self.limits
    }

    /// The limits for blocks already stored: the format's maxima for the sizes checked when
    /// they arrived (reading them back must not fail because an operator lowered those since),
    /// and `ingest.block_decoded_bytes_max` for their records, which protects this process's
    /// memory whatever a block's history (`crate::poison`).
    pub fn stored_decode_limits(&self) -> DecodeLimits {
        DecodeLimits {
            raw_bytes_max: 1 << 30,
            records_max: u32::MAX,
            body_bytes_max: 1 << 30,
            decoded_bytes_max: self.limits.decoded_bytes_max,
        }
    }

    /// The hub's data directory.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }
}

impl Hub {
    /// Stops the WAL writer after what is already queued, and waits for it. Later commits
    /// fail with `unavailable`. Dropping the hub does the same.
    pub fn shutdown(&self) {
        self.streams.stop();
        self.wal.stop();
        let join = self.writer.lock().expect("writer lock").take();
        if let Some(join) = join
            && join.join().is_err()
        {
            tracing::error!("the WAL writer panicked");
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Takes the exclusive lock on `data_dir/hub.lock`.
fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, OpenError> {
    let path = dir.join("hub.lock");
    let io = |source| OpenError::DataDir {
        path: path.clone(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(OpenError::Locked(path)),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sync::record::Value;

    fn rec(key: &str, ts: i64, v: Value) -> Record {
        Record {
            tags: Vec::new(),
            key: key.into(),
            ts,
            fields: vec![("v".into(), v)],
        }
    }

    #[test]
    fn checksum_is_independent_of_block_version() {
        let recs: Vec<Record> = (0..50).map(|i| rec("k", i, Value::F64(i as f64))).collect();
        let v1 = block::encode_block(block::VERSION_ROWS, 1, 1, &recs).unwrap();
        let v2 = block::encode_block(block::VERSION_COLUMNAR, 1, 1, &recs).unwrap();
        let l = DecodeLimits::default();
        let a = content_checksum(1, &block::decode_block(&v1, &l).unwrap().records);
        let b = content_checksum(1, &block::decode_block(&v2, &l).unwrap().records);
        assert_eq!(a, b);
        assert_eq!(a, content_checksum(1, &recs));
        assert_ne!(a, content_checksum(2, &recs));
        let mut changed = recs.clone();
        changed[7].fields[0].1 = Value::F64(-1.0);
        assert_ne!(a, content_checksum(1, &changed));
    }

    #[test]
    fn error_codes_are_distinct() {
        let errs = [
            IngestError::Fenced(String::new()),
            IngestError::BadDeviceId,
            IngestError::BadStreamName(String::new()),
            IngestError::Unauthorized(String::new()),
            IngestError::ForbiddenKey {
                stream: String::new(),
                key: String::new(),
                prefix: String::new(),
            },
            IngestError::BadKey {
                stream: String::new(),
                key: String::new(),
                why: "",
            },
            IngestError::BadTags {
                stream: String::new(),
                key: String::new(),
                why: String::new(),
            },
            IngestError::QuotaExceeded {
                stream: String::new(),
                key: "",
                max: 0,
            },
            IngestError::TooLarge { len: 0, limit: 0 },
            IngestError::BadBlock(String::new()),
            IngestError::DecodedTooLarge { size: 0, limit: 0 },
            IngestError::ReservedSeq,
            IngestError::BadGap { first: 0, last: 0 },
            IngestError::OutOfOrder { expected: 0 },
            IngestError::Conflict {
                first_seq: 0,
                last_seq: 0,
            },
            IngestError::Unavailable(CommitError::Poisoned),
            IngestError::Catalog(String::new()),
            IngestError::Internal(String::new()),
        ];
        let codes: std::collections::HashSet<_> = errs.iter().map(IngestError::code).collect();
        assert_eq!(codes.len(), errs.len());
        assert!(!IngestError::Unavailable(CommitError::Poisoned).is_peer_fault());
        assert!(
            IngestError::Conflict {
                first_seq: 1,
                last_seq: 1
            }
            .is_peer_fault()
        );
    }
}
