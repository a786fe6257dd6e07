//! NDJSON ingest: one JSON object per line, and the matching writer.
//!
//! Each non-blank line is exactly one object with these members, in any order:
//! - `"key"`: a non-empty string, the routing key;
//! - `"ts"`: an integer, nanoseconds since the Unix epoch. It may be absent or `null`, in which
//!   case [`ParseOptions::default_ts`] applies; without one that is an error;
//! - `"fields"`: an object, possibly empty (a record may be a bare event). Each value is:
//!   - an integer (no fraction, no exponent) within the i64 range: [`Value::I64`];
//!   - any other number: [`Value::F64`], parsed with correct rounding, so `71.28` becomes the
//!     f64 nearest to 71.28. Numbers that overflow to infinity are refused;
//!   - `true` or `false`: [`Value::Bool`];
//!   - a string: [`Value::Str`];
//!   - `{"$bytes":"<standard base64, padding optional>"}`: [`Value::Bytes`].
//!
//! Anything else is an error that names the field: `null`, arrays, and nested objects
//! (flattening those is the MQTT mapper's job). Unknown top-level members, duplicate members and
//! duplicate field names are errors too, so a typo never loses data silently. Blank lines and a
//! `\r` before the `\n` are accepted.
//!
//! This is a small hand-written parser rather than serde because errors must point at the exact
//! line and column of the offending token, and field order must be kept.

use super::{
    FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX, column, line_too_long, shorten, too_long, too_many_fields,
};
use super::{LINE_BYTES_MAX, ParseError, ParseOptions};
use crate::record::{Record, Value};
use thiserror::Error;

/// Parses NDJSON with default options: a record without `"ts"` is an error.
pub fn parse_ndjson(input: &str) -> Result<Vec<Record>, ParseError> {
    parse_ndjson_with(input, &ParseOptions::default())
}

/// Parses NDJSON, all or nothing.
pub fn parse_ndjson_with(input: &str, opts: &ParseOptions) -> Result<Vec<Record>, ParseError> {
    let mut records = Vec::new();
    for (index, raw) in input.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let line_no = index + 1;
        if line.len() > LINE_BYTES_MAX {
            return Err(line_too_long(line_no, line));
        }
        if line.bytes().all(|b| matches!(b, b' ' | b'\t' | b'\r')) {
            continue;
        }
        records.push(
            LineParser {
                s: line,
                b: line.as_bytes(),
                pos: 0,
                line_no,
                fields_max: opts.fields_max,
            }
            .record(opts)?,
        );
    }
    Ok(records)
}

/// A parsed JSON number.
enum Num {
    Int(i64),
    /// An integer literal outside the i64 range.
    IntOutOfRange,
    Float(f64),
}

/// A cursor over one line. `pos` is always on a character boundary: it only moves over ASCII
/// bytes or whole strings.
struct LineParser<'a> {
    s: &'a str,
    b: &'a [u8],
    pos: usize,
    line_no: usize,
    fields_max: usize,
}

impl LineParser<'_> {
    fn record(mut self, opts: &ParseOptions) -> Result<Record, ParseError> {
        self.ws();
        self.expect(b'{', r#"a JSON object {"key":..,"ts":..,"fields":{..}}"#)?;
        let (mut key, mut ts, mut fields) = (None, None, None);
        let mut seen = [false; 3];
        self.ws();
        if !self.eat(b'}') {
            loop {
                self.ws();
                let name_at = self.pos;
                let name = self.string(r#"a member name ("key", "ts" or "fields")"#)?;
                let slot = match name.as_str() {
                    "key" => 0,
                    "ts" => 1,
                    "fields" => 2,
                    _ => {
                        return Err(
                            self.err_at(name_at, r#"one of the members "key", "ts" or "fields""#)
                        );
                    }
                };
                if std::mem::replace(&mut seen[slot], true) {
                    return Err(self.err_at(name_at, "each member at most once"));
                }
                self.ws();
                self.expect(b':', "':' after the member name")?;
                self.ws();
                match slot {
                    0 => key = Some(self.key_value()?),
                    1 => ts = self.ts_value()?,
                    _ => fields = Some(self.fields()?),
                }
                self.ws();
                if self.eat(b',') {
                    continue;
                }
                if self.eat(b'}') {
                    break;
                }
                return Err(self.err_at(self.pos, "',' or '}'"));
            }
        }
        let close_at = self.pos - 1;
        self.ws();
        if self.pos != self.b.len() {
            return Err(self.err_at(self.pos, "end of line after the object"));
        }
        let key = key.ok_or_else(|| self.err_at(close_at, r#"a "key" member"#))?;
        let ts = ts.or(opts.default_ts).ok_or_else(|| {
            self.err_at(
                close_at,
                r#"a "ts" member (nanoseconds since the Unix epoch)"#,
            )
        })?;
        let fields = fields.ok_or_else(|| self.err_at(close_at, r#"a "fields" member"#))?;
        Ok(Record { key, ts, fields })
    }

    fn key_value(&mut self) -> Result<String, ParseError> {
        let at = self.pos;
        if self.peek() != Some(b'"') {
            return Err(self.err_at(at, r#"a string for "key""#));
        }
        let key = self.string(r#"a string for "key""#)?;
        if key.is_empty() {
            return Err(self.err_at(at, r#"a non-empty string for "key""#));
        }
        if let Some(expected) = too_long(r#"a "key""#, key.len(), KEY_BYTES_MAX) {
            return Err(self.err_at(at, expected));
        }
        Ok(key)
    }

    /// `None` means `null`: the default timestamp applies.
    fn ts_value(&mut self) -> Result<Option<i64>, ParseError> {
        let at = self.pos;
        if self.eat_word("null") {
            return Ok(None);
        }
        match self.number()? {
            Some(Num::Int(v)) => Ok(Some(v)),
            Some(Num::IntOutOfRange) => {
                Err(self.err_at(at, r#"nanoseconds within the i64 range for "ts""#))
            }
            Some(Num::Float(_)) => {
                Err(self.err_at(at, r#"an integer number of nanoseconds for "ts""#))
            }
            None => Err(self.err_at(at, r#"a number for "ts""#)),
        }
    }

    fn fields(&mut self) -> Result<Vec<(String, Value)>, ParseError> {
        let at = self.pos;
        if !self.eat(b'{') {
            return Err(self.err_at(at, r#"an object for "fields""#));
        }
        self.ws();
        let mut fields: Vec<(String, Value)> = Vec::new();
        // Names seen so far, so that a duplicate costs one lookup, not a scan of the record.
        let mut names = std::collections::HashSet::new();
        if self.eat(b'}') {
            return Ok(fields);
        }
        loop {
            self.ws();
            let name_at = self.pos;
            let name = self.string("a field name")?;
            if name.is_empty() {
                return Err(self.err_at(name_at, "a non-empty field name"));
            }
            if let Some(expected) = too_long("a field name", name.len(), FIELD_NAME_BYTES_MAX) {
                return Err(self.err_at(name_at, expected));
            }
            if fields.len() == self.fields_max {
                let at = column(self.s, name_at);
                return Err(too_many_fields(self.line_no, at, self.fields_max));
            }
            if !names.insert(name.clone()) {
                return Err(self.err_at(name_at, "a field name not already used in this record"));
            }
            self.ws();
            self.expect(b':', "':' after the field name")?;
            self.ws();
            let value = self.field_value(&name)?;
            fields.push((name, value));
            self.ws();
            if self.eat(b',') {
                continue;
            }
            if self.eat(b'}') {
                return Ok(fields);
            }
            return Err(self.err_at(self.pos, r#"',' or '}' in "fields""#));
        }
    }

    fn field_value(&mut self, name: &str) -> Result<Value, ParseError> {
        let at = self.pos;
        match self.peek() {
            Some(b'"') => return Ok(Value::Str(self.string("a string")?)),
            Some(b'{') => return self.bytes_value(name),
            _ => {}
        }
        if self.eat_word("true") {
            return Ok(Value::Bool(true));
        }
        if self.eat_word("false") {
            return Ok(Value::Bool(false));
        }
        match self.number()? {
            Some(Num::Int(v)) => Ok(Value::I64(v)),
            Some(Num::Float(v)) if v.is_finite() => Ok(Value::F64(v)),
            Some(Num::Float(_)) => Err(self.err_at(at, format!(r#"a finite number for field "{name}""#))),
            Some(Num::IntOutOfRange) => Err(self.err_at(
                at,
                format!(r#"an integer within the i64 range for field "{name}" (or a number with a decimal point)"#),
            )),
            None => Err(self.err_at(at, scalar_expected(name))),
        }
    }

    /// `{"$bytes":"<base64>"}`; any other object is a nested object, which is refused.
    fn bytes_value(&mut self, name: &str) -> Result<Value, ParseError> {
        let at = self.pos;
        let nested = |p: &Self| {
            let expected = format!(
                "{} (nested objects must be flattened)",
                scalar_expected(name)
            );
            p.err_found(at, expected, "an object".into())
        };
        self.pos += 1;
        self.ws();
        if self.peek() != Some(b'"') || self.string("a string")? != "$bytes" {
            return Err(nested(self));
        }
        self.ws();
        self.expect(b':', r#"':' after "$bytes""#)?;
        self.ws();
        let text_at = self.pos;
        if self.peek() != Some(b'"') {
            return Err(self.err_at(text_at, format!(r#"a base64 string for field "{name}""#)));
        }
        let text = self.string("a base64 string")?;
        let Some(bytes) = base64_decode(&text) else {
            return Err(self.err_at(text_at, format!(r#"standard base64 for field "{name}""#)));
        };
        self.ws();
        self.expect(b'}', r#"'}' closing the "$bytes" object"#)?;
        Ok(Value::Bytes(bytes))
    }

    /// A JSON number, validated against the JSON grammar. `Ok(None)` if no number starts here.
    fn number(&mut self) -> Result<Option<Num>, ParseError> {
        let (start, b) = (self.pos, self.b);
        let digits = |mut p: usize| {
            while b.get(p).is_some_and(u8::is_ascii_digit) {
                p += 1;
            }
            p
        };
        let int_start = start + usize::from(b.get(start) == Some(&b'-'));
        let mut p = digits(int_start);
        if p == int_start {
            return if p == start {
                Ok(None)
            } else {
                Err(self.err_at(start, "a number"))
            };
        }
        if b[int_start] == b'0' && p - int_start > 1 {
            return Err(self.err_at(start, "a number without leading zeros"));
        }
        let mut float = false;
        if b.get(p) == Some(&b'.') {
            let frac = p + 1;
            p = digits(frac);
            if p == frac {
                return Err(self.err_at(start, "digits after the decimal point"));
            }
            float = true;
        }
        if matches!(b.get(p), Some(b'e' | b'E')) {
            let exp = p + 1 + usize::from(matches!(b.get(p + 1), Some(b'+' | b'-')));
            p = digits(exp);
            if p == exp {
                return Err(self.err_at(start, "digits in the exponent"));
            }
            float = true;
        }
        if b.get(p).is_some_and(|c| !is_delimiter(*c)) {
            return Err(self.err_at(start, "a number"));
        }
        let text = &self.s[start..p];
        self.pos = p;
        if float {
            // Rust's float parsing is correctly rounded, as JSON parsers are expected to be.
            let v = text
                .parse::<f64>()
                .map_err(|_| self.err_at(start, "a number"))?;
            return Ok(Some(Num::Float(v)));
        }
        Ok(Some(
            text.parse::<i64>().map_or(Num::IntOutOfRange, Num::Int),
        ))
    }

    /// A JSON string starting at `pos`, unescaped.
    fn string(&mut self, expected: &str) -> Result<String, ParseError> {
        if !self.eat(b'"') {
            return Err(self.err_at(self.pos, expected));
        }
        let mut out = String::new();
        let mut run = self.pos;
        loop {
            match self.peek() {
                None => return Err(self.err_at(self.pos, "a closing '\"' ending the string")),
                Some(b'"') => {
                    out.push_str(&self.s[run..self.pos]);
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    out.push_str(&self.s[run..self.pos]);
                    self.escape(&mut out)?;
                    run = self.pos;
                }
                Some(c) if c < 0x20 => {
                    let found = format!("the control character U+{c:04X}");
                    return Err(self.err_found(
                        self.pos,
                        r"a control character escaped as \u00XX",
                        found,
                    ));
                }
                Some(_) => self.pos += 1,
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> Result<(), ParseError> {
        let at = self.pos;
        let ch = match self.b.get(at + 1) {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos = at + 2;
                return self.unicode_escape(at, out);
            }
            _ => {
                return Err(self.err_at(at, r#"a JSON escape (\" \\ \/ \b \f \n \r \t or \uXXXX)"#));
            }
        };
        self.pos = at + 2;
        out.push(ch);
        Ok(())
    }

    /// `\uXXXX`, with UTF-16 surrogate pairs combined; a lone surrogate is an error.
    fn unicode_escape(&mut self, at: usize, out: &mut String) -> Result<(), ParseError> {
        let bad = |p: &Self| p.err_at(at, r"a \uXXXX escape of a valid character");
        let hi = self.hex4().ok_or_else(|| bad(self))?;
        let code = if (0xD800..0xDC00).contains(&hi) {
            if !self.s[self.pos..].starts_with("\\u") {
                return Err(bad(self));
            }
            self.pos += 2;
            let lo = self.hex4().ok_or_else(|| bad(self))?;
            if !(0xDC00..0xE000).contains(&lo) {
                return Err(bad(self));
            }
            0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
        } else {
            hi
        };
        out.push(char::from_u32(code).ok_or_else(|| bad(self))?);
        Ok(())
    }

    fn hex4(&mut self) -> Option<u32> {
        let hex = self.s.get(self.pos..self.pos + 4)?;
        if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        self.pos += 4;
        u32::from_str_radix(hex, 16).ok()
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.pos += usize::from(hit);
        hit
    }

    /// Consumes a bare word such as `true` if it stands alone.
    fn eat_word(&mut self, word: &str) -> bool {
        let end = self.pos + word.len();
        let hit = self.b.get(self.pos..end) == Some(word.as_bytes())
            && self.b.get(end).is_none_or(|c| is_delimiter(*c));
        if hit {
            self.pos = end;
        }
        hit
    }

    fn expect(&mut self, c: u8, expected: &str) -> Result<(), ParseError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.err_at(self.pos, expected))
        }
    }

    fn err_at(&self, at: usize, expected: impl Into<String>) -> ParseError {
        self.err_found(at, expected, self.found_at(at))
    }

    fn err_found(&self, at: usize, expected: impl Into<String>, found: String) -> ParseError {
        ParseError {
            line: self.line_no,
            column: column(self.s, at),
            expected: expected.into(),
            found,
        }
    }

    /// Describes the token at `at` for an error message.
    fn found_at(&self, at: usize) -> String {
        let rest = self.s.get(at..).unwrap_or("");
        match rest.chars().next() {
            None => "end of line".into(),
            Some('{') => "an object".into(),
            Some('[') => "an array".into(),
            Some('"') => shorten(string_token(rest)),
            Some(c) => {
                let end = rest
                    .find(|c: char| c.is_ascii() && is_delimiter(c as u8))
                    .unwrap_or(rest.len());
                shorten(&rest[..end.max(c.len_utf8())])
            }
        }
    }
}

/// What a field value may be, for error messages.
fn scalar_expected(name: &str) -> String {
    format!(r#"a number, string, bool or {{"$bytes":"<base64>"}} for field "{name}""#)
}

/// Bytes that may follow a bare token.
fn is_delimiter(c: u8) -> bool {
    matches!(c, b',' | b'}' | b']' | b':' | b' ' | b'\t' | b'\r' | b'\n')
}

/// The raw text of the string token at the start of `rest`, quotes included, or up to the end
/// of the line if it is unterminated.
fn string_token(rest: &str) -> &str {
    let b = rest.as_bytes();
    let mut p = 1;
    while p < b.len() {
        match b[p] {
            b'\\' => p += 2,
            b'"' => return &rest[..=p],
            _ => p += 1,
        }
    }
    rest
}

/// Why records could not be written as NDJSON.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WriteError {
    #[error(
        "field \"{field}\" of the record with key \"{key}\" is {value}, which JSON cannot represent"
    )]
    NonFinite {
        key: String,
        field: String,
        value: String,
    },
}

/// Writes records in the canonical NDJSON shape, one line each: the inverse of
/// [`parse_ndjson`]. Floats are written in their shortest exact form (always with a `.` or an
/// exponent, so they read back as f64), bytes as `{"$bytes":"<base64>"}`.
pub fn write_ndjson(records: &[Record]) -> Result<String, WriteError> {
    let mut out = String::new();
    for r in records {
        write_ndjson_line(r, &mut out)?;
        out.push('\n');
    }
    Ok(out)
}

/// Appends one record as a JSON object, without a line ending.
pub fn write_ndjson_line(r: &Record, out: &mut String) -> Result<(), WriteError> {
    out.push_str(r#"{"key":"#);
    json_string(out, &r.key);
    out.push_str(&format!(r#","ts":{},"fields":{{"#, r.ts));
    for (i, (name, value)) in r.fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(out, name);
        out.push(':');
        match value {
            Value::F64(v) if !v.is_finite() => {
                let (key, field, value) = (r.key.clone(), name.clone(), v.to_string());
                return Err(WriteError::NonFinite { key, field, value });
            }
            // `{:?}` is the shortest representation that parses back to the same bits, and it
            // always carries a '.' or an exponent.
            Value::F64(v) => out.push_str(&format!("{v:?}")),
            Value::I64(v) => out.push_str(&v.to_string()),
            Value::Bool(v) => out.push_str(if *v { "true" } else { "false" }),
            Value::Str(s) => json_string(out, s),
            Value::Bytes(b) => {
                out.push_str(r#"{"$bytes":""#);
                out.push_str(&base64_encode(b));
                out.push_str(r#""}"#);
            }
        }
    }
    out.push_str("}}");
    Ok(())
}

fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(BASE64[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64, padding optional. Unused trailing bits must be zero, so every byte string
/// has exactly one accepted spelling per padding choice.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let body = text.trim_end_matches('=');
    let pad = text.len() - body.len();
    if pad > 2 || body.len() % 4 == 1 || (pad > 0 && body.len() % 4 + pad != 4) {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() / 4 * 3 + 2);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in body.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    (acc == 0).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_every_length() {
        for len in 0..=10u8 {
            let data: Vec<u8> = (0..len)
                .map(|i| i.wrapping_mul(97).wrapping_add(200))
                .collect();
            let text = base64_encode(&data);
            assert_eq!(base64_decode(&text), Some(data.clone()), "{text}");
            assert_eq!(
                base64_decode(text.trim_end_matches('=')),
                Some(data),
                "{text} unpadded"
            );
        }
        assert_eq!(base64_encode(b"Man"), "TWFu");
        assert_eq!(base64_encode(b"Ma"), "TWE=");
        assert_eq!(base64_decode("TWE"), Some(b"Ma".to_vec()));
        for bad in ["A", "TWF", "TWF=", "TW=", "TWE==", "T WE=", "TWE=x", "===="] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
    }
}
