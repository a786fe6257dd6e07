//! Numbers share one column: a field that arrives as integers and as decimals in one stream
//! has a single column, INT64 while only integers arrived, DOUBLE from the first decimal on
//! (integers written as doubles), or DOUBLE from the start when pinned to float. DuckDB reads
//! the field as one numeric column over old INT64 files and new DOUBLE files with
//! `union_by_name`, and with the plain glob when the field was pinned.
//!
//! The DuckDB part needs `python3 -c 'import duckdb'` to work (CI: `pip install duckdb`).

mod common;

use std::path::Path;

use anyhow::Result;
use sync::record::Value;
use tier::{
    ColumnChange, ColumnSpec, EncodeOptions, FieldRegistry, TierRecord, ValueKind, chunk_path,
    decode_chunk, encode_chunk, ingest_date,
};

const DAY1: i64 = 1_767_225_600_000_000_000; // 2026-01-01T00:00:00Z

/// `n` records from offset `first` with one field `temp`, from `value(i)`.
fn records(first: u64, n: u64, value: impl Fn(u64) -> Value) -> Vec<TierRecord> {
    (0..n)
        .map(|i| TierRecord {
            tags: Vec::new(),
            device: "dev-1".into(),
            epoch: 1,
            seq: first + i,
            offset: first + i,
            key: "k".into(),
            ts_ns: DAY1 + (first + i) as i64,
            ingest_ts_ns: DAY1 + (first + i) as i64 * 1000,
            fields: vec![("temp".into(), value(first + i))],
        })
        .collect()
}

fn int(i: u64) -> Value {
    Value::I64(60 + i as i64)
}

fn dec(i: u64) -> Value {
    Value::F64(70.25 + i as f64)
}

fn names(reg: &FieldRegistry) -> Vec<(&str, ValueKind)> {
    reg.columns()
        .iter()
        .map(|c| (c.name.as_str(), c.kind))
        .collect()
}

#[test]
fn integers_then_decimals_widen_the_column() {
    let mut reg = FieldRegistry::new();
    assert_eq!(reg.register("temp", ValueKind::I64), (0, true));
    assert_eq!(names(&reg), [("temp", ValueKind::I64)]);
    let before = reg.clone();
    assert_eq!(reg.register("temp", ValueKind::F64), (0, true));
    assert_eq!(reg.register("temp", ValueKind::I64), (0, false));
    assert_eq!(names(&reg), [("temp", ValueKind::F64)]);
    assert_eq!(
        reg.changes_since(&before),
        [ColumnChange::Widened {
            field: "temp".into(),
            column: "temp".into()
        }]
    );
    // The widened registry, stored and read back, still sends integers to the one column.
    let back = FieldRegistry::from_columns(reg.columns().to_vec()).unwrap();
    assert_eq!(back.column_of("temp", ValueKind::I64), Some(0));
}

#[test]
fn decimals_then_integers_share_the_column() {
    let mut reg = FieldRegistry::new();
    assert_eq!(reg.register("temp", ValueKind::F64), (0, true));
    assert_eq!(reg.register("temp", ValueKind::I64), (0, false));
    assert_eq!(names(&reg), [("temp", ValueKind::F64)]);
}

#[test]
fn a_kind_change_still_gets_its_own_column_and_is_reported() {
    let mut reg = FieldRegistry::new();
    reg.register("temp", ValueKind::I64);
    let before = reg.clone();
    assert_eq!(reg.register("temp", ValueKind::Str), (1, true));
    assert_eq!(
        names(&reg),
        [("temp", ValueKind::I64), ("temp__str", ValueKind::Str)]
    );
    assert_eq!(
        reg.changes_since(&before),
        [ColumnChange::NewKind {
            field: "temp".into(),
            column: "temp__str".into(),
            kind: ValueKind::Str,
            existing: vec![ValueKind::I64],
        }]
    );
}

#[test]
fn pinned_field_is_double_from_its_first_integer() {
    let mut reg = FieldRegistry::new();
    assert!(!reg.pin_float("temp"));
    assert_eq!(reg.register("temp", ValueKind::I64), (0, true));
    assert_eq!(names(&reg), [("temp", ValueKind::F64)]);
    // Pinning a field that already has an INT64 column widens it.
    let mut reg = FieldRegistry::new();
    reg.register("rpm", ValueKind::I64);
    assert!(reg.pin_float("rpm"));
    assert_eq!(names(&reg), [("rpm", ValueKind::F64)]);
}

#[test]
fn registry_from_before_shared_columns_keeps_both() {
    let spec = |name: &str, kind| ColumnSpec {
        name: name.into(),
        field: "rpm".into(),
        kind,
    };
    let mut reg = FieldRegistry::from_columns(vec![
        spec("rpm", ValueKind::I64),
        spec("rpm__f64", ValueKind::F64),
    ])
    .unwrap();
    assert_eq!(reg.column_of("rpm", ValueKind::I64), Some(0));
    assert_eq!(reg.column_of("rpm", ValueKind::F64), Some(1));
    assert_eq!(reg.register("rpm", ValueKind::F64), (1, false));
    // A DOUBLE column registered first, then an INT64 one (both stored): not a duplicate.
    let reg = FieldRegistry::from_columns(vec![
        spec("rpm", ValueKind::F64),
        spec("rpm__i64", ValueKind::I64),
    ])
    .unwrap();
    assert_eq!(reg.column_of("rpm", ValueKind::I64), Some(1));
}

#[test]
fn a_mixed_chunk_decodes_as_doubles() {
    let mut recs = records(0, 4, int);
    recs.extend(records(4, 4, dec));
    let reg = common::registry_for(&recs);
    let (bytes, _) = encode_chunk(&recs, &reg, &EncodeOptions::default()).unwrap();
    let decoded = decode_chunk(bytes).unwrap();
    let temps: Vec<Value> = decoded.iter().map(|r| r.fields[0].1.clone()).collect();
    let want: Vec<Value> = (0..8u64)
        .map(|i| match i < 4 {
            true => Value::F64((60 + i) as f64),
            false => dec(i),
        })
        .collect();
    assert_eq!(temps, want);
}

/// Writes `chunks` in order as one stream's files, observing each before it is written.
fn write(root: &Path, chunks: &[Vec<TierRecord>], mut reg: FieldRegistry) -> Result<()> {
    for recs in chunks {
        reg.observe_records(recs);
        let (bytes, _) = encode_chunk(recs, &reg, &EncodeOptions::default())?;
        let path = root.join(chunk_path(
            "s",
            1,
            recs[0].offset,
            ingest_date(recs[0].ingest_ts_ns),
        ));
        std::fs::create_dir_all(path.parent().unwrap())?;
        std::fs::write(&path, &bytes)?;
    }
    Ok(())
}

/// The field's column names and types over every file, and its values in offset order.
fn read_back(root: &Path, union_by_name: bool) -> Result<(Vec<String>, Vec<f64>)> {
    let opts = if union_by_name {
        ", union_by_name=true"
    } else {
        ""
    };
    let glob = format!("{}/streams/s/**/*.parquet", root.display());
    let cols = common::duckdb(&format!(
        "SELECT column_name || ' ' || column_type FROM (DESCRIBE SELECT * FROM read_parquet('{glob}'{opts})) \
         WHERE column_name LIKE 'temp%'"
    ))?;
    let cols = cols
        .iter()
        .map(|r| r[0].as_str().unwrap().to_owned())
        .collect();
    let vals = common::duckdb(&format!(
        "SELECT temp FROM read_parquet('{glob}'{opts}) ORDER BY hub_offset"
    ))?;
    let vals = vals.iter().map(|r| r[0].as_f64().unwrap()).collect();
    Ok((cols, vals))
}

fn expected(chunks: &[Vec<TierRecord>]) -> Vec<f64> {
    chunks
        .iter()
        .flatten()
        .map(|r| match r.fields[0].1 {
            Value::I64(v) => v as f64,
            Value::F64(v) => v,
            _ => unreachable!(),
        })
        .collect()
}

#[test]
fn duckdb_reads_one_numeric_column() -> Result<()> {
    // Integers, then decimals (an INT64 file, then a DOUBLE one), and the reverse.
    let int_first = vec![records(0, 5, int), records(5, 5, dec), records(10, 5, int)];
    let dec_first = vec![records(0, 5, dec), records(5, 5, int)];
    for (name, chunks) in [("int first", int_first), ("decimal first", dec_first)] {
        let dir = tempfile::tempdir()?;
        write(dir.path(), &chunks, FieldRegistry::new())?;
        let (cols, vals) = read_back(dir.path(), true)?;
        assert_eq!(cols, ["temp DOUBLE"], "{name}");
        assert_eq!(vals, expected(&chunks), "{name}");
    }
    Ok(())
}

#[test]
fn duckdb_reads_a_pinned_field_with_the_plain_glob() -> Result<()> {
    let chunks = vec![records(0, 5, int), records(5, 5, dec)];
    let dir = tempfile::tempdir()?;
    let mut reg = FieldRegistry::new();
    reg.pin_float("temp");
    write(dir.path(), &chunks, reg)?;
    for union_by_name in [false, true] {
        let (cols, vals) = read_back(dir.path(), union_by_name)?;
        assert_eq!(cols, ["temp DOUBLE"]);
        assert_eq!(vals, expected(&chunks));
    }
    Ok(())
}
