//! The in-memory index shared by the writer thread and readers: segments, blocks, durable
//! marks, acknowledgements and gap markers, behind one mutex.
//!
//! The writer is the only one that changes segment files; it updates this index after every
//! write and publishes durable marks only after the fsync that covers them. Readers copy block
//! locations out under the lock and read the bytes without it.

use super::ReadError;
use crate::storage::Storage;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use sync::block::{BlockHeader, DecodeLimits, verify_block};
use sync::segment::FRAME_HEADER_LEN;
use tokio::sync::{Notify, watch};

/// Why a range of seqs is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GapReason {
    /// Dropped by the disk budget (`on_full = drop-oldest`).
    Dropped,
    /// Quarantined at recovery because its block failed verification.
    Corrupt,
    /// Quarantined because the hub refused its block for good (decoded size over the hub's
    /// limit, or a block nobody can decode); reported to the hub as `Corrupt`.
    Refused,
}

/// A recorded gap: the seqs `first_seq..=last_seq` of `epoch` are gone, for `reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gap {
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub reason: GapReason,
    pub records: u64,
}

/// A durable block as stored: its header, and the block bytes exactly as framed (without the
/// 8-byte frame header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBlock {
    pub header: BlockHeader,
    pub bytes: Vec<u8>,
}

/// One stream's state, as [`super::LogHandle::status`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStatus {
    pub stream: String,
    pub epoch: u64,
    /// The seq the next appended record will get.
    pub next_seq: u64,
    /// The last seq made durable (fsynced) in the current epoch.
    pub durable_seq: u64,
    /// The hub's acknowledgements for the current epoch.
    pub acked_durable: u64,
    pub acked_tiered: u64,
    /// Durable blocks not yet acknowledged as durable by the hub (all epochs).
    pub backlog_bytes: u64,
    pub backlog_blocks: u64,
    pub segments: usize,
    /// Event time of the oldest unacknowledged record (min ts of the first unacked block).
    pub oldest_unsent_ts: Option<i64>,
    /// Records dropped by the disk budget over the data directory's life: the sum of the
    /// `Dropped` gap markers, which are durable, so a restart keeps the count.
    pub dropped_records: u64,
    /// Blocks dropped since open (the markers keep runs of records, not blocks).
    pub dropped_blocks: u64,
    /// `Dropped` gap markers (one per contiguous run of dropped records).
    pub dropped_gaps: u64,
    pub quarantined_blocks: u64,
}

/// A snapshot of the whole log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogStatus {
    pub epoch: u64,
    pub streams: Vec<StreamStatus>,
    /// Bytes in segment files.
    pub disk_bytes: u64,
    pub poisoned: Option<String>,
}

/// Where one block lives.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockRef {
    /// File offset of the frame header.
    pub offset: u64,
    /// Block length (without the frame header).
    pub len: u32,
    pub first_seq: u64,
    pub count: u32,
    pub min_ts: i64,
    pub flags: u8,
}

impl BlockRef {
    pub(crate) fn last_seq(&self) -> u64 {
        self.first_seq + u64::from(self.count) - 1
    }
    pub(crate) fn frame_bytes(&self) -> u64 {
        FRAME_HEADER_LEN as u64 + u64::from(self.len)
    }
}

/// One segment file.
#[derive(Debug, Clone)]
pub(crate) struct SegIndex {
    pub epoch: u64,
    pub first_seq: u64,
    pub path: PathBuf,
    /// File length.
    pub bytes: u64,
    pub blocks: Vec<BlockRef>,
}

impl SegIndex {
    pub(crate) fn last_seq(&self) -> Option<u64> {
        self.blocks.last().map(BlockRef::last_seq)
    }
}

/// One stream.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamIndex {
    /// Ordered by epoch (minting order), then seq.
    pub segments: Vec<SegIndex>,
    /// Last durable seq per epoch.
    pub durable: HashMap<u64, u64>,
    pub next_seq: u64,
    /// `(durable_seq, tiered_seq)` acknowledged by the hub, per epoch.
    pub acks: HashMap<u64, (u64, u64)>,
    pub gaps: Vec<Gap>,
    /// Per old epoch, the first seq whose records were moved to a newer epoch (rekey).
    pub moved: HashMap<u64, u64>,
    pub dropped_records: u64,
    pub dropped_blocks: u64,
    pub quarantined_blocks: u64,
}

/// Everything under the lock.
#[derive(Debug, Default)]
pub(crate) struct SharedState {
    /// Epochs in minting order; the last is current.
    pub epochs: Vec<u64>,
    pub streams: BTreeMap<String, StreamIndex>,
    pub disk_bytes: u64,
    pub poisoned: Option<String>,
    pub acks_dirty: bool,
}

/// The state shared between handles and the writer.
#[derive(Debug)]
pub(crate) struct Shared {
    pub storage: Arc<dyn Storage>,
    state: Mutex<SharedState>,
    epoch: AtomicU64,
    poisoned: AtomicBool,
    pub durable_tx: watch::Sender<u64>,
    /// Signalled whenever the writer drained the queue.
    pub queue_space: Notify,
}

impl Shared {
    pub(crate) fn new(storage: Arc<dyn Storage>, state: SharedState) -> Shared {
        let epoch = *state
            .epochs
            .last()
            .expect("recovery always yields an epoch");
        let (durable_tx, _) = watch::channel(0);
        Shared {
            storage,
            state: Mutex::new(state),
            epoch: AtomicU64::new(epoch),
            poisoned: AtomicBool::new(false),
            durable_tx,
            queue_space: Notify::new(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, SharedState> {
        // Every update under this lock is a few assignments; a panic mid-way is a bug we
        // surface elsewhere, so keep serving the data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    pub(crate) fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
    }

    pub(crate) fn poisoned(&self) -> Option<String> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        self.lock().poisoned.clone()
    }

    pub(crate) fn poison(&self, why: String) {
        let mut s = self.lock();
        if s.poisoned.is_none() {
            tracing::error!(error = %why, "local log poisoned; refusing writes until reopened");
            s.poisoned = Some(why);
        }
        self.poisoned.store(true, Ordering::Release);
    }

    pub(crate) fn set_acked(&self, stream: &str, epoch: u64, durable_seq: u64, tiered_seq: u64) {
        let mut s = self.lock();
        if let Some(st) = s.streams.get_mut(stream) {
            let a = st.acks.entry(epoch).or_insert((0, 0));
            a.0 = a.0.max(durable_seq);
            a.1 = a.1.max(tiered_seq);
        }
        s.acks_dirty = true;
    }

    pub(crate) fn gaps(&self, stream: &str) -> Vec<Gap> {
        self.lock()
            .streams
            .get(stream)
            .map(|s| s.gaps.clone())
            .unwrap_or_default()
    }

    pub(crate) fn epochs_held(&self, stream: &str) -> Vec<(u64, u64, u64)> {
        let s = self.lock();
        let Some(st) = s.streams.get(stream) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        for e in &s.epochs {
            let moved = st.moved.get(e).map_or(u64::MAX, |m| m - 1);
            let durable = st.durable.get(e).copied().unwrap_or(0).min(moved);
            let mut blocks = st
                .segments
                .iter()
                .filter(|g| g.epoch == *e)
                .flat_map(|g| g.blocks.iter());
            let Some(first) = blocks.next() else { continue };
            if first.first_seq > durable {
                continue;
            }
            out.push((*e, first.first_seq, durable));
        }
        out
    }

    pub(crate) fn status(&self, names: &[String]) -> LogStatus {
        let s = self.lock();
        let epoch = *s.epochs.last().expect("an epoch");
        let streams = names
            .iter()
            .filter_map(|n| s.streams.get(n).map(|st| stream_status(n, epoch, st)))
            .collect();
        LogStatus {
            epoch,
            streams,
            disk_bytes: s.disk_bytes,
            poisoned: s.poisoned.clone(),
        }
    }

    /// Finds the durable blocks to read, then reads them without holding the lock. A segment
    /// deleted in between (retention, budget) is looked up again.
    pub(crate) fn read_blocks(
        &self,
        stream: &str,
        epoch: u64,
        after_seq: u64,
        bytes_max: usize,
    ) -> Result<Vec<StoredBlock>, ReadError> {
        let mut attempts = 0;
        loop {
            let plan = self.plan_read(stream, epoch, after_seq, bytes_max)?;
            match self.execute_read(&plan) {
                Ok(blocks) => return Ok(blocks),
                Err(ReadError::Io { path, error }) => {
                    attempts += 1;
                    let still_there = self
                        .lock()
                        .streams
                        .get(stream)
                        .is_some_and(|st| st.segments.iter().any(|g| g.path == path));
                    if still_there || attempts >= 3 {
                        return Err(ReadError::Io { path, error });
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn plan_read(
        &self,
        stream: &str,
        epoch: u64,
        after_seq: u64,
        bytes_max: usize,
    ) -> Result<Vec<(PathBuf, Vec<BlockRef>)>, ReadError> {
        let s = self.lock();
        let st = s
            .streams
            .get(stream)
            .ok_or_else(|| ReadError::UnknownStream(stream.to_string()))?;
        let durable = st.durable.get(&epoch).copied().unwrap_or(0);
        let mut plan: Vec<(PathBuf, Vec<BlockRef>)> = Vec::new();
        let mut total = 0usize;
        for seg in st.segments.iter().filter(|g| g.epoch == epoch) {
            if seg.last_seq().is_none_or(|l| l <= after_seq) {
                continue;
            }
            for b in &seg.blocks {
                if b.last_seq() <= after_seq {
                    continue;
                }
                // A quarantined block (a refused one stays in its segment) is never shipped.
                if st.gaps.iter().any(|g| {
                    g.epoch == epoch && g.first_seq <= b.first_seq && b.last_seq() <= g.last_seq
                }) {
                    continue;
                }
                if b.last_seq() > durable || (total > 0 && total + b.len as usize > bytes_max) {
                    return Ok(plan);
                }
                total += b.len as usize;
                match plan.last_mut() {
                    Some((p, v)) if *p == seg.path => v.push(*b),
                    _ => plan.push((seg.path.clone(), vec![*b])),
                }
            }
        }
        Ok(plan)
    }

    fn execute_read(
        &self,
        plan: &[(PathBuf, Vec<BlockRef>)],
    ) -> Result<Vec<StoredBlock>, ReadError> {
        let mut out = Vec::new();
        let limits = DecodeLimits::default();
        for (path, blocks) in plan {
            let start = blocks[0].offset;
            let end = blocks
                .last()
                .map(|b| b.offset + b.frame_bytes())
                .expect("non-empty");
            let buf = self
                .storage
                .read_at(path, start, (end - start) as usize)
                .map_err(|e| ReadError::Io {
                    path: path.clone(),
                    error: e.to_string(),
                })?;
            for b in blocks {
                let at = (b.offset - start) as usize + FRAME_HEADER_LEN;
                let bytes = buf[at..at + b.len as usize].to_vec();
                // Checked when written and at open; checked again here before it leaves the agent.
                let header = verify_block(&bytes, &limits).map_err(|e| ReadError::Corrupt {
                    path: path.clone(),
                    offset: b.offset,
                    error: e.to_string(),
                })?;
                assert_eq!(
                    header.first_seq, b.first_seq,
                    "index and block header disagree"
                );
                out.push(StoredBlock { header, bytes });
            }
        }
        Ok(out)
    }
}

fn stream_status(name: &str, epoch: u64, st: &StreamIndex) -> StreamStatus {
    let (acked_durable, acked_tiered) = st.acks.get(&epoch).copied().unwrap_or((0, 0));
    let (mut backlog_bytes, mut backlog_blocks, mut oldest) = (0u64, 0u64, None::<i64>);
    for seg in &st.segments {
        let durable = st.durable.get(&seg.epoch).copied().unwrap_or(0);
        let acked = st.acks.get(&seg.epoch).map_or(0, |a| a.0);
        let moved = st.moved.get(&seg.epoch).copied().unwrap_or(u64::MAX);
        for b in seg
            .blocks
            .iter()
            .filter(|b| b.last_seq() > acked && b.last_seq() <= durable && b.first_seq < moved)
        {
            backlog_bytes += b.frame_bytes();
            backlog_blocks += 1;
            oldest = Some(oldest.map_or(b.min_ts, |o| o.min(b.min_ts)));
        }
    }
    let dropped = st.gaps.iter().filter(|g| g.reason == GapReason::Dropped);
    StreamStatus {
        stream: name.to_string(),
        epoch,
        next_seq: st.next_seq,
        durable_seq: st.durable.get(&epoch).copied().unwrap_or(0),
        acked_durable,
        acked_tiered,
        backlog_bytes,
        backlog_blocks,
        segments: st.segments.len(),
        oldest_unsent_ts: oldest,
        dropped_records: dropped.clone().map(|g| g.records).sum(),
        dropped_blocks: st.dropped_blocks,
        dropped_gaps: dropped.count() as u64,
        quarantined_blocks: st.quarantined_blocks,
    }
}
