//! MQTT republish against a real mosquitto: every record of the merged stream is republished
//! on its original topic (the edge's `_topic` field; the topic template otherwise), with
//! `device`, `epoch` and `seq` as MQTT 5 user properties; the checkpoint (a stream position in
//! the hub catalog) lets a restarted sink resume without losing anything.
//!
//! Needs `mosquitto` on PATH (CI installs the Debian package); `MOSQUITTO=/path` overrides.

mod common;
/// Ports below the kernel's ephemeral range: a port released here and bound again by a child
/// (or after a restart) cannot meanwhile become some outgoing connection's source port.
#[path = "../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

use core_hub::republish::{self, RawRepublish};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::record::{Record, Value};
use tokio::sync::watch;

const STREAM: &str = "telemetry";
const DEADLINE: Duration = Duration::from_secs(30);

/// A mosquitto on a free loopback port, killed on drop (a minimal copy of
/// `tests/src/mosquitto.rs`, which core-hub cannot depend on).
struct Broker {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Broker {
    fn start() -> Broker {
        let binary = std::env::var("MOSQUITTO")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
                    .iter()
                    .map(PathBuf::from)
                    .find(|p| p.is_file())
                    .unwrap_or_else(|| PathBuf::from("mosquitto"))
            });
        let port = ports::tcp();
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"),
        )
        .unwrap();
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting {}: {e} (apt-get install mosquitto)",
                    binary.display()
                )
            });
        let mut broker = Broker {
            child,
            port,
            _dir: dir,
        };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let start = Instant::now();
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                broker.child.try_wait().unwrap().is_none(),
                "mosquitto exited at start"
            );
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "mosquitto did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        broker
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Records `first..=last` of `device`; even seqs came from MQTT (they carry `_topic`).
fn records(device: &str, first: u64, last: u64) -> Vec<Record> {
    (first..=last)
        .map(|seq| {
            let mut fields = vec![("temp".to_string(), Value::F64(seq as f64 / 2.0))];
            if seq.is_multiple_of(2) {
                fields.push((
                    "_topic".into(),
                    Value::Str(format!("sensors/{device}/temp")),
                ));
                fields.push(("_mqtt_digest".into(), Value::I64(seq as i64)));
            }
            Record {
                key: format!("{device}/temp"),
                ts: 1_764_374_400_000_000_000 + seq as i64,
                fields,
            }
        })
        .collect()
}

fn expected_topic(device: &str, seq: u64) -> String {
    if seq.is_multiple_of(2) {
        format!("sensors/{device}/temp")
    } else {
        format!("hub/{STREAM}/{device}/{device}/temp")
    }
}

/// One received message: (device, epoch, seq) -> topic.
type Seen = BTreeMap<(String, u64, u64), Vec<String>>;

/// Subscribes to everything and collects messages until `stop`.
async fn subscriber(
    port: u16,
) -> (
    tokio::sync::mpsc::UnboundedReceiver<(String, String, u64, u64, serde_json::Value)>,
    AsyncClient,
) {
    let mut opts = MqttOptions::new("test-subscriber", "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30));
    let (client, mut ev) = AsyncClient::new(opts, 100);
    client.subscribe("#", QoS::AtLeastOnce).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let (ready_tx, mut ready_rx) = watch::channel(false);
    tokio::spawn(async move {
        loop {
            match ev.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    let _ = ready_tx.send(true);
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let topic = String::from_utf8_lossy(&p.topic).into_owned();
                    let props = p
                        .properties
                        .map(|pp| pp.user_properties)
                        .unwrap_or_default();
                    let prop = |k: &str| {
                        props
                            .iter()
                            .find(|(n, _)| n == k)
                            .map(|(_, v)| v.clone())
                            .unwrap_or_default()
                    };
                    let payload: serde_json::Value =
                        serde_json::from_slice(&p.payload).unwrap_or(serde_json::Value::Null);
                    let msg = (
                        topic,
                        prop("device"),
                        prop("epoch").parse().unwrap_or(0),
                        prop("seq").parse().unwrap_or(0),
                        payload,
                    );
                    if tx.send(msg).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                // The broker goes away when the test ends; a failure before that shows as
                // missing messages in `collect_until`.
                Err(_) => return,
            }
        }
    });
    let start = Instant::now();
    while !*ready_rx.borrow_and_update() {
        assert!(start.elapsed() < DEADLINE, "no SUBACK");
        tokio::time::timeout(Duration::from_secs(1), ready_rx.changed())
            .await
            .ok();
    }
    (rx, client)
}

async fn collect_until(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(String, String, u64, u64, serde_json::Value)>,
    seen: &mut Seen,
    want: &BTreeSet<(String, u64, u64)>,
) {
    let start = Instant::now();
    while !want.iter().all(|k| seen.contains_key(k)) {
        let left = DEADLINE.saturating_sub(start.elapsed());
        assert!(
            !left.is_zero(),
            "timed out: {} of {} records republished",
            seen.len(),
            want.len()
        );
        if let Ok(Some((topic, device, epoch, seq, payload))) =
            tokio::time::timeout(left, rx.recv()).await
        {
            assert_eq!(
                payload["device"],
                device.as_str(),
                "payload ids match the properties"
            );
            assert_eq!(payload["seq"], seq);
            assert!(
                payload["fields"].get("_topic").is_none(),
                "internal fields stay out"
            );
            assert!(payload["fields"].get("_mqtt_digest").is_none());
            seen.entry((device, epoch, seq)).or_default().push(topic);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_republished_on_its_topic_with_ids() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let hub = common::open(dir.path());
    let (mut rx, _sub) = subscriber(broker.port).await;

    let mut want = BTreeSet::new();
    for (device, n) in [("truck-1", 300u64), ("truck-2", 200)] {
        for (first, last) in [(1, n / 2), (n / 2 + 1, n)] {
            let block =
                encode_block(VERSION_ROWS, 1, first, &records(device, first, last)).unwrap();
            hub.commit_block(device, STREAM, &block).await.unwrap();
        }
        want.extend((1..=n).map(|s| (device.to_string(), 1, s)));
    }

    let cfg = RawRepublish {
        url: Some(format!("mqtt://127.0.0.1:{}", broker.port)),
        streams: Some(vec![STREAM.into()]),
        qos: Some(1),
        topic_template: Some("hub/{stream}/{device}/{key}".into()),
        batch_records: Some(64),
        poll_interval: Some("10ms".into()),
        ..RawRepublish::default()
    }
    .parse()
    .unwrap();
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks = republish::start(hub.clone(), cfg.clone(), stop_rx);

    let mut seen = Seen::new();
    collect_until(&mut rx, &mut seen, &want).await;
    for ((device, _, seq), topics) in &seen {
        for t in topics {
            assert_eq!(t, &expected_topic(device, *seq), "{device} seq {seq}");
        }
    }
    // The checkpoint reaches the end once the last batch is acknowledged.
    let start = Instant::now();
    while republish::checkpoint(&hub, STREAM).unwrap() < 500 {
        assert!(start.elapsed() < DEADLINE, "checkpoint stuck");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(republish::checkpoint(&hub, STREAM).unwrap(), 500);

    // Stop the sink, commit more, start a new one: it resumes from the checkpoint, so it
    // republishes the new records and nothing it had already checkpointed.
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let block = encode_block(VERSION_ROWS, 1, 301, &records("truck-1", 301, 350)).unwrap();
    hub.commit_block("truck-1", STREAM, &block).await.unwrap();
    let before = seen.values().map(Vec::len).sum::<usize>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let tasks = republish::start(hub.clone(), cfg, stop_rx);
    let more: BTreeSet<_> = (301..=350).map(|s| ("truck-1".to_string(), 1, s)).collect();
    collect_until(&mut rx, &mut seen, &more).await;
    let after = seen.values().map(Vec::len).sum::<usize>();
    assert_eq!(after - before, 50, "only the new records were republished");
    let start = Instant::now();
    while republish::checkpoint(&hub, STREAM).unwrap() < 550 {
        assert!(
            start.elapsed() < DEADLINE,
            "checkpoint stuck after the restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(republish::checkpoint(&hub, STREAM).unwrap(), 550);
    hub.shutdown();
}
