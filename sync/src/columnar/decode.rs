//! The version 2 and 3 decoder: parses the dictionaries and every column's header up front, then
//! rebuilds the records in one pass, pulling each field from its column's stream.
//!
//! Every count is checked against the bytes left and against the record count before anything
//! is sized from it, and every stream must be consumed exactly. [`decoded_size`] walks the key,
//! shape, string-id and bytes streams once without building records, so a caller can refuse a
//! body whose records would not fit (see `crate::decoded`) before [`decode_into`] builds them.

use super::floats::F64Decoder;
use super::ints::{IntDecoder, SlotBudget};
use super::wire::{BitReader, Cursor};
use super::{COLUMNS_MAX, ColumnarError, TAG_TYPE};
use crate::decoded::{self, FIELD_NAME_BYTES_MAX, KEY_BYTES_MAX};
use crate::record::{Record, Value};

/// Every record takes at least one byte in each of the key, shape and ts streams.
const RECORD_BYTES_MIN: usize = 3;

/// One column's decoder.
#[derive(Debug)]
enum ColumnDecoder<'a> {
    F64(F64Decoder<'a>),
    I64(IntDecoder<'a>),
    Bool(BitReader<'a>),
    Str {
        dict: Vec<&'a str>,
        ids: IntDecoder<'a>,
    },
    Bytes(Cursor<'a>),
}

impl<'a> ColumnDecoder<'a> {
    #[inline]
    fn next(&mut self, key: u32) -> Result<Value, ColumnarError> {
        Ok(match self {
            ColumnDecoder::F64(d) => Value::F64(d.next(key)?),
            ColumnDecoder::I64(d) => Value::I64(d.next(key)?),
            ColumnDecoder::Bool(b) => Value::Bool(b.bit()?),
            ColumnDecoder::Str { dict, ids } => {
                let id = ids.next(key)?;
                let s = usize::try_from(id).ok().and_then(|i| dict.get(i));
                Value::Str((*s.ok_or_else(|| ids.err("string id out of range"))?).to_owned())
            }
            ColumnDecoder::Bytes(c) => Value::Bytes(c.bytes()?.to_vec()),
        })
    }

    /// The next value of a tag column (string data), borrowed from the body.
    #[inline]
    fn next_tag(&mut self, key: u32) -> Result<&'a str, ColumnarError> {
        let ColumnDecoder::Str { dict, ids } = self else {
            unreachable!("tag columns are parsed as string columns")
        };
        let id = ids.next(key)?;
        let s = usize::try_from(id).ok().and_then(|i| dict.get(i));
        Ok(*s.ok_or_else(|| ids.err("string id out of range"))?)
    }

    /// As `next`, overwriting `v` and reusing its string or byte buffer when it has one.
    #[inline]
    fn next_into(&mut self, key: u32, v: &mut Value) -> Result<(), ColumnarError> {
        match (self, v) {
            (ColumnDecoder::Str { dict, ids }, Value::Str(s)) => {
                let id = ids.next(key)?;
                let src = usize::try_from(id).ok().and_then(|i| dict.get(i));
                assign(s, src.ok_or_else(|| ids.err("string id out of range"))?);
            }
            (ColumnDecoder::Bytes(c), Value::Bytes(b)) => {
                b.clear();
                b.extend_from_slice(c.bytes()?);
            }
            (dec, v) => *v = dec.next(key)?,
        }
        Ok(())
    }

    /// Advances a string or bytes column past its next value and returns the value's length,
    /// without copying it. Other columns hold no payload: 0, and they are not advanced.
    #[inline]
    fn payload_len(&mut self, key: u32) -> Result<usize, ColumnarError> {
        Ok(match self {
            ColumnDecoder::Str { dict, ids } => {
                let id = ids.next(key)?;
                let s = usize::try_from(id).ok().and_then(|i| dict.get(i));
                s.ok_or_else(|| ids.err("string id out of range"))?.len()
            }
            ColumnDecoder::Bytes(c) => c.bytes()?.len(),
            ColumnDecoder::F64(_) | ColumnDecoder::I64(_) | ColumnDecoder::Bool(_) => 0,
        })
    }

    fn finish(&self) -> Result<(), ColumnarError> {
        match self {
            ColumnDecoder::F64(d) => d.finish(),
            ColumnDecoder::I64(d) | ColumnDecoder::Str { ids: d, .. } => d.finish(),
            ColumnDecoder::Bool(b) => b.finish(),
            ColumnDecoder::Bytes(c) => c.finish(),
        }
    }
}

/// The dictionaries at the head of the body, borrowed from it.
struct Head<'a> {
    keys: Vec<&'a str>,
    names: Vec<&'a str>,
    tags: Vec<u8>,
    /// Shape `s` is `shape_cols[shape_at[s]..shape_at[s + 1]]`.
    shape_cols: Vec<u32>,
    shape_at: Vec<usize>,
}

/// Refuses a key or field name over the format's maximum. Checked when records are built, not
/// while sizing, so that a block whose records would not fit is refused as such whatever its
/// strings (the decoded size is the bound that protects memory; this is the format's rule).
fn check_lengths(raw: &[u8], head: &Head<'_>) -> Result<(), ColumnarError> {
    let keys = head.keys.iter().map(|k| ("key", *k, KEY_BYTES_MAX));
    let names = head.names.iter().zip(&head.tags).map(|(n, &t)| {
        let what = if t == TAG_TYPE {
            "tag name"
        } else {
            "field name"
        };
        (what, *n, FIELD_NAME_BYTES_MAX)
    });
    match keys.chain(names).find(|(_, s, max)| s.len() > *max) {
        None => Ok(()),
        Some((what, s, max)) => Err(ColumnarError::TooLong {
            what,
            len: s.len(),
            max,
            // Strings borrow from the body, so their offset is a pointer difference.
            offset: s.as_ptr() as usize - raw.as_ptr() as usize,
        }),
    }
}

fn parse_head<'a>(c: &mut Cursor<'a>, count: usize) -> Result<Head<'a>, ColumnarError> {
    if c.byte()? != 0 {
        return Err(c.err("unknown body flags"));
    }
    let nkeys = c.count(1)?;
    if nkeys > count {
        return Err(c.err("more keys than records"));
    }
    let mut keys = Vec::with_capacity(nkeys);
    for _ in 0..nkeys {
        keys.push(c.str()?);
    }
    let ncols = c.count(2)?;
    if ncols > COLUMNS_MAX {
        return Err(c.err("too many columns"));
    }
    let (mut names, mut tags) = (Vec::with_capacity(ncols), Vec::with_capacity(ncols));
    for _ in 0..ncols {
        names.push(c.str()?);
        tags.push(c.byte()?);
    }
    let nshapes = c.count(1)?;
    if nshapes > count {
        return Err(c.err("more shapes than records"));
    }
    let mut shape_at = Vec::with_capacity(nshapes + 1);
    let mut shape_cols = Vec::new();
    shape_at.push(0);
    for _ in 0..nshapes {
        let len = c.count(1)?;
        shape_cols.reserve(len);
        for _ in 0..len {
            let col = c.uvar()?;
            if col >= ncols as u64 {
                return Err(c.err("shape names an unknown column"));
            }
            shape_cols.push(col as u32);
        }
        shape_at.push(shape_cols.len());
    }
    Ok(Head {
        keys,
        names,
        tags,
        shape_cols,
        shape_at,
    })
}

fn parse_column<'a>(
    c: &mut Cursor<'a>,
    tag: u8,
    tagged: bool,
    nkeys: usize,
    budget: &mut SlotBudget,
) -> Result<ColumnDecoder<'a>, ColumnarError> {
    if tag == TAG_TYPE && !tagged {
        return Err(c.err("tag column in a body of a version without tags"));
    }
    Ok(match tag {
        0 => ColumnDecoder::F64(F64Decoder::parse(c, nkeys, budget)?),
        1 => ColumnDecoder::I64(IntDecoder::parse(c, "i64", nkeys, true, budget)?),
        2 => ColumnDecoder::Bool(BitReader::new(c.section("bool")?)?),
        3 | TAG_TYPE => {
            // Not bounded by the record count: a record may repeat a field name.
            let n = c.count(1)?;
            let mut dict = Vec::with_capacity(n);
            for _ in 0..n {
                dict.push(c.str()?);
            }
            ColumnDecoder::Str {
                dict,
                ids: IntDecoder::parse(c, "string ids", nkeys, true, budget)?,
            }
        }
        4 => ColumnDecoder::Bytes(c.section("bytes")?),
        _ => return Err(c.err("unknown column type")),
    })
}

/// The parsed dictionaries and every stream's decoder, positioned at the first record.
fn parse<'a>(
    raw: &'a [u8],
    count: u32,
    tagged: bool,
) -> Result<(Head<'a>, Rows<'a>), ColumnarError> {
    let n = count as usize;
    if n > raw.len() / RECORD_BYTES_MIN {
        return Err(ColumnarError::CountExceedsBody {
            count,
            len: raw.len(),
        });
    }
    let mut c = Cursor::new(raw, "dictionaries");
    let head = parse_head(&mut c, n)?;
    let nkeys = head.keys.len();
    let mut budget = SlotBudget::new(n);
    let mut rows = Rows {
        keys: IntDecoder::parse(&mut c, "key", nkeys, false, &mut budget)?,
        shapes: IntDecoder::parse(&mut c, "shape", nkeys, true, &mut budget)?,
        ts: IntDecoder::parse(&mut c, "ts", nkeys, true, &mut budget)?,
        cols: Vec::with_capacity(head.tags.len()),
    };
    for &tag in &head.tags {
        rows.cols
            .push(parse_column(&mut c, tag, tagged, nkeys, &mut budget)?);
    }
    c.finish()?;
    Ok((head, rows))
}

/// The decoded size of the body's records (see `crate::decoded`), from the dictionaries and
/// the key, shape, string-id and bytes streams; the other streams are not read. Allocates only
/// per shape and per column, never per record.
pub(super) fn decoded_size(raw: &[u8], count: u32, tagged: bool) -> Result<u64, ColumnarError> {
    let (head, mut rows) = parse(raw, count, tagged)?;
    let nshapes = head.shape_at.len() - 1;
    // Per shape: the fixed bytes of its fields, and its string and bytes columns.
    let mut fixed = Vec::with_capacity(nshapes);
    let (mut var_at, mut var_cols) = (Vec::with_capacity(nshapes + 1), Vec::<u32>::new());
    var_at.push(0);
    for s in 0..nshapes {
        let cols = &head.shape_cols[head.shape_at[s]..head.shape_at[s + 1]];
        let entry_bytes = |&c: &u32| {
            let len = head.names[c as usize].len();
            match head.tags[c as usize] {
                TAG_TYPE => decoded::tag_bytes(len, 0),
                _ => decoded::field_bytes(len, 0),
            }
        };
        fixed.push(cols.iter().map(entry_bytes).sum::<u64>());
        var_cols.extend(
            cols.iter()
                .filter(|&&c| matches!(head.tags[c as usize], 3 | 4 | TAG_TYPE)),
        );
        var_at.push(var_cols.len());
    }
    let mut size = 0u64;
    for _ in 0..count {
        let (k, s) = rows.key_and_shape(&head)?;
        size += decoded::record_base_bytes(head.keys[k as usize].len()) + fixed[s];
        for &col in &var_cols[var_at[s]..var_at[s + 1]] {
            size += rows.cols[col as usize].payload_len(k)? as u64;
        }
    }
    Ok(size)
}

/// Decodes a body holding `count` records into `out`, reusing the records, strings and field
/// vectors already there (a reader that decodes block after block allocates almost nothing).
/// On error, `out` holds unspecified records.
pub(super) fn decode_into(
    raw: &[u8],
    count: u32,
    tagged: bool,
    out: &mut Vec<Record>,
) -> Result<(), ColumnarError> {
    let n = count as usize;
    let (head, mut rows) = parse(raw, count, tagged)?;
    check_lengths(raw, &head)?;
    out.truncate(n);
    out.reserve_exact(n - out.len());
    for i in 0..n {
        match out.get_mut(i) {
            Some(r) => rows.next_into(&head, r)?,
            None => out.push(rows.next(&head)?),
        }
    }
    rows.finish()
}

/// The per-record streams.
struct Rows<'a> {
    keys: IntDecoder<'a>,
    shapes: IntDecoder<'a>,
    ts: IntDecoder<'a>,
    cols: Vec<ColumnDecoder<'a>>,
}

impl Rows<'_> {
    /// The next record's key id and shape id, both checked against the dictionaries.
    #[inline]
    fn key_and_shape(&mut self, head: &Head<'_>) -> Result<(u32, usize), ColumnarError> {
        let k = self.keys.next(0)?;
        if !(0..head.keys.len() as i64).contains(&k) {
            return Err(self.keys.err("key id out of range"));
        }
        let k = k as u32;
        let s = self.shapes.next(k)?;
        if !(0..(head.shape_at.len() - 1) as i64).contains(&s) {
            return Err(self.shapes.err("shape id out of range"));
        }
        Ok((k, s as usize))
    }

    /// The next record's key id, timestamp and shape (its column list).
    #[inline]
    fn start<'h>(&mut self, head: &'h Head<'_>) -> Result<(u32, i64, &'h [u32]), ColumnarError> {
        let (k, s) = self.key_and_shape(head)?;
        let shape = &head.shape_cols[head.shape_at[s]..head.shape_at[s + 1]];
        Ok((k, self.ts.next(k)?, shape))
    }

    fn next(&mut self, head: &Head<'_>) -> Result<Record, ColumnarError> {
        let (k, ts, shape) = self.start(head)?;
        let (mut tags, mut fields) = (Vec::new(), Vec::with_capacity(shape.len()));
        for &col in shape {
            let (name, dec) = (head.names[col as usize], &mut self.cols[col as usize]);
            if head.tags[col as usize] == TAG_TYPE {
                tags.push((name.to_owned(), dec.next_tag(k)?.to_owned()));
            } else {
                fields.push((name.to_owned(), dec.next(k)?));
            }
        }
        Ok(Record {
            key: head.keys[k as usize].to_owned(),
            tags,
            ts,
            fields,
        })
    }

    /// As [`Rows::next`], overwriting `r` in place.
    fn next_into(&mut self, head: &Head<'_>, r: &mut Record) -> Result<(), ColumnarError> {
        let (k, ts, shape) = self.start(head)?;
        assign(&mut r.key, head.keys[k as usize]);
        r.ts = ts;
        let (mut ntags, mut nfields) = (0, 0);
        for &col in shape {
            let (name, dec) = (head.names[col as usize], &mut self.cols[col as usize]);
            if head.tags[col as usize] == TAG_TYPE {
                let value = dec.next_tag(k)?;
                match r.tags.get_mut(ntags) {
                    Some((n, v)) => {
                        assign(n, name);
                        assign(v, value);
                    }
                    None => r.tags.push((name.to_owned(), value.to_owned())),
                }
                ntags += 1;
                continue;
            }
            match r.fields.get_mut(nfields) {
                Some((n, v)) => {
                    assign(n, name);
                    dec.next_into(k, v)?;
                }
                None => r.fields.push((name.to_owned(), dec.next(k)?)),
            }
            nfields += 1;
        }
        r.tags.truncate(ntags);
        r.fields.truncate(nfields);
        Ok(())
    }

    fn finish(&self) -> Result<(), ColumnarError> {
        self.keys.finish()?;
        self.shapes.finish()?;
        self.ts.finish()?;
        self.cols.iter().try_for_each(ColumnDecoder::finish)
    }
}

/// Overwrites `dst` with `src`, keeping its allocation when it is large enough.
#[inline]
fn assign(dst: &mut String, src: &str) {
    dst.clear();
    dst.push_str(src);
}
