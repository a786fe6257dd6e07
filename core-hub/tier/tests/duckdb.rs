//! DuckDB (python `duckdb` from pip) over chunk files in a local tier-2 directory: the SQL
//! engine sees exactly the records written, across files whose schema evolved (new fields, a
//! field changing type), through `read_parquet('<tier2>/streams/telemetry/**/*.parquet')`.
//!
//! Needs `python3 -c 'import duckdb'` to work (CI: `pip install duckdb`).

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use anyhow::Result;
use sync::record::Value;
use tier::{
    EncodeOptions, FieldRegistry, Tier2, TierConfig, TierRecord, chunk_path, encode_chunk,
    ingest_date,
};

const DAY1: i64 = 1_767_225_600_000_000_000; // 2026-01-01T00:00:00Z
const DAY2: i64 = DAY1 + 86_400_000_000_000;

/// Three chunks of one stream over two ingest days: the second adds a string field, the third
/// changes `rpm` from i64 to f64 and adds a bool.
fn chunks() -> Vec<(u64, Vec<TierRecord>)> {
    let mut c1 = common::telemetry(7, 30, 0, DAY1 + 3_600_000_000_000);
    for r in &mut c1 {
        r.fields.retain(|(n, _)| n != "ok");
    }
    let mut c2 = common::telemetry(7, 30, 210, DAY1 + 7_200_000_000_000);
    for (i, r) in c2.iter_mut().enumerate() {
        r.fields.retain(|(n, _)| n != "ok");
        r.seq += 30;
        if i % 3 == 0 {
            r.fields
                .push(("state".into(), Value::Str(format!("s{}", i % 4))));
        }
    }
    let mut c3 = common::telemetry(7, 30, 420, DAY2);
    for r in c3.iter_mut() {
        r.seq += 60;
        for f in r.fields.iter_mut() {
            if let ("rpm", Value::I64(v)) = (f.0.as_str(), &f.1) {
                f.1 = Value::F64(*v as f64 + 0.25);
            }
        }
    }
    // Segment 1 holds the first two chunks, segment 2 the third (e.g. after a split).
    vec![(1, c1), (1, c2), (2, c3)]
}

async fn write_tier(root: &Path) -> Result<(Vec<TierRecord>, FieldRegistry)> {
    let tier = Tier2::open(&TierConfig::Local {
        root: root.to_path_buf(),
    })?;
    let mut registry = FieldRegistry::new();
    let mut all = Vec::new();
    for (segment, records) in chunks() {
        registry.observe_records(&records);
        let (bytes, summary) = encode_chunk(&records, &registry, &EncodeOptions::default())?;
        let path = chunk_path(
            "telemetry",
            segment,
            records[0].offset,
            ingest_date(records[0].ingest_ts_ns),
        );
        tier.put_chunk(&path, bytes).await?;
        tier.verify_chunk(&path, &summary).await?;
        all.extend(records);
    }
    Ok((all, registry))
}

fn f(v: &serde_json::Value) -> f64 {
    v.as_f64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duckdb_reads_what_was_written() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (records, registry) = write_tier(dir.path()).await?;
    let names: Vec<&str> = registry.columns().iter().map(|c| c.name.as_str()).collect();
    // `rpm` went from integers to decimals: one column, widened to DOUBLE in the third file.
    assert_eq!(names, ["temp", "rpm", "state", "ok"]);
    let glob = format!("{}/streams/telemetry/**/*.parquet", dir.path().display());
    assert!(
        dir.path()
            .join(
                "streams/telemetry/ingest_date=2026-01-02/seg-00000002-00000000000000000420.parquet"
            )
            .is_file()
    );

    // Expected figures, computed from what was written.
    let distinct: HashSet<(&str, u64, u64)> = records
        .iter()
        .map(|r| (r.device.as_str(), r.epoch, r.seq))
        .collect();
    let mut per_device: BTreeMap<&str, (f64, u32)> = BTreeMap::new();
    for r in &records {
        if let Some(Value::F64(t)) = r.fields.iter().find(|f| f.0 == "temp").map(|f| &f.1) {
            let e = per_device.entry(&r.device).or_default();
            e.0 += t;
            e.1 += 1;
        }
    }
    let sum_rpm_i64: i64 = records
        .iter()
        .filter_map(|r| match r.fields.iter().find(|f| f.0 == "rpm") {
            Some((_, Value::I64(v))) => Some(*v),
            _ => None,
        })
        .sum();
    let sum_rpm_f64: f64 = records
        .iter()
        .filter_map(|r| match r.fields.iter().find(|f| f.0 == "rpm") {
            Some((_, Value::F64(v))) => Some(*v),
            _ => None,
        })
        .sum();
    let states = records
        .iter()
        .filter(|r| r.fields.iter().any(|f| f.0 == "state"))
        .count();

    // The plain form the issue asks for: it binds the first file's columns, which every later
    // file also has (files only gain trailing columns), so counts and averages are right.
    for opts in ["", ", union_by_name=true"] {
        let rows = common::duckdb(&format!(
            "SELECT count(*), count(DISTINCT (device, epoch, seq)), count(DISTINCT hub_offset), \
             min(hub_offset), max(hub_offset) FROM read_parquet('{glob}'{opts})"
        ))?;
        assert_eq!(
            serde_json::json!(rows[0]),
            serde_json::json!([
                records.len(),
                distinct.len(),
                records.len(),
                0,
                records.len() - 1
            ]),
            "opts {opts:?}"
        );
        let rows = common::duckdb(&format!(
            "SELECT device, avg(temp), count(temp) FROM read_parquet('{glob}'{opts}) \
             GROUP BY device ORDER BY device"
        ))?;
        assert_eq!(rows.len(), per_device.len());
        for (row, (dev, (sum, n))) in rows.iter().zip(&per_device) {
            assert_eq!(row[0], serde_json::json!(dev));
            assert!((f(&row[1]) - sum / f64::from(*n)).abs() < 1e-9, "{row:?}");
            assert_eq!(row[2], serde_json::json!(n));
        }
    }

    // Columns added after the first file need union_by_name=true (DuckDB binds the first
    // file's schema otherwise).
    let rows = common::duckdb(&format!(
        "SELECT sum(rpm), count(rpm), count(state), count(ok), count(DISTINCT ingest_date), \
         any_value(typeof(rpm)) FROM read_parquet('{glob}', union_by_name=true)"
    ))?;
    let rpm_all = sum_rpm_i64 as f64 + sum_rpm_f64;
    assert!((f(&rows[0][0]) - rpm_all).abs() < 1e-6, "{rows:?}");
    assert_eq!(rows[0][1], serde_json::json!(records.len()));
    assert_eq!(rows[0][2], serde_json::json!(states));
    assert_eq!(rows[0][4], serde_json::json!(2));
    assert_eq!(rows[0][5], serde_json::json!("DOUBLE"));
    assert!(
        common::duckdb(&format!("SELECT count(state) FROM read_parquet('{glob}')")).is_err(),
        "plain form unexpectedly sees a column added later; update docs/format/parquet.md"
    );
    // The plain form binds the first file's INT64 `rpm` and casts the later doubles to it:
    // docs/format/parquet.md says to read a widened field with union_by_name.
    let rows = common::duckdb(&format!(
        "SELECT any_value(typeof(rpm)) FROM read_parquet('{glob}')"
    ))?;
    assert_eq!(rows[0][0], serde_json::json!("BIGINT"));

    // Event time is a UTC timestamp with microsecond precision; pruning by time and key.
    let first = &records[0];
    let rows = common::duckdb(&format!(
        "SELECT typeof(ts), epoch_us(min(ts)), typeof(ingest_ts), typeof(epoch) \
         FROM read_parquet('{glob}') GROUP BY ALL"
    ))?;
    assert_eq!(rows[0][0], serde_json::json!("TIMESTAMP WITH TIME ZONE"));
    assert_eq!(rows[0][1], serde_json::json!(first.ts_ns / 1000));
    assert_eq!(rows[0][3], serde_json::json!("BIGINT"));
    let rows = common::duckdb(&format!(
        "SELECT count(*) FROM read_parquet('{glob}') WHERE key = 'truck-003/engine' \
         AND ts >= make_timestamptz({}::BIGINT)",
        first.ts_ns / 1000 + 10_000_000
    ))?;
    let expected = records
        .iter()
        .filter(|r| {
            r.key == "truck-003/engine" && r.ts_ns / 1000 >= first.ts_ns / 1000 + 10_000_000
        })
        .count();
    assert_eq!(rows[0][0], serde_json::json!(expected));
    Ok(())
}
