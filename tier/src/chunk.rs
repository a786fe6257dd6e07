//! Chunk encoding: hub records <-> one Parquet file.
//!
//! A chunk is the records of one hub segment within a stream-offset range fixed in the hub's
//! catalog before upload. [`encode_chunk`] writes them as Parquet (zstd, row groups sized for
//! scans, statistics on, a bloom filter on `key`) and returns the [`ChunkSummary`] the hub
//! records and [`crate::Tier2::verify_chunk`] checks the uploaded object against.
//! [`decode_chunk`] reads a file back into records for read-through and recovery.
//!
//! Event time is stored as `ts` TIMESTAMP(MICROS, UTC) — the type DuckDB, Spark and DataFusion
//! all read without flags — plus `ts_ns_rem` (0..=999, the nanoseconds below the microsecond) so
//! the exact nanosecond `ts` round-trips. `ingest_ts` is kept at microsecond precision only.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, BooleanBuilder, Float64Builder, Int64Builder, StringBuilder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int32Type, Int64Type, TimestampMicrosecondType};
use arrow_array::{
    Array, ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use arrow_schema::{DataType, Field, Schema, TimeUnit};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::basic::{Compression, ZstdLevel};
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
            ts_ns: record.ts,
            ingest_ts_ns,
            fields: record.fields,
        }
    }

    /// The record as readers see it (origin and position dropped).
    pub fn record(&self) -> Record {
        Record {
            key: self.key.clone(),
            ts: self.ts_ns,
            fields: self.fields.clone(),
        }
    }

    /// Moves the record out (origin and position dropped).
    pub fn into_record(self) -> Record {
        Record {
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
    /// zstd level of every column.
    pub zstd_level: i32,
    /// Write a bloom filter on `key` (lets engines skip row groups on `key = '...'`).
    pub key_bloom_filter: bool,
    /// Write f64 field columns with BYTE_STREAM_SPLIT instead of dictionary/PLAIN. Off by
    /// default: on the telemetry set (values rounded by the sensors, so dictionaries hit) it is
    /// 24% larger (32.3 vs 26.0 bytes/record, `benches/tier.rs`).
    pub float_byte_stream_split: bool,
    /// Extra key-value metadata written into the file footer (e.g. stream and segment).
    pub metadata: Vec<(String, String)>,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            row_group_rows: DEFAULT_ROW_GROUP_ROWS,
            zstd_level: 3,
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
}

/// The Arrow type of a field column.
fn arrow_type(kind: ValueKind) -> DataType {
    match kind {
        ValueKind::F64 => DataType::Float64,
        ValueKind::I64 => DataType::Int64,
        ValueKind::Bool => DataType::Boolean,
        ValueKind::Str => DataType::Utf8,
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

/// A field column being built; `filled` rows have been appended so far.
enum ColumnBuilder {
    F64(Float64Builder),
    I64(Int64Builder),
    Bool(BooleanBuilder),
    Str(StringBuilder),
    Bytes(BinaryBuilder),
}

impl ColumnBuilder {
    fn new(kind: ValueKind, rows: usize) -> ColumnBuilder {
        match kind {
            ValueKind::F64 => ColumnBuilder::F64(Float64Builder::with_capacity(rows)),
            ValueKind::I64 => ColumnBuilder::I64(Int64Builder::with_capacity(rows)),
            ValueKind::Bool => ColumnBuilder::Bool(BooleanBuilder::with_capacity(rows)),
            ValueKind::Str => ColumnBuilder::Str(StringBuilder::with_capacity(rows, rows * 8)),
            ValueKind::Bytes => ColumnBuilder::Bytes(BinaryBuilder::with_capacity(rows, rows * 8)),
        }
    }

    fn append_nulls(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        match self {
            ColumnBuilder::F64(b) => b.append_nulls(n),
            ColumnBuilder::I64(b) => b.append_nulls(n),
            ColumnBuilder::Bool(b) => b.append_nulls(n),
            ColumnBuilder::Str(b) => b.append_nulls(n),
            ColumnBuilder::Bytes(b) => b.append_nulls(n),
        }
    }

    /// Appends `value`; the registry lookup guarantees its kind matches the builder.
    fn append(&mut self, value: &Value) {
        match (self, value) {
            (ColumnBuilder::F64(b), Value::F64(v)) => b.append_value(*v),
            (ColumnBuilder::I64(b), Value::I64(v)) => b.append_value(*v),
            (ColumnBuilder::Bool(b), Value::Bool(v)) => b.append_value(*v),
            (ColumnBuilder::Str(b), Value::Str(v)) => b.append_value(v),
            (ColumnBuilder::Bytes(b), Value::Bytes(v)) => b.append_value(v),
            // Unreachable by construction (column chosen by the value's kind); a null keeps
            // the column aligned rather than panicking.
            (b, _) => b.append_nulls(1),
        }
    }

    fn finish(&mut self) -> ArrayRef {
        match self {
            ColumnBuilder::F64(b) => Arc::new(b.finish()),
            ColumnBuilder::I64(b) => Arc::new(b.finish()),
            ColumnBuilder::Bool(b) => Arc::new(b.finish()),
            ColumnBuilder::Str(b) => Arc::new(b.finish()),
            ColumnBuilder::Bytes(b) => Arc::new(b.finish()),
        }
    }
}

fn to_i64(offset: u64, what: &'static str, value: u64) -> Result<i64, EncodeError> {
    i64::try_from(value).map_err(|_| EncodeError::OutOfRange {
        offset,
        what,
        value,
    })
}

/// Encodes `records` (one chunk, normally in offset order) as a Parquet file with the columns
/// of `registry`, which must already contain every (field, type) the records carry (see
/// [`FieldRegistry::observe_records`]).
pub fn encode_chunk(
    records: &[TierRecord],
    registry: &FieldRegistry,
    options: &EncodeOptions,
) -> Result<(Bytes, ChunkSummary), EncodeError> {
    if records.is_empty() {
        return Err(EncodeError::Empty);
    }
    if options.row_group_rows == 0 {
        return Err(EncodeError::Options("row_group_rows must be > 0".into()));
    }
    let level = ZstdLevel::try_new(options.zstd_level)
        .map_err(|e| EncodeError::Options(format!("zstd level: {e}")))?;
    let rows = records.len();

    let mut device = StringBuilder::with_capacity(rows, rows * 8);
    let mut epoch = Vec::with_capacity(rows);
    let mut seq = Vec::with_capacity(rows);
    let mut offset = Vec::with_capacity(rows);
    let mut key = StringBuilder::with_capacity(rows, rows * 16);
    let mut ts = Vec::with_capacity(rows);
    let mut ts_rem = Vec::with_capacity(rows);
    let mut ingest = Vec::with_capacity(rows);
    let mut columns: Vec<ColumnBuilder> = registry
        .columns()
        .iter()
        .map(|c| ColumnBuilder::new(c.kind, rows))
        .collect();
    let mut filled = vec![0usize; columns.len()];

    let mut seq_ranges: HashMap<(&str, u64), SeqRange, FastHash> = HashMap::default();
    // Records of a stream mostly carry the same fields in the same order: remember which column
    // the field at each position went to and skip the registry lookup when it repeats.
    let mut field_cache: Vec<Option<(&str, ValueKind, usize)>> = Vec::new();
    let first = &records[0];
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
    let mut keys: HashSet<&str, FastHash> = HashSet::default();

    for (row, r) in records.iter().enumerate() {
        device.append_value(&r.device);
        epoch.push(to_i64(r.offset, "epoch", r.epoch)?);
        seq.push(to_i64(r.offset, "seq", r.seq)?);
        offset.push(to_i64(r.offset, "offset", r.offset)?);
        key.append_value(&r.key);
        if options.key_bloom_filter {
            keys.insert(&r.key);
        }
        ts.push(r.ts_ns.div_euclid(1000));
        ts_rem.push(r.ts_ns.rem_euclid(1000) as i32);
        ingest.push(r.ingest_ts_ns.div_euclid(1000));
        for (pos, (name, value)) in r.fields.iter().enumerate() {
            let kind = ValueKind::of(value);
            if field_cache.len() <= pos {
                field_cache.push(None);
            }
            let col = match field_cache[pos] {
                Some((n, k, col)) if k == kind && n == name => col,
                _ => {
                    let Some(col) = registry.column_of(name, kind) else {
                        return Err(EncodeError::UnregisteredField {
                            offset: r.offset,
                            field: name.clone(),
                            kind,
                        });
                    };
                    field_cache[pos] = Some((name.as_str(), kind, col));
                    col
                }
            };
            if filled[col] > row {
                return Err(EncodeError::DuplicateField {
                    offset: r.offset,
                    field: name.clone(),
                });
            }
            columns[col].append_nulls(row - filled[col]);
            columns[col].append(value);
            filled[col] = row + 1;
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
        seq_ranges
            .entry((r.device.as_str(), r.epoch))
            .and_modify(|s| {
                s.min_seq = s.min_seq.min(r.seq);
                s.max_seq = s.max_seq.max(r.seq);
                s.count += 1;
            })
            .or_insert_with(|| SeqRange {
                device: r.device.clone(),
                epoch: r.epoch,
                min_seq: r.seq,
                max_seq: r.seq,
                count: 1,
            });
    }
    summary.seq_ranges = seq_ranges.into_values().collect();
    summary
        .seq_ranges
        .sort_by(|a, b| a.device.cmp(&b.device).then(a.epoch.cmp(&b.epoch)));

    let schema = Arc::new(arrow_schema(registry));
    let mut arrays: Vec<ArrayRef> = vec![
        Arc::new(device.finish()),
        Arc::new(Int64Array::from(epoch)),
        Arc::new(Int64Array::from(seq)),
        Arc::new(Int64Array::from(offset)),
        Arc::new(key.finish()),
        Arc::new(TimestampMicrosecondArray::from(ts).with_timezone("UTC")),
        Arc::new(Int32Array::from(ts_rem)),
        Arc::new(TimestampMicrosecondArray::from(ingest).with_timezone("UTC")),
    ];
    for (col, b) in columns.iter_mut().enumerate() {
        b.append_nulls(rows - filled[col]);
        arrays.push(b.finish());
    }
    let batch = RecordBatch::try_new(schema.clone(), arrays)?;

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
        .set_key_value_metadata(Some(kv))
        // Offsets and the fixed integer columns are near-sequential: delta encoding beats
        // dictionaries there.
        .set_column_dictionary_enabled(ColumnPath::from("hub_offset"), false)
        .set_column_dictionary_enabled(ColumnPath::from("seq"), false)
        .set_column_dictionary_enabled(ColumnPath::from("ts"), false)
        .set_column_dictionary_enabled(ColumnPath::from("ingest_ts"), false)
        .set_column_encoding(
            ColumnPath::from("hub_offset"),
            parquet::basic::Encoding::DELTA_BINARY_PACKED,
        )
        .set_column_encoding(
            ColumnPath::from("seq"),
            parquet::basic::Encoding::DELTA_BINARY_PACKED,
        )
        .set_column_encoding(
            ColumnPath::from("ts"),
            parquet::basic::Encoding::DELTA_BINARY_PACKED,
        )
        .set_column_encoding(
            ColumnPath::from("ingest_ts"),
            parquet::basic::Encoding::DELTA_BINARY_PACKED,
        );
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
    if options.float_byte_stream_split {
        for spec in registry
            .columns()
            .iter()
            .filter(|c| c.kind == ValueKind::F64)
        {
            let path = ColumnPath::from(spec.name.as_str());
            props = props
                .set_column_dictionary_enabled(path.clone(), false)
                .set_column_encoding(path, parquet::basic::Encoding::BYTE_STREAM_SPLIT);
        }
    }
    if options.key_bloom_filter {
        let ndv = keys.len().clamp(1, options.row_group_rows) as u64;
        props = props
            .set_column_bloom_filter_enabled(ColumnPath::from("key"), true)
            .set_column_bloom_filter_max_ndv(ColumnPath::from("key"), ndv)
            .set_column_bloom_filter_fpp(ColumnPath::from("key"), 0.01);
    }
    let mut out = Vec::with_capacity(rows * 16);
    let mut writer = ArrowWriter::try_new(&mut out, schema, Some(props.build()))?;
    writer.write(&batch)?;
    writer.close()?;
    summary.bytes = out.len() as u64;
    Ok((Bytes::from(out), summary))
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
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
    let metadata = ArrowReaderMetadata::load(&bytes, options)?;
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
                ValueKind::Str => FieldArray::Str(a.as_string::<i32>()),
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
        for (view, spec) in &fields {
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
            ts_ns: tss[row].saturating_mul(1000).saturating_add(rem_ns),
            ingest_ts_ns: ingests[row].saturating_mul(1000),
            fields: rec_fields,
        });
    }
    Ok(())
}
