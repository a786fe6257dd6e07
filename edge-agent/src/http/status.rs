//! The agent's status as `GET /v1/status` serves it and `edge-agent status` prints it.
//!
//! One serde type on both ends, so the CLI and the endpoint can never disagree about a field.

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

/// The whole agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The current epoch.
    pub epoch: u64,
    pub link: LinkState,
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
    pub dropped_records: u64,
    pub dropped_blocks: u64,
    pub quarantined_blocks: u64,
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
                quarantined_blocks: s.quarantined_blocks,
            })
            .collect();
        StatusReport {
            epoch: status.epoch,
            link,
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
