//! Completeness: "has the hub got every record of stream S with event time in [from, to]?"
//!
//! The hub cannot see records that never arrived, so it answers from what devices tell it and
//! what it committed (docs/completeness.md has the rules for operators):
//!
//! - **Heard after `to`.** A device *settles* a time `to` once the hub received one of its
//!   Backlog reports at or after `to + clock_skew` (a device with no report at all for the
//!   stream: its last contact). Before that the device may still hold records stamped
//!   before `to` that the hub has never heard of, so it is listed as `owed` (reason
//!   `not_heard_since`). `clock_skew` allows for the device clock running behind the hub's
//!   and for records still in flight when the report left.
//! - **Backlog.** A settled device whose latest report shows unsent blocks whose oldest
//!   record has event time `<= to` (or an unknown oldest time) still owes data: `owed`,
//!   reason `backlog`, with blocks, bytes and the oldest unsent event time.
//! - **Gaps.** Gap markers are seq ranges a device dropped for good. The protocol carries no
//!   times for them, so their event-time span is derived from the committed blocks around
//!   them in the same `(device, epoch, stream)`: from the `max_ts` of the block just before
//!   to the `min_ts` of the block just after, open-ended where no such block exists. A gap
//!   *covers* the range when that span overlaps `[from, to]`.
//! - **Answer.** `owed` if any device owes; else `complete_with_gaps` if any gap covers the
//!   range; else `complete`.
//! - **Retired** devices (`core-hub devices retire ID`) are left out of every answer, the
//!   watermark and the gauges.
//! - **Watermark.** Per stream, the minimum over its *active* devices of the maximum event
//!   time the hub committed from each; a device whose last block for the stream was ingested
//!   more than `idle_timeout` ago is idle and drops out.
//! - **Complete through.** Per device, the latest `T` for which a query `to = T` would not
//!   list it as owed: `report_time - clock_skew`, or just before its oldest unsent record.
//!   The stream's value is the minimum over its non-retired devices (a gauge in `/metrics`).
//!
//! The per-`(device, stream)` maximum event time and last ingest time come from the block
//! index through an incremental scan by block row id ([`Tracker`]), so each query costs only
//! the blocks committed since the last one.

use crate::catalog::{CatalogError, DeviceId, StreamId};
use crate::config::ConfigError;
use crate::ingest::Hub;
use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};
use thiserror::Error;

/// Default allowance for device clocks behind the hub's and records in flight.
pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_secs(5);
/// Default time without new blocks after which a device leaves a stream's watermark.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Default time without contact after which the status page shows a device offline. Agents
/// report backlog every 10 s while connected, so three missed reports mean it is gone.
pub const DEFAULT_OFFLINE_AFTER: Duration = Duration::from_secs(30);

/// Blocks read per step of the incremental scan.
const SCAN_PAGE: i64 = 50_000;

/// `[completeness]` in `hub.toml`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletenessConfig {
    pub clock_skew: Duration,
    pub idle_timeout: Duration,
    pub offline_after: Duration,
}

impl Default for CompletenessConfig {
    fn default() -> Self {
        CompletenessConfig {
            clock_skew: DEFAULT_CLOCK_SKEW,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            offline_after: DEFAULT_OFFLINE_AFTER,
        }
    }
}

/// The raw `[completeness]` table.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCompleteness {
    pub clock_skew: Option<String>,
    pub idle_timeout: Option<String>,
    pub offline_after: Option<String>,
}

impl RawCompleteness {
    /// Types and checks the table.
    pub fn parse(&self) -> Result<CompletenessConfig, ConfigError> {
        let d = CompletenessConfig::default();
        let dur = |key: &str, v: &Option<String>, default: Duration| match v.as_deref() {
            None => Ok(default),
            Some(s) => humantime::parse_duration(s.trim()).map_err(|e| ConfigError::Key {
                key: format!("completeness.{key}"),
                problem: format!("`{s}` is not a duration such as 5s: {e}"),
            }),
        };
        Ok(CompletenessConfig {
            clock_skew: dur("clock_skew", &self.clock_skew, d.clock_skew)?,
            idle_timeout: dur("idle_timeout", &self.idle_timeout, d.idle_timeout)?,
            offline_after: dur("offline_after", &self.offline_after, d.offline_after)?,
        })
    }
}

/// Why a completeness query failed.
#[derive(Debug, Error)]
pub enum CompletenessError {
    #[error("unknown stream `{0}`")]
    UnknownStream(String),
    /// The time parser's message: what was given and the forms accepted.
    #[error("{0}")]
    BadTime(String),
    #[error("`from` is after `to`")]
    EmptyRange,
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

impl From<rusqlite::Error> for CompletenessError {
    fn from(e: rusqlite::Error) -> Self {
        CompletenessError::Catalog(CatalogError::from(e))
    }
}

/// Parses a query time with the one time parser ([`sync::time`]): RFC 3339 with `Z` or a
/// numeric offset (`2025-11-29T01:00:00+01:00`), `now` or a relative time (`-1h`), an epoch
/// number with a unit (`1764374400s`), or a bare integer as ns since the Unix epoch.
pub fn parse_time(s: &str) -> Result<i64, CompletenessError> {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
    sync::time::parse_instant_with(s, now, Some(sync::time::TimeUnit::Ns))
        .map_err(|e| CompletenessError::BadTime(e.to_string()))
}

/// Formats ns since the Unix epoch as RFC 3339 (UTC).
pub fn format_time(ns: i64) -> String {
    if ns < 0 {
        return ns.to_string();
    }
    let t = SystemTime::UNIX_EPOCH + Duration::from_nanos(ns as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The three-way answer.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Complete,
    Owed,
    CompleteWithGaps,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Complete => "complete",
            Status::Owed => "owed",
            Status::CompleteWithGaps => "complete_with_gaps",
        }
    }
}

/// Why a device still owes data.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OwedReason {
    /// Not heard from since `to + clock_skew`.
    NotHeardSince,
    /// Reported unsent records from before `to`.
    Backlog,
}

/// A device that still owes data for the range.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Owed {
    pub device: String,
    pub reason: OwedReason,
    pub last_contact_ns: Option<i64>,
    /// When the backlog figures below were reported.
    pub backlog_reported_at_ns: Option<i64>,
    /// Records owed, when the device reported the seq it holds (`last_seq - acked`).
    pub records: Option<u64>,
    pub blocks: u64,
    pub bytes: u64,
    /// Event time of the oldest record not yet sent.
    pub oldest_unsent_ts: Option<i64>,
}

/// A gap marker covering the range.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GapCover {
    pub device: String,
    /// 16 hex digits ([`sync::epoch`]).
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub records: u64,
    pub reason: String,
    /// The derived event-time span: after this (the block before the gap), `None` = open.
    pub after_ts: Option<i64>,
    /// ... and before this (the block after the gap), `None` = open.
    pub before_ts: Option<i64>,
}

/// The durable mark of one epoch.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EpochMark {
    /// 16 hex digits ([`sync::epoch`]).
    #[serde(with = "sync::epoch::serde_hex")]
    pub epoch: u64,
    pub acked_seq: u64,
}

/// What the hub knows of one device in one stream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceState {
    pub device: String,
    pub last_contact_ns: Option<i64>,
    pub marks: Vec<EpochMark>,
    pub backlog_reported_at_ns: Option<i64>,
    pub backlog_blocks: u64,
    pub backlog_bytes: u64,
    pub oldest_unsent_ts: Option<i64>,
    /// Largest event time committed from this device in this stream.
    pub max_event_ts: Option<i64>,
    /// Hub ingest time of its last block in this stream.
    pub last_ingest_ns: Option<i64>,
    /// In the watermark (not idle).
    pub active: bool,
    /// The latest `to` for which this device is settled; see the module docs.
    pub complete_through_ns: i64,
}

/// `GET /v1/streams/{s}/completeness`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Answer {
    pub stream: String,
    pub from_ns: i64,
    pub to_ns: i64,
    pub status: Status,
    /// Devices must have been heard from at or after this time to count.
    pub heard_after_ns: i64,
    pub owed: Vec<Owed>,
    pub gaps: Vec<GapCover>,
    pub devices: Vec<DeviceState>,
    /// Retired devices, left out of the answer.
    pub retired: Vec<String>,
    pub watermark_ns: Option<i64>,
    pub complete_through_ns: Option<i64>,
}

/// A stream's summary for gauges and the status page.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StreamSummary {
    pub stream: String,
    pub watermark_ns: Option<i64>,
    pub complete_through_ns: Option<i64>,
    pub active_devices: u64,
    pub devices: Vec<DeviceState>,
}

/// Per `(device, stream)`: (newest event time, last ingest time) of its committed blocks.
type Seen = HashMap<(DeviceId, StreamId), (i64, i64)>;

/// One device's state in a stream, and the records it owes when known.
type DeviceRows = Vec<(DeviceId, DeviceState, Option<Option<u64>>)>;

#[derive(Debug, Default)]
struct TrackerState {
    last_row: i64,
    /// (device, stream) -> (max event ts, last ingest ts).
    seen: Seen,
}

/// Follows the block index incrementally; shared by the API, the status page and `/metrics`.
#[derive(Debug)]
pub struct Tracker {
    cfg: CompletenessConfig,
    state: Mutex<TrackerState>,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn dur_ns(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

impl Tracker {
    pub fn new(cfg: CompletenessConfig) -> Tracker {
        Tracker {
            cfg,
            state: Mutex::new(TrackerState::default()),
        }
    }

    pub fn config(&self) -> &CompletenessConfig {
        &self.cfg
    }

    /// Folds the blocks committed since the last call into the per-device maxima.
    fn refresh(&self, hub: &Hub) -> Result<Seen, CompletenessError> {
        let mut st = self.state.lock().expect("tracker lock");
        loop {
            let from = st.last_row;
            let rows: Vec<(i64, i64, i64, i64, i64)> = hub.catalog().with_read_conn(|c| {
                let mut q = c.prepare_cached(
                    "SELECT id, device, stream, max_ts, ingest_ts FROM blocks WHERE id > ?1 ORDER BY id LIMIT ?2",
                )?;
                let rows = q.query_map(params![from, SCAN_PAGE], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                })?;
                rows.collect::<Result<Vec<_>, _>>()
            })?;
            for &(id, d, s, max_ts, ingest) in &rows {
                let e = st
                    .seen
                    .entry((d as DeviceId, s as StreamId))
                    .or_insert((max_ts, ingest));
                e.0 = e.0.max(max_ts);
                e.1 = e.1.max(ingest);
                st.last_row = st.last_row.max(id);
            }
            if (rows.len() as i64) < SCAN_PAGE {
                return Ok(st.seen.clone());
            }
        }
    }

    /// Per-device state of `stream` (retired devices separately), as of `now`.
    fn device_states(
        &self,
        hub: &Hub,
        sid: StreamId,
        now: i64,
    ) -> Result<(DeviceRows, Vec<String>), CompletenessError> {
        let seen = self.refresh(hub)?;
        let cat = hub.catalog();
        let skew = dur_ns(self.cfg.clock_skew);
        let idle = dur_ns(self.cfg.idle_timeout);
        let mut out = Vec::new();
        let mut retired = Vec::new();
        for d in cat.devices()? {
            let marks: Vec<EpochMark> = cat
                .marks_of(d.id)?
                .into_iter()
                .filter(|m| m.stream == sid)
                .map(|m| EpochMark {
                    epoch: m.epoch,
                    acked_seq: m.durable_seq,
                })
                .collect();
            let backlog = cat.backlog_of(d.id)?.into_iter().find(|b| b.stream == sid);
            let wrote = !marks.is_empty() || backlog.is_some();
            if !wrote && !seen.contains_key(&(d.id, sid)) {
                continue; // never wrote this stream
            }
            if d.retired {
                retired.push(d.name);
                continue;
            }
            let (max_event_ts, last_ingest_ns) = match seen.get(&(d.id, sid)) {
                Some(&(m, i)) => (Some(m), Some(i)),
                None => (None, None),
            };
            let heard = backlog
                .as_ref()
                .map(|b| b.reported_at_ns)
                .or(d.last_contact_ns);
            let mut through = heard.map_or(i64::MIN, |h| h.saturating_sub(skew));
            let (mut blocks, mut bytes, mut oldest, mut records) = (0, 0, None, None);
            if let Some(b) = &backlog {
                (blocks, bytes, oldest) = (b.blocks, b.bytes, b.oldest_unsent_ts);
                if b.blocks > 0 || b.bytes > 0 {
                    through =
                        through.min(b.oldest_unsent_ts.map_or(i64::MIN, |t| t.saturating_sub(1)));
                    let acked = marks.iter().map(|m| m.acked_seq).max().unwrap_or(0);
                    records = Some((b.last_seq > 0).then(|| b.last_seq.saturating_sub(acked)));
                }
            }
            let active = last_ingest_ns.is_some_and(|i| now.saturating_sub(i) <= idle);
            out.push((
                d.id,
                DeviceState {
                    device: d.name,
                    last_contact_ns: d.last_contact_ns,
                    marks,
                    backlog_reported_at_ns: backlog.as_ref().map(|b| b.reported_at_ns),
                    backlog_blocks: blocks,
                    backlog_bytes: bytes,
                    oldest_unsent_ts: oldest,
                    max_event_ts,
                    last_ingest_ns,
                    active,
                    complete_through_ns: through,
                },
                records,
            ));
        }
        Ok((out, retired))
    }

    /// The summary of one stream.
    pub fn summary(&self, hub: &Hub, stream: &str) -> Result<StreamSummary, CompletenessError> {
        let sid = hub
            .lookup_stream(stream)
            .ok_or_else(|| CompletenessError::UnknownStream(stream.into()))?;
        let (states, _) = self.device_states(hub, sid, now_ns())?;
        let devices: Vec<DeviceState> = states.into_iter().map(|(_, s, _)| s).collect();
        Ok(StreamSummary {
            stream: stream.into(),
            watermark_ns: watermark(&devices),
            complete_through_ns: devices.iter().map(|d| d.complete_through_ns).min(),
            active_devices: devices.iter().filter(|d| d.active).count() as u64,
            devices,
        })
    }

    /// Answers a completeness query for `[from, to]` (event time, ns).
    pub fn query(
        &self,
        hub: &Hub,
        stream: &str,
        from: i64,
        to: i64,
    ) -> Result<Answer, CompletenessError> {
        if from > to {
            return Err(CompletenessError::EmptyRange);
        }
        let sid = hub
            .lookup_stream(stream)
            .ok_or_else(|| CompletenessError::UnknownStream(stream.into()))?;
        let (states, retired) = self.device_states(hub, sid, now_ns())?;
        let heard_after = to.saturating_add(dur_ns(self.cfg.clock_skew));
        let mut owed = Vec::new();
        let mut gaps = Vec::new();
        for (id, d, records) in &states {
            if d.complete_through_ns < to {
                let heard = d.backlog_reported_at_ns.or(d.last_contact_ns);
                let reason = if heard.is_none_or(|h| h < heard_after) {
                    OwedReason::NotHeardSince
                } else {
                    OwedReason::Backlog
                };
                owed.push(Owed {
                    device: d.device.clone(),
                    reason,
                    last_contact_ns: d.last_contact_ns,
                    backlog_reported_at_ns: d.backlog_reported_at_ns,
                    records: records.flatten(),
                    blocks: d.backlog_blocks,
                    bytes: d.backlog_bytes,
                    oldest_unsent_ts: d.oldest_unsent_ts,
                });
            }
            gaps.extend(covering_gaps(hub, *id, &d.device, sid, from, to)?);
        }
        let status = if !owed.is_empty() {
            Status::Owed
        } else if !gaps.is_empty() {
            Status::CompleteWithGaps
        } else {
            Status::Complete
        };
        let devices: Vec<DeviceState> = states.into_iter().map(|(_, s, _)| s).collect();
        Ok(Answer {
            stream: stream.into(),
            from_ns: from,
            to_ns: to,
            status,
            heard_after_ns: heard_after,
            owed,
            gaps,
            watermark_ns: watermark(&devices),
            complete_through_ns: devices.iter().map(|d| d.complete_through_ns).min(),
            devices,
            retired,
        })
    }
}

/// Minimum over active devices of their maximum event time.
fn watermark(devices: &[DeviceState]) -> Option<i64> {
    devices
        .iter()
        .filter(|d| d.active)
        .filter_map(|d| d.max_event_ts)
        .min()
}

/// The gaps of one device in `stream` whose derived event-time span overlaps `[from, to]`.
fn covering_gaps(
    hub: &Hub,
    device: DeviceId,
    name: &str,
    sid: StreamId,
    from: i64,
    to: i64,
) -> Result<Vec<GapCover>, CompletenessError> {
    let gaps: Vec<_> = hub
        .catalog()
        .gaps_of(device)?
        .into_iter()
        .filter(|g| g.stream == sid)
        .collect();
    let mut out = Vec::new();
    for g in gaps {
        let (d, s, e) = (i64::from(device), i64::from(sid), g.epoch as i64);
        let (after, before) = hub.catalog().with_read_conn(|c| {
            let after: Option<i64> = c
                .query_row(
                    "SELECT max_ts FROM blocks WHERE device = ?1 AND stream = ?2 AND epoch = ?3
                     AND first_seq < ?4 ORDER BY first_seq DESC LIMIT 1",
                    params![d, s, e, g.first_seq as i64],
                    |r| r.get(0),
                )
                .optional()?;
            let before: Option<i64> = c
                .query_row(
                    "SELECT min_ts FROM blocks WHERE device = ?1 AND stream = ?2 AND epoch = ?3
                     AND first_seq > ?4 ORDER BY first_seq LIMIT 1",
                    params![d, s, e, g.last_seq as i64],
                    |r| r.get(0),
                )
                .optional()?;
            Ok::<_, rusqlite::Error>((after, before))
        })?;
        let overlaps = after.is_none_or(|a| a <= to) && before.is_none_or(|b| b >= from);
        if overlaps {
            out.push(GapCover {
                device: name.into(),
                epoch: g.epoch,
                first_seq: g.first_seq,
                last_seq: g.last_seq,
                records: g.last_seq - g.first_seq + 1,
                reason: g.reason,
                after_ts: after,
                before_ts: before,
            });
        }
    }
    Ok(out)
}

/// Retires (or un-retires) device `name`. Returns false when the hub has never seen it.
pub fn set_retired(hub: &Hub, name: &str, retired: bool) -> Result<bool, CatalogError> {
    let n = hub.catalog().with_write_conn(|c| {
        c.execute(
            "UPDATE devices SET retired = ?2 WHERE name = ?1",
            params![name, i64::from(retired)],
        )
    })?;
    Ok(n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse() {
        assert_eq!(
            parse_time("1764374400000000000").unwrap(),
            1_764_374_400_000_000_000
        );
        assert_eq!(
            parse_time("2025-11-29T00:00:00Z").unwrap(),
            1_764_374_400_000_000_000
        );
        assert_eq!(
            parse_time("2025-11-29T00:00:00.5Z").unwrap(),
            1_764_374_400_500_000_000
        );
        // The offset is honoured: 01:00 at +01:00 is midnight UTC.
        assert_eq!(
            parse_time("2025-11-29T01:00:00+01:00").unwrap(),
            1_764_374_400_000_000_000
        );
        assert_eq!(
            parse_time("2025-11-28T19:00:00.5-05:00").unwrap(),
            1_764_374_400_500_000_000
        );
        assert_eq!(
            parse_time("1764374400s").unwrap(),
            1_764_374_400_000_000_000
        );
        let before = parse_time("now").unwrap();
        let hour_ago = parse_time("-1h").unwrap();
        assert!(before - hour_ago >= 3_600_000_000_000 - 1_000_000_000);
        let e = parse_time("yesterday").unwrap_err();
        assert!(matches!(e, CompletenessError::BadTime(_)));
        assert!(e.to_string().contains("RFC 3339"), "{e}");
        let e = parse_time("2025-11-29T00:00:00").unwrap_err();
        assert!(e.to_string().contains("add Z for UTC"), "{e}");
        assert_eq!(
            format_time(1_764_374_400_000_000_000),
            "2025-11-29T00:00:00.000Z"
        );
    }

    #[test]
    fn hub_toml_sections() {
        let c = crate::HubConfig::from_toml(
            "data_dir = \"/d\"\n[completeness]\nclock_skew = \"2s\"\n\
             [republish]\nurl = \"mqtt://127.0.0.1:1883\"\nstreams = [\"t\"]\nqos = 1\n",
        )
        .unwrap();
        assert_eq!(c.completeness.clock_skew, Duration::from_secs(2));
        let r = c.republish.unwrap();
        assert_eq!((r.port, r.streams), (1883, vec!["t".to_string()]));
        let d = crate::HubConfig::from_toml("data_dir = \"/d\"").unwrap();
        assert_eq!(d.completeness, CompletenessConfig::default());
        assert!(d.republish.is_none());
        let err = crate::HubConfig::from_toml("data_dir = \"/d\"\n[completeness]\nskew = \"1s\"\n");
        assert!(err.is_err(), "unknown keys are refused");
    }

    #[test]
    fn config_parses() {
        let raw = RawCompleteness {
            clock_skew: Some("2s".into()),
            idle_timeout: None,
            offline_after: Some("soon".into()),
        };
        let err = raw.parse().unwrap_err().to_string();
        assert!(err.contains("completeness.offline_after"), "{err}");
        let raw = RawCompleteness {
            clock_skew: Some("2s".into()),
            ..RawCompleteness::default()
        };
        let c = raw.parse().unwrap();
        assert_eq!(c.clock_skew, Duration::from_secs(2));
        assert_eq!(c.idle_timeout, DEFAULT_IDLE_TIMEOUT);
    }
}
