//! A block the hub refuses for good does not wedge its lane: a real hub with a small
//! `ingest.block_decoded_bytes_max` and a real agent that posts small batches, one big batch
//! (one block whose records decode to more than the hub's limit), then more small batches.
//!
//! The big block is refused once (`DECODED_TOO_LARGE`, counted by the hub), quarantined by the
//! agent (a copy under `data_dir/quarantine/`, a `Refused` gap marker, counted on the agent's
//! `/metrics`), its seqs reach the hub as a gap (`GET /v1/devices`), and every other record
//! arrives exactly once, in order. Restarting the agent, then the hub, sends the block again
//! never: the hub's refusal counter stays at one and later records keep flowing.
//!
//! Mutation check: with the agent's test-only switch `TRIBUTARY_TEST_EDGE_RESEND_REFUSED=1`
//! (`fault-injection` builds), refusals are taken as transient, as before the quarantine
//! existed; the same scenario then shows the defect the first test guards against: the hub
//! refuses the block again and again and the lane behind it never moves.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::procs::wait_until;

const STREAM: &str = "telemetry";
const WAIT: Duration = Duration::from_secs(60);
const REFUSED: &str = "tributary_hub_decoded_too_large_blocks_total";
const QUARANTINED: &str = "tributary_edge_link_blocks_refused_total";

/// NDJSON for `n` records of `blob_len`-byte strings, tagged with `batch`.
fn batch(batch: u64, n: usize, blob_len: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        let line = json!({
            "key": format!("dev-1/k{}", i % 3),
            "ts": 1_764_374_400_000_000_000i64 + (batch * 1000 + i as u64) as i64,
            "fields": {"batch": batch, "i": i, "blob": "x".repeat(blob_len)},
        });
        out.extend_from_slice(line.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

fn post(agent: std::net::SocketAddr, body: &[u8]) -> Result<()> {
    let path = format!("/v1/streams/{STREAM}/records");
    let r = http::post_ndjson(agent, &path, body)?;
    ensure!(r.status == 200, "post: {} {}", r.status, r.text());
    Ok(())
}

/// The seqs the hub holds for the stream, in hub order.
fn hub_seqs(hub: std::net::SocketAddr) -> Result<Vec<u64>> {
    Ok(cluster::read_stream(hub, STREAM)?
        .into_iter()
        .map(|r| r.seq)
        .collect())
}

/// The gaps the hub lists for `dev-1`, as `(first_seq, last_seq, reason)`.
fn hub_gaps(hub: std::net::SocketAddr) -> Result<Vec<(u64, u64, String)>> {
    let devices: serde_json::Value = http::get(hub, "/v1/devices")?.json()?;
    let dev = devices
        .as_array()
        .and_then(|d| d.iter().find(|d| d["id"] == "dev-1"))
        .context("dev-1 in /v1/devices")?;
    let gaps = dev["gaps"].as_array().cloned().unwrap_or_default();
    Ok(gaps
        .iter()
        .map(|g| {
            (
                g["first_seq"].as_u64().unwrap_or(0),
                g["last_seq"].as_u64().unwrap_or(0),
                g["reason"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect())
}

#[test]
fn a_block_refused_for_good_is_quarantined_once_and_the_lane_moves_on() -> Result<()> {
    let root = tempfile::Builder::new().prefix("trb-refused-").tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.extra_toml = "[ingest]\nblock_decoded_bytes_max = \"64KiB\"\n".into();
    let mut hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    let mut agent = spec.start()?;

    // Seqs 1..=5, then the big batch 6..=45 (40 records of 4 KiB: one block of about 170 KB
    // decoded), then 10 batches of 10 small records, 46..=145.
    post(spec.http, &batch(0, 5, 16))?;
    post(spec.http, &batch(1, 40, 4096))?;
    for b in 2..12 {
        post(spec.http, &batch(b, 10, 16))?;
    }
    let want: Vec<u64> = (1..=5).chain(46..=145).collect();
    wait_until(WAIT, "the agent to quarantine the refused block", || {
        cluster::fetch_metric(spec.http, QUARANTINED).unwrap_or(0.0) >= 1.0
    })?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    wait_until(WAIT, "every other record at the hub", || {
        hub_seqs(hub_spec.http).is_ok_and(|s| s.len() >= want.len())
    })?;
    assert_eq!(hub_seqs(hub_spec.http)?, want, "each record once, in order");
    assert_eq!(cluster::fetch_metric(spec.http, QUARANTINED)?, 1.0);
    assert_eq!(
        cluster::fetch_metric(hub_spec.http, REFUSED)?,
        1.0,
        "refused once"
    );
    let gaps = hub_gaps(hub_spec.http)?;
    assert!(
        gaps.iter().any(|(f, l, _)| *f == 6 && *l == 45),
        "the hub lists the refused seqs as a gap: {gaps:?}"
    );
    let qdir = spec.data_dir.join("quarantine");
    let kept: Vec<_> = std::fs::read_dir(&qdir)
        .with_context(|| format!("{}", qdir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".refused"))
        .collect();
    assert_eq!(kept.len(), 1, "the refused block is kept for inspection");
    let name = kept[0].file_name().to_string_lossy().into_owned();
    assert!(name.ends_with("-6-45.refused"), "named by its seqs: {name}");
    // The frame as stored: its 8-byte frame header, then the block, which decodes to the 40
    // records the hub refused.
    let frame = std::fs::read(kept[0].path())?;
    let block = sync::block::decode_block(&frame[8..], &sync::block::DecodeLimits::default())?;
    assert_eq!(block.header.first_seq, 6);
    assert_eq!(block.records.len(), 40, "with its records");

    // A restart of the agent: the gap is on its disk, the block is not sent again.
    agent.kill9()?;
    let mut agent = spec.start()?;
    post(spec.http, &batch(12, 10, 16))?;
    cluster::wait_caught_up(spec.http, WAIT)?;
    wait_until(WAIT, "the records posted after the agent's restart", || {
        hub_seqs(hub_spec.http).is_ok_and(|s| s.len() >= want.len() + 10)
    })?;
    assert_eq!(cluster::fetch_metric(spec.http, QUARANTINED)?, 0.0);
    assert_eq!(cluster::fetch_metric(hub_spec.http, REFUSED)?, 1.0);

    // A restart of the hub: its marks are past the gap, nothing is refused again.
    hub.kill9()?;
    let _hub = hub_spec.start(&pki)?;
    post(spec.http, &batch(13, 10, 16))?;
    wait_until(WAIT, "the agent to reconnect and catch up", || {
        cluster::status(spec.http)
            .is_ok_and(|s| cluster::link(&s) == "up" && cluster::caught_up(&s))
    })?;
    let want: Vec<u64> = (1..=5).chain(46..=165).collect();
    wait_until(WAIT, "the records posted after the hub's restart", || {
        hub_seqs(hub_spec.http).is_ok_and(|s| s.len() >= want.len())
    })?;
    assert_eq!(hub_seqs(hub_spec.http)?, want, "each record once, in order");
    assert_eq!(
        cluster::fetch_metric(hub_spec.http, REFUSED)?,
        0.0,
        "a new hub process refused nothing"
    );
    assert_eq!(cluster::fetch_metric(spec.http, QUARANTINED)?, 0.0);
    agent.kill9()?;
    Ok(())
}

#[test]
fn without_the_quarantine_the_block_is_resent_and_the_lane_stalls() -> Result<()> {
    let root = tempfile::Builder::new()
        .prefix("trb-refused-mut-")
        .tempdir()?;
    let pki = Pki::init(root.path().join("pki"))?;
    let mut hub_spec = HubSpec::new(root.path());
    hub_spec.extra_toml = "[ingest]\nblock_decoded_bytes_max = \"64KiB\"\n".into();
    let _hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-1", None)?;
    let mut spec = AgentSpec::new(root.path(), "dev-1", cert, Some(hub_spec.quic));
    spec.env
        .push(("TRIBUTARY_TEST_EDGE_RESEND_REFUSED".into(), "1".into()));
    let mut agent = spec.start()?;
    post(spec.http, &batch(0, 5, 16))?;
    post(spec.http, &batch(1, 40, 4096))?;
    for b in 2..12 {
        post(spec.http, &batch(b, 10, 16))?;
    }
    // An agent built without `fault-injection` ignores the switch and quarantines at once.
    wait_until(WAIT, "the hub to refuse the same block three times", || {
        cluster::fetch_metric(hub_spec.http, REFUSED).unwrap_or(0.0) >= 3.0
            || cluster::fetch_metric(spec.http, QUARANTINED).unwrap_or(0.0) >= 1.0
    })?;
    assert_eq!(
        cluster::fetch_metric(spec.http, QUARANTINED)?,
        0.0,
        "the agent ignored TRIBUTARY_TEST_EDGE_RESEND_REFUSED: build it with edge-agent's \
         fault-injection feature (cargo build --workspace --all-targets)"
    );
    let seqs = hub_seqs(hub_spec.http)?;
    assert_eq!(
        seqs,
        (1..=5).collect::<Vec<u64>>(),
        "the lane is stuck behind the block"
    );
    agent.kill9()?;
    Ok(())
}
