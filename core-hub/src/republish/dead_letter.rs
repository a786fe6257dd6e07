//! Dead letters: records the sink cannot publish. Each is recorded (bounded, in the catalog:
//! [`super::store`]), counted per reason on `/metrics`, logged once per reason per episode, and
//! skipped: the checkpoint moves past it with its batch, so it is never retried and the rest
//! of the stream keeps flowing. The record itself stays in the stream, readable at its offset.

use crate::read::ReadRecord;
use serde::Serialize;
use std::collections::BTreeMap;

/// The longest key prefix kept in a dead-letter entry.
pub const KEY_BYTES_KEPT: usize = 256;

/// Why a record was dead-lettered (the `reason` label on `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The topic has a wildcard, NUL, a control character or a leading `$`, or is empty.
    TopicInvalid,
    /// The topic is over `republish.topic_bytes_max` (or MQTT's 65,535 bytes).
    TopicTooLong,
    /// The PUBLISH packet is over `republish.packet_bytes_max` or the broker's maximum.
    PacketTooLarge,
    /// A part of the packet cannot be encoded (a user property over 65,535 bytes).
    Encoding,
    /// The broker answered the PUBLISH with a refusal that a retry cannot change
    /// (not authorized, topic name invalid, payload format invalid, unspecified).
    BrokerRefused,
    /// The broker closed the connection every time this record was outstanding on its own
    /// (`republish::SUSPECT_FAILURES` times, after as many with its batch): a record the
    /// checks above did not catch but the broker will not take.
    BrokerDisconnected,
    /// `format = "sparkplug"`: the record's new metrics would take the edge node over
    /// `republish.sparkplug.metrics_max` metric definitions.
    TooManyMetrics,
    /// A reason this build does not know (read from a newer catalog).
    Other,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TopicInvalid => "topic_invalid",
            Reason::TopicTooLong => "topic_too_long",
            Reason::PacketTooLarge => "packet_too_large",
            Reason::Encoding => "encoding",
            Reason::BrokerRefused => "broker_refused",
            Reason::BrokerDisconnected => "broker_disconnected",
            Reason::TooManyMetrics => "too_many_metrics",
            Reason::Other => "other",
        }
    }

    pub fn parse(s: &str) -> Reason {
        [
            Reason::TopicInvalid,
            Reason::TopicTooLong,
            Reason::PacketTooLarge,
            Reason::Encoding,
            Reason::BrokerRefused,
            Reason::BrokerDisconnected,
            Reason::TooManyMetrics,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
        .unwrap_or(Reason::Other)
    }
}

/// One dead-lettered record: where it is, whose it is, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    pub stream: String,
    /// The record's hub offset: `GET /v1/streams/{stream}/records?from={offset}` reads it.
    pub offset: u64,
    pub device: String,
    /// 16 hex digits ([`sync::epoch`]).
    #[serde(serialize_with = "sync::epoch::serde_hex::serialize")]
    pub epoch: u64,
    pub seq: u64,
    /// The key's first [`KEY_BYTES_KEPT`] bytes (cut at a character boundary).
    pub key: String,
    /// The key's full length.
    pub key_bytes: usize,
    pub reason: Reason,
    pub detail: String,
    /// When it was dead-lettered (ns since the Unix epoch).
    pub at_ns: i64,
}

impl DeadLetter {
    pub fn new(stream: &str, r: &ReadRecord, reason: Reason, detail: String) -> DeadLetter {
        let mut cut = r.key.len().min(KEY_BYTES_KEPT);
        while !r.key.is_char_boundary(cut) {
            cut -= 1;
        }
        DeadLetter {
            stream: stream.to_string(),
            offset: r.offset,
            device: r.device.chars().take(KEY_BYTES_KEPT).collect(),
            epoch: r.epoch,
            seq: r.seq,
            key: r.key[..cut].to_string(),
            key_bytes: r.key.len(),
            reason,
            detail,
            at_ns: now_ns(),
        }
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// Logging once per reason per episode: an episode is a run of dead letters of one stream
/// with no record published in between. The first dead letter of each reason in an episode
/// is logged as a warning with its details; the rest are only counted, and a summary is
/// logged when a record is published again.
#[derive(Debug, Default)]
pub struct Episode {
    counts: BTreeMap<Reason, u64>,
}

impl Episode {
    /// Notes a dead letter; logs it when it is its reason's first in this episode.
    pub fn dead_lettered(&mut self, d: &DeadLetter) {
        let n = self.counts.entry(d.reason).or_default();
        *n += 1;
        if *n == 1 {
            tracing::warn!(
                stream = %d.stream,
                offset = d.offset,
                device = %d.device,
                seq = d.seq,
                reason = d.reason.as_str(),
                detail = %d.detail,
                "republish: record dead-lettered and skipped (further ones for this reason are \
                 counted, not logged, until a record is published again)"
            );
        }
    }

    /// Notes a published record: ends the episode with a summary if it had dead letters.
    pub fn published(&mut self, stream: &str) {
        if self.counts.is_empty() {
            return;
        }
        for (reason, n) in std::mem::take(&mut self.counts) {
            tracing::info!(
                %stream,
                reason = reason.as_str(),
                records = n,
                "republish: episode over, records dead-lettered in it"
            );
        }
    }

    /// How many dead letters of `reason` this episode has seen.
    pub fn count(&self, reason: Reason) -> u64 {
        self.counts.get(&reason).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_round_trip_and_keys_are_cut_on_a_boundary() {
        for r in [
            Reason::TopicInvalid,
            Reason::TopicTooLong,
            Reason::PacketTooLarge,
            Reason::Encoding,
            Reason::BrokerRefused,
        ] {
            assert_eq!(Reason::parse(r.as_str()), r);
        }
        assert_eq!(Reason::parse("from-the-future"), Reason::Other);
        let rec = ReadRecord {
            tags: Vec::new(),
            device: "d".into(),
            epoch: 1,
            seq: 2,
            key: "ü".repeat(200),
            ts: 0,
            fields: vec![],
            offset: 9,
            ingest_ts: 0,
            segment: 0,
        };
        let d = DeadLetter::new("s", &rec, Reason::TopicTooLong, "x".into());
        assert_eq!((d.key.len(), d.key_bytes), (256, 400));
        let mut e = Episode::default();
        e.dead_lettered(&d);
        e.dead_lettered(&d);
        assert_eq!(e.count(Reason::TopicTooLong), 2);
        e.published("s");
        assert_eq!(e.count(Reason::TopicTooLong), 0);
    }
}
