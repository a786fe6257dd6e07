//! Prometheus remote write (`POST /api/v1/write`) end to end, in-process on a real socket:
//! - hand-built snappy `WriteRequest`s get every answer the route documents (204 once durable,
//!   staleness markers dropped and counted, 400 for a body that does not decode or a bad
//!   series, 401, 404, 413 before decompressing, 415), and other routes still refuse snappy;
//! - a real Prometheus (Debian's `prometheus` package) scrapes itself and the agent every
//!   second and forwards through `remote_write`; the records hold the metric name as the field
//!   and the labels as tags, keyed by `key_from_tags`, at plausible nanosecond times, and no
//!   sample is stored twice unless Prometheus says it retried.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_agent::config::EdgeConfig;
use edge_agent::http::AppState;
use edge_agent::http::client::Client;
use edge_agent::http::prom_write::{Label, STALE_NAN_BITS, Sample, TimeSeries, WriteRequest};
use edge_agent::log::{Log, LogHandle};
use edge_agent::storage::RealStorage;
use prost::Message as _;
use sync::block::{DecodeLimits, decode_block};
use sync::{Record, Value};
use tokio::sync::oneshot;

const TOKEN: &str = "prom-write-test-token";

/// A served API over a fresh log with streams `prometheus`, `node` and `telemetry`; stops
/// when dropped.
struct Server {
    client: Client,
    addr: String,
    app: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.app.ingest.log().shutdown();
    }
}

async fn start(extra: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "data_dir = {:?}\n[[streams]]\nname = \"prometheus\"\n[[streams]]\nname = \"node\"\n\
         [[streams]]\nname = \"telemetry\"\n[http]\ntoken = \"{TOKEN}\"\n{extra}",
        dir.path().join("data")
    );
    let cfg = EdgeConfig::from_toml(&toml, dir.path(), Some(HashMap::new())).unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    let app = AppState::new(&cfg, log);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(edge_agent::http::serve(listener, app.clone(), async {
        let _ = stopped.await;
    }));
    let client = Client::new(&addr)
        .unwrap()
        .with_token(Some(TOKEN.into()))
        .with_timeout(Duration::from_secs(20));
    Server {
        client,
        addr,
        app,
        stop: Some(stop),
        _dir: dir,
    }
}

fn stored(log: &LogHandle, stream: &str) -> Vec<Record> {
    let blocks = log.read_blocks(stream, log.epoch(), 0, usize::MAX).unwrap();
    let limits = DecodeLimits::default();
    let mut out = Vec::new();
    for b in blocks {
        out.extend(decode_block(&b.bytes, &limits).unwrap().records);
    }
    out
}

/// Sends one raw HTTP/1.1 POST to `path` with `headers` and returns (status, body).
async fn raw_post(addr: &str, path: &str, headers: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Content-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

/// The headers Prometheus sends, with the bearer token.
fn rw_headers() -> String {
    format!(
        "Authorization: Bearer {TOKEN}\r\nContent-Type: application/x-protobuf\r\n\
         Content-Encoding: snappy\r\nX-Prometheus-Remote-Write-Version: 0.1.0\r\n"
    )
}

fn series(labels: &[(&str, &str)], samples: &[(f64, i64)]) -> TimeSeries {
    TimeSeries {
        labels: labels
            .iter()
            .map(|(n, v)| Label {
                name: (*n).into(),
                value: (*v).into(),
            })
            .collect(),
        samples: samples
            .iter()
            .map(|&(value, timestamp)| Sample { value, timestamp })
            .collect(),
        exemplars: vec![],
        histograms: vec![],
    }
}

fn snappy(timeseries: Vec<TimeSeries>) -> Vec<u8> {
    let plain = WriteRequest { timeseries }.encode_to_vec();
    snap::raw::Encoder::new().compress_vec(&plain).unwrap()
}

/// The sum of the samples of the family `name`, whatever their labels; `None` without one.
fn family_sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The value of the sample `line_start` (name and labels as rendered) on a `/metrics` text.
fn metric(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

#[tokio::test]
async fn hand_built_writes_get_the_documented_answers() {
    let s = start("body_bytes_max = \"64KiB\"\n").await;
    let headers = rw_headers();
    let now_ms = 1_764_374_400_000;
    let good = snappy(vec![
        series(
            &[("__name__", "up"), ("job", "node"), ("instance", "h:9100")],
            &[
                (1.0, now_ms),
                (f64::from_bits(STALE_NAN_BITS), now_ms + 1000),
            ],
        ),
        series(
            &[("__name__", "temp_celsius"), ("room", "a/b")],
            &[(21.5, now_ms)],
        ),
    ]);
    let (status, body) = raw_post(&s.addr, "/api/v1/write", &headers, &good).await;
    assert_eq!(status, 204, "{body}");
    let records = stored(s.app.ingest.log(), "prometheus");
    assert_eq!(
        records.len(),
        2,
        "the staleness marker is not stored: {records:?}"
    );
    assert_eq!(records[0].key, "instance=h:9100/job=node");
    assert_eq!(records[0].tag("job"), Some("node"));
    assert_eq!(records[0].ts, now_ms * 1_000_000);
    assert_eq!(records[0].fields, vec![("up".into(), Value::F64(1.0))]);
    assert_eq!(records[1].key, "room=a%2Fb");

    let (status, body) = raw_post(&s.addr, "/api/v1/write?stream=node", &headers, &good).await;
    assert_eq!(status, 204, "{body}");
    assert_eq!(stored(s.app.ingest.log(), "node").len(), 2);
    let text = s.client.get("/metrics").await.unwrap().text();
    for (line, want) in [
        (
            "tributary_edge_prometheus_dropped_total{stream=\"prometheus\",reason=\"stale\"}",
            1.0,
        ),
        (
            "tributary_edge_prometheus_dropped_total{stream=\"node\",reason=\"stale\"}",
            1.0,
        ),
        ("tributary_edge_http_requests_total{code=\"204\"}", 2.0),
    ] {
        assert_eq!(metric(&text, line), Some(want), "{line} in\n{text}");
    }

    let (status, body) = raw_post(&s.addr, "/api/v1/write?stream=nope", &headers, &good).await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("\\\"nope\\\""), "{body}");
    let no_token = headers.replace(TOKEN, "wrong");
    let (status, _) = raw_post(&s.addr, "/api/v1/write", &no_token, &good).await;
    assert_eq!(status, 401);

    // Bodies that do not decode: Prometheus does not retry a 4xx.
    let (status, body) =
        raw_post(&s.addr, "/api/v1/write", &headers, b"\xff\xff\xff\xff\xff").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not snappy"), "{body}");
    let not_proto = snap::raw::Encoder::new()
        .compress_vec(b"\x0a\x05hi")
        .unwrap();
    let (status, body) = raw_post(&s.addr, "/api/v1/write", &headers, &not_proto).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a remote-write WriteRequest"), "{body}");
    let twice = snappy(vec![series(
        &[("__name__", "m"), ("a", "1"), ("a", "2")],
        &[(1.0, now_ms)],
    )]);
    let (status, body) = raw_post(&s.addr, "/api/v1/write", &headers, &twice).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("`a` appears twice"), "{body}");

    // 1 MiB of one byte compresses far below the 64 KiB cap; its header says 1 MiB.
    let big = snap::raw::Encoder::new()
        .compress_vec(&vec![7u8; 1 << 20])
        .unwrap();
    assert!(big.len() < 64 << 10);
    let (status, body) = raw_post(&s.addr, "/api/v1/write", &headers, &big).await;
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("http.body_bytes_max"), "{body}");

    for (from, to) in [
        ("application/x-protobuf", "application/json"),
        ("Content-Encoding: snappy", "Content-Encoding: zstd"),
        ("Content-Encoding: snappy\r\n", ""),
    ] {
        let (status, body) =
            raw_post(&s.addr, "/api/v1/write", &headers.replace(from, to), &good).await;
        assert_eq!(status, 415, "{from} -> {to}: {body}");
    }
    // Another route still refuses snappy.
    let ndjson = snap::raw::Encoder::new()
        .compress_vec(b"{\"key\":\"k\",\"ts\":1,\"fields\":{\"v\":1}}\n")
        .unwrap();
    let records_headers = format!(
        "Authorization: Bearer {TOKEN}\r\nContent-Type: application/x-ndjson\r\n\
         Content-Encoding: snappy\r\n"
    );
    let (status, body) = raw_post(
        &s.addr,
        "/v1/streams/telemetry/records",
        &records_headers,
        &ndjson,
    )
    .await;
    assert_eq!(status, 415, "{body}");
    assert!(body.contains("\\\"snappy\\\""), "{body}");

    // Only the two good batches were stored.
    assert_eq!(stored(s.app.ingest.log(), "prometheus").len(), 2);
    assert!(stored(s.app.ingest.log(), "telemetry").is_empty());
}

/// A Prometheus process, killed on drop if it is still running.
struct Prometheus {
    child: Child,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Ends it with SIGTERM (it flushes its remote-write queue) and waits, up to a minute.
    fn stop(&mut self) {
        // By its pid: only the process this test started.
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").arg("-TERM").arg(pid).status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("prometheus did not stop within 60 s of SIGTERM");
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn prometheus_binary() -> PathBuf {
    for p in ["/usr/bin/prometheus", "/usr/local/bin/prometheus"] {
        if Path::new(p).exists() {
            return p.into();
        }
    }
    let found = Command::new("prometheus")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "prometheus is not installed: install Debian's prometheus package (apt-get install prometheus)"
    );
    "prometheus".into()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_prometheus(dir: &Path, agent: &str) -> (Prometheus, String) {
    let binary = prometheus_binary();
    let port = free_port();
    let me = format!("127.0.0.1:{port}");
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n\
             \x20 - job_name: prometheus\n    static_configs: [{{targets: [\"{me}\"]}}]\n\
             \x20 - job_name: agent\n    static_configs: [{{targets: [\"{agent}\"]}}]\n\
             remote_write:\n\
             \x20 - url: http://{agent}/api/v1/write\n\
             \x20   authorization: {{credentials: {TOKEN}}}\n\
             \x20   queue_config: {{batch_send_deadline: 1s}}\n"
        ),
    )
    .unwrap();
    let log = dir.join("prometheus.log");
    let child = Command::new(binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={me}"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("prometheus.out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    (Prometheus { child, log }, me)
}

/// Whether `records` hold `up` samples of both jobs at two scrape times or more each.
fn both_jobs_scraped_twice(records: &[Record]) -> bool {
    ["agent", "prometheus"].iter().all(|job| {
        let times: std::collections::HashSet<i64> = records
            .iter()
            .filter(|r| r.tag("job") == Some(job) && r.field("up").is_some())
            .map(|r| r.ts)
            .collect();
        times.len() >= 2
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_forwards_its_scrapes_through_the_agent() {
    let s = start("").await;
    let dir = tempfile::tempdir().unwrap();
    let started_ns = edge_agent::http::now_ns();
    let (mut prom, prom_addr) = start_prometheus(dir.path(), &s.addr);
    let log = s.app.ingest.log().clone();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if both_jobs_scraped_twice(&stored(&log, "prometheus")) {
            break;
        }
        if let Ok(Some(exit)) = prom.child.try_wait() {
            panic!("prometheus exited ({exit}):\n{}", prom.log_text());
        }
        assert!(
            Instant::now() < deadline,
            "no `up` samples of both jobs within 120 s; prometheus log:\n{}",
            prom.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let prom_metrics = Client::new(&prom_addr)
        .unwrap()
        .get("/metrics")
        .await
        .map(|r| r.text())
        .unwrap_or_default();
    tokio::task::block_in_place(|| prom.stop());
    let ended_ns = edge_agent::http::now_ns();
    let prom_log = prom.log_text();
    let retried_lines = prom_log.lines().filter(|l| l.contains("retrying")).count();
    let retried_samples = family_sum(
        &prom_metrics,
        "prometheus_remote_storage_samples_retried_total",
    )
    .unwrap_or(0.0);
    let failed = family_sum(
        &prom_metrics,
        "prometheus_remote_storage_samples_failed_total",
    );
    assert_eq!(
        failed,
        Some(0.0),
        "prometheus dropped samples:\n{prom_metrics}\n{prom_log}"
    );

    let records = stored(&log, "prometheus");
    check_records(&records, started_ns, ended_ns);
    let mut seen = std::collections::HashSet::new();
    let mut duplicates = 0usize;
    for r in &records {
        if !seen.insert((r.key.clone(), r.fields[0].0.clone(), r.ts)) {
            duplicates += 1;
        }
    }
    if retried_lines == 0 && retried_samples == 0.0 {
        assert_eq!(duplicates, 0, "stored twice without a retry");
    } else {
        eprintln!(
            "prometheus retried ({retried_lines} log lines, {retried_samples} samples); \
             {duplicates} duplicates"
        );
    }
    // Every write was answered 204, none refused.
    let text = s.client.get("/metrics").await.unwrap().text();
    assert!(
        metric(&text, "tributary_edge_http_requests_total{code=\"204\"}").unwrap() >= 2.0,
        "{text}"
    );
    for code in ["400", "413", "415", "503"] {
        let line = format!("tributary_edge_http_requests_total{{code=\"{code}\"}}");
        assert_eq!(metric(&text, &line), Some(0.0), "{line}\n{prom_log}");
    }
}

/// What every forwarded record must look like, and a few that must be there.
fn check_records(records: &[Record], started_ns: i64, ended_ns: i64) {
    assert!(records.len() > 100, "only {} records", records.len());
    for r in records {
        assert_eq!(r.fields.len(), 1, "{r:?}");
        let (name, value) = &r.fields[0];
        assert!(!name.starts_with("__"), "{r:?}");
        assert!(matches!(value, Value::F64(_)), "{r:?}");
        assert!(
            value_bits(value) != STALE_NAN_BITS,
            "a staleness marker was stored: {r:?}"
        );
        assert!(
            r.tag("job").is_some() && r.tag("instance").is_some(),
            "{r:?}"
        );
        assert!(r.tag("__name__").is_none(), "{r:?}");
        assert_eq!(r.key, sync::record::key_from_tags(&r.tags), "{r:?}");
        // Scrape times in ns, within the run (a minute of slack for the clock's granularity).
        let slack = 60_000_000_000;
        assert!(
            r.ts > started_ns - slack && r.ts < ended_ns + slack,
            "implausible ts {} (run {started_ns}..{ended_ns}): {r:?}",
            r.ts
        );
    }
    let up_agent = records
        .iter()
        .find(|r| r.tag("job") == Some("agent") && r.field("up") == Some(&Value::F64(1.0)));
    assert!(up_agent.is_some(), "no up=1 for the agent's job");
    // A label of the agent's own exposition became a tag beside job and instance.
    let agent_records = records.iter().find(|r| {
        r.field("tributary_edge_records_total").is_some() && r.tag("stream") == Some("prometheus")
    });
    assert!(
        agent_records.is_some(),
        "no tributary_edge_records_total{{stream=\"prometheus\"}}"
    );
}

fn value_bits(v: &Value) -> u64 {
    match v {
        Value::F64(x) => x.to_bits(),
        _ => 0,
    }
}
