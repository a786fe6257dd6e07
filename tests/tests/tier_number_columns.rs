//! JSON numbers through the real binaries: an agent ships `temp` as integers (`65`), then as
//! decimals (`71.3`), then as integers again, the hub tiers each batch to local Parquet, and
//! DuckDB reads one DOUBLE `temp` column holding every value, with no `temp__i64`/`temp__f64`
//! second column. `pinned`, listed in the hub's `[streams.types]` as `"float"`, is DOUBLE from
//! its first file, so even the plain glob reads it exactly (docs/format/parquet.md).

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::json;
use tributary_tests::cluster::{AgentSpec, HubSpec, Pki};
use tributary_tests::ledger::{Ledger, PostOutcome, Producer, SentRecord};
use tributary_tests::tier2;

const STREAM: &str = "telemetry";
const BATCH: u64 = 20;

/// DuckDB over the stream's files: `temp*`/`pinned*` columns with their types, and
/// `temp`, `pinned` by seq.
fn duckdb(glob: &str, opts: &str) -> Result<serde_json::Value> {
    let script = format!(
        r#"
import duckdb, json
g = {glob:?}
c = duckdb.connect()
cols = c.execute(f"SELECT column_name || ' ' || column_type FROM (DESCRIBE SELECT * FROM read_parquet('{{g}}'{opts})) WHERE column_name LIKE 'temp%' OR column_name LIKE 'pinned%' ORDER BY column_name").fetchall()
vals = c.execute(f"SELECT temp, pinned FROM read_parquet('{{g}}'{opts}) ORDER BY seq").fetchall()
print(json.dumps([[r[0] for r in cols], [list(r) for r in vals]]))
"#
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .output()
        .context("python3 with duckdb")?;
    ensure!(
        out.status.success(),
        "duckdb: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("duckdb output")
}

#[test]
fn integers_and_decimals_of_a_field_are_one_column() -> Result<()> {
    let (_scratch, root) = tier2::scratch_dir("trb-number-columns-")?;
    let root = root.as_path();
    let pki = Pki::init(root.join("pki"))?;
    let tier2_dir = root.join("tier2");
    let mut hub_spec = HubSpec::new(root);
    hub_spec.extra_toml = format!(
        "[tier2]\nurl = \"file://{}\"\nchunk_records_max = {BATCH}\nchunk_age_max = \"1s\"\n\
         poll_interval = \"100ms\"\n[[streams]]\nname = \"{STREAM}\"\n[streams.types]\npinned = \"float\"\n",
        tier2_dir.display()
    );
    let _hub = hub_spec.start(&pki)?;
    let cert = pki.issue("dev-0", None)?;
    let agent_spec = AgentSpec::new(root, "dev-0", cert, Some(hub_spec.quic));
    let _agent = agent_spec.start()?;
    let catalog = hub_spec.data_dir.join("catalog.sqlite");

    // Integers, decimals, integers: each batch tiered before the next is sent.
    let mut want = Vec::new();
    let mut ledger = Ledger::new();
    for (b, decimal) in [false, true, false].into_iter().enumerate() {
        let batch: Vec<SentRecord> = (0..BATCH)
            .map(|i| {
                let n = b as u64 * BATCH + i;
                let (temp, pinned) = if decimal {
                    (json!(60.5 + n as f64), json!(0.25 + n as f64))
                } else {
                    (json!(60 + n), json!(n))
                };
                want.push(vec![temp.as_f64().unwrap(), pinned.as_f64().unwrap()]);
                SentRecord::new(
                    "k",
                    1_700_000_000_000_000_000 + n as i64,
                    json!({ "temp": temp, "pinned": pinned }),
                )
            })
            .collect();
        let outcome =
            Producer::new("dev-0", agent_spec.http).post(&mut ledger, STREAM, &batch, None)?;
        ensure!(
            matches!(outcome, PostOutcome::Acked(_)),
            "ingest failed: {outcome:?}"
        );
        tier2::wait_tiered(
            &catalog,
            STREAM,
            (b as u64 + 1) * BATCH,
            Duration::from_secs(60),
        )?;
    }

    let glob = format!("{}/streams/{STREAM}/**/*.parquet", tier2_dir.display());
    let got = duckdb(&glob, ", union_by_name=true")?;
    assert_eq!(got[0], json!(["pinned DOUBLE", "temp DOUBLE"]));
    assert_eq!(got[1], json!(want));
    // The pinned field's first file is DOUBLE already: the plain glob binds DOUBLE for it.
    let plain = duckdb(&glob, "")?;
    assert_eq!(plain[0], json!(["pinned DOUBLE", "temp BIGINT"]));
    let pinned: Vec<f64> = want.iter().map(|r| r[1]).collect();
    let plain_pinned: Vec<f64> = plain[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r[1].as_f64().unwrap())
        .collect();
    assert_eq!(plain_pinned, pinned);
    Ok(())
}
