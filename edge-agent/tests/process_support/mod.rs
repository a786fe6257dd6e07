//! Shared harness for the `process_*` tests: runs the real `edge-agent` binary on a free
//! loopback port with a temporary data directory, waits for readiness on `/healthz`, kills it
//! with SIGKILL, and reads the stored records back with `edge-agent inspect`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use edge_agent::http::client::Client;
use serde_json::Value as Json;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_edge-agent");

/// Ports below the kernel's ephemeral range: a port released here and bound again by a child
/// (or after a restart) cannot meanwhile become some outgoing connection's source port.
#[path = "../../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

/// A free loopback port, below the ephemeral range. The agent binds it a moment later;
/// SO_REUSEADDR makes the reuse across restarts safe.
pub fn free_port() -> u16 {
    ports::tcp()
}

/// A data directory, a config file and a port for one agent.
#[derive(Debug)]
pub struct Setup {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub port: u16,
}

impl Setup {
    /// Writes a config with stream `telemetry`; `storage` is the body of `[storage]`.
    pub fn new(storage: &str) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let config = dir.path().join("edge.toml");
        let text = format!(
            "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{port}\"\n[storage]\n{storage}\n[[streams]]\nname = \"telemetry\"\n"
        );
        std::fs::write(&config, text).unwrap();
        Setup { dir, config, port }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn client(&self) -> Client {
        Client::new(&self.url())
            .unwrap()
            .with_timeout(Duration::from_secs(30))
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Starts the agent and waits until `/healthz` answers `ok`.
    pub fn start(&self) -> Agent {
        self.start_with_env(&[])
    }

    /// Starts the agent with `env` added to its environment (test switches of the
    /// `fault-injection` build) and waits until `/healthz` answers `ok`.
    pub fn start_with_env(&self, env: &[(&str, &str)]) -> Agent {
        let log = self.dir.path().join("agent.log");
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut agent = Agent { child, log };
        agent.wait_ready(&self.client(), Duration::from_secs(30));
        agent
    }

    /// Sums a numeric field of the agent's "local log recovered" lines over every start, such as
    /// `truncated_records`: how often crashes left something for recovery to remove.
    pub fn recovered_total(&self, field: &str) -> u64 {
        let log = std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default();
        let needle = format!("{field}=");
        log.lines()
            .filter(|l| l.contains("local log recovered"))
            .filter_map(|l| l.split(&needle).nth(1))
            .filter_map(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    }

    /// Runs `edge-agent inspect` and parses its NDJSON.
    pub fn inspect(&self) -> Vec<Json> {
        let out = self.cli(
            &[
                "inspect",
                "--stream",
                "telemetry",
                "--config",
                self.config.to_str().unwrap(),
            ],
            None,
        );
        assert!(
            out.status.success(),
            "inspect failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("bad inspect line {l:?}: {e}"))
            })
            .collect()
    }

    /// Runs the binary with `args`, feeding `stdin`.
    pub fn cli(&self, args: &[&str], stdin: Option<&[u8]>) -> Output {
        run_cli(args, stdin)
    }
}

/// Runs the binary with `args`, feeding `stdin`, and collects its output.
pub fn run_cli(args: &[&str], stdin: Option<&[u8]>) -> Output {
    use std::io::Write as _;
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().unwrap();
        let input = input.to_vec();
        std::thread::spawn(move || {
            let _ = pipe.write_all(&input);
        });
    }
    child.wait_with_output().unwrap()
}

/// A running agent process.
#[derive(Debug)]
pub struct Agent {
    pub child: Child,
    log: PathBuf,
}

impl Agent {
    fn wait_ready(&mut self, client: &Client, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut delay = Duration::from_millis(2);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "the agent exited during start-up ({status}):\n{}",
                    self.log_text()
                );
            }
            let probe = rt.block_on(
                client
                    .clone()
                    .with_timeout(Duration::from_secs(2))
                    .get("/healthz"),
            );
            if probe.is_ok_and(|r| r.status == 200) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the agent was not ready in {timeout:?}:\n{}",
                self.log_text()
            );
            // Polling the condition itself; the pause only spaces the probes.
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then wait for a clean exit.
    pub fn terminate(&mut self) {
        // The shell's builtin `kill`: no unsafe libc call, and no dependency on procps.
        let status = Command::new("sh")
            .args(["-c", &format!("kill -TERM {}", self.child.id())])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "the agent exited with {status} on SIGTERM:\n{}",
                    self.log_text()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the agent ignored SIGTERM:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A record as `inspect` prints it, reduced to what a producer controls.
pub fn content(line: &Json) -> (String, i64, Json) {
    (
        line["key"].as_str().unwrap().to_owned(),
        line["ts"].as_i64().unwrap(),
        line["fields"].clone(),
    )
}

/// The epoch of an `inspect` line, an ack or a status: 16 hex digits, a string.
pub fn epoch_of(v: &Json) -> u64 {
    let hex = v["epoch"].as_str();
    assert!(
        hex.is_some_and(|h| h.len() == 16),
        "the epoch is not 16 hex digits as a string: {v}"
    );
    sync::epoch::parse(hex.unwrap()).unwrap_or_else(|| panic!("not a hex epoch: {v}"))
}

/// Checks that `lines` hold seqs 1..=N exactly once each, in one epoch, and returns them by seq.
pub fn by_seq(lines: &[Json]) -> (u64, HashMap<u64, &Json>) {
    let epoch = lines.first().map_or(0, epoch_of);
    let mut seqs = HashMap::new();
    for l in lines {
        assert_eq!(epoch_of(l), epoch, "one epoch only: {l}");
        let seq = l["seq"].as_u64().unwrap();
        assert!(seqs.insert(seq, l).is_none(), "seq {seq} appears twice");
    }
    let n = seqs.len() as u64;
    for s in 1..=n {
        assert!(
            seqs.contains_key(&s),
            "seq {s} is missing: seqs must be 1..={n} without gaps"
        );
    }
    (epoch, seqs)
}

/// The data directory's size, for budget checks.
pub fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        total += if m.is_dir() {
            dir_bytes(&e.path())
        } else {
            m.len()
        };
    }
    total
}
