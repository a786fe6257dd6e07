//! A refused stream and a restarted hub, against the real binaries.
//!
//! - A hub allow-list that refuses one of a device's two streams refuses that stream alone
//!   (StreamRefused): the allowed stream keeps flowing on the one session, with no reconnect;
//!   the agent shows the refused stream with its code on `/metrics`, and in `/v1/status` and
//!   `edge-agent status` with its code, the hub's message, since when (kept through the hub's
//!   repeated refusals) and the next retry; the hub offers it a retry every
//!   `ingest.stream_refusal_retry`. Once the allow-list is fixed (a hub restart with the new
//!   config) the refused stream ships, without a new epoch, exactly once by the ledger, and
//!   leaves the status.
//! - After a hub restart (twice, away 2 s then 5 s) the agent's session is back within 2 s of
//!   the hub being ready.
//! - Against a hub that is not there, the attempts slow down (the backoff still grows).

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::{Proc, bin_path, wait_until};

const REFUSED: &str = "telemetry";
const ALLOWED: &str = "other";
const WAIT: Duration = Duration::from_secs(60);
const RETRY_TOML: &str = "[ingest]\nstream_refusal_retry = \"2s\"\n\n";

fn batch(tag: &str, from: u64, n: u64) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 3),
                9_000 + i as i64,
                json!({ "tag": tag, "i": i }),
            )
        })
        .collect()
}

fn ingest(p: &Producer, ledger: &mut Ledger, stream: &str, records: &[SentRecord]) -> Result<()> {
    for chunk in records.chunks(250) {
        match p.post(ledger, stream, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("ingest into {stream} not acknowledged: {other:?}"),
        }
    }
    Ok(())
}

fn acked(spec: &AgentSpec, stream: &str) -> u64 {
    cluster::status(spec.http)
        .map(|st| cluster::stream_u64(&st, stream, "acked_seq"))
        .unwrap_or(0)
}

fn wait_acked(spec: &AgentSpec, logs: &[&Proc], stream: &str, seq: u64) -> Result<()> {
    wait_until(WAIT, &format!("{stream} acknowledged up to {seq}"), || {
        acked(spec, stream) >= seq
    })
    .with_context(|| tails(logs))
}

fn tails(logs: &[&Proc]) -> String {
    logs.iter()
        .map(|p| p.log_tail(25))
        .collect::<Vec<_>>()
        .join("\n")
}

fn metrics(addr: std::net::SocketAddr) -> String {
    http::get(addr, "/metrics").map_or_else(|_| String::new(), |r| r.text())
}

fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    cluster::fetch_metric(addr, name).unwrap_or(0.0)
}

/// `stream`'s entry among the agent's `refused_streams` in `/v1/status`, if it has one.
fn refusal(spec: &AgentSpec, stream: &str) -> Option<Value> {
    let status = cluster::status(spec.http).ok()?;
    cluster::refused_streams(&status)
        .into_iter()
        .find(|r| r["stream"] == stream)
}

/// What `edge-agent status` prints for a person.
fn human_status(spec: &AgentSpec) -> Result<String> {
    let out = Command::new(bin_path("edge-agent"))
        .args(["status", "--url", &format!("http://{}", spec.http)])
        .output()
        .context("running edge-agent status")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "edge-agent status failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(text)
}

/// The refused stream as `/v1/status` and `edge-agent status` show it: code, the hub's
/// message (which names the stream), since when and the next retry (RFC 3339, after `since`).
fn check_refusal_shown(spec: &AgentSpec, r: &Value) -> Result<()> {
    let text = |k: &str| r[k].as_str().unwrap_or("").to_owned();
    ensure!(
        text("code") == "UNAUTHORIZED_STREAM" && text("message").contains(REFUSED),
        "the status shows the refusal without its code or the hub's message: {r}"
    );
    let (since, next) = (text("since"), text("next_retry"));
    ensure!(
        since.ends_with('Z') && next.ends_with('Z') && since < next,
        "since and next retry are not RFC 3339 times in order: {r}"
    );
    ensure!(
        refusal(spec, ALLOWED).is_none(),
        "the allowed stream is listed as refused"
    );
    let human = human_status(spec)?;
    let line = format!("refused   {REFUSED}: UNAUTHORIZED_STREAM since {since} (");
    ensure!(
        human
            .lines()
            .any(|l| l.starts_with(&line) && l.contains("; next retry in ")),
        "edge-agent status has no line {line:?}...:\n{human}"
    );
    Ok(())
}

#[test]
fn a_refused_stream_keeps_the_session_and_ships_once_allowed() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-refuse-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.extra_toml = format!("{RETRY_TOML}[devices.dev-1]\nstreams = [\"{ALLOWED}\"]\n");
    let mut hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    spec.streams = vec![REFUSED.into(), ALLOWED.into()];
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, REFUSED, &batch("refused", 0, 300))?;
    ingest(&producer, &mut ledger, ALLOWED, &batch("allowed", 0, 300))?;
    wait_acked(&spec, &[&hub, &agent], ALLOWED, 300)?;

    // The agent shows the refused stream with its code.
    let shown = format!(
        "tributary_edge_stream_refused{{stream=\"{REFUSED}\",code=\"UNAUTHORIZED_STREAM\"}} 1"
    );
    wait_until(WAIT, "the agent to show the refused stream", || {
        metrics(spec.http).contains(&shown)
    })
    .with_context(|| tails(&[&hub, &agent]))?;
    // ... and in its status, JSON and human, with the hub's message, since and next retry.
    wait_until(
        WAIT,
        "the agent's status to list the refused stream",
        || refusal(&spec, REFUSED).is_some(),
    )
    .with_context(|| tails(&[&hub, &agent]))?;
    let first = refusal(&spec, REFUSED).context("the refused stream left the status")?;
    check_refusal_shown(&spec, &first)?;
    // The allowed stream keeps flowing while the hub refuses the other one again, once per
    // retry period, on the same session.
    ingest(&producer, &mut ledger, ALLOWED, &batch("allowed", 300, 300))?;
    wait_acked(&spec, &[&hub, &agent], ALLOWED, 600)?;
    wait_until(
        WAIT,
        "the hub to refuse the stream again after its retry",
        || metric(hub_spec.http, "tributary_hub_streams_refused_total") >= 2.0,
    )
    .with_context(|| tails(&[&hub, &agent]))?;
    let sessions = metric(spec.http, "tributary_edge_link_sessions_total");
    let ended = metric(hub_spec.http, "tributary_hub_sessions_ended_total");
    ensure!(
        sessions == 1.0 && ended == 0.0,
        "the refusal cost sessions: agent sessions {sessions}, hub sessions ended {ended}\n{}",
        tails(&[&hub, &agent])
    );
    ensure!(
        acked(&spec, REFUSED) == 0,
        "the refused stream was acknowledged"
    );
    ensure!(cluster::read_stream(hub_spec.http, REFUSED)?.is_empty());
    // Refused again: still listed, since the first refusal.
    let again = refusal(&spec, REFUSED).context("the refused stream left the status")?;
    check_refusal_shown(&spec, &again)?;
    ensure!(
        again["since"] == first["since"],
        "a repeated refusal moved `since`: {first} then {again}"
    );
    let epoch = cluster::stream_epoch(&cluster::status(spec.http)?, REFUSED)?;

    // The operator fixes the allow-list: the hub restarts with the new config.
    hub.terminate(Duration::from_secs(20))?;
    hub_spec.extra_toml = RETRY_TOML.to_string();
    hub = hub_spec.start(&pki)?;
    ingest(&producer, &mut ledger, REFUSED, &batch("refused", 300, 50))?;
    wait_acked(&spec, &[&hub, &agent], REFUSED, 350)?;
    wait_acked(&spec, &[&hub, &agent], ALLOWED, 600)?;
    let minted = metric(spec.http, "tributary_edge_epochs_minted_total");
    let now_epoch = cluster::stream_epoch(&cluster::status(spec.http)?, REFUSED)?;
    ensure!(
        minted == 0.0 && now_epoch == epoch,
        "nothing was restored, yet the agent minted an epoch ({minted}, {epoch:016x} -> {now_epoch:016x})\n{}",
        tails(&[&hub, &agent])
    );
    // Shipping again, it leaves the status.
    wait_until(
        WAIT,
        "the shipped stream to leave the refused streams",
        || refusal(&spec, REFUSED).is_none(),
    )
    .with_context(|| tails(&[&hub, &agent]))?;
    let human = human_status(&spec)?;
    ensure!(
        !human.lines().any(|l| l.starts_with("refused")),
        "edge-agent status still shows a refusal:\n{human}"
    );
    let mut observed = cluster::read_stream(hub_spec.http, REFUSED)?;
    observed.extend(cluster::read_stream(hub_spec.http, ALLOWED)?);
    ledger
        .check_streams(&[REFUSED, ALLOWED], observed)
        .assert_ok();
    agent.kill9()?;
    Ok(())
}

/// Mutation check: an agent that does not announce the StreamRefused capability (the switch
/// `TRIBUTARY_TEST_EDGE_NO_STREAM_REFUSED=1`, in `fault-injection` builds) gets the old
/// behaviour, its session closed over the refused stream, which the checks above catch.
#[test]
fn mutation_without_the_capability_the_session_is_lost() -> Result<()> {
    let root = tempfile::Builder::new()
        .prefix("trb-refuse-mut-")
        .tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.extra_toml = format!("{RETRY_TOML}[devices.dev-1]\nstreams = [\"{ALLOWED}\"]\n");
    let hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    spec.streams = vec![REFUSED.into(), ALLOWED.into()];
    spec.env
        .push(("TRIBUTARY_TEST_EDGE_NO_STREAM_REFUSED".into(), "1".into()));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, REFUSED, &batch("refused", 0, 10))?;
    ingest(&producer, &mut ledger, ALLOWED, &batch("allowed", 0, 10))?;
    wait_until(WAIT, "the switch to take effect", || {
        format!("{}{}", agent.stdout(), agent.stderr()).contains("NO STREAMREFUSED CAPABILITY")
    })
    .context(
        "the agent ignored TRIBUTARY_TEST_EDGE_NO_STREAM_REFUSED: build it with edge-agent's \
         fault-injection feature (cargo build -p edge-agent --features fault-injection)",
    )?;
    wait_until(
        WAIT,
        "the hub to end the session over the refused stream",
        || metric(hub_spec.http, "tributary_hub_sessions_ended_total") >= 1.0,
    )
    .with_context(|| tails(&[&hub, &agent]))?;
    ensure!(
        metric(hub_spec.http, "tributary_hub_streams_refused_total") == 0.0,
        "an agent without the capability was sent StreamRefused"
    );
    agent.kill9()?;
    Ok(())
}

#[test]
fn the_agent_is_back_within_2s_of_a_restarted_hub_being_ready() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-restart-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let mut hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    ingest(&producer, &mut ledger, REFUSED, &batch("a", 0, 100))?;
    wait_acked(&spec, &[&hub, &agent], REFUSED, 100)?;
    for round in 0..2 {
        let before = metric(spec.http, "tributary_edge_link_sessions_total");
        // A restart (SIGTERM, as systemd does): the hub is away for a while, longer the
        // second time, then back on the same port.
        hub.terminate(Duration::from_secs(20))?;
        std::thread::sleep(Duration::from_secs(2 + 3 * round));
        hub = hub_spec.start(&pki)?;
        let ready = Instant::now();
        let mut back = None;
        while ready.elapsed() < Duration::from_secs(20) {
            if metric(spec.http, "tributary_edge_link_sessions_total") > before {
                back = Some(ready.elapsed());
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let back =
            back.with_context(|| format!("never reconnected\n{}", tails(&[&hub, &agent])))?;
        println!("round {round}: session back {back:?} after the hub was ready");
        ensure!(
            back <= Duration::from_millis(2_100),
            "round {round}: the session came back {back:?} after the hub was ready, over 2 s\n{}",
            tails(&[&hub, &agent])
        );
    }
    agent.kill9()?;
    Ok(())
}

#[test]
fn against_a_hub_that_is_away_the_attempts_slow_down() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-away-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let cert = pki.issue("dev-1", None)?;
    // Nobody listens on this port.
    let away = tributary_tests::ports::loopback(tributary_tests::ports::Proto::Udp);
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(away));
    let mut agent = spec.start()?;
    let start = Instant::now();
    let connects = || metric(spec.http, "tributary_edge_link_connects_total");
    let mut at = Vec::new();
    let mut seen = 0.0;
    while start.elapsed() < Duration::from_secs(24) {
        let n = connects();
        if n > seen {
            seen = n;
            at.push(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("attempts at {at:?}");
    // Deadlines of 1, 2, 4, 8 s with growing waits between: about five attempts in 24 s, where
    // fixed short attempts would make twenty.
    ensure!(
        (2.0..=7.0).contains(&seen),
        "{seen} attempts in 24 s against a hub that is away\n{}",
        agent.log_tail(20)
    );
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    ensure!(
        gaps.last() > gaps.first(),
        "the attempts did not slow down: {gaps:?}"
    );
    agent.kill9()?;
    Ok(())
}
