//! A full disk at the hub's tier 1, injected at the WAL write (`FaultPoint::WriteNoSpace`,
//! ENOSPC halfway through a group's frames) and at the catalog commit
//! (`FaultPoint::CatalogNoSpace`, SQLite's "database or disk is full" after the WAL fsync).
//!
//! Unlike an EIO or a failed fsync (`faults.rs`), a full disk must not poison the log: the
//! failed group's requests (and every request queued behind them) fail with the retryable
//! `DiskFull`, the WAL is cut back so no byte of theirs stays, writes are refused cheaply
//! while the disk stays full, and once the fault clears the same hub takes writes again, with
//! seqs and hub offsets contiguous: no hole, no duplicate. A reopened hub holds exactly the
//! same records. Committed data stays readable throughout.

mod common;

use common::{block, config, read_all};
use core_hub::read::ReadRecord;
use core_hub::wal::{CommitError, FaultPoint};
use core_hub::{CommitOutcome, Hub, IngestError};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A fault hook failing `point` while `full` is set, counting the faults it injected.
fn hook(
    point: FaultPoint,
    full: &Arc<AtomicBool>,
    injected: &Arc<AtomicU64>,
) -> core_hub::wal::FaultHook {
    let (full, injected) = (full.clone(), injected.clone());
    Arc::new(move |p: FaultPoint| {
        let fail = p == point && full.load(Ordering::SeqCst);
        if fail {
            injected.fetch_add(1, Ordering::SeqCst);
        }
        fail
    })
}

/// A hub whose WAL files roll at `segment_bytes_max`: small files make failed groups span
/// rolls, so the cut must remove files; at 1 byte every block starts a new file, so a failed
/// group always rolled right where it started (the file before it may be evictable).
fn open_with(dir: &Path, hook: core_hub::wal::FaultHook, segment_bytes_max: u64) -> Arc<Hub> {
    let cfg = config(dir, |c| c.wal.segment_bytes_max = segment_bytes_max);
    Hub::open_with_faults(&cfg, Some(hook)).unwrap()
}

fn is_disk_full(e: &IngestError) -> bool {
    matches!(e, IngestError::Unavailable(CommitError::DiskFull { .. }))
}

/// Retryable refusals a lane may see after a failure: the disk-full error itself, or a block
/// abandoned because an earlier one of its lane failed.
fn is_retryable(e: &IngestError) -> bool {
    matches!(
        e,
        IngestError::Unavailable(CommitError::DiskFull { .. } | CommitError::EarlierFailed)
    )
}

/// Waits (with a deadline) until the hub takes writes again after the fault cleared.
async fn wait_resumed(hub: &Hub) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Err(why) = hub.health() {
        assert!(Instant::now() < deadline, "writes did not resume: {why}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Bytes in the WAL files beyond their headers: with nothing in flight this must equal the
/// committed end (no byte of a failed group left behind).
fn wal_payload_bytes(dir: &Path) -> u64 {
    let (first, len) = last_wal_file(dir);
    first + len - core_hub::wal::WAL_HEADER_LEN as u64
}

/// The newest WAL file: its first logical offset and its length.
fn last_wal_file(dir: &Path) -> (u64, u64) {
    let wal = dir.join("wal");
    let first_of = |name: &str| {
        name.strip_suffix(".wal")
            .and_then(|s| s.parse::<u64>().ok())
    };
    let mut files: Vec<(u64, u64)> = std::fs::read_dir(&wal)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let first = first_of(e.file_name().to_str()?)?;
            Some((first, e.metadata().unwrap().len()))
        })
        .collect();
    files.sort_unstable();
    *files.last().unwrap()
}

/// Waits (with a deadline) until the WAL holds exactly the committed bytes: the cut after a
/// failed catalog commit happens on the writer thread, shortly after the failure returned.
async fn wait_cut(hub: &Hub, dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let committed = hub.wal_stats().committed_end.load(Ordering::SeqCst);
        let held = wal_payload_bytes(dir);
        if held == committed {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the WAL holds {held} bytes, {committed} committed: the failed group was not cut off"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn assert_contiguous(got: &[ReadRecord], device: &str, last: u64) {
    let seqs: Vec<(u64, u64)> = got
        .iter()
        .filter(|r| r.device == device)
        .map(|r| (r.seq, r.offset))
        .collect();
    assert_eq!(seqs.len() as u64, last, "{device}: records");
    for (i, &(seq, _)) in seqs.iter().enumerate() {
        assert_eq!(
            seq,
            i as u64 + 1,
            "{device}: seqs must be 1..={last} without hole"
        );
    }
    let mut offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
    offsets.sort_unstable();
    assert_eq!(
        offsets,
        (0..got.len() as u64).collect::<Vec<_>>(),
        "hub offsets must be contiguous from 0"
    );
}

/// One block at a time: the failing block errors, nothing earlier is lost, writes are refused
/// while the disk is full, and resume on their own.
async fn one_at_a_time(point: FaultPoint, segment_bytes_max: u64) {
    let dir = tempfile::tempdir().unwrap();
    let full = Arc::new(AtomicBool::new(false));
    let injected = Arc::new(AtomicU64::new(0));
    let hub = open_with(dir.path(), hook(point, &full, &injected), segment_bytes_max);
    for i in 0..3u64 {
        let out = hub
            .commit_block("d1", "telemetry", &block("d1", 1, i * 10 + 1, i * 10 + 10))
            .await
            .unwrap();
        assert_eq!(out.durable_seq(), i * 10 + 10);
    }
    let before = read_all(&hub, "telemetry");

    full.store(true, Ordering::SeqCst);
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 31, 40))
        .await
        .unwrap_err();
    assert!(is_disk_full(&err), "{point:?}: {err}");
    assert!(
        injected.load(Ordering::SeqCst) >= 1,
        "the fault never fired"
    );
    let stats = hub.wal_stats();
    assert!(
        !stats.poisoned.load(Ordering::SeqCst),
        "a full disk must not poison"
    );
    assert!(stats.disk_full.load(Ordering::SeqCst));
    let why = hub.health().unwrap_err();
    assert!(why.contains("disk full"), "{why}");
    let metrics = core_hub::metrics::render(&hub);
    assert!(
        metrics.contains("\ntributary_hub_wal_disk_full 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("\ntributary_hub_wal_poisoned 0\n"));

    // Refused cheaply while full (before decoding: the fault hook is not reached again).
    let fired = injected.load(Ordering::SeqCst);
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 31, 40))
        .await
        .unwrap_err();
    assert!(is_disk_full(&err), "{err}");
    assert_eq!(injected.load(Ordering::SeqCst), fired);
    // Committed data stays readable, and no byte of the failed group is left in the WAL.
    assert_eq!(read_all(&hub, "telemetry"), before);
    wait_cut(&hub, dir.path()).await;
    if segment_bytes_max == 1 {
        // The failed group rolled right where it started: that new file stays, emptied, as
        // the active one (the file before it ends at the committed end and may be evicted).
        let committed = stats.committed_end.load(Ordering::SeqCst);
        assert_eq!(
            last_wal_file(dir.path()),
            (committed, core_hub::wal::WAL_HEADER_LEN as u64),
            "{point:?}"
        );
    }
    assert_eq!(hub.marks("d1")[0].durable_seq, 30);

    full.store(false, Ordering::SeqCst);
    wait_resumed(&hub).await;
    for i in 3..10u64 {
        let out = hub
            .commit_block("d1", "telemetry", &block("d1", 1, i * 10 + 1, i * 10 + 10))
            .await
            .unwrap();
        assert!(
            matches!(out, CommitOutcome::Committed { durable_seq, hub_offset_base, .. }
                if durable_seq == i * 10 + 10 && hub_offset_base == i * 10),
            "{point:?}: {out:?}"
        );
    }
    assert!(
        core_hub::metrics::render(&hub).contains("\ntributary_hub_wal_disk_full_resumed_total 1\n")
    );
    let got = read_all(&hub, "telemetry");
    assert_contiguous(&got, "d1", 100);
    drop(hub);

    let hub = common::open(dir.path());
    assert_eq!(
        read_all(&hub, "telemetry"),
        got,
        "{point:?}: content after reopen"
    );
    assert_eq!(hub.marks("d1")[0].durable_seq, 100);
}

#[tokio::test]
async fn enospc_on_wal_write_rolls_back_and_resumes() {
    one_at_a_time(FaultPoint::WriteNoSpace, 4 << 10).await;
}

#[tokio::test]
async fn enospc_on_wal_write_after_a_roll_keeps_the_new_file() {
    one_at_a_time(FaultPoint::WriteNoSpace, 1).await;
}

#[tokio::test]
async fn enospc_on_catalog_commit_rolls_back_and_resumes() {
    one_at_a_time(FaultPoint::CatalogNoSpace, 4 << 10).await;
}

#[tokio::test]
async fn enospc_on_catalog_commit_after_a_roll() {
    one_at_a_time(FaultPoint::CatalogNoSpace, 1).await;
}

/// Two lanes pipelined (many blocks queued before any is durable) when the disk fills up:
/// each lane's outcomes are a run of successes then only retryable failures, never a success
/// after a failure (that would be a hole). After the disk has space again the lanes resend
/// everything, like agents do from the hub's marks: acknowledged blocks are duplicates, the
/// rest commit once, and the result is contiguous.
async fn pipelined(point: FaultPoint) {
    let dir = tempfile::tempdir().unwrap();
    let full = Arc::new(AtomicBool::new(false));
    let injected = Arc::new(AtomicU64::new(0));
    let hub = open_with(dir.path(), hook(point, &full, &injected), 4 << 10);
    const BLOCKS: u64 = 40;
    let lane = |device: &'static str, fill_at: Option<u64>| {
        let (hub, full) = (hub.clone(), full.clone());
        tokio::spawn(async move {
            let mut pending = Vec::new();
            for i in 0..BLOCKS {
                if Some(i) == fill_at {
                    full.store(true, Ordering::SeqCst);
                }
                let b = block(device, 1, i * 10 + 1, i * 10 + 10);
                pending.push(hub.submit_block(device, "telemetry", &b).await);
            }
            let mut outcomes = Vec::new();
            for p in pending {
                outcomes.push(match p {
                    Ok(p) => p.wait().await,
                    Err(e) => Err(e),
                });
            }
            outcomes
        })
    };
    let a = lane("d1", Some(BLOCKS / 2));
    let b = lane("d2", None);
    let outcomes = [("d1", a.await.unwrap()), ("d2", b.await.unwrap())];
    assert!(
        injected.load(Ordering::SeqCst) >= 1,
        "the fault never fired"
    );
    assert!(!hub.wal_stats().poisoned.load(Ordering::SeqCst));
    let mut acked = Vec::new();
    for (device, outs) in &outcomes {
        let ok = outs.iter().take_while(|o| o.is_ok()).count();
        if let Some(Err(e)) = outs.get(ok) {
            assert!(is_retryable(e), "{point:?} {device}: {e}");
        }
        for o in outs.iter().skip(ok + 1) {
            // Never a success after a failure. A block submitted after its predecessor was
            // refused outright (never queued) is out of order; the hub's session driver has
            // closed the connection on the first failure by then, as the agent sees it.
            let e = o.as_ref().unwrap_err();
            assert!(
                is_retryable(e) || matches!(e, IngestError::OutOfOrder { .. }),
                "{point:?} {device}: {e}"
            );
        }
        let mark = hub.marks(device).first().map_or(0, |m| m.durable_seq);
        assert_eq!(mark, ok as u64 * 10, "{point:?} {device}: mark vs acks");
        acked.push(ok as u64);
    }
    assert!(
        acked[0] < BLOCKS,
        "{point:?}: the lane that filled the disk lost nothing?"
    );
    wait_cut(&hub, dir.path()).await;

    full.store(false, Ordering::SeqCst);
    wait_resumed(&hub).await;
    for ((device, _), acked) in outcomes.iter().zip(acked) {
        for i in 0..BLOCKS {
            let out = hub
                .commit_block(
                    device,
                    "telemetry",
                    &block(device, 1, i * 10 + 1, i * 10 + 10),
                )
                .await
                .unwrap();
            if i < acked {
                assert!(
                    matches!(out, CommitOutcome::Duplicate { .. }),
                    "{point:?} {device}: {out:?}"
                );
            } else {
                assert!(
                    matches!(out, CommitOutcome::Committed { durable_seq, trimmed: 0, .. } if durable_seq == i * 10 + 10),
                    "{point:?} {device} block {i}: {out:?}"
                );
            }
        }
    }
    let got = read_all(&hub, "telemetry");
    assert_contiguous(&got, "d1", BLOCKS * 10);
    assert_contiguous(&got, "d2", BLOCKS * 10);
    drop(hub);
    let hub = common::open(dir.path());
    assert_eq!(
        read_all(&hub, "telemetry"),
        got,
        "{point:?}: content after reopen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_lanes_enospc_on_wal_write() {
    pipelined(FaultPoint::WriteNoSpace).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_lanes_enospc_on_catalog_commit() {
    pipelined(FaultPoint::CatalogNoSpace).await;
}

/// EIO-like failures keep poisoning: only a full disk is rolled back.
#[tokio::test]
async fn torn_write_still_poisons() {
    let dir = tempfile::tempdir().unwrap();
    let full = Arc::new(AtomicBool::new(false));
    let injected = Arc::new(AtomicU64::new(0));
    let hub = open_with(
        dir.path(),
        hook(FaultPoint::Write, &full, &injected),
        4 << 10,
    );
    hub.commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap();
    full.store(true, Ordering::SeqCst);
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 11, 20))
        .await
        .unwrap_err();
    assert!(
        matches!(err, IngestError::Unavailable(CommitError::Io(_))),
        "{err}"
    );
    full.store(false, Ordering::SeqCst);
    assert!(hub.wal_stats().poisoned.load(Ordering::SeqCst));
    assert!(!hub.wal_stats().disk_full.load(Ordering::SeqCst));
    assert!(hub.health().unwrap_err().contains("poisoned"));
}
