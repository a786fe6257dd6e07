//! Power loss under the real `core-hub`: its data directory, with tier 2 as a local directory
//! inside it (`file://<data_dir>/tier2`), is on the fault filesystem
//! (`tributary_tests::faultfs`); an agent on a normal disk ships to it while a producer posts
//! to the agent; tiering is aggressive (small chunks, 1 s chunk age, 2 s tier-1 retention), so
//! uploads, commits and evictions run all the time. The hub's power is cut at random moments
//! (unsynced writes dropped, the last write torn, zeros for unsynced appends, or later writes
//! kept without earlier ones), the hub is killed, the filesystem comes back with what survived
//! and the hub restarts; the agent is restarted cleanly with it, so it reconnects at once.
//!
//! At the end the agent must catch up and tier 2 must catch up; then the power is cut once more,
//! with everything tiered and evicted, and after the restart:
//! - every record acknowledged to the producer is readable from the hub exactly once, with its
//!   content (the ledger checker, through the HTTP API, which reads evicted ranges from tier 2);
//! - every Parquet file under `tier2/streams/` is readable by DuckDB, and together they hold
//!   each record the API shows exactly once.
//!
//! With `[tier2] table = "iceberg"` (`hub_with_iceberg_tables_survives_power_cuts`) the Iceberg
//! catalog (SQLite, in the data directory) and the tables' metadata are on the fault filesystem
//! too, with a commit every second and upkeep (snapshot expiry, orphan removal with no grace)
//! every two; at the end pyiceberg must read each record the API shows exactly once as well.
//!
//! 12 cuts by default (8 with Iceberg tables), 500 with `TRIBUTARY_SOAK=1`. The seed is printed; `TRIBUTARY_SEED=<n>`
//! replays the same cut moments and modes, and `TRIBUTARY_KEEP=1` keeps the directory with the
//! logs. The faults must have happened: the filesystem counts what each cut dropped, tore or
//! reordered (at least one cut must find unsynced state), and at least one cut must land while
//! committed records waited for tier 2 (every other cut waits up to 10 s for that). Cuts that
//! found the agent with records unacknowledged are counted too, for the record only: the hub
//! acknowledges within milliseconds, so that is rare on a fast machine.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tributary_tests::chaos::{Target, mid_transfer, produce, seed, soak};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::faultfs::{CutMode, FaultFs};
use tributary_tests::ledger::Ledger;
use tributary_tests::procs::{Proc, wait_until};
use tributary_tests::tier2;

const STREAM: &str = "telemetry";
/// How long after the last cut the agent gets to ship everything, and tier 2 to catch up.
const CATCH_UP: Duration = Duration::from_secs(120);
/// How long a cut waits for tiering to have work in hand before it lands anyway.
const PENDING_WAIT: Duration = Duration::from_secs(10);

/// What the cuts found when they landed.
#[derive(Debug, Default)]
struct Landed {
    /// Cuts that found unsynced state to lose.
    unsynced: u64,
    /// Cuts while the agent had records the hub had not acknowledged (reported, not required).
    mid_transfer: u64,
    /// Cuts while committed records waited for tier 2.
    tier_pending: u64,
}

/// How tier 2 presents the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    Parquet,
    Iceberg,
}

#[test]
fn hub_survives_power_cuts() -> Result<()> {
    power_cuts(Table::Parquet, 12)
}

#[test]
fn hub_with_iceberg_tables_survives_power_cuts() -> Result<()> {
    power_cuts(Table::Iceberg, 8)
}

fn power_cuts(table: Table, cuts: usize) -> Result<()> {
    let seed = seed();
    println!("power_loss_hub ({table:?}) seed {seed} (replay with TRIBUTARY_SEED={seed})");
    let (cuts, records) = if soak() {
        (500, 1_000_000)
    } else {
        (cuts, 5_000 * cuts)
    };
    run(seed, cuts, records, table).with_context(|| {
        format!(
            "seed {seed}: replay with TRIBUTARY_SEED={seed} cargo test -p tributary-tests \
             --test power_loss_hub"
        )
    })
}

/// Fields drop in order: the processes are killed before the filesystem under the hub unmounts.
struct Cluster {
    hub_spec: HubSpec,
    hub: Proc,
    agent_spec: AgentSpec,
    agent: Proc,
    catalog: std::path::PathBuf,
    tier2_dir: std::path::PathBuf,
    table: Table,
    fs: FaultFs,
}

/// The `[tier2]` keys of an Iceberg tier 2 under power cuts: frequent commits and upkeep.
const ICEBERG_TOML: &str = "table = \"iceberg\"\ncommit_interval = \"1s\"\n\
     snapshot_retention = \"10s\"\norphan_grace = \"0s\"\nmaintenance_interval = \"2s\"\n";

fn start(root: &Path, table: Table) -> Result<Cluster> {
    let fs = FaultFs::mount(root.join("mnt"))?;
    let pki = Pki::init(root.join("pki"))?;
    let mut hub_spec = HubSpec::new(root);
    hub_spec.data_dir = fs.path().join("hub-data");
    let tier2_dir = hub_spec.data_dir.join("tier2");
    std::fs::create_dir_all(&tier2_dir)?;
    for dir in [fs.path(), hub_spec.data_dir.as_path()] {
        std::fs::File::open(dir)?.sync_all()?;
    }
    hub_spec.extra_toml = format!(
        "[tier2]\nurl = \"file://{}\"\nchunk_records_max = 2000\nchunk_age_max = \"1s\"\n\
         poll_interval = \"100ms\"\ntier1_retention_time = \"2s\"\n{}",
        tier2_dir.display(),
        if table == Table::Iceberg {
            ICEBERG_TOML
        } else {
            ""
        }
    );
    let hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-0", None)?;
    let agent_spec = AgentSpec::new(root, "dev-0", cert, Some(hub_spec.quic));
    let agent = agent_spec.start()?;
    let catalog = hub_spec.data_dir.join("catalog.sqlite");
    Ok(Cluster {
        hub_spec,
        hub,
        agent_spec,
        agent,
        catalog,
        tier2_dir,
        table,
        fs,
    })
}

fn run(seed: u64, cuts: usize, records: usize, table: Table) -> Result<()> {
    let (_scratch, root) = tier2::scratch_dir("trb-powerloss-hub-")?;
    let mut c = start(&root, table)?;
    let started = Instant::now();
    let produce_over = Duration::from_millis(1_500 * cuts as u64);
    let (device, addr) = (c.agent_spec.cert.id.clone(), c.agent_spec.http);
    let producer =
        std::thread::spawn(move || produce(device, addr, STREAM, records, produce_over, seed));

    let mut rng = StdRng::seed_from_u64(seed);
    let mut landed = Landed::default();
    for cut in 0..cuts {
        std::thread::sleep(Duration::from_millis(rng.random_range(200..2_000)));
        if cut % 2 == 0 {
            // Every other cut waits for tiering to have work in hand, so the cuts land there
            // on any machine; the others land wherever the pause ended.
            let _ = wait_until(PENDING_WAIT, "committed records waiting for tier 2", || {
                tier2::tier_progress(&c.catalog, STREAM).is_ok_and(|p| p.pending())
            });
        }
        landed.mid_transfer += u64::from(mid_transfer(Target::Hub, &[c.agent_spec.clone()]));
        let pending = tier2::tier_progress(&c.catalog, STREAM).is_ok_and(|p| p.pending());
        landed.tier_pending += u64::from(pending);
        let mode = CutMode::ALL[rng.random_range(0..CutMode::ALL.len())];
        landed.unsynced += u64::from(power_cycle(&mut c, mode, &mut rng)? > 0);
    }
    let ledger = producer
        .join()
        .map_err(|_| anyhow::anyhow!("the producer panicked"))??;
    let cuts_done = started.elapsed();
    catch_up(&c)?;
    // Everything tiered and (after the retention) evicted from tier 1: now what tier 2 holds
    // must be durable, and what the hub acknowledged must survive one more cut.
    power_cycle(&mut c, CutMode::Drop, &mut rng)?;
    catch_up(&c)?;
    check(seed, &c, &ledger, &landed, cuts, cuts_done)
}

/// Cuts the hub's power, kills it, brings its filesystem back and restarts it; then restarts
/// the agent cleanly (SIGTERM), because a SIGKILLed hub closes no connection and the agent would
/// wait out its 30 s QUIC idle timeout before it reconnected. Returns the faults the cut applied.
fn power_cycle(c: &mut Cluster, mode: CutMode, rng: &mut StdRng) -> Result<u64> {
    let counts = c.fs.power_cut(mode, rng);
    c.hub.kill9()?;
    c.fs.restart()?;
    c.hub.restart()?;
    c.hub
        .wait_http_ok(c.hub_spec.http, "/healthz", cluster::START_TIMEOUT)
        .with_context(|| format!("the hub did not come back after a {mode:?} cut"))?;
    c.agent.terminate(cluster::START_TIMEOUT)?;
    c.agent.restart()?;
    c.agent
        .wait_http_ok(c.agent_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    Ok(counts.faults())
}

fn catch_up(c: &Cluster) -> Result<()> {
    cluster::wait_caught_up(c.agent_spec.http, CATCH_UP)
        .with_context(|| format!("the agent did not catch up\n{}", c.agent.log_tail(30)))?;
    tier2::wait_tiered(&c.catalog, STREAM, 1, CATCH_UP)
        .with_context(|| format!("tier 2 did not catch up\n{}", c.hub.log_tail(30)))?;
    Ok(())
}

fn check(
    seed: u64,
    c: &Cluster,
    ledger: &Ledger,
    landed: &Landed,
    cuts: usize,
    cuts_done: Duration,
) -> Result<()> {
    let observed = cluster::read_stream(c.hub_spec.http, STREAM)?;
    let mut failures = Vec::new();
    let report = ledger.check(observed.iter().cloned());
    if !report.is_ok() {
        failures.push(report.summary());
    }
    let api: std::collections::BTreeSet<(String, u64, u64)> = observed
        .iter()
        .map(|r| (r.device.clone(), r.epoch, r.seq))
        .collect();
    if c.table == Table::Iceberg {
        let lake = c.hub_spec.data_dir.join("iceberg.sqlite");
        match tier2::iceberg_ids(&lake, &c.tier2_dir, STREAM) {
            Ok(t) if t.rows != t.distinct || t.ids != api => failures.push(format!(
                "the Iceberg table holds {} rows, {} distinct; {} not at the API, {} missing",
                t.rows,
                t.distinct,
                t.ids.difference(&api).count(),
                api.difference(&t.ids).count()
            )),
            Ok(_) => {}
            Err(error) => failures.push(format!("pyiceberg cannot read the table: {error:#}")),
        }
    }
    match tier2::parquet_ids(&c.tier2_dir, STREAM) {
        Ok(parquet) => {
            if parquet.rows != parquet.distinct {
                failures.push(format!(
                    "tier 2 has {} rows but {} distinct (device, epoch, seq)",
                    parquet.rows, parquet.distinct
                ));
            }
            if parquet.ids != api {
                failures.push(format!(
                    "tier 2 and the API hold different records: {} only in tier 2, {} only in \
                     the API",
                    parquet.ids.difference(&api).count(),
                    api.difference(&parquet.ids).count()
                ));
            }
        }
        Err(error) => failures.push(format!("DuckDB cannot read tier 2: {error:#}")),
    }
    let counts = c.fs.counts();
    println!(
        "power_loss_hub: seed {seed}; {cuts} cuts (+1 at the end) in {cuts_done:.1?}: {landed:?}; \
         faults {counts:?}; {} records acknowledged, {} at the hub",
        ledger.acked_len(),
        observed.len()
    );
    if counts.faults() == 0 || landed.unsynced == 0 {
        failures.push("no power cut found unsynced state to lose".into());
    }
    if landed.tier_pending == 0 {
        failures.push("no cut landed while committed records waited for tier 2".into());
    }
    if ledger.acked_len() == 0 {
        failures.push("nothing was acknowledged".into());
    }
    if !failures.is_empty() {
        bail!("{}\n{}", failures.join("\n"), c.hub.log_tail(30));
    }
    Ok(())
}
