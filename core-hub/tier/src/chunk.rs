//! Chunk encoding: hub records <-> one Parquet file.
//!
//! A chunk is the records of one hub segment within a stream-offset range fixed in the hub's
//! catalog before upload. [`encode_chunk`] writes them as Parquet (zstd, row groups sized for
//! scans, statistics on, a bloom filter on `key`) and returns the [`ChunkSummary`] the hub
//! records and [`crate::Tier2::verify_chunk`] checks the uploaded object against.
//! [`decode_chunk`] reads a file back into records for read-through and recovery.
//!
//! Encoding is built for throughput (issue 7: tier-2 upload near the store's raw PUT rate):
//! one pass over the records fills typed column buffers directly (each field resolved to its
//! column once per position and name change, not per value; values written at their row, so
//! nulls cost nothing), number columns whose values are mostly distinct skip Parquet's
//! dictionary (interning them only to overflow the dictionary page was the dearest step), and
//! the (row group, column) chunks can be encoded on several threads
//! ([`encode_chunk_with_threads`]) with the same bytes as on one.
//!
//! Event time is stored as `ts` TIMESTAMP(MICROS, UTC) — the type DuckDB, Spark and DataFusion
//! all read without flags — plus `ts_ns_rem` (0..=999, the nanoseconds below the microsecond) so
//! the exact nanosecond `ts` round-trips. `ingest_ts` is kept at microsecond precision only.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int32Type, Int64Type, TimestampMicrosecondType};
use arrow_array::{
    Array, ArrayRef, BinaryArray, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch,
    StringArray, TimestampMicrosecondArray,
};
use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field, Schema, TimeUnit};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::arrow::arrow_writer::{
    ArrowColumnChunk, ArrowColumnWriter, ArrowLeafColumn, compute_leaves,
};
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::PageIndexPolicy;
use parquet::file::metadata::{KeyValue, SortingColumn};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;
use serde::{Deserialize, Serialize};
use sync::record::{Record, Value};

use crate::schema::{ColumnSpec, FIXED_COLUMNS, FastHash, FieldRegistry, ValueKind};

/// Key of the Parquet key-value metadata entry holding the file's [`ColumnSpec`]s (JSON).
pub const META_COLUMNS: &str = "tributary.columns";
/// Key of the Parquet key-value metadata entry holding the format version.
pub const META_FORMAT: &str = "tributary.format";
/// The chunk file format version written by this crate.
pub const FORMAT_VERSION: u32 = 1;
/// Default rows per row group: large enough for scan throughput (DuckDB parallelises per row
/// group, Spark per split), small enough that min/max statistics still prune by time.
pub const DEFAULT_ROW_GROUP_ROWS: usize = 128 * 1024;

/// One record as tier 2 stores it: the record plus its origin and hub position.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierRecord {
    pub device: String,
    pub epoch: u64,
    pub seq: u64,
    /// The hub stream offset.
    pub offset: u64,
    pub key: String,
    /// The record's tags; each is a string column of the stream (kind `tag`). After a decode,
    /// in the stream's column order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<(String, String)>,
    /// Event time, nanoseconds since the Unix epoch (exact round trip).
    pub ts_ns: i64,
    /// Hub ingest time, nanoseconds since the Unix epoch (stored at microsecond precision).
    pub ingest_ts_ns: i64,
    /// Fields; after a decode, in the stream's column order (not the producer's order).
    pub fields: Vec<(String, Value)>,
}

impl TierRecord {
    /// A tier record from a record and its origin and hub position.
    pub fn from_record(
        device: &str,
        epoch: u64,
        seq: u64,
        offset: u64,
        ingest_ts_ns: i64,
        record: Record,
    ) -> TierRecord {
        TierRecord {
            device: device.to_owned(),
            epoch,
            seq,
            offset,
            key: record.key,
            tags: record.tags,
            ts_ns: record.ts,
            ingest_ts_ns,
            fields: record.fields,
        }
    }

    /// The record as readers see it (origin and position dropped).
    pub fn record(&self) -> Record {
        Record {
            tags: self.tags.clone(),
            key: self.key.clone(),
            ts: self.ts_ns,
            fields: self.fields.clone(),
        }
    }

    /// Moves the record out (origin and position dropped).
    pub fn into_record(self) -> Record {
        Record {
            tags: self.tags,
            key: self.key,
            ts: self.ts_ns,
            fields: self.fields,
        }
    }
}

/// How a chunk is written.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodeOptions {
    /// Maximum rows per row group.
    pub row_group_rows: usize,
    /// zstd level of every column. Default 1: on the telemetry set it is both faster and (with
    /// the encodings chosen per column) smaller than level 3 (18.9 vs 19.3 bytes/record,
    /// `benches/tier.rs`).
    pub zstd_level: i32,
    /// Write a bloom filter on `key` (lets engines skip row groups on `key = '...'`).
    pub key_bloom_filter: bool,
    /// Write every f64 field column with BYTE_STREAM_SPLIT. Off by default, where only mostly
    /// distinct f64 columns get it and the others keep a dictionary: on the telemetry set
    /// (values rounded by the sensors, so dictionaries hit) all-BYTE_STREAM_SPLIT is 58% larger
    /// (29.9 vs 18.9 bytes/record, `benches/tier.rs`).
    pub float_byte_stream_split: bool,
    /// Extra key-value metadata written into the file footer (e.g. stream and segment).
    pub metadata: Vec<(String, String)>,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            row_group_rows: DEFAULT_ROW_GROUP_ROWS,
            zstd_level: 1,
            key_bloom_filter: true,
            float_byte_stream_split: false,
            metadata: Vec::new(),
        }
    }
}

/// The seqs one (device, epoch) contributed to a chunk. Within one segment a device's seqs
/// need not be contiguous (its other keys may live in sibling segments), hence `count`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqRange {
    pub device: String,
    pub epoch: u64,
    pub min_seq: u64,
    pub max_seq: u64,
    pub count: u64,
}

/// What a chunk file holds, as computed at encode time and verified after upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkSummary {
    pub rows: u64,
    /// Size of the encoded file in bytes.
    pub bytes: u64,
    pub min_offset: u64,
    pub max_offset: u64,
    pub min_ts_ns: i64,
    pub max_ts_ns: i64,
    pub min_ingest_ts_ns: i64,
    pub max_ingest_ts_ns: i64,
    /// Per (device, epoch), sorted by device then epoch.
    pub seq_ranges: Vec<SeqRange>,
}

/// Why a chunk could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("cannot encode an empty chunk")]
    Empty,
    #[error("record at offset {offset}: field {field:?} of type {kind:?} is not in the registry")]
    UnregisteredField {
        offset: u64,
        field: String,
        kind: ValueKind,
    },
    #[error("record at offset {offset}: field {field:?} appears twice")]
    DuplicateField { offset: u64, field: String },
    #[error("record at offset {offset}: {what} {value} does not fit INT64")]
    OutOfRange {
        offset: u64,
        what: &'static str,
        value: u64,
    },
    #[error("column {column:?} holds more than 2 GiB in one chunk")]
    ColumnTooLarge { column: String },
    #[error("invalid encode options: {0}")]
    Options(String),
    #[error("writing parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("building arrow batch: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),
}

/// Why a chunk file could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("reading parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    #[error("chunk file lacks column {0:?}")]
    MissingColumn(&'static str),
    #[error("chunk column {column:?} has type {found}, expected {expected}")]
    ColumnType {
        column: String,
        found: String,
        expected: &'static str,
    },
    #[error("chunk file has a bad {META_COLUMNS} entry: {0}")]
    Metadata(String),
    #[error("row {row}: {what} is null or negative")]
    BadValue { row: usize, what: &'static str },
    #[error("malformed Parquet file (the reader gave up: {0})")]
    Malformed(String),
}

/// The Arrow type of a field column.
fn arrow_type(kind: ValueKind) -> DataType {
    match kind {
        ValueKind::F64 => DataType::Float64,
        ValueKind::I64 => DataType::Int64,
        ValueKind::Bool => DataType::Boolean,
        ValueKind::Str | ValueKind::Tag => DataType::Utf8,
        ValueKind::Bytes => DataType::Binary,
    }
}

fn ts_type() -> DataType {
    DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
}

/// The Arrow schema of a chunk written with `registry`.
pub fn arrow_schema(registry: &FieldRegistry) -> Schema {
    let mut fields = vec![
        Field::new("device", DataType::Utf8, false),
        Field::new("epoch", DataType::Int64, false),
        Field::new("seq", DataType::Int64, false),
        Field::new("hub_offset", DataType::Int64, false),
        Field::new("key", DataType::Utf8, false),
        Field::new("ts", ts_type(), false),
        Field::new("ts_ns_rem", DataType::Int32, false),
        Field::new("ingest_ts", ts_type(), false),
    ];
    debug_assert_eq!(fields.len(), FIXED_COLUMNS.len());
    for spec in registry.columns() {
        fields.push(Field::new(&spec.name, arrow_type(spec.kind), true));
    }
    Schema::new(fields)
}

/// Rows of a chunk whose values [`encode_chunk`] samples, per number column, to choose between
/// dictionary and plain encoding.
const CARDINALITY_SAMPLE: usize = 4096;

/// A number column whose sample is more than this fraction distinct (in 1/8ths) is written
/// without a dictionary: Parquet would intern every value only to overflow the dictionary
/// page and fall back to PLAIN anyway (lat/lon/odometer on the telemetry set).
const DISTINCT_EIGHTHS: usize = 6;

/// A field column being built: every value at its row, nulls where a record lacks the field.
struct FieldColumn {
    data: FieldData,
    /// One validity bit per row, least significant bit first (Arrow's order).
    valid: Vec<u8>,
    /// Rows holding a value.
    present: usize,
}

enum FieldData {
    F64(Vec<f64>),
    I64(Vec<i64>),
    /// Values as bits, like `valid`.
    Bool(Vec<u8>),
    Str(VarColumn),
    Bytes(VarColumn),
}

/// A variable-length column appended in row order; `offsets` covers rows `0..offsets.len() - 1`
/// (a row skipped by a later append is an empty slot, i.e. a null).
struct VarColumn {
    offsets: Vec<i32>,
    bytes: Vec<u8>,
}

impl VarColumn {
    fn new(rows: usize, bytes_hint: usize) -> VarColumn {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        VarColumn {
            offsets,
            bytes: Vec::with_capacity(bytes_hint),
        }
    }

    /// Appends `value` at `row` (> every row appended before).
    fn push(&mut self, row: usize, value: &[u8], column: &str) -> Result<(), EncodeError> {
        let last = self.offsets.last().copied().unwrap_or(0);
        self.offsets.resize(row + 1, last);
        self.bytes.extend_from_slice(value);
        let end = i32::try_from(self.bytes.len()).map_err(|_| EncodeError::ColumnTooLarge {
            column: column.to_owned(),
        })?;
        self.offsets.push(end);
        Ok(())
    }

    fn finish(mut self, rows: usize) -> (OffsetBuffer<i32>, Buffer) {
        let last = self.offsets.last().copied().unwrap_or(0);
        self.offsets.resize(rows + 1, last);
        (
            OffsetBuffer::new(ScalarBuffer::from(self.offsets)),
            Buffer::from_vec(self.bytes),
        )
    }
}

impl FieldColumn {
    fn new(kind: ValueKind, rows: usize) -> FieldColumn {
        let data = match kind {
            ValueKind::F64 => FieldData::F64(vec![0.0; rows]),
            ValueKind::I64 => FieldData::I64(vec![0; rows]),
            ValueKind::Bool => FieldData::Bool(vec![0; rows.div_ceil(8)]),
            ValueKind::Str | ValueKind::Tag => FieldData::Str(VarColumn::new(rows, 0)),
            ValueKind::Bytes => FieldData::Bytes(VarColumn::new(rows, 0)),
        };
        FieldColumn {
            data,
            valid: vec![0; rows.div_ceil(8)],
            present: 0,
        }
    }

    /// Sets `value` at `row`; false if the row already holds one (a duplicate field).
    #[inline]
    fn set(&mut self, row: usize, value: &Value, name: &str) -> Result<bool, EncodeError> {
        let (byte, mask) = (row >> 3, 1u8 << (row & 7));
        if self.valid[byte] & mask != 0 {
            return Ok(false);
        }
        match (&mut self.data, value) {
            (FieldData::F64(v), Value::F64(x)) => v[row] = *x,
            (FieldData::I64(v), Value::I64(x)) => v[row] = *x,
            // A number column widened to DOUBLE holds the field's integers too (exact up to
            // 2^53, rounded to the nearest double beyond).
            (FieldData::F64(v), Value::I64(x)) => v[row] = *x as f64,
            (FieldData::Bool(v), Value::Bool(x)) => {
                if *x {
                    v[byte] |= mask;
                }
            }
            (FieldData::Str(c), Value::Str(s)) => c.push(row, s.as_bytes(), name)?,
            (FieldData::Bytes(c), Value::Bytes(b)) => c.push(row, b, name)?,
            // Unreachable by construction (the column is chosen by the value's kind); leaving
            // the row null keeps the column aligned rather than panicking.
            _ => return Ok(true),
        }
        self.valid[byte] |= mask;
        self.present += 1;
        Ok(true)
    }

    /// Sets a tag's value at `row` (a tag column holds strings); false if the row already
    /// holds one (a duplicate tag).
    #[inline]
    fn set_tag(&mut self, row: usize, value: &str, name: &str) -> Result<bool, EncodeError> {
        let (byte, mask) = (row >> 3, 1u8 << (row & 7));
        if self.valid[byte] & mask != 0 {
            return Ok(false);
        }
        let FieldData::Str(c) = &mut self.data else {
            unreachable!("a tag column is a string column (FieldColumn::new)")
        };
        c.push(row, value.as_bytes(), name)?;
        self.valid[byte] |= mask;
        self.present += 1;
        Ok(true)
    }

    /// Whether a sample of the values looks mostly distinct (see [`DISTINCT_EIGHTHS`]). Only
    /// number columns are judged; strings keep Parquet's dictionary with its own fallback.
    fn mostly_distinct(&self) -> bool {
        let sample = |bits: &mut dyn Iterator<Item = u64>| {
            let mut seen: HashSet<u64, FastHash> = HashSet::default();
            let mut n = 0usize;
            for b in bits.take(CARDINALITY_SAMPLE) {
                seen.insert(b);
                n += 1;
            }
            n >= 64 && seen.len() * 8 > n * DISTINCT_EIGHTHS
        };
        let valid = |row: usize| self.valid[row >> 3] & (1 << (row & 7)) != 0;
        match &self.data {
            FieldData::F64(v) => sample(
                &mut v
                    .iter()
                    .enumerate()
                    .filter(|(r, _)| valid(*r))
                    .map(|(_, x)| x.to_bits()),
            ),
            FieldData::I64(v) => sample(
                &mut v
                    .iter()
                    .enumerate()
                    .filter(|(r, _)| valid(*r))
                    .map(|(_, x)| *x as u64),
            ),
            _ => false,
        }
    }

    fn finish(self, rows: usize) -> Result<ArrayRef, EncodeError> {
        let nulls = (self.present < rows)
            .then(|| NullBuffer::new(BooleanBuffer::new(Buffer::from_vec(self.valid), 0, rows)));
        Ok(match self.data {
            FieldData::F64(v) => Arc::new(Float64Array::new(ScalarBuffer::from(v), nulls)),
            FieldData::I64(v) => Arc::new(Int64Array::new(ScalarBuffer::from(v), nulls)),
            FieldData::Bool(v) => Arc::new(BooleanArray::new(
                BooleanBuffer::new(Buffer::from_vec(v), 0, rows),
                nulls,
            )),
            FieldData::Str(c) => {
                let (offsets, bytes) = c.finish(rows);
                Arc::new(StringArray::try_new(offsets, bytes, nulls)?)
            }
            FieldData::Bytes(c) => {
                let (offsets, bytes) = c.finish(rows);
                Arc::new(BinaryArray::try_new(offsets, bytes, nulls)?)
            }
        })
    }
}

/// Field names compared without a `memcmp` call for the usual short names: the encoder checks
/// every field of every record against the column it went to in the previous record.
#[inline]
fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word = |s: &[u8], i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[i..i + 8]);
        u64::from_ne_bytes(w)
    };
    let half = |s: &[u8], i: usize| {
        let mut w = [0u8; 4];
        w.copy_from_slice(&s[i..i + 4]);
        u32::from_ne_bytes(w)
    };
    match n {
        0 => true,
        1..=3 => a == b,
        4..=7 => half(a, 0) == half(b, 0) && half(a, n - 4) == half(b, n - 4),
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        17..=32 => {
            word(a, 0) == word(b, 0)
                && word(a, 8) == word(b, 8)
                && word(a, n - 16) == word(b, n - 16)
                && word(a, n - 8) == word(b, n - 8)
        }
        _ => a == b,
    }
}

/// A string hash-map key compared with [`same_name`]: devices and keys are looked up once per
/// record, and `str`'s `==` calls `memcmp` for them.
#[derive(Clone, Copy)]
struct ShortStr<'a>(&'a str);

impl PartialEq for ShortStr<'_> {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        same_name(self.0, other.0)
    }
}

impl Eq for ShortStr<'_> {}

impl std::hash::Hash for ShortStr<'_> {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

/// A non-null Utf8 column built from its offsets and bytes.
fn utf8(offsets: Vec<i32>, bytes: Vec<u8>) -> Result<ArrayRef, EncodeError> {
    Ok(Arc::new(StringArray::try_new(
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        Buffer::from_vec(bytes),
        None,
    )?))
}

fn push_str(
    offsets: &mut Vec<i32>,
    bytes: &mut Vec<u8>,
    s: &str,
    column: &'static str,
) -> Result<(), EncodeError> {
    bytes.extend_from_slice(s.as_bytes());
    offsets.push(
        i32::try_from(bytes.len()).map_err(|_| EncodeError::ColumnTooLarge {
            column: column.to_owned(),
        })?,
    );
    Ok(())
}

fn to_i64(offset: u64, what: &'static str, value: u64) -> Result<i64, EncodeError> {
    i64::try_from(value).map_err(|_| EncodeError::OutOfRange {
        offset,
        what,
        value,
    })
}

/// The per-(device, epoch) seq ranges of a chunk, with devices interned once per record.
#[derive(Default)]
struct SeqRanges<'a> {
    devices: HashMap<ShortStr<'a>, usize, FastHash>,
    /// Per interned device: (epoch, index into `ranges`), almost always one entry.
    epochs: Vec<Vec<(u64, usize)>>,
    ranges: Vec<(&'a str, SeqRange)>,
}

impl<'a> SeqRanges<'a> {
    #[inline]
    fn add(&mut self, device: &'a str, epoch: u64, seq: u64) {
        let next = self.epochs.len();
        let d = *self.devices.entry(ShortStr(device)).or_insert(next);
        if d == next {
            self.epochs.push(Vec::new());
        }
        let slot = self.epochs[d]
            .iter()
            .find(|(e, _)| *e == epoch)
            .map(|x| x.1);
        match slot {
            Some(i) => {
                let s = &mut self.ranges[i].1;
                s.min_seq = s.min_seq.min(seq);
                s.max_seq = s.max_seq.max(seq);
                s.count += 1;
            }
            None => {
                self.epochs[d].push((epoch, self.ranges.len()));
                self.ranges.push((
                    device,
                    SeqRange {
                        device: String::new(),
                        epoch,
                        min_seq: seq,
                        max_seq: seq,
                        count: 1,
                    },
                ));
            }
        }
    }

    fn finish(self) -> Vec<SeqRange> {
        let mut out: Vec<SeqRange> = self
            .ranges
            .into_iter()
            .map(|(device, mut s)| {
                s.device = device.to_owned();
                s
            })
            .collect();
        out.sort_by(|a, b| a.device.cmp(&b.device).then(a.epoch.cmp(&b.epoch)));
        out
    }
}

/// Writes the tags of record `r` into their columns at `row`.
fn set_tags(
    registry: &FieldRegistry,
    columns: &mut [FieldColumn],
    row: usize,
    r: &TierRecord,
) -> Result<(), EncodeError> {
    for (name, value) in &r.tags {
        let Some(col) = registry.column_of(name, ValueKind::Tag) else {
            return Err(EncodeError::UnregisteredField {
                offset: r.offset,
                field: name.clone(),
                kind: ValueKind::Tag,
            });
        };
        if !columns[col].set_tag(row, value, name)? {
            return Err(EncodeError::DuplicateField {
                offset: r.offset,
                field: name.clone(),
            });
        }
    }
    Ok(())
}

/// Encodes `records` (one chunk, normally in offset order) as a Parquet file with the columns
/// of `registry` that the records use (in the registry's order and names), which must already
/// contain every (field, type) the records carry (see [`FieldRegistry::observe_records`]).
///
/// The output is a pure function of the records, the registry and the options. Encodes on the
/// calling thread; see [`encode_chunk_with_threads`].
pub fn encode_chunk(
    records: &[TierRecord],
    registry: &FieldRegistry,
    options: &EncodeOptions,
) -> Result<(Bytes, ChunkSummary), EncodeError> {
    encode_chunk_with_threads(records, registry, options, 1)
}

/// [`encode_chunk`] with the file's column chunks (one per column and row group) encoded on up
/// to `threads` scoped threads (1 = the calling thread only). The bytes are the same for every
/// thread count: chunks are spliced into the file in schema order.
pub fn encode_chunk_with_threads(
    records: &[TierRecord],
    registry: &FieldRegistry,
    options: &EncodeOptions,
    threads: usize,
) -> Result<(Bytes, ChunkSummary), EncodeError> {
    if records.is_empty() {
        return Err(EncodeError::Empty);
    }
    if options.row_group_rows == 0 {
        return Err(EncodeError::Options("row_group_rows must be > 0".into()));
    }
    let level = ZstdLevel::try_new(options.zstd_level)
        .map_err(|e| EncodeError::Options(format!("zstd level: {e}")))?;
    // Only the columns these records use (`FieldRegistry::narrowed_to`).
    let narrowed = registry.narrowed_to(records);
    let registry = &narrowed;
    let rows = records.len();
    let first = &records[0];

    let mut device_offsets = Vec::with_capacity(rows + 1);
    let mut device_bytes = Vec::with_capacity(rows * first.device.len().max(1));
    let mut key_offsets = Vec::with_capacity(rows + 1);
    let mut key_bytes = Vec::with_capacity(rows * first.key.len().max(1));
    device_offsets.push(0i32);
    key_offsets.push(0i32);
    let mut epoch = Vec::with_capacity(rows);
    let mut seq = Vec::with_capacity(rows);
    let mut offset = Vec::with_capacity(rows);
    let mut ts = Vec::with_capacity(rows);
    let mut ts_rem = Vec::with_capacity(rows);
    let mut ingest = Vec::with_capacity(rows);
    let mut columns: Vec<FieldColumn> = registry
        .columns()
        .iter()
        .map(|c| FieldColumn::new(c.kind, rows))
        .collect();

    let mut seq_ranges = SeqRanges::default();
    // Records of a stream mostly carry the same fields in the same order: remember which column
    // the field at each position went to and skip the registry lookup when it repeats.
    let mut field_cache: Vec<(&str, ValueKind, usize)> = Vec::new();
    let mut summary = ChunkSummary {
        rows: rows as u64,
        bytes: 0,
        min_offset: first.offset,
        max_offset: first.offset,
        min_ts_ns: first.ts_ns,
        max_ts_ns: first.ts_ns,
        min_ingest_ts_ns: first.ingest_ts_ns,
        max_ingest_ts_ns: first.ingest_ts_ns,
        seq_ranges: Vec::new(),
    };
    let mut sorted_by_offset = true;
    let mut prev_offset = None;
    let mut keys: HashSet<ShortStr, FastHash> = HashSet::default();

    for (row, r) in records.iter().enumerate() {
        push_str(&mut device_offsets, &mut device_bytes, &r.device, "device")?;
        push_str(&mut key_offsets, &mut key_bytes, &r.key, "key")?;
        epoch.push(to_i64(r.offset, "epoch", r.epoch)?);
        seq.push(to_i64(r.offset, "seq", r.seq)?);
        offset.push(to_i64(r.offset, "offset", r.offset)?);
        if options.key_bloom_filter {
            keys.insert(ShortStr(&r.key));
        }
        ts.push(r.ts_ns.div_euclid(1000));
        ts_rem.push(r.ts_ns.rem_euclid(1000) as i32);
        ingest.push(r.ingest_ts_ns.div_euclid(1000));
        set_tags(registry, &mut columns, row, r)?;
        for (pos, (name, value)) in r.fields.iter().enumerate() {
            let kind = ValueKind::of(value);
            let col = match field_cache.get(pos) {
                Some(&(n, k, col)) if k == kind && same_name(n, name) => col,
                _ => {
                    let Some(col) = registry.column_of(name, kind) else {
                        return Err(EncodeError::UnregisteredField {
                            offset: r.offset,
                            field: name.clone(),
                            kind,
                        });
                    };
                    let entry = (name.as_str(), kind, col);
                    match field_cache.get_mut(pos) {
                        Some(slot) => *slot = entry,
                        None => field_cache.push(entry),
                    }
                    col
                }
            };
            if !columns[col].set(row, value, name)? {
                return Err(EncodeError::DuplicateField {
                    offset: r.offset,
                    field: name.clone(),
                });
            }
        }

        summary.min_offset = summary.min_offset.min(r.offset);
        summary.max_offset = summary.max_offset.max(r.offset);
        summary.min_ts_ns = summary.min_ts_ns.min(r.ts_ns);
        summary.max_ts_ns = summary.max_ts_ns.max(r.ts_ns);
        summary.min_ingest_ts_ns = summary.min_ingest_ts_ns.min(r.ingest_ts_ns);
        summary.max_ingest_ts_ns = summary.max_ingest_ts_ns.max(r.ingest_ts_ns);
        if prev_offset.is_some_and(|p| p >= r.offset) {
            sorted_by_offset = false;
        }
        prev_offset = Some(r.offset);
        seq_ranges.add(&r.device, r.epoch, r.seq);
    }
    summary.seq_ranges = seq_ranges.finish();

    // Number columns whose values are mostly distinct skip the dictionary.
    let plain: Vec<bool> = columns.iter().map(FieldColumn::mostly_distinct).collect();
    let schema = Arc::new(arrow_schema(registry));
    let mut arrays: Vec<ArrayRef> = vec![
        utf8(device_offsets, device_bytes)?,
        Arc::new(Int64Array::from(epoch)),
        Arc::new(Int64Array::from(seq)),
        Arc::new(Int64Array::from(offset)),
        utf8(key_offsets, key_bytes)?,
        Arc::new(TimestampMicrosecondArray::from(ts).with_timezone("UTC")),
        Arc::new(Int32Array::from(ts_rem)),
        Arc::new(TimestampMicrosecondArray::from(ingest).with_timezone("UTC")),
    ];
    for c in columns {
        arrays.push(c.finish(rows)?);
    }

    let props = writer_properties(
        registry,
        options,
        level,
        &plain,
        sorted_by_offset,
        keys.len(),
    )?;
    let mut out = Vec::with_capacity(rows * 32);
    write_parallel(
        &mut out,
        schema,
        props,
        &arrays,
        options.row_group_rows,
        threads,
    )?;
    summary.bytes = out.len() as u64;
    Ok((Bytes::from(out), summary))
}

/// The writer settings of one chunk: zstd, statistics, delta encodings for the sequential
/// fixed columns, no dictionary for `plain` field columns, the key bloom filter.
fn writer_properties(
    registry: &FieldRegistry,
    options: &EncodeOptions,
    level: ZstdLevel,
    plain: &[bool],
    sorted_by_offset: bool,
    distinct_keys: usize,
) -> Result<WriterProperties, EncodeError> {
    let columns_json = serde_json::to_string(registry.columns())
        .map_err(|e| EncodeError::Options(format!("serializing column specs: {e}")))?;
    let mut kv = vec![
        KeyValue::new(META_FORMAT.to_owned(), FORMAT_VERSION.to_string()),
        KeyValue::new(META_COLUMNS.to_owned(), columns_json),
    ];
    kv.extend(
        options
            .metadata
            .iter()
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
    );
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(level))
        .set_max_row_group_row_count(Some(options.row_group_rows))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_key_value_metadata(Some(kv));
    // Offsets and the fixed integer columns are near-sequential: delta encoding beats
    // dictionaries there.
    for name in ["hub_offset", "seq", "ts", "ingest_ts"] {
        props = props
            .set_column_dictionary_enabled(ColumnPath::from(name), false)
            .set_column_encoding(ColumnPath::from(name), Encoding::DELTA_BINARY_PACKED);
    }
    if sorted_by_offset {
        // Tells engines the file is ordered by hub_offset (ascending, no nulls).
        let offset_idx = FIXED_COLUMNS
            .iter()
            .position(|c| *c == "hub_offset")
            .unwrap_or(3);
        props = props.set_sorting_columns(Some(vec![SortingColumn {
            column_idx: offset_idx as i32,
            descending: false,
            nulls_first: false,
        }]));
    }
    for (spec, plain) in registry.columns().iter().zip(plain) {
        let path = ColumnPath::from(spec.name.as_str());
        if options.float_byte_stream_split && spec.kind == ValueKind::F64 {
            props = props
                .set_column_dictionary_enabled(path, false)
                .set_column_encoding(
                    ColumnPath::from(spec.name.as_str()),
                    Encoding::BYTE_STREAM_SPLIT,
                );
        } else if *plain {
            // Mostly distinct doubles (coordinates): byte-stream-split groups the sign/exponent
            // and high mantissa bytes, which zstd then packs well; integers stay PLAIN, which
            // measured smaller than DELTA_BINARY_PACKED for interleaved device counters.
            props = props.set_column_dictionary_enabled(path, false);
            if spec.kind == ValueKind::F64 {
                props = props.set_column_encoding(
                    ColumnPath::from(spec.name.as_str()),
                    Encoding::BYTE_STREAM_SPLIT,
                );
            }
        }
    }
    if options.key_bloom_filter {
        let ndv = distinct_keys.clamp(1, options.row_group_rows) as u64;
        props = props
            .set_column_bloom_filter_enabled(ColumnPath::from("key"), true)
            .set_column_bloom_filter_max_ndv(ColumnPath::from("key"), ndv)
            .set_column_bloom_filter_fpp(ColumnPath::from("key"), 0.01);
    }
    Ok(props.build())
}

/// Writes `arrays` (one per schema field) as a Parquet file into `out`, split into row groups
/// of `group_rows`, encoding the (row group, column) chunks on up to `threads` threads. Chunks are spliced into the file in schema order, so the bytes do
/// not depend on the thread count.
fn write_parallel(
    out: &mut Vec<u8>,
    schema: Arc<Schema>,
    props: WriterProperties,
    arrays: &[ArrayRef],
    group_rows: usize,
    threads: usize,
) -> Result<(), EncodeError> {
    let rows = arrays.first().map_or(0, |a| a.len());
    let writer = ArrowWriter::try_new(out, schema.clone(), Some(props))?;
    let (mut file, factory) = writer.into_serialized_writer()?;
    let groups = rows.div_ceil(group_rows);
    let mut tasks = Vec::with_capacity(groups * arrays.len());
    for g in 0..groups {
        let start = g * group_rows;
        let len = group_rows.min(rows - start);
        let writers = factory.create_column_writers(g)?;
        for ((writer, field), array) in writers.into_iter().zip(schema.fields()).zip(arrays) {
            let leaves = compute_leaves(field, &array.slice(start, len))?;
            tasks.push(Mutex::new(Some((writer, leaves))));
        }
    }
    let encode = |task: &Mutex<Option<(ArrowColumnWriter, Vec<ArrowLeafColumn>)>>| {
        let taken = task.lock().ok().and_then(|mut t| t.take());
        let Some((mut writer, leaves)) = taken else {
            return Err(EncodeError::Options("column task taken twice".into()));
        };
        for leaf in &leaves {
            writer.write(leaf)?;
        }
        Ok(writer.close()?)
    };
    let threads = threads.clamp(1, tasks.len().max(1));
    let mut chunks: Vec<Option<Result<ArrowColumnChunk, EncodeError>>> =
        (0..tasks.len()).map(|_| None).collect();
    if threads == 1 {
        for (slot, task) in chunks.iter_mut().zip(&tasks) {
            *slot = Some(encode(task));
        }
    } else {
        let next = AtomicUsize::new(0);
        let done: Vec<Vec<(usize, Result<ArrowColumnChunk, EncodeError>)>> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..threads)
                    .map(|_| {
                        let (next, tasks, encode) = (&next, &tasks, &encode);
                        scope.spawn(move || {
                            let mut mine = Vec::new();
                            loop {
                                let i = next.fetch_add(1, Ordering::Relaxed);
                                let Some(task) = tasks.get(i) else { break };
                                mine.push((i, encode(task)));
                            }
                            mine
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            vec![(
                                usize::MAX,
                                Err(EncodeError::Options("encoder thread panicked".into())),
                            )]
                        })
                    })
                    .collect()
            });
        for (i, result) in done.into_iter().flatten() {
            match chunks.get_mut(i) {
                Some(slot) => *slot = Some(result),
                None => return result.map(|_| ()),
            }
        }
    }
    let mut chunks = chunks.into_iter();
    for _ in 0..groups {
        let mut rg = file.next_row_group()?;
        for _ in 0..arrays.len() {
            let chunk = chunks
                .next()
                .flatten()
                .ok_or_else(|| EncodeError::Options("a column chunk was not encoded".into()))??;
            chunk.append_to_row_group(&mut rg)?;
        }
        rg.close()?;
    }
    file.close()?;
    Ok(())
}

/// The field columns of a decoded file: from its `tributary.columns` metadata when present,
/// otherwise derived from the column names and types.
fn field_columns(
    schema: &Schema,
    kv: Option<&Vec<KeyValue>>,
) -> Result<Vec<(usize, ColumnSpec)>, DecodeError> {
    let stored: Option<Vec<ColumnSpec>> = match kv
        .and_then(|kv| kv.iter().find(|e| e.key == META_COLUMNS))
        .and_then(|e| e.value.as_deref())
    {
        Some(json) => {
            Some(serde_json::from_str(json).map_err(|e| DecodeError::Metadata(e.to_string()))?)
        }
        None => None,
    };
    let mut out = Vec::new();
    for (i, f) in schema.fields().iter().enumerate() {
        if FIXED_COLUMNS.contains(&f.name().as_str()) {
            continue;
        }
        let spec = match stored
            .as_ref()
            .and_then(|s| s.iter().find(|c| c.name == *f.name()))
        {
            Some(spec) => spec.clone(),
            None => {
                let kind = match f.data_type() {
                    DataType::Float64 => ValueKind::F64,
                    DataType::Int64 => ValueKind::I64,
                    DataType::Boolean => ValueKind::Bool,
                    DataType::Utf8 => ValueKind::Str,
                    DataType::Binary => ValueKind::Bytes,
                    // Not a column this crate writes: skip rather than fail the whole file.
                    _ => continue,
                };
                let suffix = format!("__{}", kind.suffix());
                let field = f.name().strip_suffix(&suffix).unwrap_or(f.name());
                ColumnSpec {
                    name: f.name().clone(),
                    field: field.to_owned(),
                    kind,
                }
            }
        };
        if *f.data_type() != arrow_type(spec.kind) {
            return Err(DecodeError::ColumnType {
                column: f.name().clone(),
                found: f.data_type().to_string(),
                expected: spec.kind.suffix(),
            });
        }
        out.push((i, spec));
    }
    Ok(out)
}

fn fixed<'a>(batch: &'a RecordBatch, name: &'static str) -> Result<&'a ArrayRef, DecodeError> {
    batch
        .column_by_name(name)
        .ok_or(DecodeError::MissingColumn(name))
}

fn check_type(
    a: &ArrayRef,
    column: &'static str,
    expected: &'static str,
    ok: bool,
) -> Result<(), DecodeError> {
    if ok {
        Ok(())
    } else {
        Err(DecodeError::ColumnType {
            column: column.to_owned(),
            found: a.data_type().to_string(),
            expected,
        })
    }
}

fn int64_col<'a>(b: &'a RecordBatch, name: &'static str) -> Result<&'a Int64Array, DecodeError> {
    let a = fixed(b, name)?;
    check_type(a, name, "Int64", *a.data_type() == DataType::Int64)?;
    Ok(a.as_primitive::<Int64Type>())
}

fn str_col<'a>(b: &'a RecordBatch, name: &'static str) -> Result<&'a StringArray, DecodeError> {
    let a = fixed(b, name)?;
    check_type(a, name, "Utf8", *a.data_type() == DataType::Utf8)?;
    Ok(a.as_string::<i32>())
}

fn ts_col<'a>(
    b: &'a RecordBatch,
    name: &'static str,
) -> Result<&'a TimestampMicrosecondArray, DecodeError> {
    let a = fixed(b, name)?;
    check_type(
        a,
        name,
        "Timestamp(Microsecond)",
        matches!(a.data_type(), DataType::Timestamp(TimeUnit::Microsecond, _)),
    )?;
    Ok(a.as_primitive::<TimestampMicrosecondType>())
}

fn nonneg(v: i64, row: usize, what: &'static str) -> Result<u64, DecodeError> {
    u64::try_from(v).map_err(|_| DecodeError::BadValue { row, what })
}

/// Rejects a file whose offset index places a page outside its column chunk: the parquet
/// reader trusts those offsets (a page before the chunk's start underflows in its arithmetic,
/// which panics in debug builds), and a flipped bit in the footer must be an error instead.
fn check_page_locations(
    meta: &parquet::file::metadata::ParquetMetaData,
) -> Result<(), DecodeError> {
    for (g, rg) in meta.row_groups().iter().enumerate() {
        let index = meta.page_index_for_row_group(g);
        for (c, column) in rg.columns().iter().enumerate() {
            let Some(pages) = index.page_locations(c) else {
                continue;
            };
            // `byte_range()` asserts on negative offsets; a damaged footer must be an error.
            let start = column
                .dictionary_page_offset()
                .unwrap_or_else(|| column.data_page_offset());
            let (Ok(start), Ok(len)) = (
                u64::try_from(start),
                u64::try_from(column.compressed_size()),
            ) else {
                return Err(DecodeError::Malformed(format!(
                    "row group {g} column {c}: negative column chunk offset or size"
                )));
            };
            let end = start.saturating_add(len);
            for page in pages {
                let inside = u64::try_from(page.offset).is_ok_and(|o| {
                    o >= start
                        && u64::try_from(page.compressed_page_size)
                            .is_ok_and(|size| o.saturating_add(size) <= end)
                });
                if !inside {
                    return Err(DecodeError::Metadata(format!(
                        "row group {g} column {c}: page index points outside the column chunk"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Rows below which [`decode_chunk`] does not split the work across threads.
const PARALLEL_DECODE_MIN_ROWS: usize = 32 * 1024;

/// Decodes a chunk file written by [`encode_chunk`] (or any file with the same fixed columns),
/// in offset order, on the calling thread. Readers get parallelism by decoding several
/// prefetched chunks at once; on the shared 2-core hub, splitting one chunk across threads
/// measured slower (`benches/tier.rs`), see [`decode_chunk_with_threads`].
pub fn decode_chunk(bytes: Bytes) -> Result<Vec<TierRecord>, DecodeError> {
    decode_chunk_with_threads(bytes, 1)
}

/// [`decode_chunk`] split across up to `threads` scoped threads, each decoding a contiguous
/// row range of at least 32k rows (1 = on the calling thread only).
pub fn decode_chunk_with_threads(
    bytes: Bytes,
    threads: usize,
) -> Result<Vec<TierRecord>, DecodeError> {
    // The parquet crate asserts on some malformed files (a dictionary-encoded page without its
    // dictionary, for one) rather than returning an error, in more places than can be checked
    // up front. A damaged tier-2 object must be a decode error that the reader quarantines,
    // never a panic in the hub.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decode_chunk_unchecked(bytes, threads)
    }))
    .unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Err(DecodeError::Malformed(why))
    })
}

fn decode_chunk_unchecked(bytes: Bytes, threads: usize) -> Result<Vec<TierRecord>, DecodeError> {
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
    let metadata = ArrowReaderMetadata::load(&bytes, options)?;
    check_page_locations(metadata.metadata())?;
    let rows = usize::try_from(metadata.metadata().file_metadata().num_rows()).unwrap_or(0);
    let specs = field_columns(
        metadata.schema(),
        metadata.metadata().file_metadata().key_value_metadata(),
    )?;
    let threads = threads.clamp(1, (rows / PARALLEL_DECODE_MIN_ROWS).max(1));
    if threads == 1 {
        return decode_range(&bytes, &metadata, &specs, 0, rows);
    }
    let per = rows.div_ceil(threads);
    let parts: Vec<Result<Vec<TierRecord>, DecodeError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (bytes, metadata, specs) = (&bytes, &metadata, &specs);
                let start = (t * per).min(rows);
                let len = per.min(rows - start);
                scope.spawn(move || decode_range(bytes, metadata, specs, start, len))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DecodeError::Metadata("decoder thread panicked".into()))
                })
            })
            .collect()
    });
    let mut out = Vec::with_capacity(rows);
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

/// Decodes rows `start..start + len` of the file.
fn decode_range(
    bytes: &Bytes,
    metadata: &ArrowReaderMetadata,
    specs: &[(usize, ColumnSpec)],
    start: usize,
    len: usize,
) -> Result<Vec<TierRecord>, DecodeError> {
    let mut out = Vec::with_capacity(len);
    if len == 0 {
        return Ok(out);
    }
    let selection = RowSelection::from(vec![RowSelector::skip(start), RowSelector::select(len)]);
    let reader =
        ParquetRecordBatchReaderBuilder::new_with_metadata(bytes.clone(), metadata.clone())
            .with_row_selection(selection)
            .with_batch_size(8 * 1024)
            .build()?;
    for batch in reader {
        let batch = batch.map_err(parquet::errors::ParquetError::from)?;
        decode_batch(&batch, specs, &mut out)?;
    }
    Ok(out)
}

/// A typed view of one field column of a batch.
enum FieldArray<'a> {
    F64(&'a arrow_array::Float64Array),
    I64(&'a Int64Array),
    Bool(&'a arrow_array::BooleanArray),
    Str(&'a StringArray),
    Bytes(&'a arrow_array::BinaryArray),
}

fn decode_batch(
    batch: &RecordBatch,
    specs: &[(usize, ColumnSpec)],
    out: &mut Vec<TierRecord>,
) -> Result<(), DecodeError> {
    let base = out.len();
    let device = str_col(batch, "device")?;
    let key = str_col(batch, "key")?;
    let epoch = int64_col(batch, "epoch")?;
    let seq = int64_col(batch, "seq")?;
    let offset = int64_col(batch, "hub_offset")?;
    let ts = ts_col(batch, "ts")?;
    let ingest = ts_col(batch, "ingest_ts")?;
    let rem = match batch.column_by_name("ts_ns_rem") {
        Some(a) => {
            check_type(a, "ts_ns_rem", "Int32", *a.data_type() == DataType::Int32)?;
            Some(a.as_primitive::<Int32Type>())
        }
        None => None,
    };
    let fields: Vec<(FieldArray, &ColumnSpec)> = specs
        .iter()
        .map(|(i, spec)| {
            let a = batch.column(*i);
            let view = match spec.kind {
                ValueKind::F64 => FieldArray::F64(a.as_primitive::<Float64Type>()),
                ValueKind::I64 => FieldArray::I64(a.as_primitive::<Int64Type>()),
                ValueKind::Bool => FieldArray::Bool(a.as_boolean()),
                ValueKind::Str | ValueKind::Tag => FieldArray::Str(a.as_string::<i32>()),
                ValueKind::Bytes => FieldArray::Bytes(a.as_binary::<i32>()),
            };
            (view, spec)
        })
        .collect();
    for a in [
        device.nulls(),
        key.nulls(),
        epoch.nulls(),
        seq.nulls(),
        offset.nulls(),
    ]
    .into_iter()
    .chain([ts.nulls(), ingest.nulls()])
    {
        if a.is_some_and(|n| n.null_count() > 0) {
            return Err(DecodeError::BadValue {
                row: base,
                what: "a fixed column",
            });
        }
    }
    let epochs = epoch.values();
    let seqs = seq.values();
    let offsets = offset.values();
    let tss = ts.values();
    let ingests = ingest.values();
    for row in 0..batch.num_rows() {
        let mut rec_fields = Vec::with_capacity(fields.len());
        let mut rec_tags = Vec::new();
        for (view, spec) in &fields {
            if let (FieldArray::Str(a), ValueKind::Tag) = (view, spec.kind) {
                if a.is_valid(row) {
                    rec_tags.push((spec.field.clone(), a.value(row).to_owned()));
                }
                continue;
            }
            let value = match view {
                FieldArray::F64(a) => a.is_valid(row).then(|| Value::F64(a.value(row))),
                FieldArray::I64(a) => a.is_valid(row).then(|| Value::I64(a.value(row))),
                FieldArray::Bool(a) => a.is_valid(row).then(|| Value::Bool(a.value(row))),
                FieldArray::Str(a) => a.is_valid(row).then(|| Value::Str(a.value(row).to_owned())),
                FieldArray::Bytes(a) => {
                    a.is_valid(row).then(|| Value::Bytes(a.value(row).to_vec()))
                }
            };
            if let Some(v) = value {
                rec_fields.push((spec.field.clone(), v));
            }
        }
        let rem_ns = rem.map_or(0, |r| i64::from(r.value(row)));
        out.push(TierRecord {
            device: device.value(row).to_owned(),
            epoch: nonneg(epochs[row], base + row, "epoch")?,
            seq: nonneg(seqs[row], base + row, "seq")?,
            offset: nonneg(offsets[row], base + row, "offset")?,
            key: key.value(row).to_owned(),
            tags: rec_tags,
            ts_ns: tss[row].saturating_mul(1000).saturating_add(rem_ns),
            ingest_ts_ns: ingests[row].saturating_mul(1000),
            fields: rec_fields,
        });
    }
    Ok(())
}
