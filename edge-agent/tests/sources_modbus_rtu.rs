//! The Modbus source over a serial line (RTU) inside the real agent, against a real peer:
//! pymodbus's serial RTU server (`modbus_rtu_server.py`) on one end of a socat pseudo-terminal
//! pair, the agent on the other. Three RTU sources share the one line: unit 1 (values in
//! ABCD order), unit 3, which never answers, and unit 2 (the same values in DCBA order). The
//! values decode as configured; the dead unit's timeouts are counted and it is reported down,
//! while the two others keep being polled. A mutation check runs the same bus with reads that
//! never time out (a test-only switch) and shows that the check then fails: the dead unit
//! stalls the line.

mod process_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use process_support::{Agent, Setup};
use serde_json::Value as Json;

const DEADLINE: Duration = Duration::from_secs(60);

/// A child process (socat, the server), killed on drop.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The bus: a socat pseudo-terminal pair in `dir` (`agent` and `bus`) and the pymodbus RTU
/// server on its `bus` end. Returns the path the agent opens.
fn start_bus(dir: &Path) -> (PathBuf, Vec<Peer>) {
    let socat = Command::new("socat").arg("-V").output();
    assert!(
        socat.is_ok_and(|o| o.status.success()),
        "socat is not installed: apt-get install -y socat (as .ci/test does)"
    );
    let check = Command::new("python3")
        .args(["-c", "import pymodbus, serial"])
        .status()
        .expect("python3 is needed for the Modbus RTU test");
    assert!(
        check.success(),
        "pymodbus or pyserial is not installed: pip install pymodbus==3.8.6 pyserial==3.5 (as .ci/test does)"
    );
    let (agent_end, bus_end) = (dir.join("agent"), dir.join("bus"));
    let socat = Command::new("socat")
        .arg("-d")
        .arg("-d")
        .arg(format!("pty,raw,echo=0,link={}", agent_end.display()))
        .arg(format!("pty,raw,echo=0,link={}", bus_end.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let socat = Peer(socat);
    let deadline = Instant::now() + DEADLINE;
    while !(agent_end.exists() && bus_end.exists()) {
        assert!(
            Instant::now() < deadline,
            "socat made no pty pair in {dir:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/modbus_rtu_server.py");
    let mut server = Command::new("python3")
        .arg(script)
        .arg(&bus_end)
        .arg(&agent_end)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The server says "ready" once unit 1 answers through the agent's end of the line.
    let stdout = server.stdout.take().unwrap();
    let server = Peer(server);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(DEADLINE)
        .expect("the RTU server did not say ready");
    assert_eq!(line.trim(), "ready", "the RTU server did not start");
    (agent_end, vec![socat, server])
}

/// The channels of units 1 and 2: the same values, in each unit's byte and word order.
fn channels(order: &str) -> String {
    let o = format!("byte_order = \"{order}\"\nword_order = \"{order}\"\n");
    format!(
        "[[sources.channels]]\nname = \"u32\"\nfunction = \"holding\"\naddress = 0\ntype = \"u32\"\n{o}\
         [[sources.channels]]\nname = \"f32\"\nfunction = \"holding\"\naddress = 2\ntype = \"f32\"\n{o}\
         [[sources.channels]]\nname = \"i32\"\nfunction = \"holding\"\naddress = 4\ntype = \"i32\"\n{o}\
         [[sources.channels]]\nname = \"f64\"\nfunction = \"holding\"\naddress = 6\ntype = \"f64\"\n{o}\
         [[sources.channels]]\nname = \"temp_c\"\nfunction = \"holding\"\naddress = 10\ntype = \"i16\"\n\
         byte_order = \"{order}\"\nscale = 0.1\noffset = -40\n\
         [[sources.channels]]\nname = \"running\"\nfunction = \"coil\"\naddress = 0\n"
    )
}

/// One RTU source on `path`.
fn source(path: &Path, unit: u8, timeout: &str, channels: &str) -> String {
    format!(
        "[[sources]]\nkind = \"modbus\"\ntransport = \"rtu\"\nunit_id = {unit}\n\
         poll_interval = \"100ms\"\ntimeout = \"{timeout}\"\nstream = \"telemetry\"\n\
         key = \"bus/unit-{unit}\"\n\
         [sources.serial]\npath = \"{}\"\nbaud = 19200\nparity = \"none\"\ndata_bits = 8\nstop_bits = 1\n\
         {channels}",
        path.display()
    )
}

/// An agent polling units 1, 3 (dead) and 2, in that order, on the line at `path`.
fn start_agent(setup: &Setup, path: &Path, env: &[(&str, &str)]) -> Agent {
    let config = format!(
        "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{port}\"\n[[streams]]\nname = \"telemetry\"\n{}{}{}",
        source(path, 1, "1s", &channels("big")),
        // The dead unit has a shorter timeout of its own.
        source(path, 3, "200ms", &channels("big")),
        source(path, 2, "1s", &channels("little")),
        port = setup.port,
    );
    std::fs::write(&setup.config, config).unwrap();
    setup.start_with_env(env)
}

/// The value of the metric line starting with `prefix` (name and labels), 0 when absent.
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn per_source(text: &str, name: &str, source: usize) -> f64 {
    metric(
        text,
        &format!("tributary_edge_modbus_{name}{{source=\"{source}\"}}"),
    )
}

/// Waits until `/metrics` satisfies `cond`; on the deadline, the last `/metrics` as the error.
fn wait_metrics(
    get: &dyn Fn() -> String,
    deadline: Duration,
    cond: &dyn Fn(&str) -> bool,
) -> Result<String, String> {
    let end = Instant::now() + deadline;
    loop {
        let m = get();
        if cond(&m) {
            return Ok(m);
        }
        if Instant::now() >= end {
            return Err(m);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The bus check: the dead unit (source 1) times out, is counted and reported down, and while
/// it keeps timing out, units 1 and 2 (sources 0 and 2) keep being polled and stay up. Returns
/// `/metrics` once both live units answer, and at the end.
fn the_line_goes_on(
    get: &dyn Fn() -> String,
    deadline: Duration,
) -> Result<(String, String), String> {
    let first = wait_metrics(get, deadline, &|m| {
        per_source(m, "timeouts_total", 1) >= 1.0
            && per_source(m, "records_total", 0) >= 1.0
            && per_source(m, "records_total", 2) >= 1.0
    })
    .map_err(|m| format!("no timeout of the dead unit, or no record of the others:\n{m}"))?;
    let (r0, r2) = (
        per_source(&first, "records_total", 0),
        per_source(&first, "records_total", 2),
    );
    let t1 = per_source(&first, "timeouts_total", 1);
    let then = wait_metrics(get, deadline, &|m| {
        per_source(m, "timeouts_total", 1) >= t1 + 2.0
            && per_source(m, "records_total", 0) >= r0 + 5.0
            && per_source(m, "records_total", 2) >= r2 + 5.0
    })
    .map_err(|m| format!("the other units stopped while the dead unit timed out:\n{m}"))?;
    let up = |s| per_source(&then, "up", s);
    if (up(0), up(1), up(2)) != (1.0, 0.0, 1.0) {
        return Err(format!("up should be 1, 0, 1:\n{then}"));
    }
    Ok((first, then))
}

#[test]
fn rtu_units_on_one_line_decode_and_a_dead_unit_does_not_stop_the_others() {
    let setup = Setup::new("fsync = \"always\"");
    let (path, _peers) = start_bus(setup.dir.path());
    let mut agent = start_agent(&setup, &path, &[]);
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = |p: &str| rt.block_on(client.get(p)).unwrap().text();

    let (first, m) =
        the_line_goes_on(&|| get("/metrics"), DEADLINE).unwrap_or_else(|e| panic!("{e}"));

    // Once the live units answer, none of their reads fails while the dead unit times out
    // (the agent may poll before the server has opened its end of the line, so errors from
    // before that are allowed).
    for s in [0, 2] {
        for ch in ["u32", "f32", "i32", "f64", "temp_c", "running"] {
            let errors = |m: &str| {
                metric(
                    m,
                    &format!(
                        "tributary_edge_modbus_errors_total{{source=\"{s}\",channel=\"{ch}\"}}"
                    ),
                )
            };
            assert_eq!(errors(&first), errors(&m), "source {s} channel {ch}:\n{m}");
        }
    }
    // The dead unit's first channel is the one that times out; its others are skipped.
    let dead_first = metric(
        &m,
        "tributary_edge_modbus_errors_total{source=\"1\",channel=\"u32\"}",
    );
    assert!(
        dead_first >= per_source(&m, "timeouts_total", 1),
        "each timeout counted on the channel:\n{m}"
    );
    for s in [0, 2] {
        let t = |m: &str| per_source(m, "timeouts_total", s);
        assert_eq!(t(&first), t(&m), "no timeout of a live unit:\n{m}");
    }
    let status: Json = serde_json::from_str(&get("/v1/status")).unwrap();
    let sources: Vec<&Json> = status["sources"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "modbus")
        .collect();
    assert_eq!(sources.len(), 3, "{status}");
    assert_eq!(sources[0]["state"], "connected", "{status}");
    assert_eq!(sources[2]["state"], "connected", "{status}");
    assert_eq!(sources[1]["state"], "disconnected", "{status}");
    assert!(
        sources[1]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("timed out")),
        "{status}"
    );
    assert!(
        sources[1]["broker"]
            .as_str()
            .is_some_and(|b| b.ends_with("unit 3")),
        "the dead unit is named: {status}"
    );
    let health = get("/healthz");
    assert!(
        health.starts_with("ok"),
        "the agent stays healthy: {health}"
    );

    agent.terminate();
    let log = agent.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("modbus device not answering") && l.contains("unit 3")),
        "the dead unit is logged:\n{log}"
    );
    let records = setup.inspect();
    let want = serde_json::json!({
        "u32": 0x1122_3344, "f32": 21.5, "i32": -123_456, "f64": -1234.5678,
        "temp_c": -45.0, "running": true,
    });
    let want = want.as_object().unwrap();
    let mut per_key = std::collections::BTreeMap::<String, usize>::new();
    for r in &records {
        let key = r["key"].as_str().unwrap().to_owned();
        assert!(
            key == "bus/unit-1" || key == "bus/unit-2",
            "no record from the dead unit: {r}"
        );
        let f = r["fields"].as_object().unwrap();
        assert_eq!(
            f.len(),
            want.len(),
            "every channel of a unit that answers: {r}"
        );
        for (k, w) in want {
            let v = &f[k];
            if w.is_f64() {
                let got = v
                    .as_f64()
                    .unwrap_or_else(|| panic!("{k} not a number: {r}"));
                assert!((got - w.as_f64().unwrap()).abs() < 1e-9, "{k}: {r}");
            } else {
                assert_eq!(v, w, "{k}: {r}");
            }
        }
        *per_key.entry(key).or_default() += 1;
    }
    assert!(
        per_key.get("bus/unit-1").is_some_and(|n| *n >= 6)
            && per_key.get("bus/unit-2").is_some_and(|n| *n >= 6),
        "both live units stored: {per_key:?}"
    );
}

/// Mutation check: with reads that never time out, the dead unit holds the line, and the check
/// above fails: no timeout is counted, and unit 2, polled after it, gets nothing.
#[test]
fn without_a_read_timeout_the_dead_unit_stalls_the_line_and_the_check_fails() {
    let setup = Setup::new("fsync = \"always\"");
    let (path, _peers) = start_bus(setup.dir.path());
    let _agent = start_agent(
        &setup,
        &path,
        &[("TRIBUTARY_TEST_EDGE_MODBUS_NO_READ_TIMEOUT", "1")],
    );
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = || rt.block_on(client.get("/metrics")).unwrap().text();
    // Unit 1 is polled first and answers: the line and the peer work.
    wait_metrics(&get, DEADLINE, &|m| {
        per_source(m, "records_total", 0) >= 1.0
    })
    .unwrap_or_else(|m| panic!("unit 1 never answered:\n{m}"));
    let err = the_line_goes_on(&get, Duration::from_secs(5))
        .expect_err("the check must fail when the dead unit stalls the line");
    assert!(err.contains("no timeout of the dead unit"), "{err}");
    let m = get();
    assert_eq!(per_source(&m, "timeouts_total", 1), 0.0, "{m}");
    assert_eq!(per_source(&m, "records_total", 2), 0.0, "{m}");
}
