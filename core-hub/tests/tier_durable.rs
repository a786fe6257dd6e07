//! The hub commits a chunk (its `tiered_seq` goes to the agents, tier 1 may be evicted) only
//! behind durable puts: at the last step before the commit transaction (fault point
//! `AfterManifest`) every chunk object and manifest the range wrote to a local tier 2 has had
//! its file synced before the rename into place and its directories synced after it
//! (observed through `tier::Tier2::sync_probe`, feature `fault-injection`: the probe of the
//! hub's storage-backed store, `core_hub::storage::StorageStore`, which writes a `file://`
//! tier 2 through the hub's `Storage` trait). With the file syncs switched off (the mutation
//! check) the same assertions fail.

mod tier_support;

use core_hub::HubConfig;
use core_hub::tiering::{TierFaultHook, TierFaultPoint, Tiering, store};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tier::durable::SyncEvent;
use tier_support::*;

/// A hub in `dir/hub` with tier 2 in `dir/tier2`, evicting tier 1 as soon as it is tiered.
fn file_config(dir: &Path) -> HubConfig {
    common::config(&dir.join("hub"), |c| {
        c.wal.segment_bytes_max = 16 << 10;
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.join("tier2").display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_budget_bytes = 1 << 40;
        t.tier1_retention_time = Duration::ZERO;
        t.tier1_retention_bytes = 0;
    })
}

/// What the hook saw at the commit points: each put checked there, and the failed checks.
#[derive(Debug, Default)]
struct Seen {
    /// Events of the probe already looked at.
    cursor: usize,
    /// Files whose put had returned, checked durable, before some commit.
    checked: Vec<PathBuf>,
    failures: Vec<String>,
    commits: u64,
}

/// Checks, at every `AfterManifest`, each put that returned since the previous one.
fn hook(tier2: Arc<OnceLock<tier::Tier2>>, seen: Arc<Mutex<Seen>>) -> TierFaultHook {
    Arc::new(move |point| {
        if point != TierFaultPoint::AfterManifest {
            return false;
        }
        let t = tier2.get().expect("tier 2 is set before the first round");
        let probe = t.sync_probe().expect("local tier 2");
        let root = t.local_root().expect("local tier 2");
        let events = probe.events();
        let mut seen = seen.lock().unwrap();
        seen.commits += 1;
        for e in &events[seen.cursor..] {
            if let SyncEvent::PutDone(dest) = e {
                match probe.check_put(root, dest) {
                    Ok(()) => seen.checked.push(dest.clone()),
                    Err(e) => seen.failures.push(e),
                }
            }
        }
        seen.cursor = events.len();
        false
    })
}

/// Ingests, tiers and evicts with the hook installed; `skip_file_syncs` is the mutation.
async fn tier_with_hook(dir: &Path, skip_file_syncs: bool) -> (Seen, Vec<PathBuf>, u64) {
    let cfg = file_config(dir);
    let hub = reopen(&cfg).await;
    let tier2 = Arc::new(OnceLock::new());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let t = Tiering::open(hub.clone(), &cfg, Some(hook(tier2.clone(), seen.clone())))
        .await
        .unwrap();
    t.store()
        .sync_probe()
        .expect("local tier 2")
        .skip_file_syncs(skip_file_syncs);
    tier2.set(t.store().clone()).unwrap();
    ingest(&hub, "truck-1", 1, 3_000, 100).await;
    flush(&t).await;
    let root = t.store().local_root().unwrap().to_path_buf();
    let sid = hub.stream_id("telemetry").unwrap();
    let mut committed = Vec::new();
    for c in store::committed_chunks(hub.catalog(), sid).unwrap() {
        committed.push(root.join(&c.path));
        committed.push(root.join(tier::manifest_path("telemetry", c.segment, c.first_offset)));
    }
    let tiered = hub.tiered_seq("truck-1", "telemetry", 1);
    hub.shutdown();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    (seen, committed, tiered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_commit_only_after_their_object_and_manifest_are_synced() {
    let dir = tempfile::tempdir().unwrap();
    let (seen, committed, tiered) = tier_with_hook(dir.path(), false).await;
    assert!(seen.commits >= 3, "{} commits", seen.commits);
    assert!(seen.failures.is_empty(), "{:?}", seen.failures);
    assert_eq!(tiered, 3_000, "agents were told everything is tiered");
    assert!(!committed.is_empty());
    for f in &committed {
        assert!(
            seen.checked.contains(f),
            "{} was committed without being seen durable first",
            f.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_file_syncs_the_commit_check_fails() {
    let dir = tempfile::tempdir().unwrap();
    let (seen, committed, _) = tier_with_hook(dir.path(), true).await;
    assert!(seen.commits >= 3, "{} commits", seen.commits);
    assert!(!committed.is_empty());
    // Every put of every committed range was caught unsynced.
    assert_eq!(seen.failures.len(), committed.len(), "{:?}", seen.failures);
    assert!(
        seen.failures
            .iter()
            .all(|f| f.contains("file sync missing")),
        "{:?}",
        seen.failures
    );
}
