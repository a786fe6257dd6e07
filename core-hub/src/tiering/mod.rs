//! Tiering: sealed hub chunks go to tier 2 (Parquet on object storage), exactly once as SQL
//! engines see it; tier 1 (the WAL) is evicted only behind them; agents learn `tiered_seq`.
//!
//! One uploader task runs [`Tiering::run_once`] in a loop. A round:
//!
//! 1. **Plan.** For every stream, the committed blocks after `planned_end` are cut into plan
//!    ranges of whole blocks (`[tier2] chunk_records_max` / `chunk_bytes_max`, or everything
//!    once the oldest is `chunk_age_max` old). Each range yields one chunk per segment that
//!    overlaps it ([`segments_overlapping`]); the chunk rows (state `planned`) and the new
//!    `planned_end` are committed in one catalog transaction BEFORE anything is uploaded.
//! 2. **Upload.** For each planned range, in offset order: read its blocks from the WAL, build
//!    [`tier::TierRecord`]s, extend the stream's field registry, encode each chunk, put it to
//!    its deterministic name ([`tier::chunk_path`]), verify it ([`tier::Tier2::upload_chunk`]:
//!    MD5 against the store's ETag, or size + footer + offsets), then
//!    write the manifests under `_tributary/`, then commit the chunk rows, registry,
//!    `tiered_end` and the lanes' `tiered_seq` in one catalog transaction. A crash anywhere
//!    before that transaction re-runs the range: the same records to the same names, so the
//!    object is overwritten, never duplicated.
//! 3. **Evict.** WAL files (oldest first, never the active one) whose blocks all lie below
//!    their stream's `tiered_end` are deleted once older than `tier1_retention_time` or while
//!    tier 1 holds more than `tier1_retention_bytes`. The catalog records the new
//!    `evicted_end` per stream first, so readers switch to tier 2 before the file goes.
//! 4. **Tier-2 retention.** Whole plan ranges older than `tier2_retention_time`, or beyond
//!    `tier2_retention_bytes` per stream, are deleted (object, manifest, rows).
//!
//! When tier 2 fails, rounds fail and are retried; ingest continues until tier 1 holds
//! `tier1_budget_bytes`, then the hub's admission gate refuses new blocks with the retryable
//! `unavailable` error (agents back off and resend; nothing is dropped) until uploads and
//! eviction bring tier 1 back under budget.

pub mod export;
pub mod faults;
pub mod lake;
pub mod read;
pub mod recover;
pub mod store;

use crate::catalog::{BlockRow, CatalogError, StreamId};
use crate::config::{HubConfig, TableFormat, Tier2Config};
use crate::ingest::Hub;
use crate::wal::{KIND_BLOCK, WalReadError};
pub use faults::{TierFaultHook, TierFaultPoint};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use store::{COMMITTED, ChunkRow, PLANNED, RangeCommit};
use thiserror::Error;
use tier::{EncodeOptions, FieldRegistry, Manifest, Tier2, TierRecord};
use tokio::sync::watch;

/// One plan range read from tier 1 and encoded, ready to upload.
struct BuiltRange {
    /// The stream's fields after this range's records were observed.
    registry: FieldRegistry,
    /// Per chunk row: its Parquet bytes and summary, or `None` for a chunk without records.
    encoded: Vec<Option<(bytes::Bytes, tier::ChunkSummary)>>,
}

type BuildTask = tokio::task::JoinHandle<Result<BuiltRange, TierRunError>>;

/// A range whose chunks and manifests are durably in tier 2, not committed yet.
struct StagedRange {
    commit: RangeCommit,
    lake: tier::table::LakeRange,
    /// The stream's fields after the range.
    registry: FieldRegistry,
    records: u64,
}

/// Most ranges one Iceberg snapshot appends; a round with more commits several.
const RANGES_PER_SNAPSHOT_MAX: usize = 256;

/// Logs how this range changed the stream's field columns (docs/format/parquet.md): a
/// widened number column at INFO, a field arriving with a new kind (its values then land in a
/// column of their own, `{field}__{type}`) at WARN, counted in `field_kind_changes`.
fn report_column_changes(
    stream: &str,
    before: &FieldRegistry,
    after: &FieldRegistry,
    stats: &TierStats,
) {
    for change in after.changes_since(before) {
        match change {
            tier::ColumnChange::Widened { field, column } => tracing::info!(
                stream,
                field,
                column,
                "tier 2: number column widened from INT64 to DOUBLE; files already written keep INT64"
            ),
            tier::ColumnChange::NewKind {
                field,
                column,
                kind,
                existing,
            } => {
                stats.field_kind_changes.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    stream,
                    field,
                    column,
                    kind = kind.suffix(),
                    existing = ?existing,
                    "tier 2: field arrived with a new kind; its values of that kind go to a column of their own"
                );
            }
        }
    }
}

/// Blocks fetched from the index per query while planning or reading a chunk.
const INDEX_PAGE_BLOCKS: usize = 1024;

/// The full hash space `[0, 2^32)` of the initial segment.
pub const HASH_SPACE_END: u64 = 1 << 32;

/// Why tiering could not start.
#[derive(Debug, Error)]
pub enum TierOpenError {
    #[error("tier 2: {0}")]
    Store(#[from] tier::OpenError),
    #[error(transparent)]
    Config(#[from] StoreConfigError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("tier 1: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Lake(#[from] tier::table::LakeError),
    #[error("bringing the Iceberg table of `{stream}` up to tier 2's manifests: {source}")]
    Reconcile {
        stream: String,
        #[source]
        source: Box<tier::TierError>,
    },
    #[error("creating tier-2 directory {}: {source}", path.display())]
    LocalRoot {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Why a tiering round stopped (it is retried on the next round).
#[derive(Debug, Error)]
pub enum TierRunError {
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("tier 1: {0}")]
    Wal(#[from] WalReadError),
    #[error("tier 1 block at offset {offset} of stream {stream}: {what}")]
    Block {
        stream: StreamId,
        offset: u64,
        what: String,
    },
    #[error("tier 2: {0}")]
    Tier2(#[from] tier::TierError),
    #[error("tier 2 did not answer within {0:?}")]
    Timeout(Duration),
    #[error("fault injected at {0:?}")]
    Fault(TierFaultPoint),
    #[error("tier 1 eviction: {0}")]
    Io(#[from] std::io::Error),
    #[error("internal: {0}")]
    Internal(String),
}

/// A segment as tiering sees it: an id, a hash range and a stream-offset range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSpan {
    pub id: u64,
    pub hash_lo: u64,
    pub hash_hi: u64,
    pub start: u64,
    pub end: Option<u64>,
}

impl SegmentSpan {
    /// The initial segment: every key, every offset.
    pub const WHOLE: SegmentSpan = SegmentSpan {
        id: 0,
        hash_lo: 0,
        hash_hi: HASH_SPACE_END,
        start: 0,
        end: None,
    };

    fn covers_all_keys(&self) -> bool {
        self.hash_lo == 0 && self.hash_hi >= HASH_SPACE_END
    }

    /// Whether a record with `key` belongs to this segment's hash range.
    pub fn holds_key(&self, key: &str) -> bool {
        if self.covers_all_keys() {
            return true;
        }
        let p = u64::from(crate::streams::hash::key_point(key));
        self.hash_lo <= p && p < self.hash_hi
    }
}

/// The segments of `stream` overlapping the offset range `[first, end)`, clipped to it.
///
/// This is the one place that knows the segment model: the stream manager's graph snapshot
/// (merged streams). A stream the manager does not know is the single segment 0.
pub fn segments_overlapping(
    hub: &Hub,
    stream: StreamId,
    first: u64,
    end: u64,
) -> Result<Vec<SegmentSpan>, CatalogError> {
    let spans: Vec<SegmentSpan> = match hub.streams().snapshot(stream) {
        Ok(snap) => snap
            .graph
            .segments()
            .iter()
            .map(|s| SegmentSpan {
                id: u64::from(s.id),
                hash_lo: s.lo,
                hash_hi: s.hi,
                start: s.start,
                end: s.end,
            })
            .collect(),
        Err(_) => vec![SegmentSpan::WHOLE],
    };
    Ok(spans
        .into_iter()
        .filter_map(|s| {
            let lo = first.max(s.start);
            let hi = s.end.map_or(end, |e| e.min(end));
            (lo < hi).then_some(SegmentSpan {
                start: lo,
                end: Some(hi),
                ..s
            })
        })
        .collect())
}

/// The readable end of `stream` (records below it are committed and routed to segments);
/// tiering never plans past it.
fn readable_end(hub: &Hub, stream: StreamId, committed: u64) -> u64 {
    hub.streams()
        .snapshot(stream)
        .map_or(committed, |snap| snap.end.min(committed))
}

/// Counters for `/metrics`, the tests and the benchmarks.
#[derive(Debug, Default)]
pub struct TierStats {
    pub rounds: AtomicU64,
    pub round_errors: AtomicU64,
    pub chunks_committed: AtomicU64,
    pub records_tiered: AtomicU64,
    pub bytes_uploaded: AtomicU64,
    pub wal_files_evicted: AtomicU64,
    pub wal_bytes_evicted: AtomicU64,
    pub tier2_chunks_deleted: AtomicU64,
    /// Set while the last round failed talking to tier 2.
    pub tier2_down: AtomicBool,
    /// Set while the admission gate refuses blocks.
    pub pushing_back: AtomicBool,
    /// Blocks refused by the admission gate.
    pub pushbacks: AtomicU64,
    /// Fields that arrived with a new kind (a string after numbers, ...) and got a column of
    /// their own (`{field}__{type}`, docs/format/parquet.md).
    pub field_kind_changes: AtomicU64,
    /// Iceberg snapshots that appended tiering ranges.
    pub lake_commits: AtomicU64,
    /// Tiering ranges a restart found already in the table (nothing appended again).
    pub lake_ranges_already_committed: AtomicU64,
    /// Data files removed from Iceberg tables by tier-2 retention (`delete` snapshots).
    pub lake_files_deleted: AtomicU64,
    /// Iceberg snapshots expired by table maintenance.
    pub lake_snapshots_expired: AtomicU64,
    /// Objects under a table's location removed as orphans.
    pub lake_orphans_removed: AtomicU64,
    /// Table maintenance runs of a table that failed (retried at the next interval).
    pub lake_maintenance_errors: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundReport {
    pub ranges_planned: u64,
    pub chunks_committed: u64,
    pub records_tiered: u64,
    pub wal_files_evicted: u64,
    pub tier2_chunks_deleted: u64,
}

/// The tiering service of one hub.
pub struct Tiering {
    hub: Arc<Hub>,
    store: Tier2,
    cfg: Tier2Config,
    faults: Option<TierFaultHook>,
    /// First logical offset of the oldest WAL file kept.
    floor: Arc<AtomicU64>,
    stats: Arc<TierStats>,
    /// Bumped whenever some lane's `tiered_seq` moved (the QUIC server can push acks on it).
    tiered_tx: watch::Sender<u64>,
    /// Serializes rounds (the loop, tests and `flush` may call `run_once`).
    round: tokio::sync::Mutex<()>,
    encode: EncodeOptions,
    /// The streams' Iceberg tables, when `[tier2] table = "iceberg"`.
    lake: Option<tier::table::Lake>,
    /// When the tables' upkeep last ran ([`lake`]).
    lake_maintained: Mutex<Option<std::time::Instant>>,
}

impl std::fmt::Debug for Tiering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiering")
            .field("url", &self.cfg.url)
            .finish_non_exhaustive()
    }
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// Why `[tier2]` cannot be turned into a store location.
#[derive(Debug, Error)]
pub enum StoreConfigError {
    #[error("tier2.url `{0}`: give the bucket only (s3://bucket); key prefixes are not supported")]
    Prefix(String),
    #[error("tier2.url `{0}` is neither file:///path nor s3://bucket")]
    Url(String),
}

/// The library's store location from the hub's `[tier2]`: `file:///dir` is a local
/// directory, `s3://bucket` an S3 bucket (path-style; endpoint, region and credentials from
/// the config or the `AWS_*` environment).
pub fn store_config(cfg: &Tier2Config) -> Result<tier::TierConfig, StoreConfigError> {
    if let Some(path) = cfg.url.strip_prefix("file://") {
        return Ok(tier::TierConfig::Local {
            root: std::path::PathBuf::from(path),
        });
    }
    let Some(rest) = cfg.url.strip_prefix("s3://") else {
        return Err(StoreConfigError::Url(cfg.url.clone()));
    };
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if !prefix.trim_matches('/').is_empty() {
        return Err(StoreConfigError::Prefix(cfg.url.clone()));
    }
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let endpoint = cfg
        .endpoint
        .clone()
        .or_else(|| env("AWS_ENDPOINT_URL"))
        .unwrap_or_else(|| {
            let region = cfg.region.clone().or_else(|| env("AWS_REGION"));
            format!(
                "https://s3.{}.amazonaws.com",
                region.as_deref().unwrap_or("us-east-1")
            )
        });
    Ok(tier::TierConfig::S3 {
        allow_http: endpoint.starts_with("http://"),
        endpoint,
        region: cfg
            .region
            .clone()
            .or_else(|| env("AWS_REGION"))
            .unwrap_or_else(|| "us-east-1".into()),
        bucket: bucket.to_string(),
        access_key_id: cfg.access_key_id.clone(),
        secret_access_key: cfg.secret_access_key.clone(),
    })
}

/// Opens the tier-2 store described by `[tier2]`, a local directory on the real file system.
pub fn open_store(cfg: &Tier2Config) -> Result<Tier2, TierOpenError> {
    open_store_on(cfg, crate::storage::RealStorage::shared())
}

/// As [`open_store`], with a local directory on `storage` ([`crate::storage::StorageStore`]:
/// every put and delete synced through the hub's storage trait, like tier 1).
pub fn open_store_on(
    cfg: &Tier2Config,
    storage: Arc<dyn crate::storage::Storage>,
) -> Result<Tier2, TierOpenError> {
    match store_config(cfg)? {
        tier::TierConfig::Local { root } => {
            let local = crate::storage::StorageStore::open(storage, &root).map_err(|source| {
                TierOpenError::LocalRoot {
                    path: root.clone(),
                    source,
                }
            })?;
            let t2 = Tier2::from_store(Arc::new(local.clone()), root.display().to_string())
                .with_local_root(root);
            #[cfg(feature = "fault-injection")]
            let t2 = t2.with_sync_probe(local.probe().clone());
            Ok(t2)
        }
        s3 => Ok(Tier2::open(&s3)?),
    }
}

impl Tiering {
    /// Opens tiering for `hub`: creates its catalog tables, opens the store, finishes any
    /// eviction a crash interrupted, and installs the admission gate (tier-1 budget).
    pub async fn open(
        hub: Arc<Hub>,
        cfg: &HubConfig,
        faults: Option<TierFaultHook>,
    ) -> Result<Arc<Tiering>, TierOpenError> {
        store::init(hub.catalog())?;
        let store = open_store_on(&cfg.tier2, hub.storage().clone())?;
        let recorded = store::tier1_floor(hub.catalog())?;
        let files = hub.wal_reader().files()?;
        // Files below the recorded floor were evicted in the catalog; a crash kept them.
        for &f in files.iter().filter(|&&f| f < recorded) {
            hub.wal_reader().evict(f)?;
        }
        let floor = files
            .iter()
            .copied()
            .find(|&f| f >= recorded)
            .unwrap_or(recorded);
        let lake = match cfg.tier2.table {
            TableFormat::Parquet => None,
            TableFormat::Iceberg => Some(
                tier::table::Lake::open(
                    &store,
                    cfg.tier2.url.trim_end_matches('/'),
                    &cfg.tier2.iceberg_catalog,
                )
                .await?,
            ),
        };
        let (tiered_tx, _) = watch::channel(0);
        let t = Arc::new(Tiering {
            hub,
            store,
            cfg: cfg.tier2.clone(),
            faults,
            floor: Arc::new(AtomicU64::new(floor)),
            stats: Arc::new(TierStats::default()),
            tiered_tx,
            round: tokio::sync::Mutex::new(()),
            encode: EncodeOptions::default(),
            lake,
            lake_maintained: Mutex::new(None),
        });
        t.reconcile_lake().await?;
        t.install_gate();
        // Readers of the hub read evicted offsets through tier 2 (`crate::read::scan`).
        t.hub.streams().set_tiering(&t);
        Ok(t)
    }

    fn install_gate(&self) {
        let wal = self.hub.wal_stats().clone();
        let floor = self.floor.clone();
        let stats = self.stats.clone();
        let budget = self.cfg.tier1_budget_bytes;
        let gate: crate::ingest::AdmissionGate = Arc::new(move || {
            let held = wal
                .committed_end
                .load(Ordering::Relaxed)
                .saturating_sub(floor.load(Ordering::Relaxed));
            let over = held >= budget;
            stats.pushing_back.store(over, Ordering::Relaxed);
            if !over {
                return None;
            }
            stats.pushbacks.fetch_add(1, Ordering::Relaxed);
            Some(format!(
                "tier 1 holds {held} bytes, its budget is {budget}; waiting for tier 2"
            ))
        });
        self.hub.set_admission_gate(Some(gate));
    }

    /// Mutation switch of the tests: off, a range the Iceberg table already holds is appended
    /// again on a re-run.
    #[cfg(feature = "fault-injection")]
    pub fn set_table_recheck(&self, on: bool) {
        if let Some(lake) = &self.lake {
            lake.set_recheck(on);
        }
    }

    /// The hub this tiering serves.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The tier-2 store.
    /// The streams' Iceberg tables (`[tier2] table = "iceberg"`).
    pub fn lake(&self) -> Option<&tier::table::Lake> {
        self.lake.as_ref()
    }

    /// The tier-2 store.
    pub fn store(&self) -> &Tier2 {
        &self.store
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<TierStats> {
        &self.stats
    }

    /// The `[tier2]` settings.
    pub fn config(&self) -> &Tier2Config {
        &self.cfg
    }

    /// Bytes of committed frames tier 1 holds (WAL files not yet evicted).
    pub fn tier1_bytes(&self) -> u64 {
        self.hub
            .wal_stats()
            .committed_end
            .load(Ordering::Relaxed)
            .saturating_sub(self.floor.load(Ordering::Relaxed))
    }

    /// A receiver that changes whenever some lane's `tiered_seq` moved.
    pub fn subscribe_tiered(&self) -> watch::Receiver<u64> {
        self.tiered_tx.subscribe()
    }

    /// Holds off upload rounds (and with them eviction and retention) while the tier-2 scrub
    /// quarantines or repairs a chunk object (`crate::scrub`).
    pub(crate) async fn lock_rounds(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.round.lock().await
    }

    /// Runs one tier-2 request within `request_timeout`.
    async fn bounded<T, E: Into<tier::TierError>>(
        &self,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, TierRunError> {
        let limit = self.cfg.request_timeout;
        match tokio::time::timeout(limit, f).await {
            Ok(r) => r.map_err(|e| TierRunError::Tier2(e.into())),
            Err(_) => Err(TierRunError::Timeout(limit)),
        }
    }

    fn fault(&self, p: TierFaultPoint) -> Result<(), TierRunError> {
        match &self.faults {
            Some(f) if f(p) => Err(TierRunError::Fault(p)),
            _ => Ok(()),
        }
    }

    /// Runs the uploader until `stop` turns true. Errors are logged and retried with backoff.
    pub fn spawn(self: &Arc<Self>, mut stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        let t = self.clone();
        tokio::spawn(async move {
            let mut backoff = t.cfg.poll_interval;
            loop {
                let wait = match t.run_once(false).await {
                    // Iceberg tables: at most one committing round per `commit_interval`,
                    // so each table sees at most one snapshot per interval.
                    Ok(r) if r.chunks_committed > 0 && t.lake.is_some() => {
                        backoff = t.cfg.poll_interval;
                        t.cfg.lake.commit_interval
                    }
                    Ok(r) if r.chunks_committed > 0 || r.ranges_planned > 0 => {
                        backoff = t.cfg.poll_interval;
                        Duration::ZERO
                    }
                    Ok(_) => {
                        backoff = t.cfg.poll_interval;
                        t.cfg.poll_interval
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?backoff, "tiering round failed");
                        let w = backoff;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                        w
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        })
    }

    /// One round: plan, upload, evict, tier-2 retention. `seal_all` seals partial chunks
    /// regardless of their age (tests, `flush`).
    pub async fn run_once(&self, seal_all: bool) -> Result<RoundReport, TierRunError> {
        let _round = self.round.lock().await;
        self.stats.rounds.fetch_add(1, Ordering::Relaxed);
        let result = self.round(seal_all).await;
        match &result {
            Ok(_) => {
                self.stats.tier2_down.store(false, Ordering::Relaxed);
                *self.stats.last_error.lock().expect("stats lock") = None;
            }
            Err(e) => {
                self.stats.round_errors.fetch_add(1, Ordering::Relaxed);
                if matches!(e, TierRunError::Tier2(_) | TierRunError::Timeout(_)) {
                    self.stats.tier2_down.store(true, Ordering::Relaxed);
                }
                *self.stats.last_error.lock().expect("stats lock") = Some(e.to_string());
            }
        }
        result
    }

    async fn round(&self, seal_all: bool) -> Result<RoundReport, TierRunError> {
        let mut report = RoundReport {
            ranges_planned: self.plan(seal_all)?,
            ..RoundReport::default()
        };
        let pending = store::pending_chunks(self.hub.catalog())?;
        let mut groups: BTreeMap<(StreamId, u64), Vec<ChunkRow>> = BTreeMap::new();
        for ch in pending {
            groups
                .entry((ch.stream, ch.range_first))
                .or_default()
                .push(ch);
        }
        // Ranges go up in offset order, each committed before the next; the next range's
        // records are read and encoded (CPU) while this one uploads (network), starting from
        // the fields this one registered when it is of the same stream.
        let groups: Vec<(StreamId, Vec<ChunkRow>)> =
            groups.into_iter().map(|((s, _), c)| (s, c)).collect();
        let mut building: Option<BuildTask> = None;
        let mut staged: Vec<StagedRange> = Vec::new();
        for (i, (stream, chunks)) in groups.iter().enumerate() {
            let task = match building.take() {
                Some(t) => t,
                None => self.start_build(*stream, chunks, None)?,
            };
            let built = task
                .await
                .map_err(|e| TierRunError::Internal(e.to_string()))??;
            if let Some((next, next_chunks)) = groups.get(i + 1) {
                let fields = (next == stream).then(|| built.registry.clone());
                building = Some(self.start_build(*next, next_chunks, fields)?);
            }
            staged.push(self.upload_range(*stream, chunks, built).await?);
            // Ranges of one stream wait for one snapshot (Iceberg), up to a bound; in the
            // plain layout each commits at once.
            let next_same = groups.get(i + 1).is_some_and(|(next, _)| next == stream);
            if self.lake.is_none() || !next_same || staged.len() >= RANGES_PER_SNAPSHOT_MAX {
                let (n, records) = self
                    .commit_staged(*stream, std::mem::take(&mut staged))
                    .await?;
                report.chunks_committed += n;
                report.records_tiered += records;
            }
        }
        self.fault(TierFaultPoint::BeforeEvict)?;
        report.wal_files_evicted = self.evict()?;
        report.tier2_chunks_deleted = self.tier2_retention().await?;
        self.maintain_lake(false).await;
        Ok(report)
    }

    /// Step 1: fixes chunk boundaries in the catalog. Returns the number of ranges planned.
    fn plan(&self, seal_all: bool) -> Result<u64, TierRunError> {
        let cat = self.hub.catalog();
        let now = now_ns();
        let age_max = i64::try_from(self.cfg.chunk_age_max.as_nanos()).unwrap_or(i64::MAX);
        let mut planned = 0;
        for s in cat.streams()? {
            let st = store::state(cat, s.id)?;
            let readable = readable_end(&self.hub, s.id, s.next_offset);
            let mut from = st.planned_end;
            'ranges: loop {
                let (mut records, mut bytes) = (0u64, 0u64);
                let mut first_ingest = None;
                let mut seen_end = from;
                let cut = 'scan: loop {
                    let blocks = cat.blocks_from(s.id, seen_end, INDEX_PAGE_BLOCKS)?;
                    if blocks.is_empty() {
                        break 'scan None;
                    }
                    for b in &blocks {
                        if b.hub_offset_base + b.count() > readable {
                            break 'scan None;
                        }
                        // A chunk lies in one ingest day: its path's `ingest_date` and its
                        // Iceberg partition hold for every record in it.
                        if let Some(first) = first_ingest
                            && tier::ingest_date(b.ingest_ts) != tier::ingest_date(first)
                        {
                            break 'scan Some(seen_end);
                        }
                        records += b.count();
                        bytes += u64::from(b.frame_len);
                        first_ingest.get_or_insert(b.ingest_ts);
                        seen_end = b.hub_offset_base + b.count();
                        if records >= self.cfg.chunk_records_max
                            || bytes >= self.cfg.chunk_bytes_max
                        {
                            break 'scan Some(seen_end);
                        }
                    }
                };
                let Some(first_ingest) = first_ingest else {
                    break 'ranges;
                };
                // A range that did not reach a size limit is sealed once its first block is
                // old enough (or when asked), so slow streams reach tier 2 too.
                let end = match cut {
                    Some(end) => end,
                    None if seal_all || now.saturating_sub(first_ingest) >= age_max => seen_end,
                    None => break 'ranges,
                };
                let mut rows = Vec::new();
                for seg in segments_overlapping(&self.hub, s.id, from, end)? {
                    let first = seg.start;
                    rows.push(ChunkRow {
                        stream: s.id,
                        segment: seg.id,
                        first_offset: first,
                        end_offset: seg.end.unwrap_or(end),
                        range_first: from,
                        state: PLANNED,
                        path: tier::chunk_path(
                            &s.name,
                            seg.id,
                            first,
                            tier::ingest_date(first_ingest),
                        ),
                        rows: 0,
                        bytes: 0,
                        ingest_ts_min: 0,
                        ingest_ts_max: 0,
                    });
                }
                store::insert_plan(cat, s.id, &rows, end)?;
                planned += 1;
                from = end;
            }
        }
        Ok(planned)
    }

    /// Step 2a for one plan range, on the blocking pool: read its records from tier 1 and
    /// encode its chunks. `fields`: the stream's registry as the previous range left it, when
    /// that range is not committed yet; else the catalog's is used.
    fn start_build(
        &self,
        stream: StreamId,
        chunks: &[ChunkRow],
        fields: Option<FieldRegistry>,
    ) -> Result<BuildTask, TierRunError> {
        let name = self.stream_name(stream)?;
        let registry = match fields {
            Some(r) => r,
            None => {
                let specs = store::fields(self.hub.catalog(), stream)?;
                FieldRegistry::from_columns(specs).map_err(tier::TierError::from)?
            }
        };
        let mut registry = match self.lake {
            Some(_) => registry.without_widening(),
            None => registry,
        };
        let before = registry.clone();
        if let Some(types) = self.cfg.field_types.get(&name) {
            for (field, kind) in types {
                if *kind == tier::ValueKind::F64 {
                    registry.pin_float(field);
                }
            }
        }
        let hub = self.hub.clone();
        let plan = chunks.to_vec();
        let encode = self.encode.clone();
        let stats = self.stats.clone();
        let stream_name = name;
        Ok(tokio::task::spawn_blocking(move || {
            let mut per_chunk = Vec::new();
            for ch in &plan {
                let seg = segment_of(&hub, ch);
                let recs = chunk_records(&hub, ch, &seg)?;
                registry.observe_records(&recs);
                per_chunk.push(recs);
            }
            report_column_changes(&stream_name, &before, &registry, &stats);
            // Encoding is the slow stage of an upload (issue 7): each chunk's column chunks
            // are encoded on every core (`benches/tier.rs`: about as fast as one chunk per
            // core, with half the records in flight). The bytes do not depend on the thread
            // count.
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let mut out = Vec::new();
            for (ch, recs) in plan.iter().zip(per_chunk) {
                if recs.is_empty() {
                    out.push(None);
                    continue;
                }
                let mut opts = encode.clone();
                opts.metadata
                    .push(("tributary.stream".into(), stream_name.clone()));
                opts.metadata
                    .push(("tributary.segment".into(), ch.segment.to_string()));
                let (bytes, summary) =
                    tier::encode_chunk_with_threads(&recs, &registry, &opts, threads)
                        .map_err(tier::TierError::from)?;
                out.push(Some((bytes, summary)));
            }
            Ok(BuiltRange {
                registry,
                encoded: out,
            })
        }))
    }

    fn stream_name(&self, stream: StreamId) -> Result<String, TierRunError> {
        self.hub
            .stream_name(stream)
            .ok_or_else(|| TierRunError::Internal(format!("stream {stream} has no name")))
    }

    /// Step 2b for one plan range: upload, verify, manifest, commit. Returns (chunks, records).
    async fn upload_range(
        &self,
        stream: StreamId,
        chunks: &[ChunkRow],
        built: BuiltRange,
    ) -> Result<StagedRange, TierRunError> {
        let cat = self.hub.catalog().clone();
        let name = self.stream_name(stream)?;
        let BuiltRange { registry, encoded } = built;
        let mut manifests = Vec::new();
        let mut commit = RangeCommit {
            stream,
            tiered_end: chunks.iter().map(|c| c.end_offset).max().unwrap_or(0),
            fields: registry.columns().to_vec(),
            ..RangeCommit::default()
        };
        let mut lanes: BTreeMap<(u32, u64), u64> = BTreeMap::new();
        let mut records = 0;
        // Chunk objects and manifests whose put returned: durable (`tier::Tier2` syncs a local
        // directory before a put returns). Nothing is committed that is not in both.
        let mut durable = DurablePuts::default();
        for (ch, enc) in chunks.iter().zip(encoded) {
            let mut row = ch.clone();
            row.state = COMMITTED;
            if let Some((bytes, summary)) = enc {
                let len = bytes.len() as u64;
                // The object's size and crc32c, so read-through and the tier-2 scrub detect
                // bit rot and truncation (`crate::scrub`).
                let check = store::ObjectCheck::of(&bytes);
                // Upload and verify (by the store's MD5 ETag where it has one, else by reading
                // the footer back) before anything counts it as tiered.
                self.bounded(self.store.upload_chunk(&ch.path, bytes, &summary))
                    .await?;
                durable.chunks.insert(ch.path.clone());
                store::set_uploaded(&cat, ch, summary.rows, len)?;
                store::set_object_check(&cat, ch.stream, ch.segment, ch.first_offset, check)?;
                self.stats.bytes_uploaded.fetch_add(len, Ordering::Relaxed);
                row.rows = summary.rows;
                row.bytes = len;
                row.ingest_ts_min = summary.min_ingest_ts_ns;
                row.ingest_ts_max = summary.max_ingest_ts_ns;
                records += summary.rows;
                for r in &summary.seq_ranges {
                    let d = self
                        .hub
                        .device_id(&r.device)
                        .map_err(|e| TierRunError::Internal(e.to_string()))?;
                    let e = lanes.entry((d, r.epoch)).or_insert(0);
                    *e = (*e).max(r.max_seq);
                }
                let seg = segment_of(&self.hub, ch);
                // The segment's own start and predecessors, and (in the first manifest of the
                // range) the whole segment graph so far: `recover` rebuilds the graph from them.
                let (segment_start, preds, graph) =
                    graph_for_manifest(&self.hub, stream, ch.segment, manifests.is_empty());
                let mut extra = serde_json::json!({
                    "range_first": ch.range_first,
                    "range_end": commit.tiered_end,
                });
                if let Some(g) = graph {
                    extra["segments"] = g;
                }
                extra["crc32c"] = check.crc32c.into();
                if manifests.is_empty() {
                    // The range's dedupe checksums, for `recover` (see `store::block_ranges_json`).
                    extra["block_ranges"] = store::block_ranges_json(
                        &cat,
                        stream,
                        ch.range_first,
                        commit.tiered_end,
                        &|d| self.hub.device_name(d),
                    )?;
                }
                manifests.push(Manifest {
                    version: tier::layout::MANIFEST_VERSION,
                    stream: name.clone(),
                    segment: ch.segment,
                    first_offset: ch.first_offset,
                    end_offset: ch.end_offset,
                    path: ch.path.clone(),
                    summary,
                    columns: registry.columns().to_vec(),
                    hash_lo: seg.hash_lo as i64,
                    hash_hi: seg.hash_hi as i64,
                    segment_start: segment_start.unwrap_or(seg.start),
                    preds,
                    committed_ns: now_ns(),
                    extra,
                });
            }
            commit.chunks.push(row);
        }
        self.fault(TierFaultPoint::AfterUpload)?;
        for m in &manifests {
            self.bounded(self.store.put_manifest(m)).await?;
            durable.manifests.insert(m.path.clone());
        }
        self.fault(TierFaultPoint::AfterManifest)?;
        durable.assert_covers(&commit.chunks);
        commit.lanes = lanes.into_iter().map(|((d, e), s)| (d, e, s)).collect();
        let files = manifests
            .iter()
            .map(|m| tier::table::LakeFile {
                path: m.path.clone(),
                summary: m.summary.clone(),
            })
            .collect();
        Ok(StagedRange {
            lake: tier::table::LakeRange {
                first: chunks.first().map_or(0, |c| c.range_first),
                end: commit.tiered_end,
                files,
            },
            commit,
            registry,
            records,
        })
    }

    /// Step 2c: commits uploaded ranges of one stream (consecutive, in offset order): with
    /// Iceberg tables one snapshot holds them all, then the hub's catalog commits each.
    /// Returns the chunks and records committed.
    async fn commit_staged(
        &self,
        stream: StreamId,
        staged: Vec<StagedRange>,
    ) -> Result<(u64, u64), TierRunError> {
        let (Some(lake), Some(last)) = (&self.lake, staged.last()) else {
            return self.commit_in_catalog(staged);
        };
        let ranges: Vec<tier::table::LakeRange> = (staged.iter())
            .filter(|r| !r.lake.files.is_empty())
            .map(|r| r.lake.clone())
            .collect();
        if !ranges.is_empty() {
            let name = self.stream_name(stream)?;
            let outcome = self
                .bounded(lake.commit_ranges(&name, &last.registry, &ranges))
                .await?;
            let counter = match outcome {
                tier::table::CommitOutcome::Committed { .. } => &self.stats.lake_commits,
                tier::table::CommitOutcome::AlreadyCommitted => {
                    &self.stats.lake_ranges_already_committed
                }
            };
            counter.fetch_add(1, Ordering::Relaxed);
            self.fault(TierFaultPoint::AfterTableCommit)?;
        }
        self.commit_in_catalog(staged)
    }

    /// The hub's catalog commit of each range, in order.
    fn commit_in_catalog(&self, staged: Vec<StagedRange>) -> Result<(u64, u64), TierRunError> {
        let cat = self.hub.catalog();
        let (mut chunks, mut records) = (0, 0);
        for StagedRange {
            mut commit,
            records: r,
            ..
        } in staged
        {
            commit.committed_ns = now_ns();
            // The commit moves `tiered_end` (eviction follows it) and the lanes' `tiered_seq`
            // (agents free their copies on it): only now, behind the durable puts and the
            // table's snapshot.
            let moved = store::commit_range(cat, &commit)?;
            let n = commit.chunks.len() as u64;
            self.stats.chunks_committed.fetch_add(n, Ordering::Relaxed);
            self.stats.records_tiered.fetch_add(r, Ordering::Relaxed);
            if !moved.is_empty() {
                self.tiered_tx.send_modify(|g| *g += 1);
            }
            chunks += n;
            records += r;
        }
        Ok((chunks, records))
    }

    /// Step 3: deletes WAL files whose blocks are all tiered, oldest first, within retention.
    fn evict(&self) -> Result<u64, TierRunError> {
        let cat = self.hub.catalog();
        let files = self.hub.wal_reader().files()?;
        let Some((&active, older)) = files.split_last() else {
            return Ok(0);
        };
        let retention_ns =
            i64::try_from(self.cfg.tier1_retention_time.as_nanos()).unwrap_or(i64::MAX);
        let now = now_ns();
        // A batch may roll files mid-write: frames past the committed end are not in the
        // block index yet, so a file is a candidate only if it ends at or before it.
        let committed_end = cat.wal_committed_end()?;
        let mut states = BTreeMap::new();
        let mut evicted = 0;
        for (i, &f) in older.iter().enumerate() {
            let next = older.get(i + 1).copied().unwrap_or(active);
            if next > committed_end {
                break;
            }
            let blocks = cat.blocks_in_wal_file(f)?;
            let mut ends: BTreeMap<StreamId, u64> = BTreeMap::new();
            let mut newest = i64::MIN;
            let mut tiered = true;
            for b in &blocks {
                let st = match states.get(&b.stream) {
                    Some(s) => *s,
                    None => {
                        let s = store::state(cat, b.stream)?;
                        states.insert(b.stream, s);
                        s
                    }
                };
                let end = b.hub_offset_base + b.count();
                if end > st.tiered_end {
                    tiered = false;
                    break;
                }
                let e = ends.entry(b.stream).or_insert(0);
                *e = (*e).max(end);
                newest = newest.max(b.ingest_ts);
            }
            if !tiered {
                break;
            }
            let held = self.tier1_bytes();
            let old_enough = now.saturating_sub(newest) >= retention_ns;
            if !old_enough && held <= self.cfg.tier1_retention_bytes {
                break;
            }
            let ends: Vec<(StreamId, u64)> = ends.into_iter().collect();
            store::record_eviction(cat, &ends, next)?;
            let len = self.hub.wal_reader().evict(f)?;
            self.floor.store(next, Ordering::Relaxed);
            self.stats.wal_files_evicted.fetch_add(1, Ordering::Relaxed);
            self.stats
                .wal_bytes_evicted
                .fetch_add(len, Ordering::Relaxed);
            evicted += 1;
        }
        Ok(evicted)
    }

    /// Step 4: deletes whole plan ranges beyond tier-2 retention (oldest first).
    async fn tier2_retention(&self) -> Result<u64, TierRunError> {
        if self.cfg.tier2_retention_time.is_none() && self.cfg.tier2_retention_bytes.is_none() {
            return Ok(0);
        }
        let cat = self.hub.catalog().clone();
        let now = now_ns();
        let mut deleted = 0;
        for (sid, st) in store::streams_with_state(&cat)? {
            let Some(name) = self.hub.stream_name(sid) else {
                continue;
            };
            let chunks = store::committed_chunks(&cat, sid)?;
            let mut ranges: BTreeMap<u64, Vec<ChunkRow>> = BTreeMap::new();
            for c in chunks {
                ranges.entry(c.range_first).or_default().push(c);
            }
            let mut total: u64 = ranges.values().flatten().map(|c| c.bytes).sum();
            let mut new_start = st.tier2_start;
            for chunks in ranges.values() {
                let newest = chunks.iter().map(|c| c.ingest_ts_max).max().unwrap_or(0);
                let bytes: u64 = chunks.iter().map(|c| c.bytes).sum();
                let too_old = self.cfg.tier2_retention_time.is_some_and(|t| {
                    now.saturating_sub(newest) >= i64::try_from(t.as_nanos()).unwrap_or(i64::MAX)
                });
                let too_big = self.cfg.tier2_retention_bytes.is_some_and(|b| total > b);
                // Never delete from tier 2 what tier 1 no longer holds and readers still
                // could need? Retention is the operator's explicit choice: data older than it
                // goes, from both tiers alike.
                if !too_old && !too_big {
                    break;
                }
                // A table keeps its files until no retained snapshot references them: the
                // delete snapshot goes first, the objects go as orphans (`lake`).
                if let Some(lake) = &self.lake {
                    let paths: Vec<String> = chunks.iter().map(|c| c.path.clone()).collect();
                    let removed = self.bounded(lake.delete_files(&name, &paths)).await?;
                    (self.stats.lake_files_deleted).fetch_add(removed.files, Ordering::Relaxed);
                }
                for c in chunks {
                    if self.lake.is_none() {
                        self.bounded(self.store.delete(&c.path)).await?;
                    }
                    let manifest = tier::manifest_path(&name, c.segment, c.first_offset);
                    self.bounded(self.store.delete(&manifest)).await?;
                    deleted += 1;
                }
                total -= bytes;
                new_start = chunks
                    .iter()
                    .map(|c| c.end_offset)
                    .max()
                    .unwrap_or(new_start);
                store::drop_chunks_below(&cat, sid, new_start)?;
            }
        }
        self.stats
            .tier2_chunks_deleted
            .fetch_add(deleted, Ordering::Relaxed);
        Ok(deleted)
    }
}

/// The chunk objects and manifests of one plan range whose puts returned, i.e. are durable.
#[derive(Debug, Default)]
struct DurablePuts {
    chunks: std::collections::BTreeSet<String>,
    /// By the chunk path each manifest names.
    manifests: std::collections::BTreeSet<String>,
}

impl DurablePuts {
    /// The invariant behind `tiered_seq` and eviction: every chunk row about to be committed
    /// with records has its object and its manifest durably in tier 2. Only a bug (an upload
    /// not awaited, a reordered step) can break it, so it holds in release builds too.
    fn assert_covers(&self, rows: &[ChunkRow]) {
        for row in rows.iter().filter(|r| r.rows > 0) {
            assert!(
                self.chunks.contains(&row.path) && self.manifests.contains(&row.path),
                "committing chunk {} before its object and manifest puts returned",
                row.path
            );
        }
    }
}

/// For a manifest of `segment`: its start and predecessors in the stream's graph, and with
/// `whole` the graph's segments encoded for [`recover`] (`crate::streams::graph::to_json`).
fn graph_for_manifest(
    hub: &Hub,
    stream: StreamId,
    segment: u64,
    whole: bool,
) -> (Option<u64>, Vec<u64>, Option<serde_json::Value>) {
    let Ok(snap) = hub.streams().snapshot(stream) else {
        return (None, Vec::new(), None);
    };
    let own = u32::try_from(segment)
        .ok()
        .and_then(|id| snap.graph.segment(id));
    let graph = whole.then(|| crate::streams::graph::to_json(snap.graph.segments()));
    match own {
        Some(s) => (
            Some(s.start),
            s.preds.iter().map(|&p| u64::from(p)).collect(),
            graph,
        ),
        None => (None, Vec::new(), graph),
    }
}

/// The segment a chunk row belongs to, with its hash range, clipped to the chunk.
fn segment_of(hub: &Hub, ch: &ChunkRow) -> SegmentSpan {
    let seg = segments_overlapping(hub, ch.stream, ch.first_offset, ch.end_offset)
        .ok()
        .and_then(|v| v.into_iter().find(|s| s.id == ch.segment));
    SegmentSpan {
        id: ch.segment,
        start: ch.first_offset,
        end: Some(ch.end_offset),
        ..seg.unwrap_or(SegmentSpan::WHOLE)
    }
}

/// Reads the committed records of one chunk from tier 1: every record with offset in
/// `[first_offset, end_offset)` whose key belongs to `seg`.
pub(crate) fn chunk_records(
    hub: &Hub,
    ch: &ChunkRow,
    seg: &SegmentSpan,
) -> Result<Vec<TierRecord>, TierRunError> {
    let cat = hub.catalog();
    let mut out = Vec::new();
    let mut skipped = 0u64;
    let mut from = ch.first_offset;
    'pages: while from < ch.end_offset {
        let rows = cat.blocks_from(ch.stream, from, INDEX_PAGE_BLOCKS)?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            if row.hub_offset_base >= ch.end_offset {
                break 'pages;
            }
            // Quarantined blocks (damaged, or not decodable within the limits) are not served
            // from tier 1 and are not tiered either: their offsets stay a hole.
            if crate::scrub::is_quarantined(hub, row) || !append_block(hub, row, ch, seg, &mut out)?
            {
                let end = (row.hub_offset_base + row.count()).min(ch.end_offset);
                skipped += end.saturating_sub(row.hub_offset_base.max(ch.first_offset));
            }
            from = row.hub_offset_base + row.count();
        }
    }
    let want = ch.end_offset - ch.first_offset;
    if seg.covers_all_keys() && out.len() as u64 + skipped != want {
        return Err(TierRunError::Block {
            stream: ch.stream,
            offset: from,
            what: format!(
                "tier 1 holds {} of the {want} records of the planned chunk",
                out.len()
            ),
        });
    }
    let mut repeated = 0u64;
    for r in &mut out {
        r.fields.retain(|(name, _)| is_tiered_field(name));
        repeated += drop_repeated_fields(&mut r.fields);
    }
    if repeated > 0 {
        tracing::warn!(
            stream = ch.stream,
            first_offset = ch.first_offset,
            end_offset = ch.end_offset,
            repeated,
            "records of this chunk name a field more than once; tier 2 keeps the first value \
             of each (a device's block, not a parser of this project, made them)"
        );
    }
    Ok(out)
}

/// Removes every field whose name an earlier field of the record already has, keeping the
/// first, and returns how many it removed. The agent's parsers never produce such a record,
/// but a block from a device is not trusted: a chunk cannot hold two values of one field in
/// one row, and refusing to encode it would stop the stream's tiering for good.
fn drop_repeated_fields(fields: &mut Vec<(String, sync::record::Value)>) -> u64 {
    let before = fields.len();
    if before < 2 {
        return 0;
    }
    let mut seen = std::collections::HashSet::with_capacity(before);
    fields.retain(|(name, _)| seen.insert(name.clone()));
    (before - fields.len()) as u64
}

/// Internal fields (names starting with `_`, the edge agent's own) that become tier-2 columns:
/// `_topic`, the MQTT topic a record came from, is data a query may group by and republish
/// honours. Every other internal field (`_mqtt_digest`, `_idempotency`) is the agent's
/// duplicate-detection bookkeeping, meaningless at the hub, and is left out of the Parquet
/// files (`docs/format/parquet.md`).
pub const TIERED_INTERNAL_FIELDS: [&str; 1] = ["_topic"];

/// True when a field of this name becomes a tier-2 column; tier-1 reads serve the same fields
/// (`crate::read`), so a record reads the same from either tier.
pub fn is_tiered_field(name: &str) -> bool {
    !name.starts_with('_') || TIERED_INTERNAL_FIELDS.contains(&name)
}

/// Appends the records of `row` that `ch` holds; false when the block does not decode within
/// the limits and was quarantined instead (`crate::poison`).
fn append_block(
    hub: &Hub,
    row: &BlockRow,
    ch: &ChunkRow,
    seg: &SegmentSpan,
    out: &mut Vec<TierRecord>,
) -> Result<bool, TierRunError> {
    let bad = |what: String| TierRunError::Block {
        stream: row.stream,
        offset: row.hub_offset_base,
        what,
    };
    let (entry, block) = hub.wal_reader().read(row)?;
    let same = entry.kind == KIND_BLOCK
        && entry.device == row.device
        && entry.stream == row.stream
        && entry.epoch == row.epoch
        && entry.first_seq == row.first_seq
        && u64::from(entry.count) == row.count()
        && entry.hub_offset_base == row.hub_offset_base;
    if !same {
        return Err(bad(format!(
            "entry header {entry:?} differs from its index row"
        )));
    }
    let Ok(decoded) = crate::poison::decode_stored(hub, row, &block) else {
        return Ok(false);
    };
    if decoded.records.len() as u64 != row.count() {
        return Err(bad("block holds a different record count".into()));
    }
    let device = hub
        .device_name(row.device)
        .unwrap_or_else(|| format!("#{}", row.device));
    for (i, r) in decoded.records.into_iter().enumerate() {
        let offset = row.hub_offset_base + i as u64;
        if offset < ch.first_offset || offset >= ch.end_offset || !seg.holds_key(&r.key) {
            continue;
        }
        out.push(TierRecord {
            tags: r.tags,
            device: device.clone(),
            epoch: row.epoch,
            seq: row.first_seq + i as u64,
            offset,
            key: r.key,
            ts_ns: r.ts,
            ingest_ts_ns: entry.ingest_ts,
            fields: r.fields,
        });
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sync::record::Value;

    #[test]
    fn a_repeated_field_keeps_its_first_value_and_the_chunk_encodes() {
        let mut fields = vec![
            ("temp".to_owned(), Value::I64(65)),
            ("rpm".to_owned(), Value::F64(1.5)),
            ("temp".to_owned(), Value::F64(71.3)),
            ("temp".to_owned(), Value::Str("x".into())),
        ];
        assert_eq!(drop_repeated_fields(&mut fields), 2);
        assert_eq!(
            fields,
            vec![
                ("temp".to_owned(), Value::I64(65)),
                ("rpm".to_owned(), Value::F64(1.5)),
            ]
        );
        let record = TierRecord {
            tags: Vec::new(),
            device: "dev-1".into(),
            epoch: 1,
            seq: 1,
            offset: 0,
            key: "k".into(),
            ts_ns: 1,
            ingest_ts_ns: 1,
            fields,
        };
        let mut registry = FieldRegistry::new();
        registry.observe_records(std::slice::from_ref(&record));
        tier::encode_chunk(&[record], &registry, &EncodeOptions::default())
            .expect("a record without repeated fields encodes");
    }

    #[test]
    fn a_repeated_field_does_not_encode_as_it_arrives() {
        // Why the hub removes repeats before encoding: the encoder refuses them.
        let record = TierRecord {
            tags: Vec::new(),
            device: "dev-1".into(),
            epoch: 1,
            seq: 1,
            offset: 0,
            key: "k".into(),
            ts_ns: 1,
            ingest_ts_ns: 1,
            fields: vec![
                ("temp".to_owned(), Value::I64(65)),
                ("temp".to_owned(), Value::I64(66)),
            ],
        };
        let mut registry = FieldRegistry::new();
        registry.observe_records(std::slice::from_ref(&record));
        assert!(tier::encode_chunk(&[record], &registry, &EncodeOptions::default()).is_err());
    }
}
