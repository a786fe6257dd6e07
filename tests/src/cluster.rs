//! A hub and its agents as real processes, for the replication system tests.
//!
//! [`Pki`] runs `core-hub pki init|issue|revoke` into a temporary directory; [`HubSpec`] and
//! [`AgentSpec`] write `hub.toml` / `edge.toml` with their own data directories and free ports
//! and start the binaries; the free functions read what the tests assert on: an agent's
//! `/v1/status`, a Prometheus counter, and every record a hub holds for a stream (paged).
//!
//! Everything here is plumbing: the tests decide what to kill, cut or check.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

use crate::http;
use crate::ledger::ObservedRecord;
use crate::ports::{self, Proto};
use crate::procs::{Proc, ProcSpec, bin_path, wait_until};

/// How long a freshly started hub or agent may take to answer `/healthz`.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `core-hub` with `args` to completion; fails with its output when it fails.
pub fn core_hub(args: &[&str]) -> Result<String> {
    let output = Command::new(bin_path("core-hub"))
        .args(args)
        .output()
        .with_context(|| format!("running core-hub {args:?} (built? `cargo build --workspace`)"))?;
    ensure!(
        output.status.success(),
        "core-hub {args:?} failed with {}: {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A fleet CA with the hub's certificate, made by `core-hub pki init`.
#[derive(Debug, Clone)]
pub struct Pki {
    pub dir: PathBuf,
}

/// A device's files as `core-hub pki issue` writes them.
#[derive(Debug, Clone)]
pub struct DeviceCert {
    pub id: String,
    pub dir: PathBuf,
}

impl Pki {
    /// `core-hub pki init --dir DIR` (the hub certificate names localhost and 127.0.0.1).
    pub fn init(dir: impl Into<PathBuf>) -> Result<Pki> {
        let dir = dir.into();
        core_hub(&["pki", "init", "--dir", &path_str(&dir)?])?;
        Ok(Pki { dir })
    }

    /// `core-hub pki issue` for `device`, into `<pki dir>/../certs/<device>` unless `out` is given.
    pub fn issue(&self, device: &str, out: Option<&Path>) -> Result<DeviceCert> {
        let out = match out {
            Some(out) => out.to_path_buf(),
            None => self.dir.with_file_name(format!("certs-{device}")),
        };
        core_hub(&[
            "pki",
            "issue",
            "--dir",
            &path_str(&self.dir)?,
            "--device",
            device,
            "--out",
            &path_str(&out)?,
        ])?;
        Ok(DeviceCert {
            id: device.to_string(),
            dir: out,
        })
    }

    /// `core-hub pki revoke`: the hub re-reads `revoked.txt` without restarting.
    pub fn revoke(&self, device: &str) -> Result<()> {
        core_hub(&[
            "pki",
            "revoke",
            "--dir",
            &path_str(&self.dir)?,
            "--device",
            device,
        ])?;
        Ok(())
    }
}

/// How to start a hub: addresses, directories and extra TOML appended to `hub.toml`.
#[derive(Debug, Clone)]
pub struct HubSpec {
    pub name: String,
    pub data_dir: PathBuf,
    pub config: PathBuf,
    pub quic: SocketAddr,
    pub http: SocketAddr,
    /// Appended verbatim, e.g. `[devices.dev-1]\nstreams = ["other"]`.
    pub extra_toml: String,
    /// Runs the hub inside this network namespace.
    pub netns: Option<String>,
}

impl HubSpec {
    /// A hub under `root/hub` on free loopback ports.
    pub fn new(root: &Path) -> HubSpec {
        HubSpec {
            name: "hub".into(),
            data_dir: root.join("hub-data"),
            config: root.join("hub.toml"),
            quic: ports::loopback(Proto::Udp),
            http: ports::loopback(Proto::Tcp),
            extra_toml: String::new(),
            netns: None,
        }
    }

    /// Writes `hub.toml` and starts `core-hub run`, without waiting for it.
    pub fn spawn(&self, pki: &Pki) -> Result<Proc> {
        let config = format!(
            "data_dir = {data}\n\n[listen]\nquic = \"{quic}\"\nhttp = \"{http}\"\n\n[tls]\n\
             ca = {ca}\ncert = {cert}\nkey = {key}\n\n{extra}\n",
            data = toml_str(&self.data_dir)?,
            quic = self.quic,
            http = self.http,
            ca = toml_str(&pki.dir.join("ca.pem"))?,
            cert = toml_str(&pki.dir.join("hub.pem"))?,
            key = toml_str(&pki.dir.join("hub.key"))?,
            extra = self.extra_toml,
        );
        std::fs::write(&self.config, config)
            .with_context(|| format!("writing {}", self.config.display()))?;
        let log_dir = self.config.parent().unwrap_or(Path::new(".")).join("logs");
        let mut spec = ProcSpec::new(bin_path("core-hub"))
            .name(&self.name)
            .arg("run")
            .arg("--config")
            .arg(&self.config)
            .log_dir(log_dir);
        if let Some(ns) = &self.netns {
            spec = spec.netns(ns);
        }
        Proc::spawn(spec)
    }

    /// Spawns and waits for `/healthz` (only possible from the host when `netns` is unset).
    pub fn start(&self, pki: &Pki) -> Result<Proc> {
        let mut proc = self.spawn(pki)?;
        proc.wait_http_ok(self.http, "/healthz", START_TIMEOUT)?;
        Ok(proc)
    }
}

/// How to start an agent.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    pub name: String,
    pub data_dir: PathBuf,
    pub config: PathBuf,
    pub http: SocketAddr,
    /// The hub's QUIC address (or a proxy's); `None` runs the agent without replication.
    pub hub: Option<SocketAddr>,
    pub cert: DeviceCert,
    pub streams: Vec<String>,
    /// Appended verbatim to `edge.toml`.
    pub extra_toml: String,
    pub netns: Option<String>,
    /// Extra environment for the agent process (for example a faked clock).
    pub env: Vec<(String, String)>,
}

impl AgentSpec {
    /// An agent named `name` under `root/name`, on a free loopback HTTP port, one stream
    /// `telemetry`, shipping to `hub`.
    pub fn new(root: &Path, name: &str, cert: DeviceCert, hub: Option<SocketAddr>) -> AgentSpec {
        AgentSpec {
            name: name.into(),
            data_dir: root.join(format!("{name}-data")),
            config: root.join(format!("{name}.toml")),
            http: ports::loopback(Proto::Tcp),
            hub,
            cert,
            streams: vec!["telemetry".into()],
            extra_toml: String::new(),
            netns: None,
            env: Vec::new(),
        }
    }

    /// Writes `edge.toml` and starts `edge-agent run`, without waiting for it.
    pub fn spawn(&self) -> Result<Proc> {
        let mut config = format!("data_dir = {}\n\n", toml_str(&self.data_dir)?);
        if let Some(hub) = self.hub {
            config.push_str(&format!(
                "[hub]\naddr = \"{hub}\"\nserver_name = \"localhost\"\n\n[tls]\nca = {}\ncert = {}\nkey = {}\n\n",
                toml_str(&self.cert.dir.join("ca.pem"))?,
                toml_str(&self.cert.dir.join("device.pem"))?,
                toml_str(&self.cert.dir.join("device.key"))?,
            ));
        }
        config.push_str(&format!("[http]\nlisten = \"{}\"\n\n", self.http));
        config.push_str(&self.extra_toml);
        config.push('\n');
        for stream in &self.streams {
            config.push_str(&format!("[[streams]]\nname = \"{stream}\"\n\n"));
        }
        std::fs::write(&self.config, config)
            .with_context(|| format!("writing {}", self.config.display()))?;
        let log_dir = self.config.parent().unwrap_or(Path::new(".")).join("logs");
        let mut spec = ProcSpec::new(bin_path("edge-agent"))
            .name(&self.name)
            .arg("run")
            .arg("--config")
            .arg(&self.config)
            .log_dir(log_dir);
        for (k, v) in &self.env {
            spec = spec.env(k, v);
        }
        if let Some(ns) = &self.netns {
            spec = spec.netns(ns);
        }
        Proc::spawn(spec)
    }

    /// Spawns and waits for `/healthz`.
    pub fn start(&self) -> Result<Proc> {
        let mut proc = self.spawn()?;
        proc.wait_http_ok(self.http, "/healthz", START_TIMEOUT)?;
        Ok(proc)
    }
}

/// An agent's `GET /v1/status`.
pub fn status(agent: SocketAddr) -> Result<Value> {
    let response = http::get(agent, "/v1/status")?;
    ensure!(
        response.status == 200,
        "status {}: {}",
        response.status,
        response.text()
    );
    response.json()
}

/// `link` of a status: `up`, `down`, ...
pub fn link(status: &Value) -> &str {
    status.get("link").and_then(Value::as_str).unwrap_or("")
}

/// One stream's entry of a status.
pub fn stream_status<'a>(status: &'a Value, stream: &str) -> Option<&'a Value> {
    status
        .get("streams")?
        .as_array()?
        .iter()
        .find(|s| s.get("stream").and_then(Value::as_str) == Some(stream))
}

/// The agent's current epoch in a status: 16 hex digits, a string (`sync::epoch`).
pub fn epoch(status: &Value) -> Result<u64> {
    hex_epoch(status.get("epoch")).with_context(|| format!("no hex `epoch` in {status}"))
}

/// A stream's epoch in a status.
pub fn stream_epoch(status: &Value, stream: &str) -> Result<u64> {
    hex_epoch(stream_status(status, stream).and_then(|s| s.get("epoch")))
        .with_context(|| format!("no hex `epoch` for stream {stream:?} in {status}"))
}

fn hex_epoch(v: Option<&Value>) -> Option<u64> {
    v?.as_str().and_then(sync::epoch::parse)
}

/// The streams a status lists as refused by the hub (`refused_streams`), by name.
pub fn refused_streams(status: &Value) -> Vec<Value> {
    status
        .get("refused_streams")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// An integer field of a stream's status, 0 when absent.
pub fn stream_u64(status: &Value, stream: &str, field: &str) -> u64 {
    stream_status(status, stream)
        .and_then(|s| s.get(field))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// Records that are durable at the edge but not yet acknowledged by the hub, over all streams.
pub fn unacked(status: &Value) -> u64 {
    status
        .get("streams")
        .and_then(Value::as_array)
        .map(|streams| {
            streams
                .iter()
                .map(|s| {
                    let get = |f: &str| s.get(f).and_then(Value::as_u64).unwrap_or(0);
                    get("durable_seq").saturating_sub(get("acked_seq"))
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Whether everything durable at the edge is acknowledged by the hub and nothing is left to send.
pub fn caught_up(status: &Value) -> bool {
    let streams = status.get("streams").and_then(Value::as_array);
    streams.is_some_and(|streams| {
        streams.iter().all(|s| {
            let get = |f: &str| s.get(f).and_then(Value::as_u64).unwrap_or(u64::MAX);
            get("acked_seq") == get("durable_seq") && get("backlog_blocks") == 0
        })
    })
}

/// Waits until the agent at `agent` has shipped and had acknowledged everything it holds.
pub fn wait_caught_up(agent: SocketAddr, timeout: Duration) -> Result<Value> {
    let mut last = Value::Null;
    let outcome = wait_until(
        timeout,
        "the agent to catch up (acked == durable)",
        || match status(agent) {
            Ok(s) => {
                let done = caught_up(&s);
                last = s;
                done
            }
            Err(_) => false,
        },
    );
    match outcome {
        Ok(()) => Ok(last),
        Err(error) => Err(error.context(format!("last status: {last}"))),
    }
}

/// The value of a Prometheus sample `name` (with its labels, if any, e.g. `x{a="b"}`), summed
/// over every line that starts with it.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((sample, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let bare = sample.split('{').next().unwrap_or(sample);
        if (sample == name || bare == name)
            && let Ok(v) = value.parse::<f64>()
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// `GET /metrics` on `addr` and one sample of it, 0 when absent.
pub fn fetch_metric(addr: SocketAddr, name: &str) -> Result<f64> {
    let response = http::get(addr, "/metrics")?;
    ensure!(response.status == 200, "metrics status {}", response.status);
    Ok(metric(&response.text(), name).unwrap_or(0.0))
}

/// Every record the hub holds for `stream`, in hub order, read page by page through
/// `GET /v1/streams/{stream}/records?from=&limit=`. An unknown stream reads as empty.
pub fn read_stream(hub: SocketAddr, stream: &str) -> Result<Vec<ObservedRecord>> {
    let mut records = Vec::new();
    let mut from = 0u64;
    loop {
        let path = format!("/v1/streams/{stream}/records?from={from}&limit=50000");
        let response =
            http::request_timeout(hub, "GET", &path, &[], None, Duration::from_secs(60))?;
        if response.status == 404 && from == 0 {
            return Ok(records);
        }
        if response.status != 200 {
            bail!(
                "reading {path}: status {}: {}",
                response.status,
                response.text()
            );
        }
        let page = ObservedRecord::parse_ndjson(stream, &response.text())?;
        if page.is_empty() {
            return Ok(records);
        }
        let next = response
            .header("x-tributary-next-offset")
            .and_then(|v| v.parse::<u64>().ok())
            .context("a page without x-tributary-next-offset")?;
        ensure!(
            next > from,
            "next offset {next} does not advance past {from}"
        );
        from = next;
        records.extend(page);
    }
}

fn path_str(path: &Path) -> Result<String> {
    path.to_str()
        .map(str::to_string)
        .with_context(|| format!("path {} is not UTF-8", path.display()))
}

/// A path as a TOML basic string.
fn toml_str(path: &Path) -> Result<String> {
    Ok(serde_json::to_string(&path_str(path)?)?)
}
