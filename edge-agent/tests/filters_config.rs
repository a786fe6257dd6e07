//! The filter pipeline wired into the agent: `[[streams]] filters`, `source_stream`,
//! `replicate` and `retention` in the config (errors name the key), pipeline snapshots (the
//! state a derived stream carries across restarts), filtering on the HTTP ingest path, the 409
//! for derived streams, and the filter counters on `/metrics` and `/v1/status`. The kill -9 test
//! of derived streams is `process_derive.rs`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use edge_agent::config::{ConfigError, EdgeConfig};
use edge_agent::filters::{Agg, DownsampleMode, Pipeline, RestoreError, StageSpec};
use edge_agent::http::AppState;
use edge_agent::http::client::Client;
use edge_agent::log::Log;
use edge_agent::storage::RealStorage;
use serde_json::Value as Json;
use sync::{Record, Value};

fn parse(text: &str) -> Result<EdgeConfig, ConfigError> {
    EdgeConfig::from_toml(text, Path::new("/tmp"), Some(HashMap::new()))
}

const BASE: &str = "data_dir = \"/tmp/x\"\n";

#[test]
fn filters_parse_into_stages() {
    let cfg = parse(&format!(
        r#"{BASE}
[[streams]]
name = "raw"
replicate = false
retention = "10m"

[[streams]]
name = "telemetry"
source_stream = "raw"
priority = 3
filters = [
  {{ kind = "where", expr = "temp > 3.5 and site == \"a\"" }},
  {{ kind = "deadband", field = "temp", threshold = 0.5 }},
  {{ kind = "downsample", interval = "10s", mode = "mean" }},
  {{ kind = "window", interval = "1m", field = "temp", aggs = ["count", "max"] }},
  {{ kind = "project", fields = ["temp.count as n", "temp.max"] }},
]
"#
    ))
    .unwrap();
    let raw = cfg.stream("raw").unwrap();
    assert!(!raw.replicate && !raw.is_derived() && raw.filters.is_empty());
    assert_eq!(raw.retention, Duration::from_secs(600));
    let t = cfg.stream("telemetry").unwrap();
    assert!(t.replicate);
    assert_eq!(t.source_stream.as_deref(), Some("raw"));
    assert_eq!(
        t.filters,
        vec![
            StageSpec::Where("temp > 3.5 and site == \"a\"".into()),
            StageSpec::Deadband {
                field: "temp".into(),
                threshold: 0.5
            },
            StageSpec::Downsample {
                interval_ns: 10_000_000_000,
                mode: DownsampleMode::Mean
            },
            StageSpec::Window {
                interval_ns: 60_000_000_000,
                field: "temp".into(),
                aggs: vec![Agg::Count, Agg::Max]
            },
            StageSpec::Project(vec![
                ("temp.count".into(), Some("n".into())),
                ("temp.max".into(), None)
            ]),
        ]
    );
    // A window without `aggs` gets all five.
    let cfg = parse(&format!(
        "{BASE}[[streams]]\nname = \"s\"\nfilters = [{{ kind = \"window\", interval = \"1s\", field = \"v\" }}]\n"
    ))
    .unwrap();
    assert!(matches!(
        &cfg.streams[0].filters[0],
        StageSpec::Window { aggs, .. } if aggs.len() == 5
    ));
}

#[test]
fn filter_config_errors_name_the_key() {
    let two = |stage: &str, extra: &str| {
        format!(
            "{BASE}[[streams]]\nname = \"raw\"\nreplicate = false\n[[streams]]\nname = \"t\"\n{extra}filters = [{stage}]\n"
        )
    };
    let cases: Vec<(String, &str, &str)> = vec![
        (
            two(r#"{ kind = "where", expr = "temp >" }"#, ""),
            "streams[1].filters[0]",
            "at byte",
        ),
        (
            two(r#"{ kind = "sample" }"#, ""),
            "streams[1].filters[0].kind",
            "expected where",
        ),
        (
            two(r#"{ kind = "where" }"#, ""),
            "streams[1].filters[0].expr",
            "missing",
        ),
        (
            two(r#"{ kind = "deadband", field = "v", threshold = -1 }"#, ""),
            "streams[1].filters[0].threshold",
            "number >= 0",
        ),
        (
            two(r#"{ kind = "downsample", interval = "0s" }"#, ""),
            "streams[1].filters[0].interval",
            "above zero",
        ),
        (
            two(
                r#"{ kind = "downsample", interval = "1s", mode = "median" }"#,
                "",
            ),
            "streams[1].filters[0].mode",
            "last | mean",
        ),
        (
            two(
                r#"{ kind = "window", interval = "1s", field = "v", aggs = ["p99"] }"#,
                "",
            ),
            "streams[1].filters[0].aggs",
            "count | min",
        ),
        (
            two(r#"{ kind = "project", fields = [] }"#, ""),
            "streams[1].filters[0].fields",
            "non-empty",
        ),
        (
            two(r#"{ kind = "where", expr = "v > 1", bogus = 1 }"#, ""),
            "streams[1].filters[0].bogus",
            "unknown key",
        ),
        (
            two(
                r#"{ kind = "where", expr = "v > 1" }"#,
                "source_stream = \"nope\"\n",
            ),
            "streams[1].source_stream",
            "no [[streams]] entry",
        ),
        (
            two(
                r#"{ kind = "where", expr = "v > 1" }"#,
                "source_stream = \"t\"\n",
            ),
            "streams[1].source_stream",
            "itself",
        ),
        (
            format!("{BASE}[[streams]]\nname = \"a\"\nretention = \"1h\"\n"),
            "streams[0].retention",
            "replicate = false",
        ),
        (
            format!("{BASE}[[streams]]\nname = \"a\"\nreplicate = \"maybe\"\n"),
            "streams[0].replicate",
            "true | false",
        ),
        (
            format!(
                "{BASE}[[streams]]\nname = \"a\"\n[[streams]]\nname = \"b\"\nsource_stream = \"a\"\n\
                 [[streams]]\nname = \"c\"\nsource_stream = \"b\"\n"
            ),
            "streams[2].source_stream",
            "itself derived",
        ),
        (
            format!(
                "{BASE}[[streams]]\nname = \"a\"\nfilters = [{{ kind = \"where\", expr = \"v > 1\" }}]\n\
                 [[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:1883\"\ntopics = [\"s/#\"]\nstream = \"a\"\n"
            ),
            "sources[0].stream",
            "derived stream",
        ),
        (
            format!(
                "{BASE}[[streams]]\nname = \"a\"\n[[streams]]\nname = \"b\"\nsource_stream = \"a\"\n\
                 [[sources]]\nkind = \"simulator\"\nstream = \"b\"\n"
            ),
            "sources[0].stream",
            "only its filter runner",
        ),
    ];
    for (text, key, needle) in cases {
        let e = parse(&text).expect_err(&text);
        assert_eq!(e.key(), Some(key), "{e} for\n{text}");
        assert!(e.to_string().contains(needle), "{e:?} lacks {needle:?}");
    }
}

fn rec(key: &str, ts: i64, v: f64) -> Record {
    Record {
        tags: Vec::new(),
        key: key.into(),
        ts,
        fields: vec![
            ("v".into(), Value::F64(v)),
            ("n".into(), Value::I64(ts)),
            ("s".into(), Value::Str("x".into())),
            ("b".into(), Value::Bytes(vec![1, 2])),
        ],
    }
}

fn stateful() -> Vec<StageSpec> {
    vec![
        StageSpec::Deadband {
            field: "v".into(),
            threshold: 0.3,
        },
        StageSpec::Downsample {
            interval_ns: 30,
            mode: DownsampleMode::Last,
        },
        StageSpec::Window {
            interval_ns: 100,
            field: "v".into(),
            aggs: vec![Agg::Count, Agg::Min, Agg::Max, Agg::Mean, Agg::Last],
        },
    ]
}

#[test]
fn a_restored_snapshot_continues_exactly_where_the_pipeline_was() {
    let input: Vec<Record> = (0..400)
        .map(|i| rec(&format!("k{}", i % 7), i * 3, ((i * 37) % 19) as f64 / 3.0))
        .collect();
    for specs in [
        stateful(),
        vec![StageSpec::Downsample {
            interval_ns: 20,
            mode: DownsampleMode::Mean,
        }],
    ] {
        let whole = Pipeline::compile(&specs).unwrap().run(input.clone());
        assert!(!whole.is_empty());
        for cut in [0, 1, 57, 200, 399, 400] {
            let mut a = Pipeline::compile(&specs).unwrap();
            let mut out = a.run(input[..cut].to_vec());
            // Through text, as the progress file stores it.
            let text = a.snapshot().to_string();
            let mut b = Pipeline::compile(&specs).unwrap();
            b.restore(&serde_json::from_str(&text).unwrap()).unwrap();
            out.extend(b.run(input[cut..].to_vec()));
            assert_eq!(out, whole, "cut at {cut}");
        }
    }
    let a = Pipeline::compile(&stateful()).unwrap();
    let mut other = Pipeline::compile(&stateful()[..2]).unwrap();
    assert!(matches!(
        other.restore(&a.snapshot()),
        Err(RestoreError::OtherPipeline { .. })
    ));
    let mut same = Pipeline::compile(&stateful()).unwrap();
    let mut bad = a.snapshot();
    bad["stages"][2] = serde_json::json!([["k", "not a number"]]);
    assert!(matches!(
        same.restore(&bad),
        Err(RestoreError::Malformed { stage: 2, .. })
    ));
}

#[test]
fn stage_counters_count_in_out_and_dropped() {
    let mut p = Pipeline::compile(&[
        StageSpec::Where("v >= 1".into()),
        StageSpec::Project(vec![("v".into(), Some("value".into()))]),
    ])
    .unwrap();
    let out = p.run((0..10).map(|i| rec("k", i, i as f64 / 2.0)).collect());
    assert_eq!(out.len(), 8);
    assert_eq!(out[0].fields, vec![("value".into(), Value::F64(1.0))]);
    let st = &p.stats().stages;
    assert_eq!(st[0].kind, "where");
    assert_eq!(st[0].input.load(std::sync::atomic::Ordering::Relaxed), 10);
    assert_eq!(st[0].output.load(std::sync::atomic::Ordering::Relaxed), 8);
    assert_eq!(st[0].dropped(), 2);
    assert_eq!(st[1].dropped(), 0);
}

/// Serves the API over a fresh log with the given streams.
async fn serve(streams: &str) -> (Client, Arc<AppState>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!("data_dir = {:?}\n{streams}", dir.path().join("data"));
    let cfg = EdgeConfig::from_toml(&toml, dir.path(), Some(HashMap::new())).unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    let app = AppState::new(&cfg, log);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(edge_agent::http::serve(
        listener,
        app.clone(),
        std::future::pending(),
    ));
    edge_agent::filters::derive::spawn_all(&cfg, app.ingest.clone()).await;
    (Client::new(&url).unwrap(), app, dir)
}

#[tokio::test]
async fn ingest_filters_before_sequencing_and_refuses_derived_streams() {
    let (client, app, _dir) = serve(
        r#"
[[streams]]
name = "hot"
filters = [ { kind = "where", expr = "temp > 30" }, { kind = "project", fields = ["temp as t"] } ]
[[streams]]
name = "raw"
replicate = false
[[streams]]
name = "win"
source_stream = "raw"
filters = [ { kind = "window", interval = "10s", field = "temp", aggs = ["count"] } ]
idle_close_after = "off"
"#,
    )
    .await;
    let post = |stream: &'static str, body: &'static str| {
        let client = client.clone();
        async move {
            let r = client
                .post(
                    &format!("/v1/streams/{stream}/records"),
                    "application/x-ndjson",
                    body,
                )
                .await
                .unwrap();
            let j: Json = serde_json::from_slice(&r.body).unwrap_or(Json::Null);
            (r.status, j)
        }
    };
    let cold = r#"{"key":"a","ts":1,"fields":{"temp":20.5}}"#;
    let (status, j) = post("hot", cold).await;
    assert_eq!(status, 200, "{j}");
    assert_eq!(
        (j["count"].as_u64(), j["first_seq"].as_u64()),
        (Some(0), Some(0))
    );
    let mixed = "{\"key\":\"a\",\"ts\":2,\"fields\":{\"temp\":31.5,\"hum\":1}}\n\
                 {\"key\":\"a\",\"ts\":3,\"fields\":{\"temp\":29.0}}\n\
                 {\"key\":\"a\",\"ts\":4,\"fields\":{\"temp\":35.0}}\n";
    let (status, j) = post("hot", mixed).await;
    assert_eq!(status, 200, "{j}");
    assert_eq!(
        (
            j["count"].as_u64(),
            j["first_seq"].as_u64(),
            j["last_seq"].as_u64()
        ),
        (Some(2), Some(1), Some(2))
    );
    let (status, j) = post("win", cold).await;
    assert_eq!(status, 409, "{j}");
    assert!(
        j["error"]
            .as_str()
            .unwrap()
            .contains("/v1/streams/raw/records"),
        "{j}"
    );

    // The derived stream: two windows of "a" closed by a record in a third (the clock closes
    // none: `idle_close_after = "off"`). Event times from T, a multiple of the interval.
    const T: i64 = 1_764_374_400_000_000_000;
    const S: i64 = 1_000_000_000;
    let raw: String = [(1, 1), (2, 2), (12, 3), (25, 4)]
        .iter()
        .map(|(s, temp)| {
            format!(
                "{{\"key\":\"a\",\"ts\":{},\"fields\":{{\"temp\":{temp}}}}}\n",
                T + s * S
            )
        })
        .collect();
    let (status, j) = post("raw", raw.leak()).await;
    assert_eq!(status, 200, "{j}");
    let log = app.ingest.log().clone();
    let mut durable = log.durable_watch();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let win = log
            .status()
            .streams
            .into_iter()
            .find(|s| s.stream == "win")
            .unwrap();
        let consumed = app
            .ingest
            .metrics()
            .filter_reports()
            .into_iter()
            .find(|f| f.stream == "win")
            .map(|f| f.consumed_seq);
        if win.durable_seq >= 2 && consumed == Some(4) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no windows: {win:?}"
        );
        let _ = tokio::time::timeout(Duration::from_millis(200), durable.changed()).await;
    }
    let (epoch, _, last) = log.epochs_held("win")[0];
    let windows = edge_agent::filters::derive::read_records(&log, "win", epoch, 0, last).unwrap();
    assert_eq!(
        windows
            .iter()
            .map(|r| (r.ts, r.fields.clone()))
            .collect::<Vec<_>>(),
        vec![
            (T, vec![("temp.count".into(), Value::I64(2))]),
            (T + 10 * S, vec![("temp.count".into(), Value::I64(1))]),
        ]
    );

    let metrics = client.get("/metrics").await.unwrap().text();
    for needle in [
        "tributary_edge_filter_stage_in_total{stream=\"hot\",stage=\"0\",kind=\"where\"} 4",
        "tributary_edge_filter_stage_out_total{stream=\"hot\",stage=\"0\",kind=\"where\"} 2",
        "tributary_edge_filter_stage_dropped_total{stream=\"hot\",stage=\"0\",kind=\"where\"} 2",
        "tributary_edge_filter_stage_in_total{stream=\"win\",stage=\"0\",kind=\"window\"} 4",
        "tributary_edge_derived_consumed_seq{stream=\"win\"} 4",
    ] {
        assert!(metrics.contains(needle), "{needle} not in\n{metrics}");
    }
    let status: Json =
        serde_json::from_slice(&client.get("/v1/status").await.unwrap().body).unwrap();
    let win = status["filters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["stream"] == "win")
        .unwrap();
    assert_eq!(win["consumed_seq"], 4);
    assert_eq!(win["stages"][0]["records_out"], 2);
    app.ingest.log().shutdown();
}
