//! The decoded size of a block: the bytes its records take once materialised.
//!
//! A block body is small on the wire but can ask for far more memory once decoded: a version 2
//! body names a key once in its dictionary and every record gets its own copy, so one 16 KiB
//! key and a million records (217 bytes sealed) decode to 15 GiB. Both body decoders therefore
//! compute this size from the body *before* building any record
//! ([`crate::block::size_block`]), and a block above `DecodeLimits::decoded_bytes_max` is
//! refused. The definition is part of the format (`docs/format/segment.md`, "Decoded size"),
//! so a limit means the same on every build:
//!
//! ```text
//! decoded_size = sum over records of  RECORD_OVERHEAD_BYTES + len(key)
//!                  + sum over fields of FIELD_OVERHEAD_BYTES + len(name) + len(payload)
//!                  + sum over tags   of TAG_OVERHEAD_BYTES + len(name) + len(value)
//! ```
//!
//! where `len` is in UTF-8 bytes, a string or bytes value's payload is its length and every
//! other value's payload is 0 (it lives inside the field's fixed overhead). The overheads are
//! fixed numbers, asserted at compile time to cover this build's `Record` and field sizes.

use crate::record::{Record, Value};

/// Fixed bytes counted per record: at least `size_of::<Record>()` (key, tags, ts, fields).
pub const RECORD_OVERHEAD_BYTES: u64 = 96;
/// Fixed bytes counted per field: at least `size_of::<(String, Value)>()`.
pub const FIELD_OVERHEAD_BYTES: u64 = 64;
/// Fixed bytes counted per tag: at least `size_of::<(String, String)>()`.
pub const TAG_OVERHEAD_BYTES: u64 = 48;
const _: () = assert!(std::mem::size_of::<Record>() as u64 <= RECORD_OVERHEAD_BYTES);
const _: () = assert!(std::mem::size_of::<(String, String)>() as u64 <= TAG_OVERHEAD_BYTES);
const _: () = assert!(std::mem::size_of::<(String, Value)>() as u64 <= FIELD_OVERHEAD_BYTES);

/// Longest key (UTF-8 bytes) a block may hold; encoders refuse longer, decoders reject them.
pub const KEY_BYTES_MAX: usize = 4096;
/// Longest field name (UTF-8 bytes) a block may hold.
pub const FIELD_NAME_BYTES_MAX: usize = 1024;

/// The bytes one field counts: its overhead, its name and its payload.
#[inline]
pub(crate) fn field_bytes(name_len: usize, payload_len: usize) -> u64 {
    FIELD_OVERHEAD_BYTES + name_len as u64 + payload_len as u64
}

/// The bytes one tag counts: its overhead, its name and its value.
#[inline]
pub(crate) fn tag_bytes(name_len: usize, value_len: usize) -> u64 {
    TAG_OVERHEAD_BYTES + name_len as u64 + value_len as u64
}

/// The bytes one record counts without its fields.
#[inline]
pub(crate) fn record_base_bytes(key_len: usize) -> u64 {
    RECORD_OVERHEAD_BYTES + key_len as u64
}

/// A value's payload length in the definition above.
pub fn payload_len(v: &Value) -> usize {
    match v {
        Value::Str(s) => s.len(),
        Value::Bytes(b) => b.len(),
        Value::F64(_) | Value::I64(_) | Value::Bool(_) => 0,
    }
}

/// The decoded size of one materialised record.
pub fn record_bytes(r: &Record) -> u64 {
    let fields: u64 = r
        .fields
        .iter()
        .map(|(name, v)| field_bytes(name.len(), payload_len(v)))
        .sum();
    let tags: u64 = r
        .tags
        .iter()
        .map(|(n, v)| tag_bytes(n.len(), v.len()))
        .sum();
    record_base_bytes(r.key.len()) + fields + tags
}

/// The decoded size of materialised records: what [`crate::block::size_block`] computes from
/// the body before decoding them.
pub fn records_bytes(records: &[Record]) -> u64 {
    records.iter().map(record_bytes).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_definition_counts_overheads_names_and_payloads() {
        let r = Record {
            key: "abc".into(),
            tags: vec![("host".into(), "gw".into())],
            ts: 1,
            fields: vec![
                ("s".into(), Value::Str("hello".into())),
                ("b".into(), Value::Bytes(vec![0; 7])),
                ("f".into(), Value::F64(1.0)),
            ],
        };
        let want = 96 + 3 + (64 + 1 + 5) + (64 + 1 + 7) + (64 + 1) + (48 + 4 + 2);
        assert_eq!(record_bytes(&r), want);
        assert_eq!(records_bytes(&[r.clone(), r]), 2 * want);
    }
}
