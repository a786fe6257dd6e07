//! Every file under `examples/` is loaded here, so none can rot:
//! - each agent config parses with the agent's own loader (commented-out source blocks too),
//!   and together they cover every source kind;
//! - `run-fleet.sh` starts a hub and two agents from the examples and sees the sample arrive;
//! - `hub.toml` with `edge-http.toml` runs, every metric the Grafana dashboard queries is on
//!   a live `/metrics`, and `duckdb/run.py` runs the README's queries over the tier 2 it wrote;
//! - the MQTT bridge (mosquitto with `mosquitto.conf`, the agent of `mqtt-bridge/edge.toml`,
//!   the hub of `mqtt-bridge/hub-republish.toml`) carries published messages to the hub;
//! - the hub warns at start when tier 2 is on its data directory's disk, and only then.
//!
//! The examples name fixed ports and `/var/tmp/tributary`; the tests override both through
//! the environment (`TRIBUTARY_HUB__*`, `TRIBUTARY_EDGE__*`), as the examples' comments say.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use edge_agent::config::{EdgeConfig, SensorKind, SourceConfig};
use serde_json::Value;
use tributary_tests::cluster::{DeviceCert, HubSpec, Pki, START_TIMEOUT};
use tributary_tests::http;
use tributary_tests::mosquitto::{Mosquitto, MosquittoOptions};
use tributary_tests::ports::{self, Proto};
use tributary_tests::procs::{Proc, ProcSpec, bin_path, wait_for, wait_until};

/// Records in `examples/sample.ndjson`.
const SAMPLE_RECORDS: u64 = 180;
/// Long enough for a chunk to seal (`tier2.chunk_age_max = "10s"` in `examples/hub.toml`) and
/// upload on a busy machine.
const TIER_TIMEOUT: Duration = Duration::from_secs(60);

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn edge_configs() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(examples())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("edge") && name.ends_with(".toml")
        })
        .collect();
    files.push(examples().join("mqtt-bridge/edge.toml"));
    files.sort();
    files
}

/// `text` with the commented-out `[[sources]]` blocks uncommented, so they are checked too.
fn uncomment_sources(text: &str) -> String {
    let mut out = String::new();
    let mut in_block = false;
    for line in text.lines() {
        if line.trim() == "# [[sources]]" {
            in_block = true;
        } else if !line.starts_with("# ") {
            in_block = false;
        }
        let line = if in_block { &line[2..] } else { line };
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn source_kind(s: &SourceConfig) -> &'static str {
    match s {
        SourceConfig::Mqtt(_) => "mqtt",
        SourceConfig::Sensor(s) => match s.kind {
            SensorKind::Hwmon { .. } => "hwmon",
            SensorKind::Iio { .. } => "iio",
            SensorKind::Nmea { .. } => "nmea",
            SensorKind::Simulator { .. } => "simulator",
        },
        SourceConfig::Modbus(_) => "modbus",
        SourceConfig::Opcua(_) => "opcua",
    }
}

#[test]
fn edge_examples_load_and_cover_every_source_kind() {
    let mut kinds = BTreeSet::new();
    for path in edge_configs() {
        let cfg = EdgeConfig::load_with_env(&path, Some(HashMap::new()))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!cfg.streams.is_empty(), "{}", path.display());
        kinds.extend(cfg.sources.iter().map(source_kind));
        let text = std::fs::read_to_string(&path).unwrap();
        let all = uncomment_sources(&text);
        let cfg = EdgeConfig::from_toml(&all, path.parent().unwrap(), Some(HashMap::new()))
            .unwrap_or_else(|e| panic!("{} with its commented sources: {e}", path.display()));
        kinds.extend(cfg.sources.iter().map(source_kind));
    }
    let want: BTreeSet<&str> = [
        "hwmon",
        "iio",
        "modbus",
        "mqtt",
        "nmea",
        "opcua",
        "simulator",
    ]
    .into();
    assert_eq!(kinds, want, "source kinds the examples cover");
    let stdin = std::fs::read_to_string(examples().join("edge-stdin.toml")).unwrap();
    assert!(stdin.contains("edge-agent ingest --stream logs"));
}

/// The environment that points an example hub at `spec`'s ports, directories and `pki`.
fn hub_env(spec: &HubSpec, pki: &Pki, tier2: &Path) -> Vec<(String, String)> {
    let p = |f: &str| pki.dir.join(f).display().to_string();
    vec![
        (
            "TRIBUTARY_HUB__DATA_DIR".into(),
            spec.data_dir.display().to_string(),
        ),
        ("TRIBUTARY_HUB__LISTEN__QUIC".into(), spec.quic.to_string()),
        ("TRIBUTARY_HUB__LISTEN__HTTP".into(), spec.http.to_string()),
        ("TRIBUTARY_HUB__TLS__CA".into(), p("ca.pem")),
        ("TRIBUTARY_HUB__TLS__CERT".into(), p("hub.pem")),
        ("TRIBUTARY_HUB__TLS__KEY".into(), p("hub.key")),
        (
            "TRIBUTARY_HUB__TIER2__URL".into(),
            format!("file://{}", tier2.display()),
        ),
    ]
}

fn edge_env(
    data: &Path,
    http: SocketAddr,
    hub: SocketAddr,
    cert: &DeviceCert,
) -> Vec<(String, String)> {
    let c = |f: &str| cert.dir.join(f).display().to_string();
    vec![
        (
            "TRIBUTARY_EDGE__DATA_DIR".into(),
            data.display().to_string(),
        ),
        ("TRIBUTARY_EDGE__HTTP__LISTEN".into(), http.to_string()),
        ("TRIBUTARY_EDGE__HUB__ADDR".into(), hub.to_string()),
        ("TRIBUTARY_EDGE__TLS__CA".into(), c("ca.pem")),
        ("TRIBUTARY_EDGE__TLS__CERT".into(), c("device.pem")),
        ("TRIBUTARY_EDGE__TLS__KEY".into(), c("device.key")),
    ]
}

fn start(
    name: &str,
    bin: &str,
    config: &Path,
    env: &[(String, String)],
    logs: &Path,
) -> Result<Proc> {
    let mut spec = ProcSpec::new(bin_path(bin))
        .name(name)
        .args(["run", "--config"])
        .arg(config)
        .log_dir(logs);
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    Proc::spawn(spec)
}

fn stream_records(hub: SocketAddr, stream: &str) -> u64 {
    let Ok(resp) = http::get(hub, "/v1/streams") else {
        return 0;
    };
    let Ok(v) = resp.json() else { return 0 };
    let list = v.get("streams").unwrap_or(&v).clone();
    list.as_array()
        .into_iter()
        .flatten()
        .find(|s| s["name"] == stream)
        .and_then(|s| {
            s.get("records")
                .or(s.get("next_offset"))
                .and_then(Value::as_u64)
        })
        .unwrap_or(0)
}

fn wait_records(hub: SocketAddr, stream: &str, n: u64) -> Result<()> {
    wait_until(START_TIMEOUT, &format!("{n} records in {stream}"), || {
        stream_records(hub, stream) >= n
    })?;
    assert_eq!(stream_records(hub, stream), n, "stream {stream}");
    Ok(())
}

#[test]
fn run_fleet_script_starts_a_hub_and_two_agents() -> Result<()> {
    let root = tempfile::tempdir()?;
    let work = root.path().join("fleet");
    let port = |p| ports::loopback(p).to_string();
    let out = Command::new(examples().join("run-fleet.sh"))
        .arg("--check")
        .arg(&work)
        .env("BIN", bin_path("core-hub").parent().unwrap())
        .env("HUB_QUIC", port(Proto::Udp))
        .env("HUB_HTTP", port(Proto::Tcp))
        .env("EDGE_HTTP_1", port(Proto::Tcp))
        .env("EDGE_HTTP_2", port(Proto::Tcp))
        .output()?;
    let log =
        |name: &str| std::fs::read_to_string(work.join("logs").join(name)).unwrap_or_default();
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "run-fleet.sh failed ({}): {stdout}{}\nhub log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        log("hub.log")
    );
    assert!(
        stdout.contains(&format!("holds {SAMPLE_RECORDS} telemetry records")),
        "{stdout}"
    );
    for agent in ["edge-http.log", "edge-sensors.log"] {
        assert!(
            log(agent).contains("replication session established"),
            "{agent}: {}",
            log(agent)
        );
    }
    // Its tier 2 is beside the hub's data directory, on the same disk: the hub says so.
    assert!(
        log("hub.log").contains("tier 2 is on the filesystem of data_dir"),
        "{}",
        log("hub.log")
    );
    Ok(())
}

/// Metric names the dashboard's queries use (a histogram's `_bucket`/`_sum`/`_count` stripped).
fn dashboard_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(examples().join("grafana/tributary.json")).unwrap();
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut names = BTreeSet::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("tributary_") {
                    names.insert(word.to_string());
                }
            }
        }
    }
    names
}

fn metric_names(addr: SocketAddr) -> BTreeSet<String> {
    let text = http::get(addr, "/metrics")
        .map(|r| r.text())
        .unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

fn run_duckdb_queries(tier2: &Path) -> Result<String> {
    let out = Command::new("python3")
        .arg(examples().join("duckdb/run.py"))
        .arg(tier2)
        .output()
        .context("python3 with duckdb (.ci/test installs it)")?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "examples/duckdb/run.py failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

#[test]
fn hub_and_http_agent_examples_feed_the_dashboard_and_duckdb() -> Result<()> {
    let root = tempfile::tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let cert = pki.issue("edge-http", None)?;
    let spec = HubSpec::new(root.path());
    let tier2 = tempfile::tempdir_in("/dev/shm").context("a tier 2 on another filesystem")?;
    let logs = root.path().join("logs");
    let mut hub = start(
        "hub",
        "core-hub",
        &examples().join("hub.toml"),
        &hub_env(&spec, &pki, tier2.path()),
        &logs,
    )?;
    hub.wait_http_ok(spec.http, "/healthz", START_TIMEOUT)?;
    let edge_http = ports::loopback(Proto::Tcp);
    let env = edge_env(&root.path().join("edge"), edge_http, spec.quic, &cert);
    let mut agent = start(
        "edge-http",
        "edge-agent",
        &examples().join("edge-http.toml"),
        &env,
        &logs,
    )?;
    agent.wait_http_ok(edge_http, "/healthz", START_TIMEOUT)?;
    let sample = std::fs::read(examples().join("sample.ndjson"))?;
    let resp = http::post_ndjson(edge_http, "/v1/streams/telemetry/records", &sample)?;
    assert_eq!(resp.status, 200, "{}", resp.text());
    wait_records(spec.http, "telemetry", SAMPLE_RECORDS)?;

    let wanted = dashboard_metrics();
    assert!(wanted.len() >= 20, "the dashboard queries {wanted:?}");
    let missing = wait_for(
        START_TIMEOUT,
        "every dashboard metric on a live /metrics",
        || {
            let live: BTreeSet<String> = metric_names(spec.http)
                .union(&metric_names(edge_http))
                .cloned()
                .collect();
            let missing: Vec<&String> = wanted.iter().filter(|m| !live.contains(*m)).collect();
            missing.is_empty().then_some(missing.len())
        },
    );
    assert!(
        missing.is_ok(),
        "{missing:?}; missing from /metrics: {:?}",
        {
            let live: BTreeSet<String> = metric_names(spec.http)
                .union(&metric_names(edge_http))
                .cloned()
                .collect();
            wanted.difference(&live).cloned().collect::<Vec<_>>()
        }
    );

    // Tier 2 on /dev/shm is on another filesystem: no warning.
    assert!(!hub.stderr().contains("tier 2 is"), "{}", hub.stderr());
    let out = wait_for(
        TIER_TIMEOUT,
        "the sample in tier 2, queried by run.py",
        || {
            run_duckdb_queries(tier2.path())
                .ok()
                .filter(|out| out.contains(&SAMPLE_RECORDS.to_string()))
        },
    )?;
    assert!(out.contains("truck-0000/engine"), "{out}");
    let _ = agent.terminate(Duration::from_secs(10));
    let _ = hub.terminate(Duration::from_secs(10));
    Ok(())
}

#[test]
fn hub_default_tier2_inside_data_dir_is_warned_about() -> Result<()> {
    let root = tempfile::tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let spec = HubSpec::new(root.path());
    let mut hub = spec.start(&pki)?;
    let warned = wait_until(START_TIMEOUT, "the tier-2 placement warning", || {
        let log = hub.stderr() + &hub.stdout();
        log.contains("WARN") && log.contains("tier 2 is inside data_dir")
    });
    assert!(warned.is_ok(), "{warned:?}: {}", hub.log_tail(40));
    let _ = hub.terminate(Duration::from_secs(10));
    Ok(())
}

/// `mosquitto.conf` as written, on `port`, keeping its state in `dir` (and as root, in the
/// test's user: mosquitto would otherwise switch to its own).
fn bridge_mosquitto(port: u16, dir: &Path) -> Result<Mosquitto> {
    let conf = std::fs::read_to_string(examples().join("mqtt-bridge/mosquitto.conf"))?;
    let extra: Vec<String> = conf
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| !l.starts_with("listener") && !l.starts_with("persistence"))
        .map(str::to_string)
        .collect();
    assert!(
        conf.contains("listener 1883 127.0.0.1"),
        "the example listens on loopback"
    );
    assert!(conf.contains("persistence true"));
    Mosquitto::start_with(MosquittoOptions {
        port: Some(port),
        persistence_dir: Some(dir.to_path_buf()),
        extra_conf: extra,
    })
}

#[test]
fn mqtt_bridge_example_carries_published_messages_to_the_hub() -> Result<()> {
    let root = tempfile::tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let cert = pki.issue("edge-mqtt", None)?;
    let logs = root.path().join("logs");
    let (local_port, core_port) = (ports::tcp(), ports::tcp());
    std::fs::create_dir_all(root.path().join("mq-local"))?;
    let _local = bridge_mosquitto(local_port, &root.path().join("mq-local"))?;
    let _core = Mosquitto::start_with(MosquittoOptions {
        port: Some(core_port),
        ..MosquittoOptions::default()
    })?;
    let spec = HubSpec::new(root.path());
    let mut env = hub_env(&spec, &pki, &root.path().join("tier2"));
    env.push((
        "TRIBUTARY_HUB__REPUBLISH__URL".into(),
        format!("mqtt://127.0.0.1:{core_port}"),
    ));
    let hub_toml = examples().join("mqtt-bridge/hub-republish.toml");
    let mut hub = start("hub", "core-hub", &hub_toml, &env, &logs)?;
    hub.wait_http_ok(spec.http, "/healthz", START_TIMEOUT)?;
    // The broker URL sits in a [[sources]] array, which the environment cannot reach.
    let text = std::fs::read_to_string(examples().join("mqtt-bridge/edge.toml"))?;
    assert!(text.contains("mqtt://127.0.0.1:1883"));
    let edge_toml = root.path().join("edge-mqtt.toml");
    std::fs::write(
        &edge_toml,
        text.replace(":1883\"", &format!(":{local_port}\"")),
    )?;
    let edge_http = ports::loopback(Proto::Tcp);
    let env = edge_env(&root.path().join("edge"), edge_http, spec.quic, &cert);
    let mut agent = start("edge-mqtt", "edge-agent", &edge_toml, &env, &logs)?;
    agent.wait_http_ok(edge_http, "/healthz", START_TIMEOUT)?;
    publish_until_stored(local_port, spec.http)?;
    let _ = agent.terminate(Duration::from_secs(10));
    let _ = hub.terminate(Duration::from_secs(10));
    Ok(())
}

/// Publishes three messages as the README does, once the agent's subscription is up, and
/// waits for the hub to hold them keyed by the tags the topic template captures.
fn publish_until_stored(port: u16, hub: SocketAddr) -> Result<()> {
    let publish = |i: u32| {
        Command::new("mosquitto_pub")
            .args([
                "-p",
                &port.to_string(),
                "-q",
                "1",
                "-t",
                "sensors/press-4/temp",
                "-m",
            ])
            .arg(format!("{{\"ts\":176437440{i}000,\"value\":7{i}.5}}"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    // A message published before the agent subscribed is lost (nothing retains it): publish
    // the first one again every half second until the hub holds one.
    let mut last: Option<Instant> = None;
    wait_until(START_TIMEOUT, "a first MQTT message stored", || {
        if last.is_none_or(|t| t.elapsed() > Duration::from_millis(500)) {
            last = Some(Instant::now());
            publish(1);
        }
        stream_records(hub, "mqtt") > 0
    })?;
    let before = stream_records(hub, "mqtt");
    ensure!(publish(2) && publish(3), "mosquitto_pub failed");
    wait_records(hub, "mqtt", before + 2)?;
    let page = http::get(hub, "/v1/streams/mqtt/records?from=start&limit=10")?.text();
    assert!(
        page.contains("device=press-4/sensor=temp"),
        "the key of the tags the template captures: {page}"
    );
    Ok(())
}
