//! `republish.format = "sparkplug"`: the hub as a Sparkplug B edge node. The state machine
//! here does no IO and never reads the clock (the sink passes `now`); it decides which
//! messages a record becomes, in what order, with which sequence numbers.
//!
//! - **One edge node per republished stream:** `spBv1.0/{group_id}/{NBIRTH,NDEATH,NCMD}/
//!   {edge_node_id}` (the id with `{stream}` filled in). Each connection takes the next
//!   `bdSeq` (0..=255, wrapping, stored in the catalog so it goes on across restarts): the Will set at
//!   CONNECT is an NDEATH with that `bdSeq`, and the NBIRTH sent after the CONNACK carries the
//!   same one, with `Node Control/Rebirth = false`.
//! - **One Sparkplug device per record device:** `spBv1.0/{group_id}/{DBIRTH,DDATA}/
//!   {edge_node_id}/{device}` with the record's `device`, escaped as a topic placeholder is
//!   (`/` → `%2F`, see [`super::topic`]).
//! - **One DDATA per record:** a metric per field, named `{key}/{field}` (Sparkplug reads `/`
//!   in a metric name as folders), its timestamp the record's `ts` in milliseconds, its
//!   datatype from the field's kind (f64 → Double, i64 → Int64, bool → Boolean, string →
//!   String, bytes → Bytes), `is_historical` set as [`Historical`] says. The edge's internal
//!   fields `_topic` and `_mqtt_digest` are left out.
//! - **DBIRTH before DATA:** before a device's first DDATA of a session, and again before a
//!   DDATA that brings a metric name the device has not announced (or a known name with
//!   another datatype), a DBIRTH lists every metric of that device known so far with its
//!   datatype and `is_null = true`: the values travel only in DDATA, so each record's value is
//!   published once, not once more in a birth.
//! - **seq:** NBIRTH takes 0; every DBIRTH and DDATA after it takes the next, wrapping from 255
//!   to 0. NDEATH carries none.
//! - **Rebirth:** an NCMD with `Node Control/Rebirth = true` makes the node send a new NBIRTH
//!   (same `bdSeq`, seq 0) before its next batch, and every device a new DBIRTH before its next
//!   DDATA.

use super::dead_letter::Reason;
use prost::Message as _;
use std::collections::BTreeMap;
use std::time::Duration;
use sync::Value;
use sync::sparkplug::{Metric, MetricValue, Payload, datatype};

/// The Sparkplug B topic namespace.
pub const NAMESPACE: &str = "spBv1.0";
/// The NBIRTH and NCMD metric asking for a rebirth.
pub const REBIRTH_METRIC: &str = "Node Control/Rebirth";
/// The NBIRTH and NDEATH metric tying a death to its birth.
pub const BDSEQ_METRIC: &str = "bdSeq";
/// Default `republish.sparkplug.group_id`.
pub const DEFAULT_GROUP_ID: &str = "tributary";
/// Default `republish.sparkplug.edge_node_id`.
pub const DEFAULT_EDGE_NODE_ID: &str = "{stream}";
/// Default `republish.sparkplug.historical_after`.
pub const DEFAULT_HISTORICAL_AFTER: Duration = Duration::from_secs(10);
/// Default `republish.sparkplug.metrics_max`: metric definitions one edge node keeps.
pub const DEFAULT_METRICS_MAX: usize = 100_000;

/// `[republish.sparkplug]`, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparkplugConfig {
    pub group_id: String,
    /// May hold `{stream}`; required when several streams are republished.
    pub edge_node_id: String,
    pub historical: Historical,
    pub metrics_max: usize,
}

impl SparkplugConfig {
    /// The edge node id of `stream`'s sink.
    pub fn edge_node_of(&self, stream: &str) -> String {
        self.edge_node_id
            .replace("{stream}", &super::topic::escape(stream))
    }
}

/// The backfill rule: a record is historical when, as its batch is planned, its `ts` is more
/// than `after` older than the hub's clock. A live record reaches the sink within a poll
/// interval of its commit, so it is well inside the window; a backlog that an agent ships
/// after an outage, or records the sink republishes while it catches up after a broker
/// outage, are older, and a SCADA host must not show them as the tag's current value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Historical {
    pub after: Duration,
}

impl Historical {
    /// Whether a record with event time `ts_ns` is historical at `now_ns`.
    pub fn is_historical(&self, ts_ns: i64, now_ns: i64) -> bool {
        let after = i64::try_from(self.after.as_nanos()).unwrap_or(i64::MAX);
        now_ns.saturating_sub(ts_ns) > after
    }
}

/// One record's DDATA contents, planned (pure) before the batch is published.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceData {
    /// The Sparkplug device id (escaped).
    pub device: String,
    /// Name, datatype, timestamp, value and `is_historical` set.
    pub metrics: Vec<Metric>,
}

/// One message to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub topic: String,
    pub payload: Vec<u8>,
    /// DDATA (the record's own message), not a birth.
    pub data: bool,
}

/// The datatype and value of a field, or `None` for a kind Sparkplug has no metric for.
pub fn metric_value(v: &Value) -> (u32, MetricValue) {
    match v {
        Value::F64(f) => (datatype::DOUBLE, MetricValue::DoubleValue(*f)),
        // Int64 travels as two's complement in the unsigned `long_value`.
        Value::I64(i) => (datatype::INT64, MetricValue::LongValue(*i as u64)),
        Value::Bool(b) => (datatype::BOOLEAN, MetricValue::BooleanValue(*b)),
        Value::Str(s) => (datatype::STRING, MetricValue::StringValue(s.clone())),
        Value::Bytes(b) => (datatype::BYTES, MetricValue::BytesValue(b.clone())),
    }
}

/// One device as the node has announced it.
#[derive(Debug, Default)]
struct Device {
    /// Metric name → datatype, every one known so far.
    metrics: BTreeMap<String, u32>,
    /// A DBIRTH with every metric above was sent in this session (since the last NBIRTH).
    born: bool,
}

/// The edge node of one stream's sink. It outlives connections: the metric definitions and
/// the `bdSeq` carry over, the births and `seq` start again with each session.
#[derive(Debug)]
pub struct EdgeNode {
    group: String,
    node: String,
    metrics_max: usize,
    metrics_total: usize,
    /// The current session's `bdSeq`; `None` before the first.
    bd_seq: Option<u8>,
    /// The last seq sent.
    seq: u8,
    devices: BTreeMap<String, Device>,
}

impl EdgeNode {
    pub fn new(cfg: &SparkplugConfig, stream: &str) -> EdgeNode {
        EdgeNode {
            group: cfg.group_id.clone(),
            node: cfg.edge_node_of(stream),
            metrics_max: cfg.metrics_max,
            metrics_total: 0,
            bd_seq: None,
            seq: 0,
            devices: BTreeMap::new(),
        }
    }

    /// A new connection with `bd_seq` (the stored next one, `store::next_bd_seq`); returns the
    /// Will to set at CONNECT (an NDEATH with that `bdSeq`).
    pub fn start_session(&mut self, bd_seq: u8) -> Outgoing {
        self.bd_seq = Some(bd_seq);
        self.ndeath()
    }

    /// The current session's `bdSeq`.
    pub fn bd_seq(&self) -> u8 {
        self.bd_seq.expect("start_session comes first")
    }

    /// The NDEATH of the current session (the Will, and what a graceful stop sends).
    pub fn ndeath(&self) -> Outgoing {
        let payload = Payload {
            metrics: vec![bd_seq_metric(self.bd_seq())],
            ..Payload::default()
        };
        self.node_message("NDEATH", payload)
    }

    /// The NBIRTH (after the CONNACK, or answering a rebirth request): seq 0, and every
    /// device needs a new DBIRTH.
    pub fn nbirth(&mut self, now_ms: u64) -> Outgoing {
        self.seq = 0;
        for d in self.devices.values_mut() {
            d.born = false;
        }
        let rebirth = Metric {
            name: Some(REBIRTH_METRIC.into()),
            timestamp: Some(now_ms),
            datatype: Some(datatype::BOOLEAN),
            value: Some(MetricValue::BooleanValue(false)),
            ..Metric::default()
        };
        let mut bd = bd_seq_metric(self.bd_seq());
        bd.timestamp = Some(now_ms);
        let payload = Payload {
            timestamp: Some(now_ms),
            metrics: vec![bd, rebirth],
            seq: Some(0),
            ..Payload::default()
        };
        self.node_message("NBIRTH", payload)
    }

    /// The NCMD topic the node subscribes to.
    pub fn ncmd_topic(&self) -> String {
        format!("{NAMESPACE}/{}/NCMD/{}", self.group, self.node)
    }

    /// The messages for one record: a DBIRTH when the device needs one, then its DDATA. `fits`
    /// says whether a message can be sent (its packet size); when one cannot, or the record
    /// would take the node over `metrics_max`, nothing changes and the record is refused.
    pub fn device_data(
        &mut self,
        d: &DeviceData,
        now_ms: u64,
        fits: impl Fn(&Outgoing) -> bool,
    ) -> Result<Vec<Outgoing>, (Reason, String)> {
        let device = self.devices.get(&d.device);
        let mut metrics = device.map(|x| x.metrics.clone()).unwrap_or_default();
        let before = metrics.len();
        for m in &d.metrics {
            let (name, dt) = (m.name.clone().unwrap_or_default(), m.datatype.unwrap_or(0));
            metrics.insert(name, dt);
        }
        let added = metrics.len() - before;
        if self.metrics_total + added > self.metrics_max {
            return Err((
                Reason::TooManyMetrics,
                format!(
                    "{added} new metric(s) would take the edge node over \
                     republish.sparkplug.metrics_max ({})",
                    self.metrics_max
                ),
            ));
        }
        let changed = device.is_none_or(|x| !x.born || x.metrics != metrics);
        let mut seq = self.seq;
        let mut out = Vec::with_capacity(2);
        if changed {
            seq = seq.wrapping_add(1);
            out.push(self.dbirth(&d.device, &metrics, now_ms, seq));
        }
        seq = seq.wrapping_add(1);
        out.push(self.ddata(d, now_ms, seq));
        if let Some(big) = out.iter().find(|o| !fits(o)) {
            let what = if big.data { "DDATA" } else { "DBIRTH" };
            return Err((
                Reason::PacketTooLarge,
                format!(
                    "the {what} ({} payload bytes) is over the packet limit",
                    big.payload.len()
                ),
            ));
        }
        self.seq = seq;
        self.metrics_total += added;
        let dev = self.devices.entry(d.device.clone()).or_default();
        (dev.metrics, dev.born) = (metrics, true);
        Ok(out)
    }

    fn dbirth(&self, device: &str, metrics: &BTreeMap<String, u32>, now: u64, seq: u8) -> Outgoing {
        let metrics = metrics
            .iter()
            .map(|(name, &dt)| Metric {
                name: Some(name.clone()),
                timestamp: Some(now),
                datatype: Some(dt),
                is_null: Some(true),
                ..Metric::default()
            })
            .collect();
        let payload = Payload {
            timestamp: Some(now),
            metrics,
            seq: Some(u64::from(seq)),
            ..Payload::default()
        };
        self.device_message("DBIRTH", device, payload, false)
    }

    fn ddata(&self, d: &DeviceData, now: u64, seq: u8) -> Outgoing {
        let payload = Payload {
            timestamp: Some(now),
            metrics: d.metrics.clone(),
            seq: Some(u64::from(seq)),
            ..Payload::default()
        };
        self.device_message("DDATA", &d.device, payload, true)
    }

    fn node_message(&self, kind: &str, payload: Payload) -> Outgoing {
        Outgoing {
            topic: format!("{NAMESPACE}/{}/{kind}/{}", self.group, self.node),
            payload: payload.encode_to_vec(),
            data: false,
        }
    }

    fn device_message(&self, kind: &str, device: &str, payload: Payload, data: bool) -> Outgoing {
        Outgoing {
            topic: format!("{NAMESPACE}/{}/{kind}/{}/{device}", self.group, self.node),
            payload: payload.encode_to_vec(),
            data,
        }
    }
}

fn bd_seq_metric(bd_seq: u8) -> Metric {
    Metric {
        name: Some(BDSEQ_METRIC.into()),
        datatype: Some(datatype::UINT64),
        value: Some(MetricValue::LongValue(u64::from(bd_seq))),
        ..Metric::default()
    }
}

/// Whether an NCMD payload asks for a rebirth (`Node Control/Rebirth = true`). A payload that
/// does not decode asks for nothing.
pub fn asks_rebirth(payload: &[u8]) -> bool {
    Payload::decode(payload).is_ok_and(|p| {
        p.metrics.iter().any(|m| {
            m.name.as_deref() == Some(REBIRTH_METRIC)
                && m.value == Some(MetricValue::BooleanValue(true))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SparkplugConfig {
        SparkplugConfig {
            group_id: "g".into(),
            edge_node_id: "hub-{stream}".into(),
            historical: Historical {
                after: Duration::from_secs(10),
            },
            metrics_max: 3,
        }
    }

    fn data(device: &str, names: &[(&str, Value)]) -> DeviceData {
        DeviceData {
            device: device.into(),
            metrics: names
                .iter()
                .map(|(n, v)| {
                    let (dt, value) = metric_value(v);
                    Metric {
                        name: Some((*n).into()),
                        datatype: Some(dt),
                        timestamp: Some(5),
                        value: Some(value),
                        ..Metric::default()
                    }
                })
                .collect(),
        }
    }

    fn decode(o: &Outgoing) -> Payload {
        Payload::decode(&o.payload[..]).unwrap()
    }

    #[test]
    fn births_come_before_data_and_seq_wraps() {
        let mut n = EdgeNode::new(&cfg(), "t");
        let will = n.start_session(0);
        assert_eq!(will.topic, "spBv1.0/g/NDEATH/hub-t");
        let birth = n.nbirth(1);
        assert_eq!(birth.topic, "spBv1.0/g/NBIRTH/hub-t");
        let p = decode(&birth);
        assert_eq!(p.seq, Some(0));
        assert_eq!(p.metrics[0].value, Some(MetricValue::LongValue(0)));
        assert_eq!(decode(&will).metrics[0], bd_seq_metric(0));

        let a = data("d1", &[("k/x", Value::F64(1.0))]);
        let out = n.device_data(&a, 2, |_| true).unwrap();
        let topics: Vec<_> = out.iter().map(|o| o.topic.as_str()).collect();
        assert_eq!(
            topics,
            ["spBv1.0/g/DBIRTH/hub-t/d1", "spBv1.0/g/DDATA/hub-t/d1"]
        );
        assert_eq!(decode(&out[0]).metrics[0].is_null, Some(true));
        assert_eq!(
            (decode(&out[0]).seq, decode(&out[1]).seq),
            (Some(1), Some(2))
        );
        // Known metrics: DDATA only. A new one: a DBIRTH with both.
        assert_eq!(n.device_data(&a, 3, |_| true).unwrap().len(), 1);
        let b = data("d1", &[("k/y", Value::I64(1))]);
        let out = n.device_data(&b, 4, |_| true).unwrap();
        assert_eq!(decode(&out[0]).metrics.len(), 2);
        for _ in 0..300 {
            n.device_data(&a, 5, |_| true).unwrap();
        }
        assert_eq!(n.seq, ((5 + 300) % 256) as u8);
        // A rebirth: seq 0 again, and the device is born again before its data.
        assert_eq!(decode(&n.nbirth(6)).seq, Some(0));
        let out = n.device_data(&a, 7, |_| true).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(decode(&out[1]).seq, Some(2));
        // The next session takes the next bdSeq.
        assert_eq!(decode(&n.start_session(1)).metrics[0], bd_seq_metric(1));
    }

    #[test]
    fn refusals_change_nothing() {
        let mut n = EdgeNode::new(&cfg(), "t");
        n.start_session(2);
        n.nbirth(1);
        let big = data(
            "d1",
            &[("a", Value::Bool(true)), ("b", Value::Str("s".into()))],
        );
        let (reason, _) = n.device_data(&big, 2, |o| o.data).unwrap_err();
        assert_eq!(reason, Reason::PacketTooLarge);
        assert_eq!((n.seq, n.metrics_total), (0, 0));
        n.device_data(&big, 2, |_| true).unwrap();
        let more = data("d2", &[("c", Value::F64(1.0)), ("d", Value::F64(1.0))]);
        let (reason, detail) = n.device_data(&more, 3, |_| true).unwrap_err();
        assert_eq!(reason, Reason::TooManyMetrics);
        assert!(detail.contains("metrics_max"), "{detail}");
        assert_eq!(n.seq, 2);
    }

    #[test]
    fn the_historical_rule() {
        let h = Historical {
            after: Duration::from_secs(10),
        };
        let s = 1_000_000_000i64;
        assert!(!h.is_historical(100 * s, 100 * s));
        assert!(
            !h.is_historical(90 * s, 100 * s),
            "exactly `after` old is live"
        );
        assert!(h.is_historical(90 * s - 1, 100 * s));
        assert!(!h.is_historical(200 * s, 100 * s), "a future ts is live");
        assert!(h.is_historical(i64::MIN, i64::MAX));
    }

    #[test]
    fn rebirth_commands() {
        let cmd = |v| {
            Payload {
                metrics: vec![Metric {
                    name: Some(REBIRTH_METRIC.into()),
                    value: Some(MetricValue::BooleanValue(v)),
                    ..Metric::default()
                }],
                ..Payload::default()
            }
            .encode_to_vec()
        };
        assert!(asks_rebirth(&cmd(true)));
        assert!(!asks_rebirth(&cmd(false)));
        assert!(!asks_rebirth(b"\xff\xff not protobuf"));
    }
}
