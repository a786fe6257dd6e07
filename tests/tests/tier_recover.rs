//! Catalog rebuild with real processes (issue 7, "Catalog rebuild"): a hub tiering to a local
//! tier-2 directory and 2 agents. Records are ingested through the agents; part of them reaches
//! tier 2 (chunks of 3,000 records, no age limit, so the tail stays in tier 1 only). The hub is
//! `kill -9`ed, its data directory deleted (tier 2 kept), `core-hub recover --from-tier2` run,
//! and the hub started again. The agents reconnect and re-ship what tier 2 lacked (their
//! retention keys on `tiered_seq`, so they still hold it); more records are ingested after the
//! rebuild. Then the ledger checker must find every acknowledged record exactly once, in order
//! per key, through the API, and DuckDB must see the same records exactly once in tier 2.
//!
//! `TRIBUTARY_KEEP=1` keeps the scratch directory with every process's log.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::wait_until;
use tributary_tests::tier2;

const STREAM: &str = "telemetry";
const TIMEOUT: Duration = Duration::from_secs(60);

/// Posts records `from..to` of `device` in batches of 500; every batch must be acknowledged
/// (nothing is killed while producing here), a 503 is retried.
fn post(ledger: &mut Ledger, device: &str, addr: SocketAddr, from: u64, to: u64) -> Result<()> {
    let producer = Producer::new(device, addr);
    let mut next = from;
    while next < to {
        let end = (next + 500).min(to);
        let batch: Vec<SentRecord> = (next..end)
            .map(|id| {
                SentRecord::new(
                    format!("k{}", id % 8),
                    1_700_000_000_000_000_000 + id as i64,
                    json!({ "i": id, "v": (id * 7) % 1000 }),
                )
            })
            .collect();
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match producer.post(ledger, STREAM, &batch, None)? {
                PostOutcome::Acked(_) => break,
                PostOutcome::Rejected { status: 503, .. } if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => bail!("{device}: batch {next}..{end} not acknowledged: {other:?}"),
            }
        }
        next = end;
    }
    Ok(())
}

#[test]
fn data_dir_lost_rebuild_from_tier2_and_reship() -> Result<()> {
    let started = Instant::now();
    let (_scratch, root) = tier2::scratch_dir("trb-recover-")?;
    let root = root.as_path();
    let pki = Pki::init(root.join("pki"))?;
    let tier2_dir = root.join("tier2");
    let tier2_toml = |age: &str| {
        format!(
            "[tier2]\nurl = \"file://{}\"\nchunk_records_max = 3000\nchunk_age_max = \"{age}\"\n\
             poll_interval = \"100ms\"\n",
            tier2_dir.display()
        )
    };
    let mut hub_spec = HubSpec::new(root);
    hub_spec.extra_toml = tier2_toml("1h");
    let catalog = hub_spec.data_dir.join("catalog.sqlite");
    let mut hub = hub_spec.start(&pki)?;
    let mut specs = Vec::new();
    let mut agents = Vec::new();
    for i in 0..2 {
        let device = format!("dev-{i}");
        let cert = pki.issue(&device, None)?;
        let spec = AgentSpec::new(root, &device, cert, Some(hub_spec.quic));
        agents.push(spec.start()?);
        specs.push(spec);
    }
    let mut ledgers: Vec<Ledger> = (0..2).map(|_| Ledger::new()).collect();

    // Phase 1: most of it reaches tier 2.
    for (spec, ledger) in specs.iter().zip(&mut ledgers) {
        post(ledger, &spec.cert.id, spec.http, 0, 8_000)?;
    }
    for spec in &specs {
        cluster::wait_caught_up(spec.http, TIMEOUT)?;
    }
    let mut last = tier2::TierProgress::default();
    wait_until(
        TIMEOUT,
        "part of the stream to be tiered",
        || match tier2::tier_progress(&catalog, STREAM) {
            Ok(p) => {
                last = p;
                p.next_offset >= 16_000 && p.tiered_end >= 9_000 && p.open_chunks == 0
            }
            Err(_) => false,
        },
    )
    .with_context(|| format!("last tier progress {last:?}"))?;
    // Phase 2: a little more, which stays in tier 1 (the chunk is not full, no age limit).
    for (spec, ledger) in specs.iter().zip(&mut ledgers) {
        post(ledger, &spec.cert.id, spec.http, 8_000, 8_700)?;
    }
    for spec in &specs {
        cluster::wait_caught_up(spec.http, TIMEOUT)?;
    }
    // Tiering settles first: a round still uploading a full range when the disk is lost would
    // leave an object the catalog never committed, which is not what this test is about.
    let mut settled = (tier2::TierProgress::default(), Instant::now());
    wait_until(TIMEOUT, "tiering to settle before the loss", || {
        let Ok(p) = tier2::tier_progress(&catalog, STREAM) else {
            return false;
        };
        if p != settled.0 {
            settled = (p, Instant::now());
        }
        p.open_chunks == 0
            && p.planned_end == p.tiered_end
            && settled.1.elapsed() >= Duration::from_secs(1)
    })
    .with_context(|| format!("last tier progress {:?}", settled.0))?;

    // The disk is lost.
    hub.kill9()?;
    let lost = tier2::tier_progress(&catalog, STREAM)?;
    ensure!(
        lost.tiered_end < lost.next_offset,
        "everything was tiered before the loss, the test proves nothing: {lost:?}"
    );
    let before = tier2::parquet_ids(&tier2_dir, STREAM)?;
    ensure!(
        before.rows == lost.tiered_end && before.distinct == before.rows,
        "tier 2 before the loss: {} rows, {} distinct, catalog {lost:?}",
        before.rows,
        before.distinct
    );
    std::fs::remove_dir_all(&hub_spec.data_dir)?;
    let out = cluster::core_hub(&[
        "recover",
        "--from-tier2",
        "--config",
        hub_spec.config.to_str().context("config path")?,
    ])?;
    println!("recover: {}", out.trim());
    let rebuilt = tier2::tier_progress(&catalog, STREAM)?;
    ensure!(
        rebuilt.next_offset == lost.tiered_end && rebuilt.tiered_end == lost.tiered_end,
        "the rebuilt catalog {rebuilt:?} does not match what tier 2 held ({lost:?})"
    );

    // Started again, now with an age limit so that everything reaches tier 2 for the check.
    hub_spec.extra_toml = tier2_toml("1s");
    let hub = hub_spec.start(&pki)?;
    for (spec, agent) in specs.iter().zip(&mut agents) {
        cluster::wait_caught_up(spec.http, TIMEOUT)
            .with_context(|| format!("{} did not re-ship\n{}", spec.name, agent.log_tail(30)))?;
    }
    // Phase 3: ingest goes on after the rebuild.
    for (spec, ledger) in specs.iter().zip(&mut ledgers) {
        post(ledger, &spec.cert.id, spec.http, 8_700, 9_000)?;
    }
    for spec in &specs {
        cluster::wait_caught_up(spec.http, TIMEOUT)?;
    }
    let acked: usize = ledgers.iter().map(Ledger::acked_len).sum();
    let done = tier2::wait_tiered(&catalog, STREAM, acked as u64, TIMEOUT)
        .with_context(|| format!("tier 2 did not catch up\n{}", hub.log_tail(30)))?;

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let mut failures = Vec::new();
    for (spec, ledger) in specs.iter().zip(&ledgers) {
        let mine = observed
            .iter()
            .filter(|r| r.device == spec.cert.id)
            .cloned();
        let report = ledger.check(mine);
        if !report.is_ok() {
            failures.push(format!("{}: {}", spec.cert.id, report.summary()));
        }
    }
    let parquet = tier2::parquet_ids(&tier2_dir, STREAM)?;
    let api_ids: BTreeSet<(String, u64, u64)> = observed
        .iter()
        .map(|r| (r.device.clone(), r.epoch, r.seq))
        .collect();
    if parquet.rows != parquet.distinct {
        failures.push(format!(
            "tier 2: {} rows, {} distinct (device, epoch, seq)",
            parquet.rows, parquet.distinct
        ));
    }
    if parquet.ids != api_ids || parquet.rows != observed.len() as u64 {
        failures.push(format!(
            "tier 2 has {} rows, the API {} records; {} only in tier 2, {} only in the API",
            parquet.rows,
            observed.len(),
            parquet.ids.difference(&api_ids).count(),
            api_ids.difference(&parquet.ids).count()
        ));
    }
    println!(
        "tier_recover: {acked} acknowledged; lost with the disk {lost:?} (tier 2 held {} rows); \
         rebuilt {rebuilt:?}; at the end {} through the API, {} rows in tier 2 ({done:?}); {:.1?}",
        before.rows,
        observed.len(),
        parquet.rows,
        started.elapsed()
    );
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}
