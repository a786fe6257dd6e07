//! Replication through network faults, with the real hub and agent binaries.
//!
//! - A partition of minutes (150 s; two hours with `TRIBUTARY_SOAK=1`, any length with
//!   `TRIBUTARY_PARTITION_SECS`): the hub runs in its own network namespace, the agent in the peer one,
//!   and iptables DROP rules on both sides cut the link. The agent keeps taking data meanwhile;
//!   after healing it reconnects by itself and its lag (durable but unacknowledged records)
//!   returns to zero within [`RECOVERY_BOUND`]: a handshake begun just before the heal whose
//!   retransmits all fall in the partition (it ends at the 30 s QUIC idle timeout), then the
//!   reconnect backoff cap (30 s by default), then 15 s for the handshake and the drain. The
//!   rules' counters prove packets were dropped.
//! - Loss only in the hub-to-edge direction: acks and handshakes get lost, the agent resends,
//!   and the hub still holds every record exactly once.
//! - A link that flaps every 2 s with 20% loss both ways while the agent takes data: the agent
//!   never stalls (its lag returns to zero within [`FLAP_RECOVERY_BOUND`] of the link settling),
//!   its memory stays bounded, and the hub holds every record exactly once. Cuts of 2 s are
//!   shorter than the 30 s QUIC idle timeout, so the session rides through them (the long
//!   partition above covers reconnecting).
//!
//! The partition test takes about three minutes on purpose (the issue asks for minutes of
//! partition in CI and hours in soak mode).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tributary_tests::chaos::soak;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::netem::{Impairment, ProxyConfig, UdpImpairProxy};
use tributary_tests::netns::{DropSpec, L4, NetnsPair, Partition, Side};
use tributary_tests::procs::wait_until;

const STREAM: &str = "telemetry";
const WAIT: Duration = Duration::from_secs(60);
/// The partition's length in CI.
const PARTITION_CI: Duration = Duration::from_secs(150);
/// ... and in soak mode.
const PARTITION_SOAK: Duration = Duration::from_secs(2 * 3600);
/// The worst case after healing: a handshake that began in the partition times out (the 30 s
/// QUIC idle timeout), the agent's default reconnect backoff cap (30 s) passes, and 15 s to
/// reconnect and drain.
const RECOVERY_BOUND: Duration = Duration::from_secs(75);
/// After a flapping link settles: the agent's backoff cap (set to 2 s in that test) plus the
/// drain over a link that still loses 20% both ways.
const FLAP_RECOVERY_BOUND: Duration = Duration::from_secs(60);
/// The agent's RSS while the link flaps; far above its ~10 MiB steady state, far below a leak.
const FLAP_RSS_MAX: u64 = 96 << 20;

fn records(tag: &str, from: u64, n: u64, pad: usize) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| {
            // Pseudo-random padding that compresses poorly, so the drain moves real bytes.
            let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
            let pad: String = (0..pad)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    char::from(b'a' + (x % 26) as u8)
                })
                .collect();
            SentRecord::new(
                format!("k{}", i % 7),
                5_000 + i as i64,
                json!({ "tag": tag, "i": i, "pad": pad }),
            )
        })
        .collect()
}

fn ingest_all(producer: &Producer, ledger: &mut Ledger, batch: &[SentRecord]) -> Result<()> {
    for chunk in batch.chunks(500) {
        match producer.post(ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => anyhow::bail!("ingest not acknowledged: {other:?}"),
        }
    }
    Ok(())
}

/// The partition's length and how often the agent takes a batch of 200 records meanwhile
/// (rarer in soak mode, so that hours of ledger stay small).
fn partition_plan() -> Result<(Duration, Duration)> {
    let length = match std::env::var("TRIBUTARY_PARTITION_SECS") {
        Ok(s) => Duration::from_secs(
            s.parse()
                .with_context(|| format!("TRIBUTARY_PARTITION_SECS={s:?} is not whole seconds"))?,
        ),
        Err(_) if soak() => PARTITION_SOAK,
        Err(_) => PARTITION_CI,
    };
    let every = if length > Duration::from_secs(600) {
        Duration::from_secs(5)
    } else {
        Duration::from_millis(250)
    };
    Ok((length, every))
}

#[test]
fn a_partition_of_minutes_heals_by_itself_and_lag_returns_to_zero() -> Result<()> {
    let (partition_len, ingest_every) = partition_plan()?;
    let pair = NetnsPair::create()?;
    let root = tempfile::Builder::new().prefix("trb-part-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_ip = pair.addr(Side::A);
    let agent_ip = pair.addr(Side::B);
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.quic = SocketAddr::from((hub_ip, 7400));
    hub_spec.http = SocketAddr::from((hub_ip, 7480));
    hub_spec.netns = Some(pair.name(Side::A).to_string());
    let mut hub = hub_spec.spawn(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    spec.http = SocketAddr::from((agent_ip, 7401));
    spec.netns = Some(pair.name(Side::B).to_string());
    let mut agent = spec.spawn()?;

    // HTTP to each process from inside its namespace.
    let agent_status = || {
        pair.in_ns(Side::B, || cluster::status(spec.http))
            .and_then(|r| r)
    };
    wait_until(
        cluster::START_TIMEOUT,
        "the hub and the agent to start, and the link to come up",
        || hub.is_running() && agent_status().is_ok_and(|s| cluster::link(&s) == "up"),
    )
    .with_context(|| format!("{}\n{}", hub.log_tail(20), agent.log_tail(20)))?;

    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    let before = records("before", 0, 5_000, 16);
    pair.in_ns(Side::B, || ingest_all(&producer, &mut ledger, &before))??;
    wait_until(WAIT, "the first batch to replicate", || {
        agent_status().is_ok_and(|s| cluster::caught_up(&s))
    })?;

    // DROP every QUIC datagram to the hub (in its namespace) and from it (in the agent's).
    // Only UDP is cut: the test's own HTTP to each process stays inside one namespace, and a
    // blanket INPUT rule would drop that too.
    let quic_port = hub_spec.quic.port();
    let to_hub = DropSpec {
        protocol: Some(L4::Udp),
        dport: Some(quic_port),
        ..DropSpec::default()
    };
    let from_hub = DropSpec {
        protocol: Some(L4::Udp),
        sport: Some(quic_port),
        ..DropSpec::default()
    };
    let partition = Partition {
        rules: [
            pair.add_drop(Side::A, to_hub)?,
            pair.add_drop(Side::B, from_hub)?,
        ],
    };
    let cut_at = Instant::now();
    let mut next = 5_000;
    let mut saw_down = false;
    // The agent keeps ingesting for the whole partition; the loop is the partition's length.
    let mut batches = 0u64;
    while cut_at.elapsed() < partition_len {
        let batch = records("during", next, 200, 16);
        next += 200;
        batches += 1;
        pair.in_ns(Side::B, || ingest_all(&producer, &mut ledger, &batch))??;
        let status = agent_status()?;
        saw_down |= cluster::link(&status) != "up";
        std::thread::sleep(ingest_every);
    }
    let lag_at_heal = cluster::unacked(&agent_status()?);
    let dropped = pair.heal(&partition)?;
    let healed_at = Instant::now();
    ensure!(dropped > 0, "the partition dropped no packets");
    assert!(
        saw_down,
        "the link never showed as down during a {partition_len:?} partition"
    );
    assert!(lag_at_heal > 0, "no lag built up during the partition");

    let recovered = wait_until(
        RECOVERY_BOUND,
        "the lag to return to zero after healing",
        || agent_status().is_ok_and(|s| cluster::link(&s) == "up" && cluster::caught_up(&s)),
    );
    let recovery = healed_at.elapsed();
    recovered.with_context(|| format!("{}\n{}", agent.log_tail(30), hub.log_tail(20)))?;

    let observed = pair.in_ns(Side::A, || cluster::read_stream(hub_spec.http, STREAM))??;
    let report = ledger.check(observed);
    assert!(report.is_ok(), "{}", report.summary());
    println!(
        "partition: {dropped} packets dropped in {partition_len:?}; {batches} batches taken \
         meanwhile; lag at heal {lag_at_heal} records; lag back to zero {recovery:.1?} after \
         healing (bound {RECOVERY_BOUND:?}); {} records acked",
        ledger.acked_len()
    );
    hub.kill9()?;
    agent.kill9()?;
    Ok(())
}

#[test]
fn loss_only_from_hub_to_edge_duplicates_nothing() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-ackloss-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let _hub = hub_spec.start(&pki)?;
    let mut cfg = ProxyConfig::new(hub_spec.quic);
    cfg.seed = 7;
    cfg.upstream_to_client = Impairment {
        loss: 0.2,
        delay: Duration::from_millis(5),
        ..Impairment::none()
    };
    let proxy = UdpImpairProxy::start(cfg)?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(proxy.local_addr()));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();
    for round in 0..20 {
        ingest_all(
            &producer,
            &mut ledger,
            &records("r", round * 1_000, 1_000, 16),
        )?;
    }
    cluster::wait_caught_up(spec.http, Duration::from_secs(120))
        .with_context(|| agent.log_tail(20))?;
    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let report = ledger.check(observed.iter().cloned());
    assert!(report.is_ok(), "{}", report.summary());
    assert_eq!(observed.len(), 20_000);
    let stats = proxy.stats();
    assert!(
        stats.upstream_to_client.dropped_loss > 0,
        "nothing was lost hub-to-edge: {stats:?}"
    );
    assert_eq!(
        stats.client_to_upstream.dropped(),
        0,
        "edge-to-hub must be clean: {stats:?}"
    );
    let duplicates = cluster::fetch_metric(hub_spec.http, "tributary_hub_duplicate_blocks_total")?;
    println!(
        "hub-to-edge loss: {} datagrams lost hub-to-edge, {duplicates} duplicate blocks answered \
         idempotently, {} records once each",
        stats.upstream_to_client.dropped_loss,
        observed.len()
    );
    agent.kill9()?;
    Ok(())
}

/// VmRSS of a process in bytes.
fn rss_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS line")?;
    Ok(kib << 10)
}

#[test]
fn a_flapping_lossy_link_never_stalls_the_agent() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-flap-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let _hub = hub_spec.start(&pki)?;
    let lossy = Impairment {
        loss: 0.2,
        delay: Duration::from_millis(5),
        ..Impairment::none()
    };
    let mut cfg = ProxyConfig::new(hub_spec.quic);
    cfg.seed = 11;
    cfg.client_to_upstream = lossy.clone();
    cfg.upstream_to_client = lossy;
    let proxy = UdpImpairProxy::start(cfg)?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(proxy.local_addr()));
    spec.env
        .push(("TRIBUTARY_EDGE__HUB__BACKOFF_MAX".into(), "2s".into()));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();

    // 10 cycles: 2 s up, 2 s cut, with a batch of records taken in each half.
    let mut rss_peak = 0;
    let mut flaps = 0;
    for cycle in 0..10u64 {
        for (half, cut) in [(0, false), (1, true)] {
            proxy.partition(cut);
            flaps += usize::from(cut);
            let started = Instant::now();
            ingest_all(
                &producer,
                &mut ledger,
                &records("f", (cycle * 2 + half) * 1_000, 1_000, 16),
            )?;
            rss_peak = rss_peak.max(rss_bytes(agent.pid())?);
            std::thread::sleep(Duration::from_secs(2).saturating_sub(started.elapsed()));
        }
    }
    proxy.partition(false);
    let settled = Instant::now();
    cluster::wait_caught_up(spec.http, FLAP_RECOVERY_BOUND)
        .with_context(|| format!("lag did not return to zero\n{}", agent.log_tail(20)))?;
    let recovered_in = settled.elapsed();
    rss_peak = rss_peak.max(rss_bytes(agent.pid())?);

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let report = ledger.check(observed.iter().cloned());
    assert!(report.is_ok(), "{}", report.summary());
    assert_eq!(observed.len(), 20_000);
    let stats = proxy.stats();
    assert!(
        stats.client_to_upstream.dropped_partition > 0 && stats.upstream_to_client.dropped_loss > 0,
        "the link neither flapped nor lost packets: {stats:?}"
    );
    assert!(
        stats.client_to_upstream.dropped_loss > 0,
        "nothing was lost edge-to-hub: {stats:?}"
    );
    assert!(
        rss_peak < FLAP_RSS_MAX,
        "agent RSS peaked at {} MiB",
        rss_peak >> 20
    );
    let sessions = cluster::fetch_metric(spec.http, "tributary_edge_link_sessions_total")?;
    println!(
        "flapping link: {flaps} cuts, {} + {} datagrams lost to loss, {} to cuts, {sessions} \
         sessions; caught up {recovered_in:.1?} after the link settled; agent RSS peak {} MiB; \
         {} records once each",
        stats.client_to_upstream.dropped_loss,
        stats.upstream_to_client.dropped_loss,
        stats.client_to_upstream.dropped_partition + stats.upstream_to_client.dropped_partition,
        rss_peak >> 20,
        observed.len()
    );
    agent.kill9()?;
    Ok(())
}
