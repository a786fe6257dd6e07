//! Storage faults and self-healing (promise 5): a failed fsync poisons the log until reopened,
//! ENOSPC is a clear error, a corrupt sealed block is quarantined and reported as a gap marker
//! while everything else stays readable, and a torn tail is truncated with what was removed
//! reported.

mod log_util;

use edge_agent::log::{AppendError, GapReason, Log, LogConfig, LogHandle};
use edge_agent::storage::{Fault, FaultError, FaultyStorage, OpKind, RealStorage, Storage};
use log_util::{read_all, rec, small_cfg};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use sync::Record;
use sync::segment::{FRAME_HEADER_LEN, SEGMENT_HEADER_LEN};

fn fill(h: &LogHandle, from: u64, batches: u64) -> BTreeMap<u64, Record> {
    let mut acked = BTreeMap::new();
    for b in 0..batches {
        let recs: Vec<Record> = (0..5).map(|i| rec(from + b * 5 + i, 60)).collect();
        let ack = h.append_blocking("s", recs.clone()).expect("append");
        acked.extend((ack.first_seq..=ack.last_seq).zip(recs));
    }
    acked
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("streams/s"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    v.sort();
    v
}

fn block_of(segment: &[u8], f: sync::segment::FrameRef) -> &[u8] {
    &segment[f.block_offset() as usize..f.end() as usize]
}

fn faulty(dir: &Path) -> (LogConfig, FaultyStorage) {
    (small_cfg(dir), FaultyStorage::new(Arc::new(RealStorage)))
}

#[test]
fn failed_fsync_poisons_until_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, fs) = faulty(dir.path());
    let (h, _) = Log::open(cfg.clone(), Arc::new(fs.clone())).unwrap();
    let epoch = h.epoch();
    let acked = fill(&h, 0, 10);
    fs.add(Fault {
        path_contains: Some(".seg".into()),
        ..Fault::on(OpKind::Sync, FaultError::Eio)
    });

    let err = h.append_blocking("s", vec![rec(100, 10)]).unwrap_err();
    assert!(
        matches!(&err, AppendError::Storage(m) if m.contains("fsync")),
        "{err}"
    );
    assert_eq!(fs.fired(), 1);
    // The disk is healthy again, but a retried fsync proves nothing: stay poisoned.
    fs.clear();
    for _ in 0..3 {
        let err = h.append_blocking("s", vec![rec(101, 10)]).unwrap_err();
        assert!(
            matches!(&err, AppendError::Poisoned(m) if m.contains("fsync")),
            "{err}"
        );
    }
    assert!(h.status().poisoned.is_some());
    // Reads of durable data still work while poisoned.
    assert_eq!(read_all(&h, "s", epoch), acked);
    drop(h);

    let (h, report) = Log::open(cfg, Arc::new(fs)).expect("reopen re-verifies and works");
    assert!(h.status().poisoned.is_none());
    assert!(report.quarantined.is_empty());
    let held = read_all(&h, "s", epoch);
    for (seq, r) in &acked {
        assert_eq!(held.get(seq), Some(r));
    }
    let ack = h.append_blocking("s", vec![rec(102, 10)]).unwrap();
    assert_eq!(ack.first_seq, *held.keys().next_back().unwrap() + 1);
}

#[test]
fn enospc_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, fs) = faulty(dir.path());
    let (h, _) = Log::open(cfg.clone(), Arc::new(fs.clone())).unwrap();
    let epoch = h.epoch();
    let acked = fill(&h, 0, 4);
    fs.add(Fault {
        path_contains: Some(".seg".into()),
        ..Fault::on(OpKind::Append, FaultError::Enospc)
    });
    let err = h.append_blocking("s", vec![rec(50, 10)]).unwrap_err();
    assert!(err.to_string().contains("No space left on device"), "{err}");
    assert!(matches!(
        h.append_blocking("s", vec![rec(51, 10)]),
        Err(AppendError::Poisoned(_))
    ));
    drop(h);
    fs.clear();
    let (h, _) = Log::open(cfg, Arc::new(fs)).unwrap();
    assert_eq!(read_all(&h, "s", epoch), acked);
    h.append_blocking("s", vec![rec(52, 10)]).unwrap();
}

#[test]
fn fault_while_rolling_is_handled() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, fs) = faulty(dir.path());
    let (h, _) = Log::open(cfg.clone(), Arc::new(fs.clone())).unwrap();
    let epoch = h.epoch();
    fs.add(Fault {
        path_contains: Some(".seg".into()),
        sticky: true,
        ..Fault::on(OpKind::Create, FaultError::Eio)
    });
    let mut acked = BTreeMap::new();
    let mut failed = false;
    for b in 0..50 {
        let recs: Vec<Record> = (0..5).map(|i| rec(b * 5 + i, 60)).collect();
        match h.append_blocking("s", recs.clone()) {
            Ok(ack) => acked.extend((ack.first_seq..=ack.last_seq).zip(recs)),
            Err(e) => {
                assert!(
                    matches!(e, AppendError::Storage(_) | AppendError::Poisoned(_)),
                    "{e}"
                );
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "the first roll must fail");
    drop(h);
    fs.clear();
    let (h, _) = Log::open(cfg, Arc::new(fs)).unwrap();
    let held = read_all(&h, "s", epoch);
    for (seq, r) in &acked {
        assert_eq!(held.get(seq), Some(r));
    }
}

#[test]
fn corrupt_sealed_block_is_quarantined_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (h, _) = Log::open(cfg.clone(), Arc::new(RealStorage)).unwrap();
    let epoch = h.epoch();
    let acked = fill(&h, 0, 60);
    drop(h);
    let segs = segments(dir.path());
    assert!(segs.len() >= 4);
    // Flip a byte in the body of the second block of a middle segment.
    let victim = &segs[segs.len() / 2];
    let mut bytes = std::fs::read(victim).unwrap();
    let frames = log_util::block_frames(&bytes);
    assert!(frames.len() >= 3);
    let target = frames[1];
    let header = sync::block::decode_header(block_of(&bytes, target)).unwrap();
    let at = target.block_offset() as usize + sync::block::HEADER_LEN + 3;
    bytes[at] ^= 0x40;
    std::fs::write(victim, &bytes).unwrap();

    let (h, report) =
        Log::open(cfg.clone(), Arc::new(RealStorage)).expect("the agent always starts");
    assert_eq!(report.quarantined.len(), 1, "{report:?}");
    let (qpath, why) = &report.quarantined[0];
    assert!(
        qpath.starts_with(dir.path().join("quarantine")) && qpath.exists(),
        "{qpath:?}"
    );
    assert!(why.contains("corrupt"), "{why}");
    assert_eq!(
        std::fs::read(qpath).unwrap(),
        bytes[target.offset as usize..target.end() as usize]
    );
    let gaps = h.gaps("s");
    assert_eq!(gaps.len(), 1);
    let g = gaps[0];
    assert_eq!(
        (g.reason, g.epoch, g.first_seq, g.last_seq),
        (
            GapReason::Corrupt,
            epoch,
            header.first_seq,
            header.last_seq()
        )
    );
    assert_eq!(g.records, u64::from(header.count));
    assert_eq!(h.status().streams[0].quarantined_blocks, 1);
    let held = read_all(&h, "s", epoch);
    for (seq, r) in &acked {
        if (g.first_seq..=g.last_seq).contains(seq) {
            assert!(!held.contains_key(seq));
        } else {
            assert_eq!(
                held.get(seq),
                Some(r),
                "seq {seq} outside the corrupt block is intact"
            );
        }
    }
    let next = h.append_blocking("s", vec![rec(7, 7)]).unwrap();
    assert_eq!(next.first_seq, *acked.keys().next_back().unwrap() + 1);
    drop(h);

    // Repaired once: the next open finds nothing new, and the gap marker persists.
    let (h, report) = Log::open(cfg, Arc::new(RealStorage)).unwrap();
    assert!(report.quarantined.is_empty(), "{report:?}");
    assert_eq!(h.gaps("s"), gaps);
}

#[test]
fn unreadable_segment_header_quarantines_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (h, _) = Log::open(cfg.clone(), Arc::new(RealStorage)).unwrap();
    let epoch = h.epoch();
    let acked = fill(&h, 0, 60);
    drop(h);
    let segs = segments(dir.path());
    let victim = segs[1].clone();
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[0] ^= 0xFF;
    std::fs::write(&victim, &bytes).unwrap();
    let first_of_next = {
        let b = std::fs::read(&segs[2]).unwrap();
        let f = log_util::block_frames(&b)[0];
        sync::block::decode_header(block_of(&b, f))
            .unwrap()
            .first_seq
    };
    let first_of_victim = {
        let f = sync::segment::scan_frames(&bytes, SEGMENT_HEADER_LEN)
            .frames
            .into_iter()
            .find(|f| sync::segment::decode_sync_mark(block_of(&bytes, *f)).is_none())
            .unwrap();
        sync::block::decode_header(block_of(&bytes, f))
            .unwrap()
            .first_seq
    };

    let (h, report) = Log::open(cfg, Arc::new(RealStorage)).unwrap();
    assert_eq!(report.quarantined.len(), 1);
    assert!(!victim.exists() && report.quarantined[0].0.exists());
    let g = h.gaps("s")[0];
    assert_eq!(
        (g.first_seq, g.last_seq, g.reason),
        (first_of_victim, first_of_next - 1, GapReason::Corrupt)
    );
    let held = read_all(&h, "s", epoch);
    assert_eq!(held.len() as u64 + g.records, acked.len() as u64);
}

#[test]
fn torn_tail_is_truncated_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (h, _) = Log::open(cfg.clone(), Arc::new(RealStorage)).unwrap();
    let epoch = h.epoch();
    let acked = fill(&h, 0, 20);
    drop(h);
    // Simulate a block whose write was cut short: the first 70% of a copy of the last frame.
    let last = segments(dir.path()).pop().unwrap();
    let bytes = std::fs::read(&last).unwrap();
    let frame = *log_util::block_frames(&bytes).last().unwrap();
    let whole = &bytes[frame.offset as usize..frame.end() as usize];
    let torn = &whole[..whole.len() * 7 / 10];
    assert!(torn.len() > FRAME_HEADER_LEN + sync::block::HEADER_LEN);
    let count = sync::block::decode_header(&whole[FRAME_HEADER_LEN..])
        .unwrap()
        .count;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&last)
        .unwrap();
    std::io::Write::write_all(&mut f, torn).unwrap();
    drop(f);

    let (h, report) = Log::open(cfg, Arc::new(RealStorage)).unwrap();
    assert_eq!(report.truncated_bytes, torn.len() as u64);
    assert_eq!(report.truncated_records, u64::from(count));
    assert!(report.quarantined.is_empty());
    assert_eq!(std::fs::metadata(&last).unwrap().len(), bytes.len() as u64);
    assert_eq!(read_all(&h, "s", epoch), acked);
    let ack = h.append_blocking("s", vec![rec(1, 1)]).unwrap();
    assert_eq!(ack.first_seq, acked.len() as u64 + 1);
}

#[test]
fn storage_trait_is_object_safe_and_shared() {
    // The log takes `Arc<dyn Storage>`; every implementation must fit.
    let stores: Vec<Arc<dyn Storage>> = vec![
        Arc::new(RealStorage),
        Arc::new(edge_agent::storage::MemStorage::default()),
        Arc::new(FaultyStorage::new(Arc::new(RealStorage))),
    ];
    assert_eq!(stores.len(), 3);
}
