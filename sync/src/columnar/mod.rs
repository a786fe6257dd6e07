//! Columnar block bodies (format versions 2 and 3), built for thin links.
//!
//! Version 3 is version 2 with tag columns: a column of type [`TAG_TYPE`] holds string data
//! like a string field, and its values decode into the record's tags, not its fields. A tag and
//! a field of one name are two columns, told apart by their type. A version 2 body with a tag
//! column is refused.
//!
//! A version 2 body holds the same records as version 1, transposed: a key dictionary, a table
//! of typed columns (one per field name and type), a dictionary of record *shapes* (the ordered
//! list of columns a record has, which also serves as every column's presence bitmap), then one
//! stream per column. Each column is predicted from the previous value *of the same key* where
//! that is cheaper, because telemetry interleaves many devices whose own series are smooth.
//! [`crate::block`] compresses the body with zstd afterwards.
//!
//! The byte layout is specified in `docs/format/columnar.md`, which also records the measured
//! comparison with the alternatives (Gorilla XOR, per-column zstd, a trained dictionary).
//!
//! Decoding is total: any input either decodes or returns a [`ColumnarError`], and no
//! allocation exceeds what the input's length or the record count (limited by the caller)
//! can justify, except the records themselves: a key, field name or string named once in a
//! dictionary is copied into every record that uses it. [`decoded_size`] computes their exact
//! size (`crate::decoded`) without building them, so a caller can refuse the body first.

mod cut;
mod decode;
mod encode;
mod floats;
mod ints;
mod wire;

pub use cut::{CutLimits, cut};

use crate::record::Record;
use thiserror::Error;

/// Records per block the edge agent seals while offline or catching up: large blocks make the
/// backlog small (see `docs/benchmarks.md`).
pub const OFFLINE_BLOCK_RECORDS: usize = 32_768;

/// The most distinct (field name, type) columns one body may have. It bounds the decoder's
/// per-column state; telemetry has tens.
pub const COLUMNS_MAX: usize = 1 << 16;

/// The column type of a tag (version 3 bodies only); field types are `Value::type_tag`.
pub const TAG_TYPE: u8 = 5;

/// Why a columnar body could not be written or read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ColumnarError {
    #[error("malformed columnar body in {section} at byte {offset}: {what}")]
    Malformed {
        section: &'static str,
        offset: usize,
        what: &'static str,
    },
    #[error("columnar body of {len} bytes cannot hold {count} records")]
    CountExceedsBody { count: u32, len: usize },
    #[error("{0} distinct field columns in one block, more than the format allows ({COLUMNS_MAX})")]
    TooManyColumns(usize),
    #[error("{what} of {len} bytes at body byte {offset} is longer than the format allows ({max})")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
        offset: usize,
    },
}

/// How f64 columns are encoded. `Auto` is what blocks are sealed with; the others exist so the
/// benchmark can measure each mode against the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FloatChoice {
    /// The smallest estimated of scaled decimals, Gorilla XOR and raw bits, per column.
    #[default]
    Auto,
    /// Scaled decimals, with every value that does not scale exactly stored as raw bits.
    Scaled,
    /// Gorilla XOR against the previous value.
    Gorilla,
    /// Eight raw bytes per value.
    Raw,
}

/// Encoder knobs. The default is the sealing encoder; readers need no knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    pub floats: FloatChoice,
    /// Allow predicting a value from the previous value of the same key. Off gives the plain
    /// "delta against the previous row" columnar baseline.
    pub per_key: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            floats: FloatChoice::Auto,
            per_key: true,
        }
    }
}

/// One labelled part of an encoded body, for size breakdowns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// `dictionaries`, `key`, `shape`, `ts`, or `field:<name>:<type>`.
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Encodes `records` as a version 2 body, or version 3 if any record has tags.
pub fn encode(records: &[Record]) -> Result<Vec<u8>, ColumnarError> {
    encode_with(records, &Tuning::default())
}

/// As [`encode`], with explicit encoder knobs. Every choice decodes with [`decode`].
pub fn encode_with(records: &[Record], tuning: &Tuning) -> Result<Vec<u8>, ColumnarError> {
    Ok(encode::encode(records, tuning)?.0)
}

/// The body [`encode_with`] writes, cut into its labelled sections (concatenated, they are the
/// body). Used by the benchmark to measure per-column compression.
pub fn sections(records: &[Record], tuning: &Tuning) -> Result<Vec<Section>, ColumnarError> {
    let (body, marks) = encode::encode(records, tuning)?;
    let mut out = Vec::with_capacity(marks.len());
    for (i, (name, start)) in marks.iter().enumerate() {
        let end = marks.get(i + 1).map_or(body.len(), |m| m.1);
        out.push(Section {
            name: name.clone(),
            bytes: body[*start..end].to_vec(),
        });
    }
    Ok(out)
}

/// Decodes a version 3 body (a version 2 body is one too) holding `count` records. Its
/// records are not bounded here: a reader of untrusted bodies checks [`decoded_size`] first,
/// as `block::size_block` does.
pub fn decode(raw: &[u8], count: u32) -> Result<Vec<Record>, ColumnarError> {
    let mut out = Vec::new();
    decode::decode_into(raw, count, true, &mut out)?;
    Ok(out)
}

/// The decoded size ([`crate::decoded`]) of a version 2 body holding `count` records, computed
/// from its dictionaries and its key, shape, string-id and bytes streams without building a
/// record. Whatever [`decode`] returns for the same body has exactly this size.
pub fn decoded_size(raw: &[u8], count: u32) -> Result<u64, ColumnarError> {
    decode::decoded_size(raw, count, true)
}

/// As [`decoded_size`] for a body of the given block version: `tagged` is false for version 2,
/// whose bodies may not hold tag columns.
pub fn decoded_size_of(raw: &[u8], count: u32, tagged: bool) -> Result<u64, ColumnarError> {
    decode::decoded_size(raw, count, tagged)
}

/// As [`decode_into`] for a body of the given block version (see [`decoded_size_of`]).
pub fn decode_into_of(
    raw: &[u8],
    count: u32,
    tagged: bool,
    out: &mut Vec<Record>,
) -> Result<(), ColumnarError> {
    decode::decode_into(raw, count, tagged, out)
}

/// As [`decode`], into `out`, reusing the records and buffers already there: a reader that
/// decodes block after block into the same vector allocates almost nothing. On error, `out`
/// holds unspecified records.
pub fn decode_into(raw: &[u8], count: u32, out: &mut Vec<Record>) -> Result<(), ColumnarError> {
    decode::decode_into(raw, count, true, out)
}

/// The fuzz target's body, shared with the corpus replay test: the first two bytes are the
/// record count (little endian), the rest a candidate body. Whatever decodes must re-encode and
/// decode to the same records; anything else must be an error, never a panic.
pub fn fuzz_decode(data: &[u8]) {
    let Some((count, raw)) = data.split_first_chunk::<2>() else {
        return;
    };
    let count = u32::from(u16::from_le_bytes(*count));
    let Ok(size) = decoded_size(raw, count) else {
        assert!(
            decode(raw, count).is_err(),
            "a body that cannot be sized must not decode"
        );
        return;
    };
    let limit = crate::fuzzing::fuzz_limits().decoded_bytes_max;
    if size > limit {
        // Over the configured limit: the block decoder must refuse it before building a record.
        let small = raw.len() < crate::fuzzing::fuzz_limits().raw_bytes_max as usize / 2;
        if small
            && let Some(block) = crate::fuzzing::wrap_body(crate::block::VERSION_TAGGED, count, raw)
        {
            let refused = crate::block::size_block(&block, &crate::fuzzing::fuzz_limits());
            assert!(
                matches!(
                    refused,
                    Err(crate::block::BlockError::DecodedTooLarge { .. })
                ),
                "a body sized over the limit is refused as too large, not {refused:?}"
            );
        }
        return;
    }
    let Ok(records) = decode(raw, count) else {
        return;
    };
    crate::fuzzing::assert_decoded_size(&records, size, limit);
    let again = encode(&records).expect("decoded records always re-encode");
    let back = decode(&again, count).expect("a fresh encoding always decodes");
    assert_eq!(
        back, records,
        "decode(encode(decode(x))) differs from decode(x)"
    );
    // Decoding over other records must give the same result as decoding afresh.
    let mut reused = vec![
        Record {
            key: "old".into(),
            tags: vec![("t".into(), "u".into()); 2],
            ts: 0,
            fields: vec![("x".into(), crate::Value::Str("y".into()))]
        };
        3
    ];
    decode_into(&again, count, &mut reused).expect("a fresh encoding always decodes");
    assert_eq!(
        reused, records,
        "decode_into over old records differs from decode"
    );
}
