//! `kill -9` at random moments: a hub and 3 agents as real processes on loopback, 300k records
//! posted through the agents' ingest API, while the hub is SIGKILLed 20 times and each agent 20
//! times (and restarted each time). At the end every agent must catch up, and the hub must hold
//! exactly the acknowledged records, each once, in order per key (the ledger checker).
//!
//! The kill moments are seeded: the seed is printed, and `TRIBUTARY_SEED=<n>` replays the same
//! schedule (the processes' own timing still varies). `TRIBUTARY_SOAK=1` multiplies the kills by
//! 5 and the records by 4.
//!
//! A kill counts as "mid-transfer" when, just before the signal, an established session
//! (`link == "up"`) had records durable at the edge but not yet acknowledged by the hub
//! (`durable_seq > acked_seq`): for an agent kill, on that agent; for a hub kill, on any agent.
//! Those records are in flight or being committed, which is the window where a crash could lose
//! or duplicate them. The test fails if no kill landed there.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tributary_tests::chaos::{Target, ensure_running, mid_transfer, produce, seed, soak};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};

const AGENTS: usize = 3;
const STREAM: &str = "telemetry";
/// Producers spread their records over about this long, so the kills land while data flows.
const PRODUCE_OVER: Duration = Duration::from_secs(25);
/// How long after the last kill the agents get to ship everything.
const CATCH_UP: Duration = Duration::from_secs(120);

#[test]
fn kill9_hub_and_agents_keeps_exactly_once() -> Result<()> {
    let seed = seed();
    println!("replication_kill seed {seed} (replay with TRIBUTARY_SEED={seed})");
    let scale = if soak() { 5 } else { 1 };
    let records_total = 300_000 * if soak() { 4 } else { 1 };
    let kills_hub = 20 * scale;
    let kills_per_agent = 20 * scale;

    let root = tempfile::Builder::new().prefix("trb-kill-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let mut hub = hub_spec.start(&pki)?;
    let mut agent_specs = Vec::new();
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let device = format!("dev-{i}");
        let cert = pki.issue(&device, None)?;
        let spec = AgentSpec::new(root.path(), &device, cert, Some(hub_spec.quic));
        agents.push(spec.start()?);
        agent_specs.push(spec);
    }

    let started = Instant::now();
    let producers: Vec<_> = agent_specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let device = spec.cert.id.clone();
            let addr = spec.http;
            let quota = records_total / AGENTS;
            let producer_seed = seed ^ (i as u64 + 1);
            std::thread::spawn(move || {
                produce(device, addr, STREAM, quota, PRODUCE_OVER, producer_seed)
            })
        })
        .collect();

    let mut rng = StdRng::seed_from_u64(seed);
    let mut schedule: Vec<Target> = std::iter::repeat_n(Target::Hub, kills_hub)
        .chain((0..AGENTS).flat_map(|i| std::iter::repeat_n(Target::Agent(i), kills_per_agent)))
        .collect();
    schedule.shuffle(&mut rng);
    // Spread the kills over the production window: the mean pause is the window divided by the
    // kills, minus roughly what a restart takes.
    let pause_max_ms = (2 * PRODUCE_OVER.as_millis() as u64 / schedule.len() as u64).max(20);
    let mut mid = 0usize;
    let mut mid_hub = 0usize;
    for target in &schedule {
        std::thread::sleep(Duration::from_millis(rng.random_range(0..pause_max_ms)));
        ensure_running(&mut hub)?;
        let landed = mid_transfer(*target, &agent_specs);
        match *target {
            Target::Hub => {
                hub.kill9()?;
                hub.restart()?;
                hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
                mid_hub += usize::from(landed);
            }
            Target::Agent(i) => {
                let agent = &mut agents[i];
                ensure_running(agent)?;
                agent.kill9()?;
                agent.restart()?;
                agent.wait_http_ok(agent_specs[i].http, "/healthz", cluster::START_TIMEOUT)?;
            }
        }
        mid += usize::from(landed);
    }
    let kills_done = started.elapsed();

    let mut ledgers = Vec::new();
    for (i, producer) in producers.into_iter().enumerate() {
        let ledger = producer
            .join()
            .map_err(|_| anyhow::anyhow!("producer {i} panicked"))?
            .with_context(|| format!("producer {i}"))?;
        ledgers.push(ledger);
    }
    let produced = started.elapsed();

    for (spec, agent) in agent_specs.iter().zip(&mut agents) {
        ensure_running(agent)?;
        cluster::wait_caught_up(spec.http, CATCH_UP)
            .with_context(|| format!("{} did not catch up\n{}", spec.name, agent.log_tail(30)))?;
    }
    ensure_running(&mut hub)?;
    let caught_up = started.elapsed();

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let mut acked = 0;
    let mut maybe = 0;
    for (spec, ledger) in agent_specs.iter().zip(&ledgers) {
        acked += ledger.acked_len();
        maybe += ledger.maybe_len();
        let mine = observed
            .iter()
            .filter(|r| r.device == spec.cert.id)
            .cloned();
        let report = ledger.check(mine);
        assert!(report.is_ok(), "{}: {}", spec.cert.id, report.summary());
    }
    let strangers = observed
        .iter()
        .filter(|r| !agent_specs.iter().any(|s| s.cert.id == r.device))
        .count();
    assert_eq!(strangers, 0, "records from devices that never sent any");

    println!(
        "replication_kill: seed {seed}; {} kills ({kills_hub} hub, {kills_per_agent} per agent), \
         {mid} mid-transfer ({mid_hub} of them hub kills); {acked} records acknowledged, {maybe} \
         unknown, {} at the hub; kills done at {kills_done:.1?}, producers at {produced:.1?}, \
         caught up at {caught_up:.1?}",
        schedule.len(),
        observed.len(),
    );
    assert!(mid > 0, "no kill landed mid-transfer (seed {seed})");
    assert!(
        acked >= records_total / 2,
        "only {acked} records were acknowledged"
    );
    Ok(())
}
