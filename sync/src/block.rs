//! Sealed blocks: the unit of durability and of replication.
//!
//! A block is an immutable run of consecutive records of one stream from one device epoch.
//! It is a fixed 64-byte header followed by a zstd-compressed body. The layout is specified in
//! `docs/format/segment.md`; offsets below are derived from one another and the header size is
//! checked at compile time.
//!
//! Decoding is defensive: every length is checked against [`DecodeLimits`] before anything is
//! allocated, so a corrupt or hostile block cannot exhaust memory. That includes the records
//! themselves: [`size_block`] computes the exact decoded size ([`crate::decoded`]) from the
//! body before a single record is built, and refuses a block above `decoded_bytes_max`.

use crate::decoded::{self, FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
use crate::record::{Record, Value};
use crate::{columnar, varint};
use thiserror::Error;

/// `TRBK`: marks the start of every block header.
pub const BLOCK_MAGIC: [u8; 4] = *b"TRBK";
/// Row-by-row body encoding.
pub const VERSION_ROWS: u8 = 1;
/// Columnar body encoding (see [`crate::columnar`]).
pub const VERSION_COLUMNAR: u8 = 2;
/// Columnar body encoding with tag columns. A block is sealed as version 3 whenever one of its
/// records has tags, whatever version was asked for; blocks without tags keep their version,
/// so their bytes (and their checksums) are what they were before tags existed.
pub const VERSION_TAGGED: u8 = 3;

// Header field offsets, each derived from the previous field.
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = OFF_MAGIC + 4;
const OFF_FLAGS: usize = OFF_VERSION + 1;
const OFF_HEADER_LEN: usize = OFF_FLAGS + 1;
const OFF_EPOCH: usize = OFF_HEADER_LEN + 2;
const OFF_FIRST_SEQ: usize = OFF_EPOCH + 8;
const OFF_COUNT: usize = OFF_FIRST_SEQ + 8;
const OFF_RAW_LEN: usize = OFF_COUNT + 4;
const OFF_MIN_TS: usize = OFF_RAW_LEN + 4;
const OFF_MAX_TS: usize = OFF_MIN_TS + 8;
const OFF_BODY_LEN: usize = OFF_MAX_TS + 8;
const OFF_BODY_CRC: usize = OFF_BODY_LEN + 4;
const OFF_RAW_CRC: usize = OFF_BODY_CRC + 4;
const OFF_HEADER_CRC: usize = OFF_RAW_CRC + 4;
/// Size of the fixed block header in bytes.
pub const HEADER_LEN: usize = OFF_HEADER_CRC + 4;
const _: () = assert!(HEADER_LEN == 64);

/// Set on every block of a producer batch except its last, when one batch had to be split
/// across blocks. Recovery drops a trailing run of such blocks, so a batch is all or nothing.
pub const FLAG_BATCH_CONTINUES: u8 = 1;
/// Set on every block of a split batch except its first, so recovery can tell a block that
/// starts a batch from one whose head is missing. Old readers ignore it.
pub const FLAG_BATCH_CONTINUED: u8 = 2;

/// zstd level used when sealing. Level 3 is zstd's default balance of speed and ratio.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

/// Limits applied while decoding untrusted blocks.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    /// Largest decompressed body accepted.
    pub raw_bytes_max: u32,
    /// Largest record count accepted.
    pub records_max: u32,
    /// Largest compressed body accepted.
    pub body_bytes_max: u32,
    /// Largest decoded size ([`crate::decoded`]) accepted: what the records take once
    /// materialised, computed from the body before any is built.
    pub decoded_bytes_max: u64,
}

/// The default `decoded_bytes_max`: 256 MiB. A sealed block of 32,768 telemetry records with
/// ten fields each decodes to about 27 MiB.
pub const DECODED_BYTES_MAX_DEFAULT: u64 = 256 << 20;

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            raw_bytes_max: 64 << 20,
            records_max: 1 << 20,
            body_bytes_max: 64 << 20,
            decoded_bytes_max: DECODED_BYTES_MAX_DEFAULT,
        }
    }
}

/// The decoded fixed header of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub version: u8,
    /// Bit flags; see [`FLAG_BATCH_CONTINUES`]. Unknown bits are preserved and ignored.
    pub flags: u8,
    pub epoch: u64,
    pub first_seq: u64,
    pub count: u32,
    pub raw_len: u32,
    pub min_ts: i64,
    pub max_ts: i64,
    pub body_len: u32,
    /// crc32c of the compressed body as stored.
    pub body_crc: u32,
    /// crc32c of the decompressed body: checked again after decompression.
    pub raw_crc: u32,
}

impl BlockHeader {
    /// The last seq in the block. Blocks are never empty, and a decoded header's range never
    /// overflows; the parentheses matter for a range that ends at `u64::MAX`.
    pub fn last_seq(&self) -> u64 {
        self.first_seq + (u64::from(self.count) - 1)
    }

    /// Total encoded size of the block, header included.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len as usize
    }
}

/// A decoded block.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub header: BlockHeader,
    pub records: Vec<Record>,
}

/// Why a block could not be sealed.
#[derive(Debug, Error)]
pub enum EncodeError {
    #[error("a block must hold at least one record")]
    Empty,
    #[error("block holds {0} records, more than the format allows")]
    TooManyRecords(usize),
    #[error("block body is {0} bytes, more than the format allows")]
    TooLarge(usize),
    #[error("unsupported block version {0}")]
    UnsupportedVersion(u8),
    #[error("seq range starting at {first_seq} with {count} records overflows u64")]
    SeqOverflow { first_seq: u64, count: usize },
    #[error("compression failed: {0}")]
    Compress(#[source] std::io::Error),
    #[error("columnar encoding failed: {0}")]
    Columnar(#[from] columnar::ColumnarError),
    #[error("record {index}: {what} of {len} bytes is longer than the format allows ({max})")]
    TooLong {
        index: usize,
        what: &'static str,
        len: usize,
        max: usize,
    },
}

/// Why bytes are not a valid block. Every variant names what was wrong.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("block is {got} bytes, shorter than the {need}-byte header")]
    ShortHeader { got: usize, need: usize },
    #[error("bad block magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("block header checksum mismatch")]
    HeaderChecksum,
    #[error("unsupported block version {0}; this build reads versions 1 to 3")]
    UnsupportedVersion(u8),
    #[error("block header length {0} is not 64")]
    BadHeaderLen(u16),
    #[error("block records {count} exceed limit {limit}")]
    TooManyRecords { count: u32, limit: u32 },
    #[error("block with zero records")]
    Empty,
    #[error("block body of {len} bytes exceeds limit {limit}")]
    BodyTooLarge { len: u32, limit: u32 },
    #[error("decompressed size {len} exceeds limit {limit}")]
    RawTooLarge { len: u32, limit: u32 },
    #[error("block is {got} bytes but its header says {need}")]
    Truncated { got: usize, need: usize },
    #[error("block body checksum mismatch")]
    BodyChecksum,
    #[error("decompressed body checksum mismatch")]
    RawChecksum,
    #[error("decompression failed: {0}")]
    Decompress(String),
    #[error("decompressed {got} bytes, header says {want}")]
    RawLenMismatch { got: usize, want: u32 },
    #[error("malformed block body at byte {offset}: {what}")]
    Body { offset: usize, what: &'static str },
    #[error("malformed columnar body: {0}")]
    Columnar(String),
    #[error("block seq range first={first_seq} count={count} overflows")]
    SeqOverflow { first_seq: u64, count: u32 },
    #[error("record {index} has ts {ts}, outside the header's range {min_ts}..={max_ts}")]
    TsOutOfRange {
        index: u32,
        ts: i64,
        min_ts: i64,
        max_ts: i64,
    },
    #[error("block header min_ts {min_ts} is after max_ts {max_ts}")]
    BadTsRange { min_ts: i64, max_ts: i64 },
    /// The records would take more memory than `decoded_bytes_max` (see [`crate::decoded`]).
    #[error("block decodes to {size} bytes of records, more than the {limit}-byte limit")]
    DecodedTooLarge { size: u64, limit: u64 },
    #[error("{what} of {len} bytes at body byte {offset} is longer than the format allows ({max})")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
        offset: usize,
    },
}

/// Seals `records` into one block with the given body version.
pub fn encode_block(
    version: u8,
    epoch: u64,
    first_seq: u64,
    records: &[Record],
) -> Result<Vec<u8>, EncodeError> {
    let opts = EncodeOptions {
        version,
        ..EncodeOptions::default()
    };
    encode_block_with(&opts, epoch, first_seq, records)
}

/// How a block is sealed.
#[derive(Debug, Clone, Copy)]
pub struct EncodeOptions {
    pub version: u8,
    pub flags: u8,
    pub zstd_level: i32,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            version: VERSION_ROWS,
            flags: 0,
            zstd_level: DEFAULT_ZSTD_LEVEL,
        }
    }
}

/// As [`encode_block`], with explicit options.
pub fn encode_block_with(
    opts: &EncodeOptions,
    epoch: u64,
    first_seq: u64,
    records: &[Record],
) -> Result<Vec<u8>, EncodeError> {
    let (version, level) = (opts.version, opts.zstd_level);
    if records.is_empty() {
        return Err(EncodeError::Empty);
    }
    let count =
        u32::try_from(records.len()).map_err(|_| EncodeError::TooManyRecords(records.len()))?;
    if first_seq.checked_add(u64::from(count) - 1).is_none() {
        return Err(EncodeError::SeqOverflow {
            first_seq,
            count: records.len(),
        });
    }
    check_lengths(records)?;
    let version = match version {
        VERSION_ROWS | VERSION_COLUMNAR if records.iter().any(|r| !r.tags.is_empty()) => {
            VERSION_TAGGED
        }
        v => v,
    };
    let raw = match version {
        VERSION_ROWS => encode_rows(records),
        VERSION_COLUMNAR | VERSION_TAGGED => columnar::encode(records)?,
        other => return Err(EncodeError::UnsupportedVersion(other)),
    };
    let raw_len = u32::try_from(raw.len()).map_err(|_| EncodeError::TooLarge(raw.len()))?;
    let body = zstd::bulk::compress(&raw, level).map_err(EncodeError::Compress)?;
    let body_len = u32::try_from(body.len()).map_err(|_| EncodeError::TooLarge(body.len()))?;
    let min_ts = records.iter().map(|r| r.ts).min().expect("non-empty");
    let max_ts = records.iter().map(|r| r.ts).max().expect("non-empty");
    let header = BlockHeader {
        version,
        flags: opts.flags,
        epoch,
        first_seq,
        count,
        raw_len,
        min_ts,
        max_ts,
        body_len,
        body_crc: crc32c::crc32c(&body),
        raw_crc: crc32c::crc32c(&raw),
    };
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&write_header(&header));
    out.extend_from_slice(&body);
    Ok(out)
}

/// Refuses keys and field names that a decoder would reject.
fn check_lengths(records: &[Record]) -> Result<(), EncodeError> {
    let too_long = |index, what, len, max| EncodeError::TooLong {
        index,
        what,
        len,
        max,
    };
    for (index, r) in records.iter().enumerate() {
        if r.key.len() > KEY_BYTES_MAX {
            return Err(too_long(index, "key", r.key.len(), KEY_BYTES_MAX));
        }
        if let Some((n, _)) = r
            .fields
            .iter()
            .find(|(n, _)| n.len() > FIELD_NAME_BYTES_MAX)
        {
            return Err(too_long(index, "field name", n.len(), FIELD_NAME_BYTES_MAX));
        }
        if let Some((n, _)) = r.tags.iter().find(|(n, _)| n.len() > FIELD_NAME_BYTES_MAX) {
            return Err(too_long(index, "tag name", n.len(), FIELD_NAME_BYTES_MAX));
        }
    }
    Ok(())
}

/// Serialises a header, computing its own checksum.
pub fn write_header(h: &BlockHeader) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[OFF_MAGIC..OFF_VERSION].copy_from_slice(&BLOCK_MAGIC);
    b[OFF_VERSION] = h.version;
    b[OFF_FLAGS] = h.flags;
    b[OFF_HEADER_LEN..OFF_EPOCH].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
    b[OFF_EPOCH..OFF_FIRST_SEQ].copy_from_slice(&h.epoch.to_le_bytes());
    b[OFF_FIRST_SEQ..OFF_COUNT].copy_from_slice(&h.first_seq.to_le_bytes());
    b[OFF_COUNT..OFF_RAW_LEN].copy_from_slice(&h.count.to_le_bytes());
    b[OFF_RAW_LEN..OFF_MIN_TS].copy_from_slice(&h.raw_len.to_le_bytes());
    b[OFF_MIN_TS..OFF_MAX_TS].copy_from_slice(&h.min_ts.to_le_bytes());
    b[OFF_MAX_TS..OFF_BODY_LEN].copy_from_slice(&h.max_ts.to_le_bytes());
    b[OFF_BODY_LEN..OFF_BODY_CRC].copy_from_slice(&h.body_len.to_le_bytes());
    b[OFF_BODY_CRC..OFF_RAW_CRC].copy_from_slice(&h.body_crc.to_le_bytes());
    b[OFF_RAW_CRC..OFF_HEADER_CRC].copy_from_slice(&h.raw_crc.to_le_bytes());
    let crc = crc32c::crc32c(&b[..OFF_HEADER_CRC]);
    b[OFF_HEADER_CRC..HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    b
}

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Parses and verifies the fixed header. Does not touch the body.
pub fn decode_header(bytes: &[u8]) -> Result<BlockHeader, BlockError> {
    if bytes.len() < HEADER_LEN {
        return Err(BlockError::ShortHeader {
            got: bytes.len(),
            need: HEADER_LEN,
        });
    }
    let magic: [u8; 4] = bytes[OFF_MAGIC..OFF_VERSION].try_into().expect("4 bytes");
    if magic != BLOCK_MAGIC {
        return Err(BlockError::BadMagic(magic));
    }
    if crc32c::crc32c(&bytes[..OFF_HEADER_CRC]) != le_u32(bytes, OFF_HEADER_CRC) {
        return Err(BlockError::HeaderChecksum);
    }
    let version = bytes[OFF_VERSION];
    if !matches!(version, VERSION_ROWS | VERSION_COLUMNAR | VERSION_TAGGED) {
        return Err(BlockError::UnsupportedVersion(version));
    }
    let header_len = le_u16(bytes, OFF_HEADER_LEN);
    if usize::from(header_len) != HEADER_LEN {
        return Err(BlockError::BadHeaderLen(header_len));
    }
    let h = BlockHeader {
        version,
        flags: bytes[OFF_FLAGS],
        epoch: le_u64(bytes, OFF_EPOCH),
        first_seq: le_u64(bytes, OFF_FIRST_SEQ),
        count: le_u32(bytes, OFF_COUNT),
        raw_len: le_u32(bytes, OFF_RAW_LEN),
        min_ts: le_u64(bytes, OFF_MIN_TS) as i64,
        max_ts: le_u64(bytes, OFF_MAX_TS) as i64,
        body_len: le_u32(bytes, OFF_BODY_LEN),
        body_crc: le_u32(bytes, OFF_BODY_CRC),
        raw_crc: le_u32(bytes, OFF_RAW_CRC),
    };
    if h.count == 0 {
        return Err(BlockError::Empty);
    }
    if h.first_seq.checked_add(u64::from(h.count) - 1).is_none() {
        return Err(BlockError::SeqOverflow {
            first_seq: h.first_seq,
            count: h.count,
        });
    }
    if h.min_ts > h.max_ts {
        return Err(BlockError::BadTsRange {
            min_ts: h.min_ts,
            max_ts: h.max_ts,
        });
    }
    Ok(h)
}

/// Verifies the header and the compressed body's checksum without decompressing.
pub fn verify_block(bytes: &[u8], limits: &DecodeLimits) -> Result<BlockHeader, BlockError> {
    let h = decode_header(bytes)?;
    check_limits(&h, limits)?;
    let need = h.encoded_len();
    if bytes.len() != need {
        return Err(BlockError::Truncated {
            got: bytes.len(),
            need,
        });
    }
    if crc32c::crc32c(&bytes[HEADER_LEN..]) != h.body_crc {
        return Err(BlockError::BodyChecksum);
    }
    Ok(h)
}

fn check_limits(h: &BlockHeader, limits: &DecodeLimits) -> Result<(), BlockError> {
    if h.count > limits.records_max {
        return Err(BlockError::TooManyRecords {
            count: h.count,
            limit: limits.records_max,
        });
    }
    if h.body_len > limits.body_bytes_max {
        return Err(BlockError::BodyTooLarge {
            len: h.body_len,
            limit: limits.body_bytes_max,
        });
    }
    if h.raw_len > limits.raw_bytes_max {
        return Err(BlockError::RawTooLarge {
            len: h.raw_len,
            limit: limits.raw_bytes_max,
        });
    }
    Ok(())
}

/// A verified block whose body is decompressed and whose decoded size is known and within the
/// limits, before any record is built. Lets a caller reserve memory for exactly
/// [`SizedBlock::decoded_bytes`] before [`SizedBlock::decode_into`] spends it.
#[derive(Debug, Clone)]
pub struct SizedBlock {
    header: BlockHeader,
    raw: Vec<u8>,
    decoded_bytes: u64,
}

impl SizedBlock {
    pub fn header(&self) -> &BlockHeader {
        &self.header
    }

    /// What the records will take once decoded, as defined in [`crate::decoded`].
    pub fn decoded_bytes(&self) -> u64 {
        self.decoded_bytes
    }

    /// Builds the records into `out` (cleared first, its allocations reused where the body
    /// version allows it).
    pub fn decode_into(&self, out: &mut Vec<Record>) -> Result<BlockHeader, BlockError> {
        let h = self.header;
        match h.version {
            VERSION_ROWS => *out = decode_rows(&self.raw, h.count)?,
            v @ (VERSION_COLUMNAR | VERSION_TAGGED) => {
                columnar::decode_into_of(&self.raw, h.count, v == VERSION_TAGGED, out)
                    .map_err(columnar_error)?
            }
            other => return Err(BlockError::UnsupportedVersion(other)),
        }
        check_records(&h, out)?;
        // The sizing pass and the decoder read the same grammar, so only a bug makes them
        // disagree. Not a release assert: a hub must never crash-loop on a stored block. The
        // fuzz targets and the table tests check it on every input they see.
        debug_assert_eq!(decoded::records_bytes(out), self.decoded_bytes);
        Ok(h)
    }
}

/// Verifies a block, decompresses its body and computes its decoded size without building a
/// record; a block over `limits.decoded_bytes_max` is [`BlockError::DecodedTooLarge`].
pub fn size_block(bytes: &[u8], limits: &DecodeLimits) -> Result<SizedBlock, BlockError> {
    let header = verify_block(bytes, limits)?;
    let raw = decompress_body(&header, &bytes[HEADER_LEN..])?;
    let size = match header.version {
        VERSION_ROWS => rows_decoded_size(&raw, header.count)?,
        v @ (VERSION_COLUMNAR | VERSION_TAGGED) => {
            columnar::decoded_size_of(&raw, header.count, v == VERSION_TAGGED)
                .map_err(columnar_error)?
        }
        other => return Err(BlockError::UnsupportedVersion(other)),
    };
    if size > limits.decoded_bytes_max && !mutation::decoded_size_guard_off() {
        return Err(BlockError::DecodedTooLarge {
            size,
            limit: limits.decoded_bytes_max,
        });
    }
    Ok(SizedBlock {
        header,
        raw,
        decoded_bytes: size,
    })
}

/// Test-only mutation switch (cargo feature `fault-injection`, enabled from this crate's own
/// dev-dependencies, never in a build that ships): with the decoded-size guard off,
/// [`size_block`] lets every size through, so that `tests/decoded_size_mutation.rs` can prove
/// the bomb tests fail without the guard. Process-wide: only that one-test binary uses it.
pub mod mutation {
    #[cfg(feature = "fault-injection")]
    static OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Switches the decoded-size guard off (`true`) or back on.
    #[cfg(feature = "fault-injection")]
    pub fn set_decoded_size_guard_off(off: bool) {
        OFF.store(off, std::sync::atomic::Ordering::SeqCst);
    }

    #[inline]
    pub(crate) fn decoded_size_guard_off() -> bool {
        #[cfg(feature = "fault-injection")]
        return OFF.load(std::sync::atomic::Ordering::SeqCst);
        #[cfg(not(feature = "fault-injection"))]
        false
    }
}

fn columnar_error(e: columnar::ColumnarError) -> BlockError {
    match e {
        columnar::ColumnarError::TooLong {
            what,
            len,
            max,
            offset,
        } => BlockError::TooLong {
            what,
            len,
            max,
            offset,
        },
        other => BlockError::Columnar(other.to_string()),
    }
}

/// Verifies and fully decodes a block, within the limits (the decoded size included).
pub fn decode_block(bytes: &[u8], limits: &DecodeLimits) -> Result<Block, BlockError> {
    let mut records = Vec::new();
    let header = decode_block_into(bytes, limits, &mut records)?;
    Ok(Block { header, records })
}

/// As [`decode_block`], decoding into `out` (cleared first) so a reader that walks many
/// blocks reuses the previous block's allocations. Version 2 bodies reuse the record buffers
/// themselves, which keeps decoding fast whatever the allocator does with freed memory.
pub fn decode_block_into(
    bytes: &[u8],
    limits: &DecodeLimits,
    out: &mut Vec<Record>,
) -> Result<BlockHeader, BlockError> {
    size_block(bytes, limits)?.decode_into(out)
}

/// Cross-checks decoded records against the header, whatever the body version. Readers prune
/// blocks by `min_ts..=max_ts`, so a record outside that range would be silently skipped.
fn check_records(h: &BlockHeader, records: &[Record]) -> Result<(), BlockError> {
    if records.len() != h.count as usize {
        return Err(BlockError::Body {
            offset: 0,
            what: "body holds a different record count than the header",
        });
    }
    for (index, r) in records.iter().enumerate() {
        if r.ts < h.min_ts || r.ts > h.max_ts {
            let index = index as u32;
            return Err(BlockError::TsOutOfRange {
                index,
                ts: r.ts,
                min_ts: h.min_ts,
                max_ts: h.max_ts,
            });
        }
    }
    Ok(())
}

/// Decompresses a body whose size was already checked against the limits.
fn decompress_body(h: &BlockHeader, body: &[u8]) -> Result<Vec<u8>, BlockError> {
    // The capacity bound is what makes a zstd bomb harmless: zstd stops at `raw_len` bytes.
    let raw = zstd::bulk::decompress(body, h.raw_len as usize)
        .map_err(|e| BlockError::Decompress(e.to_string()))?;
    if raw.len() != h.raw_len as usize {
        return Err(BlockError::RawLenMismatch {
            got: raw.len(),
            want: h.raw_len,
        });
    }
    if crc32c::crc32c(&raw) != h.raw_crc {
        return Err(BlockError::RawChecksum);
    }
    Ok(raw)
}

/// Version 1 body: records one after another.
///
/// Per record: key (varint length + UTF-8), ts (zigzag varint), field count (varint), then per
/// field: name (varint length + UTF-8), a type tag byte, and the value.
fn encode_rows(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::with_capacity(records.iter().map(Record::approx_bytes).sum::<usize>() + 16);
    for r in records {
        varint::put_bytes(&mut out, r.key.as_bytes());
        varint::put_i64(&mut out, r.ts);
        varint::put_u64(&mut out, r.fields.len() as u64);
        for (name, value) in &r.fields {
            varint::put_bytes(&mut out, name.as_bytes());
            out.push(value.type_tag());
            match value {
                Value::F64(v) => out.extend_from_slice(&v.to_bits().to_le_bytes()),
                Value::I64(v) => varint::put_i64(&mut out, *v),
                Value::Bool(v) => out.push(u8::from(*v)),
                Value::Str(s) => varint::put_bytes(&mut out, s.as_bytes()),
                Value::Bytes(b) => varint::put_bytes(&mut out, b),
            }
        }
    }
    out
}

/// The decoded size of a version 1 body, walking the same grammar as [`decode_rows`] without
/// building anything. Malformed bodies fail here with the error the decoder would give.
fn rows_decoded_size(raw: &[u8], count: u32) -> Result<u64, BlockError> {
    let mut r = varint::Reader::new(raw);
    let mut size = 0u64;
    for _ in 0..count {
        let key = r.bytes().map_err(body_err)?;
        r.i64().map_err(body_err)?;
        let nfields = r.u64().map_err(body_err)?;
        if nfields > r.remaining() as u64 {
            return Err(BlockError::Body {
                offset: r.offset(),
                what: "field count exceeds body",
            });
        }
        size += decoded::record_base_bytes(key.len());
        for _ in 0..nfields {
            let name = r.bytes().map_err(body_err)?;
            let payload = match r.byte().map_err(body_err)? {
                0 => r.u64_le().map(|_| 0),
                1 => r.i64().map(|_| 0),
                2 => r.byte().map(|_| 0),
                3 | 4 => r.bytes().map(<[u8]>::len),
                _ => {
                    return Err(BlockError::Body {
                        offset: r.offset(),
                        what: "unknown field type tag",
                    });
                }
            }
            .map_err(body_err)?;
            size += decoded::field_bytes(name.len(), payload);
        }
    }
    Ok(size)
}

/// Refuses a key or field name that just ended at `r`'s position if it is over `max`. Checked
/// when records are built, not while sizing (as for version 2, see `columnar::decode`).
fn check_len(
    r: &varint::Reader<'_>,
    what: &'static str,
    len: usize,
    max: usize,
) -> Result<(), BlockError> {
    if len > max {
        return Err(BlockError::TooLong {
            what,
            len,
            max,
            offset: r.offset() - len,
        });
    }
    Ok(())
}

fn decode_rows(raw: &[u8], count: u32) -> Result<Vec<Record>, BlockError> {
    let mut r = varint::Reader::new(raw);
    // Each record takes at least 3 bytes, which bounds the allocation by the input.
    let mut records = Vec::with_capacity((count as usize).min(raw.len() / 3 + 1));
    for _ in 0..count {
        let key = r.string().map_err(body_err)?;
        check_len(&r, "key", key.len(), KEY_BYTES_MAX)?;
        let ts = r.i64().map_err(body_err)?;
        let nfields = r.u64().map_err(body_err)?;
        if nfields > r.remaining() as u64 {
            return Err(BlockError::Body {
                offset: r.offset(),
                what: "field count exceeds body",
            });
        }
        let mut fields = Vec::with_capacity(nfields as usize);
        for _ in 0..nfields {
            let name = r.string().map_err(body_err)?;
            check_len(&r, "field name", name.len(), FIELD_NAME_BYTES_MAX)?;
            let value = match r.byte().map_err(body_err)? {
                0 => Value::F64(f64::from_bits(r.u64_le().map_err(body_err)?)),
                1 => Value::I64(r.i64().map_err(body_err)?),
                2 => match r.byte().map_err(body_err)? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    _ => {
                        return Err(BlockError::Body {
                            offset: r.offset() - 1,
                            what: "bool byte is not 0 or 1",
                        });
                    }
                },
                3 => Value::Str(r.string().map_err(body_err)?),
                4 => Value::Bytes(r.bytes().map_err(body_err)?.to_vec()),
                _ => {
                    return Err(BlockError::Body {
                        offset: r.offset(),
                        what: "unknown field type tag",
                    });
                }
            };
            fields.push((name, value));
        }
        records.push(Record {
            tags: Vec::new(),
            key,
            ts,
            fields,
        });
    }
    if r.remaining() != 0 {
        return Err(BlockError::Body {
            offset: r.offset(),
            what: "trailing bytes after last record",
        });
    }
    Ok(records)
}

fn body_err(e: varint::ReadError) -> BlockError {
    BlockError::Body {
        offset: e.offset,
        what: e.what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<Record> {
        (0..n)
            .map(|i| Record {
                tags: Vec::new(),
                key: format!("truck-{:04}/engine", i % 7),
                ts: 1_764_374_400_000_000_000 + i as i64 * 1_000_000_000,
                fields: vec![
                    ("temp".into(), Value::F64(71.25 + i as f64)),
                    ("odo".into(), Value::I64(i as i64 * 17)),
                    ("on".into(), Value::Bool(i % 2 == 0)),
                    ("note".into(), Value::Str("ok".into())),
                    ("raw".into(), Value::Bytes(vec![1, 2, 3])),
                ],
            })
            .collect()
    }

    #[test]
    fn round_trip_rows() {
        let recs = sample(100);
        let bytes = encode_block(VERSION_ROWS, 42, 1000, &recs).unwrap();
        let b = decode_block(&bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(b.records, recs);
        assert_eq!(b.header.epoch, 42);
        assert_eq!(b.header.first_seq, 1000);
        assert_eq!(b.header.last_seq(), 1099);
        assert_eq!(b.header.min_ts, recs[0].ts);
        assert_eq!(b.header.max_ts, recs[99].ts);
    }

    #[test]
    fn limits_are_enforced_before_decompression() {
        let recs = sample(100);
        let bytes = encode_block(VERSION_ROWS, 1, 1, &recs).unwrap();
        let tight = DecodeLimits {
            raw_bytes_max: 100,
            ..DecodeLimits::default()
        };
        assert!(matches!(
            decode_block(&bytes, &tight),
            Err(BlockError::RawTooLarge { .. })
        ));
        let few = DecodeLimits {
            records_max: 10,
            ..DecodeLimits::default()
        };
        assert!(matches!(
            decode_block(&bytes, &few),
            Err(BlockError::TooManyRecords { .. })
        ));
    }
}
