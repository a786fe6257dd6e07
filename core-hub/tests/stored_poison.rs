//! Stored poison: a block already in the WAL whose records would exceed the decoded-size limit
//! in force (`ingest.block_decoded_bytes_max`) never crash-loops the hub. It is stored under a
//! high limit, the hub restarts with a lower one, and then the readers, the scrubber and
//! tiering each meet it: it is quarantined (`quarantine.json`), counted, never decoded, and
//! every other record is still served and tiered, across further restarts.
//!
//! The quarantine the readers consult is process-wide (one hub per process), so both scenarios
//! run in one test, one after the other.

mod tier_support;

use core_hub::HubConfig;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use tier_support::common::{self, long_key_block};
use tier_support::*;

/// Records whose keys are this long make the heavy block: 2,000 of them decode to 8 MB.
const KEY_LEN: usize = 4000;
const HEAVY: u64 = 2000;
const HIGH: u64 = 64 << 20;
const LOW: u64 = 1 << 20;

/// d1 sends seqs 1..=400, then d2 one heavy block, then d1 seqs 401..=800.
async fn store_with_a_heavy_block(cfg: &HubConfig) {
    let hub = reopen(cfg).await;
    ingest(&hub, "d1", 1, 400, 50).await;
    let heavy = long_key_block("d2", 1, 1, HEAVY, KEY_LEN);
    hub.commit_block("d2", "telemetry", &heavy).await.unwrap();
    ingest(&hub, "d1", 401, 800, 50).await;
    hub.shutdown();
}

fn quarantined(dir: &std::path::Path) -> Vec<core_hub::scrub::Damaged> {
    core_hub::scrub::Quarantine::load(dir).unwrap().list()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_block_over_the_limit_is_quarantined_and_the_rest_served() {
    readers_and_the_scrubber_quarantine_it().await;
    tiering_quarantines_it_and_tiers_the_rest().await;
}

async fn readers_and_the_scrubber_quarantine_it() {
    let dir = tempfile::tempdir().unwrap();
    let at = |limit| common::config(dir.path(), |c| c.ingest.block_decoded_bytes_max = limit);
    store_with_a_heavy_block(&at(HIGH)).await;

    // Restarted with a lower limit: the scrubber reports the block, no record is built.
    let hub = reopen(&at(LOW)).await;
    let names = |_: &core_hub::catalog::BlockRow| (String::new(), String::new());
    let report = core_hub::scrub::scrub_wal(
        hub.catalog(),
        hub.wal_reader(),
        &at(LOW).wal_dir(),
        &names,
        &hub.stored_decode_limits(),
    )
    .unwrap();
    assert_eq!(report.damaged.len(), 1, "{report:?}");
    assert!(report.damaged[0].what.contains("decodes to"), "{report:?}");
    assert_eq!(
        (report.damaged[0].first_seq, report.damaged[0].last_seq),
        (1, HEAVY)
    );

    // A reader meets it: it is quarantined and skipped, everything else is served.
    let got = common::read_all(&hub, "telemetry");
    assert_eq!(got.len(), 800);
    assert!(got.iter().all(|r| r.device == "d1"));
    let seqs: Vec<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=800).collect::<Vec<_>>());
    assert_eq!(hub.stats().stored_quarantined.load(Ordering::Relaxed), 1);
    let metrics = core_hub::metrics::render(&hub);
    assert!(
        metrics.contains("tributary_hub_stored_blocks_quarantined_total 1"),
        "{metrics}"
    );
    let list = quarantined(dir.path());
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].device.as_str(), list[0].first_seq), ("d2", 1));
    // New data keeps flowing.
    ingest(&hub, "d1", 801, 900, 50).await;
    hub.shutdown();
    drop(hub);

    // After another restart the quarantine list alone keeps readers off it.
    let hub = reopen(&at(LOW)).await;
    assert_eq!(common::read_all(&hub, "telemetry").len(), 900);
    assert_eq!(hub.stats().stored_refused.load(Ordering::Relaxed), 0);
}

async fn tiering_quarantines_it_and_tiers_the_rest() {
    let server = s3();
    let dir = tempfile::tempdir().unwrap();
    let at = |limit| {
        config(dir.path(), &server.endpoint(), |c| {
            c.ingest.block_decoded_bytes_max = limit
        })
    };
    store_with_a_heavy_block(&at(HIGH)).await;

    // Restarted with a lower limit, no device connected: tiering runs into the block first.
    let (hub, t) = open(&at(LOW)).await;
    flush(&t).await;
    assert_eq!(hub.stats().stored_quarantined.load(Ordering::Relaxed), 1);
    assert_eq!(quarantined(dir.path()).len(), 1);
    let (records, _) = tier2_records(&t).await;
    let mut seen = BTreeMap::new();
    for r in &records {
        assert_eq!(r.device, "d1", "the quarantined block was tiered");
        *seen.entry(r.seq).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 800, "every other record is tiered");
    assert!(seen.values().all(|&n| n == 1), "tiered once each");
    assert_eq!(hub.tiered_seq("d1", "telemetry", 1), 800);

    // The hub keeps serving: more data commits and tiers, across another restart.
    ingest(&hub, "d1", 801, 900, 50).await;
    hub.shutdown();
    drop((hub, t));
    let (hub, t) = open(&at(LOW)).await;
    flush(&t).await;
    assert_eq!(hub.tiered_seq("d1", "telemetry", 1), 900);
    assert_eq!(hub.stats().stored_refused.load(Ordering::Relaxed), 0);
}
