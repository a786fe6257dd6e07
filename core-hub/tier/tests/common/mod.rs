//! Shared generators for the tier tests (included with `mod common;`).

#![allow(dead_code)]

use anyhow::{Context, Result, bail};
use std::process::Command;
use sync::record::Value;
use tier::{FieldRegistry, TierRecord};

/// Records of `devices` devices x `per_device` seqs with telemetry-like fields, offsets from
/// `first_offset`, ingest time `ingest_ns` + offset ms.
pub fn telemetry(
    devices: usize,
    per_device: usize,
    first_offset: u64,
    ingest_ns: i64,
) -> Vec<TierRecord> {
    let mut out = Vec::with_capacity(devices * per_device);
    let mut offset = first_offset;
    for s in 0..per_device {
        for d in 0..devices {
            out.push(TierRecord {
                tags: Vec::new(),
                device: format!("dev-{d:03}"),
                epoch: 1,
                seq: s as u64,
                offset,
                key: format!("truck-{d:03}/engine"),
                ts_ns: 1_700_000_000_000_000_000 + (s as i64) * 1_000_000_000 + d as i64,
                ingest_ts_ns: ingest_ns + (offset as i64) * 1_000_000,
                fields: vec![
                    ("temp".into(), Value::F64(20.0 + (s % 17) as f64 * 0.5)),
                    ("rpm".into(), Value::I64(1000 + (s as i64 % 300))),
                    ("ok".into(), Value::Bool(s % 5 != 0)),
                ],
            });
            offset += 1;
        }
    }
    out
}

/// Observes and returns a registry covering `records`.
pub fn registry_for(records: &[TierRecord]) -> FieldRegistry {
    let mut reg = FieldRegistry::new();
    reg.observe_records(records);
    reg
}

/// Records with fields sorted by name, for order-insensitive comparison (decode returns
/// fields in column order), and ingest time truncated to microseconds (its stored precision).
pub fn normalized(records: &[TierRecord]) -> Vec<TierRecord> {
    records
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.fields
                .sort_by(|a, b| a.0.cmp(&b.0).then(a.1.type_tag().cmp(&b.1.type_tag())));
            r.ingest_ts_ns = r.ingest_ts_ns.div_euclid(1000) * 1000;
            r
        })
        .collect()
}

/// Records as a chunk encoded with `registry` stores them: an integer of a field whose number
/// column is DOUBLE reads back as a double.
pub fn as_stored(records: &[TierRecord], registry: &FieldRegistry) -> Vec<TierRecord> {
    records
        .iter()
        .map(|r| {
            let mut r = r.clone();
            for (name, value) in r.fields.iter_mut() {
                if let Value::I64(v) = *value {
                    let col = registry.column_of(name, tier::ValueKind::I64);
                    if col.is_some_and(|c| registry.columns()[c].kind == tier::ValueKind::F64) {
                        *value = Value::F64(v as f64);
                    }
                }
            }
            r
        })
        .collect()
}

/// Runs `sql` in DuckDB (Python) and returns its rows as JSON values.
pub fn duckdb(sql: &str) -> Result<Vec<Vec<serde_json::Value>>> {
    let script = r#"
import sys, json, duckdb
rows = duckdb.connect().execute(sys.argv[1]).fetchall()
print(json.dumps([list(r) for r in rows], default=str))
"#;
    let out = Command::new("python3")
        .args(["-c", script, sql])
        .output()
        .context("running python3")?;
    if !out.status.success() {
        bail!(
            "duckdb query failed (is `pip install duckdb` done?): {sql}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("parsing duckdb output")
}
