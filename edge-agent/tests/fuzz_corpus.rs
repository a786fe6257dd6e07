//! Replays the committed corpus of every cargo-fuzz target in `edge-agent/fuzz/` on stable
//! Rust, through the same function the target calls (`edge-agent/fuzz/bodies.rs`, compiled here
//! by path), so the corpora are regression tests in `cargo test` even where nightly and
//! libFuzzer are absent. A crash `cargo fuzz` finds is fixed, then its input goes into the
//! target's corpus, where this test keeps it fixed. See docs/fuzzing.md.
//!
//! `TRIBUTARY_WRITE_FIXTURES=1` (re)writes the hand-made seeds (`seed-*`); without it, the test
//! checks that they are all present (seeds are inputs, not golden outputs).

#[path = "../fuzz/bodies.rs"]
mod bodies;
#[path = "../../sync/fuzz/replay.rs"]
mod replay;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use edge_agent::config::EdgeConfig;
use edge_agent::filters::Pipeline;
use edge_agent::filters::predicate;

use replay::Target;

const TARGETS: [(&str, Target); 6] = [
    ("edge_config", bodies::edge_config),
    ("filter_predicate", bodies::filter_predicate),
    ("filter_pipeline", bodies::filter_pipeline),
    ("mqtt_map", bodies::mqtt_map),
    ("http_body", bodies::http_body),
    ("sparkplug_host", bodies::sparkplug_host),
];

const FULL_CONFIG: &str = r#"data_dir = "/var/lib/tributary"
[hub]
addr = "hub.example.net:7400"
server_name = "hub.example.net"
backoff_max = "10s"
[tls]
ca = "ca.pem"
cert = "device.pem"
key = "/etc/tributary/device.key"
[http]
listen = "127.0.0.1:7401"
body_bytes_max = "1MiB"
token = "s3cret"
[storage]
fsync = "interval:10ms"
disk_bytes_max = "2GiB"
on_full = "drop-oldest"
segment_bytes_max = "64MiB"
block_records_max = 500
block_bytes_max = "256KiB"
block_linger = "5ms"
block_version = 2
queue_batches_max = 64
[[streams]]
name = "raw"
replicate = false
retention = "2h"
[[streams]]
name = "telemetry"
source_stream = "raw"
filters = [
  { kind = "where", expr = "temp > -40 and exists(site)" },
  { kind = "deadband", field = "temp", threshold = 0.2 },
  { kind = "downsample", interval = "10s", mode = "mean" },
  { kind = "window", interval = "1m", field = "temp", aggs = ["count", "min", "max", "mean", "last"] },
  { kind = "project", fields = ["temp.mean as temp", "temp.max"] },
]
[[streams]]
name = "status"
priority = 10
[[sources]]
kind = "mqtt"
url = "mqtt://127.0.0.1:1883"
topics = ["sensors/#"]
stream = "raw"
format = "json"
topic_template = "sensors/{device}/{sensor}"
ts_field = "ts"
ts_unit = "ms"
[[sources]]
kind = "hwmon"
stream = "status"
interval = "5s"
key_prefix = "truck-1"
[[sources]]
kind = "http"
"#;

fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/edge.toml");
    let mut pipeline = Pipeline::compile(&bodies::every_stage()).unwrap();
    pipeline.run(bodies::sample_records());
    let snapshot = serde_json::to_vec(&pipeline.snapshot()).unwrap();
    let fresh = Pipeline::compile(&bodies::every_stage()).unwrap();
    let empty_snapshot = serde_json::to_vec(&fresh.snapshot()).unwrap();
    let mqtt = |selector: u8, lines: &str| {
        let mut v = vec![selector];
        v.extend_from_slice(lines.as_bytes());
        v
    };
    vec![
        ("edge_config", "seed-full.toml", FULL_CONFIG.as_bytes().to_vec()),
        ("edge_config", "seed-example.toml", std::fs::read(examples).unwrap()),
        (
            "edge_config",
            "seed-bad-filter.toml",
            b"data_dir = \"d\"\n[[streams]]\nname = \"t\"\nfilters = [{ kind = \"where\", expr = \"temp >\" }]\n"
                .to_vec(),
        ),
        ("edge_config", "seed-not-toml.toml", b"data_dir = \n".to_vec()),
        (
            "filter_predicate",
            "seed-all-ops.txt",
            b"not (temp >= 1.5e1 and rpm != 900) or state == \"run\" and exists(site.id) or ok == true and temp <= -3 and rpm < 1 and temp > 0"
                .to_vec(),
        ),
        ("filter_predicate", "seed-unclosed.txt", b"(temp > 1 and \"x".to_vec()),
        ("filter_predicate", "seed-nested.txt", b"((((not not exists(a)))))".to_vec()),
        ("filter_pipeline", "seed-snapshot.json", snapshot),
        ("filter_pipeline", "seed-empty-snapshot.json", empty_snapshot),
        (
            "filter_pipeline",
            "seed-records.txt",
            b"null\n{\"key\":\"k\",\"ts\":-5000000001,\"fields\":{\"temp\":1.5}}\n{\"key\":\"k\",\"ts\":9223372036854775807,\"fields\":{\"temp\":-50}}\n".to_vec(),
        ),
        (
            "filter_pipeline",
            "seed-other.json",
            br#"{"fingerprint":"0000000000000001","stages":[null,{"k":[1,2]},[],{},null]}"#.to_vec(),
        ),
        (
            "mqtt_map",
            "seed-json-template.bin",
            mqtt(
                0x30,
                "sensors/{device}/{sensor}\nts\nsensors/dev7/temp\n{\"ts\":1700000000000,\"v\":21.5,\"nested\":{\"a\":[1,2],\"b\":null}}",
            ),
        ),
        (
            "mqtt_map",
            "seed-line.bin",
            mqtt(0x01, "plant/line1\nm,host=a x=1i,y=2.5,s=\"t\" 1700000000000000000\nm x=2i\n"),
        ),
        (
            "mqtt_map",
            "seed-rfc3339.bin",
            mqtt(0x28, "time\na/b\n{\"time\":\"2026-11-29T17:00:00.123Z\",\"t\":1}"),
        ),
        (
            "mqtt_map",
            "seed-mismatch.bin",
            mqtt(0x10, "a/{x}/b\na/1/c/d\n{\"_topic\":1}"),
        ),
        (
            "http_body",
            "seed-ndjson.txt",
            b"{\"key\":\"truck-1\",\"ts\":1,\"fields\":{\"temp\":21.5,\"ok\":true}}\n{\"key\":\"truck-2\",\"fields\":{\"n\":1}}\n"
                .to_vec(),
        ),
        (
            "http_body",
            "seed-line.txt",
            b"telemetry,device=truck-1 temp=21.5,rpm=900i 1700000000000000000\n# c\ntelemetry x=1u\n"
                .to_vec(),
        ),
        (
            "http_body",
            "seed-wrong-measurement.txt",
            b"telemetry x=1\nother x=2\n".to_vec(),
        ),
        ("http_body", "seed-not-utf8.txt", b"{\"key\":\"a\"}\n\xff\xfe\n".to_vec()),
        ("sparkplug_host", "seed-birth-data-death.bin", sparkplug_seed(true)),
        ("sparkplug_host", "seed-data-without-birth.bin", sparkplug_seed(false)),
        (
            "sparkplug_host",
            "seed-not-protobuf.bin",
            b"\x12spBv1.0/g/NDATA/n\x00\x05\xff\xff\xff\xff\xff\x03a/b".to_vec(),
        ),
    ]
}

/// NBIRTH (when `born`), NDATA by alias (with a seq gap), DBIRTH, DDATA and NDEATH of one
/// node, framed as `bodies::sparkplug_host` reads them.
fn sparkplug_seed(born: bool) -> Vec<u8> {
    use edge_agent::sources::sparkplug::proto::{Metric, MetricValue, Payload};
    use prost::Message as _;
    let metric = |name: Option<&str>, alias, dt, v| Metric {
        name: name.map(str::to_owned),
        alias: Some(alias),
        datatype: dt,
        value: Some(v),
        ..Metric::default()
    };
    let msg = |out: &mut Vec<u8>, topic: &str, seq: Option<u64>, metrics: Vec<Metric>| {
        let p = Payload {
            timestamp: Some(1_700_000_000_000),
            seq,
            metrics,
            ..Payload::default()
        }
        .encode_to_vec();
        out.push(topic.len() as u8);
        out.extend_from_slice(topic.as_bytes());
        out.extend_from_slice(&(p.len() as u16).to_be_bytes());
        out.extend_from_slice(&p);
    };
    let mut out = Vec::new();
    let bd = || metric(Some("bdSeq"), 0, Some(4), MetricValue::LongValue(1));
    let birth = vec![
        bd(),
        metric(Some("t"), 1, Some(1), MetricValue::IntValue(250)),
        metric(Some("d"), 2, Some(10), MetricValue::DoubleValue(1.5)),
    ];
    if born {
        msg(&mut out, "spBv1.0/g/NBIRTH/n", Some(0), birth.clone());
    }
    msg(
        &mut out,
        "spBv1.0/g/NDATA/n",
        Some(2),
        vec![metric(None, 1, None, MetricValue::IntValue(3))],
    );
    msg(
        &mut out,
        "spBv1.0/g/DBIRTH/n/x",
        Some(3),
        birth[1..].to_vec(),
    );
    msg(
        &mut out,
        "spBv1.0/g/DDATA/n/x",
        Some(4),
        vec![metric(None, 2, None, MetricValue::DoubleValue(2.5))],
    );
    msg(&mut out, "spBv1.0/g/NDEATH/n", None, vec![bd()]);
    out
}

#[test]
fn every_corpus_file_passes_its_target() {
    replay::replay(env!("CARGO_MANIFEST_DIR"), &TARGETS);
}

#[test]
fn seeds_are_on_disk() {
    replay::seeds_on_disk(env!("CARGO_MANIFEST_DIR"), seeds());
}

#[test]
fn the_seeds_reach_past_the_checks_and_errors_point_home() {
    // Seeds only help the fuzzer if they are valid where they should be.
    let c = EdgeConfig::from_toml(FULL_CONFIG, Path::new("/etc"), Some(HashMap::new())).unwrap();
    assert_eq!(c.streams.len(), 3);
    let e = predicate::compile("(temp > 1 and \"x").err().unwrap();
    assert!(
        e.at > 0 && e.at <= 17,
        "offset {} for an unclosed string",
        e.at
    );
    let e = EdgeConfig::from_toml(
        "data_dir = \"d\"\n[[streams]]\nname = \"t\"\nfilters = [{ kind = \"where\", expr = \"temp >\" }]\n",
        Path::new("/etc"),
        Some(HashMap::new()),
    )
    .unwrap_err();
    assert!(
        e.key().is_some_and(|k| k.starts_with("streams[0].filters")),
        "the error names the filter: {e}"
    );
}
