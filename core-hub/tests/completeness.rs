//! Completeness through the HTTP API: `owed` for a device offline with a backlog (naming it),
//! `complete` after it catches up, `complete_with_gaps` for a drop-oldest gap, retired devices
//! left out, `not_heard_since` until devices report after `to + clock_skew`, the watermark, and
//! the gauges in `/metrics`.
//!
//! Devices are driven through the hub's ingest API (`commit_block`, `record_backlog`,
//! `record_gap`): exactly what the QUIC server calls for Block, Backlog and Gap frames.

mod common;

use core_hub::client::{self, ApiTarget};
use core_hub::completeness::{CompletenessConfig, Tracker};
use core_hub::ingest::BacklogReport;
use core_hub::{Hub, api};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

const STREAM: &str = "telemetry";
const DEADLINE: Duration = Duration::from_secs(20);

/// Event time of `seq` in [`common::record`].
fn ts(seq: u64) -> i64 {
    common::record("x", seq).ts
}

async fn serve(hub: Arc<Hub>, cfg: CompletenessConfig) -> ApiTarget {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api::router_with(hub, Vec::new(), cfg);
    tokio::spawn(api::serve(listener, router, std::future::pending()));
    ApiTarget::from_listen(addr, None)
}

async fn get(t: &ApiTarget, path: &str) -> (u16, Value) {
    let r = client::get(t, path).await.unwrap();
    let v = serde_json::from_slice(&r.body)
        .unwrap_or(Value::String(String::from_utf8_lossy(&r.body).into_owned()));
    (r.status, v)
}

async fn query(t: &ApiTarget, from: i64, to: i64) -> Value {
    let (status, v) = get(
        t,
        &format!("/v1/streams/{STREAM}/completeness?from={from}&to={to}"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Polls a query until `pred` holds; backlog reports and contacts reach the catalog with the
/// next group commit or idle flush (1 s).
async fn wait_for(
    t: &ApiTarget,
    from: i64,
    to: i64,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let v = query(t, from, to).await;
        if pred(&v) {
            return v;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn commit(hub: &Hub, device: &str, first: u64, last: u64) {
    hub.commit_block(device, STREAM, &common::block(device, 1, first, last))
        .await
        .unwrap();
}

fn backlog(hub: &Hub, device: &str, blocks: u64, oldest_seq: Option<u64>) {
    let report = BacklogReport {
        blocks,
        bytes: blocks * 1000,
        oldest_unsent_ts: oldest_seq.map(ts),
        last_seq: 0,
    };
    hub.record_backlog(device, STREAM, report).unwrap();
}

fn owed_devices(v: &Value) -> Vec<String> {
    v["owed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["device"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owed_complete_gaps_and_retired() {
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let cfg = CompletenessConfig {
        clock_skew: Duration::from_millis(300),
        ..CompletenessConfig::default()
    };
    let t = serve(hub.clone(), cfg.clone()).await;

    // truck-1: all sent. truck-2: went offline with 3 blocks from seq 51 on unsent.
    // truck-3: dropped its oldest unsent seqs 11..=20 (disk full), sent the rest.
    commit(&hub, "truck-1", 1, 100).await;
    backlog(&hub, "truck-1", 0, None);
    commit(&hub, "truck-2", 1, 50).await;
    backlog(&hub, "truck-2", 3, Some(51));
    commit(&hub, "truck-3", 1, 10).await;
    hub.record_gap("truck-3", STREAM, 1, 11, 20, "disk_full")
        .await
        .unwrap();
    commit(&hub, "truck-3", 21, 80).await;
    backlog(&hub, "truck-3", 0, None);

    // Owed: truck-2 still holds records from before `to`, and the answer names it.
    let v = wait_for(&t, ts(1), ts(90), "only truck-2 owed", |v| {
        v["devices"].as_array().unwrap().len() == 3 && owed_devices(v) == ["truck-2"]
    })
    .await;
    assert_eq!(v["status"], "owed");
    assert_eq!(owed_devices(&v), vec!["truck-2"]);
    let owed = &v["owed"][0];
    assert_eq!(owed["reason"], "backlog");
    assert_eq!(owed["blocks"], 3);
    assert_eq!(owed["bytes"], 3000);
    assert_eq!(owed["oldest_unsent_ts"], ts(51));
    // The gap is listed too (it covers the range), and carries its derived time span.
    let gaps = v["gaps"].as_array().unwrap();
    assert_eq!(gaps.len(), 1, "{v:#}");
    assert_eq!(gaps[0]["device"], "truck-3");
    assert_eq!(
        (gaps[0]["first_seq"].as_u64(), gaps[0]["last_seq"].as_u64()),
        (Some(11), Some(20))
    );
    assert_eq!(gaps[0]["after_ts"], ts(10));
    assert_eq!(gaps[0]["before_ts"], ts(21));
    // Watermark: the minimum of the devices' newest event times.
    assert_eq!(v["watermark_ns"], ts(50));

    // Before truck-2's oldest unsent record, only the gap matters.
    let v = query(&t, ts(1), ts(40)).await;
    assert_eq!(v["status"], "complete_with_gaps", "{v:#}");
    // A range the gap does not touch (its span is ts(10)..ts(21)) is complete.
    let v = query(&t, ts(30), ts(40)).await;
    assert_eq!(v["status"], "complete", "{v:#}");
    assert!(v["owed"].as_array().unwrap().is_empty());
    assert!(v["gaps"].as_array().unwrap().is_empty());

    // truck-2 reconnects and catches up: complete (with truck-3's gap where it applies).
    commit(&hub, "truck-2", 51, 100).await;
    backlog(&hub, "truck-2", 0, None);
    let v = wait_for(&t, ts(30), ts(90), "catch-up", |v| {
        v["status"] == "complete"
    })
    .await;
    assert!(v["owed"].as_array().unwrap().is_empty());
    let v = query(&t, ts(1), ts(90)).await;
    assert_eq!(v["status"], "complete_with_gaps", "{v:#}");
    assert_eq!(v["watermark_ns"], ts(80));

    // A device counts only once heard from after `to + clock_skew`: with `to` = now, every
    // device is owed until each reports again.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    let v = query(&t, ts(30), now).await;
    assert_eq!(v["status"], "owed");
    assert_eq!(owed_devices(&v), vec!["truck-1", "truck-2", "truck-3"]);
    assert!(
        v["owed"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["reason"] == "not_heard_since")
    );
    let v = wait_for(&t, ts(30), now, "reports after to + skew", |v| {
        // Agents report periodically while connected; here each device reports again.
        for d in ["truck-1", "truck-2", "truck-3"] {
            backlog(&hub, d, 0, None);
        }
        v["status"] == "complete"
    })
    .await;
    assert!(v["heard_after_ns"].as_i64().unwrap() >= now);

    // truck-2 goes offline again with a backlog; then it is scrapped and retired.
    commit(&hub, "truck-2", 101, 110).await;
    backlog(&hub, "truck-2", 5, Some(111));
    let v = wait_for(&t, ts(100), ts(200), "truck-2 owed again", |v| {
        owed_devices(v).contains(&"truck-2".to_string())
            && v["owed"]
                .as_array()
                .unwrap()
                .iter()
                .any(|o| o["blocks"] == 5)
    })
    .await;
    assert_eq!(v["status"], "owed");
    let r = client::post(&t, "/v1/devices/truck-2/retire")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = query(&t, ts(100), ts(200)).await;
    assert!(!owed_devices(&v).contains(&"truck-2".to_string()), "{v:#}");
    assert_eq!(v["retired"], serde_json::json!(["truck-2"]));
    assert!(
        v["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["device"] != "truck-2")
    );
    // Out of the watermark too: truck-2's newest event (ts(110)) no longer counts, and the
    // others' minimum (truck-3 at ts(80)) is the watermark.
    assert_eq!(v["watermark_ns"], ts(80));
    let r = client::post(&t, "/v1/devices/nobody/retire").await.unwrap();
    assert_eq!(r.status, 404);
    let (_, devices) = get(&t, "/v1/devices").await;
    let retired: Vec<_> = devices
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["retired"] == true)
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(retired, vec!["truck-2"]);

    // Gauges.
    let m = client::get(&t, "/metrics").await.unwrap();
    let text = String::from_utf8(m.body).unwrap();
    let wm = format!("tributary_hub_stream_watermark_seconds{{stream=\"{STREAM}\"}} ");
    assert!(text.contains(&wm), "{text}");
    assert!(
        text.contains("tributary_hub_stream_active_devices{stream=\"telemetry\"} 2"),
        "{text}"
    );
    assert!(text.contains(
        "tributary_hub_device_backlog_blocks{device=\"truck-1\",stream=\"telemetry\"} 0"
    ));
    assert!(
        !text.contains("device=\"truck-2\",stream=\"telemetry\"} 5"),
        "retired devices have no gauges"
    );

    // Bad input answers 400/404, never panics.
    for (path, want) in [
        (format!("/v1/streams/{STREAM}/completeness?from=1"), 400),
        (
            format!("/v1/streams/{STREAM}/completeness?to=yesterday"),
            400,
        ),
        (
            format!("/v1/streams/{STREAM}/completeness?from=5&to=1"),
            400,
        ),
        ("/v1/streams/nope/completeness?to=1".to_string(), 404),
    ] {
        let r = client::get(&t, &path).await.unwrap();
        assert_eq!(r.status, want, "{path}");
    }
    // RFC 3339 works as well as ns.
    let v = query(&t, 0, ts(40)).await;
    let (status, v2) = get(
        &t,
        &format!(
            "/v1/streams/{STREAM}/completeness?from=1970-01-01T00:00:00Z&to={}",
            ts(40)
        ),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(v["status"], v2["status"]);
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_devices_leave_the_watermark() {
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    commit(&hub, "a", 1, 10).await;
    commit(&hub, "b", 1, 20).await;
    let active = Tracker::new(CompletenessConfig::default());
    let s = active.summary(&hub, STREAM).unwrap();
    assert_eq!(s.watermark_ns, Some(ts(10)));
    assert_eq!(s.active_devices, 2);
    // With a zero idle timeout every device is idle at once: no watermark.
    let idle = Tracker::new(CompletenessConfig {
        idle_timeout: Duration::ZERO,
        ..CompletenessConfig::default()
    });
    let s = idle.summary(&hub, STREAM).unwrap();
    assert_eq!((s.watermark_ns, s.active_devices), (None, 0));
    // The tracker follows new blocks incrementally.
    commit(&hub, "a", 11, 30).await;
    let s = active.summary(&hub, STREAM).unwrap();
    assert_eq!(s.watermark_ns, Some(ts(20)));
    hub.shutdown();
}
