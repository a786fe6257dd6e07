//! Reader groups over an auto-scaling stream: three readers read live while the stream
//! splits and merges, and one reader of three is killed.
//!
//! Checked for every delivered record: per-key order, nothing missing, and every duplicate
//! explained by a checkpoint (a segment taken over from a dead reader restarts at its
//! checkpoint). The hub is driven in-process (`Hub::commit_block`), without QUIC.
//!
//! `TRIBUTARY_SOAK=1` runs the big variant with more records; by default the live test runs
//! 1M records too (see `RECORDS`), which takes well under a minute in the dev profile.

mod common;

use core_hub::Hub;
use core_hub::config::ScalePolicy;
use core_hub::streams::SegmentId;
use core_hub::streams::group::GroupReader;
use core_hub::streams::reader::Start;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

const STREAM: &str = "merged";

fn soak() -> bool {
    std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1")
}

/// A block with one record per key, seqs from `first`.
fn block_of(first: u64, keys: &[&str]) -> Vec<u8> {
    let records: Vec<Record> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| Record {
            tags: Vec::new(),
            key: (*k).to_string(),
            ts: 1_764_374_400_000_000_000 + (first + i as u64) as i64,
            fields: vec![("v".into(), Value::I64((first + i as u64) as i64))],
        })
        .collect();
    encode_block(VERSION_ROWS, 1, first, &records).unwrap()
}

fn policy(window_ms: u64, target: u64, max_segments: u32) -> ScalePolicy {
    ScalePolicy {
        target_records_per_s: Some(target),
        target_bytes_per_s: None,
        window: Duration::from_millis(window_ms),
        min_segments: 1,
        max_segments,
    }
}

fn open_hub(dir: &std::path::Path, p: ScalePolicy) -> Arc<Hub> {
    let cfg = common::config(dir, |c| {
        c.streams.scale.insert(STREAM.into(), p);
    });
    Hub::open(&cfg).unwrap()
}

/// One delivery as a reader handed it to the application.
#[derive(Debug, Clone)]
struct Delivery {
    reader: usize,
    segment: SegmentId,
    offset: u64,
    key: String,
}

/// Producers: `devices` devices, each committing blocks of `block` records with keys drawn
/// from `keys`; `hot_records` as fast as possible, then slowly until `cool_done` says stop.
struct Load {
    committed: AtomicU64,
}

/// How many producers write, how big their blocks are and how many records they write hot.
struct Shape {
    devices: usize,
    block: usize,
    hot_records: u64,
}

async fn produce(
    hub: Arc<Hub>,
    shape: Shape,
    keys: Arc<Vec<String>>,
    load: Arc<Load>,
    cool_until: impl Fn() -> bool + Send + Sync + 'static,
    stay_hot: impl Fn() -> bool + Send + Sync + 'static,
) -> u64 {
    let cool_until = Arc::new(cool_until);
    let stay_hot = Arc::new(stay_hot);
    let Shape {
        devices,
        block,
        hot_records,
    } = shape;
    let per_device = hot_records / devices as u64 / block as u64;
    let mut tasks = Vec::new();
    for d in 0..devices {
        let (hub, keys, load, cool_until, stay_hot) = (
            hub.clone(),
            keys.clone(),
            load.clone(),
            cool_until.clone(),
            stay_hot.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let device = format!("dev-{d}");
            let mut rng = rand::rngs::SmallRng::seed_from_u64(d as u64);
            let mut seq = 1u64;
            // Hot: as fast as the hub takes it (pipelined, as a connection would).
            let mut pending = std::collections::VecDeque::new();
            // At least the hot records; longer while `stay_hot` (the splits are not done yet
            // on a fast machine).
            let hot_deadline = Instant::now() + Duration::from_secs(60);
            let mut i = 0;
            while i < per_device || (stay_hot() && Instant::now() < hot_deadline) {
                i += 1;
                let ks: Vec<&str> = (0..block)
                    .map(|_| keys[rng.random_range(0..keys.len())].as_str())
                    .collect();
                let b = block_of(seq, &ks);
                seq += block as u64;
                pending.push_back(hub.submit_block(&device, STREAM, &b).await.unwrap());
                if pending.len() >= 4 {
                    pending.pop_front().unwrap().wait().await.unwrap();
                }
                load.committed.fetch_add(block as u64, Ordering::Relaxed);
            }
            for p in pending {
                p.wait().await.unwrap();
            }
            // Cool: 10 records every 20 ms per device until the condition holds.
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            let deadline = Instant::now() + Duration::from_secs(60);
            while !cool_until() && Instant::now() < deadline {
                tick.tick().await;
                let ks: Vec<&str> = (0..10)
                    .map(|_| keys[rng.random_range(0..keys.len())].as_str())
                    .collect();
                hub.commit_block(&device, STREAM, &block_of(seq, &ks))
                    .await
                    .unwrap();
                seq += 10;
                load.committed.fetch_add(10, Ordering::Relaxed);
            }
            seq - 1
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

/// Runs one reader until `stop`: poll, hand the batch over, checkpoint (unless killed first).
async fn run_reader(
    r: GroupReader,
    idx: usize,
    log: Arc<Mutex<Vec<Delivery>>>,
    stop: Arc<AtomicBool>,
    kill_after: Option<u64>,
    checkpoints_at_death: Arc<Mutex<Option<BTreeMap<SegmentId, u64>>>>,
) {
    let mut delivered = 0u64;
    let mut last_checkpoint = BTreeMap::new();
    while !stop.load(Ordering::Relaxed) {
        let batch = r.poll(2000, Duration::from_millis(100)).await.unwrap();
        {
            let mut log = log.lock().unwrap();
            for rec in &batch.records {
                log.push(Delivery {
                    reader: idx,
                    segment: rec.segment,
                    offset: rec.offset,
                    key: rec.key.clone(),
                });
            }
        }
        delivered += batch.records.len() as u64;
        if kill_after.is_some_and(|k| delivered >= k) && !batch.records.is_empty() {
            // Crash: the batch was handed over but never checkpointed, and the reader stops
            // heartbeating. Its segments must resume from `last_checkpoint`.
            *checkpoints_at_death.lock().unwrap() = Some(last_checkpoint);
            return;
        }
        r.checkpoint(&batch.positions).unwrap();
        last_checkpoint = batch.positions.clone();
    }
    r.leave();
}

/// Per-key order, completeness and explained duplicates.
fn verify(
    log: &[Delivery],
    total: u64,
    hub: &Hub,
    killed: Option<(usize, &BTreeMap<SegmentId, u64>)>,
) -> usize {
    let all = common::read_all(hub, STREAM);
    assert_eq!(all.len() as u64, total, "the stream holds every record");
    let key_of: HashMap<u64, &str> = all.iter().map(|r| (r.offset, r.key.as_str())).collect();
    let seg_of: HashMap<u64, SegmentId> = all.iter().map(|r| (r.offset, r.segment)).collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, u64> = HashMap::new();
    let mut dups = 0;
    for d in log {
        assert_eq!(
            key_of.get(&d.offset).copied(),
            Some(d.key.as_str()),
            "record {} intact",
            d.offset
        );
        assert_eq!(seg_of[&d.offset], d.segment, "segment of {}", d.offset);
        let first_time = seen.insert(d.offset);
        if !first_time {
            dups += 1;
            let (dead, cps) = killed.expect("duplicates only after a reader died");
            assert_ne!(
                d.reader, dead,
                "the dead reader delivers nothing after death"
            );
            let cp = cps.get(&d.segment).copied().unwrap_or(0);
            assert!(
                d.offset >= cp,
                "redelivered offset {} of segment {} is below the checkpoint {cp}",
                d.offset,
                d.segment
            );
        }
        let prev = last.insert(d.key.as_str(), d.offset);
        if let Some(p) = prev
            && d.offset <= p
        {
            assert!(
                !first_time,
                "key {} went back from {p} to unseen {}",
                d.key, d.offset
            );
        }
    }
    assert_eq!(seen.len() as u64, total, "every record delivered");
    dups
}

fn keys(n: usize) -> Arc<Vec<String>> {
    Arc::new((0..n).map(|i| format!("sensor-{i}/temp")).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_readers_read_live_through_three_splits_and_three_merges() {
    let records: u64 = if soak() { 3_000_000 } else { 1_000_000 };
    let dir = tempfile::tempdir().unwrap();
    // 20k records/s per segment over 300 ms windows; the hot phase runs far above that.
    let hub = open_hub(dir.path(), policy(300, 20_000, 4));
    let sid = hub.stream_id(STREAM).unwrap();
    hub.streams()
        .groups()
        .create(&hub, sid, "g", &Start::Beginning, Duration::from_secs(5))
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let none = Arc::new(Mutex::new(None));
    let mut readers = Vec::new();
    for i in 0..3 {
        let r = hub
            .streams()
            .groups()
            .join(&hub, sid, "g", &format!("r{i}"))
            .unwrap();
        readers.push(tokio::spawn(run_reader(
            r,
            i,
            log.clone(),
            stop.clone(),
            None,
            none.clone(),
        )));
    }
    let load = Arc::new(Load {
        committed: AtomicU64::new(0),
    });
    let started = Instant::now();
    let (h, h2) = (hub.clone(), hub.clone());
    let shape = Shape {
        devices: 8,
        block: 1000,
        hot_records: records,
    };
    let total = produce(
        hub.clone(),
        shape,
        keys(4096),
        load.clone(),
        move || h.streams().stats().merges.load(Ordering::Relaxed) >= 3,
        move || h2.streams().stats().splits.load(Ordering::Relaxed) < 3,
    )
    .await;
    let produced_in = started.elapsed();
    let stats = hub.streams().stats();
    let (splits, merges) = (
        stats.splits.load(Ordering::Relaxed),
        stats.merges.load(Ordering::Relaxed),
    );
    assert!(total >= records, "{total}");
    assert!(splits >= 3, "splits {splits}");
    assert!(merges >= 3, "merges {merges}");
    // Wait for the group to deliver everything.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = log
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.offset)
            .collect::<HashSet<_>>()
            .len() as u64;
        if n == total {
            break;
        }
        assert!(Instant::now() < deadline, "delivered {n} of {total}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.await.unwrap();
    }
    let log = log.lock().unwrap();
    let dups = verify(&log, total, &hub, None);
    assert_eq!(dups, 0, "no reader died, so nothing is delivered twice");
    let per_reader: Vec<usize> = (0..3)
        .map(|i| log.iter().filter(|d| d.reader == i).count())
        .collect();
    assert!(
        per_reader.iter().filter(|&&n| n > 0).count() >= 2,
        "readers shared the work: {per_reader:?}"
    );
    let graph = hub.streams().snapshot(sid).unwrap().graph.clone();
    eprintln!(
        "{total} records in {produced_in:?}, {splits} splits, {merges} merges, {} segments, per reader {per_reader:?}",
        graph.segments().len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_reader_resumes_from_its_checkpoint() {
    let records: u64 = if soak() { 1_000_000 } else { 200_000 };
    let dir = tempfile::tempdir().unwrap();
    let hub = open_hub(dir.path(), policy(200, 20_000, 4));
    let sid = hub.stream_id(STREAM).unwrap();
    hub.streams()
        .groups()
        .create(
            &hub,
            sid,
            "g",
            &Start::Beginning,
            // Long enough that a live reader waiting on a busy catalog is never taken for dead;
            // the killed one is taken over well within the delivery deadline.
            Duration::from_secs(3),
        )
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let death = Arc::new(Mutex::new(None));
    let mut readers = Vec::new();
    for i in 0..3 {
        let r = hub
            .streams()
            .groups()
            .join(&hub, sid, "g", &format!("r{i}"))
            .unwrap();
        // Reader 0 (which holds segment 0 from the start) dies once it delivered 20k records.
        let kill = (i == 0).then_some(20_000);
        readers.push(tokio::spawn(run_reader(
            r,
            i,
            log.clone(),
            stop.clone(),
            kill,
            death.clone(),
        )));
    }
    let load = Arc::new(Load {
        committed: AtomicU64::new(0),
    });
    let h = hub.clone();
    let h2 = hub.clone();
    let shape = Shape {
        devices: 4,
        block: 1000,
        hot_records: records,
    };
    let total = produce(
        hub.clone(),
        shape,
        keys(1024),
        load,
        move || h.streams().stats().merges.load(Ordering::Relaxed) >= 1,
        move || h2.streams().stats().splits.load(Ordering::Relaxed) < 1,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = log
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.offset)
            .collect::<HashSet<_>>()
            .len() as u64;
        if n == total {
            break;
        }
        assert!(Instant::now() < deadline, "delivered {n} of {total}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.await.unwrap();
    }
    let cps = death.lock().unwrap().clone().expect("reader 0 was killed");
    let log = log.lock().unwrap();
    let dups = verify(&log, total, &hub, Some((0, &cps)));
    assert!(
        dups > 0,
        "the killed reader's last batch is delivered again from its checkpoint"
    );
    let status = hub
        .streams()
        .groups()
        .status(sid, "g", &hub.streams().snapshot(sid).unwrap().graph)
        .unwrap();
    assert!(
        status.readers.iter().all(|r| r.name != "r0"),
        "the dead reader left the group"
    );
    eprintln!("{total} records, {dups} redelivered after the kill");
}
