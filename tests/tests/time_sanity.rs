//! Time sanity with the real binaries and a faked wall clock (libfaketime, `apt-get install
//! faketime`, which `.ci/test` installs).
//!
//! - A board with no RTC boots at 1970: the agent still connects (TLS validity is checked at
//!   `max(now, build time)`), records stamped with its clock are stored as given and counted
//!   as implausible on `/metrics`, and the hub holds every record exactly once.
//! - The wall clock jumps a day forward and then a day back while ingesting: nothing is
//!   reordered, dropped or deduplicated, because seqs and never clocks decide order and
//!   identity, and the link stays usable.
//!
//! Only the agent's wall clock is faked; its monotonic clock (timers, QUIC) is left alone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};

const STREAM: &str = "telemetry";
const WAIT: Duration = Duration::from_secs(60);

fn libfaketime() -> PathBuf {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("libfaketime is missing: apt-get install faketime (.ci/test installs it)")
}

/// Environment that runs the agent with its wall clock read from `spec_file` on every call.
fn faked_clock(spec_file: &Path, spec: &str) -> Vec<(String, String)> {
    std::fs::write(spec_file, spec).unwrap();
    vec![
        ("LD_PRELOAD".into(), libfaketime().display().to_string()),
        (
            "FAKETIME_TIMESTAMP_FILE".into(),
            spec_file.display().to_string(),
        ),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
    ]
}

/// Records stamped with the real time, which is after the agent was built: plausible.
fn batch(tag: &str, from: u64, n: u64) -> Vec<SentRecord> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    (from..from + n)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 3),
                now + i as i64,
                json!({ "tag": tag, "i": i }),
            )
        })
        .collect()
}

/// An NDJSON body without `ts`: such records get the agent's receive time, its (faked) clock.
fn undated_body(from: u64, n: u64) -> String {
    (from..from + n)
        .map(|i| {
            json!({ "key": format!("k{}", i % 3), "fields": { "tag": "undated", "i": i } })
                .to_string()
                + "\n"
        })
        .collect()
}

fn post_all(producer: &Producer, ledger: &mut Ledger, records: &[SentRecord]) -> Result<()> {
    for chunk in records.chunks(100) {
        match producer.post(ledger, STREAM, chunk, None)? {
            PostOutcome::Acked(_) => {}
            other => anyhow::bail!("not acknowledged: {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn agent_with_a_clock_at_1970_connects_and_ships_exactly_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::init(dir.path().join("pki"))?;
    let hub_spec = HubSpec::new(dir.path());
    let _hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1970", None)?;
    let mut spec = AgentSpec::new(dir.path(), "dev-1970", cert, Some(hub_spec.quic));
    spec.env = faked_clock(&dir.path().join("clock"), "@1970-01-02 00:00:00");
    let _agent = spec.start()?;
    let producer = Producer::new("dev-1970", spec.http);
    let mut ledger = Ledger::new();
    post_all(&producer, &mut ledger, &batch("dated", 0, 300))?;
    // Event times taken from a clock at 1970 are stored as given, and flagged.
    let path = format!("/v1/streams/{STREAM}/records");
    let response =
        tributary_tests::http::post_ndjson(spec.http, &path, undated_body(300, 200).as_bytes())?;
    assert_eq!(response.status, 200, "{}", response.text());
    let status = cluster::wait_caught_up(spec.http, WAIT)?;
    assert_eq!(
        cluster::link(&status),
        "up",
        "a board at 1970 must still connect: {status}"
    );
    let flagged = cluster::fetch_metric(spec.http, "tributary_edge_implausible_ts_records_total")?;
    assert_eq!(
        flagged, 200.0,
        "records stamped at 1970 must be counted as implausible"
    );
    let held = cluster::read_stream(hub_spec.http, STREAM)?;
    assert_eq!(held.len(), 500, "the hub holds every record once");
    let undated_ts: Vec<i64> = held
        .iter()
        .filter(|r| r.fields["tag"] == "undated")
        .map(|r| r.ts)
        .collect();
    assert_eq!(undated_ts.len(), 200);
    let year_1971_ns = 31_536_000_000_000_000i64 * 2;
    assert!(
        undated_ts.iter().all(|&ts| ts > 0 && ts < year_1971_ns),
        "receive time is the 1970 clock, stored as given"
    );
    let dated = held.into_iter().filter(|r| r.fields["tag"] == "dated");
    ledger.check_streams(&[STREAM], dated).assert_ok();
    Ok(())
}

#[test]
fn clock_jumping_a_day_each_way_reorders_drops_and_dedupes_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::init(dir.path().join("pki"))?;
    let hub_spec = HubSpec::new(dir.path());
    let _hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-jump", None)?;
    let clock = dir.path().join("clock");
    let mut spec = AgentSpec::new(dir.path(), "dev-jump", cert, Some(hub_spec.quic));
    spec.env = faked_clock(&clock, "+0");
    let _agent = spec.start()?;
    let producer = Producer::new("dev-jump", spec.http);
    let mut ledger = Ledger::new();
    // The same content in every phase: only seqs tell the records apart, and none may be
    // taken for a duplicate.
    let path = format!("/v1/streams/{STREAM}/records");
    for (phase, offset) in ["+0", "+1d", "-1d", "+0"].into_iter().enumerate() {
        std::fs::write(&clock, offset)?;
        let records = batch("same", 0, 250);
        post_all(&producer, &mut ledger, &records)?;
        // One record stamped by the agent's clock per phase proves the jump took effect.
        let response = tributary_tests::http::post_ndjson(
            spec.http,
            &path,
            undated_body(phase as u64, 1).as_bytes(),
        )?;
        assert_eq!(response.status, 200, "{}", response.text());
    }
    let status = cluster::wait_caught_up(spec.http, WAIT)?;
    assert_eq!(cluster::link(&status), "up", "{status}");
    let held = cluster::read_stream(hub_spec.http, STREAM)?;
    assert_eq!(
        held.len(),
        1004,
        "identical content at different seqs is never deduplicated"
    );
    let seqs: Vec<u64> = held.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (1..=1004).collect::<Vec<_>>(),
        "hub order is seq order across the clock jumps"
    );
    let stamps: Vec<i64> = held
        .iter()
        .filter(|r| r.fields["tag"] == "undated")
        .map(|r| r.ts)
        .collect();
    let day_ns = 86_400_000_000_000i64;
    let near = |a: i64, b: i64| (a - b).abs() < day_ns / 4;
    assert!(
        near(stamps[1] - stamps[0], day_ns),
        "the clock jumped a day forward: {stamps:?}"
    );
    assert!(
        near(stamps[2] - stamps[0], -day_ns),
        "then a day back: {stamps:?}"
    );
    assert!(near(stamps[3], stamps[0]), "then returned: {stamps:?}");
    let same = held.into_iter().filter(|r| r.fields["tag"] == "same");
    ledger.check_streams(&[STREAM], same).assert_ok();
    Ok(())
}
