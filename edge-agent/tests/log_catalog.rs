//! Losing the SQLite catalog loses nothing else: deleted or corrupted, it is rebuilt from the
//! segment files with the same epoch, seqs continue without reuse, and the data reads back
//! identically. Runs on the real file system in a temporary directory.

mod log_util;

use edge_agent::log::{Log, LogConfig, LogHandle};
use edge_agent::storage::RealStorage;
use log_util::{read_all, rec, small_cfg};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use sync::Record;

fn open(cfg: &LogConfig) -> (LogHandle, edge_agent::log::RecoveryReport) {
    Log::open(cfg.clone(), Arc::new(RealStorage)).expect("open")
}

fn fill(h: &LogHandle, from: u64, batches: u64) -> u64 {
    let mut last = 0;
    for b in 0..batches {
        let recs: Vec<Record> = (0..7).map(|i| rec(from + b * 7 + i, 40)).collect();
        last = h.append_blocking("s", recs).expect("append").last_seq;
    }
    last
}

fn remove_catalog(dir: &Path) {
    for f in ["catalog.db", "catalog.db-wal", "catalog.db-shm"] {
        let p = dir.join(f);
        if p.exists() {
            std::fs::remove_file(p).unwrap();
        }
    }
}

fn check_rebuilt(
    cfg: &LogConfig,
    epoch: u64,
    before: &BTreeMap<u64, Record>,
    last: u64,
) -> LogHandle {
    let (h, report) = open(cfg);
    assert!(
        report.catalog_rebuilt,
        "report must say the catalog was rebuilt: {report:?}"
    );
    assert!(!report.epoch_minted);
    assert_eq!(h.epoch(), epoch, "a rebuilt catalog keeps the epoch");
    assert_eq!(
        &read_all(&h, "s", epoch),
        before,
        "data reads back identically"
    );
    let ack = h.append_blocking("s", vec![rec(999_999, 10)]).unwrap();
    assert_eq!(ack.first_seq, last + 1, "seqs continue without reuse");
    h
}

#[test]
fn deleted_catalog_is_rebuilt_with_same_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (h, report) = open(&cfg);
    assert!(report.epoch_minted && !report.catalog_rebuilt);
    let epoch = h.epoch();
    let last = fill(&h, 0, 40);
    h.set_acked("s", epoch, 10, 0).unwrap();
    let before = read_all(&h, "s", epoch);
    assert_eq!(before.len() as u64, last);
    drop(h);
    assert!(
        std::fs::read_dir(dir.path().join("streams/s"))
            .unwrap()
            .count()
            > 3,
        "several segments"
    );

    remove_catalog(dir.path());
    let h = check_rebuilt(&cfg, epoch, &before, last);
    // Acknowledgements are lost with the catalog; the hub repeats them on reconnect.
    assert_eq!(h.status().streams[0].acked_durable, 0);
}

#[test]
fn corrupt_catalog_is_moved_aside_and_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (h, _) = open(&cfg);
    let epoch = h.epoch();
    let last = fill(&h, 0, 30);
    let before = read_all(&h, "s", epoch);
    drop(h);

    remove_catalog(dir.path());
    std::fs::write(
        dir.path().join("catalog.db"),
        b"this is not a sqlite database at all".repeat(200),
    )
    .unwrap();
    let (h, report) = open(&cfg);
    assert!(report.catalog_rebuilt);
    let aside = report.catalog_moved_aside.clone().expect("moved aside");
    assert!(
        aside.exists()
            && aside
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("catalog.db.corrupt-")
    );
    assert_eq!(h.epoch(), epoch);
    assert_eq!(read_all(&h, "s", epoch), before);
    let ack = h.append_blocking("s", vec![rec(1, 1)]).unwrap();
    assert_eq!(ack.first_seq, last + 1);
    let last = ack.last_seq;
    let before = read_all(&h, "s", epoch);
    drop(h);

    // And once more, with the rebuilt catalog corrupted in place (the header survives, pages don't).
    let p = dir.path().join("catalog.db");
    let mut bytes = std::fs::read(&p).unwrap();
    for b in bytes.iter_mut().skip(100) {
        *b = 0xEE;
    }
    std::fs::write(&p, bytes).unwrap();
    for side in ["catalog.db-wal", "catalog.db-shm"] {
        let _ = std::fs::remove_file(dir.path().join(side));
    }
    check_rebuilt(&cfg, epoch, &before, last);
}

#[test]
fn minted_epoch_survives_catalog_loss() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_cfg(dir.path());
    let (h, _) = open(&cfg);
    let old = h.epoch();
    fill(&h, 0, 5);
    let new = h.mint_epoch().unwrap();
    assert_ne!(new, old);
    let ack = h.append_blocking("s", vec![rec(5, 5)]).unwrap();
    assert_eq!(
        (ack.epoch, ack.first_seq),
        (new, 1),
        "seqs restart at 1 in a new epoch"
    );
    let old_data = read_all(&h, "s", old);
    drop(h);

    remove_catalog(dir.path());
    let (h, report) = open(&cfg);
    assert!(report.catalog_rebuilt);
    assert_eq!(
        h.epoch(),
        new,
        "the minted epoch is kept, not the older one"
    );
    assert_eq!(
        read_all(&h, "s", old),
        old_data,
        "older epochs stay readable"
    );
    assert_eq!(
        h.append_blocking("s", vec![rec(6, 5)]).unwrap().first_seq,
        2
    );
    let held: Vec<u64> = h.epochs_held("s").iter().map(|e| e.0).collect();
    assert_eq!(held, vec![old, new]);
}
