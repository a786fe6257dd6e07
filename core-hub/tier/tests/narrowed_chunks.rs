//! A chunk file carries only the columns its records use, not every column the stream's
//! registry ever saw (`FieldRegistry::narrowed_to`): a stream that once had a thousand
//! fields does not write a thousand empty columns into each later file. The hub's decoder
//! reads each file by its own column specs, and DuckDB with `union_by_name` sees the stream's
//! whole schema over its files.
//!
//! Needs `python3 -c 'import duckdb'` for the SQL check (CI: `pip install duckdb`).

mod common;

use anyhow::Result;
use bytes::Bytes;
use parquet::file::reader::{FileReader, SerializedFileReader};
use sync::record::Value;
use tier::{EncodeOptions, FieldRegistry, TierRecord, decode_chunk, encode_chunk};

/// Records `offsets` with one field each: `name` = offset.
fn with_field(offsets: std::ops::Range<u64>, name: &str) -> Vec<TierRecord> {
    let mut rs = common::telemetry(1, offsets.clone().count(), offsets.start, 0);
    for r in &mut rs {
        r.fields = vec![(name.into(), Value::I64(r.offset as i64))];
    }
    rs
}

/// The field column names in a Parquet file's schema.
fn field_columns(bytes: &Bytes) -> Result<Vec<String>> {
    let reader = SerializedFileReader::new(bytes.clone())?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let fixed = tier::chunk::arrow_schema(&FieldRegistry::new());
    Ok(schema
        .columns()
        .iter()
        .map(|c| c.name().to_string())
        .filter(|n| fixed.field_with_name(n).is_err())
        .collect())
}

#[test]
fn chunks_carry_only_the_columns_their_records_use() -> Result<()> {
    // The stream's registry holds a flood of fields from its past.
    let mut registry = FieldRegistry::new();
    for i in 0..500 {
        registry.register(&format!("old{i}"), tier::ValueKind::F64);
    }
    let first = with_field(0..50, "a");
    let second = with_field(50..100, "b");
    registry.observe_records(&first);
    registry.observe_records(&second);
    assert_eq!(registry.len(), 502);

    let opts = EncodeOptions::default();
    let (f1, _) = encode_chunk(&first, &registry, &opts)?;
    let (f2, _) = encode_chunk(&second, &registry, &opts)?;
    assert_eq!(field_columns(&f1)?, vec!["a"]);
    assert_eq!(field_columns(&f2)?, vec!["b"]);
    // Each file decodes to exactly its records.
    assert_eq!(decode_chunk(f1.clone())?, first);
    assert_eq!(decode_chunk(f2.clone())?, second);

    // A registry whose every column is used is written whole, as before.
    let used = registry.narrowed_to(&first);
    assert_eq!(used.columns().len(), 1);
    assert_eq!(used.narrowed_to(&first), used);

    // DuckDB over both files sees both columns with union_by_name.
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("1.parquet"), &f1)?;
    std::fs::write(dir.path().join("2.parquet"), &f2)?;
    let glob = format!("{}/*.parquet", dir.path().display());
    let rows = common::duckdb(&format!(
        "SELECT count(*), sum(a), sum(b), count(a), count(b) \
         FROM read_parquet('{glob}', union_by_name = true)"
    ))?;
    let sum = |r: std::ops::Range<i64>| r.sum::<i64>();
    assert_eq!(
        serde_json::json!(rows[0]),
        serde_json::json!([100, sum(0..50), sum(50..100), 50, 50])
    );
    Ok(())
}
