//! Backlog drains over a lossy, long link: the real hub and a real agent talk through the
//! userspace UDP impairment proxy ([`crate::netem`]). Shared by the exactly-once test
//! (`tests/replication_lossy.rs`) and the throughput benchmark (`benches/lossy.rs`), so the
//! figure the benchmark reports comes from the same drain the test checks record by record.
//!
//! One [`leg`] preloads a backlog into a fresh agent while the proxy is partitioned, sets the
//! impairment on both directions, heals the link, restarts the agent (so the drain starts from
//! a fresh connection, not whenever a jittered reconnect backoff fires) and waits until the
//! agent is caught up (acked == durable, no backlog).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;

use crate::cluster::{self, AgentSpec, HubSpec, Pki};
use crate::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use crate::netem::{Direction, Impairment, ProxyConfig, ProxyHandle, UdpImpairProxy};
use crate::procs::{Proc, wait_until};

/// The stream every leg writes.
pub const STREAM: &str = "telemetry";
/// One-way delay of both legs.
pub const DELAY: Duration = Duration::from_millis(50);
/// Loss rate, each way, of the lossy leg.
pub const LOSS: f64 = 0.05;
/// A generous bound on one drain, so a stalled link fails instead of hanging; the lossless
/// drain of 120,000 records takes about a second.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(90);

/// What one leg measured.
#[derive(Debug, Clone)]
pub struct Leg {
    /// Records drained.
    pub records: u64,
    /// From the replication session being up to the agent being caught up: the throughput.
    /// A lost handshake packet (a one-second probe timeout on a fresh path) is not in it.
    pub drain: Duration,
    /// From the heal (and agent restart) to caught up: handshake and session setup included.
    pub total: Duration,
    /// Bytes the proxy forwarded edge-to-hub during the drain.
    pub bytes_up: u64,
    /// Datagrams the proxy dropped for loss, both directions, during the drain.
    pub dropped_loss: u64,
}

impl Leg {
    /// Drain throughput in records per second.
    pub fn rate(&self) -> f64 {
        self.records as f64 / self.drain.as_secs_f64()
    }
}

/// A hub under `root` and the impairment proxy in front of its QUIC port, its loss pattern
/// seeded with `seed`: what every leg runs against.
pub struct Link {
    pub pki: Pki,
    pub hub_spec: HubSpec,
    pub hub: Proc,
    pub proxy: ProxyHandle,
}

impl Link {
    pub fn start(root: &Path, seed: u64) -> Result<Link> {
        let pki = Pki::init(root.join("pki"))?;
        let hub_spec = HubSpec::new(root);
        let hub = hub_spec.start(&pki)?;
        let mut cfg = ProxyConfig::new(hub_spec.quic);
        cfg.seed = seed;
        let proxy = UdpImpairProxy::start(cfg)?;
        Ok(Link {
            pki,
            hub_spec,
            hub,
            proxy,
        })
    }
}

/// The lossless impairment: only the delay.
pub fn clean() -> Impairment {
    Impairment {
        delay: DELAY,
        ..Impairment::none()
    }
}

/// The lossy impairment: the delay and `LOSS` each way.
pub fn lossy() -> Impairment {
    Impairment {
        delay: DELAY,
        loss: LOSS,
        ..Impairment::none()
    }
}

/// `n` records tagged `tag`, over 7 keys, with pseudo-random padding that compresses poorly,
/// so the drain moves real bytes.
pub fn records(tag: &str, n: u64) -> Vec<SentRecord> {
    (0..n)
        .map(|i| {
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

/// Preloads `backlog` records into a fresh agent `device` behind the partitioned proxy, sets
/// `impairment` on both directions, heals, restarts the agent and times the drain. Every
/// record posted is entered in `ledger`.
pub fn leg(
    root: &Path,
    pki: &Pki,
    proxy: &ProxyHandle,
    ledger: &mut Ledger,
    device: &str,
    backlog: u64,
    impairment: Impairment,
) -> Result<Leg> {
    proxy.partition(true);
    proxy.set(Direction::Both, impairment)?;
    let cert = pki.issue(device, None)?;
    let spec = AgentSpec::new(root, device, cert, Some(proxy.local_addr()));
    let mut agent = spec.start()?;
    let producer = Producer::new(device, spec.http);
    for chunk in records(device, backlog).chunks(1_000) {
        match producer.post(ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => bail!("ingest not acknowledged: {other:?}"),
        }
    }
    let status = cluster::status(spec.http)?;
    ensure!(
        cluster::unacked(&status) + 1 >= backlog && !cluster::caught_up(&status),
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
        records: backlog,
        drain,
        total,
        bytes_up: after.client_to_upstream.forwarded_bytes
            - before.client_to_upstream.forwarded_bytes,
        dropped_loss: (after.client_to_upstream.dropped_loss
            - before.client_to_upstream.dropped_loss)
            + (after.upstream_to_client.dropped_loss - before.upstream_to_client.dropped_loss),
    })
}
