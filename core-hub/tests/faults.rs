//! Storage faults at each step of a group commit: a torn WAL write, a failed fsync, and a
//! crash between the WAL fsync and the catalog commit. The writer poisons itself, refuses
//! everything after, and a reopened hub holds exactly the acknowledged records; the agents'
//! resend from the start is accepted exactly once.

mod common;

use common::{block, config, open, read_all};
use core_hub::wal::{CommitError, FaultPoint};
use core_hub::{CommitOutcome, Hub, IngestError};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

async fn fault_at(point: FaultPoint) {
    let dir = tempfile::tempdir().unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let hook_seen = seen.clone();
    // Fail the 4th time the writer reaches `point`.
    let hook =
        Arc::new(move |p: FaultPoint| p == point && hook_seen.fetch_add(1, Ordering::SeqCst) == 3);
    let hub = Hub::open_with_faults(&config(dir.path(), |_| {}), Some(hook)).unwrap();
    let mut acked = 0;
    let mut failure = None;
    for i in 0..10u64 {
        let (first, last) = (i * 10 + 1, i * 10 + 10);
        match hub
            .commit_block("d1", "telemetry", &block("d1", 1, first, last))
            .await
        {
            Ok(out) => acked = out.durable_seq(),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let failure = failure.expect("the fault must surface");
    assert!(
        matches!(
            failure,
            IngestError::Unavailable(CommitError::Io(_) | CommitError::Catalog(_))
        ),
        "{failure}"
    );
    assert_eq!(acked, 30, "{point:?}");
    // Poisoned: nothing more is accepted, not even a duplicate.
    let err = hub
        .commit_block("d1", "telemetry", &block("d1", 1, 1, 10))
        .await
        .unwrap_err();
    assert_eq!(err, IngestError::Unavailable(CommitError::Poisoned));
    assert!(core_hub::metrics::render(&hub).contains("\ntributary_hub_wal_poisoned 1\n"));
    drop(hub);

    let hub = open(dir.path());
    assert_eq!(hub.marks("d1")[0].durable_seq, acked, "{point:?}");
    for i in 0..10u64 {
        let (first, last) = (i * 10 + 1, i * 10 + 10);
        let out = hub
            .commit_block("d1", "telemetry", &block("d1", 1, first, last))
            .await
            .unwrap();
        if last <= acked {
            assert_eq!(out, CommitOutcome::Duplicate { durable_seq: acked });
        } else {
            assert!(
                matches!(out, CommitOutcome::Committed { durable_seq, .. } if durable_seq == last)
            );
        }
    }
    let got = read_all(&hub, "telemetry");
    let seqs: Vec<(u64, u64)> = got.iter().map(|r| (r.seq, r.offset)).collect();
    assert_eq!(
        seqs,
        (1..=100).map(|s| (s, s - 1)).collect::<Vec<_>>(),
        "{point:?}"
    );
}

#[tokio::test]
async fn torn_wal_write() {
    fault_at(FaultPoint::Write).await;
}

#[tokio::test]
async fn failed_fsync() {
    fault_at(FaultPoint::Fsync).await;
}

#[tokio::test]
async fn crash_between_wal_fsync_and_catalog_commit() {
    fault_at(FaultPoint::CatalogCommit).await;
}
