//! HTTP ingest throughput: the agent's real HTTP API (axum, NDJSON parsing, `Ingest`, the log
//! writer with group commit and fsync) in-process on loopback, with concurrent clients posting
//! batches of 1,000 records and waiting for each durable answer.
//!
//! Run: `cargo bench -p edge-agent --bench http_ingest` (target: at least 500k records/s).
//! `HTTP_BENCH_COMPARE=influx` instead posts the same line-protocol records (with `host` and
//! `site` tags) to the native endpoint and to the Influx drop-in `/api/v2/write`, one fresh log
//! each, in one run, and prints the ratio (target: the drop-in within 10% of native).
//! Environment: `HTTP_BENCH_RECORDS` (default 2,000,000), `HTTP_BENCH_CLIENTS` (default 8),
//! `HTTP_BENCH_BATCH` (default 1000), `HTTP_BENCH_FSYNC` (default `interval:10ms`; `always`
//! for per-group fsync), `HTTP_BENCH_DIR` (default a temporary directory in the current one).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use edge_agent::config::EdgeConfig;
use edge_agent::http::client::Client;
use edge_agent::http::{self, AppState};
use edge_agent::log::Log;
use edge_agent::storage::RealStorage;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One NDJSON body of `n` records: 100 keys, two float fields and an integer, like telemetry.
fn body(batch: u64, n: usize) -> Bytes {
    let mut s = String::with_capacity(n * 90);
    for j in 0..n as u64 {
        let i = batch * n as u64 + j;
        s.push_str(&format!(
            "{{\"key\":\"site{}/dev{}\",\"ts\":{},\"fields\":{{\"temp\":{:.2},\"hum\":{:.1},\"n\":{}}}}}\n",
            i % 10,
            i % 100,
            1_700_000_000_000_000_000i64 + i as i64 * 1_000_000,
            20.0 + (i % 500) as f64 / 100.0,
            40.0 + (i % 300) as f64 / 10.0,
            i
        ));
    }
    Bytes::from(s)
}

/// One line-protocol body of `n` records, the telemetry of [`body`] with its key as tags.
fn line_body(batch: u64, n: usize) -> Bytes {
    let mut s = String::with_capacity(n * 100);
    for j in 0..n as u64 {
        let i = batch * n as u64 + j;
        s.push_str(&format!(
            "telemetry,site=site{},host=dev{} temp={:.2},hum={:.1},n={}i {}\n",
            i % 10,
            i % 100,
            20.0 + (i % 500) as f64 / 100.0,
            40.0 + (i % 300) as f64 / 10.0,
            i,
            1_700_000_000_000_000_000i64 + i as i64 * 1_000_000,
        ));
    }
    Bytes::from(s)
}

/// Where a run posts, and what a durable answer is.
struct Target {
    path: &'static str,
    content_type: &'static str,
    ok: u16,
}

fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let records: u64 = env("HTTP_BENCH_RECORDS", 2_000_000);
    let batch: usize = env("HTTP_BENCH_BATCH", 1000);
    let batches = records.div_ceil(batch as u64);
    if std::env::var("HTTP_BENCH_COMPARE").as_deref() == Ok("influx") {
        let bodies: Arc<Vec<Bytes>> = Arc::new((0..batches).map(|b| line_body(b, batch)).collect());
        let native = Target {
            path: "/v1/streams/telemetry/records",
            content_type: "text/plain",
            ok: 200,
        };
        let influx = Target {
            path: "/api/v2/write?bucket=telemetry",
            content_type: "text/plain; charset=utf-8",
            ok: 204,
        };
        let a = run("native line protocol", &native, bodies.clone(), batch)?;
        let b = run("influx /api/v2/write", &influx, bodies, batch)?;
        println!(
            "influx /api/v2/write at {:.1}% of the native endpoint on the same records ({})",
            100.0 * b / a,
            if b >= 0.9 * a {
                "within the 10% target"
            } else {
                "outside the 10% target"
            }
        );
        return Ok(());
    }
    // Bodies are built before the clock starts, so only the agent's work (and the client's
    // HTTP) is timed.
    let bodies: Arc<Vec<Bytes>> = Arc::new((0..batches).map(|b| body(b, batch)).collect());
    let native = Target {
        path: "/v1/streams/telemetry/records",
        content_type: "application/x-ndjson",
        ok: 200,
    };
    let rate = run("http ingest", &native, bodies, batch)?;
    println!(
        "{}",
        if rate >= 500_000.0 {
            "meets the 500k records/s target"
        } else {
            "below the 500k records/s target"
        }
    );
    Ok(())
}

/// Posts every body with the configured clients against a fresh agent; returns records/s.
fn run(label: &str, target: &Target, bodies: Arc<Vec<Bytes>>, batch: usize) -> anyhow::Result<f64> {
    let clients: u64 = env("HTTP_BENCH_CLIENTS", 8);
    let fsync: String = env("HTTP_BENCH_FSYNC", "interval:10ms".to_owned());
    let base = std::env::var("HTTP_BENCH_DIR").unwrap_or_else(|_| ".".into());
    let dir = tempfile::Builder::new()
        .prefix("http-bench-")
        .tempdir_in(base)?;
    let cfg = EdgeConfig::from_toml(
        &format!(
            "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:0\"\nbody_bytes_max = \"64MiB\"\n\
             [storage]\nfsync = \"{fsync}\"\n[[streams]]\nname = \"telemetry\"\n"
        ),
        dir.path(),
        Some(Default::default()),
    )?;
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (elapsed, stored) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = AppState::new(&cfg, log.clone());
        tokio::spawn(http::serve(listener, app, std::future::pending()));
        let client = Client::new(&format!("http://{addr}"))?;
        let next = Arc::new(AtomicU64::new(0));
        let stored = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let (client, next, stored, bodies) =
                    (client.clone(), next.clone(), stored.clone(), bodies.clone());
                let (path, content_type, ok) = (target.path, target.content_type, target.ok);
                tokio::spawn(async move {
                    loop {
                        let b = next.fetch_add(1, Ordering::Relaxed);
                        let Some(body) = bodies.get(b as usize) else {
                            return Ok::<_, anyhow::Error>(());
                        };
                        let r = client.post(path, content_type, body.clone()).await?;
                        anyhow::ensure!(r.status == ok, "answer {}: {}", r.status, r.text());
                        stored.fetch_add(batch as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await??;
        }
        Ok::<_, anyhow::Error>((start.elapsed(), stored.load(Ordering::Relaxed)))
    })?;
    log.shutdown();
    let rate = stored as f64 / elapsed.as_secs_f64();
    println!(
        "{label}: {stored} records in batches of {batch}, {clients} clients, fsync {fsync}: \
         {:.2} s, {:.0} records/s",
        elapsed.as_secs_f64(),
        rate,
    );
    Ok(rate)
}
