//! Tier 2 down: s3s-fs is stopped while devices keep sending. Ingest continues until tier 1
//! holds its budget, then the hub refuses new blocks with the retryable `unavailable` error
//! (agents back off and resend) and drops nothing. Once the server is back, uploads resume,
//! tier 1 is evicted, ingest is admitted again, and tier 2 ends up with every record once.

mod tier_support;

use core_hub::IngestError;
use core_hub::wal::CommitError;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tier_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier2_outage_pushes_back_then_recovers() {
    let mut server = s3();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &server.endpoint(), |c| {
        c.tier2.tier1_budget_bytes = 3 << 20;
        c.tier2.tier1_retention_bytes = 0;
        c.tier2.chunk_records_max = 3_000;
    });
    let (hub, t) = open(&cfg).await;
    let mut sent: BTreeMap<String, u64> = BTreeMap::new();
    ingest(&hub, "truck-0", 1, 5_000, 100).await;
    sent.insert("truck-0".into(), 5_000);
    flush(&t).await;

    server.stop();
    // Ingest until the hub pushes back; every acknowledged block must survive. A round in
    // between shows uploads failing while the server is down.
    let mut next = 5_001;
    let mut rounds_failed = 0;
    let refused = loop {
        let block = common::block("truck-0", 1, next, next + 99);
        match hub.commit_block("truck-0", "telemetry", &block).await {
            Ok(_) => next += 100,
            Err(e) => break e,
        }
        if next % 50_000 == 1 && t.run_once(true).await.is_err() {
            rounds_failed += 1;
        }
        assert!(next < 2_000_000, "the hub never pushed back");
    };
    assert!(rounds_failed > 0, "rounds must fail while tier 2 is down");
    assert!(
        matches!(refused, IngestError::Unavailable(CommitError::Full(_))),
        "{refused:?}"
    );
    assert!(
        !refused.is_peer_fault(),
        "pushback is retryable, not the device's fault"
    );
    assert!(t.stats().tier2_down.load(Ordering::Relaxed));
    assert!(t.tier1_bytes() >= 3 << 20);
    let acked = next - 1;
    sent.insert("truck-0".into(), acked);
    // Still refused while tier 2 stays down.
    let _ = t.run_once(true).await;
    let again = hub
        .commit_block(
            "truck-0",
            "telemetry",
            &common::block("truck-0", 1, next, next + 99),
        )
        .await;
    assert!(again.is_err());

    server.restart().unwrap();
    // Recovery: rounds succeed again, tier 1 drains below budget, ingest is admitted.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if t.run_once(true).await.is_ok() && t.tier1_bytes() < 3 << 20 {
            break;
        }
        assert!(Instant::now() < deadline, "tier 2 did not recover");
    }
    assert!(!t.stats().tier2_down.load(Ordering::Relaxed));
    ingest(&hub, "truck-0", next, next + 999, 100).await;
    sent.insert("truck-0".into(), next + 999);
    flush(&t).await;
    let (records, _) = tier2_records(&t).await;
    assert_exactly(&records, &sent);
    assert_eq!(hub.tiered_seq("truck-0", "telemetry", 1), next + 999);
    hub.shutdown();
}
