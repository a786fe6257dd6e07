//! The HTTP ingest API in-process: every answer the API documents, on a real socket.
//!
//! Each test opens a real log in a temporary directory, serves the router on a free loopback
//! port, and talks to it with the same client `edge-agent ingest` uses. Process-level behaviour
//! (kill -9, restarts, the CLI) is in the `process_*` tests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use edge_agent::config::EdgeConfig;
use edge_agent::http::client::Client;
use edge_agent::http::{AppState, StatusReport};
use edge_agent::log::Log;
use edge_agent::storage::{Fault, FaultError, FaultyStorage, OpKind, RealStorage, Storage};
use serde_json::Value as Json;
use tokio::sync::oneshot;

/// A served API over a fresh log; stops when dropped.
struct Server {
    client: Client,
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

/// Starts a server; `extra` is TOML appended to a config with streams `telemetry` and `status`.
async fn start(extra: &str, storage: Option<Arc<dyn Storage>>) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "data_dir = {:?}\n[[streams]]\nname = \"telemetry\"\n[[streams]]\nname = \"status\"\n{extra}",
        dir.path().join("data")
    );
    let cfg = EdgeConfig::from_toml(&toml, dir.path(), Some(HashMap::new())).unwrap();
    let storage = storage.unwrap_or_else(|| Arc::new(RealStorage));
    let (log, _) = Log::open(cfg.log_config(), storage).unwrap();
    let app = AppState::new(&cfg, log);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(edge_agent::http::serve(listener, app.clone(), async {
        let _ = stopped.await;
    }));
    let client = Client::new(&url)
        .unwrap()
        .with_timeout(Duration::from_secs(20));
    Server {
        client,
        app,
        stop: Some(stop),
        _dir: dir,
    }
}

fn ndjson(key: &str, n: usize, first_ts: i64) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"key\":\"{key}\",\"ts\":{},\"fields\":{{\"v\":{i},\"ok\":true}}}}\n",
                first_ts + i as i64
            )
        })
        .collect()
}

fn json(r: &edge_agent::http::client::Response) -> Json {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.text()))
}

const NDJSON: &str = "application/x-ndjson";
const RECORDS: &str = "/v1/streams/telemetry/records";

#[tokio::test]
async fn ndjson_batch_is_acknowledged_with_its_seq_range() {
    let s = start("", None).await;
    let r = s
        .client
        .post(RECORDS, NDJSON, ndjson("truck-1/engine", 3, 100))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let a = json(&r);
    assert_eq!(a["stream"], "telemetry");
    assert_eq!(
        (
            a["first_seq"].as_u64(),
            a["last_seq"].as_u64(),
            a["count"].as_u64()
        ),
        (Some(1), Some(3), Some(3))
    );
    assert_eq!(
        a["epoch"].as_str().and_then(sync::epoch::parse),
        Some(s.app.ingest.log().epoch()),
        "the epoch is a hex string: {a}"
    );
    let r = s
        .client
        .post(
            RECORDS,
            "application/json; charset=utf-8",
            ndjson("k", 2, 5),
        )
        .await
        .unwrap();
    let a = json(&r);
    assert_eq!(
        (a["first_seq"].as_u64(), a["last_seq"].as_u64()),
        (Some(4), Some(5))
    );
    // The other stream numbers its own seqs.
    let r = s
        .client
        .post("/v1/streams/status/records", NDJSON, ndjson("k", 1, 5))
        .await
        .unwrap();
    assert_eq!(json(&r)["first_seq"].as_u64(), Some(1));
}

#[tokio::test]
async fn line_protocol_batch_is_accepted_and_keyed_by_tags() {
    let s = start("", None).await;
    let body = "# a comment\ntelemetry,device=truck-7,unit=engine temp=71.5,rpm=900i 1764374400000000000\n\
                telemetry,device=truck-7,unit=engine temp=71.6,rpm=905i\n";
    let r = s
        .client
        .post(RECORDS, "text/plain; charset=utf-8", body.to_owned())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(json(&r)["count"].as_u64(), Some(2));
    let status = s.app.ingest.log().status();
    let t = status
        .streams
        .iter()
        .find(|t| t.stream == "telemetry")
        .unwrap();
    assert_eq!(t.next_seq, 3);
    let r = s
        .client
        .post(RECORDS, "text/plain", "status,device=a x=1 1\n".to_owned())
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    let m = json(&r)["error"].as_str().unwrap().to_owned();
    assert!(m.contains("/v1/streams/status/records"), "{m}");
}

#[tokio::test]
async fn malformed_body_is_400_with_line_and_column() {
    let s = start("", None).await;
    let body = format!(
        "{}{{\"key\":\"a\",\"ts\":\"soon\",\"fields\":{{\"x\":1}}}}\n",
        ndjson("a", 2, 1)
    );
    let r = s.client.post(RECORDS, NDJSON, body).await.unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    let e = json(&r);
    assert_eq!(e["line"].as_u64(), Some(3), "{e}");
    assert!(e["column"].as_u64().unwrap() > 1, "{e}");
    assert!(e["error"].as_str().unwrap().contains("line 3"), "{e}");
    // All or nothing: the two good lines before it were not stored.
    assert_eq!(s.app.ingest.log().status().streams[0].next_seq, 1);
    let r = s
        .client
        .post(RECORDS, "text/plain", "telemetry x=\n".to_owned())
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(json(&r)["line"].as_u64(), Some(1));
    let r = s
        .client
        .post(RECORDS, NDJSON, vec![b'{', 0xff, b'}'])
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(json(&r)["error"].as_str().unwrap().contains("UTF-8"));
}

#[tokio::test]
async fn empty_unknown_stream_content_type_and_size_errors() {
    let s = start("[http]\nbody_bytes_max = \"4KiB\"\n", None).await;
    let r = s
        .client
        .post(RECORDS, NDJSON, "\n\n".to_owned())
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(json(&r)["error"].as_str().unwrap().contains("no records"));
    let r = s.client.post(RECORDS, NDJSON, Vec::new()).await.unwrap();
    assert_eq!(r.status, 400);

    let r = s
        .client
        .post("/v1/streams/nope/records", NDJSON, ndjson("a", 1, 1))
        .await
        .unwrap();
    assert_eq!(r.status, 404);
    assert!(json(&r)["error"].as_str().unwrap().contains("\"nope\""));

    let r = s
        .client
        .post(RECORDS, "text/csv", "a,b\n".to_owned())
        .await
        .unwrap();
    assert_eq!(r.status, 415);
    assert!(
        json(&r)["error"]
            .as_str()
            .unwrap()
            .contains("application/x-ndjson")
    );
    let r = s
        .client
        .send("POST", RECORDS, None, ndjson("a", 1, 1).into())
        .await
        .unwrap();
    assert_eq!(r.status, 415);

    let r = s
        .client
        .post(RECORDS, NDJSON, ndjson("a", 200, 1))
        .await
        .unwrap();
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(
        json(&r)["error"]
            .as_str()
            .unwrap()
            .contains("http.body_bytes_max")
    );
    assert_eq!(
        s.app.ingest.log().status().streams[0].next_seq,
        1,
        "nothing stored"
    );
}

#[tokio::test]
async fn token_protects_ingest_and_status_but_not_probes() {
    let s = start("[http]\ntoken = \"s3cret\"\n", None).await;
    let r = s
        .client
        .post(RECORDS, NDJSON, ndjson("a", 1, 1))
        .await
        .unwrap();
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    assert_eq!(s.client.get("/v1/status").await.unwrap().status, 401);
    let wrong = s.client.clone().with_token(Some("guess".into()));
    assert_eq!(
        wrong
            .post(RECORDS, NDJSON, ndjson("a", 1, 1))
            .await
            .unwrap()
            .status,
        401
    );
    let right = s.client.clone().with_token(Some("s3cret".into()));
    assert_eq!(
        right
            .post(RECORDS, NDJSON, ndjson("a", 1, 1))
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(right.get("/v1/status").await.unwrap().status, 200);
    assert_eq!(s.client.get("/healthz").await.unwrap().status, 200);
    assert_eq!(s.client.get("/metrics").await.unwrap().status, 200);
}

#[tokio::test]
async fn healthz_metrics_and_status_report_the_log() {
    let s = start("", None).await;
    let r = s.client.get("/healthz").await.unwrap();
    assert_eq!((r.status, r.text().trim()), (200, "ok"));
    s.client
        .post(RECORDS, NDJSON, ndjson("a", 10, 1))
        .await
        .unwrap();
    let _ = s
        .client
        .post("/v1/streams/nope/records", NDJSON, ndjson("a", 1, 1))
        .await
        .unwrap();

    let r = s.client.get("/metrics").await.unwrap();
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let text = r.text();
    for line in [
        "tributary_edge_next_seq{stream=\"telemetry\"} 11",
        "tributary_edge_durable_seq{stream=\"telemetry\"} 10",
        "tributary_edge_records_total{stream=\"telemetry\"} 10",
        "tributary_edge_appends_total{stream=\"telemetry\"} 1",
        "tributary_edge_segments{stream=\"telemetry\"} 1",
        "tributary_edge_http_requests_total{code=\"404\"} 1",
        "# TYPE tributary_edge_backlog_bytes gauge",
        "# TYPE tributary_edge_dropped_records_total counter",
        "# TYPE tributary_edge_quarantined_blocks_total counter",
        "# TYPE tributary_edge_oldest_unsent_age_seconds gauge",
        "# TYPE tributary_edge_disk_bytes gauge",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }

    let r = s.client.get("/v1/status").await.unwrap();
    let report: StatusReport = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(report.link.label(), "not configured");
    assert_eq!(report.fsync, "interval:10ms");
    let t = &report.streams[0];
    assert_eq!(
        (t.stream.as_str(), t.next_seq, t.durable_seq, t.acked_seq),
        ("telemetry", 11, 10, 0)
    );
    assert!(t.backlog_bytes > 0 && t.backlog_blocks > 0, "{t:?}");
    assert!(
        t.oldest_unsent_age_s.unwrap() > 1e9,
        "event time 1 ns is decades old: {t:?}"
    );
}

#[tokio::test]
async fn concurrent_producers_get_disjoint_contiguous_seq_ranges() {
    let s = start("[storage]\nfsync = \"always\"\n", None).await;
    let mut tasks = Vec::new();
    for p in 0..16 {
        let client = s.client.clone();
        tasks.push(tokio::spawn(async move {
            let mut ranges = Vec::new();
            for b in 0..10 {
                let n = 1 + (p + b) % 7;
                let r = client
                    .post(RECORDS, NDJSON, ndjson(&format!("p{p}"), n, 1))
                    .await
                    .unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
                let a = json(&r);
                let (first, last) = (
                    a["first_seq"].as_u64().unwrap(),
                    a["last_seq"].as_u64().unwrap(),
                );
                assert_eq!(last - first + 1, n as u64);
                ranges.push((first, last));
            }
            ranges
        }));
    }
    let mut ranges = Vec::new();
    for t in tasks {
        ranges.extend(t.await.unwrap());
    }
    ranges.sort();
    let mut next = 1;
    for (first, last) in ranges {
        assert_eq!(
            first, next,
            "ranges must tile 1..=N without gaps or overlap"
        );
        next = last + 1;
    }
}

#[tokio::test]
async fn full_disk_under_block_is_503_with_retry_after() {
    let s = start(
        "[storage]\non_full = \"block\"\ndisk_bytes_max = \"8KiB\"\nsegment_bytes_max = \"2KiB\"\n",
        None,
    )
    .await;
    let big = |i: usize| {
        (0..20)
            .map(|j| {
                format!(
                    "{{\"key\":\"k\",\"ts\":{},\"fields\":{{\"pad\":\"{}\"}}}}\n",
                    i * 100 + j,
                    "x".repeat(200)
                )
            })
            .collect::<String>()
    };
    let mut acked = 0;
    let refused = loop {
        let r = s.client.post(RECORDS, NDJSON, big(acked)).await.unwrap();
        if r.status != 200 {
            break r;
        }
        acked += 1;
        assert!(acked < 1000, "the budget never filled");
    };
    assert_eq!(refused.status, 503, "{}", refused.text());
    let retry: u64 = refused
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let m = json(&refused)["error"].as_str().unwrap().to_owned();
    assert!(m.contains("disk_bytes_max") && m.contains("block"), "{m}");
    assert!(acked > 0, "some batches fit before the budget filled");
    let status = s.app.ingest.log().status();
    assert_eq!(
        status.streams[0].durable_seq,
        acked as u64 * 20,
        "everything acknowledged is still held"
    );
    assert_eq!(
        s.client.get("/healthz").await.unwrap().status,
        200,
        "full is not unhealthy"
    );
}

#[tokio::test]
async fn poisoned_log_answers_503_and_healthz_reports_it() {
    let faulty = FaultyStorage::new(Arc::new(RealStorage));
    let s = start(
        "[storage]\nfsync = \"always\"\n",
        Some(Arc::new(faulty.clone())),
    )
    .await;
    assert_eq!(
        s.client
            .post(RECORDS, NDJSON, ndjson("a", 1, 1))
            .await
            .unwrap()
            .status,
        200
    );
    faulty.add(Fault {
        sticky: true,
        ..Fault::on(OpKind::Sync, FaultError::Eio)
    });
    let r = s
        .client
        .post(RECORDS, NDJSON, ndjson("a", 1, 2))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    let r = s
        .client
        .post(RECORDS, NDJSON, ndjson("a", 1, 3))
        .await
        .unwrap();
    assert_eq!(r.status, 503);
    assert!(
        json(&r)["error"].as_str().unwrap().contains("restart"),
        "{}",
        r.text()
    );
    let h = s.client.get("/healthz").await.unwrap();
    assert_eq!(h.status, 503);
    assert!(h.text().contains("poisoned"), "{}", h.text());
    assert!(
        s.client
            .get("/metrics")
            .await
            .unwrap()
            .text()
            .lines()
            .any(|l| l == "tributary_edge_poisoned 1")
    );
}

/// Sends one raw HTTP/1.1 POST with `headers` and returns (status, body).
async fn raw_post(s: &Server, headers: &str, body: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = s.client.url();
    let addr = url.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {RECORDS} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: {NDJSON}\r\n{headers}\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
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

#[tokio::test]
async fn gzip_bodies_are_decoded_and_bombs_refused_at_the_body_cap() {
    use std::io::Write;
    let gzip = |data: &[u8]| {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(data).unwrap();
        enc.finish().unwrap()
    };
    let s = start("[http]\nbody_bytes_max = \"64KiB\"\n", None).await;
    let plain = ndjson("truck-1/engine", 3, 100);
    let (status, body) = raw_post(&s, "Content-Encoding: gzip\r\n", &gzip(plain.as_bytes())).await;
    assert_eq!(status, 200, "{body}");
    let ack: Json = serde_json::from_str(&body).unwrap();
    assert_eq!(ack["count"], 3);

    // 8 MiB of newlines compress to a few KiB, far below the cap on the wire.
    let bomb = gzip(&vec![b'\n'; 8 << 20]);
    assert!(bomb.len() < 64 << 10);
    let (status, body) = raw_post(&s, "Content-Encoding: gzip\r\n", &bomb).await;
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("decompresses to over"), "{body}");

    let (status, body) = raw_post(&s, "Content-Encoding: gzip\r\n", plain.as_bytes()).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not valid gzip"), "{body}");
    let (status, body) = raw_post(&s, "Content-Encoding: zstd\r\n", plain.as_bytes()).await;
    assert_eq!(status, 415, "{body}");

    // Only the first batch was stored.
    let r = s.client.get("/v1/status").await.unwrap();
    let st = json(&r);
    let stream = st["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["stream"] == "telemetry")
        .unwrap()
        .clone();
    assert_eq!(stream["next_seq"], 4, "{st}");
}
