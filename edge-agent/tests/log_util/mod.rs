//! Helpers shared by the local log's integration tests: record builders, a config for small
//! logs, and a reader that decodes everything a stream holds.

#![allow(dead_code)]

use edge_agent::log::{FsyncPolicy, LogConfig, LogHandle};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use sync::block::{DecodeLimits, decode_block};
use sync::{Record, Value};

/// A record whose content is derived from `id`, with `pad` bytes of payload.
pub fn rec(id: u64, pad: usize) -> Record {
    Record {
        tags: Vec::new(),
        key: format!("dev/{}", id % 5),
        ts: 1_764_374_400_000_000_000 + id as i64,
        fields: vec![
            ("id".into(), Value::I64(id as i64)),
            ("pad".into(), Value::Str(filler(id, pad))),
        ],
    }
}

/// Deterministic, poorly compressible filler.
pub fn filler(seed: u64, len: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}

/// A config for tests: one stream `s`, small segments and blocks.
pub fn small_cfg(data_dir: &Path) -> LogConfig {
    LogConfig {
        data_dir: data_dir.to_path_buf(),
        streams: vec!["s".into()],
        fsync: FsyncPolicy::Always,
        segment_bytes_max: 4096,
        block_records_max: 16,
        block_bytes_max: 64 << 10,
        block_linger: Duration::from_millis(1),
        ..LogConfig::default()
    }
}

/// Every durable record of `(stream, epoch)`, by seq, decoded from the stored blocks. Panics if
/// a seq appears twice.
pub fn read_all(h: &LogHandle, stream: &str, epoch: u64) -> BTreeMap<u64, Record> {
    let mut out = BTreeMap::new();
    let mut after = 0;
    loop {
        let blocks = h
            .read_blocks(stream, epoch, after, 1 << 20)
            .expect("read_blocks");
        let Some(last) = blocks.last() else {
            return out;
        };
        let next_after = last.header.last_seq();
        for b in blocks {
            let block =
                decode_block(&b.bytes, &DecodeLimits::default()).expect("stored block decodes");
            for (i, r) in block.records.into_iter().enumerate() {
                let seq = block.header.first_seq + i as u64;
                assert!(seq > after, "seq {seq} returned again after {after}");
                assert!(out.insert(seq, r).is_none(), "seq {seq} stored twice");
            }
        }
        after = next_after;
    }
}

/// Total size of the `.seg` files under `dir` (recursively), on the real file system.
pub fn seg_bytes_on_disk(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            total += seg_bytes_on_disk(&p);
        } else if p.extension().is_some_and(|x| x == "seg") {
            total += e.metadata().map(|m| m.len()).unwrap_or(0);
        }
    }
    total
}

/// The frames of a segment that hold blocks, leaving out sync marks.
pub fn block_frames(segment: &[u8]) -> Vec<sync::segment::FrameRef> {
    let scan = sync::segment::scan(segment).expect("a readable segment header");
    scan.frames
        .into_iter()
        .filter(|f| sync::segment::decode_sync_mark(f.block(segment).expect("in range")).is_none())
        .collect()
}
