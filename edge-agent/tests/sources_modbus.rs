//! The Modbus source inside the real agent, against a real Modbus TCP peer: pymodbus serving
//! `modbus_server.py` on a loopback port. Values in all four byte/word orders, scale and
//! offset, a coil and a discrete input arrive decoded in the stored records; a register that
//! does not exist answers with an exception, is left out and counted, and the other channels
//! keep flowing. The device is then hung (SIGSTOP: reads time out, counted per channel, the
//! device reported down) and resumed, and then killed: the failure is counted and reported while the agent
//! stays healthy, and polling resumes by itself once the device is back.

mod process_support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use process_support::Setup;
use serde_json::Value as Json;

const DEADLINE: Duration = Duration::from_secs(60);

/// The simulator on `port`, killed on drop.
struct Device(Child);

impl Device {
    fn start(port: u16) -> Device {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/modbus_server.py");
        let check = Command::new("python3")
            .args(["-c", "import pymodbus"])
            .status()
            .expect("python3 is needed for the Modbus test");
        assert!(
            check.success(),
            "pymodbus is not installed: pip install pymodbus==3.8.6 (as .ci/test does)"
        );
        let child = Command::new("python3")
            .arg(script)
            .arg(port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Device(child)
    }

    /// Sends `sig` (`STOP`, `CONT`) to the device with kill(1).
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.0.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The value of the metric line starting with `prefix` (name and labels), if present.
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

const CHANNELS: &str = r#"
[[sources.channels]]
name = "u32_abcd"
function = "holding"
address = 0
type = "u32"
[[sources.channels]]
name = "f32_cdab"
function = "holding"
address = 2
type = "f32"
word_order = "little"
[[sources.channels]]
name = "i32_badc"
function = "holding"
address = 4
type = "i32"
byte_order = "little"
[[sources.channels]]
name = "u32_dcba"
function = "holding"
address = 6
type = "u32"
byte_order = "little"
word_order = "little"
[[sources.channels]]
name = "temp_c"
function = "holding"
address = 8
type = "i16"
scale = 0.1
offset = -40
[[sources.channels]]
name = "f64_abcd"
function = "holding"
address = 10
type = "f64"
[[sources.channels]]
name = "i64_dcba"
function = "holding"
address = 14
type = "i64"
byte_order = "little"
word_order = "little"
[[sources.channels]]
name = "flow"
function = "input"
address = 3
type = "u16"
scale = 2
offset = 1
[[sources.channels]]
name = "missing"
function = "holding"
address = 500
[[sources.channels]]
name = "running"
function = "coil"
address = 0
[[sources.channels]]
name = "door_open"
function = "discrete"
address = 1
"#;

#[test]
fn modbus_values_arrive_decoded_and_a_dead_device_is_reported_and_rejoined() {
    let setup = Setup::new("fsync = \"always\"");
    let device_port = process_support::free_port();
    let config = format!(
        "data_dir = \"data\"\n[http]\nlisten = \"127.0.0.1:{port}\"\n[[streams]]\nname = \"telemetry\"\n\
         [[sources]]\nkind = \"modbus\"\naddress = \"127.0.0.1:{device_port}\"\nunit_id = 1\n\
         poll_interval = \"100ms\"\ntimeout = \"500ms\"\nstream = \"telemetry\"\nkey = \"line-1/plc\"\n{CHANNELS}",
        port = setup.port,
    );
    std::fs::write(&setup.config, config).unwrap();
    let mut device = Device::start(device_port);
    let mut agent = setup.start();
    let client = setup.client();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = |path: &str| rt.block_on(client.get(path)).unwrap().text();
    let status = || -> Json { serde_json::from_str(&get("/v1/status")).unwrap() };
    let next_seq = |s: &Json| s["streams"][0]["next_seq"].as_u64().unwrap();
    let source = |s: &Json| {
        s["sources"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["kind"] == "modbus")
            .cloned()
            .unwrap_or_else(|| panic!("no modbus source in /v1/status: {s}"))
    };
    let wait = |what: &str, cond: &dyn Fn() -> bool| {
        let deadline = Instant::now() + DEADLINE;
        while !cond() {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {}",
                status()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    // Up: records flow, the missing register is counted, the device is reported connected.
    wait("3 records", &|| next_seq(&status()) >= 3);
    let m = get("/metrics");
    let missing = "tributary_edge_modbus_errors_total{source=\"0\",channel=\"missing\"}";
    assert!(metric(&m, missing).unwrap() >= 1.0, "{m}");
    let good = "tributary_edge_modbus_errors_total{source=\"0\",channel=\"u32_abcd\"}";
    assert_eq!(metric(&m, good), Some(0.0), "{m}");
    assert_eq!(
        metric(&m, "tributary_edge_modbus_up{source=\"0\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(source(&status())["state"], "connected");

    // Hung: the device keeps its connections but answers nothing (SIGSTOP). Reads time out,
    // are counted per channel, and the device is reported down; it rejoins on SIGCONT.
    let errors_before = metric(&get("/metrics"), good).unwrap();
    device.signal("STOP");
    wait("timeouts counted and the device reported down", &|| {
        let s = source(&status());
        s["state"] == "disconnected"
            && s["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("timed out"))
            && metric(&get("/metrics"), good).unwrap() > errors_before
    });
    let health = get("/healthz");
    assert!(
        health.starts_with("ok"),
        "the agent stays healthy: {health}"
    );
    let seq_hung = next_seq(&status());
    device.signal("CONT");
    wait("records after the device answers again", &|| {
        next_seq(&status()) >= seq_hung + 2
    });

    // Down: the failure is counted and reported, the agent stays healthy.
    device.kill();
    wait("the device reported down", &|| {
        let m = get("/metrics");
        source(&status())["state"] == "disconnected"
            && metric(&m, "tributary_edge_modbus_up{source=\"0\"}") == Some(0.0)
            && metric(
                &m,
                "tributary_edge_modbus_connect_errors_total{source=\"0\"}",
            )
            .is_some_and(|n| n >= 1.0)
    });
    let down = source(&status());
    assert!(
        down["last_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{down}"
    );
    let health = get("/healthz");
    assert!(
        health.starts_with("ok"),
        "the agent stays healthy: {health}"
    );
    let seq_down = next_seq(&status());

    // Back: the source reconnects by itself and polling resumes.
    let _device = Device::start(device_port);
    wait("records after the device is back", &|| {
        next_seq(&status()) >= seq_down + 3
    });
    assert_eq!(source(&status())["state"], "connected");

    agent.terminate();
    let log = agent.log_text();
    assert!(
        log.contains("modbus channel read failed") && log.contains("missing"),
        "the failed channel is logged by name:\n{log}"
    );
    assert!(
        log.contains("modbus device not answering"),
        "the dead device is logged:\n{log}"
    );
    let records = setup.inspect();
    // next_seq is the next to be given out: records 1..next_seq are stored, each once.
    let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "stored once each, in order"
    );
    assert!(
        seqs.len() as u64 >= seq_down + 2,
        "polls after the device came back are stored"
    );
    // A poll that ran into the hang has the channels read before it and is missing the rest;
    // every value stored is right, and most polls have every channel.
    let want = serde_json::json!({
        "u32_abcd": 0x1122_3344, "f32_cdab": 21.5, "i32_badc": -123_456,
        "u32_dcba": 0xA1B2_C3D4u32, "temp_c": -45.0, "f64_abcd": -1234.5678,
        "i64_dcba": -9_876_543_210i64, "flow": 2469.0, "running": true, "door_open": true,
    });
    let want = want.as_object().unwrap();
    let mut complete = 0;
    for r in &records {
        assert_eq!(r["key"], "line-1/plc", "{r}");
        let f = r["fields"].as_object().unwrap();
        for (k, v) in f {
            let w = want
                .get(k)
                .unwrap_or_else(|| panic!("unexpected field {k}: {r}"));
            // Integers must stay integers; floats are compared as floats.
            if w.is_f64() {
                let got = v
                    .as_f64()
                    .unwrap_or_else(|| panic!("{k} not a number: {r}"));
                assert!((got - w.as_f64().unwrap()).abs() < 1e-9, "{k}: {r}");
            } else {
                assert_eq!(v, w, "{k}: {r}");
            }
        }
        complete += usize::from(f.len() == want.len());
        let f = &r["fields"];
        assert!(
            f.get("missing").is_none(),
            "the failed channel is left out: {r}"
        );
    }
    assert!(
        complete >= 6,
        "{complete} complete records of {}",
        records.len()
    );
}
