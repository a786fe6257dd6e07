//! Tiering into Iceberg tables next to the plain Parquet layout, on the same records and the
//! same local tier-2 directory:
//! - **throughput**: records/s from tier 1 into committed tier 2 (plan, WAL read, encode,
//!   upload, manifests, and with Iceberg the snapshot), for a backlog of `TIER_BENCH_RECORDS`
//!   records (default 400,000) in ranges of 100,000;
//! - **commit latency**: `TIER_BENCH_ROUNDS` (default 200) rounds of one small range each
//!   (1,000 records), p50 and p99 of the round time per layout; the difference is what the
//!   snapshot costs, measured as the table grows by one snapshot per round.
//!
//! `cargo bench -p core-hub --bench tier_iceberg` (release; the readers are not needed).

use core_hub::config::TableFormat;
use core_hub::tiering::Tiering;
use core_hub::{Hub, HubConfig};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

fn record(device: &str, seq: u64) -> Record {
    Record {
        tags: Vec::new(),
        key: format!("{device}/engine"),
        ts: 1_764_374_400_000_000_000 + seq as i64 * 1_000_000,
        fields: vec![
            ("temp".into(), Value::F64(20.0 + (seq % 100) as f64 / 4.0)),
            ("rpm".into(), Value::I64((seq * 37 % 5000) as i64)),
            ("ok".into(), Value::Bool(seq.is_multiple_of(2))),
        ],
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(dir: &Path, table: TableFormat) -> HubConfig {
    let mut cfg = HubConfig::with_data_dir(dir.join("hub"));
    cfg.wal.segment_bytes_max = 1 << 20;
    cfg.wal.group_commit_linger = Duration::from_micros(500);
    let t = &mut cfg.tier2;
    t.url = format!("file://{}", dir.join("tier2").display());
    t.scheme = "file".into();
    t.chunk_records_max = 100_000;
    t.chunk_age_max = Duration::from_secs(3600);
    t.tier1_retention_time = Duration::ZERO;
    t.tier1_retention_bytes = 0;
    t.table = table;
    t.iceberg_catalog = tier::table::CatalogLocation::Sqlite(dir.join("iceberg.sqlite"));
    cfg
}

/// Commits `device`'s records `first..=last` in blocks of 1,000.
async fn ingest(hub: &Hub, device: &str, first: u64, last: u64) {
    let mut s = first;
    while s <= last {
        let e = (s + 999).min(last);
        let recs: Vec<Record> = (s..=e).map(|q| record(device, q)).collect();
        let block = encode_block(VERSION_ROWS, 1, s, &recs).unwrap();
        hub.commit_block(device, "telemetry", &block).await.unwrap();
        s = e + 1;
    }
}

async fn settle(t: &Tiering) {
    loop {
        let r = t.run_once(true).await.unwrap();
        if r.ranges_planned == 0 && r.chunks_committed == 0 && r.wal_files_evicted == 0 {
            return;
        }
    }
}

/// Records/s of tiering a backlog of `total` records.
async fn throughput(table: TableFormat, total: u64) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), table);
    let hub = Hub::open(&cfg).unwrap();
    let devices = 8;
    for d in 0..devices {
        ingest(&hub, &format!("truck-{d}"), 1, total / devices).await;
    }
    let t = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    let start = Instant::now();
    settle(&t).await;
    let el = start.elapsed();
    let tiered = t
        .stats()
        .records_tiered
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(tiered, total / devices * devices, "every record tiered");
    drop(t);
    hub.shutdown();
    tiered as f64 / el.as_secs_f64()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Round times of `rounds` rounds of one 1,000-record range each.
async fn rounds(table: TableFormat, rounds: u64) -> Vec<Duration> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), table);
    let hub = Hub::open(&cfg).unwrap();
    let t: Arc<Tiering> = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    let mut times = Vec::new();
    for r in 0..rounds {
        ingest(&hub, "truck-0", r * 1000 + 1, (r + 1) * 1000).await;
        let start = Instant::now();
        let report = t.run_once(true).await.unwrap();
        times.push(start.elapsed());
        assert_eq!(report.records_tiered, 1000, "one range per round");
    }
    drop(t);
    hub.shutdown();
    times.sort();
    times
}

fn main() {
    let total = env("TIER_BENCH_RECORDS", 400_000);
    let n = env("TIER_BENCH_ROUNDS", 200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let plain = throughput(TableFormat::Parquet, total).await;
        let lake = throughput(TableFormat::Iceberg, total).await;
        println!(
            "backlog of {total} records: parquet {plain:.0} records/s, iceberg {lake:.0} records/s = {:.0}% of parquet",
            100.0 * lake / plain
        );
        let plain = rounds(TableFormat::Parquet, n).await;
        let lake = rounds(TableFormat::Iceberg, n).await;
        for (name, t) in [("parquet", &plain), ("iceberg", &lake)] {
            println!(
                "{n} rounds of one 1000-record range, {name}: p50 {:.2?}, p99 {:.2?}, max {:.2?}",
                percentile(t, 0.5),
                percentile(t, 0.99),
                t[t.len() - 1]
            );
        }
        println!(
            "snapshot commit (iceberg round - parquet round): p50 {:.2?}, p99 {:.2?}",
            percentile(&lake, 0.5).saturating_sub(percentile(&plain, 0.5)),
            percentile(&lake, 0.99).saturating_sub(percentile(&plain, 0.99)),
        );
    });
}
