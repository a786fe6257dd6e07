//! The hub's operator surface over a real listener: every API error is a JSON body with a
//! stable `code`; with tokens set the status page signs a browser in instead of answering
//! 401; a follow response ends with a shutdown line when the hub stops, and the HTTP drain is
//! bounded; `tributary_hub_devices_connected` follows connections; `tributary_hub_gaps_total`
//! starts from the catalog after a restart; config errors name the key as written in TOML and
//! the environment variable that set it.

mod common;

use common::{block, open};
use core_hub::completeness::CompletenessConfig;
use core_hub::config::HttpConfig;
use core_hub::{Hub, HubConfig, api};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const READER: &str = "reader-token-0123456789";
const ADMIN: &str = "admin-token-0123456789";
const WAIT: Duration = Duration::from_secs(20);

struct Served {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

async fn serve(hub: Arc<Hub>, http: HttpConfig) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let guard = api::guard(&http);
    let router = api::router_for(hub, &http, CompletenessConfig::default(), guard.clone());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(api::serve_with(listener, router, guard, async {
        let _ = rx.await;
    }));
    Served {
        addr,
        stop: Some(tx),
        task: Some(task),
    }
}

fn tokens(admin: bool) -> HttpConfig {
    HttpConfig {
        reader_tokens: vec![READER.into()],
        admin_tokens: if admin {
            vec![ADMIN.into()]
        } else {
            Vec::new()
        },
        ..HttpConfig::default()
    }
}

/// One HTTP/1.1 exchange on a fresh connection: status, head, body (not de-chunked).
async fn raw(addr: SocketAddr, method: &str, path: &str, extra: &str) -> (u16, String, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{extra}\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let status = head[9..12].parse().unwrap();
    (status, head, out[split + 4..].to_vec())
}

/// Asserts a JSON error body with `code`; returns its message.
async fn json_error(addr: SocketAddr, method: &str, path: &str, extra: &str, want: (u16, &str)) {
    let (status, head, body) = raw(addr, method, path, extra).await;
    let what = format!("{method} {path}");
    assert_eq!(status, want.0, "{what}: {head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{what} is not JSON: {head}"
    );
    let v: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{what}: body is not JSON ({e}): {body:?}"));
    assert_eq!(v["code"], want.1, "{what}: {v}");
    let msg = v["error"].as_str().unwrap_or_default();
    assert!(!msg.is_empty(), "{what}: no message: {v}");
}

#[tokio::test]
async fn every_api_error_is_json_with_a_stable_code() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("truck-1", "telemetry", &block("truck-1", 1, 1, 4))
        .await
        .unwrap();
    let bearer = format!("Authorization: Bearer {READER}\r\n");
    let closed = serve(hub.clone(), tokens(false)).await;
    let a = closed.addr;
    json_error(a, "GET", "/v1/streams", "", (401, "TOKEN_REQUIRED")).await;
    json_error(a, "GET", "/metrics", "", (401, "METRICS_TOKEN_REQUIRED")).await;
    let retire = "/v1/devices/truck-1/retire";
    let not_configured = (403, "ADMIN_TOKEN_NOT_CONFIGURED");
    json_error(a, "POST", retire, &bearer, not_configured).await;
    let records = "/v1/streams/nope/records";
    json_error(a, "GET", records, &bearer, (404, "UNKNOWN_STREAM")).await;
    json_error(
        a,
        "GET",
        "/v1/streams/nope",
        &bearer,
        (404, "UNKNOWN_STREAM"),
    )
    .await;
    let completeness = "/v1/streams/telemetry/completeness";
    json_error(a, "GET", completeness, &bearer, (400, "BAD_TIME")).await;
    // An extractor's rejection (axum's own text) and a bad `from`.
    let bad_limit = "/v1/streams/telemetry/records?limit=many";
    json_error(a, "GET", bad_limit, &bearer, (400, "BAD_REQUEST")).await;
    let bad_from = "/v1/streams/telemetry/records?from=yesterday-ish";
    json_error(a, "GET", bad_from, &bearer, (400, "BAD_REQUEST")).await;
    json_error(a, "GET", "/v1/nothing", &bearer, (404, "NOT_FOUND")).await;
    json_error(
        a,
        "DELETE",
        "/v1/streams",
        &bearer,
        (405, "METHOD_NOT_ALLOWED"),
    )
    .await;
    let groups = "/v1/streams/telemetry/groups/g1";
    json_error(a, "GET", groups, &bearer, (404, "UNKNOWN_GROUP")).await;

    let admin = serve(hub.clone(), tokens(true)).await;
    let a = admin.addr;
    json_error(a, "POST", retire, &bearer, (401, "ADMIN_TOKEN_REQUIRED")).await;
    let admin_bearer = format!("Authorization: Bearer {ADMIN}\r\nContent-Length: 0\r\n");
    let ghost = "/v1/devices/ghost/retire";
    json_error(a, "POST", ghost, &admin_bearer, (404, "UNKNOWN_DEVICE")).await;
    // The shared HTTP guard: a body over the hub's bound, and a foreign Origin.
    let big =
        format!("{admin_bearer}Content-Length: 1000000\r\n").replace("Content-Length: 0\r\n", "");
    json_error(a, "POST", retire, &big, (413, "BODY_TOO_LARGE")).await;
    let origin = format!("{bearer}Origin: http://evil.example\r\n");
    json_error(a, "GET", "/v1/streams", &origin, (403, "FORBIDDEN")).await;
}

#[tokio::test]
async fn follows_over_the_limit_get_a_json_503() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), |c| c.read.follows_max = 1);
    let hub = Hub::open(&cfg).unwrap();
    hub.commit_block("truck-1", "telemetry", &block("truck-1", 1, 1, 4))
        .await
        .unwrap();
    let served = serve(hub.clone(), HttpConfig::default()).await;
    let follow = "/v1/streams/telemetry/records?follow=true";
    let mut first = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    let req = format!("GET {follow} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    first.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 256];
    let n = first.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "the first follow opens"
    );
    json_error(served.addr, "GET", follow, "", (503, "FOLLOWS_MAX")).await;
}

#[tokio::test]
async fn status_page_signs_a_browser_in_when_tokens_are_set() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block(
        "truck-secret-7",
        "telemetry",
        &block("truck-secret-7", 1, 1, 4),
    )
    .await
    .unwrap();
    hub.touch("truck-secret-7");
    let served = serve(hub.clone(), tokens(true)).await;
    let a = served.addr;

    // A browser without a token: a sign-in page, 200, that shows nothing of the fleet.
    let (status, head, body) = raw(a, "GET", "/", "").await;
    let page = String::from_utf8(body).unwrap();
    assert_eq!(status, 200, "{head}");
    assert!(
        page.contains("id=login") && page.contains("id=token"),
        "{page}"
    );
    assert!(
        !page.contains("truck-secret-7") && !page.contains("telemetry"),
        "{page}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-security-policy: default-src 'none'; script-src 'self'"),
        "{head}"
    );
    let (status, head, script) = raw(a, "GET", "/status-login.js", "").await;
    assert_eq!(status, 200, "{head}");
    let script = String::from_utf8(script).unwrap();
    assert!(
        script.contains("sessionStorage") && script.contains("Bearer"),
        "{script}"
    );

    // The script's fetch: with the token, the status page itself.
    for token in [READER, ADMIN] {
        let (status, _, body) =
            raw(a, "GET", "/", &format!("Authorization: Bearer {token}\r\n")).await;
        let page = String::from_utf8(body).unwrap();
        assert_eq!(status, 200);
        assert!(
            page.contains("id=devices") && page.contains("truck-secret-7"),
            "{page}"
        );
    }
    // A wrong token is refused, so the script can say so and ask again.
    let wrong = "Authorization: Bearer wrong-token-0123456789\r\n";
    json_error(a, "GET", "/", wrong, (401, "TOKEN_REQUIRED")).await;
}

/// Reads a follow response into `seen` until `done` holds for what arrived so far.
async fn read_until(
    s: &mut tokio::net::TcpStream,
    seen: &mut Vec<u8>,
    done: impl Fn(&str) -> bool,
) {
    let mut buf = [0u8; 8192];
    while !done(&String::from_utf8_lossy(seen)) {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the follow ended early: {}",
            String::from_utf8_lossy(seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
}

/// Reads a follow response (`seen` holds what was read of it already) until its shutdown
/// line; returns that line.
async fn shutdown_line(mut s: tokio::net::TcpStream, mut seen: Vec<u8>) -> Value {
    let has_end = |t: &str| t.lines().any(|l| l.contains("\"end\""));
    read_until(&mut s, &mut seen, has_end).await;
    let text = String::from_utf8_lossy(&seen).to_string();
    let line = text.lines().find(|l| l.contains("\"end\"")).unwrap();
    serde_json::from_str(line.trim()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_ends_with_a_shutdown_line_and_the_drain_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let hub = open(dir.path());
    hub.commit_block("truck-1", "telemetry", &block("truck-1", 1, 1, 6))
        .await
        .unwrap();
    let mut served = serve(hub.clone(), HttpConfig::default()).await;
    // A reader that reads, and one that never reads a byte after its request.
    let follow =
        "GET /v1/streams/telemetry/records?follow=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    let mut reader = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    reader.write_all(follow.as_bytes()).await.unwrap();
    let mut idle = tokio::net::TcpStream::connect(served.addr).await.unwrap();
    idle.write_all(follow.as_bytes()).await.unwrap();
    let deadline = Instant::now() + WAIT;
    while hub
        .streams()
        .read_state()
        .follows_active
        .load(std::sync::atomic::Ordering::Relaxed)
        < 2
    {
        assert!(Instant::now() < deadline, "the follows did not open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The six records reach the reader before the hub stops (a busy machine may be slow).
    let mut seen = Vec::new();
    let six = |t: &str| t.lines().filter(|l| l.contains("\"seq\"")).count() >= 6;
    tokio::time::timeout(WAIT, read_until(&mut reader, &mut seen, six))
        .await
        .expect("the six records did not arrive");
    let started = Instant::now();
    let _ = served.stop.take().unwrap().send(());
    let task = served.task.take().unwrap();
    let (line, drained) = tokio::join!(shutdown_line(reader, seen), api::shut_down(&hub, task));
    drained.unwrap();
    assert_eq!(line["end"], "hub_shutting_down", "{line}");
    assert_eq!(line["code"], "HUB_SHUTTING_DOWN", "{line}");
    assert_eq!(
        line["next_offset"], 6,
        "resume after the six records: {line}"
    );
    let took = started.elapsed();
    assert!(
        took < api::SHUTDOWN_GRACE + Duration::from_secs(3),
        "the HTTP drain took {took:?}"
    );
    drop(idle);
}

fn scrape(hub: &Hub) -> String {
    core_hub::metrics::render(hub)
}

fn gauge(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn gaps_total_starts_from_the_catalog_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let hub = open(dir.path());
        for dev in ["truck-1", "truck-2", "truck-3"] {
            hub.record_gap(dev, "telemetry", 1, 1, 5, "drop-oldest")
                .await
                .unwrap();
        }
        assert_eq!(gauge(&scrape(&hub), "tributary_hub_gaps_total"), Some(3));
        hub.shutdown();
    }
    let hub = open(dir.path());
    assert_eq!(
        gauge(&scrape(&hub), "tributary_hub_gaps_total"),
        Some(3),
        "after a restart the counter starts from the catalog's gaps"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_connected_follows_connections() {
    let running = common::quic::start(core_hub::server::Mutation::None, |_| {})
        .await
        .unwrap();
    let wait_for = |want: u64| {
        let hub = running.hub.clone();
        async move {
            let deadline = Instant::now() + WAIT;
            loop {
                let now = gauge(&scrape(&hub), "tributary_hub_devices_connected");
                if now == Some(want) {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "devices_connected is {now:?}, not {want}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for(0).await;
    let (c1, _) = common::quic::issue(&running.pki, "truck-1").unwrap();
    let (c2, _) = common::quic::issue(&running.pki, "truck-2").unwrap();
    let a = common::quic::connect(running.quic, &c1).await.unwrap();
    wait_for(1).await;
    let b = common::quic::connect(running.quic, &c2).await.unwrap();
    wait_for(2).await;
    a.close(0u32.into(), b"bye");
    wait_for(1).await;
    b.close(0u32.into(), b"bye");
    wait_for(0).await;
}

#[test]
fn config_errors_name_the_toml_key_and_the_environment_variable() {
    let text = "data_dir = \"/d\"\n[[streams]]\nname = \"a\"\n[streams.scale]\ntarget_records_per_s = \"fast\"\n";
    let err = HubConfig::from_toml(text).unwrap_err().to_string();
    assert!(
        err.contains("`streams[0].scale.target_records_per_s`"),
        "not the key as written in TOML: {err}"
    );
    let unknown = HubConfig::from_toml("data_dir = \"/d\"\n[[streams]]\nname = \"a\"\nscal = 1\n")
        .unwrap_err()
        .to_string();
    assert!(
        unknown.contains("`streams[0].scal`") && unknown.contains("unknown key"),
        "{unknown}"
    );

    let mut env = config::Map::new();
    env.insert("TRIBUTARY_HUB__DATA_DIR".to_string(), "/d".to_string());
    env.insert(
        "TRIBUTARY_HUB__WAL__GROUP_COMMIT_LINGER".to_string(),
        "soon".to_string(),
    );
    let err = HubConfig::load_with_env(None, Some(env))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`wal.group_commit_linger`")
            && err.contains("TRIBUTARY_HUB__WAL__GROUP_COMMIT_LINGER"),
        "the key and the variable are not both named: {err}"
    );
    let mut env = config::Map::new();
    env.insert("TRIBUTARY_HUB__DATA_DIR".to_string(), "/d".to_string());
    env.insert(
        "TRIBUTARY_HUB__INGEST__RECORDS_PER_BLOCK_MAX".to_string(),
        "lots".to_string(),
    );
    let err = HubConfig::load_with_env(None, Some(env))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ingest.records_per_block_max")
            && err.contains("TRIBUTARY_HUB__INGEST__RECORDS_PER_BLOCK_MAX"),
        "a type error from the environment: {err}"
    );
    let log = HubConfig::from_toml("data_dir = \"/d\"\n[log]\nformat = \"xml\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        log.contains("`log.format`") && log.contains("\"json\""),
        "{log}"
    );
}
