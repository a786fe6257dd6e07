//! `core-hub export --from/--to` with RFC 3339 numeric offsets: the window is the instants the
//! offsets name (the one time parser, `sync::time`), not the wall-clock digits read as UTC.

mod tier_support;

use std::path::Path;
use std::time::Duration;

use tier_support::common;

#[path = "../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

const BIN: &str = env!("CARGO_BIN_EXE_core-hub");

fn exported_seqs(path: &Path) -> Vec<u64> {
    let bytes = std::fs::read(path).unwrap();
    tier::decode_chunk(bytes.into())
        .unwrap()
        .into_iter()
        .map(|r| r.seq)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_reads_numeric_offsets_as_the_instants_they_name() {
    let dir = tempfile::tempdir().unwrap();
    let (data, tier2) = (dir.path().join("data"), dir.path().join("tier2"));
    let cfg = common::config(&data, |c| {
        c.tier2.url = format!("file://{}", tier2.display());
        c.tier2.chunk_age_max = Duration::from_secs(3600);
    });
    let (hub, tiering) = tier_support::open(&cfg).await;
    // Seq s has event time 2025-11-29T00:00:00Z + s ms.
    tier_support::ingest(&hub, "van-1", 1, 50, 50).await;
    tier_support::flush(&tiering).await;
    drop(tiering);
    hub.shutdown();
    drop(hub);
    tier_support::reopen(&cfg).await.shutdown();

    let config = dir.path().join("hub.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = \"{}\"\n[listen]\nhttp = \"127.0.0.1:{}\"\n[tier2]\nurl = \"file://{}\"\n",
            data.display(),
            ports::tcp(),
            tier2.display()
        ),
    )
    .unwrap();
    // 01:00:00.010 at +01:00 is 00:00:00.010Z; 19:00:00.020 at -05:00 the next day's 00:00:00.020Z.
    let out_file = dir.path().join("window.parquet");
    let out = tokio::process::Command::new(BIN)
        .args([
            "export",
            "telemetry",
            "--from",
            "2025-11-29T01:00:00.010+01:00",
            "--to",
            "2025-11-28T19:00:00.020-05:00",
            "--config",
            config.to_str().unwrap(),
            "--out",
            out_file.to_str().unwrap(),
        ])
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        exported_seqs(&out_file),
        (10..20).collect::<Vec<u64>>(),
        "[00:00:00.010Z, 00:00:00.020Z) holds seqs 10 to 19"
    );
}
