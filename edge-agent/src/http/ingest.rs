//! The one front door for records entering the agent, and the HTTP body decoding in front of it.
//!
//! Every source (the HTTP API, MQTT, the sensor sources) hands whole batches to
//! [`Ingest::ingest`], which runs the stream's filter pipeline (when it has `filters`), appends
//! what comes out to the local log, waits for durability and counts the outcome for `/metrics`.
//! Keeping this in one place means a source can never forget to count or to filter.
//!
//! A plain stream's pipeline runs here, under a mutex, before sequencing. Its window and
//! interval state lives in memory only: a restart loses open windows, and when producers race,
//! their batches may be stored in another order than the pipeline saw them. For exactly-once
//! windows, filter in a derived stream instead (`crate::filters::derive`), which reads its
//! input back from the log.
//!
//! # Idempotency keys
//!
//! A batch sent with an `Idempotency-Key` carries its key in its own last record, so the key is
//! durable in the same fsync as the batch; `data_dir/idempotency.db` is a cache rebuilt from the
//! log. See `super::idempotency`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use sync::Record;
use sync::parse::{ParseError, ParseOptions, parse_line_protocol, parse_ndjson_with};
use sync::time::TimeUnit;

use crate::config::StreamConfig;
use crate::filters::Pipeline;
use crate::log::{AppendAck, AppendError, LogHandle};
use crate::metrics::Metrics;

pub use super::idempotency::{
    BatchAnswer, IDEMPOTENCY_KEY_BYTES_MAX, IDEMPOTENCY_KEYS_MAX, IDEMPOTENCY_RETENTION,
    IdempotencyError, IdempotentStart, KeyClaim, body_digest,
};
use super::idempotency::{KEY_FIELD, KeyStore, strip_key_fields};

/// Appends batches to the log and counts them. Cheap to clone.
#[derive(Clone)]
pub struct Ingest {
    log: LogHandle,
    metrics: Arc<Metrics>,
    pub(super) keys: Arc<KeyStore>,
    /// Pipelines of plain streams with `filters`.
    pipelines: Arc<HashMap<String, Mutex<Pipeline>>>,
    /// Derived streams and their source: they take no records from here.
    derived: Arc<HashMap<String, String>>,
}

/// The number of records an [`AppendAck`] covers (0 for a batch filtered out entirely).
pub fn stored_count(ack: &AppendAck) -> u64 {
    if ack.first_seq == 0 {
        0
    } else {
        ack.last_seq + 1 - ack.first_seq
    }
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest").finish_non_exhaustive()
    }
}

impl Ingest {
    pub fn new(log: LogHandle, metrics: Arc<Metrics>) -> Self {
        let keys = Arc::new(KeyStore::new(
            log.config().data_dir.join("idempotency.db"),
            &log.config().streams,
        ));
        Ingest {
            log,
            metrics,
            keys,
            pipelines: Arc::default(),
            derived: Arc::default(),
        }
    }

    /// As [`Ingest::new`], running the `filters` of plain streams before sequencing and refusing
    /// derived streams. The config was validated, so every pipeline compiles; one that does not
    /// (a bug) is left out with an error logged rather than taking the agent down.
    pub fn with_streams(log: LogHandle, metrics: Arc<Metrics>, streams: &[StreamConfig]) -> Self {
        let mut ingest = Ingest::new(log, metrics);
        let mut pipelines = HashMap::new();
        let mut derived = HashMap::new();
        for s in streams {
            if let Some(src) = &s.source_stream {
                derived.insert(s.name.clone(), src.clone());
                continue;
            }
            if s.filters.is_empty() {
                continue;
            }
            match Pipeline::compile(&s.filters).map(|p| p.with_idle_close(s.idle_close)) {
                Ok(p) => {
                    ingest.metrics.register_filter(&s.name, p.stats().clone());
                    pipelines.insert(s.name.clone(), Mutex::new(p));
                }
                Err(e) => tracing::error!(stream = %s.name, error = %e, "filters not compiled"),
            }
        }
        ingest.pipelines = Arc::new(pipelines);
        ingest.derived = Arc::new(derived);
        ingest
    }

    /// How producers' bodies and payloads are parsed: records without a timestamp get
    /// `default_ts`, and none may carry more than `ingest.fields_per_record_max` fields.
    pub fn parse_options(&self, default_ts: i64) -> ParseOptions {
        ParseOptions {
            default_ts: Some(default_ts),
            fields_max: self.log.config().fields_per_record_max,
            ..ParseOptions::default()
        }
    }

    /// How an HTTP request's body is parsed, from its query string: `precision=ns|us|ms|s`
    /// gives the unit of integer timestamps (nanoseconds by default, as in Influx's write
    /// API), and an integer implausible in that unit but plausible in another is refused
    /// naming the likely unit. `now` is the receive time. Unknown parameters are ignored, as
    /// Influx clients send their own (`db`, `org`, `bucket`).
    pub fn request_options(&self, query: Option<&str>, now: i64) -> Result<ParseOptions, String> {
        let mut opts = self.parse_options(now);
        opts.plausible_at = Some(now);
        opts.ts_unit = request_precision(query)?;
        Ok(opts)
    }

    /// The source of `stream` when it is a derived stream.
    pub fn derived_from(&self, stream: &str) -> Option<&str> {
        self.derived.get(stream).map(String::as_str)
    }

    /// Runs `stream`'s filters over `records`, then appends what comes out as one atomic batch;
    /// resolves once it is durable. When the filters drop everything, nothing is appended and
    /// the ack has `first_seq == last_seq == 0`. The reserved key field (`_idempotency`) is
    /// removed from records of plain streams first: only a keyed request may write one.
    pub async fn ingest(
        &self,
        stream: &str,
        mut records: Vec<Record>,
    ) -> Result<AppendAck, AppendError> {
        if !self.derived.contains_key(stream) {
            strip_key_fields(&mut records);
        }
        let records = self.run_filters(stream, records);
        if records.is_empty() {
            return Ok(self.filtered_out_ack(stream));
        }
        self.append_counted(stream, records).await
    }

    /// Closes the intervals of quiet keys in every plain stream's pipeline
    /// (`crate::filters::idle`) and appends what they emit. `Err(Closed)` once the log is
    /// shut down; another failure is logged, and those outputs are lost like any open window
    /// of a plain stream at a restart.
    pub async fn close_idle_intervals(&self) -> Result<(), AppendError> {
        for (stream, p) in self.pipelines.iter() {
            let out = p.lock().unwrap_or_else(|e| e.into_inner()).close_idle();
            if out.is_empty() {
                continue;
            }
            match self.append_counted(stream, out).await {
                Ok(_) => {}
                Err(AppendError::Closed) => return Err(AppendError::Closed),
                Err(e) => {
                    tracing::warn!(%stream, error = %e, "filters: idle intervals could not be stored")
                }
            }
        }
        Ok(())
    }

    /// `records` after `stream`'s filters (unchanged for a stream without them).
    pub(super) fn run_filters(&self, stream: &str, records: Vec<Record>) -> Vec<Record> {
        match self.pipelines.get(stream) {
            Some(p) if !records.is_empty() => {
                p.lock().unwrap_or_else(|e| e.into_inner()).run(records)
            }
            _ => records,
        }
    }

    /// The ack of a batch the filters reduced to nothing.
    pub(super) fn filtered_out_ack(&self, stream: &str) -> AppendAck {
        AppendAck {
            stream: stream.to_owned(),
            epoch: self.log.epoch(),
            first_seq: 0,
            last_seq: 0,
        }
    }

    /// Appends `records` as one batch and counts the outcome for `/metrics`.
    pub(super) async fn append_counted(
        &self,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<AppendAck, AppendError> {
        let count = records.len() as u64;
        let implausible = records
            .iter()
            .filter(|r| implausible_ts(r.ts, now_ns()))
            .count() as u64;
        let result = self.log.append(stream, records).await;
        match &result {
            Ok(_) => {
                self.metrics.appended(stream, count);
                if implausible > 0 {
                    self.metrics.implausible_ts(stream, implausible);
                }
            }
            Err(e) => self.metrics.append_failed(stream, e),
        }
        result
    }

    /// The log records are appended to.
    pub fn log(&self) -> &LogHandle {
        &self.log
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// How a request body encodes records, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFormat {
    /// `application/x-ndjson`, `application/json`, `application/jsonl`.
    Ndjson,
    /// `text/plain`: InfluxDB line protocol, as Telegraf sends it.
    LineProtocol,
}

/// The content types the ingest endpoint accepts, for error messages.
pub const ACCEPTED_CONTENT_TYPES: &str =
    "application/x-ndjson or application/json (NDJSON), text/plain (line protocol)";

impl BodyFormat {
    /// Maps a `Content-Type` header (parameters such as `charset` ignored).
    pub fn from_content_type(value: &str) -> Option<Self> {
        let media = value
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match media.as_str() {
            "application/x-ndjson"
            | "application/json"
            | "application/jsonl"
            | "application/ndjson" => Some(BodyFormat::Ndjson),
            "text/plain" => Some(BodyFormat::LineProtocol),
            _ => None,
        }
    }
}

/// Why a body could not be turned into records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// Not UTF-8: names the line holding the first bad byte.
    NotUtf8 {
        line: usize,
    },
    Parse(ParseError),
    /// A line-protocol record written to another measurement than the URL's stream.
    WrongMeasurement {
        line: usize,
        measurement: String,
        stream: String,
    },
    /// Only blank or comment lines.
    Empty,
    /// A record carries a field name the agent reserves (starting with `_`: `_idempotency`
    /// could forge a key, `_topic` steer the hub's MQTT republish).
    ReservedField {
        line: usize,
        field: String,
    },
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::NotUtf8 { line } => write!(f, "line {line}: the body is not valid UTF-8"),
            BodyError::Parse(e) => write!(f, "{e}"),
            BodyError::WrongMeasurement {
                line,
                measurement,
                stream,
            } => write!(
                f,
                "line {line}: measurement {measurement:?} does not match the stream {stream:?} \
                 in the URL: post it to /v1/streams/{measurement}/records"
            ),
            BodyError::Empty => write!(f, "the body holds no records"),
            BodyError::ReservedField { line, field } if field == KEY_FIELD => write!(
                f,
                "line {line}: the field {field:?} is reserved by the agent for idempotency keys \
                 (send the key in the Idempotency-Key header): rename the field"
            ),
            BodyError::ReservedField { line, field } => write!(
                f,
                "line {line}: the field {field:?} is reserved: names starting with '_' are set \
                 only by the agent's own sources: rename the field"
            ),
        }
    }
}

impl BodyError {
    /// The 1-based line and column the error points at, when it points at one.
    pub fn position(&self) -> Option<(usize, usize)> {
        match self {
            BodyError::NotUtf8 { line }
            | BodyError::WrongMeasurement { line, .. }
            | BodyError::ReservedField { line, .. } => Some((*line, 1)),
            BodyError::Parse(e) => Some((e.line, e.column)),
            BodyError::Empty => None,
        }
    }
}

/// Decodes a request body for `stream` under the default field limit. Records without a
/// timestamp get `default_ts`.
pub fn parse_body(
    format: BodyFormat,
    stream: &str,
    body: &[u8],
    default_ts: i64,
) -> Result<Vec<Record>, BodyError> {
    let opts = ParseOptions {
        default_ts: Some(default_ts),
        fields_max: crate::log::FIELDS_PER_RECORD_DEFAULT,
        ..ParseOptions::default()
    };
    parse_body_with(format, stream, body, &opts)
}

/// Decodes a request body for `stream`: all of it or nothing. A record over
/// `opts.fields_max` fields stops the parse there; a field name starting with `_` (reserved for
/// the agent's own sources, see [`RESERVED_PREFIX`]) refuses the body.
pub fn parse_body_with(
    format: BodyFormat,
    stream: &str,
    body: &[u8],
    opts: &ParseOptions,
) -> Result<Vec<Record>, BodyError> {
    let text = std::str::from_utf8(body).map_err(|e| BodyError::NotUtf8 {
        line: 1 + body[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count(),
    })?;
    let records = match format {
        BodyFormat::Ndjson => parse_ndjson_with(text, opts).map_err(BodyError::Parse)?,
        BodyFormat::LineProtocol => {
            let lines = parse_line_protocol(text, opts).map_err(BodyError::Parse)?;
            if let Some(bad) = lines.iter().find(|l| l.measurement != stream) {
                let line = measurement_line(text, &bad.measurement).unwrap_or(1);
                return Err(BodyError::WrongMeasurement {
                    line,
                    measurement: bad.measurement.clone(),
                    stream: stream.to_owned(),
                });
            }
            lines.into_iter().map(|l| l.record).collect()
        }
    };
    if records.is_empty() {
        return Err(BodyError::Empty);
    }
    if let Some((i, field)) = first_reserved(&records) {
        return Err(BodyError::ReservedField {
            line: record_line(text, i),
            field: field.to_owned(),
        });
    }
    Ok(records)
}

/// Field names starting with this are reserved for the agent's own sources (`_topic` and
/// `_mqtt_digest` from MQTT, `_idempotency` from a keyed request): producers cannot set them.
pub const RESERVED_PREFIX: char = '_';

/// The first record, and its field, whose name is reserved.
pub fn first_reserved(records: &[Record]) -> Option<(usize, &str)> {
    records.iter().enumerate().find_map(|(i, r)| {
        r.fields
            .iter()
            .find(|(n, _)| n.starts_with(RESERVED_PREFIX))
            .map(|(n, _)| (i, n.as_str()))
    })
}

/// The 1-based line of the `index`-th record: both formats hold one record per line that is
/// neither blank nor a `#` comment.
fn record_line(text: &str, index: usize) -> usize {
    text.lines()
        .enumerate()
        .filter(|(_, l)| {
            let l = l.trim();
            !l.is_empty() && !l.starts_with('#')
        })
        .nth(index)
        .map_or(1, |(i, _)| i + 1)
}

/// The 1-based number of the first line written to `measurement`, for error messages.
fn measurement_line(text: &str, measurement: &str) -> Option<usize> {
    text.lines()
        .position(|line| {
            let line = line.trim_start();
            !line.starts_with('#')
                && line
                    .strip_prefix(measurement)
                    .is_some_and(|rest| rest.starts_with([',', ' ']))
        })
        .map(|i| i + 1)
}

/// Now, in nanoseconds since the Unix epoch: the timestamp of records sent without one.
pub fn now_ns() -> i64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// The `precision` of a request's query string: the unit of its integer timestamps.
pub fn request_precision(query: Option<&str>) -> Result<TimeUnit, String> {
    let value = query
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == "precision")
        .map(|(_, v)| v)
        .next_back();
    match value {
        None => Ok(TimeUnit::Ns),
        Some(v) => TimeUnit::parse(v).map_err(|e| format!("query parameter precision: {e}")),
    }
}

/// Event time is stored as given; sequence order, never time, decides order and dedupe. A time
/// outside the plausible window ([`sync::time::plausible`]: before 2000-01-01 or more than a
/// day ahead of the clock) is counted on `/metrics` so that a device with a bad clock is
/// visible; honest backfill of old data is not. A clock behind the build time is itself
/// wrong (a board without an RTC boots at 1970), so the future is judged from the later of
/// the two; the build time is never a lower bound for event times.
pub fn implausible_ts(ts: i64, now_ns: i64) -> bool {
    let built_ns = crate::link::BUILD_UNIX
        .parse::<i64>()
        .unwrap_or(0)
        .saturating_mul(1_000_000_000);
    !sync::time::plausible(ts, now_ns.max(built_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types() {
        let cases = [
            ("application/x-ndjson", Some(BodyFormat::Ndjson)),
            ("application/json; charset=utf-8", Some(BodyFormat::Ndjson)),
            ("Application/X-NDJSON", Some(BodyFormat::Ndjson)),
            ("text/plain; charset=utf-8", Some(BodyFormat::LineProtocol)),
            ("text/csv", None),
            ("", None),
        ];
        for (ct, want) in cases {
            assert_eq!(BodyFormat::from_content_type(ct), want, "{ct}");
        }
    }

    #[test]
    fn bodies() {
        let ok = br#"{"key":"a","ts":1,"fields":{"x":1}}"#;
        assert_eq!(parse_body(BodyFormat::Ndjson, "s", ok, 0).unwrap().len(), 1);
        let no_ts = br#"{"key":"a","fields":{"x":1}}"#;
        assert_eq!(
            parse_body(BodyFormat::Ndjson, "s", no_ts, 42).unwrap()[0].ts,
            42
        );
        assert_eq!(
            parse_body(BodyFormat::Ndjson, "s", b"\n\n", 0),
            Err(BodyError::Empty)
        );
        let bad = parse_body(BodyFormat::Ndjson, "s", b"{\"key\":\"a\"}\n{", 0).unwrap_err();
        assert!(bad.position().is_some());
        let not_utf8 = parse_body(BodyFormat::Ndjson, "s", b"{}\n\xff", 0).unwrap_err();
        assert_eq!(not_utf8, BodyError::NotUtf8 { line: 2 });
        let lp = b"# c\ns,dev=a x=1 5\nother,dev=b x=2 6\n";
        let e = parse_body(BodyFormat::LineProtocol, "s", lp, 0).unwrap_err();
        assert_eq!(e.position(), Some((3, 1)), "{e}");
        let recs = parse_body(BodyFormat::LineProtocol, "s", b"s,dev=a x=1 5\n", 0).unwrap();
        assert_eq!(recs[0].key, "dev=a");
        assert_eq!(recs[0].tag("dev"), Some("a"));
    }

    #[test]
    fn precision_from_the_query_string() {
        assert_eq!(request_precision(None), Ok(TimeUnit::Ns));
        assert_eq!(
            request_precision(Some("db=x&precision=ms")),
            Ok(TimeUnit::Ms)
        );
        assert_eq!(request_precision(Some("precision=s")), Ok(TimeUnit::S));
        let e = request_precision(Some("precision=h")).unwrap_err();
        assert!(
            e.contains("precision") && e.contains("ns, us, ms or s"),
            "{e}"
        );
    }

    #[test]
    fn implausible_is_a_window_not_the_build_date() {
        let now = 1_764_590_400_000_000_000;
        // Backfill from 2001 is honest, whenever the binary was built.
        assert!(!implausible_ts(1_000_000_000_000_000_000, now));
        assert!(
            implausible_ts(1_764_590_400_000, now),
            "ms read as ns: 1970"
        );
        let far = now.max(1_000_000_000 * crate::link::BUILD_UNIX.parse::<i64>().unwrap());
        assert!(implausible_ts(far + 2 * 86_400_000_000_000, now));
        // A clock at 1970 does not make today's event times implausible.
        assert!(!implausible_ts(far, 86_400_000_000_000));
    }
}
