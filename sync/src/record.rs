//! The record model shared by every side.
//!
//! A record is the InfluxDB line-protocol model: a routing key, named tags (string dimensions),
//! an event timestamp in nanoseconds, and a set of typed fields. Tags and fields live in
//! separate namespaces, so a tag and a field may share a name (see `docs/format/tags.md`); the
//! key is derived from the tags by [`key_from_tags`] unless the producer gives one.
//!
//! A record's origin (`device`, `epoch`, `seq`) is not stored in each record: the device is the
//! connection's identity and the block header carries the epoch and the seq range, so a
//! record's seq is `first_seq + index` within its block.

use serde::{Deserialize, Serialize};

/// A typed field value.
///
/// Equality on `F64` compares bits, so NaN payloads and `-0.0` round-trip checks are exact.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Value {
    F64(f64),
    I64(i64),
    Bool(bool),
    Str(String),
    Bytes(Vec<u8>),
}

impl Value {
    /// A stable one-byte tag for the value's type, used by the encoders.
    pub fn type_tag(&self) -> u8 {
        match self {
            Value::F64(_) => 0,
            Value::I64(_) => 1,
            Value::Bool(_) => 2,
            Value::Str(_) => 3,
            Value::Bytes(_) => 4,
        }
    }

    /// The type's name as it appears in errors and docs.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::F64(_) => "f64",
            Value::I64(_) => "i64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Bytes(_) => "bytes",
        }
    }
}

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::F64(a), Value::F64(b)) => a.to_bits() == b.to_bits(),
            (Value::I64(a), Value::I64(b)) => a == b,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Str(a), Value::Str(b)) => a == b,
            (Value::Bytes(a), Value::Bytes(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Value {}

/// One record as producers write it and readers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The routing key, for example `truck-0042/engine`. Per-key order is preserved end to end.
    pub key: String,
    /// Named string dimensions (`host=gw-01`), in the order the producer wrote them. Names are
    /// unique within a record. Tier 2 gives each tag its own column.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<(String, String)>,
    /// Event time in nanoseconds since the Unix epoch, stored exactly as given.
    pub ts: i64,
    /// Typed fields in the order the producer wrote them. Names are unique within a record.
    pub fields: Vec<(String, Value)>,
}

impl Record {
    /// A rough in-memory size, used for block sealing thresholds and budgets.
    pub fn approx_bytes(&self) -> usize {
        let fields: usize = self
            .fields
            .iter()
            .map(|(name, value)| {
                name.len()
                    + match value {
                        Value::Str(s) => s.len(),
                        Value::Bytes(b) => b.len(),
                        _ => 8,
                    }
                    + 2
            })
            .sum();
        let tags: usize = self.tags.iter().map(|(n, v)| n.len() + v.len() + 2).sum();
        self.key.len() + 8 + fields + tags
    }

    /// Looks a tag up by name.
    pub fn tag(&self, name: &str) -> Option<&str> {
        self.tags
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Looks a field up by name.
    pub fn field(&self, name: &str) -> Option<&Value> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

/// Why `key` is not an acceptable routing key, or `None` if it is. The agent refuses such a
/// record at ingest and the hub refuses a block holding one, with the same rule on both sides.
///
/// A key is a `/`-separated path of segments (`truck-0042/engine`) that can be spelled only one
/// way: it is not empty, has no empty segment (`a//b`, a `/` at either end), no `.` or `..`
/// segment, and holds no NUL or other control character. So keys that only look alike
/// (`dev1/x` and `dev1//x`, or `dev1/../dev2/x`) never reach a stream, a topic or a file name.
pub fn key_problem(key: &str) -> Option<&'static str> {
    if key.is_empty() {
        return Some("the key is empty");
    }
    if key.chars().any(char::is_control) {
        return Some("keys may not hold NUL or control characters");
    }
    for seg in key.split('/') {
        match seg {
            "" => return Some("keys may not have empty segments (`//`, or `/` at either end)"),
            "." | ".." => return Some("keys may not have `.` or `..` segments"),
            _ => {}
        }
    }
    None
}

/// The routing key of a record that has tags and no key of its own: its tags sorted by name,
/// each written `name=value`, joined by `/`. Order-independent (`b=2,a=1` and `a=1,b=2` give
/// `a=1/b=2`) and unambiguous: `%`, `/`, `=` and control characters in a name or value are
/// written as `%XX` (upper-case hex), so no two tag sets give the same key. Empty when `tags`
/// is empty. The result always passes [`key_problem`] when every tag passes [`tags_problem`].
pub fn key_from_tags(tags: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = tags.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut key = String::new();
    for (i, (name, value)) in sorted.into_iter().enumerate() {
        if i > 0 {
            key.push('/');
        }
        escape_into(&mut key, name);
        key.push('=');
        escape_into(&mut key, value);
    }
    key
}

fn escape_into(out: &mut String, s: &str) {
    for c in s.chars() {
        if matches!(c, '%' | '/' | '=') || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
}

/// The most tags one record may carry.
pub const TAGS_PER_RECORD_MAX: usize = 256;

/// Why `tags` are not acceptable, or `None` if they are: at most [`TAGS_PER_RECORD_MAX`], each
/// name non-empty and unique within the record, no value empty, and no NUL in either. The agent
/// refuses such a record at ingest and the hub refuses a block holding one.
pub fn tags_problem(tags: &[(String, String)]) -> Option<String> {
    if tags.len() > TAGS_PER_RECORD_MAX {
        return Some(format!(
            "{} tags, more than the {TAGS_PER_RECORD_MAX} a record may have",
            tags.len()
        ));
    }
    for (name, value) in tags {
        if name.is_empty() {
            return Some("a tag name is empty".into());
        }
        if value.is_empty() {
            return Some(format!("tag `{name}` has an empty value"));
        }
        if name.contains('\0') || value.contains('\0') {
            return Some(format!("tag `{name}` holds a NUL character"));
        }
    }
    // Quadratic for the usual handful of tags, sorted beyond: a hostile block cannot make the
    // hub spend more than n log n per record here.
    let twice = if tags.len() <= 16 {
        (1..tags.len()).find_map(|i| tags[..i].iter().find(|(n, _)| *n == tags[i].0))
    } else {
        let mut names: Vec<&String> = tags.iter().map(|(n, _)| n).collect();
        names.sort_unstable();
        names
            .windows(2)
            .find(|w| w[0] == w[1])
            .map(|w| w[0])
            .and_then(|n| tags.iter().find(|(t, _)| t == n))
    };
    twice.map(|(name, _)| format!("tag `{name}` appears twice"))
}

/// Where a record came from: the agent stamps these, the hub deduplicates on them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Origin {
    pub device: String,
    pub epoch: u64,
    pub seq: u64,
}
