//! The writer thread: the only owner of segment files.
//!
//! Each loop iteration drains the queue (up to `queue_batches_max` messages), stages batches
//! into per-stream pending blocks (assigning seqs), seals blocks, writes every stream's sealed
//! frames with one `append` per segment, then fsyncs according to the policy and only then
//! answers the producers whose batches that fsync covered. See the module docs of `log` for the
//! whole picture.
//!
//! The first append to a segment after an fsync is preceded by a sync mark
//! (`sync::segment::encode_sync_mark`) holding the length that fsync made durable, which is what
//! lets recovery tell a hole in an unsynced group from corruption of durable data.

use super::index::{BlockRef, Gap, GapReason, SegIndex, Shared};
use super::markers::{self, EPOCHS_FILE, GAPS_FILE, MarkerFile};
use super::recovery::{self, StreamInit, gap_row, segment_name};
use super::{AppendAck, AppendError, FsyncPolicy, LogConfig, MintError, Msg, OnFull};
use crate::catalog::{Catalog, SegmentRow};
use crate::storage::{Storage, WriteFile};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};
use sync::Record;
use sync::block::{
    DecodeLimits, EncodeOptions, FLAG_BATCH_CONTINUED, FLAG_BATCH_CONTINUES, decode_block,
    decode_header, encode_block_with,
};
use sync::segment::{
    FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, SYNC_MARK_FRAME_LEN, encode_sync_mark, frame_header,
    segment_header,
};
use tokio::sync::oneshot;

mod refused;

/// How long a producer refused under `on_full = block` is told to wait.
const FULL_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Per-batch overhead assumed by the budget pre-check (frame + block header).
const BLOCK_OVERHEAD_BYTES: u64 = (FRAME_HEADER_LEN + sync::block::HEADER_LEN) as u64;

type Reply = oneshot::Sender<Result<AppendAck, AppendError>>;

struct Waiter {
    reply: Reply,
    ack: AppendAck,
}

/// A sealed block waiting in the stream's write buffer.
#[derive(Clone, Copy)]
struct Sealed {
    len: u32,
    first_seq: u64,
    count: u32,
    min_ts: i64,
    flags: u8,
}

struct Active {
    file: Box<dyn WriteFile>,
    path: PathBuf,
    first_seq: u64,
    dirty: bool,
    /// The file length the last fsync made durable.
    synced_len: u64,
    /// The `synced_len` the last sync mark in this file carries.
    marked_len: u64,
}

struct WStream {
    name: String,
    dir: PathBuf,
    next_seq: u64,
    active: Option<Active>,
    /// The recovered tail segment, reopened on the first write.
    tail: Option<(PathBuf, u64)>,
    pending: Vec<Record>,
    pending_bytes: usize,
    pending_first: u64,
    pending_since: Option<Instant>,
    /// Flags for the pending block: `FLAG_BATCH_CONTINUED` when it starts with the tail of a
    /// split batch.
    pending_flags: u8,
    sealed_buf: Vec<u8>,
    sealed: Vec<Sealed>,
    /// The last seq written whose block completes a producer batch.
    written_complete: u64,
    gaps: Option<MarkerFile>,
}

pub(crate) struct Writer {
    cfg: LogConfig,
    shared: Arc<Shared>,
    storage: Arc<dyn Storage>,
    catalog: Catalog,
    epoch: u64,
    streams: Vec<WStream>,
    waiters: Vec<Waiter>,
    last_fsync: Instant,
    unsynced: bool,
    disk_bytes: u64,
    budget_warned: bool,
}

/// What a drain pass ended on.
enum Control {
    Mint {
        epoch_min: u64,
        rekey: Vec<(usize, u64, u64)>,
        reply: mpsc::Sender<Result<u64, MintError>>,
    },
    Shutdown(mpsc::Sender<()>),
    Disconnected,
}

impl Writer {
    pub(crate) fn new(
        cfg: LogConfig,
        shared: Arc<Shared>,
        catalog: Catalog,
        inits: Vec<StreamInit>,
    ) -> Writer {
        let (epoch, disk_bytes) = {
            let s = shared.lock();
            (*s.epochs.last().expect("an epoch"), s.disk_bytes)
        };
        let streams = cfg
            .streams
            .iter()
            .zip(inits)
            .map(|(name, init)| WStream {
                name: name.clone(),
                dir: init.dir,
                next_seq: init.next_seq,
                active: None,
                tail: init.tail,
                pending: Vec::new(),
                pending_bytes: 0,
                pending_first: init.next_seq,
                pending_since: None,
                pending_flags: 0,
                sealed_buf: Vec::new(),
                sealed: Vec::new(),
                written_complete: init.next_seq - 1,
                gaps: None,
            })
            .collect();
        let storage = shared.storage.clone();
        // An fsync long ago: the first append under `Interval` is synced at once.
        let last_fsync = Instant::now()
            .checked_sub(Duration::from_secs(3600))
            .unwrap_or_else(Instant::now);
        Writer {
            cfg,
            shared,
            storage,
            catalog,
            epoch,
            streams,
            waiters: Vec::new(),
            last_fsync,
            unsynced: false,
            disk_bytes,
            budget_warned: false,
        }
    }

    /// The thread body.
    pub(crate) fn run(mut self, rx: Receiver<Msg>) {
        loop {
            let control = self.drain(&rx);
            self.shared.queue_space.notify_waiters();
            // Acks first: an append queued after `set_acked` is answered after retention ran.
            self.apply_acks();
            self.tick(control.is_some());
            match control {
                None => {}
                Some(Control::Mint {
                    epoch_min,
                    rekey,
                    reply,
                }) => {
                    let _ = reply.send(self.mint(epoch_min, &rekey));
                }
                Some(Control::Shutdown(reply)) => {
                    self.close();
                    let _ = reply.send(());
                    return;
                }
                Some(Control::Disconnected) => {
                    self.close();
                    return;
                }
            }
        }
    }

    /// Waits for the first message (or the next deadline), then takes everything queued. Stops
    /// early at a control message so that appends queued after it see its effect.
    fn drain(&mut self, rx: &Receiver<Msg>) -> Option<Control> {
        let first = match self.next_deadline() {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => rx.recv_timeout(d),
        };
        let mut msg = match first {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => return None,
            Err(RecvTimeoutError::Disconnected) => return Some(Control::Disconnected),
        };
        for _ in 0..self.cfg.queue_batches_max {
            match msg {
                Msg::Append {
                    stream,
                    records,
                    reply,
                } => self.on_append(stream, records, reply),
                Msg::Wake => {}
                Msg::Quarantine {
                    stream,
                    epoch,
                    first_seq,
                    last_seq,
                    why,
                    reply,
                } => {
                    let _ = reply
                        .send(self.quarantine_refused(stream, epoch, first_seq, last_seq, &why));
                }
                Msg::Mint {
                    epoch_min,
                    rekey,
                    reply,
                } => {
                    return Some(Control::Mint {
                        epoch_min,
                        rekey,
                        reply,
                    });
                }
                Msg::Shutdown(r) => return Some(Control::Shutdown(r)),
            }
            msg = match rx.try_recv() {
                Ok(m) => m,
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Disconnected) => return Some(Control::Disconnected),
            };
        }
        // The pass is full; handle the message already taken and leave the rest for the next.
        match msg {
            Msg::Append {
                stream,
                records,
                reply,
            } => self.on_append(stream, records, reply),
            Msg::Wake => {}
            Msg::Quarantine {
                stream,
                epoch,
                first_seq,
                last_seq,
                why,
                reply,
            } => {
                let _ =
                    reply.send(self.quarantine_refused(stream, epoch, first_seq, last_seq, &why));
            }
            Msg::Mint {
                epoch_min,
                rekey,
                reply,
            } => {
                return Some(Control::Mint {
                    epoch_min,
                    rekey,
                    reply,
                });
            }
            Msg::Shutdown(r) => return Some(Control::Shutdown(r)),
        }
        None
    }

    fn next_deadline(&self) -> Option<Duration> {
        let FsyncPolicy::Interval(every) = self.cfg.fsync else {
            return None;
        };
        let mut at: Option<Instant> = None;
        for st in &self.streams {
            if let Some(t) = st.pending_since {
                at = Some(at.map_or(t + self.cfg.block_linger, |a| {
                    a.min(t + self.cfg.block_linger)
                }));
            }
        }
        if self.unsynced || !self.waiters.is_empty() {
            let t = self.last_fsync + every;
            at = Some(at.map_or(t, |a| a.min(t)));
        }
        at.map(|t| t.saturating_duration_since(Instant::now()))
    }

    fn on_append(&mut self, stream: usize, records: Vec<Record>, reply: Reply) {
        if let Some(why) = self.shared.poisoned() {
            let _ = reply.send(Err(AppendError::Poisoned(why)));
            return;
        }
        if self.cfg.on_full == OnFull::Block && self.would_exceed(&records) {
            // Acks that arrived in this same pass may free space: apply them before refusing.
            self.apply_acks();
            if self.would_exceed(&records) {
                let _ = reply.send(Err(AppendError::Full {
                    retry_after: FULL_RETRY_AFTER,
                }));
                return;
            }
        }
        let ack = match self.stage(stream, records) {
            Ok(ack) => ack,
            Err(why) => {
                self.poison(why.clone());
                let _ = reply.send(Err(AppendError::Storage(why)));
                return;
            }
        };
        self.waiters.push(Waiter { reply, ack });
    }

    /// The `block` policy's pre-check: would this batch, with everything not yet written, push
    /// the segment bytes over the budget? Uses uncompressed sizes, so it errs on the safe side.
    fn would_exceed(&self, records: &[Record]) -> bool {
        let unwritten: u64 = self
            .streams
            .iter()
            .map(|s| (s.pending_bytes + s.sealed_buf.len()) as u64)
            .sum();
        let batch: u64 =
            records.iter().map(|r| r.approx_bytes() as u64).sum::<u64>() + BLOCK_OVERHEAD_BYTES;
        self.disk_bytes + unwritten + batch > self.cfg.disk_bytes_max
    }

    /// Assigns seqs and stages one batch. A batch that fits the block limits is never split; one
    /// that does not is cut into full blocks flagged `FLAG_BATCH_CONTINUES` and a pending tail.
    fn stage(&mut self, i: usize, records: Vec<Record>) -> Result<AppendAck, String> {
        let (rec_max, bytes_max) = (self.cfg.block_records_max, self.cfg.block_bytes_max);
        let bytes: usize = records.iter().map(Record::approx_bytes).sum();
        let n = records.len() as u64;
        let st = &mut self.streams[i];
        let first = st.next_seq;
        let last = first.checked_add(n - 1).ok_or("seq space exhausted")?;
        st.next_seq = last + 1;
        let ack = AppendAck {
            stream: st.name.clone(),
            epoch: self.epoch,
            first_seq: first,
            last_seq: last,
        };
        let fits = records.len() <= rec_max && bytes <= bytes_max;
        let overflow =
            st.pending.len() + records.len() > rec_max || st.pending_bytes + bytes > bytes_max;
        if !st.pending.is_empty() && (!fits || overflow) {
            self.seal_pending(i)?;
        }
        if fits {
            self.push_pending(i, first, records, bytes);
            return Ok(ack);
        }
        let chunks = split_batch(&records, rec_max, bytes_max);
        let mut at = 0usize;
        for (k, len) in chunks.iter().enumerate() {
            let seq = first + at as u64;
            let continued = if k > 0 { FLAG_BATCH_CONTINUED } else { 0 };
            if k + 1 < chunks.len() {
                let flags = FLAG_BATCH_CONTINUES | continued;
                self.seal(i, &records[at..at + len], seq, flags)?;
            } else {
                let tail: Vec<Record> = records[at..].to_vec();
                let tail_bytes = tail.iter().map(Record::approx_bytes).sum();
                self.push_pending(i, seq, tail, tail_bytes);
                // Pending was sealed before the split, so this block starts with the tail.
                self.streams[i].pending_flags = continued;
            }
            at += len;
        }
        Ok(ack)
    }

    fn push_pending(&mut self, i: usize, first: u64, records: Vec<Record>, bytes: usize) {
        let st = &mut self.streams[i];
        if st.pending.is_empty() {
            st.pending_first = first;
            st.pending_since = Some(Instant::now());
            if st.pending.capacity() == 0 {
                st.pending = records;
                st.pending_bytes = bytes;
                return;
            }
        }
        assert_eq!(
            st.pending_first + st.pending.len() as u64,
            first,
            "seqs must be contiguous"
        );
        st.pending.extend(records);
        st.pending_bytes += bytes;
    }

    fn seal_pending(&mut self, i: usize) -> Result<(), String> {
        let st = &mut self.streams[i];
        if st.pending.is_empty() {
            return Ok(());
        }
        let records = std::mem::take(&mut st.pending);
        let first = st.pending_first;
        let flags = std::mem::take(&mut st.pending_flags);
        let res = self.seal(i, &records, first, flags);
        let st = &mut self.streams[i];
        st.pending = records;
        st.pending.clear();
        st.pending_bytes = 0;
        st.pending_since = None;
        res
    }

    /// Encodes `records` as one block, or as several when they exceed what a columnar block
    /// holds (`sync::columnar::cut`), and frames them into the stream's write buffer. The
    /// blocks of a cut carry `FLAG_BATCH_CONTINUES` between them, so they stay one batch.
    fn seal(
        &mut self,
        i: usize,
        records: &[Record],
        first_seq: u64,
        flags: u8,
    ) -> Result<(), String> {
        let runs = cut_for(self.cfg.block_version, records);
        if runs.len() > 1 {
            tracing::debug!(stream = %self.streams[i].name, blocks = runs.len(), "block cut at the columnar limits");
        }
        let (mut at, last) = (0usize, runs.len() - 1);
        for (k, len) in runs.into_iter().enumerate() {
            let head = if k == 0 {
                flags & FLAG_BATCH_CONTINUED
            } else {
                FLAG_BATCH_CONTINUED
            };
            let tail = if k == last {
                flags & FLAG_BATCH_CONTINUES
            } else {
                FLAG_BATCH_CONTINUES
            };
            let other = flags & !(FLAG_BATCH_CONTINUED | FLAG_BATCH_CONTINUES);
            let seq = first_seq + at as u64;
            self.seal_one(i, &records[at..at + len], seq, head | tail | other)?;
            at += len;
        }
        Ok(())
    }

    /// Encodes one block and frames it into the stream's write buffer.
    fn seal_one(
        &mut self,
        i: usize,
        records: &[Record],
        first_seq: u64,
        flags: u8,
    ) -> Result<(), String> {
        let opts = EncodeOptions {
            version: self.cfg.block_version,
            flags,
            zstd_level: self.cfg.zstd_level,
        };
        let block = encode_block_with(&opts, self.epoch, first_seq, records)
            .map_err(|e| format!("sealing a block failed: {e}"))?;
        // Check what we are about to write, as the reader will check it after reading.
        let h = decode_header(&block).map_err(|e| format!("sealed block does not verify: {e}"))?;
        assert!(
            h.first_seq == first_seq && h.count as usize == records.len(),
            "sealed header disagrees"
        );
        let st = &mut self.streams[i];
        st.sealed_buf.extend_from_slice(&frame_header(&block));
        st.sealed_buf.extend_from_slice(&block);
        st.sealed.push(Sealed {
            len: block.len() as u32,
            first_seq,
            count: h.count,
            min_ts: h.min_ts,
            flags,
        });
        Ok(())
    }

    /// Seals what is due, writes it, fsyncs per policy and answers producers.
    fn tick(&mut self, force: bool) {
        if self.shared.poisoned().is_some() {
            self.fail_waiters();
            return;
        }
        let now = Instant::now();
        let fsync_due = match self.cfg.fsync {
            FsyncPolicy::Always => true,
            FsyncPolicy::Never => false,
            FsyncPolicy::Interval(d) => force || now.duration_since(self.last_fsync) >= d,
        };
        let interval = matches!(self.cfg.fsync, FsyncPolicy::Interval(_));
        let will_sync = fsync_due && (self.unsynced || !self.waiters.is_empty());
        for i in 0..self.streams.len() {
            let aged = self.streams[i]
                .pending_since
                .is_some_and(|t| now.duration_since(t) >= self.cfg.block_linger);
            if (!interval || force || will_sync || aged)
                && let Err(why) = self.seal_pending(i)
            {
                return self.poison(why);
            }
        }
        for i in 0..self.streams.len() {
            if let Err(e) = self.write_stream(i) {
                return self.poison(format!(
                    "writing stream {:?} failed: {e}",
                    self.streams[i].name
                ));
            }
        }
        self.publish_next_seqs();
        match self.cfg.fsync {
            FsyncPolicy::Never => self.complete(),
            _ if will_sync || (force && self.unsynced) => {
                if let Err(e) = self.fsync_all() {
                    return self.poison(format!("fsync failed: {e}"));
                }
                self.complete();
            }
            _ => {}
        }
    }

    fn publish_next_seqs(&self) {
        let mut s = self.shared.lock();
        for st in &self.streams {
            if let Some(idx) = s.streams.get_mut(&st.name) {
                idx.next_seq = st.next_seq;
            }
        }
    }

    /// Writes the stream's sealed frames: one append per segment, rolling when full.
    fn write_stream(&mut self, i: usize) -> io::Result<()> {
        if self.streams[i].sealed.is_empty() {
            return Ok(());
        }
        let buf = std::mem::take(&mut self.streams[i].sealed_buf);
        let sealed = std::mem::take(&mut self.streams[i].sealed);
        let res = self.write_sealed(i, &buf, &sealed);
        let st = &mut self.streams[i];
        st.sealed_buf = buf;
        st.sealed_buf.clear();
        st.sealed = sealed;
        st.sealed.clear();
        res
    }

    fn write_sealed(&mut self, i: usize, buf: &[u8], sealed: &[Sealed]) -> io::Result<()> {
        let seg_max = self.cfg.segment_bytes_max;
        let (mut k, mut pos) = (0usize, 0usize);
        while k < sealed.len() {
            let frame = FRAME_HEADER_LEN as u64 + u64::from(sealed[k].len);
            if self.streams[i].active.is_none() {
                self.open_active(i, sealed[k].first_seq)?;
            }
            let len = self.streams[i].active.as_ref().expect("active").file.len();
            if len > SEGMENT_HEADER_LEN as u64 && len + frame > seg_max {
                self.roll(i, sealed[k].first_seq)?;
            }
            self.write_mark(i)?;
            let start_len = self.streams[i].active.as_ref().expect("active").file.len();
            let (start_k, mut run) = (k, 0u64);
            while k < sealed.len() {
                let f = FRAME_HEADER_LEN as u64 + u64::from(sealed[k].len);
                if k > start_k && start_len + run + f > seg_max {
                    break;
                }
                run += f;
                k += 1;
            }
            if self.cfg.on_full == OnFull::DropOldest {
                self.ensure_room(run)?;
            }
            let active = self.streams[i].active.as_mut().expect("active");
            active.file.append(&buf[pos..pos + run as usize])?;
            active.dirty = true;
            self.unsynced = true;
            pos += run as usize;
            self.disk_bytes += run;
            self.index_blocks(i, start_len, &sealed[start_k..k]);
        }
        Ok(())
    }

    /// Appends a sync mark when an fsync made more of the active file durable than the last mark
    /// says. Frames written after it then carry the proof that the bytes before `synced_len`
    /// were durable before they were written.
    fn write_mark(&mut self, i: usize) -> io::Result<()> {
        let a = self.streams[i].active.as_ref().expect("active");
        if a.synced_len <= a.marked_len {
            return Ok(());
        }
        let mark = encode_sync_mark(a.synced_len);
        if self.cfg.on_full == OnFull::DropOldest {
            self.ensure_room(SYNC_MARK_FRAME_LEN as u64)?;
        }
        let a = self.streams[i].active.as_mut().expect("active");
        a.file.append(&mark)?;
        a.marked_len = a.synced_len;
        a.dirty = true;
        self.unsynced = true;
        self.disk_bytes += SYNC_MARK_FRAME_LEN as u64;
        Ok(())
    }

    /// Adds written (not yet durable) blocks to the shared index.
    fn index_blocks(&mut self, i: usize, mut offset: u64, blocks: &[Sealed]) {
        let st = &mut self.streams[i];
        let path = &st.active.as_ref().expect("active").path;
        let mut s = self.shared.lock();
        s.disk_bytes = self.disk_bytes;
        let idx = s.streams.get_mut(&st.name).expect("configured stream");
        let seg = idx
            .segments
            .iter_mut()
            .rfind(|g| g.path == *path)
            .expect("active segment is indexed");
        for b in blocks {
            let r = BlockRef {
                offset,
                len: b.len,
                first_seq: b.first_seq,
                count: b.count,
                min_ts: b.min_ts,
                flags: b.flags,
            };
            if let Some(prev) = seg.blocks.last() {
                assert_eq!(
                    prev.last_seq() + 1,
                    r.first_seq,
                    "seqs within a segment are contiguous"
                );
            }
            offset += r.frame_bytes();
            seg.bytes = offset;
            if b.flags & FLAG_BATCH_CONTINUES == 0 {
                st.written_complete = r.last_seq();
            }
            seg.blocks.push(r);
        }
    }

    /// Makes the stream's active segment: the recovered tail if it is of this epoch, else new.
    fn open_active(&mut self, i: usize, first_seq: u64) -> io::Result<()> {
        let st = &mut self.streams[i];
        if let Some((path, seg_first)) = st.tail.take() {
            let file = self.storage.open_append(&path)?;
            // Recovery fsynced the tail it hands over, so all of it is durable; the first
            // append writes a mark that says so.
            let synced_len = file.len();
            st.active = Some(Active {
                file,
                path,
                first_seq: seg_first,
                dirty: false,
                synced_len,
                marked_len: 0,
            });
            return Ok(());
        }
        self.create_segment(i, first_seq)
    }

    /// Creates a segment durably: header, fsync, directory fsync.
    fn create_segment(&mut self, i: usize, first_seq: u64) -> io::Result<()> {
        let st = &mut self.streams[i];
        let path = st.dir.join(segment_name(self.epoch, first_seq));
        let mut file = self.storage.create(&path)?;
        file.append(&segment_header())?;
        file.sync()?;
        self.storage.sync_dir(&st.dir)?;
        let header = SEGMENT_HEADER_LEN as u64;
        self.disk_bytes += header;
        {
            let mut s = self.shared.lock();
            s.disk_bytes = self.disk_bytes;
            let epoch = self.epoch;
            let idx = s.streams.get_mut(&st.name).expect("configured stream");
            // Epochs are minted in order, so appending keeps segments in (epoch, seq) order.
            idx.segments.push(SegIndex {
                epoch,
                first_seq,
                path: path.clone(),
                bytes: header,
                blocks: Vec::new(),
            });
        }
        let row = SegmentRow {
            stream: st.name.clone(),
            epoch: self.epoch,
            first_seq,
            last_seq: 0,
            bytes: header,
        };
        if let Err(e) = self.catalog.upsert_segment(&row) {
            tracing::warn!(error = %e, "catalog: recording a new segment failed (it is rebuilt at open)");
        }
        // The durable header proves nothing about frames, so no mark is needed for it.
        st.active = Some(Active {
            file,
            path,
            first_seq,
            dirty: false,
            synced_len: header,
            marked_len: header,
        });
        Ok(())
    }

    /// Seals the active segment (fsync) and starts the next one.
    fn roll(&mut self, i: usize, first_seq: u64) -> io::Result<()> {
        if let Some(mut old) = self.streams[i].active.take() {
            old.file.sync().map_err(|e| {
                let what = format!("fsync of {} before rolling: {e}", old.path.display());
                io::Error::new(e.kind(), what)
            })?;
            let (last, bytes) = self.segment_stats(i, &old.path);
            let row = SegmentRow {
                stream: self.streams[i].name.clone(),
                epoch: self.epoch,
                first_seq: old.first_seq,
                last_seq: last,
                bytes,
            };
            if let Err(e) = self.catalog.upsert_segment(&row) {
                tracing::warn!(error = %e, "catalog: recording a sealed segment failed (it is rebuilt at open)");
            }
        }
        self.create_segment(i, first_seq)
    }

    fn segment_stats(&self, i: usize, path: &PathBuf) -> (u64, u64) {
        let s = self.shared.lock();
        s.streams
            .get(&self.streams[i].name)
            .and_then(|idx| idx.segments.iter().find(|g| g.path == *path))
            .map_or((0, 0), |g| (g.last_seq().unwrap_or(0), g.bytes))
    }

    /// Under `drop-oldest`, drops the oldest droppable segments until `need` more bytes fit.
    fn ensure_room(&mut self, need: u64) -> io::Result<()> {
        while self.disk_bytes + need > self.cfg.disk_bytes_max {
            let Some((j, seg)) = self.oldest_droppable() else {
                if !self.budget_warned {
                    tracing::warn!(
                        disk_bytes = self.disk_bytes,
                        budget = self.cfg.disk_bytes_max,
                        "disk budget exceeded but nothing can be dropped yet (only active or not yet durable segments)"
                    );
                    self.budget_warned = true;
                }
                return Ok(());
            };
            self.drop_segment(j, &seg)?;
        }
        self.budget_warned = false;
        Ok(())
    }

    /// The segment to drop: each stream's oldest (in write order: epoch, then seq), and among
    /// streams the one with the oldest event time. Only the oldest segment of a stream is ever a
    /// candidate, so a stream loses a prefix, never a middle; and it must be neither active nor
    /// holding blocks that are not durable yet (their producers still wait for an answer).
    fn oldest_droppable(&self) -> Option<(usize, SegIndex)> {
        let s = self.shared.lock();
        let mut best: Option<(i64, usize, &SegIndex)> = None;
        for (j, st) in self.streams.iter().enumerate() {
            let active = st.active.as_ref().map(|a| &a.path);
            let Some(seg) = s
                .streams
                .get(&st.name)
                .and_then(|idx| idx.segments.first().map(|g| (idx, g)))
            else {
                continue;
            };
            let (idx, seg) = seg;
            let durable = idx.durable.get(&seg.epoch).copied().unwrap_or(0);
            if Some(&seg.path) == active || seg.last_seq().is_some_and(|l| l > durable) {
                continue;
            }
            let ts = seg.blocks.first().map_or(i64::MIN, |b| b.min_ts);
            if best.as_ref().is_none_or(|(t, _, _)| ts < *t) {
                best = Some((ts, j, seg));
            }
        }
        best.map(|(_, j, seg)| (j, seg.clone()))
    }

    /// Drops one segment: its exact seq ranges become `Dropped` gap markers, fsynced first.
    fn drop_segment(&mut self, j: usize, seg: &SegIndex) -> io::Result<()> {
        let gaps = contiguous_runs(seg);
        if !gaps.is_empty() {
            self.append_gaps(j, &gaps)?;
        }
        self.storage.remove(&seg.path)?;
        self.storage.sync_dir(&self.streams[j].dir)?;
        let records: u64 = seg.blocks.iter().map(|b| u64::from(b.count)).sum();
        self.disk_bytes -= seg.bytes;
        {
            let mut s = self.shared.lock();
            s.disk_bytes = self.disk_bytes;
            let idx = s
                .streams
                .get_mut(&self.streams[j].name)
                .expect("configured stream");
            idx.segments.retain(|g| g.path != seg.path);
            idx.gaps.extend(gaps.iter().copied());
            idx.dropped_records += records;
            idx.dropped_blocks += seg.blocks.len() as u64;
        }
        let name = self.streams[j].name.clone();
        for g in &gaps {
            if let Err(e) = self.catalog.add_gap(&gap_row(&name, g)) {
                tracing::warn!(error = %e, "catalog: recording a gap marker failed (gaps.log has it)");
            }
        }
        if let Err(e) = self.catalog.remove_segment(&name, seg.epoch, seg.first_seq) {
            tracing::warn!(error = %e, "catalog: forgetting a dropped segment failed");
        }
        tracing::warn!(stream = %name, file = %seg.path.display(), records, "disk budget: dropped the oldest segment");
        Ok(())
    }

    fn append_gaps(&mut self, j: usize, gaps: &[Gap]) -> io::Result<()> {
        let entries: Vec<Vec<u8>> = gaps.iter().map(markers::encode_gap).collect();
        self.append_markers(j, &entries)
    }

    /// Appends entries to the stream's `gaps.log` and fsyncs them.
    fn append_markers(&mut self, j: usize, entries: &[Vec<u8>]) -> io::Result<()> {
        let st = &mut self.streams[j];
        if st.gaps.is_none() {
            st.gaps = Some(MarkerFile::open(
                self.storage.as_ref(),
                &st.dir.join(GAPS_FILE),
            )?);
        }
        st.gaps.as_mut().expect("opened").append(entries)
    }

    fn fsync_all(&mut self) -> io::Result<()> {
        for st in &mut self.streams {
            if let Some(a) = st.active.as_mut().filter(|a| a.dirty) {
                a.file.sync()?;
                a.dirty = false;
                a.synced_len = a.file.len();
            }
        }
        self.unsynced = false;
        self.last_fsync = Instant::now();
        Ok(())
    }

    /// Publishes durable marks and answers every waiting producer.
    fn complete(&mut self) {
        let mut advanced = false;
        {
            let mut s = self.shared.lock();
            for st in &self.streams {
                let idx = s.streams.get_mut(&st.name).expect("configured stream");
                let d = idx.durable.entry(self.epoch).or_insert(0);
                if st.written_complete > *d {
                    *d = st.written_complete;
                    advanced = true;
                }
            }
        }
        if advanced {
            self.shared.durable_tx.send_modify(|c| *c += 1);
        }
        for w in self.waiters.drain(..) {
            let _ = w.reply.send(Ok(w.ack));
        }
    }

    fn fail_waiters(&mut self) {
        let why = self.shared.poisoned().unwrap_or_default();
        for w in self.waiters.drain(..) {
            let _ = w.reply.send(Err(AppendError::Storage(why.clone())));
        }
    }

    /// After a storage error: refuse everything until reopened. Staged data was never
    /// acknowledged and is discarded.
    fn poison(&mut self, why: String) {
        self.shared.poison(why);
        self.fail_waiters();
        for st in &mut self.streams {
            st.pending.clear();
            st.pending_bytes = 0;
            st.pending_since = None;
            st.pending_flags = 0;
            st.sealed.clear();
            st.sealed_buf.clear();
        }
    }

    /// Persists changed acknowledgements and deletes segments the hub has tiered.
    fn apply_acks(&mut self) {
        let acks: Vec<(String, u64, u64, u64)> = {
            let mut s = self.shared.lock();
            if !s.acks_dirty {
                return;
            }
            s.acks_dirty = false;
            s.streams
                .iter()
                .flat_map(|(n, st)| st.acks.iter().map(|(e, (d, t))| (n.clone(), *e, *d, *t)))
                .collect()
        };
        if let Err(e) = self.catalog.set_acks(&acks) {
            tracing::warn!(error = %e, "catalog: storing acknowledgements failed");
        }
        if self.shared.poisoned().is_some() {
            return;
        }
        if let Err(e) = self.retention() {
            self.poison(format!("retention failed: {e}"));
        }
    }

    fn retention(&mut self) -> io::Result<()> {
        for j in 0..self.streams.len() {
            let doomed: Vec<SegIndex> = {
                let s = self.shared.lock();
                let active = self.streams[j].active.as_ref().map(|a| &a.path);
                let idx = &s.streams[&self.streams[j].name];
                // The newest segment (segments are ordered by epoch, then seq) always stays: it
                // holds the highest seq this stream ever assigned, which is what recovery
                // continues from. Without it a restart after everything was tiered would start
                // the current epoch at seq 1 again and reuse seqs.
                let newest = idx.segments.last().map(|g| &g.path);
                idx.segments
                    .iter()
                    .filter(|g| Some(&g.path) != active && Some(&g.path) != newest)
                    .filter(|g| {
                        // Freed once tiered, or once moved into a newer epoch (rekey).
                        let tiered = idx.acks.get(&g.epoch).map_or(0, |a| a.1);
                        let moved = idx.moved.get(&g.epoch).copied().unwrap_or(u64::MAX);
                        !g.blocks.is_empty()
                            && g.blocks
                                .iter()
                                .all(|b| b.last_seq() <= tiered || b.first_seq >= moved)
                    })
                    .cloned()
                    .collect()
            };
            if doomed.is_empty() {
                continue;
            }
            for g in &doomed {
                self.storage.remove(&g.path)?;
            }
            self.storage.sync_dir(&self.streams[j].dir)?;
            let freed: u64 = doomed.iter().map(|g| g.bytes).sum();
            self.disk_bytes -= freed;
            let name = self.streams[j].name.clone();
            {
                let mut s = self.shared.lock();
                s.disk_bytes = self.disk_bytes;
                let idx = s.streams.get_mut(&name).expect("configured stream");
                idx.segments
                    .retain(|g| !doomed.iter().any(|d| d.path == g.path));
            }
            for g in &doomed {
                if let Err(e) = self.catalog.remove_segment(&name, g.epoch, g.first_seq) {
                    tracing::warn!(error = %e, "catalog: forgetting a tiered segment failed");
                }
            }
            tracing::debug!(stream = %name, segments = doomed.len(), bytes = freed, "retention: deleted tiered segments");
        }
        Ok(())
    }

    /// Starts a new epoch and moves the `rekey` records into it. Everything staged was flushed
    /// by the forced tick before.
    fn mint(&mut self, epoch_min: u64, rekey: &[(usize, u64, u64)]) -> Result<u64, MintError> {
        let epoch = self.start_epoch(epoch_min)?;
        if rekey.is_empty() {
            return Ok(epoch);
        }
        for &(i, old, from_seq) in rekey {
            if let Err(why) = self.rekey(i, old, from_seq) {
                self.poison(why.clone());
                return Err(MintError::Rekey(why));
            }
        }
        self.tick(true);
        if self.unsynced && self.fsync_all().is_err() {
            self.poison("fsync after moving records into the new epoch failed".into());
        }
        if let Some(why) = self.shared.poisoned() {
            return Err(MintError::Rekey(why));
        }
        self.complete();
        // Only now that the copies are durable: a mark without its copy would hide records.
        // (A crash between the two leaves the old records announced; the hub asks again.)
        for &(i, old, from_seq) in rekey {
            if let Err(e) = self.append_markers(i, &[markers::encode_move(old, from_seq)]) {
                let why = format!("recording moved records failed: {e}");
                self.poison(why.clone());
                return Err(MintError::Rekey(why));
            }
        }
        {
            let mut s = self.shared.lock();
            for &(i, old, from_seq) in rekey {
                let idx = s
                    .streams
                    .get_mut(&self.streams[i].name)
                    .expect("configured stream");
                let m = idx.moved.entry(old).or_insert(from_seq);
                *m = (*m).min(from_seq);
            }
            s.acks_dirty = true;
        }
        self.apply_acks();
        Ok(epoch)
    }

    /// Copies the held records of `(stream i, old)` with `seq >= from_seq` into the current
    /// epoch as one batch: every block but the last carries `FLAG_BATCH_CONTINUES`, so a crash
    /// part-way leaves nothing of the copy after recovery.
    fn rekey(&mut self, i: usize, old: u64, from_seq: u64) -> Result<(), String> {
        let name = self.streams[i].name.clone();
        let limits = DecodeLimits::default();
        let (rec_max, bytes_max) = (self.cfg.block_records_max, self.cfg.block_bytes_max);
        let mut after = from_seq - 1;
        let mut held_back: Option<Vec<Record>> = None;
        let mut moved = 0u64;
        // Every block of the copy but its first continues the one before.
        let mut continued = 0u8;
        loop {
            let blocks = self
                .shared
                .read_blocks(&name, old, after, 4 << 20)
                .map_err(|e| e.to_string())?;
            if blocks.is_empty() {
                break;
            }
            for b in blocks {
                let block = decode_block(&b.bytes, &limits)
                    .map_err(|e| format!("reading {name} epoch {old:x}: {e}"))?;
                after = block.header.last_seq();
                let skip = from_seq.saturating_sub(block.header.first_seq) as usize;
                let records: Vec<Record> = block.records.into_iter().skip(skip).collect();
                let mut at = 0;
                for len in split_batch(&records, rec_max, bytes_max) {
                    let chunk = records[at..at + len].to_vec();
                    at += len;
                    moved += len as u64;
                    if let Some(prev) = held_back.replace(chunk) {
                        self.seal_next(i, &prev, FLAG_BATCH_CONTINUES | continued)?;
                        continued = FLAG_BATCH_CONTINUED;
                    }
                }
            }
            if self.streams[i].sealed_buf.len() > 8 << 20 {
                self.write_stream(i)
                    .map_err(|e| format!("writing moved records failed: {e}"))?;
            }
        }
        if let Some(last) = held_back {
            self.seal_next(i, &last, continued)?;
        }
        tracing::warn!(stream = %name, old_epoch = format_args!("{old:016x}"), from_seq, records = moved, "moved records into the new epoch");
        Ok(())
    }

    fn seal_next(&mut self, i: usize, records: &[Record], flags: u8) -> Result<(), String> {
        let first = self.streams[i].next_seq;
        self.streams[i].next_seq += records.len() as u64;
        self.seal(i, records, first, flags)
    }

    /// Persists a new epoch and switches every stream to it.
    fn start_epoch(&mut self, epoch_min: u64) -> Result<u64, MintError> {
        if let Some(why) = self.shared.poisoned() {
            return Err(MintError::Poisoned(why));
        }
        if self.unsynced
            && let Err(e) = self.fsync_all()
        {
            let why = format!("fsync before minting an epoch failed: {e}");
            self.poison(why.clone());
            return Err(MintError::Storage(why));
        }
        let epochs = self.shared.lock().epochs.clone();
        let epoch = recovery::mint(&epochs, epoch_min).ok_or(MintError::EpochSpace(epoch_min))?;
        let path = self.cfg.data_dir.join(EPOCHS_FILE);
        let res = MarkerFile::open(self.storage.as_ref(), &path)
            .and_then(|mut f| f.append(&[markers::encode_epoch(epoch)]));
        if let Err(e) = res {
            let why = format!("writing {} failed: {e}", path.display());
            self.poison(why.clone());
            return Err(MintError::Storage(why));
        }
        self.epoch = epoch;
        {
            let mut s = self.shared.lock();
            s.epochs.push(epoch);
            for idx in s.streams.values_mut() {
                idx.next_seq = 1;
                idx.durable.insert(epoch, 0);
            }
        }
        self.shared.set_epoch(epoch);
        for st in &mut self.streams {
            st.active = None;
            st.tail = None;
            st.next_seq = 1;
            st.pending_first = 1;
            st.pending_flags = 0;
            st.written_complete = 0;
        }
        let all = self.shared.lock().epochs.clone();
        if let Err(e) = self.catalog.replace_epochs(&all) {
            tracing::warn!(error = %e, "catalog: recording the new epoch failed (epochs.log has it)");
        }
        tracing::info!(epoch = format_args!("{epoch:016x}"), "minted a new epoch");
        Ok(epoch)
    }

    /// Final flush at shutdown.
    fn close(&mut self) {
        self.tick(true);
        // Even under `Never`, leave the files durable on a clean shutdown.
        if self.unsynced && self.shared.poisoned().is_none() && self.fsync_all().is_err() {
            tracing::error!("fsync at shutdown failed; recovery will verify at the next open");
        }
        self.apply_acks();
        for st in &mut self.streams {
            st.active = None;
        }
    }
}

/// The runs `records` are sealed in: one, except for a columnar block over the format's column
/// limit or a default reader's decoded-size limit (a row block has neither).
pub fn cut_for(version: u8, records: &[Record]) -> Vec<usize> {
    if version != sync::block::VERSION_COLUMNAR || !super::switches::block_cut() {
        return vec![records.len()];
    }
    sync::columnar::cut(records, &sync::columnar::CutLimits::default())
}

/// Splits a batch into block-sized chunks (lengths), each within the limits but never empty.
pub(crate) fn split_batch(records: &[Record], records_max: usize, bytes_max: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let (mut n, mut b) = (0usize, 0usize);
    for r in records {
        let rb = r.approx_bytes();
        if n > 0 && (n + 1 > records_max || b + rb > bytes_max) {
            out.push(n);
            n = 0;
            b = 0;
        }
        n += 1;
        b += rb;
    }
    if n > 0 {
        out.push(n);
    }
    out
}

/// A dropped segment's seq ranges, one gap per contiguous run of blocks.
fn contiguous_runs(seg: &SegIndex) -> Vec<Gap> {
    let mut out: Vec<Gap> = Vec::new();
    for b in &seg.blocks {
        match out.last_mut() {
            Some(g) if g.last_seq + 1 == b.first_seq => {
                g.last_seq = b.last_seq();
                g.records += u64::from(b.count);
            }
            _ => out.push(Gap {
                epoch: seg.epoch,
                first_seq: b.first_seq,
                last_seq: b.last_seq(),
                reason: GapReason::Dropped,
                records: u64::from(b.count),
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sync::Value;

    fn rec(i: usize, pad: usize) -> Record {
        Record {
            tags: Vec::new(),
            key: format!("k{i}"),
            ts: i as i64,
            fields: vec![("v".into(), Value::Str("x".repeat(pad)))],
        }
    }

    #[test]
    fn split_respects_count_and_bytes() {
        let recs: Vec<Record> = (0..10).map(|i| rec(i, 10)).collect();
        assert_eq!(split_batch(&recs, 4, usize::MAX), vec![4, 4, 2]);
        let one = recs[0].approx_bytes();
        assert_eq!(split_batch(&recs, 100, one * 3), vec![3, 3, 3, 1]);
        // A single record larger than the byte limit still gets its own block.
        let big = vec![rec(0, 1000), rec(1, 1)];
        assert_eq!(split_batch(&big, 100, 10), vec![1, 1]);
    }

    #[test]
    fn runs_follow_contiguity() {
        let b = |first_seq, count| BlockRef {
            offset: 0,
            len: 1,
            first_seq,
            count,
            min_ts: 0,
            flags: 0,
        };
        let seg = SegIndex {
            epoch: 7,
            first_seq: 1,
            path: PathBuf::new(),
            bytes: 0,
            blocks: vec![b(1, 3), b(4, 2), b(10, 1)],
        };
        let runs = contiguous_runs(&seg);
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[0].first_seq, runs[0].last_seq, runs[0].records),
            (1, 5, 5)
        );
        assert_eq!(
            (runs[1].first_seq, runs[1].last_seq, runs[1].records),
            (10, 10, 1)
        );
    }
}
