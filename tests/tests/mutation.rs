//! Mutation check: CI proves that the ledger checker can fail.
//!
//! The hub has a test-only switch, `TRIBUTARY_TEST_HUB_DISABLE_DEDUPE=1`
//! (`core_hub::ingest::dedupe_disabled`, only in builds with core-hub's `fault-injection`
//! feature, which `cargo build --workspace --all-targets` enables): it reports marks of 0 in the handshake, so a
//! reconnecting agent resends everything it holds, and it stores resent blocks again instead of
//! dropping them. The same scenario runs twice, on a real hub and agent:
//!
//! 1. post acknowledged batches, wait until the agent has shipped them all;
//! 2. `kill -9` the hub and restart it, so the agent reconnects (counted by the agent's
//!    `tributary_edge_link_sessions_total`) and resends whatever the hub's marks ask for;
//! 3. post more, catch up, read the whole stream back and run the ledger checker.
//!
//! With the switch on the checker must report duplicates (and nothing missing); with it off
//! the same scenario must pass. A run where the reconnect did not happen fails, because then
//! no duplicate could have arrived and the check would prove nothing.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki, START_TIMEOUT};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, Report, SentRecord};
use tributary_tests::procs::{Proc, ProcSpec, bin_path, wait_until};

const STREAM: &str = "telemetry";
const DEVICE: &str = "dev-mut";
const DISABLE_DEDUPE_ENV: &str = "TRIBUTARY_TEST_HUB_DISABLE_DEDUPE";
const WAIT: Duration = Duration::from_secs(60);
/// What the hub logs when the switch is on (`core_hub::ingest::Hub::open_with_faults`).
const LOUD_LINE: &str = "DEDUPLICATION IS OFF";

fn batch(from: u64, n: u64) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| SentRecord::new(format!("k{}", i % 7), 5_000 + i as i64, json!({ "i": i })))
        .collect()
}

fn ingest(producer: &Producer, ledger: &mut Ledger, from: u64, n: u64) -> Result<()> {
    for chunk in batch(from, n).chunks(250) {
        match producer.post(ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("ingest was not acknowledged: {other:?}"),
        }
    }
    Ok(())
}

/// Starts the hub with `env`. `HubSpec` has no environment of its own, so its `hub.toml` is
/// written by a first spawn that is stopped at once, and the hub runs from that file.
fn start_hub(spec: &HubSpec, pki: &Pki, env: &[(&str, &str)]) -> Result<Proc> {
    let mut writer = spec.spawn(pki)?;
    writer.kill9()?;
    let log_dir = spec.config.parent().unwrap_or(Path::new(".")).join("logs");
    let mut proc_spec = ProcSpec::new(bin_path("core-hub"))
        .name("hub-mut")
        .arg("run")
        .arg("--config")
        .arg(&spec.config)
        .log_dir(log_dir);
    for (k, v) in env {
        proc_spec = proc_spec.env(k, v);
    }
    let mut hub = Proc::spawn(proc_spec)?;
    hub.wait_http_ok(spec.http, "/healthz", START_TIMEOUT)?;
    Ok(hub)
}

struct Outcome {
    report: Report,
    sessions: f64,
    hub_log: String,
}

fn scenario(disable_dedupe: bool) -> Result<Outcome> {
    let root = tempfile::Builder::new().prefix("trb-mutation-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let cert = pki.issue(DEVICE, None)?;
    let hub_spec = HubSpec::new(root.path());
    let env: &[(&str, &str)] = if disable_dedupe {
        &[(DISABLE_DEDUPE_ENV, "1")]
    } else {
        &[]
    };
    let mut hub = start_hub(&hub_spec, &pki, env)?;
    let agent_spec = AgentSpec::new(root.path(), "agent", cert, Some(hub_spec.quic));
    let _agent = agent_spec.start()?;
    let producer = Producer::new(DEVICE, agent_spec.http);
    let mut ledger = Ledger::new();

    ingest(&producer, &mut ledger, 0, 2_000)?;
    cluster::wait_caught_up(agent_spec.http, WAIT)?;

    // The reconnect: the agent must open a second session with the restarted hub.
    hub.kill9()?;
    hub.restart()?;
    hub.wait_http_ok(hub_spec.http, "/healthz", START_TIMEOUT)?;
    wait_until(WAIT, "the agent to reconnect to the restarted hub", || {
        cluster::fetch_metric(agent_spec.http, "tributary_edge_link_sessions_total")
            .is_ok_and(|n| n >= 2.0)
    })?;
    ingest(&producer, &mut ledger, 2_000, 1_000)?;
    cluster::wait_caught_up(agent_spec.http, WAIT)?;

    let sessions = cluster::fetch_metric(agent_spec.http, "tributary_edge_link_sessions_total")?;
    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let report = ledger.check(observed);
    Ok(Outcome {
        report,
        sessions,
        hub_log: hub.stderr() + &hub.stdout(),
    })
}

#[test]
fn the_checker_catches_duplicates_when_dedupe_is_off() -> Result<()> {
    let mutated = scenario(true).context("scenario with deduplication off")?;
    ensure!(
        mutated.sessions >= 2.0,
        "the reconnect did not happen ({} sessions)",
        mutated.sessions
    );
    ensure!(
        mutated.hub_log.contains(LOUD_LINE),
        "the hub did not log that deduplication is off (a hub binary built without core-hub's \
         `fault-injection` feature ignores the switch; build with \
         `cargo build --workspace --all-targets`):\n{}",
        mutated.hub_log
    );
    let r = &mutated.report;
    eprintln!("dedupe off: {}", r.summary());
    ensure!(
        !r.is_ok() && r.duplicates > 0,
        "the checker missed the duplicates of a hub without deduplication: {}",
        r.summary()
    );
    // The mutation adds copies; it must not hide a loss in the same run.
    ensure!(r.missing == 0, "records went missing: {}", r.summary());
    Ok(())
}

#[test]
fn the_same_scenario_passes_with_dedupe_on() -> Result<()> {
    let normal = scenario(false).context("scenario with deduplication on")?;
    ensure!(
        normal.sessions >= 2.0,
        "the reconnect did not happen ({} sessions)",
        normal.sessions
    );
    ensure!(
        !normal.hub_log.contains(LOUD_LINE),
        "the switch leaked into the normal run"
    );
    eprintln!("dedupe on: {}", normal.report.summary());
    normal.report.assert_ok();
    ensure!(
        normal.report.matched == 3_000,
        "{}",
        normal.report.summary()
    );
    Ok(())
}
