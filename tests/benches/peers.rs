//! Side-by-side benchmarks against peer systems, with the machine's limits measured in the same
//! run (issue 9). A benchmark program (`harness = false`), never a timed test:
//!
//! ```text
//! cargo build --release -p edge-agent -p core-hub
//! cargo bench -p tributary-tests --bench peers -- [limits] [fsync] [catchup] [mqtt] \
//!     [--seconds S] [--catchup-records N] [--mqtt-records M] [--dir DIR]
//! ```
//!
//! With no section named, all run. Each prints one JSON object per figure on stdout and a
//! human summary on stderr. Sections:
//!
//! - `limits`: `edge-agent bench append --json --records 1` (first line: sequential write MB/s
//!   and the fdatasync rate of the data directory's disk).
//! - `fsync`: 64 concurrent single-record producers, each acknowledged only after fsync, for
//!   S seconds (default 5), and the same with 1 producer. Tributary: the agent's HTTP ingest
//!   with `storage.fsync = "always"`, keep-alive connections. NATS: JetStream publish with ack
//!   to a file-storage stream, `sync_interval: always`, one connection per producer.
//! - `catchup`: store-and-forward after an outage. NATS: a leaf node (JetStream domain `leaf`,
//!   stream `EDGE`) and a hub server (domain `hub`, stream `HUB` sourcing `EDGE`). Tributary: an
//!   agent and a hub. The hub side is stopped, N records (default 100,000) are published at the
//!   edge and acknowledged there, the hub side is started again, and the time until the hub
//!   side holds all N is measured from the moment it accepts connections. Reconnect backoff is
//!   capped at 1 s on both sides (`leafnodes.reconnect`, `TRIBUTARY_EDGE__HUB__BACKOFF_MAX`).
//! - `mqtt`: mosquitto with persistence as a QoS 1 bridge (edge broker bridged to a core
//!   broker, persistent subscriber session on the core) against the agent's MQTT source
//!   shipping to a hub. The core side is stopped, M messages (default 20,000) are published to
//!   the edge broker with `mosquitto_pub -q 1`, the core side is restarted, and losses,
//!   duplicates and catch-up time are counted at the core. Run twice: a clean outage, and one
//!   where the edge store (the edge broker for the bridge, the agent for Tributary) is
//!   `kill -9`ed during the outage, right after the publisher got its last PUBACK. Both brokers
//!   save their persistence file every second (`autosave_interval 1`; the default is 30 min).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::mosquitto::{Mosquitto, MosquittoOptions};
use tributary_tests::peers::{self, KeepAlive, NatsClient, NatsServer, jetstream_conf};
use tributary_tests::procs::{Proc, bin_path, wait_until};

const PRODUCERS: usize = 64;
const WAIT: Duration = Duration::from_secs(600);

struct Args {
    sections: Vec<String>,
    seconds: f64,
    catchup_records: u64,
    mqtt_records: u64,
    dir: PathBuf,
}

fn args() -> Result<Args> {
    let mut a = Args {
        sections: Vec::new(),
        seconds: 5.0,
        catchup_records: 100_000,
        mqtt_records: 20_000,
        dir: std::env::temp_dir().join("trb-peers"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().context("missing value");
        match arg.as_str() {
            "--seconds" => a.seconds = value()?.parse()?,
            "--catchup-records" => a.catchup_records = value()?.parse()?,
            "--mqtt-records" => a.mqtt_records = value()?.parse()?,
            "--dir" => a.dir = value()?.into(),
            // `cargo bench` passes `--bench`.
            "--bench" => {}
            s if !s.starts_with('-') => a.sections.push(s.to_string()),
            other => bail!("unknown option {other}"),
        }
    }
    if a.sections.is_empty() {
        a.sections = ["limits", "fsync", "catchup", "mqtt"]
            .map(String::from)
            .to_vec();
    }
    Ok(a)
}

fn emit(v: Value) {
    println!("{v}");
    let _ = std::io::stdout().flush();
}

/// One record's JSON, about 100 bytes like the other benchmarks' records.
fn record_json(producer: usize, n: u64) -> Value {
    json!({ "key": format!("sensor-{producer:02}"), "ts": 1_700_000_000_000_000_000i64 + n as i64,
            "fields": { "i": n, "p": producer, "temp": 21.5, "ok": true, "site": "plant-north" } })
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() -> Result<()> {
    let args = args()?;
    std::fs::create_dir_all(&args.dir)?;
    for bin in ["edge-agent", "core-hub"] {
        ensure!(
            bin_path(bin).is_file(),
            "{} missing: `cargo build --release -p edge-agent -p core-hub` first",
            bin_path(bin).display()
        );
    }
    let mut limits = Value::Null;
    for section in &args.sections {
        let dir = args.dir.join(section);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        match section.as_str() {
            "limits" => limits = machine_limits(&dir)?,
            "fsync" => fsync_producers(&dir, args.seconds, &limits)?,
            "catchup" => catchup(&dir, args.catchup_records)?,
            "mqtt" => {
                mqtt(&dir.join("clean"), args.mqtt_records, false)?;
                mqtt(&dir.join("kill9"), args.mqtt_records, true)?;
            }
            other => bail!("unknown section {other}"),
        }
    }
    Ok(())
}

fn machine_limits(dir: &Path) -> Result<Value> {
    let output = Command::new(bin_path("edge-agent"))
        .args(["bench", "append", "--json", "--records", "1", "--dir"])
        .arg(dir.join("d"))
        .output()?;
    ensure!(output.status.success(), "edge-agent bench append failed");
    let text = String::from_utf8_lossy(&output.stdout);
    let disk: Value = serde_json::from_str(text.lines().next().context("no output")?)?;
    eprintln!(
        "limits: sequential write {} MB/s, fdatasync {}/s",
        disk["seq_write_mb_per_s"], disk["fdatasync_per_s"]
    );
    emit(json!({ "section": "limits", "disk": disk }));
    Ok(disk)
}

/// Runs `producers` threads calling `op` until `seconds` pass; returns (count, latencies µs).
fn run_producers<F>(producers: usize, seconds: f64, make: F) -> Result<(u64, Vec<u64>)>
where
    F: Fn(usize) -> Result<Box<dyn FnMut(u64) -> Result<()> + Send>>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for p in 0..producers {
        let mut op = make(p)?;
        let (stop, count) = (stop.clone(), count.clone());
        handles.push(std::thread::spawn(move || -> Result<Vec<u64>> {
            let mut lat = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                op(n)?;
                lat.push(t.elapsed().as_micros() as u64);
                count.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok(lat)
        }));
    }
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for h in handles {
        all.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("producer panicked"))??,
        );
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let rate = all.len() as f64 / elapsed;
    Ok((rate as u64, all))
}

fn fsync_producers(dir: &Path, seconds: f64, limits: &Value) -> Result<()> {
    let pki = Pki::init(dir.join("pki"))?;
    let cert = pki.issue("bench-dev", None)?;
    let mut agent = AgentSpec::new(dir, "agent", cert, None);
    agent.extra_toml = "[storage]\nfsync = \"always\"\n".into();
    let _agent = agent.start()?;

    let nats_port = peers::free_port();
    let store = dir.join("nats-js");
    let _nats = NatsServer::start(
        dir,
        "nats",
        nats_port,
        &jetstream_conf("bench", nats_port, &store, None, ""),
    )?;
    let nats_addr = SocketAddr::from(([127, 0, 0, 1], nats_port));
    let mut admin = NatsClient::connect(nats_addr)?;
    admin.js_api(
        None,
        "STREAM.CREATE.BENCH",
        &json!({ "name": "BENCH", "subjects": ["bench.>"], "storage": "file", "num_replicas": 1 }),
    )?;

    let fdatasync = limits.get("fdatasync_per_s").and_then(Value::as_f64);
    let mut results = HashMap::new();
    for producers in [PRODUCERS, 1] {
        let http = agent.http;
        let (trb, trb_lat) = run_producers(producers, seconds, |p| {
            let mut client = KeepAlive::new(http);
            Ok(Box::new(move |n| {
                let body = format!("{}\n", record_json(p, n));
                let (status, answer) = client.post(
                    "/v1/streams/telemetry/records",
                    "application/x-ndjson",
                    body.as_bytes(),
                )?;
                ensure!(
                    status == 200,
                    "ingest {status}: {}",
                    String::from_utf8_lossy(&answer)
                );
                Ok(())
            }))
        })?;
        let (nats, nats_lat) = run_producers(producers, seconds, |p| {
            let mut client = NatsClient::connect(nats_addr)?;
            let subject = format!("bench.p{p}");
            Ok(Box::new(move |n| {
                let body = record_json(p, n).to_string();
                client.js_publish(&subject, body.as_bytes())?;
                Ok(())
            }))
        })?;
        let figure = json!({
            "section": "fsync", "producers": producers, "seconds": seconds,
            "tributary_records_per_s": trb, "tributary_p50_us": percentile(&trb_lat, 0.5),
            "tributary_p99_us": percentile(&trb_lat, 0.99),
            "nats_records_per_s": nats, "nats_p50_us": percentile(&nats_lat, 0.5),
            "nats_p99_us": percentile(&nats_lat, 0.99),
            "ratio_tributary_to_nats": trb as f64 / nats.max(1) as f64,
            "fdatasync_per_s": fdatasync,
            "tributary_records_per_fdatasync_limit": fdatasync.map(|f| trb as f64 / f),
            "nats_records_per_fdatasync_limit": fdatasync.map(|f| nats as f64 / f),
        });
        eprintln!(
            "fsync always, {producers} single-record producers: tributary {trb}/s (p99 {} µs), nats {nats}/s (p99 {} µs), ratio {:.2}",
            percentile(&trb_lat, 0.99),
            percentile(&nats_lat, 0.99),
            trb as f64 / nats.max(1) as f64
        );
        results.insert(producers, (trb, nats));
        emit(figure);
    }
    let nats_msgs = admin.stream_messages(None, "BENCH")?;
    eprintln!("nats stream BENCH holds {nats_msgs} messages");
    Ok(())
}

/// Publishes `n` records to a JetStream subject, `window` acks in flight; every ack checked.
fn nats_publish_pipelined(client: &mut NatsClient, subject: &str, from: u64, n: u64) -> Result<()> {
    let window = 256u64;
    let mut pending = std::collections::VecDeque::new();
    for i in from..from + n {
        let body = record_json(0, i).to_string();
        pending.push_back(client.send_request(subject, body.as_bytes())?);
        if pending.len() as u64 >= window {
            let reply = pending.pop_front().expect("non-empty");
            peers::parse_pub_ack(&client.wait_reply(&reply)?)?;
        }
    }
    while let Some(reply) = pending.pop_front() {
        peers::parse_pub_ack(&client.wait_reply(&reply)?)?;
    }
    Ok(())
}

fn catchup(dir: &Path, n: u64) -> Result<()> {
    // NATS: leaf node store-and-forward to a hub server.
    let (hub_port, leaf_port, leafnode_port) =
        (peers::free_port(), peers::free_port(), peers::free_port());
    let hub_conf = jetstream_conf(
        "hub",
        hub_port,
        &dir.join("nats-hub-js"),
        Some("hub"),
        &format!("leafnodes {{ listen: 127.0.0.1:{leafnode_port} }}"),
    );
    let leaf_conf = jetstream_conf(
        "leaf",
        leaf_port,
        &dir.join("nats-leaf-js"),
        Some("leaf"),
        &format!(
            "leafnodes {{ reconnect: \"1s\", remotes [ {{ url: \"nats-leaf://127.0.0.1:{leafnode_port}\" }} ] }}"
        ),
    );
    let mut nats_hub = NatsServer::start(dir, "nats-hub", hub_port, &hub_conf)?;
    let _nats_leaf = NatsServer::start(dir, "nats-leaf", leaf_port, &leaf_conf)?;
    let leaf_addr = SocketAddr::from(([127, 0, 0, 1], leaf_port));
    let hub_addr = SocketAddr::from(([127, 0, 0, 1], hub_port));
    let mut leaf = NatsClient::connect(leaf_addr)?;
    leaf.js_api(
        None,
        "STREAM.CREATE.EDGE",
        &json!({ "name": "EDGE", "subjects": ["tel.>"], "storage": "file", "num_replicas": 1 }),
    )?;
    // The hub's stream must be created once the leaf connection is up (the source is remote).
    wait_until(Duration::from_secs(30), "the leaf node to connect", || {
        NatsClient::connect(hub_addr)
            .and_then(|mut c| c.js_api(Some("leaf"), "STREAM.INFO.EDGE", &Value::Null))
            .is_ok()
    })?;
    let mut hub = NatsClient::connect(hub_addr)?;
    hub.js_api(
        None,
        "STREAM.CREATE.HUB",
        &json!({ "name": "HUB", "storage": "file", "num_replicas": 1,
                 "sources": [{ "name": "EDGE", "external": { "api": "$JS.leaf.API", "deliver": "" } }] }),
    )?;
    let warmup = 10;
    nats_publish_pipelined(&mut leaf, "tel.warm", 0, warmup)?;
    wait_until(
        Duration::from_secs(30),
        "the warm-up to reach the hub",
        || hub.stream_messages(None, "HUB").is_ok_and(|m| m == warmup),
    )?;
    drop(hub);
    nats_hub.proc.terminate(Duration::from_secs(20))?;
    let t = Instant::now();
    nats_publish_pipelined(&mut leaf, "tel.x", warmup, n)?;
    let nats_offline = n as f64 / t.elapsed().as_secs_f64();
    nats_hub.restart()?;
    let t0 = Instant::now();
    let mut hub = NatsClient::connect(hub_addr)?;
    let mut first_progress = None;
    wait_until(WAIT, "the NATS hub stream to catch up", || {
        let m = hub.stream_messages(None, "HUB").unwrap_or(0);
        if m > warmup && first_progress.is_none() {
            first_progress = Some(t0.elapsed());
        }
        m >= warmup + n
    })?;
    let nats_total = t0.elapsed();
    let nats_final = hub.stream_messages(None, "HUB")?;

    // Tributary: agent -> hub.
    let pki = Pki::init(dir.join("pki"))?;
    let cert = pki.issue("bench-dev", None)?;
    let hub_spec = HubSpec::new(dir);
    let mut trb_hub = hub_spec.start(&pki)?;
    let mut agent = AgentSpec::new(dir, "agent", cert, Some(hub_spec.quic));
    agent.extra_toml = "[storage]\nfsync = \"always\"\n".into();
    agent
        .env
        .push(("TRIBUTARY_EDGE__HUB__BACKOFF_MAX".into(), "1s".into()));
    let _agent = agent.start()?;
    let mut poster = KeepAlive::new(agent.http);
    let post = |poster: &mut KeepAlive, from: u64, n: u64| -> Result<()> {
        let mut i = from;
        while i < from + n {
            let m = 1_000.min(from + n - i);
            let mut body = String::new();
            for k in i..i + m {
                body.push_str(&record_json(0, k).to_string());
                body.push('\n');
            }
            let (status, answer) = poster.post(
                "/v1/streams/telemetry/records",
                "application/x-ndjson",
                body.as_bytes(),
            )?;
            ensure!(
                status == 200,
                "ingest {status}: {}",
                String::from_utf8_lossy(&answer)
            );
            i += m;
        }
        Ok(())
    };
    post(&mut poster, 0, warmup)?;
    cluster::wait_caught_up(agent.http, Duration::from_secs(60))?;
    trb_hub.terminate(Duration::from_secs(20))?;
    let t = Instant::now();
    post(&mut poster, warmup, n)?;
    let trb_offline = n as f64 / t.elapsed().as_secs_f64();
    trb_hub.restart()?;
    trb_hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    let t0 = Instant::now();
    let mut trb_first = None;
    wait_until(WAIT, "the agent to catch up", || {
        let s = cluster::status(agent.http);
        if trb_first.is_none()
            && s.as_ref()
                .is_ok_and(|s| cluster::stream_u64(s, "telemetry", "acked_seq") > warmup)
        {
            trb_first = Some(t0.elapsed());
        }
        s.is_ok_and(|s| cluster::caught_up(&s))
    })?;
    let trb_total = t0.elapsed();
    let held = cluster::read_stream(hub_spec.http, "telemetry")?.len() as u64;

    let figure = json!({
        "section": "catchup", "records": n,
        "nats_offline_publish_per_s": nats_offline as u64,
        "nats_catchup_s": nats_total.as_secs_f64(),
        "nats_first_progress_s": first_progress.map(|d| d.as_secs_f64()),
        "nats_catchup_records_per_s": (n as f64 / nats_total.as_secs_f64()) as u64,
        "nats_hub_holds": nats_final,
        "nats_drain_records_per_s_after_first_progress":
            first_progress.map(|f| (n as f64 / (nats_total - f).as_secs_f64().max(1e-3)) as u64),
        "tributary_offline_ingest_per_s": trb_offline as u64,
        "tributary_catchup_s": trb_total.as_secs_f64(),
        "tributary_first_progress_s": trb_first.map(|d| d.as_secs_f64()),
        "tributary_catchup_records_per_s": (n as f64 / trb_total.as_secs_f64()) as u64,
        "tributary_hub_holds": held,
        "ratio_catchup_time_nats_to_tributary": nats_total.as_secs_f64() / trb_total.as_secs_f64(),
    });
    eprintln!(
        "catch-up of {n} records: nats leaf->hub {:.2} s ({} held), tributary edge->hub {:.2} s ({held} held)",
        nats_total.as_secs_f64(),
        nats_final,
        trb_total.as_secs_f64()
    );
    emit(figure);
    Ok(())
}

/// Publishes `n` JSON messages `{"i":k,...}` to `topic` on `port` with `mosquitto_pub -q 1 -l`.
fn mosquitto_publish(port: u16, topic: &str, n: u64) -> Result<()> {
    let mut child = Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-q",
            "1",
            "-t",
            topic,
            "-l",
        ])
        .arg("-i")
        .arg(format!("bench-pub-{}-{}", std::process::id(), n))
        .stdin(Stdio::piped())
        .spawn()
        .context("mosquitto_pub (apt-get install mosquitto-clients)")?;
    {
        let mut stdin = std::io::BufWriter::new(child.stdin.take().context("stdin")?);
        for i in 0..n {
            writeln!(
                stdin,
                "{{\"i\":{i},\"temp\":21.5,\"site\":\"plant-north\",\"ok\":true}}"
            )?;
        }
    }
    let status = child.wait()?;
    ensure!(status.success(), "mosquitto_pub failed: {status}");
    Ok(())
}

/// Counts `i` values: (unique, duplicates).
fn count_ids(ids: impl IntoIterator<Item = u64>, n: u64) -> (u64, u64) {
    let mut seen = vec![0u32; n as usize];
    let mut dups = 0;
    for i in ids {
        if let Some(slot) = seen.get_mut(i as usize) {
            if *slot > 0 {
                dups += 1;
            }
            *slot += 1;
        }
    }
    (seen.iter().filter(|&&c| c > 0).count() as u64, dups)
}

fn mqtt(dir: &Path, n: u64, kill_edge: bool) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let variant = if kill_edge {
        "edge kill -9 during the outage"
    } else {
        "clean outage"
    };
    // mosquitto: edge broker bridged to a core broker, QoS 1, persistence on both.
    let core_port = peers::free_port();
    let core_dir = dir.join("core-db");
    std::fs::create_dir_all(&core_dir)?;
    let mut core = Mosquitto::start_with(MosquittoOptions {
        port: Some(core_port),
        persistence_dir: Some(core_dir),
        extra_conf: vec!["autosave_interval 1".into()],
    })?;
    let edge_dir = dir.join("edge-db");
    std::fs::create_dir_all(&edge_dir)?;
    let mut edge = Mosquitto::start_with(MosquittoOptions {
        port: None,
        persistence_dir: Some(edge_dir),
        extra_conf: vec![
            "connection core".into(),
            format!("address 127.0.0.1:{core_port}"),
            "topic bench/# out 1".into(),
            "cleansession false".into(),
            "clientid edge-bridge".into(),
            "restart_timeout 1".into(),
            "bridge_protocol_version mqttv311".into(),
            // Write the persistence file every second (the default is every 30 minutes and at
            // shutdown); `autosave_on_changes` would rewrite the whole file per message.
            "autosave_interval 1".into(),
        ],
    })?;
    // The subscriber's persistent session on the core broker, alive for the whole run.
    let received: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::default();
    let mut sub = Command::new("mosquitto_sub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &core_port.to_string(),
            "-q",
            "1",
            "-c",
            "-i",
            "core-sub",
            "-t",
            "bench/#",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("mosquitto_sub")?;
    let stdout = sub.stdout.take().context("sub stdout")?;
    let sink = received.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(i) = serde_json::from_str::<Value>(&line)
                .ok()
                .and_then(|v| v["i"].as_u64())
            {
                sink.lock().expect("sink").push((i, Instant::now()));
            }
        }
    });
    // Warm-up: the bridge and the subscription work end to end.
    wait_until(
        Duration::from_secs(30),
        "the bridge to forward a warm-up message",
        || {
            let _ = mosquitto_publish(edge.port(), "bench/warm", 1);
            !received.lock().expect("sink").is_empty()
        },
    )?;
    received.lock().expect("sink").clear();
    core.stop()?;
    mosquitto_publish(edge.port(), "bench/x", n)?;
    if kill_edge {
        // At once: the publisher holds PUBACKs for everything, which is the promise under test.
        edge.proc_mut().kill9()?;
        edge.restart()?;
    }
    core.restart()?;
    let t0 = Instant::now();
    let idle = Duration::from_secs(10);
    // Done when every message arrived, or nothing new arrived for `idle`.
    wait_until(WAIT, "the bridge to deliver or go quiet", || {
        let r = received.lock().expect("sink");
        let unique = count_ids(r.iter().map(|x| x.0), n).0;
        let last = r.last().map_or(t0, |x| x.1);
        unique == n || last.elapsed() > idle && t0.elapsed() > idle
    })?;
    // Late duplicates get a moment to show up.
    std::thread::sleep(Duration::from_secs(2));
    let r = received.lock().expect("sink").clone();
    let (unique, dups) = count_ids(r.iter().map(|x| x.0), n);
    let mosq_time = r.last().map(|x| x.1.duration_since(t0).as_secs_f64());
    let _ = sub.kill();
    let _ = sub.wait();
    drop(edge);
    drop(core);

    // Tributary: an edge broker, the agent's MQTT source, the hub.
    std::fs::create_dir_all(dir.join("trb-edge-db"))?;
    let edge = Mosquitto::start_with(MosquittoOptions {
        persistence_dir: Some(dir.join("trb-edge-db")),
        ..MosquittoOptions::default()
    })?;
    let pki = Pki::init(dir.join("pki"))?;
    let cert = pki.issue("bench-mqtt", None)?;
    let hub_spec = HubSpec::new(dir);
    let mut hub = hub_spec.start(&pki)?;
    let mut agent_spec = AgentSpec::new(dir, "agent", cert, Some(hub_spec.quic));
    agent_spec.extra_toml = format!(
        "[storage]\nfsync = \"always\"\n\n[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\n\
         topics = [\"bench/#\"]\nstream = \"telemetry\"\nformat = \"json\"\n",
        edge.port()
    );
    agent_spec
        .env
        .push(("TRIBUTARY_EDGE__HUB__BACKOFF_MAX".into(), "1s".into()));
    let mut agent: Proc = agent_spec.start()?;
    mosquitto_publish(edge.port(), "bench/warm", 1)?;
    wait_until(
        Duration::from_secs(30),
        "the warm-up record to reach the hub",
        || {
            cluster::status(agent_spec.http).is_ok_and(|s| {
                cluster::stream_u64(&s, "telemetry", "acked_seq") >= 1 && cluster::caught_up(&s)
            })
        },
    )?;
    hub.terminate(Duration::from_secs(20))?;
    mosquitto_publish(edge.port(), "bench/x", n)?;
    if kill_edge {
        // At once, as for the bridge: the publisher holds PUBACKs for everything.
        agent.kill9()?;
        agent.restart()?;
        agent.wait_http_ok(agent_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    }
    // The agent has them once its durable mark covers the warm-up plus n (a loss shows up as a
    // timeout here and as `tributary_lost` below).
    wait_until(
        Duration::from_secs(120),
        "the agent to store the published messages",
        || {
            cluster::status(agent_spec.http)
                .is_ok_and(|s| cluster::stream_u64(&s, "telemetry", "durable_seq") > n)
        },
    )
    .ok();
    hub.restart()?;
    hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    let t0 = Instant::now();
    wait_until(WAIT, "the agent to catch up", || {
        cluster::status(agent_spec.http).is_ok_and(|s| cluster::caught_up(&s))
    })?;
    let trb_time = t0.elapsed().as_secs_f64();
    let ids: Vec<u64> = cluster::read_stream(hub_spec.http, "telemetry")?
        .iter()
        .filter(|r| r.key != "bench/warm")
        .filter_map(|r| r.fields.get("i").and_then(Value::as_u64))
        .collect();
    let (trb_unique, trb_dups) = count_ids(ids, n);

    let figure = json!({
        "section": "mqtt", "variant": variant, "messages": n,
        "mosquitto_bridge_lost": n - unique, "mosquitto_bridge_duplicates": dups,
        "mosquitto_bridge_catchup_s": mosq_time,
        "tributary_lost": n - trb_unique, "tributary_duplicates": trb_dups,
        "tributary_catchup_s": trb_time,
    });
    eprintln!(
        "mqtt, {variant}, {n} messages: mosquitto bridge lost {} dup {} in {:?} s; tributary lost {} dup {} in {:.2} s",
        n - unique,
        dups,
        mosq_time,
        n - trb_unique,
        trb_dups,
        trb_time
    );
    emit(figure);
    Ok(())
}
