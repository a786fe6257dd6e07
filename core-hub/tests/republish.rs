//! MQTT republish against a real mosquitto: every record of the merged stream is republished
//! on its original topic (the edge's `_topic` field, honoured because the stream is listed in
//! `republish.topic_from_record`; the topic template with the key escaped otherwise), with
//! `device`, `epoch` and `seq` as MQTT 5 user properties; the checkpoint (a stream position in
//! the hub catalog) lets a restarted sink resume without losing anything.
//!
//! Needs `mosquitto` (see `mqtt_support`).

mod common;
mod mqtt_support;

use core_hub::republish::{self, RawRepublish};
use mqtt_support::{Broker, DEADLINE, Msg, subscriber};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};
use tokio::sync::watch;

const STREAM: &str = "telemetry";

/// Records `first..=last` of `device`; even seqs came from MQTT (they carry `_topic`).
fn records(device: &str, first: u64, last: u64) -> Vec<Record> {
    (first..=last)
        .map(|seq| {
            let mut fields = vec![("temp".to_string(), Value::F64(seq as f64 / 2.0))];
            if seq.is_multiple_of(2) {
                fields.push((
                    "_topic".into(),
                    Value::Str(format!("sensors/{device}/temp")),
                ));
                fields.push(("_mqtt_digest".into(), Value::I64(seq as i64)));
            }
            Record {
                tags: Vec::new(),
                key: format!("{device}/temp"),
                ts: 1_764_374_400_000_000_000 + seq as i64,
                fields,
            }
        })
        .collect()
}

fn expected_topic(device: &str, seq: u64) -> String {
    if seq.is_multiple_of(2) {
        format!("sensors/{device}/temp")
    } else {
        // The key fills one level: its `/` is escaped.
        format!("hub/{STREAM}/{device}/{device}%2Ftemp")
    }
}

/// One received message: (device, epoch, seq) -> topic.
type Seen = BTreeMap<(String, u64, u64), Vec<String>>;

async fn collect_until(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Msg>,
    seen: &mut Seen,
    want: &BTreeSet<(String, u64, u64)>,
) {
    let start = Instant::now();
    while !want.iter().all(|k| seen.contains_key(k)) {
        let left = DEADLINE.saturating_sub(start.elapsed());
        assert!(
            !left.is_zero(),
            "timed out: {} of {} records republished",
            seen.len(),
            want.len()
        );
        if let Ok(Some(Msg {
            topic,
            device,
            epoch,
            seq,
            payload,
        })) = tokio::time::timeout(left, rx.recv()).await
        {
            assert_eq!(
                payload["device"],
                device.as_str(),
                "payload ids match the properties"
            );
            assert_eq!(payload["seq"], seq);
            assert!(
                payload["fields"].get("_topic").is_none(),
                "internal fields stay out"
            );
            assert!(payload["fields"].get("_mqtt_digest").is_none());
            seen.entry((device, epoch, seq)).or_default().push(topic);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_republished_on_its_topic_with_ids() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let (mut rx, _sub) = subscriber(broker.port, "test-subscriber").await;

    let mut want = BTreeSet::new();
    for (device, n) in [("truck-1", 300u64), ("truck-2", 200)] {
        for (first, last) in [(1, n / 2), (n / 2 + 1, n)] {
            let block =
                encode_block(VERSION_ROWS, 1, first, &records(device, first, last)).unwrap();
            hub.commit_block(device, STREAM, &block).await.unwrap();
        }
        want.extend((1..=n).map(|s| (device.to_string(), 1, s)));
    }

    let cfg = RawRepublish {
        url: Some(format!("mqtt://127.0.0.1:{}", broker.port)),
        streams: Some(vec![STREAM.into()]),
        qos: Some(1),
        topic_template: Some("hub/{stream}/{device}/{key}".into()),
        topic_from_record: Some(vec![STREAM.into()]),
        batch_records: Some(64),
        poll_interval: Some("10ms".into()),
        ..RawRepublish::default()
    }
    .parse()
    .unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks = republish::start(hub.clone(), cfg.clone(), stop_rx);

    let mut seen = Seen::new();
    collect_until(&mut rx, &mut seen, &want).await;
    for ((device, _, seq), topics) in &seen {
        for t in topics {
            assert_eq!(t, &expected_topic(device, *seq), "{device} seq {seq}");
        }
    }
    // The checkpoint reaches the end once the last batch is acknowledged.
    let start = Instant::now();
    while republish::checkpoint(&hub, STREAM).unwrap() < 500 {
        assert!(start.elapsed() < DEADLINE, "checkpoint stuck");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(republish::checkpoint(&hub, STREAM).unwrap(), 500);

    // Stop the sink, commit more, start a new one: it resumes from the checkpoint, so it
    // republishes the new records and nothing it had already checkpointed.
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let block = encode_block(VERSION_ROWS, 1, 301, &records("truck-1", 301, 350)).unwrap();
    hub.commit_block("truck-1", STREAM, &block).await.unwrap();
    let before = seen.values().map(Vec::len).sum::<usize>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks = republish::start(hub.clone(), cfg, stop_rx);
    let more: BTreeSet<_> = (301..=350).map(|s| ("truck-1".to_string(), 1, s)).collect();
    collect_until(&mut rx, &mut seen, &more).await;
    let after = seen.values().map(Vec::len).sum::<usize>();
    assert_eq!(after - before, 50, "only the new records were republished");
    let start = Instant::now();
    while republish::checkpoint(&hub, STREAM).unwrap() < 550 {
        assert!(
            start.elapsed() < DEADLINE,
            "checkpoint stuck after the restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(republish::checkpoint(&hub, STREAM).unwrap(), 550);
    hub.shutdown();
}
