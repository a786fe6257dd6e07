//! Recovery at open: find the epoch, scan and verify every segment, truncate what was never
//! durable, quarantine corruption of durable data as gap markers, drop incomplete batches, and
//! rebuild the catalog.
//!
//! Which damage is which is decided by [`super::durability`]; which blocks form incomplete
//! batches by [`super::batches`].
//!
//! Every repair is ordered so that a crash in the middle of recovery loses nothing: corrupt bytes
//! are copied to `quarantine/` (fsynced) and their gap marker is fsynced before the segment is
//! rewritten without them; a rewrite goes through a `.tmp` file, fsync, rename, directory fsync.
//! Running recovery again after such a crash finds the same state or a cleaner one.

use super::batches::{self, Fragment};
use super::durability::{self, HoleFacts, Verdict};
use super::index::{BlockRef, Gap, GapReason, SegIndex, SharedState, StreamIndex};
use super::markers::{self, EPOCHS_FILE, GAPS_FILE, MarkerFile};
use super::switches;
use super::{LogConfig, OpenError, RecoveryReport};
use crate::catalog::{Catalog, CatalogOpen, GapRow, SegmentRow};
use crate::storage::Storage;
use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};
use sync::block::{BLOCK_MAGIC, DecodeLimits, HEADER_LEN, decode_header, verify_block};
use sync::segment::{self, FRAME_HEADER_LEN, FrameRef, SEGMENT_HEADER_LEN, SEGMENT_VERSION};

/// What the writer needs to continue a stream.
#[derive(Debug)]
pub(crate) struct StreamInit {
    pub dir: PathBuf,
    pub next_seq: u64,
    /// The current epoch's last segment, reopened for appending on the first write.
    pub tail: Option<(PathBuf, u64)>,
}

/// Everything recovery produced.
#[derive(Debug)]
pub(crate) struct Recovered {
    pub state: SharedState,
    pub catalog: Catalog,
    pub writer_streams: Vec<StreamInit>,
    pub report: RecoveryReport,
}

struct SegFile {
    epoch: u64,
    first_seq: u64,
    name: String,
    path: PathBuf,
}

struct Ctx<'a> {
    storage: &'a dyn Storage,
    qdir: PathBuf,
    report: RecoveryReport,
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> OpenError + use<> {
    let path = path.to_path_buf();
    move |source| OpenError::Storage { op, path, source }
}

/// The file name of a segment.
pub(crate) fn segment_name(epoch: u64, first_seq: u64) -> String {
    format!("{epoch:016x}-{first_seq:020}.seg")
}

fn parse_segment_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".seg")?;
    let (e, s) = stem.split_once('-')?;
    if e.len() != 16 || s.len() != 20 {
        return None;
    }
    Some((u64::from_str_radix(e, 16).ok()?, s.parse().ok()?))
}

pub(crate) fn recover(
    cfg: &LogConfig,
    storage: &dyn Storage,
    mut catalog: Catalog,
    cat_open: CatalogOpen,
) -> Result<Recovered, OpenError> {
    let streams_dir = cfg.data_dir.join("streams");
    let mut cx = Ctx {
        storage,
        qdir: cfg.data_dir.join("quarantine"),
        report: RecoveryReport::default(),
    };
    for d in [&cfg.data_dir, &streams_dir, &cx.qdir] {
        storage
            .create_dir_all(d)
            .map_err(io_err("create_dir_all", d))?;
    }
    let mut files = Vec::new();
    for name in &cfg.streams {
        let dir = streams_dir.join(name);
        storage
            .create_dir_all(&dir)
            .map_err(io_err("create_dir_all", &dir))?;
        files.push(list_segments(&cx, &dir)?);
    }
    for d in [&cfg.data_dir, &streams_dir] {
        storage.sync_dir(d).map_err(io_err("sync_dir", d))?;
    }
    let seg_epochs: BTreeSet<u64> = files.iter().flatten().map(|f| f.epoch).collect();
    let (epochs, had_history) = recover_epochs(&mut cx, cfg, &catalog, &seg_epochs)?;
    cx.report.catalog_rebuilt = cat_open.created && (had_history || !seg_epochs.is_empty());
    cx.report.catalog_moved_aside = cat_open.moved_aside.clone();
    if let Some(why) = &cat_open.corrupt_reason {
        tracing::warn!(reason = %why, moved_to = %crate::logging::Maybe(cat_open.moved_aside.as_ref().map(|p| p.display()).as_ref()), "catalog was corrupt; rebuilding it from the segment files");
    }
    let mut state = SharedState {
        epochs: epochs.clone(),
        ..SharedState::default()
    };
    let mut inits = Vec::new();
    let acks = catalog.acks().unwrap_or_default();
    for (name, segs) in cfg.streams.iter().zip(files) {
        let dir = streams_dir.join(name);
        let stream_acks: Vec<(u64, u64, u64)> = acks
            .iter()
            .filter(|a| a.0 == *name)
            .map(|a| (a.1, a.2, a.3))
            .collect();
        let (mut idx, mut init) = recover_stream(&mut cx, name, &dir, segs, &epochs, &stream_acks)?;
        // Seqs the hub acknowledged in the current epoch were assigned even if no segment holds
        // them any more (retention keeps the newest segment, but a data directory written
        // before that rule may lack it): never assign them again.
        let current = *epochs.last().expect("an epoch");
        let acked = idx.acks.get(&current).map_or(0, |&(d, t)| d.max(t));
        if acked >= idx.next_seq {
            tracing::warn!(stream = %name, epoch = format_args!("{current:016x}"), acked, "continuing after the hub's acknowledged seq: the newest segment is gone");
            idx.next_seq = acked + 1;
            init.next_seq = acked + 1;
            init.tail = None;
        }
        state.disk_bytes += idx.segments.iter().map(|s| s.bytes).sum::<u64>();
        cx.report.segments += idx.segments.len();
        for seg in &idx.segments {
            cx.report.blocks += seg.blocks.len();
            cx.report.records += seg.blocks.iter().map(|b| u64::from(b.count)).sum::<u64>();
        }
        state.streams.insert(name.clone(), idx);
        inits.push(init);
    }
    sync_catalog(&mut catalog, &state)?;
    cx.report.epoch = *epochs.last().expect("an epoch");
    Ok(Recovered {
        state,
        catalog,
        writer_streams: inits,
        report: cx.report,
    })
}

/// Lists a stream directory's segments, removing leftover `.tmp` files of interrupted rewrites.
fn list_segments(cx: &Ctx<'_>, dir: &Path) -> Result<Vec<SegFile>, OpenError> {
    let mut out = Vec::new();
    for name in cx.storage.list(dir).map_err(io_err("list", dir))? {
        let path = dir.join(&name);
        if name.ends_with(".tmp") {
            // A rewrite that never got renamed: the original is intact.
            cx.storage.remove(&path).map_err(io_err("remove", &path))?;
            continue;
        }
        match parse_segment_name(&name) {
            Some((epoch, first_seq)) => out.push(SegFile {
                epoch,
                first_seq,
                name,
                path,
            }),
            None if name == GAPS_FILE => {}
            None => {
                tracing::warn!(file = %path.display(), "ignoring unexpected file in stream directory")
            }
        }
    }
    Ok(out)
}

/// Finds the epoch history: `epochs.log`, else the catalog, else the segments' epochs. Mints a
/// new epoch for a fresh directory, or when the order of several epochs cannot be known.
fn recover_epochs(
    cx: &mut Ctx<'_>,
    cfg: &LogConfig,
    catalog: &Catalog,
    seg_epochs: &BTreeSet<u64>,
) -> Result<(Vec<u64>, bool), OpenError> {
    let path = cfg.data_dir.join(EPOCHS_FILE);
    let tmp = cfg.data_dir.join(format!("{EPOCHS_FILE}.tmp"));
    if cx.storage.exists(&tmp) {
        cx.storage.remove(&tmp).map_err(io_err("remove", &tmp))?;
    }
    let (entries, cut) = markers::read_entries(cx.storage, &path).map_err(io_err("read", &path))?;
    if cut > 0 {
        tracing::warn!(bytes = cut, "epochs.log had a torn tail; truncated");
    }
    let mut epochs: Vec<u64> = Vec::new();
    for e in entries.iter().filter_map(|e| markers::decode_epoch(e)) {
        if !epochs.contains(&e) {
            epochs.push(e);
        }
    }
    let mut rewrite = false;
    if epochs.is_empty() {
        epochs = catalog.epochs().unwrap_or_default();
        rewrite = !epochs.is_empty();
    }
    let had_history = !epochs.is_empty();
    let unknown: Vec<u64> = seg_epochs
        .iter()
        .copied()
        .filter(|e| !epochs.contains(e))
        .collect();
    let ambiguous = epochs.is_empty() && unknown.len() > 1;
    if !unknown.is_empty() {
        // Epochs seen only in segment names are older than any recorded history.
        tracing::warn!(
            unknown = %crate::logging::List(&unknown),
            "segments of epochs missing from the epoch history"
        );
        epochs.splice(0..0, unknown);
        rewrite = true;
    }
    if epochs.is_empty() || ambiguous {
        // With several epochs and no record of their order, continuing any of them could reuse
        // seqs; a fresh epoch never does.
        let e = mint(&epochs, 0)
            .ok_or_else(|| OpenError::Config("no epoch left above the existing ones".into()))?;
        epochs.push(e);
        cx.report.epoch_minted = true;
        rewrite = true;
    }
    if rewrite {
        let entries: Vec<Vec<u8>> = epochs.iter().map(|e| markers::encode_epoch(*e)).collect();
        markers::rewrite(cx.storage, &path, &entries).map_err(io_err("write", &path))?;
    }
    Ok((epochs, had_history))
}

/// A random epoch `>= min` and above every used one. The first epoch of a data directory is
/// drawn below 2^62 and later ones within 2^32 above the floor, so the space never runs out in
/// practice; `None` if it did.
pub(crate) fn mint(used: &[u64], min: u64) -> Option<u64> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(entropy());
    let floor = match used.iter().max() {
        Some(m) => m.checked_add(1)?.max(min),
        None => min.max(1),
    };
    let span: u64 = if used.is_empty() && min == 0 {
        1 << 62
    } else {
        1 << 32
    };
    let room = u64::MAX - floor;
    Some(floor + rng.random_range(0..=room.min(span - 1)))
}

/// 64 bits of entropy for seeding. The workspace builds `rand` without its OS generator, so read
/// the kernel's directly; if that fails, std's per-process random hash keys mixed with the clock
/// and pid still make two devices (or two mints) differ.
fn entropy() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::io::Read;
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    h.finish()
}

/// Appends gap markers to a stream's `gaps.log`, opening it on first use.
struct GapWriter<'a> {
    storage: &'a dyn Storage,
    path: PathBuf,
    file: Option<MarkerFile>,
}

impl GapWriter<'_> {
    fn write(&mut self, g: &Gap) -> Result<(), OpenError> {
        if self.file.is_none() {
            self.file = Some(
                MarkerFile::open(self.storage, &self.path).map_err(io_err("open", &self.path))?,
            );
        }
        let f = self.file.as_mut().expect("opened");
        f.append(&[markers::encode_gap(g)])
            .map_err(io_err("append", &self.path))
    }
}

fn recover_stream(
    cx: &mut Ctx<'_>,
    stream: &str,
    dir: &Path,
    mut files: Vec<SegFile>,
    epochs: &[u64],
    acks: &[(u64, u64, u64)],
) -> Result<(StreamIndex, StreamInit), OpenError> {
    let order = |e: u64| epochs.iter().position(|x| *x == e).unwrap_or(0);
    files.sort_by_key(|f| (order(f.epoch), f.first_seq));
    let gaps_path = dir.join(GAPS_FILE);
    let (entries, cut) =
        markers::read_entries(cx.storage, &gaps_path).map_err(io_err("read", &gaps_path))?;
    if cut > 0 {
        tracing::warn!(stream, bytes = cut, "gaps.log had a torn tail; truncated");
    }
    let mut idx = StreamIndex::default();
    for &(epoch, d, t) in acks {
        idx.acks.insert(epoch, (d, t));
    }
    for g in entries.iter().filter_map(|e| markers::decode_gap(e)) {
        if !idx.gaps.contains(&g) {
            idx.gaps.push(g);
        }
    }
    for (epoch, from_seq) in entries.iter().filter_map(|e| markers::decode_move(e)) {
        let m = idx.moved.entry(epoch).or_insert(from_seq);
        *m = (*m).min(from_seq);
    }
    let mut gw = GapWriter {
        storage: cx.storage,
        path: gaps_path,
        file: None,
    };
    for (i, f) in files.iter().enumerate() {
        let next = files.get(i + 1).filter(|n| n.epoch == f.epoch);
        let is_tail = next.is_none();
        if let Some(seg) = recover_segment(
            cx,
            &mut gw,
            &mut idx,
            stream,
            f,
            is_tail,
            next.map(|n| n.first_seq),
        )? {
            idx.segments.push(seg);
        }
    }
    finish_interrupted_drops(cx, &mut idx, dir)?;
    if switches::batch_rule() {
        for e in epochs {
            drop_fragments(cx, &mut gw, &mut idx, stream, *e)?;
        }
    }
    remove_empty_segments(cx, &mut idx, dir)?;
    idx.gaps.sort_by_key(|g| (order(g.epoch), g.first_seq));
    for seg in idx.segments.iter() {
        let d = idx.durable.entry(seg.epoch).or_insert(0);
        *d = (*d).max(seg.last_seq().unwrap_or(0));
    }
    // What was read may still sit only in the page cache (kill -9): make it durable before any
    // of it is shipped as durable.
    sync_tails(cx, &idx)?;
    let current = *epochs.last().expect("an epoch");
    let last_block = idx.durable.get(&current).copied().unwrap_or(0);
    let last_gap = idx
        .gaps
        .iter()
        .filter(|g| g.epoch == current)
        .map(|g| g.last_seq)
        .max()
        .unwrap_or(0);
    idx.next_seq = last_block.max(last_gap) + 1;
    // Reopen the tail only if new blocks continue it; after a gap marker past its end (a lost
    // tail segment), the next block starts a new segment named after its first seq.
    let tail = idx
        .segments
        .iter()
        .rfind(|s| s.epoch == current)
        .filter(|s| s.last_seq().is_some_and(|l| l + 1 == idx.next_seq))
        // A version 1 tail has no sync marks to vouch for what follows; start a new segment.
        .filter(|s| segment_version(cx.storage, &s.path) == Some(SEGMENT_VERSION))
        .map(|s| (s.path.clone(), s.first_seq));
    let init = StreamInit {
        dir: dir.to_path_buf(),
        next_seq: idx.next_seq,
        tail,
    };
    Ok((idx, init))
}

/// Scans one segment file and repairs it; returns its index, or `None` if it was removed.
#[allow(clippy::too_many_arguments)]
fn recover_segment(
    cx: &mut Ctx<'_>,
    gw: &mut GapWriter<'_>,
    idx: &mut StreamIndex,
    stream: &str,
    f: &SegFile,
    is_tail: bool,
    next_first: Option<u64>,
) -> Result<Option<SegIndex>, OpenError> {
    let bytes = cx.storage.read(&f.path).map_err(io_err("read", &f.path))?;
    let version = match segment::header_version(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return bad_header(cx, gw, idx, stream, f, &bytes, next_first, e.to_string())
                .map(|()| None);
        }
    };
    let walk = walk_frames(&bytes, f.epoch, !is_tail, version);
    // Before the first block, the file name says where the segment's seqs start.
    let prev_last = f.first_seq.saturating_sub(1);
    let last_good_before = |start: u64, good: &[(FrameRef, BlockRef)]| {
        good.iter()
            .filter(|(fr, _)| fr.offset < start)
            .map(|(_, b)| b.last_seq())
            .max()
    };
    for &(start, end) in &walk.bad {
        let qpath = cx.qdir.join(format!("{stream}-{}-{start}.bad", f.name));
        write_quarantine(cx.storage, &qpath, &bytes[start as usize..end as usize])?;
        let before = last_good_before(start, &walk.good).unwrap_or(prev_last);
        let after = walk
            .good
            .iter()
            .find(|(fr, _)| fr.offset >= end)
            .map(|(_, b)| b.first_seq)
            .or(next_first)
            .or_else(|| last_seq_in_headers(&bytes[start as usize..end as usize], f.epoch))
            .map(|a| a.max(before + 1));
        let why = format!("corrupt bytes {start}..{end} of {}", f.path.display());
        if let Some(after) = after
            && after > before + 1
        {
            let g = Gap {
                epoch: f.epoch,
                first_seq: before + 1,
                last_seq: after - 1,
                reason: GapReason::Corrupt,
                records: after - 1 - before,
            };
            gw.write(&g)?;
            if !idx.gaps.contains(&g) {
                idx.gaps.push(g);
            }
        }
        idx.quarantined_blocks += 1;
        tracing::error!(stream, quarantine = %qpath.display(), "{why}; quarantined");
        cx.report.quarantined.push((qpath, why));
    }
    if let Some(off) = walk.torn {
        let removed = bytes.len() as u64 - off;
        let records = torn_records(&bytes, off as usize);
        if walk.hole_then_valid {
            cx.report.holes_never_durable += 1;
            tracing::warn!(stream, file = %f.path.display(), offset = off, "a hole followed by frames of the same unsynced group: never durable");
        }
        cx.storage
            .truncate(&f.path, off)
            .map_err(io_err("truncate", &f.path))?;
        cx.report.truncated_bytes += removed;
        cx.report.truncated_records += records;
        tracing::warn!(stream, file = %f.path.display(), bytes = removed, records, "truncated torn tail");
    }
    let mut seg = SegIndex {
        epoch: f.epoch,
        first_seq: f.first_seq,
        path: f.path.clone(),
        bytes: 0,
        blocks: Vec::new(),
    };
    if walk.bad.is_empty() {
        seg.bytes = walk.torn.unwrap_or(bytes.len() as u64);
        seg.blocks = walk.good.iter().map(|(_, b)| *b).collect();
    } else {
        rewrite_segment(cx.storage, &f.path, &bytes, &walk.good, &mut seg)?;
    }
    Ok(Some(seg))
}

/// The outcome of walking a segment's frames.
#[derive(Default)]
struct Walk {
    good: Vec<(FrameRef, BlockRef)>,
    /// Byte ranges to quarantine.
    bad: Vec<(u64, u64)>,
    /// Offset from which the file was never durable: truncate there.
    torn: Option<u64>,
    /// The never-durable region is a hole followed by valid frames, not just a torn end.
    hole_then_valid: bool,
}

/// Walks the frames of a segment; `sealed` when a later segment of its epoch exists.
fn walk_frames(bytes: &[u8], epoch: u64, sealed: bool, version: u32) -> Walk {
    let limits = DecodeLimits::default();
    let mut w = Walk::default();
    let mut pos = SEGMENT_HEADER_LEN;
    loop {
        let scan = segment::scan_frames(bytes, pos);
        for fr in scan.frames {
            let block = &bytes[fr.block_offset() as usize..fr.end() as usize];
            if version >= SEGMENT_VERSION && segment::decode_sync_mark(block).is_some() {
                continue;
            }
            match verify_block(block, &limits) {
                Ok(h) if h.epoch == epoch => w.good.push((
                    fr,
                    BlockRef {
                        offset: fr.offset,
                        len: fr.len,
                        first_seq: h.first_seq,
                        count: h.count,
                        min_ts: h.min_ts,
                        flags: h.flags,
                    },
                )),
                _ => w.bad.push((fr.offset, fr.end())),
            }
        }
        let Some((off, _)) = scan.fault else { break };
        let next = durability::next_frame(bytes, off as usize, version >= SEGMENT_VERSION);
        let durable_to = if version >= SEGMENT_VERSION {
            durability::durable_to_after(bytes, off as usize)
        } else {
            0
        };
        let facts = HoleFacts {
            at: off,
            sealed,
            version,
            valid_after: next.is_some(),
            durable_to,
        };
        match (durability::judge(&facts), next) {
            (Verdict::NeverDurable, _) => {
                w.torn = Some(off);
                w.hole_then_valid = next.is_some();
                break;
            }
            (Verdict::Corrupt, Some(next)) => {
                w.bad.push((off, next as u64));
                pos = next;
            }
            (Verdict::Corrupt, None) => {
                w.bad.push((off, bytes.len() as u64));
                break;
            }
        }
    }
    w
}

/// Records in a never-durable region starting at `from`: the block whose header survives at
/// `from`, and every valid block after it.
fn torn_records(bytes: &[u8], from: usize) -> u64 {
    let at_start = bytes
        .get(from + FRAME_HEADER_LEN..from + FRAME_HEADER_LEN + HEADER_LEN)
        .and_then(|h| decode_header(h).ok())
        .map_or(0, |h| u64::from(h.count));
    let mut total = at_start;
    let mut pos = from;
    while let Some(at) = segment::resync(bytes, pos) {
        let h = &bytes[at + FRAME_HEADER_LEN..];
        total += decode_header(h).map_or(0, |h| u64::from(h.count));
        pos = at;
    }
    total
}

/// One past the highest seq named by a block header (its own crc intact) within damaged bytes:
/// where the seqs of a damaged tail end, when no later block says so.
fn last_seq_in_headers(bytes: &[u8], epoch: u64) -> Option<u64> {
    let mut best = None;
    for at in 0..bytes.len().saturating_sub(HEADER_LEN) {
        if bytes[at..at + 4] == BLOCK_MAGIC
            && let Ok(h) = decode_header(&bytes[at..at + HEADER_LEN])
            && h.epoch == epoch
        {
            best = best.max(h.last_seq().checked_add(1));
        }
    }
    best
}

/// The version in a segment's header, if it is readable.
fn segment_version(storage: &dyn Storage, path: &Path) -> Option<u32> {
    let head = storage.read_at(path, 0, SEGMENT_HEADER_LEN).ok()?;
    segment::header_version(&head).ok()
}

/// A segment whose header is unreadable: a torn roll if it holds no more than a header and is
/// the last of its epoch (removed); otherwise quarantined whole.
#[allow(clippy::too_many_arguments)]
fn bad_header(
    cx: &mut Ctx<'_>,
    gw: &mut GapWriter<'_>,
    idx: &mut StreamIndex,
    stream: &str,
    f: &SegFile,
    bytes: &[u8],
    next_first: Option<u64>,
    why: String,
) -> Result<(), OpenError> {
    let dir = crate::storage::parent_dir(&f.path);
    if bytes.len() <= SEGMENT_HEADER_LEN && next_first.is_none() {
        cx.storage
            .remove(&f.path)
            .map_err(io_err("remove", &f.path))?;
        cx.storage
            .sync_dir(&dir)
            .map_err(io_err("sync_dir", &dir))?;
        cx.report.truncated_bytes += bytes.len() as u64;
        tracing::warn!(stream, file = %f.path.display(), "removed a segment whose creation was interrupted");
        return Ok(());
    }
    // Whatever blocks can still be found bound the seqs it held.
    let salvaged = max_seq_in(bytes, f.epoch).unwrap_or(0);
    let last = next_first.map_or(salvaged, |n| (n - 1).max(salvaged));
    if last >= f.first_seq {
        let g = Gap {
            epoch: f.epoch,
            first_seq: f.first_seq,
            last_seq: last,
            reason: GapReason::Corrupt,
            records: last - f.first_seq + 1,
        };
        gw.write(&g)?;
        if !idx.gaps.contains(&g) {
            idx.gaps.push(g);
        }
    }
    let qpath = cx.qdir.join(format!("{stream}-{}", f.name));
    cx.storage
        .rename(&f.path, &qpath)
        .map_err(io_err("rename", &f.path))?;
    cx.storage
        .sync_dir(&cx.qdir)
        .map_err(io_err("sync_dir", &cx.qdir))?;
    cx.storage
        .sync_dir(&dir)
        .map_err(io_err("sync_dir", &dir))?;
    idx.quarantined_blocks += 1;
    let why = format!("unreadable segment header ({why})");
    tracing::error!(stream, quarantine = %qpath.display(), "{why}; segment quarantined");
    cx.report.quarantined.push((qpath, why));
    Ok(())
}

fn max_seq_in(bytes: &[u8], epoch: u64) -> Option<u64> {
    let mut pos = 0usize;
    let mut best = None;
    while let Some(at) = segment::resync(bytes, pos) {
        let len = segment::check_frame(bytes, at).expect("resync returns valid frames") as usize;
        let block = &bytes[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + len];
        if let Ok(h) = decode_header(block)
            && h.epoch == epoch
        {
            best = best.max(Some(h.last_seq()));
        }
        pos = at;
    }
    best
}

fn write_quarantine(storage: &dyn Storage, path: &Path, bytes: &[u8]) -> Result<(), OpenError> {
    let mut f = storage.create(path).map_err(io_err("create", path))?;
    f.append(bytes).map_err(io_err("append", path))?;
    f.sync().map_err(io_err("sync", path))?;
    let dir = crate::storage::parent_dir(path);
    storage.sync_dir(&dir).map_err(io_err("sync_dir", &dir))
}

/// Rewrites a segment with only its good frames: tmp, fsync, rename, directory fsync.
fn rewrite_segment(
    storage: &dyn Storage,
    path: &Path,
    bytes: &[u8],
    good: &[(FrameRef, BlockRef)],
    seg: &mut SegIndex,
) -> Result<(), OpenError> {
    let mut out = segment::segment_header().to_vec();
    seg.blocks.clear();
    for (fr, b) in good {
        let mut b = *b;
        b.offset = out.len() as u64;
        out.extend_from_slice(&bytes[fr.offset as usize..fr.end() as usize]);
        seg.blocks.push(b);
    }
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let mut f = storage.create(&tmp).map_err(io_err("create", &tmp))?;
    f.append(&out).map_err(io_err("append", &tmp))?;
    f.sync().map_err(io_err("sync", &tmp))?;
    storage.rename(&tmp, path).map_err(io_err("rename", &tmp))?;
    let dir = crate::storage::parent_dir(path);
    storage.sync_dir(&dir).map_err(io_err("sync_dir", &dir))?;
    seg.bytes = out.len() as u64;
    Ok(())
}

/// Applies the batch-completeness rule ([`super::batches`]) to one epoch: a batch whose end
/// never reached the disk is truncated (it was never acknowledged); any other fragment is
/// quarantined, its seqs recorded as a `Corrupt` gap, and removed from its segments.
fn drop_fragments(
    cx: &mut Ctx<'_>,
    gw: &mut GapWriter<'_>,
    idx: &mut StreamIndex,
    stream: &str,
    epoch: u64,
) -> Result<(), OpenError> {
    let at: Vec<(usize, usize)> = idx
        .segments
        .iter()
        .enumerate()
        .filter(|(_, s)| s.epoch == epoch)
        .flat_map(|(i, s)| (0..s.blocks.len()).map(move |k| (i, k)))
        .collect();
    let blocks: Vec<BlockRef> = at.iter().map(|&(i, k)| idx.segments[i].blocks[k]).collect();
    let tiered = idx.acks.get(&epoch).map_or(0, |a| a.1);
    let moved = idx.moved.get(&epoch).copied().unwrap_or(u64::MAX);
    let in_gap = |seq: u64, dropped_only: bool| {
        idx.gaps.iter().any(|g| {
            g.epoch == epoch
                && (g.first_seq..=g.last_seq).contains(&seq)
                && (!dropped_only || g.reason == GapReason::Dropped)
        })
    };
    let explained = |seq: u64| seq <= tiered || seq >= moved || in_gap(seq, true);
    let frags = batches::fragments(&blocks, explained, |seq| in_gap(seq, false));
    // Later fragments first, so that the positions of earlier ones stay valid.
    for f in frags.iter().rev() {
        let mut per_seg: Vec<(usize, Vec<usize>)> = Vec::new();
        for &(i, k) in &at[f.blocks.clone()] {
            match per_seg.last_mut() {
                Some((j, ks)) if *j == i => ks.push(k),
                _ => per_seg.push((i, vec![k])),
            }
        }
        if f.torn_end {
            for (i, ks) in per_seg.iter().rev() {
                truncate_blocks(cx, &mut idx.segments[*i], ks[0])?;
            }
        } else {
            quarantine_fragment(cx, gw, idx, stream, f, &blocks, &per_seg)?;
        }
    }
    Ok(())
}

/// Truncates a segment before its block `k`: the tail of a batch that never became durable.
fn truncate_blocks(cx: &mut Ctx<'_>, seg: &mut SegIndex, k: usize) -> Result<(), OpenError> {
    let cut = seg.blocks[k].offset;
    let records: u64 = seg.blocks[k..].iter().map(|b| u64::from(b.count)).sum();
    cx.storage
        .truncate(&seg.path, cut)
        .map_err(io_err("truncate", &seg.path))?;
    cx.report.truncated_bytes += seg.bytes - cut;
    cx.report.truncated_records += records;
    tracing::warn!(file = %seg.path.display(), records, "dropped an incomplete trailing batch");
    seg.blocks.truncate(k);
    seg.bytes = cut;
    Ok(())
}

/// Copies a fragment's frames aside, records its seqs as a `Corrupt` gap (both fsynced), then
/// rewrites each segment without them. A crash in between finds the same fragment again.
fn quarantine_fragment(
    cx: &mut Ctx<'_>,
    gw: &mut GapWriter<'_>,
    idx: &mut StreamIndex,
    stream: &str,
    f: &Fragment,
    blocks: &[BlockRef],
    per_seg: &[(usize, Vec<usize>)],
) -> Result<(), OpenError> {
    let mut contents = Vec::new();
    for (i, ks) in per_seg {
        let seg = &idx.segments[*i];
        let bytes = cx
            .storage
            .read(&seg.path)
            .map_err(io_err("read", &seg.path))?;
        let name = seg
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        let first = seg.blocks[ks[0]];
        let qpath = cx.qdir.join(format!(
            "{stream}-{}-{}.fragment",
            name.unwrap_or_default(),
            first.offset
        ));
        let mut frames = Vec::new();
        for &k in ks {
            let b = seg.blocks[k];
            frames.extend_from_slice(
                &bytes[b.offset as usize..(b.offset + b.frame_bytes()) as usize],
            );
        }
        write_quarantine(cx.storage, &qpath, &frames)?;
        contents.push((*i, bytes, qpath));
    }
    let (head, tail) = (blocks[f.blocks.start], blocks[f.blocks.end - 1]);
    let g = Gap {
        epoch: idx.segments[per_seg[0].0].epoch,
        first_seq: head.first_seq,
        last_seq: tail.last_seq(),
        reason: GapReason::Corrupt,
        records: tail.last_seq() - head.first_seq + 1,
    };
    gw.write(&g)?;
    if !idx.gaps.contains(&g) {
        idx.gaps.push(g);
    }
    for ((i, ks), (_, bytes, qpath)) in per_seg.iter().zip(contents) {
        let seg = &mut idx.segments[*i];
        let good: Vec<(FrameRef, BlockRef)> = seg
            .blocks
            .iter()
            .enumerate()
            .filter(|(k, _)| !ks.contains(k))
            .map(|(_, b)| {
                (
                    FrameRef {
                        offset: b.offset,
                        len: b.len,
                    },
                    *b,
                )
            })
            .collect();
        let path = seg.path.clone();
        rewrite_segment(cx.storage, &path, &bytes, &good, seg)?;
        idx.quarantined_blocks += ks.len() as u64;
        let why = format!(
            "incomplete batch: seqs {}..={} of a batch whose other blocks are missing, from {}",
            g.first_seq,
            g.last_seq,
            seg.path.display()
        );
        tracing::error!(stream, quarantine = %qpath.display(), "{why}; quarantined");
        cx.report.quarantined.push((qpath, why));
    }
    Ok(())
}

/// Deletes segments whose every block lies in a `Dropped` gap marker: the budget wrote the
/// marker (fsynced) and lost power before the delete became durable. Finishing the drop keeps
/// the marker and the data from both claiming the same seqs.
fn finish_interrupted_drops(
    cx: &mut Ctx<'_>,
    idx: &mut StreamIndex,
    dir: &Path,
) -> Result<(), OpenError> {
    let dropped = |epoch: u64, b: &BlockRef| {
        idx.gaps.iter().any(|g| {
            g.reason == GapReason::Dropped
                && g.epoch == epoch
                && g.first_seq <= b.first_seq
                && b.last_seq() <= g.last_seq
        })
    };
    let doomed: Vec<PathBuf> = idx
        .segments
        .iter()
        .filter(|s| !s.blocks.is_empty() && s.blocks.iter().all(|b| dropped(s.epoch, b)))
        .map(|s| s.path.clone())
        .collect();
    for p in &doomed {
        cx.storage.remove(p).map_err(io_err("remove", p))?;
        tracing::warn!(file = %p.display(), "finished dropping a segment already recorded as a gap");
    }
    if !doomed.is_empty() {
        cx.storage.sync_dir(dir).map_err(io_err("sync_dir", dir))?;
        idx.segments.retain(|s| !doomed.contains(&s.path));
    }
    Ok(())
}

/// Removes segments that hold no block (an interrupted roll, or emptied by truncation).
fn remove_empty_segments(
    cx: &mut Ctx<'_>,
    idx: &mut StreamIndex,
    dir: &Path,
) -> Result<(), OpenError> {
    let mut removed = false;
    for seg in idx.segments.iter().filter(|s| s.blocks.is_empty()) {
        cx.storage
            .remove(&seg.path)
            .map_err(io_err("remove", &seg.path))?;
        cx.report.truncated_bytes += seg.bytes.saturating_sub(SEGMENT_HEADER_LEN as u64);
        removed = true;
    }
    idx.segments.retain(|s| !s.blocks.is_empty());
    if removed {
        cx.storage.sync_dir(dir).map_err(io_err("sync_dir", dir))?;
    }
    Ok(())
}

fn sync_tails(cx: &Ctx<'_>, idx: &StreamIndex) -> Result<(), OpenError> {
    let mut seen = BTreeSet::new();
    for seg in idx.segments.iter().rev() {
        if seen.insert(seg.epoch) {
            let mut f = cx
                .storage
                .open_append(&seg.path)
                .map_err(io_err("open", &seg.path))?;
            f.sync().map_err(io_err("sync", &seg.path))?;
        }
    }
    Ok(())
}

fn sync_catalog(catalog: &mut Catalog, state: &SharedState) -> Result<(), OpenError> {
    catalog.replace_epochs(&state.epochs)?;
    let mut segs = Vec::new();
    let mut gaps = Vec::new();
    for (name, st) in &state.streams {
        for s in &st.segments {
            segs.push(SegmentRow {
                stream: name.clone(),
                epoch: s.epoch,
                first_seq: s.first_seq,
                last_seq: s.last_seq().unwrap_or(0),
                bytes: s.bytes,
            });
        }
        gaps.extend(st.gaps.iter().map(|g| gap_row(name, g)));
    }
    catalog.replace_segments(&segs)?;
    catalog.replace_gaps(&gaps)?;
    Ok(())
}

pub(crate) fn gap_row(stream: &str, g: &Gap) -> GapRow {
    GapRow {
        stream: stream.to_string(),
        epoch: g.epoch,
        first_seq: g.first_seq,
        last_seq: g.last_seq,
        reason: match g.reason {
            GapReason::Dropped => "dropped".into(),
            GapReason::Corrupt => "corrupt".into(),
            GapReason::Refused => "refused".into(),
        },
        records: g.records,
    }
}

/// Logs the recovery report.
pub(crate) fn log_report(r: &RecoveryReport) {
    tracing::info!(
        epoch = format_args!("{:016x}", r.epoch),
        epoch_minted = r.epoch_minted,
        segments = r.segments,
        blocks = r.blocks,
        records = r.records,
        truncated_bytes = r.truncated_bytes,
        truncated_records = r.truncated_records,
        holes_never_durable = r.holes_never_durable,
        quarantined = r.quarantined.len(),
        catalog_rebuilt = r.catalog_rebuilt,
        "local log recovered"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip() {
        let n = segment_name(0xdead_beef, 42);
        assert_eq!(n, "00000000deadbeef-00000000000000000042.seg");
        assert_eq!(parse_segment_name(&n), Some((0xdead_beef, 42)));
        assert_eq!(parse_segment_name("gaps.log"), None);
    }
}
