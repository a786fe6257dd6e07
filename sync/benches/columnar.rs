//! Size and speed benchmark of block format version 2 (columnar) against version 1 and against
//! zstd -3 over the same records as JSON lines, in blocks of the size the agent seals offline.
//!
//! Also measures the alternatives the format was chosen against: Gorilla XOR or raw bits for
//! floats instead of scaled decimals, whole-column instead of per-key prediction, per-column
//! zstd instead of whole-body zstd, and a trained zstd dictionary.
//!
//! ```text
//! cargo bench -p tributary-sync --bench columnar [-- PATH.ndjson]
//! ```
//!
//! Input: the NDJSON file given as argument or in `TRIBUTARY_BENCH_DATA`; by default
//! `/tmp/tributary-telemetry-200x3000.ndjson`, generated on first use with
//! `shared/data/gen_telemetry.py --devices 200 --seconds 3000` (600,000 records). The data is
//! never committed. Speed is measured single-threaded, best of several runs.

use std::fmt;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};
use sync::block::{self, DecodeLimits, HEADER_LEN, VERSION_COLUMNAR, VERSION_ROWS};
use sync::columnar::{self, FloatChoice, OFFLINE_BLOCK_RECORDS, Tuning};
use sync::{Record, Value};

const DEFAULT_DATA: &str = "/tmp/tributary-telemetry-200x3000.ndjson";
const ZSTD_LEVEL: i32 = 3;
const SPEED_RUNS: usize = 5;
/// Records per block when measuring small (live) blocks, where a dictionary could matter.
const LIVE_BLOCK_RECORDS: usize = 256;

fn main() -> Result<()> {
    let path = data_path()?;
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let records = lines
        .iter()
        .map(|l| parse_line(l))
        .collect::<Result<Vec<_>>>()?;
    println!("input: {} ({} records)", path.display(), records.len());
    println!("block size: {OFFLINE_BLOCK_RECORDS} records (columnar::OFFLINE_BLOCK_RECORDS)");

    let mut summary = serde_json::Map::new();
    summary.insert("records".into(), records.len().into());
    summary.insert("block_records".into(), OFFLINE_BLOCK_RECORDS.into());
    // `TRIBUTARY_BENCH_ONLY=speed` skips the size sections; `=decode` loops the v2 decoder for
    // ten seconds, for a profiler.
    let only = std::env::var("TRIBUTARY_BENCH_ONLY").unwrap_or_default();
    if only == "decode" {
        return profile_decode(&records);
    }
    if only != "speed" {
        sizes(&records, &lines, &mut summary)?;
        alternatives(&records, &mut summary)?;
        dictionary(&records, &mut summary)?;
        breakdown(&records)?;
    }
    speed(&records, &mut summary)?;
    if std::env::var_os(TUNED_CHILD).is_none() {
        speed_with_heap_kept(&path, &mut summary)?;
    }
    println!("summary: {}", serde_json::Value::Object(summary));
    Ok(())
}

/// Set in the child run of [`speed_with_heap_kept`].
const TUNED_CHILD: &str = "TRIBUTARY_BENCH_TUNED_CHILD";
/// glibc returns freed memory to the kernel as soon as the top of its heap has a few MiB free
/// (the trim threshold: 128 KiB, raised dynamically), so a reader that frees each decoded
/// block pays page faults and zeroing for the next block's ~30 MiB of records. A long-running
/// reader keeps its heap with this one setting (or `mallopt(M_TRIM_THRESHOLD)`, or another
/// allocator).
const HEAP_KEPT: &str = "glibc.malloc.trim_threshold=268435456";

/// Re-runs the speed section in a child process whose allocator keeps its heap, to separate
/// the codec's cost from the page faults of glibc's default trimming.
fn speed_with_heap_kept(
    path: &std::path::Path,
    summary: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    println!("\n== speed again with GLIBC_TUNABLES={HEAP_KEPT}");
    let out = Command::new(std::env::current_exe()?)
        .arg(path)
        .env("GLIBC_TUNABLES", HEAP_KEPT)
        .env("TRIBUTARY_BENCH_ONLY", "speed")
        .env(TUNED_CHILD, "1")
        .output()
        .context("running the tuned child")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "tuned child failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for line in text
        .lines()
        .filter(|l| l.starts_with("v1 ") || l.starts_with("v2 "))
    {
        println!("{line}");
    }
    let child = text
        .lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .context("child summary")?;
    if let serde_json::Value::Object(m) = serde_json::from_str(child)? {
        for (k, v) in m.into_iter().filter(|(k, _)| k.contains("_records_per_")) {
            summary.insert(format!("{k}_heap_kept"), v);
        }
    }
    Ok(())
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
            "/../../shared/data/gen_telemetry.py"
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

fn per_record(bytes: usize, records: usize) -> f64 {
    bytes as f64 / records as f64
}

/// Sealed v2 and v1 blocks against zstd -3 of the same JSON lines, block by block.
fn sizes(
    records: &[Record],
    lines: &[&str],
    summary: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let (mut v2, mut v1, mut json, mut json_raw) = (0usize, 0usize, 0usize, 0usize);
    for (i, (recs, text)) in records
        .chunks(OFFLINE_BLOCK_RECORDS)
        .zip(lines.chunks(OFFLINE_BLOCK_RECORDS))
        .enumerate()
    {
        let first_seq = (i * OFFLINE_BLOCK_RECORDS) as u64;
        v2 += block::encode_block(VERSION_COLUMNAR, 1, first_seq, recs)?.len();
        v1 += block::encode_block(VERSION_ROWS, 1, first_seq, recs)?.len();
        let mut body = text.join("\n");
        body.push('\n');
        json_raw += body.len();
        json += zstd::bulk::compress(body.as_bytes(), ZSTD_LEVEL)?.len();
    }
    let n = records.len();
    println!(
        "\n== sealed size, bytes/record (blocks of {OFFLINE_BLOCK_RECORDS}, headers included)"
    );
    println!(
        "JSON lines, uncompressed     {:8.3}",
        per_record(json_raw, n)
    );
    println!("JSON lines, zstd -3          {:8.3}", per_record(json, n));
    println!("v1 rows + zstd -3            {:8.3}", per_record(v1, n));
    println!("v2 columnar + zstd -3        {:8.3}", per_record(v2, n));
    println!(
        "v2 / JSON zstd -3            {:8.3}   (target <= 0.25)",
        v2 as f64 / json as f64
    );
    summary.insert(
        "json_zstd3_bytes_per_record".into(),
        per_record(json, n).into(),
    );
    summary.insert("v1_bytes_per_record".into(), per_record(v1, n).into());
    summary.insert("v2_bytes_per_record".into(), per_record(v2, n).into());
    summary.insert(
        "v2_over_json_zstd3".into(),
        (v2 as f64 / json as f64).into(),
    );
    Ok(())
}

/// The sealed size of every block encoded with `tuning`: body through zstd -3 plus the header.
fn sealed_with(records: &[Record], tuning: &Tuning) -> Result<usize> {
    let mut total = 0;
    for recs in records.chunks(OFFLINE_BLOCK_RECORDS) {
        let body = columnar::encode_with(recs, tuning)?;
        assert_eq!(
            columnar::decode(&body, recs.len() as u32)?,
            recs,
            "{tuning:?} must round-trip"
        );
        total += HEADER_LEN + zstd::bulk::compress(&body, ZSTD_LEVEL)?.len();
    }
    Ok(total)
}

/// Each section compressed on its own instead of the body as a whole.
fn per_column_zstd(records: &[Record]) -> Result<usize> {
    let mut total = 0;
    for recs in records.chunks(OFFLINE_BLOCK_RECORDS) {
        total += HEADER_LEN;
        for s in columnar::sections(recs, &Tuning::default())? {
            total += zstd::bulk::compress(&s.bytes, ZSTD_LEVEL)?.len();
        }
    }
    Ok(total)
}

fn alternatives(
    records: &[Record],
    summary: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let n = records.len();
    let variants = [
        (
            "chosen: auto floats, per-key prediction",
            Tuning::default(),
            "v2_auto",
        ),
        (
            "floats forced to scaled decimals",
            Tuning {
                floats: FloatChoice::Scaled,
                ..Tuning::default()
            },
            "v2_scaled",
        ),
        (
            "floats forced to Gorilla XOR (per key)",
            Tuning {
                floats: FloatChoice::Gorilla,
                ..Tuning::default()
            },
            "v2_gorilla",
        ),
        (
            "floats forced to raw bits",
            Tuning {
                floats: FloatChoice::Raw,
                ..Tuning::default()
            },
            "v2_raw_floats",
        ),
        (
            "whole-column prediction only (plain columnar delta)",
            Tuning {
                per_key: false,
                ..Tuning::default()
            },
            "v2_no_per_key",
        ),
        (
            "Gorilla XOR, whole-column prediction only",
            Tuning {
                floats: FloatChoice::Gorilla,
                per_key: false,
            },
            "v2_gorilla_no_per_key",
        ),
    ];
    println!("\n== alternatives, sealed bytes/record (each verified to round-trip)");
    for (label, tuning, id) in variants {
        let bytes = sealed_with(records, &tuning)?;
        println!("{label:52} {:8.3}", per_record(bytes, n));
        summary.insert(
            format!("{id}_bytes_per_record"),
            per_record(bytes, n).into(),
        );
    }
    let per_col = per_column_zstd(records)?;
    println!(
        "{:52} {:8.3}",
        "per-column zstd -3 (instead of whole body)",
        per_record(per_col, n)
    );
    summary.insert(
        "v2_per_column_zstd_bytes_per_record".into(),
        per_record(per_col, n).into(),
    );
    Ok(())
}

/// A zstd dictionary trained on bodies from the first tenth of the data, measured on the rest,
/// for offline-sized blocks and for small live blocks.
fn dictionary(
    records: &[Record],
    summary: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    println!("\n== trained zstd dictionary (16 KiB, trained on the first 10% of records)");
    for block_records in [OFFLINE_BLOCK_RECORDS, LIVE_BLOCK_RECORDS] {
        let split = records.len() / 10;
        let train: Vec<Vec<u8>> = records[..split]
            .chunks(block_records.min(split / 8).max(1))
            .map(columnar::encode)
            .collect::<Result<_, _>>()?;
        let dict = zstd::dict::from_samples(&train, 16 << 10)?;
        let mut with = zstd::bulk::Compressor::with_dictionary(ZSTD_LEVEL, &dict)?;
        let (mut plain_total, mut dict_total, mut count) = (0usize, 0usize, 0usize);
        for recs in records[split..].chunks(block_records) {
            let body = columnar::encode(recs)?;
            plain_total += HEADER_LEN + zstd::bulk::compress(&body, ZSTD_LEVEL)?.len();
            dict_total += HEADER_LEN + with.compress(&body)?.len();
            count += recs.len();
        }
        println!(
            "blocks of {block_records:6}: no dictionary {:8.3}   with dictionary {:8.3} bytes/record",
            per_record(plain_total, count),
            per_record(dict_total, count)
        );
        summary.insert(
            format!("dict_{block_records}_plain_bytes_per_record"),
            per_record(plain_total, count).into(),
        );
        summary.insert(
            format!("dict_{block_records}_dict_bytes_per_record"),
            per_record(dict_total, count).into(),
        );
    }
    Ok(())
}

/// Where the bytes go in the first full block: each section's size after zstd -3 on its own.
fn breakdown(records: &[Record]) -> Result<()> {
    let recs = &records[..OFFLINE_BLOCK_RECORDS.min(records.len())];
    println!("\n== first block by section (raw and zstd -3 alone), bytes/record");
    for s in columnar::sections(recs, &Tuning::default())? {
        let z = zstd::bulk::compress(&s.bytes, ZSTD_LEVEL)?.len();
        println!(
            "{:32} raw {:8.3}   zstd {:8.3}",
            s.name,
            per_record(s.bytes.len(), recs.len()),
            per_record(z, recs.len())
        );
    }
    Ok(())
}

/// Time spent by the wall clock and by this thread on a CPU. The CPU figure is what one core
/// sustains, unaffected by other processes competing for the machine's cores.
#[derive(Debug, Clone, Copy, Default)]
struct Spent {
    wall: Duration,
    cpu: Duration,
}

impl std::ops::AddAssign for Spent {
    fn add_assign(&mut self, o: Spent) {
        self.wall += o.wall;
        self.cpu += o.cpu;
    }
}

/// This thread's CPU time so far, from the scheduler's nanosecond counter.
fn thread_cpu() -> Result<Duration> {
    let text =
        std::fs::read_to_string("/proc/thread-self/schedstat").context("reading schedstat")?;
    let ns: u64 = text
        .split_whitespace()
        .next()
        .context("empty schedstat")?
        .parse()?;
    Ok(Duration::from_nanos(ns))
}

/// Runs `f` and measures it.
fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Spent)> {
    let (wall, cpu) = (Instant::now(), thread_cpu()?);
    let out = f()?;
    let spent = Spent {
        wall: wall.elapsed(),
        cpu: thread_cpu()? - cpu,
    };
    Ok((out, spent))
}

/// Best-of-N rates (records/s by CPU time, by wall time) of `f`, which processes `records`
/// records per call and returns the time that counts.
fn best_rate(records: usize, mut f: impl FnMut() -> Result<Spent>) -> Result<(f64, f64)> {
    let (mut wall, mut cpu) = (Duration::MAX, Duration::MAX);
    for _ in 0..SPEED_RUNS {
        let s = f()?;
        wall = wall.min(s.wall);
        cpu = cpu.min(s.cpu);
    }
    Ok((
        records as f64 / cpu.as_secs_f64(),
        records as f64 / wall.as_secs_f64(),
    ))
}

fn speed(
    records: &[Record],
    summary: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let n = records.len();
    let limits = DecodeLimits::default();
    println!(
        "\n== speed, one thread, best of {SPEED_RUNS}: records/s by thread CPU time (wall clock), \
         through encode_block/decode_block incl. zstd"
    );
    for (version, name) in [(VERSION_COLUMNAR, "v2"), (VERSION_ROWS, "v1")] {
        let blocks: Vec<Vec<u8>> = records
            .chunks(OFFLINE_BLOCK_RECORDS)
            .map(|r| block::encode_block(version, 1, 0, r))
            .collect::<Result<_, _>>()?;
        let enc = best_rate(n, || {
            let ((), spent) = timed(|| {
                for r in records.chunks(OFFLINE_BLOCK_RECORDS) {
                    std::hint::black_box(block::encode_block(version, 1, 0, r)?);
                }
                Ok(())
            })?;
            Ok(spent)
        })?;
        // Steady state, as a reader sees it: decode a block, use it, free it, next block. The
        // first figure stops the clock before freeing (freeing is the reader's cost).
        let dec = best_rate(n, || {
            let mut total = Spent::default();
            for b in &blocks {
                let (d, spent) = timed(|| Ok(block::decode_block(b, &limits)?))?;
                total += spent;
                drop(std::hint::black_box(d));
            }
            Ok(total)
        })?;
        let dec_drop = best_rate(n, || {
            let ((), spent) = timed(|| {
                for b in &blocks {
                    drop(std::hint::black_box(block::decode_block(b, &limits)?));
                }
                Ok(())
            })?;
            Ok(spent)
        })?;
        println!(
            "{name} encode {:>9.0} ({:>9.0})   decode {:>9.0} ({:>9.0})   decode+free {:>9.0} ({:>9.0})",
            enc.0, enc.1, dec.0, dec.1, dec_drop.0, dec_drop.1
        );
        for (what, (cpu, wall)) in [
            ("encode", enc),
            ("decode", dec),
            ("decode_and_free", dec_drop),
        ] {
            summary.insert(
                format!("{name}_{what}_records_per_cpu_s"),
                cpu.round().into(),
            );
            summary.insert(
                format!("{name}_{what}_records_per_wall_s"),
                wall.round().into(),
            );
        }
        if version == VERSION_COLUMNAR {
            let reuse = speed_reusing(n, &blocks, &limits)?;
            println!(
                "v2 decode reusing the previous block's records and buffers {:>9.0} ({:>9.0})",
                reuse.0, reuse.1
            );
            summary.insert(
                "v2_decode_reusing_records_per_cpu_s".into(),
                reuse.0.round().into(),
            );
            summary.insert(
                "v2_decode_reusing_records_per_wall_s".into(),
                reuse.1.round().into(),
            );
        }
    }
    Ok(())
}

/// Decoding block after block into the same records (`columnar::decode_into`) and the same
/// raw buffer: `decode_block`'s steps (verify header and body checksum, decompress within the
/// header's size, check the raw checksum, decode), as a `decode_block_into` would run them.
fn speed_reusing(n: usize, blocks: &[Vec<u8>], limits: &DecodeLimits) -> Result<(f64, f64)> {
    let mut dz = zstd::bulk::Decompressor::new()?;
    let (mut raw, mut out) = (Vec::new(), Vec::new());
    best_rate(n, || {
        let ((), spent) = timed(|| {
            for b in blocks {
                let h = block::verify_block(b, limits)?;
                raw.clear();
                raw.reserve(h.raw_len as usize);
                let got = dz.decompress_to_buffer(&b[HEADER_LEN..], &mut raw)?;
                if got != h.raw_len as usize || crc32c::crc32c(&raw) != h.raw_crc {
                    bail!("raw body does not match its header");
                }
                columnar::decode_into(&raw, h.count, &mut out)?;
                std::hint::black_box(&out);
            }
            Ok(())
        })?;
        Ok(spent)
    })
}

fn profile_decode(records: &[Record]) -> Result<()> {
    let bodies: Vec<(Vec<u8>, u32)> = records
        .chunks(OFFLINE_BLOCK_RECORDS)
        .map(|r| Ok((columnar::encode(r)?, r.len() as u32)))
        .collect::<Result<_>>()?;
    let start = Instant::now();
    let mut n = 0usize;
    while start.elapsed() < Duration::from_secs(10) {
        for (b, count) in &bodies {
            n += std::hint::black_box(columnar::decode(b, *count)?).len();
        }
    }
    println!(
        "columnar::decode alone, decode+drop: {:.0} records/s",
        n as f64 / start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One NDJSON line as `gen_telemetry.py` writes it, keeping field order (serde_json's map
/// would sort it) and integer/float distinction.
fn parse_line(line: &str) -> Result<Record> {
    #[derive(Deserialize)]
    struct Line {
        key: String,
        ts: i64,
        fields: Fields,
    }
    let l: Line = serde_json::from_str(line).with_context(|| format!("parsing {line:?}"))?;
    Ok(Record {
        tags: Vec::new(),
        key: l.key,
        ts: l.ts,
        fields: l.fields.0,
    })
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
