//! InfluxDB line protocol ingest, on top of the maintained `influxdb-line-protocol` crate.
//!
//! `measurement[,tag=value...] field=value[,field=value...] [timestamp]` maps to:
//! - the measurement: [`LineRecord::measurement`]; the caller checks it against the stream;
//! - tags: kept as the record's tags, in the order written, each a string column in tier 2;
//! - the routing key: derived from the tags by [`key_from_tags`] (sorted by name, so the order
//!   they are written in does not matter), or the measurement when there are no tags.
//!   `telemetry,unit=engine,device=truck-0007` gives the key `device=truck-0007/unit=engine`.
//!   A repeated tag key is an error, and so are more than [`TAGS_MAX`] tags;
//! - fields: `12i` -> [`Value::I64`]; `12u` -> [`Value::I64`] if it fits, else an error;
//!   `1.5`, `12`, `1e3` -> [`Value::F64`] (refused if it overflows to infinity); `"s"` ->
//!   [`Value::Str`]; `t`/`true`/`F`/... -> [`Value::Bool`]. Line protocol has no bytes type.
//!   A repeated field name is an error;
//! - the timestamp: an integer in [`ParseOptions::ts_unit`] (nanoseconds unless the request's
//!   `precision` says otherwise), checked against [`ParseOptions::plausible_at`]; when absent,
//!   [`ParseOptions::default_ts`] applies, and without one that is an error.
//!
//! Blank lines and `#` comment lines are skipped; a `\r` before the `\n` is accepted. The crate
//! reports what went wrong but not where, so positions are recovered here: from the parsed
//! tokens themselves where they point into the line, and otherwise by locating the offending
//! section of the line.

use super::{FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
use super::{LINE_BYTES_MAX, ParseError, ParseOptions, TAGS_MAX};
use super::{column, epoch_ts, line_too_long, shorten, too_long, too_many_fields};
use crate::record::{Record, Value, key_from_tags};
use influxdb_line_protocol::{self as lp, EscapedStr, FieldValue, ParsedLine};

/// One parsed line: the record and the measurement it was written to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineRecord {
    pub measurement: String,
    pub record: Record,
}

/// Parses line protocol, all or nothing.
pub fn parse_line_protocol(
    input: &str,
    opts: &ParseOptions,
) -> Result<Vec<LineRecord>, ParseError> {
    parse_line_protocol_with(input, opts, None)
}

/// As [`parse_line_protocol`]; with `measurement_tag`, each record also gets its measurement
/// as a tag of that name (before its key is derived), and a line that sets such a tag itself is
/// an error. The Influx write endpoints keep mixed measurements apart this way.
pub fn parse_line_protocol_with(
    input: &str,
    opts: &ParseOptions,
    measurement_tag: Option<&str>,
) -> Result<Vec<LineRecord>, ParseError> {
    let mut records = Vec::new();
    let (mut line_no, mut counted) = (1, 0);
    // `split_lines` knows that a quoted string field may contain a newline.
    for raw in lp::split_lines(input) {
        let offset = raw.as_ptr() as usize - input.as_ptr() as usize;
        line_no += newlines(&input[counted..offset]);
        counted = offset;
        let mut line = Line {
            s: raw.strip_suffix('\r').unwrap_or(raw),
            line_no,
        };
        if line.s.len() > LINE_BYTES_MAX {
            return Err(line_too_long(line_no, line.s));
        }
        if let Some(body) = line.skip_comments() {
            records.extend(line.parse(body, opts, measurement_tag)?);
        }
    }
    Ok(records)
}

fn newlines(s: &str) -> usize {
    s.bytes().filter(|b| *b == b'\n').count()
}

/// One line of input and its 1-based number, for error positions.
struct Line<'a> {
    s: &'a str,
    line_no: usize,
}

impl<'a> Line<'a> {
    /// The part of the line to parse, after leading blanks and `#` comments; `None` if nothing
    /// is left. A comment can swallow a following line when it holds an unbalanced quote (the
    /// line splitter is quote-aware); that line is then parsed on its own here.
    fn skip_comments(&mut self) -> Option<&'a str> {
        loop {
            let body = self.s.trim_start_matches([' ', '\t']);
            if body.is_empty() {
                return None;
            }
            if !body.starts_with('#') {
                return Some(body);
            }
            let end = body.find('\n')?;
            self.s = &body[end + 1..];
            self.line_no += 1;
        }
    }

    /// Parses `body`, a suffix of the line.
    fn parse(
        &self,
        body: &'a str,
        opts: &ParseOptions,
        measurement_tag: Option<&str>,
    ) -> Result<Option<LineRecord>, ParseError> {
        // Trailing blanks are harmless, but the crate refuses them; keep an escaped one.
        let trimmed = body.trim_end_matches([' ', '\t']);
        let body = if trimmed.ends_with('\\') {
            body
        } else {
            trimmed
        };
        match lp::parse_lines(body).next() {
            None => Ok(None),
            Some(Ok(parsed)) => self.convert(parsed, opts, measurement_tag).map(Some),
            Some(Err(e)) => Err(self.crate_error(body, &e)),
        }
    }

    fn convert(
        &self,
        p: ParsedLine<'a>,
        opts: &ParseOptions,
        measurement_tag: Option<&str>,
    ) -> Result<LineRecord, ParseError> {
        let measurement = String::from(&p.series.measurement);
        let mut tags = self.tags(&p)?;
        if let Some(name) = measurement_tag {
            let own = p
                .series
                .tag_set
                .iter()
                .flatten()
                .find(|(k, _)| k.as_str() == name);
            if let Some((k, _)) = own {
                let expected = format!("no tag named {name:?}: it holds the line's measurement");
                return Err(self.err_at(self.offset_of(k), expected));
            }
            tags.push((name.to_owned(), measurement.clone()));
        }
        let key = match tags.is_empty() {
            true => measurement.clone(),
            false => key_from_tags(&tags),
        };
        let what = "a key (derived from the tags, else the measurement)";
        if let Some(expected) = too_long(what, key.len(), KEY_BYTES_MAX) {
            return Err(self.err_at(self.offset_of(&p.series.measurement), expected));
        }
        if let Some((name, _)) = p.field_set.get(opts.fields_max) {
            let at = column(self.s, self.offset_of(name));
            return Err(too_many_fields(self.line_no, at, opts.fields_max));
        }
        let mut fields: Vec<(String, Value)> = Vec::with_capacity(p.field_set.len());
        let mut names = std::collections::HashSet::with_capacity(p.field_set.len());
        for (name, value) in &p.field_set {
            if let Some(expected) = too_long("a field name", name.len(), FIELD_NAME_BYTES_MAX) {
                return Err(self.err_at(self.offset_of(name), expected));
            }
            if !names.insert(name.as_str()) {
                return Err(self.err_at(
                    self.offset_of(name),
                    "a field name not already used in this line",
                ));
            }
            fields.push((String::from(name), self.value(name, value)?));
        }
        let end = self.s.trim_end().len();
        let ts = match p.timestamp {
            Some(v) => epoch_ts(v, opts).map_err(|(expected, found)| ParseError {
                line: self.line_no,
                column: column(self.s, timestamp_offset(self.s)),
                expected,
                found,
            })?,
            None => opts
                .default_ts
                .ok_or_else(|| self.err_at(end, "a timestamp in nanoseconds after the fields"))?,
        };
        Ok(LineRecord {
            measurement,
            record: Record {
                key,
                tags,
                ts,
                fields,
            },
        })
    }

    /// The line's tags in the order written: at most [`TAGS_MAX`], each key once, each name
    /// within the format's limit.
    fn tags(&self, p: &ParsedLine<'a>) -> Result<Vec<(String, String)>, ParseError> {
        let Some(tags) = &p.series.tag_set else {
            return Ok(Vec::new());
        };
        if let Some((k, _)) = tags.get(TAGS_MAX) {
            let expected = format!("at most {TAGS_MAX} tags in a line");
            return Err(self.err_at(self.offset_of(k), expected));
        }
        let mut out = Vec::with_capacity(tags.len());
        for (i, (k, v)) in tags.iter().enumerate() {
            if tags[..i].iter().any(|(earlier, _)| earlier == k) {
                return Err(self.err_at(self.offset_of(k), "each tag key at most once"));
            }
            if let Some(expected) = too_long("a tag name", k.len(), FIELD_NAME_BYTES_MAX) {
                return Err(self.err_at(self.offset_of(k), expected));
            }
            out.push((String::from(k), String::from(v)));
        }
        Ok(out)
    }

    fn value(&self, name: &EscapedStr<'a>, value: &FieldValue<'a>) -> Result<Value, ParseError> {
        Ok(match value {
            FieldValue::I64(v) => Value::I64(*v),
            FieldValue::U64(v) => match i64::try_from(*v) {
                Ok(v) => Value::I64(v),
                Err(_) => {
                    let expected = format!(
                        "an unsigned integer at most {} for field \"{name}\"",
                        i64::MAX
                    );
                    return Err(self.err_at(self.value_offset(name), expected));
                }
            },
            FieldValue::F64(v) if v.is_finite() => Value::F64(*v),
            FieldValue::F64(_) => {
                let expected = format!("a finite float for field \"{name}\"");
                return Err(self.err_at(self.value_offset(name), expected));
            }
            FieldValue::String(s) => Value::Str(String::from(s)),
            FieldValue::Boolean(b) => Value::Bool(*b),
        })
    }

    /// Byte offset of a parsed token in the line: exact when the token points into the line
    /// (it was not unescaped), found by search otherwise.
    fn offset_of(&self, token: &EscapedStr<'a>) -> usize {
        let base = self.s.as_ptr() as usize;
        if let EscapedStr::SingleSlice(t) = token {
            let at = (t.as_ptr() as usize).wrapping_sub(base);
            if at <= self.s.len() && at + t.len() <= self.s.len() {
                return at;
            }
        }
        self.s.find(token.as_str()).unwrap_or(0)
    }

    /// Byte offset of the value after `name=`.
    fn value_offset(&self, name: &EscapedStr<'a>) -> usize {
        let at = self.offset_of(name);
        match self.s[at..].find('=') {
            Some(eq) => at + eq + 1,
            None => at,
        }
    }

    /// Maps the crate's position-less error onto a position in the line.
    fn crate_error(&self, body: &str, e: &lp::Error) -> ParseError {
        // `body` is a trimmed slice of the line: its position comes from the pointers.
        let start = (body.as_ptr() as usize)
            .wrapping_sub(self.s.as_ptr() as usize)
            .min(self.s.len());
        let end = (start + body.len()).min(self.s.len());
        let fields_at = fields_start(self.s, start);
        let value_after = |suffix: &str, value: &str| {
            let needle = format!("={value}{suffix}");
            self.s[fields_at..]
                .find(&needle)
                .map_or(fields_at, |i| fields_at + i + 1)
        };
        let (at, expected) = match e {
            lp::Error::MeasurementValueInvalid => (start, "a measurement name".to_owned()),
            lp::Error::TagSetMalformed => {
                let comma = find_unescaped(self.s, start, b",").unwrap_or(start);
                (comma + 1, "tags as key=value pairs after ','".to_owned())
            }
            lp::Error::FieldSetMissing => (fields_at, FIELD_EXPECTED.to_owned()),
            lp::Error::IntegerValueInvalid { value, .. } => (
                value_after("i", value),
                format!(
                    "an integer from {} to {}, ending in 'i'",
                    i64::MIN,
                    i64::MAX
                ),
            ),
            lp::Error::UIntegerValueInvalid { value, .. } => (
                value_after("u", value),
                format!("an unsigned integer at most {}, ending in 'u'", u64::MAX),
            ),
            lp::Error::FloatValueInvalid { value, .. } => {
                (value_after("", value), "a float".to_owned())
            }
            lp::Error::TimestampValueInvalid { value, .. } => {
                let at = self.s.rfind(value.as_str()).unwrap_or(fields_at);
                (
                    at,
                    "a timestamp in nanoseconds within the i64 range".to_owned(),
                )
            }
            lp::Error::EndsWithBackslash => {
                let at = self.s.rfind('\\').unwrap_or(start);
                (
                    at,
                    "a name or tag value that does not end with a backslash".to_owned(),
                )
            }
            lp::Error::CannotParseEntireLine { trailing_content } => {
                self.trailing(end.saturating_sub(trailing_content.len()))
            }
            lp::Error::DuplicateTag { .. } => (start, "each tag key at most once".to_owned()),
            // The crate's generic error mostly means the line stops before its field set.
            _ if fields_at == self.s.len() => {
                (fields_at, format!("a space and then {FIELD_EXPECTED}"))
            }
            _ => (start, "valid line protocol".to_owned()),
        };
        self.err_at(at, expected)
    }

    /// What the parser wanted where it stopped before the end of the line.
    fn trailing(&self, at: usize) -> (usize, String) {
        let (Some(before), Some(rest)) = (self.s.get(..at), self.s.get(at..)) else {
            return (at.min(self.s.len()), "valid line protocol".to_owned());
        };
        if rest.starts_with(',') {
            return (at + 1, FIELD_EXPECTED.to_owned());
        }
        if before.ends_with(',') {
            return (at, FIELD_EXPECTED.to_owned());
        }
        let spaces = rest.len() - rest.trim_start_matches(' ').len();
        if spaces > 0 {
            return (
                at + spaces,
                "a timestamp in nanoseconds (an integer)".to_owned(),
            );
        }
        (at, "end of line".to_owned())
    }

    fn err_at(&self, at: usize, expected: impl Into<String>) -> ParseError {
        ParseError {
            line: self.line_no,
            column: column(self.s, at),
            expected: expected.into(),
            found: found_at(self.s, at),
        }
    }
}

const FIELD_EXPECTED: &str = r#"a field name=value, where value is a float (1.5), an integer (2i), an unsigned integer (3u), a "string" or a bool"#;

/// Where the field set starts: past the first unescaped space after `start`, and the spaces.
fn fields_start(line: &str, start: usize) -> usize {
    match find_unescaped(line, start, b" ") {
        Some(space) => space + line[space..].len() - line[space..].trim_start_matches(' ').len(),
        None => line.len(),
    }
}

/// The first of `chars` at or after `from` that is not escaped by a backslash.
fn find_unescaped(line: &str, from: usize, chars: &[u8]) -> Option<usize> {
    let b = line.as_bytes();
    let mut p = from;
    while p < b.len() {
        if b[p] == b'\\' {
            p += 2;
            continue;
        }
        if chars.contains(&b[p]) {
            return Some(p);
        }
        p += 1;
    }
    None
}

/// The token at `at`, up to the next unescaped space or comma.
fn found_at(line: &str, at: usize) -> String {
    let Some(rest) = line.get(at..).filter(|r| !r.is_empty()) else {
        return "end of line".into();
    };
    if rest.starts_with(' ') {
        return "a space".into();
    }
    let end = find_unescaped(rest, 0, b" ,").unwrap_or(rest.len()).max(1);
    let mut end = end.min(rest.len());
    while !rest.is_char_boundary(end) {
        end += 1;
    }
    shorten(&rest[..end])
}

/// Byte offset of the timestamp: the last blank-separated token of the line.
fn timestamp_offset(line: &str) -> usize {
    let t = line.trim_end();
    t.rfind([' ', '\t']).map_or(0, |i| i + 1)
}
