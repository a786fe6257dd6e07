//! The Sparkplug B host application (`format = "sparkplug"` on an MQTT source, cargo feature
//! `sparkplug`, on by default): the agent subscribes to `spBv1.0/{group}/#` for each
//! configured group, decodes the protobuf payloads ([`proto`]) into typed records, keeps each
//! edge node's BIRTH state ([`state`]), and asks a node for a rebirth when it lacks it.
//!
//! # Records
//!
//! - Tags: `group`, `edge_node`, and `device` for device messages; the key is
//!   `sync::record::key_from_tags` of them. Each metric is a field named by the metric's name,
//!   its value typed by the BIRTH's datatype: Int8..Int64 and UInt8..UInt64 → `I64` (a UInt64
//!   above `i64::MAX` is refused and counted in `spb_bad_metrics`), Float and Double → `F64`
//!   (NaN and infinities refused likewise),
//!   Boolean → `Bool`, String, Text and UUID → `Str`, Bytes and File → `Bytes`, DateTime →
//!   `I64` milliseconds since the epoch, as sent. DataSet and Template metrics are not stored
//!   (`spb_skipped_metrics`); a null metric (`is_null`) is no field.
//! - ts: the metric's timestamp, else the payload's, else the receive time (ms → ns). Metrics
//!   of one message with one timestamp share a record.
//! - Historical metrics (`is_historical`) are stored with the tag `historical = "true"`, so
//!   back-filled values form their own series and never read as the latest value.
//! - BIRTH metrics are stored like DATA metrics (except `bdSeq`). Sparkplug's bookkeeping
//!   (`seq`, `bdSeq`) is never a field of a data record.
//! - Events are records with the tag `spb_event`: `seq_gap` (fields `_spb_seq_expected`,
//!   `_spb_seq_received`) and `death` (`_spb_bdseq` for a node, `_spb_seq` for a device).
//! - The first record of each message holds `_mqtt_digest` as every MQTT record does; there is
//!   no `_topic` field (the tags name the topic).
//!
//! # Host state and rebirths
//!
//! The rules are in [`state`]. A rebirth request is an NCMD on `spBv1.0/{group}/NCMD/{node}`
//! with the Boolean metric `Node Control/Rebirth = true`, sent at QoS 0 on the connection the
//! triggering message came on, at most once per node per `rebirth_interval` (default 10 s),
//! counted in `tributary_edge_sparkplug_rebirths_requested_total`. The state lives in memory:
//! after a restart every node is asked for a rebirth on its first DATA.
//!
//! # STATE
//!
//! Once its subscriptions are granted, the host publishes `{"online":true,"timestamp":T}`
//! retained at QoS 1 on `spBv1.0/STATE/{host_id}`, with the will `{"online":false,
//! "timestamp":T}` set at CONNECT (Sparkplug 3.0), a fresh `T` per connection. Unlike the
//! specification's host, the agent keeps its persistent session (`clean_session = false`):
//! messages sent while it was away are still delivered and stored.

/// The payload types live in `sync` (feature `sparkplug`), shared with the hub's republisher.
pub use sync::sparkplug as proto;
pub mod state;

pub use state::{Host, HostConfig, Output};

use prost::Message as _;
use rumqttc::{LastWill, Publish, QoS};

/// The metric a rebirth request sets.
pub const REBIRTH_METRIC: &str = "Node Control/Rebirth";

/// The host's STATE topic.
pub fn state_topic(host_id: &str) -> String {
    format!("spBv1.0/STATE/{host_id}")
}

/// The STATE payload.
pub fn state_payload(online: bool, timestamp_ms: u64) -> String {
    format!("{{\"online\":{online},\"timestamp\":{timestamp_ms}}}")
}

/// The will set at CONNECT: STATE offline, retained, QoS 1.
pub fn state_will(host_id: &str, timestamp_ms: u64) -> LastWill {
    LastWill::new(
        state_topic(host_id),
        state_payload(false, timestamp_ms),
        QoS::AtLeastOnce,
        true,
    )
}

/// The NCMD asking `edge_node` of `group` for a rebirth (QoS 0, not retained).
pub fn rebirth_command(group: &str, edge_node: &str, now_ms: u64) -> Publish {
    let metric = proto::Metric {
        name: Some(REBIRTH_METRIC.to_owned()),
        timestamp: Some(now_ms),
        datatype: Some(proto::datatype::BOOLEAN),
        value: Some(proto::MetricValue::BooleanValue(true)),
        ..proto::Metric::default()
    };
    let payload = proto::Payload {
        timestamp: Some(now_ms),
        metrics: vec![metric],
        ..proto::Payload::default()
    };
    Publish::new(
        format!("spBv1.0/{group}/NCMD/{edge_node}"),
        QoS::AtMostOnce,
        payload.encode_to_vec(),
    )
}

#[cfg(test)]
mod tests;
