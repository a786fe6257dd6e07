//! The fast chunk encoder (typed column buffers, per-column dictionary choice, column chunks on
//! several threads) against a plain reference encoder with the old semantics (Arrow builders,
//! one `ArrowWriter`, Parquet's default encodings): on odd inputs both files decode to the same
//! records and carry the same Arrow schema, and the fast encoder's bytes do not depend on its
//! thread count. Odd inputs: fields changing type, missing and reordered fields, NaN and other
//! special floats, names that look nested (`gps.lat`, `a/b`) or typed (`x__f64`), case variants,
//! empty strings, and columns distinct enough to take the no-dictionary path.

mod common;

use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, BooleanBuilder, Float64Builder, Int64Builder, StringBuilder,
};
use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch, TimestampMicrosecondArray};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::file::metadata::{KeyValue, ParquetMetaDataReader};
use parquet::file::properties::WriterProperties;
use proptest::prelude::*;
use sync::record::Value;
use tier::chunk::{META_COLUMNS, arrow_schema};
use tier::{
    EncodeOptions, FieldRegistry, TierRecord, ValueKind, decode_chunk, encode_chunk,
    encode_chunk_with_threads,
};

/// The old encoder's semantics, written the simplest way: one Arrow builder per column, a null
/// appended wherever a record lacks the field, one `ArrowWriter` with default encodings.
fn reference_encode(records: &[TierRecord], registry: &FieldRegistry) -> Bytes {
    enum B {
        F(Float64Builder),
        I(Int64Builder),
        Bo(BooleanBuilder),
        S(StringBuilder),
        By(BinaryBuilder),
    }
    let mut cols: Vec<B> = registry
        .columns()
        .iter()
        .map(|c| match c.kind {
            ValueKind::F64 => B::F(Float64Builder::new()),
            ValueKind::I64 => B::I(Int64Builder::new()),
            ValueKind::Bool => B::Bo(BooleanBuilder::new()),
            ValueKind::Str | ValueKind::Tag => B::S(StringBuilder::new()),
            ValueKind::Bytes => B::By(BinaryBuilder::new()),
        })
        .collect();
    let (mut device, mut key) = (StringBuilder::new(), StringBuilder::new());
    let (mut epoch, mut seq, mut offset) = (vec![], vec![], vec![]);
    let (mut ts, mut rem, mut ingest) = (vec![], vec![], vec![]);
    for r in records {
        device.append_value(&r.device);
        key.append_value(&r.key);
        epoch.push(r.epoch as i64);
        seq.push(r.seq as i64);
        offset.push(r.offset as i64);
        ts.push(r.ts_ns.div_euclid(1000));
        rem.push(r.ts_ns.rem_euclid(1000) as i32);
        ingest.push(r.ingest_ts_ns.div_euclid(1000));
        for (i, spec) in registry.columns().iter().enumerate() {
            if spec.kind == ValueKind::Tag {
                let B::S(b) = &mut cols[i] else {
                    unreachable!()
                };
                match r.tags.iter().find(|(n, _)| *n == spec.field) {
                    Some((_, v)) => b.append_value(v),
                    None => b.append_null(),
                }
                continue;
            }
            let v = r
                .fields
                .iter()
                .find(|(n, v)| {
                    *n == spec.field && registry.column_of(n, ValueKind::of(v)) == Some(i)
                })
                .map(|(_, v)| v);
            match (&mut cols[i], v) {
                (B::F(b), Some(Value::F64(x))) => b.append_value(*x),
                (B::F(b), Some(Value::I64(x))) => b.append_value(*x as f64),
                (B::I(b), Some(Value::I64(x))) => b.append_value(*x),
                (B::Bo(b), Some(Value::Bool(x))) => b.append_value(*x),
                (B::S(b), Some(Value::Str(x))) => b.append_value(x),
                (B::By(b), Some(Value::Bytes(x))) => b.append_value(x),
                (B::F(b), _) => b.append_null(),
                (B::I(b), _) => b.append_null(),
                (B::Bo(b), _) => b.append_null(),
                (B::S(b), _) => b.append_null(),
                (B::By(b), _) => b.append_null(),
            }
        }
    }
    let mut arrays: Vec<ArrayRef> = vec![
        Arc::new(device.finish()),
        Arc::new(Int64Array::from(epoch)),
        Arc::new(Int64Array::from(seq)),
        Arc::new(Int64Array::from(offset)),
        Arc::new(key.finish()),
        Arc::new(TimestampMicrosecondArray::from(ts).with_timezone("UTC")),
        Arc::new(Int32Array::from(rem)),
        Arc::new(TimestampMicrosecondArray::from(ingest).with_timezone("UTC")),
    ];
    for c in &mut cols {
        arrays.push(match c {
            B::F(b) => Arc::new(b.finish()),
            B::I(b) => Arc::new(b.finish()),
            B::Bo(b) => Arc::new(b.finish()),
            B::S(b) => Arc::new(b.finish()),
            B::By(b) => Arc::new(b.finish()),
        });
    }
    let schema = Arc::new(arrow_schema(registry));
    let batch = RecordBatch::try_new(schema.clone(), arrays).expect("reference batch");
    let mut out = Vec::new();
    // The column specs travel in the footer, as the hub's files carry them.
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(vec![KeyValue::new(
            META_COLUMNS.to_owned(),
            serde_json::to_string(registry.columns()).expect("specs"),
        )]))
        .build();
    let mut w = ArrowWriter::try_new(&mut out, schema, Some(props)).expect("reference writer");
    w.write(&batch).expect("reference write");
    w.close().expect("reference close");
    Bytes::from(out)
}

fn special_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(-f64::NAN),
        Just(f64::from_bits(0x7ff8_dead_beef_0001)),
        Just(0.0),
        Just(-0.0),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(f64::MIN_POSITIVE / 2.0),
        Just(f64::MAX),
        any::<f64>(),
        (0i32..50).prop_map(|v| f64::from(v) * 0.25),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => special_f64().prop_map(Value::F64),
        2 => prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(0), any::<i64>(), 0i64..20]
            .prop_map(Value::I64),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => prop_oneof![Just(String::new()), "[a-zé€]{0,6}"].prop_map(Value::Str),
        1 => proptest::collection::vec(any::<u8>(), 0..6).prop_map(Value::Bytes),
    ]
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("gps.lat".to_owned()),
        Just("gps.lon".to_owned()),
        Just("a/b".to_owned()),
        Just("x__f64".to_owned()),
        Just("x".to_owned()),
        Just("X".to_owned()),
        Just("ts".to_owned()),
        Just("a_rather_long_field_name_of_40_characters".to_owned()),
        "[a-c]{1,2}",
    ]
}

/// Records whose field sets, order and types vary; offsets dense from 0.
fn records(max: usize) -> impl Strategy<Value = Vec<TierRecord>> {
    proptest::collection::vec(
        (
            0u8..5,
            0u64..3,
            "[a-z/]{0,8}",
            any::<i64>(),
            proptest::collection::vec((field_name(), value()), 0..7),
        ),
        1..max,
    )
    .prop_map(|rows| {
        rows.into_iter()
            .enumerate()
            .map(|(i, (d, epoch, key, ts_ns, fields))| {
                let mut seen = std::collections::HashSet::new();
                TierRecord {
                    tags: Vec::new(),
                    device: format!("dev{d}"),
                    epoch,
                    seq: i as u64,
                    offset: i as u64,
                    key,
                    ts_ns,
                    ingest_ts_ns: ts_ns / 3,
                    fields: fields
                        .into_iter()
                        // Integers and decimals of a field share one column: one of them per record.
                        .filter(|(n, v)| {
                            let kind = match ValueKind::of(v) {
                                ValueKind::I64 => ValueKind::F64,
                                k => k,
                            };
                            seen.insert((n.clone(), kind))
                        })
                        .collect(),
                }
            })
            .collect()
    })
}

fn assert_equivalent(records: &[TierRecord], options: &EncodeOptions) {
    let registry = common::registry_for(records);
    let (fast, summary) = encode_chunk(records, &registry, options).expect("fast encode");
    let reference = reference_encode(records, &registry);
    assert_eq!(summary.rows, records.len() as u64);
    let a = decode_chunk(fast.clone()).expect("decode fast");
    let b = decode_chunk(reference.clone()).expect("decode reference");
    assert_eq!(a.len(), b.len());
    if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
        panic!(
            "record {i} decodes differently:\nfast      {:?}\nreference {:?}\ninput     {:?}",
            a[i], b[i], records[i]
        );
    }
    assert_eq!(
        common::normalized(&a),
        common::normalized(&common::as_stored(records, &registry))
    );
    // Same Arrow schema (names, types, nullability) as engines see it.
    let schema = |bytes: &Bytes| {
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
            .expect("reader")
            .schema()
            .clone()
    };
    assert_eq!(schema(&fast).fields(), schema(&reference).fields());
    // Splitting the column chunks across threads changes nothing in the file.
    for threads in [2, 3] {
        let (again, s2) =
            encode_chunk_with_threads(records, &registry, options, threads).expect("threads");
        assert_eq!(again, fast, "{threads} threads wrote different bytes");
        assert_eq!(s2, summary);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Up to 300 records: many columns get >= 64 mostly distinct values and take the
    /// no-dictionary path (BYTE_STREAM_SPLIT for doubles), others keep the dictionary.
    #[test]
    fn fast_encoder_matches_reference(records in records(300), rg in 1usize..400) {
        let options = EncodeOptions { row_group_rows: rg, ..EncodeOptions::default() };
        assert_equivalent(&records, &options);
    }
}

#[test]
fn dense_and_sparse_columns_across_row_groups() {
    // 5000 records: a mostly distinct double (coordinates), a mostly distinct integer
    // (odometer), a low-cardinality double, a field that changes type every 7th record, one
    // present in 1% of records, and NaNs.
    let records: Vec<TierRecord> = (0..5000u64)
        .map(|i| {
            let mut fields = vec![
                // Mostly distinct, with NaN, -0.0 and infinities on the BYTE_STREAM_SPLIT path.
                (
                    "lat".to_owned(),
                    Value::F64(match i % 13 {
                        0 => f64::NAN,
                        1 => -0.0,
                        2 => f64::NEG_INFINITY,
                        _ => 45.0 + (i as f64) * 1e-6,
                    }),
                ),
                (
                    "odometer".to_owned(),
                    Value::I64((i * 7919 % 100_003) as i64),
                ),
                ("temp".to_owned(), Value::F64(20.0 + (i % 13) as f64 * 0.5)),
            ];
            if i % 7 == 0 {
                fields.push(("speed".into(), Value::I64(0)));
            } else {
                fields.push(("speed".into(), Value::F64(i as f64 / 3.0)));
            }
            if i % 100 == 0 {
                fields.push(("rare.str".into(), Value::Str(format!("r{i}"))));
            }
            if i % 11 == 0 {
                fields.push(("nan".into(), Value::F64(f64::NAN)));
            }
            if i % 2 == 0 {
                fields.reverse();
            }
            TierRecord {
                tags: Vec::new(),
                device: format!("truck-{:04}", i % 37),
                epoch: 1 + i / 4000,
                seq: i / 37,
                offset: 10_000 + i,
                key: format!("truck-{:04}/engine", i % 37),
                ts_ns: 1_700_000_000_123_456_789 + (i as i64) * 1_000_000_007,
                ingest_ts_ns: 1_700_000_000_000_000_000 + (i as i64) * 1_000_000,
                fields,
            }
        })
        .collect();
    let options = EncodeOptions {
        row_group_rows: 1024,
        ..EncodeOptions::default()
    };
    assert_equivalent(&records, &options);

    // The mostly distinct columns really went without a dictionary, the others kept one, and
    // every column chunk of every row group has statistics.
    let registry = common::registry_for(&records);
    let (bytes, _) = encode_chunk(&records, &registry, &options).unwrap();
    let meta = ParquetMetaDataReader::new()
        .parse_and_finish(&bytes)
        .unwrap();
    assert_eq!(meta.num_row_groups(), 5);
    let schema = meta.file_metadata().schema_descr();
    let col = |name: &str| {
        schema
            .columns()
            .iter()
            .position(|c| c.name() == name)
            .unwrap()
    };
    for rg in meta.row_groups() {
        for (name, dictionary) in [("lat", false), ("odometer", false), ("temp", true)] {
            let c = rg.column(col(name));
            assert_eq!(c.dictionary_page_offset().is_some(), dictionary, "{name}");
        }
        for c in rg.columns() {
            assert!(c.statistics().is_some(), "{}", c.column_path());
        }
    }
}

#[test]
fn same_input_same_bytes() {
    let records = common::telemetry(20, 300, 0, 1_700_000_000_000_000_000);
    let registry = common::registry_for(&records);
    let options = EncodeOptions::default();
    let (a, _) = encode_chunk(&records, &registry, &options).unwrap();
    let cloned: Vec<TierRecord> = records.to_vec();
    let (b, _) = encode_chunk_with_threads(&cloned, &registry, &options, 4).unwrap();
    assert_eq!(a, b);
}
