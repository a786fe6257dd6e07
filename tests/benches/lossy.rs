//! Backlog drain throughput over a long link, with and without 5% loss: a benchmark program
//! (`harness = false`), never a timed test. The drains are the ones the exactly-once test
//! (`tests/replication_lossy.rs`) checks, from `tributary_tests::lossy`.
//!
//! ```text
//! cargo build --release -p edge-agent -p core-hub
//! cargo bench -p tributary-tests --bench lossy -- [--runs N] [--records R] [--seed S]
//! ```
//!
//! Each run drains the same backlog (default 120,000 records) twice through the UDP impairment
//! proxy against one real hub: leg A with 50 ms one-way delay each way, leg B with the delay
//! and 5% loss each way. Leg A is the physical reference measured in the same run: the same
//! machine, the same link latency, no loss. The drain is timed from the replication session
//! being up to the agent being caught up. One JSON object per run is printed on stdout
//! (throughputs, their ratio B/A, bytes moved, datagrams lost) and a summary on stderr. The
//! project's target is a ratio of at least 0.5 (docs/benchmarks.md, "Lossy links"); the
//! benchmark reports whether each run met it and does not fail on a slow run.

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use tributary_tests::ledger::Ledger;
use tributary_tests::lossy::{self, Leg};
use tributary_tests::procs::bin_path;

struct Args {
    runs: u32,
    records: u64,
    seed: u64,
}

fn args() -> Result<Args> {
    let mut a = Args {
        runs: 3,
        records: 120_000,
        seed: 42,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--runs" => a.runs = value()?.parse().context("--runs")?,
            "--records" => a.records = value()?.parse().context("--records")?,
            "--seed" => a.seed = value()?.parse().context("--seed")?,
            // `cargo bench` passes `--bench` to every harness-less bench.
            "--bench" => {}
            other => bail!("unknown argument {other}; usage: [--runs N] [--records R] [--seed S]"),
        }
    }
    ensure!(
        a.runs > 0 && a.records > 0,
        "--runs and --records must be positive"
    );
    Ok(a)
}

fn main() -> Result<()> {
    let args = args()?;
    for bin in ["edge-agent", "core-hub"] {
        ensure!(
            bin_path(bin).is_file(),
            "{} missing: `cargo build --release -p edge-agent -p core-hub` first",
            bin_path(bin).display()
        );
    }
    let mut ratios = Vec::new();
    for run in 0..args.runs {
        let seed = args.seed + u64::from(run);
        let (a, b) = one_run(args.records, seed)?;
        let ratio = b.rate() / a.rate();
        ratios.push(ratio);
        println!(
            "{}",
            json!({
                "bench": "lossy_drain",
                "run": run,
                "seed": seed,
                "records": args.records,
                "delay_ms": lossy::DELAY.as_millis() as u64,
                "loss": lossy::LOSS,
                "lossless_records_per_s": a.rate().round(),
                "lossy_records_per_s": b.rate().round(),
                "ratio": (ratio * 100.0).round() / 100.0,
                "lossless_mb_up": a.bytes_up as f64 / 1e6,
                "lossy_mb_up": b.bytes_up as f64 / 1e6,
                "lossy_datagrams_lost": b.dropped_loss,
                "target_ratio": 0.5,
                "met": ratio >= 0.5,
            })
        );
        eprintln!(
            "run {run} (seed {seed}): lossless {:.0} rec/s in {:.2?}, 5% loss {:.0} rec/s in {:.2?} \
             ({} datagrams lost): ratio {ratio:.2}",
            a.rate(),
            a.drain,
            b.rate(),
            b.drain,
            b.dropped_loss
        );
    }
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let max = ratios.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "{} runs: ratio {min:.2}-{max:.2} (target >= 0.5: {})",
        ratios.len(),
        if min >= 0.5 {
            "met in every run"
        } else {
            "missed in a run"
        }
    );
    Ok(())
}

/// One hub, one proxy, two agents: the lossless leg, then the lossy one.
fn one_run(records: u64, seed: u64) -> Result<(Leg, Leg)> {
    let root = tempfile::Builder::new()
        .prefix("trb-lossy-bench-")
        .tempdir()?;
    let lossy::Link {
        pki,
        mut hub,
        proxy,
        ..
    } = lossy::Link::start(root.path(), seed)?;
    let mut ledger = Ledger::new();
    let a = lossy::leg(
        root.path(),
        &pki,
        &proxy,
        &mut ledger,
        "dev-a",
        records,
        lossy::clean(),
    )
    .with_context(|| hub.log_tail(20))?;
    let b = lossy::leg(
        root.path(),
        &pki,
        &proxy,
        &mut ledger,
        "dev-b",
        records,
        lossy::lossy(),
    )
    .with_context(|| hub.log_tail(20))?;
    ensure!(a.dropped_loss == 0, "the lossless leg lost datagrams");
    ensure!(b.dropped_loss > 0, "the lossy leg lost nothing");
    hub.kill9()?;
    Ok((a, b))
}
