//! `kill -9` of the real agent while a derived stream turns a raw stream into tumbling-window
//! aggregates: every window is emitted exactly once across the kills.
//!
//! The raw stream (`replicate = false`) takes batches over HTTP; the derived stream
//! (`source_stream = "raw"`) runs a predicate, a 1 s tumbling window (count, min, max, mean,
//! last) and a projection with renaming. After the kills, the expected derived records are
//! computed from what the raw stream actually holds, with the same pipeline run in-process;
//! the derived stream must hold exactly those, in order: none lost, none twice.
//!
//! 20 kills by default; `TRIBUTARY_SOAK=1` runs 200. The seed is printed; `TRIBUTARY_SEED=N`
//! replays one.

mod process_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use edge_agent::filters::{Agg, Pipeline, StageSpec};
use process_support::Setup;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::Value as Json;
use sync::{Record, Value};

const FILTERS: &str = r#"filters = [
  { kind = "where", expr = "v >= 0" },
  { kind = "window", interval = "1s", field = "v", aggs = ["count", "min", "max", "mean", "last"] },
  { kind = "project", fields = ["v.count as n", "v.min", "v.max", "v.mean", "v.last"] },
]"#;

fn specs() -> Vec<StageSpec> {
    vec![
        StageSpec::Where("v >= 0".into()),
        StageSpec::Window {
            interval_ns: 1_000_000_000,
            field: "v".into(),
            aggs: vec![Agg::Count, Agg::Min, Agg::Max, Agg::Mean, Agg::Last],
        },
        StageSpec::Project(vec![
            ("v.count".into(), Some("n".into())),
            ("v.min".into(), None),
            ("v.max".into(), None),
            ("v.mean".into(), None),
            ("v.last".into(), None),
        ]),
    ]
}

fn seed() -> u64 {
    let seed = std::env::var("TRIBUTARY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("seed {seed} (TRIBUTARY_SEED={seed} replays it)");
    seed
}

/// Batch `b` of 50 records: 10 keys, event time 20 ms apart, values multiples of 1/4 (exact in
/// JSON), every 13th negative so the predicate drops it.
fn batch(b: u64) -> String {
    let mut body = String::new();
    for j in 0..50u64 {
        let i = b * 50 + j;
        let v = if i.is_multiple_of(13) {
            -1.0
        } else {
            ((i * 7919) % 1000) as f64 / 4.0
        };
        let ts = 1_700_000_000_000_000_000i64 + i as i64 * 20_000_000;
        body.push_str(&format!(
            "{{\"key\":\"dev{}\",\"ts\":{ts},\"fields\":{{\"v\":{v:?}}}}}\n",
            i % 10
        ));
    }
    body
}

async fn producer(
    client: edge_agent::http::client::Client,
    next: Arc<AtomicU64>,
    acks: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let b = next.fetch_add(1, Ordering::Relaxed);
        let Ok(r) = client
            .post("/v1/streams/raw/records", "application/x-ndjson", batch(b))
            .await
        else {
            return; // Killed: the batch is stored whole or not at all; either is fine here.
        };
        assert_eq!(r.status, 200, "{}", r.text());
        acks.fetch_add(1, Ordering::Relaxed);
    }
}

fn inspect(setup: &Setup, stream: &str) -> Vec<Json> {
    let out = setup.cli(
        &[
            "inspect",
            "--stream",
            stream,
            "--config",
            setup.config.to_str().unwrap(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "inspect: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Waits until the derived runner has consumed everything the raw stream holds.
fn wait_caught_up(setup: &Setup) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = setup.client();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = rt.block_on(client.get("/v1/status")).unwrap();
        let s: Json = serde_json::from_slice(&r.body).unwrap();
        let raw = s["streams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["stream"] == "raw")
            .unwrap()["durable_seq"]
            .as_u64()
            .unwrap();
        let consumed = s["filters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["stream"] == "win")
            .map(|x| x["consumed_seq"].as_u64().unwrap());
        if consumed == Some(raw) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the derived stream did not catch up: raw {raw}, consumed {consumed:?}"
        );
        // Polling the condition itself; the pause only spaces the probes.
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn derived_windows_are_emitted_exactly_once_across_kill9() {
    let soak = std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1");
    let kills = if soak { 200 } else { 20 };
    let seed = seed();
    let mut rng = SmallRng::seed_from_u64(seed);
    let setup = Setup::new("fsync = \"interval:5ms\"");
    let port = setup.port;
    std::fs::write(
        &setup.config,
        format!(
            "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{port}\"\n[storage]\nfsync = \"interval:5ms\"\n\
             [[streams]]\nname = \"raw\"\nreplicate = false\nretention = \"1h\"\n\
             [[streams]]\nname = \"win\"\nsource_stream = \"raw\"\n{FILTERS}\n"
        ),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let next = Arc::new(AtomicU64::new(0));
    for _ in 0..kills {
        let mut agent = setup.start();
        let (acks, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                rt.spawn(producer(
                    setup.client(),
                    next.clone(),
                    acks.clone(),
                    stop.clone(),
                ))
            })
            .collect();
        // A random kill point: after some acknowledged batches (so the runner is busy), plus a
        // random delay that lands anywhere in its read / progress / append cycle.
        let want = rng.random_range(1..20u64);
        let deadline = Instant::now() + Duration::from_secs(20);
        while acks.load(Ordering::Relaxed) < want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_micros(rng.random_range(0..20_000)));
        agent.kill9();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            rt.block_on(t).unwrap();
        }
    }
    // A last run lets the runner resolve the last kill and consume every raw record.
    let mut agent = setup.start();
    wait_caught_up(&setup);
    agent.kill9();
    let log = std::fs::read_to_string(setup.dir.path().join("agent.log")).unwrap_or_default();
    let landed = log.matches("the pending batch is stored").count();
    let replayed = log.matches("the pending batch was not stored").count();

    let raw: Vec<Record> = inspect(&setup, "raw")
        .iter()
        .map(|r| Record {
            tags: Vec::new(),
            key: r["key"].as_str().unwrap().to_owned(),
            ts: r["ts"].as_i64().unwrap(),
            fields: vec![("v".into(), Value::F64(r["fields"]["v"].as_f64().unwrap()))],
        })
        .collect();
    let expected = Pipeline::compile(&specs()).unwrap().run(raw.clone());
    let derived = inspect(&setup, "win");
    eprintln!(
        "{kills} kills: {} raw records, {} windows; pending batches resolved as stored {landed}, replayed {replayed}",
        raw.len(),
        derived.len()
    );
    assert!(!expected.is_empty());
    let seqs: Vec<u64> = derived.iter().map(|d| d["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=derived.len() as u64).collect::<Vec<_>>());
    for (i, (want, got)) in expected.iter().zip(&derived).enumerate() {
        assert_eq!(got["key"].as_str().unwrap(), want.key, "window {i}");
        assert_eq!(got["ts"].as_i64().unwrap(), want.ts, "window {i}");
        for (name, v) in &want.fields {
            let g = &got["fields"][name];
            match v {
                Value::I64(n) => assert_eq!(g.as_i64(), Some(*n), "window {i} {name}"),
                Value::F64(x) => assert_eq!(g.as_f64(), Some(*x), "window {i} {name}"),
                other => panic!("unexpected value {other:?}"),
            }
        }
    }
    assert_eq!(
        derived.len(),
        expected.len(),
        "windows stored vs computed from the raw stream"
    );
}
