//! DuckDB (python `duckdb` from pip) over a chunk file whose number columns took every path of
//! the encoder's per-column choice: mostly distinct doubles as BYTE_STREAM_SPLIT, mostly distinct
//! integers as PLAIN, low-cardinality values with a dictionary, and a sparse column. The engine
//! must read every value exactly (sums, extremes and counts equal the Rust-side figures).
//!
//! Needs `python3 -c 'import duckdb'` to work (CI: `pip install duckdb`).

mod common;

use anyhow::Result;
use sync::record::Value;
use tier::{EncodeOptions, TierRecord, encode_chunk};

fn records() -> Vec<TierRecord> {
    (0..6000u64)
        .map(|i| {
            let mut fields = vec![
                ("lat".to_owned(), Value::F64(45.0 + (i as f64) * 1.25e-6)),
                (
                    "odometer".to_owned(),
                    Value::I64((i * 7919 % 100_003) as i64),
                ),
                ("temp".to_owned(), Value::F64(20.0 + (i % 13) as f64 * 0.5)),
            ];
            if i % 10 == 0 {
                fields.push(("rare".into(), Value::F64(i as f64)));
            }
            TierRecord {
                tags: Vec::new(),
                device: format!("truck-{:04}", i % 37),
                epoch: 1,
                seq: i / 37,
                offset: i,
                key: format!("truck-{:04}/engine", i % 37),
                ts_ns: 1_767_225_600_000_000_000 + (i as i64) * 1_000_000_000,
                ingest_ts_ns: 1_767_225_600_000_000_000 + (i as i64) * 1_000_000_000,
                fields,
            }
        })
        .collect()
}

#[test]
fn duckdb_reads_every_encoding() -> Result<()> {
    let records = records();
    let registry = common::registry_for(&records);
    let options = EncodeOptions {
        row_group_rows: 2048,
        ..EncodeOptions::default()
    };
    let (bytes, _) = encode_chunk(&records, &registry, &options)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("chunk.parquet");
    std::fs::write(&path, &bytes)?;
    let file = path.display().to_string();

    // The file really holds the encodings this test is about.
    let encodings = common::duckdb(&format!(
        "SELECT path_in_schema, string_agg(DISTINCT encodings, ',') FROM parquet_metadata('{file}') GROUP BY 1"
    ))?;
    let enc_of = |col: &str| {
        encodings
            .iter()
            .find(|r| r[0].as_str() == Some(col))
            .and_then(|r| r[1].as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    assert!(enc_of("lat").contains("BYTE_STREAM_SPLIT"), "{encodings:?}");
    assert!(!enc_of("odometer").contains("DICTIONARY"), "{encodings:?}");
    assert!(enc_of("temp").contains("DICTIONARY"), "{encodings:?}");

    let rows = common::duckdb(&format!(
        "SELECT count(*), sum(lat), min(lat), max(lat), sum(odometer), max(odometer), \
         sum(temp), count(rare), sum(rare), count(DISTINCT device) FROM read_parquet('{file}')"
    ))?;
    let row = &rows[0];
    let num = |v: &serde_json::Value| -> f64 {
        v.as_f64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .unwrap_or(f64::NAN)
    };
    let field = |r: &TierRecord, name: &str| {
        r.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| match v {
                Value::F64(x) => *x,
                Value::I64(x) => *x as f64,
                _ => f64::NAN,
            })
    };
    let sum = |name: &str| records.iter().filter_map(|r| field(r, name)).sum::<f64>();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    assert_eq!(num(&row[0]), records.len() as f64);
    assert!(close(num(&row[1]), sum("lat")), "{row:?}");
    assert_eq!(num(&row[2]), 45.0);
    assert!(close(num(&row[3]), 45.0 + 5999.0 * 1.25e-6), "{row:?}");
    assert_eq!(num(&row[4]), sum("odometer"));
    let max_odo = records
        .iter()
        .filter_map(|r| field(r, "odometer"))
        .fold(f64::MIN, f64::max);
    assert_eq!(num(&row[5]), max_odo);
    assert!(close(num(&row[6]), sum("temp")), "{row:?}");
    assert_eq!(num(&row[7]), 600.0);
    assert_eq!(num(&row[8]), sum("rare"));
    assert_eq!(num(&row[9]), 37.0);
    Ok(())
}
