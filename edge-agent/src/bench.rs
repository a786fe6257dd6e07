//! `edge-agent bench append`: durable append throughput and latency on this device's storage.
//!
//! Operators run it to qualify a device, because SD cards and eMMC vary enormously. For each
//! fsync policy (`always`, `interval:10ms`, `never`), record size (100 and 1000 bytes), producer
//! count (1 and 64) and batch size (1 and 1000 records), it appends through the real log on the
//! real file system and reports one line: records/s, MB/s, the number of fsyncs, and the p50 and
//! p99 latency from the append call to its durable acknowledgement.
//!
//! In the same run it measures the disk's own limits, so the figures sit next to what the
//! hardware can do: sequential write speed (256 MiB in 1 MiB writes, then fdatasync) and the
//! fdatasync rate (a 4 KiB write plus fdatasync, repeated).
//!
//! fsyncs are counted by wrapping the storage: every `WriteFile::sync` and `sync_dir` is one.

use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::Rng as _;
use rand::SeedableRng as _;
use serde::Serialize;
use sync::{Record, Value};
use thiserror::Error;

use crate::config::fsync_name;
use crate::log::{AppendError, FsyncPolicy, Log, LogConfig, LogHandle, OnFull, OpenError};
use crate::storage::{RealStorage, Storage, WriteFile};

/// The longest a single configuration runs, whatever `records` says.
pub const CONFIG_SECONDS_MAX: Duration = Duration::from_secs(3);

/// What to measure.
#[derive(Debug, Clone)]
pub struct AppendOptions {
    /// One JSON object per line instead of a table.
    pub json: bool,
    /// Where to write; a fresh directory under the current one when `None`.
    pub dir: Option<PathBuf>,
    /// Records per configuration (each also stops after [`CONFIG_SECONDS_MAX`]).
    pub records: u64,
    /// Measure the disk's sequential write and fdatasync rate too.
    pub disk: bool,
}

/// Why the benchmark could not run.
#[derive(Debug, Error)]
pub enum BenchError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("opening the log: {0}")]
    Open(#[from] OpenError),
    #[error("append failed: {0}")]
    Append(#[from] AppendError),
    #[error("starting the async runtime: {0}")]
    Runtime(io::Error),
}

/// One configuration's result: the keys `bench append --json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct AppendResult {
    pub kind: &'static str,
    pub fsync: String,
    pub record_bytes: usize,
    pub producers: usize,
    pub batch_records: usize,
    pub records: u64,
    pub seconds: f64,
    pub records_per_s: f64,
    pub mb_per_s: f64,
    pub fsyncs: u64,
    pub p50_us: u64,
    pub p99_us: u64,
}

/// The disk's own limits, measured in the same directory.
#[derive(Debug, Clone, Serialize)]
pub struct DiskResult {
    pub kind: &'static str,
    pub dir: String,
    pub seq_write_mb_per_s: f64,
    pub fdatasync_per_s: f64,
    pub fdatasync_p50_us: u64,
    pub fdatasync_p99_us: u64,
}

/// One configuration to run.
#[derive(Debug, Clone)]
pub struct AppendSpec {
    pub fsync: FsyncPolicy,
    pub record_bytes: usize,
    pub producers: usize,
    pub batch_records: usize,
    pub records: u64,
    pub seconds_max: Duration,
}

/// Runs every configuration and prints the results.
pub fn run_append(opts: &AppendOptions) -> Result<(), BenchError> {
    let dir = opts
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!(".tributary-bench-{}", std::process::id())));
    let created = !dir.exists();
    std::fs::create_dir_all(&dir).map_err(|source| BenchError::Io {
        what: "creating",
        path: dir.clone(),
        source,
    })?;
    let result = run_all(opts, &dir);
    if created {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn run_all(opts: &AppendOptions, dir: &Path) -> Result<(), BenchError> {
    if !opts.json {
        println!(
            "{:<14} {:>6} {:>9} {:>6} {:>9} {:>12} {:>8} {:>7} {:>9} {:>9}",
            "fsync",
            "bytes",
            "producers",
            "batch",
            "records",
            "records/s",
            "MB/s",
            "fsyncs",
            "p50 us",
            "p99 us"
        );
    }
    if opts.disk {
        let disk = measure_disk(dir)?;
        print_line(opts.json, &disk, || {
            format!(
                "disk: sequential write {:.1} MB/s, fdatasync {:.0}/s (p50 {} us, p99 {} us) in {}",
                disk.seq_write_mb_per_s,
                disk.fdatasync_per_s,
                disk.fdatasync_p50_us,
                disk.fdatasync_p99_us,
                disk.dir
            )
        });
    }
    let policies = [
        FsyncPolicy::Always,
        FsyncPolicy::Interval(Duration::from_millis(10)),
        FsyncPolicy::Never,
    ];
    for (i, spec) in specs(&policies, opts.records).into_iter().enumerate() {
        let run_dir = dir.join(format!("run-{i}"));
        let r = run_one(&spec, &run_dir);
        let _ = std::fs::remove_dir_all(&run_dir);
        let r = r?;
        print_line(opts.json, &r, || {
            format!(
                "{:<14} {:>6} {:>9} {:>6} {:>9} {:>12.0} {:>8.1} {:>7} {:>9} {:>9}",
                r.fsync,
                r.record_bytes,
                r.producers,
                r.batch_records,
                r.records,
                r.records_per_s,
                r.mb_per_s,
                r.fsyncs,
                r.p50_us,
                r.p99_us
            )
        });
    }
    Ok(())
}

/// Every combination of policy, record size, producers and batch size.
pub fn specs(policies: &[FsyncPolicy], records: u64) -> Vec<AppendSpec> {
    let mut out = Vec::new();
    for fsync in policies {
        for record_bytes in [100, 1000] {
            for producers in [1, 64] {
                for batch_records in [1, 1000] {
                    out.push(AppendSpec {
                        fsync: *fsync,
                        record_bytes,
                        producers,
                        batch_records,
                        records,
                        seconds_max: CONFIG_SECONDS_MAX,
                    });
                }
            }
        }
    }
    out
}

fn print_line<T: Serialize>(json: bool, value: &T, table: impl FnOnce() -> String) {
    if json {
        println!("{}", serde_json::to_string(value).unwrap_or_default());
    } else {
        println!("{}", table());
    }
    let _ = io::stdout().flush();
}

/// Runs one configuration in a fresh log under `dir`.
pub fn run_one(spec: &AppendSpec, dir: &Path) -> Result<AppendResult, BenchError> {
    let counter = Arc::new(AtomicU64::new(0));
    let storage: Arc<dyn Storage> = Arc::new(CountingStorage {
        inner: RealStorage,
        syncs: counter.clone(),
    });
    let cfg = LogConfig {
        data_dir: dir.to_owned(),
        streams: vec!["bench".into()],
        fsync: spec.fsync,
        disk_bytes_max: u64::MAX / 2,
        on_full: OnFull::Block,
        ..LogConfig::default()
    };
    let (log, _) = Log::open(cfg, storage)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    let syncs_before = counter.load(Ordering::Relaxed);
    let started = Instant::now();
    let samples = runtime.block_on(produce(&log, spec))?;
    let seconds = started.elapsed().as_secs_f64();
    let fsyncs = counter.load(Ordering::Relaxed) - syncs_before;
    log.shutdown();
    let records = samples.len() as u64 * spec.batch_records as u64;
    let (p50_us, p99_us) = percentiles(samples);
    let records_per_s = records as f64 / seconds;
    Ok(AppendResult {
        kind: "append",
        fsync: fsync_name(&spec.fsync),
        record_bytes: spec.record_bytes,
        producers: spec.producers,
        batch_records: spec.batch_records,
        records,
        seconds: (seconds * 1000.0).round() / 1000.0,
        records_per_s: records_per_s.round(),
        mb_per_s: (records_per_s * spec.record_bytes as f64 / 1e6 * 10.0).round() / 10.0,
        fsyncs,
        p50_us,
        p99_us,
    })
}

/// Runs the producers; returns one latency sample (µs) per append call.
async fn produce(log: &LogHandle, spec: &AppendSpec) -> Result<Vec<u32>, BenchError> {
    let deadline = Instant::now() + spec.seconds_max;
    let per_producer = spec
        .records
        .div_ceil(spec.producers as u64)
        .div_ceil(spec.batch_records as u64);
    let pool = Arc::new(record_pool(spec.record_bytes, 1024));
    let mut tasks = Vec::with_capacity(spec.producers);
    for p in 0..spec.producers {
        let (log, pool, batch) = (log.clone(), pool.clone(), spec.batch_records);
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::with_capacity(per_producer.min(1 << 20) as usize);
            for i in 0..per_producer {
                if Instant::now() >= deadline {
                    break;
                }
                let start = (p * 7919 + i as usize * batch) % pool.len();
                let records: Vec<Record> = (0..batch)
                    .map(|j| pool[(start + j) % pool.len()].clone())
                    .collect();
                let t = Instant::now();
                log.append("bench", records).await?;
                samples.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
            }
            Ok::<_, AppendError>(samples)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(
            t.await
                .map_err(|e| BenchError::Runtime(io::Error::other(e)))??,
        );
    }
    Ok(all)
}

/// Records whose `approx_bytes` is `record_bytes`: a key, a timestamp, two numbers and a
/// random alphanumeric payload (random so that compression does not flatter the figures).
pub fn record_pool(record_bytes: usize, n: usize) -> Vec<Record> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    (0..n)
        .map(|i| {
            let mut r = Record {
                tags: Vec::new(),
                key: format!("bench-{:04}/sensor", i % 64),
                ts: 1_764_374_400_000_000_000 + i as i64 * 1_000_000,
                fields: vec![
                    ("value".into(), Value::F64(rng.random::<f64>() * 100.0)),
                    ("count".into(), Value::I64(i as i64)),
                ],
            };
            let pad = record_bytes.saturating_sub(r.approx_bytes() + "payload".len() + 2);
            let payload: String = (0..pad)
                .map(|_| char::from(rng.sample(rand::distr::Alphanumeric)))
                .collect();
            r.fields.push(("payload".into(), Value::Str(payload)));
            r
        })
        .collect()
}

/// p50 and p99 of latency samples in µs.
fn percentiles(mut samples: Vec<u32>) -> (u64, u64) {
    if samples.is_empty() {
        return (0, 0);
    }
    samples.sort_unstable();
    let at = |q: f64| u64::from(samples[((samples.len() - 1) as f64 * q).round() as usize]);
    (at(0.50), at(0.99))
}

/// The fdatasync rate and sequential write MB/s, in `dir`. The fdatasync loop runs first, so
/// the writeback of the large sequential file cannot slow it down.
pub fn measure_disk(dir: &Path) -> Result<DiskResult, BenchError> {
    let io_err = |what: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| BenchError::Io { what, path, source }
    };
    let path = dir.join("disk-sync.bin");
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io_err("creating", &path))?;
    let block = vec![0x5Au8; 4096];
    let (mut samples, started) = (Vec::new(), Instant::now());
    while samples.len() < 2000 && started.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        f.write_all(&block).map_err(io_err("writing", &path))?;
        f.sync_data().map_err(io_err("fdatasync", &path))?;
        samples.push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
    }
    let fdatasync_per_s = samples.len() as f64 / started.elapsed().as_secs_f64();
    drop(f);
    let _ = std::fs::remove_file(&path);
    let path = dir.join("disk-seq.bin");
    let chunk = vec![0xA5u8; 1 << 20];
    let started = Instant::now();
    let mut f = File::create(&path).map_err(io_err("creating", &path))?;
    for _ in 0..256 {
        f.write_all(&chunk).map_err(io_err("writing", &path))?;
    }
    f.sync_data().map_err(io_err("fdatasync", &path))?;
    let seq_write_mb_per_s = 256.0 * 1.048_576 / started.elapsed().as_secs_f64();
    drop(f);
    let _ = std::fs::remove_file(&path);

    let (fdatasync_p50_us, fdatasync_p99_us) = percentiles(samples);
    Ok(DiskResult {
        kind: "disk",
        dir: dir
            .canonicalize()
            .unwrap_or_else(|_| dir.to_owned())
            .display()
            .to_string(),
        seq_write_mb_per_s: (seq_write_mb_per_s * 10.0).round() / 10.0,
        fdatasync_per_s: fdatasync_per_s.round(),
        fdatasync_p50_us,
        fdatasync_p99_us,
    })
}

/// Real storage that counts every file and directory fsync.
#[derive(Debug)]
struct CountingStorage {
    inner: RealStorage,
    syncs: Arc<AtomicU64>,
}

#[derive(Debug)]
struct CountingFile {
    inner: Box<dyn WriteFile>,
    syncs: Arc<AtomicU64>,
}

impl WriteFile for CountingFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.inner.append(data)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
}

impl Storage for CountingStorage {
    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let inner = self.inner.create(path)?;
        Ok(Box::new(CountingFile {
            inner,
            syncs: self.syncs.clone(),
        }))
    }
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let inner = self.inner.open_append(path)?;
        Ok(Box::new(CountingFile {
            inner,
            syncs: self.syncs.clone(),
        }))
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.inner.read(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.inner.read_at(path, offset, len)
    }
    fn len(&self, path: &Path) -> io::Result<u64> {
        self.inner.len(path)
    }
    fn exists(&self, path: &Path) -> bool {
        self.inner.exists(path)
    }
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.inner.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.inner.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.inner.create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.inner.sync_dir(dir)
    }
    fn available_bytes(&self, dir: &Path) -> Option<u64> {
        self.inner.available_bytes(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_records_have_the_requested_size() {
        for size in [100, 1000] {
            for r in record_pool(size, 16) {
                assert_eq!(r.approx_bytes(), size);
            }
        }
    }

    #[test]
    fn percentiles_of_known_samples() {
        assert_eq!(percentiles((1..=100).collect()), (51, 99));
        assert_eq!(percentiles(vec![]), (0, 0));
    }

    #[test]
    fn every_policy_size_producer_count_and_batch_is_covered() {
        let s = specs(&[FsyncPolicy::Always, FsyncPolicy::Never], 10);
        assert_eq!(s.len(), 2 * 2 * 2 * 2);
        assert!(
            s.iter().any(|s| s.producers == 64
                && s.batch_records == 1
                && s.fsync == FsyncPolicy::Always)
        );
    }
}
