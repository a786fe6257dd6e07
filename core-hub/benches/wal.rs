//! Group-commit benchmark for the hub's tier-1 WAL (harness = false).
//!
//! N simulated devices (default 100) each commit blocks through `Hub::submit_block`, keeping at
//! most `window` blocks unacknowledged (default 1: wait for each ack before sending the next,
//! the worst case for batching), for a fixed duration. Prints commits/s, records/s, MB/s, WAL
//! fsyncs/s and the mean group-commit size.
//!
//! ```text
//! cargo bench -p core-hub --bench wal -- [devices] [records_per_block] [seconds] [dir] [window]
//! ```
//!
//! The data directory defaults to a temp dir under `$TMPDIR`; pass a path on the disk you want
//! to measure.

use core_hub::{Hub, HubConfig};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

fn records(device: usize, first: u64, n: u64) -> Vec<Record> {
    (first..first + n)
        .map(|seq| Record {
            tags: Vec::new(),
            key: format!("dev-{device:04}/engine"),
            ts: 1_764_374_400_000_000_000 + seq as i64 * 1_000_000,
            fields: vec![
                ("temp".into(), Value::F64(20.0 + (seq % 97) as f64 * 0.25)),
                ("rpm".into(), Value::I64(800 + (seq % 3000) as i64)),
                ("ok".into(), Value::Bool(seq % 5 != 0)),
            ],
        })
        .collect()
}

fn arg<T: std::str::FromStr>(i: usize, default: T) -> T {
    std::env::args()
        .filter(|a| !a.starts_with("--"))
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let devices: usize = arg(1, 100);
    let per_block: u64 = arg(2, 100);
    let seconds: u64 = arg(3, 5);
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir: std::path::PathBuf = arg(4, tmp.path().to_path_buf());
    let window: usize = arg(5, 1).max(1);
    let cfg = HubConfig::with_data_dir(&dir);
    let hub = Hub::open(&cfg).expect("open hub");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");

    // Blocks are encoded up front so the benchmark measures the hub, not the edge's sealing.
    let blocks: Vec<Vec<Vec<u8>>> = (0..devices)
        .map(|d| {
            (0..64u64)
                .map(|i| {
                    encode_block(
                        VERSION_ROWS,
                        1,
                        i * per_block + 1,
                        &records(d, i * per_block + 1, per_block),
                    )
                    .unwrap()
                })
                .collect()
        })
        .collect();
    let blocks = Arc::new(blocks);
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));

    let start = Instant::now();
    let fsyncs0 = hub.wal_stats().fsyncs.load(Ordering::Relaxed);
    rt.block_on(async {
        let mut tasks = Vec::new();
        for d in 0..devices {
            let (hub, blocks, stop, commits, bytes) = (
                hub.clone(),
                blocks.clone(),
                stop.clone(),
                commits.clone(),
                bytes.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let device = format!("dev-{d:04}");
                // Each device cycles through its 64 blocks in successive epochs, so every
                // commit is new data (never a duplicate).
                let mut epoch = 1u64;
                let mut i = 0usize;
                let mut in_flight = std::collections::VecDeque::new();
                while !stop.load(Ordering::Relaxed) {
                    let block = reseal(&blocks[d][i], epoch);
                    in_flight.push_back(
                        hub.submit_block(&device, "telemetry", &block)
                            .await
                            .expect("submit"),
                    );
                    if in_flight.len() >= window {
                        in_flight
                            .pop_front()
                            .expect("non-empty")
                            .wait()
                            .await
                            .expect("commit");
                        commits.fetch_add(1, Ordering::Relaxed);
                    }
                    bytes.fetch_add(block.len() as u64, Ordering::Relaxed);
                    i += 1;
                    if i == blocks[d].len() {
                        // The next epoch's block 1 must not overtake this epoch's tail: drain.
                        while let Some(p) = in_flight.pop_front() {
                            p.wait().await.expect("commit");
                            commits.fetch_add(1, Ordering::Relaxed);
                        }
                        i = 0;
                        epoch += 1;
                    }
                }
                while let Some(p) = in_flight.pop_front() {
                    p.wait().await.expect("commit");
                    commits.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("device task");
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let w = hub.wal_stats();
    let fsyncs = w.fsyncs.load(Ordering::Relaxed) - fsyncs0;
    let groups = w.group_commits.load(Ordering::Relaxed);
    let reqs = w.group_commit_requests.load(Ordering::Relaxed);
    let c = commits.load(Ordering::Relaxed);
    println!(
        "devices={devices} records_per_block={per_block} window={window} seconds={secs:.1} dir={}",
        dir.display()
    );
    println!(
        "commits/s={:.0} records/s={:.0} block MB/s={:.1} wal_fsyncs/s={:.0} commits_per_fsync={:.1} mean_group_commit={:.1}",
        c as f64 / secs,
        (c * per_block) as f64 / secs,
        bytes.load(Ordering::Relaxed) as f64 / secs / 1e6,
        fsyncs as f64 / secs,
        c as f64 / fsyncs.max(1) as f64,
        reqs as f64 / groups.max(1) as f64,
    );
}

/// The same records under another epoch: only the header changes.
fn reseal(block: &[u8], epoch: u64) -> Vec<u8> {
    let mut h = sync::block::decode_header(block).expect("header");
    h.epoch = epoch;
    let mut out = block.to_vec();
    out[..sync::block::HEADER_LEN].copy_from_slice(&sync::block::write_header(&h));
    out
}
