//! Idle agents learn their tier-2 mark (issue 7): "tiered_seq goes back to the agents over the
//! replication protocol once their data is in tier 2, so the edge can free it".
//!
//! A hub tiering to a local directory (chunks sealed by age only, after 10 s) and one agent as
//! real processes. The agent ingests one batch, ships it and is acknowledged long before tier 2
//! holds it, then stays idle on the same session: no new data means no new ack of data, so
//! the new `tiered_seq` can only reach it through the hub's tiering push (`core-hub` server,
//! `Hub::subscribe_tiered`). Its `/v1/status` must show `tiered_seq` reaching `durable_seq`.

use std::time::Duration;

use anyhow::{Result, ensure};
use serde_json::json;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::procs::wait_until;
use tributary_tests::tier2;

const STREAM: &str = "telemetry";
const RECORDS: u64 = 1_000;

#[test]
fn idle_agent_learns_tiered_seq() -> Result<()> {
    let (_scratch, root) = tier2::scratch_dir("trb-tier-ack-")?;
    let root = root.as_path();
    let pki = Pki::init(root.join("pki"))?;
    let tier2_dir = root.join("tier2");
    let mut hub_spec = HubSpec::new(root);
    // Only age seals a chunk, 10 s after its first record: the data ack always comes first.
    hub_spec.extra_toml = format!(
        "[tier2]\nurl = \"file://{}\"\nchunk_records_max = 1000000\nchunk_age_max = \"10s\"\n\
         poll_interval = \"100ms\"\n",
        tier2_dir.display()
    );
    let _hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-0", None)?;
    let agent_spec = AgentSpec::new(root, "dev-0", cert, Some(hub_spec.quic));
    let _agent = agent_spec.start()?;

    let batch: Vec<SentRecord> = (0..RECORDS)
        .map(|i| {
            SentRecord::new(
                format!("k{}", i % 8),
                1_700_000_000_000_000_000 + i as i64,
                json!({ "i": i }),
            )
        })
        .collect();
    let mut ledger = Ledger::new();
    let outcome =
        Producer::new("dev-0", agent_spec.http).post(&mut ledger, STREAM, &batch, None)?;
    ensure!(
        matches!(outcome, PostOutcome::Acked(_)),
        "ingest failed: {outcome:?}"
    );

    let acked = cluster::wait_caught_up(agent_spec.http, Duration::from_secs(30))?;
    let durable = cluster::stream_u64(&acked, STREAM, "durable_seq");
    ensure!(
        durable >= RECORDS,
        "durable_seq {durable} after {RECORDS} records: {acked}"
    );
    let tiered_at_ack = cluster::stream_u64(&acked, STREAM, "tiered_seq");
    ensure!(
        tiered_at_ack < durable,
        "tier 2 held the data before its ack ({tiered_at_ack} >= {durable}): the test proves nothing"
    );

    // Nothing more is ingested: only the push can move the agent's tiered_seq.
    let mut last = acked;
    let reached = wait_until(
        Duration::from_secs(60),
        "tiered_seq to reach durable_seq",
        || match cluster::status(agent_spec.http) {
            Ok(s) => {
                let done = cluster::stream_u64(&s, STREAM, "tiered_seq") >= durable;
                last = s;
                done
            }
            Err(_) => false,
        },
    );
    ensure!(
        reached.is_ok(),
        "the idle agent never learned its tiered_seq; last status: {last}"
    );
    ensure!(
        cluster::stream_u64(&last, STREAM, "durable_seq") == durable,
        "the agent wrote new data during the test: {last}"
    );
    Ok(())
}
