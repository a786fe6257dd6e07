//! Kill schedules shared by the crash tests (`replication_kill`, `crash_loop`): the seed and soak
//! switches, paced producers that keep a ledger through agent kills, and the check of whether a
//! kill lands mid-transfer.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::cluster::{self, AgentSpec};
use crate::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use crate::procs::{Proc, wait_until};

/// `TRIBUTARY_SOAK=1`: the long variants.
pub fn soak() -> bool {
    std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1")
}

/// `TRIBUTARY_SEED`, or one taken from the clock (tests print it so a run can be replayed).
pub fn seed() -> u64 {
    std::env::var("TRIBUTARY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// What a kill hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Hub,
    Agent(usize),
}

/// One producer thread: posts paced batches of 500 to 1000 records to `stream` until `quota`
/// records were acknowledged or left unknown, spread over about `over`; waits for a killed
/// agent to come back.
pub fn produce(
    device: String,
    addr: SocketAddr,
    stream: &str,
    quota: usize,
    over: Duration,
    seed: u64,
) -> Result<Ledger> {
    let mut ledger = Ledger::new();
    let producer = Producer::new(&device, addr);
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let mut posted = 0usize;
    let mut next = 0u64;
    while posted < quota {
        // Pacing keeps data flowing for the whole kill schedule instead of a burst at the start.
        let due = (quota as f64 * started.elapsed().as_secs_f64() / over.as_secs_f64()) as usize;
        if posted > due {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let n = rng.random_range(500..=1000).min(quota - posted);
        let batch: Vec<SentRecord> = (0..n as u64)
            .map(|i| {
                let id = next + i;
                SentRecord::new(
                    format!("k{}", id % 16),
                    1_700_000_000_000_000_000 + id as i64,
                    json!({ "i": id, "dev": device, "v": (id * 7) % 1000 }),
                )
            })
            .collect();
        next += n as u64;
        match producer.post(&mut ledger, stream, &batch, None)? {
            PostOutcome::Acked(_) => posted += n,
            PostOutcome::Unknown { .. } => {
                // The agent was probably killed mid-request: the batch may or may not exist.
                posted += n;
                wait_until(
                    Duration::from_secs(60),
                    "the agent to accept requests again",
                    || cluster::status(addr).is_ok(),
                )?;
            }
            PostOutcome::Rejected { status, body } => {
                if status != 503 {
                    bail!("{device}: ingest rejected with {status}: {body}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Ok(ledger)
}

/// Whether a kill of `target` right now lands mid-transfer: an established session had records
/// durable at the edge but not yet acknowledged by the hub (on that agent for an agent kill, on
/// any agent for a hub kill).
pub fn mid_transfer(target: Target, agents: &[AgentSpec]) -> bool {
    let busy = |spec: &AgentSpec| {
        cluster::status(spec.http)
            .map(|s| cluster::link(&s) == "up" && cluster::unacked(&s) > 0)
            .unwrap_or(false)
    };
    match target {
        Target::Hub => agents.iter().any(busy),
        Target::Agent(i) => busy(&agents[i]),
    }
}

/// Fails with the process's log tail if it exited by itself.
pub fn ensure_running(proc: &mut Proc) -> Result<()> {
    if !proc.is_running() {
        bail!("{} died on its own\n{}", proc.name(), proc.log_tail(40));
    }
    Ok(())
}
