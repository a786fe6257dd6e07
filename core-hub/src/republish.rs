//! MQTT republish: an optional sink that republishes merged streams to a core MQTT broker.
//!
//! One task per configured stream reads the stream in hub offset order (commit order, so per
//! key order holds) and publishes every record with QoS 1:
//!
//! - **Topic:** the record's original MQTT topic, which the edge's MQTT source keeps in the
//!   string field `_topic`; records from other sources get `topic_template` with `{stream}`,
//!   `{device}` and `{key}` filled in.
//! - **Payload:** the record as one JSON object in the reader's NDJSON shape
//!   (`device, epoch, seq, key, ts, fields, offset, ingest_ts`, see
//!   [`crate::read::write_ndjson_line`]) without the newline and without the edge's internal
//!   fields `_topic` and `_mqtt_digest`.
//! - **Ids:** MQTT 5 user properties `device`, `epoch` and `seq` (plus `offset`), so that
//!   subscribers can deduplicate.
//!
//! **At least once.** A batch is published, then the task waits for every PUBACK of it; only
//! then is the batch's end stored as the stream's checkpoint (table `republish_checkpoints` in
//! the hub catalog: a stream position, the next hub offset). Any broker error drops the
//! connection and starts again from the checkpoint, so records published but not yet
//! checkpointed are published again: duplicates, never losses. The ids above identify them.
//!
//! When caught up the task polls the stream every `poll_interval` for new commits.

use crate::config::ConfigError;
use crate::ingest::Hub;
use crate::read::{ReadRecord, read_records, write_ndjson_line};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use rusqlite::{OptionalExtension, params};
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use sync::record::Value;
use thiserror::Error;
use tokio::sync::{mpsc, watch};

/// The field the edge's MQTT source stores the original topic in.
pub const TOPIC_FIELD: &str = "_topic";
/// The edge's per-message dedupe digest field; internal, never republished.
pub const DIGEST_FIELD: &str = "_mqtt_digest";
/// Default topic for records that did not come from MQTT.
pub const DEFAULT_TOPIC_TEMPLATE: &str = "tributary/{stream}/{device}/{key}";
/// Default records per published batch (one checkpoint each).
pub const DEFAULT_BATCH_RECORDS: usize = 1000;
/// Default poll interval when caught up.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(50);

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS republish_checkpoints (
    stream TEXT PRIMARY KEY,
    next_offset INTEGER NOT NULL
)";

/// `[republish]` in `hub.toml`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepublishConfig {
    pub host: String,
    pub port: u16,
    pub client_id: String,
    pub streams: Vec<String>,
    pub topic_template: String,
    pub batch_records: usize,
    pub poll_interval: Duration,
}

/// The raw `[republish]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRepublish {
    /// `mqtt://host:port`.
    pub url: Option<String>,
    pub client_id: Option<String>,
    pub streams: Option<Vec<String>>,
    /// Only 1 (at least once) is supported.
    pub qos: Option<u8>,
    pub topic_template: Option<String>,
    pub batch_records: Option<usize>,
    pub poll_interval: Option<String>,
}

fn key_err(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Key {
        key: format!("republish.{key}"),
        problem: problem.into(),
    }
}

impl RawRepublish {
    /// Types and checks the table.
    pub fn parse(&self) -> Result<RepublishConfig, ConfigError> {
        let url = self
            .url
            .as_deref()
            .ok_or_else(|| key_err("url", "is required in [republish]"))?;
        let (host, port) = parse_url(url).ok_or_else(|| {
            key_err(
                "url",
                format!("`{url}` is not a URL such as mqtt://127.0.0.1:1883"),
            )
        })?;
        let streams = self.streams.clone().unwrap_or_default();
        if streams.is_empty() {
            return Err(key_err("streams", "list at least one stream to republish"));
        }
        if let Some(q) = self.qos.filter(|&q| q != 1) {
            return Err(key_err(
                "qos",
                format!("{q} is not supported; use 1 (at least once)"),
            ));
        }
        let batch_records = self.batch_records.unwrap_or(DEFAULT_BATCH_RECORDS);
        if !(1..=65_535).contains(&batch_records) {
            return Err(key_err("batch_records", "must be 1..=65535"));
        }
        let poll_interval = match self.poll_interval.as_deref() {
            None => DEFAULT_POLL_INTERVAL,
            Some(s) => humantime::parse_duration(s.trim())
                .map_err(|e| key_err("poll_interval", format!("`{s}`: {e}")))?,
        };
        Ok(RepublishConfig {
            host,
            port,
            client_id: self
                .client_id
                .clone()
                .unwrap_or_else(|| "tributary-hub".into()),
            streams,
            topic_template: self
                .topic_template
                .clone()
                .unwrap_or_else(|| DEFAULT_TOPIC_TEMPLATE.into()),
            batch_records,
            poll_interval,
        })
    }
}

fn parse_url(url: &str) -> Option<(String, u16)> {
    let rest = url
        .strip_prefix("mqtt://")
        .or_else(|| url.strip_prefix("tcp://"))?;
    let rest = rest.trim_end_matches('/');
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().ok()?),
        None => (rest, 1883),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| (host.to_string(), port))
}

/// Why a republish step failed; the task reconnects and resumes from its checkpoint.
#[derive(Debug, Error)]
pub enum RepublishError {
    #[error("catalog: {0}")]
    Catalog(#[from] rusqlite::Error),
    #[error("reading the stream: {0}")]
    Read(#[from] crate::read::ReadError),
    #[error("mqtt client: {0}")]
    Client(Box<rumqttc::v5::ClientError>),
    #[error("mqtt connection: {0}")]
    Connection(String),
    #[error("broker refused a publish: {0:?}")]
    Refused(PubAckReason),
    #[error("stopped")]
    Stopped,
}

impl From<rumqttc::v5::ClientError> for RepublishError {
    fn from(e: rumqttc::v5::ClientError) -> Self {
        RepublishError::Client(Box::new(e))
    }
}

/// The stored checkpoint of `stream` (0 when none).
pub fn checkpoint(hub: &Hub, stream: &str) -> Result<u64, RepublishError> {
    let v = hub.catalog().with_write_conn(|c| {
        c.execute(SCHEMA, [])?;
        c.query_row(
            "SELECT next_offset FROM republish_checkpoints WHERE stream = ?1",
            [stream],
            |r| r.get::<_, i64>(0),
        )
        .optional()
    })?;
    Ok(v.map_or(0, |v| v as u64))
}

fn store_checkpoint(hub: &Hub, stream: &str, next: u64) -> Result<(), RepublishError> {
    hub.catalog().with_write_conn(|c| {
        c.execute(SCHEMA, [])?;
        c.execute(
            "INSERT INTO republish_checkpoints (stream, next_offset) VALUES (?1, ?2)
             ON CONFLICT (stream) DO UPDATE SET next_offset = max(next_offset, excluded.next_offset)",
            params![stream, next as i64],
        )
    })?;
    Ok(())
}

/// The topic a record is republished on.
pub fn topic_of(r: &ReadRecord, stream: &str, template: &str) -> String {
    for (name, v) in &r.fields {
        if name == TOPIC_FIELD
            && let Value::Str(t) = v
            && !t.is_empty()
        {
            return t.clone();
        }
    }
    template
        .replace("{stream}", stream)
        .replace("{device}", &r.device)
        .replace("{key}", &r.key)
}

/// The payload of a record (see the module docs).
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

/// Starts one task per configured stream. They stop when `stop` turns true.
pub fn start(
    hub: Arc<Hub>,
    cfg: RepublishConfig,
    stop: watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    cfg.streams
        .iter()
        .map(|stream| {
            let (hub, cfg, stop, stream) = (hub.clone(), cfg.clone(), stop.clone(), stream.clone());
            tokio::spawn(async move { run_stream(hub, cfg, stream, stop).await })
        })
        .collect()
}

async fn run_stream(
    hub: Arc<Hub>,
    cfg: RepublishConfig,
    stream: String,
    mut stop: watch::Receiver<bool>,
) {
    let mut delay = Duration::from_millis(100);
    loop {
        if *stop.borrow() {
            return;
        }
        match session(&hub, &cfg, &stream, &mut stop).await {
            Err(RepublishError::Stopped) | Ok(()) => return,
            Err(e) => {
                tracing::warn!(%stream, error = %e, "republish: resuming from the checkpoint");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.changed() => return,
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// Drives the MQTT event loop, forwarding PUBACKs; ends on the first connection error.
async fn drive(mut ev: EventLoop, acks: mpsc::UnboundedSender<Result<PubAckReason, String>>) {
    loop {
        match ev.poll().await {
            Ok(Event::Incoming(Packet::PubAck(a))) => {
                if acks.send(Ok(a.reason)).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) => {
                let _ = acks.send(Err(e.to_string()));
                return;
            }
        }
    }
}

async fn session(
    hub: &Arc<Hub>,
    cfg: &RepublishConfig,
    stream: &str,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), RepublishError> {
    let mut opts = MqttOptions::new(
        format!("{}-{stream}", cfg.client_id),
        cfg.host.clone(),
        cfg.port,
    );
    opts.set_keep_alive(Duration::from_secs(30));
    opts.set_clean_start(true);
    let (client, ev) = AsyncClient::new(opts, cfg.batch_records.max(10));
    let (ack_tx, mut acks) = mpsc::unbounded_channel();
    let driver = tokio::spawn(drive(ev, ack_tx));
    let result = publish_loop(hub, cfg, stream, stop, &client, &mut acks).await;
    let _ = client.try_disconnect();
    driver.abort();
    result
}

async fn publish_loop(
    hub: &Arc<Hub>,
    cfg: &RepublishConfig,
    stream: &str,
    stop: &mut watch::Receiver<bool>,
    client: &AsyncClient,
    acks: &mut mpsc::UnboundedReceiver<Result<PubAckReason, String>>,
) -> Result<(), RepublishError> {
    let mut next = {
        let (h, s) = (hub.clone(), stream.to_string());
        tokio::task::spawn_blocking(move || checkpoint(&h, &s))
            .await
            .map_err(|e| RepublishError::Connection(e.to_string()))??
    };
    loop {
        if *stop.borrow() {
            return Err(RepublishError::Stopped);
        }
        let page = {
            let (h, s, n) = (hub.clone(), stream.to_string(), cfg.batch_records);
            let from = next;
            tokio::task::spawn_blocking(move || read_records(&h, &s, from, n))
                .await
                .map_err(|e| RepublishError::Connection(e.to_string()))?
        };
        let page = match page {
            Ok(p) => p,
            // The stream appears with its first commit.
            Err(crate::read::ReadError::UnknownStream(_)) => crate::read::ReadPage {
                records: Vec::new(),
                next,
            },
            Err(e) => return Err(e.into()),
        };
        if page.records.is_empty() {
            tokio::select! {
                _ = tokio::time::sleep(cfg.poll_interval) => {}
                _ = stop.changed() => return Err(RepublishError::Stopped),
                ack = acks.recv() => match ack {
                    // Nothing is outstanding, so this is a connection error.
                    Some(Err(e)) => return Err(RepublishError::Connection(e)),
                    None => return Err(RepublishError::Connection("event loop ended".into())),
                    Some(Ok(_)) => {}
                },
            }
            continue;
        }
        for r in &page.records {
            let props = PublishProperties {
                user_properties: vec![
                    ("device".into(), r.device.clone()),
                    ("epoch".into(), r.epoch.to_string()),
                    ("seq".into(), r.seq.to_string()),
                    ("offset".into(), r.offset.to_string()),
                ],
                content_type: Some("application/json".into()),
                ..PublishProperties::default()
            };
            client
                .publish_with_properties(
                    topic_of(r, stream, &cfg.topic_template),
                    QoS::AtLeastOnce,
                    false,
                    payload_of(r),
                    props,
                )
                .await?;
        }
        let mut waiting = page.records.len();
        while waiting > 0 {
            tokio::select! {
                ack = acks.recv() => match ack {
                    Some(Ok(PubAckReason::Success | PubAckReason::NoMatchingSubscribers)) => waiting -= 1,
                    Some(Ok(reason)) => return Err(RepublishError::Refused(reason)),
                    Some(Err(e)) => return Err(RepublishError::Connection(e)),
                    None => return Err(RepublishError::Connection("event loop ended".into())),
                },
                _ = stop.changed() => return Err(RepublishError::Stopped),
            }
        }
        next = page.next;
        let (h, s) = (hub.clone(), stream.to_string());
        tokio::task::spawn_blocking(move || store_checkpoint(&h, &s, next))
            .await
            .map_err(|e| RepublishError::Connection(e.to_string()))??;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(fields: Vec<(String, Value)>) -> ReadRecord {
        ReadRecord {
            device: "d1".into(),
            epoch: 1,
            seq: 7,
            key: "d1/temp".into(),
            ts: 5,
            fields,
            offset: 3,
            ingest_ts: 6,
            segment: 0,
        }
    }

    #[test]
    fn topics_and_payloads() {
        let r = rec(vec![
            ("v".into(), Value::F64(1.5)),
            (TOPIC_FIELD.into(), Value::Str("sensors/d1/temp".into())),
            (DIGEST_FIELD.into(), Value::I64(9)),
        ]);
        assert_eq!(topic_of(&r, "t", DEFAULT_TOPIC_TEMPLATE), "sensors/d1/temp");
        let p: serde_json::Value = serde_json::from_slice(&payload_of(&r)).unwrap();
        assert_eq!(p["fields"], serde_json::json!({"v": 1.5}));
        assert_eq!(p["seq"], 7);
        let plain = rec(vec![("v".into(), Value::F64(1.5))]);
        assert_eq!(
            topic_of(&plain, "t", DEFAULT_TOPIC_TEMPLATE),
            "tributary/t/d1/d1/temp"
        );
    }

    #[test]
    fn config_checks() {
        let mut raw = RawRepublish {
            url: Some("mqtt://127.0.0.1:1884".into()),
            streams: Some(vec!["t".into()]),
            ..RawRepublish::default()
        };
        let c = raw.parse().unwrap();
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 1884));
        raw.qos = Some(2);
        assert!(
            raw.parse()
                .unwrap_err()
                .to_string()
                .contains("republish.qos")
        );
        raw.qos = None;
        raw.url = Some("http://x".into());
        assert!(
            raw.parse()
                .unwrap_err()
                .to_string()
                .contains("republish.url")
        );
        assert_eq!(parse_url("mqtt://broker"), Some(("broker".into(), 1883)));
    }
}
