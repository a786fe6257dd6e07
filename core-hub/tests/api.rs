//! The HTTP API and the CLI against a real listener: the reader returns exactly the committed
//! records in hub offset order, pages through them, and honours reader tokens; `/healthz`,
//! `/metrics` and `/v1/devices` answer; `core-hub read` and `core-hub pki` work as a binary.

mod common;

use common::{block, open, record};
use core_hub::Hub;
use core_hub::api::{self, NEXT_OFFSET_HEADER, StreamInfo};
use core_hub::client::{self, ApiTarget};
use std::sync::Arc;

/// Serves the API on a free loopback port; returns its target.
async fn serve(
    hub: Arc<Hub>,
    tokens: Vec<String>,
) -> (ApiTarget, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let router = api::router(hub, tokens);
    tokio::spawn(api::serve(listener, router, async {
        let _ = rx.await;
    }));
    (ApiTarget::from_listen(addr, None), tx)
}

/// Commits interleaved blocks of three devices; returns `(device, seq)` in commit order.
async fn commit_three_devices(hub: &Hub) -> Vec<(String, u64)> {
    let mut order = Vec::new();
    for round in 0..5u64 {
        for dev in ["truck-1", "truck-2", "pump-7"] {
            let (first, last) = (round * 4 + 1, round * 4 + 4);
            hub.commit_block(dev, "telemetry", &block(dev, 1, first, last))
                .await
                .unwrap();
            order.extend((first..=last).map(|s| (dev.to_string(), s)));
        }
    }
    order
}

fn lines(body: &[u8]) -> Vec<serde_json::Value> {
    body.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect()
}

#[tokio::test]
async fn reader_returns_exactly_the_committed_records_in_offset_order() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let order = commit_three_devices(&hub).await;
    let (target, _stop) = serve(hub.clone(), Vec::new()).await;

    let resp = client::get(&target, "/v1/streams/telemetry/records?from=start")
        .await
        .unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/x-ndjson"));
    let got = lines(&resp.body);
    assert_eq!(got.len(), order.len());
    for (i, (line, (dev, seq))) in got.iter().zip(&order).enumerate() {
        assert_eq!(line["offset"], i as u64);
        assert_eq!(line["device"], dev.as_str());
        assert_eq!(line["seq"], *seq);
        assert_eq!(line["epoch"], "0000000000000001", "epochs are hex strings");
        let want = record(dev, *seq);
        assert_eq!(line["key"], want.key.as_str());
        assert_eq!(line["ts"], want.ts);
        assert_eq!(line["fields"]["seq"], *seq);
        assert_eq!(line["fields"]["who"], dev.as_str());
        assert!(line["ingest_ts"].as_i64().unwrap() > 0);
    }

    // Paging with `limit` and the next-offset header yields the same sequence.
    let mut from = 0u64;
    let mut paged = Vec::new();
    loop {
        let resp = client::get(
            &target,
            &format!("/v1/streams/telemetry/records?from={from}&limit=7"),
        )
        .await
        .unwrap();
        let page = lines(&resp.body);
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 7);
        from = resp.header(NEXT_OFFSET_HEADER).unwrap().parse().unwrap();
        paged.extend(page);
    }
    assert_eq!(paged, got);

    let resp = client::get(&target, "/v1/streams").await.unwrap();
    let streams: Vec<StreamInfo> = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(
        streams,
        vec![StreamInfo {
            name: "telemetry".into(),
            next_offset: 60,
            records: 60
        }]
    );
    assert_eq!(
        client::get(&target, "/v1/streams/nope/records")
            .await
            .unwrap()
            .status,
        404
    );
    assert_eq!(
        client::get(&target, "/v1/streams/telemetry/records?from=yesterday")
            .await
            .unwrap()
            .status,
        400
    );
}

#[tokio::test]
async fn health_metrics_devices_and_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    commit_three_devices(&hub).await;
    hub.touch("truck-1");
    let token = "reader-token-0123456789".to_string();
    let (target, _stop) = serve(hub.clone(), vec![token.clone()]).await;

    let health = client::get(&target, "/healthz").await.unwrap();
    assert_eq!((health.status, health.body.as_slice()), (200, &b"ok\n"[..]));
    // `/metrics` names every device: with reader tokens set, it needs one of them.
    let metrics = client::get(&target, "/metrics").await.unwrap();
    assert_eq!(metrics.status, 401);
    let reader = ApiTarget {
        token: Some(token.clone()),
        ..target.clone()
    };
    let metrics = client::get(&reader, "/metrics").await.unwrap();
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8(metrics.body).unwrap();
    for needle in [
        "tributary_hub_blocks_committed_total 15",
        "tributary_hub_records_committed_total 60",
        "tributary_hub_durable_seq{device=\"truck-2\",stream=\"telemetry\",epoch=\"0000000000000001\"} 20",
        "tributary_hub_group_commit_size_count",
        "tributary_hub_wal_fsyncs_total",
        "tributary_hub_wal_bytes_total",
        "tributary_hub_fenced_devices 0",
        "tributary_hub_stream_next_offset{stream=\"telemetry\"} 60",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }

    // The reader API needs the token; health did not.
    assert_eq!(
        client::get(&target, "/v1/devices").await.unwrap().status,
        401
    );
    let authed = ApiTarget {
        token: Some(token),
        ..target.clone()
    };
    let resp = client::get(&authed, "/v1/devices").await.unwrap();
    assert_eq!(resp.status, 200);
    let devices: Vec<api::DeviceInfo> = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(
        devices.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
        vec!["pump-7", "truck-1", "truck-2"]
    );
    let pump = &devices[0];
    assert_eq!(
        (pump.marks[0].stream.as_str(), pump.marks[0].durable_seq),
        ("telemetry", 20)
    );
    assert!(pump.fenced.is_none());
    let wrong = ApiTarget {
        token: Some("wrong-token-0123456789".into()),
        ..target.clone()
    };
    assert_eq!(
        client::get(&wrong, "/v1/streams").await.unwrap().status,
        401
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_read_devices_and_pki() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    let order = commit_three_devices(&hub).await;
    let (target, _stop) = serve(hub.clone(), Vec::new()).await;
    let url = format!("http://{}", target.authority);
    let bin = env!("CARGO_BIN_EXE_core-hub");

    let out = tokio::process::Command::new(bin)
        .args([
            "read",
            "telemetry",
            "--from",
            "start",
            "--format",
            "ndjson",
            "--url",
            &url,
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = lines(&out.stdout);
    assert_eq!(got.len(), order.len());
    for (line, (dev, seq)) in got.iter().zip(&order) {
        assert_eq!(
            (
                line["device"].as_str().unwrap(),
                line["seq"].as_u64().unwrap()
            ),
            (dev.as_str(), *seq)
        );
    }
    let out = tokio::process::Command::new(bin)
        .args(["devices", "--json", "--url", &url])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let devices: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(devices.as_array().unwrap().len(), 3);

    let pki = dir.path().join("pki");
    let pki_s = pki.to_str().unwrap();
    let run = |args: Vec<&str>| std::process::Command::new(bin).args(args).output().unwrap();
    assert!(
        run(vec![
            "pki",
            "init",
            "--dir",
            pki_s,
            "--san",
            "hub.example.net"
        ])
        .status
        .success()
    );
    assert!(
        !run(vec!["pki", "init", "--dir", pki_s]).status.success(),
        "must refuse to overwrite the CA"
    );
    let dev_dir = dir.path().join("dev");
    let issued = run(vec![
        "pki",
        "issue",
        "--dir",
        pki_s,
        "--device",
        "truck-1",
        "--out",
        dev_dir.to_str().unwrap(),
    ]);
    assert!(
        issued.status.success(),
        "{}",
        String::from_utf8_lossy(&issued.stderr)
    );
    for f in ["ca.pem", "device.pem", "device.key"] {
        assert!(dev_dir.join(f).exists(), "{f}");
    }
    let cert = core_hub::pki::load_certs(&dev_dir.join("device.pem"))
        .unwrap()
        .remove(0);
    assert_eq!(
        core_hub::pki::device_id_from_cert(&cert).unwrap(),
        "truck-1"
    );
    assert!(
        run(vec!["pki", "revoke", "--dir", pki_s, "--device", "truck-1"])
            .status
            .success()
    );
    let list = core_hub::pki::RevocationList::load(&pki.join("revoked.txt")).unwrap();
    assert!(list.is_revoked("truck-1"));
}

/// Ports below the kernel's ephemeral range: a port released here and bound again by a child
/// (or after a restart) cannot meanwhile become some outgoing connection's source port.
#[path = "../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

/// A free loopback port (bound and released; the hub binds it right after).
fn free_port() -> u16 {
    ports::tcp()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_the_api_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = dir.path().join("hub.toml");
    let toml = format!(
        "data_dir = \"{}\"\n[listen]\nhttp = \"127.0.0.1:{port}\"\n",
        dir.path().join("data").display()
    );
    std::fs::write(&config, toml).unwrap();
    let bin = env!("CARGO_BIN_EXE_core-hub");
    let mut child = tokio::process::Command::new(bin)
        .args(["run", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the hub's own "listening" log line, with a deadline.
    let stderr = child.stderr.take().unwrap();
    let listening = async {
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("HTTP API listening") {
                return lines;
            }
        }
        panic!("the hub exited before listening");
    };
    let _rest = tokio::time::timeout(std::time::Duration::from_secs(30), listening)
        .await
        .expect("the hub did not come up");
    let target = ApiTarget::parse(&format!("http://127.0.0.1:{port}"), None).unwrap();
    // The API listens before tier 2 is open; /healthz says ready (200) once it is.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let status = client::get(&target, "/healthz").await.unwrap().status;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "/healthz before the hub is ready");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hub never became ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let out = tokio::process::Command::new(bin)
        .args(["read", "nothing-yet", "--config", config.to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "an unknown stream is an error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("404"));
    let status = tokio::process::Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status()
        .await
        .unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}
