//! The writer thread: batches requests into groups, writes and rolls files, and undoes a group
//! that failed for a full disk.

#[allow(unused_imports)]
use super::*;

/// A batch stops collecting once it holds this many bytes.
pub(super) const BATCH_BYTES_MAX: usize = 64 << 20;
/// A batch stops collecting once it holds this many requests.
pub(super) const BATCH_REQUESTS_MAX: usize = 8192;
/// How often the writer wakes without requests: to carry out a rewind the committer asked for
/// and, while the disk is full, to probe for free space.
pub(super) const WRITER_TICK: Duration = Duration::from_millis(100);

/// Writes groups into the log, in order, and hands them to the [`Committer`].
///
/// The write of group N+1 overlaps with the fsync and the catalog commit of group N. Nothing
/// is acknowledged here: a group's callers complete only after the committer's fsync that
/// covers it and its catalog transaction, so the acknowledgement rule is unchanged.
pub(super) struct Writer {
    pub(super) dir: PathBuf,
    /// Shared with the committer, which fsyncs through it.
    pub(super) file: Arc<File>,
    pub(super) file_first: u64,
    pub(super) file_len: u64,
    pub(super) next_offset: HashMap<StreamId, u64>,
    pub(super) cfg: WriterConfig,
    pub(super) stats: Arc<WalStats>,
    pub(super) last_ingest_ts: i64,
    pub(super) written: mpsc::SyncSender<Piped>,
    /// Blocks of the group being written, for [`WriterConfig::on_commit`].
    pub(super) routed: Vec<crate::streams::CommittedBlock>,
    /// Read for the committed stream offsets when the log is cut back to the committed end.
    pub(super) catalog: Arc<Catalog>,
    pub(super) shared: Arc<Shared>,
    /// WAL files the group being written rolled into (removed if it fails for a full disk).
    pub(super) created: Vec<PathBuf>,
    /// The next offset of each stream before the group being written assigned any.
    pub(super) group_offsets: HashMap<StreamId, u64>,
    /// A stop request was drained while failing queued requests.
    pub(super) stop_seen: bool,
}

/// Where the group being written started, to cut it off again.
pub(super) struct GroupStart {
    pub(super) file: Arc<File>,
    pub(super) file_first: u64,
    pub(super) file_len: u64,
}

impl Writer {
    pub(super) fn run(mut self, rx: mpsc::Receiver<Request>) {
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
    pub(super) fn tick(&mut self, rx: &mpsc::Receiver<Request>) {
        if self.shared.rewind.load(Ordering::Acquire) {
            self.rewind_to_committed(Vec::new(), rx);
        }
        self.probe();
    }

    /// Ends the disk-full state once the backoff has passed and the file system shows space.
    /// The next groups are the real test: if they fail again, the wait doubles.
    pub(super) fn probe(&mut self) {
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
    pub(super) fn collect(&self, first: Request, rx: &mpsc::Receiver<Request>) -> (Vec<Request>, bool) {
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
    pub(super) fn write(&mut self, batch: Vec<Request>, rx: &mpsc::Receiver<Request>) {
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
    pub(super) fn undo_group(
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
    pub(super) fn cut_group(&mut self, start: GroupStart) -> std::io::Result<()> {
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
    pub(super) fn fail_and_drain(&mut self, reqs: Vec<Request>, e: CommitError, rx: &mpsc::Receiver<Request>) {
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
    pub(super) fn rewind_to_committed(&mut self, batch: Vec<Request>, rx: &mpsc::Receiver<Request>) {
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

    pub(super) fn rewind_files(&mut self) -> Result<(), String> {
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
    pub(super) fn ingest_ts(&mut self) -> i64 {
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
    pub(super) fn write_batch(
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

    pub(super) fn logical_end(&self) -> u64 {
        self.file_first + self.file_len - WAL_HEADER_LEN as u64
    }

    /// Appends `buf` to the active file (no fsync).
    pub(super) fn flush(&mut self, buf: &mut Vec<u8>) -> Result<(), CommitError> {
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
    pub(super) fn roll(&mut self) -> Result<(), CommitError> {
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