//! Stream cuts and starting points: cuts taken at random moments while the stream scales
//! yield exactly the records committed after them; a reader group's cut yields exactly what
//! the group has not checkpointed; `from=TIME` selects by hub ingest time.

mod common;

use core_hub::Hub;
use core_hub::config::ScalePolicy;
use core_hub::streams::Cut;
use core_hub::streams::reader::{Start, StreamReader};
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};

const STREAM: &str = "cuts";

fn block_of(first: u64, n: usize, salt: u64) -> Vec<u8> {
    let records: Vec<Record> = (0..n)
        .map(|i| Record {
            tags: Vec::new(),
            key: format!("key-{}", (first + i as u64 + salt) % 997),
            ts: (first + i as u64) as i64,
            fields: vec![("v".into(), Value::I64(i as i64))],
        })
        .collect();
    encode_block(VERSION_ROWS, 1, first, &records).unwrap()
}

fn open_scaling(dir: &std::path::Path) -> Arc<Hub> {
    let cfg = common::config(dir, |c| {
        c.streams.scale.insert(
            STREAM.into(),
            ScalePolicy {
                target_records_per_s: Some(20_000),
                target_bytes_per_s: None,
                window: Duration::from_millis(100),
                min_segments: 1,
                max_segments: 4,
            },
        );
    });
    Hub::open(&cfg).unwrap()
}

/// Every record from `start` until caught up, as offsets.
fn offsets_from(hub: &Arc<Hub>, start: Start) -> Vec<u64> {
    let mut r = StreamReader::open(hub.clone(), STREAM, start, None).unwrap();
    let mut out = Vec::new();
    loop {
        let page = r.read(10_000).unwrap();
        if page.is_empty() {
            return out;
        }
        out.extend(page.iter().map(|x| x.offset));
    }
}

/// Two devices: `hot` records fast, then slowly until the stream has merged once.
async fn produce(hub: Arc<Hub>, hot: u64, done: Arc<AtomicBool>) -> u64 {
    let mut tasks = Vec::new();
    for d in 0..2u64 {
        let hub = hub.clone();
        tasks.push(tokio::spawn(async move {
            let device = format!("d{d}");
            let mut seq = 1;
            // The hot records, and on until the stream has split (a slow machine needs longer).
            let hot_deadline = std::time::Instant::now() + Duration::from_secs(30);
            while seq <= hot / 2
                || (hub.streams().stats().splits.load(Ordering::Relaxed) == 0
                    && std::time::Instant::now() < hot_deadline)
            {
                hub.commit_block(&device, STREAM, &block_of(seq, 500, d))
                    .await
                    .unwrap();
                seq += 500;
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while hub.streams().stats().merges.load(Ordering::Relaxed) == 0
                && std::time::Instant::now() < deadline
            {
                hub.commit_block(&device, STREAM, &block_of(seq, 5, d))
                    .await
                    .unwrap();
                seq += 5;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seq - 1
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cuts_at_random_moments_yield_exactly_the_later_records() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open_scaling(dir.path());
    let sid = hub.stream_id(STREAM).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(hub.clone(), 200_000, done.clone()));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut cuts = Vec::new();
    while !done.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1..40))).await;
        let (cut, end) = hub.streams().tail_cut(sid).unwrap();
        let token = cut.token();
        assert_eq!(Cut::parse(&token).unwrap(), cut);
        cuts.push((token, end));
    }
    let total = producer.await.unwrap();
    assert!(hub.streams().stats().splits.load(Ordering::Relaxed) >= 1);
    assert!(cuts.len() >= 5, "{} cuts", cuts.len());
    let multi = cuts
        .iter()
        .filter(|(t, _)| Cut::parse(t).unwrap().positions.len() > 1)
        .count();
    assert!(multi > 0, "some cuts span several segments");
    for (token, end) in &cuts {
        let got = offsets_from(&hub, Start::parse(token).unwrap());
        let want: Vec<u64> = (*end..total).collect();
        assert_eq!(got.len(), want.len(), "cut at {end}");
        assert_eq!(got, want, "cut at {end}");
    }
    eprintln!(
        "{} cuts over {total} records, {multi} across several segments",
        cuts.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_cut_yields_what_the_group_has_not_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open_scaling(dir.path());
    let sid = hub.stream_id(STREAM).unwrap();
    let groups = hub.streams().groups();
    groups
        .create(&hub, sid, "g", &Start::Beginning, Duration::from_secs(10))
        .unwrap();
    let reader = groups.join(&hub, sid, "g", "only").unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(hub.clone(), 100_000, done.clone()));
    let mut delivered = BTreeSet::new();
    let mut checks = Vec::new();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
    while !done.load(Ordering::Relaxed) {
        let batch = reader
            .poll(rng.random_range(100..3000), Duration::from_millis(20))
            .await
            .unwrap();
        delivered.extend(batch.records.iter().map(|r| r.offset));
        reader.checkpoint(&batch.positions).unwrap();
        if rng.random_bool(0.2) {
            let graph = hub.streams().snapshot(sid).unwrap().graph.clone();
            let cut = groups.cut(sid, "g", &graph).unwrap();
            checks.push((cut.token(), delivered.clone()));
        }
    }
    let total = producer.await.unwrap();
    assert!(checks.len() >= 3, "{} group cuts", checks.len());
    for (token, delivered) in &checks {
        let got: BTreeSet<u64> = offsets_from(&hub, Start::parse(token).unwrap())
            .into_iter()
            .collect();
        let want: BTreeSet<u64> = (0..total).filter(|o| !delivered.contains(o)).collect();
        assert_eq!(got.len(), want.len());
        assert_eq!(got, want);
    }
    // A group started from a cut reads exactly the records after it.
    let (token, delivered) = checks.last().unwrap();
    groups
        .create(
            &hub,
            sid,
            "from-cut",
            &Start::parse(token).unwrap(),
            Duration::from_secs(10),
        )
        .unwrap();
    let r2 = groups.join(&hub, sid, "from-cut", "x").unwrap();
    let want: BTreeSet<u64> = (0..total).filter(|o| !delivered.contains(o)).collect();
    let mut got = BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while got.len() < want.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {}",
            got.len(),
            want.len()
        );
        let b = r2.poll(5000, Duration::from_millis(50)).await.unwrap();
        for r in &b.records {
            assert!(got.insert(r.offset), "offset {} twice", r.offset);
        }
        r2.checkpoint(&b.positions).unwrap();
    }
    assert!(
        r2.poll_now(1000).unwrap().records.is_empty(),
        "nothing beyond the cut's records"
    );
    assert_eq!(got, want);
}

#[tokio::test]
async fn from_time_is_hub_ingest_time() {
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let mut seq = 1;
    for _ in 0..3 {
        for _ in 0..4 {
            hub.commit_block("d", STREAM, &block_of(seq, 50, 0))
                .await
                .unwrap();
            seq += 50;
        }
        // Separate the three rounds in ingest time.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let all = common::read_all(&hub, STREAM);
    assert_eq!(all.len(), 600);
    let t = all[200].ingest_ts;
    let got = offsets_from(&hub, Start::Time(t));
    let first = all.iter().position(|r| r.ingest_ts >= t).unwrap() as u64;
    assert_eq!(got, (first..600).collect::<Vec<_>>());
    // The same through an RFC 3339 string (nanosecond precision).
    let secs = t.div_euclid(1_000_000_000);
    let nanos = t.rem_euclid(1_000_000_000) as u32;
    let text = chrono::DateTime::from_timestamp(secs, nanos)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
    assert_eq!(Start::parse(&text).unwrap(), Start::Time(t));
    assert_eq!(offsets_from(&hub, Start::Time(i64::MAX)), Vec::<u64>::new());
    assert_eq!(offsets_from(&hub, Start::Time(0)).len(), 600);
    // Bad starts are refused, not misread.
    assert!(Start::parse("yesterday").is_err());
    assert!(Start::parse("AAAA").is_err());
}
