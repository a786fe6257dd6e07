//! Group commit: 100 simulated devices committing concurrently share WAL fsyncs, so the fsync
//! rate does not grow with the device count. Every acknowledged block is readable exactly once.

mod common;

use common::{block, open, read_all};
use core_hub::CommitOutcome;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

const DEVICES: usize = 100;
const BLOCKS_PER_DEVICE: u64 = 20;
const RECORDS_PER_BLOCK: u64 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_devices_share_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let mut tasks = Vec::new();
    for d in 0..DEVICES {
        let hub = hub.clone();
        tasks.push(tokio::spawn(async move {
            let device = format!("dev-{d:03}");
            for b in 0..BLOCKS_PER_DEVICE {
                let first = b * RECORDS_PER_BLOCK + 1;
                let last = first + RECORDS_PER_BLOCK - 1;
                // Each device waits for its ack before sending the next block, like an agent
                // with a window of one: only concurrency across devices can fill a batch.
                let out = hub.commit_block(&device, "telemetry", &block(&device, 1, first, last)).await.unwrap();
                assert!(matches!(out, CommitOutcome::Committed { durable_seq, .. } if durable_seq == last));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let commits = (DEVICES as u64) * BLOCKS_PER_DEVICE;
    let stats = hub.wal_stats();
    let fsyncs = stats.fsyncs.load(Ordering::Relaxed);
    let groups = stats.group_commits.load(Ordering::Relaxed);
    println!("{commits} commits, {fsyncs} WAL fsyncs, {groups} group commits");
    assert_eq!(
        hub.stats().blocks_committed.load(Ordering::Relaxed),
        commits
    );
    assert!(
        fsyncs * 5 <= commits,
        "{fsyncs} fsyncs for {commits} commits: group commit is not grouping"
    );

    // Every record once, per-device seqs in order, hub offsets dense.
    let got = read_all(&hub, "telemetry");
    assert_eq!(got.len() as u64, commits * RECORDS_PER_BLOCK);
    let mut next: HashMap<&str, u64> = HashMap::new();
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.offset, i as u64);
        let n = next.entry(r.device.as_str()).or_insert(1);
        assert_eq!(r.seq, *n, "device {} out of order", r.device);
        *n += 1;
    }
    assert_eq!(next.len(), DEVICES);
    for d in 0..DEVICES {
        let marks = hub.marks(&format!("dev-{d:03}"));
        assert_eq!(marks[0].durable_seq, BLOCKS_PER_DEVICE * RECORDS_PER_BLOCK);
    }
}
