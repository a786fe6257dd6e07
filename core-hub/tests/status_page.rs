//! The operator status page in a real browser: headless Chromium (Debian's `chromium`) loads
//! `/` from a hub holding real devices and streams; the rendered DOM must show them, and a
//! screenshot is kept as a test artifact in `target/test-artifacts/status-page.png`.
//!
//! Needs `chromium` on PATH (CI installs the Debian package); `CHROMIUM=/path` overrides.

mod common;

use core_hub::api;
use core_hub::completeness::CompletenessConfig;
use core_hub::ingest::BacklogReport;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Chromium start-up on a loaded 2-core box can take seconds; this bounds a hang.
const BROWSER_DEADLINE: Duration = Duration::from_secs(90);

fn chromium() -> PathBuf {
    if let Ok(p) = std::env::var("CHROMIUM") {
        return PathBuf::from(p);
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "headless Chromium is required for this test: apt-get install chromium (or set CHROMIUM)"
    );
}

fn artifacts_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs Chromium headless with `args` and returns its stdout.
fn run_browser(args: &[String]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let out_path = out_dir.path().join("stdout");
    let err_path = out_dir.path().join("stderr");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("starting chromium");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > BROWSER_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish within {BROWSER_DEADLINE:?}: {}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(status.success(), "chromium failed ({status}): {stderr}");
    std::fs::read_to_string(&out_path).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_shows_devices_and_streams_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    for (device, stream, n) in [
        ("truck-7", "telemetry", 400),
        ("truck-9", "telemetry", 250),
        ("truck-9", "gps-fixes", 120),
        ("pump-station-3", "gps-fixes", 60),
    ] {
        hub.commit_block(device, stream, &common::block(device, 1, 1, n))
            .await
            .unwrap();
    }
    hub.record_backlog(
        "truck-9",
        "telemetry",
        BacklogReport {
            blocks: 12,
            bytes: 48_000,
            oldest_unsent_ts: Some(common::record("truck-9", 251).ts),
            last_seq: 0,
        },
    )
    .unwrap();
    core_hub::completeness::set_retired(&hub, "pump-station-3", true).unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api::router_with(hub.clone(), Vec::new(), CompletenessConfig::default());
    tokio::spawn(api::serve(listener, router, std::future::pending()));
    let url = format!("http://{addr}/");

    // The backlog report reaches the catalog with the writer's next idle flush (1 s): wait for
    // it through the page itself before asking the browser.
    let target = core_hub::client::ApiTarget::from_listen(addr, None);
    let start = Instant::now();
    loop {
        let page = core_hub::client::get(&target, "/").await.unwrap();
        assert_eq!(page.status, 200);
        if String::from_utf8_lossy(&page.body).contains("12 blocks") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "backlog never showed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let dom = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || run_browser(&["--dump-dom".into(), url]))
            .await
            .unwrap()
    };
    for name in [
        "truck-7",
        "truck-9",
        "pump-station-3",
        "telemetry",
        "gps-fixes",
    ] {
        assert!(
            dom.contains(name),
            "`{name}` missing from the rendered page:\n{dom}"
        );
    }
    assert!(dom.contains("id=\"devices\""), "{dom}");
    assert!(dom.contains("id=\"stream-telemetry\""), "{dom}");
    assert!(dom.contains("id=\"stream-gps-fixes\""), "{dom}");
    let row = |device: &str| {
        let start = dom
            .find(&format!("id=\"device-{device}\""))
            .unwrap_or_else(|| panic!("no row for {device}"));
        let end = dom[start..].find("</tr>").unwrap() + start;
        dom[start..end].to_string()
    };
    assert!(row("truck-9").contains("12 blocks"), "{}", row("truck-9"));
    assert!(
        row("pump-station-3").contains("retired"),
        "{}",
        row("pump-station-3")
    );
    assert!(dom.contains("Completeness"), "{dom}");
    assert!(
        dom.contains("Segments") || dom.contains("segment graph"),
        "{dom}"
    );

    let shot = artifacts_dir().join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    let args = vec![
        format!("--screenshot={}", shot.display()),
        "--window-size=1280,1600".into(),
        url,
    ];
    tokio::task::spawn_blocking(move || run_browser(&args))
        .await
        .unwrap();
    let png =
        std::fs::read(&shot).unwrap_or_else(|e| panic!("no screenshot at {}: {e}", shot.display()));
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    assert!(
        png.len() > 10_000,
        "suspiciously small screenshot: {} bytes",
        png.len()
    );
    hub.shutdown();
}
