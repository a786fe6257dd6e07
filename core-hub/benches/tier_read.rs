//! Cold read-through benchmark: records/s reading a stream from offset 0 when tier 1 holds
//! none of it (every chunk comes from tier 2, an s3s-fs server on loopback), plus the tier-2
//! upload rate of the hub's uploader (encode + PUT + verify + manifest + commit).
//!
//! `cargo bench --profile dev -p core-hub --bench tier_read` (needs s3s-fs, see docs/tiering.md).
//! `TIER_BENCH_RECORDS` sets the record count (default 400000).

use core_hub::tiering::Tiering;
use core_hub::{Hub, HubConfig};
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

fn main() {
    let total: u64 = std::env::var("TIER_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400_000);
    let server = tier::testing::S3sFs::start().expect("s3s-fs");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = HubConfig::with_data_dir(dir.path());
    cfg.wal.segment_bytes_max = 1 << 20;
    cfg.wal.group_commit_linger = Duration::from_micros(500);
    let t = &mut cfg.tier2;
    t.url = format!("s3://{}", tier::testing::BUCKET);
    t.endpoint = Some(server.endpoint());
    t.access_key_id = Some(tier::testing::ACCESS_KEY.into());
    t.secret_access_key = Some(tier::testing::SECRET_KEY.into());
    t.chunk_records_max = 100_000;
    t.tier1_retention_time = Duration::ZERO;
    t.tier1_retention_bytes = 0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let hub = Hub::open(&cfg).unwrap();
        let devices = 8u64;
        let per = total / devices;
        for d in 0..devices {
            let dev = format!("truck-{d}");
            let mut s = 1;
            while s <= per {
                let e = (s + 999).min(per);
                let recs: Vec<Record> = (s..=e).map(|q| record(&dev, q)).collect();
                let block = encode_block(VERSION_ROWS, 1, s, &recs).unwrap();
                hub.commit_block(&dev, "telemetry", &block).await.unwrap();
                s = e + 1;
            }
        }
        let tiering = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
        let start = Instant::now();
        loop {
            let r = tiering.run_once(true).await.unwrap();
            if r.ranges_planned == 0 && r.chunks_committed == 0 && r.wal_files_evicted == 0 {
                break;
            }
        }
        let up = start.elapsed();
        let bytes = tiering
            .stats()
            .bytes_uploaded
            .load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "tier-2 upload (hub uploader, incl. WAL read + Parquet encode): {} records, {} bytes in {:.2?}: {:.0} records/s, {:.1} MB/s",
            per * devices,
            bytes,
            up,
            (per * devices) as f64 / up.as_secs_f64(),
            bytes as f64 / up.as_secs_f64() / 1e6
        );
        let start = Instant::now();
        let mut reader =
            core_hub::tiering::read::TierReader::new(tiering.clone(), "telemetry", None, 0)
                .unwrap();
        let mut n = 0u64;
        loop {
            let page = reader.next_page(50_000).await.unwrap();
            if page.records.is_empty() {
                break;
            }
            n += page.records.len() as u64;
        }
        let el = start.elapsed();
        assert_eq!(n, per * devices);
        println!(
            "cold read-through from tier 2: {n} records in {el:.2?}: {:.0} records/s",
            n as f64 / el.as_secs_f64()
        );
        hub.shutdown();
    });
}
