//! Counters the agent keeps itself, and the Prometheus text rendering of `/metrics`.
//!
//! Gauges (backlog, segments, seqs, disk usage) come from a fresh [`LogStatus`] snapshot on every
//! scrape, so they can never drift from the log. Only what the log does not count (appends and
//! records accepted per stream, refusals by reason, HTTP answers by status code) lives here, in
//! plain atomics fixed at start-up: the set of streams does not change while the agent runs.
//! Filter pipelines register their [`FilterStats`] (records in, out and dropped per stage;
//! missing fields, type mismatches and late records per stream). With the `prometheus` feature,
//! `tributary_edge_prometheus_dropped_total` counts the remote-write samples not stored
//! (staleness markers, native histograms, exemplars) per stream.
//! A `replicate = false` stream owes the hub nothing: it has no backlog and no replication lag,
//! so `tributary_edge_backlog_bytes`, `tributary_edge_backlog_blocks` and
//! `tributary_edge_oldest_unsent_age_seconds` carry no sample for it (an alert on them never
//! fires for it), and `tributary_edge_stream_replicated` is 0 for it, 1 for the others.
//! The text is rendered by hand: a few dozen lines, and it keeps the exporter stack (and its
//! HTTP listener and crypto defaults) out of the edge binary.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::filters::FilterStats;
use crate::log::{AppendError, LogStatus};

/// Why an append was refused, as the `reason` label of `tributary_edge_append_errors_total`.
const ERROR_REASONS: [&str; 6] = [
    "full",
    "poisoned",
    "storage",
    "too_large",
    "closed",
    "invalid",
];

/// HTTP status codes counted in `tributary_edge_http_requests_total`; anything else is `other`.
const HTTP_CODES: [u16; 10] = [200, 204, 400, 401, 404, 413, 415, 500, 503, 0];

/// What a Prometheus remote write held and the agent did not store, as the `reason` label of
/// `tributary_edge_prometheus_dropped_total`.
#[cfg(feature = "prometheus")]
const PROM_DROP_REASONS: [&str; 3] = ["stale", "histogram", "exemplar"];

/// The agent's own counters.
#[derive(Debug)]
pub struct Metrics {
    streams: HashMap<String, StreamCounters>,
    http: [AtomicU64; HTTP_CODES.len()],
    /// Each filtered stream's pipeline counters, registered when its pipeline is compiled.
    filters: std::sync::Mutex<Vec<(String, Arc<FilterStats>)>>,
    /// Streams kept on the device (`replicate = false`): no backlog, no lag.
    local: std::collections::HashSet<String>,
}

#[derive(Debug, Default)]
struct StreamCounters {
    appends: AtomicU64,
    records: AtomicU64,
    implausible_ts: AtomicU64,
    errors: [AtomicU64; ERROR_REASONS.len()],
    #[cfg(feature = "prometheus")]
    prom_dropped: [AtomicU64; PROM_DROP_REASONS.len()],
}

impl Metrics {
    /// Counters for the configured streams.
    pub fn new<'a>(streams: impl IntoIterator<Item = &'a str>) -> Self {
        Metrics {
            streams: streams
                .into_iter()
                .map(|s| (s.to_owned(), StreamCounters::default()))
                .collect(),
            http: Default::default(),
            filters: std::sync::Mutex::default(),
            local: Default::default(),
        }
    }

    /// Marks `streams` as kept on the device (`replicate = false`): they report no backlog and
    /// no replication lag, on `/metrics` and in the status report.
    pub fn with_local_streams<'a>(mut self, streams: impl IntoIterator<Item = &'a str>) -> Self {
        self.local = streams.into_iter().map(str::to_owned).collect();
        self
    }

    /// True for a stream kept on the device (`replicate = false`).
    pub fn is_local(&self, stream: &str) -> bool {
        self.local.contains(stream)
    }

    /// Shows `stats` on `/metrics` and `/v1/status` as the filter pipeline of `stream`.
    pub fn register_filter(&self, stream: &str, stats: Arc<FilterStats>) {
        let mut f = self.filters.lock().unwrap_or_else(|e| e.into_inner());
        f.retain(|(s, _)| s != stream);
        f.push((stream.to_owned(), stats));
        f.sort_by(|a, b| a.0.cmp(&b.0));
    }

    /// The registered pipelines' counters, by stream name.
    pub fn filter_reports(&self) -> Vec<FilterReport> {
        let f = self.filters.lock().unwrap_or_else(|e| e.into_inner());
        f.iter()
            .map(|(stream, st)| FilterReport {
                stream: stream.clone(),
                missing_fields: st.missing_fields.load(Ordering::Relaxed),
                type_mismatches: st.type_mismatches.load(Ordering::Relaxed),
                late_records: st.late_records.load(Ordering::Relaxed),
                consumed_seq: st.consumed_seq.load(Ordering::Relaxed),
                stages: st
                    .stages
                    .iter()
                    .enumerate()
                    .map(|(i, c)| StageReport {
                        stage: i,
                        kind: c.kind.to_owned(),
                        records_in: c.input.load(Ordering::Relaxed),
                        records_out: c.output.load(Ordering::Relaxed),
                        dropped: c.dropped(),
                    })
                    .collect(),
            })
            .collect()
    }

    fn render_filters(&self, m: &mut Writer<'_>) {
        let reports = self.filter_reports();
        type Get = fn(&StageReport) -> u64;
        let stage_families: [(&str, &str, Get); 3] = [
            (
                "tributary_edge_filter_stage_in_total",
                "Records into a filter stage.",
                |s| s.records_in,
            ),
            (
                "tributary_edge_filter_stage_out_total",
                "Records out of a filter stage.",
                |s| s.records_out,
            ),
            (
                "tributary_edge_filter_stage_dropped_total",
                "Records a filter stage took in and did not pass on (filtered, merged into a window or interval, or late).",
                |s| s.dropped,
            ),
        ];
        for (name, help, get) in stage_families {
            m.family(name, "counter", help);
            for r in &reports {
                for st in &r.stages {
                    m.sample(
                        name,
                        &[
                            ("stream", &r.stream),
                            ("stage", &st.stage.to_string()),
                            ("kind", &st.kind),
                        ],
                        get(st) as f64,
                    );
                }
            }
        }
        type GetR = fn(&FilterReport) -> u64;
        let families: [(&str, &str, GetR); 3] = [
            (
                "tributary_edge_filter_missing_fields_total",
                "Records missing a field a filter stage needs.",
                |r| r.missing_fields,
            ),
            (
                "tributary_edge_filter_type_mismatches_total",
                "Records whose field has a type a filter stage cannot use.",
                |r| r.type_mismatches,
            ),
            (
                "tributary_edge_filter_late_records_total",
                "Records older than their key's open window or interval, dropped.",
                |r| r.late_records,
            ),
        ];
        for (name, help, get) in families {
            m.family(name, "counter", help);
            for r in &reports {
                m.sample(name, &[("stream", &r.stream)], get(r) as f64);
            }
        }
        m.family(
            "tributary_edge_derived_consumed_seq",
            "gauge",
            "The source seq a derived stream's runner has consumed up to (compare with the source's durable seq).",
        );
        for r in &reports {
            m.sample(
                "tributary_edge_derived_consumed_seq",
                &[("stream", &r.stream)],
                r.consumed_seq as f64,
            );
        }
    }

    /// A batch of `records` was appended durably to `stream`.
    pub fn appended(&self, stream: &str, records: u64) {
        if let Some(c) = self.streams.get(stream) {
            c.appends.fetch_add(1, Ordering::Relaxed);
            c.records.fetch_add(records, Ordering::Relaxed);
        }
    }

    /// `records` of a batch appended to `stream` carried an implausible event time.
    pub fn implausible_ts(&self, stream: &str, records: u64) {
        if let Some(c) = self.streams.get(stream) {
            c.implausible_ts.fetch_add(records, Ordering::Relaxed);
        }
    }

    /// A batch for `stream` was refused.
    pub fn append_failed(&self, stream: &str, error: &AppendError) {
        let reason = match error {
            AppendError::Full { .. } => 0,
            AppendError::Poisoned(_) => 1,
            AppendError::Storage(_) => 2,
            AppendError::RecordTooLarge { .. }
            | AppendError::TooManyFields { .. }
            | AppendError::Unsealable { .. } => 3,
            AppendError::Closed => 4,
            AppendError::UnknownStream(_)
            | AppendError::EmptyBatch
            | AppendError::BadKey { .. } => 5,
        };
        if let Some(c) = self.streams.get(stream) {
            c.errors[reason].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A Prometheus remote write to `stream` held samples that were not stored.
    #[cfg(feature = "prometheus")]
    pub fn prom_dropped(&self, stream: &str, dropped: crate::http::prom_write::Dropped) {
        let Some(c) = self.streams.get(stream) else {
            return;
        };
        let counts = [dropped.stale, dropped.histograms, dropped.exemplars];
        for (counter, n) in c.prom_dropped.iter().zip(counts) {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The HTTP API answered with `code`.
    pub fn http_answered(&self, code: u16) {
        let i = HTTP_CODES
            .iter()
            .position(|c| *c == code)
            .unwrap_or(HTTP_CODES.len() - 1);
        self.http[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Appends and records accepted for `stream` so far.
    pub fn appends(&self, stream: &str) -> (u64, u64) {
        self.streams.get(stream).map_or((0, 0), |c| {
            (
                c.appends.load(Ordering::Relaxed),
                c.records.load(Ordering::Relaxed),
            )
        })
    }

    /// Renders the Prometheus text exposition format (version 0.0.4).
    pub fn render(&self, status: &LogStatus, limits: &Limits, now_ns: i64) -> String {
        let mut out = String::with_capacity(4096);
        let mut m = Writer { out: &mut out };
        m.family(
            "tributary_edge_info",
            "gauge",
            "Constant 1, labelled with the current epoch (hex).",
        );
        m.sample(
            "tributary_edge_info",
            &[("epoch", &format!("{:016x}", status.epoch))],
            1.0,
        );
        m.single(
            "tributary_edge_disk_bytes",
            "gauge",
            "Bytes in segment files.",
            status.disk_bytes as f64,
        );
        m.single(
            "tributary_edge_disk_bytes_max",
            "gauge",
            "The disk budget (storage.disk_bytes_max).",
            limits.disk_bytes_max as f64,
        );
        m.single(
            "tributary_edge_poisoned",
            "gauge",
            "1 when the log refuses writes after a storage failure (restart to re-verify).",
            if status.poisoned.is_some() { 1.0 } else { 0.0 },
        );
        self.render_streams(&mut m, status, now_ns);
        self.render_counters(&mut m);
        self.render_filters(&mut m);
        out
    }

    fn render_streams(&self, m: &mut Writer<'_>, status: &LogStatus, now_ns: i64) {
        type Get = fn(&crate::log::StreamStatus, i64) -> f64;
        // Families about what the hub is owed: no sample for a local stream.
        const OWED: [&str; 3] = [
            "tributary_edge_backlog_bytes",
            "tributary_edge_backlog_blocks",
            "tributary_edge_oldest_unsent_age_seconds",
        ];
        let families: [(&str, &str, &str, Get); 11] = [
            (
                "tributary_edge_backlog_bytes",
                "gauge",
                "Durable bytes not yet acknowledged by the hub.",
                |s, _| s.backlog_bytes as f64,
            ),
            (
                "tributary_edge_backlog_blocks",
                "gauge",
                "Durable blocks not yet acknowledged by the hub.",
                |s, _| s.backlog_blocks as f64,
            ),
            (
                "tributary_edge_segments",
                "gauge",
                "Segment files held.",
                |s, _| s.segments as f64,
            ),
            (
                "tributary_edge_next_seq",
                "gauge",
                "The seq the next record will get (current epoch).",
                |s, _| s.next_seq as f64,
            ),
            (
                "tributary_edge_durable_seq",
                "gauge",
                "The last seq fsynced locally (current epoch).",
                |s, _| s.durable_seq as f64,
            ),
            (
                "tributary_edge_acked_seq",
                "gauge",
                "The last seq the hub acknowledged as durable (current epoch).",
                |s, _| s.acked_durable as f64,
            ),
            (
                "tributary_edge_tiered_seq",
                "gauge",
                "The last seq the hub reported tiered (current epoch).",
                |s, _| s.acked_tiered as f64,
            ),
            (
                "tributary_edge_oldest_unsent_age_seconds",
                "gauge",
                "Now minus the event time of the oldest unacknowledged record; 0 when none.",
                |s, now| oldest_unsent_age_s(s.oldest_unsent_ts, now).unwrap_or(0.0),
            ),
            (
                "tributary_edge_dropped_records_total",
                "counter",
                "Records dropped by the disk budget (drop-oldest), recorded as gap markers.",
                |s, _| s.dropped_records as f64,
            ),
            (
                "tributary_edge_dropped_blocks_total",
                "counter",
                "Blocks dropped by the disk budget (drop-oldest).",
                |s, _| s.dropped_blocks as f64,
            ),
            (
                "tributary_edge_quarantined_blocks_total",
                "counter",
                "Corrupt blocks moved to quarantine at recovery.",
                |s, _| s.quarantined_blocks as f64,
            ),
        ];
        for (name, kind, help, get) in families {
            m.family(name, kind, help);
            for s in &status.streams {
                if OWED.contains(&name) && self.is_local(&s.stream) {
                    continue;
                }
                m.sample(name, &[("stream", &s.stream)], get(s, now_ns));
            }
        }
        let name = "tributary_edge_stream_replicated";
        m.family(
            name,
            "gauge",
            "1 for a stream replicated to the hub, 0 for one kept on the device (replicate = false).",
        );
        for s in &status.streams {
            let replicated = if self.is_local(&s.stream) { 0.0 } else { 1.0 };
            m.sample(name, &[("stream", &s.stream)], replicated);
        }
    }

    fn render_counters(&self, m: &mut Writer<'_>) {
        let mut names: Vec<&String> = self.streams.keys().collect();
        names.sort();
        m.family(
            "tributary_edge_appends_total",
            "counter",
            "Batches appended durably.",
        );
        for s in &names {
            m.sample(
                "tributary_edge_appends_total",
                &[("stream", s)],
                self.streams[*s].appends.load(Ordering::Relaxed) as f64,
            );
        }
        m.family(
            "tributary_edge_records_total",
            "counter",
            "Records appended durably.",
        );
        for s in &names {
            m.sample(
                "tributary_edge_records_total",
                &[("stream", s)],
                self.streams[*s].records.load(Ordering::Relaxed) as f64,
            );
        }
        m.family(
            "tributary_edge_implausible_ts_records_total",
            "counter",
            "Records stored with an implausible event time: before 2000-01-01, or more than a day ahead of the clock (or of the build time, when the clock is behind it). Stored as given.",
        );
        for s in &names {
            m.sample(
                "tributary_edge_implausible_ts_records_total",
                &[("stream", s)],
                self.streams[*s].implausible_ts.load(Ordering::Relaxed) as f64,
            );
        }
        m.family(
            "tributary_edge_append_errors_total",
            "counter",
            "Batches refused by the log, by reason.",
        );
        for s in &names {
            for (i, reason) in ERROR_REASONS.iter().enumerate() {
                let v = self.streams[*s].errors[i].load(Ordering::Relaxed) as f64;
                m.sample(
                    "tributary_edge_append_errors_total",
                    &[("stream", s), ("reason", reason)],
                    v,
                );
            }
        }
        #[cfg(feature = "prometheus")]
        self.render_prom_dropped(m, &names);
        m.family(
            "tributary_edge_http_requests_total",
            "counter",
            "HTTP API answers by status code.",
        );
        for (i, code) in HTTP_CODES.iter().enumerate() {
            let label = if *code == 0 {
                "other".to_owned()
            } else {
                code.to_string()
            };
            m.sample(
                "tributary_edge_http_requests_total",
                &[("code", &label)],
                self.http[i].load(Ordering::Relaxed) as f64,
            );
        }
    }

    #[cfg(feature = "prometheus")]
    fn render_prom_dropped(&self, m: &mut Writer<'_>, names: &[&String]) {
        let name = "tributary_edge_prometheus_dropped_total";
        m.family(
            name,
            "counter",
            "Prometheus remote-write samples not stored: staleness markers, native histograms, exemplars.",
        );
        for s in names {
            for (i, reason) in PROM_DROP_REASONS.iter().enumerate() {
                let v = self.streams[*s].prom_dropped[i].load(Ordering::Relaxed) as f64;
                m.sample(name, &[("stream", s), ("reason", reason)], v);
            }
        }
    }
}

/// One stream's filter pipeline counters, as `/v1/status` reports them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilterReport {
    pub stream: String,
    pub missing_fields: u64,
    pub type_mismatches: u64,
    pub late_records: u64,
    /// For a derived stream: the source seq its runner has consumed up to (0 otherwise).
    pub consumed_seq: u64,
    pub stages: Vec<StageReport>,
}

/// One stage's counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReport {
    pub stage: usize,
    pub kind: String,
    pub records_in: u64,
    pub records_out: u64,
    pub dropped: u64,
}

/// Configured limits shown next to the log's state.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub disk_bytes_max: u64,
}

/// Seconds between an event time and now, never negative.
pub fn oldest_unsent_age_s(oldest_ts: Option<i64>, now_ns: i64) -> Option<f64> {
    oldest_ts.map(|ts| (now_ns.saturating_sub(ts)).max(0) as f64 / 1e9)
}

/// Writes samples in the text format.
struct Writer<'a> {
    out: &'a mut String,
}

impl Writer<'_> {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn single(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

/// Label values escape backslash, double quote and newline.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::StreamStatus;

    fn stream(name: &str) -> StreamStatus {
        StreamStatus {
            stream: name.into(),
            epoch: 7,
            next_seq: 11,
            durable_seq: 10,
            acked_durable: 4,
            acked_tiered: 2,
            backlog_bytes: 1234,
            backlog_blocks: 3,
            segments: 1,
            oldest_unsent_ts: Some(1_000_000_000),
            dropped_records: 5,
            dropped_blocks: 1,
            dropped_gaps: 1,
            quarantined_blocks: 0,
        }
    }

    #[test]
    fn renders_every_family_with_help_and_type() {
        let m = Metrics::new(["telemetry"]);
        m.appended("telemetry", 10);
        m.append_failed(
            "telemetry",
            &AppendError::Full {
                retry_after: std::time::Duration::from_secs(1),
            },
        );
        m.http_answered(200);
        m.http_answered(418);
        let status = LogStatus {
            epoch: 7,
            streams: vec![stream("telemetry")],
            disk_bytes: 99,
            poisoned: None,
        };
        let text = m.render(
            &status,
            &Limits {
                disk_bytes_max: 1000,
            },
            3_500_000_000,
        );
        for line in [
            "tributary_edge_backlog_bytes{stream=\"telemetry\"} 1234",
            "tributary_edge_oldest_unsent_age_seconds{stream=\"telemetry\"} 2.5",
            "tributary_edge_acked_seq{stream=\"telemetry\"} 4",
            "tributary_edge_dropped_records_total{stream=\"telemetry\"} 5",
            "tributary_edge_disk_bytes 99",
            "tributary_edge_records_total{stream=\"telemetry\"} 10",
            "tributary_edge_append_errors_total{stream=\"telemetry\",reason=\"full\"} 1",
            "tributary_edge_http_requests_total{code=\"other\"} 1",
            "tributary_edge_info{epoch=\"0000000000000007\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Every sample's family was announced with HELP and TYPE before it.
        let mut announced = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                announced.insert(rest.split(' ').next().unwrap().to_owned());
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                assert!(announced.contains(name), "{name} has no TYPE line");
            }
        }
    }

    #[test]
    fn a_local_stream_has_no_backlog_or_lag_samples() {
        let m = Metrics::new(["telemetry", "raw"]).with_local_streams(["raw"]);
        let status = LogStatus {
            epoch: 7,
            streams: vec![stream("telemetry"), stream("raw")],
            disk_bytes: 99,
            poisoned: None,
        };
        let limits = Limits {
            disk_bytes_max: 1000,
        };
        let text = m.render(&status, &limits, 3_500_000_000);
        let has = |line: &str| text.lines().any(|l| l == line);
        for owed in [
            "tributary_edge_backlog_bytes",
            "tributary_edge_backlog_blocks",
            "tributary_edge_oldest_unsent_age_seconds",
        ] {
            assert!(
                !text
                    .lines()
                    .any(|l| l.starts_with(&format!("{owed}{{stream=\"raw\"}}"))),
                "{owed} sampled for a local stream:\n{text}"
            );
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("{owed}{{stream=\"telemetry\"}}"))),
                "{owed} missing for the replicated stream:\n{text}"
            );
        }
        assert!(
            has("tributary_edge_stream_replicated{stream=\"raw\"} 0"),
            "{text}"
        );
        assert!(
            has("tributary_edge_stream_replicated{stream=\"telemetry\"} 1"),
            "{text}"
        );
        // What the local stream holds is still shown.
        assert!(has("tributary_edge_segments{stream=\"raw\"} 1"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
