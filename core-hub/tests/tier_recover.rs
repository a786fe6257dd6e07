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
            ingest(
                &hub,
                &format!("truck-{d}"),
                6_001,
                6_000 + 700 * (d + 1),
                70,
            )
            .await;
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
    assert!(
        report.adopted >= 1,
        "the uncommitted chunk file is adopted: {report:?}"
    );
    // Recovering twice is refused: the catalog exists now.
    assert!(
        core_hub::tiering::recover::from_tier2(&cfg, |_, _, _| {})
            .await
            .is_err()
    );

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
    let manifests = t
        .store()
        .list("_tributary/manifests/telemetry/")
        .await
        .unwrap();
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

/// A scaled stream: `recover --from-tier2` rebuilds its segment graph (ranges, starts, ends,
/// predecessor links) from the manifests, and readers of the rebuilt hub see every tiered
/// record once, in the segments it had, through tier 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_restores_the_segment_graph() {
    use core_hub::config::ScalePolicy;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("hub");
    let cfg = common::config(&data, |c| {
        c.wal.segment_bytes_max = 64 << 10;
        c.streams.scale.insert(
            "telemetry".into(),
            ScalePolicy {
                target_records_per_s: Some(20_000),
                target_bytes_per_s: None,
                window: Duration::from_millis(100),
                min_segments: 1,
                max_segments: 4,
            },
        );
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.path().join("tier2").display());
        t.chunk_records_max = 2_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_retention_time = Duration::ZERO;
        t.tier1_retention_bytes = 0;
    });
    let (before, tiered_end) = {
        let (hub, t) = open(&cfg).await;
        let mut seq = 1;
        let deadline = Instant::now() + Duration::from_secs(30);
        while seq <= 30_000
            || (hub.streams().stats().splits.load(Ordering::Relaxed) == 0
                && Instant::now() < deadline)
        {
            for d in 0..2 {
                let dev = format!("truck-{d}");
                hub.commit_block(&dev, "telemetry", &common::block(&dev, 1, seq, seq + 299))
                    .await
                    .unwrap();
            }
            seq += 300;
        }
        assert!(hub.streams().stats().splits.load(Ordering::Relaxed) >= 1);
        flush(&t).await;
        let sid = hub.stream_id("telemetry").unwrap();
        let st = core_hub::tiering::store::state(hub.catalog(), sid).unwrap();
        let graph = hub.streams().snapshot(sid).unwrap().graph.clone();
        hub.shutdown();
        (graph, st.tiered_end)
    };
    std::fs::remove_dir_all(&data).unwrap();

    let report = core_hub::tiering::recover::from_tier2(&cfg, |_, _, _| {})
        .await
        .unwrap();
    let (hub, _t) = open(&cfg).await;
    let sid = hub.stream_id("telemetry").unwrap();
    let snap = hub.streams().snapshot(sid).unwrap();
    assert_eq!(snap.end, tiered_end);
    let want = core_hub::streams::graph::truncate_at(before.segments().to_vec(), tiered_end);
    assert!(want.len() > 1, "the stream had split below the tiered end");
    assert_eq!(report.segments, want.len() as u64, "{report:?}");
    let got = snap.graph.segments();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(
            (g.id, g.lo, g.hi, g.start, g.end, &g.preds, &g.succs),
            (w.id, w.lo, w.hi, w.start, w.end, &w.preds, &w.succs),
            "segment {}",
            w.id
        );
    }
    // Every tiered record once, in offset order, tagged with the segment the graph locates.
    let h = hub.clone();
    let all = tokio::task::spawn_blocking(move || common::read_all(&h, "telemetry"))
        .await
        .unwrap();
    assert_eq!(all.len() as u64, tiered_end);
    for (i, r) in all.iter().enumerate() {
        assert_eq!(r.offset, i as u64);
        let p = core_hub::streams::key_point(&r.key);
        assert_eq!(r.segment, snap.graph.locate(r.offset, p));
    }
    hub.shutdown();
}

/// The range checksums survive the loss: `recover --from-tier2` restores the content checksum
/// of every old block range from the manifests, so a device re-shipping an old range after
/// the rebuild is verified exactly as before: identical content is a duplicate (no second
/// row anywhere), different content is a conflict that fences the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reship_after_rebuild_is_verified_against_restored_checksums() {
    use core_hub::ingest::{CommitOutcome, IngestError};
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("hub");
    let cfg = common::config(&data, |c| {
        c.wal.segment_bytes_max = 64 << 10;
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.path().join("tier2").display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_retention_time = Duration::ZERO;
        t.tier1_retention_bytes = 0;
    });
    {
        let (hub, t) = open(&cfg).await;
        for d in 0..2 {
            ingest(&hub, &format!("truck-{d}"), 1, 3_000, 100).await;
        }
        flush(&t).await;
        hub.shutdown();
    }
    std::fs::remove_dir_all(&data).unwrap();

    let report = core_hub::tiering::recover::from_tier2(&cfg, |_, _, _| {})
        .await
        .unwrap();
    assert_eq!(report.ranges, 60, "2 devices x 30 blocks: {report:?}");
    assert_eq!(report.unverified_chunks, 0, "{report:?}");
    assert_eq!(report.missing_objects, 0, "{report:?}");

    let (hub, t) = open(&cfg).await;
    assert_eq!(hub.marks("truck-0")[0].durable_seq, 3_000);
    // Identical content for an old range: a duplicate, acknowledged, nothing stored.
    let dup = hub
        .commit_block(
            "truck-0",
            "telemetry",
            &common::block("truck-0", 1, 101, 200),
        )
        .await
        .unwrap();
    assert!(
        matches!(dup, CommitOutcome::Duplicate { durable_seq: 3_000 }),
        "{dup:?}"
    );
    // A block straddling the mark: the old part is compared, the new part appended.
    let straddle = hub
        .commit_block(
            "truck-0",
            "telemetry",
            &common::block("truck-0", 1, 2_901, 3_100),
        )
        .await
        .unwrap();
    assert!(
        matches!(
            straddle,
            CommitOutcome::Committed {
                durable_seq: 3_100,
                trimmed: 100,
                ..
            }
        ),
        "{straddle:?}"
    );
    // Different content for an old range (a restored or cloned device): refused, fenced.
    let mut changed = common::records("truck-1", 1_001, 1_100);
    changed[17].fields[0].1 = sync::record::Value::F64(-273.15);
    let block = sync::block::encode_block(sync::block::VERSION_ROWS, 1, 1_001, &changed).unwrap();
    let err = hub
        .commit_block("truck-1", "telemetry", &block)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            IngestError::Conflict {
                first_seq: 1_001,
                last_seq: 1_100
            }
        ),
        "{err:?}"
    );
    assert!(hub.is_fenced("truck-1").is_some());
    assert!(hub.is_fenced("truck-0").is_none());

    flush(&t).await;
    let (records, _) = tier2_records(&t).await;
    let expect: BTreeMap<String, u64> = [
        ("truck-0".to_string(), 3_100),
        ("truck-1".to_string(), 3_000),
    ]
    .into();
    assert_exactly(&records, &expect);
    hub.shutdown();
}
