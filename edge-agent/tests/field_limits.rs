//! Field limits and reserved fields, end to end through the agent's ingest API, the MQTT
//! mapper, the local log and the re-blocker:
//! - `ingest.fields_per_record_max` trips with an error naming the record and the limit, for
//!   NDJSON, line protocol, MQTT JSON and line payloads, and a filter that adds fields; nothing
//!   of the refused batch is stored and the next valid batch gets the next seqs;
//! - producers cannot set `_` fields (reserved for the agent's own sources), nor send a key the
//!   hub would refuse (empty, `.` or `..` segments, control characters);
//! - with `block_version = 2`, one request with more distinct field names than a columnar block
//!   holds is sealed as several blocks and the log stays writable; a backlog of 70,000 distinct
//!   field names re-blocks by cutting blocks. Turning the cut off (the `fault-injection` switch)
//!   makes both fail, as they did before: the mutation check.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use edge_agent::config::{EdgeConfig, MqttSourceConfig, MqttUnmatched, PayloadFormat, TsUnit};
use edge_agent::http::AppState;
use edge_agent::http::client::{Client, Response};
use edge_agent::log::{Log, LogHandle, switches};
use edge_agent::replicator::reblock;
use edge_agent::sources::mqtt::{Mapper, MqttStats, TOPIC_FIELD};
use edge_agent::storage::RealStorage;
use rumqttc::{Publish, QoS};
use serde_json::Value as Json;
use sync::block::{DecodeLimits, VERSION_COLUMNAR, decode_block};
use sync::{Record, Value};
use tokio::sync::oneshot;

/// A served API over a fresh log; stops when dropped.
struct Server {
    client: Client,
    app: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.app.ingest.log().shutdown();
    }
}

impl Server {
    async fn post(&self, stream: &str, content_type: &str, body: String) -> Response {
        let path = format!("/v1/streams/{stream}/records");
        self.client.post(&path, content_type, body).await.unwrap()
    }

    fn log(&self) -> &LogHandle {
        self.app.ingest.log()
    }

    /// Every record stored in `stream`, in seq order.
    fn stored(&self, stream: &str) -> Vec<Record> {
        stored(self.log(), stream)
    }
}

/// Starts a server with streams `telemetry` and `windows` (a window filter adding fields);
/// `extra` is TOML appended to the config.
async fn start(extra: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "data_dir = {:?}\n{extra}\n[[streams]]\nname = \"telemetry\"\n[[streams]]\nname = \"windows\"\n\
         filters = [{{ kind = \"window\", interval = \"1s\", field = \"v\" }}]\n",
        dir.path().join("data")
    );
    let cfg = EdgeConfig::from_toml(&toml, dir.path(), Some(HashMap::new())).unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    let app = AppState::new(&cfg, log);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(edge_agent::http::serve(listener, app.clone(), async {
        let _ = stopped.await;
    }));
    let client = Client::new(&url)
        .unwrap()
        .with_timeout(Duration::from_secs(60));
    Server {
        client,
        app,
        stop: Some(stop),
        _dir: dir,
    }
}

fn stored(log: &LogHandle, stream: &str) -> Vec<Record> {
    let epoch = log.epoch();
    let blocks = log.read_blocks(stream, epoch, 0, usize::MAX).unwrap();
    let limits = DecodeLimits::default();
    let mut out = Vec::new();
    for b in blocks {
        out.extend(decode_block(&b.bytes, &limits).unwrap().records);
    }
    out
}

fn json(r: &Response) -> Json {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.text()))
}

/// One NDJSON line: key `k`, `fields` fields named `{prefix}{i}`.
fn ndjson_line(ts: i64, prefix: &str, fields: usize) -> String {
    let f: Vec<String> = (0..fields)
        .map(|i| format!("\"{prefix}{i}\":{i}"))
        .collect();
    format!(
        "{{\"key\":\"k\",\"ts\":{ts},\"fields\":{{{}}}}}\n",
        f.join(",")
    )
}

fn line_protocol(ts: i64, fields: usize) -> String {
    let f: Vec<String> = (0..fields).map(|i| format!("f{i}={i}i")).collect();
    format!("telemetry,dev=a {} {ts}\n", f.join(","))
}

const NDJSON: &str = "application/x-ndjson";
const LP: &str = "text/plain";

/// Asserts an answer is a refusal of `status` whose error contains every one of `needles`.
fn assert_refused(r: &Response, status: u16, needles: &[&str]) {
    assert_eq!(r.status, status, "{}", r.text());
    let msg = json(r)["error"].as_str().unwrap_or_default().to_owned();
    for n in needles {
        assert!(msg.contains(n), "{n:?} not in {msg:?}");
    }
}

#[tokio::test]
async fn the_field_limit_refuses_a_whole_request_and_the_next_one_succeeds() {
    let s = start("[ingest]\nfields_per_record_max = 5").await;
    let ok = ndjson_line(1, "f", 5);
    let over = format!("{ok}{}", ndjson_line(2, "f", 6));
    let r = s.post("telemetry", NDJSON, over).await;
    assert_refused(&r, 400, &["at most 5 fields in a record", "field number 6"]);
    assert_eq!(json(&r)["line"], 2, "the error names the record's line");
    let r = s
        .post(
            "telemetry",
            LP,
            format!("{}{}", line_protocol(1, 1), line_protocol(2, 6)),
        )
        .await;
    assert_refused(&r, 400, &["at most 5 fields in a record"]);
    assert_eq!(json(&r)["line"], 2);
    assert!(
        s.stored("telemetry").is_empty(),
        "nothing of a refused request is stored"
    );
    // The next valid batch succeeds, from seq 1.
    let r = s.post("telemetry", NDJSON, ok.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(json(&r)["first_seq"], 1);
    let r = s.post("telemetry", LP, line_protocol(3, 5)).await;
    assert_eq!(json(&r)["first_seq"], 2, "{}", r.text());
    assert_eq!(s.stored("telemetry").len(), 2);
}

#[tokio::test]
async fn a_key_the_hub_would_refuse_is_refused_at_ingest_alone() {
    // The hub refuses a whole block holding such a key, which would stall the stream; the
    // agent applies the same rule (`sync::record::key_problem`) to each request instead.
    let s = start("").await;
    for bad in ["a//b", "/a", "a/", "dev1/../dev2/x", "a/./b"] {
        let body = format!("{{\"key\":{bad:?},\"ts\":1,\"fields\":{{\"v\":1}}}}\n");
        let r = s.post("telemetry", NDJSON, body).await;
        assert_refused(&r, 400, &[bad, "which the hub refuses", "segments"]);
    }
    let r = s
        .post(
            "telemetry",
            NDJSON,
            "{\"key\":\"a\\u0000b\",\"ts\":1,\"fields\":{\"v\":1}}\n".into(),
        )
        .await;
    assert_refused(&r, 400, &["control characters"]);
    assert!(
        s.stored("telemetry").is_empty(),
        "nothing of a refused request is stored"
    );
    let r = s.post("telemetry", NDJSON, ndjson_line(1, "f", 1)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        json(&r)["first_seq"],
        1,
        "the next valid batch gets the next seq"
    );
}

#[tokio::test]
async fn a_filter_that_adds_fields_is_held_to_the_limit() {
    // The window emits five fields (v.count, v.min, v.max, v.mean, v.last) from one.
    let s = start("[ingest]\nfields_per_record_max = 4").await;
    let body = (0..3)
        .map(|i| {
            format!(
                "{{\"key\":\"k\",\"ts\":{},\"fields\":{{\"v\":{i}.5}}}}\n",
                1_764_374_400_000_000_000i64 + i * 1_000_000_000
            )
        })
        .collect::<String>();
    let r = s.post("windows", NDJSON, body).await;
    assert_refused(
        &r,
        413,
        &["has 5 fields", "ingest.fields_per_record_max (4)"],
    );
    assert!(s.stored("windows").is_empty());
    let r = s.post("telemetry", NDJSON, ndjson_line(1, "v", 4)).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn producers_cannot_set_reserved_fields() {
    let s = start("").await;
    for (ct, body, field) in [
        (
            NDJSON,
            "{\"key\":\"k\",\"ts\":1,\"fields\":{\"v\":1,\"_topic\":\"plant/valve7/cmd/open\"}}\n",
            "_topic",
        ),
        (
            NDJSON,
            "{\"key\":\"k\",\"ts\":1,\"fields\":{\"_mqtt_digest\":7}}\n",
            "_mqtt_digest",
        ),
        (LP, "telemetry,dev=a v=1,_topic=\"x/y\" 1\n", "_topic"),
    ] {
        let r = s.post("telemetry", ct, body.to_owned()).await;
        assert_refused(&r, 400, &[&format!("{field:?} is reserved")]);
        assert_eq!(json(&r)["line"], 1);
    }
    // The idempotency field keeps its own explanation.
    let r = s
        .post(
            "telemetry",
            NDJSON,
            "{\"key\":\"k\",\"ts\":1,\"fields\":{\"_idempotency\":\"x\"}}\n".into(),
        )
        .await;
    assert_refused(
        &r,
        400,
        &["\"_idempotency\" is reserved", "Idempotency-Key"],
    );
    assert!(s.stored("telemetry").is_empty());
    // A `_` inside a name is an ordinary name.
    let r = s
        .post("telemetry", LP, "telemetry,dev=a v_1=1 1\n".into())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

fn mqtt_cfg(format: PayloadFormat) -> MqttSourceConfig {
    MqttSourceConfig {
        url: "mqtt://127.0.0.1:1883".into(),
        topics: vec!["sensors/#".into()],
        stream: "telemetry".into(),
        format,
        topic_template: None,
        value_field: "value".into(),
        unmatched: MqttUnmatched::Drop,
        ts_field: None,
        ts_unit: TsUnit::Ms,
        ts_invalid_receive_time: false,
        client_id: None,
        qos: 1,
        dedupe_window: 16,
        tls: None,
        sparkplug: None,
    }
}

#[test]
fn mqtt_payloads_meet_the_same_rules() {
    let stats = Arc::new(MqttStats::default());
    let json = Mapper::new(&mqtt_cfg(PayloadFormat::Json), stats.clone()).with_fields_max(3);
    let line = Mapper::new(&mqtt_cfg(PayloadFormat::Line), stats.clone()).with_fields_max(3);
    let publish = |p: &str| Publish::new("sensors/a", QoS::AtLeastOnce, p.as_bytes().to_vec());
    let mut out = Vec::new();
    let bad = [
        (&json, r#"{"a":1,"b":{"c":2,"d":{"e":3}},"f":4}"#),
        (&json, r#"{"v":1,"_topic":"plant/valve7/cmd/open"}"#),
        (&line, "m,dev=a a=1,b=2,c=3,d=4 1"),
        (&line, "m,dev=a v=1,_topic=\"x\" 1"),
    ];
    for (m, payload) in bad {
        m.map(&publish(payload), 5, 9, &mut out);
        assert!(out.is_empty(), "{payload} stored {out:?}");
    }
    assert_eq!(
        stats.bad_payloads.load(Ordering::Relaxed),
        4,
        "each refused payload is counted (and acked without storing, as every bad payload)"
    );
    // At the limit both store, and the agent's own `_topic` is set on top of it.
    json.map(&publish(r#"{"a":1,"b":{"c":2,"d":3}}"#), 5, 9, &mut out);
    line.map(&publish("m,dev=a a=1,b=2,c=3 1"), 5, 9, &mut out);
    assert_eq!(out.len(), 2);
    for r in &out {
        assert_eq!(r.field(TOPIC_FIELD), Some(&Value::Str("sensors/a".into())));
        assert_eq!(
            r.fields.iter().filter(|(n, _)| !n.starts_with('_')).count(),
            3
        );
    }
}

/// `records` records of `fields` fields each, every name new: `{tag}_{record}_{field}`.
fn distinct(tag: &str, records: usize, fields: usize, ts: i64) -> Vec<Record> {
    (0..records)
        .map(|r| Record {
            tags: Vec::new(),
            key: format!("k{}", r % 7),
            ts: ts + r as i64,
            fields: (0..fields)
                .map(|f| (format!("{tag}_{r}_{f}"), Value::I64(f as i64)))
                .collect(),
        })
        .collect()
}

fn ndjson_of(records: &[Record]) -> String {
    sync::parse::write_ndjson(records).unwrap()
}

/// One request with more distinct field names than a columnar block holds (80 records of 1,000
/// new names: 80,000 columns) under `block_version = 2` and block limits that would take it in
/// one block.
async fn hostile_request_under_columnar_blocks() -> (Server, Response, Vec<Record>) {
    let s = start(
        "[http]\nbody_bytes_max = \"64MiB\"\n[storage]\nblock_version = \"2\"\n\
         block_bytes_max = \"64MiB\"\nfsync = \"always\"",
    )
    .await;
    let records = distinct("h", 80, 1_000, 1);
    let r = s.post("telemetry", NDJSON, ndjson_of(&records)).await;
    (s, r, records)
}

/// The columnar cut, in the log's sealer and in the re-blocker, and its mutation check. One
/// test, because the switch is process-wide: nothing else in this binary seals columnar blocks.
#[test]
fn columnar_blocks_are_cut_instead_of_failing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(a_hostile_request_is_cut());
    reblock_of_a_wide_backlog_cuts_blocks();

    // Mutation check: without the cut, the same request fails and takes the log down with it,
    // and the backlog cannot be re-sealed: the tests above catch a missing cut.
    switches::set_block_cut(false);
    let (status, next, poisoned) = rt.block_on(async {
        let (s, r, _) = hostile_request_under_columnar_blocks().await;
        let next = s.post("telemetry", NDJSON, ndjson_line(1, "v", 2)).await;
        (r.status, next.status, s.log().status().poisoned.is_some())
    });
    let reblocked = reblock(backlog_blocks().1, 32_768, VERSION_COLUMNAR);
    switches::set_block_cut(true);
    assert_ne!(status, 200, "without the cut the request cannot be sealed");
    assert!(
        poisoned && next == 503,
        "without the cut the log is poisoned ({next})"
    );
    assert!(
        reblocked.is_err(),
        "without the cut the backlog cannot be re-sealed"
    );
}

async fn a_hostile_request_is_cut() {
    let (s, r, records) = hostile_request_under_columnar_blocks().await;
    assert_eq!(r.status, 200, "{}", r.text());
    let blocks = s
        .log()
        .read_blocks("telemetry", s.log().epoch(), 0, usize::MAX)
        .unwrap();
    assert!(blocks.len() >= 2, "80,000 columns need at least two blocks");
    assert!(blocks.iter().all(|b| b.header.version == VERSION_COLUMNAR));
    assert_eq!(
        s.stored("telemetry"),
        records,
        "every record, in order, as sent"
    );
    let next = s.post("telemetry", NDJSON, ndjson_line(1, "v", 2)).await;
    assert_eq!(next.status, 200, "the log stays writable: {}", next.text());
    assert_eq!(json(&next)["first_seq"], 81);
}

/// A stored backlog of 70 row blocks whose records carry 70,000 distinct field names (1,000
/// each), as a long outage of a producer with changing names leaves it.
fn backlog_blocks() -> (
    tempfile::TempDir,
    Vec<edge_agent::log::StoredBlock>,
    Vec<Record>,
) {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "data_dir = {:?}\n[[streams]]\nname = \"telemetry\"\n",
        dir.path().join("data")
    );
    let cfg = EdgeConfig::from_toml(&toml, dir.path(), Some(HashMap::new())).unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    let mut all = Vec::new();
    for b in 0..70 {
        let recs = distinct(&format!("b{b}"), 1, 1_000, b);
        log.append_blocking("telemetry", recs.clone()).unwrap();
        all.extend(recs);
    }
    let blocks = log
        .read_blocks("telemetry", log.epoch(), 0, usize::MAX)
        .unwrap();
    log.shutdown();
    (dir, blocks, all)
}

fn reblock_of_a_wide_backlog_cuts_blocks() {
    let (_dir, blocks, records) = backlog_blocks();
    assert!(blocks.len() >= 2, "the backlog is a run of stored blocks");
    let first_seq = blocks[0].header.first_seq;
    let out = reblock(blocks, 32_768, VERSION_COLUMNAR).expect("the backlog re-seals");
    assert!(out.len() >= 2, "70,000 columns need at least two blocks");
    let limits = DecodeLimits::default();
    let mut seq = first_seq;
    let mut back = Vec::new();
    for bytes in &out {
        let b = decode_block(bytes, &limits).unwrap();
        assert_eq!(b.header.version, VERSION_COLUMNAR);
        assert_eq!(b.header.first_seq, seq, "the cut blocks are contiguous");
        seq += u64::from(b.header.count);
        back.extend(b.records);
    }
    assert_eq!(back, records, "every record, in order");
}
