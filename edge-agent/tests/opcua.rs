//! The OPC UA source inside the real agent, against a real OPC UA server: asyncua serving
//! `opcua_server.py` on a loopback port, its variables changing every 100 ms. Values arrive
//! with their names, types, tags and source timestamps. The server is then killed and started
//! again on the same port: the subscription comes back by itself, records resume from the new
//! server, exactly one gap record covers the outage, and the reconnect is counted.
//!
//! Mutation check: with the `fault-injection` switch that skips re-creating the subscription
//! after a session loss, the same scenario sees the session come back but no records resume.

mod opcua_support;
mod process_support;

use std::time::{Duration, Instant};

use opcua_support::{Server, metric};
use process_support::Setup;
use serde_json::Value as Json;

const DEADLINE: Duration = Duration::from_secs(60);

/// The restarted server's counter starts above this; the first server's stays below it.
const SECOND_BASE: i64 = 1_000_000;

/// How long the mutated run waits for records that must not come: 50 sampling intervals.
const MUTATION_WAIT: Duration = Duration::from_secs(5);

fn now_ns() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(d.as_nanos()).unwrap()
}

const ITEMS: &str = r#"
[[sources.items]]
node_id = "ns=2;s=Counter"
name = "counter"
sampling_interval = "100ms"
queue_size = "10"
tags = { line = "3" }
[[sources.items]]
node_id = "ns=2;s=Temp"
name = "temp"
sampling_interval = "100ms"
queue_size = "10"
deadband = "0.01"
deadband_type = "absolute"
[[sources.items]]
node_id = "ns=2;s=Running"
name = "running"
sampling_interval = "100ms"
[[sources.items]]
node_id = "ns=2;s=Label"
name = "label"
sampling_interval = "100ms"
"#;

/// What one run saw.
struct Run {
    records: Vec<Json>,
    /// Just before the server was killed, and just before it was started again.
    killed_ns: i64,
    restarted_ns: i64,
    /// Once the agent reported the reconnect.
    reconnected_ns: i64,
    /// Records appended after the reconnect, before the run ended.
    resumed: bool,
    reconnects: f64,
    gaps: f64,
}

/// Runs the agent against the server, restarts the server mid-run, and waits up to `resume`
/// for records from the new server.
fn run(env: &[(&str, &str)], resume: Duration) -> Run {
    let setup = Setup::new("fsync = \"always\"");
    let port = process_support::free_port();
    let config = format!(
        "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{http}\"\n[[streams]]\nname = \"telemetry\"\n\
         [[sources]]\nkind = \"opcua\"\nendpoint = \"opc.tcp://127.0.0.1:{port}/tributary/\"\n\
         publishing_interval = \"200ms\"\ntimeout = \"2s\"\nstream = \"telemetry\"\nkey = \"plant/opcua\"\n{ITEMS}",
        http = setup.port,
    );
    std::fs::write(&setup.config, config).unwrap();
    let mut server = Server::start(port, 0, &[]);
    let mut agent = setup.start_with_env(env);
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = |path: &str| rt.block_on(client.get(path)).unwrap().text();
    let status = || -> Json { serde_json::from_str(&get("/v1/status")).unwrap() };
    let next_seq = || status()["streams"][0]["next_seq"].as_u64().unwrap();
    let m = |name: &str| {
        metric(
            &get("/metrics"),
            &format!("tributary_edge_opcua_{name}{{source=\"0\"}}"),
        )
        .unwrap_or(-1.0)
    };
    let wait = |what: &str, deadline: Duration, cond: &dyn Fn() -> bool| -> bool {
        let end = Instant::now() + deadline;
        while !cond() {
            if Instant::now() >= end {
                return false;
            }
            // Polling the condition itself; the pause only spaces the probes.
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = what;
        true
    };
    let must = |what: &str, cond: &dyn Fn() -> bool| {
        assert!(
            wait(what, DEADLINE, cond),
            "timed out waiting for {what}: {}",
            status()
        );
    };

    must("20 records from the first server", &|| next_seq() >= 21);
    assert_eq!(m("up"), 1.0);
    assert_eq!(m("reconnects_total"), 0.0, "no loss yet");

    // The fault: the server dies, the agent notices, and a connect fails while it is away.
    let killed_ns = now_ns();
    server.kill();
    must("the session reported lost and a failed connect", &|| {
        m("up") == 0.0 && m("connect_errors_total") >= 1.0
    });
    let restarted_ns = now_ns();
    let _server = Server::start(port, SECOND_BASE, &[]);
    must("the reconnect counted", &|| m("reconnects_total") >= 1.0);
    let reconnected_ns = now_ns();
    let seq_back = next_seq();
    let resumed = wait("20 records from the second server", resume, &|| {
        next_seq() >= seq_back + 20
    });
    let (reconnects, gaps) = (m("reconnects_total"), m("gaps_total"));
    agent.terminate();
    Run {
        records: setup.inspect(),
        killed_ns,
        restarted_ns,
        reconnected_ns,
        resumed,
        reconnects,
        gaps,
    }
}

fn is_gap(r: &Json) -> bool {
    r["tags"]["opcua_event"] == "gap"
}

#[test]
fn values_arrive_and_the_subscription_comes_back_after_a_server_restart() {
    let started_ns = now_ns();
    let run = run(&[], DEADLINE);
    assert!(run.resumed, "records resume after the restart");
    assert!(
        run.reconnects >= 1.0,
        "the fault happened: {}",
        run.reconnects
    );
    assert_eq!(run.gaps, 1.0);

    let gaps: Vec<&Json> = run.records.iter().filter(|r| is_gap(r)).collect();
    assert_eq!(gaps.len(), 1, "exactly one gap record: {gaps:?}");
    let gap = gaps[0];
    let start = gap["fields"]["_opcua_gap_start_ns"].as_i64().unwrap();
    let end = gap["fields"]["_opcua_gap_end_ns"].as_i64().unwrap();
    assert_eq!(gap["key"], "plant/opcua");
    assert_eq!(gap["ts"].as_i64(), Some(start));
    // The gap covers the outage: it opens once the server is gone and closes once the new
    // server's subscription is in place.
    assert!(run.killed_ns <= start && start < run.restarted_ns, "{gap}");
    assert!(
        run.restarted_ns <= end && end <= run.reconnected_ns,
        "{gap}"
    );

    let gap_seq = gap["seq"].as_u64().unwrap();
    let (mut before, mut after) = (0, 0);
    let mut by_ts: std::collections::HashMap<i64, (Option<i64>, Option<String>)> =
        std::collections::HashMap::new();
    for r in run.records.iter().filter(|r| !is_gap(r)) {
        assert_eq!(r["key"], "plant/opcua", "{r}");
        let ts = r["ts"].as_i64().unwrap();
        assert!(
            started_ns <= ts && ts <= now_ns(),
            "a source timestamp of this run: {r}"
        );
        let fields = r["fields"].as_object().unwrap();
        assert_eq!(fields.len(), 1, "one field per data change: {r}");
        let (name, v) = fields.iter().next().unwrap();
        let node = match name.as_str() {
            "counter" => {
                let n = v
                    .as_i64()
                    .unwrap_or_else(|| panic!("Int32 stays an integer: {r}"));
                assert_eq!(r["tags"]["line"], "3", "the item's own tag: {r}");
                by_ts.entry(ts).or_default().0 = Some(n);
                // The restarted server counts from SECOND_BASE: each value is its server's.
                let second = r["seq"].as_u64().unwrap() > gap_seq;
                assert_eq!(n > SECOND_BASE, second, "counter of the right server: {r}");
                "ns=2;s=Counter"
            }
            "temp" => {
                assert!(v.is_f64(), "Double stays a float: {r}");
                "ns=2;s=Temp"
            }
            "running" => {
                assert!(v.is_boolean(), "{r}");
                "ns=2;s=Running"
            }
            "label" => {
                let s = v
                    .as_str()
                    .unwrap_or_else(|| panic!("String stays a string: {r}"));
                by_ts.entry(ts).or_default().1 = Some(s.to_owned());
                "ns=2;s=Label"
            }
            other => panic!("unexpected field {other}: {r}"),
        };
        assert_eq!(r["tags"]["node"], node, "{r}");
        if r["seq"].as_u64().unwrap() < gap_seq {
            before += 1;
            assert!(ts <= start, "a value from before the loss: {r}");
        } else {
            after += 1;
            assert!(ts >= run.restarted_ns, "a value from the new server: {r}");
        }
    }
    assert!(
        before >= 19 && after >= 19,
        "{before} records before the gap, {after} after"
    );
    // Values sampled at one instant carry that instant: the label and the counter agree.
    let pairs: Vec<_> = by_ts
        .values()
        .filter_map(|(n, s)| Some((n.as_ref()?, s.as_ref()?)))
        .collect();
    assert!(pairs.len() >= 5, "{} label/counter pairs", pairs.len());
    for (n, s) in pairs {
        assert_eq!(*s, format!("n{n}"), "one source timestamp, one server tick");
    }
}

#[test]
fn without_resubscribing_the_test_sees_no_records_after_the_restart() {
    let run = run(
        &[("TRIBUTARY_FAULT_OPCUA_NO_RESUBSCRIBE", "1")],
        MUTATION_WAIT,
    );
    assert!(
        run.reconnects >= 1.0,
        "the session came back: {}",
        run.reconnects
    );
    assert!(
        !run.resumed,
        "with the subscription not re-created, records must not resume"
    );
    let after_gap = run
        .records
        .iter()
        .skip_while(|r| !is_gap(r))
        .filter(|r| !is_gap(r))
        .count();
    assert_eq!(after_gap, 0, "no data record after the gap");
}
