//! Exhaustive truncation: a small segment of four blocks is cut at every length from 0 to its
//! full size, as a crash mid-append leaves it. The scan must never panic and must keep exactly
//! the frames that were complete before the cut, and nothing after the cut may look like a
//! valid frame (so recovery classifies the tail as torn, to be truncated, not as corruption).

use sync::block::{self, DecodeLimits, EncodeOptions, FLAG_BATCH_CONTINUES};
use sync::segment::{self, FRAME_HEADER_LEN, FrameFault, SEGMENT_HEADER_LEN, SegmentError};
use sync::{Record, Value};

/// Four blocks of different sizes and contents, and their records.
fn small_segment() -> (Vec<u8>, Vec<Vec<Record>>) {
    let mut seg = segment::segment_header().to_vec();
    let mut batches = Vec::new();
    let mut seq = 100;
    for (b, n) in [3usize, 1, 5, 2].into_iter().enumerate() {
        let recs: Vec<Record> = (0..n)
            .map(|i| Record {
                tags: Vec::new(),
                key: format!("dev-{b}/sensor-{i}"),
                ts: 1_764_374_400_000_000_000 + (b * 10 + i) as i64,
                fields: vec![
                    ("t".into(), Value::F64(20.5 + i as f64)),
                    ("n".into(), Value::I64(-(i as i64))),
                    ("s".into(), Value::Str("x".repeat(i))),
                ],
            })
            .collect();
        let flags = if b == 2 { FLAG_BATCH_CONTINUES } else { 0 };
        let opts = EncodeOptions {
            flags,
            ..EncodeOptions::default()
        };
        let bytes = block::encode_block_with(&opts, 0xfeed, seq, &recs).unwrap();
        seg.extend_from_slice(&segment::encode_frame(&bytes));
        seq += n as u64;
        batches.push(recs);
    }
    (seg, batches)
}

#[test]
fn every_truncation_keeps_exactly_the_complete_frames() {
    let (seg, batches) = small_segment();
    let full = segment::scan(&seg).unwrap();
    assert_eq!(full.frames.len(), 4);
    assert_eq!(full.fault, None);
    let mut checked_with_fault = 0;
    for cut in 0..=seg.len() {
        let torn = &seg[..cut];
        if cut < SEGMENT_HEADER_LEN {
            assert_eq!(
                segment::scan(torn),
                Err(SegmentError::ShortHeader(cut)),
                "cut {cut}"
            );
            continue;
        }
        let s = segment::scan(torn).unwrap();
        let complete: Vec<_> = full
            .frames
            .iter()
            .copied()
            .filter(|f| f.end() as usize <= cut)
            .collect();
        assert_eq!(s.frames, complete, "cut {cut}");
        let valid_len = complete
            .last()
            .map_or(SEGMENT_HEADER_LEN as u64, |f| f.end());
        assert_eq!(s.valid_len, valid_len, "cut {cut}");
        let partial = cut as u64 - valid_len;
        match s.fault {
            None => assert_eq!(partial, 0, "cut {cut}: a partial frame went unreported"),
            Some((at, fault)) => {
                checked_with_fault += 1;
                assert_eq!(at, valid_len, "cut {cut}");
                if partial < FRAME_HEADER_LEN as u64 {
                    assert_eq!(fault, FrameFault::ShortFrameHeader, "cut {cut}");
                } else {
                    assert!(
                        matches!(fault, FrameFault::ShortBlock { .. }),
                        "cut {cut}: {fault:?}"
                    );
                }
                // A torn tail holds no later valid frame: recovery may truncate it.
                assert_eq!(segment::resync(torn, at as usize), None, "cut {cut}");
            }
        }
        for (frame, recs) in s.frames.iter().zip(&batches) {
            let b =
                block::decode_block(frame.block(torn).unwrap(), &DecodeLimits::default()).unwrap();
            assert_eq!(&b.records, recs, "cut {cut}");
        }
    }
    assert_eq!(checked_with_fault, seg.len() + 1 - SEGMENT_HEADER_LEN - 5);
}

#[test]
fn truncating_a_block_alone_is_detected() {
    let (seg, _) = small_segment();
    let full = segment::scan(&seg).unwrap();
    let whole = full.frames[0].block(&seg).unwrap();
    for cut in 0..whole.len() {
        let r = block::decode_block(&whole[..cut], &DecodeLimits::default());
        assert!(r.is_err(), "block cut at {cut} decoded");
    }
    assert!(block::decode_block(whole, &DecodeLimits::default()).is_ok());
}
