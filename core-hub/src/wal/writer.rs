//! The writer thread: batches requests into groups, writes their frames and rolls files, and
//! undoes a group that failed for a full disk or for want of file descriptors (or cuts back
//! to the committed end when the committer asks). It never fsyncs for a group's sake and never acknowledges: the
//! [`super::committer`] does both, in write order.

use super::committer::{Done, Piped, Written};
use super::disk_full::{
    FullState, Shared, end_fd_exhausted, enter_disk_full, enter_fd_exhausted, fd_error, fd_refusal,
    fd_retry_due, is_fd_exhausted, try_resume,
};
use super::format::{
    EntryHeader, KIND_BLOCK, WAL_HEADER_LEN, encode_frame, frame_len, wal_file_header,
    wal_file_path,
};
use super::recover::{Recovered, empty_wal_file, rewind};
use super::{
    AppendDone, AppendRequest, CommitError, FaultPoint, GapRequest, Request, WalEnv, WalStats,
    WriterConfig, fail, fault, poison, request_bytes, write_error,
};
use crate::catalog::{BlockRow, Catalog, DeviceId, GroupCommit, StreamId};
use crate::storage::StorageFile;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::time::{Instant, SystemTime};
use sync::segment::FRAME_BYTES_MAX;

/// A batch stops collecting once it holds this many bytes.
const BATCH_BYTES_MAX: usize = 64 << 20;
/// A batch stops collecting once it holds this many requests.
const BATCH_REQUESTS_MAX: usize = 8192;

/// What the writer and the committer share.
pub(super) struct Link {
    pub(super) stats: Arc<WalStats>,
    pub(super) shared: Arc<Shared>,
    pub(super) written: mpsc::SyncSender<Piped>,
}

/// Writes groups into the log, in order, and hands them to the committer.
///
/// The write of group N+1 overlaps with the fsync and the catalog commit of group N. Nothing
/// is acknowledged here: a group's callers complete only after the committer's fsync that
/// covers it and its catalog transaction, so the acknowledgement rule is unchanged.
pub(super) struct Writer {
    env: WalEnv,
    dir: PathBuf,
    /// Shared with the committer, which fsyncs through it.
    file: Arc<dyn StorageFile>,
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
    /// WAL files the group being written rolled into (removed if it fails for a full disk or
    /// for want of descriptors), with their handle once created whole (reused by the cut, so
    /// it needs no new descriptor).
    created: Vec<(PathBuf, Option<Arc<dyn StorageFile>>)>,
    /// The WAL directory must be fsynced before anything more is written: a roll created a
    /// file, or a cut removed one, and the directory fsync then found no descriptor.
    dir_sync_owed: bool,
    /// The out-of-descriptors backoff (`disk_full::enter_fd_exhausted`).
    fd: FullState,
    /// The next offset of each stream before the group being written assigned any.
    group_offsets: HashMap<StreamId, u64>,
    /// The WAL end the last group handed to the committer reaches: groups go in write order.
    sent_end: u64,
    /// A stop request was drained while failing queued requests.
    stop_seen: bool,
}

/// Where the group being written started, to cut it off again.
struct GroupStart {
    file: Arc<dyn StorageFile>,
    file_first: u64,
    file_len: u64,
}

/// The rows and completions of the group being written, and its frames not yet flushed.
#[derive(Default)]
struct Group {
    g: GroupCommit,
    dones: Vec<Done>,
    buf: Vec<u8>,
    marks: HashMap<(DeviceId, u64, StreamId), u64>,
    touched_streams: Vec<StreamId>,
    wrote: bool,
}

impl Group {
    fn mark(&mut self, key: (DeviceId, u64, StreamId), seq: u64) {
        let mark = self.marks.entry(key).or_insert(seq);
        *mark = (*mark).max(seq);
    }
}

impl Writer {
    pub(super) fn new(
        env: WalEnv,
        dir: PathBuf,
        rec: Recovered,
        next_offset: HashMap<StreamId, u64>,
        cfg: WriterConfig,
        catalog: Arc<Catalog>,
        link: Link,
    ) -> Writer {
        let sent_end = rec.first + rec.len - WAL_HEADER_LEN as u64;
        Writer {
            env,
            dir,
            file: rec.file,
            file_first: rec.first,
            file_len: rec.len,
            next_offset,
            cfg,
            stats: link.stats,
            last_ingest_ts: 0,
            written: link.written,
            routed: Vec::new(),
            catalog,
            shared: link.shared,
            created: Vec::new(),
            dir_sync_owed: false,
            fd: FullState::default(),
            group_offsets: HashMap::new(),
            sent_end,
            stop_seen: false,
        }
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Request>) {
        while !self.stop_seen {
            let first = match rx.recv_timeout(self.env.tuning.writer_tick) {
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

    /// Idle work: a rewind the committer asked for, and the disk-full and descriptor probes.
    fn tick(&mut self, rx: &mpsc::Receiver<Request>) {
        if self.shared.rewind.load(Ordering::Acquire) {
            self.rewind_to_committed(Vec::new(), rx);
        }
        self.probe_fds();
        let (storage, dir) = (&self.env.storage, &self.dir);
        try_resume(&self.stats, &self.shared, &self.env.tuning, || {
            storage.free_bytes(dir)
        });
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
            let refused = self.fail_and_drain(batch, e, rx);
            self.stats
                .disk_full_refused
                .fetch_add(refused, Ordering::Relaxed);
            return;
        }
        if let Err(e) = self.fd_gate() {
            if matches!(e, CommitError::FdExhausted { .. }) {
                self.fail_and_drain(batch, e, rx);
            } else {
                poison(&self.stats, &e);
                for req in batch {
                    fail(req, e.clone());
                }
            }
            return;
        }
        let requests = batch.len();
        let start = GroupStart {
            file: self.file.clone(),
            file_first: self.file_first,
            file_len: self.file_len,
        };
        self.created.clear();
        self.group_offsets.clear();
        let mut pending = batch.into_iter();
        let mut group = Group::default();
        let (file, error) = match self.write_batch(&mut pending, &mut group) {
            Ok(()) => (group.wrote.then(|| self.file.clone()), None),
            Err(e @ (CommitError::DiskFull { .. } | CommitError::FdExhausted { .. })) => {
                self.undo_group(start, group.dones, pending.collect(), e, rx);
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
        if error.is_none() {
            end_fd_exhausted(&self.stats);
        }
        self.send(group, requests, file, error);
    }

    /// Before a group: refuses it while an out-of-descriptors episode waits out its backoff
    /// (`FdExhausted`), and settles a directory fsync still owed (its own EMFILE extends the
    /// episode; any other failure is returned to poison the log).
    fn fd_gate(&mut self) -> Result<(), CommitError> {
        fd_retry_due(&self.stats, &mut self.fd, &self.env.tuning, Instant::now());
        if let Some(e) = fd_refusal(&self.stats, &self.fd) {
            return Err(e);
        }
        if !self.dir_sync_owed {
            return Ok(());
        }
        match self.env.storage.sync_dir(&self.dir) {
            Ok(()) => {
                self.dir_sync_owed = false;
                Ok(())
            }
            Err(e) if self.fd_transient(&e) => {
                let e = fd_error(&self.dir, &e);
                enter_fd_exhausted(&self.stats, &mut self.fd, &self.env.tuning, &e);
                Err(e)
            }
            Err(e) => Err(CommitError::Io(format!("{}: {e}", self.dir.display()))),
        }
    }

    /// The idle probe of an out-of-descriptors episode: once its backoff has passed, one
    /// descriptor is taken (the directory fsync if one is owed, else opening the active file)
    /// and the episode ends if that works, so an idle hub reports healthy again by itself.
    fn probe_fds(&mut self) {
        if !self.stats.fd_exhausted.load(Ordering::Acquire)
            || self.stats.poisoned.load(Ordering::Acquire)
        {
            return;
        }
        if !fd_retry_due(&self.stats, &mut self.fd, &self.env.tuning, Instant::now()) {
            return;
        }
        let probe = if self.dir_sync_owed {
            self.fd_gate().map(drop)
        } else {
            let path = wal_file_path(&self.dir, self.file_first);
            match self.env.storage.open(&path) {
                Ok(_) => Ok(()),
                Err(e) if self.fd_transient(&e) => {
                    let e = fd_error(&path, &e);
                    enter_fd_exhausted(&self.stats, &mut self.fd, &self.env.tuning, &e);
                    Err(e)
                }
                // Not a descriptor problem: the next group finds out what it is.
                Err(_) => Ok(()),
            }
        };
        match probe {
            Ok(()) => end_fd_exhausted(&self.stats),
            Err(CommitError::FdExhausted { .. }) => {}
            Err(e) => poison(&self.stats, &e),
        }
    }

    /// Whether `e` is a descriptor shortage to wait out (always, unless the test-only
    /// mutation makes it fatal again).
    fn fd_transient(&self, e: &std::io::Error) -> bool {
        is_fd_exhausted(e) && !self.fd_fatal_mutation()
    }

    #[cfg(feature = "fault-injection")]
    fn fd_fatal_mutation(&self) -> bool {
        self.env.tuning.mutated(super::Mutation::FdExhaustionFatal)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn fd_fatal_mutation(&self) -> bool {
        false
    }

    /// Hands a written group to the committer, in write order.
    fn send(
        &mut self,
        group: Group,
        requests: usize,
        file: Option<Arc<dyn StorageFile>>,
        error: Option<CommitError>,
    ) {
        if error.is_none() {
            let end = group.g.wal_end.expect("a written group records its end");
            assert!(
                end >= self.sent_end,
                "groups go to the committer in write order"
            );
            self.sent_end = end;
        }
        let w = Written {
            g: group.g,
            dones: group.dones,
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

    /// Cuts off a group whose write failed for a full disk (or for want of descriptors), fails
    /// its requests and everything queued behind them, and starts refusing writes. Groups
    /// written before it are intact.
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
            let fatal = CommitError::Io(format!("cutting off a group after {e}: {io}"));
            poison(&self.stats, &fatal);
        } else if matches!(e, CommitError::FdExhausted { .. }) {
            enter_fd_exhausted(&self.stats, &mut self.fd, &self.env.tuning, &e);
        } else {
            enter_disk_full(&self.stats, &self.shared, &self.env.tuning, &e);
        }
        for done in dones {
            done.finish(Err(e.clone()));
        }
        let refused = self.fail_and_drain(rest, e.clone(), rx);
        if matches!(e, CommitError::DiskFull { .. }) {
            self.stats
                .disk_full_refused
                .fetch_add(refused, Ordering::Relaxed);
        }
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
        let mut removed = false;
        for (path, _) in created.iter().filter(|(p, _)| *p != keep) {
            match self.env.storage.remove(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                r => removed |= r.is_ok(),
            }
        }
        if removed && !self.env.tuning.skip_cut_dir_sync() {
            // Durable before the log grows again: a removed file that came back after a crash
            // would start inside the range the active file goes on to commit, and recovery
            // would take it for the file holding the committed end. Without a descriptor for
            // it, it is owed: no later group writes before it succeeded (`fd_gate`).
            match self.env.storage.sync_dir(&self.dir) {
                Err(e) if self.fd_transient(&e) => self.dir_sync_owed = true,
                r => r?,
            }
        }
        if let Some((_, handle)) = created.iter().find(|(p, _)| *p == keep) {
            self.file = match handle {
                // Created whole by this group: emptied through its handle, no new descriptor.
                Some(f) => {
                    f.set_len(WAL_HEADER_LEN as u64)?;
                    f.clone()
                }
                None => empty_wal_file(&*self.env.storage, &keep)?,
            };
            self.file_first = cut_at;
            self.file_len = WAL_HEADER_LEN as u64;
        } else {
            start.file.set_len(start.file_len)?;
            self.file = start.file;
            self.file_first = start.file_first;
            self.file_len = start.file_len;
        }
        assert_eq!(
            self.logical_end(),
            cut_at,
            "the cut ends where the group started"
        );
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
    /// Returns how many requests it failed.
    fn fail_and_drain(
        &mut self,
        reqs: Vec<Request>,
        e: CommitError,
        rx: &mpsc::Receiver<Request>,
    ) -> u64 {
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
        refused
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
        let refused = self.fail_and_drain(Vec::new(), e, rx);
        self.stats
            .disk_full_refused
            .fetch_add(refused, Ordering::Relaxed);
    }

    fn rewind_files(&mut self) -> Result<(), String> {
        // The committer commits nothing while a rewind is pending, so this end is final.
        let end = self.stats.committed_end.load(Ordering::Acquire);
        let streams = self.catalog.streams().map_err(|e| e.to_string())?;
        let sync_dir = !self.env.tuning.skip_cut_dir_sync();
        let rec =
            rewind(&*self.env.storage, &self.dir, end, sync_dir).map_err(|e| e.to_string())?;
        if rec.dropped_bytes > 0 {
            tracing::warn!(
                bytes = rec.dropped_bytes,
                committed_end = end,
                "cut the uncommitted WAL tail after a full disk"
            );
        }
        self.file = rec.file;
        self.file_first = rec.first;
        self.file_len = rec.len;
        assert_eq!(self.logical_end(), end, "rewound to the committed end");
        self.sent_end = end;
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
    /// committer's). On an error, the requests not yet turned into `dones` are left in
    /// `batch`.
    fn write_batch(
        &mut self,
        batch: &mut std::vec::IntoIter<Request>,
        group: &mut Group,
    ) -> Result<(), CommitError> {
        let ingest_ts = self.ingest_ts();
        let bytes: usize = batch.as_slice().iter().map(request_bytes).sum();
        group.buf = Vec::with_capacity(bytes.min(BATCH_BYTES_MAX + FRAME_BYTES_MAX as usize));
        for req in batch.by_ref() {
            match req {
                Request::Append(a) => self.append(a, ingest_ts, group)?,
                Request::Gap(gr) => add_gap(gr, group),
                Request::Stop => unreachable!("collect never batches a stop request"),
            }
        }
        self.flush(group)?;
        self.finish_rows(group);
        Ok(())
    }

    /// Adds one block's frame to the group, rolling first if it would not fit the file.
    fn append(
        &mut self,
        a: AppendRequest,
        ingest_ts: i64,
        group: &mut Group,
    ) -> Result<(), CommitError> {
        let frame = frame_len(a.block.len()) as u64;
        let pending = self.file_len + group.buf.len() as u64;
        if pending > WAL_HEADER_LEN as u64
            && pending + frame > self.cfg.segment_bytes_max
            && let Err(e) = self.flush(group).and_then(|()| self.roll())
        {
            (a.done)(Err(e.clone()));
            return Err(e);
        }
        let next = self.next_offset.entry(a.stream).or_insert(0);
        let base = *next;
        *next += u64::from(a.count);
        assert!(*next > base, "a block holds records");
        self.group_offsets.entry(a.stream).or_insert(base);
        group.touched_streams.push(a.stream);
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
        let wal_pos = self.file_len + group.buf.len() as u64;
        encode_frame(&mut group.buf, &header, &a.block);
        group.g.blocks.push(self.block_row(&a, &header, wal_pos));
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
        let last_seq = a.first_seq + u64::from(a.count) - 1;
        group.mark((a.device, a.epoch, a.stream), last_seq);
        self.stats.entries.fetch_add(1, Ordering::Relaxed);
        let done = AppendDone {
            hub_offset_base: base,
            last_seq,
            ingest_ts,
        };
        group.dones.push(Done::Append(a.done, done));
        Ok(())
    }

    /// The block index row of a frame written at `wal_pos` of the active file.
    fn block_row(&self, a: &AppendRequest, h: &EntryHeader, wal_pos: u64) -> BlockRow {
        // An empty summary (no records) has no range to skip by.
        let hashed = !a.key_hashes.buckets.is_empty();
        BlockRow {
            device: a.device,
            epoch: a.epoch,
            stream: a.stream,
            first_seq: a.first_seq,
            last_seq: a.first_seq + u64::from(a.count) - 1,
            checksum: a.checksum,
            hub_offset_base: h.hub_offset_base,
            wal_file: self.file_first,
            wal_pos,
            frame_len: frame_len(a.block.len()) as u32,
            ingest_ts: h.ingest_ts,
            min_ts: a.min_ts,
            max_ts: a.max_ts,
            key_hash_min: hashed.then_some(a.key_hashes.min),
            key_hash_max: hashed.then_some(a.key_hashes.max),
        }
    }

    /// The group's marks, stream offsets and WAL end, once every frame is in the file.
    fn finish_rows(&self, group: &mut Group) {
        group.g.marks = group
            .marks
            .drain()
            .map(|((d, e, s), m)| (d, e, s, m))
            .collect();
        group.touched_streams.sort_unstable();
        group.touched_streams.dedup();
        group.g.stream_offsets = group
            .touched_streams
            .iter()
            .map(|&s| (s, self.next_offset[&s]))
            .collect();
        group.g.wal_end = Some(self.logical_end());
    }

    fn logical_end(&self) -> u64 {
        self.file_first + self.file_len - WAL_HEADER_LEN as u64
    }

    /// Appends the group's pending frames to the active file (no fsync).
    fn flush(&mut self, group: &mut Group) -> Result<(), CommitError> {
        let buf = &mut group.buf;
        if buf.is_empty() {
            return Ok(());
        }
        group.wrote = true;
        if fault(&self.cfg, FaultPoint::Write) {
            let _ = self.file.append(&buf[..buf.len() / 2]);
            return Err(CommitError::Io("injected torn write".into()));
        }
        let path = wal_file_path(&self.dir, self.file_first);
        if fault(&self.cfg, FaultPoint::WriteNoSpace) {
            let _ = self.file.append(&buf[..buf.len() / 2]);
            let e = std::io::Error::from(std::io::ErrorKind::StorageFull);
            return Err(write_error(&path, e));
        }
        self.file.append(buf).map_err(|e| write_error(&path, e))?;
        self.file_len += buf.len() as u64;
        assert_eq!(
            self.file.len(),
            self.file_len,
            "the active file ends where we wrote"
        );
        self.stats
            .bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        buf.clear();
        Ok(())
    }

    /// Seals the active file (fsync) and starts the next one at the current logical end: the
    /// new file's header is fsynced, then the directory, before any frame goes into it. The
    /// committer may still fsync the old file for groups written before the roll; that
    /// second fsync finds nothing left to flush.
    fn roll(&mut self) -> Result<(), CommitError> {
        let io = |e: std::io::Error| CommitError::Io(e.to_string());
        self.file.sync().map_err(io)?;
        self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        let first = self.logical_end();
        assert!(
            first > self.file_first,
            "a roll starts a file past the previous one"
        );
        let path = wal_file_path(&self.dir, first);
        // Recorded first: a failed creation may still leave the file behind.
        self.created.push((path.clone(), None));
        let file = match self.env.storage.create(&path) {
            Ok(f) => f,
            Err(e) if self.fd_transient(&e) => {
                // EMFILE/ENFILE: open(2) gave up before it created anything.
                self.created.pop();
                return Err(fd_error(&path, &e));
            }
            Err(e) => return Err(write_error(&path, e)),
        };
        file.append(&wal_file_header())
            .map_err(|e| write_error(&path, e))?;
        file.sync().map_err(io)?;
        self.created.last_mut().expect("recorded above").1 = Some(file.clone());
        if !self.skip_roll_dir_sync() {
            match self.env.storage.sync_dir(&self.dir) {
                Err(e) if self.fd_transient(&e) => {
                    // The file is whole but its entry may not be durable: nothing goes into
                    // it, or into any file, before the directory fsync succeeded.
                    self.dir_sync_owed = true;
                    return Err(fd_error(&self.dir, &e));
                }
                r => r.map_err(io)?,
            }
        }
        self.file = file;
        self.file_first = first;
        self.file_len = WAL_HEADER_LEN as u64;
        Ok(())
    }

    #[cfg(feature = "fault-injection")]
    fn skip_roll_dir_sync(&self) -> bool {
        self.env.tuning.mutated(super::Mutation::SkipRollDirSync)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn skip_roll_dir_sync(&self) -> bool {
        false
    }
}

/// Adds a gap to the group, moving the lane's mark over it when it extends the prefix.
fn add_gap(gr: GapRequest, group: &mut Group) {
    if let Some(m) = gr.new_mark {
        group.mark((gr.gap.device, gr.gap.epoch, gr.gap.stream), m);
    }
    group.g.gaps.push(gr.gap);
    group.dones.push(Done::Gap(gr.done));
}
