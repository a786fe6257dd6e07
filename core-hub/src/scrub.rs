//! Scrubbing tier 1 at rest: finding bit flips in WAL files before a reader trips over them.
//!
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
//!   list survives restarts and operators can read it), and in a process-wide set that the
//!   reader consults through [`is_quarantined`] to skip them, so the rest of the stream is
//!   still served.
//!
//! The records of a damaged block are lost at the hub, but not necessarily anywhere: an agent
//! that still holds them can be asked to resend (a later issue); until then the quarantine
//! file is the authoritative list of what is missing.
//!
//! # Hooks (outside this file)
//!
//! - `main.rs`, after `Hub::open`: `let _scrub = core_hub::scrub::Scrubber::start(hub.clone(), &cfg.data_dir, core_hub::scrub::DEFAULT_INTERVAL);`
//! - `read.rs`, first line of the loop over index rows in `read_records`:
//!   `if crate::scrub::is_quarantined(row) { continue; }`
//! - `metrics.rs`, in `render`: `crate::scrub::render_metrics(&mut out);`

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
/// come from `names` (`(device id, stream id) -> (device, stream)`).
pub fn scrub_wal(
    catalog: &Catalog,
    reader: &WalReader,
    wal_dir: &Path,
    names: &dyn Fn(&BlockRow) -> (String, String),
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
                Ok((entry, _)) => {
                    let same = entry.kind == KIND_BLOCK
                        && entry.device == row.device
                        && entry.stream == row.stream
                        && entry.epoch == row.epoch
                        && entry.first_seq == row.first_seq
                        && u64::from(entry.count) == row.count()
                        && entry.hub_offset_base == row.hub_offset_base;
                    (!same).then(|| "entry header differs from the index row".to_string())
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

/// Process-wide counters and the quarantine the reader consults.
#[derive(Debug, Default)]
struct Global {
    quarantine: RwLock<Option<Arc<Quarantine>>>,
    runs: AtomicU64,
    failures: AtomicU64,
    blocks_checked: AtomicU64,
    bytes_checked: AtomicU64,
}

fn global() -> &'static Global {
    static GLOBAL: std::sync::OnceLock<Global> = std::sync::OnceLock::new();
    GLOBAL.get_or_init(Global::default)
}

/// Whether the block of `row` is quarantined (the reader skips it). False until a
/// [`Scrubber`] runs in this process. One hub per process: the set is process-wide.
pub fn is_quarantined(row: &BlockRow) -> bool {
    global()
        .quarantine
        .read()
        .expect("quarantine slot")
        .as_ref()
        .is_some_and(|q| q.contains(row.wal_file, row.wal_pos))
}

/// Appends the `tributary_hub_scrub_*` metrics in Prometheus text format.
pub fn render_metrics(out: &mut String) {
    let g = global();
    let quarantined = g
        .quarantine
        .read()
        .expect("quarantine slot")
        .as_ref()
        .map_or(0, |q| q.len());
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
}

/// A background thread that scrubs at start and then every `interval`.
pub struct Scrubber {
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scrubber {
    /// Loads the quarantine list (so the reader skips known damage at once) and starts the
    /// thread. A quarantine file that cannot be read is logged and replaced by an empty list.
    pub fn start(hub: Arc<Hub>, data_dir: &Path, interval: Duration) -> Scrubber {
        let quarantine = Quarantine::load(data_dir).unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot load the quarantine list; starting empty");
            Quarantine {
                path: data_dir.join(QUARANTINE_FILE),
                blocks: RwLock::new(BTreeMap::new()),
            }
        });
        let quarantine = Arc::new(quarantine);
        if !quarantine.is_empty() {
            tracing::warn!(
                blocks = quarantine.len(),
                "tier-1 blocks are quarantined (see {QUARANTINE_FILE})"
            );
        }
        *global().quarantine.write().expect("quarantine slot") = Some(quarantine.clone());
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
    let g = global();
    let names = |row: &BlockRow| {
        (
            hub.device_name(row.device)
                .unwrap_or_else(|| format!("#{}", row.device)),
            hub.stream_name(row.stream)
                .unwrap_or_else(|| format!("#{}", row.stream)),
        )
    };
    let report = match scrub_wal(hub.catalog(), hub.wal_reader(), wal_dir, &names) {
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
                device = %d.device, stream = %d.stream, epoch = d.epoch,
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
        let clean =
            scrub_wal(hub.catalog(), hub.wal_reader(), &cfg.wal_dir(), &names).expect("scrub");
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

        let found =
            scrub_wal(hub.catalog(), hub.wal_reader(), &cfg.wal_dir(), &names).expect("scrub");
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
    fn a_garbled_quarantine_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(QUARANTINE_FILE), b"{not json").expect("write");
        assert!(matches!(
            Quarantine::load(dir.path()),
            Err(ScrubError::BadQuarantine { .. })
        ));
    }
}
