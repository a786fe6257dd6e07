//! Exhaustive single-bit corruption: every bit of a small block, and every bit of a framed
//! segment, is flipped in turn. Detection is guaranteed: decoding fails or the scan reports a
//! fault, and no flip ever yields records different from what was written.
//!
//! Why this holds: the header crc covers bytes 0..60, the body crc the compressed body, the raw
//! crc the decompressed body, and the frame crc the whole block. CRC-32C detects every
//! single-bit error in messages of these sizes, so one flip cannot pass any of them.

use sync::block::{self, DecodeLimits, EncodeOptions, FLAG_BATCH_CONTINUES};
use sync::segment::{self, SEGMENT_HEADER_LEN};
use sync::{Record, Value};

fn records(tag: usize, n: usize) -> Vec<Record> {
    (0..n)
        .map(|i| Record {
            tags: Vec::new(),
            key: format!("site-{tag}/pump-{i}"),
            ts: 1_700_000_000_000_000_000 + i as i64 * 1_000,
            fields: vec![
                ("pressure".into(), Value::F64(1.5 + i as f64 / 8.0)),
                ("count".into(), Value::I64(i as i64 * 1000)),
                ("ok".into(), Value::Bool(i % 2 == 0)),
                ("raw".into(), Value::Bytes(vec![tag as u8, i as u8])),
            ],
        })
        .collect()
}

fn flip(bytes: &[u8], bit: usize) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[bit / 8] ^= 1 << (bit % 8);
    out
}

#[test]
fn every_bit_of_a_block_is_protected() {
    let recs = records(0, 4);
    let opts = EncodeOptions {
        flags: FLAG_BATCH_CONTINUES,
        ..EncodeOptions::default()
    };
    let good = block::encode_block_with(&opts, 42, 7, &recs).unwrap();
    let limits = DecodeLimits::default();
    assert_eq!(block::decode_block(&good, &limits).unwrap().records, recs);
    for bit in 0..good.len() * 8 {
        let bad = flip(&good, bit);
        assert!(
            block::verify_block(&bad, &limits).is_err(),
            "bit {bit}: verify_block accepted it"
        );
        assert!(
            block::decode_block(&bad, &limits).is_err(),
            "bit {bit}: decode_block accepted it"
        );
    }
}

#[test]
fn every_bit_of_a_segment_is_protected() {
    let batches: Vec<Vec<Record>> = (0..3).map(|b| records(b, b + 2)).collect();
    let mut seg = segment::segment_header().to_vec();
    let mut seq = 0;
    for recs in &batches {
        let b = block::encode_block(block::VERSION_ROWS, 42, seq, recs).unwrap();
        seg.extend_from_slice(&segment::encode_frame(&b));
        seq += recs.len() as u64;
    }
    let full = segment::scan(&seg).unwrap();
    let limits = DecodeLimits::default();
    for bit in 0..seg.len() * 8 {
        let bad = flip(&seg, bit);
        let Ok(scan) = segment::scan(&bad) else {
            assert!(
                bit < SEGMENT_HEADER_LEN * 8,
                "bit {bit}: header error for a flip outside the header"
            );
            continue;
        };
        let (at, _) = scan
            .fault
            .unwrap_or_else(|| panic!("bit {bit}: flip went unnoticed"));
        // Everything kept before the fault is exactly what was written.
        assert_eq!(
            scan.frames[..],
            full.frames[..scan.frames.len()],
            "bit {bit}"
        );
        for (frame, recs) in scan.frames.iter().zip(&batches) {
            let decoded = block::decode_block(frame.block(&bad).unwrap(), &limits).unwrap();
            assert_eq!(&decoded.records, recs, "bit {bit}");
        }
        // The damaged frame is the one that holds the bit; the frames after it are still
        // found by resync, so one bad block is quarantined without losing its successors.
        let hit = full
            .frames
            .iter()
            .position(|f| (bit / 8) < f.end() as usize)
            .unwrap();
        assert_eq!(at, full.frames[hit].offset, "bit {bit}");
        let next = full.frames.get(hit + 1).map(|f| f.offset as usize);
        assert_eq!(segment::resync(&bad, at as usize), next, "bit {bit}");
    }
}
