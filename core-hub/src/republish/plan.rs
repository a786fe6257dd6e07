//! Planning a batch (pure): which records of a page go into it (bounded by
//! `republish.batch_records` and `republish.batch_bytes_max`), and for each one either the
//! PUBLISH to send (topic checked, packet size known) or why it is dead-lettered instead.
//! Nothing unchecked is ever handed to the MQTT client. With `format = "sparkplug"` a record
//! is planned as its DDATA metrics; the births and sequence numbers around it are the edge
//! node's, decided as the batch is published ([`super::sparkplug`]).

use super::config::{Format, RepublishConfig};
use super::dead_letter::Reason;
use super::sparkplug::{DeviceData, SparkplugConfig, metric_value};
use super::topic::{Values, check_topic};
use crate::read::{ReadRecord, write_ndjson_line};
use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use sync::record::Value;

/// The field the edge's MQTT source stores the original topic in.
pub const TOPIC_FIELD: &str = "_topic";
/// The edge's per-message dedupe digest field; internal, never republished.
pub const DIGEST_FIELD: &str = "_mqtt_digest";
/// MQTT's limit on a UTF-8 string (user properties, content type).
const STRING_BYTES_LIMIT: usize = 65_535;

/// What to do with one record.
#[derive(Debug, Clone)]
pub enum Plan {
    Publish {
        topic: String,
        payload: Bytes,
        properties: PublishProperties,
    },
    /// `format = "sparkplug"`: the record's DDATA, sent with the births it needs.
    Sparkplug(DeviceData),
    Dead {
        reason: Reason,
        detail: String,
    },
}

/// A planned batch: `plans[i]` is for `records[i]`; `next` is where the batch after it starts.
#[derive(Debug)]
pub struct Batch {
    pub records: Vec<ReadRecord>,
    pub plans: Vec<Plan>,
    pub next: u64,
}

/// Plans a batch from the head of a page whose end is `page_next`. `packet_max` is the lower
/// of `republish.packet_bytes_max` and the broker's maximum packet size. At least one record
/// goes into a non-empty page's batch, whatever its size. `now_ns` is the hub's clock, for
/// Sparkplug's backfill rule.
pub fn plan_batch(
    page: Vec<ReadRecord>,
    page_next: u64,
    stream: &str,
    cfg: &RepublishConfig,
    packet_max: u64,
    now_ns: i64,
) -> Batch {
    let mut batch = Batch {
        records: Vec::new(),
        plans: Vec::new(),
        next: page_next,
    };
    let mut bytes = 0u64;
    for r in page {
        let plan = match &cfg.format {
            Format::Json => plan_record(&r, stream, cfg, packet_max),
            Format::Sparkplug(spb) => plan_sparkplug(&r, stream, cfg, spb, now_ns),
        };
        let cost = match &plan {
            Plan::Publish { topic, payload, .. } => (topic.len() + payload.len()) as u64,
            Plan::Sparkplug(d) => {
                d.device.len() as u64
                    + d.metrics
                        .iter()
                        .map(prost::Message::encoded_len)
                        .sum::<usize>() as u64
            }
            Plan::Dead { .. } => r.key.len() as u64,
        };
        if !batch.records.is_empty() && bytes + cost > cfg.batch_bytes_max {
            batch.next = r.offset;
            break;
        }
        bytes += cost;
        batch.records.push(r);
        batch.plans.push(plan);
    }
    batch
}

/// The PUBLISH for `r`, or why it cannot be sent.
pub fn plan_record(r: &ReadRecord, stream: &str, cfg: &RepublishConfig, packet_max: u64) -> Plan {
    let topic = topic_for(r, stream, cfg);
    if let Err(e) = checked(&topic, cfg) {
        let reason = match e {
            super::topic::TopicError::TooLong { .. } => Reason::TopicTooLong,
            _ => Reason::TopicInvalid,
        };
        return Plan::Dead {
            reason,
            detail: e.to_string(),
        };
    }
    if r.device.len() > STRING_BYTES_LIMIT {
        return Plan::Dead {
            reason: Reason::Encoding,
            detail: format!(
                "the device id is {} bytes, over MQTT's 65535",
                r.device.len()
            ),
        };
    }
    let payload = Bytes::from(payload_of(r));
    let properties = properties_of(r, Some("application/json"));
    let size = packet_size_with(&topic, payload.clone(), &properties);
    if size > packet_max {
        return Plan::Dead {
            reason: Reason::PacketTooLarge,
            detail: format!("the PUBLISH packet is {size} bytes, over the limit of {packet_max}"),
        };
    }
    Plan::Publish {
        topic,
        payload,
        properties,
    }
}

/// A record as Sparkplug DDATA metrics (see [`super::sparkplug`] for the mapping). The packet
/// sizes are checked when the edge node builds the messages.
pub fn plan_sparkplug(
    r: &ReadRecord,
    stream: &str,
    republish: &RepublishConfig,
    cfg: &SparkplugConfig,
    now_ns: i64,
) -> Plan {
    let dead = |reason, detail: String| Plan::Dead { reason, detail };
    let device = super::topic::escape(&r.device);
    // The DBIRTH topic is the longest this record is published on.
    let topic = format!(
        "{}/{}/DBIRTH/{}/{device}",
        super::sparkplug::NAMESPACE,
        cfg.group_id,
        cfg.edge_node_of(stream)
    );
    if device.is_empty() {
        return dead(Reason::TopicInvalid, "the device id is empty".into());
    }
    if let Err(e) = check_topic(&topic, republish.topic_bytes_max) {
        return dead(Reason::TopicTooLong, e.to_string());
    }
    if r.ts < 0 {
        return dead(
            Reason::Encoding,
            format!(
                "ts {} is before 1970, which a Sparkplug timestamp cannot hold",
                r.ts
            ),
        );
    }
    let timestamp = (r.ts / 1_000_000) as u64;
    let historical = cfg.historical.is_historical(r.ts, now_ns);
    let metrics: Vec<_> = r
        .fields
        .iter()
        .filter(|(n, _)| n != TOPIC_FIELD && n != DIGEST_FIELD)
        .map(|(name, v)| {
            let (datatype, value) = metric_value(v);
            sync::sparkplug::Metric {
                name: Some(format!("{}/{name}", r.key)),
                timestamp: Some(timestamp),
                datatype: Some(datatype),
                is_historical: historical.then_some(true),
                value: Some(value),
                ..Default::default()
            }
        })
        .collect();
    if metrics.is_empty() {
        return dead(
            Reason::Encoding,
            "the record has no fields to publish as metrics".into(),
        );
    }
    Plan::Sparkplug(DeviceData { device, metrics })
}

/// The size of the QoS 1 PUBLISH of `payload` on `topic` with `properties`.
pub fn packet_size_with(topic: &str, payload: Bytes, properties: &PublishProperties) -> u64 {
    let mut packet = Publish::new(topic, QoS::AtLeastOnce, payload, Some(properties.clone()));
    packet.pkid = 1;
    packet.size() as u64
}

/// The topic check, unless a test switched it off.
fn checked(topic: &str, cfg: &RepublishConfig) -> Result<(), super::topic::TopicError> {
    #[cfg(feature = "fault-injection")]
    if cfg.mutation == super::config::Mutation::SkipTopicCheck {
        return Ok(());
    }
    check_topic(topic, cfg.topic_bytes_max)
}

/// The topic `r` is published on: its `_topic` where `republish.topic_from_record` lists
/// the stream and the record has a non-empty one, the template otherwise.
pub fn topic_for(r: &ReadRecord, stream: &str, cfg: &RepublishConfig) -> String {
    if cfg.topic_from_record.iter().any(|s| s == stream)
        && let Some(t) = record_topic(r)
    {
        return t.to_string();
    }
    let values = Values {
        stream,
        device: &r.device,
        key: &r.key,
    };
    #[cfg(feature = "fault-injection")]
    if cfg.mutation == super::config::Mutation::RawPlaceholders {
        return cfg.topic_template.render_raw(values);
    }
    cfg.topic_template.render(values)
}

fn record_topic(r: &ReadRecord) -> Option<&str> {
    r.fields.iter().find_map(|(name, v)| match v {
        Value::Str(t) if name == TOPIC_FIELD && !t.is_empty() => Some(t.as_str()),
        _ => None,
    })
}

/// The payload of a record: its reader NDJSON line without the newline and without the
/// edge's internal fields `_topic` and `_mqtt_digest`.
pub fn payload_of(r: &ReadRecord) -> Vec<u8> {
    let mut clean = r.clone();
    clean
        .fields
        .retain(|(n, _)| n != TOPIC_FIELD && n != DIGEST_FIELD);
    let mut out = Vec::with_capacity(128);
    write_ndjson_line(&clean, &mut out);
    out.pop();
    out
}

/// `device`, `epoch`, `seq` and `offset` as MQTT 5 user properties, so subscribers can
/// deduplicate.
pub fn properties_of(r: &ReadRecord, content_type: Option<&str>) -> PublishProperties {
    PublishProperties {
        user_properties: vec![
            ("device".into(), r.device.clone()),
            ("epoch".into(), sync::epoch::format(r.epoch)),
            ("seq".into(), r.seq.to_string()),
            ("offset".into(), r.offset.to_string()),
        ],
        content_type: content_type.map(str::to_owned),
        ..PublishProperties::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::republish::RawRepublish;

    fn cfg(edit: impl FnOnce(&mut RawRepublish)) -> RepublishConfig {
        let mut raw = RawRepublish {
            url: Some("mqtt://127.0.0.1:1883".into()),
            streams: Some(vec!["t".into()]),
            topic_template: Some("hub/{stream}/{device}/{key}".into()),
            ..RawRepublish::default()
        };
        edit(&mut raw);
        raw.parse().unwrap()
    }

    fn rec(offset: u64, key: &str, fields: Vec<(String, Value)>) -> ReadRecord {
        ReadRecord {
            tags: Vec::new(),
            device: "d1".into(),
            epoch: 1,
            seq: offset + 1,
            key: key.into(),
            ts: 5,
            fields,
            offset,
            ingest_ts: 6,
            segment: 0,
        }
    }

    fn steered(offset: u64) -> ReadRecord {
        rec(
            offset,
            "d1/temp",
            vec![
                ("v".into(), Value::F64(1.5)),
                (
                    TOPIC_FIELD.into(),
                    Value::Str("plant/valve7/cmd/open".into()),
                ),
                (DIGEST_FIELD.into(), Value::I64(9)),
            ],
        )
    }

    #[test]
    fn record_topics_are_ignored_unless_the_stream_is_listed() {
        let r = steered(0);
        assert_eq!(topic_for(&r, "t", &cfg(|_| {})), "hub/t/d1/d1%2Ftemp");
        let open = cfg(|c| c.topic_from_record = Some(vec!["t".into()]));
        assert_eq!(topic_for(&r, "t", &open), "plant/valve7/cmd/open");
        let p: serde_json::Value = serde_json::from_slice(&payload_of(&r)).unwrap();
        assert_eq!(p["fields"], serde_json::json!({"v": 1.5}));
        assert_eq!(p["seq"], 1);
    }

    #[test]
    fn unpublishable_records_are_planned_as_dead() {
        let open = cfg(|c| c.topic_from_record = Some(vec!["t".into()]));
        let with_topic = |t: &str| rec(0, "k", vec![(TOPIC_FIELD.into(), Value::Str(t.into()))]);
        let dead = |p: Plan| match p {
            Plan::Dead { reason, .. } => Some(reason),
            Plan::Publish { .. } | Plan::Sparkplug(_) => None,
        };
        let cases = [
            ("a/+/b", Some(Reason::TopicInvalid)),
            ("$SYS/x", Some(Reason::TopicInvalid)),
            ("a\0b", Some(Reason::TopicInvalid)),
            ("fine/topic", None),
        ];
        for (t, want) in cases {
            assert_eq!(
                dead(plan_record(&with_topic(t), "t", &open, 1 << 20)),
                want,
                "{t:?}"
            );
        }
        let long = with_topic(&"a".repeat(70_000));
        assert_eq!(
            dead(plan_record(&long, "t", &open, 1 << 20)),
            Some(Reason::TopicTooLong)
        );
        let big = rec(0, "k", vec![("blob".into(), Value::Bytes(vec![7; 5000]))]);
        assert_eq!(
            dead(plan_record(&big, "t", &open, 4096)),
            Some(Reason::PacketTooLarge)
        );
        assert_eq!(dead(plan_record(&big, "t", &open, 1 << 20)), None);
    }

    #[test]
    fn sparkplug_metrics_from_fields() {
        let c = cfg(|c| {
            c.topic_template = None;
            c.format = Some("sparkplug".into());
            c.sparkplug = Some(crate::republish::RawSparkplug {
                historical_after: Some("10s".into()),
                ..Default::default()
            });
        });
        let Format::Sparkplug(spb) = &c.format else {
            unreachable!()
        };
        let mut r = steered(0);
        r.device = "truck/7".into();
        r.ts = 100_000_000_123_456;
        r.fields.push(("n".into(), Value::I64(-1)));
        let now = r.ts + 10_000_000_000;
        let Plan::Sparkplug(d) = plan_sparkplug(&r, "t", &c, spb, now) else {
            panic!()
        };
        assert_eq!(d.device, "truck%2F7");
        let names: Vec<_> = d.metrics.iter().map(|m| m.name.clone().unwrap()).collect();
        assert_eq!(
            names,
            ["d1/temp/v", "d1/temp/n"],
            "internal fields stay out"
        );
        assert_eq!(
            d.metrics[1].datatype,
            Some(sync::sparkplug::datatype::INT64)
        );
        assert_eq!(d.metrics[0].timestamp, Some(100_000_000));
        assert!(d.metrics.iter().all(|m| m.is_historical.is_none()));
        let Plan::Sparkplug(d) = plan_sparkplug(&r, "t", &c, spb, now + 1) else {
            panic!()
        };
        assert!(d.metrics.iter().all(|m| m.is_historical == Some(true)));
        r.ts = -1;
        assert!(matches!(
            plan_sparkplug(&r, "t", &c, spb, now),
            Plan::Dead {
                reason: Reason::Encoding,
                ..
            }
        ));
    }

    #[test]
    fn batches_are_bounded_in_bytes_but_never_empty() {
        let c = cfg(|c| c.batch_bytes_max = Some("1KiB".into()));
        let page: Vec<_> = (0..10)
            .map(|i| rec(i, "k", vec![("s".into(), Value::Str("x".repeat(300)))]))
            .collect();
        let b = plan_batch(page, 10, "t", &c, 1 << 20, 0);
        assert_eq!(b.records.len(), 2, "two ~450-byte records fit in 1 KiB");
        assert_eq!(
            b.next, 2,
            "the next batch starts at the first record left out"
        );
        let huge = vec![rec(
            5,
            "k",
            vec![("s".into(), Value::Str("x".repeat(5000)))],
        )];
        let b = plan_batch(huge, 6, "t", &c, 1 << 20, 0);
        assert_eq!((b.records.len(), b.next), (1, 6));
    }
}
