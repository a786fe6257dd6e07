//! `Idempotency-Key` on the Influx writes (`POST /write`, `POST /api/v2/write`) and on
//! Prometheus remote write (`POST /api/v1/write`), in process on a real socket and a real
//! data directory: the same keyed path as the native records route (`http::idempotency`).
//!
//! For each route: a keyed write is stored (204); its retry with the same key and body gets
//! 204 with `Idempotency-Replayed: true` and stores nothing; the same key with another body
//! gets 422; then the crash window: a keyed write is durable and the agent "dies" before the
//! key's cache row is written (`FaultSwitches::skip_cache_write`), the agent restarts on the
//! same directory, and the retry is still answered from the log. Every batch is stored once.
//!
//! Mutation check: with `FaultSwitches::key_record_off` (no key record in the log, only the
//! cache) the retry after the restart appends the batch again, and the check fails on every
//! route.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use edge_agent::config::EdgeConfig;
use edge_agent::http::AppState;
use edge_agent::http::prom_write::{Label, Sample, TimeSeries, WriteRequest};
use edge_agent::log::{Log, LogHandle};
use edge_agent::storage::RealStorage;
use prost::Message as _;
use sync::Value;
use sync::block::{DecodeLimits, decode_block};
use tokio::sync::oneshot;

const STREAM: &str = "metrics";

/// One agent in process over `dir`; [`Agent::stop`] shuts it down as a restart would.
struct Agent {
    addr: String,
    app: Arc<AppState>,
    stop: oneshot::Sender<()>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Agent {
    async fn start(dir: &Path, mutant: bool) -> Agent {
        let toml = format!(
            "data_dir = {:?}\n[[streams]]\nname = \"{STREAM}\"\n[storage]\nfsync = \"always\"\n",
            dir.join("data")
        );
        let cfg = EdgeConfig::from_toml(&toml, dir, Some(HashMap::new())).unwrap();
        let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
        let app = AppState::new(&cfg, log);
        app.ingest
            .fault_switches()
            .key_record_off
            .store(mutant, Ordering::Relaxed);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = oneshot::channel::<()>();
        let served = tokio::spawn(edge_agent::http::serve(listener, app.clone(), async {
            let _ = stopped.await;
        }));
        Agent {
            addr,
            app,
            stop,
            served,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.served.await.unwrap().unwrap();
        self.app.ingest.log().shutdown();
    }
}

/// A write route and how to build its body.
#[derive(Debug, Clone, Copy)]
enum Route {
    InfluxV1,
    InfluxV2,
    Prometheus,
}

impl Route {
    fn path(self) -> String {
        match self {
            Route::InfluxV1 => format!("/write?db={STREAM}&precision=s"),
            Route::InfluxV2 => format!("/api/v2/write?org=o&bucket={STREAM}&precision=s"),
            Route::Prometheus => format!("/api/v1/write?stream={STREAM}"),
        }
    }

    fn headers(self) -> &'static str {
        match self {
            Route::InfluxV1 | Route::InfluxV2 => "Content-Type: text/plain\r\n",
            Route::Prometheus => {
                "Content-Type: application/x-protobuf\r\nContent-Encoding: snappy\r\n\
                 X-Prometheus-Remote-Write-Version: 0.1.0\r\n"
            }
        }
    }

    /// Batch `b`: `n` samples of the metric `batch` with value `b`, at seconds `1..=n`.
    fn body(self, b: i64, n: i64) -> Vec<u8> {
        match self {
            Route::InfluxV1 | Route::InfluxV2 => (1..=n)
                .map(|i| format!("m,host=gw batch={b}i,i={i}i {i}\n"))
                .collect::<String>()
                .into_bytes(),
            Route::Prometheus => {
                let series = TimeSeries {
                    labels: [("__name__", "batch"), ("host", "gw")]
                        .iter()
                        .map(|(name, value)| Label {
                            name: (*name).into(),
                            value: (*value).into(),
                        })
                        .collect(),
                    samples: (1..=n)
                        .map(|i| Sample {
                            value: b as f64,
                            timestamp: i * 1000,
                        })
                        .collect(),
                    exemplars: vec![],
                    histograms: vec![],
                };
                let plain = WriteRequest {
                    timeseries: vec![series],
                }
                .encode_to_vec();
                snap::raw::Encoder::new().compress_vec(&plain).unwrap()
            }
        }
    }
}

/// The status, the lower-cased head and the body of one raw HTTP/1.1 POST.
async fn post(agent: &Agent, route: Route, key: &str, body: &[u8]) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = &agent.addr;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {addr}\r\n{}Idempotency-Key: {key}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        route.path(),
        route.headers(),
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// How many records of each batch the stream holds, by the batch number.
fn stored_batches(log: &LogHandle) -> HashMap<i64, usize> {
    let blocks = log.read_blocks(STREAM, log.epoch(), 0, usize::MAX).unwrap();
    let mut out = HashMap::new();
    for b in blocks {
        for r in decode_block(&b.bytes, &DecodeLimits::default())
            .unwrap()
            .records
        {
            let batch = r.fields.iter().find_map(|(n, v)| match (n.as_str(), v) {
                ("batch", Value::I64(x)) => Some(*x),
                ("batch", Value::F64(x)) => Some(*x as i64),
                _ => None,
            });
            *out.entry(batch.expect("every record names its batch"))
                .or_default() += 1;
        }
    }
    out
}

/// The scenario of the module docs on `route`; `Err` says what went wrong.
async fn retries_are_stored_once(route: Route, mutant: bool) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), mutant).await;

    let (status, head, body) = post(&agent, route, "k-1", &route.body(1, 3)).await;
    assert_eq!(status, 204, "{route:?} first write: {body}");
    assert!(!head.contains("idempotency-replayed"), "{head}");
    let (status, head, body) = post(&agent, route, "k-1", &route.body(1, 3)).await;
    assert_eq!(status, 204, "{route:?} retry: {body}");
    assert!(head.contains("idempotency-replayed: true"), "{head}");
    let (status, _, body) = post(&agent, route, "k-1", &route.body(9, 1)).await;
    assert_eq!(status, 422, "{route:?} the key with another body: {body}");
    assert!(body.contains("different body"), "{body}");

    // The crash window: batch 2 is durable, its cache row is never written.
    let switches = agent.app.ingest.fault_switches();
    switches.skip_cache_write.store(true, Ordering::Relaxed);
    let (status, _, body) = post(&agent, route, "k-2", &route.body(2, 4)).await;
    assert_eq!(status, 204, "{route:?} batch 2: {body}");
    agent.stop().await;

    let agent = Agent::start(dir.path(), mutant).await;
    for (key, b, n) in [("k-2", 2, 4), ("k-1", 1, 3)] {
        let (status, head, body) = post(&agent, route, key, &route.body(b, n)).await;
        if status != 204 {
            return Err(format!("retry of {key} after the restart: {status} {body}"));
        }
        if !head.contains("idempotency-replayed: true") {
            return Err(format!("retry of {key} after the restart was stored again"));
        }
    }
    let stored = stored_batches(agent.app.ingest.log());
    agent.stop().await;
    let want = HashMap::from([(1, 3), (2, 4)]);
    if stored != want {
        return Err(format!(
            "{route:?}: stored records per batch {stored:?}, want {want:?}"
        ));
    }
    Ok(())
}

const ROUTES: [Route; 3] = [Route::InfluxV1, Route::InfluxV2, Route::Prometheus];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_influx_write_with_a_key_is_stored_once() {
    for route in [Route::InfluxV1, Route::InfluxV2] {
        retries_are_stored_once(route, false).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_prometheus_write_with_a_key_is_stored_once() {
    retries_are_stored_once(Route::Prometheus, false)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_without_the_key_record_the_retries_store_twice() {
    for route in ROUTES {
        let err = retries_are_stored_once(route, true)
            .await
            .expect_err("the retry check passed without key records");
        println!("{route:?} with key_record_off fails as it must: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_precision_is_part_of_an_influx_batch() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(dir.path(), false).await;
    let body = Route::InfluxV1.body(1, 1);
    let (status, _, _) = post(&agent, Route::InfluxV1, "p-1", &body).await;
    assert_eq!(status, 204);
    // The same lines at another precision are other records: not a retry.
    let (status, head, body) = {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = &agent.addr;
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /write?db={STREAM}&precision=ms HTTP/1.1\r\nHost: {addr}\r\n\
             Content-Type: text/plain\r\nIdempotency-Key: p-1\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body).await.unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, head.to_owned(), body.to_owned())
    };
    assert_eq!(status, 422, "{head}\n{body}");
    assert_eq!(
        stored_batches(agent.app.ingest.log()),
        HashMap::from([(1, 1)])
    );
    agent.stop().await;
}
