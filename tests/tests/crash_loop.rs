//! The crash loop (issue 9, section 2): a hub tiering to tier 2 (a local directory, small
//! chunks so uploads run all the time) and 3 agents as real processes on loopback, records
//! posted through the agents' ingest API, while a random process (the hub or an agent) is
//! `kill -9`ed at a random moment and restarted: 200 times, 2,000 under `TRIBUTARY_SOAK=1`.
//!
//! At the end every agent must catch up and tier 2 must catch up (`tiered_end == next_offset`
//! in the hub's catalog). Then the hub must hold exactly the acknowledged records, each once, in
//! order per key (the ledger checker, through the HTTP API, which reads evicted ranges back from
//! tier 2), and DuckDB over `<tier2>/streams/telemetry/**/*.parquet` must see every one of them
//! exactly once: row count == distinct `(device, epoch, seq)` == the records the API shows, and
//! the same id set.
//!
//! The kill moments are seeded: the seed is printed, and `TRIBUTARY_SEED=<n>` replays the same
//! schedule (the processes' own timing still varies); `TRIBUTARY_KEEP=1` keeps the directory
//! with every process's log.
//!
//! The faults must have landed, or the test fails:
//! - "mid-transfer" (as in `replication_kill`): an established session had records durable at
//!   the edge but not acknowledged by the hub, on the killed agent or (hub kill) on any agent;
//! - "mid-upload": a hub kill that left the catalog with chunk rows planned but not committed
//!   (the kill landed between plan and commit, an upload in flight), and "tiering pending": a
//!   hub kill that left committed records not yet in tier 2. Read from the catalog of the dead
//!   hub, before its restart.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tributary_tests::chaos::{Target, ensure_running, mid_transfer, produce, seed, soak};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::tier2;

const AGENTS: usize = 3;
const STREAM: &str = "telemetry";
/// Producers spread their records over about this long, so the kills land while data flows.
const PRODUCE_OVER: Duration = Duration::from_secs(40);
/// How long after the last kill the agents get to ship everything, and tier 2 to catch up.
const CATCH_UP: Duration = Duration::from_secs(120);

#[test]
fn crash_loop_while_ingesting_and_tiering() -> Result<()> {
    let seed = seed();
    println!("crash_loop seed {seed} (replay with TRIBUTARY_SEED={seed})");
    let kills_total = if soak() { 2_000 } else { 200 };
    let records_total = if soak() { 600_000 } else { 150_000 };

    let (_scratch, root) = tier2::scratch_dir("trb-crash-")?;
    let root = root.as_path();
    let pki = Pki::init(root.join("pki"))?;
    let tier2_dir = root.join("tier2");
    let mut hub_spec = HubSpec::new(root);
    // Small chunks and a short age so uploads run during the whole loop; a short tier-1
    // retention so eviction runs too and the API reads old ranges back through tier 2.
    hub_spec.extra_toml = format!(
        "[tier2]\nurl = \"file://{}\"\nchunk_records_max = 2000\nchunk_age_max = \"1s\"\n\
         poll_interval = \"100ms\"\ntier1_retention_time = \"2s\"\n",
        tier2_dir.display()
    );
    let catalog = hub_spec.data_dir.join("catalog.sqlite");
    // The upload-to-commit step is held open for 200 ms (a test-only fault point that only
    // delays), so that random hub kills land between upload and commit, not only around it.
    let mut hub = tier2::start_hub_with_env(
        &hub_spec,
        &pki,
        &[(tier2::TIER_FAULT_ENV, "after_upload:delay:200")],
    )?;
    let mut agent_specs = Vec::new();
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let device = format!("dev-{i}");
        let cert = pki.issue(&device, None)?;
        let spec = AgentSpec::new(root, &device, cert, Some(hub_spec.quic));
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

    // Hub and agents equally likely: a quarter of the kills each.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut schedule: Vec<Target> = (0..kills_total)
        .map(|i| match i % (AGENTS + 1) {
            0 => Target::Hub,
            a => Target::Agent(a - 1),
        })
        .collect();
    schedule.shuffle(&mut rng);
    let pause_max_ms = (2 * PRODUCE_OVER.as_millis() as u64 / schedule.len() as u64).max(10);
    let (mut mid, mut mid_hub, mut hub_kills) = (0usize, 0usize, 0usize);
    let (mut mid_upload, mut tier_pending) = (0usize, 0usize);
    for target in &schedule {
        std::thread::sleep(Duration::from_millis(rng.random_range(0..pause_max_ms)));
        ensure_running(&mut hub)?;
        let landed = mid_transfer(*target, &agent_specs);
        match *target {
            Target::Hub => {
                hub.kill9()?;
                hub_kills += 1;
                // The catalog as the kill left it: chunk rows planned but not committed mean
                // the kill landed between plan and commit (an upload in flight); committed
                // records above `tiered_end` mean tiering was pending.
                let progress = tier2::tier_progress(&catalog, STREAM).ok();
                mid_hub += usize::from(landed);
                if let Some(p) = progress {
                    mid_upload += usize::from(p.uploading());
                    tier_pending += usize::from(p.pending());
                }
                hub.restart()?;
                hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
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
    // Printed now as well, so a run that fails later still shows where its kills landed.
    println!(
        "crash_loop: {} kills ({hub_kills} hub) in {kills_done:.1?}: {mid} mid-transfer ({mid_hub} \
         hub), {mid_upload} hub kills mid-upload, {tier_pending} with tiering pending",
        schedule.len()
    );

    // Every check runs and every failure is reported together, so one run shows all of what
    // broke (a producer stops at the first inconsistent acknowledgement it sees).
    let mut failures: Vec<String> = Vec::new();
    let mut ledgers = Vec::new();
    for (i, producer) in producers.into_iter().enumerate() {
        match producer.join() {
            Ok(Ok(ledger)) => ledgers.push(Some(ledger)),
            Ok(Err(e)) => {
                failures.push(format!("producer {i}: {e:#}"));
                ledgers.push(None);
            }
            Err(_) => bail!("producer {i} panicked"),
        }
    }
    let produced = started.elapsed();

    for (spec, agent) in agent_specs.iter().zip(&mut agents) {
        ensure_running(agent)?;
        cluster::wait_caught_up(spec.http, CATCH_UP)
            .with_context(|| format!("{} did not catch up\n{}", spec.name, agent.log_tail(30)))?;
    }
    ensure_running(&mut hub)?;
    let caught_up = started.elapsed();
    let progress = tier2::wait_tiered(&catalog, STREAM, 1, CATCH_UP)
        .with_context(|| format!("tier 2 did not catch up\n{}", hub.log_tail(30)))?;
    let tiered = started.elapsed();

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let mut acked = 0;
    let mut maybe = 0;
    for (spec, ledger) in agent_specs.iter().zip(&ledgers) {
        let Some(ledger) = ledger else { continue };
        acked += ledger.acked_len();
        maybe += ledger.maybe_len();
        let mine = observed
            .iter()
            .filter(|r| r.device == spec.cert.id)
            .cloned();
        let report = ledger.check(mine);
        if !report.is_ok() {
            failures.push(format!("{}: {}", spec.cert.id, report.summary()));
        }
    }
    let strangers = observed
        .iter()
        .filter(|r| !agent_specs.iter().any(|s| s.cert.id == r.device))
        .count();
    if strangers > 0 {
        failures.push(format!(
            "{strangers} records from devices that never sent any"
        ));
    }
    if progress.next_offset != observed.len() as u64 {
        failures.push(format!(
            "the API shows {} records, the catalog's next offset is {}",
            observed.len(),
            progress.next_offset
        ));
    }

    // Tier 2 as DuckDB sees it: every record once, the same records as the API.
    let parquet = tier2::parquet_ids(&tier2_dir, STREAM)?;
    if parquet.rows != parquet.distinct {
        failures.push(format!(
            "tier 2 has {} rows but {} distinct (device, epoch, seq)",
            parquet.rows, parquet.distinct
        ));
    }
    if parquet.rows != observed.len() as u64 {
        failures.push(format!(
            "tier 2 has {} rows, the API shows {} records (all tiered: {progress:?})",
            parquet.rows,
            observed.len()
        ));
    }
    let api_ids: std::collections::BTreeSet<(String, u64, u64)> = observed
        .iter()
        .map(|r| (r.device.clone(), r.epoch, r.seq))
        .collect();
    if parquet.ids != api_ids {
        failures.push(format!(
            "tier 2 and the API hold different records: {} only in tier 2, {} only in the API",
            parquet.ids.difference(&api_ids).count(),
            api_ids.difference(&parquet.ids).count()
        ));
    }

    println!(
        "crash_loop: seed {seed}; {} kills ({hub_kills} hub, the rest agents), {mid} mid-transfer \
         ({mid_hub} of them hub kills), {mid_upload} hub kills mid-upload, {tier_pending} with \
         tiering pending; {acked} records acknowledged, {maybe} unknown (producers that finished), \
         {} at the hub, {} rows in tier 2 ({progress:?}); kills done at {kills_done:.1?}, \
         producers at {produced:.1?}, caught up at {caught_up:.1?}, tiered at {tiered:.1?}",
        schedule.len(),
        observed.len(),
        parquet.rows,
    );
    if mid == 0 {
        failures.push("no kill landed mid-transfer".into());
    }
    if tier_pending == 0 {
        failures.push("no hub kill landed with tiering pending".into());
    }
    if mid_upload == 0 {
        failures.push("no hub kill landed mid-upload".into());
    }
    if ledgers.iter().all(Option::is_some) && acked < records_total / 2 {
        failures.push(format!("only {acked} records were acknowledged"));
    }
    if !failures.is_empty() {
        bail!("seed {seed}:\n{}", failures.join("\n"));
    }
    Ok(())
}
