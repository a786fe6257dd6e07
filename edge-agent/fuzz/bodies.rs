//! Fuzz target bodies for the edge agent: its decoders of input from outside the process
//! (`edge.toml`, filter expressions and snapshots, MQTT topics and payloads, ingest request
//! bodies). The record parsers underneath are fuzzed on their own in `sync/fuzz`.
//!
//! This file is the `edge-agent/fuzz` crate's library, so each cargo-fuzz target is a one-line
//! wrapper, and `edge-agent/tests/fuzz_corpus.rs` compiles the very same file (by path) to
//! replay every committed corpus file on stable Rust. Each function must never panic on any
//! input; it asserts what must hold whenever parsing succeeds, and that errors say where.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use edge_agent::config::{EdgeConfig, MqttSourceConfig, MqttUnmatched, PayloadFormat, TsUnit};
use edge_agent::filters::predicate;
use edge_agent::filters::{Agg, DownsampleMode, FilterStats, Pipeline, StageSpec};
use edge_agent::http::{BodyFormat, parse_body};
use edge_agent::sources::mqtt::{Mapper, MqttStats, TOPIC_FIELD};
use edge_agent::sources::sparkplug::{Host, HostConfig, Output};
use rumqttc::{Publish, QoS};
use sync::{Record, Value};

/// Arbitrary text as `edge.toml` (`EdgeConfig::from_toml`, with an empty environment). A
/// config that loads must be usable: its filters compile and its log config derives.
pub fn edge_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match EdgeConfig::from_toml(text, Path::new("/etc/tributary"), Some(HashMap::new())) {
        Ok(config) => {
            for s in &config.streams {
                assert!(
                    Pipeline::compile(&s.filters).is_ok(),
                    "stream {} loaded with filters that do not compile",
                    s.name
                );
                assert!(config.stream(&s.name).is_some());
            }
            assert!(config.data_dir.is_absolute(), "data_dir is resolved");
            let _ = config.log_config();
        }
        Err(e) => {
            assert!(!e.to_string().is_empty(), "errors say what is wrong");
            if let Some(key) = e.key() {
                assert!(!key.is_empty(), "errors name the key");
            }
        }
    }
}

/// Records with every value type, for predicates and pipelines to chew on.
pub fn sample_records() -> Vec<Record> {
    let r = |key: &str, ts: i64, fields: Vec<(&str, Value)>| Record {
        tags: Vec::new(),
        key: key.into(),
        ts,
        fields: fields.into_iter().map(|(n, v)| (n.to_owned(), v)).collect(),
    };
    vec![
        r(
            "truck-1/engine",
            1_000_000_000,
            vec![
                ("temp", Value::F64(21.5)),
                ("rpm", Value::I64(900)),
                ("ok", Value::Bool(true)),
                ("state", Value::Str("run".into())),
                ("site.id", Value::I64(7)),
            ],
        ),
        r(
            "truck-1/engine",
            12_000_000_000,
            vec![("temp", Value::F64(-41.0)), ("rpm", Value::F64(f64::MAX))],
        ),
        r(
            "truck-2/engine",
            -1_000_000_000_000,
            vec![
                ("temp", Value::I64(i64::MAX)),
                ("blob", Value::Bytes(vec![0, 255])),
            ],
        ),
        r(
            "truck-2/engine",
            i64::MAX,
            vec![("temp", Value::F64(f64::NAN))],
        ),
        r("truck-3", 70_000_000_000, vec![]),
    ]
}

/// Arbitrary text as a filter `where` expression: compiled, then evaluated on every sample.
pub fn filter_predicate(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match predicate::compile(text) {
        Ok(p) => {
            let stats = FilterStats::default();
            for r in sample_records() {
                let _ = p.eval(&r, &stats);
            }
        }
        Err(e) => {
            assert!(e.at <= text.len(), "error offset {} past the end", e.at);
            assert!(!e.message.is_empty(), "errors say what is wrong");
        }
    }
}

/// A pipeline with every kind of stage, as a derived stream's runner restores it.
pub fn every_stage() -> Vec<StageSpec> {
    vec![
        StageSpec::Where("temp > -40 or not exists(temp)".into()),
        StageSpec::Deadband {
            field: "temp".into(),
            threshold: 0.2,
        },
        StageSpec::Downsample {
            interval_ns: 5_000_000_000,
            mode: DownsampleMode::Mean,
        },
        StageSpec::Window {
            interval_ns: 60_000_000_000,
            field: "temp".into(),
            aggs: vec![Agg::Count, Agg::Min, Agg::Max, Agg::Mean, Agg::Last],
        },
        StageSpec::Project(vec![
            ("temp.mean".into(), Some("temp".into())),
            ("temp.count".into(), None),
        ]),
    ]
}

/// Arbitrary input as a pipeline snapshot and records for it. The first line is JSON, a
/// snapshot as `Pipeline::restore` reads it back from a derived stream's progress file; it is
/// tried as it is and with the pipeline's own fingerprint put in, since a fuzzer would rarely
/// guess that. The rest is NDJSON records (as producers send them), run through the pipeline
/// after the fixed samples. A restored pipeline must run, and its own snapshot must restore
/// into a fresh pipeline and snapshot the same.
pub fn filter_pipeline(data: &[u8]) {
    let (first, rest) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let records = std::str::from_utf8(rest)
        .ok()
        .and_then(|text| sync::parse::parse_ndjson(text).ok())
        .unwrap_or_default();
    let specs = every_stage();
    let compile = || Pipeline::compile(&specs).expect("the fixed pipeline compiles");
    let mut json = serde_json::from_slice::<serde_json::Value>(first).ok();
    let fingerprint = format!("{:016x}", compile().fingerprint());
    let fixed = json.as_mut().and_then(|j| {
        let obj = j.as_object_mut()?;
        let mut fixed = obj.clone();
        fixed.insert("fingerprint".into(), fingerprint.into());
        Some(serde_json::Value::Object(fixed))
    });
    for snapshot in [json.as_ref(), fixed.as_ref()] {
        let mut pipeline = compile();
        if let Some(snapshot) = snapshot
            && let Err(e) = pipeline.restore(snapshot)
        {
            assert!(!e.to_string().is_empty(), "errors say what is wrong");
            // After a failed restore the state is unspecified: recompile, as the runner does.
            pipeline = compile();
        }
        let _ = pipeline.run(sample_records());
        let _ = pipeline.run(records.clone());
        check_snapshot(&mut pipeline, compile());
    }
}

/// A pipeline's own snapshot restores into a fresh one, which then behaves the same.
fn check_snapshot(pipeline: &mut Pipeline, mut fresh: Pipeline) {
    let snap = pipeline.snapshot();
    fresh
        .restore(&snap)
        .expect("a pipeline's own snapshot restores");
    // Snapshots list keys in hash-map order, so compare behaviour, not JSON: later records
    // of every key close the open windows, identically in both.
    let later: Vec<Record> = sample_records()
        .into_iter()
        .map(|r| Record {
            ts: 4_000_000_000_000_000_000,
            ..r
        })
        .collect();
    let (a, b) = (pipeline.run(later.clone()), fresh.run(later));
    assert_eq!(
        format!("{a:?}"),
        format!("{b:?}"),
        "a restored pipeline continues alike"
    );
}

/// Arbitrary MQTT messages through the MQTT source's `Mapper`. Byte 0 picks the source's
/// settings (bit 0: line protocol, bits 1-3: ts unit, bit 4: a topic template, bit 5: a
/// `ts_field`, bit 6: `ts_invalid = "receive_time"`, bit 7: `unmatched = "store"`); then, one per line, the template and the ts field when present and the topic;
/// the rest is the payload.
pub fn mqtt_map(data: &[u8]) {
    let Some((&selector, mut rest)) = data.split_first() else {
        return;
    };
    let mut next_line = || {
        let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        let line = String::from_utf8_lossy(&rest[..end]).into_owned();
        rest = rest.get(end + 1..).unwrap_or(&[]);
        line
    };
    let topic_template = (selector & 0x10 != 0).then(&mut next_line);
    let ts_field = (selector & 0x20 != 0).then(&mut next_line);
    let topic = next_line();
    let payload = rest.to_vec();
    let cfg = MqttSourceConfig {
        url: "mqtt://127.0.0.1:1883".into(),
        topics: vec!["#".into()],
        stream: "telemetry".into(),
        format: if selector & 1 == 0 {
            PayloadFormat::Json
        } else {
            PayloadFormat::Line
        },
        topic_template,
        value_field: "value".into(),
        unmatched: if selector & 0x80 != 0 {
            MqttUnmatched::Store
        } else {
            MqttUnmatched::Drop
        },
        ts_field,
        ts_unit: [
            TsUnit::S,
            TsUnit::Ms,
            TsUnit::Us,
            TsUnit::Ns,
            TsUnit::Rfc3339,
        ][usize::from((selector >> 1) & 7) % 5],
        ts_invalid_receive_time: selector & 0x40 != 0,
        client_id: None,
        qos: 1,
        dedupe_window: 16,
        tls: None,
        sparkplug: None,
    };
    let stats = Arc::new(MqttStats::default());
    let mapper = Mapper::new(&cfg, stats);
    let publish = Publish::new(topic.clone(), QoS::AtLeastOnce, payload);
    let mut out = vec![Record {
        tags: Vec::new(),
        key: "earlier".into(),
        ts: 0,
        fields: vec![],
    }];
    mapper.map(&publish, 1_700_000_000_000_000_000, 42, &mut out);
    assert_eq!(
        out[0].key, "earlier",
        "records already in the batch stay as they were"
    );
    for r in &out[1..] {
        assert!(
            r.field(TOPIC_FIELD) == Some(&Value::Str(topic.clone())),
            "every record keeps its topic"
        );
        check_fields(r);
    }
}

/// Arbitrary Sparkplug messages through one `sparkplug::Host`, in order, so BIRTH state carries
/// over from one to the next: each message is a topic length (1 byte), the topic, a payload
/// length (2 bytes, big-endian) and the payload. Every record's key is its tags' key, its tags
/// valid, its fields named once, finite and within the field limit.
pub fn sparkplug_host(data: &[u8]) {
    let stats = Arc::new(MqttStats::default());
    let cfg = HostConfig {
        rebirth_interval_ns: 1_000_000_000,
        fields_max: 8,
    };
    let mut host = Host::new(cfg, stats);
    let mut rest = data;
    let mut now = 0i64;
    while let Some((&topic_len, r)) = rest.split_first() {
        let (topic, r) = r.split_at(usize::from(topic_len).min(r.len()));
        let payload_len = match r {
            [a, b, ..] => usize::from(u16::from_be_bytes([*a, *b])),
            _ => 0,
        };
        let r = r.get(2..).unwrap_or(&[]);
        let (payload, r) = r.split_at(payload_len.min(r.len()));
        rest = r;
        now += 500_000_000;
        let mut out = Output::default();
        host.handle(&String::from_utf8_lossy(topic), payload, now, &mut out);
        for rec in &out.records {
            assert_eq!(rec.key, sync::record::key_from_tags(&rec.tags));
            assert_eq!(sync::record::tags_problem(&rec.tags), None);
            assert!(!rec.fields.is_empty() && rec.fields.len() <= 8, "{rec:?}");
            check_fields(rec);
        }
    }
}

/// Field names are unique within a record, and parsed floats are finite.
fn check_fields(r: &Record) {
    for (i, (name, v)) in r.fields.iter().enumerate() {
        assert!(
            r.fields[..i].iter().all(|(n, _)| n != name),
            "field {name:?} appears twice in {r:?}"
        );
        if let Value::F64(x) = v {
            assert!(x.is_finite(), "field {name:?} is not finite: {x}");
        }
    }
}

/// Arbitrary ingest request bodies, as both NDJSON and line protocol (`http::parse_body`),
/// and the input's first line as a `Content-Type`.
pub fn http_body(data: &[u8]) {
    let first_line = data.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let _ = BodyFormat::from_content_type(&String::from_utf8_lossy(first_line));
    let lines = data.iter().filter(|&&b| b == b'\n').count() + 1;
    for format in [BodyFormat::Ndjson, BodyFormat::LineProtocol] {
        match parse_body(format, "telemetry", data, 7) {
            Ok(records) => {
                assert!(!records.is_empty(), "an accepted body holds records");
                for r in &records {
                    assert!(!r.key.is_empty(), "keys are never empty");
                    check_fields(r);
                }
            }
            Err(e) => {
                assert!(!e.to_string().is_empty(), "errors say what is wrong");
                if let Some((line, column)) = e.position() {
                    assert!(
                        (1..=lines).contains(&line) && column >= 1,
                        "error at {line}:{column} outside a body of {lines} lines: {e}"
                    );
                }
            }
        }
    }
}
