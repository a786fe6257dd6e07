//! Format version 2 (columnar) must give back exactly the records it was given: property tests
//! over arbitrary records (odd floats, strings, bytes, missing fields, fields changing type,
//! any field order) through `encode_block`/`decode_block`, every encoder mode, and a decoder
//! that turns damaged bodies into errors instead of panics.

mod columnar_support;

use columnar_support::{odd_floats, odd_records, telemetry};
use proptest::prelude::*;
use sync::block::{self, BlockError, DecodeLimits, VERSION_COLUMNAR, VERSION_ROWS, VERSION_TAGGED};
use sync::columnar::{self, ColumnarError, FloatChoice, Tuning};
use sync::{Record, Value};

const TUNINGS: [Tuning; 6] = [
    Tuning {
        floats: FloatChoice::Auto,
        per_key: true,
    },
    Tuning {
        floats: FloatChoice::Scaled,
        per_key: true,
    },
    Tuning {
        floats: FloatChoice::Gorilla,
        per_key: true,
    },
    Tuning {
        floats: FloatChoice::Raw,
        per_key: true,
    },
    Tuning {
        floats: FloatChoice::Auto,
        per_key: false,
    },
    Tuning {
        floats: FloatChoice::Gorilla,
        per_key: false,
    },
];

fn through_block(records: &[Record]) -> Vec<Record> {
    let bytes = block::encode_block(VERSION_COLUMNAR, 7, 1000, records).expect("encode");
    let b = block::decode_block(&bytes, &DecodeLimits::default()).expect("decode");
    // Records with tags seal as version 3, the columnar body with tag columns.
    let tagged = records.iter().any(|r| !r.tags.is_empty());
    let want = if tagged {
        VERSION_TAGGED
    } else {
        VERSION_COLUMNAR
    };
    assert_eq!(b.header.version, want);
    assert_eq!(b.header.count as usize, records.len());
    b.records
}

fn check_every_tuning(records: &[Record]) {
    for t in TUNINGS {
        let body = columnar::encode_with(records, &t).expect("encode");
        let back = columnar::decode(&body, records.len() as u32).expect("decode");
        assert_eq!(back, records, "{t:?}");
    }
}

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => (-1_000_000i64..1_000_000, 0u32..7).prop_map(|(m, s)| m as f64 / 10f64.powi(s as i32)),
        2 => any::<u64>().prop_map(f64::from_bits),
        1 => proptest::sample::select(odd_floats()),
        1 => any::<f64>(),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => float().prop_map(Value::F64),
        2 => prop_oneof![any::<i64>(), -1000i64..1000].prop_map(Value::I64),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => prop_oneof![proptest::sample::select(vec!["ok", "warn", ""]).prop_map(String::from), "\\PC{0,10}"]
            .prop_map(Value::Str),
        1 => proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::Bytes),
    ]
}

fn record() -> impl Strategy<Value = Record> {
    let name = prop_oneof![
        proptest::sample::select(vec!["t", "v", "x", "note", "on"]).prop_map(String::from),
        "\\PC{0,6}"
    ];
    let key = prop_oneof![
        proptest::sample::select(vec!["a", "b", "truck-0001/engine", ""]).prop_map(String::from),
        "\\PC{0,12}"
    ];
    let ts = prop_oneof![
        any::<i64>(),
        (0i64..100_000).prop_map(|x| 1_764_374_400_000_000_000 + x * 1_000_000)
    ];
    let tag = (
        proptest::sample::select(vec!["host", "t", "unit"]).prop_map(String::from),
        "\\PC{0,6}",
    );
    let tags = prop_oneof![Just(Vec::new()), proptest::collection::vec(tag, 0..3)];
    let fields = proptest::collection::vec((name, value()), 0..8);
    (key, tags, ts, fields).prop_map(|(key, tags, ts, fields)| Record {
        key,
        tags,
        ts,
        fields,
    })
}

/// 256 cases per property in CI; `TRIBUTARY_SOAK=1` runs 20,000.
fn config() -> ProptestConfig {
    let soak = std::env::var("TRIBUTARY_SOAK").as_deref() == Ok("1");
    ProptestConfig {
        cases: if soak { 20_000 } else { 256 },
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_records_round_trip_through_a_v2_block(records in proptest::collection::vec(record(), 1..120)) {
        prop_assert_eq!(through_block(&records), records);
    }

    #[test]
    fn any_records_round_trip_under_every_encoder_mode(records in proptest::collection::vec(record(), 0..60)) {
        check_every_tuning(&records);
    }

    /// Smooth series with odd values sprinkled in: exercises per-key prediction and the scaled
    /// decimal exception list.
    #[test]
    fn series_with_odd_values_round_trip(
        rows in 1usize..60,
        keys in 1usize..6,
        odd in proptest::collection::vec((any::<prop::sample::Index>(), float()), 0..20),
    ) {
        let mut records = telemetry(keys, rows);
        for (at, f) in odd {
            let r = &mut records[at.index(keys * rows)];
            r.fields[0].1 = Value::F64(f);
        }
        prop_assert_eq!(through_block(&records), records.clone());
        check_every_tuning(&records);
    }

    /// Decoding over the records of another block reuses their buffers and must give exactly
    /// what decoding afresh gives, whatever the old records' shapes and types were.
    #[test]
    fn decode_into_over_other_records_equals_decode(
        old in proptest::collection::vec(record(), 0..40),
        new in proptest::collection::vec(record(), 0..40),
    ) {
        let body = columnar::encode(&new).unwrap();
        let mut out = old;
        columnar::decode_into(&body, new.len() as u32, &mut out).unwrap();
        prop_assert_eq!(out, new);
    }

    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), count in 0u32..100) {
        let _ = columnar::decode(&bytes, count);
    }
}

#[test]
fn odd_records_round_trip_bit_exactly() {
    let records = odd_records();
    let back = through_block(&records);
    for (a, b) in back.iter().zip(&records) {
        for ((_, x), (_, y)) in a.fields.iter().zip(&b.fields) {
            if let (Value::F64(x), Value::F64(y)) = (x, y) {
                assert_eq!(x.to_bits(), y.to_bits());
            }
        }
    }
    assert_eq!(back, records);
    check_every_tuning(&records);
}

#[test]
fn telemetry_is_far_smaller_than_v1() {
    let records = telemetry(20, 200);
    let v1 = block::encode_block(VERSION_ROWS, 1, 0, &records)
        .unwrap()
        .len();
    let v2 = block::encode_block(VERSION_COLUMNAR, 1, 0, &records)
        .unwrap()
        .len();
    assert!(v2 * 4 < v1, "v2 {v2} bytes, v1 {v1} bytes");
    assert_eq!(through_block(&records), records);
}

#[test]
fn decimals_are_chosen_over_gorilla_on_telemetry() {
    let records = telemetry(10, 100);
    let size = |t: &Tuning| columnar::encode_with(&records, t).unwrap().len();
    let auto = size(&Tuning::default());
    assert!(
        auto <= size(&Tuning {
            floats: FloatChoice::Gorilla,
            ..Tuning::default()
        })
    );
    assert!(
        auto <= size(&Tuning {
            floats: FloatChoice::Raw,
            ..Tuning::default()
        })
    );
}

#[test]
fn a_wrong_record_count_is_an_error() {
    let records = telemetry(3, 10);
    let body = columnar::encode(&records).unwrap();
    let n = records.len() as u32;
    assert!(columnar::decode(&body, n - 1).is_err());
    assert!(columnar::decode(&body, n + 1).is_err());
    assert!(matches!(
        columnar::decode(&body, u32::MAX),
        Err(ColumnarError::CountExceedsBody { .. })
    ));
}

#[test]
fn every_truncation_and_every_byte_flip_is_handled() {
    let mut records = telemetry(3, 8);
    records.extend(odd_records());
    let body = columnar::encode(&records).unwrap();
    let n = records.len() as u32;
    for len in 0..body.len() {
        assert!(
            columnar::decode(&body[..len], n).is_err(),
            "truncated to {len} bytes"
        );
    }
    for at in 0..body.len() {
        for bit in [0x01u8, 0x80] {
            let mut bad = body.clone();
            bad[at] ^= bit;
            // Damage may still decode to other records; it must simply never panic.
            let _ = columnar::decode(&bad, n);
        }
    }
}

#[test]
fn damaged_v2_block_is_a_block_error() {
    let records = telemetry(2, 5);
    let mut bytes = block::encode_block(VERSION_COLUMNAR, 1, 0, &records).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    assert!(matches!(
        block::decode_block(&bytes, &DecodeLimits::default()),
        Err(BlockError::BodyChecksum)
    ));
}

#[test]
fn repeated_field_names_within_a_record_round_trip() {
    // Names should be unique within a record, but a producer that breaks that must not get a
    // block its own reader refuses: one record, more distinct strings than records.
    let fields = (0..5)
        .map(|i| ("s".to_string(), Value::Str(format!("v{i}"))))
        .collect();
    let records = vec![Record {
        tags: Vec::new(),
        key: "k".into(),
        ts: 1,
        fields,
    }];
    assert_eq!(through_block(&records), records);
    check_every_tuning(&records);
}

#[test]
fn records_without_fields_and_one_key_round_trip() {
    let records: Vec<Record> = (0..50)
        .map(|i| Record {
            tags: Vec::new(),
            key: "k".into(),
            ts: i * 3,
            fields: vec![],
        })
        .collect();
    assert_eq!(through_block(&records), records);
}

#[test]
fn many_keys_times_many_columns_stay_within_the_state_budget() {
    // 2,500 keys seen twice each, 12 columns that per-key prediction would shrink: per-key
    // state for all of them (2,500 x 14 slots) exceeds the decoder's budget (records + 4,096),
    // so the encoder must fall back to whole-column prediction for the rest and still decode.
    let records: Vec<Record> = (0..5000i64)
        .map(|i| {
            let k = i % 2500;
            Record {
                tags: Vec::new(),
                key: format!("k{k}"),
                ts: k * 1_000_000_007 + i / 2500,
                fields: (0..12)
                    .map(|c| {
                        (
                            format!("f{c}"),
                            Value::I64(k * 1_000_003 * (c + 1) + i / 2500),
                        )
                    })
                    .collect(),
            }
        })
        .collect();
    assert_eq!(through_block(&records), records);
}

#[test]
fn a_huge_declared_count_fails_without_allocating_it() {
    // A tiny body claiming a million records must be refused up front.
    let body = [0u8, 1, 1, b'a', 0, 0, 0, 0, 0, 0, 0];
    assert!(matches!(
        columnar::decode(&body, 1 << 20),
        Err(ColumnarError::CountExceedsBody { .. })
    ));
}
