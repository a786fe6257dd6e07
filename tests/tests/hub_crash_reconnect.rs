//! An agent notices a hub that died and came back at its next packet, not at its idle timeout.
//!
//! The hub keeps its QUIC stateless-reset key in `data_dir/quic-reset.key` across restarts.
//! After a `kill -9` and a restart on the same port, the agent's next keepalive (every 5 s)
//! reaches a hub that no longer knows the connection; the hub answers it with a stateless
//! reset derived from the same key, the agent recognises it ("reset by peer"), drops the dead
//! connection and reconnects. Without the kept key the reset is not recognised, and the agent
//! waits out its 30 s idle timeout ("timed out").
//!
//! The mutation check is the same scenario with the key file deleted before the restart, which
//! is what every restart looked like when the key was random per process: the session must
//! then end by the idle timeout, so the first scenario's assertion can fail.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::{Proc, wait_until};

const STREAM: &str = "telemetry";
/// Past the agent's 30 s idle timeout, so the mutation run can reconnect too.
const WAIT: Duration = Duration::from_secs(60);
const KEY_FILE: &str = "quic-reset.key";

fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    let text = http::get(addr, "/metrics").map_or_else(|_| String::new(), |r| r.text());
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn tails(procs: &[&Proc]) -> String {
    procs
        .iter()
        .map(|p| p.log_tail(25))
        .collect::<Vec<_>>()
        .join("\n")
}

/// How the agent's session ended after the hub was killed and restarted: the agent's
/// "replication session ended" lines from after the kill (none when the session ended
/// quietly, by the idle timeout).
fn session_end_after_hub_crash(delete_key: bool) -> Result<Vec<String>> {
    let root = tempfile::Builder::new().prefix("trb-hubcrash-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let mut hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    let records: Vec<SentRecord> = (0..50)
        .map(|i| SentRecord::new("k", 7_000 + i, json!({ "i": i })))
        .collect();
    match producer.post(&mut ledger, STREAM, &records, None)? {
        PostOutcome::Acked(_) => {}
        other => bail!("ingest not acknowledged: {other:?}"),
    }
    wait_until(WAIT, "the batch to be acknowledged by the hub", || {
        cluster::status(spec.http).is_ok_and(|s| cluster::stream_u64(&s, STREAM, "acked_seq") >= 50)
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    let key = hub_spec.data_dir.join(KEY_FILE);
    ensure!(key.is_file(), "the hub did not keep {}", key.display());

    let sessions = metric(spec.http, "tributary_edge_link_sessions_total");
    let ended = |agent: &Proc| -> Vec<String> {
        format!("{}\n{}", agent.stdout(), agent.stderr())
            .lines()
            .filter(|l| l.contains("replication session ended"))
            .map(str::to_owned)
            .collect()
    };
    let ended_before = ended(&agent).len();
    hub.kill9()?;
    if delete_key {
        std::fs::remove_file(&key)?;
    }
    hub = hub_spec.start(&pki)?;
    wait_until(WAIT, "the agent to open a new session", || {
        metric(spec.http, "tributary_edge_link_sessions_total") > sessions
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    let lines = ended(&agent)[ended_before..].to_vec();
    agent.kill9()?;
    hub.kill9()?;
    Ok(lines)
}

#[test]
fn a_restarted_hub_resets_the_dead_connection_at_the_agents_next_packet() -> Result<()> {
    let ended = session_end_after_hub_crash(false)?;
    println!("with the kept key: {ended:#?}");
    ensure!(
        ended.iter().any(|l| l.contains("reset by peer")),
        "the agent's session did not end by a stateless reset: {ended:#?}"
    );
    Ok(())
}

#[test]
fn without_the_kept_key_the_agent_waits_for_its_idle_timeout() -> Result<()> {
    let ended = session_end_after_hub_crash(true)?;
    println!("with a new key: {ended:#?}");
    ensure!(
        !ended.iter().any(|l| l.contains("reset by peer")),
        "with the key deleted the session should have ended by the idle timeout: {ended:#?}"
    );
    Ok(())
}
