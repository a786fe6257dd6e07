//! What `edge-agent status`, `/v1/status`, `/healthz` and `/readyz` tell an operator, at
//! process level:
//! - dropped counts come from the log's durable gap markers, so a restart (clean or `kill -9`)
//!   keeps them;
//! - a link that is not up carries its reason, since when (RFC 3339) and the next retry, in the
//!   JSON and in the CLI's text;
//! - `/healthz` stays 200 (liveness) while `/readyz` answers 503 once the link has been down
//!   longer than `hub.link_down_unready_after`, naming the reason.

mod process_support;

use std::time::{Duration, Instant};

use process_support::Setup;
use serde_json::{Value as Json, json};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn status(setup: &Setup, rt: &tokio::runtime::Runtime) -> Json {
    let r = rt.block_on(setup.client().get("/v1/status")).unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    serde_json::from_slice(&r.body).unwrap()
}

fn telemetry<'a>(s: &'a Json, field: &str) -> &'a Json {
    &s["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stream"] == "telemetry")
        .expect("stream telemetry")[field]
}

/// Polls `probe` until it returns `Some`, for at most `timeout`.
fn poll<T>(timeout: Duration, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Posts incompressible batches until the disk budget has dropped records.
fn fill_until_dropped(setup: &Setup, rt: &tokio::runtime::Runtime) -> u64 {
    let client = setup.client();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for batch in 0..2000u64 {
        let body: String = (0..20)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let fields = json!({ "pad": format!("{x:016x}").repeat(12) });
                format!(
                    "{}\n",
                    json!({"key": format!("k{i}"), "ts": batch * 100 + i, "fields": fields})
                )
            })
            .collect();
        let r = rt
            .block_on(client.post(
                "/v1/streams/telemetry/records",
                "application/x-ndjson",
                body,
            ))
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let dropped = telemetry(&status(setup, rt), "dropped_records")
            .as_u64()
            .unwrap();
        if dropped > 0 {
            return dropped;
        }
    }
    panic!("the disk budget never dropped anything");
}

#[test]
fn dropped_counts_survive_restarts() {
    let setup = Setup::new(
        "on_full = \"drop-oldest\"\ndisk_bytes_max = \"256KiB\"\nsegment_bytes_max = \"32KiB\"\nfsync = \"always\"",
    );
    let rt = runtime();
    let mut agent = setup.start();
    let dropped = fill_until_dropped(&setup, &rt);
    let gaps = telemetry(&status(&setup, &rt), "dropped_gaps")
        .as_u64()
        .unwrap();
    assert!(gaps >= 1, "dropped {dropped} records in no gap marker");

    agent.terminate();
    let mut agent = setup.start();
    let after = status(&setup, &rt);
    assert_eq!(
        telemetry(&after, "dropped_records").as_u64(),
        Some(dropped),
        "a clean restart lost the dropped count: {after}"
    );
    assert_eq!(telemetry(&after, "dropped_gaps").as_u64(), Some(gaps));

    agent.kill9();
    let _agent = setup.start();
    let after = status(&setup, &rt);
    assert_eq!(
        telemetry(&after, "dropped_records").as_u64(),
        Some(dropped),
        "kill -9 and a restart lost the dropped count: {after}"
    );
    let out = setup.cli(
        &["status", "--config", setup.config.to_str().unwrap()],
        None,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("{dropped} records")),
        "status does not show {dropped} dropped records:\n{text}"
    );
}

/// An agent whose hub link fails at once on every attempt: the TLS files do not exist.
fn failing_link_setup() -> Setup {
    let setup = Setup::new("fsync = \"always\"");
    let text = std::fs::read_to_string(&setup.config).unwrap();
    let text = text.replacen(
        "[http]",
        "[hub]\naddr = \"127.0.0.1:9\"\nserver_name = \"localhost\"\nbackoff_max = \"3s\"\n\
         link_down_unready_after = \"1s\"\n\
         [tls]\nca = \"missing/ca.pem\"\ncert = \"missing/device.pem\"\nkey = \"missing/device.key\"\n[http]",
        1,
    );
    std::fs::write(&setup.config, text).unwrap();
    setup
}

#[test]
fn link_down_carries_reason_since_and_next_retry() {
    let setup = failing_link_setup();
    let rt = runtime();
    let _agent = setup.start();
    let detail = poll(
        Duration::from_secs(20),
        "a link detail with a next retry",
        || {
            let s = status(&setup, &rt);
            let d = s["link_detail"].clone();
            (s["link"] == "down" && d["next_retry"].is_string()).then_some(d)
        },
    );
    let reason = detail["reason"].as_str().expect("a reason");
    assert!(
        reason.contains("ca.pem"),
        "the reason names no file: {detail}"
    );
    let since = detail["since"].as_str().expect("a since");
    humantime::parse_rfc3339(since).unwrap_or_else(|e| panic!("since {since:?}: {e}"));
    let next = detail["next_retry"].as_str().unwrap();
    let next = humantime::parse_rfc3339(next).unwrap_or_else(|e| panic!("next {next:?}: {e}"));
    let since = humantime::parse_rfc3339(since).unwrap();
    assert!(next >= since, "next retry {next:?} before since {since:?}");

    let text = poll(Duration::from_secs(20), "the CLI to show the retry", || {
        let out = setup.cli(
            &["status", "--config", setup.config.to_str().unwrap()],
            None,
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.contains("next retry in").then_some(text)
    });
    let link = text.lines().find(|l| l.starts_with("link")).unwrap();
    assert!(
        link.contains("down") && link.contains(" since ") && link.contains("ca.pem"),
        "{link}"
    );
}

#[test]
fn readyz_fails_once_the_link_is_down_too_long_while_healthz_stays_ok() {
    let setup = failing_link_setup();
    let rt = runtime();
    let _agent = setup.start();
    let client = setup.client();
    let body = poll(Duration::from_secs(20), "/readyz to answer 503", || {
        let r = rt.block_on(client.get("/readyz")).unwrap();
        (r.status == 503).then(|| r.text())
    });
    assert!(
        body.contains("down for") && body.contains("hub.link_down_unready_after"),
        "{body}"
    );
    assert!(body.contains("ca.pem"), "the reason is missing: {body}");
    let health = rt.block_on(client.get("/healthz")).unwrap();
    assert_eq!(health.status, 200, "liveness failed: {}", health.text());
}

#[test]
fn readyz_is_ok_without_a_hub() {
    let setup = Setup::new("fsync = \"always\"");
    let rt = runtime();
    let _agent = setup.start();
    let r = rt.block_on(setup.client().get("/readyz")).unwrap();
    assert_eq!((r.status, r.text().trim()), (200, "ready"));
}
