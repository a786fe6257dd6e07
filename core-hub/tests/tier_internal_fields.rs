//! Which of the edge agent's internal fields (names starting with `_`) become tier-2 Parquet
//! columns: `_topic` (the MQTT topic a record came from) does; `_mqtt_digest` and
//! `_idempotency`, the agent's duplicate-detection bookkeeping, never do
//! (`core_hub::tiering::TIERED_INTERNAL_FIELDS`, `docs/format/parquet.md`). Tier-1 reads (the
//! records API, `core-hub read`, follow reads) serve the same fields, so a record reads the same
//! from either tier.

mod tier_support;

use core_hub::tiering::{Tiering, store};
use std::collections::BTreeMap;
use std::time::Duration;
use sync::block::{VERSION_ROWS, encode_block};
use sync::{Record, Value};
use tier_support::*;

/// Device records as an MQTT-fed agent stores them: `_topic` and `_mqtt_digest` on each, and
/// the key record of an idempotent batch on the last.
fn bridged(first: u64, last: u64) -> Vec<Record> {
    (first..=last)
        .map(|s| {
            let mut r = common::record("dev-1", s);
            r.fields
                .push(("_topic".into(), Value::Str(format!("plant/dev-1/{s}"))));
            r.fields
                .push(("_mqtt_digest".into(), Value::I64(s as i64 * 7919)));
            if s == last {
                r.fields
                    .push(("_idempotency".into(), Value::Str("v1:batch-key".into())));
            }
            r
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_topic_of_the_internal_fields_becomes_a_column() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(&dir.path().join("hub"), |c| {
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.path().join("tier2").display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        t.tier1_budget_bytes = 1 << 40;
    });
    let hub = reopen(&cfg).await;
    let tiering = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    let block = encode_block(VERSION_ROWS, 1, 1, &bridged(1, 40)).unwrap();
    hub.commit_block("dev-1", "telemetry", &block)
        .await
        .unwrap();
    flush(&tiering).await;

    let (records, files) = tier2_records(&tiering).await;
    assert!(files >= 1, "nothing was tiered");
    assert_eq!(records.len(), 40);
    for r in &records {
        let names: Vec<&str> = r.fields.iter().map(|(n, _)| n.as_str()).collect();
        let topic = r.fields.iter().find(|(n, _)| n == "_topic");
        assert_eq!(
            topic.map(|(_, v)| v),
            Some(&Value::Str(format!("plant/dev-1/{}", r.seq))),
            "seq {}: {names:?}",
            r.seq
        );
        assert!(
            !names.contains(&"_mqtt_digest") && !names.contains(&"_idempotency"),
            "seq {}: bookkeeping fields reached tier 2: {names:?}",
            r.seq
        );
        let want = common::record("dev-1", r.seq);
        for f in &want.fields {
            assert!(r.fields.contains(f), "seq {}: {f:?} lost", r.seq);
        }
    }
    // The stream's registry, which names the Parquet columns, never saw them either.
    let stream = hub.stream_id("telemetry").expect("stream");
    let columns: Vec<String> = store::fields(hub.catalog(), stream)
        .unwrap()
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert!(columns.contains(&"_topic".to_owned()), "{columns:?}");
    assert!(
        !columns
            .iter()
            .any(|c| c.starts_with("_mqtt") || c.starts_with("_idem")),
        "{columns:?}"
    );
}

/// The field names of every NDJSON line in `body`, by seq, sorted.
fn ndjson_fields(body: &[u8]) -> BTreeMap<u64, Vec<String>> {
    let text = std::str::from_utf8(body).unwrap();
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let mut names: Vec<String> = v["fields"].as_object().unwrap().keys().cloned().collect();
            names.sort();
            (v["seq"].as_u64().unwrap(), names)
        })
        .collect()
}

fn core_hub_read(args: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_core-hub"))
        .arg("read")
        .args(args)
        .env_remove("TRIBUTARY_HUB_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "core-hub read {args:?}: {err}");
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_reads_the_same_fields_from_tier_1_and_tier_2() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(&dir.path().join("hub"), |c| {
        let t = &mut c.tier2;
        t.url = format!("file://{}", dir.path().join("tier2").display());
        t.chunk_records_max = 1_000;
        t.chunk_age_max = Duration::from_secs(3600);
        // Nothing is evicted: every read below is served by tier 1.
        t.tier1_budget_bytes = 1 << 40;
    });
    let hub = reopen(&cfg).await;
    let tiering = Tiering::open(hub.clone(), &cfg, None).await.unwrap();
    let block = encode_block(VERSION_ROWS, 1, 1, &bridged(1, 40)).unwrap();
    hub.commit_block("dev-1", "telemetry", &block)
        .await
        .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = core_hub::api::router_with(
        hub.clone(),
        Vec::new(),
        core_hub::completeness::CompletenessConfig::default(),
    );
    tokio::spawn(core_hub::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    let target = core_hub::client::ApiTarget::from_listen(addr, None);
    let page = core_hub::client::get(&target, "/v1/streams/telemetry/records?from=start")
        .await
        .unwrap();
    assert_eq!(page.status, 200);
    let http = ndjson_fields(&page.body);
    let url = format!("http://{addr}");
    let cli = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            let paged = core_hub_read(&["telemetry", "--url", &url]);
            let followed =
                core_hub_read(&["telemetry", "--follow", "--limit", "40", "--url", &url]);
            (ndjson_fields(&paged), ndjson_fields(&followed))
        }
    })
    .await
    .unwrap();

    flush(&tiering).await;
    let (tiered, _) = tier2_records(&tiering).await;
    let tier2: BTreeMap<u64, Vec<String>> = tiered
        .iter()
        .map(|r| {
            let mut names: Vec<String> = r.fields.iter().map(|(n, _)| n.clone()).collect();
            names.sort();
            (r.seq, names)
        })
        .collect();
    assert_eq!(tier2.len(), 40);
    for (how, tier1) in [
        ("HTTP", &http),
        ("core-hub read", &cli.0),
        ("follow", &cli.1),
    ] {
        assert_eq!(tier1.len(), 40, "{how}");
        for (seq, names) in tier1 {
            assert!(
                !names
                    .iter()
                    .any(|n| n == "_mqtt_digest" || n == "_idempotency"),
                "{how}: seq {seq}: bookkeeping fields served: {names:?}"
            );
            assert!(
                names.iter().any(|n| n == "_topic"),
                "{how}: seq {seq}: {names:?}"
            );
        }
        assert_eq!(tier1, &tier2, "{how}: tier 1 and tier 2 serve other fields");
    }
    hub.shutdown();
}
