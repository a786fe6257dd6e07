//! Completeness end to end with the real binaries: a hub and two agents on loopback.
//!
//! truck-b goes offline (restarted without a hub) and keeps taking records: the hub's
//! completeness answer for a range ending after those records is `owed`, naming truck-b (it
//! has not been heard from since `to + clock_skew`). Once truck-b reconnects, its Backlog
//! reports (sent at session start and again when the backlog drains) and the catch-up turn
//! the same answer into `complete`. This exercises the agent's periodic Backlog frames, not
//! just the hub's bookkeeping.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::wait_until;

const STREAM: &str = "telemetry";
const WAIT: Duration = Duration::from_secs(60);

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Posts `n` records stamped now.
fn post(device: &str, addr: SocketAddr, n: u64) -> Result<()> {
    let mut ledger = Ledger::new();
    let producer = Producer::new(device, addr);
    let ts = now_ns();
    let batch: Vec<SentRecord> = (0..n)
        .map(|i| {
            SentRecord::new(
                format!("{device}/k{}", i % 4),
                ts + i as i64,
                json!({ "i": i }),
            )
        })
        .collect();
    match producer.post(&mut ledger, STREAM, &batch, None)? {
        PostOutcome::Acked(_) => Ok(()),
        other => anyhow::bail!("{device}: ingest failed: {other:?}"),
    }
}

fn completeness(hub: SocketAddr, to: i64) -> Result<Value> {
    let path = format!("/v1/streams/{STREAM}/completeness?from=0&to={to}");
    let r = tributary_tests::http::get(hub, &path)?;
    ensure!(
        r.status == 200,
        "{path}: {} {}",
        r.status,
        String::from_utf8_lossy(&r.body)
    );
    Ok(serde_json::from_slice(&r.body)?)
}

fn owed(v: &Value) -> Vec<String> {
    v["owed"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|o| o["device"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn offline_device_is_owed_until_it_catches_up() -> Result<()> {
    let root = tempfile::tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.extra_toml = "[completeness]\nclock_skew = \"1s\"\n".into();
    let _hub = hub_spec.start(&pki)?;
    let a = AgentSpec::new(
        root.path(),
        "truck-a",
        pki.issue("truck-a", None)?,
        Some(hub_spec.quic),
    );
    let b = AgentSpec::new(
        root.path(),
        "truck-b",
        pki.issue("truck-b", None)?,
        Some(hub_spec.quic),
    );
    let _agent_a = a.start()?;
    let mut agent_b = b.start()?;
    post("truck-a", a.http, 50)?;
    post("truck-b", b.http, 50)?;
    cluster::wait_caught_up(a.http, WAIT)?;
    cluster::wait_caught_up(b.http, WAIT)?;

    // truck-b loses its link (here: runs without a hub) and keeps recording.
    agent_b.terminate(Duration::from_secs(10))?;
    let offline = AgentSpec {
        hub: None,
        ..b.clone()
    };
    let mut agent_b = offline.start()?;
    post("truck-b", b.http, 40)?;
    let to = now_ns();

    // Owed, naming truck-b: it has not reported since `to + clock_skew`. truck-a reports
    // every 10 s while connected, so it settles on its own.
    wait_until(WAIT, "only truck-b owed", || {
        completeness(hub_spec.http, to).is_ok_and(|v| owed(&v) == ["truck-b"])
    })?;
    let v = completeness(hub_spec.http, to)?;
    assert_eq!(v["status"], "owed", "{v:#}");
    assert_eq!(v["owed"][0]["reason"], "not_heard_since", "{v:#}");

    // truck-b reconnects (after `to + clock_skew`), reports and catches up: complete.
    wait_until(WAIT, "to + clock_skew to pass", || {
        now_ns() > to + 1_500_000_000
    })?;
    agent_b.terminate(Duration::from_secs(10))?;
    let _agent_b = b.start()?;
    cluster::wait_caught_up(b.http, WAIT)?;
    wait_until(WAIT, "complete after catch-up", || {
        completeness(hub_spec.http, to).is_ok_and(|v| v["status"] == "complete")
    })
    .context("truck-b caught up but the range never became complete")?;
    let v = completeness(hub_spec.http, to)?;
    let b_state = v["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["device"] == "truck-b"))
        .context("truck-b in the answer")?;
    assert!(
        b_state["backlog_reported_at_ns"].as_i64().unwrap_or(0) > to,
        "{v:#}"
    );
    assert_eq!(b_state["backlog_blocks"], 0, "{v:#}");
    Ok(())
}
