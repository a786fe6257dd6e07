//! The per-stream field registry: which Parquet column holds which (field, type).
//!
//! Rule (schema evolution, see `docs/format/parquet.md`):
//! - a field keeps the column named after it for the FIRST type the hub saw for it in the
//!   stream;
//! - numbers share one column: integers and decimals of a field go to the same column, INT64
//!   while only integers arrived, widened to DOUBLE in place once a decimal arrives (or from the
//!   start for a field pinned to float, [`FieldRegistry::pin_float`]); integers are then
//!   written as doubles;
//! - a later, different kind of the same field (number, bool, string, bytes) gets its own
//!   column `{field}__{type}` with type in `f64|i64|bool|str|bytes`;
//! - a tag is a column of kind `tag` (UTF-8, like a string field) named after the tag. Tags
//!   and fields are separate namespaces: a tag and a field of one name are two columns, and
//!   whichever the stream saw second gets the typed form (`{name}__tag`, or `{name}__str`
//!   and so on for the field), as a later kind of a field does. A tag named like a fixed
//!   column (`device`, `key`, ...) is `{name}__tag`;
//! - a name that would collide (case-insensitively, because DuckDB and Spark resolve column names
//!   case-insensitively) with a fixed column or an earlier column gets `__2`, `__3`, ... appended.
//!
//! Columns are only ever appended, in the order the hub registered them, so every file of a
//! stream carries a prefix-compatible schema and files only gain nullable columns at the end. The
//! registry is plain data (serde) so the hub can persist it in its catalog; every Parquet file
//! also carries the registry snapshot it was written with, so a file is self-describing.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};
use sync::record::Value;

/// Columns every chunk file starts with, in this order. Field columns follow.
pub const FIXED_COLUMNS: [&str; 8] = [
    "device",
    "epoch",
    "seq",
    "hub_offset",
    "key",
    "ts",
    "ts_ns_rem",
    "ingest_ts",
];

/// The type of a field value, as a column sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueKind {
    F64,
    I64,
    Bool,
    Str,
    Bytes,
    /// A tag's column: UTF-8 strings, in the tags' own namespace.
    Tag,
}

impl ValueKind {
    pub const ALL: [ValueKind; 6] = [
        ValueKind::F64,
        ValueKind::I64,
        ValueKind::Bool,
        ValueKind::Str,
        ValueKind::Bytes,
        ValueKind::Tag,
    ];

    pub fn of(value: &Value) -> ValueKind {
        match value {
            Value::F64(_) => ValueKind::F64,
            Value::I64(_) => ValueKind::I64,
            Value::Bool(_) => ValueKind::Bool,
            Value::Str(_) => ValueKind::Str,
            Value::Bytes(_) => ValueKind::Bytes,
        }
    }

    /// The suffix used in `{field}__{type}` column names.
    pub fn suffix(self) -> &'static str {
        match self {
            ValueKind::F64 => "f64",
            ValueKind::I64 => "i64",
            ValueKind::Bool => "bool",
            ValueKind::Str => "str",
            ValueKind::Bytes => "bytes",
            ValueKind::Tag => "tag",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// One field column: its Parquet column name, the record field it holds and the value type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnSpec {
    pub name: String,
    pub field: String,
    pub kind: ValueKind,
}

/// Why a registry could not be built from stored column specs.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("column {name:?} appears twice in the field registry (case-insensitively)")]
    DuplicateColumn { name: String },
    #[error("column {name:?} collides with a fixed column")]
    FixedColumn { name: String },
    #[error("field {field:?} has two columns of type {kind:?}")]
    DuplicateField { field: String, kind: ValueKind },
}

/// The ordered field columns of one stream. Serializes as the list of [`ColumnSpec`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<ColumnSpec>", into = "Vec<ColumnSpec>")]
pub struct FieldRegistry {
    columns: Vec<ColumnSpec>,
    /// field name -> column index per [`ValueKind`] (looked up once per field per record).
    by_field: HashMap<String, [Option<u32>; 6], FastHash>,
    /// lower-cased column names in use (fixed columns included), for collision checks.
    taken: HashSet<String>,
    /// Fields the operator pinned to float: their first integer already makes a DOUBLE
    /// column. Configuration, not data: it is not serialized.
    float_fields: HashSet<String>,
    /// Iceberg's type rules: an INT64 column never widens to DOUBLE (Iceberg allows only
    /// int to long and float to double); a decimal after integers gets a column of its own,
    /// `{field}__f64`. Configuration, not data: it is not serialized.
    no_widening: bool,
}

/// How a field's columns changed between two snapshots of a registry
/// ([`FieldRegistry::changes_since`]), for the hub to log and count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnChange {
    /// The field's INT64 column became DOUBLE: a decimal arrived, or the field was pinned.
    Widened { field: String, column: String },
    /// The field arrived with a kind its existing columns cannot hold (a number after a
    /// string, ...): the new kind got a column of its own.
    NewKind {
        field: String,
        column: String,
        kind: ValueKind,
        existing: Vec<ValueKind>,
    },
}

impl FieldRegistry {
    pub fn new() -> FieldRegistry {
        FieldRegistry::default()
    }

    /// Rebuilds a registry from specs as stored (catalog or file metadata), checking them.
    pub fn from_columns(columns: Vec<ColumnSpec>) -> Result<FieldRegistry, RegistryError> {
        let mut reg = FieldRegistry::new();
        for spec in columns {
            let lower = spec.name.to_ascii_lowercase();
            if FIXED_COLUMNS.contains(&lower.as_str()) {
                return Err(RegistryError::FixedColumn { name: spec.name });
            }
            if reg.taken.contains(&lower) {
                return Err(RegistryError::DuplicateColumn { name: spec.name });
            }
            let slot = reg.by_field.entry(spec.field.clone()).or_default();
            if slot[spec.kind.index()].is_some() {
                return Err(RegistryError::DuplicateField {
                    field: spec.field,
                    kind: spec.kind,
                });
            }
            slot[spec.kind.index()] = Some(reg.columns.len() as u32);
            reg.taken.insert(lower);
            reg.columns.push(spec);
        }
        // Integers of a field with a DOUBLE column and no INT64 one go to the DOUBLE column.
        // Only after every spec is in: a registry written before numbers shared a column may
        // hold both, and keeps both.
        for slots in reg.by_field.values_mut() {
            if slots[ValueKind::I64.index()].is_none() {
                slots[ValueKind::I64.index()] = slots[ValueKind::F64.index()];
            }
        }
        Ok(reg)
    }

    /// Pins `field` to float: a field with no column yet gets a DOUBLE column on its first
    /// number, and a field whose number column is INT64 has it widened now (files already
    /// written keep their INT64 column). Returns true if the registry's columns changed.
    pub fn pin_float(&mut self, field: &str) -> bool {
        self.float_fields.insert(field.to_owned());
        if self.no_widening {
            return false;
        }
        match self.by_field.get(field) {
            Some(slots) if slots[ValueKind::F64.index()].is_none() => {
                match slots[ValueKind::I64.index()] {
                    Some(i) => {
                        self.widen(field, i as usize);
                        true
                    }
                    None => false,
                }
            }
            _ => false,
        }
    }

    /// Applies Iceberg's type rules from now on: a number column keeps the type it was
    /// created with (see `no_widening`).
    pub fn without_widening(mut self) -> FieldRegistry {
        self.no_widening = true;
        self
    }

    /// What changed from `before` (an earlier snapshot of this registry) to this one.
    pub fn changes_since(&self, before: &FieldRegistry) -> Vec<ColumnChange> {
        let mut out = Vec::new();
        for (i, spec) in self.columns.iter().enumerate() {
            match before.columns.get(i) {
                Some(old) if old.kind != spec.kind => out.push(ColumnChange::Widened {
                    field: spec.field.clone(),
                    column: spec.name.clone(),
                }),
                Some(_) => {}
                None => {
                    let existing: Vec<ValueKind> = self.columns[..i]
                        .iter()
                        .filter(|c| c.field == spec.field)
                        .map(|c| c.kind)
                        .collect();
                    if !existing.is_empty() {
                        out.push(ColumnChange::NewKind {
                            field: spec.field.clone(),
                            column: spec.name.clone(),
                            kind: spec.kind,
                            existing,
                        });
                    }
                }
            }
        }
        out
    }

    pub fn columns(&self) -> &[ColumnSpec] {
        &self.columns
    }

    pub fn len(&self) -> usize {
        self.columns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// The column index holding `field` values of type `kind`, if registered.
    pub fn column_of(&self, field: &str, kind: ValueKind) -> Option<usize> {
        self.by_field
            .get(field)
            .and_then(|slots| slots[kind.index()])
            .map(|i| i as usize)
    }

    /// Registers (field, kind) if new; returns its column index and whether it was added.
    pub fn register(&mut self, field: &str, kind: ValueKind) -> (usize, bool) {
        if let Some(i) = self.column_of(field, kind) {
            return (i, false);
        }
        // A decimal for a field whose integers have an INT64 column: widen that column.
        if kind == ValueKind::F64
            && !self.no_widening
            && let Some(i) = self.column_of(field, ValueKind::I64)
        {
            self.widen(field, i);
            return (i, true);
        }
        let kind = if kind == ValueKind::I64 && self.float_fields.contains(field) {
            ValueKind::F64
        } else {
            kind
        };
        let first_type = self
            .by_field
            .get(field)
            .is_none_or(|slots| slots.iter().all(Option::is_none));
        let base = if first_type {
            field.to_owned()
        } else {
            format!("{field}__{}", kind.suffix())
        };
        let name = self.free_name(base, kind);
        let index = self.columns.len();
        self.taken.insert(name.to_ascii_lowercase());
        let slots = self.by_field.entry(field.to_owned()).or_default();
        slots[kind.index()] = Some(index as u32);
        if kind == ValueKind::F64 {
            // Integers of this field share the DOUBLE column.
            slots[ValueKind::I64.index()].get_or_insert(index as u32);
        }
        self.columns.push(ColumnSpec {
            name,
            field: field.to_owned(),
            kind,
        });
        (index, true)
    }

    /// Retypes column `index` (the INT64 column of `field`) to DOUBLE; integers keep going to
    /// it and are written as doubles. The name stays: files already written carry it as INT64.
    fn widen(&mut self, field: &str, index: usize) {
        assert_eq!(
            self.columns[index].kind,
            ValueKind::I64,
            "only INT64 widens"
        );
        self.columns[index].kind = ValueKind::F64;
        self.by_field
            .get_mut(field)
            .expect("the field has a column")[ValueKind::F64.index()] = Some(index as u32);
    }

    /// Registers every (field, type) the records carry, in record order; returns true if the
    /// registry changed (the hub must then persist it before uploading the chunk).
    pub fn observe<'a, I>(&mut self, fields: I) -> bool
    where
        I: IntoIterator<Item = &'a (String, Value)>,
    {
        let mut changed = false;
        for (name, value) in fields {
            changed |= self.register(name, ValueKind::of(value)).1;
        }
        changed
    }

    /// Registers the fields of records; see [`FieldRegistry::observe`].
    pub fn observe_records<'a, I>(&mut self, records: I) -> bool
    where
        I: IntoIterator<Item = &'a crate::TierRecord>,
    {
        let mut changed = false;
        for r in records {
            for (name, _) in &r.tags {
                changed |= self.register(name, ValueKind::Tag).1;
            }
            changed |= self.observe(&r.fields);
        }
        changed
    }

    /// This registry narrowed to the columns `records` use, in this registry's order and
    /// with its names. A chunk file carries only those (a stream that once saw thousands of
    /// fields does not write thousands of empty columns into every later file); readers see
    /// the stream's whole schema over its files: the hub through each file's own column
    /// specs, SQL engines with `union_by_name`. Fields not registered here are left for the
    /// encoder to report.
    pub fn narrowed_to(&self, records: &[crate::TierRecord]) -> FieldRegistry {
        let mut used = vec![false; self.columns.len()];
        // Records mostly repeat the previous record's fields: skip those lookups.
        let mut last: Vec<(&str, ValueKind)> = Vec::new();
        for r in records {
            for (name, _) in &r.tags {
                if let Some(i) = self.column_of(name, ValueKind::Tag) {
                    used[i] = true;
                }
            }
            for (pos, (name, value)) in r.fields.iter().enumerate() {
                let kind = ValueKind::of(value);
                if last.get(pos) == Some(&(name.as_str(), kind)) {
                    continue;
                }
                if let Some(i) = self.column_of(name, kind) {
                    used[i] = true;
                }
                match last.get_mut(pos) {
                    Some(slot) => *slot = (name.as_str(), kind),
                    None => last.push((name.as_str(), kind)),
                }
            }
        }
        if used.iter().all(|&u| u) {
            return self.clone();
        }
        let columns = self
            .columns
            .iter()
            .zip(&used)
            .filter(|(_, u)| **u)
            .map(|(c, _)| c.clone())
            .collect();
        FieldRegistry::from_columns(columns).expect("a subset of a valid registry is valid")
    }

    /// A free column name starting from `base`: fixed columns force the typed form, then
    /// `__2`, `__3`, ... until nothing collides.
    fn free_name(&self, base: String, kind: ValueKind) -> String {
        let is_free = |n: &str| {
            let lower = n.to_ascii_lowercase();
            !self.taken.contains(&lower) && !FIXED_COLUMNS.contains(&lower.as_str())
        };
        if is_free(&base) {
            return base;
        }
        let typed = if base.ends_with(&format!("__{}", kind.suffix())) {
            base
        } else {
            format!("{base}__{}", kind.suffix())
        };
        if is_free(&typed) {
            return typed;
        }
        (2u32..)
            .map(|n| format!("{typed}__{n}"))
            .find(|n| is_free(n))
            .expect("an unbounded counter finds a free name")
    }
}

impl TryFrom<Vec<ColumnSpec>> for FieldRegistry {
    type Error = RegistryError;
    fn try_from(columns: Vec<ColumnSpec>) -> Result<Self, Self::Error> {
        FieldRegistry::from_columns(columns)
    }
}

impl From<FieldRegistry> for Vec<ColumnSpec> {
    fn from(reg: FieldRegistry) -> Self {
        reg.columns
    }
}

/// A multiply-rotate hash over 8-byte words (FxHash's step, plus a final mix so that the low
/// bits hashbrown indexes by depend on every input byte): the encoder hashes short strings
/// (field names, keys, devices) millions of times per second; SipHash's DoS resistance buys
/// nothing for data the hub already accepted.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct WordHash(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl WordHash {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for WordHash {
    #[inline]
    fn finish(&self) -> u64 {
        let h = self.0 ^ (self.0 >> 31);
        h.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (h >> 29)
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            self.add(u64::from_le_bytes(b));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(b) ^ ((rest.len() as u64) << 59));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

pub(crate) type FastHash = BuildHasherDefault<WordHash>;
