//! The agent as a Sparkplug B host application against a real edge node: `sparkplug_node.py`
//! (Eclipse Tahu's payload helpers from PyPI `mqtt-spb-wrapper`, over paho-mqtt) through a real
//! mosquitto on a loopback port. The node is born before the agent subscribes, so the agent's
//! first DATA has no BIRTH state and it must ask for a rebirth, which the node answers; then
//! DATA of every datatype by alias, device DATA, historical DATA, a seq gap, a DDEATH, an
//! NDEATH, a new session with a new bdSeq and a stale NDEATH of the old one.
//!
//! Afterwards every metric the node says the host must hold is stored exactly once, with its
//! name, type, value, timestamp and tags; the rebirth request, the gap and the deaths are
//! counted, and the gap and deaths are event records.

mod process_support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use process_support::{Setup, free_port};
use serde_json::Value as Json;

const PIP: &str = "pip install -q mqtt-spb-wrapper==2.1.2 paho-mqtt==1.6.1 protobuf==3.20.3";

/// A mosquitto process on a free loopback port, killed on drop.
struct Broker {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Broker {
    fn start() -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        )
        .unwrap();
        let bin = [
            "/usr/sbin/mosquitto",
            "/usr/local/sbin/mosquitto",
            "/usr/bin/mosquitto",
        ]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("mosquitto");
        let child = Command::new(bin)
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto must be installed: apt-get install -y mosquitto");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "mosquitto did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Broker {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Fails with the install line unless the node's Python packages import.
fn check_python() {
    let out = Command::new("python3")
        .args([
            "-c",
            "import mqtt_spb_wrapper.spb_protobuf, paho.mqtt.client",
        ])
        .output()
        .unwrap_or_else(|e| panic!("python3 is needed ({e}); then: {PIP}"));
    assert!(
        out.status.success(),
        "the Sparkplug edge node needs its Python packages: {PIP}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Reads lines from the node's stdout until `want`.
fn expect_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, want: &str) {
    for line in lines.by_ref() {
        if line.unwrap().trim() == want {
            return;
        }
    }
    panic!("the Sparkplug node ended before printing {want:?} (its stderr is above)");
}

/// `device=dev1/edge_node=n1/group=g1` into its tags.
fn tags_of(key: &str) -> HashMap<String, String> {
    key.split('/')
        .map(|t| {
            let (n, v) = t.split_once('=').unwrap();
            (n.to_owned(), v.to_owned())
        })
        .collect()
}

/// A stored field as (kind, value), the kind told by its JSON shape.
fn kind_of(v: &Json) -> (&'static str, Json) {
    match v {
        Json::Bool(_) => ("bool", v.clone()),
        Json::String(_) => ("str", v.clone()),
        Json::Number(n) if n.is_f64() => ("f64", v.clone()),
        Json::Number(_) => ("i64", v.clone()),
        Json::Object(o) => ("bytes", o["$bytes"].clone()),
        other => panic!("unexpected field value {other}"),
    }
}

fn metric(scrape: &str, name: &str) -> u64 {
    let prefix = format!("tributary_edge_sparkplug_{name}_total{{source=\"0\"}} ");
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in /metrics"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn host_application_against_a_tahu_edge_node() {
    check_python();
    let broker = Broker::start();
    let setup = Setup::new("fsync = \"interval:10ms\"");
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\nstream = \"telemetry\"\n\
             format = \"sparkplug\"\nhost_id = \"tributary\"\ngroups = [\"g1\"]\nrebirth_interval = \"1s\"\n",
            broker.port
        ),
    )
    .unwrap();
    let expected_path = setup.dir.path().join("expected.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sparkplug_node.py");
    let mut node = Command::new("python3")
        .arg(&script)
        .arg(broker.port.to_string())
        .arg("tributary")
        .arg(&expected_path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(node.stdout.take().unwrap()).lines();
    expect_line(&mut lines, "born");
    let mut agent = setup.start();
    expect_line(&mut lines, "done");
    assert!(node.wait().unwrap().success(), "the Sparkplug node failed");
    let expected: Vec<Json> =
        serde_json::from_slice(&std::fs::read(&expected_path).unwrap()).unwrap();
    // One record per metric (each has its own timestamp), plus a gap and two death events.
    let want_records = expected.len() as u64 + 3;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let scrape = loop {
        let status = rt.block_on(setup.client().get("/v1/status")).unwrap();
        let v: Json = serde_json::from_slice(&status.body).unwrap();
        if v["streams"][0]["durable_seq"].as_u64().unwrap_or(0) >= want_records {
            let m = rt.block_on(setup.client().get("/metrics")).unwrap();
            break String::from_utf8(m.body.to_vec()).unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {want_records} records stored:\n{}",
            v["streams"][0]["durable_seq"],
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    agent.terminate();
    drop(broker);

    assert!(metric(&scrape, "rebirths_requested") >= 1, "{scrape}");
    assert_eq!(metric(&scrape, "seq_gaps"), 1, "{scrape}");
    assert_eq!(
        metric(&scrape, "deaths"),
        2,
        "the DDEATH and the NDEATH: {scrape}"
    );
    // The old session's NDEATH, sent late by the new one (and its will, should the broker
    // have published it after the first session's disconnect).
    assert!(metric(&scrape, "stale_deaths") >= 1, "{scrape}");
    assert!(metric(&scrape, "dropped_messages") >= 1, "{scrape}");
    assert_eq!(metric(&scrape, "bad_metrics"), 0, "{scrape}");

    let mut stored: HashMap<String, u32> = HashMap::new();
    let mut events = Vec::new();
    for line in setup.inspect() {
        let key = line["key"].as_str().unwrap();
        let tags = tags_of(key);
        assert_eq!(tags["group"], "g1");
        assert_eq!(tags["edge_node"], "n1");
        if let Some(e) = tags.get("spb_event") {
            events.push((
                e.clone(),
                tags.get("device").cloned(),
                line["fields"].clone(),
            ));
            continue;
        }
        for (name, v) in line["fields"].as_object().unwrap() {
            if name.starts_with('_') {
                continue;
            }
            let (kind, value) = kind_of(v);
            let entry = serde_json::json!({
                "device": tags.get("device"),
                "historical": tags.contains_key("historical"),
                "name": name,
                "ts_ms": line["ts"].as_i64().unwrap() / 1_000_000,
                "kind": kind,
                "value": value,
            });
            *stored.entry(entry.to_string()).or_default() += 1;
        }
    }
    for e in &expected {
        let n = stored.remove(&e.to_string()).unwrap_or(0);
        assert_eq!(n, 1, "expected exactly once: {e}");
    }
    assert!(
        stored.is_empty(),
        "stored but never sent (or of another type): {stored:?}"
    );
    events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let kinds: Vec<(&str, Option<&str>)> = events
        .iter()
        .map(|(e, d, _)| (e.as_str(), d.as_deref()))
        .collect();
    assert_eq!(
        kinds,
        [("death", None), ("death", Some("dev1")), ("seq_gap", None)]
    );
    assert_eq!(events[0].2["_spb_bdseq"], 0);
    assert_eq!(events[2].2["_spb_seq_expected"], 5);
    assert_eq!(events[2].2["_spb_seq_received"], 6);
}
