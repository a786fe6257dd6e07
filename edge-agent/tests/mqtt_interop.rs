//! MQTT interop against a real mosquitto: the agent binary subscribes at QoS 1 with a persistent
//! session while a separate rumqttc client publishes messages with unique ids, and the agent is
//! `kill -9`'d 10 times during the run. Afterwards every published message is in the log exactly
//! once, and the agent's log shows that the broker redelivered (DUP) messages and that the ones
//! already stored were recognised and not stored again.
//!
//! The broker runs with the recommended settings (`max_inflight_messages 1000`,
//! `max_queued_messages 1000000`, persistence on). The default run publishes 100,000 messages
//! (about 3 s on a 2-core box); `TRIBUTARY_SOAK=1` publishes 1,000,000.
//! `TRIBUTARY_MQTT_MESSAGES=N` overrides both. A second test floods the agent from a broker
//! without an inflight limit.

mod process_support;

use std::collections::HashMap;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use process_support::{Agent, Setup, free_port};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use sync::record::key_from_tags;

/// A mosquitto process on a free loopback port, killed on drop.
struct Broker {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Broker {
    /// The recommended settings: at most 1,000 unacknowledged messages in flight per client.
    fn start() -> Broker {
        Broker::start_with_inflight(1000)
    }

    /// `max_inflight_messages` as given; 0 means no limit.
    fn start_with_inflight(inflight: u32) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {port} 127.0.0.1\nallow_anonymous true\nmax_inflight_messages {inflight}\n\
                 max_queued_messages 1000000\npersistence true\npersistence_location {}/\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("mosquitto.log")).unwrap();
        let child = Command::new(mosquitto_binary())
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("mosquitto must be installed (.ci/test installs it)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "mosquitto did not listen on {port}"
            );
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

fn mosquitto_binary() -> String {
    for p in [
        "/usr/sbin/mosquitto",
        "/usr/local/sbin/mosquitto",
        "/usr/bin/mosquitto",
    ] {
        if Path::new(p).exists() {
            return p.to_owned();
        }
    }
    "mosquitto".to_owned()
}

fn message_count() -> u64 {
    if let Some(n) = std::env::var("TRIBUTARY_MQTT_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    if std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1") {
        1_000_000
    } else {
        100_000
    }
}

/// Publishes QoS 1 messages with ids 0..n, in chunks: each value received on `release` lets
/// the publisher go up to that many messages. `acked` counts the broker's PUBACKs.
fn publish_all(
    port: u16,
    n: u64,
    acked: Arc<AtomicU64>,
    mut release: tokio::sync::mpsc::UnboundedReceiver<u64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut opts = MqttOptions::new("interop-publisher", "127.0.0.1", port);
            opts.set_inflight(500).set_clean_session(true);
            let (client, mut eventloop) = AsyncClient::new(opts, 1000);
            // Held until every PUBACK is in: with all clients dropped the event loop stops
            // reading them.
            let _keep = client.clone();
            let publisher = tokio::spawn(async move {
                let mut id = 0;
                while let Some(upto) = release.recv().await {
                    while id < upto.min(n) {
                        let topic = format!("sensors/dev{}/temp", id % 16);
                        let payload = format!(
                            "{{\"id\":{id},\"v\":{}.5,\"meta\":{{\"ok\":true}}}}",
                            id % 100
                        );
                        client
                            .publish(topic, QoS::AtLeastOnce, false, payload)
                            .await
                            .unwrap();
                        id += 1;
                    }
                    if id >= n {
                        break;
                    }
                }
            });
            while acked.load(Ordering::Relaxed) < n {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::PubAck(_))) => {
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(e) => panic!("publisher connection failed: {e}"),
                }
            }
            publisher.await.unwrap();
        });
    })
}

/// Sums `name=N` over the agent log's lines containing `needle`.
fn log_sum(log: &str, needle: &str, name: &str) -> u64 {
    let key = format!("{name}=");
    log.lines()
        .filter(|l| l.contains(needle))
        .filter_map(|l| l.split(&key).nth(1))
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// The agent's `tributary_edge_mqtt_acks_sent_total` of its first MQTT source.
fn acks_sent(setup: &Setup) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let Ok(r) = rt.block_on(setup.client().get("/metrics")) else {
        return 0;
    };
    let text = String::from_utf8_lossy(&r.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("tributary_edge_mqtt_acks_sent_total{source=\"0\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The stream's last durable seq from `/v1/status`.
fn durable_seq(setup: &Setup) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let Ok(r) = rt.block_on(setup.client().get("/v1/status")) else {
        return 0;
    };
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
    v["streams"][0]["durable_seq"].as_u64().unwrap_or(0)
}

#[test]
fn kill9_during_qos1_stream_stores_every_message_exactly_once() {
    let started = Instant::now();
    let broker = Broker::start();
    let n = message_count();
    let kills = 10u64;
    let setup = Setup::new("fsync = \"interval:10ms\"");
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\n\
             topics = [\"sensors/#\"]\nstream = \"telemetry\"\nformat = \"json\"\n\
             topic_template = \"sensors/{{device}}/{{sensor}}\"\n",
            broker.port
        ),
    )
    .unwrap();
    // `start` waits for `/healthz` = ok, which needs every subscription granted: the persistent
    // session exists before the first message is published, so the broker queues everything.
    let mut agent: Agent = setup.start();
    let acked = Arc::new(AtomicU64::new(0));
    let (release, released) = tokio::sync::mpsc::unbounded_channel();
    let publisher = publish_all(broker.port, n, acked.clone(), released);
    let chunk = n / (kills + 1);
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut mid_flow = 0;
    for k in 1..=kills {
        // Release one more chunk and kill the agent once it has stored half of it, so the kill
        // lands while messages flow and some are appended but not yet acked.
        release.send(k * chunk).unwrap();
        let target = (k - 1) * chunk + chunk / 2;
        let stored = loop {
            let stored = durable_seq(&setup);
            if stored >= target {
                break stored;
            }
            assert!(
                Instant::now() < deadline,
                "no progress towards kill {k}: stored {stored}"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        agent.kill9();
        mid_flow += u64::from(stored < k * chunk);
        agent = setup.start();
    }
    release.send(n).unwrap();
    drop(release);
    publisher.join().unwrap();
    // Everything the broker accepted must arrive; wait for the stream to reach n records.
    let wait_start = Instant::now();
    loop {
        let stored = durable_seq(&setup);
        if stored >= n {
            break;
        }
        assert!(
            wait_start.elapsed() < Duration::from_secs(120),
            "only {stored} of {n} messages stored:\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.terminate();
    let log = agent.log_text();
    drop(broker);

    let lines = setup.inspect();
    let mut seen: HashMap<u64, u32> = HashMap::new();
    for l in &lines {
        let fields = &l["fields"];
        let id = fields["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no id: {l}"));
        *seen.entry(id).or_default() += 1;
        // The template's captures are the record's tags; the key is theirs.
        let device = format!("dev{}", id % 16);
        let tags = [
            ("device".into(), device.clone()),
            ("sensor".into(), "temp".into()),
        ];
        assert_eq!(
            l["key"].as_str(),
            Some(key_from_tags(&tags).as_str()),
            "{l}"
        );
        assert_eq!(
            fields["_topic"].as_str(),
            Some(format!("sensors/{device}/temp").as_str())
        );
        assert_eq!(fields["meta.ok"].as_bool(), Some(true), "{l}");
    }
    let twice: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).take(10).collect();
    assert!(
        twice.is_empty(),
        "stored more than once (id, times): {twice:?}"
    );
    let missing: Vec<u64> = (0..n)
        .filter(|id| !seen.contains_key(id))
        .take(10)
        .collect();
    assert!(missing.is_empty(), "never stored: {missing:?}");
    assert_eq!(lines.len() as u64, n);

    let needle = "mqtt: redeliveries received";
    let dup = log_sum(&log, needle, "dup");
    let dropped = log_sum(&log, needle, "dropped");
    let starts = log
        .lines()
        .filter(|l| l.contains("mqtt subscriptions granted"))
        .count();
    println!(
        "{n} messages, {kills} kills ({mid_flow} before the chunk was all stored), {starts} starts: {dup} redelivered with DUP, {dropped} of them \
         already stored and dropped; {:.1?} in all",
        started.elapsed()
    );
    assert_eq!(starts as u64, kills + 1);
    assert!(
        dup > 0,
        "no redelivery across {kills} kills: the kills missed the inflight window"
    );
    assert!(
        dropped > 0,
        "no redelivered message had been stored: the kills never hit between append and ack"
    );
    assert!(dropped <= dup);
}

/// A broker that sends without waiting for acks (no inflight limit, as some brokers are set up,
/// and as mosquitto behaves when it ignores `max_inflight_messages`) floods the source faster
/// than one ack per read. Every message is stored, the source never stops, and every ack
/// reaches the broker: after a clean restart the broker redelivers nothing. With acks through
/// rumqttc's request channel this flood stopped the source before its subscription was even
/// granted.
#[test]
fn a_broker_without_an_inflight_limit_never_stalls_the_source() {
    let broker = Broker::start_with_inflight(0);
    let n: u64 = std::env::var("FLOOD_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150_000);
    let setup =
        Setup::new(&std::env::var("FLOOD_FSYNC").unwrap_or("fsync = \"interval:10ms\"".into()));
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\n\
             topics = [\"sensors/#\"]\nstream = \"telemetry\"\nformat = \"json\"\n",
            broker.port
        ),
    )
    .unwrap();
    // The first start creates the persistent session; the broker then queues the whole load
    // while the agent is down and sends it as fast as it can once the agent is back: the
    // heaviest flood, as after an outage.
    let mut agent: Agent = setup.start();
    agent.terminate();
    let acked = Arc::new(AtomicU64::new(0));
    let (release, released) = tokio::sync::mpsc::unbounded_channel();
    let publisher = publish_all(broker.port, n, acked.clone(), released);
    release.send(n).unwrap();
    publisher.join().unwrap();
    let started = Instant::now();
    let mut agent = setup.start();
    let mut last = (0, Instant::now());
    loop {
        let stored = durable_seq(&setup);
        if stored >= n {
            break;
        }
        if stored > last.0 {
            last = (stored, Instant::now());
        }
        assert!(
            last.1.elapsed() < Duration::from_secs(30),
            "the MQTT source stalled at {stored} of {n} messages stored:\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let drained = started.elapsed();
    // A stop drops acks not yet written (the broker redelivers those, and the digest check
    // keeps them from being stored twice): the clean restart below comes after every ack was
    // written out, so that what the broker redelivers is only what it had not read yet.
    let deadline = Instant::now() + Duration::from_secs(30);
    while acks_sent(&setup) < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} acks sent 30 s after every message was stored",
            acks_sent(&setup)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.terminate();
    let first_run = agent.log_text();
    assert!(
        !first_run.contains("redeliveries received"),
        "redeliveries though every earlier message was acked:\n{first_run}"
    );

    // Restart; one more message goes behind anything the broker still holds for the session.
    let agent = setup.start();
    let (release, released) = tokio::sync::mpsc::unbounded_channel();
    let marker = publish_all(broker.port, 1, Arc::new(AtomicU64::new(0)), released);
    release.send(1).unwrap();
    marker.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while durable_seq(&setup) < n + 1 {
        assert!(
            Instant::now() < deadline,
            "the marker message never arrived"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = agent.log_text();
    let dup = log_sum(&log, "mqtt: redeliveries received", "dup");
    let dropped = log_sum(&log, "mqtt: redeliveries received", "dropped");
    println!(
        "{n} messages without an inflight limit: queued while the agent was down, all stored {drained:.1?} after it came back; {dup} redelivered after a clean restart, {dropped} of them recognised as stored"
    );
    // Acks written just before the stop can still be lost with the connection (the agent
    // closes it without a DISCONNECT, and a broker that has not read them yet drops them), so
    // the broker may redeliver: each such message must be recognised as stored and dropped.
    assert_eq!(
        dropped, dup,
        "redelivered messages that were already stored must not be appended again"
    );
    assert_eq!(durable_seq(&setup), n + 1, "every message stored once");
}

/// `GET /healthz` from the agent at `setup`: status and body.
fn healthz(setup: &Setup) -> Option<(u16, String)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(setup.client().get("/healthz")).ok()?;
    Some((r.status, r.text()))
}

#[test]
fn healthz_is_ready_only_once_subscriptions_are_granted() {
    // Reserve the broker's port but start the broker only after the agent.
    let port = free_port();
    let setup = Setup::new("");
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{port}\"\n\
             topics = [\"a/#\", \"b/+\"]\nstream = \"telemetry\"\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(process_support::BIN)
        .args(["run", "--config"])
        .arg(&setup.config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let not_ready = loop {
        if let Some(answer) = healthz(&setup) {
            break answer;
        }
        assert!(Instant::now() < deadline, "the agent never answered");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(not_ready.0, 503, "{}", not_ready.1);
    assert!(not_ready.1.contains("not ready"), "{}", not_ready.1);

    // Start mosquitto on the reserved port: the agent reconnects, subscribes, becomes ready.
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
    )
    .unwrap();
    let mut broker = Command::new(mosquitto_binary())
        .arg("-c")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ready = loop {
        match healthz(&setup) {
            Some((200, body)) => break body,
            _ => {
                assert!(
                    Instant::now() < deadline,
                    "never ready after the broker started"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    };
    assert_eq!(ready.trim(), "ok");
    let _ = broker.kill();
    let _ = broker.wait();
    let _ = child.kill();
    let _ = child.wait();
}

/// Publishes each `(topic, payload)` at QoS 1 and waits for the broker's PUBACKs.
fn publish_payloads(port: u16, messages: &[(&str, &str)]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut opts = MqttOptions::new("payload-publisher", "127.0.0.1", port);
        opts.set_clean_session(true);
        let (client, mut eventloop) = AsyncClient::new(opts, 64);
        for (topic, payload) in messages {
            client
                .publish(*topic, QoS::AtLeastOnce, false, payload.to_string())
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

/// Producers cannot steer the hub's republish through a payload's `_topic`, nor exceed
/// `ingest.fields_per_record_max`: such messages are counted as bad payloads, logged, acked and
/// not stored, and the next message flows with the `_topic` the agent itself sets.
#[test]
fn payloads_with_reserved_fields_or_too_many_fields_are_refused_and_the_stream_flows() {
    let broker = Broker::start();
    let setup = Setup::new("fsync = \"always\"");
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[ingest]\nfields_per_record_max = 3\n[[sources]]\nkind = \"mqtt\"\n\
             url = \"mqtt://127.0.0.1:{}\"\ntopics = [\"sensors/#\"]\nstream = \"telemetry\"\n\
             format = \"json\"\n",
            broker.port
        ),
    )
    .unwrap();
    let mut agent = setup.start();
    let deadline = Instant::now() + Duration::from_secs(30);
    while healthz(&setup).is_none_or(|(code, _)| code != 200) {
        assert!(Instant::now() < deadline, "the agent never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    publish_payloads(
        broker.port,
        &[
            (
                "sensors/a",
                r#"{"v":1,"_topic":"plant/line1/valve7/cmd/open"}"#,
            ),
            ("sensors/a", r#"{"a":1,"b":{"c":2,"d":{"e":3}},"f":4}"#),
            ("sensors/a", r#"{"v":2,"n":{"x":1,"y":2}}"#),
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while durable_seq(&setup) < 1 {
        assert!(Instant::now() < deadline, "the valid message never arrived");
        std::thread::sleep(Duration::from_millis(20));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let metrics = rt.block_on(setup.client().get("/metrics")).unwrap().text();
    let log = agent.log_text();
    agent.terminate();
    let bad = metrics
        .lines()
        .find(|l| l.starts_with("tributary_edge_mqtt_bad_payloads_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(bad, Some(2.0), "{metrics}");
    assert!(log.contains("\"_topic\" is reserved"), "{log}");
    assert!(log.contains("more than 3 fields"), "{log}");
    let stored = setup.inspect();
    assert_eq!(
        stored.len(),
        1,
        "only the valid message is stored: {stored:?}"
    );
    let fields = &stored[0]["fields"];
    assert_eq!(
        fields["_topic"], "sensors/a",
        "the agent sets the topic: {fields}"
    );
    assert_eq!(fields["n.y"], 2);
}

/// Through a real broker: the template's captures key the records by their tags, a scalar
/// payload becomes `value_field`, and under `unmatched = "drop"` a topic off the template is
/// counted, logged naming topic and template, acked and not stored, while the stream flows.
#[test]
fn captures_key_by_tags_scalars_are_a_field_and_unmatched_topics_are_dropped() {
    let broker = Broker::start();
    let setup = Setup::new("fsync = \"always\"");
    let config = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        format!(
            "{config}[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\n\
             topics = [\"site/#\"]\nstream = \"telemetry\"\nformat = \"json\"\n\
             topic_template = \"site/{{device}}/{{sensor}}\"\nvalue_field = \"reading\"\n",
            broker.port
        ),
    )
    .unwrap();
    let mut agent = setup.start();
    // In order on one connection: once the third is durable, the second was handled.
    publish_payloads(
        broker.port,
        &[
            ("site/d1/temp", "72.5"),
            ("site/d1/extra/level", r#"{"v":1}"#),
            ("site/d1/hum", r#"{"h":40}"#),
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while durable_seq(&setup) < 2 {
        assert!(Instant::now() < deadline, "the two messages never arrived");
        std::thread::sleep(Duration::from_millis(20));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let metrics = rt.block_on(setup.client().get("/metrics")).unwrap().text();
    let log = agent.log_text();
    agent.terminate();
    let mismatches = metrics
        .lines()
        .find(|l| l.starts_with("tributary_edge_mqtt_topic_mismatches_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(mismatches, Some(1.0), "{metrics}");
    assert!(
        log.contains("site/d1/extra/level") && log.contains("site/{device}/{sensor}"),
        "the warning names the topic and the template: {log}"
    );
    let stored = setup.inspect();
    assert_eq!(
        stored.len(),
        2,
        "the unmatched message is dropped: {stored:?}"
    );
    let tags = |sensor: &str| {
        [
            ("device".into(), "d1".into()),
            ("sensor".into(), sensor.into()),
        ]
    };
    assert_eq!(stored[0]["key"], key_from_tags(&tags("temp")).as_str());
    assert_eq!(stored[0]["fields"]["reading"], 72.5);
    assert_eq!(stored[1]["key"], key_from_tags(&tags("hum")).as_str());
    assert_eq!(stored[1]["fields"]["h"], 40);
    for r in &stored {
        let names: Vec<&String> = r["fields"].as_object().unwrap().keys().collect();
        assert!(
            names
                .iter()
                .all(|n| !n.starts_with('_') || *n == "_topic" || *n == "_mqtt_digest"),
            "no other bookkeeping field: {names:?}"
        );
    }
}
