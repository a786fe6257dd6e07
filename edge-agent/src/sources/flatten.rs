//! MQTT JSON payloads into record fields: nested objects flatten into dotted names
//! (`{"a":{"b":1}}` gives `a.b`), in one pass over the payload.
//!
//! The flattener is a serde visitor that deserializes the payload straight into fields: no
//! `serde_json::Value` tree is built for objects, and one path buffer holds the dotted prefix
//! (a key is appended on the way down and truncated on the way up), so a name is copied once,
//! when its leaf is stored. Names are checked as they grow and the field count as leaves
//! arrive: the parse stops at the first field over `fields_max`, at a name over the block
//! format's 1,024 bytes, or at a name reserved for the agent (`_` first), without reading
//! the rest.
//!
//! Work is linear in the payload: each byte is read once by serde_json, each key is copied
//! once into the path, and each leaf copies its path once. A leaf's name is at most 1,024
//! bytes and every leaf costs at least four payload bytes (`"":0`), so a payload of `n` bytes
//! costs at most `n + 256 n` name bytes; typical payloads (`tests` below) cost about `2 n`.
//! [`Flattened::work`] counts it (bytes copied plus values visited) so tests can hold the bound
//! without timing anything. The fields are then sorted by name (stable: of two equal names the
//! first in the payload wins), which costs `f log f` comparisons for `f` fields.
//!
//! Values: integers within i64 stay `I64`, other numbers are `F64`, booleans and strings as
//! they are, `null` is skipped, arrays are kept as their JSON text.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use sync::Value;
use sync::parse::FIELD_NAME_BYTES_MAX;

/// The most work per payload byte (see the module docs): every byte read once, and each leaf
/// of at least four bytes copying a name of at most 1,024.
pub const WORK_PER_BYTE_MAX: u64 = 1 + (FIELD_NAME_BYTES_MAX as u64 + 1) / 4;

/// A payload's fields, sorted by name, and what flattening it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Flattened {
    pub fields: Vec<(String, Value)>,
    /// Bytes copied into names and values plus values visited: the work counter.
    pub work: u64,
}

/// Why a payload has no fields to store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlattenError {
    #[error("not JSON: {0}")]
    NotJson(String),
    #[error("expected a JSON object")]
    NotObject,
    #[error("more than {max} fields (ingest.fields_per_record_max) once flattened")]
    TooManyFields { max: usize },
    #[error(
        "field name {name:?}... is longer than the format allows ({FIELD_NAME_BYTES_MAX} bytes)"
    )]
    NameTooLong { name: String },
    #[error("field {0:?} is reserved: names starting with '_' are set only by the agent")]
    Reserved(String),
}

/// Flattens a JSON object payload into at most `fields_max` fields (see the module docs).
pub fn flatten_json(payload: &[u8], fields_max: usize) -> Result<Flattened, FlattenError> {
    let mut st = State {
        path: String::new(),
        fields: Vec::new(),
        fields_max,
        work: 0,
        error: None,
    };
    let mut de = serde_json::Deserializer::from_slice(payload);
    let parsed = Top(&mut st).deserialize(&mut de).and_then(|()| de.end());
    if let Some(e) = st.error.take() {
        return Err(e);
    }
    parsed.map_err(|e| FlattenError::NotJson(e.to_string()))?;
    let mut fields = st.fields;
    fields.sort_by(|a, b| a.0.cmp(&b.0));
    fields.dedup_by(|later, first| later.0 == first.0);
    Ok(Flattened {
        fields,
        work: st.work,
    })
}

struct State {
    /// The dotted name of the object being read.
    path: String,
    fields: Vec<(String, Value)>,
    fields_max: usize,
    work: u64,
    /// The reason the visitor stopped the parse, when it did.
    error: Option<FlattenError>,
}

impl State {
    /// Stops the parse with `e`.
    fn fail<E: de::Error>(&mut self, e: FlattenError) -> E {
        let msg = e.to_string();
        self.error = Some(e);
        E::custom(msg)
    }

    /// Appends `key` to the path; returns the path's length before, to truncate back to.
    fn enter<E: de::Error>(&mut self, key: &str) -> Result<usize, E> {
        let before = self.path.len();
        if before == 0 && key.starts_with(crate::http::ingest::RESERVED_PREFIX) {
            return Err(self.fail(FlattenError::Reserved(key.to_owned())));
        }
        let dot = usize::from(before > 0);
        if before + dot + key.len() > FIELD_NAME_BYTES_MAX {
            let mut name = self.path.clone();
            name.truncate(64);
            return Err(self.fail(FlattenError::NameTooLong { name }));
        }
        if dot == 1 {
            self.path.push('.');
        }
        self.path.push_str(key);
        self.work += key.len() as u64 + 1;
        Ok(before)
    }

    /// Stores a leaf under the current path.
    fn leaf<E: de::Error>(&mut self, value: Value) -> Result<(), E> {
        if self.fields.len() == self.fields_max {
            let max = self.fields_max;
            return Err(self.fail(FlattenError::TooManyFields { max }));
        }
        self.work += self.path.len() as u64 + 1;
        self.fields.push((self.path.clone(), value));
        Ok(())
    }
}

/// The payload: it must be an object.
struct Top<'s>(&'s mut State);

impl<'de> DeserializeSeed<'de> for Top<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(TopVisitor(self.0))
    }
}

struct TopVisitor<'s>(&'s mut State);

impl<'de> Visitor<'de> for TopVisitor<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        read_object(self.0, map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(self.0.fail(FlattenError::NotObject))
    }
    // Any scalar at the top is refused the same way.
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(self.0.fail(FlattenError::NotObject))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Err(self.0.fail(FlattenError::NotObject))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Err(self.0.fail(FlattenError::NotObject))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(self.0.fail(FlattenError::NotObject))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(self.0.fail(FlattenError::NotObject))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(self.0.fail(FlattenError::NotObject))
    }
}

/// Reads one object's members under the current path.
fn read_object<'de, A: MapAccess<'de>>(st: &mut State, mut map: A) -> Result<(), A::Error> {
    while let Some(key) = map.next_key::<String>()? {
        let before = st.enter(&key)?;
        map.next_value_seed(Member(st))?;
        st.path.truncate(before);
    }
    Ok(())
}

/// One member's value: a leaf, or a nested object read under the member's name.
struct Member<'s>(&'s mut State);

impl<'de> DeserializeSeed<'de> for Member<'_> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Member<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        self.0.work += 1;
        read_object(self.0, map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<(), A::Error> {
        let array: serde_json::Value =
            de::Deserialize::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
        let text = array.to_string();
        self.0.work += text.len() as u64;
        self.0.leaf(Value::Str(text))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.0.leaf(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.0.leaf(Value::I64(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        let value = i64::try_from(v).map_or(Value::F64(v as f64), Value::I64);
        self.0.leaf(value)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.0.leaf(Value::F64(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.work += v.len() as u64;
        self.0.leaf(Value::Str(v.to_owned()))
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        // `null` is skipped.
        self.0.work += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(f: &Flattened) -> Vec<&str> {
        f.fields.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn flattens_sorts_and_keeps_the_first_of_equal_names() {
        let f = flatten_json(
            br#"{"v":1.5,"n":{"b":{"c":true},"a":2},"z":null,"arr":[1,{"x":2}],"n.a":9,"s":"t","big":18446744073709551615}"#,
            100,
        )
        .unwrap();
        assert_eq!(names(&f), ["arr", "big", "n.a", "n.b.c", "s", "v"]);
        assert_eq!(f.fields[0].1, Value::Str(r#"[1,{"x":2}]"#.into()));
        assert_eq!(f.fields[1].1, Value::F64(18446744073709551615.0));
        assert_eq!(
            f.fields[2].1,
            Value::I64(2),
            "the first n.a in the payload wins"
        );
    }

    #[test]
    fn refuses_what_cannot_be_stored() {
        assert_eq!(flatten_json(b"[1]", 10), Err(FlattenError::NotObject));
        assert_eq!(flatten_json(b"7", 10), Err(FlattenError::NotObject));
        assert!(matches!(
            flatten_json(b"{", 10),
            Err(FlattenError::NotJson(_))
        ));
        assert!(matches!(
            flatten_json(b"{} x", 10),
            Err(FlattenError::NotJson(_))
        ));
        assert_eq!(
            flatten_json(br#"{"a":1,"b":{"c":2,"d":3}}"#, 2),
            Err(FlattenError::TooManyFields { max: 2 })
        );
        assert_eq!(
            flatten_json(br#"{"ok":1,"_topic":"plant/valve/cmd"}"#, 10),
            Err(FlattenError::Reserved("_topic".into()))
        );
        // Only a top-level name is reserved: a nested `_` is part of an ordinary name.
        assert_eq!(
            names(&flatten_json(br#"{"a":{"_b":1}}"#, 10).unwrap()),
            ["a._b"]
        );
        let long = format!(r#"{{"{}":{{"{}":1}}}}"#, "a".repeat(600), "b".repeat(600));
        assert!(matches!(
            flatten_json(long.as_bytes(), 10),
            Err(FlattenError::NameTooLong { .. })
        ));
    }

    #[test]
    fn stops_at_the_limit_without_reading_the_rest() {
        // The limit trips at the third field; what follows is not even JSON.
        let e = flatten_json(br#"{"a":1,"b":2,"c":3,"d": not json"#, 2).unwrap_err();
        assert_eq!(e, FlattenError::TooManyFields { max: 2 });
    }

    /// A payload `depth` objects deep with `width` leaves in the innermost one.
    fn nested(depth: usize, width: usize) -> String {
        let mut s = String::new();
        for i in 0..depth {
            s.push_str(&format!(r#"{{"k{i}":"#));
        }
        s.push('{');
        for j in 0..width {
            if j > 0 {
                s.push(',');
            }
            s.push_str(&format!(r#""f{j}":{j}"#));
        }
        s.push('}');
        s.push_str(&"}".repeat(depth));
        s
    }

    #[test]
    fn work_is_linear_in_the_payload() {
        // For each shape (wide: many leaves in one object; deep: as deep as serde_json reads;
        // both), ten times the payload costs about ten times the work: the work per payload
        // byte stays within 1.5x (it settles as fixed overheads fade), where a quadratic
        // flattener (the old per-leaf scan of the names) makes it grow tenfold. Wide or deep
        // alone cost under 3 per byte; deep and wide repeats the prefix in every name, within
        // the proven bound of 257 per byte.
        type Shape = fn(usize) -> String;
        let shapes: [(Shape, f64); 3] = [
            (|n| nested(0, n), 3.0),
            (|n| nested(n / 100, 1), 3.0),
            (|n| nested(20, n), WORK_PER_BYTE_MAX as f64),
        ];
        for (shape, bound) in shapes {
            let ratio = |n: usize| {
                let payload = shape(n);
                let f = flatten_json(payload.as_bytes(), 1 << 20).unwrap();
                f.work as f64 / payload.len() as f64
            };
            let (small, large) = (ratio(1_200), ratio(12_000));
            assert!(large <= bound, "{large:.2} work per byte, above {bound}");
            assert!(
                large <= small * 1.5,
                "work per byte grew from {small:.2} to {large:.2} with ten times the payload"
            );
        }
    }
}
