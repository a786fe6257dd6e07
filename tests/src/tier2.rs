//! Looking at the hub's tier 2 from outside, for the crash-loop and catalog-rebuild system tests.
//!
//! - [`tier_progress`] reads the hub's catalog (`catalog.sqlite`, read-only, with python's
//!   `sqlite3`): the stream's next offset and the tiering marks `planned_end`, `tiered_end`,
//!   `evicted_end`, plus the chunk rows not yet committed. `/metrics` has tiering counters
//!   (`tributary_hub_tier_*`), but per-stream marks and uncommitted chunk rows are only in the
//!   catalog, which is the ground truth of what is tiered anyway.
//! - [`parquet_ids`] reads `<tier2>/streams/<stream>/**/*.parquet` with python `duckdb` (as SQL
//!   users will), returning the row count, the distinct `(device, epoch, seq)` count and the ids.
//!
//! python3 with `duckdb` is a test prerequisite (`pip install duckdb`, see docs/tiering.md).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};

use crate::cluster::{HubSpec, Pki, START_TIMEOUT};
use crate::procs::{Proc, ProcSpec, bin_path, wait_until};

/// One stream's tiering state, from the hub's catalog.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierProgress {
    /// Records committed in tier 1 (the stream's next offset).
    pub next_offset: u64,
    /// Offsets below this are in chunk rows (planned, maybe uploaded).
    pub planned_end: u64,
    /// Offsets below this are in committed tier-2 chunks.
    pub tiered_end: u64,
    /// Offsets below this were evicted from tier 1.
    pub evicted_end: u64,
    /// Chunk rows planned or uploaded but not committed: an upload in flight or to be redone.
    pub open_chunks: u64,
}

impl TierProgress {
    /// Whether an upload is in flight (chunks planned, not committed).
    pub fn uploading(&self) -> bool {
        self.open_chunks > 0 || self.planned_end > self.tiered_end
    }

    /// Whether committed records still wait to be tiered.
    pub fn pending(&self) -> bool {
        self.next_offset > self.tiered_end
    }
}

const PROGRESS_PY: &str = r#"
import sqlite3, sys
c = sqlite3.connect('file:' + sys.argv[1] + '?mode=ro', uri=True, timeout=10)
row = c.execute("select id, next_offset from streams where name = ?", (sys.argv[2],)).fetchone()
if row is None:
    print("0 0 0 0 0"); sys.exit(0)
sid, nxt = row
try:
    t = c.execute("select planned_end, tiered_end, evicted_end from tier_state where stream = ?", (sid,)).fetchone() or (0, 0, 0)
    n = c.execute("select count(*) from tier_chunks where stream = ? and state != 2", (sid,)).fetchone()[0]
except sqlite3.OperationalError:
    t, n = (0, 0, 0), 0
print(nxt, t[0], t[1], t[2], n)
"#;

/// Reads `stream`'s tiering state from the catalog at `catalog` (the hub may be running).
pub fn tier_progress(catalog: &Path, stream: &str) -> Result<TierProgress> {
    let out = python(&[
        "-c",
        PROGRESS_PY,
        catalog.to_str().context("catalog path not UTF-8")?,
        stream,
    ])?;
    let v: Vec<u64> = out
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing tier progress {out:?}"))?;
    ensure!(v.len() == 5, "tier progress {out:?}");
    Ok(TierProgress {
        next_offset: v[0],
        planned_end: v[1],
        tiered_end: v[2],
        evicted_end: v[3],
        open_chunks: v[4],
    })
}

/// Waits until every committed record of `stream` (at least `min_records`) is in tier 2.
pub fn wait_tiered(
    catalog: &Path,
    stream: &str,
    min_records: u64,
    timeout: Duration,
) -> Result<TierProgress> {
    let mut last = TierProgress::default();
    wait_until(
        timeout,
        "tier 2 to catch up (tiered_end == next_offset)",
        || match tier_progress(catalog, stream) {
            Ok(p) => {
                last = p;
                p.next_offset >= min_records && p.tiered_end == p.next_offset
            }
            Err(_) => false,
        },
    )
    .with_context(|| format!("last tier progress: {last:?}"))?;
    Ok(last)
}

/// What DuckDB sees in tier 2 for a stream.
#[derive(Debug, Clone, Default)]
pub struct ParquetSummary {
    pub rows: u64,
    pub distinct: u64,
    /// Every distinct `(device, epoch, seq)`.
    pub ids: BTreeSet<(String, u64, u64)>,
}

const DUCKDB_PY: &str = r#"
import duckdb, glob, sys
pattern = sys.argv[1] + '/streams/' + sys.argv[2] + '/**/*.parquet'
if not glob.glob(pattern, recursive=True):
    print("0 0"); sys.exit(0)
c = duckdb.connect()
src = "read_parquet('%s', hive_partitioning = false)" % pattern.replace("'", "''")
rows, distinct = c.execute("select count(*), count(distinct (device, epoch, seq)) from " + src).fetchone()
print(rows, distinct)
for d, e, s in c.execute("select distinct device, epoch, seq from " + src).fetchall():
    print(d, e, s)
"#;

/// Reads tier 2 under `tier2_dir` (a `file://` tier) with DuckDB.
pub fn parquet_ids(tier2_dir: &Path, stream: &str) -> Result<ParquetSummary> {
    let out = python(&[
        "-c",
        DUCKDB_PY,
        tier2_dir.to_str().context("tier2 path not UTF-8")?,
        stream,
    ])?;
    summary_of(&out, "duckdb")
}

const PYICEBERG_PY: &str = r#"
import sys
from pyiceberg.catalog.sql import SqlCatalog
catalog, warehouse, stream = sys.argv[1:4]
t = SqlCatalog("tributary", uri="sqlite:///" + catalog, warehouse="file://" + warehouse).load_table("tributary." + stream)
a = t.scan(selected_fields=("device", "epoch", "seq")).to_arrow()
ids = list(zip(a["device"].to_pylist(), a["epoch"].to_pylist(), a["seq"].to_pylist()))
print(len(ids), len(set(ids)))
for d, e, s in sorted(set(ids)):
    print(d, e, s)
"#;

/// Reads a stream's Iceberg table (the SQLite catalog at `catalog`, a `file://` tier 2 under
/// `tier2_dir`) with pyiceberg, in the interpreter `.ci/test` prepares (`TRIBUTARY_LAKE_PYTHON`,
/// by default `/opt/tributary-lake/bin/python`).
pub fn iceberg_ids(catalog: &Path, tier2_dir: &Path, stream: &str) -> Result<ParquetSummary> {
    let lake = std::env::var("TRIBUTARY_LAKE_PYTHON")
        .unwrap_or_else(|_| "/opt/tributary-lake/bin/python".into());
    let out = run_python(
        &lake,
        &[
            "-c",
            PYICEBERG_PY,
            catalog.to_str().context("catalog path not UTF-8")?,
            tier2_dir.to_str().context("tier2 path not UTF-8")?,
            stream,
        ],
    )?;
    summary_of(&out, "pyiceberg")
}

/// `rows distinct` on the first line, then one `device epoch seq` per line.
fn summary_of(out: &str, reader: &str) -> Result<ParquetSummary> {
    let mut lines = out.lines();
    let head = lines
        .next()
        .with_context(|| format!("{reader} printed nothing"))?;
    let (rows, distinct) = head
        .split_once(' ')
        .with_context(|| format!("{reader} head {head:?}"))?;
    let mut summary = ParquetSummary {
        rows: rows.parse()?,
        distinct: distinct.parse()?,
        ids: BTreeSet::new(),
    };
    for line in lines {
        let mut parts = line.rsplitn(3, ' ');
        let (Some(seq), Some(epoch), Some(device)) = (parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("{reader} id line {line:?}");
        };
        summary
            .ids
            .insert((device.to_string(), epoch.parse()?, seq.parse()?));
    }
    Ok(summary)
}

fn python(args: &[&str]) -> Result<String> {
    run_python("python3", args)
}

fn run_python(interpreter: &str, args: &[&str]) -> Result<String> {
    let output = Command::new(interpreter)
        .args(args)
        .output()
        .with_context(|| format!("running {interpreter} (needed for the tier-2 checks)"))?;
    ensure!(
        output.status.success(),
        "{interpreter} failed with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// A scratch directory for a system test: removed at the end unless `TRIBUTARY_KEEP=1`, which
/// keeps it (and prints where) so the processes' logs can be read after a failure.
pub fn scratch_dir(prefix: &str) -> Result<(Option<tempfile::TempDir>, std::path::PathBuf)> {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir()?;
    if std::env::var("TRIBUTARY_KEEP").is_ok_and(|v| v == "1") {
        let path = dir.keep();
        println!("keeping {}", path.display());
        Ok((None, path))
    } else {
        let path = dir.path().to_path_buf();
        Ok((Some(dir), path))
    }
}

/// Like [`HubSpec::start`], with extra environment for the hub process (for example
/// `TRIBUTARY_TIER_FAULT`, see `core-hub/src/tiering/faults.rs`); the environment stays on
/// restarts.
pub fn start_hub_with_env(spec: &HubSpec, pki: &Pki, env: &[(&str, &str)]) -> Result<Proc> {
    let toml = |p: &Path| -> Result<String> {
        Ok(serde_json::to_string(
            p.to_str().context("path not UTF-8")?,
        )?)
    };
    let config = format!(
        "data_dir = {data}\n\n[listen]\nquic = \"{quic}\"\nhttp = \"{http}\"\n\n[tls]\n\
         ca = {ca}\ncert = {cert}\nkey = {key}\n\n{extra}\n",
        data = toml(&spec.data_dir)?,
        quic = spec.quic,
        http = spec.http,
        ca = toml(&pki.dir.join("ca.pem"))?,
        cert = toml(&pki.dir.join("hub.pem"))?,
        key = toml(&pki.dir.join("hub.key"))?,
        extra = spec.extra_toml,
    );
    std::fs::write(&spec.config, config)
        .with_context(|| format!("writing {}", spec.config.display()))?;
    let log_dir = spec.config.parent().unwrap_or(Path::new(".")).join("logs");
    let mut ps = ProcSpec::new(bin_path("core-hub"))
        .name(&spec.name)
        .arg("run")
        .arg("--config")
        .arg(&spec.config)
        .log_dir(log_dir);
    for (k, v) in env {
        ps = ps.env(k, v);
    }
    let mut proc = Proc::spawn(ps)?;
    proc.wait_http_ok(spec.http, "/healthz", START_TIMEOUT)?;
    if env.iter().any(|(k, _)| *k == TIER_FAULT_ENV) {
        // Only a hub built with core-hub's `fault-injection` feature reads the variable; a
        // test whose fault silently did nothing would prove nothing.
        wait_until(
            START_TIMEOUT,
            "the hub to log that tier faults are on",
            || (proc.stderr() + &proc.stdout()).contains(TIER_FAULT_LINE),
        )
        .with_context(|| {
            format!(
                "{TIER_FAULT_ENV} had no effect: the hub binary lacks core-hub's `fault-injection` \
                 feature (build it with `cargo build --workspace --all-targets`)\n{}",
                proc.log_tail(40)
            )
        })?;
    }
    Ok(proc)
}

/// The tier fault switch's variable (`core_hub::tiering::faults::FAULT_ENV`, test builds only).
pub const TIER_FAULT_ENV: &str = "TRIBUTARY_TIER_FAULT";
/// What the hub logs when it reads [`TIER_FAULT_ENV`].
const TIER_FAULT_LINE: &str = "tiering fault injection is ON";

/// Access key and secret of the S3 servers [`spawn_s3s_fs`] starts.
pub const S3_KEYS: (&str, &str) = ("tributary", "tributary-secret");

/// Starts `s3s-fs` (installed by `.ci/test`) on `127.0.0.1:port` over `root/data`, with the
/// bucket `bucket` created, and waits until it accepts connections.
pub fn spawn_s3s_fs(root: &Path, port: u16, bucket: &str) -> Result<Proc> {
    let bin = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain(std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo/bin")))
        .map(|d| d.join("s3s-fs"))
        .find(|p| p.is_file())
        .context(
            "s3s-fs is not installed: cargo install s3s-fs@0.14.1 --features binary --locked",
        )?;
    let data = root.join("data");
    std::fs::create_dir_all(data.join(bucket))?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut proc = Proc::spawn(
        ProcSpec::new(bin)
            .name("s3s-fs")
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", S3_KEYS.0, "--secret-key", S3_KEYS.1])
            .arg(data)
            .log_dir(root.join("logs")),
    )?;
    wait_until(START_TIMEOUT, "s3s-fs to accept connections", || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            || !proc.is_running()
    })?;
    ensure!(proc.is_running(), "s3s-fs exited:\n{}", proc.log_tail(20));
    Ok(proc)
}
