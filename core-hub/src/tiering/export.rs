//! `core-hub export STREAM --from T --to T --out FILE.parquet`: one Parquet file with the
//! records of a stream whose event time lies in `[from, to)`, read from tier 2.
//!
//! It reads the manifests (so it works next to a running hub, and on a tier 2 without any
//! hub), skips chunks whose event-time range misses the window, and writes the records in
//! offset order with the stream's newest column set. Data not yet tiered is not included.

use super::TierOpenError;
use crate::config::HubConfig;
use std::path::Path;
use thiserror::Error;
use tier::{EncodeOptions, FieldRegistry, TierRecord};

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
/// columns and types as the tier-2 chunk files).
pub async fn export(
    cfg: &HubConfig,
    stream: &str,
    from_ns: i64,
    to_ns: i64,
    out: &Path,
    progress: &mut dyn ExportProgress,
) -> Result<ExportReport, ExportError> {
    let t2 = super::open_store(&cfg.tier2)?;
    let manifests = t2
        .list_manifests(stream)
        .await
        .map_err(tier::TierError::from)?;
    if manifests.is_empty() {
        return Err(ExportError::UnknownStream(stream.to_string()));
    }
    let columns = manifests
        .iter()
        .max_by_key(|m| m.columns.len())
        .map(|m| m.columns.clone())
        .unwrap_or_default();
    let mut registry = FieldRegistry::from_columns(columns).map_err(tier::TierError::from)?;
    let wanted: Vec<_> = manifests
        .into_iter()
        .filter(|m| m.summary.max_ts_ns >= from_ns && m.summary.min_ts_ns < to_ns)
        .collect();
    progress.start(wanted.len() as u64);
    let mut report = ExportReport::default();
    let mut records: Vec<TierRecord> = Vec::new();
    for m in &wanted {
        let chunk = t2
            .read_chunk(&m.path)
            .await
            .map_err(tier::TierError::from)?;
        records.extend(
            chunk
                .into_iter()
                .filter(|r| r.ts_ns >= from_ns && r.ts_ns < to_ns),
        );
        report.chunks_read += 1;
        progress.chunk(records.len() as u64);
    }
    if records.is_empty() {
        return Err(ExportError::Empty {
            stream: stream.to_string(),
        });
    }
    records.sort_by_key(|r| r.offset);
    registry.observe_records(&records);
    let mut opts = EncodeOptions::default();
    opts.metadata
        .push(("tributary.stream".into(), stream.to_string()));
    let (bytes, summary) =
        tier::encode_chunk(&records, &registry, &opts).map_err(tier::TierError::from)?;
    let tmp = out.with_extension("parquet.tmp");
    let write = |path: &Path, source| ExportError::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, &bytes).map_err(|e| write(&tmp, e))?;
    std::fs::rename(&tmp, out).map_err(|e| write(out, e))?;
    report.records = summary.rows;
    report.bytes = bytes.len() as u64;
    Ok(report)
}
