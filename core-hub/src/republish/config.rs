//! `[republish]` in `hub.toml`: the raw table and its typed form, checked once at start-up.

use super::sparkplug::{
    DEFAULT_EDGE_NODE_ID, DEFAULT_GROUP_ID, DEFAULT_HISTORICAL_AFTER, DEFAULT_METRICS_MAX,
    Historical, SparkplugConfig,
};
use super::topic::{TOPIC_BYTES_LIMIT, Template, check_topic};
use crate::config::{ConfigError, parse_bytes};
use serde::Deserialize;
use std::time::Duration;

/// Default topic for every record (and for records without `_topic` where it is honoured).
pub const DEFAULT_TOPIC_TEMPLATE: &str = "tributary/{stream}/{device}/{key}";
/// Default records per published batch (one checkpoint each).
pub const DEFAULT_BATCH_RECORDS: usize = 1000;
/// Default bytes (topics and payloads) per published batch.
pub const DEFAULT_BATCH_BYTES_MAX: u64 = 4 << 20;
/// Default longest topic published.
pub const DEFAULT_TOPIC_BYTES_MAX: usize = 1024;
/// Default largest PUBLISH packet sent (the broker's CONNACK may lower it).
pub const DEFAULT_PACKET_BYTES_MAX: u64 = 1 << 20;
/// MQTT's limit on a packet: a 4-byte variable length plus the fixed header.
pub const PACKET_BYTES_LIMIT: u64 = 268_435_455 + 5;
/// Default number of dead-letter entries kept (the oldest go first).
pub const DEFAULT_DEAD_LETTERS_MAX: u64 = 10_000;
/// Default poll interval when caught up.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// `[republish]` in `hub.toml`, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepublishConfig {
    pub host: String,
    pub port: u16,
    pub client_id: String,
    pub streams: Vec<String>,
    pub topic_template: Template,
    /// Streams whose records' `_topic` is honoured (none by default).
    pub topic_from_record: Vec<String>,
    pub topic_bytes_max: usize,
    pub packet_bytes_max: u64,
    pub batch_records: usize,
    pub batch_bytes_max: u64,
    pub dead_letters_max: u64,
    pub poll_interval: Duration,
    /// What a record is published as.
    pub format: Format,
    /// A test-only switch that turns one guard off (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub mutation: Mutation,
}

/// `republish.format`: what each record is published as.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Format {
    /// One JSON object per record on the template's topic (the default).
    #[default]
    Json,
    /// Sparkplug B, the hub as an edge node ([`super::sparkplug`]).
    Sparkplug(SparkplugConfig),
}

/// Test-only switches that leave one republish guard out, so that
/// `core-hub/tests/republish_abuse.rs` can prove it catches the bug.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mutation {
    #[default]
    None,
    /// Placeholders are pasted into the template raw, not escaped.
    RawPlaceholders,
    /// Topics are not checked before they are handed to the MQTT client.
    SkipTopicCheck,
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
    pub topic_from_record: Option<Vec<String>>,
    pub topic_bytes_max: Option<String>,
    pub packet_bytes_max: Option<String>,
    pub batch_records: Option<usize>,
    pub batch_bytes_max: Option<String>,
    pub dead_letters_max: Option<u64>,
    pub poll_interval: Option<String>,
    /// `"json"` (the default) or `"sparkplug"`.
    pub format: Option<String>,
    /// `[republish.sparkplug]`, only with `format = "sparkplug"`.
    pub sparkplug: Option<RawSparkplug>,
}

/// The raw `[republish.sparkplug]` table.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSparkplug {
    pub group_id: Option<String>,
    pub edge_node_id: Option<String>,
    pub historical_after: Option<String>,
    pub metrics_max: Option<usize>,
}

fn key_err(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Key {
        key: format!("republish.{key}"),
        problem: problem.into(),
    }
}

/// A byte size in `range`, or `default`.
fn bytes_in(
    key: &str,
    s: Option<&str>,
    default: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<u64, ConfigError> {
    let Some(s) = s else { return Ok(default) };
    let n = parse_bytes(s).map_err(|p| key_err(key, p))?;
    if !range.contains(&n) {
        return Err(key_err(
            key,
            format!("{n} bytes is outside {}..={}", range.start(), range.end()),
        ));
    }
    Ok(n)
}

impl RawRepublish {
    /// Types and checks the table.
    pub fn parse(&self) -> Result<RepublishConfig, ConfigError> {
        let (host, port) = self.broker()?;
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
        let topic_from_record = self.topic_from_record.clone().unwrap_or_default();
        if let Some(s) = topic_from_record.iter().find(|s| !streams.contains(s)) {
            return Err(key_err(
                "topic_from_record",
                format!("`{s}` is not in republish.streams"),
            ));
        }
        let batch_records = self.batch_records.unwrap_or(DEFAULT_BATCH_RECORDS);
        if !(1..=65_535).contains(&batch_records) {
            return Err(key_err("batch_records", "must be 1..=65535"));
        }
        let dead_letters_max = self.dead_letters_max.unwrap_or(DEFAULT_DEAD_LETTERS_MAX);
        if !(1..=10_000_000).contains(&dead_letters_max) {
            return Err(key_err("dead_letters_max", "must be 1..=10000000"));
        }
        Ok(RepublishConfig {
            host,
            port,
            client_id: self
                .client_id
                .clone()
                .unwrap_or_else(|| "tributary-hub".into()),
            streams: streams.clone(),
            topic_template: self.template()?,
            topic_from_record,
            topic_bytes_max: bytes_in(
                "topic_bytes_max",
                self.topic_bytes_max.as_deref(),
                DEFAULT_TOPIC_BYTES_MAX as u64,
                1..=TOPIC_BYTES_LIMIT as u64,
            )? as usize,
            packet_bytes_max: bytes_in(
                "packet_bytes_max",
                self.packet_bytes_max.as_deref(),
                DEFAULT_PACKET_BYTES_MAX,
                1024..=PACKET_BYTES_LIMIT,
            )?,
            batch_records,
            batch_bytes_max: bytes_in(
                "batch_bytes_max",
                self.batch_bytes_max.as_deref(),
                DEFAULT_BATCH_BYTES_MAX,
                1..=1 << 30,
            )?,
            dead_letters_max,
            poll_interval: self.poll_interval()?,
            format: self.format(&streams)?,
            #[cfg(feature = "fault-injection")]
            mutation: Mutation::None,
        })
    }

    fn broker(&self) -> Result<(String, u16), ConfigError> {
        let url = self
            .url
            .as_deref()
            .ok_or_else(|| key_err("url", "is required in [republish]"))?;
        parse_url(url).ok_or_else(|| {
            key_err(
                "url",
                format!("`{url}` is not a URL such as mqtt://127.0.0.1:1883"),
            )
        })
    }

    fn template(&self) -> Result<Template, ConfigError> {
        let text = self
            .topic_template
            .as_deref()
            .unwrap_or(DEFAULT_TOPIC_TEMPLATE);
        Template::parse(text).map_err(|p| key_err("topic_template", format!("`{text}`: {p}")))
    }

    fn format(&self, streams: &[String]) -> Result<Format, ConfigError> {
        match self.format.as_deref().unwrap_or("json") {
            "json" if self.sparkplug.is_some() => Err(key_err(
                "sparkplug",
                "is only read with republish.format = \"sparkplug\"",
            )),
            "json" => Ok(Format::Json),
            "sparkplug" => {
                // Sparkplug fixes the topics; a template or a record's topic would be ignored.
                for (key, set) in [
                    ("topic_template", self.topic_template.is_some()),
                    ("topic_from_record", self.topic_from_record.is_some()),
                ] {
                    if set {
                        return Err(key_err(
                            key,
                            "does not apply with format = \"sparkplug\" (Sparkplug fixes the topics)",
                        ));
                    }
                }
                let raw = self.sparkplug.clone().unwrap_or_default();
                Ok(Format::Sparkplug(raw.parse(streams)?))
            }
            other => Err(key_err(
                "format",
                format!("`{other}` is not a format; use \"json\" or \"sparkplug\""),
            )),
        }
    }

    fn poll_interval(&self) -> Result<Duration, ConfigError> {
        match self.poll_interval.as_deref() {
            None => Ok(DEFAULT_POLL_INTERVAL),
            Some(s) => humantime::parse_duration(s.trim())
                .map_err(|e| key_err("poll_interval", format!("`{s}`: {e}"))),
        }
    }
}

impl RawSparkplug {
    fn parse(&self, streams: &[String]) -> Result<SparkplugConfig, ConfigError> {
        let group_id = self.group_id.as_deref().unwrap_or(DEFAULT_GROUP_ID);
        level("sparkplug.group_id", group_id)?;
        let edge_node_id = self.edge_node_id.as_deref().unwrap_or(DEFAULT_EDGE_NODE_ID);
        if streams.len() > 1 && !edge_node_id.contains("{stream}") {
            return Err(key_err(
                "sparkplug.edge_node_id",
                format!(
                    "`{edge_node_id}` has no {{stream}}: each of the {} streams is its own \
                     edge node and needs its own id",
                    streams.len()
                ),
            ));
        }
        level(
            "sparkplug.edge_node_id",
            &edge_node_id.replace("{stream}", "s"),
        )?;
        let after = match self.historical_after.as_deref() {
            None => DEFAULT_HISTORICAL_AFTER,
            Some(s) => humantime::parse_duration(s.trim())
                .map_err(|e| key_err("sparkplug.historical_after", format!("`{s}`: {e}")))?,
        };
        let metrics_max = self.metrics_max.unwrap_or(DEFAULT_METRICS_MAX);
        if !(1..=10_000_000).contains(&metrics_max) {
            return Err(key_err("sparkplug.metrics_max", "must be 1..=10000000"));
        }
        Ok(SparkplugConfig {
            group_id: group_id.to_string(),
            edge_node_id: edge_node_id.to_string(),
            historical: Historical { after },
            metrics_max,
        })
    }
}

/// A Sparkplug id fills exactly one topic level.
fn level(key: &str, id: &str) -> Result<(), ConfigError> {
    if id.contains('/') {
        return Err(key_err(
            key,
            format!("`{id}` has a `/`; an id is one topic level"),
        ));
    }
    check_topic(id, 256).map_err(|e| key_err(key, format!("`{id}`: {e}")))
}

pub(crate) fn parse_url(url: &str) -> Option<(String, u16)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> RawRepublish {
        RawRepublish {
            url: Some("mqtt://127.0.0.1:1884".into()),
            streams: Some(vec!["t".into()]),
            ..RawRepublish::default()
        }
    }

    fn err(raw: &RawRepublish) -> String {
        raw.parse().unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_the_safe_ones() {
        let c = raw().parse().unwrap();
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 1884));
        assert!(
            c.topic_from_record.is_empty(),
            "no record steers by default"
        );
        assert_eq!(c.topic_bytes_max, DEFAULT_TOPIC_BYTES_MAX);
        assert_eq!(c.packet_bytes_max, DEFAULT_PACKET_BYTES_MAX);
        assert_eq!(c.batch_bytes_max, DEFAULT_BATCH_BYTES_MAX);
        assert_eq!(c.dead_letters_max, DEFAULT_DEAD_LETTERS_MAX);
        assert_eq!(parse_url("mqtt://broker"), Some(("broker".into(), 1883)));
    }

    #[test]
    fn every_key_reads_from_hub_toml() {
        let text = "data_dir = \"/tmp/x\"\n[republish]\nurl = \"mqtt://127.0.0.1:1883\"\n\
            streams = [\"t\", \"b\"]\ntopic_template = \"hub/{stream}/{key}\"\n\
            topic_from_record = [\"b\"]\ntopic_bytes_max = \"512\"\npacket_bytes_max = \"64KiB\"\n\
            batch_records = 10\nbatch_bytes_max = \"1MiB\"\ndead_letters_max = 50\n";
        let c = crate::config::HubConfig::from_toml(text)
            .unwrap()
            .republish
            .unwrap();
        assert_eq!(c.topic_from_record, ["b"]);
        assert_eq!((c.topic_bytes_max, c.packet_bytes_max), (512, 64 << 10));
        assert_eq!((c.batch_records, c.batch_bytes_max), (10, 1 << 20));
        assert_eq!(c.dead_letters_max, 50);
        let unknown = text.replace("dead_letters_max", "dead_letter_max");
        let e = crate::config::HubConfig::from_toml(&unknown).unwrap_err();
        assert!(e.to_string().contains("dead_letter_max"), "{e}");
    }

    #[test]
    fn sparkplug_keys_read_and_problems_name_their_key() {
        let text = "data_dir = \"/tmp/x\"\n[republish]\nurl = \"mqtt://127.0.0.1:1883\"\n\
            streams = [\"t\", \"b\"]\nformat = \"sparkplug\"\n[republish.sparkplug]\n\
            group_id = \"plant\"\nedge_node_id = \"hub-{stream}\"\n\
            historical_after = \"30s\"\nmetrics_max = 50\n";
        let c = crate::config::HubConfig::from_toml(text)
            .unwrap()
            .republish
            .unwrap();
        let Format::Sparkplug(s) = c.format else {
            panic!("{:?}", c.format)
        };
        assert_eq!(
            (s.group_id.as_str(), s.edge_node_of("b")),
            ("plant", "hub-b".into())
        );
        assert_eq!(s.historical.after, Duration::from_secs(30));
        assert_eq!(s.metrics_max, 50);
        assert_eq!(
            raw().parse().unwrap().format,
            Format::Json,
            "json by default"
        );
        let e = crate::config::HubConfig::from_toml(&text.replace("metrics_max", "metric_max"))
            .unwrap_err();
        assert!(e.to_string().contains("metric_max"), "{e}");

        let spb = |edit: fn(&mut RawSparkplug)| {
            let mut r = raw();
            r.format = Some("sparkplug".into());
            let mut s = RawSparkplug::default();
            edit(&mut s);
            r.sparkplug = Some(s);
            r
        };
        type Edit = fn(&mut RawRepublish);
        let mut two = spb(|s| s.edge_node_id = Some("hub".into()));
        two.streams = Some(vec!["a".into(), "b".into()]);
        let cases: Vec<(RawRepublish, &str)> = vec![
            (
                spb(|s| s.group_id = Some("a/b".into())),
                "republish.sparkplug.group_id",
            ),
            (
                spb(|s| s.group_id = Some("+".into())),
                "republish.sparkplug.group_id",
            ),
            (
                spb(|s| s.edge_node_id = Some("".into())),
                "republish.sparkplug.edge_node_id",
            ),
            (two, "republish.sparkplug.edge_node_id"),
            (
                spb(|s| s.historical_after = Some("soon".into())),
                "republish.sparkplug.historical_after",
            ),
            (
                spb(|s| s.metrics_max = Some(0)),
                "republish.sparkplug.metrics_max",
            ),
            (
                {
                    let mut r = spb(|_| {});
                    r.topic_template = Some("a/{key}".into());
                    r
                },
                "republish.topic_template",
            ),
            (
                {
                    let mut r = raw();
                    r.sparkplug = Some(RawSparkplug::default());
                    r
                },
                "republish.sparkplug",
            ),
            (
                {
                    let e: Edit = |r| r.format = Some("xml".into());
                    let mut r = raw();
                    e(&mut r);
                    r
                },
                "republish.format",
            ),
        ];
        for (r, key) in cases {
            let e = err(&r);
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn config_problems_name_their_key() {
        type Edit = fn(&mut RawRepublish);
        let cases: [(Edit, &str); 8] = [
            (|r| r.qos = Some(2), "republish.qos"),
            (|r| r.url = Some("http://x".into()), "republish.url"),
            (
                |r| r.topic_template = Some("a/{nope}".into()),
                "republish.topic_template",
            ),
            (
                |r| r.topic_template = Some("a/#".into()),
                "republish.topic_template",
            ),
            (
                |r| r.topic_from_record = Some(vec!["other".into()]),
                "republish.topic_from_record",
            ),
            (
                |r| r.topic_bytes_max = Some("70000".into()),
                "republish.topic_bytes_max",
            ),
            (
                |r| r.packet_bytes_max = Some("1GiB".into()),
                "republish.packet_bytes_max",
            ),
            (
                |r| r.batch_bytes_max = Some("lots".into()),
                "republish.batch_bytes_max",
            ),
        ];
        for (edit, key) in cases {
            let mut r = raw();
            edit(&mut r);
            let e = err(&r);
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
