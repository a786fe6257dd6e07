//! Property tests of the version 1 block and of segment framing: any sequence of records survives
//! encode -> decode bit-exactly, alone and as several blocks framed in a segment.
//!
//! Values are drawn to hit the awkward corners: every f64 bit pattern (NaN payloads, signalling
//! NaNs, -0.0, subnormals, infinities), i64 and timestamp extremes, empty and non-ASCII strings,
//! empty and binary bytes, and seq ranges ending exactly at `u64::MAX`.
//!
//! 256 cases per property by default; `TRIBUTARY_SOAK=1` runs 10,000.

use proptest::prelude::*;
use sync::block::{self, DecodeLimits, EncodeOptions, VERSION_ROWS, VERSION_TAGGED};
use sync::segment;
use sync::{Record, Value};

fn cases() -> u32 {
    if std::env::var_os("TRIBUTARY_SOAK").is_some() {
        10_000
    } else {
        256
    }
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z0-9/_-]{1,24}",
        prop::collection::vec(any::<char>(), 0..16).prop_map(|c| c.into_iter().collect()),
    ]
}

fn f64_any() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>().prop_map(f64::from_bits),
        any::<f64>(),
        Just(-0.0),
        Just(0.0),
        Just(f64::NAN),
        Just(f64::from_bits(0x7ff0_0000_0000_0001)), // signalling NaN
        Just(f64::from_bits(0xfff8_dead_beef_0001)), // negative quiet NaN with a payload
        Just(f64::from_bits(1)),                     // smallest subnormal
        Just(f64::from_bits(0x000f_ffff_ffff_ffff)), // largest subnormal
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(f64::MAX),
        Just(f64::MIN),
    ]
}

fn i64_any() -> impl Strategy<Value = i64> {
    prop_oneof![
        any::<i64>(),
        Just(i64::MIN),
        Just(i64::MAX),
        Just(0),
        Just(-1),
        -1000i64..1000
    ]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        f64_any().prop_map(Value::F64),
        i64_any().prop_map(Value::I64),
        any::<bool>().prop_map(Value::Bool),
        text().prop_map(Value::Str),
        prop::collection::vec(any::<u8>(), 0..24).prop_map(Value::Bytes),
    ]
}

fn record() -> impl Strategy<Value = Record> {
    // Half the records carry tags (a tagged record makes its block version 3).
    let tags = prop_oneof![
        Just(Vec::new()),
        prop::collection::vec((text(), text()), 0..4)
    ];
    (
        text(),
        tags,
        i64_any(),
        prop::collection::vec((text(), value()), 0..8),
    )
        .prop_map(|(key, tags, ts, fields)| Record {
            key,
            tags,
            ts,
            fields,
        })
}

fn records() -> impl Strategy<Value = Vec<Record>> {
    prop::collection::vec(record(), 1..40)
}

fn first_seq(n: usize) -> impl Strategy<Value = u64> {
    let last_start = u64::MAX - (n as u64 - 1);
    prop_oneof![Just(0), Just(1), Just(last_start), (0..=last_start)]
}

fn options() -> impl Strategy<Value = EncodeOptions> {
    (
        any::<u8>(),
        prop_oneof![Just(-5), Just(1), Just(3), Just(19)],
    )
        .prop_map(|(flags, zstd_level)| EncodeOptions {
            version: VERSION_ROWS,
            flags,
            zstd_level,
        })
}

fn block_case() -> impl Strategy<Value = (EncodeOptions, u64, u64, Vec<Record>)> {
    records().prop_flat_map(|recs| {
        let n = recs.len();
        (options(), any::<u64>(), first_seq(n), Just(recs))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn block_round_trips_bit_exactly((opts, epoch, first_seq, recs) in block_case()) {
        let bytes = block::encode_block_with(&opts, epoch, first_seq, &recs).unwrap();
        let decoded = block::decode_block(&bytes, &DecodeLimits::default()).unwrap();
        prop_assert_eq!(&decoded.records, &recs);
        let h = decoded.header;
        // Tags need the columnar body: a block with any is sealed as version 3.
        let want = if recs.iter().any(|r| !r.tags.is_empty()) { VERSION_TAGGED } else { VERSION_ROWS };
        prop_assert_eq!((h.version, h.flags, h.epoch, h.first_seq), (want, opts.flags, epoch, first_seq));
        prop_assert_eq!(h.count as usize, recs.len());
        prop_assert_eq!(h.last_seq(), first_seq + (recs.len() as u64 - 1));
        prop_assert_eq!(h.min_ts, recs.iter().map(|r| r.ts).min().unwrap());
        prop_assert_eq!(h.max_ts, recs.iter().map(|r| r.ts).max().unwrap());
        prop_assert_eq!(h.encoded_len(), bytes.len());
        prop_assert_eq!(block::decode_header(&bytes).unwrap(), h);
        prop_assert_eq!(block::verify_block(&bytes, &DecodeLimits::default()).unwrap(), h);
        // The hub compares checksums of what it committed: encoding must be deterministic.
        prop_assert_eq!(block::encode_block_with(&opts, epoch, first_seq, &recs).unwrap(), bytes);
    }

    #[test]
    fn segment_of_blocks_round_trips(batches in prop::collection::vec((records(), any::<u8>()), 1..6)) {
        let mut seg = segment::segment_header().to_vec();
        let mut seq = 0u64;
        for (recs, flags) in &batches {
            let opts = EncodeOptions { flags: *flags, ..EncodeOptions::default() };
            let b = block::encode_block_with(&opts, 7, seq, recs).unwrap();
            seg.extend_from_slice(&segment::encode_frame(&b));
            seq += recs.len() as u64;
        }
        let scan = segment::scan(&seg).unwrap();
        prop_assert_eq!(scan.fault, None);
        prop_assert_eq!(scan.valid_len as usize, seg.len());
        prop_assert_eq!(scan.frames.len(), batches.len());
        let mut expect_seq = 0u64;
        for (frame, (recs, flags)) in scan.frames.iter().zip(&batches) {
            let b = block::decode_block(frame.block(&seg).unwrap(), &DecodeLimits::default()).unwrap();
            prop_assert_eq!(&b.records, recs);
            prop_assert_eq!((b.header.first_seq, b.header.flags), (expect_seq, *flags));
            expect_seq += recs.len() as u64;
        }
    }
}

#[test]
fn empty_and_overflowing_blocks_are_refused() {
    let r = Record {
        tags: Vec::new(),
        key: "k".into(),
        ts: 0,
        fields: vec![],
    };
    assert!(matches!(
        block::encode_block(VERSION_ROWS, 1, 0, &[]),
        Err(block::EncodeError::Empty)
    ));
    let two = [r.clone(), r.clone()];
    assert!(matches!(
        block::encode_block(VERSION_ROWS, 1, u64::MAX, &two),
        Err(block::EncodeError::SeqOverflow { .. })
    ));
    assert!(block::encode_block(VERSION_ROWS, 1, u64::MAX, &two[..1]).is_ok());
    assert!(matches!(
        block::encode_block(9, 1, 0, &two),
        Err(block::EncodeError::UnsupportedVersion(9))
    ));
}
