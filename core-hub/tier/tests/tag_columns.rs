//! Tags are real columns: each tag of a stream is a UTF-8 column of kind `tag`, named after the
//! tag, beside the field columns. A tag and a field of one name are two columns (the second to
//! arrive gets the typed name), a tag named like a fixed column is `{name}__tag`, and a chunk
//! decodes back to the records' tags. DuckDB filters and groups by a tag column directly.
//!
//! The DuckDB part needs `python3 -c 'import duckdb'` to work (CI: `pip install duckdb`).

mod common;

use anyhow::Result;
use sync::record::Value;
use tier::{EncodeOptions, FieldRegistry, TierRecord, ValueKind, decode_chunk, encode_chunk};

const DAY1: i64 = 1_767_225_600_000_000_000; // 2026-01-01T00:00:00Z

fn tag(n: &str, v: &str) -> (String, String) {
    (n.into(), v.into())
}

/// Records of two hosts; every third has no `line` tag; a field `host` shares a tag's name.
fn records() -> Vec<TierRecord> {
    (0..12u64)
        .map(|i| {
            let host = if i % 2 == 0 { "gw-01" } else { "gw-02" };
            let mut tags = vec![tag("host", host)];
            if i % 3 != 0 {
                tags.push(tag("line", &format!("press{}", i % 3)));
            }
            TierRecord {
                device: "dev-1".into(),
                epoch: 1,
                seq: i + 1,
                offset: i,
                key: sync::record::key_from_tags(&tags),
                tags,
                ts_ns: DAY1 + i as i64,
                ingest_ts_ns: DAY1 + i as i64 * 1000,
                fields: vec![
                    ("temp".into(), Value::F64(20.0 + i as f64)),
                    ("host".into(), Value::Str(format!("field-{i}"))),
                ],
            }
        })
        .collect()
}

fn names(reg: &FieldRegistry) -> Vec<(&str, ValueKind)> {
    reg.columns()
        .iter()
        .map(|c| (c.name.as_str(), c.kind))
        .collect()
}

#[test]
fn tags_get_columns_of_their_own_namespace() {
    let reg = common::registry_for(&records());
    assert_eq!(
        names(&reg),
        // In order of arrival: the first record has no `line` tag.
        [
            ("host", ValueKind::Tag),
            ("temp", ValueKind::F64),
            ("host__str", ValueKind::Str),
            ("line", ValueKind::Tag),
        ]
    );
    // The other order: the field came first, so the tag takes the typed name.
    let mut reg = FieldRegistry::new();
    reg.register("host", ValueKind::Str);
    assert_eq!(reg.register("host", ValueKind::Tag), (1, true));
    assert_eq!(reg.columns()[1].name, "host__tag");
    // A tag named like a fixed column.
    let mut reg = FieldRegistry::new();
    reg.register("device", ValueKind::Tag);
    assert_eq!(reg.columns()[0].name, "device__tag");
    // The registry round-trips through its stored form with the tag kind.
    let stored = serde_json::to_string(&reg).unwrap();
    assert!(stored.contains(r#""kind":"tag""#), "{stored}");
    let back: FieldRegistry = serde_json::from_str(&stored).unwrap();
    assert_eq!(back, reg);
}

#[test]
fn a_chunk_decodes_back_to_the_tags() {
    let recs = records();
    let reg = common::registry_for(&recs);
    let (bytes, _) = encode_chunk(&recs, &reg, &EncodeOptions::default()).unwrap();
    let decoded = decode_chunk(bytes).unwrap();
    assert_eq!(common::normalized(&decoded), common::normalized(&recs));
    // A duplicate tag name within a record is refused, not silently dropped.
    let mut bad = records();
    bad[3].tags.push(tag("host", "again"));
    let err = encode_chunk(&bad, &reg, &EncodeOptions::default()).unwrap_err();
    assert!(err.to_string().contains("host"), "{err}");
}

#[test]
fn duckdb_filters_and_groups_by_a_tag_column() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let recs = records();
    let reg = common::registry_for(&recs);
    let (bytes, _) = encode_chunk(&recs, &reg, &EncodeOptions::default())?;
    let path = dir.path().join("c.parquet");
    std::fs::write(&path, &bytes)?;
    let file = path.display();
    let types = common::duckdb(&format!(
        "SELECT column_name || ' ' || column_type FROM (DESCRIBE SELECT * FROM read_parquet('{file}')) \
         WHERE column_name IN ('host', 'line', 'host__str')"
    ))?;
    let types: Vec<&str> = types.iter().map(|r| r[0].as_str().unwrap()).collect();
    assert_eq!(types, ["host VARCHAR", "host__str VARCHAR", "line VARCHAR"]);
    let rows = common::duckdb(&format!(
        "SELECT host, count(*), count(line) FROM read_parquet('{file}') \
         WHERE host = 'gw-01' GROUP BY host"
    ))?;
    assert_eq!(rows, [vec![serde_json::json!("gw-01"), 6.into(), 4.into()]]);
    Ok(())
}
