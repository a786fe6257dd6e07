//! The agent's status as `GET /v1/status` serves it and `edge-agent status` prints it.
//!
//! One serde type on both ends, so the CLI and the endpoint can never disagree about a field.
//!
//! - `link` is one word (`up`, `down`, `not configured`); `link_detail` says why, since when
//!   and when the next attempt is due. The replicator records its transitions in a
//!   [`LinkRecord`], the type both are built from.
//! - Dropped counts come from the log's gap markers, which are durable: they survive restarts.
//! - `refused_streams` lists the streams the hub refuses now: its code and message, since
//!   when, and when the agent offers the stream again; a stream leaves it once it ships.
//! - `sources` shows each MQTT source's connection: broker, state, last error, since when and
//!   messages received.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::log::LogStatus;
use crate::metrics::oldest_unsent_age_s;

/// The state of the link to the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkState {
    /// No `[hub]` in the config: the agent only records locally.
    NotConfigured,
    Down,
    Up,
}

impl LinkState {
    /// How `status` prints it.
    pub fn label(self) -> &'static str {
        match self {
            LinkState::NotConfigured => "not configured",
            LinkState::Down => "down",
            LinkState::Up => "up",
        }
    }
}

/// What the replicator last recorded about the link (`LinkStatus` keeps it under a lock).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LinkRecord {
    /// `not configured`, `connecting`, `up` or `down`.
    pub state: String,
    /// The last failure: the connection error, or the hub's close code and message. Kept
    /// through reconnect attempts; cleared when a session is established.
    pub last_error: Option<String>,
    /// Unix ms of the last state change.
    pub since_ms: u64,
    /// Unix ms since the link is up, or since it is not (last up, or the first attempt).
    pub condition_since_ms: u64,
    /// Unix ms when the next connection attempt is due, while waiting for it.
    pub next_retry_ms: Option<u64>,
}

impl LinkRecord {
    /// Records a transition to `state`; `error` replaces the last error when set (and going
    /// up clears it).
    pub fn record(&mut self, state: &str, error: Option<String>, now_ms: u64) {
        let was_up = self.state == "up";
        let is_up = state == "up";
        if self.state.is_empty() || was_up != is_up {
            self.condition_since_ms = now_ms;
        }
        if error.is_some() || is_up {
            self.last_error = error;
        }
        self.state = state.to_owned();
        self.since_ms = now_ms;
        self.next_retry_ms = None;
    }

    /// The next attempt is due in `delay`.
    pub fn retry_in(&mut self, delay: Duration, now_ms: u64) {
        self.next_retry_ms = Some(now_ms.saturating_add(delay.as_millis() as u64));
    }

    /// How long the link has not been up at `now_ms` (None while up or not configured).
    pub fn down_for(&self, now_ms: u64) -> Option<Duration> {
        match self.state.as_str() {
            "up" | "not configured" | "" => None,
            _ => Some(Duration::from_millis(
                now_ms.saturating_sub(self.condition_since_ms),
            )),
        }
    }

    /// The report's view at `now_ms`.
    pub fn detail(&self, now_ms: u64) -> LinkDetail {
        let known = |ms: u64| (ms > 0).then(|| rfc3339_ms(ms));
        LinkDetail {
            state: self.state.clone(),
            reason: self.last_error.as_deref().map(explain),
            since: known(self.condition_since_ms),
            since_s: (self.condition_since_ms > 0)
                .then(|| now_ms.saturating_sub(self.condition_since_ms) as f64 / 1e3),
            next_retry: self.next_retry_ms.map(rfc3339_ms),
            next_retry_in_s: self
                .next_retry_ms
                .map(|at| at.saturating_sub(now_ms) as f64 / 1e3),
        }
    }
}

/// The link beyond its one word: why, since when, and when the next attempt is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkDetail {
    /// `connecting`, `up`, `down` or `not configured`.
    pub state: String,
    /// The last failure (connection error, or the hub's close code and message); none once
    /// a session is established.
    pub reason: Option<String>,
    /// RFC 3339: since when the link is up, or since when it is not (when it was last up, or
    /// when the agent first tried).
    pub since: Option<String>,
    /// Seconds since `since`.
    pub since_s: Option<f64>,
    /// RFC 3339: when the next connection attempt is due, while the agent waits for it.
    pub next_retry: Option<String>,
    pub next_retry_in_s: Option<f64>,
}

/// A stream the hub refuses now (not on its allow-list, a quota, a forbidden key): the agent
/// keeps its records, keeps it announced and offers it again at `next_retry`. Listed until the
/// hub acknowledges the stream again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RefusedReport {
    pub stream: String,
    /// The hub's code, as the protocol spells it (`UNAUTHORIZED_STREAM`, `QUOTA_EXCEEDED`).
    pub code: String,
    /// The hub's message.
    pub message: String,
    /// RFC 3339: the hub's first refusal since the stream last shipped.
    pub since: String,
    /// Seconds since `since`.
    pub since_s: f64,
    /// RFC 3339: when the agent offers the stream to the hub again.
    pub next_retry: String,
    pub next_retry_in_s: f64,
}

/// One MQTT source's connection, for the report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceReport {
    /// Its index among the MQTT sources (`source` label on `/metrics`).
    pub source: usize,
    pub kind: String,
    /// `host:port` of the broker.
    pub broker: String,
    pub stream: String,
    /// `connecting`, `connected` (every subscription granted), `subscribing` or
    /// `disconnected`.
    pub state: String,
    pub last_error: Option<String>,
    /// RFC 3339 of the last state change.
    pub since: Option<String>,
    /// PUBLISH packets received since the agent started.
    pub messages_received: u64,
    pub records: u64,
}

/// A link error with the TLS alert it carries named: quinn reports the hub's verdict on the
/// device certificate only as "the cryptographic handshake failed: error 44". Without "by
/// peer" the alert is this device's own verdict on the hub's certificate.
pub fn explain(error: &str) -> String {
    const MARK: &str = "the cryptographic handshake failed: error ";
    let Some(at) = error.find(MARK) else {
        return error.to_owned();
    };
    if !error.contains("by peer") {
        return format!(
            "this device refused the hub's certificate (check tls.ca and hub.server_name) ({error})"
        );
    }
    let digits: String = error[at + MARK.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let what = match digits.parse::<u8>() {
        Ok(42) => "the hub refused the device certificate (bad certificate)",
        Ok(44) => "the hub refused the device certificate: it is revoked",
        Ok(45) => "the hub refused the device certificate: expired or not yet valid",
        Ok(46) => "the hub refused the device certificate (certificate unknown)",
        Ok(48 | 51) => {
            "the hub refused the device certificate: not signed by the hub's fleet CA (unknown CA)"
        }
        _ => return error.to_owned(),
    };
    format!("{what}; TLS alert {digits} ({error})")
}

/// Whether the link lets the agent count as ready: `Err` with the reason once it has been
/// down longer than `limit`. Without a `[hub]` (`limit` or `link` absent) it always is.
pub fn readiness(
    link: Option<&LinkRecord>,
    limit: Option<Duration>,
    now_ms: u64,
) -> Result<(), String> {
    let (Some(link), Some(limit)) = (link, limit) else {
        return Ok(());
    };
    let Some(down) = link.down_for(now_ms) else {
        return Ok(());
    };
    if down <= limit {
        return Ok(());
    }
    let reason = link
        .last_error
        .as_deref()
        .map_or_else(|| "no error recorded yet".to_owned(), explain);
    Err(format!(
        "the link to the hub has been down for {}s (since {}, over hub.link_down_unready_after = {}): {reason}",
        down.as_secs(),
        rfc3339_ms(link.condition_since_ms),
        humantime::format_duration(limit),
    ))
}

/// Unix ms now, from the wall clock.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Unix ms as RFC 3339 in UTC, to the millisecond.
pub fn rfc3339_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The whole agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The current epoch: 16 hex digits in JSON, like every epoch the agent and the hub write
    /// (a number from older agents is read too).
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub link: LinkState,
    /// Why, since when, next retry (absent from older agents).
    #[serde(default)]
    pub link_detail: Option<LinkDetail>,
    /// The streams the hub refuses now (absent from older agents).
    #[serde(default)]
    pub refused_streams: Vec<RefusedReport>,
    /// The MQTT sources' connections (absent from older agents).
    #[serde(default)]
    pub sources: Vec<SourceReport>,
    /// The fsync policy, as written in the config (`interval:10ms`).
    pub fsync: String,
    /// `drop-oldest` or `block`.
    pub on_full: String,
    pub disk_bytes: u64,
    pub disk_bytes_max: u64,
    /// Why the log refuses writes, when it does.
    pub poisoned: Option<String>,
    pub streams: Vec<StreamReport>,
    /// Filter pipeline counters of every filtered stream (absent from older agents).
    #[serde(default)]
    pub filters: Vec<crate::metrics::FilterReport>,
}

/// One stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamReport {
    pub stream: String,
    /// 16 hex digits in JSON, as `StatusReport::epoch`.
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    /// The seq the next record will get.
    pub next_seq: u64,
    /// The last seq fsynced locally.
    pub durable_seq: u64,
    /// The last seq the hub acknowledged as durable (0: none yet).
    pub acked_seq: u64,
    /// The last seq the hub reported tiered (0: none yet).
    pub tiered_seq: u64,
    pub backlog_bytes: u64,
    pub backlog_blocks: u64,
    pub segments: usize,
    /// Event time (ns) of the oldest record the hub has not acknowledged.
    pub oldest_unsent_ts: Option<i64>,
    /// Seconds since that event time.
    pub oldest_unsent_age_s: Option<f64>,
    /// Records the disk budget dropped, over the data directory's life (from its gap
    /// markers, so a restart keeps them).
    pub dropped_records: u64,
    /// Blocks dropped since the agent started (block counts are not kept in the markers).
    pub dropped_blocks: u64,
    /// Gap markers of dropped records (one per contiguous run), over the data directory's life.
    #[serde(default)]
    pub dropped_gaps: u64,
    pub quarantined_blocks: u64,
    /// False for a stream kept on the device (`replicate = false`): it owes the hub nothing,
    /// so its backlog is 0 and it has no oldest unsent record (absent from older agents).
    #[serde(default = "replicated")]
    pub replicate: bool,
}

fn replicated() -> bool {
    true
}

impl StatusReport {
    /// Builds the report from a log snapshot.
    pub fn new(
        status: &LogStatus,
        link: LinkState,
        fsync: &str,
        on_full: &str,
        disk_bytes_max: u64,
        now_ns: i64,
    ) -> Self {
        let streams = status
            .streams
            .iter()
            .map(|s| StreamReport {
                stream: s.stream.clone(),
                epoch: s.epoch,
                next_seq: s.next_seq,
                durable_seq: s.durable_seq,
                acked_seq: s.acked_durable,
                tiered_seq: s.acked_tiered,
                backlog_bytes: s.backlog_bytes,
                backlog_blocks: s.backlog_blocks,
                segments: s.segments,
                oldest_unsent_ts: s.oldest_unsent_ts,
                oldest_unsent_age_s: oldest_unsent_age_s(s.oldest_unsent_ts, now_ns),
                dropped_records: s.dropped_records,
                dropped_blocks: s.dropped_blocks,
                dropped_gaps: s.dropped_gaps,
                quarantined_blocks: s.quarantined_blocks,
                replicate: true,
            })
            .collect();
        StatusReport {
            epoch: status.epoch,
            link,
            link_detail: None,
            refused_streams: Vec::new(),
            sources: Vec::new(),
            fsync: fsync.to_owned(),
            on_full: on_full.to_owned(),
            disk_bytes: status.disk_bytes,
            disk_bytes_max,
            poisoned: status.poisoned.clone(),
            streams,
            filters: Vec::new(),
        }
    }
}

impl StatusReport {
    /// Marks the streams for which `is_local` holds as kept on the device: no backlog and no
    /// replication lag (what they hold still shows in `segments` and `disk_bytes`).
    pub fn with_local_streams(mut self, is_local: impl Fn(&str) -> bool) -> Self {
        for s in self.streams.iter_mut().filter(|s| is_local(&s.stream)) {
            s.replicate = false;
            s.backlog_bytes = 0;
            s.backlog_blocks = 0;
            s.oldest_unsent_ts = None;
            s.oldest_unsent_age_s = None;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_since_counts_from_the_last_up_and_survives_retries() {
        let mut l = LinkRecord::default();
        l.record("connecting", None, 1_000);
        assert_eq!(l.condition_since_ms, 1_000);
        l.record("up", None, 2_000);
        assert_eq!(l.down_for(5_000), None);
        l.record("down", Some("connection lost: timed out".into()), 9_000);
        l.retry_in(Duration::from_millis(1_500), 9_000);
        assert_eq!(l.next_retry_ms, Some(10_500));
        l.record("connecting", None, 10_500);
        l.record("down", None, 12_000);
        // Since the link went down, not since the last attempt; the reason is kept.
        assert_eq!(l.condition_since_ms, 9_000);
        assert_eq!(l.down_for(12_000), Some(Duration::from_secs(3)));
        let d = l.detail(12_000);
        assert_eq!(d.reason.as_deref(), Some("connection lost: timed out"));
        assert_eq!(d.since.as_deref(), Some("1970-01-01T00:00:09.000Z"));
        assert_eq!(d.next_retry, None);
        assert!(readiness(Some(&l), Some(Duration::from_secs(2)), 12_000).is_err());
        assert!(readiness(Some(&l), Some(Duration::from_secs(5)), 12_000).is_ok());
        l.record("up", None, 13_000);
        assert_eq!(l.last_error, None);
        assert!(readiness(Some(&l), Some(Duration::from_secs(2)), 99_000).is_ok());
    }

    #[test]
    fn tls_alerts_are_named() {
        let e = "connection lost: aborted by peer: the cryptographic handshake failed: error 44";
        assert!(explain(e).contains("revoked"), "{}", explain(e));
        let e = "control stream: closed by peer: the cryptographic handshake failed: error 48: x";
        assert!(explain(e).contains("unknown CA"), "{}", explain(e));
        assert_eq!(explain("timed out"), "timed out");
        let local = "connecting: the cryptographic handshake failed: error 51: BadSignature";
        assert!(
            explain(local).contains("this device refused"),
            "{}",
            explain(local)
        );
        let mut l = LinkRecord::default();
        l.record("down", Some(e.to_owned()), 1_000);
        let why = readiness(Some(&l), Some(Duration::from_secs(1)), 5_000).unwrap_err();
        assert!(
            why.contains("unknown CA") && why.contains("down for 4s"),
            "{why}"
        );
    }
}
