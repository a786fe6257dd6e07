//! Sparkplug B end to end through the real binaries and real peers: an edge node (Eclipse
//! Tahu's payload helpers from PyPI `mqtt-spb-wrapper`, over paho-mqtt) publishes to the site's
//! mosquitto; `edge-agent`, a Sparkplug host application there (`format = "sparkplug"`), ships
//! to `core-hub`, whose `[republish] format = "sparkplug"` sink is an edge node on a second
//! mosquitto, where the Sparkplug subscriber `core-hub/tests/sparkplug_host.py` records what a
//! SCADA host sees.
//!
//! The scenario: with the hub up, the node is born and publishes live node and device DATA
//! (stamped now). Then the hub is stopped (SIGTERM); the node keeps publishing for longer than
//! the sink's `historical_after`, and the agent stores it durably while its link is down. Once
//! the newest of that backlog is older than `historical_after`, the hub starts again, the agent
//! drains its backlog, and afterwards the node publishes live DATA again.
//!
//! Asserted: the fault happened (the agent's link went down, it held unacknowledged records
//! while the node published, the subscriber saw the hub's NDEATH and a new NBIRTH). The hub's
//! stream holds every metric value the node published exactly once, under its Sparkplug tags
//! as key, with its name, timestamp and value, and nothing else. The subscriber saw every one of
//! them exactly once as a DDATA metric (named `{key}/{metric}`, of the hub's device for the
//! agent) with its timestamp, datatype and value, and nothing else; the backlog's metrics, and
//! only they, have `is_historical` (counted: more than none); the live ones before the stop and
//! after the restart do not. Nothing was dead-lettered, dropped or left unknown on the way.
//!
//! Needs `mosquitto` and the Python packages below (`.ci/test` installs them).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use serde_json::Value as Json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::mosquitto::Mosquitto;
use tributary_tests::procs::{Proc, wait_until};

const PIP: &str = "pip install -q mqtt-spb-wrapper==2.1.2 paho-mqtt==1.6.1 protobuf==3.20.3";
const STREAM: &str = "telemetry";
/// The agent's device id (its certificate): the Sparkplug device of the hub's edge node.
const DEVICE_ID: &str = "spb-gw-1";
/// The agent's Sparkplug host id on the site broker.
const HOST_ID: &str = "tributary";
/// The site's edge node and its one device.
const GROUP: &str = "g1";
const NODE: &str = "n1";
const SPB_DEVICE: &str = "dev1";
/// The hub's edge node on its own broker.
const HUB_GROUP: &str = "scada";
const HUB_NODE: &str = "hub-telemetry";
/// The sink's `historical_after`. Live records reach the sink within moments of their
/// timestamp; the backlog is held back until it is older than this.
const HISTORICAL_AFTER: Duration = Duration::from_secs(3);
const WAIT: Duration = Duration::from_secs(60);
const STOP: Duration = Duration::from_secs(20);
// Sparkplug datatype numbers of what the hub publishes.
const INT64: u64 = 4;
const DOUBLE: u64 = 10;
const BOOLEAN: u64 = 11;
const STRING: u64 = 12;

/// The edge node, driven by commands on stdin, one at a time, each answered by a line `ok`:
/// `birth` waits for the host's STATE online and publishes NBIRTH and DBIRTH (with values);
/// `burst N GAP_MS` publishes N rounds of NDATA and DDATA, GAP_MS apart. Every metric value
/// the host must store is printed as a JSON line once its PUBLISH is acknowledged. Every
/// message is stamped now, a millisecond after the previous one at least, and its metrics
/// share that timestamp.
const NODE_PY: &str = r#"
import json, sys, threading, time
import paho.mqtt.client as mqtt
from mqtt_spb_wrapper.spb_protobuf import Payload, addMetric, MetricDataType as T

PORT, HOST_ID, GROUP, NODE, DEVICE = int(sys.argv[1]), *sys.argv[2:6]
NS = "spBv1.0"
online = threading.Event()
seq = 0
last_ts = 0


def stamp():
    global last_ts
    last_ts = max(int(time.time() * 1000), last_ts + 1)
    return last_ts


def node_metrics(i):
    return [("temp", T.Double, i + 0.25, "f64", i + 0.25),
            ("count", T.UInt32, i * 10, "i64", i * 10),
            ("on", T.Boolean, i % 2 == 0, "bool", i % 2 == 0),
            ("label", T.String, "v-%d" % i, "str", "v-%d" % i)]


def device_metrics(i):
    return [("level", T.Double, i / 2.0, "f64", i / 2.0),
            ("alarms", T.Int64, i * 3, "i64", i * 3)]


def topic(kind, device=None):
    return "%s/%s/%s/%s" % (NS, GROUP, kind, NODE) + ("/" + device if device else "")


def on_message(_c, _u, msg):
    if "/STATE/" in msg.topic:
        if json.loads(msg.payload).get("online"):
            online.set()
    else:
        print("sparkplug node: a command on %s" % msg.topic, file=sys.stderr, flush=True)


def publish(kind, metrics, device=None, bd=None):
    global seq
    ts = stamp()
    p = Payload()
    p.timestamp = ts
    p.seq = seq
    seq = (seq + 1) % 256
    if bd is not None:
        addMetric(p, "bdSeq", None, T.Int64, bd, ts)
    for name, dtype, value, _kind, _stored in metrics:
        addMetric(p, name, None, dtype, value, ts)
    c.publish(topic(kind, device), p.SerializeToString(), 1).wait_for_publish()
    for name, _dtype, _value, kind_, stored in metrics:
        print(json.dumps({"device": device, "name": name, "ts_ms": ts,
                          "kind": kind_, "value": stored}))


c = mqtt.Client(client_id="spb-e2e-node", clean_session=True)
will = Payload()
will.timestamp = stamp()
addMetric(will, "bdSeq", None, T.Int64, 0, will.timestamp)
c.will_set(topic("NDEATH"), will.SerializeToString(), 1, False)
c.on_message = on_message
c.connect("127.0.0.1", PORT)
c.loop_start()
c.subscribe([(topic("NCMD"), 1), ("%s/STATE/%s" % (NS, HOST_ID), 1)])
i = 0
for line in sys.stdin:
    words = line.split()
    if words[0] == "birth":
        if not online.wait(60):
            sys.exit("sparkplug node: no STATE online from the host within 60 s")
        rebirth = ("Node Control/Rebirth", T.Boolean, False, "bool", False)
        publish("NBIRTH", [rebirth] + node_metrics(0), bd=0)
        publish("DBIRTH", device_metrics(0), DEVICE)
    elif words[0] == "burst":
        n, gap = int(words[1]), float(words[2]) / 1000
        for _ in range(n):
            i += 1
            publish("NDATA", node_metrics(i))
            publish("DDATA", device_metrics(i), DEVICE)
            time.sleep(gap)
    else:
        sys.exit("sparkplug node: unknown command %r" % line)
    print("ok", flush=True)
"#;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Fails with the install line unless the peers' Python packages import.
fn check_python() -> Result<()> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import mqtt_spb_wrapper.spb_protobuf, paho.mqtt.client",
        ])
        .output()
        .with_context(|| format!("python3 is needed; then: {PIP}"))?;
    ensure!(
        out.status.success(),
        "the Sparkplug peers need their Python packages: {PIP}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A Python peer: its stdout lines arrive on a channel, stamped with the wall clock (ms) when
/// read; its stderr goes to a file for failure messages. Killed on drop.
struct Peer {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<(i64, String)>,
    stderr_path: std::path::PathBuf,
}

impl Peer {
    fn spawn(name: &'static str, dir: &Path, args: &[&str]) -> Result<Peer> {
        let stderr_path = dir.join(format!("{name}.stderr.log"));
        let mut child = Command::new("python3")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(File::create(&stderr_path)?)
            .spawn()
            .with_context(|| format!("starting the {name} (python3)"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let stdin = child.stdin.take().context("no stdin")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send((now_ms(), line)).is_err() {
                    return;
                }
            }
        });
        Ok(Peer {
            name,
            child,
            stdin,
            lines,
            stderr_path,
        })
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        format!(
            "--- {} stderr (last 20 lines) ---\n{}",
            self.name,
            all[all.len().saturating_sub(20)..].join("\n")
        )
    }

    /// The next stdout line within `timeout`, or why there is none.
    fn next(&mut self, timeout: Duration) -> Result<(i64, String)> {
        self.lines.recv_timeout(timeout).map_err(|e| {
            let exited = self.child.try_wait().ok().flatten();
            anyhow::anyhow!(
                "the {} sent no line ({e}; exit status {exited:?})\n{}",
                self.name,
                self.log_tail()
            )
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which part of the scenario a metric was published in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// Before the hub was stopped.
    Live,
    /// While the hub was down: the backlog.
    Backlog,
    /// After the hub came back and the backlog was drained.
    LiveAgain,
}

/// One metric value the node published (and the agent must have stored).
#[derive(Debug, Clone)]
struct Sent {
    phase: Phase,
    /// The record's key at the agent and the hub: `key_from_tags` of its Sparkplug tags.
    key: String,
    name: String,
    ts_ms: i64,
    kind: String,
    value: Json,
}

impl Sent {
    /// The metric's name in the hub's DDATA: `{key}/{field}`.
    fn hub_metric(&self) -> String {
        format!("{}/{}", self.key, self.name)
    }

    fn datatype(&self) -> u64 {
        match self.kind.as_str() {
            "f64" => DOUBLE,
            "i64" => INT64,
            "bool" => BOOLEAN,
            _ => STRING,
        }
    }

    /// Whether `got` is this value (numbers compared by kind, not by JSON spelling).
    fn same_value(&self, got: &Json) -> bool {
        match self.kind.as_str() {
            "f64" => got.as_f64().is_some() && got.as_f64() == self.value.as_f64(),
            "i64" => got.as_i64().is_some() && got.as_i64() == self.value.as_i64(),
            _ => got == &self.value,
        }
    }
}

/// The edge node.
struct Node {
    peer: Peer,
}

impl Node {
    /// Sends one command and returns the metrics it published, tagged with `phase`.
    fn command(&mut self, phase: Phase, cmd: &str) -> Result<Vec<Sent>> {
        writeln!(self.peer.stdin, "{cmd}").context("writing to the sparkplug node")?;
        self.peer.stdin.flush()?;
        let mut sent = Vec::new();
        loop {
            let (_, line) = self.peer.next(WAIT)?;
            if line == "ok" {
                return Ok(sent);
            }
            let m: Json = serde_json::from_str(&line).with_context(|| line.clone())?;
            let mut tags = vec![
                ("group".to_string(), GROUP.to_string()),
                ("edge_node".to_string(), NODE.to_string()),
            ];
            if let Some(d) = m["device"].as_str() {
                tags.push(("device".into(), d.into()));
            }
            sent.push(Sent {
                phase,
                key: sync::record::key_from_tags(&tags),
                name: m["name"].as_str().context("name")?.into(),
                ts_ms: m["ts_ms"].as_i64().context("ts_ms")?,
                kind: m["kind"].as_str().context("kind")?.into(),
                value: m["value"].clone(),
            });
        }
    }
}

/// The SCADA side: everything the subscriber printed, with when it was read.
struct Subscriber {
    peer: Peer,
    seen: Vec<(i64, Json)>,
}

impl Subscriber {
    /// Takes in whatever the subscriber printed so far.
    fn drain(&mut self) -> Result<()> {
        while let Ok((at, line)) = self.peer.lines.try_recv() {
            let m = serde_json::from_str(&line).with_context(|| line.clone())?;
            self.seen.push((at, m));
        }
        Ok(())
    }

    fn count(&self, kind: &str) -> usize {
        self.seen.iter().filter(|(_, m)| m["kind"] == kind).count()
    }

    /// Every DDATA metric: (read at ms, device, metric).
    fn ddata(&self) -> impl Iterator<Item = (i64, &str, &Json)> {
        self.seen
            .iter()
            .filter(|(_, m)| m["kind"] == "DDATA")
            .flat_map(|(at, m)| {
                let device = m["device"].as_str().unwrap_or("");
                m["metrics"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(move |x| (*at, device, x))
            })
    }

    /// Waits until the DDATA metrics number at least `n`.
    fn wait_ddata(&mut self, n: usize, what: &str) -> Result<()> {
        let mut err = None;
        let done = wait_until(WAIT, what, || match self.drain() {
            Ok(()) => self.ddata().count() >= n,
            Err(e) => {
                err = Some(e);
                true
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        done.with_context(|| {
            format!(
                "the subscriber saw {} of {n} DDATA metrics\n{}",
                self.ddata().count(),
                self.peer.log_tail()
            )
        })
    }

    fn wait_kind(&mut self, kind: &str, n: usize) -> Result<()> {
        let done = wait_until(WAIT, &format!("{n} {kind} at the subscriber"), || {
            self.drain().is_ok() && self.count(kind) >= n
        });
        done.with_context(|| self.peer.log_tail())
    }
}

fn tails(procs: &[&Proc]) -> String {
    procs
        .iter()
        .map(|p| p.log_tail(30))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The hub's republish checkpoint of the stream and the stream's readable end.
fn checkpoint_and_end(hub: std::net::SocketAddr) -> Result<(f64, f64)> {
    let checkpoint = cluster::fetch_metric(
        hub,
        &format!("tributary_hub_republish_checkpoint_offset{{stream=\"{STREAM}\"}}"),
    )?;
    let cut = http::get(hub, &format!("/v1/streams/{STREAM}/cut"))?;
    ensure!(cut.status == 200, "cut: {} {}", cut.status, cut.text());
    let end = cut.json()?["offset"]
        .as_f64()
        .context("no offset in the cut")?;
    Ok((checkpoint, end))
}

/// The agent's counter `tributary_edge_sparkplug_{name}_total`.
fn sparkplug_counter(agent: std::net::SocketAddr, name: &str) -> Result<f64> {
    cluster::fetch_metric(agent, &format!("tributary_edge_sparkplug_{name}_total"))
}

#[test]
fn a_backlog_shipped_after_a_hub_outage_reaches_scada_as_historical() -> Result<()> {
    check_python()?;
    let root = tempfile::Builder::new().prefix("trb-spb-e2e-").tempdir()?;
    let root = root.path();
    let site = Mosquitto::start()?;
    let scada = Mosquitto::start()?;

    let host_script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../core-hub/tests/sparkplug_host.py"
    );
    let mut sub = Subscriber {
        peer: Peer::spawn(
            "sparkplug subscriber",
            root,
            &[host_script, &scada.port().to_string(), HUB_GROUP],
        )?,
        seen: Vec::new(),
    };
    let (_, ready) = sub.peer.next(WAIT)?;
    ensure!(ready == "\"ready\"", "the subscriber said {ready}");

    let pki = Pki::init(root.join("pki"))?;
    let mut hub_spec = HubSpec::new(root);
    hub_spec.extra_toml = format!(
        "[republish]\nurl = \"mqtt://127.0.0.1:{port}\"\nstreams = [\"{STREAM}\"]\n\
         format = \"sparkplug\"\npoll_interval = \"10ms\"\n\n[republish.sparkplug]\n\
         group_id = \"{HUB_GROUP}\"\nedge_node_id = \"hub-{{stream}}\"\n\
         historical_after = \"{after}ms\"\n",
        port = scada.port(),
        after = HISTORICAL_AFTER.as_millis(),
    );
    let mut hub = hub_spec.start(&pki)?;
    let cert = pki.issue(DEVICE_ID, None)?;
    let mut agent_spec = AgentSpec::new(root, "agent", cert, Some(hub_spec.quic));
    agent_spec.extra_toml = format!(
        "[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\nstream = \"{STREAM}\"\n\
         format = \"sparkplug\"\nhost_id = \"{HOST_ID}\"\ngroups = [\"{GROUP}\"]\n\n",
        site.port()
    );
    // Back quickly once the hub is up again.
    agent_spec
        .env
        .push(("TRIBUTARY_EDGE__HUB__BACKOFF_MAX".into(), "500ms".into()));
    let agent = agent_spec.start()?;
    wait_until(WAIT, "the agent's link up", || {
        cluster::status(agent_spec.http).is_ok_and(|s| cluster::link(&s) == "up")
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    // The sink is connected once its edge node is born.
    sub.wait_kind("NBIRTH", 1)
        .with_context(|| tails(&[&hub, &agent]))?;

    let mut node = Node {
        peer: Peer::spawn(
            "sparkplug node",
            root,
            &[
                "-c",
                NODE_PY,
                &site.port().to_string(),
                HOST_ID,
                GROUP,
                NODE,
                SPB_DEVICE,
            ],
        )?,
    };
    let mut sent = Vec::new();

    // Live: births and DATA with the hub up.
    sent.extend(node.command(Phase::Live, "birth")?);
    sent.extend(node.command(Phase::Live, "burst 20 10")?);
    sub.wait_ddata(sent.len(), "the live metrics at the subscriber")
        .with_context(|| tails(&[&hub, &agent]))?;
    // Everything so far is checkpointed, so the restarted sink starts after it.
    wait_until(WAIT, "the republish checkpoint at the stream's end", || {
        checkpoint_and_end(hub_spec.http).is_ok_and(|(c, e)| c == e && e > 0.0)
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    let up = cluster::wait_caught_up(agent_spec.http, WAIT).with_context(|| agent.log_tail(30))?;
    let acked_before = cluster::stream_u64(&up, STREAM, "acked_seq");

    // The outage: the hub stops; the node publishes for longer than `historical_after`.
    hub.terminate(STOP)?;
    wait_until(WAIT, "the agent's link down", || {
        cluster::status(agent_spec.http).is_ok_and(|s| cluster::link(&s) != "up")
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    sub.wait_kind("NDEATH", 1)?;
    let outage_start = now_ms();
    let mut backlog = Vec::new();
    while backlog.is_empty() || now_ms() - outage_start <= HISTORICAL_AFTER.as_millis() as i64 {
        backlog.extend(node.command(Phase::Backlog, "burst 5 50")?);
    }
    // One record per message: its metrics share its timestamp.
    let backlog_records = backlog
        .iter()
        .map(|s| s.ts_ms)
        .collect::<BTreeSet<_>>()
        .len();
    // The agent holds the backlog durably, unacknowledged.
    let mut last = Json::Null;
    wait_until(WAIT, "the agent to store the backlog", || {
        cluster::status(agent_spec.http).is_ok_and(|s| {
            let durable = cluster::stream_u64(&s, STREAM, "durable_seq");
            last = s;
            durable >= acked_before + backlog_records as u64
        })
    })
    .with_context(|| format!("last status {last}\n{}", agent.log_tail(30)))?;
    let down = cluster::status(agent_spec.http)?;
    ensure!(
        cluster::link(&down) != "up" && cluster::unacked(&down) >= backlog_records as u64,
        "the agent must hold the backlog unacknowledged while the hub is down \
         ({backlog_records} records): {down}"
    );
    assert_eq!(
        cluster::stream_u64(&down, STREAM, "acked_seq"),
        acked_before,
        "nothing acknowledged while the hub is down: {down}"
    );
    // The backlog must be old by the time the sink sees it: the restart waits until its
    // newest metric is older than `historical_after`.
    let newest = backlog.iter().map(|s| s.ts_ms).max().unwrap_or(0);
    let old_at = newest + HISTORICAL_AFTER.as_millis() as i64 + 50;
    wait_until(
        WAIT,
        "the backlog to be older than historical_after",
        || now_ms() > old_at,
    )?;
    sent.extend(backlog);

    // The hub comes back; the agent drains the backlog and the sink republishes it.
    hub.restart()?;
    hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    cluster::wait_caught_up(agent_spec.http, WAIT).with_context(|| tails(&[&hub, &agent]))?;
    sub.wait_ddata(sent.len(), "the backlog at the subscriber")
        .with_context(|| tails(&[&hub, &agent]))?;

    // Live again.
    sent.extend(node.command(Phase::LiveAgain, "burst 20 10")?);
    sub.wait_ddata(sent.len(), "the live metrics after the restart")
        .with_context(|| tails(&[&hub, &agent]))?;
    cluster::wait_caught_up(agent_spec.http, WAIT).with_context(|| tails(&[&hub, &agent]))?;
    wait_until(WAIT, "the republish checkpoint at the stream's end", || {
        checkpoint_and_end(hub_spec.http).is_ok_and(|(c, e)| c == e)
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    sub.drain()?;
    ensure!(
        sub.count("NBIRTH") >= 2,
        "the restarted hub's edge node is born again"
    );

    // Nothing refused or lost on the way.
    for name in [
        "dropped_messages",
        "unknown_metrics",
        "bad_metrics",
        "seq_gaps",
    ] {
        let n = sparkplug_counter(agent_spec.http, name)?;
        assert_eq!(n, 0.0, "the agent's sparkplug {name}");
    }
    let dead = cluster::fetch_metric(hub_spec.http, "tributary_hub_republish_dead_letter_total")?;
    assert_eq!(dead, 0.0, "nothing dead-lettered");

    check_hub_stream(hub_spec.http, &sent)?;
    check_subscriber(&sub, &sent);
    Ok(())
}

/// The hub's stream: every sent metric once, under its key with its timestamp and value, and
/// nothing else (the agent's `_` fields aside).
fn check_hub_stream(hub: std::net::SocketAddr, sent: &[Sent]) -> Result<()> {
    let records = cluster::read_stream(hub, STREAM)?;
    let mut got: BTreeMap<(String, String, i64), Vec<Json>> = BTreeMap::new();
    for r in &records {
        assert_eq!(r.device, DEVICE_ID, "{r:?}");
        let fields = r.fields.as_object().context("fields")?;
        for (name, v) in fields.iter().filter(|(n, _)| !n.starts_with('_')) {
            let ts_ms = r.ts / 1_000_000;
            assert_eq!(r.ts, ts_ms * 1_000_000, "a ms timestamp: {r:?}");
            got.entry((r.key.clone(), name.clone(), ts_ms))
                .or_default()
                .push(v.clone());
        }
    }
    for s in sent {
        let id = (s.key.clone(), s.name.clone(), s.ts_ms);
        let values = got.remove(&id).unwrap_or_default();
        assert!(
            values.len() == 1 && s.same_value(&values[0]),
            "the hub's stream must hold {s:?} exactly once, holds {values:?}"
        );
    }
    assert!(
        got.is_empty(),
        "in the hub's stream but never sent: {got:?}"
    );
    Ok(())
}

/// The subscriber: every sent metric once as a DDATA metric, historical exactly when it was
/// the backlog, and nothing else.
fn check_subscriber(sub: &Subscriber, sent: &[Sent]) {
    let mut got: BTreeMap<(String, i64), Vec<(i64, &Json)>> = BTreeMap::new();
    for (at, device, m) in sub.ddata() {
        assert_eq!(device, DEVICE_ID, "the agent is the hub's device: {m}");
        let name = m["name"].as_str().unwrap_or("").to_string();
        let ts = m["timestamp"].as_i64().unwrap_or(-1);
        got.entry((name, ts)).or_default().push((at, m));
    }
    let nodes: Vec<&Json> = sub
        .seen
        .iter()
        .map(|(_, m)| &m["node"])
        .filter(|n| **n != HUB_NODE)
        .collect();
    assert!(nodes.is_empty(), "messages of another node: {nodes:?}");
    let (mut historical, mut live_delay_max) = (0, 0);
    for s in sent {
        let seen = got.remove(&(s.hub_metric(), s.ts_ms)).unwrap_or_default();
        assert_eq!(
            seen.len(),
            1,
            "the subscriber must see {s:?} exactly once as DDATA: {seen:?}"
        );
        let (at, m) = seen[0];
        assert_eq!(m["datatype"], s.datatype(), "{s:?}: {m}");
        assert!(s.same_value(&m["value"]), "{s:?}: {m}");
        assert_eq!(m["is_null"], false, "{s:?}: {m}");
        let is_historical = m["is_historical"] == true;
        historical += usize::from(is_historical);
        if s.phase != Phase::Backlog {
            live_delay_max = live_delay_max.max(at - s.ts_ms);
        }
        assert_eq!(
            is_historical,
            s.phase == Phase::Backlog,
            "is_historical exactly for the backlog: {s:?} arrived {} ms after its timestamp: {m}",
            at - s.ts_ms
        );
    }
    assert!(
        got.is_empty(),
        "DDATA metrics at the subscriber that were never sent: {got:?}"
    );
    let backlog = sent.iter().filter(|s| s.phase == Phase::Backlog).count();
    assert!(historical > 0, "the outage produced historical metrics");
    assert_eq!(historical, backlog, "every backlog metric is historical");
    eprintln!(
        "{} metrics; {historical} of the backlog historical; live ones read at most \
         {live_delay_max} ms after their timestamp",
        sent.len()
    );
}
