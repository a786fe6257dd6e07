//! The recovery decision end to end, on `MemStorage`: a hole in the last fsync group followed
//! by valid frames of that group was never durable and is truncated without a gap marker; the
//! same hole followed by a later group, whose sync mark proves it was fsynced, is corruption and
//! is quarantined together with the rest of its batch; and segments of both released versions
//! still read (checked-in fixtures).
//!
//! `fixtures/segment-v2/` holds a version 2 segment written by the log (sync marks, a split
//! batch with `FLAG_BATCH_CONTINUES` and `FLAG_BATCH_CONTINUED`) and `segment.json`, its epoch,
//! blocks and marks. It is generated once, with
//! `TRIBUTARY_WRITE_FIXTURES=1 cargo test -p edge-agent --test log_recovery_rule`, and never
//! regenerated. The version 1 fixture is the one in `sync/tests/fixtures/v1/`.

mod log_util;

use edge_agent::catalog::CatalogLocation;
use edge_agent::log::{FsyncPolicy, GapReason, Log, LogConfig, RecoveryReport};
use edge_agent::storage::{MemStorage, Storage};
use log_util::{block_frames, read_all, rec};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use sync::block::{FLAG_BATCH_CONTINUED, FLAG_BATCH_CONTINUES, decode_header};
use sync::segment::{self, SEGMENT_VERSION, SEGMENT_VERSION_V1};

const DIR: &str = "/data/streams/s";

fn cfg() -> LogConfig {
    LogConfig {
        data_dir: PathBuf::from("/data"),
        streams: vec!["s".into()],
        fsync: FsyncPolicy::Always,
        segment_bytes_max: 1 << 20,
        block_records_max: 10,
        block_linger: Duration::from_micros(1),
        catalog: CatalogLocation::Memory,
        ..LogConfig::default()
    }
}

fn open(mem: &MemStorage) -> (edge_agent::log::LogHandle, RecoveryReport) {
    Log::open(cfg(), Arc::new(mem.clone())).expect("the agent always starts")
}

fn only_segment(mem: &MemStorage) -> PathBuf {
    let names = mem.list(Path::new(DIR)).unwrap();
    let segs: Vec<&String> = names.iter().filter(|n| n.ends_with(".seg")).collect();
    assert_eq!(segs.len(), 1, "{names:?}");
    Path::new(DIR).join(segs[0])
}

/// Replaces a file's bytes, durably.
fn put(mem: &MemStorage, path: &Path, bytes: &[u8]) {
    let mut f = mem.create(path).unwrap();
    f.append(bytes).unwrap();
    f.sync().unwrap();
    mem.sync_dir(Path::new(DIR)).unwrap();
}

/// A log holding seqs 1..=5, then one batch of 35 records split into four blocks (6..=40),
/// each append its own fsync group; with `later`, one more group (41..=45) after it.
fn setup(later: bool) -> (MemStorage, u64) {
    let mem = MemStorage::with_seed(11);
    let (h, _) = open(&mem);
    h.append_blocking("s", (1..=5).map(|i| rec(i, 20)).collect())
        .unwrap();
    let ack = h
        .append_blocking("s", (6..=40).map(|i| rec(i, 20)).collect())
        .unwrap();
    assert_eq!((ack.first_seq, ack.last_seq), (6, 40));
    if later {
        h.append_blocking("s", (41..=45).map(|i| rec(i, 20)).collect())
            .unwrap();
    }
    let epoch = h.epoch();
    h.shutdown();
    (mem, epoch)
}

/// Zeroes the first block of the split batch, as a crash that persisted the batch's later
/// writes but not its first one leaves it. Returns the hole's offset.
fn zero_batch_head(mem: &MemStorage) -> u64 {
    let path = only_segment(mem);
    let mut bytes = mem.contents(&path).unwrap();
    let head = block_frames(&bytes)
        .into_iter()
        .find(|f| decode_header(f.block(&bytes).unwrap()).unwrap().first_seq == 6)
        .unwrap();
    bytes[head.offset as usize..head.end() as usize].fill(0);
    put(mem, &path, &bytes);
    head.offset
}

fn seqs(h: &edge_agent::log::LogHandle, epoch: u64) -> Vec<u64> {
    read_all(h, "s", epoch).into_keys().collect()
}

#[test]
fn hole_in_the_last_group_was_never_durable() {
    let (mem, epoch) = setup(false);
    zero_batch_head(&mem);
    let (h, report) = open(&mem);
    assert!(report.quarantined.is_empty(), "{report:?}");
    assert_eq!(report.holes_never_durable, 1);
    assert_eq!(
        report.truncated_records, 25,
        "the batch's three later blocks"
    );
    assert!(
        h.gaps("s").is_empty(),
        "nothing durable was lost: no gap marker"
    );
    assert_eq!(
        seqs(&h, epoch),
        (1..=5).collect::<Vec<_>>(),
        "the batch is absent"
    );
    assert_eq!(
        h.append_blocking("s", vec![rec(99, 1)]).unwrap().first_seq,
        6
    );
}

#[test]
fn hole_covered_by_a_later_sync_mark_is_corruption_of_a_whole_batch() {
    let (mem, epoch) = setup(true);
    zero_batch_head(&mem);
    let (h, report) = open(&mem);
    assert_eq!(report.holes_never_durable, 0);
    // The zeroed head, and the three intact blocks of its batch, which are kept aside too.
    assert_eq!(report.quarantined.len(), 2, "{report:?}");
    assert!(
        report.quarantined[1].1.contains("incomplete batch"),
        "{report:?}"
    );
    let mut gaps: Vec<(u64, u64, GapReason)> = h
        .gaps("s")
        .iter()
        .map(|g| (g.first_seq, g.last_seq, g.reason))
        .collect();
    gaps.sort_by_key(|g| g.0);
    assert_eq!(
        gaps,
        vec![(6, 15, GapReason::Corrupt), (16, 40, GapReason::Corrupt)]
    );
    let want: Vec<u64> = (1..=5).chain(41..=45).collect();
    assert_eq!(seqs(&h, epoch), want, "no fragment of the batch is kept");
    assert_eq!(
        h.append_blocking("s", vec![rec(99, 1)]).unwrap().first_seq,
        46
    );
    h.shutdown();
    // Repaired once: the next open finds nothing new.
    let (h, report) = open(&mem);
    assert!(report.quarantined.is_empty(), "{report:?}");
    assert_eq!(h.gaps("s").len(), 2);
}

#[test]
fn batch_rule_off_keeps_the_fragment() {
    let (mem, epoch) = setup(true);
    zero_batch_head(&mem);
    edge_agent::log::switches::set_batch_rule(false);
    let (h, report) = open(&mem);
    edge_agent::log::switches::set_batch_rule(true);
    assert_eq!(report.quarantined.len(), 1, "{report:?}");
    assert!(
        seqs(&h, epoch).contains(&16),
        "the tail of the batch is kept without the rule"
    );
}

fn v1_fixture() -> (Vec<u8>, Vec<sync::Record>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sync/tests/fixtures/v1");
    let seg = std::fs::read(dir.join("segment.trseg")).unwrap();
    let ndjson = std::fs::read_to_string(dir.join("records.ndjson")).unwrap();
    (seg, sync::parse::parse_ndjson(&ndjson).unwrap())
}

const V1_EPOCH: u64 = 0x0123_4567_89ab_cdef;

/// A data directory whose only segment is the version 1 fixture (seqs 1000..=1012).
fn v1_dir(seg: &[u8]) -> (MemStorage, PathBuf) {
    let mem = MemStorage::with_seed(12);
    mem.create_dir_all(Path::new(DIR)).unwrap();
    let path = Path::new(DIR).join(format!("{V1_EPOCH:016x}-{:020}.seg", 1000));
    put(&mem, &path, seg);
    (mem, path)
}

#[test]
fn version_1_segment_still_reads_and_is_not_continued() {
    let (seg, records) = v1_fixture();
    assert_eq!(segment::header_version(&seg), Ok(SEGMENT_VERSION_V1));
    let (mem, path) = v1_dir(&seg);
    let (h, report) = open(&mem);
    assert!(
        report.quarantined.is_empty() && report.truncated_bytes == 0,
        "{report:?}"
    );
    assert_eq!(h.epoch(), V1_EPOCH);
    let held = read_all(&h, "s", V1_EPOCH);
    assert_eq!(
        held.keys().copied().collect::<Vec<_>>(),
        (1000..=1012).collect::<Vec<_>>()
    );
    assert_eq!(held.into_values().collect::<Vec<_>>(), records);
    let ack = h.append_blocking("s", vec![rec(1, 1)]).unwrap();
    assert_eq!(ack.first_seq, 1013);
    h.shutdown();
    assert_eq!(
        mem.contents(&path).unwrap(),
        seg,
        "a version 1 file is never appended to"
    );
    let new = Path::new(DIR).join(format!("{V1_EPOCH:016x}-{:020}.seg", 1013));
    let bytes = mem.contents(&new).expect("appends go to a new segment");
    assert_eq!(segment::header_version(&bytes), Ok(SEGMENT_VERSION));
}

#[test]
fn version_1_hole_then_valid_frame_is_still_quarantined() {
    let (mut seg, _) = v1_fixture();
    let frames = segment::scan(&seg).unwrap().frames;
    let victim = frames[1];
    seg[victim.offset as usize..victim.end() as usize].fill(0);
    let (mem, _) = v1_dir(&seg);
    let (h, report) = open(&mem);
    assert_eq!(
        report.quarantined.len(),
        1,
        "no mark can prove it never durable: {report:?}"
    );
    let g = h.gaps("s")[0];
    assert_eq!(
        (g.first_seq, g.last_seq, g.reason),
        (1005, 1007, GapReason::Corrupt)
    );
}

fn v2_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/segment-v2")
}

/// The fixture's description: epoch, blocks and sync marks.
fn describe(epoch: u64, bytes: &[u8]) -> serde_json::Value {
    let scan = segment::scan(bytes).unwrap();
    let mut blocks = Vec::new();
    let mut marks = Vec::new();
    for f in scan.frames {
        let payload = f.block(bytes).unwrap();
        match segment::decode_sync_mark(payload) {
            Some(synced_len) => marks.push(json!({"offset": f.offset, "synced_len": synced_len})),
            None => {
                let h = decode_header(payload).unwrap();
                blocks.push(json!({"first_seq": h.first_seq, "count": h.count, "flags": h.flags}));
            }
        }
    }
    json!({"epoch": format!("{epoch:016x}"), "blocks": blocks, "marks": marks})
}

#[test]
fn version_2_fixture_still_reads() {
    let dir = v2_dir();
    if std::env::var_os("TRIBUTARY_WRITE_FIXTURES").is_some() {
        let (mem, epoch) = setup(true);
        let bytes = mem.contents(&only_segment(&mem)).unwrap();
        std::fs::write(dir.join("segment.trseg"), &bytes).unwrap();
        let desc = serde_json::to_string_pretty(&describe(epoch, &bytes)).unwrap() + "\n";
        std::fs::write(dir.join("segment.json"), desc).unwrap();
    }
    let seg = std::fs::read(dir.join("segment.trseg")).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("segment.json")).unwrap()).unwrap();
    let epoch = u64::from_str_radix(want["epoch"].as_str().unwrap(), 16).unwrap();
    assert_eq!(
        describe(epoch, &seg),
        want,
        "the fixture and its description agree"
    );
    let flags: Vec<u64> = want["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["flags"].as_u64().unwrap())
        .collect();
    let (c, d) = (
        u64::from(FLAG_BATCH_CONTINUES),
        u64::from(FLAG_BATCH_CONTINUED),
    );
    assert_eq!(flags, vec![0, c, c | d, c | d, d, 0]);
    assert_eq!(want["marks"].as_array().unwrap().len(), 2);

    let mem = MemStorage::with_seed(13);
    mem.create_dir_all(Path::new(DIR)).unwrap();
    let path = Path::new(DIR).join(format!("{epoch:016x}-{:020}.seg", 1));
    put(&mem, &path, &seg);
    let (h, report) = open(&mem);
    assert!(
        report.quarantined.is_empty() && report.truncated_bytes == 0,
        "{report:?}"
    );
    let held = read_all(&h, "s", epoch);
    let expected: Vec<sync::Record> = (1..=45).map(|i| rec(i, 20)).collect();
    assert_eq!(held.into_values().collect::<Vec<_>>(), expected);
    let ack = h.append_blocking("s", vec![rec(46, 20)]).unwrap();
    assert_eq!(ack.first_seq, 46);
    h.shutdown();
    let grown = mem.contents(&path).unwrap();
    assert!(
        grown.len() > seg.len() && grown.starts_with(&seg),
        "the v2 tail is continued"
    );
}
