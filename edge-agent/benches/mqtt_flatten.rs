//! The MQTT JSON flattener (`sources::flatten`) on 1 MiB payloads: wide (every member a leaf),
//! deep and wide (leaves under a 20-level prefix), and wide under the default field limit
//! (the parse stops at the first field over it).
//!
//! Run: `cargo bench -p edge-agent --bench mqtt_flatten`. Prints, per payload, the fields
//! stored, the work counter per payload byte and the median time of `MQTT_FLATTEN_RUNS`
//! (default 11) runs. The figure recorded in docs/benchmarks.md comes from this.

use std::time::Instant;

use edge_agent::sources::flatten::flatten_json;

const PAYLOAD_BYTES: usize = 1 << 20;

/// `{"k0":{"k1":...{"f0":0,"f1":1,...}}}` of about `PAYLOAD_BYTES`, `depth` levels deep.
fn payload(depth: usize) -> String {
    let mut s = String::with_capacity(PAYLOAD_BYTES + 64);
    for i in 0..depth {
        s.push_str(&format!("{{\"k{i}\":"));
    }
    s.push('{');
    let mut j = 0;
    while s.len() < PAYLOAD_BYTES {
        if j > 0 {
            s.push(',');
        }
        s.push_str(&format!("\"f{j}\":{j}"));
        j += 1;
    }
    s.push('}');
    s.push_str(&"}".repeat(depth));
    s
}

fn main() {
    let runs: usize = std::env::var("MQTT_FLATTEN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(11);
    let cases = [
        ("wide, no limit", payload(0), usize::MAX),
        ("deep and wide, no limit", payload(20), usize::MAX),
        ("wide, default limit (1,000)", payload(0), 1000),
    ];
    for (name, p, max) in &cases {
        let mut times = Vec::with_capacity(runs);
        let mut last = None;
        for _ in 0..runs {
            let t = Instant::now();
            let out = flatten_json(p.as_bytes(), *max);
            times.push(t.elapsed());
            last = Some(out);
        }
        times.sort();
        let (fields, work) = match last.expect("at least one run") {
            Ok(f) => (f.fields.len().to_string(), f.work as f64 / p.len() as f64),
            Err(e) => (format!("refused ({e})"), f64::NAN),
        };
        println!(
            "{name}: {} bytes, fields {fields}, work/byte {work:.2}, median {:?}",
            p.len(),
            times[runs / 2]
        );
    }
}
