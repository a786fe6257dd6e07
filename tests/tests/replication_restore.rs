//! Restored and cloned data directories, with the real hub and agent binaries.
//!
//! "An agent's data directory is replaced by a copy from 10 minutes earlier", with time scaled
//! down: snapshot the directory, keep ingesting and replicating, then put the old copy back.
//! The hub is ahead of the restored directory, so the agent must mint a new epoch and never
//! reuse a seq: nothing acknowledged is lost and nothing is duplicated (ledger check).
//!
//! A cloned device (two agents with the same certificate and copies of one data directory)
//! writing different content under the same seqs must be fenced by the hub with an alarm
//! (metric and `/v1/devices`), never silently deduplicated.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::wait_until;

const STREAM: &str = "telemetry";
const WAIT: Duration = Duration::from_secs(60);
const STOP: Duration = Duration::from_secs(20);

fn batch(tag: &str, from: u64, n: u64) -> Vec<SentRecord> {
    (from..from + n)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 5),
                1_000 + i as i64,
                json!({ "tag": tag, "i": i }),
            )
        })
        .collect()
}

/// Posts `records` in batches of 200; every batch must be acknowledged. Returns the epochs seen.
fn ingest(producer: &Producer, ledger: &mut Ledger, records: &[SentRecord]) -> Result<Vec<u64>> {
    let mut epochs = Vec::new();
    for chunk in records.chunks(200) {
        match producer.post(ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(ack) => epochs.push(ack.epoch),
            other => anyhow::bail!("ingest was not acknowledged: {other:?}"),
        }
    }
    epochs.dedup();
    Ok(epochs)
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .context("running cp")?;
    ensure!(
        status.success(),
        "cp -a {} {} failed",
        from.display(),
        to.display()
    );
    Ok(())
}

#[test]
fn a_restored_older_data_directory_mints_a_new_epoch_and_loses_nothing() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-restore-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;
    let producer = Producer::new("dev-1", spec.http);
    let mut ledger = Ledger::new();

    // Phase A: replicated, then the "backup" is taken from a killed agent (a crash-consistent
    // copy, like a disk image).
    let epochs_a = ingest(&producer, &mut ledger, &batch("a", 0, 2_000))?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    agent.kill9()?;
    let backup = root.path().join("backup");
    copy_dir(&spec.data_dir, &backup)?;

    // Phase B: more data, replicated; the hub's mark moves past everything in the backup.
    agent.restart()?;
    agent.wait_http_ok(spec.http, "/healthz", cluster::START_TIMEOUT)?;
    let epochs_b = ingest(&producer, &mut ledger, &batch("b", 2_000, 3_000))?;
    let before_restore = cluster::wait_caught_up(spec.http, WAIT)?;
    let old_epoch = cluster::epoch(&before_restore)?;
    assert_eq!(epochs_a, vec![old_epoch], "phase A epochs");
    assert_eq!(epochs_b, vec![old_epoch], "phase B epochs");
    agent.terminate(STOP)?;

    // The restore: the old copy replaces the directory.
    std::fs::remove_dir_all(&spec.data_dir)?;
    copy_dir(&backup, &spec.data_dir)?;
    agent.restart()?;
    agent.wait_http_ok(spec.http, "/healthz", cluster::START_TIMEOUT)?;
    // The handshake tells the agent the hub is ahead; it must mint before taking new data
    // under the old epoch's seqs.
    let minted = wait_until(WAIT, "the restored agent to mint a new epoch", || {
        cluster::status(spec.http).is_ok_and(|s| {
            cluster::link(&s) == "up" && cluster::epoch(&s).is_ok_and(|e| e != old_epoch)
        })
    });
    minted.with_context(|| agent.log_tail(30))?;
    // The status can show the new epoch a moment before the log line is written.
    let logged = wait_until(WAIT, "the agent to log the new epoch", || {
        agent.stderr().contains("minted a new epoch")
            || agent.stdout().contains("minted a new epoch")
    });
    logged.with_context(|| agent.log_tail(30))?;
    // The log names the epochs as everything else does: 16 hex digits.
    let minted_hex = format!(
        "epoch={:016x}",
        cluster::epoch(&cluster::status(spec.http)?)?
    );
    let log = format!("{}{}", agent.stderr(), agent.stdout());
    ensure!(
        log.lines()
            .any(|l| l.contains("hub is ahead of this data directory") && l.contains(&minted_hex)),
        "no mint line with {minted_hex}:\n{}",
        agent.log_tail(30)
    );

    // Phase C: new data goes under the new epoch and replicates.
    let epochs_c = ingest(&producer, &mut ledger, &batch("c", 5_000, 2_000))?;
    let after = cluster::wait_caught_up(spec.http, WAIT)?;
    let new_epoch = cluster::epoch(&after)?;
    assert_ne!(new_epoch, old_epoch);
    assert_eq!(epochs_c, vec![new_epoch], "phase C epochs");

    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let report = ledger.check(observed.iter().cloned());
    assert!(report.is_ok(), "{}", report.summary());
    assert_eq!(observed.len(), 7_000, "every acknowledged record once");
    let conflicts = cluster::fetch_metric(hub_spec.http, "tributary_hub_conflicts_total")?;
    assert_eq!(conflicts, 0.0, "a restore is not a conflict");
    drop(hub);
    Ok(())
}

#[test]
fn a_cloned_device_writing_different_content_is_fenced_with_an_alarm() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-clone-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let hub_spec = HubSpec::new(root.path());
    let mut hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let original = AgentSpec::new(root.path(), "orig", cert.clone(), Some(hub_spec.quic));
    let mut agent = original.start()?;
    let mut ledger = Ledger::new();
    ingest(
        &Producer::new("dev-1", original.http),
        &mut ledger,
        &batch("base", 0, 1_000),
    )?;
    cluster::wait_caught_up(original.http, WAIT)?;
    agent.terminate(STOP)?;

    // Both clones start from the same directory and take different content while the hub is
    // away, so both hold the same (epoch, seqs) with different bytes.
    hub.terminate(STOP)?;
    let mut clones = Vec::new();
    for name in ["clone-x", "clone-y"] {
        let spec = AgentSpec::new(root.path(), name, cert.clone(), Some(hub_spec.quic));
        copy_dir(&original.data_dir, &spec.data_dir)?;
        let proc = spec.start()?;
        let mut clone_ledger = Ledger::new();
        let epochs = ingest(
            &Producer::new("dev-1", spec.http),
            &mut clone_ledger,
            &batch(name, 1_000, 500),
        )?;
        clones.push((spec, proc, epochs));
    }
    assert_eq!(clones[0].2, clones[1].2, "the clones share their epoch");

    hub.restart()?;
    hub.wait_http_ok(hub_spec.http, "/healthz", cluster::START_TIMEOUT)?;
    let mut last = String::new();
    // The conflict is caught either by the protocol receiver (against stored checksums) or by
    // the hub's ingest path, depending on which clone's blocks arrive first; both raise the same
    // alarm: the `tributary_hub_fenced_devices` gauge, the conflict counter and one log line.
    let fenced = wait_until(
        WAIT,
        "the hub to fence dev-1 and raise the alarm gauge",
        || {
            let gauge =
                cluster::fetch_metric(hub_spec.http, "tributary_hub_fenced_devices").unwrap_or(0.0);
            let devices = http::get(hub_spec.http, "/v1/devices")
                .and_then(|r| r.json())
                .unwrap_or(Value::Null);
            let fenced = devices.as_array().is_some_and(|ds| {
                ds.iter()
                    .any(|d| d["id"] == "dev-1" && !d["fenced"].is_null())
            });
            last = format!("fenced_devices {gauge}, devices {devices}");
            gauge >= 1.0 && fenced
        },
    );
    fenced.with_context(|| format!("last: {last}\n{}", hub.log_tail(30)))?;
    let conflicts = cluster::fetch_metric(hub_spec.http, "tributary_hub_conflicts_total")?;
    assert!(
        conflicts >= 1.0,
        "the conflict was not counted: {conflicts}"
    );
    assert!(
        hub.stderr().contains("ALARM: device fenced")
            || hub.stdout().contains("ALARM: device fenced"),
        "the hub did not log the alarm\n{}",
        hub.log_tail(30)
    );

    // What the hub holds for dev-1 beyond the shared base came from one clone only, never a mix
    // passed off as duplicates.
    let observed = cluster::read_stream(hub_spec.http, STREAM)?;
    let tags: std::collections::BTreeSet<String> = observed
        .iter()
        .filter_map(|r| {
            r.fields
                .get("tag")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect();
    assert!(tags.contains("base"), "the base data is at the hub");
    assert!(
        !(tags.contains("clone-x") && tags.contains("clone-y")),
        "both clones' content for the same seqs was committed: {tags:?}"
    );
    Ok(())
}
