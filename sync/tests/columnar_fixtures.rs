//! The checked-in version 2 fixture must keep reading: `fixtures/v2/blocks.seg` is a segment
//! file of version 2 blocks and `fixtures/v2/records.ndjson` the records it holds, in exact
//! form (see `columnar_support::exact_json`).
//!
//! The fixture is written once, by a release that introduced the format, with
//! `TRIBUTARY_WRITE_FIXTURES=1 cargo test -p tributary-sync --test columnar_fixtures`; after
//! that it is never rewritten, so a reader change that breaks old blocks fails here.

mod columnar_support;

use std::path::{Path, PathBuf};

use columnar_support::{from_exact_json, odd_records, telemetry, write_fixture, write_fixtures};
use sync::Record;
use sync::block::{self, DecodeLimits, VERSION_COLUMNAR};
use sync::segment;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v2")
}

/// The fixture's blocks: telemetry, odd values, and one block with a single record.
fn fixture_blocks() -> Vec<Vec<Record>> {
    let mut tele = telemetry(5, 30);
    tele.truncate(137);
    vec![tele, odd_records(), vec![odd_records().remove(1)]]
}

fn write() {
    write_fixture(&dir(), fixture_blocks(), VERSION_COLUMNAR);
}

#[test]
fn v2_fixture_reads() {
    if write_fixtures() {
        write();
    }
    let seg = std::fs::read(dir().join("blocks.seg")).expect("fixture segment; see the file docs");
    let text = std::fs::read_to_string(dir().join("records.ndjson")).unwrap();
    let want: Vec<Record> = text
        .lines()
        .map(|l| from_exact_json(&serde_json::from_str(l).unwrap()).unwrap())
        .collect();
    let scan = segment::scan(&seg).unwrap();
    assert!(scan.fault.is_none(), "{:?}", scan.fault);
    assert_eq!(scan.frames.len(), 3);
    let mut got = Vec::new();
    let mut next_seq = 1;
    for f in &scan.frames {
        let bytes = &seg[f.block_offset() as usize..f.end() as usize];
        let b = block::decode_block(bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(b.header.version, VERSION_COLUMNAR);
        assert_eq!(b.header.epoch, 3);
        assert_eq!(b.header.first_seq, next_seq);
        next_seq = b.header.last_seq() + 1;
        got.extend(b.records);
    }
    assert_eq!(got, want);
    // The expected records are also what this build's fixture generator produces, so the
    // NDJSON cannot silently drift from the code that documents it.
    assert_eq!(want, fixture_blocks().concat());
}
