//! Which of the edge agent's internal fields (names starting with `_`) become tier-2 Parquet
//! columns: `_topic` (the MQTT topic a record came from) does; `_mqtt_digest` and
//! `_idempotency`, the agent's duplicate-detection bookkeeping, never do
//! (`core_hub::tiering::TIERED_INTERNAL_FIELDS`, `docs/format/parquet.md`).

mod tier_support;

use core_hub::tiering::{Tiering, store};
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
