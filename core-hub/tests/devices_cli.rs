//! The CLI through the HTTP API: `core-hub devices`, `core-hub devices retire ID [--undo]`,
//! `core-hub streams [NAME]`, against a hub served in this process, with and without a reader
//! token.

mod common;

use core_hub::api;
use core_hub::completeness::CompletenessConfig;
use core_hub::config::HttpConfig;
use serde_json::Value;

const TOKEN: &str = "0123456789abcdef0123";
const ADMIN: &str = "admin-0123456789abcdef";

async fn cli(args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_core-hub"))
        .args(args)
        .env_remove("TRIBUTARY_HUB_TOKEN")
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_retire_and_streams() {
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    for d in ["van-1", "van-2"] {
        hub.commit_block(d, "telemetry", &common::block(d, 1, 1, 20))
            .await
            .unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let http = HttpConfig {
        reader_tokens: vec![TOKEN.into()],
        admin_tokens: vec![ADMIN.into()],
        ..HttpConfig::default()
    };
    let guard = api::guard(&http);
    let router = api::router_for(hub.clone(), &http, CompletenessConfig::default(), guard);
    tokio::spawn(api::serve(listener, router, std::future::pending()));

    // The reader token is enforced on the API and on /metrics (which lists every device);
    // /healthz stays open.
    let (ok, _, err) = cli(&["devices", "--url", &url]).await;
    assert!(!ok);
    assert!(err.contains("401"), "{err}");
    let target = core_hub::client::ApiTarget::parse(&url, None).unwrap();
    assert_eq!(
        core_hub::client::get(&target, "/healthz")
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        core_hub::client::get(&target, "/metrics")
            .await
            .unwrap()
            .status,
        401
    );
    let reader = core_hub::client::ApiTarget::parse(&url, Some(TOKEN.into())).unwrap();
    assert_eq!(
        core_hub::client::get(&reader, "/metrics")
            .await
            .unwrap()
            .status,
        200
    );
    // Without a token, `/` is the sign-in page, which names no device.
    let sign_in = core_hub::client::get(&target, "/").await.unwrap();
    let sign_in_text = String::from_utf8_lossy(&sign_in.body).to_string();
    assert_eq!(sign_in.status, 200);
    assert!(
        sign_in_text.contains("id=login") && !sign_in_text.contains("id=devices"),
        "{sign_in_text}"
    );
    let page = core_hub::client::get(&target, &format!("/?token={TOKEN}"))
        .await
        .unwrap();
    assert_eq!(
        page.status, 200,
        "the status page takes ?token= for browsers"
    );

    let (ok, out, err) = cli(&["devices", "--json", "--url", &url, "--token", TOKEN]).await;
    assert!(ok, "{err}");
    let list: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 2);
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .all(|d| d["retired"] == false)
    );

    // Retiring is an admin action: a reader token is refused.
    let (ok, _, err) = cli(&[
        "devices", "retire", "van-2", "--url", &url, "--token", TOKEN,
    ])
    .await;
    assert!(!ok);
    assert!(err.contains("401") && err.contains("admin"), "{err}");
    let (ok, out, err) = cli(&[
        "devices", "retire", "van-2", "--url", &url, "--token", ADMIN,
    ])
    .await;
    assert!(ok, "{err}");
    assert!(out.contains("retired van-2"), "{out}");
    let (ok, out, _) = cli(&["devices", "list", "--json", "--url", &url, "--token", TOKEN]).await;
    assert!(ok);
    let list: Value = serde_json::from_str(&out).unwrap();
    let retired: Vec<_> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["retired"] == true)
        .map(|d| d["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(retired, vec!["van-2"]);
    let (ok, _, err) = cli(&[
        "devices", "retire", "ghost", "--url", &url, "--token", ADMIN,
    ])
    .await;
    assert!(!ok);
    assert!(err.contains("404"), "{err}");
    let (ok, _, err) = cli(&[
        "devices", "retire", "van-2", "--undo", "--url", &url, "--token", ADMIN,
    ])
    .await;
    assert!(ok, "{err}");
    let (_, out, _) = cli(&["devices", "--json", "--url", &url, "--token", TOKEN]).await;
    let list: Value = serde_json::from_str(&out).unwrap();
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .all(|d| d["retired"] == false)
    );

    let (ok, out, err) = cli(&["streams", "--json", "--url", &url, "--token", TOKEN]).await;
    assert!(ok, "{err}");
    let streams: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(streams[0]["name"], "telemetry");
    assert_eq!(streams[0]["records"], 40);
    let (ok, out, err) = cli(&[
        "streams",
        "telemetry",
        "--json",
        "--url",
        &url,
        "--token",
        TOKEN,
    ])
    .await;
    assert!(ok, "{err}");
    let detail: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(detail["name"], "telemetry");
    assert_eq!(detail["records"], 40);
    assert!(
        detail["rates"]["records_per_s_60s"].as_f64().unwrap() > 0.0,
        "{detail:#}"
    );
    assert_eq!(
        detail["completeness"]["devices"].as_array().unwrap().len(),
        2
    );
    assert!(
        detail["segments"]["segments"]
            .as_array()
            .is_some_and(|s| !s.is_empty()),
        "the segment graph is part of the detail: {detail:#}"
    );
    let (ok, _, err) = cli(&["streams", "nope", "--url", &url, "--token", TOKEN]).await;
    assert!(!ok);
    assert!(err.contains("404"), "{err}");
    hub.shutdown();
}
