//! Fuzz target bodies, shared by the `cargo fuzz` targets in `sync/fuzz/` and by the
//! `fuzz_corpus` test that replays their corpora on stable Rust.
//!
//! Each function takes arbitrary bytes, must never panic on them, and asserts the invariants
//! that must hold whenever decoding or parsing succeeds. A panic here is a bug in the decoder
//! (or in the invariant), which is exactly what the fuzzer is for.
#![doc(hidden)]

use crate::block::{self, BlockHeader, DecodeLimits, HEADER_LEN, VERSION_ROWS, VERSION_TAGGED};
use crate::decoded;
use crate::parse::{self, FIELDS_MAX, ParseOptions};
use crate::record::{Record, Value};
use crate::segment::{self, SEGMENT_HEADER_LEN};

/// Limits small enough that a fuzzer does not spend its time allocating.
const LIMITS: DecodeLimits = DecodeLimits {
    raw_bytes_max: 1 << 20,
    records_max: 1 << 16,
    body_bytes_max: 1 << 20,
    decoded_bytes_max: 16 << 20,
};

/// The segment reader: scan, decode every frame, and check the scan's own bookkeeping. The
/// input is tried as a whole file and, since few inputs carry a valid file header, also as
/// the frames following a valid header.
pub fn segment_scan(data: &[u8]) {
    if let Ok(scan) = segment::scan(data) {
        check_scan(data, &scan);
    }
    let mut file = segment::segment_header().to_vec();
    file.extend_from_slice(data);
    let scan = segment::scan(&file).expect("a valid header always scans");
    check_scan(&file, &scan);
}

fn check_scan(file: &[u8], scan: &segment::Scan) {
    let mut pos = SEGMENT_HEADER_LEN as u64;
    for frame in &scan.frames {
        assert_eq!(frame.offset, pos, "frames are contiguous");
        pos = frame.end();
        let bytes = frame
            .block(file)
            .expect("a scanned frame lies within the file");
        if let Some(b) = decode_sized(bytes) {
            check_block(&b);
        }
    }
    assert_eq!(
        scan.valid_len, pos,
        "valid_len ends at the last valid frame"
    );
    match scan.fault {
        None => assert_eq!(
            scan.valid_len as usize,
            file.len(),
            "no fault means the whole file is valid"
        ),
        Some((at, _)) => {
            assert_eq!(
                at, scan.valid_len,
                "the fault is where the valid prefix ends"
            );
            if let Some(next) = segment::resync(file, at as usize) {
                assert!(next > at as usize, "resync moves forward");
                assert!(
                    segment::check_frame(file, next).is_ok(),
                    "resync lands on a valid frame"
                );
            }
        }
    }
}

/// The block decoder on arbitrary bytes. Few inputs pass the checksums, so see also
/// [`block_body_decode`].
pub fn block_decode(data: &[u8]) {
    let _ = block::decode_header(data);
    let _ = block::verify_block(data, &LIMITS);
    if let Some(b) = decode_sized(data) {
        check_block(&b);
    }
}

/// The decoded-size contract every block and frame decoder's fuzz target asserts (and the
/// corpus replay tests with it): the size a decoder computed before materialising any record
/// never exceeds the configured `limit`, and the records it then built never exceed that
/// size (they are exactly that size: the sizing pass and the decoders read one grammar).
/// Public so that the protocol targets in `sync/fuzz/bodies.rs` call the same check.
pub fn assert_decoded_size(records: &[Record], computed: u64, limit: u64) {
    assert!(
        computed <= limit,
        "the decoded size computed before decoding ({computed}) is within the limit ({limit})"
    );
    let actual = decoded::records_bytes(records);
    assert!(
        actual <= computed,
        "the decoded records ({actual} bytes) exceed the size computed before decoding them ({computed})"
    );
    assert_eq!(
        actual, computed,
        "the decoded records are exactly the size computed before decoding them"
    );
}

/// The limits the block targets decode under (also for the protocol targets' blocks).
pub fn fuzz_limits() -> DecodeLimits {
    LIMITS
}

/// Decodes a block in two steps, sizing it first, and checks the decoded-size contract
/// ([`assert_decoded_size`]) under `limits`; whatever cannot be sized does not decode either,
/// and fails with the same error. Returns the block when it decodes.
pub fn decode_sized_with(bytes: &[u8], limits: &DecodeLimits) -> Option<block::Block> {
    let sized = match block::size_block(bytes, limits) {
        Ok(s) => s,
        Err(e) => {
            if let block::BlockError::DecodedTooLarge { size, limit } = e {
                assert!(
                    size > limit && limit == limits.decoded_bytes_max,
                    "a block is refused as too large only above the configured limit"
                );
            }
            let whole = block::decode_block(bytes, limits);
            assert_eq!(
                whole.err(),
                Some(e),
                "decode_block fails as size_block does"
            );
            return None;
        }
    };
    let mut records = Vec::new();
    let header = sized.decode_into(&mut records).ok()?;
    assert_decoded_size(&records, sized.decoded_bytes(), limits.decoded_bytes_max);
    let whole = block::decode_block(bytes, limits).expect("a block that sized and decoded decodes");
    assert_eq!(
        whole.records, records,
        "one-step and two-step decodes agree"
    );
    Some(block::Block { header, records })
}

fn decode_sized(bytes: &[u8]) -> Option<block::Block> {
    decode_sized_with(bytes, &LIMITS)
}

/// A block around a raw (decompressed) body: a valid header and zstd frame, so that a body
/// reaches its decoder past the checksums. `None` when zstd refuses the input.
pub fn wrap_body(version: u8, count: u32, raw: &[u8]) -> Option<Vec<u8>> {
    let body = zstd::bulk::compress(raw, 1).ok()?;
    let header = BlockHeader {
        version,
        flags: 0,
        epoch: 1,
        first_seq: 0,
        count,
        raw_len: raw.len() as u32,
        min_ts: i64::MIN,
        max_ts: i64::MAX,
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(&body),
        raw_crc: crc32c::crc32c(raw),
    };
    let mut bytes = Vec::with_capacity(HEADER_LEN + body.len());
    bytes.extend_from_slice(&block::write_header(&header));
    bytes.extend_from_slice(&body);
    Some(bytes)
}

/// The body decoders, reached past the checksums: the input's first byte picks the version
/// and the count, the rest is the raw (decompressed) body, and a valid header and zstd frame
/// are built around it.
pub fn block_body_decode(data: &[u8]) {
    let Some((&selector, raw)) = data.split_first() else {
        return;
    };
    let version = if selector & 0x80 == 0 {
        VERSION_ROWS
    } else {
        // Version 3 reads every version 2 body too, and tag columns besides.
        VERSION_TAGGED
    };
    let count = u32::from(selector & 0x7f) + 1;
    let Some(bytes) = wrap_body(version, count, raw) else {
        return;
    };
    if let Some(b) = decode_sized(&bytes) {
        check_block(&b);
    }
}

/// Whatever decodes must agree with its header and survive a re-encode unchanged.
fn check_block(b: &block::Block) {
    let h = &b.header;
    assert_eq!(
        b.records.len(),
        h.count as usize,
        "record count matches the header"
    );
    assert!(
        b.records
            .iter()
            .all(|r| (h.min_ts..=h.max_ts).contains(&r.ts)),
        "ts within header range"
    );
    let opts = block::EncodeOptions {
        version: h.version,
        flags: h.flags,
        zstd_level: 1,
    };
    let again = block::encode_block_with(&opts, h.epoch, h.first_seq, &b.records)
        .expect("decoded records re-encode");
    let back =
        block::decode_block(&again, &DecodeLimits::default()).expect("re-encoded block decodes");
    assert_eq!(
        back.records, b.records,
        "decode(encode(records)) == records"
    );
}

/// The NDJSON parser: errors point inside the input; successes write back and re-parse to
/// the same records.
pub fn ndjson_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse::parse_ndjson_with(
        text,
        &ParseOptions {
            default_ts: Some(0),
            ..ParseOptions::default()
        },
    ) {
        Ok(records) => {
            check_records(&records);
            let written = parse::write_ndjson(&records).expect("parsed floats are finite");
            let again = parse::parse_ndjson(&written).expect("written NDJSON parses");
            assert_eq!(again, records, "parse(write(records)) == records");
        }
        Err(e) => check_error_position(text, &e),
    }
}

/// The line-protocol parser: errors point inside the input; records are well formed.
pub fn line_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse::parse_line_protocol(
        text,
        &ParseOptions {
            default_ts: Some(0),
            ..ParseOptions::default()
        },
    ) {
        Ok(lines) => {
            for l in &lines {
                assert!(!l.measurement.is_empty(), "measurement is never empty");
                assert!(
                    !l.record.fields.is_empty(),
                    "line protocol records have fields"
                );
            }
            let records: Vec<Record> = lines.into_iter().map(|l| l.record).collect();
            check_records(&records);
        }
        Err(e) => check_error_position(text, &e),
    }
}

fn check_records(records: &[Record]) {
    for r in records {
        assert!(!r.key.is_empty(), "keys are never empty");
        assert!(
            r.key.len() <= decoded::KEY_BYTES_MAX,
            "parsed keys fit the block format"
        );
        assert!(r.fields.len() <= FIELDS_MAX, "field limit holds");
        for (i, (name, value)) in r.fields.iter().enumerate() {
            assert!(!name.is_empty(), "field names are never empty");
            assert!(
                name.len() <= decoded::FIELD_NAME_BYTES_MAX,
                "parsed field names fit the block format"
            );
            assert!(
                r.fields[..i].iter().all(|(n, _)| n != name),
                "field names are unique"
            );
            if let Value::F64(v) = value {
                assert!(v.is_finite(), "parsers only produce finite floats");
            }
        }
    }
}

fn check_error_position(text: &str, e: &parse::ParseError) {
    let lines = text.split('\n').count();
    assert!(
        e.line >= 1 && e.line <= lines,
        "error line {} within 1..={lines}",
        e.line
    );
    assert!(e.column >= 1, "columns are 1-based");
    assert!(
        !e.expected.is_empty() && !e.found.is_empty(),
        "errors say what and where"
    );
}
