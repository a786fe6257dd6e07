//! Shared helpers of the tier-2 tests: a hub whose tier 2 is an s3s-fs server on loopback,
//! ingest of deterministic telemetry, and checks over what tier 2 holds.
#![allow(dead_code)]

#[path = "../common/mod.rs"]
pub mod common;

use core_hub::tiering::Tiering;
use core_hub::{Hub, HubConfig};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tier::testing::S3sFs;

/// Starts s3s-fs (installed by `.ci/test`).
pub fn s3() -> S3sFs {
    S3sFs::start()
        .expect("s3s-fs must be installed: cargo install s3s-fs@0.14.1 --features binary --locked")
}

/// A hub config in `dir` with tier 2 on `server`, small WAL files and small chunks.
pub fn config(dir: &Path, endpoint: &str, edit: impl FnOnce(&mut HubConfig)) -> HubConfig {
    common::config(dir, |cfg| {
        cfg.wal.segment_bytes_max = 1 << 20;
        let t = &mut cfg.tier2;
        t.url = format!("s3://{}", tier::testing::BUCKET);
        t.scheme = "s3".into();
        t.endpoint = Some(endpoint.to_string());
        t.region = Some("us-east-1".into());
        t.access_key_id = Some(tier::testing::ACCESS_KEY.into());
        t.secret_access_key = Some(tier::testing::SECRET_KEY.into());
        t.chunk_records_max = 5_000;
        t.chunk_bytes_max = 64 << 20;
        t.chunk_age_max = std::time::Duration::from_secs(3600);
        t.tier1_retention_time = std::time::Duration::ZERO;
        t.tier1_retention_bytes = 0;
        t.tier1_budget_bytes = 1 << 40;
        t.request_timeout = std::time::Duration::from_secs(2);
        edit(cfg);
    })
}

/// Opens a hub and its tiering.
pub async fn open(cfg: &HubConfig) -> (Arc<Hub>, Arc<Tiering>) {
    let hub = reopen(cfg).await;
    let t = Tiering::open(hub.clone(), cfg, None).await.unwrap();
    (hub, t)
}

/// Commits `device`'s records `first..=last` in blocks of `size`.
pub async fn ingest(hub: &Hub, device: &str, first: u64, last: u64, size: u64) {
    let mut s = first;
    while s <= last {
        let e = (s + size - 1).min(last);
        hub.commit_block(device, "telemetry", &common::block(device, 1, s, e))
            .await
            .unwrap();
        s = e + 1;
    }
}

/// Runs tiering rounds (sealing everything) until one does nothing.
pub async fn flush(t: &Tiering) {
    for _ in 0..1000 {
        let r = t.run_once(true).await.unwrap();
        if r.ranges_planned == 0 && r.chunks_committed == 0 && r.wal_files_evicted == 0 {
            return;
        }
    }
    panic!("tiering did not settle");
}

/// Every record tier 2 holds for `telemetry`, decoded from the chunk files the manifests
/// name, plus the number of chunk files found by listing `streams/` (what SQL engines see).
pub async fn tier2_records(t: &Tiering) -> (Vec<tier::TierRecord>, usize) {
    let store = t.store();
    let listed = store
        .list("streams/telemetry/")
        .await
        .unwrap()
        .into_iter()
        .filter(|o| o.path.ends_with(".parquet"))
        .collect::<Vec<_>>();
    let mut out = Vec::new();
    for o in &listed {
        out.extend(store.read_chunk(&o.path).await.unwrap());
    }
    out.sort_by_key(|r| r.offset);
    (out, listed.len())
}

/// Asserts tier 2 holds exactly seqs 1..=n of every device in `expect`, once each, with
/// dense offsets from 0 and the content ingested.
pub fn assert_exactly(records: &[tier::TierRecord], expect: &BTreeMap<String, u64>) {
    let mut next: BTreeMap<&str, u64> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r.offset, i as u64, "offsets must be dense and unique");
        let n = next.entry(r.device.as_str()).or_insert(1);
        assert_eq!(r.seq, *n, "device {} seq duplicated or missing", r.device);
        *n += 1;
        let want = common::record(&r.device, r.seq);
        assert_eq!(r.ts_ns, want.ts);
        let mut got = r.fields.clone();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let mut w = want.fields.clone();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, w);
    }
    let total: u64 = expect.values().sum();
    assert_eq!(records.len() as u64, total);
    for (d, n) in expect {
        assert_eq!(next.get(d.as_str()).copied().unwrap_or(1) - 1, *n, "{d}");
    }
}

/// Runs DuckDB (python) over the Parquet files under `root` and returns
/// `(rows, distinct (device, epoch, seq), [(device, avg(temp), count)])`.
pub fn duckdb_summary(root: &Path) -> (u64, u64, Vec<(String, f64, u64)>) {
    let glob = root.join("streams/telemetry/**/*.parquet");
    let script = format!(
        r#"
import duckdb, json
g = {glob:?}
c = duckdb.connect()
rows = c.execute(f"SELECT count(*) FROM read_parquet('{{g}}')").fetchone()[0]
distinct = c.execute(f"SELECT count(*) FROM (SELECT DISTINCT device, epoch, seq FROM read_parquet('{{g}}'))").fetchone()[0]
per = c.execute(f"SELECT device, avg(temp), count(*) FROM read_parquet('{{g}}') GROUP BY device ORDER BY device").fetchall()
print(json.dumps([rows, distinct, per]))
"#,
        glob = glob.display().to_string()
    );
    let v = duckdb_json(&script);
    let per = v[2]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap().to_string(),
                p[1].as_f64().unwrap(),
                p[2].as_u64().unwrap(),
            )
        })
        .collect();
    (v[0].as_u64().unwrap(), v[1].as_u64().unwrap(), per)
}

/// The expected per-device average of `temp` over seqs 1..=n (see `common::record`).
pub fn expected_avg(n: u64) -> f64 {
    (1..=n).map(|s| 20.0 + (s % 100) as f64 / 4.0).sum::<f64>() / n as f64
}

/// Checks the DuckDB view of tier 2 against what was ingested.
pub fn assert_duckdb(root: &Path, expect: &BTreeMap<String, u64>) {
    let (rows, distinct, per) = duckdb_summary(root);
    let total: u64 = expect.values().sum();
    assert_eq!(rows, total, "DuckDB row count");
    assert_eq!(distinct, total, "DuckDB distinct (device, epoch, seq)");
    assert_eq!(per.len(), expect.len());
    for (dev, avg, n) in per {
        assert_eq!(n, expect[&dev], "{dev} count");
        assert!((avg - expected_avg(n)).abs() < 1e-9, "{dev} average {avg}");
    }
}

/// Opens the hub again after a simulated crash. Tasks of the previous instance (spawned on this
/// test's runtime) may still hold it, and with it the data directory's lock, until they next
/// run: yield to them until the lock is free, within a deadline.
pub async fn reopen(cfg: &HubConfig) -> Arc<Hub> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match Hub::open(cfg) {
            Ok(hub) => return hub,
            Err(core_hub::ingest::OpenError::Locked(path)) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{} stayed locked by the previous instance",
                    path.display()
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            Err(e) => panic!("reopening the hub: {e}"),
        }
    }
}

/// Runs a Python script that prints one JSON value with DuckDB, and returns the value.
pub fn duckdb_json(script: &str) -> serde_json::Value {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .expect("python3 with duckdb (pip install duckdb)");
    assert!(
        out.status.success(),
        "duckdb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints one JSON value")
}
