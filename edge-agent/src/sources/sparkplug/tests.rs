//! The host state machine, message by message: alias resolution, typed decoding by the BIRTH
//! datatype, seq wrap and gaps, bdSeq and stale deaths, and when a rebirth is requested.
//!
//! Mutation check (feature `fault-injection`): with `state::switches::set_gap_check(false)` the
//! seq test must fail.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prost::Message as _;
use sync::Value;

use super::proto::{Metric, MetricValue, Payload, datatype as dt};
use super::*;
use crate::sources::mqtt::MqttStats;

const SEC: i64 = 1_000_000_000;

fn host() -> (Host, Arc<MqttStats>) {
    let stats = Arc::new(MqttStats::default());
    let cfg = HostConfig {
        rebirth_interval_ns: 10 * SEC,
        fields_max: 64,
    };
    (Host::new(cfg, stats.clone()), stats)
}

fn m(name: Option<&str>, alias: Option<u64>, datatype: Option<u32>, v: MetricValue) -> Metric {
    Metric {
        name: name.map(str::to_owned),
        alias,
        datatype,
        value: Some(v),
        ..Metric::default()
    }
}

fn payload(seq: Option<u64>, ts: u64, metrics: Vec<Metric>) -> Vec<u8> {
    Payload {
        timestamp: Some(ts),
        seq,
        metrics,
        ..Payload::default()
    }
    .encode_to_vec()
}

fn bd(v: u64) -> Metric {
    m(
        Some("bdSeq"),
        None,
        Some(dt::INT64),
        MetricValue::LongValue(v),
    )
}

/// NBIRTH of g/n with bdSeq `b`, seq 0: temp (alias 1, Int8) and name (alias 2, String).
fn nbirth(b: u64) -> Vec<u8> {
    payload(
        Some(0),
        1_000,
        vec![
            bd(b),
            m(
                Some("temp"),
                Some(1),
                Some(dt::INT8),
                MetricValue::IntValue(5),
            ),
            m(
                Some("name"),
                Some(2),
                Some(dt::STRING),
                MetricValue::StringValue("a".into()),
            ),
        ],
    )
}

fn run(h: &mut Host, topic: &str, p: &[u8], now: i64) -> Output {
    let mut out = Output::default();
    h.handle(topic, p, now, &mut out);
    out
}

fn field<'a>(r: &'a sync::Record, name: &str) -> Option<&'a Value> {
    r.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

#[test]
fn birth_then_data_by_alias_with_birth_types() {
    let (mut h, stats) = host();
    let out = run(&mut h, "spBv1.0/g/NBIRTH/n", &nbirth(3), 0);
    assert_eq!(out.records.len(), 1);
    let r = &out.records[0];
    assert_eq!(r.tag("group"), Some("g"));
    assert_eq!(r.tag("edge_node"), Some("n"));
    assert_eq!(r.key, sync::record::key_from_tags(&r.tags));
    assert_eq!(r.ts, 1_000 * 1_000_000);
    assert_eq!(field(r, "temp"), Some(&Value::I64(5)));
    assert!(field(r, "bdSeq").is_none(), "bookkeeping is no field");
    // DATA by alias only, no datatype: 255 as the BIRTH's Int8 is -1; the metric's own
    // timestamp wins over the payload's.
    let mut t = m(None, Some(1), None, MetricValue::IntValue(255));
    t.timestamp = Some(2_500);
    let data = payload(
        Some(1),
        2_000,
        vec![
            t,
            m(None, Some(2), None, MetricValue::StringValue("b".into())),
        ],
    );
    let out = run(&mut h, "spBv1.0/g/NDATA/n", &data, 0);
    assert_eq!(out.records.len(), 2, "two timestamps, two records");
    assert_eq!(field(&out.records[0], "temp"), Some(&Value::I64(-1)));
    assert_eq!(out.records[0].ts, 2_500_000_000);
    assert_eq!(
        field(&out.records[1], "name"),
        Some(&Value::Str("b".into()))
    );
    assert_eq!(out.records[1].ts, 2_000_000_000);
    assert!(out.rebirths.is_empty());
    // By name too.
    let by_name = payload(
        Some(2),
        3_000,
        vec![m(Some("temp"), None, None, MetricValue::IntValue(7))],
    );
    let out = run(&mut h, "spBv1.0/g/NDATA/n", &by_name, 0);
    assert_eq!(field(&out.records[0], "temp"), Some(&Value::I64(7)));
    assert_eq!(stats.spb_seq_gaps.load(Ordering::Relaxed), 0);
    assert_eq!(stats.bad_payloads.load(Ordering::Relaxed), 0);
}

#[test]
fn data_without_birth_asks_for_a_rebirth_at_most_once_per_interval() {
    let (mut h, stats) = host();
    let data = payload(
        Some(4),
        2_000,
        vec![m(None, Some(1), None, MetricValue::IntValue(1))],
    );
    let out = run(&mut h, "spBv1.0/g/NDATA/n", &data, 0);
    assert!(out.records.is_empty(), "types unknown: not stored");
    assert_eq!(out.rebirths, [("g".to_owned(), "n".to_owned())]);
    assert!(
        run(&mut h, "spBv1.0/g/NDATA/n", &data, SEC)
            .rebirths
            .is_empty()
    );
    assert!(
        run(&mut h, "spBv1.0/g/DDATA/n/d", &data, 2 * SEC)
            .rebirths
            .is_empty()
    );
    assert_eq!(
        run(&mut h, "spBv1.0/g/NDATA/n", &data, 11 * SEC)
            .rebirths
            .len(),
        1
    );
    assert_eq!(stats.spb_rebirths_requested.load(Ordering::Relaxed), 2);
    assert_eq!(stats.spb_dropped_messages.load(Ordering::Relaxed), 4);
    // After the BIRTH the node's DATA is stored; an unknown alias is left out and asks again
    // (the interval has passed), the known metric of the message is still stored.
    run(&mut h, "spBv1.0/g/NBIRTH/n", &nbirth(0), 30 * SEC);
    let mixed = payload(
        Some(1),
        2_000,
        vec![
            m(None, Some(1), None, MetricValue::IntValue(1)),
            m(None, Some(9), None, MetricValue::IntValue(1)),
        ],
    );
    let out = run(&mut h, "spBv1.0/g/NDATA/n", &mixed, 45 * SEC);
    assert_eq!(out.records.len(), 1);
    assert_eq!(out.rebirths.len(), 1);
    assert_eq!(stats.spb_unknown_metrics.load(Ordering::Relaxed), 1);
    // DDATA for a device never born: dropped, rebirth (rate-limited: asked just now).
    let out = run(
        &mut h,
        "spBv1.0/g/DDATA/n/d",
        &payload(Some(2), 1, vec![]),
        46 * SEC,
    );
    assert!(out.records.is_empty() && out.rebirths.is_empty());
    assert_eq!(stats.spb_dropped_messages.load(Ordering::Relaxed), 5);
}

#[test]
fn seq_wraps_and_gaps_are_recorded() {
    let (mut h, stats) = host();
    run(&mut h, "spBv1.0/g/NBIRTH/n", &nbirth(0), 0);
    let data = |seq| {
        payload(
            Some(seq),
            5,
            vec![m(None, Some(1), None, MetricValue::IntValue(1))],
        )
    };
    for seq in (1..=255).chain(0..=2) {
        let out = run(&mut h, "spBv1.0/g/NDATA/n", &data(seq), 0);
        assert_eq!(out.records.len(), 1, "seq {seq}");
    }
    assert_eq!(
        stats.spb_seq_gaps.load(Ordering::Relaxed),
        0,
        "255 → 0 is no gap"
    );
    let out = run(&mut h, "spBv1.0/g/NDATA/n", &data(5), 0);
    assert_eq!(out.records.len(), 2, "the gap event and the data");
    let gap = &out.records[0];
    assert_eq!(gap.tag(state::EVENT_TAG), Some("seq_gap"));
    assert_eq!(field(gap, "_spb_seq_expected"), Some(&Value::I64(3)));
    assert_eq!(field(gap, "_spb_seq_received"), Some(&Value::I64(5)));
    assert_ne!(gap.key, out.records[1].key, "events are their own series");
    assert_eq!(stats.spb_seq_gaps.load(Ordering::Relaxed), 1);
    // Counting goes on from the value received.
    assert_eq!(
        run(&mut h, "spBv1.0/g/NDATA/n", &data(6), 0).records.len(),
        1
    );
    assert_eq!(stats.spb_seq_gaps.load(Ordering::Relaxed), 1);
    // A seq over 255 or none refuses the message.
    run(&mut h, "spBv1.0/g/NDATA/n", &data(256), 0);
    run(&mut h, "spBv1.0/g/NDATA/n", &payload(None, 5, vec![]), 0);
    assert_eq!(stats.bad_payloads.load(Ordering::Relaxed), 2);
}

/// Mutation check: with gap detection off (`state::switches`) the test above fails.
#[cfg(feature = "fault-injection")]
#[test]
fn mutation_without_gap_detection_the_seq_test_fails() {
    state::switches::set_gap_check(false);
    let caught = std::panic::catch_unwind(seq_wraps_and_gaps_are_recorded);
    state::switches::set_gap_check(true);
    assert!(
        caught.is_err(),
        "the seq test passed with gap detection off"
    );
}

#[test]
fn death_with_matching_bdseq_only() {
    let (mut h, stats) = host();
    run(&mut h, "spBv1.0/g/NBIRTH/n", &nbirth(7), 0);
    let dbirth = payload(
        Some(1),
        9,
        vec![m(
            Some("x"),
            Some(1),
            Some(dt::DOUBLE),
            MetricValue::DoubleValue(0.5),
        )],
    );
    let out = run(&mut h, "spBv1.0/g/DBIRTH/n/d", &dbirth, 0);
    assert_eq!(out.records[0].tag("device"), Some("d"));
    assert_eq!(field(&out.records[0], "x"), Some(&Value::F64(0.5)));
    // A stale NDEATH (an older session's bdSeq) changes nothing.
    let out = run(
        &mut h,
        "spBv1.0/g/NDEATH/n",
        &payload(None, 10, vec![bd(6)]),
        0,
    );
    assert!(out.records.is_empty());
    assert_eq!(stats.spb_stale_deaths.load(Ordering::Relaxed), 1);
    let ddata = payload(
        Some(2),
        11,
        vec![m(None, Some(1), None, MetricValue::DoubleValue(1.5))],
    );
    assert_eq!(
        run(&mut h, "spBv1.0/g/DDATA/n/d", &ddata, 0).records.len(),
        1
    );
    // The matching one: an event record, the node and its devices offline.
    let out = run(
        &mut h,
        "spBv1.0/g/NDEATH/n",
        &payload(None, 12, vec![bd(7)]),
        0,
    );
    assert_eq!(out.records.len(), 1);
    assert_eq!(out.records[0].tag(state::EVENT_TAG), Some("death"));
    assert_eq!(field(&out.records[0], "_spb_bdseq"), Some(&Value::I64(7)));
    assert_eq!(stats.spb_deaths.load(Ordering::Relaxed), 1);
    let ddata = payload(
        Some(3),
        13,
        vec![m(None, Some(1), None, MetricValue::DoubleValue(2.5))],
    );
    let out = run(&mut h, "spBv1.0/g/DDATA/n/d", &ddata, 0);
    assert!(out.records.is_empty());
    assert_eq!(out.rebirths.len(), 1, "DATA after death asks for a rebirth");
    // A second death is stale.
    run(
        &mut h,
        "spBv1.0/g/NDEATH/n",
        &payload(None, 14, vec![bd(7)]),
        0,
    );
    assert_eq!(stats.spb_stale_deaths.load(Ordering::Relaxed), 2);
    // A new session (bdSeq 8) is born again; its devices must be born again too.
    run(&mut h, "spBv1.0/g/NBIRTH/n", &nbirth(8), 0);
    run(&mut h, "spBv1.0/g/DBIRTH/n/d", &dbirth, 0);
    let out = run(
        &mut h,
        "spBv1.0/g/DDEATH/n/d",
        &payload(Some(2), 15, vec![]),
        0,
    );
    assert_eq!(out.records[0].tag("device"), Some("d"));
    assert_eq!(out.records[0].tag(state::EVENT_TAG), Some("death"));
    assert_eq!(stats.spb_deaths.load(Ordering::Relaxed), 2);
}

#[test]
fn historical_metrics_are_tagged_and_special_types_skipped() {
    let (mut h, stats) = host();
    let birth = payload(
        Some(0),
        1,
        vec![
            m(
                Some("v"),
                Some(1),
                Some(dt::UINT64),
                MetricValue::LongValue(1),
            ),
            m(
                Some("ds"),
                Some(2),
                Some(dt::DATASET),
                MetricValue::DatasetValue(vec![]),
            ),
            m(
                Some("big"),
                Some(3),
                Some(dt::UINT64),
                MetricValue::LongValue(u64::MAX),
            ),
        ],
    );
    let out = run(&mut h, "spBv1.0/g/NBIRTH/n", &birth, 0);
    assert_eq!(out.records.len(), 1);
    assert_eq!(out.records[0].fields, [("v".to_owned(), Value::I64(1))]);
    assert_eq!(stats.spb_skipped_metrics.load(Ordering::Relaxed), 1);
    assert_eq!(stats.spb_bad_metrics.load(Ordering::Relaxed), 1);
    let mut old = m(None, Some(1), None, MetricValue::LongValue(2));
    old.is_historical = Some(true);
    old.timestamp = Some(500);
    let mut null = m(None, Some(1), None, MetricValue::LongValue(0));
    null.is_null = Some(true);
    let data = payload(
        Some(1),
        900,
        vec![old, m(None, Some(1), None, MetricValue::LongValue(3)), null],
    );
    let out = run(&mut h, "spBv1.0/g/NDATA/n", &data, 0);
    assert_eq!(out.records.len(), 2);
    assert_eq!(out.records[0].tag(state::HISTORICAL_TAG), Some("true"));
    assert_eq!(out.records[0].ts, 500_000_000);
    assert_eq!(out.records[1].tag(state::HISTORICAL_TAG), None);
    assert_ne!(out.records[0].key, out.records[1].key);
}

#[test]
fn bad_topics_and_payloads_are_counted_other_traffic_ignored() {
    let (mut h, stats) = host();
    for ignored in ["spBv1.0/STATE/h", "spBv1.0/g/NCMD/n", "spBv1.0/g/DCMD/n/d"] {
        assert!(
            run(&mut h, ignored, b"{\"online\":true}", 0)
                .records
                .is_empty()
        );
    }
    assert_eq!(stats.bad_payloads.load(Ordering::Relaxed), 0);
    for bad in [
        "spBv1.0/g/NDATA",
        "spBv1.0/g/XDATA/n",
        "other/g/NDATA/n",
        "spBv1.0/g/DDATA/n",
    ] {
        run(&mut h, bad, &payload(Some(0), 1, vec![]), 0);
    }
    run(&mut h, "spBv1.0/g/NBIRTH/n", b"\xff\xff\xff", 0);
    assert_eq!(stats.bad_payloads.load(Ordering::Relaxed), 5);
}

#[test]
fn commands_and_state() {
    let p = rebirth_command("g", "n", 77);
    assert_eq!(p.topic, "spBv1.0/g/NCMD/n");
    assert_eq!(p.qos, rumqttc::QoS::AtMostOnce);
    let decoded = Payload::decode(&p.payload[..]).unwrap();
    let metric = &decoded.metrics[0];
    assert_eq!(metric.name.as_deref(), Some(REBIRTH_METRIC));
    assert_eq!(metric.datatype, Some(dt::BOOLEAN));
    assert_eq!(metric.value, Some(MetricValue::BooleanValue(true)));
    assert_eq!(state_topic("h1"), "spBv1.0/STATE/h1");
    let v: serde_json::Value = serde_json::from_str(&state_payload(false, 5)).unwrap();
    assert_eq!(v, serde_json::json!({"online": false, "timestamp": 5}));
}
