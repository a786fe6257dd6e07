//! Event times and JSON mapping over the real binary, through HTTP and through a real
//! mosquitto (started here on a loopback port):
//! - one JSON document (RFC 3339 time with a `+01:00` offset and a fraction, a nested object,
//!   an array, a `null`) gives the same stored record over HTTP NDJSON and over MQTT, at the
//!   right instant;
//! - a millisecond `ts` with `precision=ms` is stored right; without it the request gets a 400
//!   naming the record and the likely unit, and nothing of it is stored;
//! - over MQTT, a timestamp that cannot be read is counted and refused, never stored at the
//!   receive time.

mod process_support;

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use process_support::{Setup, free_port};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::{Value as Json, json};

/// 2025-12-01T12:00:00Z in nanoseconds.
const NOON_NS: i64 = 1_764_590_400_000_000_000;
const HOUR_NS: i64 = 3_600_000_000_000;

/// A mosquitto process on a free loopback port, killed on drop.
struct Broker {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Broker {
    fn start() -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        )
        .unwrap();
        let binary = ["/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or("mosquitto");
        let child = Command::new(binary)
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto must be installed (.ci/test installs it)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "mosquitto did not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        Broker {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Publishes each `(topic, payload)` at QoS 1 and waits for the broker's PUBACKs.
fn publish(port: u16, messages: &[(&str, String)]) {
    rt().block_on(async {
        let mut opts = MqttOptions::new("time-publisher", "127.0.0.1", port);
        opts.set_clean_session(true);
        let (client, mut eventloop) = AsyncClient::new(opts, 64);
        for (topic, payload) in messages {
            client
                .publish(*topic, QoS::AtLeastOnce, false, payload.clone())
                .await
                .unwrap();
        }
        let mut acked = 0;
        while acked < messages.len() {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                Ok(_) => {}
                Err(e) => panic!("publisher connection failed: {e}"),
            }
        }
    });
}

/// A counter from the agent's `/metrics`, summed over its label sets.
fn metric(setup: &Setup, name: &str) -> f64 {
    let Ok(r) = rt().block_on(setup.client().get("/metrics")) else {
        return 0.0;
    };
    r.text()
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits until `check` holds, polling with a deadline.
fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn post(setup: &Setup, query: &str, body: &str) -> (u16, Json) {
    let path = format!("/v1/streams/telemetry/records{query}");
    let r = rt()
        .block_on(
            setup
                .client()
                .post(&path, "application/x-ndjson", body.to_owned()),
        )
        .unwrap();
    let json = serde_json::from_slice(&r.body).unwrap_or(Json::Null);
    (r.status, json)
}

/// An agent with the HTTP API and an MQTT source on `broker`, its event time in `ts`.
fn agent_with_mqtt(broker: &Broker) -> Setup {
    let setup = Setup::new("fsync = \"always\"");
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\n\
             topics = [\"dev7/#\"]\nstream = \"telemetry\"\nts_field = \"ts\"\nts_unit = \"ms\"\n",
            broker.port
        ),
    )
    .unwrap();
    setup
}

/// A stored record without the fields the MQTT source adds (`_topic`, `_mqtt_digest`).
fn content(r: &Json) -> (String, i64, Json) {
    let mut fields = r["fields"].clone();
    let map = fields.as_object_mut().unwrap();
    map.retain(|name, _| !name.starts_with('_'));
    (
        r["key"].as_str().unwrap().to_owned(),
        r["ts"].as_i64().unwrap(),
        fields,
    )
}

#[test]
fn one_json_document_is_one_record_over_http_and_mqtt() {
    let broker = Broker::start();
    let setup = agent_with_mqtt(&broker);
    // Ready (`/healthz` ok) only once the MQTT subscriptions are granted.
    let mut agent = setup.start();
    let document = json!({
        "t": 21.5,
        "gps": { "lat": 51.5, "fix": { "ok": true } },
        "xyz": [1, null, 3],
        "gone": null,
        "note": "x",
    });
    let ts = "2025-12-01T12:00:00.5+01:00";
    let line = json!({ "key": "dev7/temp", "ts": ts, "fields": document });
    let (status, answer) = post(&setup, "", &format!("{line}\n"));
    assert_eq!(status, 200, "{answer}");
    let mut payload = document.clone();
    payload["ts"] = json!(ts);
    publish(broker.port, &[("dev7/temp", payload.to_string())]);
    wait_for("the MQTT record", || {
        metric(&setup, "tributary_edge_records_total") >= 2.0
    });
    agent.terminate();

    let stored = setup.inspect();
    assert_eq!(stored.len(), 2, "{stored:?}");
    let (http, mqtt) = (content(&stored[0]), content(&stored[1]));
    assert_eq!(http, mqtt, "HTTP and MQTT store one document alike");
    assert_eq!(http.0, "dev7/temp");
    assert_eq!(http.1, NOON_NS - HOUR_NS + 500_000_000, "+01:00 honoured");
    assert_eq!(
        http.2,
        json!({
            "t": 21.5, "gps.lat": 51.5, "gps.fix.ok": true, "xyz.0": 1, "xyz.2": 3, "note": "x"
        }),
        "nested objects flatten, arrays by index, null is no field"
    );
}

#[test]
fn millisecond_ts_needs_precision_ms_and_a_bad_mqtt_time_is_refused() {
    let broker = Broker::start();
    let setup = agent_with_mqtt(&broker);
    let mut agent = setup.start();
    let ms = NOON_NS / 1_000_000;
    let body = |key: &str| format!("{}\n", json!({"key": key, "ts": ms, "fields": {"v": 1}}));

    let (status, answer) = post(&setup, "?precision=ms", &body("with-precision"));
    assert_eq!(status, 200, "{answer}");
    let two = format!(
        "{}{}",
        body("fine-but-refused-with-the-batch"),
        body("ms-as-ns")
    );
    let (status, answer) = post(&setup, "", &two);
    assert_eq!(
        status, 400,
        "a ms value read as ns must not land in 1970: {answer}"
    );
    let error = answer["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("line 1, column"),
        "names the record: {error}"
    );
    assert!(
        error.contains("precision=ms"),
        "names the likely unit: {error}"
    );
    let (status, answer) = post(&setup, "?precision=minutes", &body("x"));
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("precision"),
        "{answer}"
    );

    // Over MQTT (ts_unit = "ms"): seconds, an unreadable string and a missing ts are counted
    // and refused; an RFC 3339 string with an offset is stored at its instant.
    let secs = NOON_NS / 1_000_000_000;
    publish(
        broker.port,
        &[
            ("dev7/a", json!({"ts": secs, "v": 1}).to_string()),
            ("dev7/a", json!({"ts": "noon", "v": 2}).to_string()),
            ("dev7/a", json!({"v": 3}).to_string()),
            (
                "dev7/a",
                json!({"ts": "2025-12-01T12:00:00+01:00", "v": 4}).to_string(),
            ),
        ],
    );
    wait_for("the valid MQTT record", || {
        metric(&setup, "tributary_edge_records_total") >= 2.0
    });
    wait_for("three refused MQTT messages", || {
        metric(&setup, "tributary_edge_mqtt_bad_payloads_total") >= 3.0
    });
    let log = agent.log_text();
    agent.terminate();
    assert!(log.contains("looks like s"), "{log}");
    let stored = setup.inspect();
    let got: Vec<(String, i64, Json)> = stored.iter().map(content).collect();
    assert_eq!(
        got,
        [
            ("with-precision".to_owned(), NOON_NS, json!({"v": 1})),
            ("dev7/a".to_owned(), NOON_NS - HOUR_NS, json!({"v": 4})),
        ],
        "nothing of the refused batch nor of the bad messages is stored"
    );
}
