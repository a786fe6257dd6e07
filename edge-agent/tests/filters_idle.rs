//! Filter stages and the agent's internal fields, and intervals closed by the clock.
//!
//! - `downsample` in `mean` mode never averages an internal field (`_mqtt_digest`) and carries
//!   `_topic` from the interval's last record; a `window` carries `_topic` too, and a window
//!   over an internal field is refused.
//! - A key that goes quiet has its last interval emitted once the interval's end plus
//!   `idle_close_after` has passed on the pipeline's clock and the key sent nothing for that
//!   long; a record for that interval arriving after is late (counted) and nothing is emitted
//!   twice, also across a snapshot and restore. A backfill that keeps arriving is not cut.
//!
//! The clock is the pipeline's own (`Pipeline::with_clock`), moved by hand: no sleeps.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use edge_agent::filters::{Agg, DownsampleMode, IdleClose, Pipeline, StageSpec};
use sync::{Record, Value};

const S: i64 = 1_000_000_000;
/// An interval-aligned event time, the clock's start.
const T0: i64 = 1_764_374_400 * S;

fn rec(key: &str, ts: i64, v: f64, topic: &str, digest: i64) -> Record {
    Record {
        tags: Vec::new(),
        key: key.into(),
        ts,
        fields: vec![
            ("v".into(), Value::F64(v)),
            ("n".into(), Value::I64(2)),
            ("_topic".into(), Value::Str(topic.into())),
            ("_mqtt_digest".into(), Value::I64(digest)),
        ],
    }
}

fn field<'a>(r: &'a Record, name: &str) -> Option<&'a Value> {
    r.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

/// A pipeline of `specs` on a clock the test moves.
fn pipeline(specs: &[StageSpec], idle: IdleClose) -> (Pipeline, Arc<AtomicI64>) {
    let now = Arc::new(AtomicI64::new(T0));
    let clock = now.clone();
    let p = Pipeline::compile(specs)
        .unwrap()
        .with_idle_close(idle)
        .with_clock(Arc::new(move || clock.load(Ordering::SeqCst)));
    (p, now)
}

fn mean(interval_s: i64) -> StageSpec {
    StageSpec::Downsample {
        interval_ns: interval_s * S,
        mode: DownsampleMode::Mean,
    }
}

#[test]
fn mean_never_averages_internal_fields_and_carries_the_topic() {
    let (mut p, _) = pipeline(&[mean(10)], IdleClose::Off);
    let out = p.run(vec![
        rec("a", T0, 1.0, "plant/a/1", 1_000_000),
        rec("a", T0 + S, 3.0, "plant/a/2", 3_000_000),
        rec("a", T0 + 10 * S, 5.0, "plant/a/3", 7),
    ]);
    assert_eq!(out.len(), 1, "{out:?}");
    let r = &out[0];
    assert_eq!(r.ts, T0);
    assert_eq!(field(r, "v"), Some(&Value::F64(2.0)));
    assert_eq!(field(r, "n"), Some(&Value::F64(2.0)));
    assert_eq!(field(r, "_topic"), Some(&Value::Str("plant/a/2".into())));
    assert_eq!(
        field(r, "_mqtt_digest"),
        None,
        "a digest names one message: {r:?}"
    );
}

#[test]
fn a_window_carries_the_topic_and_refuses_an_internal_field() {
    let spec = |field: &str| StageSpec::Window {
        interval_ns: 10 * S,
        field: field.into(),
        aggs: vec![Agg::Count, Agg::Mean],
    };
    let (mut p, _) = pipeline(&[spec("v")], IdleClose::Off);
    let out = p.run(vec![
        rec("a", T0, 1.0, "plant/a/1", 1),
        rec("a", T0 + S, 3.0, "plant/a/2", 2),
        rec("a", T0 + 10 * S, 5.0, "plant/a/3", 3),
    ]);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(field(&out[0], "v.count"), Some(&Value::I64(2)));
    assert_eq!(
        field(&out[0], "_topic"),
        Some(&Value::Str("plant/a/2".into()))
    );
    assert_eq!(field(&out[0], "_mqtt_digest"), None);
    let err = Pipeline::compile(&[spec("_mqtt_digest")]).unwrap_err();
    assert!(err.to_string().contains("internal"), "{err}");
}

#[test]
fn a_quiet_sensors_last_interval_is_emitted_once() {
    let (mut p, now) = pipeline(&[mean(10)], IdleClose::AfterNs(5 * S));
    assert!(p.run(vec![rec("a", T0 + S, 1.0, "t", 1)]).is_empty());
    assert!(p.run(vec![rec("a", T0 + 2 * S, 3.0, "t", 2)]).is_empty());
    now.store(T0 + 14 * S, Ordering::SeqCst);
    assert!(p.close_idle().is_empty(), "end + 5 s not passed yet");
    now.store(T0 + 15 * S, Ordering::SeqCst);
    let out = p.close_idle();
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(
        (out[0].ts, field(&out[0], "v")),
        (T0, Some(&Value::F64(2.0)))
    );
    assert!(p.close_idle().is_empty(), "closed once");
    assert_eq!(p.stats().stages[0].output.load(Ordering::Relaxed), 1);

    // A record for the closed interval comes too late: counted, not emitted, not reopened.
    let late = p.stats().late_records.load(Ordering::Relaxed);
    assert!(p.run(vec![rec("a", T0 + 9 * S, 9.0, "t", 3)]).is_empty());
    now.store(T0 + 60 * S, Ordering::SeqCst);
    assert!(
        p.close_idle().is_empty(),
        "the late record reopened the interval"
    );
    assert_eq!(p.stats().late_records.load(Ordering::Relaxed), late + 1);

    // The key's next interval works as before, and is closed by the clock in turn.
    assert!(p.run(vec![rec("a", T0 + 61 * S, 4.0, "t", 4)]).is_empty());
    now.store(T0 + 76 * S, Ordering::SeqCst);
    let out = p.close_idle();
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].ts, T0 + 60 * S);
}

#[test]
fn the_default_waits_one_interval_and_off_never_closes() {
    let (mut p, now) = pipeline(&[mean(10)], IdleClose::Interval);
    p.run(vec![rec("a", T0, 1.0, "t", 1)]);
    now.store(T0 + 19 * S, Ordering::SeqCst);
    assert!(p.close_idle().is_empty());
    now.store(T0 + 20 * S, Ordering::SeqCst);
    assert_eq!(p.close_idle().len(), 1);

    let (mut p, now) = pipeline(&[mean(10)], IdleClose::Off);
    p.run(vec![rec("a", T0, 1.0, "t", 1)]);
    now.store(T0 + 3600 * S, Ordering::SeqCst);
    assert!(p.close_idle().is_empty());
}

#[test]
fn a_backfill_that_keeps_arriving_is_not_cut() {
    // Records a day old: their interval ended long ago, but the key is not quiet.
    let old = T0 - 86_400 * S;
    let (mut p, now) = pipeline(&[mean(10)], IdleClose::AfterNs(5 * S));
    for i in 0..8 {
        now.store(T0 + i * 2 * S, Ordering::SeqCst);
        assert!(
            p.run(vec![rec("b", old + i * S, i as f64, "t", i)])
                .is_empty()
        );
        assert!(p.close_idle().is_empty(), "cut after record {i}");
    }
    now.store(T0 + 14 * S + 5 * S, Ordering::SeqCst);
    let out = p.close_idle();
    assert_eq!(out.len(), 1);
    assert_eq!(
        field(&out[0], "v"),
        Some(&Value::F64(3.5)),
        "all 8 records in one interval"
    );
}

#[test]
fn windows_close_by_the_clock_through_later_stages_and_across_a_restore() {
    let specs = [
        StageSpec::Window {
            interval_ns: 10 * S,
            field: "v".into(),
            aggs: vec![Agg::Max],
        },
        StageSpec::Project(vec![("v.max".into(), Some("peak".into()))]),
    ];
    let (mut p, now) = pipeline(&specs, IdleClose::AfterNs(S));
    p.run(vec![
        rec("a", T0 + S, 1.0, "t", 1),
        rec("z", T0 + S, 7.0, "t", 2),
    ]);
    now.store(T0 + 11 * S, Ordering::SeqCst);
    let out = p.close_idle();
    let keys: Vec<&str> = out.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, ["a", "z"], "due keys close in key order");
    assert_eq!(out[1].fields, vec![("peak".into(), Value::F64(7.0))]);

    // A restored pipeline remembers what the clock closed: a late record stays late.
    let snapshot = p.snapshot();
    let (mut q, qnow) = pipeline(&specs, IdleClose::AfterNs(S));
    q.restore(&snapshot).unwrap();
    assert!(q.run(vec![rec("a", T0 + 2 * S, 9.0, "t", 3)]).is_empty());
    qnow.store(T0 + 100 * S, Ordering::SeqCst);
    assert!(
        q.close_idle().is_empty(),
        "the closed window was emitted again"
    );
    assert_eq!(q.stats().late_records.load(Ordering::Relaxed), 1);
}

mod agent {
    //! The same rule in a running agent, on the wall clock: a plain stream's pipeline (closed
    //! by the agent's once-a-second tick) and a derived stream's runner both emit a quiet
    //! key's last interval, once.

    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use edge_agent::config::EdgeConfig;
    use edge_agent::http::AppState;
    use edge_agent::http::client::Client;
    use edge_agent::log::{Log, LogHandle};
    use edge_agent::storage::RealStorage;
    use sync::{Record, Value};

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

    fn now_ns() -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64
    }

    /// Every record `stream` holds, once at least `n` are durable (polled, with a deadline).
    async fn wait_records(log: &LogHandle, stream: &str, n: u64) -> Vec<Record> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let st = log.status();
            let s = st.streams.iter().find(|s| s.stream == stream).unwrap();
            if s.durable_seq >= n {
                let (epoch, _, last) = log.epochs_held(stream)[0];
                return edge_agent::filters::derive::read_records(log, stream, epoch, 0, last)
                    .unwrap();
            }
            assert!(tokio::time::Instant::now() < deadline, "{stream}: {s:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn late(app: &AppState, stream: &str) -> u64 {
        app.ingest
            .metrics()
            .filter_reports()
            .into_iter()
            .find(|f| f.stream == stream)
            .map_or(0, |f| f.late_records)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quiet_sensors_last_interval_is_emitted_by_a_running_agent() {
        let (client, app, _dir) = serve(
            r#"
[[streams]]
name = "ds"
filters = [ { kind = "downsample", interval = "200ms", mode = "mean" } ]
idle_close_after = "100ms"
[[streams]]
name = "raw"
replicate = false
[[streams]]
name = "win"
source_stream = "raw"
filters = [ { kind = "window", interval = "200ms", field = "temp", aggs = ["count"] } ]
idle_close_after = "100ms"
"#,
        )
        .await;
        // Three readings in one interval, then the sensor goes quiet.
        let start = now_ns() / 200_000_000 * 200_000_000;
        let body: String = (0..3)
            .map(|i| {
                format!(
                    "{{\"key\":\"quiet\",\"ts\":{},\"fields\":{{\"temp\":{}}}}}\n",
                    start + i * 1_000_000,
                    10 + 2 * i
                )
            })
            .collect();
        for stream in ["ds", "raw"] {
            let r = client
                .post(
                    &format!("/v1/streams/{stream}/records"),
                    "application/x-ndjson",
                    body.clone(),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let log = app.ingest.log().clone();
        let ds = wait_records(&log, "ds", 1).await;
        assert_eq!(ds.len(), 1, "{ds:?}");
        assert_eq!(ds[0].ts, start);
        assert_eq!(ds[0].fields, vec![("temp".into(), Value::F64(12.0))]);
        let win = wait_records(&log, "win", 1).await;
        assert_eq!(win.len(), 1, "{win:?}");
        assert_eq!(win[0].fields, vec![("temp.count".into(), Value::I64(3))]);

        // A straggler for the closed interval is late on both paths, and nothing reopens.
        let straggler = format!(
            "{{\"key\":\"quiet\",\"ts\":{},\"fields\":{{\"temp\":99}}}}\n",
            start + 5_000_000
        );
        for stream in ["ds", "raw"] {
            let r = client
                .post(
                    &format!("/v1/streams/{stream}/records"),
                    "application/x-ndjson",
                    straggler.clone(),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while late(&app, "ds") < 1 || late(&app, "win") < 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the straggler was not late"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(wait_records(&log, "ds", 1).await.len(), 1);
        assert_eq!(wait_records(&log, "win", 1).await.len(), 1);
    }
}
