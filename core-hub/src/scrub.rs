//! Scrubbing at rest: finding bit flips in tier-1 WAL files and in tier-2 Parquet objects
//! before a reader trips over them, quarantining what is damaged, and reporting it.
//!
//! # Tier 1
//! Recovery verifies only the active WAL file when the hub opens (`wal::recover`); sealed files
//! are checked frame by frame only when a reader fetches a block, and a damaged frame then
//! fails the whole read. Storage rots silently, so the hub must look for damage itself, name
//! what is lost, and keep serving everything else. [`scrub_wal`] walks every block the
//! catalog indexes in every WAL file on disk and verifies its frame (length, crc32c) and its
//! entry header against the index row. Damaged blocks are:
//!
//! - **reported**: one `error` log line per block with device, stream, epoch and seqs, and the
//!   `tributary_hub_scrub_*` metrics ([`render_metrics`]);
//! - **quarantined**: recorded in `<data_dir>/quarantine.json` (atomically replaced, so the
//!   list survives restarts and operators can read it), and in the hub's own set
//!   ([`Tier1Scrub`], owned by the `Hub`, loaded by `Hub::open`) that the reader consults
//!   through [`is_quarantined`] to skip them, so the rest of the stream is still served. Two
//!   hubs in one process (tests) never share it.
//!
//! The records of a damaged block are lost at the hub, but not necessarily anywhere: an agent
//! that still holds them can be asked to resend (a later issue); until then the quarantine
//! file is the authoritative list of what is missing.
//!
//! # Tier 2
//!
//! Every chunk object's size and crc32c are recorded at upload (catalog `tier_objects`, and
//! `extra.crc32c` in its manifest). Read-through (`tiering::read`) checks every object it
//! fetches; [`scrub_tier2`] reads every committed object at a bounded rate
//! (`[tier2] scrub_bytes_per_sec_max`) every `[tier2] scrub_interval` ([`start_tier2`], the
//! time of the last pass persisted in the catalog). Right after a start, before waiting for
//! that interval, [`scrub_tier2_recent`] checks the chunks committed in the last
//! [`DEFAULT_TIER2_RESTART_WINDOW`] before the stop, newest first: a power loss (on a store
//! that did not sync what it acknowledged) damages the newest objects, and tier 1 most
//! likely still holds their records for the repair. A damaged object (size, crc32c, a file
//! that does not decode, or one gone while its chunk is committed) is:
//!
//! - **quarantined** ([`report_tier2_damage`]): recorded in the catalog (`tier_quarantine`),
//!   after which readers skip its records (with a gap report) instead of serving corrupt rows;
//!   its bytes are moved to `_tributary/quarantine/<path>`, out of `streams/`, so SQL engines
//!   stop reading them ([`tend_tier2_quarantine`]);
//! - **reported**: one `error` log line naming the object, `tributary_hub_tier2_*` metrics
//!   (`tributary_hub_tier2_corrupt_objects_total`, `..._quarantined_objects`, ...) and lines in
//!   `/healthz` ([`health_detail`]);
//! - **repaired** when tier 1 still holds all its records: re-read from the WAL, encoded with
//!   the columns its manifest lists, uploaded to the same name (so SQL engines see each record
//!   once again), verified, its new check and manifest written. Otherwise it stays
//!   quarantined and reported.
//!
//! Quarantine and repair run under the uploader's round lock: no upload, eviction or
//! retention interleaves with them.
//!
//! # Hooks (outside this file)
//!
//! - `main.rs`, after `Hub::open`: `let _scrub = core_hub::scrub::Scrubber::start(hub.clone(), &cfg.data_dir, core_hub::scrub::DEFAULT_INTERVAL);`
//!   and, after `Tiering::open`: `core_hub::scrub::start_tier2(tiering.clone(), (&cfg.tier2).into(), stop_rx.clone())`.
//! - `read.rs`, first line of the loop over index rows in `read_records`:
//!   `if crate::scrub::is_quarantined(hub, row) { continue; }`
//! - `metrics.rs`, in `render`: `crate::scrub::render_metrics(&mut out, hub);`
//! - `api.rs`, `/healthz`: [`health_detail`] lines after `ok`.
//!
//! The tier-2 counters and quarantined paths belong to the hub too ([`Hub::tier2_scrub`]).

use crate::catalog::{BlockRow, Catalog, CatalogError};
use crate::ingest::Hub;
use crate::wal::{KIND_BLOCK, WalReadError, WalReader, list_wal_files};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use thiserror::Error;

/// The quarantine list, in the hub's data directory.
pub const QUARANTINE_FILE: &str = "quarantine.json";
/// How often a running hub scrubs its WAL after the scrub at start.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(6 * 3600);

/// One damaged block: where its frame is, which records it held, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Damaged {
    pub wal_file: u64,
    pub wal_pos: u64,
    pub device: String,
    pub stream: String,
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub what: String,
}

/// What one scrub pass found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrubReport {
    pub files: u64,
    pub blocks_checked: u64,
    pub bytes_checked: u64,
    pub damaged: Vec<Damaged>,
}

/// Why a scrub pass could not run (damage is a finding, not an error).
#[derive(Debug, Error)]
pub enum ScrubError {
    #[error("listing {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("catalog: {0}")]
    Catalog(#[from] CatalogError),
    #[error("writing {path}: {source}")]
    Persist {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a quarantine list: {what}")]
    BadQuarantine { path: PathBuf, what: String },
}

/// Verifies every indexed block of every WAL file in `wal_dir`. Names of devices and streams
/// come from `names` (`(device id, stream id) -> (device, stream)`). A block whose frame is
/// sound but whose records would not decode within `limits` (its decoded size is computed,
/// no record is built; see `crate::poison`) is damaged too.
pub fn scrub_wal(
    catalog: &Catalog,
    reader: &WalReader,
    wal_dir: &Path,
    names: &dyn Fn(&BlockRow) -> (String, String),
    limits: &sync::block::DecodeLimits,
) -> Result<ScrubReport, ScrubError> {
    let files = list_wal_files(wal_dir).map_err(|source| ScrubError::List {
        path: wal_dir.to_path_buf(),
        source,
    })?;
    let mut report = ScrubReport {
        files: files.len() as u64,
        ..ScrubReport::default()
    };
    for file in files {
        for row in catalog.blocks_in_wal_file(file)? {
            report.blocks_checked += 1;
            report.bytes_checked += u64::from(row.frame_len);
            let problem = match reader.read(&row) {
                Ok((entry, block)) => {
                    let same = entry.kind == KIND_BLOCK
                        && entry.device == row.device
                        && entry.stream == row.stream
                        && entry.epoch == row.epoch
                        && entry.first_seq == row.first_seq
                        && u64::from(entry.count) == row.count()
                        && entry.hub_offset_base == row.hub_offset_base;
                    if same {
                        sync::block::size_block(&block, limits)
                            .err()
                            .map(|e| format!("does not decode within the limits: {e}"))
                    } else {
                        Some("entry header differs from the index row".to_string())
                    }
                }
                Err(e @ WalReadError::Corrupt { .. }) => Some(e.to_string()),
                // A file evicted by tiering between listing and reading is not damage.
                Err(WalReadError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    None
                }
                Err(e) => Some(e.to_string()),
            };
            if let Some(what) = problem {
                let (device, stream) = names(&row);
                report.damaged.push(Damaged {
                    wal_file: row.wal_file,
                    wal_pos: row.wal_pos,
                    device,
                    stream,
                    epoch: row.epoch,
                    first_seq: row.first_seq,
                    last_seq: row.last_seq,
                    what,
                });
            }
        }
    }
    Ok(report)
}

/// Quarantined blocks by `(wal_file, wal_pos)`, persisted in [`QUARANTINE_FILE`].
#[derive(Debug)]
pub struct Quarantine {
    path: PathBuf,
    blocks: RwLock<BTreeMap<(u64, u64), Damaged>>,
}

impl Quarantine {
    /// Loads `<data_dir>/quarantine.json`, empty when absent.
    pub fn load(data_dir: &Path) -> Result<Quarantine, ScrubError> {
        let path = data_dir.join(QUARANTINE_FILE);
        let list: Vec<Damaged> = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| ScrubError::BadQuarantine {
                path: path.clone(),
                what: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => return Err(ScrubError::Persist { path, source }),
        };
        let blocks = list
            .into_iter()
            .map(|d| ((d.wal_file, d.wal_pos), d))
            .collect();
        Ok(Quarantine {
            path,
            blocks: RwLock::new(blocks),
        })
    }

    /// Adds `damaged` and rewrites the file if anything is new; returns how many were new.
    pub fn add(&self, damaged: &[Damaged]) -> Result<usize, ScrubError> {
        let mut blocks = self.blocks.write().expect("quarantine lock");
        let mut new = 0;
        for d in damaged {
            if blocks.insert((d.wal_file, d.wal_pos), d.clone()).is_none() {
                new += 1;
            }
        }
        if new > 0 {
            let list: Vec<&Damaged> = blocks.values().collect();
            persist(&self.path, &list)?;
        }
        Ok(new)
    }

    pub fn contains(&self, wal_file: u64, wal_pos: u64) -> bool {
        self.blocks
            .read()
            .expect("quarantine lock")
            .contains_key(&(wal_file, wal_pos))
    }

    pub fn len(&self) -> usize {
        self.blocks.read().expect("quarantine lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn list(&self) -> Vec<Damaged> {
        self.blocks
            .read()
            .expect("quarantine lock")
            .values()
            .cloned()
            .collect()
    }
}

/// One hub's tier-1 scrub state: the quarantine its readers consult and the scrub counters.
/// Owned by the `Hub` (loaded by `Hub::open`, so what an earlier run quarantined is skipped
/// from the first read on, before a [`Scrubber`] starts); nothing of it is process-wide.
#[derive(Debug)]
pub struct Tier1Scrub {
    quarantine: Arc<Quarantine>,
    runs: AtomicU64,
    failures: AtomicU64,
    blocks_checked: AtomicU64,
    bytes_checked: AtomicU64,
}

impl Tier1Scrub {
    /// Loads `data_dir`'s quarantine list. A list that cannot be read is logged and replaced
    /// by an empty one (the hub keeps serving; the next scrub pass finds the damage again).
    pub fn load(data_dir: &Path) -> Tier1Scrub {
        let quarantine = Quarantine::load(data_dir).unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot load the quarantine list; starting empty");
            Quarantine {
                path: data_dir.join(QUARANTINE_FILE),
                blocks: RwLock::new(BTreeMap::new()),
            }
        });
        if !quarantine.is_empty() {
            tracing::warn!(
                blocks = quarantine.len(),
                "tier-1 blocks are quarantined (see {QUARANTINE_FILE})"
            );
        }
        Tier1Scrub {
            quarantine: Arc::new(quarantine),
            runs: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            blocks_checked: AtomicU64::new(0),
            bytes_checked: AtomicU64::new(0),
        }
    }

    /// The quarantine this hub's readers consult.
    pub fn quarantine(&self) -> &Arc<Quarantine> {
        &self.quarantine
    }
}

/// Quarantines one block of `hub` found unreadable outside a scrub pass (a stored block that
/// does not decode within the limits, `crate::poison`): adds it to the hub's list, so its
/// readers skip it from now on. Returns whether it was new.
pub fn quarantine_block(hub: &Hub, damaged: Damaged) -> Result<bool, ScrubError> {
    let quarantine = hub.tier1_scrub().quarantine();
    Ok(quarantine.add(std::slice::from_ref(&damaged))? == 1)
}

/// Writes the list to a temporary file, fsyncs it and renames it over `path`.
fn persist(path: &Path, list: &[&Damaged]) -> Result<(), ScrubError> {
    let io = |source| ScrubError::Persist {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(list).map_err(|e| io(std::io::Error::other(e)))?;
    let mut file = std::fs::File::create(&tmp).map_err(io)?;
    file.write_all(&text).map_err(io)?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
    }
    Ok(())
}

/// Whether `hub`'s block of `row` is quarantined (its readers skip it).
pub fn is_quarantined(hub: &Hub, row: &BlockRow) -> bool {
    hub.tier1_scrub()
        .quarantine()
        .contains(row.wal_file, row.wal_pos)
}

/// Appends `hub`'s `tributary_hub_scrub_*` metrics, then its tier-2 ones
/// ([`render_tier2_metrics`]), in Prometheus text format.
pub fn render_metrics(out: &mut String, hub: &Hub) {
    let g = hub.tier1_scrub();
    let quarantined = g.quarantine().len();
    let mut line = |kind: &str, name: &str, help: &str, v: u64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    };
    line(
        "counter",
        "tributary_hub_scrub_runs_total",
        "Completed scrub passes over the tier-1 WAL.",
        g.runs.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_scrub_failures_total",
        "Scrub passes that could not run (catalog or directory errors).",
        g.failures.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_scrub_blocks_checked_total",
        "WAL blocks verified by the scrubber.",
        g.blocks_checked.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_scrub_bytes_checked_total",
        "WAL frame bytes verified by the scrubber.",
        g.bytes_checked.load(Ordering::Relaxed),
    );
    line(
        "gauge",
        "tributary_hub_quarantined_blocks",
        "WAL blocks found damaged and quarantined (listed in quarantine.json).",
        quarantined as u64,
    );
    render_tier2_metrics(hub, out);
}

/// A background thread that scrubs at start and then every `interval`.
pub struct Scrubber {
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scrubber {
    /// Starts the thread, which adds what it finds to the hub's quarantine (loaded by
    /// `Hub::open`, so the reader skips known damage at once).
    pub fn start(hub: Arc<Hub>, data_dir: &Path, interval: Duration) -> Scrubber {
        let quarantine = hub.tier1_scrub().quarantine().clone();
        let stop = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let wal_dir = data_dir.join("wal");
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tier1-scrub".into())
            .spawn(move || {
                loop {
                    run_once(&hub, &wal_dir, &quarantine);
                    let (lock, cvar) = &*thread_stop;
                    let stopped = lock.lock().expect("scrub stop lock");
                    let (stopped, _) = cvar
                        .wait_timeout_while(stopped, interval, |s| !*s)
                        .expect("scrub stop lock");
                    if *stopped {
                        return;
                    }
                }
            })
            .ok();
        if thread.is_none() {
            tracing::error!("cannot start the scrub thread");
        }
        Scrubber { stop, thread }
    }
}

impl Drop for Scrubber {
    fn drop(&mut self) {
        let (lock, cvar) = &*self.stop;
        *lock.lock().expect("scrub stop lock") = true;
        cvar.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One pass: scrub, report every damaged block once, quarantine it.
fn run_once(hub: &Hub, wal_dir: &Path, quarantine: &Quarantine) {
    let g = hub.tier1_scrub();
    let names = |row: &BlockRow| {
        (
            hub.device_name(row.device)
                .unwrap_or_else(|| format!("#{}", row.device)),
            hub.stream_name(row.stream)
                .unwrap_or_else(|| format!("#{}", row.stream)),
        )
    };
    let limits = hub.stored_decode_limits();
    let report = match scrub_wal(hub.catalog(), hub.wal_reader(), wal_dir, &names, &limits) {
        Ok(r) => r,
        Err(e) => {
            g.failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "tier-1 scrub failed");
            return;
        }
    };
    g.runs.fetch_add(1, Ordering::Relaxed);
    g.blocks_checked
        .fetch_add(report.blocks_checked, Ordering::Relaxed);
    g.bytes_checked
        .fetch_add(report.bytes_checked, Ordering::Relaxed);
    for d in &report.damaged {
        if !quarantine.contains(d.wal_file, d.wal_pos) {
            tracing::error!(
                device = %d.device, stream = %d.stream, epoch = %sync::epoch::format(d.epoch),
                first_seq = d.first_seq, last_seq = d.last_seq,
                wal_file = d.wal_file, wal_pos = d.wal_pos, what = %d.what,
                "tier-1 block damaged at rest: quarantined, its records are not served"
            );
        }
    }
    if let Err(e) = quarantine.add(&report.damaged) {
        tracing::error!(error = %e, "cannot persist the quarantine list");
    }
    tracing::info!(
        files = report.files,
        blocks = report.blocks_checked,
        damaged = report.damaged.len(),
        "tier-1 scrub pass done"
    );
}

// ---------------------------------------------------------------------------------------
// Tier 2: chunk objects at rest.
// ---------------------------------------------------------------------------------------

/// Settings of the tier-2 scrub (`[tier2] scrub_interval`, `scrub_bytes_per_sec_max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tier2ScrubConfig {
    /// Time between the starts of two full passes (persisted, so restarts do not reset it).
    pub interval: Duration,
    /// Read rate bound of a pass, in object bytes per second (0: unbounded).
    pub bytes_per_sec_max: u64,
    /// The pass at start covers the chunks committed this long before the newest commit.
    pub restart_window: Duration,
}

impl Default for Tier2ScrubConfig {
    fn default() -> Self {
        Tier2ScrubConfig {
            interval: DEFAULT_TIER2_INTERVAL,
            bytes_per_sec_max: DEFAULT_TIER2_BYTES_PER_SEC_MAX,
            restart_window: DEFAULT_TIER2_RESTART_WINDOW,
        }
    }
}

impl From<&crate::config::Tier2Config> for Tier2ScrubConfig {
    fn from(c: &crate::config::Tier2Config) -> Self {
        Tier2ScrubConfig {
            interval: c.scrub_interval,
            bytes_per_sec_max: c.scrub_bytes_per_sec_max,
            restart_window: DEFAULT_TIER2_RESTART_WINDOW,
        }
    }
}

/// Default time between two full tier-2 scrub passes.
pub const DEFAULT_TIER2_INTERVAL: Duration = Duration::from_secs(24 * 3600);
/// Default read rate of the tier-2 scrub.
pub const DEFAULT_TIER2_BYTES_PER_SEC_MAX: u64 = 16 << 20;
/// How far back from the newest chunk commit the pass after a start reaches
/// ([`scrub_tier2_recent`]): what a power loss could have cost on a store that lied about
/// syncs is the last few seconds of writes, and a page cache holds dirty data for about 30 s.
pub const DEFAULT_TIER2_RESTART_WINDOW: Duration = Duration::from_secs(15 * 60);
/// Where quarantined chunk objects are moved, outside `streams/` (SQL engines never see them):
/// `_tributary/quarantine/{original path}`.
pub const TIER2_QUARANTINE_PREFIX: &str = "_tributary/quarantine/";
/// Key in `tier_meta`: wall time (ns) of the start of the last complete tier-2 pass.
const META_TIER2_SCRUB_LAST: &str = "tier2_scrub_last_ns";

/// What one tier-2 pass (or quarantine round) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tier2ScrubReport {
    pub objects_checked: u64,
    pub bytes_checked: u64,
    /// Objects without a recorded check (uploaded before checks existed) that decoded
    /// cleanly and got one now.
    pub checks_recorded: u64,
    /// Paths found damaged in this pass (newly quarantined).
    pub damaged: Vec<String>,
    /// Paths re-uploaded from tier 1 and verified.
    pub repaired: Vec<String>,
    /// Paths that stay quarantined: tier 1 no longer holds their records.
    pub unrepairable: Vec<String>,
}

/// Why a tier-2 pass stopped (damage is a finding, not an error).
#[derive(Debug, Error)]
pub enum Tier2ScrubError {
    #[error("catalog: {0}")]
    Catalog(#[from] CatalogError),
    #[error("tier 2: {0}")]
    Tier2(#[from] tier::TierError),
    #[error("tier 2 did not answer within {0:?}")]
    Timeout(Duration),
}

/// One hub's tier-2 scrub counters and quarantine list (see [`Hub::tier2_scrub`]): two hubs in
/// one process never share them.
#[derive(Debug, Default)]
pub struct Tier2Scrub {
    runs: AtomicU64,
    failures: AtomicU64,
    objects_checked: AtomicU64,
    bytes_checked: AtomicU64,
    corrupt: AtomicU64,
    repaired: AtomicU64,
    records_skipped: AtomicU64,
    quarantined: AtomicU64,
    /// Objects checked by the pass after a start ([`scrub_tier2_recent`]).
    recent_checked: AtomicU64,
    /// Paths quarantined now (for `/healthz`), refreshed from the catalog on every change.
    quarantined_paths: RwLock<Vec<String>>,
    /// Wakes the tier-2 scrubber when a reader quarantined something.
    wake: tokio::sync::Notify,
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// Counts records a reader skipped because their chunk is quarantined.
pub fn note_tier2_records_skipped(hub: &Hub, rows: u64) {
    hub.tier2_scrub()
        .records_skipped
        .fetch_add(rows, Ordering::Relaxed);
}

/// Refreshes the quarantined gauge and path list from the catalog.
fn refresh_tier2_gauge(hub: &Hub) -> Result<(), CatalogError> {
    let list = crate::tiering::store::quarantine_list(hub.catalog())?;
    let paths: Vec<String> = list
        .into_iter()
        .filter(|q| q.state == crate::tiering::store::QUARANTINED)
        .map(|q| q.path)
        .collect();
    let g = hub.tier2_scrub();
    g.quarantined.store(paths.len() as u64, Ordering::Relaxed);
    *g.quarantined_paths.write().expect("tier-2 quarantine list") = paths;
    Ok(())
}

/// Quarantines a damaged chunk object found by a reader or the scrub: catalog entry (readers
/// skip it from now on), one `error` log line naming the object, the
/// `tributary_hub_tier2_corrupt_objects_total` counter, and a wake-up of the tier-2 scrubber,
/// which moves the bytes aside and repairs the chunk from tier 1 when it still holds it.
/// Returns whether this was a new finding.
pub fn report_tier2_damage(
    tiering: &crate::tiering::Tiering,
    ch: &crate::tiering::store::ChunkRow,
    what: &str,
) -> Result<bool, CatalogError> {
    let cat = tiering.hub().catalog();
    let new = crate::tiering::store::quarantine_chunk(cat, ch, what, now_ns())?;
    if new {
        let g = tiering.hub().tier2_scrub();
        g.corrupt.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            path = %ch.path,
            stream = %tiering.hub().stream_name(ch.stream).unwrap_or_default(),
            segment = ch.segment, first_offset = ch.first_offset, end_offset = ch.end_offset,
            rows = ch.rows, what,
            "tier-2 chunk object damaged: quarantined, its records are not served"
        );
        refresh_tier2_gauge(tiering.hub())?;
        g.wake.notify_one();
    }
    Ok(new)
}

/// One line per problem for `/healthz` (empty when tier 2 holds no quarantined object).
/// The hub stays healthy (it serves everything else); this only names what is lost.
/// Tier 2's list comes first, then tier 1's.
pub fn health_detail(hub: &Hub) -> Vec<String> {
    let g = hub.tier2_scrub();
    let paths = g.quarantined_paths.read().expect("tier-2 quarantine list");
    let mut out = Vec::new();
    if !paths.is_empty() {
        out.push(format!(
            "tier 2: {} chunk object(s) quarantined (damaged, records not served):",
            paths.len()
        ));
        out.extend(paths.iter().take(20).map(|p| format!("  {p}")));
    }
    let q = hub.tier1_scrub().quarantine();
    if !q.is_empty() {
        out.push(format!(
            "tier 1: {} WAL block(s) quarantined (see {QUARANTINE_FILE})",
            q.len()
        ));
    }
    out
}

/// Appends `hub`'s `tributary_hub_tier2_*` scrub and quarantine metrics.
pub fn render_tier2_metrics(hub: &Hub, out: &mut String) {
    let g = hub.tier2_scrub();
    let mut line = |kind: &str, name: &str, help: &str, v: u64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    };
    line(
        "counter",
        "tributary_hub_tier2_scrub_runs_total",
        "Completed tier-2 scrub passes.",
        g.runs.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_scrub_failures_total",
        "Tier-2 scrub passes that stopped on an error (tier 2 down, catalog).",
        g.failures.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_scrub_objects_checked_total",
        "Tier-2 chunk objects read and verified by the scrubber.",
        g.objects_checked.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_scrub_bytes_checked_total",
        "Tier-2 chunk object bytes verified by the scrubber.",
        g.bytes_checked.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_scrub_recent_objects_checked_total",
        "Tier-2 chunk objects verified by the pass after a start (the chunks committed last).",
        g.recent_checked.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_corrupt_objects_total",
        "Tier-2 chunk objects found damaged (size, crc32c or decode) and quarantined.",
        g.corrupt.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_repaired_objects_total",
        "Quarantined tier-2 chunk objects re-uploaded from tier 1 and verified.",
        g.repaired.load(Ordering::Relaxed),
    );
    line(
        "counter",
        "tributary_hub_tier2_records_skipped_total",
        "Records readers skipped because their tier-2 chunk is quarantined.",
        g.records_skipped.load(Ordering::Relaxed),
    );
    line(
        "gauge",
        "tributary_hub_tier2_quarantined_objects",
        "Tier-2 chunk objects quarantined now (not repairable from tier 1, or not yet).",
        g.quarantined.load(Ordering::Relaxed),
    );
}

async fn bounded<T, E: Into<tier::TierError>>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, Tier2ScrubError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(|e| Tier2ScrubError::Tier2(e.into())),
        Err(_) => Err(Tier2ScrubError::Timeout(limit)),
    }
}

/// One full tier-2 pass: first the quarantine (move aside, repair), then every committed
/// chunk object of every stream is read and compared with its recorded size and crc32c
/// (objects without one are decoded instead, and get one). Reads are paced to
/// `cfg.bytes_per_sec_max`. Damaged objects are quarantined and repaired when tier 1 still
/// holds their records. `stop` ends the pass early (the report covers what was done).
pub async fn scrub_tier2(
    tiering: &Arc<crate::tiering::Tiering>,
    cfg: &Tier2ScrubConfig,
    stop: Option<&tokio::sync::watch::Receiver<bool>>,
) -> Result<Tier2ScrubReport, Tier2ScrubError> {
    use crate::tiering::store;
    let started_ns = now_ns();
    let mut report = tend_tier2_quarantine(tiering).await?;
    let cat = tiering.hub().catalog().clone();
    let started = std::time::Instant::now();
    for (sid, _) in store::streams_with_state(&cat)? {
        let mut after = None;
        loop {
            let page = store::committed_chunks_after(&cat, sid, after, 256)?;
            let Some(last) = page.last() else { break };
            after = Some((last.first_offset, last.segment));
            let quarantined = store::quarantined_in(&cat, sid)?;
            for ch in &page {
                if stopped(stop) {
                    return Ok(report);
                }
                if quarantined.contains(&(ch.segment, ch.first_offset)) {
                    continue;
                }
                check_chunk(tiering, ch, &mut report).await?;
                if !pace(cfg, &report, started, stop).await {
                    return Ok(report);
                }
            }
        }
    }
    cat.with_write_conn(|c| {
        c.execute(
            "INSERT INTO tier_meta (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            rusqlite::params![META_TIER2_SCRUB_LAST, started_ns],
        )
    })
    .map_err(CatalogError::from)?;
    tiering
        .hub()
        .tier2_scrub()
        .runs
        .fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        objects = report.objects_checked,
        bytes = report.bytes_checked,
        damaged = report.damaged.len(),
        repaired = report.repaired.len(),
        "tier-2 scrub pass done"
    );
    Ok(report)
}

/// The pass a hub runs right after it starts, before waiting for the next full pass: the
/// chunks committed in the `window` before the newest recorded commit (the last ones before
/// the stop), newest first, checked and repaired like a full pass and paced alike. These
/// are the objects a power loss or a lying disk is most likely to have damaged, and the ones
/// tier 1 most likely still holds; a full pass may be a day away. Chunks without a recorded
/// commit time (committed by older versions) are left to the full pass.
pub async fn scrub_tier2_recent(
    tiering: &Arc<crate::tiering::Tiering>,
    cfg: &Tier2ScrubConfig,
    window: Duration,
    stop: Option<&tokio::sync::watch::Receiver<bool>>,
) -> Result<Tier2ScrubReport, Tier2ScrubError> {
    use crate::tiering::store;
    let mut report = tend_tier2_quarantine(tiering).await?;
    let cat = tiering.hub().catalog().clone();
    let Some(newest) = store::last_commit_ns(&cat)? else {
        return Ok(report);
    };
    let window_ns = i64::try_from(window.as_nanos()).unwrap_or(i64::MAX);
    let since = newest.saturating_sub(window_ns);
    let started = std::time::Instant::now();
    let mut before = None;
    loop {
        let page = store::committed_since(&cat, since, before, 256)?;
        let Some((t, last)) = page.last() else { break };
        before = Some((*t, last.stream, last.segment, last.first_offset));
        for (_, ch) in &page {
            if stopped(stop) {
                return Ok(report);
            }
            if store::quarantined_in(&cat, ch.stream)?.contains(&(ch.segment, ch.first_offset)) {
                continue;
            }
            check_chunk(tiering, ch, &mut report).await?;
            tiering
                .hub()
                .tier2_scrub()
                .recent_checked
                .fetch_add(1, Ordering::Relaxed);
            if !pace(cfg, &report, started, stop).await {
                return Ok(report);
            }
        }
    }
    tracing::info!(
        objects = report.objects_checked,
        damaged = report.damaged.len(),
        repaired = report.repaired.len(),
        window = ?window,
        "tier-2 scrub of the chunks committed last before the start done"
    );
    Ok(report)
}

fn stopped(stop: Option<&tokio::sync::watch::Receiver<bool>>) -> bool {
    stop.is_some_and(|s| *s.borrow())
}

/// Reads one committed chunk object and compares it with its recorded check; quarantines
/// (and repairs, when tier 1 holds it) a damaged one, records a check for a legacy one.
async fn check_chunk(
    tiering: &Arc<crate::tiering::Tiering>,
    ch: &crate::tiering::store::ChunkRow,
    report: &mut Tier2ScrubReport,
) -> Result<(), Tier2ScrubError> {
    use crate::tiering::read::{Fetched, fetch_verified};
    use crate::tiering::store;
    let cat = tiering.hub().catalog().clone();
    let limit = tiering.config().request_timeout;
    let check = store::object_check(&cat, ch.stream, ch.segment, ch.first_offset)?;
    let fetched =
        match tokio::time::timeout(limit, fetch_verified(tiering.store(), &ch.path, check)).await {
            Err(_) => return Err(Tier2ScrubError::Timeout(limit)),
            Ok(Ok(f)) => f,
            Ok(Err(tier::GetError::NotFound { .. })) => {
                // Retention may have deleted it since the page was read.
                if store::committed_chunk(&cat, ch.stream, ch.segment, ch.first_offset)?.is_none() {
                    return Ok(());
                }
                Fetched::Damaged("object missing".into())
            }
            Ok(Err(e)) => return Err(Tier2ScrubError::Tier2(e.into())),
        };
    report.objects_checked += 1;
    report.bytes_checked += ch.bytes;
    let g = tiering.hub().tier2_scrub();
    g.objects_checked.fetch_add(1, Ordering::Relaxed);
    g.bytes_checked.fetch_add(ch.bytes, Ordering::Relaxed);
    match fetched {
        Fetched::Records(records) if check.is_none() => {
            // Legacy object: it decodes and holds the rows the catalog expects, so its
            // current bytes become its check.
            if records.len() as u64 == ch.rows
                && let Ok(bytes) = bounded(limit, tiering.store().get(&ch.path)).await
            {
                let c = store::ObjectCheck::of(&bytes);
                store::set_object_check(&cat, ch.stream, ch.segment, ch.first_offset, c)?;
                report.checks_recorded += 1;
            } else if records.len() as u64 != ch.rows {
                let what = format!(
                    "holds {} rows, the catalog committed {}",
                    records.len(),
                    ch.rows
                );
                damaged(tiering, ch, &what, report).await?;
            }
        }
        Fetched::Records(_) => {}
        Fetched::Damaged(what) => damaged(tiering, ch, &what, report).await?,
    }
    Ok(())
}

/// Paces a pass: never more than `cfg.bytes_per_sec_max` of tier 2. `false`: stopped.
async fn pace(
    cfg: &Tier2ScrubConfig,
    report: &Tier2ScrubReport,
    started: std::time::Instant,
    stop: Option<&tokio::sync::watch::Receiver<bool>>,
) -> bool {
    if cfg.bytes_per_sec_max == 0 {
        return true;
    }
    let due = Duration::from_secs_f64(report.bytes_checked as f64 / cfg.bytes_per_sec_max as f64);
    let Some(ahead) = due.checked_sub(started.elapsed()) else {
        return true;
    };
    match stop {
        Some(s) => {
            let mut s = s.clone();
            tokio::select! {
                _ = tokio::time::sleep(ahead) => true,
                _ = s.wait_for(|v| *v) => false,
            }
        }
        None => {
            tokio::time::sleep(ahead).await;
            true
        }
    }
}

/// A damaged object found by the pass: confirm under the round lock (a repair or an upload
/// may just have replaced it), quarantine, then tend it at once.
async fn damaged(
    tiering: &Arc<crate::tiering::Tiering>,
    ch: &crate::tiering::store::ChunkRow,
    what: &str,
    report: &mut Tier2ScrubReport,
) -> Result<(), Tier2ScrubError> {
    if report_tier2_damage(tiering, ch, what)? {
        report.damaged.push(ch.path.clone());
    }
    let more = tend_tier2_quarantine(tiering).await?;
    report.repaired.extend(more.repaired);
    for p in more.unrepairable {
        if !report.unrepairable.contains(&p) {
            report.unrepairable.push(p);
        }
    }
    Ok(())
}

/// Works through every quarantined chunk: moves its damaged bytes to
/// [`TIER2_QUARANTINE_PREFIX`] (out of `streams/`, so SQL engines stop reading them), then
/// re-uploads it from tier 1 if tier 1 still holds all its records (same name, so SQL engines
/// see it again exactly once), verifies it and records its new check; otherwise it stays
/// quarantined and reported. Runs under the uploader's round lock, so that no upload,
/// eviction or retention interleaves.
pub async fn tend_tier2_quarantine(
    tiering: &Arc<crate::tiering::Tiering>,
) -> Result<Tier2ScrubReport, Tier2ScrubError> {
    use crate::tiering::read::{Fetched, fetch_verified};
    use crate::tiering::store;
    let cat = tiering.hub().catalog().clone();
    let limit = tiering.config().request_timeout;
    let mut report = Tier2ScrubReport::default();
    let list: Vec<_> = store::quarantine_list(&cat)?
        .into_iter()
        .filter(|q| q.state == store::QUARANTINED)
        .collect();
    if list.is_empty() {
        return Ok(report);
    }
    let _round = tiering.lock_rounds().await;
    for q in list {
        let Some(ch) = store::committed_chunk(&cat, q.stream, q.segment, q.first_offset)? else {
            continue; // deleted by retention
        };
        let check = store::object_check(&cat, q.stream, q.segment, q.first_offset)?;
        if !q.moved {
            match bounded(limit, fetch_verified(tiering.store(), &q.path, check)).await {
                Ok(Fetched::Records(_)) if check.is_some() => {
                    // Good again (a transient read, or already replaced): serve it.
                    tracing::warn!(path = %q.path, "tier-2 chunk object reads clean now: released from quarantine");
                    store::set_repaired(&cat, &q, now_ns())?;
                    continue;
                }
                Ok(_) => {
                    let bytes = bounded(limit, tiering.store().get(&q.path)).await?;
                    let aside = format!("{TIER2_QUARANTINE_PREFIX}{}", q.path);
                    bounded(limit, tiering.store().raw_put(&aside, bytes)).await?;
                    bounded(limit, tiering.store().delete(&q.path)).await?;
                    tracing::warn!(path = %q.path, to = %aside, "moved a damaged tier-2 chunk object aside");
                }
                Err(Tier2ScrubError::Tier2(tier::TierError::Get(tier::GetError::NotFound {
                    ..
                }))) => {}
                Err(e) => return Err(e),
            }
            store::set_quarantine_moved(&cat, &q)?;
        }
        match repair_from_tier1(tiering, &ch).await {
            Ok(true) => {
                store::set_repaired(&cat, &q, now_ns())?;
                tiering
                    .hub()
                    .tier2_scrub()
                    .repaired
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(path = %q.path, rows = ch.rows, "tier-2 chunk object repaired from tier 1");
                report.repaired.push(q.path.clone());
            }
            Ok(false) => {
                tracing::warn!(
                    path = %q.path, first_offset = q.first_offset, end_offset = q.end_offset,
                    "quarantined tier-2 chunk cannot be repaired: tier 1 no longer holds its records"
                );
                report.unrepairable.push(q.path.clone());
            }
            Err(e) => {
                tracing::error!(path = %q.path, error = %e, "repairing a tier-2 chunk object failed; retried on the next pass");
                report.unrepairable.push(q.path.clone());
            }
        }
    }
    refresh_tier2_gauge(tiering.hub())?;
    Ok(report)
}

/// Re-uploads `ch` from tier 1: the same records (its offsets, its segment's keys) encoded with
/// the columns its manifest lists, to the same name; verified; the new size and crc32c and
/// the manifest updated. `Ok(false)` when tier 1 no longer holds every record of it.
async fn repair_from_tier1(
    tiering: &Arc<crate::tiering::Tiering>,
    ch: &crate::tiering::store::ChunkRow,
) -> Result<bool, Tier2ScrubError> {
    use crate::tiering::store;
    let hub = tiering.hub().clone();
    let cat = hub.catalog().clone();
    let limit = tiering.config().request_timeout;
    let st = store::state(&cat, ch.stream)?;
    if ch.first_offset < st.evicted_end {
        return Ok(false);
    }
    let Some(stream) = hub.stream_name(ch.stream) else {
        return Ok(false);
    };
    let manifest_path = tier::manifest_path(&stream, ch.segment, ch.first_offset);
    let manifest = bounded(limit, tiering.store().get_manifest(&manifest_path))
        .await
        .ok();
    let columns = match &manifest {
        Some(m) => m.columns.clone(),
        None => store::fields(&cat, ch.stream)?,
    };
    let row = ch.clone();
    let h = hub.clone();
    let encoded = tokio::task::spawn_blocking(move || {
        let seg =
            crate::tiering::segments_overlapping(&h, row.stream, row.first_offset, row.end_offset)
                .ok()
                .and_then(|v| v.into_iter().find(|s| s.id == row.segment))
                .map(|s| crate::tiering::SegmentSpan {
                    start: row.first_offset,
                    end: Some(row.end_offset),
                    ..s
                })
                .unwrap_or(crate::tiering::SegmentSpan {
                    id: row.segment,
                    start: row.first_offset,
                    end: Some(row.end_offset),
                    ..crate::tiering::SegmentSpan::WHOLE
                });
        let records = crate::tiering::chunk_records(&h, &row, &seg).map_err(|e| e.to_string())?;
        if records.len() as u64 != row.rows {
            return Err(format!(
                "tier 1 yields {} records, the chunk held {}",
                records.len(),
                row.rows
            ));
        }
        let mut registry = tier::FieldRegistry::from_columns(columns).map_err(|e| e.to_string())?;
        registry.observe_records(&records);
        let mut opts = tier::EncodeOptions::default();
        opts.metadata.push(("tributary.stream".into(), stream));
        opts.metadata
            .push(("tributary.segment".into(), row.segment.to_string()));
        tier::encode_chunk(&records, &registry, &opts)
            .map(|(bytes, summary)| (bytes, summary, registry.columns().to_vec()))
            .map_err(|e| e.to_string())
    })
    .await;
    let (bytes, summary, columns) = match encoded {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::warn!(path = %ch.path, error = %e, "cannot rebuild a tier-2 chunk from tier 1");
            return Ok(false);
        }
        Err(e) => {
            tracing::warn!(path = %ch.path, error = %e, "rebuilding a tier-2 chunk failed");
            return Ok(false);
        }
    };
    let check = store::ObjectCheck::of(&bytes);
    bounded(
        limit,
        tiering.store().upload_chunk(&ch.path, bytes, &summary),
    )
    .await?;
    store::set_object_check(&cat, ch.stream, ch.segment, ch.first_offset, check)?;
    if let Some(mut m) = manifest {
        m.summary = summary;
        m.columns = columns;
        if !m.extra.is_object() {
            m.extra = serde_json::json!({});
        }
        m.extra["crc32c"] = check.crc32c.into();
        m.extra["repaired_ns"] = now_ns().into();
        bounded(limit, tiering.store().put_manifest(&m)).await?;
    }
    Ok(true)
}

/// The background tier-2 scrubber: at start it checks the chunks committed last before the
/// stop ([`scrub_tier2_recent`]); it tends the quarantine at start and whenever a reader
/// quarantines something, and runs a full pass every `interval` (measured from the last
/// complete pass, persisted in the catalog, so frequent restarts do not postpone it forever).
pub fn start_tier2(
    tiering: Arc<crate::tiering::Tiering>,
    cfg: Tier2ScrubConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let g = tiering.hub().tier2_scrub();
        if let Err(e) = refresh_tier2_gauge(tiering.hub()) {
            tracing::error!(error = %e, "reading the tier-2 quarantine");
        }
        // First the chunks committed last before the stop, not a whole interval later.
        if let Err(e) = scrub_tier2_recent(&tiering, &cfg, cfg.restart_window, Some(&stop)).await {
            g.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "tier-2 scrub of the recent chunks failed; the full pass covers them");
        }
        if *stop.borrow() {
            return;
        }
        loop {
            if let Err(e) = tend_tier2_quarantine(&tiering).await {
                tracing::warn!(error = %e, "tending the tier-2 quarantine failed; retried later");
            }
            let last: i64 = tiering
                .hub()
                .catalog()
                .with_read_conn(|c| {
                    c.query_row(
                        "SELECT value FROM tier_meta WHERE key = ?1",
                        [META_TIER2_SCRUB_LAST],
                        |r| r.get(0),
                    )
                })
                .unwrap_or(0);
            let since = Duration::from_nanos(now_ns().saturating_sub(last).max(0) as u64);
            let wait = cfg.interval.saturating_sub(since);
            let full = tokio::select! {
                _ = tokio::time::sleep(wait) => true,
                _ = g.wake.notified() => false,
                _ = stop.wait_for(|s| *s) => return,
            };
            if !full {
                continue;
            }
            if let Err(e) = scrub_tier2(&tiering, &cfg, Some(&stop)).await {
                g.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "tier-2 scrub pass failed; retried after the poll interval");
                tokio::select! {
                    _ = tokio::time::sleep(tiering.config().poll_interval.max(Duration::from_secs(60))) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
            if *stop.borrow() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HubConfig;
    use std::os::unix::fs::FileExt;
    use sync::block::{EncodeOptions, encode_block_with};
    use sync::record::{Record, Value};

    /// Incompressible bytes (xorshift), so a few blocks fill 1 MiB WAL segments.
    fn noise(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn block(epoch: u64, first: u64, n: u64) -> Vec<u8> {
        let records: Vec<Record> = (0..n)
            .map(|i| Record {
                tags: Vec::new(),
                key: format!("k{}", i % 3),
                ts: 1_000 + (first + i) as i64,
                fields: vec![
                    ("v".into(), Value::I64((first + i) as i64)),
                    ("blob".into(), Value::Bytes(noise(first + i, 16 << 10))),
                ],
            })
            .collect();
        encode_block_with(&EncodeOptions::default(), epoch, first, &records).expect("encode")
    }

    fn cfg(dir: &Path) -> HubConfig {
        let text = format!(
            "data_dir = {:?}\n[wal]\nsegment_bytes_max = \"1 MiB\"\n",
            dir.to_str().expect("utf-8")
        );
        HubConfig::from_toml(&text).expect("config")
    }

    #[tokio::test]
    async fn a_flipped_byte_in_a_sealed_file_is_found_and_quarantined() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = cfg(dir.path());
        let hub = Hub::open(&cfg).expect("open");
        let mut first = 1;
        for _ in 0..20 {
            hub.commit_block("dev-1", "s", &block(1, first, 20))
                .await
                .expect("commit");
            first += 20;
        }
        let names = |_: &BlockRow| ("dev-1".to_string(), "s".to_string());
        let clean = scrub_wal(
            hub.catalog(),
            hub.wal_reader(),
            &cfg.wal_dir(),
            &names,
            &hub.stored_decode_limits(),
        )
        .expect("scrub");
        assert!(clean.files >= 3, "the WAL did not roll: {clean:?}");
        assert_eq!(clean.blocks_checked, 20);
        assert!(clean.damaged.is_empty());

        // Flip one byte inside the second block of the oldest (sealed) file.
        let files = list_wal_files(&cfg.wal_dir()).expect("list");
        let rows = hub.catalog().blocks_in_wal_file(files[0]).expect("rows");
        assert!(rows.len() >= 2, "{rows:?}");
        let target = &rows[1];
        let path = crate::wal::wal_file_path(&cfg.wal_dir(), files[0]);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open wal");
        let at = target.wal_pos + u64::from(target.frame_len) - 3;
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at).expect("read");
        file.write_all_at(&[byte[0] ^ 0x10], at).expect("flip");

        let found = scrub_wal(
            hub.catalog(),
            hub.wal_reader(),
            &cfg.wal_dir(),
            &names,
            &hub.stored_decode_limits(),
        )
        .expect("scrub");
        assert_eq!(found.blocks_checked, 20);
        assert_eq!(found.damaged.len(), 1, "{found:?}");
        let d = &found.damaged[0];
        assert_eq!(
            (d.first_seq, d.last_seq),
            (target.first_seq, target.last_seq)
        );
        assert!(d.what.contains("checksum"), "{}", d.what);

        let q = Quarantine::load(dir.path()).expect("load");
        assert_eq!(q.add(&found.damaged).expect("add"), 1);
        assert_eq!(q.add(&found.damaged).expect("add again"), 0);
        let reloaded = Quarantine::load(dir.path()).expect("reload");
        assert!(reloaded.contains(target.wal_file, target.wal_pos));
        assert_eq!(reloaded.list(), found.damaged);
        hub.shutdown();
    }

    #[test]
    fn object_checks_name_truncation_and_bit_rot() {
        use crate::tiering::store::ObjectCheck;
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let check = ObjectCheck::of(&bytes);
        assert_eq!(check.mismatch(&bytes), None);
        let what = check.mismatch(&bytes[..4000]).expect("truncated");
        assert!(what.contains("size 4000"), "{what}");
        let mut flipped = bytes.clone();
        flipped[2048] ^= 0x20;
        let what = check.mismatch(&flipped).expect("flipped");
        assert!(what.contains("crc32c"), "{what}");
        assert_eq!(
            check.mismatch(&[]).map(|w| w.contains("size 0")),
            Some(true)
        );
    }

    #[test]
    fn a_garbled_quarantine_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(QUARANTINE_FILE), b"{not json").expect("write");
        assert!(matches!(
            Quarantine::load(dir.path()),
            Err(ScrubError::BadQuarantine { .. })
        ));
    }
}
