//! A backlog drains exactly once over a lossy, long link: 50 ms one-way delay and 5% loss each
//! way, through the userspace UDP impairment proxy, between the real hub and a real agent
//! (`tributary_tests::lossy`).
//!
//! The test asserts what must hold, not how fast: the proxy really lost datagrams (counted),
//! the agent caught up within a generous bound, and the ledger finds every acknowledged
//! record at the hub exactly once. How the lossy drain's throughput compares with the same
//! link without loss (the BBR congestion controller at both ends keeps it at about the same
//! rate; quinn's default Cubic gave 0.06 of it) is a benchmark:
//! `cargo bench -p tributary-tests --bench lossy` (docs/benchmarks.md, "Lossy links").
//!
//! The proxy's loss pattern is seeded (42, or `TRIBUTARY_LOSSY_SEED`), so a run can be
//! reproduced.

use anyhow::{Context, Result};
use tributary_tests::cluster;
use tributary_tests::ledger::Ledger;
use tributary_tests::lossy::{self, STREAM};

/// Enough that the drain spans many round trips and many losses.
const BACKLOG: u64 = 60_000;

#[test]
fn backlog_drains_exactly_once_through_five_percent_loss() -> Result<()> {
    let seed = match std::env::var("TRIBUTARY_LOSSY_SEED") {
        Ok(v) => v
            .parse()
            .context("TRIBUTARY_LOSSY_SEED must be an integer")?,
        Err(_) => 42,
    };
    let root = tempfile::Builder::new().prefix("trb-lossy-").tempdir()?;
    let lossy::Link {
        pki,
        hub_spec,
        mut hub,
        proxy,
    } = lossy::Link::start(root.path(), seed)?;
    let mut ledger = Ledger::new();

    let leg = lossy::leg(
        root.path(),
        &pki,
        &proxy,
        &mut ledger,
        "dev-lossy",
        BACKLOG,
        lossy::lossy(),
    )
    .with_context(|| hub.log_tail(20))?;
    println!(
        "lossy drain of {BACKLOG} records ({:?} one-way delay, {:.0}% loss each way): {:.2?} \
         ({:.0} rec/s, {:.2} MB up, {:.2?} from heal, {} datagrams lost); seed {seed} \
         (replay: TRIBUTARY_LOSSY_SEED={seed} cargo test -p tributary-tests --test replication_lossy)",
        lossy::DELAY,
        lossy::LOSS * 100.0,
        leg.drain,
        leg.rate(),
        leg.bytes_up as f64 / 1e6,
        leg.total,
        leg.dropped_loss,
    );
    assert!(
        leg.dropped_loss > 0,
        "the proxy lost nothing, so the link was not lossy: {:?}",
        proxy.stats()
    );

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let report = ledger.check(observed.iter().cloned());
    assert!(report.is_ok(), "{}", report.summary());
    assert_eq!(observed.len() as u64, BACKLOG);
    hub.kill9()?;
    Ok(())
}
