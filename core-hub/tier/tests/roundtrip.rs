//! Encode/decode round trips of chunk files (property tests), the schema-evolution naming rule,
//! and bad input: every record, field type change and new field survives Parquet exactly.

mod common;

use bytes::Bytes;
use proptest::prelude::*;
use sync::record::Value;
use tier::schema::FIXED_COLUMNS;
use tier::{
    ColumnSpec, EncodeError, EncodeOptions, FieldRegistry, TierRecord, ValueKind, decode_chunk,
    encode_chunk,
};

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<f64>().prop_map(Value::F64),
        any::<u64>().prop_map(|b| Value::F64(f64::from_bits(b))),
        any::<i64>().prop_map(Value::I64),
        any::<bool>().prop_map(Value::Bool),
        ".{0,12}".prop_map(Value::Str),
        proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::Bytes),
    ]
}

/// Field names include collisions with fixed columns, case variants and `__type` look-alikes.
fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("temp".to_owned()),
        Just("Temp".to_owned()),
        Just("rpm".to_owned()),
        Just("ts".to_owned()),
        Just("key".to_owned()),
        Just("temp__i64".to_owned()),
        Just("état".to_owned()),
        "[a-z]{1,3}",
    ]
}

fn record() -> impl Strategy<Value = TierRecord> {
    (
        0u8..4,
        0u64..3,
        0u64..(i64::MAX as u64),
        ".{0,10}",
        any::<i64>(),
        any::<i64>(),
        proptest::collection::vec((field_name(), value()), 0..6),
    )
        .prop_map(|(d, epoch, seq, key, ts_ns, ingest, fields)| {
            let mut seen = std::collections::HashSet::new();
            let fields = fields
                .into_iter()
                .filter(|(n, _)| seen.insert(n.clone()))
                .collect();
            TierRecord {
                tags: Vec::new(),
                device: format!("d{d}"),
                epoch,
                seq,
                offset: 0,
                key,
                ts_ns,
                ingest_ts_ns: ingest,
                fields,
            }
        })
}

/// Chunks of records with dense increasing offsets across chunks.
fn chunks() -> impl Strategy<Value = Vec<Vec<TierRecord>>> {
    proptest::collection::vec(proptest::collection::vec(record(), 1..40), 1..5).prop_map(
        |mut chunks| {
            let mut offset = 0;
            for c in &mut chunks {
                for r in c.iter_mut() {
                    r.offset = offset;
                    offset += 1;
                }
            }
            chunks
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Each chunk is encoded with the registry as it stands after observing it (columns only
    /// grow), decodes to the same records, and its schema is a prefix of every later one.
    #[test]
    fn chunks_round_trip_with_evolving_schema(chunks in chunks(), rg in 1usize..50) {
        let mut registry = FieldRegistry::new();
        let options = EncodeOptions { row_group_rows: rg, ..EncodeOptions::default() };
        let mut previous: Vec<ColumnSpec> = Vec::new();
        for chunk in &chunks {
            registry.observe_records(chunk);
            // Columns keep their place and name; a kind only ever widens, INT64 to DOUBLE.
            for (now, before) in registry.columns().iter().zip(&previous) {
                prop_assert_eq!((&now.name, &now.field), (&before.name, &before.field));
                prop_assert!(now.kind == before.kind
                    || (before.kind == ValueKind::I64 && now.kind == ValueKind::F64));
            }
            prop_assert!(registry.len() >= previous.len());
            previous = registry.columns().to_vec();
            let (bytes, summary) = encode_chunk(chunk, &registry, &options).unwrap();
            prop_assert_eq!(summary.rows, chunk.len() as u64);
            prop_assert_eq!(summary.bytes, bytes.len() as u64);
            prop_assert_eq!(summary.min_offset, chunk[0].offset);
            prop_assert_eq!(summary.max_offset, chunk[chunk.len() - 1].offset);
            let count: u64 = summary.seq_ranges.iter().map(|s| s.count).sum();
            prop_assert_eq!(count, chunk.len() as u64);
            let decoded = decode_chunk(bytes).unwrap();
            prop_assert_eq!(
                common::normalized(&decoded),
                common::normalized(&common::as_stored(chunk, &registry))
            );
        }
        // Names are a pure function of the order of observation.
        let mut again = FieldRegistry::new();
        for chunk in &chunks {
            again.observe_records(chunk);
        }
        prop_assert_eq!(&again, &registry);
        let json = serde_json::to_string(&registry).unwrap();
        let back: FieldRegistry = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(back, registry.clone());
        // No column name collides, case-insensitively, with another or a fixed column.
        let mut names: Vec<String> = registry.columns().iter().map(|c| c.name.to_ascii_lowercase()).collect();
        names.extend(FIXED_COLUMNS.iter().map(|s| s.to_string()));
        let n = names.len();
        names.sort();
        names.dedup();
        prop_assert_eq!(names.len(), n);
    }

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut framed = b"PAR1".to_vec();
        framed.extend_from_slice(&bytes);
        framed.extend_from_slice(b"PAR1");
        let _ = decode_chunk(Bytes::from(framed));
        let _ = decode_chunk(Bytes::from(bytes));
    }
}

#[test]
fn evolution_rule_names() {
    let mut reg = FieldRegistry::new();
    assert_eq!(reg.register("temp", ValueKind::F64), (0, true));
    assert_eq!(reg.register("temp", ValueKind::F64), (0, false));
    // Integers of a field with a DOUBLE column share it.
    assert_eq!(reg.register("temp", ValueKind::I64), (0, false));
    assert_eq!(reg.register("temp", ValueKind::Bool), (1, true));
    assert_eq!(reg.register("ts", ValueKind::F64), (2, true));
    assert_eq!(reg.register("Temp", ValueKind::Str), (3, true));
    assert_eq!(reg.register("temp__bool", ValueKind::Bool), (4, true));
    assert_eq!(reg.register("state", ValueKind::Str), (5, true));
    assert_eq!(reg.register("state", ValueKind::Bytes), (6, true));
    let names: Vec<&str> = reg.columns().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "temp",
            "temp__bool",
            "ts__f64",
            "Temp__str",
            "temp__bool__2",
            "state",
            "state__bytes"
        ]
    );
    assert_eq!(reg.column_of("temp", ValueKind::I64), Some(0));
    assert_eq!(reg.column_of("temp", ValueKind::Str), None);
    let json = serde_json::to_value(&reg).unwrap();
    assert_eq!(
        json[1],
        serde_json::json!({"name": "temp__bool", "field": "temp", "kind": "bool"})
    );
}

#[test]
fn registry_rejects_inconsistent_specs() {
    let spec = |name: &str, field: &str, kind| ColumnSpec {
        name: name.into(),
        field: field.into(),
        kind,
    };
    assert!(matches!(
        FieldRegistry::from_columns(vec![
            spec("a", "a", ValueKind::F64),
            spec("A", "b", ValueKind::F64)
        ]),
        Err(tier::RegistryError::DuplicateColumn { .. })
    ));
    assert!(matches!(
        FieldRegistry::from_columns(vec![spec("ts", "ts", ValueKind::F64)]),
        Err(tier::RegistryError::FixedColumn { .. })
    ));
    assert!(matches!(
        FieldRegistry::from_columns(vec![
            spec("a", "a", ValueKind::F64),
            spec("b", "a", ValueKind::F64)
        ]),
        Err(tier::RegistryError::DuplicateField { .. })
    ));
}

#[test]
fn encode_rejects_bad_input() {
    let records = common::telemetry(2, 3, 0, 1_700_000_000_000_000_000);
    let empty = FieldRegistry::new();
    let opts = EncodeOptions::default();
    assert!(matches!(
        encode_chunk(&records, &empty, &opts),
        Err(EncodeError::UnregisteredField { offset: 0, .. })
    ));
    let reg = common::registry_for(&records);
    assert!(matches!(
        encode_chunk(&[], &reg, &opts),
        Err(EncodeError::Empty)
    ));
    let mut dup = records.clone();
    dup[1].fields.push(("temp".into(), Value::F64(1.0)));
    assert!(matches!(
        encode_chunk(&dup, &reg, &opts),
        Err(EncodeError::DuplicateField { offset: 1, .. })
    ));
    let mut big = records.clone();
    big[2].seq = u64::MAX;
    assert!(matches!(
        encode_chunk(&big, &reg, &opts),
        Err(EncodeError::OutOfRange { what: "seq", .. })
    ));
    let zero = EncodeOptions {
        row_group_rows: 0,
        ..EncodeOptions::default()
    };
    assert!(matches!(
        encode_chunk(&records, &reg, &zero),
        Err(EncodeError::Options(_))
    ));
}

#[test]
fn truncated_and_corrupted_files_fail_cleanly() {
    let records = common::telemetry(5, 20, 0, 1_700_000_000_000_000_000);
    let reg = common::registry_for(&records);
    let (bytes, _) = encode_chunk(&records, &reg, &EncodeOptions::default()).unwrap();
    for cut in [0, 4, 8, bytes.len() / 2, bytes.len() - 9, bytes.len() - 1] {
        assert!(decode_chunk(bytes.slice(..cut)).is_err(), "cut at {cut}");
    }
    // Flip bytes all over the file: decoding may fail or (for data bytes) succeed, but never
    // panic.
    for pos in (0..bytes.len()).step_by(bytes.len() / 97 + 1) {
        let mut v = bytes.to_vec();
        v[pos] ^= 0x5a;
        let _ = decode_chunk(Bytes::from(v));
    }
}

#[test]
fn row_groups_and_statistics_are_written() {
    let records = common::telemetry(10, 100, 5000, 1_700_000_000_000_000_000);
    let reg = common::registry_for(&records);
    let opts = EncodeOptions {
        row_group_rows: 256,
        ..EncodeOptions::default()
    };
    let (bytes, summary) = encode_chunk(&records, &reg, &opts).unwrap();
    let meta = parquet::file::metadata::ParquetMetaDataReader::new()
        .parse_and_finish(&bytes)
        .unwrap();
    assert_eq!(meta.num_row_groups(), 1000usize.div_ceil(256));
    let schema = meta.file_metadata().schema_descr();
    let col = |name: &str| {
        schema
            .columns()
            .iter()
            .position(|c| c.name() == name)
            .unwrap()
    };
    for name in ["ts", "key", "hub_offset", "ingest_ts"] {
        let i = col(name);
        for rg in meta.row_groups() {
            let stats = rg.column(i).statistics().expect("statistics");
            assert!(
                stats.min_bytes_opt().is_some() && stats.max_bytes_opt().is_some(),
                "{name}"
            );
        }
    }
    assert!(
        meta.row_groups()[0]
            .column(col("key"))
            .bloom_filter_offset()
            .is_some()
    );
    assert_eq!(summary.min_offset, 5000);
    assert_eq!(summary.max_offset, 5999);
    assert_eq!(summary.seq_ranges.len(), 10);
    assert_eq!(summary.seq_ranges[0].min_seq, 0);
    assert_eq!(summary.seq_ranges[0].max_seq, 99);
    // The logical type engines see for ts.
    let ts = &schema.columns()[col("ts")];
    assert!(
        format!("{:?}", ts.logical_type_ref()).contains("is_adjusted_to_u_t_c: true"),
        "{:?}",
        ts.logical_type_ref()
    );
}

#[test]
fn parallel_decode_keeps_order() {
    let records = common::telemetry(50, 2000, 7, 1_700_000_000_000_000_000);
    let reg = common::registry_for(&records);
    let opts = EncodeOptions {
        row_group_rows: 30_000,
        ..EncodeOptions::default()
    };
    let (bytes, _) = encode_chunk(&records, &reg, &opts).unwrap();
    let one = tier::decode_chunk_with_threads(bytes.clone(), 1).unwrap();
    let three = tier::decode_chunk_with_threads(bytes.clone(), 3).unwrap();
    assert_eq!(one, three);
    assert_eq!(common::normalized(&one), common::normalized(&records));
    assert_eq!(decode_chunk(bytes).unwrap(), one);
}
