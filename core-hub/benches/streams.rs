//! Merged-stream benchmarks (a program, not a timed test): `cargo bench -p core-hub --bench streams`.
//!
//! 1. Follow latency: a follow-mode reader on a hub while a producer commits small blocks at a
//!    steady pace; per block, the time from `commit_block` being called to the reader holding
//!    the records (this includes the group commit's fsync, so it bounds commit -> reader from
//!    above) and from `commit_block` returning (the ack) to the reader (negative when readers
//!    see records before the producer's ack, which the hub allows).
//! 2. Merge + index throughput, one core: routing records into segments as the hub does it,
//!    i.e. the ingest-side key hash and 256-bucket histogram per block plus the reader-side
//!    segment lookup per record (hash point + offset -> segment) on a 4-segment graph.
//! 3. Stream read throughput: a reader scanning 1M committed records from the WAL, decoding,
//!    routing and filtering them (one core).
//!
//! `STREAMS_BENCH_BLOCKS` sets the number of follow-latency blocks (default 2000).

use core_hub::streams::graph::{Graph, NewSegment, ScaleEvent};
use core_hub::streams::hash::HASH_SPACE;
use core_hub::streams::reader::{Start, StreamReader};
use core_hub::streams::{BlockHashes, key_point};
use core_hub::{Hub, HubConfig};
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

fn records(first: u64, n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| Record {
            tags: Vec::new(),
            key: format!("sensor-{}/temp", (first + i as u64) % 4096),
            ts: (first + i as u64) as i64,
            fields: vec![("v".into(), Value::F64(i as f64))],
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn follow_latency(rt: &tokio::runtime::Runtime) {
    let blocks: usize = std::env::var("STREAMS_BENCH_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let dir = tempfile::tempdir().unwrap();
    let hub = Hub::open(&HubConfig::with_data_dir(dir.path())).unwrap();
    rt.block_on(async {
        // The stream must exist before the reader opens it.
        let first = encode_block(VERSION_ROWS, 1, 1, &records(1, 10)).unwrap();
        hub.commit_block("dev", "s", &first).await.unwrap();
        let mut reader = StreamReader::open(hub.clone(), "s", Start::Offset(10), None).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
        let follower = tokio::spawn(async move {
            let mut seen = 0;
            while seen < blocks * 10 {
                reader.wait(Duration::from_secs(5)).await;
                let (r, got) = tokio::task::spawn_blocking(move || {
                    let got = reader.read(100_000).unwrap();
                    (reader, got)
                })
                .await
                .unwrap();
                reader = r;
                let now = Instant::now();
                for rec in got.iter().filter(|r| r.offset % 10 == 0) {
                    let _ = tx.send((rec.offset, now));
                }
                seen += got.len();
            }
        });
        let mut sent = Vec::with_capacity(blocks);
        let mut tick = tokio::time::interval(Duration::from_millis(2));
        for b in 0..blocks as u64 {
            tick.tick().await;
            let seq = 11 + b * 10;
            let block = encode_block(VERSION_ROWS, 1, seq, &records(seq, 10)).unwrap();
            let t0 = Instant::now();
            hub.commit_block("dev", "s", &block).await.unwrap();
            sent.push((t0, Instant::now()));
        }
        follower.await.unwrap();
        let mut from_submit = Vec::new();
        let mut from_ack = Vec::new();
        while let Ok((offset, t)) = rx.try_recv() {
            let i = (offset / 10 - 1) as usize;
            let (t0, t1) = sent[i];
            from_submit.push(t.duration_since(t0).as_secs_f64() * 1e3);
            from_ack.push((t.duration_since(t1).as_secs_f64() - t1.duration_since(t).as_secs_f64()) * 1e3);
        }
        from_submit.sort_by(f64::total_cmp);
        from_ack.sort_by(f64::total_cmp);
        println!(
            "follow latency, {} blocks of 10 records every 2 ms: submit->reader p50 {:.2} ms p99 {:.2} ms max {:.2} ms; ack->reader p50 {:.2} ms p99 {:.2} ms",
            from_submit.len(),
            percentile(&from_submit, 0.5),
            percentile(&from_submit, 0.99),
            from_submit.last().unwrap(),
            percentile(&from_ack, 0.5),
            percentile(&from_ack, 0.99),
        );
    });
    hub.shutdown();
}

fn index_throughput() {
    let half = HASH_SPACE / 2;
    let (g, _) = Graph::initial(0).apply(
        &ScaleEvent {
            at: 0,
            sealed: vec![0],
            created: vec![
                NewSegment {
                    lo: 0,
                    hi: half,
                    preds: vec![0],
                },
                NewSegment {
                    lo: half,
                    hi: HASH_SPACE,
                    preds: vec![0],
                },
            ],
        },
        0,
    );
    let q = HASH_SPACE / 4;
    let (g, _) = g.apply(
        &ScaleEvent {
            at: 1,
            sealed: vec![1, 2],
            created: vec![
                NewSegment {
                    lo: 0,
                    hi: q,
                    preds: vec![1],
                },
                NewSegment {
                    lo: q,
                    hi: half,
                    preds: vec![1],
                },
                NewSegment {
                    lo: half,
                    hi: 3 * q,
                    preds: vec![2],
                },
                NewSegment {
                    lo: 3 * q,
                    hi: HASH_SPACE,
                    preds: vec![2],
                },
            ],
        },
        0,
    );
    let keys: Vec<String> = (0..1000)
        .map(|i| format!("truck-{}/engine/temp", i % 700))
        .collect();
    let n_blocks = 5000;
    let start = Instant::now();
    let mut sink = 0u64;
    for b in 0..n_blocks {
        // Ingest side: one summary per block.
        let h = BlockHashes::of_keys(keys.iter().map(String::as_str));
        sink += u64::from(h.max);
        // Reader side: each record's segment.
        for (i, k) in keys.iter().enumerate() {
            let o = (b * keys.len() + i) as u64 + 1;
            sink += u64::from(g.locate(o, key_point(k)));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let n = (n_blocks * keys.len()) as f64;
    println!(
        "merge+index, one core: {:.2} M records/s (key hash + histogram at ingest, hash + segment lookup at read; {} records, checksum {sink})",
        n / secs / 1e6,
        n as u64
    );
}

fn read_throughput(rt: &tokio::runtime::Runtime) {
    let dir = tempfile::tempdir().unwrap();
    let hub = Hub::open(&HubConfig::with_data_dir(dir.path())).unwrap();
    let total = 1_000_000u64;
    rt.block_on(async {
        let mut seq = 1;
        while seq <= total {
            let block = encode_block(VERSION_ROWS, 1, seq, &records(seq, 5000)).unwrap();
            hub.commit_block("dev", "s", &block).await.unwrap();
            seq += 5000;
        }
    });
    let start = Instant::now();
    let mut reader = StreamReader::open(hub.clone(), "s", Start::Beginning, None).unwrap();
    let mut n = 0;
    loop {
        let page = reader.read(50_000).unwrap();
        if page.is_empty() {
            break;
        }
        n += page.len();
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(n as u64, total);
    println!(
        "stream read from the WAL, one core: {:.2} M records/s ({n} records: index lookup, frame read + verify, decode, route, copy out)",
        n as f64 / secs / 1e6
    );
    hub.shutdown();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    index_throughput();
    follow_latency(&rt);
    read_throughput(&rt);
}
