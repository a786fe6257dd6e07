//! The hub's command line as an operator meets it, through the real binary: one-line errors
//! with documented exit codes (no error chain, no backtrace), a closed stdout ends quietly,
//! tables by default and the API's JSON with `--json`, `completeness` over a half-open window
//! with relative times, epochs in one hex form across JSON, NDJSON, tables and metrics,
//! `read --follow` across a hub killed and restarted (no gap, no duplicate; a documented
//! give-up), and `export` of every committed record, tiered or not.

mod tier_support;

use core_hub::api;
use core_hub::completeness::CompletenessConfig;
use core_hub::config::HttpConfig;
use serde_json::Value;
use std::path::Path;
use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tier_support::common;

#[path = "../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

const BIN: &str = env!("CARGO_BIN_EXE_core-hub");
/// Event time of seq 0 in `common::record`; seq `s` is `s` ms later.
const BASE_TS: i64 = 1_764_374_400_000_000_000;
const MS: i64 = 1_000_000;
/// An epoch above 2^53, which a JavaScript number would round.
const BIG_EPOCH: u64 = 0x9e37_79b9_7f4a_7c15;

fn cmd(args: &[&str]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(BIN);
    c.args(args)
        .env_remove("TRIBUTARY_HUB_TOKEN")
        .env_remove("RUST_BACKTRACE")
        .env("RUST_LOG", "warn");
    c
}

async fn run(args: &[&str]) -> Output {
    cmd(args).output().await.unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The CLI's error style: exactly one line, prefixed, with neither a chain nor a backtrace.
fn assert_one_error_line(out: &Output, code: i32) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("core-hub: "), "{err}");
    for bad in ["Caused by", "backtrace", "panicked", "Error: "] {
        assert!(!err.contains(bad), "`{bad}` in {err:?}");
    }
    err
}

/// A hub with `telemetry` from two devices (seqs 1..=20 each), the second in a big epoch,
/// served on loopback; returns its URL.
async fn serve_hub(dir: &Path) -> (Arc<core_hub::Hub>, String) {
    let hub = common::open(dir);
    hub.commit_block("van-1", "telemetry", &common::block("van-1", 1, 1, 20))
        .await
        .unwrap();
    hub.commit_block(
        "van-2",
        "telemetry",
        &common::block("van-2", BIG_EPOCH, 1, 20),
    )
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let http = HttpConfig::default();
    let guard = api::guard(&http);
    let router = api::router_for(hub.clone(), &http, CompletenessConfig::default(), guard);
    tokio::spawn(api::serve(listener, router, std::future::pending()));
    (hub, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_one_line_with_an_exit_code_and_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on this port: exit 3, naming the address and what to do.
    let url = format!("http://127.0.0.1:{}", ports::tcp());
    let err = assert_one_error_line(&run(&["streams", "--url", &url]).await, 3);
    assert!(
        err.contains("cannot reach the hub") && err.contains("--url"),
        "{err}"
    );

    // `read` with neither --url nor --config, and no hub.toml here: how to point it at a hub.
    let out = cmd(&["read", "telemetry"])
        .current_dir(dir.path())
        .output()
        .await
        .unwrap();
    let err = assert_one_error_line(&out, 1);
    assert!(err.contains("--url") && err.contains("--config"), "{err}");

    // A config that does not parse: the file named, on one line.
    let bad = dir.path().join("hub.toml");
    std::fs::write(&bad, "data_dir = 7\n").unwrap();
    let out = run(&["devices", "--config", bad.to_str().unwrap()]).await;
    let err = assert_one_error_line(&out, 1);
    assert!(err.contains("hub.toml"), "{err}");

    // A hub answering an error: its status and message.
    let (hub, url) = serve_hub(&dir.path().join("hub")).await;
    let err = assert_one_error_line(&run(&["streams", "nope", "--url", &url]).await, 1);
    assert!(err.contains("404") && err.contains("nope"), "{err}");
    let out = run(&[
        "completeness",
        "telemetry",
        "--from",
        "yesterday-ish",
        "--url",
        &url,
    ])
    .await;
    let err = assert_one_error_line(&out, 1);
    assert!(
        err.contains("--from") && err.contains("yesterday-ish"),
        "{err}"
    );
    hub.shutdown();
}

/// Runs `args` with stdout a pipe whose reading end is already closed (`| head` that has
/// exited): every write meets EPIPE.
async fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut c = cmd(args);
    c.stdout(Stdio::from(writer)).stderr(Stdio::piped());
    c.output().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, url) = serve_hub(dir.path()).await;
    for args in [
        vec!["streams", "--url", &url],
        vec!["streams", "--json", "--url", &url],
        vec!["devices", "--url", &url],
        vec!["read", "telemetry", "--url", &url],
    ] {
        let out = with_closed_stdout(&args).await;
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stderr), "", "{args:?} is quiet");
    }
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_by_default_json_for_scripts_and_one_epoch_form() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, url) = serve_hub(dir.path()).await;
    let hex = format!("{BIG_EPOCH:016x}");

    let out = run(&["streams", "--url", &url]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[0].split_whitespace().next(),
        Some("STREAM"),
        "{table}"
    );
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        vec!["telemetry", "40", "40"],
        "{table}"
    );
    let out = run(&["streams", "--json", "--url", &url]).await;
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json[0]["name"], "telemetry");
    assert_eq!(json[0]["records"], 40);

    // Detail: RFC 3339 times, not integer ns.
    let out = run(&["streams", "telemetry", "--url", &url]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let detail = text(&out.stdout);
    assert!(detail.contains("records       40"), "{detail}");
    assert!(detail.contains("2025-11-29T00:00:00.020Z"), "{detail}");

    // Devices: a table with the epoch in hex; JSON with the epoch as that same string.
    let out = run(&["devices", "--url", &url]).await;
    let table = text(&out.stdout);
    assert!(table.starts_with("DEVICE"), "{table}");
    let van2 = table.lines().find(|l| l.starts_with("van-2")).unwrap();
    assert!(van2.contains(&hex) && van2.contains("active"), "{table}");
    let out = run(&["devices", "--json", "--url", &url]).await;
    let devices: Value = serde_json::from_slice(&out.stdout).unwrap();
    let marks = &devices[1]["marks"][0];
    assert_eq!(devices[1]["id"], "van-2");
    assert_eq!(marks["epoch"], Value::String(hex.clone()), "{devices:#}");
    assert_eq!(devices[0]["marks"][0]["epoch"], "0000000000000001");

    // The records NDJSON and the metrics label say the same.
    let out = run(&["read", "telemetry", "--url", &url]).await;
    let line = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["device"] == "van-2")
        .unwrap();
    assert_eq!(line["epoch"], Value::String(hex.clone()));
    let target = core_hub::client::ApiTarget::parse(&url, None).unwrap();
    let metrics = core_hub::client::get(&target, "/metrics").await.unwrap();
    let metrics = text(&metrics.body);
    assert!(
        metrics.contains(&format!(
            "device=\"van-2\",stream=\"telemetry\",epoch=\"{hex}\""
        )),
        "{metrics}"
    );
    assert!(!metrics.contains(&format!("epoch=\"{BIG_EPOCH}\"")));
    hub.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completeness_over_a_half_open_window_with_relative_times() {
    let dir = tempfile::tempdir().unwrap();
    let (hub, url) = serve_hub(dir.path()).await;
    let t = (BASE_TS + 10 * MS).to_string();
    let t1 = (BASE_TS + 10 * MS + 1).to_string();
    // [t, t) holds no instant: refused, where an inclusive `to` answered for one.
    let out = run(&[
        "completeness",
        "telemetry",
        "--from",
        &t,
        "--to",
        &t,
        "--url",
        &url,
    ])
    .await;
    let err = assert_one_error_line(&out, 1);
    assert!(err.contains("400"), "{err}");
    // [t, t + 1 ns): the answer names the window as given.
    let out = run(&[
        "completeness",
        "telemetry",
        "--from",
        &t,
        "--to",
        &t1,
        "--json",
        "--url",
        &url,
    ])
    .await;
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["from_ns"].as_i64(), Some(BASE_TS + 10 * MS));
    assert_eq!(answer["to_ns"].as_i64(), Some(BASE_TS + 10 * MS + 1));
    let want = match answer["status"].as_str().unwrap() {
        "complete" => 0,
        "owed" => 4,
        "complete_with_gaps" => 5,
        s => panic!("status {s}"),
    };
    assert_eq!(
        out.status.code(),
        Some(want),
        "the exit code says the answer"
    );

    // Relative times are resolved against the clock: `-1h` to now.
    let before = now();
    let out = run(&[
        "completeness",
        "telemetry",
        "--from",
        "-1h",
        "--json",
        "--url",
        &url,
    ])
    .await;
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {} {}", text(&out.stdout), text(&out.stderr));
    });
    let from = answer["from_ns"].as_i64().unwrap();
    let hour = 3_600_000_000_000;
    assert!(
        (before - hour - 60_000_000_000..=now() - hour).contains(&from),
        "{from}"
    );
    // For people: the verdict with RFC 3339 times.
    let out = run(&[
        "completeness",
        "telemetry",
        "--from",
        &t,
        "--to",
        &t1,
        "--url",
        &url,
    ])
    .await;
    let human = text(&out.stdout);
    assert!(
        human.starts_with("telemetry [2025-11-29T00:00:00.010Z, 2025-11-29T00:00:00.010Z): "),
        "{human}"
    );
    hub.shutdown();
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

/// A hub config file for `data_dir` with its API on `port` and tier 2 in `tier2`.
fn hub_toml(dir: &Path, data_dir: &Path, port: u16, tier2: &Path) -> std::path::PathBuf {
    let path = dir.join("hub.toml");
    let toml = format!(
        "data_dir = \"{}\"\n[listen]\nhttp = \"127.0.0.1:{port}\"\n[tier2]\nurl = \"file://{}\"\n",
        data_dir.display(),
        tier2.display()
    );
    std::fs::write(&path, toml).unwrap();
    path
}

/// A running `core-hub run`, ready (`/healthz` 200).
struct HubProcess(tokio::process::Child);

impl HubProcess {
    async fn start(config: &Path, port: u16) -> HubProcess {
        let child = cmd(&["run", "--config", config.to_str().unwrap()])
            .kill_on_drop(true)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let target =
            core_hub::client::ApiTarget::parse(&format!("http://127.0.0.1:{port}"), None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = core_hub::client::get(&target, "/healthz").await
                && r.status == 200
            {
                return HubProcess(child);
            }
            assert!(Instant::now() < deadline, "the hub did not become ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn kill(mut self) {
        self.0.kill().await.unwrap();
    }

    /// SIGTERM, and the hub's exit within a deadline.
    async fn stop(mut self) {
        let pid = self.0.id().unwrap().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(sent.success());
        let exit = tokio::time::timeout(Duration::from_secs(60), self.0.wait())
            .await
            .expect("the hub did not stop on SIGTERM with a follow reader connected")
            .unwrap();
        assert!(exit.success(), "{exit:?}");
    }
}

/// Commits `van-1`'s seqs `first..=last` into the (stopped) hub's data directory.
async fn commit_offline(data_dir: &Path, first: u64, last: u64) {
    let hub = tier_support::reopen(&common::config(data_dir, |_| {})).await;
    hub.commit_block(
        "van-1",
        "telemetry",
        &common::block("van-1", 1, first, last),
    )
    .await
    .unwrap();
    hub.shutdown();
}

/// Reads NDJSON lines from `out` until `n` have arrived (within a deadline).
async fn read_lines(
    out: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    seqs: &mut Vec<u64>,
    n: usize,
) {
    let deadline = Duration::from_secs(60);
    while seqs.len() < n {
        let got = seqs.len();
        let line = tokio::time::timeout(deadline, out.next_line())
            .await
            .unwrap_or_else(|_| panic!("the follow reader went quiet after {got} of {n} records"))
            .unwrap()
            .unwrap_or_else(|| panic!("the follow reader ended after {got} of {n} records"));
        let v: Value = serde_json::from_str(&line).unwrap();
        seqs.push(v["seq"].as_u64().unwrap());
    }
}

/// Waits until the hub holds `n` follow responses open, so that a reader that has printed
/// every record has also switched from paging to following.
async fn wait_follows(url: &str, n: u64) {
    let target = core_hub::client::ApiTarget::parse(url, None).unwrap();
    let want = format!("tributary_hub_read_follows_active {n}\n");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let metrics = text(
            &core_hub::client::get(&target, "/metrics")
                .await
                .unwrap()
                .body,
        );
        if metrics.contains(&want) {
            return;
        }
        let seen: Vec<&str> = metrics.lines().filter(|l| l.contains("follow")).collect();
        assert!(
            Instant::now() < deadline,
            "not {n} follow responses: {seen:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_survives_a_hub_restart_without_gaps_or_duplicates() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    commit_offline(&data, 1, 100).await;
    let port = ports::tcp();
    let config = hub_toml(dir.path(), &data, port, &dir.path().join("tier2"));
    let url = format!("http://127.0.0.1:{port}");
    let hub = HubProcess::start(&config, port).await;

    let mut reader = cmd(&[
        "read",
        "telemetry",
        "--follow",
        "--retry-for",
        "2m",
        "--url",
        &url,
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()
    .unwrap();
    let mut out = tokio::io::BufReader::new(reader.stdout.take().unwrap()).lines();
    let mut seqs = Vec::new();
    read_lines(&mut out, &mut seqs, 100).await;

    // The hub dies under the reader; more records commit while it is down.
    hub.kill().await;
    commit_offline(&data, 101, 150).await;
    let hub = HubProcess::start(&config, port).await;
    read_lines(&mut out, &mut seqs, 150).await;
    // The reader may still be paging through what committed while the hub was down; the
    // shutdown line below is the follow response's.
    wait_follows(&url, 1).await;
    // A clean stop (SIGTERM: the hub ends the follow with its shutdown line) and a restart.
    hub.stop().await;
    commit_offline(&data, 151, 160).await;
    let hub = HubProcess::start(&config, port).await;
    read_lines(&mut out, &mut seqs, 160).await;
    assert_eq!(
        seqs,
        (1..=160).collect::<Vec<_>>(),
        "every record once, in order"
    );
    assert!(
        reader.try_wait().unwrap().is_none(),
        "the reader is still following"
    );
    reader.start_kill().unwrap();
    let waited = reader.wait_with_output().await.unwrap();
    let err = text(&waited.stderr);
    assert!(
        err.contains("lost the hub") && err.contains("reconnecting"),
        "{err}"
    );
    assert_eq!(err.matches("reconnected").count(), 2, "{err}");
    assert!(
        err.contains("shutting down") || err.contains("shutting_down"),
        "{err}"
    );

    // A reader with a short --retry-for gives up with exit 3 once the hub stays down.
    let mut quick = cmd(&[
        "read",
        "telemetry",
        "--follow",
        "--retry-for",
        "1s",
        "--url",
        &url,
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true)
    .spawn()
    .unwrap();
    let mut out = tokio::io::BufReader::new(quick.stdout.take().unwrap()).lines();
    let mut seqs = Vec::new();
    read_lines(&mut out, &mut seqs, 160).await;
    hub.kill().await;
    let done = tokio::time::timeout(Duration::from_secs(60), quick.wait_with_output())
        .await
        .expect("the reader never gave up")
        .unwrap();
    let err = text(&done.stderr);
    assert_eq!(done.status.code(), Some(3), "{err}");
    let last = err.lines().last().unwrap();
    assert!(
        last.contains("gave up") && last.contains("resume with --from "),
        "{err}"
    );
}

/// Decodes an export and returns its `(seq, offset)` pairs.
fn exported(path: &Path) -> Vec<(u64, u64)> {
    let bytes = std::fs::read(path).unwrap();
    tier::decode_chunk(bytes.into())
        .unwrap()
        .into_iter()
        .map(|r| (r.seq, r.offset))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_holds_every_committed_record_tiered_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let (data, tier2) = (dir.path().join("data"), dir.path().join("tier2"));
    let cfg = common::config(&data, |c| {
        c.tier2.url = format!("file://{}", tier2.display());
        c.tier2.chunk_records_max = 1_000;
        c.tier2.chunk_age_max = Duration::from_secs(3600);
    });
    let (hub, tiering) = tier_support::open(&cfg).await;
    tier_support::ingest(&hub, "van-1", 1, 2_000, 100).await;
    tier_support::flush(&tiering).await;
    // Committed after the last tiering round: in tier 1 only.
    tier_support::ingest(&hub, "van-1", 2_001, 2_600, 100).await;
    let port = ports::tcp();
    let config = hub_toml(dir.path(), &data, port, &tier2);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let http = HttpConfig::default();
    let guard = api::guard(&http);
    let router = api::router_for(hub.clone(), &http, CompletenessConfig::default(), guard);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(api::serve(listener, router, async move {
        let _ = stop_rx.await;
    }));
    let cfg_s = config.to_str().unwrap();

    // Through the running hub's API: [seq 1, seq 2600) holds seqs 1..=2599, 599 untiered.
    let out_a = dir.path().join("a.parquet");
    let (from, to) = (
        (BASE_TS + MS).to_string(),
        (BASE_TS + 2_600 * MS).to_string(),
    );
    let args = [
        "export",
        "telemetry",
        "--from",
        &from,
        "--to",
        &to,
        "--config",
        cfg_s,
    ];
    let out = run(&[&args[..], &["--out", out_a.to_str().unwrap()]].concat()).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("599 records not yet tiered"),
        "{}",
        text(&out.stdout)
    );
    let got = exported(&out_a);
    assert_eq!(
        got.iter().map(|r| r.0).collect::<Vec<_>>(),
        (1..=2_599).collect::<Vec<_>>(),
        "every committed record of the window once, the one at `to` left out"
    );
    assert!(got.windows(2).all(|w| w[0].1 < w[1].1), "offset order");

    // An empty window, and relative times (these records are from 2025): exit 0, no file.
    for (f, t) in [
        (
            (BASE_TS - 7_200_000 * MS).to_string(),
            (BASE_TS - 3_600_000 * MS).to_string(),
        ),
        ("-1h".to_string(), "now".to_string()),
    ] {
        let empty = dir.path().join("empty.parquet");
        let out = run(&[
            "export",
            "telemetry",
            "--from",
            &f,
            "--to",
            &t,
            "--config",
            cfg_s,
            "--out",
            empty.to_str().unwrap(),
        ])
        .await;
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(text(&out.stdout).starts_with("no records of `telemetry`"));
        assert!(!empty.exists());
    }

    // With the hub stopped, from its data directory: the same records.
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    drop(tiering);
    hub.shutdown();
    drop(hub);
    tier_support::reopen(&cfg).await.shutdown();
    let out_b = dir.path().join("b.parquet");
    let out = run(&[&args[..], &["--out", out_b.to_str().unwrap()]].concat()).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(exported(&out_b), got);
    // Tier 2 alone only when asked for.
    let out_c = dir.path().join("c.parquet");
    let out = run(&[
        &args[..],
        &["--tier2-only", "--out", out_c.to_str().unwrap()],
    ]
    .concat())
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(exported(&out_c).len(), 2_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_renders_again_and_again() {
    use tokio::io::AsyncBufReadExt;
    let dir = tempfile::tempdir().unwrap();
    let (hub, url) = serve_hub(dir.path()).await;
    let mut watch = cmd(&["status", "--watch", "1", "--url", &url])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let (mut renders, mut saw_table) = (0, false);
    while renders < 3 {
        let line = tokio::time::timeout(Duration::from_secs(30), out.next_line())
            .await
            .expect("status --watch went quiet")
            .unwrap()
            .expect("status --watch ended");
        renders += usize::from(line.starts_with("health: ok"));
        saw_table |= line.split_whitespace().collect::<Vec<_>>() == ["telemetry", "40", "40"];
    }
    assert!(saw_table, "each rendering has the stream table");
    assert!(watch.try_wait().unwrap().is_none(), "--watch keeps running");
    watch.start_kill().unwrap();
    hub.shutdown();
}
