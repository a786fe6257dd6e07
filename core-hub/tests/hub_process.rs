//! The `core-hub run` process as an operator meets it: SIGTERM with a `follow` reader connected
//! exits within seconds (the reader gets the shutdown line) and a restart takes `hub.lock` at
//! once; its log file holds no ANSI colour codes and no `Debug` struct text; with
//! `log.format = "json"` every line is a JSON object; a device refused at the handshake
//! (revoked, or from another CA) is logged at INFO with its CN, once per device per minute.

mod common;

use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// A hub data directory holding six committed records of `telemetry`, and its config.
fn prepared(dir: &Path, extra: &str) -> (PathBuf, SocketAddr) {
    let http = free_port();
    let data = dir.join("data");
    let toml = format!(
        "data_dir = {data:?}\n[listen]\nhttp = \"{http}\"\nquic = \"{}\"\n{extra}",
        free_port()
    );
    let path = dir.join("hub.toml");
    std::fs::write(&path, toml).unwrap();
    let cfg = core_hub::HubConfig::load(&path).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let hub = core_hub::Hub::open(&cfg).unwrap();
    rt.block_on(hub.commit_block("truck-1", "telemetry", &common::block("truck-1", 1, 1, 6)))
        .unwrap();
    hub.shutdown();
    drop(hub);
    (path, http)
}

struct Hub {
    child: Child,
    log: PathBuf,
}

impl Hub {
    fn start(config: &Path, log: &Path) -> Hub {
        let file = std::fs::File::create(log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_core-hub"))
            .args(["run", "--config"])
            .arg(config)
            .env_remove("NO_COLOR")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Hub {
            child,
            log: log.to_owned(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_ready(&mut self, http: SocketAddr) {
        let deadline = Instant::now() + WAIT;
        while get(http, "/healthz").is_none_or(|(s, _)| s != 200) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the hub exited ({status}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "not ready:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn terminate(&mut self) -> Duration {
        let started = Instant::now();
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "exit {status}:\n{}", self.log());
                return started.elapsed();
            }
            assert!(
                started.elapsed() < WAIT,
                "no exit after SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some((out.get(9..12)?.parse().ok()?, out))
}

/// Opens a follow and reads until its first record arrived; returns the open stream.
fn follow(http: SocketAddr) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).unwrap();
    let req = "GET /v1/streams/telemetry/records?follow=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    s.write_all(req.as_bytes()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"seq\"") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the follow ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

/// What lines of a log must not hold: colour codes and `Debug` struct or option text.
fn assert_plain(log: &str) {
    for line in log.lines() {
        assert!(
            !line.contains('\u{1b}'),
            "an ANSI escape in the log file: {line:?}"
        );
        for debug in ["Pos {", " { ", "Some(", "None,", "[\""] {
            assert!(!line.contains(debug), "Debug text {debug:?} in: {line}");
        }
    }
}

#[test]
fn sigterm_with_a_follow_reader_exits_at_once_and_a_restart_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let (config, http) = prepared(dir.path(), "");
    let mut hub = Hub::start(&config, &dir.path().join("hub.log"));
    hub.wait_ready(http);
    let mut reader = follow(http);
    let took = hub.terminate();
    assert!(
        took < core_hub::api::SHUTDOWN_GRACE,
        "SIGTERM with a follow reader took {took:?}:\n{}",
        hub.log()
    );
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut reader, &mut rest);
    assert!(
        rest.contains("\"code\":\"HUB_SHUTTING_DOWN\"") && rest.contains("\"next_offset\":6"),
        "the reader got no shutdown line: {rest}"
    );
    let first_log = hub.log();
    // The reader is still connected (its socket open): the restart takes the lock at once.
    let mut again = Hub::start(&config, &dir.path().join("hub2.log"));
    again.wait_ready(http);
    again.terminate();
    drop(reader);
    assert!(first_log.contains("HTTP API listening"), "{first_log}");
    assert_plain(&first_log);
    assert_plain(&again.log());
}

#[test]
fn json_log_lines_parse() {
    let dir = tempfile::tempdir().unwrap();
    let (config, http) = prepared(dir.path(), "[log]\nformat = \"json\"\n");
    let mut hub = Hub::start(&config, &dir.path().join("hub.log"));
    hub.wait_ready(http);
    let _ = get(http, "/v1/streams/telemetry/records?from=start");
    hub.terminate();
    let log = hub.log();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 3, "too few lines: {log}");
    for line in lines {
        let v: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
        assert!(v["timestamp"].is_string(), "{line}");
    }
    assert!(log.contains("\"message\":\"HTTP API listening\""), "{log}");
}

#[test]
fn a_device_refused_at_the_handshake_is_logged_with_its_cn_once_a_minute() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    core_hub::pki::init(&pki, &[], false).unwrap();
    let (revoked, _) = common::quic::issue(&pki, "truck-revoked").unwrap();
    core_hub::pki::revoke(&pki, "truck-revoked", None).unwrap();
    let other = dir.path().join("other-pki");
    core_hub::pki::init(&other, &[], false).unwrap();
    let (foreign, _) = common::quic::issue(&other, "truck-foreign").unwrap();
    // It trusts the hub (so it gets as far as showing its certificate), but its own
    // certificate is from another CA.
    std::fs::copy(pki.join("ca.pem"), foreign.join("ca.pem")).unwrap();
    let tls = format!(
        "[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        pki.join("ca.pem"),
        pki.join("hub.pem"),
        pki.join("hub.key")
    );
    let (config, http) = prepared(dir.path(), &tls);
    let quic = core_hub::HubConfig::load(&config).unwrap().listen.quic;
    let mut hub = Hub::start(&config, &dir.path().join("hub.log"));
    hub.wait_ready(http);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _ = rustls::crypto::ring::default_provider().install_default();
    for _ in 0..3 {
        for cert in [&revoked, &foreign] {
            // Under TLS 1.3 the client may finish before the hub judges it: either way the
            // connection does not last.
            let _ = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(5), common::quic::connect(quic, cert))
                    .await
            });
        }
    }
    let deadline = Instant::now() + WAIT;
    let refused = |log: &str, device: &str| {
        log.lines()
            .filter(|l| l.contains("refused a device's TLS handshake") && l.contains(device))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    loop {
        let log = hub.log();
        let (r, f) = (
            refused(&log, "device=truck-revoked"),
            refused(&log, "device=truck-foreign"),
        );
        if !r.is_empty() && !f.is_empty() {
            assert_eq!(r.len(), 1, "logged more than once a minute: {r:?}");
            assert_eq!(f.len(), 1, "logged more than once a minute: {f:?}");
            assert!(r[0].contains("INFO"), "{}", r[0]);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no refusal with the CN in:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    hub.terminate();
    assert_plain(&hub.log());
}
