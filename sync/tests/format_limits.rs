//! Decode limits: a corrupt or hostile block cannot make a reader allocate more than its
//! [`DecodeLimits`] allow.
//!
//! The blocks here carry valid checksums (a hostile peer can compute them), so only the limits
//! stand between them and memory. The zstd bombs decompress to 1 GiB; the test asserts that the
//! process's peak resident memory stays far below that while decoding them. Peak RSS is reset
//! through `/proc/self/clear_refs`, so the memory check runs as one test function with nothing
//! else allocating in this binary at the same time.

use std::io::Write;
use sync::block::{self, BlockError, BlockHeader, DecodeLimits, HEADER_LEN, VERSION_ROWS};
use sync::varint;

const LIMITS: DecodeLimits = DecodeLimits {
    raw_bytes_max: 8 << 20,
    records_max: 1 << 20,
    body_bytes_max: 8 << 20,
    decoded_bytes_max: 64 << 20,
};
const BOMB_BYTES: u64 = 1 << 30;

/// A block with correct header and body checksums around `body`, whatever its claims.
fn forge(body: &[u8], raw_len: u32, raw_crc: u32, count: u32) -> Vec<u8> {
    let h = BlockHeader {
        version: VERSION_ROWS,
        flags: 0,
        epoch: 1,
        first_seq: 0,
        count,
        raw_len,
        min_ts: i64::MIN,
        max_ts: i64::MAX,
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(body),
        raw_crc,
    };
    let mut out = block::write_header(&h).to_vec();
    out.extend_from_slice(body);
    out
}

/// 1 GiB of zeros compressed by streaming, so building it needs little memory. With
/// `declare_size` the zstd frame header states the real size; without, it states nothing.
fn zeros_bomb(declare_size: bool) -> Vec<u8> {
    let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
    if declare_size {
        enc.set_pledged_src_size(Some(BOMB_BYTES)).unwrap();
    }
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..(BOMB_BYTES >> 20) {
        enc.write_all(&chunk).unwrap();
    }
    enc.finish().unwrap()
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Resets the peak-RSS counter; false where the kernel does not allow it.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[test]
fn zstd_bombs_are_rejected_with_bounded_memory() {
    let undeclared = zeros_bomb(false);
    let declared = zeros_bomb(true);
    assert!(
        undeclared.len() < 1 << 20 && declared.len() < 1 << 20,
        "bombs should be small"
    );
    let cases = [
        // The header claims a huge raw size: refused before any decompression.
        ("huge raw_len claimed", forge(&undeclared, u32::MAX, 0, 1)),
        // The header claims a small raw size, the body really holds 1 GiB.
        (
            "1 GiB behind a 1 MiB claim",
            forge(&undeclared, 1 << 20, 0, 1),
        ),
        (
            "1 GiB declared in the zstd frame",
            forge(&declared, 1 << 20, 0, 1),
        ),
        (
            "1 GiB at the raw limit",
            forge(&undeclared, LIMITS.raw_bytes_max, 0, 1),
        ),
    ];
    let baseline_kib = status_kib("VmRSS:").unwrap_or(0);
    let measured = reset_peak_rss();
    for (name, bytes) in &cases {
        let r = block::decode_block(bytes, &LIMITS);
        assert!(r.is_err(), "{name}: decoded");
        eprintln!("{name}: {}", r.unwrap_err());
    }
    assert!(matches!(
        block::decode_block(&cases[0].1, &LIMITS),
        Err(BlockError::RawTooLarge { .. })
    ));
    assert!(matches!(
        block::decode_block(&cases[1].1, &LIMITS),
        Err(BlockError::Decompress(_))
    ));
    if measured {
        let peak_kib = status_kib("VmHWM:").unwrap();
        let grown_mib = peak_kib.saturating_sub(baseline_kib) / 1024;
        eprintln!("peak RSS grew by {grown_mib} MiB while decoding the bombs");
        assert!(grown_mib < 64, "decoding bombs grew RSS by {grown_mib} MiB");
    } else {
        eprintln!("note: /proc/self/clear_refs is not writable here; memory growth not measured");
    }
}

#[test]
fn claimed_sizes_beyond_limits_are_refused_before_work() {
    let body = zstd::bulk::compress(&[0u8; 16], 1).unwrap();
    let raw_crc = crc32c::crc32c(&[0u8; 16]);
    let over_records = forge(&body, 16, raw_crc, LIMITS.records_max + 1);
    assert!(matches!(
        block::decode_block(&over_records, &LIMITS),
        Err(BlockError::TooManyRecords { .. })
    ));
    let tight = DecodeLimits {
        body_bytes_max: body.len() as u32 - 1,
        ..LIMITS
    };
    assert!(matches!(
        block::decode_block(&forge(&body, 16, raw_crc, 1), &tight),
        Err(BlockError::BodyTooLarge { .. })
    ));
    // A header whose body length runs past the bytes given is truncation, not an allocation.
    let mut short = forge(&body, 16, raw_crc, 1);
    short.truncate(HEADER_LEN + 1);
    assert!(matches!(
        block::decode_block(&short, &LIMITS),
        Err(BlockError::Truncated { .. })
    ));
}

/// Raw bodies that claim more than they hold; each is wrapped in a valid block.
fn forge_raw(raw: &[u8], count: u32) -> Vec<u8> {
    let body = zstd::bulk::compress(raw, 1).unwrap();
    forge(&body, raw.len() as u32, crc32c::crc32c(raw), count)
}

#[test]
fn body_length_claims_are_bounded_by_the_body() {
    // One record claiming 2^62 fields.
    let mut raw = Vec::new();
    varint::put_bytes(&mut raw, b"k");
    varint::put_i64(&mut raw, 0);
    varint::put_u64(&mut raw, 1 << 62);
    let r = block::decode_block(&forge_raw(&raw, 1), &LIMITS);
    assert!(
        matches!(
            r,
            Err(BlockError::Body {
                what: "field count exceeds body",
                ..
            })
        ),
        "{r:?}"
    );

    // A key claiming 2^40 bytes.
    let mut raw = Vec::new();
    varint::put_u64(&mut raw, 1 << 40);
    raw.extend_from_slice(b"abc");
    let r = block::decode_block(&forge_raw(&raw, 1), &LIMITS);
    assert!(matches!(r, Err(BlockError::Body { .. })), "{r:?}");

    // A million records claimed by a 3-byte body: the record vector is sized by the body.
    let mut raw = Vec::new();
    varint::put_bytes(&mut raw, b"");
    varint::put_i64(&mut raw, 0);
    varint::put_u64(&mut raw, 0);
    let r = block::decode_block(&forge_raw(&raw, 1 << 20), &LIMITS);
    assert!(matches!(r, Err(BlockError::Body { .. })), "{r:?}");

    // Trailing bytes after the claimed records are refused, as is a non-canonical bool.
    let mut raw = Vec::new();
    varint::put_bytes(&mut raw, b"k");
    varint::put_i64(&mut raw, 0);
    varint::put_u64(&mut raw, 1);
    varint::put_bytes(&mut raw, b"b");
    raw.extend_from_slice(&[2, 7]);
    let r = block::decode_block(&forge_raw(&raw, 1), &LIMITS);
    assert!(
        matches!(
            r,
            Err(BlockError::Body {
                what: "bool byte is not 0 or 1",
                ..
            })
        ),
        "{r:?}"
    );
    raw.pop();
    raw.push(1);
    assert!(block::decode_block(&forge_raw(&raw, 1), &LIMITS).is_ok());
    raw.push(0);
    let r = block::decode_block(&forge_raw(&raw, 1), &LIMITS);
    assert!(
        matches!(
            r,
            Err(BlockError::Body {
                what: "trailing bytes after last record",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn header_claims_must_match_the_records() {
    let rec = sync::Record {
        tags: Vec::new(),
        key: "k".into(),
        ts: 50,
        fields: vec![],
    };
    let good = block::encode_block(VERSION_ROWS, 1, 0, std::slice::from_ref(&rec)).unwrap();
    let mut h = block::decode_header(&good).unwrap();
    let body = &good[HEADER_LEN..];
    h.min_ts = 51;
    let mut bad = block::write_header(&h).to_vec();
    bad.extend_from_slice(body);
    // min_ts > max_ts is caught by the header check alone.
    assert!(matches!(
        block::decode_header(&bad),
        Err(BlockError::BadTsRange { .. })
    ));
    h.min_ts = 0;
    h.max_ts = 49;
    let mut bad = block::write_header(&h).to_vec();
    bad.extend_from_slice(body);
    assert!(matches!(
        block::decode_block(&bad, &LIMITS),
        Err(BlockError::TsOutOfRange {
            index: 0,
            ts: 50,
            ..
        })
    ));
}
