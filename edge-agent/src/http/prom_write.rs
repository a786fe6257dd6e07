//! Prometheus remote write (protocol 1.0): the body of `POST /api/v1/write`, decoded and mapped
//! to records. Prometheus, Grafana Alloy and the OpenTelemetry Collector send it.
//!
//! A body is a `prometheus.WriteRequest` protobuf (`Content-Type: application/x-protobuf`)
//! compressed with snappy's *block* format (`Content-Encoding: snappy`, not the framed stream
//! format). The messages are derived here by hand with prost (four small messages, no build
//! script); fields this receiver does not read (metadata, and the newer fields of a series)
//! are skipped by prost, and exemplars and native histograms are decoded only as far as
//! counting them.
//!
//! # Mapping
//!
//! The one Telegraf's `prometheusremotewrite` parser uses: one record per sample, whose
//! - field is the metric name (the `__name__` label), an `F64` holding the sample value;
//! - tags are every other label, name to value, in the order the series sent them (a label
//!   with an empty value is left out: Prometheus treats it as absent);
//! - key is [`sync::record::key_from_tags`] of those tags, or the metric name for a series
//!   with no other label;
//! - ts is the sample's milliseconds times 1,000,000 (nanoseconds).
//!
//! Staleness markers (the NaN with bits [`STALE_NAN_BITS`], written when a series disappears)
//! are dropped and counted, like exemplars and native histograms: they are not measurements.
//! Every other NaN and ±Inf is stored as it came (the record model keeps f64 bits exactly; the
//! hub's JSON shows a non-finite value as `null`).
//!
//! # Bounds and refusals
//!
//! The decompressed length is read from the snappy header and checked against the body cap
//! (`http.body_bytes_max`) before anything is allocated ([`WriteError::TooLarge`], 413). A
//! body that is not snappy or not a `WriteRequest`, a series without a metric name, with a
//! label name twice, with tags a record cannot hold (more than
//! [`sync::record::TAGS_PER_RECORD_MAX`], a NUL) or a metric name the agent reserves (starting
//! with `_`), and a timestamp out of range in nanoseconds are refused whole with 400, naming
//! the series: Prometheus does not retry a 4xx, so a batch it cannot fix is not sent again.
//!
//! A request with an `Idempotency-Key` goes through the records route's keyed path
//! (`super::idempotency`), its digest taken over the compressed body as sent.

use std::collections::HashMap;

use sync::Record;
use sync::record::Value;
use thiserror::Error;

/// The route's path, where Prometheus's own receiver has it.
pub const PATH: &str = "/api/v1/write";
/// The stream written to when the request has no `?stream=`.
pub const DEFAULT_STREAM: &str = "prometheus";
/// The media type of a remote-write body.
pub const CONTENT_TYPE: &str = "application/x-protobuf";
/// The `proto` parameter of the content type that names protocol 1.0's message.
const PROTO_V1: &str = "prometheus.WriteRequest";
/// The `Content-Encoding` of a remote-write body (snappy block format).
pub const ENCODING: &str = "snappy";
/// The bits of the NaN Prometheus writes as a staleness marker (`value.StaleNaN`).
pub const STALE_NAN_BITS: u64 = 0x7ff0_0000_0000_0002;
/// The label holding the metric name.
const NAME_LABEL: &str = "__name__";

/// `prometheus.WriteRequest`: the series of one batch (field 3, metadata, is skipped).
#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRequest {
    #[prost(message, repeated, tag = "1")]
    pub timeseries: Vec<TimeSeries>,
}

/// `prometheus.TimeSeries`: one label set and its samples.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TimeSeries {
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<Label>,
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<Sample>,
    /// Decoded only to be counted as dropped.
    #[prost(message, repeated, tag = "3")]
    pub exemplars: Vec<Skipped>,
    /// Native histograms: decoded only to be counted as dropped.
    #[prost(message, repeated, tag = "4")]
    pub histograms: Vec<Skipped>,
}

/// `prometheus.Label`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `prometheus.Sample`: a value at a time in milliseconds since the Unix epoch.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    #[prost(double, tag = "1")]
    pub value: f64,
    #[prost(int64, tag = "2")]
    pub timestamp: i64,
}

/// A message whose content is skipped: what this receiver drops only needs counting.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Skipped {}

/// What a batch held that was not stored, for `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// Staleness markers.
    pub stale: u64,
    /// Native histogram samples.
    pub histograms: u64,
    pub exemplars: u64,
}

/// A decoded batch: the records to store and what was dropped.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Batch {
    pub records: Vec<Record>,
    pub dropped: Dropped,
}

/// Why a remote-write request was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WriteError {
    #[error(
        "content type {0:?} is not accepted: remote write 1.0 sends application/x-protobuf \
         (prometheus.WriteRequest); remote write 2.0 is not supported, set \
         protobuf_message: prometheus.WriteRequest"
    )]
    ContentType(String),
    #[error(
        "Content-Encoding {0:?} is not accepted: remote-write bodies are snappy-compressed \
         (Content-Encoding: snappy)"
    )]
    Encoding(String),
    #[error("the body is not snappy block format (Content-Encoding: snappy): {0}")]
    Snappy(String),
    #[error(
        "the body decompresses to {len} bytes, over {max} (http.body_bytes_max): send smaller \
         batches (queue_config.max_samples_per_send)"
    )]
    TooLarge { len: usize, max: usize },
    #[error("the body is not a remote-write WriteRequest (protobuf): {0}")]
    Protobuf(String),
    #[error("series {index} ({labels}): {why}")]
    Series {
        index: usize,
        /// The series' labels, shortened, to find it by.
        labels: String,
        why: String,
    },
    #[error("{0}")]
    Query(String),
}

impl WriteError {
    /// The HTTP status this refusal is answered with.
    pub fn status(&self) -> u16 {
        match self {
            WriteError::ContentType(_) | WriteError::Encoding(_) => 415,
            WriteError::TooLarge { .. } => 413,
            _ => 400,
        }
    }
}

/// The stream a request writes to: `?stream=NAME`, or [`DEFAULT_STREAM`]. Other parameters
/// are ignored.
pub fn stream_from_query(query: &HashMap<String, String>) -> Result<String, WriteError> {
    match query.get("stream").map(String::as_str) {
        None => Ok(DEFAULT_STREAM.to_owned()),
        Some("") => Err(WriteError::Query(
            "`stream=` is empty: name a stream".into(),
        )),
        Some(s) => Ok(s.to_owned()),
    }
}

/// Checks `Content-Type` and `Content-Encoding` (either may be missing, `None`).
pub fn check_headers(content_type: Option<&str>, encoding: Option<&str>) -> Result<(), WriteError> {
    let ct = content_type.unwrap_or("");
    let mut parts = ct.split(';').map(str::trim);
    if !parts
        .next()
        .is_some_and(|m| m.eq_ignore_ascii_case(CONTENT_TYPE))
    {
        return Err(WriteError::ContentType(ct.to_owned()));
    }
    let proto = parts.find_map(|p| p.strip_prefix("proto="));
    if proto.is_some_and(|p| p.trim_matches('"') != PROTO_V1) {
        return Err(WriteError::ContentType(ct.to_owned()));
    }
    let enc = encoding.unwrap_or("").trim();
    if !enc.eq_ignore_ascii_case(ENCODING) {
        return Err(WriteError::Encoding(enc.to_owned()));
    }
    Ok(())
}

/// Decompresses and decodes `body`, refusing one that decompresses to over `max` bytes
/// before allocating, and maps it to records.
pub fn decode(body: &[u8], max: usize) -> Result<Batch, WriteError> {
    let plain = decompress(body, max)?;
    let request = <WriteRequest as prost::Message>::decode(&plain[..])
        .map_err(|e| WriteError::Protobuf(e.to_string()))?;
    drop(plain);
    to_records(request)
}

/// The snappy block-format `body`, decompressed, if its header promises at most `max` bytes.
pub fn decompress(body: &[u8], max: usize) -> Result<Vec<u8>, WriteError> {
    let snappy = |e: snap::Error| WriteError::Snappy(e.to_string());
    let len = snap::raw::decompress_len(body).map_err(snappy)?;
    if len > max && switches::length_check() {
        return Err(WriteError::TooLarge { len, max });
    }
    snap::raw::Decoder::new()
        .decompress_vec(body)
        .map_err(snappy)
}

/// Test-only mutation switch (feature `fault-injection`; without it the check is always on):
/// off, [`decompress`] allocates whatever length the snappy header promises, as a receiver
/// that trusts the header would. Per thread: the decoder runs on the caller's thread, and tests
/// run in parallel threads.
pub mod switches {
    #[cfg(feature = "fault-injection")]
    thread_local! {
        static LENGTH_CHECK: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    }

    /// Turns the decompressed-length check on or off for decoding on this thread.
    #[cfg(feature = "fault-injection")]
    pub fn set_length_check(on: bool) {
        LENGTH_CHECK.with(|c| c.set(on));
    }

    /// Whether the decompressed length is checked against the cap (always, without the
    /// feature).
    pub(crate) fn length_check() -> bool {
        #[cfg(feature = "fault-injection")]
        return LENGTH_CHECK.with(std::cell::Cell::get);
        #[cfg(not(feature = "fault-injection"))]
        true
    }
}

/// One record per sample (see the module doc).
pub fn to_records(request: WriteRequest) -> Result<Batch, WriteError> {
    let mut batch = Batch::default();
    for (index, series) in request.timeseries.into_iter().enumerate() {
        batch.dropped.exemplars += series.exemplars.len() as u64;
        batch.dropped.histograms += series.histograms.len() as u64;
        if series.samples.is_empty() {
            continue;
        }
        let refuse = |why: String| WriteError::Series {
            index,
            labels: describe(&series.labels),
            why,
        };
        let (name, tags) = series_tags(&series.labels).map_err(refuse)?;
        let key = if tags.is_empty() {
            name.clone()
        } else {
            sync::record::key_from_tags(&tags)
        };
        for s in &series.samples {
            if s.value.to_bits() == STALE_NAN_BITS {
                batch.dropped.stale += 1;
                continue;
            }
            let ts = ts_ns(s.timestamp).map_err(refuse)?;
            batch.records.push(Record {
                key: key.clone(),
                tags: tags.clone(),
                ts,
                fields: vec![(name.clone(), Value::F64(s.value))],
            });
        }
    }
    Ok(batch)
}

/// The metric name and the tags of a series' labels.
fn series_tags(labels: &[Label]) -> Result<(String, Vec<(String, String)>), String> {
    let mut name = None;
    let mut tags = Vec::with_capacity(labels.len().saturating_sub(1));
    for (i, l) in labels.iter().enumerate() {
        if labels[..i].iter().any(|o| o.name == l.name) {
            return Err(format!("label `{}` appears twice", l.name));
        }
        if l.name == NAME_LABEL {
            name = Some(l.value.clone());
        } else if !l.value.is_empty() {
            tags.push((l.name.clone(), l.value.clone()));
        }
    }
    let name = match name {
        None => return Err("no `__name__` label (the metric name)".into()),
        Some(n) if n.is_empty() => return Err("the `__name__` label is empty".into()),
        Some(n) if n.starts_with('_') => {
            return Err(format!(
                "metric name `{n}` starts with `_`, which the agent reserves for its own fields: \
                 rename it with metric_relabel_configs"
            ));
        }
        Some(n) => n,
    };
    if let Some(why) = sync::record::tags_problem(&tags) {
        return Err(why);
    }
    Ok((name, tags))
}

/// A sample's milliseconds as nanoseconds.
fn ts_ns(ms: i64) -> Result<i64, String> {
    ms.checked_mul(1_000_000).ok_or_else(|| {
        format!("timestamp {ms} ms is out of range in nanoseconds (years 1678 to 2262)")
    })
}

/// `{a="1", b="2"}`, shortened for an error message.
fn describe(labels: &[Label]) -> String {
    let all: Vec<String> = labels
        .iter()
        .map(|l| format!("{}={:?}", l.name, l.value))
        .collect();
    let text = format!("{{{}}}", all.join(", "));
    if text.chars().count() <= 200 {
        return text;
    }
    let mut short: String = text.chars().take(200).collect();
    short.push_str("...");
    short
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    fn label(name: &str, value: &str) -> Label {
        Label {
            name: name.into(),
            value: value.into(),
        }
    }

    fn series(labels: &[(&str, &str)], samples: &[(f64, i64)]) -> TimeSeries {
        TimeSeries {
            labels: labels.iter().map(|(n, v)| label(n, v)).collect(),
            samples: samples
                .iter()
                .map(|&(value, timestamp)| Sample { value, timestamp })
                .collect(),
            exemplars: vec![],
            histograms: vec![],
        }
    }

    fn body(timeseries: Vec<TimeSeries>) -> Vec<u8> {
        let plain = WriteRequest { timeseries }.encode_to_vec();
        snap::raw::Encoder::new().compress_vec(&plain).unwrap()
    }

    #[test]
    fn samples_become_records_keyed_by_their_tags() {
        let up = series(
            &[("__name__", "up"), ("job", "node"), ("instance", "h:9100")],
            &[(1.0, 1_700_000_000_000), (0.0, 1_700_000_001_000)],
        );
        let bare = series(&[("__name__", "answer")], &[(42.0, 5)]);
        let batch = decode(&body(vec![up, bare]), 1 << 20).unwrap();
        assert_eq!(batch.dropped, Dropped::default());
        let tags = vec![
            ("job".to_owned(), "node".to_owned()),
            ("instance".to_owned(), "h:9100".to_owned()),
        ];
        assert_eq!(
            batch.records,
            vec![
                Record {
                    key: "instance=h:9100/job=node".into(),
                    tags: tags.clone(),
                    ts: 1_700_000_000_000_000_000,
                    fields: vec![("up".into(), Value::F64(1.0))],
                },
                Record {
                    key: "instance=h:9100/job=node".into(),
                    tags,
                    ts: 1_700_000_001_000_000_000,
                    fields: vec![("up".into(), Value::F64(0.0))],
                },
                Record {
                    key: "answer".into(),
                    tags: vec![],
                    ts: 5_000_000,
                    fields: vec![("answer".into(), Value::F64(42.0))],
                },
            ]
        );
        assert_eq!(
            batch.records[0].key,
            sync::record::key_from_tags(&batch.records[0].tags)
        );
    }

    #[test]
    fn staleness_markers_are_dropped_and_other_nans_kept() {
        let stale = f64::from_bits(STALE_NAN_BITS);
        // Prometheus's ordinary NaN (`value.NormalNaN`) and the infinities are values.
        let normal_nan = f64::from_bits(0x7ff8_0000_0000_0001);
        let s = series(
            &[("__name__", "m"), ("a", "1")],
            &[
                (stale, 1),
                (normal_nan, 2),
                (f64::INFINITY, 3),
                (f64::NEG_INFINITY, 4),
            ],
        );
        let batch = decode(&body(vec![s]), 1 << 20).unwrap();
        assert_eq!(batch.dropped.stale, 1);
        let bits: Vec<u64> = batch
            .records
            .iter()
            .map(|r| match r.fields[0].1 {
                Value::F64(v) => v.to_bits(),
                ref other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            bits,
            [
                normal_nan.to_bits(),
                f64::INFINITY.to_bits(),
                f64::NEG_INFINITY.to_bits()
            ]
        );
    }

    #[test]
    fn exemplars_and_histograms_are_counted_and_empty_labels_left_out() {
        let mut s = series(&[("__name__", "m"), ("a", ""), ("b", "2")], &[(1.0, 1)]);
        s.exemplars = vec![Skipped {}, Skipped {}];
        s.histograms = vec![Skipped {}];
        let batch = decode(&body(vec![s]), 1 << 20).unwrap();
        assert_eq!(
            batch.dropped,
            Dropped {
                stale: 0,
                histograms: 1,
                exemplars: 2
            }
        );
        assert_eq!(batch.records[0].tags, vec![("b".into(), "2".into())]);
        assert_eq!(batch.records[0].key, "b=2");
    }

    #[test]
    fn bad_series_are_refused_naming_them() {
        let cases: [(&[(&str, &str)], &str); 5] = [
            (
                &[("__name__", "m"), ("a", "1"), ("a", "2")],
                "`a` appears twice",
            ),
            (
                &[("__name__", "m"), ("__name__", "n")],
                "`__name__` appears twice",
            ),
            (&[("a", "1")], "no `__name__`"),
            (&[("__name__", "")], "`__name__` label is empty"),
            (&[("__name__", "_idempotency")], "reserves"),
        ];
        for (labels, want) in cases {
            let ok = series(&[("__name__", "fine")], &[(1.0, 1)]);
            let err = decode(&body(vec![ok, series(labels, &[(1.0, 1)])]), 1 << 20).unwrap_err();
            assert_eq!(err.status(), 400);
            let msg = err.to_string();
            assert!(msg.starts_with("series 1 ("), "{msg}");
            assert!(msg.contains(want), "{want:?} not in {msg}");
        }
        let nul = series(&[("__name__", "m"), ("a", "x\0y")], &[(1.0, 1)]);
        let msg = decode(&body(vec![nul]), 1 << 20).unwrap_err().to_string();
        assert!(msg.contains("NUL"), "{msg}");
    }

    #[test]
    fn timestamps_out_of_range_in_nanoseconds_are_refused() {
        let edge = i64::MAX / 1_000_000;
        let ok = decode(
            &body(vec![series(&[("__name__", "m")], &[(1.0, edge)])]),
            1 << 20,
        );
        assert_eq!(ok.unwrap().records[0].ts, edge * 1_000_000);
        for ms in [edge + 1, i64::MIN] {
            let err = decode(
                &body(vec![series(&[("__name__", "m")], &[(1.0, ms)])]),
                1 << 20,
            )
            .unwrap_err();
            assert_eq!(err.status(), 400);
            assert!(err.to_string().contains("out of range"), "{err}");
        }
    }

    #[test]
    fn the_decompressed_length_is_checked_before_allocating() {
        // A snappy body is its varint length first: this one promises 1 GiB in 5 bytes.
        let mut promise = Vec::new();
        let mut n: u64 = 1 << 30;
        while n >= 0x80 {
            promise.push((n as u8) | 0x80);
            n >>= 7;
        }
        promise.push(n as u8);
        let err = decode(&promise, 1 << 20).unwrap_err();
        assert_eq!(
            err,
            WriteError::TooLarge {
                len: 1 << 30,
                max: 1 << 20
            }
        );
        assert_eq!(err.status(), 413);
        // Exactly the cap passes.
        let b = body(vec![series(&[("__name__", "m")], &[(1.0, 1)])]);
        let len = snap::raw::decompress_len(&b).unwrap();
        assert!(decode(&b, len).is_ok());
        assert!(matches!(
            decode(&b, len - 1),
            Err(WriteError::TooLarge { .. })
        ));
    }

    /// Mutation check: with the length check off (`switches`) the test above fails.
    #[cfg(feature = "fault-injection")]
    #[test]
    fn mutation_without_the_length_check_the_size_test_fails() {
        switches::set_length_check(false);
        let caught = std::panic::catch_unwind(the_decompressed_length_is_checked_before_allocating);
        switches::set_length_check(true);
        assert!(
            caught.is_err(),
            "the size test passed with the decompressed-length check off"
        );
    }

    #[test]
    fn bodies_that_do_not_decode_are_400() {
        let not_snappy = decode(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 1 << 20).unwrap_err();
        assert!(matches!(not_snappy, WriteError::Snappy(_)), "{not_snappy}");
        let garbage = snap::raw::Encoder::new()
            .compress_vec(b"\x0a\x05hello")
            .unwrap();
        let not_proto = decode(&garbage, 1 << 20).unwrap_err();
        assert!(matches!(not_proto, WriteError::Protobuf(_)), "{not_proto}");
        for e in [not_snappy, not_proto] {
            assert_eq!(e.status(), 400);
        }
        // An empty request is a batch of nothing, not an error.
        assert_eq!(decode(&body(vec![]), 1 << 20).unwrap(), Batch::default());
    }

    #[test]
    fn headers() {
        assert!(check_headers(Some("application/x-protobuf"), Some("snappy")).is_ok());
        assert!(
            check_headers(
                Some("application/x-protobuf;proto=prometheus.WriteRequest"),
                Some("SNAPPY")
            )
            .is_ok()
        );
        let v2 = check_headers(
            Some("application/x-protobuf;proto=io.prometheus.write.v2.Request"),
            Some("snappy"),
        )
        .unwrap_err();
        assert!(v2.to_string().contains("2.0 is not supported"), "{v2}");
        for (ct, enc) in [
            (Some("application/json"), Some("snappy")),
            (None, Some("snappy")),
            (Some("application/x-protobuf"), None),
            (Some("application/x-protobuf"), Some("gzip")),
        ] {
            assert_eq!(
                check_headers(ct, enc).unwrap_err().status(),
                415,
                "{ct:?} {enc:?}"
            );
        }
    }

    #[test]
    fn the_stream_comes_from_the_query() {
        let q = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(stream_from_query(&q(&[])).unwrap(), "prometheus");
        assert_eq!(
            stream_from_query(&q(&[("stream", "node"), ("x", "1")])).unwrap(),
            "node"
        );
        assert!(stream_from_query(&q(&[("stream", "")])).is_err());
    }
}
