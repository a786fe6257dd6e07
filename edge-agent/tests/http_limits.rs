//! The agent's `[http]` limit keys, and the mutation check of "the token is checked before the
//! body is read": with the old order switched back on (feature `fault-injection`), a request
//! that sends its head and no body waits for the body timeout instead of getting its 401.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use edge_agent::config::EdgeConfig;
use edge_agent::http::AppState;
use edge_agent::log::Log;
use edge_agent::storage::RealStorage;

fn config(
    dir: &std::path::Path,
    http: &str,
) -> Result<EdgeConfig, edge_agent::config::ConfigError> {
    let toml = format!(
        "data_dir = {:?}\n[http]\n{http}\n[[streams]]\nname = \"telemetry\"\n",
        dir.join("data")
    );
    EdgeConfig::from_toml(&toml, dir, Some(HashMap::new()))
}

#[test]
fn limit_keys_parse_with_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let d = config(dir.path(), "").unwrap().http.limits;
    assert_eq!(d.header_timeout, Duration::from_secs(10));
    assert_eq!(d.body_timeout, Duration::from_secs(30));
    assert_eq!(d.idle_timeout, Duration::from_secs(30));
    assert_eq!((d.connections_max, d.requests_max), (128, 32));
    assert!(d.allowed_hosts.is_empty());
    let set = "header_timeout = \"2s\"\nbody_timeout = \"3s\"\nidle_timeout = \"4s\"\n\
               connections_max = \"7\"\nrequests_max = \"5\"\nallowed_hosts = [\"edge.lan\"]\n\
               body_bytes_max = \"1MiB\"";
    let l = config(dir.path(), set).unwrap().http.limits;
    assert_eq!(l.header_timeout, Duration::from_secs(2));
    assert_eq!(l.body_timeout, Duration::from_secs(3));
    assert_eq!(l.idle_timeout, Duration::from_secs(4));
    assert_eq!(
        (l.connections_max, l.requests_max, l.body_bytes_max),
        (7, 5, 1 << 20)
    );
    assert_eq!(l.allowed_hosts, vec!["edge.lan".to_string()]);
    for (bad, key) in [
        ("header_timeout = \"0s\"", "http.header_timeout"),
        ("idle_timeout = \"soon\"", "http.idle_timeout"),
        ("connections_max = \"0\"", "http.connections_max"),
        ("requests_maximum = \"3\"", "requests_maximum"),
    ] {
        let e = config(dir.path(), bad).unwrap_err().to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
}

/// The status a request gets when it sends a complete head (no token, `Content-Length: 1000`)
/// and no body, from an agent with a token and a 1 s body timeout.
async fn head_only_status(body_before_token: bool) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        "token = \"agent-token-0123456789\"\nbody_timeout = \"1s\"",
    )
    .unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    let app = AppState::new(&cfg, log);
    app.body_before_token
        .store(body_before_token, Ordering::Relaxed);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(edge_agent::http::serve(
        listener,
        app.clone(),
        std::future::pending(),
    ));
    let status = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let head = format!(
            "POST /v1/streams/telemetry/records HTTP/1.1\r\nHost: {addr}\r\n\
             Content-Type: application/x-ndjson\r\nContent-Length: 1000\r\n\r\n"
        );
        s.write_all(head.as_bytes()).unwrap();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n])
            .chars()
            .skip(9)
            .take(3)
            .collect::<String>()
    })
    .await
    .unwrap();
    app.ingest.log().shutdown();
    status
}

#[tokio::test]
async fn the_token_is_checked_before_the_body_is_read() {
    assert_eq!(head_only_status(false).await, "401");
}

#[tokio::test]
async fn mutation_reading_the_body_first_is_caught() {
    // The old order waits for the body that never comes: the check above would fail.
    let status = head_only_status(true).await;
    assert_eq!(
        status, "408",
        "with the body read first the answer is the body timeout"
    );
}
