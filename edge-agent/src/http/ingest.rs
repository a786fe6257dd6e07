//! The one front door for records entering the agent, and the HTTP body decoding in front of it.
//!
//! Every source (the HTTP API today; MQTT and the filter pipeline later) hands whole batches to
//! [`Ingest::ingest`], which appends them to the local log, waits for durability and counts the
//! outcome for `/metrics`. Keeping this in one place means a source can never forget to count,
//! and filters have exactly one place to hook in before sequencing.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use sync::Record;
use sync::parse::{ParseError, ParseOptions, parse_line_protocol, parse_ndjson_with};

use crate::log::{AppendAck, AppendError, LogHandle};
use crate::metrics::Metrics;

/// Appends batches to the log and counts them. Cheap to clone.
#[derive(Clone)]
pub struct Ingest {
    log: LogHandle,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Ingest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingest").finish_non_exhaustive()
    }
}

impl Ingest {
    pub fn new(log: LogHandle, metrics: Arc<Metrics>) -> Self {
        Ingest { log, metrics }
    }

    /// Appends `records` to `stream` as one atomic batch; resolves once they are durable.
    pub async fn ingest(
        &self,
        stream: &str,
        records: Vec<Record>,
    ) -> Result<AppendAck, AppendError> {
        let count = records.len() as u64;
        let result = self.log.append(stream, records).await;
        match &result {
            Ok(_) => self.metrics.appended(stream, count),
            Err(e) => self.metrics.append_failed(stream, e),
        }
        result
    }

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
        }
    }
}

impl BodyError {
    /// The 1-based line and column the error points at, when it points at one.
    pub fn position(&self) -> Option<(usize, usize)> {
        match self {
            BodyError::NotUtf8 { line } | BodyError::WrongMeasurement { line, .. } => {
                Some((*line, 1))
            }
            BodyError::Parse(e) => Some((e.line, e.column)),
            BodyError::Empty => None,
        }
    }
}

/// Decodes a request body for `stream`. Records without a timestamp get `default_ts`.
pub fn parse_body(
    format: BodyFormat,
    stream: &str,
    body: &[u8],
    default_ts: i64,
) -> Result<Vec<Record>, BodyError> {
    let text = std::str::from_utf8(body).map_err(|e| BodyError::NotUtf8 {
        line: 1 + body[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count(),
    })?;
    let opts = ParseOptions {
        default_ts: Some(default_ts),
    };
    let records = match format {
        BodyFormat::Ndjson => parse_ndjson_with(text, &opts).map_err(BodyError::Parse)?,
        BodyFormat::LineProtocol => {
            let lines = parse_line_protocol(text, &opts).map_err(BodyError::Parse)?;
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
    Ok(records)
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
        assert_eq!(recs[0].key, "a");
    }
}
