//! Crashes between upload and commit: with fail points in one process, and with `kill -9` of
//! a real hub process (this test binary re-run as a child) while it ingests and tiers.
//! Afterwards tier 2 must hold every record exactly once (decoded, and as DuckDB counts it),
//! because chunk names are fixed in the catalog before upload and a re-upload overwrites.
//!
//! `TRIBUTARY_SOAK=1` raises the number of kills; `TRIBUTARY_SEED=N` replays a run.

mod tier_support;

use core_hub::tiering::{TierFaultPoint, TierRunError, Tiering};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tier_support::*;

const DIR_ENV: &str = "TRIBUTARY_TIER_KILL9_DIR";
const ENDPOINT_ENV: &str = "TRIBUTARY_TIER_KILL9_ENDPOINT";
const TOTAL_ENV: &str = "TRIBUTARY_TIER_KILL9_TOTAL";
const DEVICES: usize = 3;

use common::soak;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_points_between_upload_and_commit() {
    if std::env::var(DIR_ENV).is_ok() {
        return; // we are a kill -9 child
    }
    let server = s3();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &server.endpoint(), |_| {});
    let mut expect = BTreeMap::new();
    {
        let hub = core_hub::Hub::open(&cfg).unwrap();
        for d in 0..DEVICES {
            let dev = format!("truck-{d}");
            ingest(&hub, &dev, 1, 8_000, 111).await;
            expect.insert(dev, 8_000u64);
        }
        // Crash 1: after the objects are uploaded and verified, before any manifest.
        let fail = Arc::new(move |p| p == TierFaultPoint::AfterUpload);
        let t = Tiering::open(hub.clone(), &cfg, Some(fail)).await.unwrap();
        let err = t.run_once(true).await.unwrap_err();
        assert!(matches!(
            err,
            TierRunError::Fault(TierFaultPoint::AfterUpload)
        ));
        let objects = t.store().list("streams/").await.unwrap();
        assert!(!objects.is_empty(), "the first chunk was uploaded");
        assert!(t.store().list("_tributary/").await.unwrap().is_empty());
        assert_eq!(hub.tiered_seq("truck-0", "telemetry", 1), 0);
        hub.shutdown();
    }
    {
        // Crash 2 (after a restart): manifests written, catalog not committed.
        let hub = reopen(&cfg).await;
        let fail = Arc::new(move |p| p == TierFaultPoint::AfterManifest);
        let t = Tiering::open(hub.clone(), &cfg, Some(fail)).await.unwrap();
        let err = t.run_once(true).await.unwrap_err();
        assert!(matches!(
            err,
            TierRunError::Fault(TierFaultPoint::AfterManifest)
        ));
        assert!(!t.store().list("_tributary/").await.unwrap().is_empty());
        assert_eq!(hub.tiered_seq("truck-0", "telemetry", 1), 0);
        // Nothing was evicted: the catalog does not count the chunk as tiered.
        hub.shutdown();
    }
    {
        // Crash 3: a fault after some commits, before eviction.
        let hub = reopen(&cfg).await;
        let hits = Arc::new(AtomicU64::new(0));
        let h = hits.clone();
        let fail = Arc::new(move |p| {
            p == TierFaultPoint::BeforeEvict && h.fetch_add(1, Ordering::SeqCst) == 0
        });
        let t = Tiering::open(hub.clone(), &cfg, Some(fail)).await.unwrap();
        let err = t.run_once(true).await.unwrap_err();
        assert!(matches!(
            err,
            TierRunError::Fault(TierFaultPoint::BeforeEvict)
        ));
        flush(&t).await;
        let (records, files) = tier2_records(&t).await;
        assert_exactly(&records, &expect);
        let manifests = t
            .store()
            .list("_tributary/manifests/telemetry/")
            .await
            .unwrap();
        assert_eq!(files, manifests.len(), "one object per chunk, no leftovers");
        for d in 0..DEVICES {
            assert_eq!(hub.tiered_seq(&format!("truck-{d}"), "telemetry", 1), 8_000);
        }
        hub.shutdown();
    }
    assert_duckdb(&server.bucket_dir(), &expect);
}

/// The child: a hub with tiering running in the background, agents ingesting.
#[test]
fn child_hub() {
    let Ok(dir) = std::env::var(DIR_ENV) else {
        return;
    };
    let endpoint = std::env::var(ENDPOINT_ENV).unwrap();
    let total: u64 = std::env::var(TOTAL_ENV).unwrap().parse().unwrap();
    let rt = common::child_runtime();
    rt.block_on(async move {
        let cfg = config(std::path::Path::new(&dir), &endpoint, |c| {
            c.tier2.chunk_records_max = 700;
            c.tier2.chunk_age_max = std::time::Duration::ZERO;
            c.tier2.poll_interval = std::time::Duration::from_millis(5);
        });
        let hub = reopen(&cfg).await;
        let faults = core_hub::tiering::faults::hook_from_env();
        let t = Tiering::open(hub.clone(), &cfg, faults).await.unwrap();
        let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let _loop = t.spawn(stop_rx);
        // Report every committed chunk, so the parent can kill mid-tiering too.
        let stats = t.stats().clone();
        tokio::spawn(async move {
            let mut seen = 0;
            loop {
                let n = stats.chunks_committed.load(Ordering::Relaxed);
                if n != seen {
                    seen = n;
                    println!("COMMIT {n}");
                }
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        });
        let mut tasks = Vec::new();
        for d in 0..DEVICES {
            let hub = hub.clone();
            tasks.push(tokio::spawn(async move {
                let device = format!("truck-{d}");
                let mark = hub.marks(&device).first().map_or(0, |m| m.durable_seq);
                let size = 50 + d as u64 * 7;
                let mut first = mark + 1;
                while first <= total {
                    let last = (first + size - 1).min(total);
                    hub.commit_block(&device, "telemetry", &common_block(&device, first, last))
                        .await
                        .unwrap();
                    println!("ACK {device} {last}");
                    first = last + 1;
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        println!("DONE");
        // Keep tiering until killed or until everything is tiered.
        loop {
            let done = (0..DEVICES)
                .all(|d| hub.tiered_seq(&format!("truck-{d}"), "telemetry", 1) >= total);
            if done {
                println!("TIERED");
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    });
}

fn common_block(device: &str, first: u64, last: u64) -> Vec<u8> {
    tier_support::common::block(device, 1, first, last)
}

/// Runs a child until `kill_after` acks (SIGKILL) or to the end. `fault` sets the fault env.
fn run_child(
    dir: &std::path::Path,
    endpoint: &str,
    total: u64,
    kill_after: Option<usize>,
    fault: Option<&str>,
) -> (usize, Option<i32>) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child_hub", "--nocapture", "--test-threads=1"])
        .env(DIR_ENV, dir)
        .env(ENDPOINT_ENV, endpoint)
        .env(TOTAL_ENV, total.to_string())
        .env_remove(core_hub::tiering::faults::FAULT_ENV)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(f) = fault {
        cmd.env(core_hub::tiering::faults::FAULT_ENV, f);
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut acks = 0;
    for line in stdout.lines() {
        let line = line.unwrap();
        if line.starts_with("ACK ") || line.starts_with("COMMIT ") {
            acks += 1;
            if kill_after.is_some_and(|k| acks >= k) {
                child.kill().unwrap(); // SIGKILL
                break;
            }
        }
    }
    let status = child.wait().unwrap();
    (acks, status.code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_dash_nine_between_upload_and_commit() {
    if std::env::var(DIR_ENV).is_ok() {
        return;
    }
    let server = s3();
    let endpoint = server.endpoint();
    let seed = common::seed();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let kills = if soak() { 30 } else { 8 };
    // Every child gets new records to ingest (its own step of the total), so each random
    // kill lands while the child still has work, however fast the machine is.
    let step = 3_000u64;
    let total = step * (kills as u64 + 2);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let ep = endpoint.clone();
    tokio::task::spawn_blocking(move || {
        // Exits exactly between upload and commit (the process ends like a crash).
        for (i, point) in ["after_upload", "after_manifest"].iter().enumerate() {
            let (_, code) = run_child(
                &d,
                &ep,
                step,
                None,
                Some(&format!("{point}:exit:{}", i + 1)),
            );
            assert_eq!(
                code,
                Some(core_hub::tiering::faults::FAULT_EXIT_CODE),
                "seed {seed}"
            );
        }
        // SIGKILL at random moments while ingesting and tiering.
        let mut mid = 0;
        for k in 0..kills as u64 {
            // Each device has at least `step / 64` blocks to commit in this child.
            let until = step * (k + 2);
            let (acks, code) = run_child(&d, &ep, until, Some(rng.random_range(2..80)), None);
            // Killed by the signal (no exit code) while it still had work: a real crash.
            if code.is_none() {
                mid += 1;
            }
            println!("child killed after {acks} events ({code:?})");
        }
        assert!(
            mid > 0,
            "no kill landed while the child was running (seed {seed})"
        );
        let (_, code) = run_child(&d, &ep, total, None, None);
        assert_eq!(code, Some(0), "the last child finishes (seed {seed})");
    })
    .await
    .unwrap();

    let cfg = config(dir.path(), &endpoint, |_| {});
    let (hub, t) = open(&cfg).await;
    flush(&t).await;
    let expect: BTreeMap<String, u64> = (0..DEVICES)
        .map(|d| (format!("truck-{d}"), total))
        .collect();
    let (records, files) = tier2_records(&t).await;
    assert_exactly(&records, &expect);
    let manifests = t
        .store()
        .list("_tributary/manifests/telemetry/")
        .await
        .unwrap();
    assert_eq!(files, manifests.len(), "one object per chunk (seed {seed})");
    assert_duckdb(&server.bucket_dir(), &expect);
    hub.shutdown();
}
