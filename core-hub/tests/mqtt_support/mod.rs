//! A real mosquitto on a free loopback port and a subscriber on `#`, for the republish suites
//! (a minimal copy of `tests/src/mosquitto.rs`, which core-hub cannot depend on).
//!
//! Needs `mosquitto` on PATH or in /usr/sbin (CI installs the Debian package); `MOSQUITTO=/path`
//! overrides.
#![allow(dead_code)]

#[path = "../../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// How long a suite waits for any one condition.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A mosquitto on a free loopback port, killed on drop.
pub struct Broker {
    child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
}

impl Broker {
    pub fn start() -> Broker {
        Broker::start_with(&[])
    }

    /// A broker with `extra` lines appended to its configuration (`max_packet_size`,
    /// `acl_file`, ...).
    pub fn start_with(extra: &[String]) -> Broker {
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
        let mut text = format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\n"
        );
        for line in extra {
            text.push_str(line);
            text.push('\n');
        }
        std::fs::write(&conf, text).unwrap();
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
        let mut broker = Broker { child, port, dir };
        broker.wait_accepting();
        broker
    }

    fn wait_accepting(&mut self) {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let start = Instant::now();
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "mosquitto exited at start"
            );
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "mosquitto did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One message the subscriber received.
#[derive(Debug, Clone)]
pub struct Msg {
    pub topic: String,
    pub device: String,
    pub epoch: u64,
    pub seq: u64,
    pub payload: serde_json::Value,
}

/// Subscribes to `#` at QoS 1; returns the messages as they arrive (and the client, which
/// must be kept alive).
pub async fn subscriber(port: u16, id: &str) -> (mpsc::UnboundedReceiver<Msg>, AsyncClient) {
    let mut opts = MqttOptions::new(id, "127.0.0.1", port);
    opts.set_keep_alive(Duration::from_secs(30));
    // Large enough for every packet the suites let through.
    opts.set_max_packet_size(Some(1 << 24));
    let (client, mut ev) = AsyncClient::new(opts, 100);
    client.subscribe("#", QoS::AtLeastOnce).await.unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let (ready_tx, mut ready_rx) = watch::channel(false);
    let (err_tx, err_rx) = watch::channel(None::<String>);
    tokio::spawn(async move {
        loop {
            match ev.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    let _ = ready_tx.send(true);
                }
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    if tx.send(message(&p)).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                // The broker goes away when the test ends; a failure before that shows as
                // missing messages (or, before the SUBACK, in the panic below).
                Err(e) => {
                    let _ = err_tx.send(Some(e.to_string()));
                    return;
                }
            }
        }
    });
    let start = Instant::now();
    while !*ready_rx.borrow_and_update() {
        assert!(
            start.elapsed() < DEADLINE,
            "no SUBACK from the broker on port {port}: {:?}",
            err_rx.borrow()
        );
        tokio::time::timeout(Duration::from_secs(1), ready_rx.changed())
            .await
            .ok();
    }
    (rx, client)
}

fn message(p: &rumqttc::v5::mqttbytes::v5::Publish) -> Msg {
    let props = p
        .properties
        .clone()
        .map(|pp| pp.user_properties)
        .unwrap_or_default();
    let prop = |k: &str| {
        props
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    Msg {
        topic: String::from_utf8_lossy(&p.topic).into_owned(),
        device: prop("device"),
        epoch: sync::epoch::parse(&prop("epoch")).unwrap_or(0),
        seq: prop("seq").parse().unwrap_or(0),
        payload: serde_json::from_slice(&p.payload).unwrap_or(serde_json::Value::Null),
    }
}
