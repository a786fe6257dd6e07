//! Backlog drain throughput on a lossy, long link (issue 4, "Network faults": "5% loss, with
//! 50 ms delay. Throughput stays at or above 50% of the same link without loss").
//!
//! The real hub and two real agents talk through the userspace UDP proxy. Each leg preloads the
//! same backlog (40 000 records) into its own agent while the proxy is partitioned, then heals
//! the link and times the drain until the agent is caught up (acked == durable, no backlog):
//!
//! - leg A: 50 ms one-way delay each way, no loss;
//! - leg B: 50 ms one-way delay and 5% loss, each way.
//!
//! Throughput B / throughput A must be at least 0.5: with quinn's default loss-based controller
//! (Cubic) leg B took about 14 s against 0.9 s (ratio 0.06), which is why both ends run BBR
//! (`edge-agent` `link::transport_config`, `core-hub` `server::transport_config`). The proxy's counters prove leg B
//! really lost packets, and the ledger checks every record landed exactly once.
//!
//! The asserted throughput runs from the replication session being up to caught up, so a lost
//! handshake packet (a one-second probe timeout on a fresh path) does not count as throughput;
//! the time from the heal is printed too. The proxy's loss pattern is seeded (42, or
//! `TRIBUTARY_LOSSY_SEED`), so a run can be reproduced.
//!
//! The agent is restarted at the heal, so both legs start the drain from a fresh connection:
//! otherwise the drain would start whenever the agent's jittered reconnect backoff (up to 30 s)
//! or the QUIC probe backoff of the stalled connection fired, which dwarfs a one-second drain.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::netem::{Direction, Impairment, ProxyConfig, ProxyHandle, UdpImpairProxy};
use tributary_tests::procs::wait_until;

const STREAM: &str = "telemetry";
// Large enough that the drain spans many round trips, so one unlucky tail loss cannot decide the ratio.
const BACKLOG: u64 = 120_000;
const DELAY: Duration = Duration::from_millis(50);
const LOSS: f64 = 0.05;
/// A generous bound on one drain; the lossless one takes about a second.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(90);

fn records(tag: &str, n: u64) -> Vec<SentRecord> {
    (0..n)
        .map(|i| {
            // Pseudo-random padding that compresses poorly, so the drain moves real bytes.
            let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
            let pad: String = (0..48)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    char::from(b'a' + (x % 26) as u8)
                })
                .collect();
            SentRecord::new(
                format!("k{}", i % 7),
                1_000 + i as i64,
                json!({ "tag": tag, "i": i, "pad": pad }),
            )
        })
        .collect()
}

/// What one leg measured.
struct Leg {
    /// From the replication session being up to the agent being caught up: the throughput.
    drain: Duration,
    /// From the heal (and agent restart) to caught up: handshake and session setup included.
    total: Duration,
    /// Datagrams the proxy forwarded edge-to-hub during the drain, and their bytes.
    bytes_up: u64,
    dropped_loss: u64,
}

/// Preloads `BACKLOG` records into a fresh agent behind the partitioned proxy, sets
/// `impairment` on both directions, heals, restarts the agent and times the drain.
fn leg(
    root: &std::path::Path,
    pki: &Pki,
    proxy: &ProxyHandle,
    ledger: &mut Ledger,
    device: &str,
    impairment: Impairment,
) -> Result<Leg> {
    proxy.partition(true);
    proxy.set(Direction::Both, impairment)?;
    let cert = pki.issue(device, None)?;
    let spec = AgentSpec::new(root, device, cert, Some(proxy.local_addr()));
    let mut agent = spec.start()?;
    let producer = Producer::new(device, spec.http);
    for chunk in records(device, BACKLOG).chunks(1_000) {
        match producer.post(ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("ingest not acknowledged: {other:?}"),
        }
    }
    let status = cluster::status(spec.http)?;
    ensure!(
        cluster::unacked(&status) + 1 >= BACKLOG && !cluster::caught_up(&status),
        "the backlog is not all unacknowledged behind the partition: {status}"
    );

    agent.kill9()?;
    let before = proxy.stats();
    proxy.partition(false);
    let healed = Instant::now();
    agent.restart()?;
    wait_until(DRAIN_TIMEOUT, "the replication session to come up", || {
        cluster::status(spec.http).is_ok_and(|s| cluster::link(&s) == "up")
    })
    .with_context(|| agent.log_tail(30))?;
    let up = Instant::now();
    let caught_up = wait_until(DRAIN_TIMEOUT, "the agent to drain its backlog", || {
        cluster::status(spec.http).is_ok_and(|s| cluster::caught_up(&s))
    });
    let drain = up.elapsed();
    let total = healed.elapsed();
    caught_up.with_context(|| agent.log_tail(30))?;
    let after = proxy.stats();
    agent.kill9()?;
    Ok(Leg {
        drain,
        total,
        bytes_up: after.client_to_upstream.forwarded_bytes
            - before.client_to_upstream.forwarded_bytes,
        dropped_loss: (after.client_to_upstream.dropped_loss
            - before.client_to_upstream.dropped_loss)
            + (after.upstream_to_client.dropped_loss - before.upstream_to_client.dropped_loss),
    })
}

#[test]
fn five_percent_loss_keeps_half_the_lossless_throughput() -> Result<()> {
    let seed = match std::env::var("TRIBUTARY_LOSSY_SEED") {
        Ok(v) => v
            .parse()
            .context("TRIBUTARY_LOSSY_SEED must be an integer")?,
        Err(_) => 42,
    };
    let root = tempfile::Builder::new().prefix("trb-lossy-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let mut hub = hub_spec.start(&pki)?;
    let mut cfg = ProxyConfig::new(hub_spec.quic);
    cfg.seed = seed;
    let proxy = UdpImpairProxy::start(cfg)?;
    let mut ledger = Ledger::new();

    let clean = Impairment {
        delay: DELAY,
        ..Impairment::none()
    };
    let a = leg(root.path(), &pki, &proxy, &mut ledger, "dev-a", clean)
        .with_context(|| hub.log_tail(20))?;
    let lossy = Impairment {
        delay: DELAY,
        loss: LOSS,
        ..Impairment::none()
    };
    let b = leg(root.path(), &pki, &proxy, &mut ledger, "dev-b", lossy)
        .with_context(|| hub.log_tail(20))?;

    let rate = |leg: &Leg| BACKLOG as f64 / leg.drain.as_secs_f64();
    let ratio = rate(&b) / rate(&a);
    let total_ratio = a.total.as_secs_f64() / b.total.as_secs_f64();
    println!(
        "lossy drain of {BACKLOG} records, {DELAY:?} one-way delay: \
         leg A (no loss) drain {:.2?} ({:.0} rec/s, {:.2} MB up, {:.2?} from heal); \
         leg B ({:.0}% loss) drain {:.2?} ({:.0} rec/s, {:.2} MB up, {:.2?} from heal, \
         {} datagrams lost); throughput ratio B/A {ratio:.2} (from heal {total_ratio:.2}); seed {seed}",
        a.drain,
        rate(&a),
        a.bytes_up as f64 / 1e6,
        a.total,
        LOSS * 100.0,
        b.drain,
        rate(&b),
        b.bytes_up as f64 / 1e6,
        b.total,
        b.dropped_loss,
    );
    assert_eq!(a.dropped_loss, 0, "leg A must be lossless");
    assert!(
        b.dropped_loss > 0,
        "the proxy lost nothing in leg B: {:?}",
        proxy.stats()
    );
    assert!(
        ratio >= 0.5,
        "throughput with 5% loss is {ratio:.2} of the lossless link (required >= 0.5)"
    );

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let report = ledger.check(observed.iter().cloned());
    assert!(report.is_ok(), "{}", report.summary());
    assert_eq!(observed.len() as u64, 2 * BACKLOG);
    hub.kill9()?;
    Ok(())
}
