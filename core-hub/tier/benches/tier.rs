//! Tier-2 benchmarks, a program (not a timed test):
//!
//! 1. encode cost: records per CPU-second (parsed records and a fresh in-order copy), the
//!    memory floor of reading the records, and the wall-clock rate on every core;
//! 2. upload, all against s3s-fs in the same run: (a) raw PUT of incompressible objects of the
//!    chunk files' sizes; (b) the upload stage alone, already-encoded chunks through
//!    `Tier2::upload_chunk` (PUT, MD5 against the ETag, HEAD) as the hub does it, as % of
//!    (a); (c) end to end,
//!    encode + PUT + verify pipelined with encoding on every core, in MB/s, records/s and % of
//!    (a) (target: >= 70%), with variants (one chunk on all cores; one core);
//! 3. size: Parquet bytes per record on the telemetry set, next to zstd -3 over the same
//!    records as JSON lines (per chunk, the same grouping);
//! 4. cold read-through: GET + decode of every chunk by a fresh `Tier2` (target: >= 1M
//!    records/s), and decode alone.
//!
//! ```text
//! cargo bench -p tributary-tier --bench tier [-- PATH.ndjson]
//! ```
//!
//! Input: the NDJSON file given as argument or in `TRIBUTARY_BENCH_DATA`; by default
//! `/tmp/tributary-telemetry-200x3000.ndjson`, generated on first use with
//! `shared/data/gen_telemetry.py --devices 200 --seconds 3000` (600,000 records). Device =
//! the key's first path component, seq per device, offsets dense, ingest time = event time.
//! `TRIBUTARY_BENCH_CHUNK_ROWS` sets the rows per chunk (default 131072). Needs s3s-fs.
//! `TRIBUTARY_BENCH_ONLY=encode` stops after the encode costs (for `perf record`);
//! `TRIBUTARY_BENCH_DUMP=FILE` writes the first chunk's Parquet file there (to inspect its
//! encodings, e.g. with DuckDB's `parquet_metadata`). Lines starting with `BENCH ` are JSON.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};
use sync::record::Value;
use tier::testing::S3sFs;
use tier::{
    ChunkSummary, EncodeOptions, FieldRegistry, Tier2, TierRecord, chunk_path,
    decode_chunk_with_threads, encode_chunk, encode_chunk_with_threads, ingest_date,
};

const DEFAULT_DATA: &str = "/tmp/tributary-telemetry-200x3000.ndjson";
const RUNS: usize = 3;

fn main() -> Result<()> {
    let path = data_path()?;
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let records = to_tier_records(&lines)?;
    let chunk_rows: usize = std::env::var("TRIBUTARY_BENCH_CHUNK_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128 * 1024);
    println!(
        "input: {} ({} records), chunks of {chunk_rows} records",
        path.display(),
        records.len()
    );
    let mut registry = FieldRegistry::new();
    registry.observe_records(&records);
    let chunks: Vec<&[TierRecord]> = records.chunks(chunk_rows).collect();
    let line_chunks: Vec<&[&str]> = lines.chunks(chunk_rows).collect();

    if let Ok(dump) = std::env::var("TRIBUTARY_BENCH_DUMP") {
        std::fs::write(
            &dump,
            encode_chunk(chunks[0], &registry, &EncodeOptions::default())?.0,
        )?;
    }
    encode_costs(&records, chunk_rows, &registry)?;
    if std::env::var("TRIBUTARY_BENCH_ONLY").as_deref() == Ok("encode") {
        return Ok(());
    }
    sizes(&records, &chunks, &line_chunks, &registry)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(upload_and_read(&records, &chunks, &line_chunks, &registry))
}

/// Encode cost with the default options: records per CPU-second of the calling thread on the
/// records as parsed (scattered over the heap by the JSON parser) and on a fresh copy (laid
/// out in order, as the hub builds a chunk's records right before encoding it), the cost of
/// merely reading every key, device, field name and value of the parsed records (the memory
/// floor), and the wall-clock rate with one chunk per core.
fn encode_costs(records: &[TierRecord], chunk_rows: usize, registry: &FieldRegistry) -> Result<()> {
    let opts = EncodeOptions::default();
    let parsed = per_cpu_second(records.len(), || {
        for c in records.chunks(chunk_rows) {
            encode_chunk(c, registry, &opts)?;
        }
        Ok(())
    })?;
    let fresh: Vec<TierRecord> = records.to_vec();
    let copied = per_cpu_second(records.len(), || {
        for c in fresh.chunks(chunk_rows) {
            encode_chunk(c, registry, &opts)?;
        }
        Ok(())
    })?;
    let touch = per_cpu_second(records.len(), || {
        let mut acc = 0u64;
        for r in records {
            acc += u64::from(r.key.as_bytes().first().copied().unwrap_or(0));
            acc += u64::from(r.device.as_bytes().first().copied().unwrap_or(0));
            for (n, v) in &r.fields {
                acc += u64::from(n.as_bytes().first().copied().unwrap_or(0));
                acc += u64::from(v.type_tag());
            }
        }
        Ok(acc)
    })?;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut best = Duration::MAX;
    for _ in 0..RUNS {
        let start = Instant::now();
        let parts: Vec<&[TierRecord]> = fresh.chunks(chunk_rows).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| -> Result<()> {
            let handles: Vec<_> = (0..cores)
                .map(|_| {
                    scope.spawn(|| -> Result<()> {
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(c) = parts.get(i) else { return Ok(()) };
                            encode_chunk(c, registry, &opts)?;
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("encoder panicked"))??;
            }
            Ok(())
        })?;
        best = best.min(start.elapsed());
    }
    let wall = records.len() as f64 / best.as_secs_f64();
    println!(
        "cpu: encode (default options, zstd-{}) {parsed:.0} records per CPU-second on the parsed records, {copied:.0} on a fresh copy; reading every key, device, field name and value of the parsed records alone: {touch:.0} records per CPU-second",
        opts.zstd_level
    );
    println!("wall: encode with one chunk per thread on {cores} threads: {wall:.0} records/s");
    println!(
        "BENCH {{\"bench\":\"tier2_encode\",\"cpu_records_per_s_parsed\":{parsed:.0},\"cpu_records_per_s_fresh\":{copied:.0},\"cpu_records_per_s_touch_only\":{touch:.0},\"wall_records_per_s\":{wall:.0},\"threads\":{cores}}}"
    );
    Ok(())
}

fn sizes(
    records: &[TierRecord],
    chunks: &[&[TierRecord]],
    line_chunks: &[&[&str]],
    registry: &FieldRegistry,
) -> Result<()> {
    let n = records.len() as f64;
    for level in [1, 3, 6] {
        let options = EncodeOptions {
            zstd_level: level,
            ..EncodeOptions::default()
        };
        let mut bytes = 0usize;
        let start = Instant::now();
        for c in chunks {
            bytes += encode_chunk(c, registry, &options)?.0.len();
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "size: parquet zstd-{level}: {:.2} bytes/record ({bytes} bytes), encode {:.0} records/s",
            bytes as f64 / n,
            n / secs
        );
    }
    for (what, options) in [
        (
            "without key bloom filter",
            EncodeOptions {
                key_bloom_filter: false,
                ..EncodeOptions::default()
            },
        ),
        (
            "all floats BYTE_STREAM_SPLIT (not only the mostly distinct ones)",
            EncodeOptions {
                float_byte_stream_split: true,
                ..EncodeOptions::default()
            },
        ),
    ] {
        let start = Instant::now();
        let bytes: usize = chunks
            .iter()
            .map(|c| encode_chunk(c, registry, &options).map(|r| r.0.len()))
            .sum::<Result<_, _>>()?;
        println!(
            "size: parquet default (zstd-1) {what}: {:.2} bytes/record, encode {:.0} records/s",
            bytes as f64 / n,
            n / start.elapsed().as_secs_f64()
        );
    }
    let opts = EncodeOptions::default();
    let files: Vec<Bytes> = chunks
        .iter()
        .map(|c| encode_chunk(c, registry, &opts).map(|r| r.0))
        .collect::<Result<_, _>>()?;
    let decode_cpu = per_cpu_second(records.len(), || {
        for f in &files {
            // Dropping the records is part of a reader's cost.
            drop(decode_chunk_with_threads(f.clone(), 1)?);
        }
        Ok(())
    })?;
    println!("cpu: decode (1 thread, incl. drop) {decode_cpu:.0} records per CPU-second");
    let mut json = 0usize;
    let mut zstd3 = 0usize;
    for c in line_chunks {
        let mut buf = Vec::new();
        for l in c.iter() {
            buf.extend_from_slice(l.as_bytes());
            buf.push(b'\n');
        }
        json += buf.len();
        zstd3 += zstd::bulk::compress(&buf, 3)?.len();
    }
    println!(
        "size: JSON lines: {:.2} bytes/record; zstd -3 over JSON lines (per chunk): {:.2} bytes/record",
        json as f64 / n,
        zstd3 as f64 / n
    );
    Ok(())
}

async fn upload_and_read(
    records: &[TierRecord],
    chunks: &[&[TierRecord]],
    line_chunks: &[&[&str]],
    registry: &FieldRegistry,
) -> Result<()> {
    let server = S3sFs::start()?;
    let tier = Tier2::open(&server.config())?;
    let options = EncodeOptions::default();
    let n = records.len() as f64;

    // Object sizes for the raw baseline, and a warm-up of the connection pool.
    let mut sizes = Vec::new();
    for c in chunks {
        sizes.push(encode_chunk(c, registry, &options)?.0.len());
    }
    tier.raw_put("_bench/warmup", Bytes::from(vec![0u8; 1024]))
        .await?;
    let total_bytes: usize = sizes.iter().sum();

    // The hub builds each chunk's records once (from tier-1 blocks) and hands them over; build
    // them outside the timed sections so both modes measure encode + upload + verify only.
    let owned_chunks: Vec<Arc<Vec<TierRecord>>> =
        chunks.iter().map(|c| Arc::new(c.to_vec())).collect();
    let json_payloads: Vec<Bytes> = line_chunks
        .iter()
        .map(|c| {
            let mut buf = Vec::new();
            for l in c.iter() {
                buf.extend_from_slice(l.as_bytes());
                buf.push(b'\n');
            }
            Bytes::from(buf)
        })
        .collect();
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut best_json = Duration::MAX;
    let mut best_raw = Duration::MAX;
    let mut best_stage = Duration::MAX;
    let mut best_e2e = Duration::MAX;
    let mut best_e2e_cols = Duration::MAX;
    let mut best_e2e_one = Duration::MAX;
    let encoded: Vec<(Bytes, ChunkSummary)> = owned_chunks
        .iter()
        .map(|c| encode_chunk(c, registry, &options))
        .collect::<Result<_, _>>()?;
    for run in 0..RUNS {
        // (a) Raw PUT of same-size objects (incompressible content, freshly made per object)
        // and (b) the upload stage alone: the already-encoded chunks through the Tier2 path
        // the hub uses, PUT then verify (HEAD + footer check). Interleaved object by object,
        // so that load from other processes on the shared box hits both alike.
        let payloads: Vec<Bytes> = sizes
            .iter()
            .enumerate()
            .map(|(i, s)| Bytes::from(pseudo_random(*s, (run * 1000 + i) as u64)))
            .collect();
        let (mut raw, mut stage) = (Duration::ZERO, Duration::ZERO);
        for (i, ((c, (bytes, summary)), p)) in chunks.iter().zip(&encoded).zip(payloads).enumerate()
        {
            let start = Instant::now();
            tier.raw_put(&format!("_bench/raw/{run}-{i}"), p).await?;
            raw += start.elapsed();
            let start = Instant::now();
            let path = path_of(c, 1000 + i as u64 + 10 * run as u64);
            tier.upload_chunk(&path, bytes.clone(), summary).await?;
            stage += start.elapsed();
        }
        best_raw = best_raw.min(raw);
        best_stage = best_stage.min(stage);

        // Raw PUT of the same records as uncompressed JSON lines (what shipping the data
        // without any conversion would move).
        let start = Instant::now();
        for (i, p) in json_payloads.iter().enumerate() {
            tier.raw_put(&format!("_bench/json/{run}-{i}"), p.clone())
                .await?;
        }
        best_json = best_json.min(start.elapsed());

        // (c) End to end: encode + PUT + verify, pipelined. Up to `cores` chunks encode at
        // once on blocking threads (one thread each) while the oldest finished one uploads.
        let start = Instant::now();
        pipeline(
            &tier,
            chunks,
            &owned_chunks,
            registry,
            &options,
            cores,
            1,
            100 + 10 * run as u64,
        )
        .await?;
        best_e2e = best_e2e.min(start.elapsed());

        // (c') The same with one chunk encoding at a time, its columns on `cores` threads.
        let start = Instant::now();
        pipeline(
            &tier,
            chunks,
            &owned_chunks,
            registry,
            &options,
            1,
            cores,
            200 + 10 * run as u64,
        )
        .await?;
        best_e2e_cols = best_e2e_cols.min(start.elapsed());

        // (c'') One chunk encoding at a time on one thread (the hub before issue 7's tuning).
        let start = Instant::now();
        pipeline(
            &tier,
            chunks,
            &owned_chunks,
            registry,
            &options,
            1,
            1,
            300 + 10 * run as u64,
        )
        .await?;
        best_e2e_one = best_e2e_one.min(start.elapsed());
    }
    let mb = total_bytes as f64 / 1e6;
    let rate = |d: Duration| mb / d.as_secs_f64();
    let pct = |d: Duration| 100.0 * best_raw.as_secs_f64() / d.as_secs_f64();
    // The better of the two parallel end-to-end modes is the figure reported.
    let best_end = best_e2e.min(best_e2e_cols);
    println!(
        "upload: (a) raw PUT {:.1} MB/s ({} objects, {mb:.1} MB, best of {RUNS})",
        rate(best_raw),
        sizes.len()
    );
    println!(
        "upload: (b) upload stage (PUT + verify of encoded chunks) {:.1} MB/s = {:.0}% of raw",
        rate(best_stage),
        pct(best_stage)
    );
    for (what, d) in [
        (
            format!("(c) end to end, {cores} chunks encoding at once"),
            best_e2e,
        ),
        (
            format!("(c') end to end, 1 chunk at a time on {cores} threads"),
            best_e2e_cols,
        ),
        (
            "(c'') end to end, 1 chunk at a time on 1 thread".to_owned(),
            best_e2e_one,
        ),
    ] {
        println!(
            "upload: {what}: {:.1} MB/s = {:.0}% of raw, {:.0} records/s",
            rate(d),
            pct(d),
            n / d.as_secs_f64()
        );
    }
    println!(
        "upload: raw PUT of the same records as JSON lines {:.0} records/s ({:.1} MB/s); best end to end = {:.0}% of it in records/s",
        n / best_json.as_secs_f64(),
        json_payloads.iter().map(Bytes::len).sum::<usize>() as f64 / 1e6 / best_json.as_secs_f64(),
        100.0 * best_json.as_secs_f64() / best_end.as_secs_f64()
    );
    println!(
        "BENCH {{\"bench\":\"tier2_upload\",\"records\":{},\"bytes\":{total_bytes},\"raw_put_mb_s\":{:.1},\"upload_stage_mb_s\":{:.1},\"upload_stage_pct_of_raw\":{:.1},\"e2e_mb_s\":{:.1},\"e2e_records_s\":{:.0},\"e2e_pct_of_raw\":{:.1},\"cores\":{cores}}}",
        records.len(),
        rate(best_raw),
        rate(best_stage),
        pct(best_stage),
        rate(best_end),
        n / best_end.as_secs_f64(),
        pct(best_end)
    );

    // Cold read-through: a fresh client reads every chunk of the last upload-stage run, one
    // after the other; then with read-ahead (the next chunk's GET in flight while the current
    // one decodes), as the hub's tier-2 reader does.
    let paths: Vec<String> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| path_of(c, 1000 + i as u64 + 10 * (RUNS as u64 - 1)))
        .collect();
    let mut best = [Duration::MAX; 5];
    for _ in 0..RUNS {
        let fresh = Tier2::open(&server.config())?;
        let start = Instant::now();
        let mut rows = 0usize;
        for p in &paths {
            rows += fresh.read_chunk(p).await?.len();
        }
        if rows != records.len() {
            bail!("read {rows} records, wrote {}", records.len());
        }
        best[0] = best[0].min(start.elapsed());

        // Read-ahead as the hub's tier-2 reader does it: up to AHEAD whole `read_chunk`s
        // (GET + decode on a blocking thread) in flight while the caller consumes the oldest.
        const AHEAD: usize = 2;
        let fresh = Tier2::open(&server.config())?;
        let start = Instant::now();
        let mut rows = 0usize;
        let mut inflight = std::collections::VecDeque::new();
        let mut next = 0;
        while next < paths.len() || !inflight.is_empty() {
            while next < paths.len() && inflight.len() < AHEAD {
                let (t, p) = (fresh.clone(), paths[next].clone());
                inflight.push_back(tokio::spawn(async move { t.read_chunk(&p).await }));
                next += 1;
            }
            let Some(h) = inflight.pop_front() else {
                bail!("nothing in flight");
            };
            rows += h.await??.len();
        }
        if rows != records.len() {
            bail!("read {rows} records, wrote {}", records.len());
        }
        best[1] = best[1].min(start.elapsed());

        let start = Instant::now();
        let mut files = Vec::new();
        for p in &paths {
            files.push(fresh.get(p).await?);
        }
        best[2] = best[2].min(start.elapsed());
        let start = Instant::now();
        for f in files.clone() {
            std::hint::black_box(decode_chunk_with_threads(f, 2)?);
        }
        best[3] = best[3].min(start.elapsed());
        let start = Instant::now();
        for f in files {
            std::hint::black_box(decode_chunk_with_threads(f, 1)?);
        }
        best[4] = best[4].min(start.elapsed());
    }
    let r = |d: Duration| n / d.as_secs_f64();
    println!(
        "read: cold read-through, one chunk at a time {:.0} records/s; with read-ahead of 2 chunks {:.0} records/s",
        r(best[0]),
        r(best[1])
    );
    println!(
        "read: GET alone {:.0} records/s ({:.1} MB/s); decode alone {:.0} records/s (2 threads per chunk), {:.0} records/s (1 thread)",
        r(best[2]),
        total_bytes as f64 / 1e6 / best[2].as_secs_f64(),
        r(best[3]),
        r(best[4])
    );
    std::io::stdout().flush()?;
    Ok(())
}

/// Encode + PUT + verify of every chunk, in chunk order: up to `parallel` chunks encode at
/// once on blocking threads (each on `threads` threads) while the oldest encoded chunk uploads.
#[allow(clippy::too_many_arguments)]
async fn pipeline(
    tier: &Tier2,
    chunks: &[&[TierRecord]],
    owned: &[Arc<Vec<TierRecord>>],
    registry: &FieldRegistry,
    options: &EncodeOptions,
    parallel: usize,
    threads: usize,
    segment_base: u64,
) -> Result<()> {
    type Encoding = tokio::task::JoinHandle<Result<(Bytes, ChunkSummary), tier::EncodeError>>;
    let registry = Arc::new(registry.clone());
    let mut encoding: VecDeque<Encoding> = VecDeque::new();
    let mut next = 0;
    let mut upload: Option<tokio::task::JoinHandle<Result<(), tier::TierError>>> = None;
    for (i, c) in chunks.iter().enumerate() {
        while next < owned.len() && encoding.len() < parallel {
            let (recs, reg, opts) = (owned[next].clone(), registry.clone(), options.clone());
            encoding.push_back(tokio::task::spawn_blocking(move || {
                encode_chunk_with_threads(&recs, &reg, &opts, threads)
            }));
            next += 1;
        }
        let Some(h) = encoding.pop_front() else {
            bail!("no encode in flight");
        };
        let (bytes, summary) = h.await??;
        // One upload in flight, as the hub's tiering loop does: wait for the previous one.
        if let Some(u) = upload.take() {
            u.await??;
        }
        let path = path_of(c, segment_base + i as u64);
        let t = tier.clone();
        upload = Some(tokio::spawn(async move {
            t.upload_chunk(&path, bytes, &summary).await?;
            Ok(())
        }));
    }
    if let Some(u) = upload.take() {
        u.await??;
    }
    Ok(())
}

/// CPU time of the calling thread (first field of `/proc/thread-self/schedstat`, ns): rates
/// per CPU-second do not depend on what else the shared 2-core box is running.
fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// Records per CPU-second of `f` run single-threaded over `chunks`, best of [`RUNS`].
fn per_cpu_second<T>(rows: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let mut best = Duration::MAX;
    for _ in 0..RUNS {
        let start = thread_cpu();
        std::hint::black_box(f()?);
        best = best.min(thread_cpu() - start);
    }
    Ok(rows as f64 / best.as_secs_f64())
}

fn path_of(c: &[TierRecord], segment: u64) -> String {
    chunk_path(
        "telemetry",
        segment,
        c[0].offset,
        ingest_date(c[0].ingest_ts_ns),
    )
}

/// Incompressible bytes (xorshift), so the raw baseline moves as many bytes as Parquet does.
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn to_tier_records(lines: &[&str]) -> Result<Vec<TierRecord>> {
    let mut seqs: HashMap<String, u64> = HashMap::new();
    let mut out = Vec::with_capacity(lines.len());
    for (offset, line) in lines.iter().enumerate() {
        let l: Line = serde_json::from_str(line).with_context(|| format!("parsing {line:?}"))?;
        let device = l.key.split('/').next().unwrap_or("").to_owned();
        let seq = seqs.entry(device.clone()).or_default();
        out.push(TierRecord {
            tags: Vec::new(),
            device,
            epoch: 1,
            seq: *seq,
            offset: offset as u64,
            key: l.key,
            ts_ns: l.ts,
            ingest_ts_ns: l.ts,
            fields: l.fields.0,
        });
        *seq += 1;
    }
    Ok(out)
}

fn data_path() -> Result<PathBuf> {
    let arg = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    if let Some(p) = arg.or_else(|| std::env::var("TRIBUTARY_BENCH_DATA").ok()) {
        return Ok(PathBuf::from(p));
    }
    let path = PathBuf::from(DEFAULT_DATA);
    if !path.exists() {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/data/gen_telemetry.py"
        );
        println!("generating {DEFAULT_DATA} with {script}");
        let out = Command::new("python3")
            .args([script, "--devices", "200", "--seconds", "3000"])
            .output()
            .context("running gen_telemetry.py")?;
        if !out.status.success() {
            bail!(
                "gen_telemetry.py failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &out.stdout)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path)
}

/// One NDJSON line as `gen_telemetry.py` writes it, keeping field order and the
/// integer/float distinction (same reading as sync's columnar bench).
#[derive(Deserialize)]
struct Line {
    key: String,
    ts: i64,
    fields: Fields,
}

struct Fields(Vec<(String, Value)>);
struct JsonValue(Value);

impl<'de> Deserialize<'de> for Fields {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of fields")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, JsonValue>()? {
                    out.push((k, v.0));
                }
                Ok(Fields(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for JsonValue {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = JsonValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number, boolean or string")
            }
            fn visit_bool<E>(self, v: bool) -> Result<JsonValue, E> {
                Ok(JsonValue(Value::Bool(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<JsonValue, E> {
                Ok(JsonValue(Value::I64(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<JsonValue, E> {
                i64::try_from(v)
                    .map(|v| JsonValue(Value::I64(v)))
                    .map_err(E::custom)
            }
            fn visit_f64<E>(self, v: f64) -> Result<JsonValue, E> {
                Ok(JsonValue(Value::F64(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<JsonValue, E> {
                Ok(JsonValue(Value::Str(v.to_owned())))
            }
        }
        d.deserialize_any(V)
    }
}
