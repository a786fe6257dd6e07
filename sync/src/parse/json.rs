//! NDJSON ingest: one JSON object per line, and the matching writer.
//!
//! Each non-blank line is exactly one object with these members, in any order:
//! - `"key"`: a non-empty string, the routing key. It may be left out when `"tags"` is given:
//!   the key is then derived from the tags ([`key_from_tags`]);
//! - `"tags"`: an object of non-empty string values (`{"host":"gw-01","line":"3"}`), the
//!   record's tags, in the order written; at most [`TAGS_MAX`], each name once. Absent or `{}`
//!   means no tags. Tags and fields are separate: a tag and a field may share a name;
//! - `"ts"`: an integer in [`ParseOptions::ts_unit`] (nanoseconds unless the request's
//!   `precision` says otherwise), or an RFC 3339 string with `Z` or a numeric offset and any
//!   fraction (`"2025-12-01T12:00:00.5+01:00"`, read by [`crate::time::parse_rfc3339`]). It may
//!   be absent or `null`, in which case [`ParseOptions::default_ts`] applies; without one that
//!   is an error. An integer implausible in its unit but plausible in another is refused
//!   naming that unit when [`ParseOptions::plausible_at`] is set;
//! - `"fields"`: an object, possibly empty (a record may be a bare event). Each value is:
//!   - an integer (no fraction, no exponent) within the i64 range: [`Value::I64`];
//!   - any other number: [`Value::F64`], parsed with correct rounding, so `71.28` becomes the
//!     f64 nearest to 71.28. Numbers that overflow to infinity are refused;
//!   - `true` or `false`: [`Value::Bool`];
//!   - a string: [`Value::Str`];
//!   - `{"$bytes":"<standard base64, padding optional>"}`: [`Value::Bytes`];
//!   - `null`: no field (as if the member were absent);
//!   - a nested object: its members become fields named `parent.child`, at any depth up to
//!     [`NESTING_MAX`] (`{"gps":{"lat":1.5}}` gives `gps.lat`);
//!   - an array: flattened by index, `name.0`, `name.1`, ... (`{"xyz":[1,2]}` gives `xyz.0`
//!     and `xyz.1`; `null` elements are skipped but keep their index; an empty array is no
//!     field).
//!
//! Flattened names obey the same limits as written ones. Unknown top-level members, duplicate
//! members and duplicate field names (also once flattened: `{"a":{"b":1},"a.b":2}`) are
//! errors, so a typo never loses data silently. Blank lines and a `\r` before the `\n` are
//! accepted. MQTT JSON payloads are read by the same code ([`parse_json_fields`]), so HTTP
//! and MQTT map one document to the same fields.
//!
//! This is a small hand-written parser rather than serde because errors must point at the exact
//! line and column of the offending token, and field order must be kept.

use super::{
    FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX, column, epoch_ts, line_too_long, shorten, too_long,
    too_many_fields,
};
use super::{LINE_BYTES_MAX, ParseError, ParseOptions, TAGS_MAX};
use crate::record::{Record, Value, key_from_tags};
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

/// The deepest nesting of objects and arrays inside `"fields"` (serde_json's own limit).
pub const NESTING_MAX: usize = 128;

/// The fields of one record as they are read: the dotted name of the value being read, and
/// the names so far, so that a duplicate costs one lookup, not a scan of the record.
#[derive(Default)]
struct Fields {
    path: String,
    list: Vec<(String, Value)>,
    names: std::collections::HashSet<String>,
}

impl Fields {
    /// Appends `name` to the path; returns the path's length before, to truncate back to.
    fn enter(&mut self, name: &str) -> usize {
        let before = self.path.len();
        if before > 0 {
            self.path.push('.');
        }
        self.path.push_str(name);
        before
    }
}

/// Parses one JSON object (an MQTT payload) into fields by the same rules as an NDJSON
/// record's `"fields"`: the one mapping for both (see the module docs). Whitespace, newlines
/// included, may surround any token; errors point at line 1 and the character offset.
pub fn parse_json_fields(
    payload: &str,
    fields_max: usize,
) -> Result<Vec<(String, Value)>, ParseError> {
    let mut p = LineParser {
        s: payload,
        b: payload.as_bytes(),
        pos: 0,
        line_no: 1,
        fields_max,
    };
    p.ws();
    if p.peek() != Some(b'{') || p.at_bytes_object() {
        return Err(p.err_at(p.pos, "a JSON object"));
    }
    let mut out = Fields::default();
    p.object(&mut out, 0)?;
    p.ws();
    if p.pos != p.b.len() {
        return Err(p.err_at(p.pos, "the end of the payload after the object"));
    }
    Ok(out.list)
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
        let (mut key, mut ts, mut fields, mut tags) = (None, None, None, Vec::new());
        let mut seen = [false; 4];
        self.ws();
        if !self.eat(b'}') {
            loop {
                self.ws();
                let name_at = self.pos;
                let name = self.string(r#"a member name ("key", "tags", "ts" or "fields")"#)?;
                let slot = match name.as_str() {
                    "key" => 0,
                    "ts" => 1,
                    "fields" => 2,
                    "tags" => 3,
                    _ => {
                        return Err(self.err_at(
                            name_at,
                            r#"one of the members "key", "tags", "ts" or "fields""#,
                        ));
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
                    1 => ts = self.ts_value(opts)?,
                    2 => fields = Some(self.fields()?),
                    _ => tags = self.tags()?,
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
        let key = match key {
            Some(key) => key,
            None if !tags.is_empty() => self.derived_key(&tags, close_at)?,
            None => return Err(self.err_at(close_at, r#"a "key" member (or "tags")"#)),
        };
        let ts = ts.or(opts.default_ts).ok_or_else(|| {
            self.err_at(
                close_at,
                r#"a "ts" member (an integer in the precision, or an RFC 3339 string)"#,
            )
        })?;
        let fields = fields.ok_or_else(|| self.err_at(close_at, r#"a "fields" member"#))?;
        Ok(Record {
            key,
            tags,
            ts,
            fields,
        })
    }

    /// The key derived from `tags`, within the format's limit.
    fn derived_key(&self, tags: &[(String, String)], at: usize) -> Result<String, ParseError> {
        let key = key_from_tags(tags);
        let what = r#"a key derived from "tags""#;
        match too_long(what, key.len(), KEY_BYTES_MAX) {
            Some(expected) => Err(self.err_at(at, expected)),
            None => Ok(key),
        }
    }

    /// The `"tags"` object: string values only, each name once, at most [`TAGS_MAX`].
    fn tags(&mut self) -> Result<Vec<(String, String)>, ParseError> {
        const EXPECTED: &str = r#"an object of strings for "tags""#;
        if !self.eat(b'{') {
            return Err(self.err_at(self.pos, EXPECTED));
        }
        let mut tags: Vec<(String, String)> = Vec::new();
        self.ws();
        if self.eat(b'}') {
            return Ok(tags);
        }
        loop {
            self.ws();
            let name_at = self.pos;
            let name = self.string("a tag name")?;
            if name.is_empty() || tags.iter().any(|(n, _)| *n == name) {
                return Err(self.err_at(name_at, "a non-empty tag name not already used"));
            }
            if let Some(expected) = too_long("a tag name", name.len(), FIELD_NAME_BYTES_MAX) {
                return Err(self.err_at(name_at, expected));
            }
            if tags.len() == TAGS_MAX {
                return Err(self.err_at(name_at, format!("at most {TAGS_MAX} tags in a record")));
            }
            self.ws();
            self.expect(b':', "':' after the tag name")?;
            self.ws();
            let value_at = self.pos;
            let expected = format!("a non-empty string for tag \"{name}\"");
            if self.peek() != Some(b'"') {
                return Err(self.err_at(value_at, expected));
            }
            let value = self.string(&expected)?;
            if value.is_empty() {
                return Err(self.err_at(value_at, expected));
            }
            tags.push((name, value));
            self.ws();
            if self.eat(b',') {
                continue;
            }
            if self.eat(b'}') {
                return Ok(tags);
            }
            return Err(self.err_at(self.pos, "',' or '}' in \"tags\""));
        }
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

    /// `None` means `null`: the default timestamp applies. An integer is in
    /// [`ParseOptions::ts_unit`]; a string is RFC 3339 with its zone ([`crate::time`]).
    fn ts_value(&mut self, opts: &ParseOptions) -> Result<Option<i64>, ParseError> {
        let at = self.pos;
        if self.eat_word("null") {
            return Ok(None);
        }
        if self.peek() == Some(b'"') {
            let text = self.string(TS_EXPECTED)?;
            return crate::time::parse_rfc3339(&text)
                .map(Some)
                .map_err(|e| self.err_at(at, rfc3339_expected(&e)));
        }
        match self.number()? {
            Some(Num::Int(v)) => epoch_ts(v, opts)
                .map(Some)
                .map_err(|(expected, found)| self.err_found(at, expected, found)),
            Some(Num::IntOutOfRange) => {
                Err(self.err_at(at, r#"an integer within the i64 range for "ts""#))
            }
            Some(Num::Float(_)) => Err(self.err_at(at, TS_EXPECTED)),
            None => Err(self.err_at(at, TS_EXPECTED)),
        }
    }

    fn fields(&mut self) -> Result<Vec<(String, Value)>, ParseError> {
        if self.peek() != Some(b'{') {
            return Err(self.err_at(self.pos, r#"an object for "fields""#));
        }
        let mut out = Fields::default();
        self.object(&mut out, 0)?;
        Ok(out.list)
    }

    /// The object at `pos`, its members stored as fields under `out.path` (see the module
    /// docs: nested objects and arrays flatten into dotted names, `null` is no field).
    fn object(&mut self, out: &mut Fields, depth: usize) -> Result<(), ParseError> {
        self.pos += 1;
        self.ws();
        if self.eat(b'}') {
            return Ok(());
        }
        loop {
            self.ws();
            let name_at = self.pos;
            let name = self.string("a field name")?;
            if name.is_empty() {
                return Err(self.err_at(name_at, "a non-empty field name"));
            }
            let before = out.enter(&name);
            if let Some(expected) = too_long("a field name", out.path.len(), FIELD_NAME_BYTES_MAX) {
                return Err(self.err_at(name_at, expected));
            }
            self.ws();
            self.expect(b':', "':' after the field name")?;
            self.ws();
            self.member(out, name_at, depth)?;
            out.path.truncate(before);
            self.ws();
            if self.eat(b',') {
                continue;
            }
            if self.eat(b'}') {
                return Ok(());
            }
            return Err(self.err_at(self.pos, r#"',' or '}' in "fields""#));
        }
    }

    /// The array at `pos`: element `i` is stored under `out.path.i`.
    fn array(&mut self, out: &mut Fields, depth: usize) -> Result<(), ParseError> {
        self.pos += 1;
        self.ws();
        if self.eat(b']') {
            return Ok(());
        }
        for index in 0usize.. {
            self.ws();
            let at = self.pos;
            let before = out.enter(&index.to_string());
            if let Some(expected) = too_long("a field name", out.path.len(), FIELD_NAME_BYTES_MAX) {
                return Err(self.err_at(at, expected));
            }
            self.member(out, at, depth)?;
            out.path.truncate(before);
            self.ws();
            if self.eat(b']') {
                break;
            }
            if !self.eat(b',') {
                return Err(self.err_at(self.pos, "',' or ']' in an array"));
            }
        }
        Ok(())
    }

    /// The value at `pos` of the field `out.path`, whose name starts at `name_at`.
    fn member(&mut self, out: &mut Fields, name_at: usize, depth: usize) -> Result<(), ParseError> {
        let nested = match self.peek() {
            Some(b'{') => !self.at_bytes_object(),
            Some(b'[') => true,
            _ => false,
        };
        if nested {
            if depth == NESTING_MAX {
                let expected = format!("at most {NESTING_MAX} levels of nested objects and arrays");
                return Err(self.err_at(self.pos, expected));
            }
            return if self.peek() == Some(b'[') {
                self.array(out, depth + 1)
            } else {
                self.object(out, depth + 1)
            };
        }
        if self.eat_word("null") {
            return Ok(());
        }
        let value = self.field_value(&out.path)?;
        if out.list.len() == self.fields_max {
            let at = column(self.s, name_at);
            return Err(too_many_fields(self.line_no, at, self.fields_max));
        }
        if !out.names.insert(out.path.clone()) {
            let expected = "a field name not already used in this record";
            return Err(self.err_found(name_at, expected, shorten(&format!("{:?}", out.path))));
        }
        out.list.push((out.path.clone(), value));
        Ok(())
    }

    /// Whether the object at `pos` is `{"$bytes":..}`.
    fn at_bytes_object(&self) -> bool {
        let rest = self.s[self.pos + 1..].trim_start_matches([' ', '\t', '\r', '\n']);
        rest.starts_with("\"$bytes\"")
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

    /// Blanks; a newline only occurs in a whole-payload parse ([`parse_json_fields`]).
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
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
/// What a `"ts"` string should have been, and why this one is not.
fn rfc3339_expected(e: &crate::time::TimeError) -> String {
    use crate::time::TimeError;
    match e {
        TimeError::NoZone(_) => {
            r#"an RFC 3339 time with a zone for "ts" (add Z for UTC or an offset such as +01:00)"#
                .to_owned()
        }
        TimeError::BadRfc3339 { reason, .. } => {
            format!(r#"an RFC 3339 time for "ts" such as "2025-12-01T12:00:00.5+01:00" ({reason})"#)
        }
        other => format!(r#"an RFC 3339 time for "ts" ({other})"#),
    }
}

/// What a `"ts"` member may hold.
const TS_EXPECTED: &str =
    r#"an integer (in the precision, ns by default) or an RFC 3339 string for "ts""#;

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
    if !r.tags.is_empty() {
        out.push_str(r#","tags":{"#);
        for (i, (name, value)) in r.tags.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            json_string(out, name);
            out.push(':');
            json_string(out, value);
        }
        out.push('}');
    }
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
