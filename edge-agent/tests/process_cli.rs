//! The `edge-agent` command line against the real binary: `ingest` from stdin, `status`,
//! `inspect`, the data directory lock, clean shutdown on SIGTERM, and the messages a user sees
//! when something is wrong (each must say what to fix).

mod process_support;

use std::sync::Arc;

use edge_agent::config::EdgeConfig;
use edge_agent::log::Log;
use edge_agent::storage::RealStorage;
use process_support::{Setup, by_seq, epoch_of, run_cli};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn sample(n: usize) -> String {
    (0..n)
        .map(|i| format!("{{\"key\":\"truck-{:04}/engine\",\"ts\":{},\"fields\":{{\"temp_c\":{}.5,\"n\":{i}}}}}\n", i % 3, 1_764_374_400_000_000_000i64 + i as i64, 60 + i % 30))
        .collect()
}

#[test]
fn ingest_status_inspect_round_trip() {
    let setup = Setup::new("fsync = \"always\"");
    let config = setup.config.to_str().unwrap().to_owned();
    let mut agent = setup.start();

    // 2,500 lines in batches of 1,000: three atomic, durable requests.
    let input = sample(2500);
    let out = setup.cli(
        &["ingest", "--stream", "telemetry", "--config", &config],
        Some(input.as_bytes()),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains("ingested 2500 records")
            && said.contains("3 batches")
            && said.contains("seqs 1..=2500"),
        "{said}"
    );

    let lp = "telemetry,device=truck-9,unit=gps lat=52.5,lon=13.25 1764374400000000000\n";
    let out = setup.cli(
        &[
            "ingest",
            "-s",
            "telemetry",
            "--format",
            "line",
            "--url",
            &setup.url(),
        ],
        Some(lp.as_bytes()),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));

    let out = setup.cli(&["status", "--config", &config], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    for want in [
        "link      not configured",
        "fsync always",
        "telemetry",
        "2502",
        "OLDEST UNSENT",
        "0 records",
    ] {
        assert!(table.contains(want), "status lacks {want:?}:\n{table}");
    }
    let out = setup.cli(&["status", "--url", &setup.url(), "--json"], None);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["streams"][0]["durable_seq"].as_u64(), Some(2501));
    assert_eq!(report["link"], "not_configured");

    // inspect refuses while the agent holds the data directory, and so does a second agent.
    let out = setup.cli(
        &["inspect", "--config", &config, "--stream", "telemetry"],
        None,
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("is using the data directory"),
        "{}",
        text(&out.stderr)
    );
    let out = setup.cli(&["run", "--config", &config], None);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("another edge-agent"),
        "{}",
        text(&out.stderr)
    );

    agent.terminate();
    let lines = setup.inspect();
    let (_, seqs) = by_seq(&lines);
    assert_eq!(seqs.len(), 2501);
    assert_eq!(seqs[&1]["key"], "truck-0000/engine");
    assert_eq!(seqs[&1]["fields"]["temp_c"].as_f64(), Some(60.5));
    assert_eq!(seqs[&2501]["key"], "device=truck-9/unit=gps");
    assert_eq!(seqs[&2501]["tags"]["device"], "truck-9");
    let out = setup.cli(
        &[
            "inspect",
            "--config",
            &config,
            "--stream",
            "telemetry",
            "--from-seq",
            "2500",
        ],
        None,
    );
    assert_eq!(
        text(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out.stderr)
    );
}

/// Every JSON the agent writes carries the epoch as 16 hex digits, a string (a random epoch is
/// almost always above 2^53, where a JavaScript number loses digits): the ingest ack, the
/// status (`/v1/status` and `status --json`) and `inspect`, each the log's own epoch, which
/// `ingest` reads back from the ack for its summary.
#[test]
fn epochs_are_hex_strings_in_acks_status_and_inspect() {
    let setup = Setup::new("fsync = \"always\"");
    let config = setup.config.to_str().unwrap().to_owned();
    let mut agent = setup.start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = setup.client();
    let r = rt
        .block_on(client.post(
            "/v1/streams/telemetry/records",
            "application/x-ndjson",
            sample(3),
        ))
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let ack: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    let epoch = epoch_of(&ack);
    assert_eq!(
        ack["last_seq"].as_u64(),
        Some(3),
        "seqs stay numbers: {ack}"
    );

    let r = rt.block_on(client.get("/v1/status")).unwrap();
    let status: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(epoch_of(&status), epoch, "{status}");
    assert_eq!(epoch_of(&status["streams"][0]), epoch, "{status}");
    let out = setup.cli(&["status", "--config", &config, "--json"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(epoch_of(&printed), epoch, "{printed}");
    assert_eq!(epoch_of(&printed["streams"][0]), epoch, "{printed}");

    let out = setup.cli(
        &["ingest", "--stream", "telemetry", "--config", &config],
        Some(sample(2).as_bytes()),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains(&format!("(epoch {epoch:016x}, seqs 4..=5)")),
        "{said}"
    );

    agent.terminate();
    let lines = setup.inspect();
    assert_eq!(lines.len(), 5);
    let (inspected, _) = by_seq(&lines);
    assert_eq!(inspected, epoch);
    let cfg = EdgeConfig::load(&setup.config).unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    assert_eq!(log.epoch(), epoch, "the JSON epoch is not the log's");
    log.shutdown();
}

#[test]
fn ingest_explains_what_to_fix() {
    let setup = Setup::new("");
    let config = setup.config.to_str().unwrap().to_owned();

    // No agent running.
    let out = setup.cli(
        &["ingest", "--stream", "telemetry", "--config", &config],
        Some(b"{}\n"),
    );
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("could not reach the agent at http://127.0.0.1:")
            && e.contains("is `edge-agent run` running?"),
        "{e}"
    );
    let out = setup.cli(&["status", "--config", &config], None);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("is `edge-agent run` running?"));

    let _agent = setup.start();
    let out = setup.cli(
        &["ingest", "--stream", "nope", "--config", &config],
        Some(sample(2).as_bytes()),
    );
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("HTTP 404") && e.contains("unknown stream \"nope\""),
        "{e}"
    );

    // A bad line in the second batch: its stdin line number, and what was stored before it.
    let mut input = sample(5);
    input.push_str("{\"key\":\"a\",\"ts\":1,\"fields\":{\"x\":tru}}\n");
    let out = setup.cli(
        &[
            "ingest",
            "--stream",
            "telemetry",
            "--config",
            &config,
            "--batch-lines",
            "3",
        ],
        Some(input.as_bytes()),
    );
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("stdin line 6, column")
            && e.contains("HTTP 400")
            && e.contains("the 3 records before"),
        "{e}"
    );
}

#[test]
fn bad_config_names_the_key_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edge.toml");
    std::fs::write(
        &path,
        "data_dir = \"d\"\n[storage]\nfsync = \"sometimes\"\n[[streams]]\nname = \"t\"\n",
    )
    .unwrap();
    let out = run_cli(&["run", "--config", path.to_str().unwrap()], None);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(
        e.contains("storage.fsync: expected always | interval:<N>ms | never, found \"sometimes\""),
        "{e}"
    );
}

#[test]
fn example_config_runs_with_environment_overrides() {
    // The README's main command, pointed at a temporary data dir and port through the environment.
    let dir = tempfile::tempdir().unwrap();
    let port = process_support::free_port();
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/edge.toml");
    let mut child = std::process::Command::new(process_support::BIN)
        .args(["run", "--config", example.to_str().unwrap()])
        .env("TRIBUTARY_EDGE__DATA_DIR", dir.path().join("data"))
        .env("TRIBUTARY_EDGE__HTTP__LISTEN", format!("127.0.0.1:{port}"))
        .env("TRIBUTARY_EDGE__STORAGE__FSYNC", "always")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let sample = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/sample.ndjson");
    let input = std::fs::read(&sample).unwrap();
    let lines = input.iter().filter(|b| **b == b'\n').count();
    // Wait for readiness by retrying status (it fails fast while nothing listens).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !run_cli(&["status", "--url", &url], None).status.success() {
        assert!(
            std::time::Instant::now() < deadline,
            "the example agent never became ready"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the example agent exited"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = run_cli(
        &["ingest", "--stream", "telemetry", "--url", &url],
        Some(&input),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&format!("ingested {lines} records")),
        "{}",
        text(&out.stderr)
    );
    let out = run_cli(&["status", "--url", &url, "--json"], None);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["fsync"], "always",
        "the environment override applied"
    );
    assert_eq!(
        report["streams"][0]["durable_seq"].as_u64(),
        Some(lines as u64)
    );
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        dir.path().join("data").join("LOCK").exists(),
        "the data_dir override applied"
    );
}
