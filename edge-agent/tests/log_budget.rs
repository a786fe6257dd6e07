//! The disk budget and retention (promise 4): `drop-oldest` stays within the budget plus one
//! segment and records exactly what it dropped as gap markers; `block` answers "full" at once
//! and keeps everything stored; only the hub's `tiered_seq` frees segments.
//!
//! Runs on the real file system in a temporary directory with a budget far below free space,
//! and measures usage from the directory itself, not from the log's own accounting.

mod log_util;

use edge_agent::log::{AppendError, GapReason, Log, LogConfig, LogHandle, OnFull};
use edge_agent::storage::RealStorage;
use log_util::{read_all, rec, seg_bytes_on_disk, small_cfg};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use sync::Record;

fn open(cfg: &LogConfig) -> LogHandle {
    Log::open(cfg.clone(), Arc::new(RealStorage))
        .expect("open")
        .0
}

fn batch(from: u64, n: u64) -> Vec<Record> {
    (from..from + n).map(|i| rec(i, 200)).collect()
}

fn seg_files(dir: &Path) -> Vec<(u64, std::path::PathBuf)> {
    let mut v: Vec<(u64, std::path::PathBuf)> = std::fs::read_dir(dir.join("streams/s"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            (name.split_once('-').unwrap().1.parse().unwrap(), p)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn drop_oldest_stays_within_budget_and_records_exact_gaps() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_cfg(dir.path());
    cfg.disk_bytes_max = 20_000;
    cfg.block_records_max = 8;
    cfg.on_full = OnFull::DropOldest;
    let h = open(&cfg);
    let epoch = h.epoch();
    let mut acked: BTreeMap<u64, Record> = BTreeMap::new();
    for b in 0..300 {
        let recs = batch(b * 4, 4);
        let ack = h
            .append_blocking("s", recs.clone())
            .expect("drop-oldest never refuses");
        acked.extend((ack.first_seq..=ack.last_seq).zip(recs));
        let used = seg_bytes_on_disk(dir.path());
        assert!(
            used <= cfg.disk_bytes_max + cfg.segment_bytes_max,
            "usage {used} exceeds budget + one segment"
        );
    }
    let st = h.status();
    assert_eq!(
        st.disk_bytes,
        seg_bytes_on_disk(dir.path()),
        "accounting matches the directory"
    );
    let s = &st.streams[0];
    assert!(
        s.dropped_records > 0 && s.dropped_blocks > 0,
        "the budget forced drops: {s:?}"
    );

    let held = read_all(&h, "s", epoch);
    for (seq, r) in &held {
        assert_eq!(acked.get(seq), Some(r), "held seq {seq} is what was acked");
    }
    let gaps = h.gaps("s");
    assert!(
        gaps.iter()
            .all(|g| g.reason == GapReason::Dropped && g.epoch == epoch)
    );
    let mut covered = 0;
    for seq in acked.keys() {
        let in_gaps = gaps
            .iter()
            .filter(|g| (g.first_seq..=g.last_seq).contains(seq))
            .count();
        let in_held = usize::from(held.contains_key(seq));
        assert_eq!(
            in_gaps + in_held,
            1,
            "seq {seq} must be either held or in exactly one gap"
        );
        covered += in_gaps;
    }
    let gap_records: u64 = gaps.iter().map(|g| g.records).sum();
    assert_eq!(gap_records, covered as u64);
    assert_eq!(gap_records, s.dropped_records);
    assert!(
        gaps.iter()
            .all(|g| g.last_seq - g.first_seq + 1 == g.records)
    );
    drop(h);

    // The markers were fsynced to gaps.log: they survive a reopen (and the loss of the catalog).
    std::fs::remove_file(dir.path().join("catalog.db")).unwrap();
    let h = open(&cfg);
    assert_eq!(h.gaps("s"), gaps);
}

#[test]
fn block_refuses_promptly_and_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_cfg(dir.path());
    cfg.disk_bytes_max = 12_000;
    cfg.on_full = OnFull::Block;
    let h = open(&cfg);
    let epoch = h.epoch();
    let mut acked: BTreeMap<u64, Record> = BTreeMap::new();
    let mut full_at = None;
    for b in 0..200 {
        let recs = batch(b * 4, 4);
        let t = Instant::now();
        match h.append_blocking("s", recs.clone()) {
            Ok(ack) => {
                acked.extend((ack.first_seq..=ack.last_seq).zip(recs));
            }
            Err(AppendError::Full { retry_after }) => {
                assert!(
                    // At once compared with blocking until space frees (which never comes
                    // here); generous for a loaded machine.
                    t.elapsed() < Duration::from_secs(10),
                    "Full must be answered at once"
                );
                assert!(retry_after > Duration::ZERO);
                full_at = Some(b);
                break;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert!(full_at.is_some(), "the budget was never reached");
    let msg = AppendError::Full {
        retry_after: Duration::from_secs(1),
    }
    .to_string();
    assert!(
        msg.contains("disk budget") && msg.contains("retry"),
        "clear error: {msg}"
    );
    for _ in 0..3 {
        assert!(matches!(
            h.append_blocking("s", batch(0, 4)),
            Err(AppendError::Full { .. })
        ));
    }
    assert!(seg_bytes_on_disk(dir.path()) <= cfg.disk_bytes_max);
    assert_eq!(read_all(&h, "s", epoch), acked, "nothing stored was lost");
    assert!(h.gaps("s").is_empty());

    // Once the hub has tiered the data, retention frees space and appends succeed again.
    let last = *acked.keys().next_back().unwrap();
    h.set_acked("s", epoch, last, last).unwrap();
    let ack = h
        .append_blocking("s", batch(10_000, 4))
        .expect("space was freed");
    assert_eq!(ack.first_seq, last + 1);
}

#[test]
fn retention_frees_only_what_tiered_seq_covers() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let h = open(&cfg);
    let epoch = h.epoch();
    let mut last = 0;
    for b in 0..60 {
        last = h.append_blocking("s", batch(b * 4, 4)).unwrap().last_seq;
    }
    let segs = seg_files(dir.path());
    assert!(segs.len() >= 5, "need several segments, got {}", segs.len());

    // durable_seq alone frees nothing. (An append is a barrier: the writer applies acks queued
    // before it, and runs retention, before answering it.)
    h.set_acked("s", epoch, last, 0).unwrap();
    last = h.append_blocking("s", batch(1000, 1)).unwrap().last_seq;
    assert!(
        segs.iter().all(|(_, p)| p.exists()),
        "no segment was deleted"
    );

    // tiered_seq one short of the end of segment 2 frees segments 0 and 1 only.
    let end_of_2 = segs[3].0 - 1;
    h.set_acked("s", epoch, last, end_of_2 - 1).unwrap();
    last = h.append_blocking("s", batch(1001, 1)).unwrap().last_seq;
    let now: Vec<u64> = seg_files(dir.path()).iter().map(|s| s.0).collect();
    assert_eq!(
        now[0], segs[2].0,
        "segments fully covered by tiered_seq are deleted, no more"
    );

    // Covering it exactly frees it too; the data after it still reads from its first seq.
    h.set_acked("s", epoch, last, end_of_2).unwrap();
    h.append_blocking("s", batch(1002, 1)).unwrap();
    assert_eq!(seg_files(dir.path())[0].0, segs[3].0);
    let blocks = h.read_blocks("s", epoch, 0, 1).unwrap();
    assert_eq!(blocks[0].header.first_seq, segs[3].0);
    assert_eq!(h.status().streams[0].acked_tiered, end_of_2);
    assert!(
        h.gaps("s").is_empty(),
        "retention is not loss: no gap markers"
    );
}

/// Waits for `cond` with a deadline, checking every few milliseconds.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn seqs_continue_after_everything_was_tiered_and_the_agent_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (epoch, last) = {
        let h = open(&cfg);
        let mut last = 0;
        for b in 0..40 {
            last = h.append_blocking("s", batch(b * 4, 4)).unwrap().last_seq;
        }
        (h.epoch(), last)
    };
    assert!(seg_files(dir.path()).len() >= 3, "need several segments");

    // After a restart no segment is open for appending; the hub then reports everything tiered.
    let h = open(&cfg);
    h.set_acked("s", epoch, last, last).unwrap();
    wait_for("retention", || seg_files(dir.path()).len() <= 1);
    assert_eq!(
        seg_files(dir.path()).len(),
        1,
        "the newest segment stays: it holds the highest seq assigned"
    );
    drop(h);

    // The next run continues the epoch after `last`; it never assigns a seq twice.
    let h = open(&cfg);
    assert_eq!(h.epoch(), epoch);
    let next = h.append_blocking("s", batch(5000, 2)).unwrap();
    assert_eq!(next.first_seq, last + 1, "seqs continue, none reused");
}

#[test]
fn acknowledged_seqs_are_never_reassigned_when_their_segments_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (epoch, acked) = {
        let h = open(&cfg);
        let mut last = 0;
        for b in 0..10 {
            last = h.append_blocking("s", batch(b * 4, 4)).unwrap().last_seq;
        }
        h.set_acked("s", h.epoch(), last, last).unwrap();
        // An append is a barrier: the acknowledgement above is stored before it is answered.
        h.append_blocking("s", batch(900, 1)).unwrap();
        (h.epoch(), last)
    };
    // Every segment file removed behind the agent's back (for example by an older agent's
    // retention); the catalog still holds what the hub acknowledged.
    for (_, p) in seg_files(dir.path()) {
        std::fs::remove_file(p).unwrap();
    }
    let h = open(&cfg);
    assert_eq!(h.epoch(), epoch);
    let next = h.append_blocking("s", batch(6000, 1)).unwrap();
    assert!(
        next.first_seq > acked,
        "seq {} reuses an acknowledged seq (acknowledged up to {acked})",
        next.first_seq
    );
}
