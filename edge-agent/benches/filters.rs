//! Filter cost: the per-record time of a 3-stage pipeline (predicate, deadband, tumbling window)
//! against the empty pipeline, on pre-built records so only the stages are timed.
//!
//! Run: `cargo bench -p edge-agent --bench filters` (target: at most 300 ns per record).
//! `FILTER_BENCH_RECORDS=N` changes the record count (default 2,000,000).

use std::hint::black_box;
use std::time::Instant;

use edge_agent::filters::{Agg, Pipeline, StageSpec};
use sync::{Record, Value};

fn records(n: usize) -> Vec<Record> {
    let keys: Vec<String> = (0..100).map(|i| format!("dev{i}/temp")).collect();
    (0..n)
        .map(|i| Record {
            tags: Vec::new(),
            key: keys[i % keys.len()].clone(),
            ts: i as i64 * 1_000_000,
            fields: vec![
                ("v".into(), Value::F64(((i * 7919) % 1000) as f64 / 1000.0)),
                ("status".into(), Value::Str("ok".into())),
            ],
        })
        .collect()
}

fn time(specs: &[StageSpec], input: Vec<Record>) -> (f64, usize) {
    let n = input.len();
    let mut p = Pipeline::compile(specs).unwrap();
    let mut out = Vec::with_capacity(1024);
    let mut emitted = 0;
    let start = Instant::now();
    for r in input {
        p.push(r, &mut out);
        if out.len() >= 1024 {
            emitted += out.len();
            black_box(&out);
            out.clear();
        }
    }
    emitted += out.len();
    black_box(&out);
    (start.elapsed().as_nanos() as f64 / n as f64, emitted)
}

fn main() {
    let n: usize = std::env::var("FILTER_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let three = [
        StageSpec::Where("v > 0.2 and status == \"ok\"".into()),
        StageSpec::Deadband {
            field: "v".into(),
            threshold: 0.05,
        },
        StageSpec::Window {
            interval_ns: 1_000_000_000,
            field: "v".into(),
            aggs: vec![Agg::Count, Agg::Min, Agg::Max, Agg::Mean, Agg::Last],
        },
    ];
    // Warm-up, then the runs that count.
    let _ = time(&three, records(n / 10));
    let (empty, _) = time(&[], records(n));
    let (staged, emitted) = time(&three, records(n));
    println!("records: {n}, window records emitted: {emitted}");
    println!("empty pipeline: {empty:.1} ns/record");
    println!("predicate + deadband + window: {staged:.1} ns/record");
    println!(
        "added by the 3 stages: {:.1} ns/record (target <= 300)",
        staged - empty
    );
}
