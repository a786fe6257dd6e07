//! Snapshot encoding of the stages' state ([`super::Pipeline::snapshot`]).
//!
//! Values are tagged (`Value` serialises untagged, which would turn an i64 into an f64 or bytes
//! into a list on the way back) and floats are stored as bits, so a restored pipeline continues
//! bit for bit. Marks of intervals the clock closed ([`super::idle`]) are entries `[key, start]`
//! beside a stage's open entries.

use std::collections::HashMap;

use sync::{Record, Value};

use super::Json;

pub(super) fn array(v: &Json) -> Result<&Vec<Json>, String> {
    v.as_array().ok_or_else(|| "expected an array".to_owned())
}

pub(super) fn str_at(v: &Json, i: usize) -> Result<&str, String> {
    v.get(i)
        .and_then(Json::as_str)
        .ok_or_else(|| format!("element {i}: expected a string"))
}

pub(super) fn u64_at(v: &Json, i: usize) -> Result<u64, String> {
    v.get(i)
        .and_then(Json::as_u64)
        .ok_or_else(|| format!("element {i}: expected an unsigned integer"))
}

pub(super) fn i64_at(v: &Json, i: usize) -> Result<i64, String> {
    v.get(i)
        .and_then(Json::as_i64)
        .ok_or_else(|| format!("element {i}: expected an integer"))
}

/// A record as `[key, ts, [[name, tag, value], ...]]`.
pub(crate) fn record_to_json(r: &Record) -> Json {
    let fields: Vec<Json> = r.fields.iter().map(field_to_json).collect();
    serde_json::json!([r.key, r.ts, fields])
}

/// A field as `[name, tag, value]`.
pub(super) fn field_to_json((n, v): &(String, Value)) -> Json {
    match v {
        Value::F64(x) => serde_json::json!([n, "f", x.to_bits()]),
        Value::I64(x) => serde_json::json!([n, "i", x]),
        Value::Bool(x) => serde_json::json!([n, "b", x]),
        Value::Str(x) => serde_json::json!([n, "s", x]),
        Value::Bytes(x) => serde_json::json!([n, "x", x]),
    }
}

/// The inverse of [`field_to_json`].
pub(super) fn field_from_json(f: &Json) -> Result<(String, Value), String> {
    let name = str_at(f, 0)?.to_owned();
    let value = match str_at(f, 1)? {
        "f" => Value::F64(f64::from_bits(u64_at(f, 2)?)),
        "i" => Value::I64(i64_at(f, 2)?),
        "b" => Value::Bool(f.get(2).and_then(Json::as_bool).ok_or("expected a bool")?),
        "s" => Value::Str(str_at(f, 2)?.to_owned()),
        "x" => Value::Bytes(
            array(f.get(2).ok_or("missing bytes")?)?
                .iter()
                .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect::<Option<Vec<u8>>>()
                .ok_or("expected bytes")?,
        ),
        other => return Err(format!("unknown value tag {other:?}")),
    };
    Ok((name, value))
}

/// The inverse of [`record_to_json`].
pub(crate) fn record_from_json(v: &Json) -> Result<Record, String> {
    let fields = array(v.get(2).ok_or("missing fields")?)?
        .iter()
        .map(field_from_json)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Record {
        tags: Vec::new(),
        key: str_at(v, 0)?.to_owned(),
        ts: i64_at(v, 1)?,
        fields,
    })
}

/// Clock-closed marks as snapshot entries `[key, start]` (two elements, unlike open entries).
pub(super) fn closed_to_json(closed: &HashMap<String, i64>) -> impl Iterator<Item = Json> + '_ {
    closed.iter().map(|(k, s)| serde_json::json!([k, s]))
}

/// A clock-closed mark, when `e` is one.
pub(super) fn closed_from_json(e: &Json) -> Result<Option<(String, i64)>, String> {
    match e.as_array() {
        Some(a) if a.len() == 2 => Ok(Some((str_at(e, 0)?.to_owned(), i64_at(e, 1)?))),
        _ => Ok(None),
    }
}
