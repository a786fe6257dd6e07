//! Ingest parsers: NDJSON objects and InfluxDB line protocol, into [`Record`](crate::Record)s.
//!
//! Both parsers take a whole request body, parse all of it or nothing, and report the first
//! problem as a [`ParseError`] that names the 1-based line and column, what was expected and
//! what was found. The HTTP layer returns that error as a JSON body ([`ParseError::to_json`]),
//! so a producer can fix its input without reading our code.
//!
//! Limits are per line ([`LINE_BYTES_MAX`]), per record ([`ParseOptions::fields_max`], by default
//! [`FIELDS_MAX`]; a parser stops at the first field over it) and per key and field
//! name (the block format's [`KEY_BYTES_MAX`] and [`FIELD_NAME_BYTES_MAX`], so that every
//! parsed record can be sealed); the body size is the caller's limit. Neither parser panics on any input: both are fuzzed (`sync/fuzz`).
//!
//! The accepted shapes:
//! - NDJSON ([`parse_ndjson`]): `{"key":"truck-0007/engine","ts":1764374400000000000,
//!   "fields":{"engine_temp_c":71.28,"odometer_m":12345,"ignition":true,"note":"x"}}`, one
//!   object per line. See [`json`] for the exact rules.
//! - Line protocol ([`parse_line_protocol`]): `telemetry,device=truck-0007,unit=engine
//!   engine_temp_c=71.28,odometer_m=12345i 1764374400000000000`. See [`line`].

pub mod json;
pub mod line;

pub use crate::decoded::{FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
pub use json::{
    WriteError, parse_json_fields, parse_ndjson, parse_ndjson_with, write_ndjson, write_ndjson_line,
};
pub use line::{LineRecord, parse_line_protocol, parse_line_protocol_with};

use crate::time::{TimeUnit, format_rfc3339, likely_unit, parse_epoch_number};
use serde::Serialize;
use thiserror::Error;

/// The longest accepted input line, in bytes (without its line ending).
pub const LINE_BYTES_MAX: usize = 1 << 20;
/// The most fields one record may carry unless [`ParseOptions::fields_max`] says otherwise.
pub const FIELDS_MAX: usize = 1024;
/// The most tags one record may carry at ingest (line protocol, NDJSON, MQTT captures).
pub const TAGS_MAX: usize = 64;
/// How much of an offending token an error quotes.
const FOUND_CHARS_MAX: usize = 40;

/// Options shared by both parsers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseOptions {
    /// The timestamp given to records that carry none, in nanoseconds since the Unix epoch.
    /// The HTTP and MQTT sources set it to the receive time; `None` makes a missing
    /// timestamp an error.
    pub default_ts: Option<i64>,
    /// The most fields one record may carry; the parser refuses the input at the first field
    /// over it, without building the rest. The agent sets its `ingest.fields_per_record_max`.
    pub fields_max: usize,
    /// The unit of integer timestamps (HTTP's `precision`, as in Influx's write API);
    /// nanoseconds by default. RFC 3339 strings (NDJSON) carry their own.
    pub ts_unit: TimeUnit,
    /// The clock, when integer timestamps are checked against their unit: one that is
    /// implausible in `ts_unit` but plausible in another ([`crate::time::likely_unit`]) is an
    /// error naming that unit, so a millisecond value is never stored as 1970.
    pub plausible_at: Option<i64>,
}

impl Default for ParseOptions {
    fn default() -> Self {
        ParseOptions {
            default_ts: None,
            fields_max: FIELDS_MAX,
            ts_unit: TimeUnit::Ns,
            plausible_at: None,
        }
    }
}

/// Why an input could not be parsed, and where.
///
/// Displays as `line 3, column 17: expected a number for "ts", found "abc"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Error)]
#[error("line {line}, column {column}: expected {expected}, found {found}")]
pub struct ParseError {
    /// 1-based line number in the input.
    pub line: usize,
    /// 1-based column, counted in characters.
    pub column: usize,
    /// What the parser wanted at that position.
    pub expected: String,
    /// What it saw there: the offending token (shortened), or a description such as
    /// `end of line`.
    pub found: String,
}

impl ParseError {
    /// The error as a JSON object: `{"error":"<display>","line":..,"column":..,"expected":..,"found":..}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "error": self.to_string(),
            "line": self.line,
            "column": self.column,
            "expected": self.expected,
            "found": self.found,
        })
    }
}

/// Converts a byte offset within `line` into a 1-based character column.
fn column(line: &str, byte_offset: usize) -> usize {
    match line.get(..byte_offset) {
        Some(prefix) => prefix.chars().count() + 1,
        None => byte_offset + 1,
    }
}

/// Shortens a token for quoting in an error, on a character boundary.
fn shorten(token: &str) -> String {
    match token.char_indices().nth(FOUND_CHARS_MAX) {
        Some((cut, _)) => format!("{}...", &token[..cut]),
        None => token.to_owned(),
    }
}

/// The error for a line longer than [`LINE_BYTES_MAX`].
fn line_too_long(line_no: usize, line: &str) -> ParseError {
    let mut cut = LINE_BYTES_MAX;
    while !line.is_char_boundary(cut) {
        cut -= 1;
    }
    ParseError {
        line: line_no,
        column: column(line, cut),
        expected: format!("a line of at most {LINE_BYTES_MAX} bytes"),
        found: format!("a line of {} bytes", line.len()),
    }
}

/// The expectation for a key or field name over the block format's maximum, if it is.
fn too_long(what: &str, len: usize, max: usize) -> Option<String> {
    (len > max).then(|| format!("{what} of at most {max} bytes (this one has {len})"))
}

/// The error for a record with more than `max` fields.
fn too_many_fields(line_no: usize, column: usize, max: usize) -> ParseError {
    ParseError {
        line: line_no,
        column,
        expected: format!("at most {max} fields in a record"),
        found: format!("field number {}", max + 1),
    }
}

/// An integer timestamp in `opts.ts_unit` as nanoseconds, or what to say about it: the
/// (expected, found) of a [`ParseError`]. See [`ParseOptions::plausible_at`].
fn epoch_ts(value: i64, opts: &ParseOptions) -> Result<i64, (String, String)> {
    let unit = opts.ts_unit;
    let ns = parse_epoch_number(value, unit).map_err(|e| {
        (
            format!("a timestamp in {unit} (the precision)"),
            e.to_string(),
        )
    })?;
    let Some(now) = opts.plausible_at else {
        return Ok(ns);
    };
    match likely_unit(value, unit, now) {
        None => Ok(ns),
        Some(likely) => {
            let as_likely = parse_epoch_number(value, likely).map_or(0, |v| v);
            Err((
                format!(
                    "a timestamp in {unit} (the precision): this one looks like {likely}, \
                     send it with precision={likely}"
                ),
                format!(
                    "{value}, which in {unit} is {} and in {likely} {}",
                    format_rfc3339(ns),
                    format_rfc3339(as_likely)
                ),
            ))
        }
    }
}
