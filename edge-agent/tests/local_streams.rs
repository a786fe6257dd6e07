//! A stream kept on the device (`replicate = false`) owes the hub nothing: `/v1/status` shows
//! it with `replicate: false`, no backlog and no oldest unsent record, and `/metrics` has no
//! backlog or lag sample for it (so a replication-lag alert never fires for it), while a
//! replicated stream beside it, with nowhere to ship, shows its backlog and growing age.

mod process_support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use process_support::Setup;
use serde_json::Value as Json;

/// An hour ago, in ns: the records' event time, so the replicated stream's lag is obvious.
fn hour_ago_ns() -> i64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    (now - Duration::from_secs(3600)).as_nanos() as i64
}

fn body(n: usize) -> String {
    let ts = hour_ago_ns();
    (0..n)
        .map(|i| {
            format!(
                "{{\"key\":\"s{}\",\"ts\":{},\"fields\":{{\"v\":{i}}}}}\n",
                i % 3,
                ts + i as i64
            )
        })
        .collect()
}

#[test]
fn a_local_stream_reports_no_backlog_and_no_lag() {
    let setup = Setup::new("");
    let text = format!(
        "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{}\"\n\
         [[streams]]\nname = \"telemetry\"\n\
         [[streams]]\nname = \"raw\"\nreplicate = false\n",
        setup.port
    );
    std::fs::write(&setup.config, text).unwrap();
    let mut agent = setup.start();
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for stream in ["telemetry", "raw"] {
        let r = rt
            .block_on(client.post(
                &format!("/v1/streams/{stream}/records"),
                "application/x-ndjson",
                body(50),
            ))
            .unwrap();
        assert_eq!(r.status, 200, "{stream}: {}", r.text());
    }

    // Both batches are durable once answered; poll anyway until the replicated stream shows
    // its backlog, then check the local one beside it in the same report.
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        let r = rt.block_on(client.get("/v1/status")).unwrap();
        let report: Json = serde_json::from_slice(&r.body).unwrap();
        let telemetry = stream_of(&report, "telemetry");
        if telemetry["backlog_bytes"].as_u64().unwrap_or(0) > 0 {
            break report;
        }
        assert!(Instant::now() < deadline, "no backlog shown: {report}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let telemetry = stream_of(&report, "telemetry");
    assert_eq!(telemetry["replicate"], Json::Bool(true), "{telemetry}");
    assert!(
        telemetry["oldest_unsent_age_s"].as_f64().unwrap() >= 3000.0,
        "{telemetry}"
    );
    let raw = stream_of(&report, "raw");
    assert_eq!(raw["replicate"], Json::Bool(false), "{raw}");
    assert_eq!(raw["backlog_bytes"], 0, "{raw}");
    assert_eq!(raw["backlog_blocks"], 0, "{raw}");
    assert!(raw["oldest_unsent_ts"].is_null(), "{raw}");
    assert!(raw["oldest_unsent_age_s"].is_null(), "{raw}");
    assert_eq!(
        raw["durable_seq"], 50,
        "what it holds is still shown: {raw}"
    );

    let metrics = rt.block_on(client.get("/metrics")).unwrap().text();
    let sample = |name: &str, stream: &str| {
        let prefix = format!("{name}{{stream=\"{stream}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .map(|v| v.parse::<f64>().unwrap())
    };
    for owed in [
        "tributary_edge_backlog_bytes",
        "tributary_edge_backlog_blocks",
        "tributary_edge_oldest_unsent_age_seconds",
    ] {
        assert_eq!(
            sample(owed, "raw"),
            None,
            "{owed} sampled for a local stream"
        );
        assert!(
            sample(owed, "telemetry").unwrap() > 0.0,
            "{owed}\n{metrics}"
        );
    }
    assert_eq!(sample("tributary_edge_stream_replicated", "raw"), Some(0.0));
    assert_eq!(
        sample("tributary_edge_stream_replicated", "telemetry"),
        Some(1.0)
    );
    assert_eq!(sample("tributary_edge_durable_seq", "raw"), Some(50.0));
    agent.terminate();
}

fn stream_of<'a>(report: &'a Json, name: &str) -> &'a Json {
    report["streams"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["stream"] == name))
        .unwrap_or_else(|| panic!("no stream {name} in {report}"))
}
