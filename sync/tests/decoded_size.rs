//! The decoded-size bound (`sync::decoded`): both body decoders compute the exact size of the
//! records a block holds before building any, and refuse a block over
//! `DecodeLimits::decoded_bytes_max`.
//!
//! Table tests: the size computed before decoding equals what the decoder materialises, for a
//! corpus of record shapes in both body versions; and bombs of every shape (a long dictionary
//! key repeated by a million records, a long field name repeated within and across records, a
//! long dictionary string, per-record and per-field overheads of version 1) are refused with
//! `DecodedTooLarge`, allocating no more than the decompressed body. A counting allocator
//! measures the allocations of the thread that decodes.
#![allow(unsafe_code)] // The counting allocator in `decoded_support`; nothing else.

mod columnar_support;
mod decoded_support;

use decoded_support::{check_refused, columnar, forge, key_bomb, zeros_col};
use sync::block::{self, BlockError, DecodeLimits, VERSION_COLUMNAR, VERSION_ROWS};
use sync::decoded::{self, FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
use sync::{Record, Value, varint};

const LIMITS: DecodeLimits = DecodeLimits {
    raw_bytes_max: 64 << 20,
    records_max: 1 << 20,
    body_bytes_max: 64 << 20,
    decoded_bytes_max: 256 << 20,
};

fn rec(key: &str, ts: i64, fields: Vec<(&str, Value)>) -> Record {
    Record {
        tags: Vec::new(),
        key: key.into(),
        ts,
        fields: fields.into_iter().map(|(n, v)| (n.into(), v)).collect(),
    }
}

/// Record sets of every shape the decoders distinguish.
fn corpus() -> Vec<(&'static str, Vec<Record>)> {
    let long_key = "k".repeat(KEY_BYTES_MAX);
    let long_name = "n".repeat(FIELD_NAME_BYTES_MAX);
    vec![
        ("no fields", vec![rec("a", 1, vec![]), rec("b", 2, vec![])]),
        (
            "every type",
            vec![rec(
                "truck/1",
                5,
                vec![
                    ("f", Value::F64(1.5)),
                    ("i", Value::I64(-3)),
                    ("b", Value::Bool(true)),
                    ("s", Value::Str("héllo".into())),
                    ("x", Value::Bytes(vec![1, 2, 3])),
                ],
            )],
        ),
        (
            "one string repeated from the dictionary",
            (0..500)
                .map(|i| rec("k", i, vec![("s", Value::Str("same text".into()))]))
                .collect(),
        ),
        (
            "many keys and shapes",
            (0..300)
                .map(|i| {
                    let mut f = vec![("v", Value::I64(i))];
                    if i % 3 == 0 {
                        f.push(("s", Value::Str(format!("s{}", i % 7))));
                    }
                    if i % 5 == 0 {
                        f.push(("raw", Value::Bytes(vec![0; (i % 11) as usize])));
                    }
                    rec(&format!("dev-{}", i % 13), i, f)
                })
                .collect(),
        ),
        (
            "a field changing type",
            vec![
                rec("k", 1, vec![("v", Value::I64(0))]),
                rec("k", 2, vec![("v", Value::F64(19.7))]),
                rec("k", 3, vec![("v", Value::Str("n/a".into()))]),
            ],
        ),
        (
            "the longest key and field name",
            (0..20)
                .map(|i| {
                    rec(
                        &long_key,
                        i,
                        vec![(long_name.as_str(), Value::Bool(i % 2 == 0))],
                    )
                })
                .collect(),
        ),
        ("telemetry", columnar_support::telemetry(7, 400)),
        ("odd records", columnar_support::odd_records()),
    ]
}

#[test]
fn the_size_computed_before_decoding_is_what_the_decoder_materialises() {
    for (name, records) in corpus() {
        for version in [VERSION_ROWS, VERSION_COLUMNAR] {
            let bytes = block::encode_block(version, 1, 1, &records).expect("encode");
            let sized = block::size_block(&bytes, &LIMITS).expect("size");
            let want = decoded::records_bytes(&records);
            assert_eq!(sized.decoded_bytes(), want, "{name}, version {version}");
            let fresh = block::decode_block(&bytes, &LIMITS)
                .expect("decode")
                .records;
            assert_eq!(
                decoded::records_bytes(&fresh),
                want,
                "{name}, version {version}"
            );
            // Decoding over other records reuses their buffers but materialises the same.
            let mut reused = columnar_support::odd_records();
            sized.decode_into(&mut reused).expect("decode into");
            assert_eq!(reused, records, "{name}, version {version}");
            // The limit is inclusive: exactly the size decodes, one byte less is refused.
            let exact = DecodeLimits {
                decoded_bytes_max: want,
                ..LIMITS
            };
            assert!(block::decode_block(&bytes, &exact).is_ok(), "{name}");
            let under = DecodeLimits {
                decoded_bytes_max: want - 1,
                ..LIMITS
            };
            assert_eq!(
                block::decode_block(&bytes, &under).unwrap_err(),
                BlockError::DecodedTooLarge {
                    size: want,
                    limit: want - 1
                },
                "{name}, version {version}"
            );
        }
    }
}

/// A bool column with a name of the longest length, listed `m` times in the one shape.
fn field_name_bomb(m: usize, n: usize) -> Vec<u8> {
    let name = "n".repeat(FIELD_NAME_BYTES_MAX);
    let mut bits = Vec::new();
    varint::put_bytes(&mut bits, &vec![0u8; (m * n).div_ceil(8)]);
    let raw = columnar("k", &[(&name, 2)], &vec![0; m], n, &bits);
    forge(VERSION_COLUMNAR, &raw, n as u32)
}

/// A string column whose dictionary holds one long string, referenced by every record.
fn string_dictionary_bomb(len: usize, n: usize) -> Vec<u8> {
    let mut col = Vec::new();
    varint::put_u64(&mut col, 1);
    varint::put_bytes(&mut col, "s".repeat(len).as_bytes());
    zeros_col(&mut col, n);
    let raw = columnar("k", &[("s", 3)], &[0], n, &col);
    forge(VERSION_COLUMNAR, &raw, n as u32)
}

/// Version 1: `n` records with an empty key and `fields` bool fields with empty names, three
/// bytes per record and per field on the wire, 64 decoded.
fn rows_overhead_bomb(n: usize, fields: usize) -> Vec<u8> {
    let mut raw = Vec::new();
    for _ in 0..n {
        raw.extend_from_slice(&[0, 0]);
        varint::put_u64(&mut raw, fields as u64);
        for _ in 0..fields {
            raw.extend_from_slice(&[0, 2, 0]);
        }
    }
    forge(VERSION_ROWS, &raw, n as u32)
}

/// Version 1: records each holding a key of the longest length.
fn rows_long_keys(n: usize) -> Vec<u8> {
    let key = "k".repeat(KEY_BYTES_MAX);
    let mut raw = Vec::new();
    for _ in 0..n {
        varint::put_bytes(&mut raw, key.as_bytes());
        raw.extend_from_slice(&[0, 0]);
    }
    forge(VERSION_ROWS, &raw, n as u32)
}

#[test]
fn bombs_of_every_shape_are_refused_before_allocation() {
    let tight = DecodeLimits {
        decoded_bytes_max: 16 << 20,
        ..LIMITS
    };
    let bombs: Vec<(&str, Vec<u8>, DecodeLimits)> = vec![
        // The reported block: 217 bytes sealed, 15 GiB decoded. Its key is over the format's
        // maximum too; the decoded size is what refuses it, before the key is ever read.
        (
            "16 KiB key x 1,000,000 records",
            key_bomb(16 << 10, 1_000_000),
            LIMITS,
        ),
        (
            "longest key x 1,000,000 records",
            key_bomb(KEY_BYTES_MAX, 1_000_000),
            LIMITS,
        ),
        (
            "longest field name x 4,096 per record",
            field_name_bomb(4096, 4096),
            LIMITS,
        ),
        (
            "1 MiB dictionary string x 10,000 records",
            string_dictionary_bomb(1 << 20, 10_000),
            LIMITS,
        ),
        (
            "v1: 1,000,000 empty records",
            rows_overhead_bomb(1_000_000, 0),
            tight,
        ),
        (
            "v1: 10,000 records x 100 fields",
            rows_overhead_bomb(10_000, 100),
            tight,
        ),
        (
            "v1: longest keys x 10,000 records",
            rows_long_keys(10_000),
            tight,
        ),
    ];
    for (name, bytes, limits) in bombs {
        match check_refused(&bytes, &limits) {
            Ok(line) => println!("{name}: {line}"),
            Err(e) => panic!("{name}: {e}"),
        }
    }
}

#[test]
fn the_reported_bomb_is_a_few_hundred_bytes_and_passes_every_other_limit() {
    let bytes = key_bomb(16 << 10, 1_000_000);
    assert!(bytes.len() < 512, "{} bytes", bytes.len());
    let h = block::verify_block(&bytes, &LIMITS).expect("passes the size checks");
    assert_eq!(h.count, 1_000_000);
    let size = 1_000_000 * (decoded::RECORD_OVERHEAD_BYTES + (16 << 10));
    assert!(matches!(
        block::size_block(&bytes, &LIMITS),
        Err(BlockError::DecodedTooLarge { size: s, .. }) if s == size
    ));
}

#[test]
fn keys_and_field_names_over_the_maximum_are_refused_by_both_sides() {
    let long_key = rec(&"k".repeat(KEY_BYTES_MAX + 1), 0, vec![]);
    let long_name = rec(
        "k",
        0,
        vec![(&"n".repeat(FIELD_NAME_BYTES_MAX + 1), Value::I64(1))],
    );
    for version in [VERSION_ROWS, VERSION_COLUMNAR] {
        for r in [&long_key, &long_name] {
            let e = block::encode_block(version, 1, 1, std::slice::from_ref(r)).unwrap_err();
            assert!(matches!(e, block::EncodeError::TooLong { .. }), "{e}");
        }
    }
    let cases = [
        (
            "key",
            forge(
                VERSION_COLUMNAR,
                &columnar(&"k".repeat(KEY_BYTES_MAX + 1), &[], &[], 1, &[]),
                1,
            ),
        ),
        ("key", rows_long_keys_over(KEY_BYTES_MAX + 1)),
        ("field name", {
            let name = "n".repeat(FIELD_NAME_BYTES_MAX + 1);
            let mut bits = Vec::new();
            varint::put_bytes(&mut bits, &[0]);
            forge(
                VERSION_COLUMNAR,
                &columnar("k", &[(&name, 2)], &[0], 1, &bits),
                1,
            )
        }),
    ];
    for (what, bytes) in cases {
        match block::decode_block(&bytes, &LIMITS) {
            Err(BlockError::TooLong {
                what: w, len, max, ..
            }) => {
                assert_eq!((w, len), (what, max + 1));
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}

fn rows_long_keys_over(len: usize) -> Vec<u8> {
    let mut raw = Vec::new();
    varint::put_bytes(&mut raw, "k".repeat(len).as_bytes());
    raw.extend_from_slice(&[0, 0]);
    forge(VERSION_ROWS, &raw, 1)
}
