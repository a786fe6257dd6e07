//! The version 2 decoder: parses the dictionaries and every column's header up front, then
//! rebuilds the records in one pass, pulling each field from its column's stream.
//!
//! Every count is checked against the bytes left and against the record count before anything
//! is sized from it, and every stream must be consumed exactly.

use super::floats::F64Decoder;
use super::ints::{IntDecoder, SlotBudget};
use super::wire::{BitReader, Cursor};
use super::{COLUMNS_MAX, ColumnarError};
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

impl ColumnDecoder<'_> {
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

    fn finish(&self) -> Result<(), ColumnarError> {
        match self {
            ColumnDecoder::F64(d) => d.finish(),
            ColumnDecoder::I64(d) | ColumnDecoder::Str { ids: d, .. } => d.finish(),
            ColumnDecoder::Bool(b) => b.finish(),
            ColumnDecoder::Bytes(c) => c.finish(),
        }
    }
}

/// The dictionaries at the head of the body.
struct Head {
    keys: Vec<String>,
    names: Vec<String>,
    tags: Vec<u8>,
    /// Shape `s` is `shape_cols[shape_at[s]..shape_at[s + 1]]`.
    shape_cols: Vec<u32>,
    shape_at: Vec<usize>,
}

fn parse_head(c: &mut Cursor<'_>, count: usize) -> Result<Head, ColumnarError> {
    if c.byte()? != 0 {
        return Err(c.err("unknown body flags"));
    }
    let nkeys = c.count(1)?;
    if nkeys > count {
        return Err(c.err("more keys than records"));
    }
    let mut keys = Vec::with_capacity(nkeys);
    for _ in 0..nkeys {
        keys.push(c.string()?);
    }
    let ncols = c.count(2)?;
    if ncols > COLUMNS_MAX {
        return Err(c.err("too many columns"));
    }
    let (mut names, mut tags) = (Vec::with_capacity(ncols), Vec::with_capacity(ncols));
    for _ in 0..ncols {
        names.push(c.string()?);
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
    nkeys: usize,
    budget: &mut SlotBudget,
) -> Result<ColumnDecoder<'a>, ColumnarError> {
    Ok(match tag {
        0 => ColumnDecoder::F64(F64Decoder::parse(c, nkeys, budget)?),
        1 => ColumnDecoder::I64(IntDecoder::parse(c, "i64", nkeys, true, budget)?),
        2 => ColumnDecoder::Bool(BitReader::new(c.section("bool")?)?),
        3 => {
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

/// Decodes a body holding `count` records into `out`, reusing the records, strings and field
/// vectors already there (a reader that decodes block after block allocates almost nothing).
/// On error, `out` holds unspecified records.
pub(super) fn decode_into(
    raw: &[u8],
    count: u32,
    out: &mut Vec<Record>,
) -> Result<(), ColumnarError> {
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
            .push(parse_column(&mut c, tag, nkeys, &mut budget)?);
    }
    c.finish()?;
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
    /// The next record's key id, timestamp and shape (its column list).
    #[inline]
    fn start<'h>(&mut self, head: &'h Head) -> Result<(u32, i64, &'h [u32]), ColumnarError> {
        let k = self.keys.next(0)?;
        if !(0..head.keys.len() as i64).contains(&k) {
            return Err(self.keys.err("key id out of range"));
        }
        let k = k as u32;
        let s = self.shapes.next(k)?;
        if !(0..(head.shape_at.len() - 1) as i64).contains(&s) {
            return Err(self.shapes.err("shape id out of range"));
        }
        let shape = &head.shape_cols[head.shape_at[s as usize]..head.shape_at[s as usize + 1]];
        Ok((k, self.ts.next(k)?, shape))
    }

    fn next(&mut self, head: &Head) -> Result<Record, ColumnarError> {
        let (k, ts, shape) = self.start(head)?;
        let mut fields = Vec::with_capacity(shape.len());
        for &col in shape {
            let v = self.cols[col as usize].next(k)?;
            fields.push((head.names[col as usize].clone(), v));
        }
        Ok(Record {
            key: head.keys[k as usize].clone(),
            ts,
            fields,
        })
    }

    /// As [`Rows::next`], overwriting `r` in place.
    fn next_into(&mut self, head: &Head, r: &mut Record) -> Result<(), ColumnarError> {
        let (k, ts, shape) = self.start(head)?;
        assign(&mut r.key, &head.keys[k as usize]);
        r.ts = ts;
        r.fields.truncate(shape.len());
        for (j, &col) in shape.iter().enumerate() {
            let (name, dec) = (&head.names[col as usize], &mut self.cols[col as usize]);
            match r.fields.get_mut(j) {
                Some((n, v)) => {
                    assign(n, name);
                    dec.next_into(k, v)?;
                }
                None => r.fields.push((name.clone(), dec.next(k)?)),
            }
        }
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
