//! The version 2 encoder: transposes records into dictionaries and columns, then writes each
//! column with the cheapest encoding (see `docs/format/columnar.md` for the layout).

use std::collections::HashMap;

use super::floats;
use super::ints::{self, SlotBudget};
use super::wire::{BitWriter, put_section};
use super::{COLUMNS_MAX, ColumnarError, TAG_TYPE, Tuning};
use crate::record::{Record, Value};
use crate::varint;

/// Marks the start of each labelled section in the body.
pub(super) type Marks = Vec<(String, usize)>;

/// One column's values, in record order, borrowed from the records.
enum Data<'r> {
    F64(Vec<f64>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
    Str {
        ids: Vec<i64>,
        index: HashMap<&'r str, u32>,
        dict: Vec<&'r str>,
    },
    Bytes(Vec<&'r [u8]>),
}

struct Column<'r> {
    name: &'r str,
    tag: u8,
    /// Key id of each value, for per-key prediction.
    keys: Vec<u32>,
    data: Data<'r>,
}

impl<'r> Column<'r> {
    fn new(name: &'r str, value: &Value) -> Self {
        let data = match value {
            Value::F64(_) => Data::F64(Vec::new()),
            Value::I64(_) => Data::I64(Vec::new()),
            Value::Bool(_) => Data::Bool(Vec::new()),
            Value::Str(_) => Data::Str {
                ids: Vec::new(),
                index: HashMap::new(),
                dict: Vec::new(),
            },
            Value::Bytes(_) => Data::Bytes(Vec::new()),
        };
        Column {
            name,
            tag: value.type_tag(),
            keys: Vec::new(),
            data,
        }
    }

    /// A tag column: string data under its own type, so a tag and a field may share a name.
    fn new_tag(name: &'r str) -> Self {
        Column {
            name,
            tag: TAG_TYPE,
            keys: Vec::new(),
            data: Data::Str {
                ids: Vec::new(),
                index: HashMap::new(),
                dict: Vec::new(),
            },
        }
    }

    fn push_str(&mut self, key: u32, s: &'r str) {
        self.keys.push(key);
        let Data::Str { ids, index, dict } = &mut self.data else {
            unreachable!("a tag column holds strings (matched by shape)")
        };
        let next = dict.len() as u32;
        let id = *index.entry(s).or_insert(next);
        if id == next {
            dict.push(s);
        }
        ids.push(i64::from(id));
    }

    fn push(&mut self, key: u32, value: &'r Value) {
        if let Value::Str(s) = value {
            return self.push_str(key, s);
        }
        self.keys.push(key);
        match (&mut self.data, value) {
            (Data::F64(v), Value::F64(x)) => v.push(*x),
            (Data::I64(v), Value::I64(x)) => v.push(*x),
            (Data::Bool(v), Value::Bool(x)) => v.push(*x),
            (Data::Bytes(v), Value::Bytes(b)) => v.push(b),
            _ => unreachable!("a column only receives values of its own type (matched by shape)"),
        }
    }
}

/// Records transposed: dictionaries plus one entry per record in the key/shape/ts columns.
struct Transposed<'r> {
    keys: Vec<&'r str>,
    columns: Vec<Column<'r>>,
    shapes: Vec<Vec<u32>>,
    rec_keys: Vec<u32>,
    rec_key_vals: Vec<i64>,
    rec_shapes: Vec<i64>,
    rec_ts: Vec<i64>,
}

/// Interning state for the transposition pass.
#[derive(Default)]
struct Interner<'r> {
    key_ids: HashMap<&'r str, u32>,
    column_ids: HashMap<(&'r str, u8), u32>,
    shape_ids: HashMap<Vec<u32>, u32>,
    /// The shape each key used last: records of one key nearly always keep their shape, so
    /// this avoids hashing field names for almost every record.
    key_shape: Vec<u32>,
}

const NO_SHAPE: u32 = u32::MAX;

fn transpose(records: &[Record]) -> Result<Transposed<'_>, ColumnarError> {
    let n = records.len();
    let mut t = Transposed {
        keys: Vec::new(),
        columns: Vec::new(),
        shapes: Vec::new(),
        rec_keys: Vec::with_capacity(n),
        rec_key_vals: Vec::with_capacity(n),
        rec_shapes: Vec::with_capacity(n),
        rec_ts: Vec::with_capacity(n),
    };
    let mut int = Interner::default();
    let mut last_key: Option<(&str, u32)> = None;
    for r in records {
        let k = match last_key {
            Some((s, k)) if s == r.key => k,
            _ => intern_key(&mut t, &mut int, &r.key),
        };
        last_key = Some((&r.key, k));
        let known = int.key_shape[k as usize];
        let s = if known != NO_SHAPE && shape_matches(&t.shapes[known as usize], &t.columns, r) {
            known
        } else {
            intern_shape(&mut t, &mut int, r)?
        };
        int.key_shape[k as usize] = s;
        let (tag_cols, field_cols) = t.shapes[s as usize].split_at(r.tags.len());
        for (&c, (_, v)) in tag_cols.iter().zip(&r.tags) {
            t.columns[c as usize].push_str(k, v);
        }
        for (&c, (_, v)) in field_cols.iter().zip(&r.fields) {
            t.columns[c as usize].push(k, v);
        }
        t.rec_keys.push(k);
        t.rec_key_vals.push(i64::from(k));
        t.rec_shapes.push(i64::from(s));
        t.rec_ts.push(r.ts);
    }
    Ok(t)
}

fn intern_key<'r>(t: &mut Transposed<'r>, int: &mut Interner<'r>, key: &'r str) -> u32 {
    let next = t.keys.len() as u32;
    let k = *int.key_ids.entry(key).or_insert(next);
    if k == next {
        t.keys.push(key);
        int.key_shape.push(NO_SHAPE);
    }
    k
}

/// Whether `r` has exactly this shape: its tag columns first, then its field columns.
fn shape_matches(shape: &[u32], columns: &[Column<'_>], r: &Record) -> bool {
    let entries = r.tags.iter().map(|(name, _)| (name, TAG_TYPE));
    let entries = entries.chain(r.fields.iter().map(|(name, v)| (name, v.type_tag())));
    shape.len() == r.tags.len() + r.fields.len()
        && shape.iter().zip(entries).all(|(&c, (name, tag))| {
            let col = &columns[c as usize];
            col.tag == tag && col.name == name
        })
}

fn intern_shape<'r>(
    t: &mut Transposed<'r>,
    int: &mut Interner<'r>,
    r: &'r Record,
) -> Result<u32, ColumnarError> {
    let mut shape = Vec::with_capacity(r.tags.len() + r.fields.len());
    let tags = r
        .tags
        .iter()
        .map(|(name, _)| (name.as_str(), TAG_TYPE, None));
    let fields = r
        .fields
        .iter()
        .map(|(n, v)| (n.as_str(), v.type_tag(), Some(v)));
    for (name, tag, value) in tags.chain(fields) {
        let next = t.columns.len() as u32;
        let c = *int.column_ids.entry((name, tag)).or_insert(next);
        if c == next {
            if t.columns.len() == COLUMNS_MAX {
                return Err(ColumnarError::TooManyColumns(COLUMNS_MAX + 1));
            }
            t.columns.push(match value {
                Some(v) => Column::new(name, v),
                None => Column::new_tag(name),
            });
        }
        shape.push(c);
    }
    let next = t.shapes.len() as u32;
    let s = *int.shape_ids.entry(shape.clone()).or_insert(next);
    if s == next {
        t.shapes.push(shape);
    }
    Ok(s)
}

/// Encodes `records`; returns the body and where each labelled section starts.
pub(super) fn encode(
    records: &[Record],
    tuning: &Tuning,
) -> Result<(Vec<u8>, Marks), ColumnarError> {
    let t = transpose(records)?;
    let nkeys = t.keys.len();
    let mut out = Vec::with_capacity(records.len() * 16 + 1024);
    let mut marks = Marks::new();
    marks.push(("dictionaries".into(), 0));
    write_dictionaries(&mut out, &t);
    let mut budget = SlotBudget::new(records.len());
    marks.push(("key".into(), out.len()));
    ints::write_best(&mut out, &t.rec_keys, &t.rec_key_vals, 1, false);
    marks.push(("shape".into(), out.len()));
    write_ints(
        &mut out,
        &t.rec_keys,
        &t.rec_shapes,
        nkeys,
        &mut budget,
        tuning,
    );
    marks.push(("ts".into(), out.len()));
    write_ints(&mut out, &t.rec_keys, &t.rec_ts, nkeys, &mut budget, tuning);
    for col in &t.columns {
        let kind = if col.tag == TAG_TYPE { "tag" } else { "field" };
        let label = format!("{kind}:{}:{}", col.name, type_name(col.tag));
        marks.push((label, out.len()));
        write_column(&mut out, col, nkeys, &mut budget, tuning);
    }
    Ok((out, marks))
}

fn type_name(tag: u8) -> &'static str {
    ["f64", "i64", "bool", "string", "bytes", "string"]
        .get(usize::from(tag))
        .copied()
        .unwrap_or("?")
}

/// Flags byte, keys, column table, shapes.
fn write_dictionaries(out: &mut Vec<u8>, t: &Transposed<'_>) {
    out.push(0);
    varint::put_u64(out, t.keys.len() as u64);
    for k in &t.keys {
        varint::put_bytes(out, k.as_bytes());
    }
    varint::put_u64(out, t.columns.len() as u64);
    for c in &t.columns {
        varint::put_bytes(out, c.name.as_bytes());
        out.push(c.tag);
    }
    varint::put_u64(out, t.shapes.len() as u64);
    for s in &t.shapes {
        varint::put_u64(out, s.len() as u64);
        for &c in s {
            varint::put_u64(out, u64::from(c));
        }
    }
}

/// An integer column whose transform may be per key if the budget allows.
fn write_ints(
    out: &mut Vec<u8>,
    keys: &[u32],
    vals: &[i64],
    nkeys: usize,
    budget: &mut SlotBudget,
    tuning: &Tuning,
) {
    let per_key_ok = tuning.per_key && budget.fits(nkeys);
    if ints::write_best(out, keys, vals, nkeys, per_key_ok).per_key {
        assert!(budget.take(nkeys), "fits() was checked above");
    }
}

fn write_column(
    out: &mut Vec<u8>,
    col: &Column<'_>,
    nkeys: usize,
    budget: &mut SlotBudget,
    tuning: &Tuning,
) {
    match &col.data {
        Data::F64(v) => floats::write(
            out,
            &col.keys,
            v,
            nkeys,
            budget,
            tuning.per_key,
            tuning.floats,
        ),
        Data::I64(v) => write_ints(out, &col.keys, v, nkeys, budget, tuning),
        Data::Bool(v) => {
            let mut w = BitWriter::with_capacity(v.len() / 8 + 1);
            for &b in v {
                w.put(u64::from(b), 1);
            }
            put_section(out, &w.finish());
        }
        Data::Str { ids, dict, .. } => {
            varint::put_u64(out, dict.len() as u64);
            for s in dict {
                varint::put_bytes(out, s.as_bytes());
            }
            write_ints(out, &col.keys, ids, nkeys, budget, tuning);
        }
        Data::Bytes(v) => {
            let mut body = Vec::with_capacity(v.iter().map(|b| b.len() + 2).sum());
            for b in v {
                varint::put_bytes(&mut body, b);
            }
            put_section(out, &body);
        }
    }
}
