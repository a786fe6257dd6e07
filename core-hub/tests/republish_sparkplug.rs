//! `republish.format = "sparkplug"` against a real peer: a Sparkplug subscriber
//! (`sparkplug_host.py`, Eclipse Tahu's payload from PyPI `mqtt-spb-wrapper` over paho-mqtt) on
//! a real mosquitto on a loopback port.
//!
//! The scenario: a live device (`truck-1`, records stamped now) whose records gain a new field
//! half way (so its device is born again), then a device whose backlog arrives late
//! (`truck-2`, records stamped two days ago, as an agent that was offline ships them) while
//! `truck-1` stays live, then a rebirth the host asks for with an NCMD, then a stop.
//!
//! Afterwards: every ingested field arrived exactly once as a DDATA metric with its name,
//! datatype, timestamp (ms) and value; the backlog's metrics, and only those, have
//! `is_historical` (and they are counted: the case happened); the NBIRTH came first with a
//! `bdSeq` and every DDATA after a DBIRTH of its device that names each of its metrics with its
//! datatype; seq runs 0..=255 and wraps; the rebirth brought a new NBIRTH with the same `bdSeq`
//! and new DBIRTHs; the stop an NDEATH with that `bdSeq`. A hub restarted on the same data
//! directory births the node with the next `bdSeq`.
//!
//! Needs `mosquitto` (see `mqtt_support`) and the Python packages below (`.ci/test` installs
//! them).

mod common;
mod mqtt_support;

use core_hub::republish::{self, RawRepublish, RawSparkplug};
use mqtt_support::{Broker, DEADLINE};
use serde_json::{Value as Json, json};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};
use tokio::sync::watch;

const PIP: &str = "pip install -q mqtt-spb-wrapper==2.1.2 paho-mqtt==1.6.1 protobuf==3.20.3";
const STREAM: &str = "telemetry";
const GROUP: &str = "plant";
const NODE: &str = "hub-telemetry";
const DAY_NS: i64 = 86_400_000_000_000;
// Sparkplug datatype numbers.
const INT64: u64 = 4;
const UINT64: u64 = 8;
const DOUBLE: u64 = 10;
const BOOLEAN: u64 = 11;
const STRING: u64 = 12;

/// The subscriber process, killed on drop; its stdout lines arrive on `lines`.
struct Host {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    seen: Vec<Json>,
}

impl Host {
    fn start(port: u16) -> Host {
        let out = Command::new("python3")
            .args([
                "-c",
                "import mqtt_spb_wrapper.spb_protobuf, paho.mqtt.client",
            ])
            .output()
            .unwrap_or_else(|e| panic!("python3 is needed ({e}); then: {PIP}"));
        assert!(
            out.status.success(),
            "the Sparkplug subscriber needs its Python packages: {PIP}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sparkplug_host.py");
        let mut child = Command::new("python3")
            .args([script, &port.to_string(), GROUP])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting sparkplug_host.py");
        let stdout = child.stdout.take().unwrap();
        let stdin = child.stdin.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut host = Host {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        };
        assert_eq!(host.next(), json!("ready"));
        host
    }

    /// The next message line, within the deadline.
    fn next(&mut self) -> Json {
        let line = self.lines.recv_timeout(DEADLINE).unwrap_or_else(|e| {
            panic!(
                "the subscriber sent nothing more ({e}) after {} messages",
                self.seen.len()
            )
        });
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line}: {e}"))
    }

    /// Collects messages until `done` holds for what was seen.
    fn until(&mut self, what: &str, done: impl Fn(&[Json]) -> bool) {
        let start = Instant::now();
        while !done(&self.seen) {
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
            let m = self.next();
            self.seen.push(m);
        }
    }

    fn rebirth(&mut self, node: &str) {
        writeln!(self.stdin, "rebirth {node}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

/// Records `first..=last` of a live `truck-1` (stamped `base`+seq ms); from seq 101 on they
/// carry a new string field, `label`.
fn live(first: u64, last: u64, base: i64) -> Vec<Record> {
    (first..=last)
        .map(|seq| {
            let mut fields = vec![
                ("temp".to_string(), Value::F64(seq as f64 / 4.0)),
                ("count".into(), Value::I64(seq as i64 * 1000)),
                ("on".into(), Value::Bool(seq.is_multiple_of(3))),
            ];
            if seq > 100 {
                fields.push(("label".into(), Value::Str(format!("run-{seq}"))));
            }
            Record {
                tags: Vec::new(),
                key: "truck-1/engine".into(),
                ts: base + seq as i64 * 1_000_000,
                fields,
            }
        })
        .collect()
}

/// The backlog of `truck-2`, stamped two days before `base`.
fn backlog(first: u64, last: u64, base: i64) -> Vec<Record> {
    (first..=last)
        .map(|seq| Record {
            tags: Vec::new(),
            key: "truck-2/gps".into(),
            ts: base - 2 * DAY_NS + seq as i64 * 1_000_000,
            fields: vec![
                ("lat".to_string(), Value::F64(48.0 + seq as f64 / 1024.0)),
                ("fix".into(), Value::Bool(seq % 5 != 0)),
            ],
        })
        .collect()
}

/// One metric as the host must see it: (device, name, datatype, timestamp, historical, value).
type Want = (String, String, u64, u64, bool, String);

fn wanted(device: &str, records: &[Record], historical: bool) -> Vec<Want> {
    let mut out = Vec::new();
    for r in records {
        for (name, v) in &r.fields {
            let (dt, value) = match v {
                Value::F64(f) => (DOUBLE, json!(f)),
                Value::I64(i) => (INT64, json!(i)),
                Value::Bool(b) => (BOOLEAN, json!(b)),
                Value::Str(s) => (STRING, json!(s)),
                Value::Bytes(_) => unreachable!(),
            };
            out.push((
                device.to_string(),
                format!("{}/{name}", r.key),
                dt,
                (r.ts / 1_000_000) as u64,
                historical,
                value.to_string(),
            ));
        }
    }
    out
}

fn kind(m: &Json) -> &str {
    m["kind"].as_str().unwrap_or("")
}

fn ddata_metrics(seen: &[Json]) -> usize {
    seen.iter()
        .filter(|m| kind(m) == "DDATA")
        .map(|m| m["metrics"].as_array().unwrap().len())
        .sum()
}

fn bd_seq_of(m: &Json) -> u64 {
    let metrics = m["metrics"].as_array().unwrap();
    let bd = metrics
        .iter()
        .find(|x| x["name"] == "bdSeq")
        .unwrap_or_else(|| panic!("no bdSeq in {m}"));
    assert_eq!(bd["datatype"], UINT64, "bdSeq is a UInt64: {m}");
    bd["value"].as_u64().unwrap()
}

async fn commit(hub: &core_hub::Hub, device: &str, first: u64, records: &[Record]) {
    let block = encode_block(VERSION_ROWS, 1, first, records).unwrap();
    hub.commit_block(device, STREAM, &block).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparkplug_births_data_and_backfill_as_historical() {
    let broker = Broker::start();
    let mut host = Host::start(broker.port);
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let cfg = RawRepublish {
        url: Some(format!("mqtt://127.0.0.1:{}", broker.port)),
        streams: Some(vec![STREAM.into()]),
        format: Some("sparkplug".into()),
        sparkplug: Some(RawSparkplug {
            group_id: Some(GROUP.into()),
            edge_node_id: Some("hub-{stream}".into()),
            // Far from both the live records' age (they reach the sink within moments) and
            // the backlog's (two days), so the rule, not the machine's speed, decides.
            historical_after: Some("1h".into()),
            ..RawSparkplug::default()
        }),
        batch_records: Some(32),
        poll_interval: Some("10ms".into()),
        ..RawRepublish::default()
    }
    .parse()
    .unwrap();
    let cfg_again = cfg.clone();
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks = republish::start(hub.clone(), cfg, stop_rx);

    // Live: truck-1, 150 records, a new field from seq 101.
    let base = now_ns();
    let mut want = Vec::new();
    for (first, last) in [(1, 60), (61, 100), (101, 150)] {
        let rs = live(first, last, base);
        commit(&hub, "truck-1", first, &rs).await;
        want.extend(wanted("truck-1", &rs, false));
    }
    let n = want.len();
    host.until("the live records", |s| ddata_metrics(s) >= n);

    // Backfill: truck-2's backlog arrives late, while truck-1 stays live.
    let old = backlog(1, 120, base);
    commit(&hub, "truck-2", 1, &old[..70]).await;
    let rs = live(151, 180, base);
    commit(&hub, "truck-1", 151, &rs).await;
    commit(&hub, "truck-2", 71, &old[70..]).await;
    want.extend(wanted("truck-1", &rs, false));
    want.extend(wanted("truck-2", &old, true));
    let n = want.len();
    host.until("the backfill", |s| ddata_metrics(s) >= n);

    // The host asks for a rebirth; then more live data.
    host.rebirth(NODE);
    host.until("the rebirth", |s| {
        s.iter().filter(|m| kind(m) == "NBIRTH").count() >= 2
    });
    let rs = live(181, 190, base);
    commit(&hub, "truck-1", 181, &rs).await;
    want.extend(wanted("truck-1", &rs, false));
    let n = want.len();
    host.until("the data after the rebirth", |s| ddata_metrics(s) >= n);

    // A stop sends the NDEATH.
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    host.until("the NDEATH", |s| s.iter().any(|m| kind(m) == "NDEATH"));
    hub.shutdown();
    drop(hub);
    let before_restart = host.seen.clone();
    check(&before_restart, want);

    // A restarted hub's node takes the next bdSeq: the stored one goes on, so a Will of the
    // dead process that reaches the host late never names the new session.
    let hub = common::open(dir.path());
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks = republish::start(hub.clone(), cfg_again, stop_rx);
    host.until("the NBIRTH after the restart", |s| {
        s.len() > before_restart.len()
            && s[before_restart.len()..]
                .iter()
                .any(|m| kind(m) == "NBIRTH")
    });
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    hub.shutdown();
    let reborn = host.seen[before_restart.len()..]
        .iter()
        .find(|m| kind(m) == "NBIRTH")
        .unwrap();
    assert_eq!(
        bd_seq_of(reborn),
        (bd_seq_of(&before_restart[0]) + 1) % 256,
        "the restarted node's bdSeq follows the last one: {reborn}"
    );
}

/// Every property the module docs promise, over everything the host received.
fn check(seen: &[Json], want: Vec<Want>) {
    let first = &seen[0];
    assert_eq!(kind(first), "NBIRTH", "the NBIRTH comes first: {first}");
    assert_eq!(first["node"], NODE);
    let bd_seq = bd_seq_of(first);
    let mut got = Vec::new();
    // Device -> metric -> datatype, as born since the last NBIRTH.
    let mut born: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut dbirths: BTreeMap<String, usize> = BTreeMap::new();
    let (mut seq, mut wraps, mut nbirths) = (0u64, 0, 0);
    for m in seen {
        match kind(m) {
            "NBIRTH" => {
                nbirths += 1;
                assert_eq!(m["seq"], 0, "an NBIRTH has seq 0: {m}");
                assert_eq!(bd_seq_of(m), bd_seq, "a rebirth keeps the bdSeq");
                let rebirth = m["metrics"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|x| x["name"] == "Node Control/Rebirth")
                    .unwrap_or_else(|| panic!("no Node Control/Rebirth in {m}"));
                assert_eq!(
                    (rebirth["datatype"].as_u64(), &rebirth["value"]),
                    (Some(BOOLEAN), &json!(false))
                );
                (seq, born) = (0, BTreeMap::new());
            }
            "NDEATH" => {
                assert_eq!(bd_seq_of(m), bd_seq, "the NDEATH names the NBIRTH's bdSeq");
                assert!(m["seq"].is_null(), "an NDEATH has no seq");
            }
            k @ ("DBIRTH" | "DDATA") => {
                seq = (seq + 1) % 256;
                assert_eq!(m["seq"], seq, "seq follows on: {m}");
                wraps += usize::from(seq == 0);
                let device = m["device"].as_str().unwrap().to_string();
                let metrics = m["metrics"].as_array().unwrap();
                if k == "DBIRTH" {
                    *dbirths.entry(device.clone()).or_default() += 1;
                    let defs = metrics
                        .iter()
                        .map(|x| {
                            assert_eq!(x["is_null"], true, "births carry no values: {x}");
                            (
                                x["name"].as_str().unwrap().to_string(),
                                x["datatype"].as_u64().unwrap(),
                            )
                        })
                        .collect();
                    born.insert(device, defs);
                    continue;
                }
                let defs = born
                    .get(&device)
                    .unwrap_or_else(|| panic!("DDATA of {device} before its DBIRTH: {m}"));
                for x in metrics {
                    let name = x["name"].as_str().unwrap().to_string();
                    let dt = x["datatype"].as_u64().unwrap();
                    assert_eq!(
                        defs.get(&name),
                        Some(&dt),
                        "{name} was born with its datatype"
                    );
                    got.push((
                        device.clone(),
                        name,
                        dt,
                        x["timestamp"].as_u64().unwrap(),
                        x["is_historical"].as_bool().unwrap(),
                        x["value"].to_string(),
                    ));
                }
            }
            other => panic!("unexpected {other}: {m}"),
        }
    }
    assert_eq!(
        nbirths, 2,
        "one NBIRTH at connect, one answering the rebirth"
    );
    assert!(wraps >= 1, "seq wrapped from 255 to 0");
    // truck-1: at first, for the new field, after the rebirth; truck-2: once.
    assert_eq!(dbirths.get("truck-1"), Some(&3), "{dbirths:?}");
    assert_eq!(dbirths.get("truck-2"), Some(&1), "{dbirths:?}");

    let historical = got.iter().filter(|g| g.4).count();
    assert_eq!(
        historical, 240,
        "every backlog metric (120 records, 2 fields) is historical"
    );
    let distinct: BTreeSet<_> = got.iter().map(|g| (&g.0, &g.1, g.3)).collect();
    assert_eq!(distinct.len(), got.len(), "no metric arrived twice");
    let (mut got, mut want) = (got, want);
    got.sort();
    want.sort();
    assert_eq!(got.len(), want.len(), "every ingested field, once");
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w);
    }
}
