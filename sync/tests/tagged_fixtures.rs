//! Block version 3 (columnar with tag columns): the checked-in fixture must keep reading, a
//! record's tags survive every path, and a version 2 body may not carry a tag column.
//!
//! `fixtures/v3/blocks.seg` is a segment of version 3 blocks and `fixtures/v3/records.ndjson`
//! the records it holds in exact form (`columnar_support::exact_json`). It is written once, with
//! `TRIBUTARY_WRITE_FIXTURES=1 cargo test -p tributary-sync --test tagged_fixtures`, and never
//! rewritten, so a reader change that breaks old blocks fails here.

mod columnar_support;

use std::path::{Path, PathBuf};

use columnar_support::{from_exact_json, odd_records, telemetry, write_fixture, write_fixtures};
use sync::block::{self, DecodeLimits, VERSION_COLUMNAR, VERSION_ROWS, VERSION_TAGGED};
use sync::record::key_from_tags;
use sync::{Record, Value, columnar, decoded, segment};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v3")
}

fn tag(name: &str, value: &str) -> (String, String) {
    (name.into(), value.into())
}

/// Telemetry with `device`/`unit` tags as line protocol gives them, keyed by its tags.
fn tagged_telemetry() -> Vec<Record> {
    let mut out = telemetry(4, 20);
    for (i, r) in out.iter_mut().enumerate() {
        r.tags = vec![
            tag("device", &format!("truck-{:04}", i % 4)),
            tag("unit", if i % 3 == 0 { "engine" } else { "cab" }),
        ];
        r.key = key_from_tags(&r.tags);
    }
    out
}

/// The fixture's blocks: tagged telemetry; records mixing tagged and untagged, a tag sharing
/// its name with a field, tag values that need escaping in a key, non-ASCII; one record alone.
fn fixture_blocks() -> Vec<Vec<Record>> {
    let mut mixed = odd_records();
    mixed.truncate(6);
    for (i, r) in mixed.iter_mut().enumerate() {
        if i % 2 == 0 {
            r.tags = vec![tag("note", "ünïcode ☃"), tag("path", "a/b=c%d")];
            r.fields.push(("note".into(), Value::Str("a field".into())));
        }
    }
    let single = Record {
        key: "k".into(),
        tags: vec![tag("only", "one")],
        ts: -1,
        fields: vec![],
    };
    vec![tagged_telemetry(), mixed, vec![single]]
}

fn write() {
    write_fixture(&dir(), fixture_blocks(), VERSION_COLUMNAR);
}

#[test]
fn v3_fixture_reads() {
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
    for f in &scan.frames {
        let bytes = &seg[f.block_offset() as usize..f.end() as usize];
        let b = block::decode_block(bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(b.header.version, VERSION_TAGGED);
        got.extend(b.records);
    }
    assert!(got.iter().any(|r| !r.tags.is_empty()));
    assert_eq!(got, want);
    assert_eq!(want, fixture_blocks().concat());
}

#[test]
fn tags_seal_as_version_3_whatever_version_is_asked_for() {
    for asked in [VERSION_ROWS, VERSION_COLUMNAR, VERSION_TAGGED] {
        let records = tagged_telemetry();
        let bytes = block::encode_block(asked, 1, 1, &records).unwrap();
        let b = block::decode_block(&bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(b.header.version, VERSION_TAGGED, "asked for {asked}");
        assert_eq!(b.records, records);
    }
    // Without tags a block keeps the version it was asked for, so its bytes are unchanged.
    let plain = telemetry(2, 3);
    for asked in [VERSION_ROWS, VERSION_COLUMNAR] {
        let bytes = block::encode_block(asked, 1, 1, &plain).unwrap();
        assert_eq!(block::decode_header(&bytes).unwrap().version, asked);
    }
}

#[test]
fn the_decoded_size_counts_tags_exactly() {
    for records in fixture_blocks() {
        let bytes = block::encode_block(VERSION_TAGGED, 1, 1, &records).unwrap();
        let sized = block::size_block(&bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(sized.decoded_bytes(), decoded::records_bytes(&records));
        let tags: u64 = records
            .iter()
            .flat_map(|r| &r.tags)
            .map(|(n, v)| decoded::TAG_OVERHEAD_BYTES + (n.len() + v.len()) as u64)
            .sum();
        assert!(tags > 0);
        let mut stripped = records.clone();
        stripped.iter_mut().for_each(|r| r.tags.clear());
        assert_eq!(
            decoded::records_bytes(&records),
            decoded::records_bytes(&stripped) + tags
        );
    }
}

#[test]
fn a_version_2_block_with_a_tag_column_is_refused() {
    let records = tagged_telemetry();
    let raw = columnar::encode(&records).unwrap();
    let count = records.len() as u32;
    assert!(columnar::decoded_size_of(&raw, count, true).is_ok());
    let err = columnar::decoded_size_of(&raw, count, false).unwrap_err();
    assert!(err.to_string().contains("tag column"), "{err}");
    let mut out = Vec::new();
    assert!(columnar::decode_into_of(&raw, count, false, &mut out).is_err());
    // The same body framed as a version 2 block is refused by the block decoder.
    let bytes = sync::fuzzing::wrap_body(VERSION_COLUMNAR, count, &raw).unwrap();
    let err = block::decode_block(&bytes, &DecodeLimits::default()).unwrap_err();
    assert!(err.to_string().contains("tag column"), "{err}");
}

#[test]
fn decoding_over_old_records_replaces_their_tags() {
    let blocks = fixture_blocks();
    let mut out = Vec::new();
    for records in blocks.iter().chain(blocks.iter().rev()) {
        let bytes = block::encode_block(VERSION_TAGGED, 1, 1, records).unwrap();
        block::decode_block_into(&bytes, &DecodeLimits::default(), &mut out).unwrap();
        assert_eq!(&out, records);
    }
}
