//! `[tier2] table = "iceberg"`: each stream is an Iceberg table in the embedded SQL catalog,
//! and readers nobody here wrote see every tiered record exactly once.
//!
//! The hub ingests tagged records in batches, tiers each batch as one range (one snapshot),
//! and then pyiceberg (its SqlCatalog on the hub's SQLite file), DuckDB's iceberg extension
//! and polars read the table (`lake_read.py`):
//! - every record once, tags and fields as typed columns, a decimal after integers in a
//!   column of its own (Iceberg does not widen long to double);
//! - one snapshot per range, each carrying `tributary.tiered-end`; time travel to an earlier
//!   snapshot returns exactly what was committed then;
//! - a crash after the Iceberg commit and before the hub's catalog commit (the fault point
//!   `AfterTableCommit`, counted) re-runs the range, finds it in the table and appends nothing;
//!   with that check switched off (the `fault-injection` mutation) the table holds the range twice;
//! - retention by size drops the oldest range in a `delete` snapshot, time travel to before it
//!   still reads every record, and upkeep with no snapshot retention expires the older
//!   snapshots and removes exactly what only they referenced (no orphan left); judging orphans
//!   by the current snapshot alone (the mutation) breaks time travel.
//!
//! Needs the interpreter `.ci/test` prepares (`TRIBUTARY_LAKE_PYTHON`, by default
//! `/opt/tributary-lake/bin/python`, with pyiceberg, duckdb + its iceberg extension, polars).

mod tier_support;

use core_hub::config::TableFormat;
use core_hub::tiering::{TierFaultPoint, TierRunError, Tiering};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use sync::block::{VERSION_TAGGED, encode_block};
use sync::{Record, Value};
use tier_support::*;

const STREAM: &str = "telemetry";

fn python() -> String {
    std::env::var("TRIBUTARY_LAKE_PYTHON")
        .unwrap_or_else(|_| "/opt/tributary-lake/bin/python".into())
}

/// Record `seq` of `dev`: a `site` tag, an integer `temp` (a decimal from `decimal_from` on)
/// and a string field.
fn record(dev: &str, seq: u64, decimal_from: u64) -> Record {
    let temp = if seq >= decimal_from {
        Value::F64(20.5 + seq as f64)
    } else {
        Value::I64(20 + seq as i64)
    };
    let site = format!("site-{}", seq % 3);
    Record {
        key: format!("{dev}/{site}"),
        tags: vec![("site".into(), site)],
        ts: 1_764_374_400_000_000_000 + seq as i64 * 1_000_000,
        fields: vec![
            ("temp".into(), temp),
            ("state".into(), Value::Str(format!("s{seq}"))),
        ],
    }
}

fn config(dir: &Path) -> core_hub::HubConfig {
    let root = dir.join("tier2");
    common::config(&dir.join("hub"), |c| {
        let t = &mut c.tier2;
        t.url = format!("file://{}", root.display());
        t.scheme = "file".into();
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_budget_bytes = 1 << 40;
        t.table = TableFormat::Iceberg;
        t.iceberg_catalog = tier::table::CatalogLocation::Sqlite(dir.join("iceberg.sqlite"));
    })
}

/// Ships records `first..=last` of `dev` as one block.
async fn ship(hub: &core_hub::Hub, dev: &str, first: u64, last: u64, decimal_from: u64) {
    let recs: Vec<Record> = (first..=last)
        .map(|s| record(dev, s, decimal_from))
        .collect();
    let block = encode_block(VERSION_TAGGED, 1, first, &recs).unwrap();
    hub.commit_block(dev, STREAM, &block).await.unwrap();
}

/// What `lake_read.py` reports about the stream's table.
fn read_lake(dir: &Path) -> serde_json::Value {
    try_read_lake(dir).unwrap_or_else(|e| panic!("lake_read.py failed: {e}"))
}

/// [`read_lake`], or what the readers printed when they failed.
fn try_read_lake(dir: &Path) -> Result<serde_json::Value, String> {
    let uri = format!("sqlite:///{}", dir.join("iceberg.sqlite").display());
    try_read_lake_in(&uri, dir)
}

/// What the readers report with pyiceberg's catalog at the SQLAlchemy URI `uri`.
fn try_read_lake_in(uri: &str, dir: &Path) -> Result<serde_json::Value, String> {
    let warehouse = format!("file://{}", dir.join("tier2").display());
    lake_reader(uri, &warehouse, None)
}

/// Runs `lake_read.py`; `s3`: `endpoint,access_key,secret_key` of an S3 tier 2.
fn lake_reader(uri: &str, warehouse: &str, s3: Option<&str>) -> Result<serde_json::Value, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/lake_read.py");
    let mut cmd = std::process::Command::new(python());
    cmd.args([script, uri, warehouse, STREAM]);
    if let Some(s3) = s3 {
        cmd.env("TRIBUTARY_LAKE_S3", s3);
    }
    let out = (cmd.output()).unwrap_or_else(|e| panic!("{} (prepared by .ci/test): {e}", python()));
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&out.stdout).expect("lake_read.py prints one JSON object"))
}

fn rows(v: &serde_json::Value) -> Vec<(String, u64, u64)> {
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r[0].as_str().unwrap().to_owned(),
                r[1].as_u64().unwrap(),
                r[2].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_is_in_the_table_once_with_typed_columns_and_snapshots_per_range() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let (hub, t) = open(&cfg).await;
    // Three ranges: integers, then integers and decimals, then a second device.
    ship(&hub, "dev-1", 1, 40, u64::MAX).await;
    flush(&t).await;
    ship(&hub, "dev-1", 41, 80, 61).await;
    flush(&t).await;
    ship(&hub, "dev-2", 1, 25, u64::MAX).await;
    flush(&t).await;

    let v = read_lake(dir.path());
    let got = rows(&v);
    let mut want: Vec<(String, u64)> = (1..=80).map(|s| ("dev-1".to_owned(), s)).collect();
    want.extend((1..=25).map(|s| ("dev-2".to_owned(), s)));
    want.sort();
    let got_keys: Vec<(String, u64)> = got.iter().map(|(d, s, _)| (d.clone(), *s)).collect();
    assert_eq!(got_keys, want, "pyiceberg: every record exactly once");
    let offsets: std::collections::BTreeSet<u64> = got.iter().map(|r| r.2).collect();
    assert_eq!(offsets.len(), 105, "hub offsets are distinct");

    let cols = &v["columns"];
    assert_eq!(cols["site"], "string", "the tag is a string column: {cols}");
    assert_eq!(cols["temp"], "long", "integers keep a long column: {cols}");
    assert_eq!(
        cols["temp__f64"], "double",
        "decimals get their own column: {cols}"
    );
    assert_eq!(cols["state"], "string");
    assert_eq!(cols["ts"], "timestamptz");

    let snaps = v["snapshots"].as_array().unwrap();
    assert_eq!(snaps.len(), 3, "one snapshot per range: {snaps:?}");
    let ends: Vec<u64> = snaps
        .iter()
        .map(|s| s["tiered_end"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ends,
        vec![40, 80, 105],
        "each snapshot records the range end"
    );
    for (s, end) in snaps.iter().zip(&ends) {
        let held: Vec<u64> = s["offsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(
            held,
            (0..*end).collect::<Vec<_>>(),
            "time travel to the snapshot of end {end}"
        );
    }
    assert_eq!(v["duckdb"]["rows"], 105, "DuckDB iceberg_scan");
    assert_eq!(v["duckdb"]["distinct_offsets"], 105);
    assert_eq!(v["polars_rows"], 105, "polars scan_iceberg");
    for f in v["data_files"].as_array().unwrap() {
        let f = f.as_str().unwrap();
        assert!(
            f.contains("/streams/telemetry/ingest_date=") && f.ends_with(".parquet"),
            "data files are the chunk files: {f}"
        );
    }
    drop((hub, t));
}

/// A hub whose tiering fails once at `AfterTableCommit` (counted).
async fn open_failing_once(
    cfg: &core_hub::HubConfig,
    hits: Arc<AtomicU64>,
) -> (Arc<core_hub::Hub>, Arc<Tiering>) {
    let hub = reopen(cfg).await;
    let fired = Arc::new(AtomicU64::new(0));
    let hook: core_hub::tiering::TierFaultHook = Arc::new(move |p| {
        p == TierFaultPoint::AfterTableCommit && fired.fetch_add(1, Ordering::SeqCst) == 0 && {
            hits.fetch_add(1, Ordering::SeqCst);
            true
        }
    });
    let t = Tiering::open(hub.clone(), cfg, Some(hook)).await.unwrap();
    (hub, t)
}

async fn crash_after_table_commit(recheck: bool) -> (serde_json::Value, u64) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let hits = Arc::new(AtomicU64::new(0));
    {
        let (hub, t) = open_failing_once(&cfg, hits.clone()).await;
        ship(&hub, "dev-1", 1, 30, u64::MAX).await;
        match t.run_once(true).await {
            Err(TierRunError::Fault(TierFaultPoint::AfterTableCommit)) => {}
            other => panic!("the round must stop at the fault point, got {other:?}"),
        }
        // The hub's catalog did not move: the range is still to tier.
        let stream = hub.stream_id(STREAM).unwrap();
        let st = core_hub::tiering::store::state(hub.catalog(), stream).unwrap();
        assert_eq!(
            st.tiered_end, 0,
            "tiered_end moves only with the hub's catalog commit"
        );
    }
    // A restart re-runs the range.
    let hub = reopen(&cfg).await;
    let t = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    t.set_table_recheck(recheck);
    flush(&t).await;
    let stream = hub.stream_id(STREAM).unwrap();
    let st = core_hub::tiering::store::state(hub.catalog(), stream).unwrap();
    assert_eq!(st.tiered_end, 30);
    let stats = t.stats();
    let (commits, skipped) = (
        stats.lake_commits.load(Ordering::Relaxed),
        stats.lake_ranges_already_committed.load(Ordering::Relaxed),
    );
    let want = if recheck { (0, 1) } else { (1, 0) };
    assert_eq!((commits, skipped), want, "counted as a skipped commit");
    (read_lake(dir.path()), hits.load(Ordering::SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_table_commit_and_the_catalog_commit_appends_nothing_twice() {
    let (v, hits) = crash_after_table_commit(true).await;
    assert_eq!(hits, 1, "the fault landed once");
    let got = rows(&v);
    assert_eq!(got.len(), 30, "each record once after the re-run: {got:?}");
    assert_eq!(
        v["snapshots"].as_array().unwrap().len(),
        1,
        "no second snapshot"
    );
    assert_eq!(v["duckdb"]["rows"], 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_without_the_table_recheck_the_range_lands_twice() {
    let (v, hits) = crash_after_table_commit(false).await;
    assert_eq!(hits, 1);
    assert_eq!(
        rows(&v).len(),
        60,
        "the check is what keeps the re-run out of the table"
    );
}

/// The stream's committed chunks by plan range: (range_first, chunk keys, bytes).
fn ranges(hub: &core_hub::Hub) -> Vec<(u64, Vec<String>, u64)> {
    let sid = hub.stream_id(STREAM).unwrap();
    let mut out: Vec<(u64, Vec<String>, u64)> = Vec::new();
    for c in core_hub::tiering::store::committed_chunks(hub.catalog(), sid).unwrap() {
        match out.last_mut() {
            Some(r) if r.0 == c.range_first => {
                r.1.push(c.path);
                r.2 += c.bytes;
            }
            _ => out.push((c.range_first, vec![c.path], c.bytes)),
        }
    }
    out
}

/// Every object under the table's location that no retained snapshot references.
async fn unreferenced(t: &Tiering) -> Vec<String> {
    let lake = t.lake().expect("an iceberg tier 2");
    let table = lake.table(STREAM).await.unwrap();
    let refs = tier::table::maintain::referenced(&table).await.unwrap();
    let objects = t.store().list("streams/telemetry/").await.unwrap();
    objects
        .into_iter()
        .map(|o| o.path)
        .filter(|k| !refs.contains(&lake.uri(k)))
        .collect()
}

fn upkeep(snapshot_retention: Duration) -> core_hub::config::LakeConfig {
    core_hub::config::LakeConfig {
        commit_interval: Duration::ZERO,
        maintenance_interval: Duration::from_secs(86_400),
        policy: tier::table::MaintainPolicy {
            snapshot_retention,
            orphan_grace: Duration::ZERO,
            deletes_max: 1_000,
        },
    }
}

/// Three ranges tiered, then a round with retention by size that drops the oldest (the
/// round's upkeep runs with a week of snapshot retention, so it expires nothing). Returns the
/// hub, its tiering, the config and the ranges as they were before.
async fn three_ranges_then_retention(
    dir: &Path,
    orphans_see_all_snapshots: bool,
) -> (
    Arc<core_hub::Hub>,
    Arc<Tiering>,
    core_hub::HubConfig,
    Vec<(u64, Vec<String>, u64)>,
) {
    let mut cfg = config(dir);
    cfg.tier2.lake = upkeep(Duration::from_secs(7 * 86_400));
    let (hub, t) = open(&cfg).await;
    ship(&hub, "dev-1", 1, 40, u64::MAX).await;
    flush(&t).await;
    ship(&hub, "dev-1", 41, 80, u64::MAX).await;
    flush(&t).await;
    ship(&hub, "dev-2", 1, 25, u64::MAX).await;
    flush(&t).await;
    let before = ranges(&hub);
    assert_eq!(before.len(), 3, "three ranges: {before:?}");
    let total: u64 = before.iter().map(|r| r.2).sum();
    drop((hub, t));

    cfg.tier2.tier2_retention_bytes = Some(total - before[0].2);
    let (hub, t) = open(&cfg).await;
    t.lake()
        .unwrap()
        .set_orphans_see_all_snapshots(orphans_see_all_snapshots);
    t.run_once(true).await.unwrap();
    let deleted = t.stats().lake_files_deleted.load(Ordering::Relaxed);
    assert_eq!(
        deleted,
        before[0].1.len() as u64,
        "the range's files left the table"
    );
    (hub, t, cfg, before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_whole_files_and_upkeep_expires_snapshots_and_removes_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, t, mut cfg, before) = three_ranges_then_retention(dir.path(), true).await;
    // A `delete` snapshot; the files stay while older snapshots reference them.
    let st = t.stats();
    assert_eq!(st.lake_orphans_removed.load(Ordering::Relaxed), 0);
    assert_eq!(st.lake_maintenance_errors.load(Ordering::Relaxed), 0);
    let first = &before[0].1[0];
    assert!(
        dir.path().join("tier2").join(first).exists(),
        "older snapshots still reference {first}"
    );
    let v = read_lake(dir.path());
    let got: Vec<(String, u64)> = rows(&v).into_iter().map(|(d, s, _)| (d, s)).collect();
    let mut want: Vec<(String, u64)> = (41..=80).map(|s| ("dev-1".to_owned(), s)).collect();
    want.extend((1..=25).map(|s| ("dev-2".to_owned(), s)));
    want.sort();
    assert_eq!(got, want, "the current snapshot holds the rest, each once");
    assert_eq!(v["duckdb"]["rows"], 65, "DuckDB reads the delete snapshot");
    assert_eq!(v["polars_rows"], 65);
    let snaps = v["snapshots"].as_array().unwrap();
    assert_eq!(snaps.len(), 4, "three appends and a delete");
    assert_eq!(
        snaps[3]["tiered_end"], 105,
        "the delete keeps the exactly-once mark"
    );
    assert_eq!(
        snaps[2]["offsets"].as_array().unwrap().len(),
        105,
        "time travel to before the delete still reads every record"
    );
    drop((hub, t));

    // Upkeep with no snapshot retention: only the current snapshot stays, and what only the
    // expired ones referenced (the dropped range's files, their manifest lists) goes.
    cfg.tier2.lake = upkeep(Duration::ZERO);
    let (hub, t) = open(&cfg).await;
    let done = t.maintain_lake(true).await.expect("the upkeep ran");
    assert_eq!(done.snapshots_expired, 3, "{done:?}");
    assert!(done.orphans_removed > before[0].1.len() as u64, "{done:?}");
    for key in &before[0].1 {
        assert!(
            !dir.path().join("tier2").join(key).exists(),
            "{key} is an orphan now"
        );
    }
    assert_eq!(
        unreferenced(&t).await,
        Vec::<String>::new(),
        "no orphan is left"
    );
    let v = read_lake(dir.path());
    assert_eq!(rows(&v).len(), 65, "the current snapshot reads as before");
    assert_eq!(v["duckdb"]["rows"], 65);
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 1);
    let again = t.maintain_lake(true).await.unwrap();
    assert_eq!((again.snapshots_expired, again.orphans_removed), (0, 0));
    drop((hub, t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_orphans_seen_from_the_current_snapshot_only_break_time_travel() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, t, _, before) = three_ranges_then_retention(dir.path(), false).await;
    let removed = t.stats().lake_orphans_removed.load(Ordering::Relaxed);
    assert!(
        removed >= before[0].1.len() as u64,
        "the mutant removed {removed}"
    );
    let err = try_read_lake(dir.path()).expect_err("time travel must lose the dropped files");
    assert!(
        err.contains("snapshot_id=") && err.contains("FileNotFoundError"),
        "time travel to an older snapshot finds its files gone: {err}"
    );
    for key in &before[0].1 {
        assert!(
            !dir.path().join("tier2").join(key).exists(),
            "the mutant removed {key}"
        );
    }
    drop((hub, t));
}

/// Ranges of 40 records, so one round uploads several.
fn small_ranges(dir: &Path) -> core_hub::HubConfig {
    let mut cfg = config(dir);
    cfg.tier2.chunk_records_max = 40;
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_commits_its_ranges_in_one_snapshot_and_a_crash_after_it_appends_only_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_ranges(dir.path());
    let hits = Arc::new(AtomicU64::new(0));
    {
        // Two ranges in one round; the round dies after the snapshot, before the hub commits.
        let (hub, t) = open_failing_once(&cfg, hits.clone()).await;
        ship(&hub, "dev-1", 1, 40, u64::MAX).await;
        ship(&hub, "dev-1", 41, 80, u64::MAX).await;
        match t.run_once(true).await {
            Err(TierRunError::Fault(TierFaultPoint::AfterTableCommit)) => {}
            other => panic!("the round must stop at the fault point, got {other:?}"),
        }
        // A third range arrives before the restart.
        ship(&hub, "dev-2", 1, 25, u64::MAX).await;
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1, "the fault landed once");
    let v = read_lake(dir.path());
    let snaps = v["snapshots"].as_array().unwrap();
    assert_eq!(snaps.len(), 1, "two ranges, one snapshot: {snaps:?}");
    assert_eq!(snaps[0]["tiered_end"], 80);
    assert_eq!(rows(&v).len(), 80);

    // The restart's round holds all three ranges; the table already has the first two.
    let (hub, t) = open(&cfg).await;
    flush(&t).await;
    let st =
        core_hub::tiering::store::state(hub.catalog(), hub.stream_id(STREAM).unwrap()).unwrap();
    assert_eq!(st.tiered_end, 105);
    let v = read_lake(dir.path());
    let mut want: Vec<(String, u64)> = (1..=80).map(|s| ("dev-1".to_owned(), s)).collect();
    want.extend((1..=25).map(|s| ("dev-2".to_owned(), s)));
    want.sort();
    let got: Vec<(String, u64)> = rows(&v).into_iter().map(|(d, s, _)| (d, s)).collect();
    assert_eq!(got, want, "each record once");
    let ends: Vec<u64> = (v["snapshots"].as_array().unwrap().iter())
        .map(|s| s["tiered_end"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ends,
        vec![80, 105],
        "the re-run appended the third range alone"
    );
    assert_eq!(v["duckdb"]["rows"], 105);
    drop((hub, t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_hub_registers_the_table_again_and_appends_what_it_lacked() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    {
        let (hub, t) = open(&cfg).await;
        ship(&hub, "dev-1", 1, 40, u64::MAX).await;
        flush(&t).await;
        ship(&hub, "dev-1", 41, 80, u64::MAX).await;
        flush(&t).await;
        drop(t);
        // The third range's files and manifests are durable, the snapshot never happened.
        let hits = Arc::new(AtomicU64::new(0));
        let seen = hits.clone();
        let hook: core_hub::tiering::TierFaultHook = Arc::new(move |p| {
            p == TierFaultPoint::AfterManifest && seen.fetch_add(1, Ordering::SeqCst) == 0
        });
        let t = Tiering::open(hub.clone(), &cfg, Some(hook)).await.unwrap();
        ship(&hub, "dev-2", 1, 25, u64::MAX).await;
        match t.run_once(true).await {
            Err(TierRunError::Fault(TierFaultPoint::AfterManifest)) => {}
            other => panic!("the round must stop at the fault point, got {other:?}"),
        }
        assert_eq!(hits.load(Ordering::SeqCst), 1, "the fault landed");
        hub.shutdown();
    }
    // The disk is lost: the hub's data and the Iceberg catalog with it.
    std::fs::remove_dir_all(dir.path().join("hub")).unwrap();
    std::fs::remove_file(dir.path().join("iceberg.sqlite")).unwrap();
    core_hub::tiering::recover::from_tier2(&cfg, |_, _, _| {})
        .await
        .unwrap();
    let (hub, t) = open(&cfg).await;
    let st =
        core_hub::tiering::store::state(hub.catalog(), hub.stream_id(STREAM).unwrap()).unwrap();
    assert_eq!(
        st.tiered_end, 105,
        "the rebuilt catalog counts the third range tiered"
    );
    let v = read_lake(dir.path());
    let mut want: Vec<(String, u64)> = (1..=80).map(|s| ("dev-1".to_owned(), s)).collect();
    want.extend((1..=25).map(|s| ("dev-2".to_owned(), s)));
    want.sort();
    let got: Vec<(String, u64)> = rows(&v).into_iter().map(|(d, s, _)| (d, s)).collect();
    assert_eq!(
        got, want,
        "the table is back, with the range it lacked, each record once"
    );
    let ends: Vec<u64> = (v["snapshots"].as_array().unwrap().iter())
        .map(|s| s["tiered_end"].as_u64().unwrap())
        .collect();
    assert_eq!(
        ends,
        vec![40, 80, 105],
        "its history is kept, the missing range appended"
    );
    // Tiering goes on from there.
    ship(&hub, "dev-2", 26, 30, u64::MAX).await;
    flush(&t).await;
    assert_eq!(rows(&read_lake(dir.path())).len(), 110);
    drop((hub, t));
}

// ---- kill -9 while tiering, committing and maintaining ----

const KILL_DIR_ENV: &str = "TRIBUTARY_LAKE_KILL9_DIR";
const KILL_TOTAL_ENV: &str = "TRIBUTARY_LAKE_KILL9_TOTAL";
const KILL_MUTANT_ENV: &str = "TRIBUTARY_LAKE_KILL9_NO_RECHECK";
const KILL_DEVICES: u64 = 3;

/// The crash loop's hub: ranges of 30 records, a commit and a full upkeep (expiry of every
/// older snapshot, orphan removal) after every round.
fn kill_config(dir: &Path) -> core_hub::HubConfig {
    let mut cfg = config(dir);
    cfg.tier2.chunk_records_max = 30;
    cfg.tier2.chunk_age_max = Duration::ZERO;
    cfg.tier2.lake = core_hub::config::LakeConfig {
        commit_interval: Duration::ZERO,
        maintenance_interval: Duration::ZERO,
        policy: tier::table::MaintainPolicy {
            snapshot_retention: Duration::ZERO,
            orphan_grace: Duration::ZERO,
            deletes_max: 1_000,
        },
    };
    cfg
}

/// The child: a hub whose tiering loop runs rounds back to back while three devices write
/// (each resuming a little before its mark); prints `ACK`, `ROUND` and, once every record is
/// tiered and maintained, `DONE`. Runs only when the parent sets `TRIBUTARY_LAKE_KILL9_DIR`.
#[test]
fn child_lake_writer() {
    let Ok(dir) = std::env::var(KILL_DIR_ENV) else {
        return;
    };
    let total: u64 = std::env::var(KILL_TOTAL_ENV).unwrap().parse().unwrap();
    let rt = common::child_runtime();
    rt.block_on(async move {
        let cfg = kill_config(Path::new(&dir));
        let hub = reopen(&cfg).await;
        let hook = core_hub::tiering::faults::hook_from_env();
        let t = Tiering::open(hub.clone(), &cfg, hook).await.unwrap();
        // The mutation of `mutation_the_crash_loop_catches_a_missing_table_recheck`.
        t.set_table_recheck(std::env::var(KILL_MUTANT_ENV).is_err());
        let rounds = {
            let t = t.clone();
            tokio::spawn(async move {
                loop {
                    let r = t.run_once(false).await.unwrap();
                    if r.chunks_committed > 0 {
                        println!("ROUND");
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        let mut writers = Vec::new();
        for d in 0..KILL_DEVICES {
            let hub = hub.clone();
            writers.push(tokio::spawn(async move {
                let dev = format!("dev-{d}");
                let mark = hub.marks(&dev).first().map_or(0, |m| m.durable_seq);
                let mut first = mark.saturating_sub(7).max(1);
                while first <= total {
                    let last = (first + 4 + d).min(total);
                    ship(&hub, &dev, first, last, u64::MAX).await;
                    println!("ACK {dev} {last}");
                    first = last + 1;
                    // Paced, so that rounds commit while the devices write.
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
            }));
        }
        for w in writers {
            w.await.unwrap();
        }
        rounds.abort();
        let _ = rounds.await;
        flush(&t).await;
        t.maintain_lake(true).await.expect("the upkeep ran");
        println!("DONE");
    });
}

/// How a child life ends.
#[derive(Debug, Clone)]
enum End {
    /// SIGKILL from the parent after this many committing rounds.
    KillAfterRounds(usize),
    /// The child exits at this tiering fault point (`TRIBUTARY_TIER_FAULT`, `point:exit:skip`).
    Seam(&'static str, u64),
    /// It finishes: every record written, tiered and maintained.
    Finish,
}

const SEAMS: [&str; 4] = [
    "after_upload",
    "after_manifest",
    "after_table_commit",
    "before_evict",
];

/// What one child life did before it ended.
struct Life {
    rounds: usize,
    killed: bool,
    /// The fault point it exited at.
    seam: Option<&'static str>,
}

fn run_lake_child(dir: &Path, total: u64, end: &End, mutant: bool) -> Life {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child_lake_writer",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(KILL_DIR_ENV, dir)
    .env(KILL_TOTAL_ENV, total.to_string())
    .env_remove(core_hub::tiering::faults::FAULT_ENV)
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::null());
    if let End::Seam(point, skip) = end {
        cmd.env(
            core_hub::tiering::faults::FAULT_ENV,
            format!("{point}:exit:{skip}"),
        );
    }
    if mutant {
        cmd.env(KILL_MUTANT_ENV, "1");
    }
    let mut child = cmd.spawn().unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut rounds = 0;
    let mut done = false;
    for line in out.lines() {
        let line = line.unwrap();
        done |= line == "DONE";
        rounds += usize::from(line == "ROUND");
        if matches!(end, End::KillAfterRounds(k) if rounds >= *k) {
            child.kill().unwrap(); // SIGKILL
            break;
        }
    }
    let status = child.wait().unwrap();
    let exited_at_seam = status.code() == Some(core_hub::tiering::faults::FAULT_EXIT_CODE);
    if matches!(end, End::Finish) {
        assert!(status.success() && done, "the final child must finish");
    }
    Life {
        rounds,
        killed: std::os::unix::process::ExitStatusExt::signal(&status) == Some(9),
        seam: match end {
            End::Seam(point, _) if exited_at_seam => Some(point),
            _ => None,
        },
    }
}

/// What a crash loop left.
struct Loop {
    seed: u64,
    total: u64,
    killed_while_tiering: u64,
    seams: std::collections::BTreeMap<&'static str, u64>,
}

/// `lives` child lives in `dir`, alternating a random SIGKILL after one to three committing
/// rounds with an exit at each fault point in turn (after zero to two earlier hits), then a
/// last life that finishes.
fn crash_loop(dir: &Path, lives: u64, mutant: bool) -> Loop {
    let seed = common::seed();
    println!(
        "seed {seed} (replay: TRIBUTARY_SEED={seed} cargo test -p core-hub --test tier_iceberg kill_dash_nine)"
    );
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    let step = 300u64;
    let mut out = Loop {
        seed,
        total: step * (lives + 1),
        killed_while_tiering: 0,
        seams: Default::default(),
    };
    for k in 0..lives {
        let end = if k % 2 == 0 {
            End::KillAfterRounds(rand::Rng::random_range(&mut rng, 1..4))
        } else {
            let point = SEAMS[(k as usize / 2) % SEAMS.len()];
            End::Seam(point, rand::Rng::random_range(&mut rng, 0..3))
        };
        let life = run_lake_child(dir, step * (k + 1), &end, mutant);
        out.killed_while_tiering += u64::from(life.killed && life.rounds > 0);
        if let Some(point) = life.seam {
            *out.seams.entry(point).or_default() += 1;
        }
    }
    run_lake_child(dir, out.total, &End::Finish, mutant);
    out
}

#[test]
fn kill_dash_nine_while_tiering_committing_and_maintaining_keeps_the_table_exactly_once() {
    if std::env::var(KILL_DIR_ENV).is_ok() {
        return; // we are the child
    }
    let lives: u64 = if common::soak() { 200 } else { 30 };
    let dir = tempfile::tempdir().unwrap();
    let l = crash_loop(dir.path(), lives, false);
    let seed = l.seed;
    println!(
        "{} kills after rounds had committed, exits at seams {:?} (seed {seed})",
        l.killed_while_tiering, l.seams
    );
    // Half the lives are random kills; a child that finished its share first is possible.
    assert!(
        l.killed_while_tiering * 2 >= lives / 2,
        "most kills land while rounds commit: {} (seed {seed})",
        l.killed_while_tiering
    );
    for point in SEAMS {
        assert!(
            l.seams.get(point).is_some_and(|&n| n > 0),
            "the crash at {point} happened: {:?} (seed {seed})",
            l.seams
        );
    }

    let v = read_lake(dir.path());
    let got = rows(&v);
    let mut want: Vec<(String, u64)> = (0..KILL_DEVICES)
        .flat_map(|d| (1..=l.total).map(move |s| (format!("dev-{d}"), s)))
        .collect();
    want.sort();
    let keys: Vec<(String, u64)> = got.iter().map(|(d, s, _)| (d.clone(), *s)).collect();
    assert_eq!(
        keys, want,
        "every record in the table exactly once (seed {seed})"
    );
    let offsets: std::collections::BTreeSet<u64> = got.iter().map(|r| r.2).collect();
    assert_eq!(
        offsets.len(),
        got.len(),
        "distinct hub offsets (seed {seed})"
    );
    let files: Vec<&str> = (v["data_files"].as_array().unwrap().iter())
        .map(|f| f.as_str().unwrap())
        .collect();
    let distinct: std::collections::BTreeSet<&str> = files.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        files.len(),
        "no data file is referenced twice (seed {seed})"
    );
    assert_eq!(
        v["duckdb"]["rows"],
        got.len(),
        "DuckDB agrees (seed {seed})"
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (hub, t) = open(&kill_config(dir.path())).await;
        let st =
            core_hub::tiering::store::state(hub.catalog(), hub.stream_id(STREAM).unwrap()).unwrap();
        assert_eq!(
            st.tiered_end,
            got.len() as u64,
            "the hub and the table agree (seed {seed})"
        );
        assert_eq!(
            unreferenced(&t).await,
            Vec::<String>::new(),
            "no orphan is left (seed {seed})"
        );
        drop((hub, t));
    });
}

#[test]
fn mutation_the_crash_loop_catches_a_missing_table_recheck() {
    if std::env::var(KILL_DIR_ENV).is_ok() {
        return; // we are the child
    }
    // Eight lives reach `after_table_commit` once (life 5); without the recheck its re-run
    // appends the range a second time.
    let dir = tempfile::tempdir().unwrap();
    let l = crash_loop(dir.path(), 8, true);
    assert_eq!(l.seams.get("after_table_commit"), Some(&1), "{:?}", l.seams);
    let v = read_lake(dir.path());
    let n = rows(&v).len() as u64;
    assert!(
        n > l.total * KILL_DEVICES,
        "the table holds a range twice: {n} rows for {} records (seed {})",
        l.total * KILL_DEVICES,
        l.seed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_catalog_serves_the_same_tables_and_survives_a_server_restart() {
    let pg = tier::testing::postgres::Postgres::start()
        .expect("a PostgreSQL server (`.ci/test` installs Debian's postgresql)");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.tier2.iceberg_catalog = tier::table::CatalogLocation::Postgres(pg.url());
    let uri = format!(
        "postgresql+psycopg2://postgres@127.0.0.1:{}/{}",
        pg.port(),
        tier::testing::postgres::DATABASE
    );
    let (hub, t) = open(&cfg).await;
    ship(&hub, "dev-1", 1, 40, u64::MAX).await;
    flush(&t).await;
    ship(&hub, "dev-1", 41, 80, u64::MAX).await;
    flush(&t).await;
    assert!(
        !dir.path().join("iceberg.sqlite").exists(),
        "no SQLite catalog beside the hub"
    );
    let v = try_read_lake_in(&uri, dir.path()).unwrap();
    assert_eq!(rows(&v).len(), 80, "pyiceberg through PostgreSQL");
    assert_eq!(v["duckdb"]["rows"], 80);
    assert_eq!(v["polars_rows"], 80);
    assert_eq!(v["columns"]["site"], "string");
    let snaps = v["snapshots"].as_array().unwrap();
    assert_eq!(snaps.len(), 2);
    assert_eq!(
        snaps[0]["offsets"].as_array().unwrap().len(),
        40,
        "time travel"
    );

    // The server restarts under the hub: the next commit connects again.
    pg.restart().unwrap();
    ship(&hub, "dev-2", 1, 25, u64::MAX).await;
    flush(&t).await;
    drop((hub, t));
    // A restarted hub finds its tables in PostgreSQL.
    let (hub, t) = open(&cfg).await;
    ship(&hub, "dev-2", 26, 30, u64::MAX).await;
    flush(&t).await;
    let v = try_read_lake_in(&uri, dir.path()).unwrap();
    let mut want: Vec<(String, u64)> = (1..=80).map(|s| ("dev-1".to_owned(), s)).collect();
    want.extend((1..=30).map(|s| ("dev-2".to_owned(), s)));
    want.sort();
    let got: Vec<(String, u64)> = rows(&v).into_iter().map(|(d, s, _)| (d, s)).collect();
    assert_eq!(got, want, "every record once");
    let ends: Vec<u64> = (v["snapshots"].as_array().unwrap().iter())
        .map(|s| s["tiered_end"].as_u64().unwrap())
        .collect();
    assert_eq!(ends, vec![40, 80, 105, 110]);
    drop((hub, t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_on_an_s3_tier2_read_by_pyiceberg_duckdb_and_polars() {
    let server = s3();
    let dir = tempfile::tempdir().unwrap();
    let catalog = dir.path().join("iceberg.sqlite");
    let cfg = tier_support::config(&dir.path().join("hub"), &server.endpoint(), |c| {
        c.tier2.chunk_records_max = 1_000;
        c.tier2.chunk_age_max = Duration::from_secs(3600);
        c.tier2.table = TableFormat::Iceberg;
        c.tier2.iceberg_catalog = tier::table::CatalogLocation::Sqlite(catalog.clone());
    });
    let (hub, t) = open(&cfg).await;
    ship(&hub, "dev-1", 1, 40, u64::MAX).await;
    flush(&t).await;
    ship(&hub, "dev-1", 41, 80, 61).await;
    flush(&t).await;
    let keys = format!(
        "{},{},{}",
        server.endpoint(),
        tier::testing::ACCESS_KEY,
        tier::testing::SECRET_KEY
    );
    let uri = format!("sqlite:///{}", catalog.display());
    let warehouse = format!("s3://{}", tier::testing::BUCKET);
    let v = lake_reader(&uri, &warehouse, Some(&keys)).unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<u64> = rows(&v).into_iter().map(|(_, s, _)| s).collect();
    assert_eq!(
        got,
        (1..=80).collect::<Vec<_>>(),
        "pyiceberg over S3: each record once"
    );
    assert_eq!(v["duckdb"]["rows"], 80, "DuckDB over S3 (httpfs)");
    assert_eq!(v["polars_rows"], 80, "polars over S3");
    assert_eq!(v["columns"]["temp__f64"], "double");
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 2);
    for f in v["data_files"].as_array().unwrap() {
        let f = f.as_str().unwrap();
        assert!(f.starts_with("s3://tier2/streams/telemetry/"), "{f}");
    }
    drop((hub, t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_outage_holds_commits_back_and_loses_nothing() {
    let pg = tier::testing::postgres::Postgres::start()
        .expect("a PostgreSQL server (`.ci/test` installs Debian's postgresql)");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.tier2.iceberg_catalog = tier::table::CatalogLocation::Postgres(pg.url());
    cfg.tier2.request_timeout = Duration::from_secs(5);
    let (hub, t) = open(&cfg).await;
    ship(&hub, "dev-1", 1, 40, u64::MAX).await;
    flush(&t).await;

    // The catalog goes away: rounds fail (counted), the hub's catalog does not move, ingest
    // goes on into tier 1.
    pg.stop().unwrap();
    ship(&hub, "dev-1", 41, 80, u64::MAX).await;
    let failed = t.run_once(true).await;
    assert!(failed.is_err(), "no commit without the catalog: {failed:?}");
    assert!(t.stats().round_errors.load(Ordering::Relaxed) >= 1);
    let sid = hub.stream_id(STREAM).unwrap();
    let st = core_hub::tiering::store::state(hub.catalog(), sid).unwrap();
    assert_eq!(
        st.tiered_end, 40,
        "nothing counts as tiered while the table cannot commit"
    );

    // Back: the next rounds commit what waited, once.
    pg.resume().unwrap();
    flush(&t).await;
    let st = core_hub::tiering::store::state(hub.catalog(), sid).unwrap();
    assert_eq!(st.tiered_end, 80);
    let uri = format!(
        "postgresql+psycopg2://postgres@127.0.0.1:{}/{}",
        pg.port(),
        tier::testing::postgres::DATABASE
    );
    let v = try_read_lake_in(&uri, dir.path()).unwrap();
    let got: Vec<u64> = rows(&v).into_iter().map(|(_, s, _)| s).collect();
    assert_eq!(got, (1..=80).collect::<Vec<_>>(), "each record once");
    let ends: Vec<u64> = (v["snapshots"].as_array().unwrap().iter())
        .map(|s| s["tiered_end"].as_u64().unwrap())
        .collect();
    assert_eq!(ends, vec![40, 80]);
    drop((hub, t));
}
