//! Replication benchmarks for issue 4: the physical QUIC limit of this machine and what the
//! real protocol path achieves against it.
//!
//! Everything runs in one process on loopback, with the product's own pieces: the PKI
//! (`core_hub::pki`), the hub (`Hub::open` + `server::start`, WAL fsynced), the edge's local log
//! (`edge_agent::log` on the real file system) and the edge's replicator
//! (`edge_agent::replicator::run`). Four figures, in this order, so they share one run:
//!
//! 1. `quic`: loopback QUIC throughput with the product's transport settings and TLS, large
//!    writes on unidirectional streams, bytes discarded on arrival. The limit for this machine.
//! 2. `raw`: opaque (high-entropy) blocks drained from a pre-filled edge backlog into the
//!    hub's fsynced tier 1, in MB/s of block bytes, against (1). Also the hub WAL's own MB/s.
//! 3. `catchup`: a telemetry backlog (the field set of `gen_telemetry.py`) in v2 columnar blocks
//!    of `OFFLINE_BLOCK_RECORDS`, drained into tier 1, in records/s.
//! 4. `live`: ingest-ack-to-hub-durable latency at a modest live rate, p50/p99.
//!
//! Run: `cargo bench -p core-hub --bench replication [-- quic raw ingest catchup live]`
//! (`ingest` is the hub alone, for locating a bottleneck in `raw`).
//! Sizes: `BENCH_QUIC_MB` (default 2048), `BENCH_RAW_MB` (1024), `BENCH_CATCHUP_RECORDS`
//! (9_000_000), `BENCH_LIVE_SECS` (20). The data directory is under `BENCH_DIR` (default the
//! system temp dir), so point it at the disk you want to measure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use core_hub::config::{HubConfig, TlsPaths as HubTls};
use core_hub::ingest::Hub;
use core_hub::pki;
use edge_agent::link::{self, TlsPaths as EdgeTls};
use edge_agent::log::{FsyncPolicy, Log, LogConfig, LogHandle};
use edge_agent::replicator::{self, LinkStatus, ReplicatorConfig};
use edge_agent::storage::RealStorage;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sync::record::{Record, Value};
use tokio::sync::watch;

const DEVICE: &str = "bench-dev";
const STREAM: &str = "telemetry";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// The PKI of one run: a CA, the hub certificate and one device certificate.
struct Pki {
    hub: HubTls,
    edge: EdgeTls,
}

fn make_pki(dir: &Path) -> Result<Pki> {
    let init = pki::init(&dir.join("pki"), &[], false)?;
    let dev = pki::issue(&dir.join("pki"), DEVICE, &dir.join("device"))?;
    Ok(Pki {
        hub: HubTls::new(init.ca_pem.clone(), init.hub_pem, init.hub_key),
        edge: EdgeTls {
            ca: dev.ca_pem,
            cert: dev.device_pem,
            key: dev.device_key,
        },
    })
}

// ---------------------------------------------------------------------------------------------
// 1. Loopback QUIC
// ---------------------------------------------------------------------------------------------

/// Streams of this size are written whole, like one block per unidirectional stream.
const QUIC_STREAM_BYTES: usize = 4 << 20;
/// Streams open at once on the sending side.
const QUIC_CONCURRENT: usize = 8;

async fn bench_quic(pki: &Pki, total_bytes: u64) -> Result<f64> {
    let revocations = pki::SharedRevocations::open(&pki.hub.ca.with_file_name("revoked.txt"))?;
    let tls = pki::server_tls_config(&pki.hub, revocations)?;
    let quic_tls = quinn::crypto::rustls::QuicServerConfig::try_from(tls)?;
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(quic_tls));
    // The same window the hub derives for its default budget (receiver window, capped at a
    // quarter of the 512 MiB ingest budget).
    let window = sync::protocol::ReceiverConfig::default()
        .window_bytes
        .min((512u64 << 20) / 4);
    server_cfg.transport_config(Arc::new(core_hub::server::transport_config(window)));
    let sock = link::udp_socket("127.0.0.1:0".parse()?)?;
    let runtime = quinn::default_runtime().context("runtime")?;
    let server = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server_cfg),
        sock,
        runtime,
    )?;
    let addr = server.local_addr()?;

    let streams = total_bytes.div_ceil(QUIC_STREAM_BYTES as u64) as usize;
    let expect = streams as u64 * QUIC_STREAM_BYTES as u64;
    let recv = tokio::spawn(async move {
        let conn = server.accept().await.context("no connection")?.await?;
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let mut got = 0u64;
        let mut first: Option<Instant> = None;
        let mut finished = 0usize;
        while finished < streams {
            tokio::select! {
                s = conn.accept_uni() => {
                    let mut s = s?;
                    first.get_or_insert_with(Instant::now);
                    let tx = done_tx.clone();
                    tokio::spawn(async move {
                        let mut n = 0u64;
                        while let Ok(Some(chunk)) = s.read_chunk(usize::MAX, true).await {
                            n += chunk.bytes.len() as u64;
                        }
                        let _ = tx.send(n);
                    });
                }
                Some(n) = done_rx.recv() => { got += n; finished += 1; }
            }
        }
        let secs = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
        conn.close(0u32.into(), b"done");
        anyhow::Ok((got, secs))
    });

    let endpoint = link::client_endpoint("127.0.0.1:0".parse()?)?;
    let conn = endpoint
        .connect_with(link::client_config(&pki.edge)?, addr, "localhost")?
        .await?;
    let payload = Arc::new(random_bytes(QUIC_STREAM_BYTES, 1));
    let sem = Arc::new(tokio::sync::Semaphore::new(QUIC_CONCURRENT));
    for _ in 0..streams {
        let permit = sem.clone().acquire_owned().await?;
        let conn = conn.clone();
        let payload = payload.clone();
        tokio::spawn(async move {
            if let Ok(mut s) = conn.open_uni().await {
                let _ = s.write_all(&payload).await;
                let _ = s.finish();
                let _ = s.stopped().await;
            }
            drop(permit);
        });
    }
    let (got, secs) = recv.await??;
    anyhow::ensure!(got == expect, "received {got} of {expect} bytes");
    let rate = mb(got) / secs;
    println!(
        "quic: {:.0} MB in {secs:.2} s = {rate:.1} MB/s ({streams} uni streams of {} MiB, {QUIC_CONCURRENT} concurrent)",
        mb(got),
        QUIC_STREAM_BYTES >> 20
    );
    endpoint.close(0u32.into(), b"done");
    Ok(rate)
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}

// ---------------------------------------------------------------------------------------------
// The hub and the edge
// ---------------------------------------------------------------------------------------------

struct RunningHub {
    hub: Arc<Hub>,
    addr: SocketAddr,
    _shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

async fn start_hub(dir: &Path, pki: &Pki) -> Result<RunningHub> {
    let mut cfg = HubConfig::with_data_dir(dir.join("hub"));
    cfg.listen.quic = "127.0.0.1:0".parse()?;
    cfg.tls = Some(pki.hub.clone());
    let hub = Hub::open(&cfg)?;
    let (tx, rx) = watch::channel(false);
    let (server, task) = core_hub::server::start(&cfg, hub.clone(), rx).await?;
    Ok(RunningHub {
        hub,
        addr: server.local_addr,
        _shutdown: tx,
        task,
    })
}

impl RunningHub {
    fn stop(self) {
        self.task.abort();
        self.hub.shutdown();
    }
}

fn open_log(
    dir: &Path,
    fsync: FsyncPolicy,
    version: u8,
    block_records: usize,
    block_bytes: usize,
) -> Result<LogHandle> {
    let cfg = LogConfig {
        data_dir: dir.join("edge"),
        streams: vec![STREAM.into()],
        fsync,
        block_records_max: block_records,
        block_bytes_max: block_bytes,
        block_version: version,
        segment_bytes_max: 256 << 20,
        disk_bytes_max: 64 << 30,
        ..LogConfig::default()
    };
    let (log, _) = Log::open(cfg, Arc::new(RealStorage))?;
    Ok(log)
}

/// `opaque`: ship blocks exactly as stored (no re-sealing of backlog runs), so the raw figure
/// measures transport and tier 1, not the edge's re-encoding.
fn start_replicator(
    pki: &Pki,
    hub_addr: SocketAddr,
    log: LogHandle,
    opaque: bool,
) -> (Arc<LinkStatus>, tokio::task::JoinHandle<()>) {
    let mut cfg = ReplicatorConfig::new(hub_addr.to_string(), "localhost".into(), pki.edge.clone());
    cfg.backoff_initial = Duration::from_millis(20);
    if opaque {
        cfg.reblock_records_max = 0;
    }
    // For locating a bottleneck: a smaller sender window shows whether the ack latency caps
    // throughput (the hub's own window is 32 MiB, so larger values change nothing).
    if let Ok(w) = std::env::var("BENCH_SENDER_WINDOW_MB") {
        cfg.sender.window_bytes_max = w.parse::<u64>().unwrap_or(32) << 20;
    }
    let status = Arc::new(LinkStatus::default());
    let task = tokio::spawn(replicator::run(cfg, log, status.clone()));
    (status, task)
}

/// Waits until the hub has acknowledged everything durable in the log; returns the elapsed time.
async fn drain(log: &LogHandle, start: Instant, deadline: Duration) -> Result<Duration> {
    let target = log.status().streams[0].durable_seq;
    loop {
        let st = log.status();
        if st.streams[0].acked_durable >= target {
            return Ok(start.elapsed());
        }
        anyhow::ensure!(
            start.elapsed() < deadline,
            "drain timed out at {} of {target}",
            st.streams[0].acked_durable
        );
        // A bench polls; 1 ms is far below the figures measured.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// CPU seconds this process has used (user + system), from `/proc/self/stat` at the usual
/// 100 ticks per second; with 2 cores, 2 CPU-seconds per second is saturation.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (ticks(14) + ticks(15)) as f64 / 100.0
}

struct WalSnap {
    bytes: u64,
    fsyncs: u64,
    commits: u64,
}

fn wal_snap(hub: &Hub) -> WalSnap {
    use std::sync::atomic::Ordering::Relaxed;
    let s = hub.wal_stats();
    WalSnap {
        bytes: s.bytes.load(Relaxed),
        fsyncs: s.fsyncs.load(Relaxed),
        commits: s.group_commits.load(Relaxed),
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Raw shipping
// ---------------------------------------------------------------------------------------------

async fn bench_raw(root: &Path, pki: &Pki, total_bytes: u64, quic: Option<f64>) -> Result<()> {
    let dir = tempfile::tempdir_in(root)?;
    // Version 1 rows with a random payload: blocks about 1 MiB, nearly incompressible.
    let log = open_log(
        dir.path(),
        FsyncPolicy::Interval(Duration::from_millis(50)),
        sync::block::VERSION_ROWS,
        4096,
        1 << 20,
    )?;
    let pool = edge_agent::bench::record_pool(1024, 4096);
    let fill = Instant::now();
    let batches = total_bytes.div_ceil(1024 * 1024) as usize;
    fill_log(&log, batches, |_| pool[..1024].to_vec()).await?;
    let st = log.status().streams[0].clone();
    println!(
        "raw: backlog {} records, {} blocks, {:.0} MB of block bytes (filled in {:.1} s)",
        st.durable_seq,
        st.backlog_blocks,
        mb(st.backlog_bytes),
        fill.elapsed().as_secs_f64()
    );
    let hub = start_hub(dir.path(), pki).await?;
    let w0 = wal_snap(&hub.hub);
    let (start, cpu0) = (Instant::now(), cpu_secs());
    let (link, task) = start_replicator(pki, hub.addr, log.clone(), true);
    let took = drain(&log, start, Duration::from_secs(600)).await?;
    let cpu = cpu_secs() - cpu0;
    let w1 = wal_snap(&hub.hub);
    let secs = took.as_secs_f64();
    println!(
        "raw: CPU {cpu:.2} s over {secs:.2} s = {:.2} cores busy (edge, QUIC both ways, hub, WAL in one process)",
        cpu / secs
    );
    let rate = mb(st.backlog_bytes) / secs;
    let ratio = quic.map_or(String::new(), |q| {
        format!(" = {:.0}% of loopback QUIC", 100.0 * rate / q)
    });
    println!(
        "raw: shipped {:.0} MB of blocks in {secs:.2} s = {rate:.1} MB/s{ratio}",
        mb(st.backlog_bytes)
    );
    println!(
        "raw: hub WAL wrote {:.0} MB ({:.1} MB/s) in {} fsyncs / {} group commits; link sent {} data frames",
        mb(w1.bytes - w0.bytes),
        mb(w1.bytes - w0.bytes) / secs,
        w1.fsyncs - w0.fsyncs,
        w1.commits - w0.commits,
        link.blocks_sent.load(std::sync::atomic::Ordering::Relaxed)
    );
    task.abort();
    hub.stop();
    log.shutdown();
    Ok(())
}

/// Appends `batches` batches, keeping several in flight so the log's group commit, not this
/// loop, sets the pace.
async fn fill_log(
    log: &LogHandle,
    batches: usize,
    make: impl Fn(usize) -> Vec<Record>,
) -> Result<()> {
    let mut inflight = tokio::task::JoinSet::new();
    for i in 0..batches {
        if inflight.len() >= 8
            && let Some(r) = inflight.join_next().await
        {
            r??;
        }
        let log = log.clone();
        let records = make(i);
        inflight.spawn(async move { log.append(STREAM, records).await.map(|_| ()) });
    }
    while let Some(r) = inflight.join_next().await {
        r??;
    }
    Ok(())
}

/// The hub alone: the same kind of opaque blocks submitted in-process through
/// `Hub::submit_block` (verify, decode, checksum, WAL append, fsync, catalog), pipelined, with
/// no QUIC and no edge. The hub WAL's own MB/s on this machine.
async fn bench_ingest(root: &Path, total_bytes: u64, quic: Option<f64>) -> Result<()> {
    let dir = tempfile::tempdir_in(root)?;
    let pool = edge_agent::bench::record_pool(1024, 1024);
    let blocks_n = total_bytes.div_ceil(1 << 20) as usize;
    // Blocks are built first so encoding is not timed.
    let opts = sync::block::EncodeOptions {
        zstd_level: 1,
        ..Default::default()
    };
    let blocks: Vec<Vec<u8>> = (0..blocks_n)
        .map(|i| sync::block::encode_block_with(&opts, 1, 1 + i as u64 * 1024, &pool))
        .collect::<Result<_, _>>()?;
    let bytes: u64 = blocks.iter().map(|b| b.len() as u64).sum();
    let mut cfg = HubConfig::with_data_dir(dir.path().join("hub"));
    cfg.listen.quic = "127.0.0.1:0".parse()?;
    let hub = Hub::open(&cfg)?;
    let (start, cpu0) = (Instant::now(), cpu_secs());
    let mut waits = tokio::task::JoinSet::new();
    for b in &blocks {
        while waits.len() >= 32 {
            waits.join_next().await.context("wait")???;
        }
        let pending = hub.submit_block(DEVICE, STREAM, b).await?;
        waits.spawn(async move { pending.wait().await.map(|_| ()) });
    }
    while let Some(r) = waits.join_next().await {
        r??;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_secs() - cpu0;
    let w = wal_snap(&hub);
    let rate = mb(bytes) / secs;
    let ratio = quic.map_or(String::new(), |q| {
        format!(" = {:.0}% of loopback QUIC", 100.0 * rate / q)
    });
    println!(
        "ingest: hub alone committed {:.0} MB of blocks in {secs:.2} s = {rate:.1} MB/s{ratio}; {} fsyncs, {} group commits; CPU {:.2} cores busy",
        mb(bytes),
        w.fsyncs,
        w.commits,
        cpu / secs
    );
    hub.shutdown();
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. Catch-up
// ---------------------------------------------------------------------------------------------

/// A fleet of trucks like `gen_telemetry.py`: drifting analogue values, counters, flags, GPS.
struct Fleet {
    rng: SmallRng,
    trucks: Vec<[f64; 8]>,
    odo: Vec<i64>,
    t: u64,
    next: usize,
}

impl Fleet {
    fn new(devices: usize) -> Fleet {
        let mut rng = SmallRng::seed_from_u64(7);
        let trucks = (0..devices)
            .map(|_| {
                [
                    rng.random_range(60.0..95.0),
                    rng.random_range(2.0..4.5),
                    rng.random_range(12.2..14.4),
                    rng.random_range(20.0..100.0),
                    rng.random_range(45.0..55.0),
                    rng.random_range(-5.0..15.0),
                    rng.random_range(0.0..std::f64::consts::TAU),
                    rng.random_range(0.0..90.0),
                ]
            })
            .collect();
        let odo = (0..devices)
            .map(|_| rng.random_range(10_000..900_000))
            .collect();
        Fleet {
            rng,
            trucks,
            odo,
            t: 0,
            next: 0,
        }
    }

    fn record(&mut self) -> Record {
        let i = self.next;
        let n = |r: &mut SmallRng, s: f64| (r.random::<f64>() - 0.5) * 2.0 * s;
        let round = |x: f64, d: i32| (x * 10f64.powi(d)).round() / 10f64.powi(d);
        let s = &mut self.trucks[i];
        s[0] += n(&mut self.rng, 0.05);
        s[1] = (s[1] + n(&mut self.rng, 0.01)).clamp(0.5, 6.0);
        s[2] = (s[2] + n(&mut self.rng, 0.005)).clamp(11.5, 14.8);
        s[7] = (s[7] + n(&mut self.rng, 0.8)).clamp(0.0, 130.0);
        s[3] = (s[3] - s[7] / 3.6e5).max(0.0);
        s[6] += n(&mut self.rng, 0.02);
        let d = s[7] / 3.6;
        s[4] += d * s[6].cos() / 111_320.0;
        s[5] += d * s[6].sin() / (111_320.0 * s[4].to_radians().cos());
        self.odo[i] += d as i64;
        let r = Record {
            tags: Vec::new(),
            key: format!("truck-{i:04}/engine"),
            ts: 1_764_374_400_000_000_000
                + (self.t * 1_000_000_000 + (i as u64 * 1_000_003) % 1_000_000_000) as i64,
            fields: vec![
                ("engine_temp_c".into(), Value::F64(round(s[0], 2))),
                ("oil_bar".into(), Value::F64(round(s[1], 3))),
                ("battery_v".into(), Value::F64(round(s[2], 2))),
                ("speed_kmh".into(), Value::F64(round(s[7], 1))),
                ("fuel_pct".into(), Value::F64(round(s[3], 1))),
                ("odometer_m".into(), Value::I64(self.odo[i])),
                ("lat".into(), Value::F64(round(s[4], 6))),
                ("lon".into(), Value::F64(round(s[5], 6))),
                ("ignition".into(), Value::Bool(s[7] > 0.5)),
                (
                    "fault".into(),
                    Value::Bool(self.rng.random::<f64>() < 0.0005),
                ),
            ],
        };
        self.next += 1;
        if self.next == self.trucks.len() {
            self.next = 0;
            self.t += 1;
        }
        r
    }
}

/// The size of a record as one line of `gen_telemetry.py --format json` output.
fn ndjson_len(r: &Record) -> usize {
    let fields: serde_json::Map<String, serde_json::Value> = r
        .fields
        .iter()
        .map(|(k, v)| {
            let v = match v {
                Value::F64(x) => serde_json::json!(x),
                Value::I64(x) => serde_json::json!(x),
                Value::Bool(x) => serde_json::json!(x),
                Value::Str(x) => serde_json::json!(x),
                Value::Bytes(x) => serde_json::json!(x),
            };
            (k.clone(), v)
        })
        .collect();
    serde_json::to_string(&serde_json::json!({"key": r.key, "ts": r.ts, "fields": fields}))
        .map_or(0, |s| s.len() + 1)
}

async fn bench_catchup(root: &Path, pki: &Pki, records: u64) -> Result<()> {
    let dir = tempfile::tempdir_in(root)?;
    let per_block = sync::columnar::OFFLINE_BLOCK_RECORDS;
    let log = open_log(
        dir.path(),
        FsyncPolicy::Interval(Duration::from_millis(50)),
        sync::block::VERSION_COLUMNAR,
        per_block,
        64 << 20,
    )?;
    let fill = Instant::now();
    let batches = (records as usize).div_ceil(per_block);
    // Generated on a blocking thread, handed over in batches of one block each.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Record>>(4);
    let gen_thread = std::thread::spawn(move || {
        let mut fleet = Fleet::new(200);
        let (mut json_bytes, mut sampled) = (0u64, 0u64);
        for b in 0..batches {
            let batch: Vec<Record> = (0..per_block).map(|_| fleet.record()).collect();
            if b % 16 == 0 {
                json_bytes += batch.iter().map(|r| ndjson_len(r) as u64).sum::<u64>();
                sampled += batch.len() as u64;
            }
            if tx.send(batch).is_err() {
                break;
            }
        }
        json_bytes as f64 / sampled.max(1) as f64
    });
    let rx = Arc::new(std::sync::Mutex::new(rx));
    fill_log(&log, batches, |_| {
        rx.lock().expect("lock").recv().unwrap_or_default()
    })
    .await?;
    let avg_json = gen_thread
        .join()
        .map_err(|_| anyhow::anyhow!("generator panicked"))?;
    let st = log.status().streams[0].clone();
    let n = st.durable_seq;
    println!(
        "catchup: backlog {n} records = {:.2} GB as NDJSON ({avg_json:.0} B/record), {:.1} MB on the edge disk in {} v2 blocks (filled in {:.1} s)",
        n as f64 * avg_json / 1e9,
        mb(st.backlog_bytes),
        st.backlog_blocks,
        fill.elapsed().as_secs_f64()
    );
    // What the hub spends per block before the WAL, on one core: decoding into records and
    // the per-record content checksum (what its connection task does for every block).
    let sample = log.read_blocks(STREAM, log.epoch(), 0, 1)?.remove(0).bytes;
    let limits = sync::block::DecodeLimits::default();
    let t = Instant::now();
    let reps = 5;
    for _ in 0..reps {
        let b = sync::block::decode_block(&sample, &limits)?;
        std::hint::black_box(core_hub::content_checksum(b.header.first_seq, &b.records));
    }
    let block_secs = t.elapsed().as_secs_f64() / reps as f64;
    let t = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(sync::block::decode_block(&sample, &limits)?);
    }
    let decode_secs = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "catchup: fresh decode + content checksum of one {per_block}-record block: {:.1} ms (decode alone {:.1} ms) = {:.2} M records/s on one core",
        block_secs * 1e3,
        decode_secs * 1e3,
        per_block as f64 / block_secs / 1e6
    );
    // What the hub's data-stream tasks do now: decode into a reused record buffer and hash the
    // records with one reused row buffer (`sync::protocol::DecodedBlock::decode`).
    let mut buffer = Vec::new();
    let t = Instant::now();
    for _ in 0..reps {
        let d = sync::protocol::DecodedBlock::decode(sample.clone(), &limits, buffer)?;
        buffer = std::hint::black_box(d).records;
    }
    let pooled_secs = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "catchup: hub decode-ahead (reused buffers) of one block: {:.1} ms = {:.2} M records/s on one core",
        pooled_secs * 1e3,
        per_block as f64 / pooled_secs / 1e6
    );
    let hub = start_hub(dir.path(), pki).await?;
    let w0 = wal_snap(&hub.hub);
    let (start, cpu0) = (Instant::now(), cpu_secs());
    let (_link, task) = start_replicator(pki, hub.addr, log.clone(), false);
    let took = drain(&log, start, Duration::from_secs(1200)).await?;
    let cpu = cpu_secs() - cpu0;
    let w1 = wal_snap(&hub.hub);
    let secs = took.as_secs_f64();
    println!(
        "catchup: CPU {cpu:.2} s over {secs:.2} s = {:.2} cores busy",
        cpu / secs
    );
    let rate = n as f64 / secs;
    println!(
        "catchup: drained {n} records into fsynced tier 1 in {secs:.2} s = {:.2} M records/s ({:.0}% of the 1 M/s target); NDJSON-equivalent {:.0} MB/s",
        rate / 1e6,
        rate / 1e4,
        n as f64 * avg_json / 1e6 / secs
    );
    println!(
        "catchup: hub WAL wrote {:.1} MB in {} fsyncs / {} group commits",
        mb(w1.bytes - w0.bytes),
        w1.fsyncs - w0.fsyncs,
        w1.commits - w0.commits
    );
    // Spot-check that the hub can read what it acknowledged.
    let page = core_hub::read::read_records(&hub.hub, STREAM, 0, 10)?;
    anyhow::ensure!(
        page.records.len() == 10,
        "hub read back {} records",
        page.records.len()
    );
    task.abort();
    hub.stop();
    log.shutdown();
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. Live latency
// ---------------------------------------------------------------------------------------------

async fn bench_live(root: &Path, pki: &Pki, secs: u64) -> Result<()> {
    let dir = tempfile::tempdir_in(root)?;
    // The agent's defaults: fsync every 10 ms, blocks linger 2 ms, v1 rows.
    let defaults = LogConfig::default();
    let log = open_log(
        dir.path(),
        defaults.fsync,
        defaults.block_version,
        defaults.block_records_max,
        defaults.block_bytes_max,
    )?;
    let hub = start_hub(dir.path(), pki).await?;
    let (_link, task) = start_replicator(pki, hub.addr, log.clone(), false);
    // Wait for the session before timing, so the connect is not counted.
    let mut up = _link.subscribe_up();
    tokio::time::timeout(Duration::from_secs(20), up.wait_for(|u| *u)).await??;

    // 1,000 records/s in batches of 10 every 10 ms.
    let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let producer_log = log.clone();
    let producer = tokio::spawn(async move {
        let mut fleet = Fleet::new(10);
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let end = Instant::now() + Duration::from_secs(secs);
        let mut sent = 0u64;
        while Instant::now() < end {
            tick.tick().await;
            let batch: Vec<Record> = (0..10).map(|_| fleet.record()).collect();
            let ack = producer_log.append(STREAM, batch).await?;
            let _ = ack_tx.send((ack.last_seq, Instant::now()));
            sent += 10;
        }
        anyhow::Ok(sent)
    });
    let mut waiting: std::collections::VecDeque<(u64, Instant)> = std::collections::VecDeque::new();
    let mut samples = Vec::new();
    let mut producer_done = false;
    loop {
        while let Ok(a) = ack_rx.try_recv() {
            waiting.push_back(a);
        }
        if producer.is_finished() {
            producer_done = true;
        }
        let durable = hub
            .hub
            .marks(DEVICE)
            .iter()
            .filter(|m| m.stream == STREAM)
            .map(|m| m.durable_seq)
            .max()
            .unwrap_or(0);
        let now = Instant::now();
        while let Some(&(seq, at)) = waiting.front() {
            if seq > durable {
                break;
            }
            samples.push(now.duration_since(at));
            waiting.pop_front();
        }
        if producer_done && waiting.is_empty() && ack_rx.is_empty() {
            break;
        }
        // The poll interval bounds the measurement error: 200 µs.
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let sent = producer.await??;
    samples.sort_unstable();
    let pct =
        |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
    println!(
        "live: {sent} records in {} batches over {secs} s; ack -> hub durable+readable: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (target p99 <= 100 ms)",
        samples.len(),
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    let page = core_hub::read::read_records(&hub.hub, STREAM, 0, sent as usize + 1)?;
    anyhow::ensure!(
        page.records.len() as u64 == sent,
        "hub holds {} of {sent} records",
        page.records.len()
    );
    task.abort();
    hub.stop();
    log.shutdown();
    Ok(())
}

// ---------------------------------------------------------------------------------------------

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; anything else selects the benchmarks to run.
    let picked: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let want = |name: &str| picked.is_empty() || picked.iter().any(|p| p == name);
    let root: PathBuf =
        std::env::var_os("BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let dir = tempfile::tempdir_in(&root)?;
        let pki = make_pki(dir.path())?;
        println!(
            "machine: {} cores; data under {}",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            root.display()
        );
        let mut quic = None;
        if want("quic") {
            quic = Some(bench_quic(&pki, env_u64("BENCH_QUIC_MB", 2048) << 20).await?);
        }
        if want("raw") {
            bench_raw(&root, &pki, env_u64("BENCH_RAW_MB", 1024) << 20, quic).await?;
        }
        if want("ingest") {
            bench_ingest(&root, env_u64("BENCH_RAW_MB", 1024) << 20, quic).await?;
        }
        if want("catchup") {
            bench_catchup(&root, &pki, env_u64("BENCH_CATCHUP_RECORDS", 9_000_000)).await?;
        }
        if want("live") {
            bench_live(&root, &pki, env_u64("BENCH_LIVE_SECS", 20)).await?;
        }
        anyhow::Ok(())
    })
}
