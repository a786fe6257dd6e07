//! `core-hub export STREAM --from T --to T --out FILE.parquet`: one Parquet file with the
//! records of a stream whose event time lies in `[from, to)`, read from tier 2.
//!
//! It reads the manifests (so it works next to a running hub, and on a tier 2 without any
//! hub), skips chunks whose event-time range misses the window, and writes the records in
//! offset order with the stream's newest column set.
//!
//! # Everything committed in the window
//!
//! An export holds every record committed in the window, tiered or not: [`export_committed`]
//! takes the records at and after tier 2's end (the largest manifest `end_offset`) from an
//! [`Untiered`] source, the running hub's API or its data directory (`core-hub export` picks),
//! and appends those in the window after the tiered ones, so the file stays in offset order
//! with no record twice. [`ExportReport::untiered_records`] counts them. The window is
//! half-open, `[from, to)`, as everywhere in Tributary (completeness, `read`).
//!
//! # Bounded memory
//!
//! The export streams: one plan range at a time (the chunks one upload wrote together, one
//! per segment, at most `[tier2] chunk_records_max` records) is fetched, checked, decoded,
//! filtered and sorted by offset, then written in batches of at most
//! [`ExportOptions::batch_records`] into one `ArrowWriter`, which flushes a row group every
//! [`ExportOptions::row_group_records`]. Memory is bounded by one plan range plus one row
//! group, whatever the window. [`ExportReport::max_buffered_records`] says how many records
//! were held at most (the tests assert on it).
//!
//! Every chunk object is compared with the size and crc32c its manifest recorded at upload;
//! a damaged or missing (quarantined) object fails the export with an error naming it (an
//! export is a file someone will trust: it must not silently lack rows). With
//! [`ExportOptions::skip_damaged`] such chunks are left out instead, each logged and counted
//! in [`ExportReport::skipped_chunks`] / [`ExportReport::skipped_records`]. The tier-2 scrub
//! quarantines and repairs damaged objects.
//!
//! The output is written to `FILE.parquet.tmp`, fsynced, renamed over `FILE.parquet`, and the
//! directory is fsynced: when `export` returns, the file survives a power loss; before that,
//! a crash leaves at most the `.tmp` file (the previous `FILE.parquet`, if any, is intact).

use super::TierOpenError;
use crate::config::HubConfig;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use thiserror::Error;
use tier::{EncodeOptions, FieldRegistry, Manifest, TierRecord};

/// Why an export failed.
#[derive(Debug, Error)]
pub enum ExportError {
    #[error(transparent)]
    Open(#[from] TierOpenError),
    #[error("tier 2: {0}")]
    Tier2(#[from] tier::TierError),
    #[error("stream `{0}` has no data in tier 2")]
    UnknownStream(String),
    #[error("no records of `{stream}` have an event time in the window")]
    Empty { stream: String },
    #[error("reading the records not yet tiered: {0}")]
    Untiered(String),
    #[error("tier-2 object {path} is damaged ({what}); not exported (see the tier-2 scrub)")]
    Damaged { path: String, what: String },
    #[error("encoding the export: {0}")]
    Encode(String),
    #[error("writing {path}: {source}")]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// What an export wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportReport {
    pub chunks_read: u64,
    pub records: u64,
    pub bytes: u64,
    /// The most records held in memory at once (one plan range after the window filter).
    pub max_buffered_records: u64,
    /// Damaged or missing chunk objects left out ([`ExportOptions::skip_damaged`]).
    pub skipped_chunks: u64,
    /// Rows those chunks held (per their manifests, whole chunks, window or not).
    pub skipped_records: u64,
    /// Records in the window committed but not yet in tier 2, taken from [`Untiered`].
    pub untiered_records: u64,
}

/// Committed records of a stream not yet in tier 2, read page by page in offset order.
#[async_trait::async_trait]
pub trait Untiered: Send {
    /// Records with hub offset `>= from`, in offset order, up to a page; empty once the
    /// records committed when the export started have all been returned.
    async fn page(&mut self, from: u64) -> Result<Vec<crate::read::ReadRecord>, String>;
}

/// No untiered source: tier 2 alone (`core-hub export --tier2-only`, and [`export_with`]).
#[derive(Debug, Default)]
pub struct TierTwoOnly;

#[async_trait::async_trait]
impl Untiered for TierTwoOnly {
    async fn page(&mut self, _: u64) -> Result<Vec<crate::read::ReadRecord>, String> {
        Ok(Vec::new())
    }
}

/// How an export writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// Records converted and handed to the Parquet writer at once.
    pub batch_records: usize,
    /// Rows per row group of the output file.
    pub row_group_records: usize,
    /// Leave damaged or missing chunk objects out (reported) instead of failing.
    pub skip_damaged: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            batch_records: 64 * 1024,
            row_group_records: tier::chunk::DEFAULT_ROW_GROUP_ROWS,
            skip_damaged: false,
        }
    }
}

/// Progress callbacks: `start(total_chunks)` once, then `chunk(records_so_far)` per chunk.
pub trait ExportProgress {
    fn start(&mut self, total_chunks: u64);
    fn chunk(&mut self, records: u64);
}

/// No progress output.
#[derive(Debug, Default)]
pub struct NoProgress;

impl ExportProgress for NoProgress {
    fn start(&mut self, _: u64) {}
    fn chunk(&mut self, _: u64) {}
}

/// Exports the records of `stream` with `from_ns <= ts < to_ns` to `out` (Parquet, the same
/// columns and types as the tier-2 chunk files), with the default [`ExportOptions`].
pub async fn export(
    cfg: &HubConfig,
    stream: &str,
    from_ns: i64,
    to_ns: i64,
    out: &Path,
    progress: &mut dyn ExportProgress,
) -> Result<ExportReport, ExportError> {
    export_with(
        cfg,
        stream,
        from_ns,
        to_ns,
        out,
        progress,
        &ExportOptions::default(),
    )
    .await
}

/// The recorded size and crc32c of a chunk object, from its manifest (absent in manifests
/// written before objects had checks).
fn manifest_check(m: &Manifest) -> Option<super::store::ObjectCheck> {
    let crc = m.extra.get("crc32c")?.as_u64()?;
    Some(super::store::ObjectCheck {
        bytes: m.summary.bytes,
        crc32c: u32::try_from(crc).ok()?,
    })
}

/// The output file being written: a temporary file renamed over `out` at the end.
struct Sink {
    writer: Option<ArrowWriter<std::io::BufWriter<std::fs::File>>>,
    file: Option<std::fs::File>,
    /// Finished when the writer is created: the key bloom filter is sized from the first
    /// plan range's distinct keys (the default size, for a million keys, would outweigh the
    /// data of a row group).
    props: Option<parquet::file::properties::WriterPropertiesBuilder>,
    tmp: std::path::PathBuf,
}

impl Sink {
    /// Writes `records` (in offset order) through a small Parquet encoding of the stream's
    /// columns, so that the output has exactly the chunk files' column types.
    fn write(
        &mut self,
        records: &[TierRecord],
        registry: &FieldRegistry,
        opts: &ExportOptions,
    ) -> Result<(), ExportError> {
        let enc = |e: String| ExportError::Encode(e);
        let mini = EncodeOptions {
            zstd_level: 1,
            key_bloom_filter: false,
            row_group_rows: opts.batch_records.max(1),
            ..EncodeOptions::default()
        };
        for slice in records.chunks(opts.batch_records.max(1)) {
            let (bytes, _) =
                tier::encode_chunk(slice, registry, &mini).map_err(|e| enc(e.to_string()))?;
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
                .map_err(|e| enc(e.to_string()))?
                .with_batch_size(opts.batch_records.max(1));
            if self.writer.is_none() {
                let file = self
                    .file
                    .take()
                    .ok_or_else(|| enc("no output file".into()))?;
                let keys: std::collections::HashSet<&str> =
                    records.iter().map(|r| r.key.as_str()).collect();
                let ndv = (keys.len() * 2).clamp(1, opts.row_group_records.max(1)) as u64;
                let props = self.props.take().map(|p| {
                    p.set_column_bloom_filter_max_ndv(ColumnPath::from("key"), ndv)
                        .build()
                });
                let w = ArrowWriter::try_new(
                    std::io::BufWriter::new(file),
                    reader.schema().clone(),
                    props,
                )
                .map_err(|e| enc(e.to_string()))?;
                self.writer = Some(w);
            }
            let w = self.writer.as_mut().expect("writer created above");
            for batch in reader.build().map_err(|e| enc(e.to_string()))? {
                let batch = batch.map_err(|e| enc(e.to_string()))?;
                w.write(&batch).map_err(|e| enc(e.to_string()))?;
            }
        }
        Ok(())
    }
}

/// [`export`] with explicit [`ExportOptions`], from tier 2 alone.
pub async fn export_with(
    cfg: &HubConfig,
    stream: &str,
    from_ns: i64,
    to_ns: i64,
    out: &Path,
    progress: &mut dyn ExportProgress,
    opts: &ExportOptions,
) -> Result<ExportReport, ExportError> {
    let window = Window { from_ns, to_ns };
    export_committed(cfg, stream, window, out, progress, opts, &mut TierTwoOnly).await
}

/// Event times `[from_ns, to_ns)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub from_ns: i64,
    pub to_ns: i64,
}

impl Window {
    fn holds(&self, ts: i64) -> bool {
        ts >= self.from_ns && ts < self.to_ns
    }
}

/// Exports every committed record of `stream` in `window`: tier 2, then what `untiered`
/// returns from tier 2's end on.
pub async fn export_committed(
    cfg: &HubConfig,
    stream: &str,
    window: Window,
    out: &Path,
    progress: &mut dyn ExportProgress,
    opts: &ExportOptions,
    untiered: &mut dyn Untiered,
) -> Result<ExportReport, ExportError> {
    let Window { from_ns, to_ns } = window;
    let t2 = super::open_store(&cfg.tier2)?;
    let manifests = t2
        .list_manifests(stream)
        .await
        .map_err(tier::TierError::from)?;
    let tiered_end = manifests.iter().map(|m| m.end_offset).max().unwrap_or(0);
    // The first untiered page tells an unknown stream from one not yet tiered.
    let first_untiered = untiered
        .page(tiered_end)
        .await
        .map_err(ExportError::Untiered)?;
    if manifests.is_empty() && first_untiered.is_empty() {
        return Err(ExportError::UnknownStream(stream.to_string()));
    }
    // The registry only grows: the longest column list is the stream's newest, and a
    // superset of every file's.
    let columns = manifests
        .iter()
        .max_by_key(|m| m.columns.len())
        .map(|m| m.columns.clone())
        .unwrap_or_default();
    let mut registry = FieldRegistry::from_columns(columns).map_err(tier::TierError::from)?;
    // The file's schema is fixed before the first row: it holds the fields of the first
    // untiered page too (a later page with a new field fails the export, see below).
    let first_untiered: Vec<TierRecord> = first_untiered.into_iter().map(to_tier_record).collect();
    registry.observe_records(&first_untiered);
    let columns = registry.columns().to_vec();
    // One plan range = the chunks one upload wrote (one per segment, overlapping offsets).
    let mut ranges: BTreeMap<u64, Vec<Manifest>> = BTreeMap::new();
    let mut total = 0u64;
    for m in manifests
        .into_iter()
        .filter(|m| m.summary.max_ts_ns >= from_ns && m.summary.min_ts_ns < to_ns)
    {
        let range = m
            .extra
            .get("range_first")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(m.first_offset);
        ranges.entry(range).or_default().push(m);
        total += 1;
    }
    progress.start(total);

    let tmp = out.with_extension("parquet.tmp");
    let write_err = |path: &Path, source| ExportError::Write {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(&tmp).map_err(|e| write_err(&tmp, e))?;
    let columns_json = serde_json::to_string(&columns)
        .map_err(|e| ExportError::Encode(format!("column specs: {e}")))?;
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(3).map_err(|e| ExportError::Encode(e.to_string()))?,
        ))
        .set_max_row_group_row_count(Some(opts.row_group_records.max(1)))
        .set_statistics_enabled(EnabledStatistics::Page)
        // High-cardinality columns (counters, ids) fall back to plain encoding early instead
        // of carrying a dictionary as large as the data.
        .set_dictionary_page_size_limit(128 << 10)
        .set_column_bloom_filter_enabled(ColumnPath::from("key"), true)
        .set_column_bloom_filter_fpp(ColumnPath::from("key"), 0.01);
    // As in the chunk files (`tier::encode_chunk`): near-sequential integer columns are
    // delta-encoded, which beats dictionaries by far there.
    for col in ["hub_offset", "seq", "ts", "ingest_ts"] {
        props = props
            .set_column_dictionary_enabled(ColumnPath::from(col), false)
            .set_column_encoding(
                ColumnPath::from(col),
                parquet::basic::Encoding::DELTA_BINARY_PACKED,
            );
    }
    let props = props.set_key_value_metadata(Some(vec![
        KeyValue::new(
            tier::chunk::META_FORMAT.to_owned(),
            tier::chunk::FORMAT_VERSION.to_string(),
        ),
        KeyValue::new(tier::chunk::META_COLUMNS.to_owned(), columns_json),
        KeyValue::new("tributary.stream".to_owned(), stream.to_owned()),
    ]));
    let mut sink = Sink {
        writer: None,
        file: Some(file),
        props: Some(props),
        tmp: tmp.clone(),
    };
    let result = stream_ranges(
        &t2, &ranges, from_ns, to_ns, &registry, opts, &mut sink, progress,
    )
    .await;
    let result = match result {
        Ok(r) => {
            let tail = Tail {
                window,
                tiered_end,
                first: first_untiered,
            };
            write_untiered(r, tail, untiered, &registry, opts, &mut sink).await
        }
        Err(e) => Err(e),
    };
    let mut report = match result {
        Ok(r) => r,
        Err(e) => {
            drop(sink.writer.take());
            let _ = std::fs::remove_file(&sink.tmp);
            return Err(e);
        }
    };
    let Some(writer) = sink.writer.take() else {
        let _ = std::fs::remove_file(&tmp);
        return Err(ExportError::Empty {
            stream: stream.to_string(),
        });
    };
    let mut buf = writer
        .into_inner()
        .map_err(|e| ExportError::Encode(e.to_string()))?;
    buf.flush().map_err(|e| write_err(&tmp, e))?;
    let file = buf
        .into_inner()
        .map_err(|e| write_err(&tmp, e.into_error()))?;
    file.sync_all().map_err(|e| write_err(&tmp, e))?;
    report.bytes = file.metadata().map_err(|e| write_err(&tmp, e))?.len();
    drop(file);
    std::fs::rename(&tmp, out).map_err(|e| write_err(out, e))?;
    // The rename is durable only once the directory holding `out` is synced.
    sync_dir_of(out).map_err(|e| write_err(out, e))?;
    Ok(report)
}

/// Where the untiered records start, and their first page.
struct Tail {
    window: Window,
    tiered_end: u64,
    first: Vec<TierRecord>,
}

/// Appends the untiered records in the window after the tiered ones, page by page.
async fn write_untiered(
    mut report: ExportReport,
    tail: Tail,
    untiered: &mut dyn Untiered,
    registry: &FieldRegistry,
    opts: &ExportOptions,
    sink: &mut Sink,
) -> Result<ExportReport, ExportError> {
    let mut page = tail.first;
    let mut from = tail.tiered_end;
    while let Some(last) = page.last() {
        assert!(
            page.windows(2).all(|w| w[0].offset < w[1].offset) && page[0].offset >= from,
            "untiered pages come in offset order from where the previous one ended"
        );
        from = last.offset + 1;
        let records: Vec<TierRecord> = page
            .into_iter()
            .filter(|r| tail.window.holds(r.ts_ns))
            .collect();
        // The first page's fields are in the file's schema already.
        if registry.clone().observe_records(&records) {
            return Err(ExportError::Encode(
                "the stream gained a field while the export ran; run the export again".into(),
            ));
        }
        if !records.is_empty() {
            sink.write(&records, registry, opts)?;
            report.records += records.len() as u64;
            report.untiered_records += records.len() as u64;
        }
        page = untiered
            .page(from)
            .await
            .map_err(ExportError::Untiered)?
            .into_iter()
            .map(to_tier_record)
            .collect();
    }
    Ok(report)
}

fn to_tier_record(r: crate::read::ReadRecord) -> TierRecord {
    TierRecord {
        tags: r.tags,
        device: r.device,
        epoch: r.epoch,
        seq: r.seq,
        offset: r.offset,
        key: r.key,
        ts_ns: r.ts,
        ingest_ts_ns: r.ingest_ts,
        fields: r.fields,
    }
}

/// Fsyncs the directory holding `path` (the current directory for a bare file name).
fn sync_dir_of(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

/// Reads and decodes one chunk object, checked against its manifest.
async fn fetch_checked(t2: &tier::Tier2, m: &Manifest) -> Result<Vec<TierRecord>, ExportError> {
    let damaged = |what: String| ExportError::Damaged {
        path: m.path.clone(),
        what,
    };
    let bytes = match t2.get(&m.path).await {
        Ok(b) => b,
        Err(tier::GetError::NotFound { .. }) => {
            return Err(damaged(
                "object missing (quarantined by the tier-2 scrub?)".into(),
            ));
        }
        Err(e) => return Err(tier::TierError::from(e).into()),
    };
    if let Some(what) = manifest_check(m).and_then(|c| c.mismatch(&bytes)) {
        return Err(damaged(what));
    }
    tokio::task::spawn_blocking(move || tier::decode_chunk(bytes))
        .await
        .map_err(|e| ExportError::Encode(format!("decoder task: {e}")))?
        .map_err(|e| damaged(format!("does not decode: {e}")))
}

/// The streaming loop of [`export_with`]: one plan range at a time.
#[allow(clippy::too_many_arguments)]
async fn stream_ranges(
    t2: &tier::Tier2,
    ranges: &BTreeMap<u64, Vec<Manifest>>,
    from_ns: i64,
    to_ns: i64,
    registry: &FieldRegistry,
    opts: &ExportOptions,
    sink: &mut Sink,
    progress: &mut dyn ExportProgress,
) -> Result<ExportReport, ExportError> {
    let mut report = ExportReport::default();
    for chunks in ranges.values() {
        let mut records: Vec<TierRecord> = Vec::new();
        for m in chunks {
            let decoded = match fetch_checked(t2, m).await {
                Ok(d) => d,
                Err(ExportError::Damaged { path, what }) if opts.skip_damaged => {
                    tracing::warn!(%path, %what, "export: leaving a damaged chunk object out");
                    report.skipped_chunks += 1;
                    report.skipped_records += m.summary.rows;
                    report.chunks_read += 1;
                    progress.chunk(report.records + records.len() as u64);
                    continue;
                }
                Err(e) => return Err(e),
            };
            records.extend(
                decoded
                    .into_iter()
                    .filter(|r| r.ts_ns >= from_ns && r.ts_ns < to_ns),
            );
            report.chunks_read += 1;
            progress.chunk(report.records + records.len() as u64);
        }
        report.max_buffered_records = report.max_buffered_records.max(records.len() as u64);
        if records.is_empty() {
            continue;
        }
        records.sort_by_key(|r| r.offset);
        let mut reg = registry.clone();
        if reg.observe_records(&records) {
            // The newest manifest's registry holds every column; a record outside it means
            // the manifests disagree with the files.
            return Err(ExportError::Encode(
                "a chunk file has a field no manifest lists".into(),
            ));
        }
        sink.write(&records, registry, opts)?;
        report.records += records.len() as u64;
    }
    Ok(report)
}
