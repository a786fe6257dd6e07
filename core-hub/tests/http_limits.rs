//! The hub's `[http]` keys: the limits with their defaults, the three kinds of token, and the
//! key named in every error; and the API served with them: which token opens which route, the
//! token checked on the head before any body, and foreign origins refused.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use core_hub::api;
use core_hub::client::{self, ApiTarget};
use core_hub::config::HubConfig;

const READER: &str = "reader-0123456789";
const ADMIN: &str = "admin-0123456789a";

fn http(text: &str) -> Result<HubConfig, core_hub::config::ConfigError> {
    HubConfig::from_toml(&format!("data_dir = \"/d\"\n[http]\n{text}"))
}

#[test]
fn limits_and_tokens_parse_with_defaults() {
    let d = http("").unwrap().http;
    assert_eq!(d.limits.header_timeout, Duration::from_secs(10));
    assert_eq!(d.limits.body_timeout, Duration::from_secs(30));
    assert_eq!(d.limits.idle_timeout, Duration::from_secs(30));
    assert_eq!(
        (d.limits.connections_max, d.limits.requests_max),
        (1024, 256)
    );
    assert_eq!(
        d.limits.body_bytes_max,
        core_hub::http_limits::BODY_BYTES_MAX
    );
    assert!(d.reader_tokens.is_empty() && d.admin_tokens.is_empty() && d.metrics_token.is_none());

    let c = http(
        "reader_tokens = [\"reader-0123456789\"]\nadmin_tokens = [\"admin-0123456789a\"]\n\
         metrics_token = \"metrics-012345678\"\nheader_timeout = \"2s\"\nbody_timeout = \"3s\"\n\
         idle_timeout = \"4s\"\nconnections_max = 9\nrequests_max = 3\n\
         allowed_hosts = [\"hub.lan\"]",
    )
    .unwrap()
    .http;
    assert_eq!(c.reader_tokens, vec!["reader-0123456789".to_string()]);
    assert_eq!(c.admin_tokens, vec!["admin-0123456789a".to_string()]);
    assert_eq!(c.metrics_token.as_deref(), Some("metrics-012345678"));
    let l = &c.limits;
    assert_eq!(
        (l.header_timeout, l.body_timeout, l.idle_timeout),
        (
            Duration::from_secs(2),
            Duration::from_secs(3),
            Duration::from_secs(4)
        )
    );
    assert_eq!((l.connections_max, l.requests_max), (9, 3));
    assert_eq!(l.allowed_hosts, vec!["hub.lan".to_string()]);
}

#[test]
fn errors_name_the_key() {
    for (bad, key) in [
        ("admin_tokens = [\"short\"]", "http.admin_tokens[0]"),
        ("metrics_token = \"short\"", "http.metrics_token"),
        ("body_timeout = \"0s\"", "http.body_timeout"),
        ("header_timeout = \"later\"", "http.header_timeout"),
        ("requests_max = 0", "http.requests_max"),
        ("connection_max = 5", "connection_max"),
    ] {
        let e = http(bad).unwrap_err().to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
}

/// Serves the API of a fresh hub with `http_toml`; the target has no token.
async fn serve(dir: &std::path::Path, http_toml: &str) -> ApiTarget {
    let cfg = http(http_toml).unwrap();
    let hub = common::open(dir);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let guard = api::guard(&cfg.http);
    let router = api::router_for(hub, &cfg.http, cfg.completeness.clone(), guard.clone());
    tokio::spawn(api::serve_with(
        listener,
        router,
        guard,
        std::future::pending(),
    ));
    ApiTarget::from_listen(addr, None)
}

fn with(target: &ApiTarget, token: &str) -> ApiTarget {
    ApiTarget {
        token: Some(token.into()),
        ..target.clone()
    }
}

async fn status(target: &ApiTarget, method: &str, path: &str) -> u16 {
    let r = match method {
        "POST" => client::post(target, path).await,
        _ => client::get(target, path).await,
    };
    r.unwrap().status
}

#[tokio::test]
async fn each_token_opens_its_routes() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!("reader_tokens = [\"{READER}\"]\nadmin_tokens = [\"{ADMIN}\"]");
    let open = serve(dir.path(), &toml).await;
    let (reader, admin) = (with(&open, READER), with(&open, ADMIN));
    let retire = "/v1/devices/nobody/retire";
    assert_eq!(status(&open, "GET", "/healthz").await, 200);
    assert_eq!(status(&open, "GET", "/metrics").await, 401);
    assert_eq!(status(&reader, "GET", "/metrics").await, 200);
    assert_eq!(status(&open, "GET", "/v1/devices").await, 401);
    assert_eq!(status(&reader, "GET", "/v1/devices").await, 200);
    assert_eq!(status(&admin, "GET", "/v1/devices").await, 200);
    assert_eq!(status(&reader, "POST", retire).await, 401);
    assert_eq!(status(&admin, "POST", retire).await, 404); // authorized; no such device

    let dir = tempfile::tempdir().unwrap();
    let readers_only = serve(dir.path(), &format!("reader_tokens = [\"{READER}\"]")).await;
    assert_eq!(
        status(&with(&readers_only, READER), "POST", retire).await,
        403
    );
}

/// Sends `head` and no body; returns the status line's code.
fn head_only(authority: &str, head: &str) -> String {
    let mut s = std::net::TcpStream::connect(authority).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .chars()
        .skip(9)
        .take(3)
        .collect()
}

#[tokio::test]
async fn refusals_come_on_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!("admin_tokens = [\"{ADMIN}\"]\nbody_timeout = \"5m\"");
    let target = serve(dir.path(), &toml).await;
    let a = target.authority.clone();
    let answers = tokio::task::spawn_blocking(move || {
        let post = |host: &str, length: usize, extra: &str| {
            let head = format!(
                "POST /v1/devices/d/retire HTTP/1.1\r\nHost: {host}\r\n\
                 Content-Length: {length}\r\n{extra}\r\n"
            );
            head_only(&a, &head)
        };
        let admin = format!("Authorization: Bearer {ADMIN}\r\n");
        [
            // No token: 401 without waiting for the body (the body timeout is 5 min).
            post(&a, 1000, ""),
            // An announced body over the cap: 413 before it is read.
            post(&a, 1_000_000, &admin),
            // A web page elsewhere, or a rebound name: 403 whatever the token.
            post(&a, 1000, &format!("{admin}Origin: http://evil.example\r\n")),
            post("rebind.evil.example", 1000, &admin),
        ]
    })
    .await
    .unwrap();
    assert_eq!(answers, ["401", "413", "403", "403"].map(String::from));
}
