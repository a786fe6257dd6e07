//! Catalog rebuild: the hub's data directory is deleted, only tier 2 remains.
//! `tiering::recover::from_tier2` rebuilds streams, offsets, per-device marks and the chunk
//! rows; the agents (played here by the test, resuming from the hub's marks as the replication
//! protocol does) re-ship what tier 2 lacked; tier 2 then holds every record exactly once.

mod tier_support;

use std::collections::BTreeMap;
use tier_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_from_tier2_then_reship() {
    let server = s3();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("hub");
    let cfg = config(&data, &server.endpoint(), |c| {
        c.tier2.chunk_records_max = 2_000;
    });
    {
        let (hub, t) = open(&cfg).await;
        for d in 0..3 {
            ingest(&hub, &format!("truck-{d}"), 1, 6_000, 150).await;
        }
        flush(&t).await;
        // More data that only tier 1 holds when the disk is lost.
        for d in 0..3 {
            ingest(&hub, &format!("truck-{d}"), 6_001, 6_000 + 700 * (d + 1), 70).await;
        }
        // One chunk uploaded but never committed (crash between upload and commit).
        let fail = std::sync::Arc::new(|p| p == core_hub::tiering::TierFaultPoint::AfterUpload);
        let t2 = core_hub::tiering::Tiering::open(hub.clone(), &cfg, Some(fail))
            .await
            .unwrap();
        drop(t);
        assert!(t2.run_once(true).await.is_err());
        hub.shutdown();
    }
    std::fs::remove_dir_all(&data).unwrap();

    let report = core_hub::tiering::recover::from_tier2(&cfg, |_, _, _| {})
        .await
        .unwrap();
    assert_eq!(report.streams, 1);
    assert!(report.adopted >= 1, "the uncommitted chunk file is adopted: {report:?}");
    // Recovering twice is refused: the catalog exists now.
    assert!(core_hub::tiering::recover::from_tier2(&cfg, |_, _, _| {}).await.is_err());

    let (hub, t) = open(&cfg).await;
    let mut expect = BTreeMap::new();
    for d in 0..3u64 {
        let dev = format!("truck-{d}");
        let marks = hub.marks(&dev);
        assert_eq!(marks.len(), 1);
        let mark = marks[0].durable_seq;
        assert!(mark >= 6_000, "{dev}: mark {mark} covers what tier 2 holds");
        assert_eq!(marks[0].tiered_seq, mark);
        // The agent re-ships from a little before the mark (the hub drops the duplicates).
        let last = 6_000 + 700 * (d + 1);
        ingest(&hub, &dev, mark.saturating_sub(30).max(1), last, 64).await;
        expect.insert(dev, last);
    }
    flush(&t).await;
    let (records, files) = tier2_records(&t).await;
    assert_exactly(&records, &expect);
    let manifests = t.store().list("_tributary/manifests/telemetry/").await.unwrap();
    assert_eq!(files, manifests.len());
    // Read-through works on the rebuilt catalog (tier 1 is empty below the rebuilt offsets).
    let page = core_hub::tiering::read::read_from(&t, "telemetry", None, 0, 3)
        .await
        .unwrap();
    assert_eq!(page.records.len(), 3);
    assert_eq!(page.records[0].offset, 0);
    assert_duckdb(&server.bucket_dir(), &expect);
    hub.shutdown();
}
