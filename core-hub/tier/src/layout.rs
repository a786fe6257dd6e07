//! Object names in tier 2 and the manifest format.
//!
//! Names are deterministic (built from stream, segment and first offset) so that a re-upload
//! after a crash overwrites the same object and never adds a second copy that SQL engines would
//! count twice. Manifests and anything else the hub keeps live under `_tributary/`, outside
//! `streams/`, so a `streams/{stream}/**/*.parquet` glob only ever sees chunk files.

use chrono::{DateTime, Datelike, NaiveDate};
use serde::{Deserialize, Serialize};

use crate::chunk::ChunkSummary;
use crate::schema::ColumnSpec;

/// The manifest format version written by this crate.
pub const MANIFEST_VERSION: u32 = 1;

/// The UTC day of a nanosecond timestamp (the hub's ingest time of a chunk's first record).
/// Out-of-range timestamps clamp to the representable range instead of failing.
pub fn ingest_date(ingest_ts_ns: i64) -> NaiveDate {
    let secs = ingest_ts_ns.div_euclid(1_000_000_000);
    DateTime::from_timestamp(secs, 0)
        .map(|d| d.date_naive())
        .unwrap_or(if secs < 0 {
            NaiveDate::MIN
        } else {
            NaiveDate::MAX
        })
}

/// `streams/{stream}/`: the prefix SQL engines glob.
pub fn chunks_prefix(stream: &str) -> String {
    format!("streams/{stream}/")
}

/// `streams/{stream}/ingest_date=YYYY-MM-DD/seg-{segment:08}-{first_offset:020}.parquet`.
pub fn chunk_path(stream: &str, segment: u64, first_offset: u64, ingest_day: NaiveDate) -> String {
    format!(
        "streams/{stream}/ingest_date={:04}-{:02}-{:02}/seg-{segment:08}-{first_offset:020}.parquet",
        ingest_day.year(),
        ingest_day.month(),
        ingest_day.day()
    )
}

/// `_tributary/manifests/{stream}/`.
pub fn manifests_prefix(stream: &str) -> String {
    format!("_tributary/manifests/{stream}/")
}

/// `_tributary/manifests/{stream}/{first_offset:020}-seg-{segment:08}.json`: sorted by offset.
pub fn manifest_path(stream: &str, segment: u64, first_offset: u64) -> String {
    format!("_tributary/manifests/{stream}/{first_offset:020}-seg-{segment:08}.json")
}

/// What the hub commits for one uploaded chunk. Enough to rebuild the catalog from tier 2
/// alone (`core-hub recover --from-tier2`): the segment, the offset range, the per-device seq
/// ranges (in `summary`) and the stream's field columns at upload time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub stream: String,
    pub segment: u64,
    /// First stream offset of the chunk (inclusive).
    pub first_offset: u64,
    /// End stream offset of the chunk (exclusive), as fixed in the catalog before upload.
    pub end_offset: u64,
    /// The chunk object's path (see [`chunk_path`]).
    pub path: String,
    pub summary: ChunkSummary,
    /// The stream's field registry when the chunk was written.
    #[serde(default)]
    pub columns: Vec<ColumnSpec>,
    /// Hash range `[hash_lo, hash_hi)` of the segment (see the merged-streams design).
    #[serde(default)]
    pub hash_lo: i64,
    #[serde(default)]
    pub hash_hi: i64,
    /// First stream offset of the segment, and its predecessor segment ids.
    #[serde(default)]
    pub segment_start: u64,
    #[serde(default)]
    pub preds: Vec<u64>,
    /// Wall time of the commit, nanoseconds since the Unix epoch.
    pub committed_ns: i64,
    /// Anything else the hub wants back on recovery.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub extra: serde_json::Value,
}

impl Manifest {
    /// Where this manifest is stored.
    pub fn path(&self) -> String {
        manifest_path(&self.stream, self.segment, self.first_offset)
    }
}
