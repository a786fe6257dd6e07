//! Checked-in format fixtures: every build must keep reading every released format version.
//!
//! `fixtures/v1/` holds a segment file written by the version 1 encoder (`segment.trseg`), the
//! records it holds as NDJSON (`records.ndjson`, in segment order), and each block's header as
//! JSON (`blocks.json`). The files are generated once, by this file's `write_v1_fixtures` test
//! with `TRIBUTARY_WRITE_FIXTURES=1`, and then never rewritten: a later format change adds a new
//! `fixtures/vN/`, it does not regenerate old ones.

use serde_json::json;
use std::path::PathBuf;
use sync::block::{
    self, BlockHeader, DecodeLimits, EncodeOptions, FLAG_BATCH_CONTINUES, VERSION_ROWS,
};
use sync::parse::{parse_ndjson, write_ndjson};
use sync::segment;
use sync::{Record, Value};

const EPOCH: u64 = 0x0123_4567_89ab_cdef;
const FIRST_SEQ: u64 = 1000;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1")
}

/// The records of the v1 fixture, block by block, with each block's flags. They cover every
/// value type and the awkward values NDJSON can carry (NaN cannot be: see `format_props`).
fn v1_blocks() -> Vec<(u8, Vec<Record>)> {
    let t0 = 1_764_374_400_000_000_000i64;
    let telemetry = |i: i64| Record {
        tags: Vec::new(),
        key: format!("truck-{:04}/engine", i % 3),
        ts: t0 + i * 1_000_000_003,
        fields: vec![
            ("engine_temp_c".into(), Value::F64(71.28 + i as f64 / 4.0)),
            ("odometer_m".into(), Value::I64(12_345 + i * 17)),
            ("ignition".into(), Value::Bool(i % 2 == 0)),
            (
                "note".into(),
                Value::Str(if i == 0 { "x".into() } else { String::new() }),
            ),
        ],
    };
    let odd = vec![
        Record {
            tags: Vec::new(),
            key: "plant/ünïcode ☃".into(),
            ts: i64::MIN,
            fields: vec![
                ("neg_zero".into(), Value::F64(-0.0)),
                ("subnormal".into(), Value::F64(f64::from_bits(1))),
                ("max".into(), Value::F64(f64::MAX)),
                ("i_min".into(), Value::I64(i64::MIN)),
                ("i_max".into(), Value::I64(i64::MAX)),
                ("bytes".into(), Value::Bytes(vec![0, 1, 2, 254, 255])),
                ("empty_bytes".into(), Value::Bytes(vec![])),
                (
                    "quote\"s".into(),
                    Value::Str("line\nbreak\t\"q\" \\".into()),
                ),
            ],
        },
        Record {
            tags: Vec::new(),
            key: "k".into(),
            ts: i64::MAX,
            fields: vec![("only".into(), Value::Bool(false))],
        },
        Record {
            tags: Vec::new(),
            key: "k".into(),
            ts: 0,
            fields: vec![],
        },
    ];
    vec![
        (0, (0..5).map(telemetry).collect()),
        (0, odd),
        // One producer batch split across two blocks: the first carries the continuation flag.
        (FLAG_BATCH_CONTINUES, (5..9).map(telemetry).collect()),
        (0, (9..10).map(telemetry).collect()),
    ]
}

fn header_json(h: &BlockHeader) -> serde_json::Value {
    json!({
        "version": h.version, "flags": h.flags, "epoch": h.epoch, "first_seq": h.first_seq,
        "count": h.count, "raw_len": h.raw_len, "min_ts": h.min_ts, "max_ts": h.max_ts,
        "body_len": h.body_len, "body_crc": h.body_crc, "raw_crc": h.raw_crc,
    })
}

#[test]
fn write_v1_fixtures() {
    let blocks = v1_blocks();
    let all: Vec<Record> = blocks.iter().flat_map(|(_, r)| r.clone()).collect();
    let ndjson = write_ndjson(&all).unwrap();
    if std::env::var_os("TRIBUTARY_WRITE_FIXTURES").is_none() {
        // Without the variable this only checks that the generator above still describes
        // the checked-in files, so the two cannot drift apart unnoticed.
        let on_disk = std::fs::read_to_string(dir().join("records.ndjson")).unwrap();
        assert_eq!(
            on_disk, ndjson,
            "the v1 fixture generator no longer matches the files"
        );
        return;
    }
    let mut seg = segment::segment_header().to_vec();
    let mut headers = Vec::new();
    let mut seq = FIRST_SEQ;
    for (flags, recs) in &blocks {
        let opts = EncodeOptions {
            version: VERSION_ROWS,
            flags: *flags,
            ..EncodeOptions::default()
        };
        let bytes = block::encode_block_with(&opts, EPOCH, seq, recs).unwrap();
        headers.push(header_json(&block::decode_header(&bytes).unwrap()));
        seg.extend_from_slice(&segment::encode_frame(&bytes));
        seq += recs.len() as u64;
    }
    std::fs::create_dir_all(dir()).unwrap();
    std::fs::write(dir().join("segment.trseg"), &seg).unwrap();
    std::fs::write(dir().join("records.ndjson"), &ndjson).unwrap();
    let headers = serde_json::to_string_pretty(&headers).unwrap() + "\n";
    std::fs::write(dir().join("blocks.json"), headers).unwrap();
}

#[test]
fn v1_fixtures_still_decode() {
    let seg = std::fs::read(dir().join("segment.trseg")).unwrap();
    let expected =
        parse_ndjson(&std::fs::read_to_string(dir().join("records.ndjson")).unwrap()).unwrap();
    let headers: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir().join("blocks.json")).unwrap()).unwrap();

    let scan = segment::scan(&seg).unwrap();
    assert_eq!(scan.fault, None);
    assert_eq!(scan.valid_len as usize, seg.len());
    assert_eq!(scan.frames.len(), headers.len());
    let mut records = Vec::new();
    let mut next_seq = FIRST_SEQ;
    for (frame, want) in scan.frames.iter().zip(&headers) {
        let b = block::decode_block(frame.block(&seg).unwrap(), &DecodeLimits::default()).unwrap();
        assert_eq!(&header_json(&b.header), want);
        assert_eq!((b.header.epoch, b.header.first_seq), (EPOCH, next_seq));
        next_seq = b.header.last_seq() + 1;
        records.extend(b.records);
    }
    assert_eq!(records, expected);
    let flags: Vec<u8> = headers
        .iter()
        .map(|h| h["flags"].as_u64().unwrap() as u8)
        .collect();
    assert_eq!(flags, [0, 0, FLAG_BATCH_CONTINUES, 0]);
}
