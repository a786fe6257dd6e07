//! A small `storage.disk_bytes_max` is a real bound. The config refuses a budget that cannot
//! hold the segments the log needs (one active segment per stream plus
//! `BUDGET_SPARE_SEGMENTS` it can drop), naming both keys and the minimum, and so does
//! `edge-agent doctor`; without an explicit `segment_bytes_max` the segment size is derived
//! from the budget. Under sustained ingest a 64 KiB budget then holds at every step, with the
//! oldest data dropped and counted.

mod log_util;

use std::path::Path;
use std::sync::Arc;

use edge_agent::config::{BUDGET_SPARE_SEGMENTS, ConfigError, EdgeConfig};
use edge_agent::log::{GapReason, Log};
use edge_agent::storage::RealStorage;
use log_util::{rec, seg_bytes_on_disk};

fn config(storage: &str, streams: &[&str], dir: &Path) -> Result<EdgeConfig, ConfigError> {
    let streams: String = streams
        .iter()
        .map(|s| format!("[[streams]]\nname = \"{s}\"\n"))
        .collect();
    let text = format!("data_dir = \"data\"\n[storage]\n{storage}\n{streams}");
    EdgeConfig::from_toml(&text, dir, Some(Default::default()))
}

fn refused(storage: &str, streams: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    match config(storage, streams, dir.path()) {
        Ok(c) => panic!("{storage:?} was accepted: {:?}", c.storage),
        Err(e) => {
            assert_eq!(e.key(), Some("storage.disk_bytes_max"), "{e}");
            e.to_string()
        }
    }
}

#[test]
fn a_budget_below_the_segments_the_log_needs_is_refused_naming_both_keys() {
    // The report's case: a 64 KiB budget with 64 MiB segments.
    let m = refused(
        "disk_bytes_max = \"64KiB\"\nsegment_bytes_max = \"64MiB\"",
        &["telemetry"],
    );
    assert_eq!(BUDGET_SPARE_SEGMENTS, 2);
    for part in [
        "storage.segment_bytes_max",
        "64KiB",
        "64MiB",
        "at least 192MiB",
    ] {
        assert!(m.contains(part), "{part:?} missing from {m:?}");
    }
    // Each stream has an active segment of its own.
    let two = ["a", "b"];
    let dir = tempfile::tempdir().unwrap();
    let ok = config(
        "disk_bytes_max = \"256KiB\"\nsegment_bytes_max = \"64KiB\"",
        &two,
        dir.path(),
    );
    assert_eq!(ok.unwrap().storage.segment_bytes_max, 64 << 10);
    let m = refused(
        "disk_bytes_max = \"255KiB\"\nsegment_bytes_max = \"64KiB\"",
        &two,
    );
    assert!(
        m.contains("2 streams") && m.contains("at least 256KiB"),
        "{m}"
    );
    // A budget too small even for derived segments.
    let m = refused("disk_bytes_max = \"4KiB\"", &["telemetry"]);
    assert!(m.contains("at least 6KiB"), "{m}");
}

#[test]
fn the_segment_size_is_derived_from_the_budget_unless_configured() {
    let dir = tempfile::tempdir().unwrap();
    let small = config("disk_bytes_max = \"64KiB\"", &["telemetry"], dir.path()).unwrap();
    let seg = small.storage.segment_bytes_max;
    assert!(
        (1024..=(64 << 10) / 3).contains(&seg),
        "segment {seg} for a 64 KiB budget"
    );
    let default = config("", &["telemetry"], dir.path()).unwrap();
    assert_eq!(default.storage.segment_bytes_max, 64 << 20);
}

#[test]
fn a_64_kib_budget_holds_under_sustained_ingest() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        "disk_bytes_max = \"64KiB\"\nfsync = \"always\"",
        &["telemetry"],
        dir.path(),
    )
    .unwrap();
    let budget = cfg.storage.disk_bytes_max;
    let data = cfg.data_dir.clone();
    let log = Log::open(cfg.log_config(), Arc::new(RealStorage))
        .expect("open")
        .0;
    let (mut appended, mut peak) = (0u64, 0u64);
    // About 1.2 MB of poorly compressible records: twenty budgets' worth.
    for b in 0..600u64 {
        let batch: Vec<_> = (0..10).map(|i| rec(b * 10 + i, 200)).collect();
        log.append_blocking("telemetry", batch)
            .expect("drop-oldest never refuses");
        appended += 10;
        let used = seg_bytes_on_disk(&data);
        peak = peak.max(used);
        assert!(
            used <= budget,
            "batch {b}: {used} bytes of segments over the {budget} budget"
        );
    }
    let status = log.status();
    let s = &status.streams[0];
    assert!(s.dropped_records > 0, "nothing was dropped: {s:?}");
    let gaps: u64 = log
        .gaps("telemetry")
        .iter()
        .filter(|g| g.reason == GapReason::Dropped)
        .map(|g| g.last_seq - g.first_seq + 1)
        .sum();
    assert_eq!(
        gaps, s.dropped_records,
        "every dropped record is in a gap marker"
    );
    let held = log_util::read_all(&log, "telemetry", status.epoch).len() as u64;
    assert_eq!(
        held + s.dropped_records,
        appended,
        "held {held}, peak {peak}"
    );
    assert!(
        peak > budget / 2,
        "the budget was never approached: peak {peak}"
    );
}

#[test]
fn doctor_refuses_the_budget_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edge.toml");
    std::fs::write(
        &path,
        "data_dir = \"data\"\n[storage]\ndisk_bytes_max = \"64KiB\"\nsegment_bytes_max = \"64MiB\"\n\
         [[streams]]\nname = \"telemetry\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["doctor", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "doctor passed:\n{stdout}");
    let line = stdout
        .lines()
        .find(|l| l.contains("config"))
        .unwrap_or_else(|| panic!("no config line:\n{stdout}"));
    assert!(line.starts_with("FAIL"), "{stdout}");
    for part in [
        "storage.disk_bytes_max",
        "storage.segment_bytes_max",
        "192MiB",
    ] {
        assert!(line.contains(part), "{part:?} missing from {line:?}");
    }
}
