//! Storage faults in tier 2 (issue 9, "bit flips in Parquet objects"): a chunk object whose
//! bytes rot (a flipped byte) or that gets truncated is detected against the size and crc32c
//! recorded at upload, by read-through and by the tier-2 scrub; it is quarantined (moved out
//! of `streams/`, its rows never served), reported (log, metrics, `/healthz` detail), and
//! repaired from tier 1 when tier 1 still holds its records; every other object keeps serving.
//!
//! Tier 2 is a local directory here, so the test can damage an object on disk.

mod tier_support;

use core_hub::HubConfig;
use core_hub::scrub::{Tier2ScrubConfig, scrub_tier2, tend_tier2_quarantine};
use core_hub::tiering::read::TierReader;
use core_hub::tiering::store;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};
use tier_support::*;

/// A hub in `dir/hub` with tier 2 in `dir/tier2`; `keep_tier1` keeps tiered data in tier 1
/// (repairable), otherwise WAL files are evicted as soon as they are tiered.
fn file_config(dir: &Path, keep_tier1: bool) -> HubConfig {
    common::config(&dir.join("hub"), |c| {
        // Small WAL files, so that tiered ones are evicted while the test still runs.
        c.wal.segment_bytes_max = 16 << 10;
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.join("tier2").display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_budget_bytes = 1 << 40;
        if keep_tier1 {
            t.tier1_retention_time = Duration::from_secs(3600);
            t.tier1_retention_bytes = 1 << 40;
        } else {
            t.tier1_retention_time = Duration::ZERO;
            t.tier1_retention_bytes = 0;
        }
    })
}

/// The committed chunk rows of `telemetry`, oldest first.
fn chunks(hub: &core_hub::Hub) -> Vec<store::ChunkRow> {
    let sid = hub.stream_id("telemetry").unwrap();
    store::committed_chunks(hub.catalog(), sid).unwrap()
}

/// Flips one bit in the middle of the object at `path` under `root`.
fn flip_byte(root: &Path, path: &str) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(root.join(path))
        .unwrap();
    let len = file.metadata().unwrap().len();
    let at = len / 2;
    let mut b = [0u8];
    file.read_exact_at(&mut b, at).unwrap();
    file.write_all_at(&[b[0] ^ 0x04], at).unwrap();
}

/// Every record of `telemetry` read from offset 0 through [`TierReader`], and the chunks it
/// skipped.
async fn read_through(
    t: &std::sync::Arc<core_hub::tiering::Tiering>,
) -> (
    Vec<core_hub::read::ReadRecord>,
    Vec<core_hub::tiering::read::SkippedChunk>,
) {
    let mut reader = TierReader::new(t.clone(), "telemetry", None, 0).unwrap();
    let mut out = Vec::new();
    loop {
        let page = reader.next_page(1_000).await.unwrap();
        if page.records.is_empty() {
            return (out, reader.gaps().to_vec());
        }
        out.extend(page.records);
    }
}

fn ingest_fleet(devices: u64, per_device: u64) -> BTreeMap<String, u64> {
    (0..devices)
        .map(|d| (format!("truck-{d}"), per_device))
        .collect()
}

/// One of `hub`'s tier-2 metrics (each hub has its own).
fn metric(hub: &core_hub::Hub, name: &str) -> u64 {
    let mut text = String::new();
    core_hub::scrub::render_tier2_metrics(hub, &mut text);
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_is_quarantined_and_repaired_from_tier1() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(dir.path(), true);
    let root = dir.path().join("tier2");
    let (hub, t) = open(&cfg).await;
    let expect = ingest_fleet(3, 2_000);
    for (dev, n) in &expect {
        ingest(&hub, dev, 1, *n, 100).await;
    }
    flush(&t).await;
    let rows = chunks(&hub);
    assert!(rows.len() >= 6, "{} chunks", rows.len());
    let sid = hub.stream_id("telemetry").unwrap();
    assert_eq!(
        store::state(hub.catalog(), sid).unwrap().evicted_end,
        0,
        "tier 1 keeps everything (repairable)"
    );
    let victim = rows[2].clone();
    let original = t.store().read_chunk(&victim.path).await.unwrap();
    let corrupt_before = metric(&hub, "tributary_hub_tier2_corrupt_objects_total");
    let repaired_before = metric(&hub, "tributary_hub_tier2_repaired_objects_total");

    flip_byte(&root, &victim.path);
    let scfg = Tier2ScrubConfig {
        interval: Duration::from_secs(3600),
        bytes_per_sec_max: 0,
        ..Tier2ScrubConfig::default()
    };
    let report = scrub_tier2(&t, &scfg, None).await.unwrap();
    assert_eq!(report.damaged, vec![victim.path.clone()], "{report:?}");
    assert_eq!(report.repaired, vec![victim.path.clone()], "{report:?}");
    assert!(report.unrepairable.is_empty(), "{report:?}");
    assert_eq!(report.objects_checked, rows.len() as u64);

    // Reported: metrics and the quarantine record (repaired now, so not in /healthz).
    assert!(metric(&hub, "tributary_hub_tier2_corrupt_objects_total") > corrupt_before);
    assert!(metric(&hub, "tributary_hub_tier2_repaired_objects_total") > repaired_before);
    let q = store::quarantine_list(hub.catalog()).unwrap();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].path, victim.path);
    assert_eq!(q[0].state, store::REPAIRED);
    assert!(q[0].what.contains("crc32c"), "{}", q[0].what);
    // The damaged bytes were kept aside, outside streams/ (SQL engines never read them).
    let aside = t
        .store()
        .list(core_hub::scrub::TIER2_QUARANTINE_PREFIX)
        .await
        .unwrap();
    assert_eq!(aside.len(), 1);
    assert!(aside[0].path.ends_with(&victim.path), "{aside:?}");

    // The repaired object holds the same records under the same name; SQL engines see every
    // record exactly once.
    assert_eq!(t.store().read_chunk(&victim.path).await.unwrap(), original);
    let (records, files) = tier2_records(&t).await;
    assert_eq!(files, rows.len());
    assert_exactly(&records, &expect);

    // A second pass finds nothing, and is paced by its rate bound.
    let total: u64 = chunks(&hub).iter().map(|c| c.bytes).sum();
    let rate = (total * 4).max(1); // about 250 ms
    let started = Instant::now();
    let clean = scrub_tier2(
        &t,
        &Tier2ScrubConfig {
            interval: Duration::from_secs(3600),
            bytes_per_sec_max: rate,
            ..Tier2ScrubConfig::default()
        },
        None,
    )
    .await
    .unwrap();
    assert!(
        clean.damaged.is_empty() && clean.repaired.is_empty(),
        "{clean:?}"
    );
    assert_eq!(clean.bytes_checked, total);
    let floor = Duration::from_secs_f64(total as f64 / rate as f64) - Duration::from_millis(20);
    assert!(
        started.elapsed() >= floor,
        "the pass took {:?}, the rate bound allows no less than {floor:?}",
        started.elapsed()
    );
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_beyond_tier1_is_quarantined_skipped_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(dir.path(), false);
    let root = dir.path().join("tier2");
    let (hub, t) = open(&cfg).await;
    let expect = ingest_fleet(2, 3_000);
    for (dev, n) in &expect {
        ingest(&hub, dev, 1, *n, 100).await;
    }
    flush(&t).await;
    let rows = chunks(&hub);
    assert!(rows.len() >= 6, "{} chunks", rows.len());
    let sid = hub.stream_id("telemetry").unwrap();
    let evicted_end = store::state(hub.catalog(), sid).unwrap().evicted_end;
    assert!(
        evicted_end >= rows[3].end_offset,
        "tier 1 was evicted (evicted_end {evicted_end})"
    );
    let corrupt_before = metric(&hub, "tributary_hub_tier2_corrupt_objects_total");

    // 1. A truncated object, found by read-through: the reader skips it and says so.
    let truncated = rows[1].clone();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join(&truncated.path))
        .unwrap();
    f.set_len(f.metadata().unwrap().len() / 3).unwrap();
    drop(f);
    let (records, gaps) = read_through(&t).await;
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(gaps[0].path, truncated.path);
    assert_eq!(gaps[0].rows, truncated.rows);
    let total: u64 = expect.values().sum();
    assert_eq!(records.len() as u64, total - truncated.rows);
    assert!(
        records
            .iter()
            .all(|r| r.offset < truncated.first_offset || r.offset >= truncated.end_offset),
        "no record of the damaged chunk is served"
    );
    let mut offsets: Vec<u64> = records.iter().map(|r| r.offset).collect();
    offsets.dedup();
    assert_eq!(offsets.len(), records.len(), "no duplicates");
    let q = store::quarantine_list(hub.catalog()).unwrap();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].state, store::QUARANTINED);
    assert!(q[0].what.contains("size"), "{}", q[0].what);
    assert!(metric(&hub, "tributary_hub_tier2_corrupt_objects_total") > corrupt_before);
    assert!(metric(&hub, "tributary_hub_tier2_records_skipped_total") >= truncated.rows);
    let health = core_hub::scrub::health_detail(&hub).join("\n");
    assert!(health.contains(&truncated.path), "{health}");

    // The hub's readers (records API, `core-hub read`) skip it too, without an error.
    let h = hub.clone();
    let all = tokio::task::spawn_blocking(move || common::read_all(&h, "telemetry"))
        .await
        .unwrap();
    assert_eq!(all.len() as u64, total - truncated.rows);

    // 2. A flipped byte, found by the scrub pass: quarantined, not repairable (tier 1 no
    //    longer holds it), moved out of streams/ with the truncated one.
    let flipped = rows[4].clone();
    flip_byte(&root, &flipped.path);
    let report = scrub_tier2(&t, &Tier2ScrubConfig::default(), None)
        .await
        .unwrap();
    assert_eq!(report.damaged, vec![flipped.path.clone()], "{report:?}");
    assert!(report.repaired.is_empty(), "{report:?}");
    assert!(report.unrepairable.contains(&flipped.path), "{report:?}");
    assert!(report.unrepairable.contains(&truncated.path), "{report:?}");
    let listed: Vec<String> = t
        .store()
        .list("streams/telemetry/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.path)
        .collect();
    assert_eq!(listed.len(), rows.len() - 2);
    assert!(!listed.contains(&flipped.path) && !listed.contains(&truncated.path));
    let aside = t
        .store()
        .list(core_hub::scrub::TIER2_QUARANTINE_PREFIX)
        .await
        .unwrap();
    assert_eq!(aside.len(), 2, "{aside:?}");
    assert_eq!(
        metric(&hub, "tributary_hub_tier2_quarantined_objects"),
        2,
        "gauge of what is quarantined now"
    );
    let health = core_hub::scrub::health_detail(&hub).join("\n");
    assert!(health.contains(&flipped.path), "{health}");
    // Another hub in the same process has its own tier 2: none of this is its business.
    let other_dir = tempfile::tempdir().unwrap();
    let (other, _other_t) = open(&file_config(other_dir.path(), true)).await;
    assert_eq!(metric(&other, "tributary_hub_tier2_quarantined_objects"), 0);
    assert_eq!(
        metric(&other, "tributary_hub_tier2_corrupt_objects_total"),
        0
    );
    assert!(core_hub::scrub::health_detail(&other).is_empty());
    other.shutdown();

    // Every other object keeps serving, and tending the quarantine again changes nothing.
    let (records, gaps) = read_through(&t).await;
    assert_eq!(gaps.len(), 2);
    assert_eq!(records.len() as u64, total - truncated.rows - flipped.rows);
    let again = tend_tier2_quarantine(&t).await.unwrap();
    assert!(again.repaired.is_empty());
    assert_eq!(again.unrepairable.len(), 2);
    // Tiering goes on: new data is uploaded and read back past the damaged ranges.
    ingest(&hub, "truck-0", 3_001, 3_500, 100).await;
    flush(&t).await;
    let (records, _) = read_through(&t).await;
    assert_eq!(
        records.len() as u64,
        total + 500 - truncated.rows - flipped.rows
    );
    hub.shutdown();
}

/// The background scrubber ([`core_hub::scrub::start_tier2`], started by `core-hub run`) finds
/// a flipped byte on its own within its interval, repairs it, and stops when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_periodic_scrub_finds_and_repairs_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = file_config(dir.path(), true);
    cfg.tier2.scrub_interval = Duration::from_millis(200);
    cfg.tier2.scrub_bytes_per_sec_max = 64 << 20;
    let root = dir.path().join("tier2");
    let (hub, t) = open(&cfg).await;
    let expect = ingest_fleet(2, 1_500);
    for (dev, n) in &expect {
        ingest(&hub, dev, 1, *n, 100).await;
    }
    flush(&t).await;
    let victim = chunks(&hub)[1].clone();
    flip_byte(&root, &victim.path);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = core_hub::scrub::start_tier2(t.clone(), (&cfg.tier2).into(), stop_rx);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let q = store::quarantine_list(hub.catalog()).unwrap();
        if q.iter()
            .any(|q| q.path == victim.path && q.state == store::REPAIRED)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the scrubber did not repair {} in time: {q:?}",
            victim.path
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (records, files) = tier2_records(&t).await;
    assert_eq!(files, chunks(&hub).len());
    assert_exactly(&records, &expect);
    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the scrubber stops when told")
        .unwrap();
    hub.shutdown();
}

/// A power loss that cost a chunk its unsynced bytes (simulated: the newest chunk file cut to
/// 0 bytes while the hub is stopped) is found by the scrub right after the restart, which
/// checks the chunks committed last before the stop first, not a scrub interval (a day) later,
/// and the chunk is repaired from tier 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_newest_chunks_are_scrubbed_first_and_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = file_config(dir.path(), true);
    cfg.tier2.scrub_interval = Duration::from_secs(24 * 3600);
    let root = dir.path().join("tier2");
    let expect = ingest_fleet(2, 3_000);
    let (victim, original, committed) = {
        let (hub, t) = open(&cfg).await;
        for (dev, n) in &expect {
            ingest(&hub, dev, 1, n / 2, 100).await;
        }
        flush(&t).await;
        // A full pass ran (and is recorded): the next one is a day away.
        let full = scrub_tier2(&t, &Tier2ScrubConfig::default(), None)
            .await
            .unwrap();
        assert!(full.damaged.is_empty(), "{full:?}");
        for (dev, n) in &expect {
            ingest(&hub, dev, n / 2 + 1, *n, 100).await;
        }
        flush(&t).await;
        let rows = chunks(&hub);
        let victim = rows.last().unwrap().clone();
        let original = t.store().read_chunk(&victim.path).await.unwrap();
        hub.shutdown();
        (victim, original, rows.len())
    };
    // While the hub is down: the newest chunk's bytes are gone, as after a power loss that
    // dropped unsynced writes.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join(&victim.path))
        .unwrap();
    f.set_len(0).unwrap();
    drop(f);

    let (hub, t) = open(&cfg).await;
    let runs_before = metric(&hub, "tributary_hub_tier2_scrub_runs_total");
    let recent_before = metric(
        &hub,
        "tributary_hub_tier2_scrub_recent_objects_checked_total",
    );
    let repaired_before = metric(&hub, "tributary_hub_tier2_repaired_objects_total");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = core_hub::scrub::start_tier2(t.clone(), (&cfg.tier2).into(), stop_rx);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let q = store::quarantine_list(hub.catalog()).unwrap();
        if let Some(found) = q
            .iter()
            .find(|q| q.path == victim.path && q.state == store::REPAIRED)
        {
            assert!(found.what.contains("size 0"), "{found:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the scrub after the restart did not repair {} in time: {q:?}",
            victim.path
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(metric(&hub, "tributary_hub_tier2_repaired_objects_total") > repaired_before);
    assert!(
        metric(
            &hub,
            "tributary_hub_tier2_scrub_recent_objects_checked_total"
        ) > recent_before,
        "found by the pass after the start"
    );
    assert_eq!(
        metric(&hub, "tributary_hub_tier2_scrub_runs_total"),
        runs_before,
        "no full pass ran: the next one is a day away"
    );
    assert_eq!(t.store().read_chunk(&victim.path).await.unwrap(), original);
    let (records, files) = tier2_records(&t).await;
    assert_eq!(files, committed);
    assert_exactly(&records, &expect);
    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the scrubber stops when told")
        .unwrap();
    hub.shutdown();
}
