//! Runs `core-hub demo --short` exactly as CI and a new user would: the real hub binary, the
//! real edge-agent binary next to it, real QUIC through the demo's link relays.
//!
//! The demo itself verifies the merged stream against what the edges acknowledged and exits 0
//! only on PASS; this test checks that it did, that every device contributed records, and that
//! links really dropped along the way (otherwise the demo would prove nothing about outages).
//!
//! `cargo test -p core-hub` builds only core-hub's binaries, so the edge-agent binary must come
//! from an earlier `cargo build --workspace --all-targets` (CI does that first).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The short demo takes about 25 s; this bounds a hang, it is not a target.
const DEADLINE: Duration = Duration::from_secs(240);

#[test]
fn short_demo_passes_with_link_drops() {
    let core_hub = PathBuf::from(env!("CARGO_BIN_EXE_core-hub"));
    let edge_agent = core_hub.with_file_name(format!("edge-agent{}", std::env::consts::EXE_SUFFIX));
    assert!(
        edge_agent.is_file(),
        "{} is missing: build the workspace first (cargo build --workspace --all-targets), the demo runs the real edge-agent binary",
        edge_agent.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("demo");
    let out_path = dir.path().join("demo.out");
    let err_path = dir.path().join("demo.err");
    let mut child = Command::new(&core_hub)
        .args(["demo", "--short", "--dir"])
        .arg(&work)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the demo did not finish within {DEADLINE:?}:\n{}",
                std::fs::read_to_string(&out_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&out_path).unwrap();
    let err = std::fs::read_to_string(&err_path).unwrap();
    let took = started.elapsed();
    assert!(
        status.success(),
        "the demo failed ({status}) after {took:?}\nstdout:\n{out}\nstderr:\n{err}"
    );

    let pass = out
        .lines()
        .find(|l| l.starts_with("PASS:"))
        .unwrap_or_else(|| panic!("no PASS line in the output:\n{out}"));
    let counts: Vec<(String, u64)> = pass
        .split(['(', ')', ' '])
        .filter_map(|t| t.split_once('='))
        .map(|(device, n)| {
            (
                device.to_owned(),
                n.parse()
                    .unwrap_or_else(|_| panic!("bad count in {pass:?}")),
            )
        })
        .collect();
    assert!(counts.len() >= 3, "at least three devices in {pass:?}");
    assert!(
        counts.iter().all(|(_, n)| *n > 0),
        "every device merged records: {pass:?}"
    );

    let drops: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("link drops: "))
        .unwrap_or_else(|| panic!("no `link drops:` line in the output:\n{out}"))
        .trim()
        .parse()
        .unwrap();
    assert!(
        drops >= 3,
        "the short demo must drop links at least 3 times, saw {drops}:\n{out}"
    );
    // The demo points at tier 2, and the hub tiered what it merged into Parquet there.
    let tier2 = out
        .lines()
        .find_map(|l| l.strip_prefix("tier 2 (Parquet): "))
        .unwrap_or_else(|| panic!("no tier 2 line in the output:\n{out}"))
        .split_whitespace()
        .next()
        .expect("a path");
    let parquet_files = walk_files(std::path::Path::new(tier2))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .count();
    assert!(parquet_files > 0, "no Parquet file under {tier2}:\n{out}");
    assert!(
        work.join("hub").join("data").is_dir(),
        "--dir keeps the hub's data"
    );
    eprintln!("short demo passed in {took:?}: {pass}; link drops: {drops}");
}

/// Every file under `dir`, recursively (none if it does not exist).
fn walk_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}
