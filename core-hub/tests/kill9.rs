//! `kill -9` of a real hub process at random moments, then recovery.
//!
//! The test re-runs its own binary as a child (`child_writer`, selected by the
//! `TRIBUTARY_KILL9_DIR` environment variable). The child opens the hub and plays four agents:
//! each resumes from the hub's mark, resends a little old data on purpose (so straddling and
//! duplicate blocks are exercised), and prints `ACK device seq` for every acknowledged block.
//! The parent kills it with SIGKILL after a random number of acks, many times, then lets a
//! last child finish. Checked: every acknowledged record is present, every record exactly
//! once, in seq order per device, with dense hub offsets.
//!
//! `TRIBUTARY_SOAK=1` raises the number of kills and records; `TRIBUTARY_SEED=N` replays a run.

mod common;

use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const DEVICES: usize = 4;
const DIR_ENV: &str = "TRIBUTARY_KILL9_DIR";
const TOTAL_ENV: &str = "TRIBUTARY_KILL9_TOTAL";

use common::soak;

/// The child: runs only when the parent sets `TRIBUTARY_KILL9_DIR`.
#[test]
fn child_writer() {
    let Ok(dir) = std::env::var(DIR_ENV) else {
        return;
    };
    let total: u64 = std::env::var(TOTAL_ENV).unwrap().parse().unwrap();
    let rt = common::child_runtime();
    rt.block_on(async move {
        let hub = common::open(std::path::Path::new(&dir));
        let mut tasks = Vec::new();
        for d in 0..DEVICES {
            let hub = hub.clone();
            tasks.push(tokio::spawn(async move {
                let device = format!("agent-{d}");
                let mark = hub.marks(&device).first().map_or(0, |m| m.durable_seq);
                // Resend from a little before the mark, with a block size that varies per device,
                // so blocks straddle the mark or duplicate it.
                let size = 7 + d as u64 * 5;
                let mut first = mark.saturating_sub(13).max(1);
                while first <= total {
                    let last = (first + size - 1).min(total);
                    let out = hub
                        .commit_block(
                            &device,
                            "telemetry",
                            &common::block(&device, 1, first, last),
                        )
                        .await
                        .unwrap();
                    assert!(out.durable_seq() >= last);
                    println!("ACK {device} {last}");
                    first = last + 1;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        println!("DONE");
    });
}

/// Runs a child; kills it with SIGKILL after `kill_after` acks (if given). Returns the acks
/// seen and whether the child had more work in flight when it was killed.
fn run_child(
    dir: &std::path::Path,
    total: u64,
    kill_after: Option<usize>,
    acked: &mut HashMap<String, u64>,
) -> bool {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "child_writer", "--nocapture", "--test-threads=1"])
        .env(DIR_ENV, dir)
        .env(TOTAL_ENV, total.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = 0;
    let mut done = false;
    for line in stdout.lines() {
        let line = line.unwrap();
        if line.contains("DONE") {
            done = true;
        }
        let Some(rest) = line.strip_prefix("ACK ") else {
            continue;
        };
        let (dev, seq) = rest.split_once(' ').unwrap();
        let seq: u64 = seq.parse().unwrap();
        let e = acked.entry(dev.to_string()).or_insert(0);
        *e = (*e).max(seq);
        seen += 1;
        if kill_after.is_some_and(|k| seen >= k) {
            child.kill().unwrap(); // SIGKILL
            break;
        }
    }
    let status = child.wait().unwrap();
    if kill_after.is_none() {
        assert!(status.success() && done, "the final child must finish");
    }
    // Mid-transfer: the signal ended it, before it had written everything.
    !done && std::os::unix::process::ExitStatusExt::signal(&status) == Some(9)
}

#[test]
fn kill_dash_nine_loses_and_duplicates_nothing() {
    if std::env::var(DIR_ENV).is_ok() {
        return; // we are the child
    }
    let (kills, step) = if soak() { (40, 1_000u64) } else { (12, 500u64) };
    // Child k writes up to `step * (k + 1)` records per device: every child has fresh work
    // (at least `step / 22` blocks per device), so each random kill lands mid-transfer on any
    // machine. The last child writes the whole total.
    let total = step * (kills as u64 + 1);
    let seed = common::seed();
    println!("seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut acked: HashMap<String, u64> = HashMap::new();
    let mut mid_transfer = 0;
    for k in 0..kills as u64 {
        let until = step * (k + 1);
        if run_child(dir.path(), until, Some(rng.random_range(1..60)), &mut acked) {
            mid_transfer += 1;
        }
    }
    run_child(dir.path(), total, None, &mut acked);
    println!("{mid_transfer} of {kills} kills landed mid-transfer (seed {seed})");
    assert!(
        mid_transfer > 0,
        "no kill landed mid-transfer (seed {seed})"
    );

    let hub = common::open(dir.path());
    let got = common::read_all(&hub, "telemetry");
    let mut next: HashMap<&str, u64> = HashMap::new();
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.offset, i as u64, "seed {seed}");
        let n = next.entry(r.device.as_str()).or_insert(1);
        assert_eq!(
            r.seq, *n,
            "device {} seq out of order or duplicated (seed {seed})",
            r.device
        );
        assert_eq!(
            r.fields,
            common::record(&r.device, r.seq).fields,
            "seed {seed}"
        );
        *n += 1;
    }
    assert_eq!(got.len() as u64, total * DEVICES as u64, "seed {seed}");
    for (dev, seq) in &acked {
        let mark = hub.marks(dev)[0].durable_seq;
        assert!(
            mark >= *seq,
            "{dev}: acked {seq} but mark {mark} (seed {seed})"
        );
    }
}
