//! `mqtts://`: the agent's MQTT source over TLS to a real mosquitto that requires a client
//! certificate. Certificates are generated with rcgen for the test (a CA, the broker's
//! certificate for 127.0.0.1, a client certificate); the broker has a TLS listener the agent
//! subscribes on and a plain loopback listener the test publishes on.

use std::collections::HashMap;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_agent::config::EdgeConfig;
use edge_agent::http::AppState;
use edge_agent::log::Log;
use edge_agent::storage::RealStorage;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

struct Broker(Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Ports below the kernel's ephemeral range: a port released here and bound again by a child
/// (or after a restart) cannot meanwhile become some outgoing connection's source port.
#[path = "../../tests/src/ports.rs"]
#[allow(dead_code)]
mod ports;

fn free_port() -> u16 {
    ports::tcp()
}

fn mosquitto_binary() -> String {
    [
        "/usr/sbin/mosquitto",
        "/usr/local/sbin/mosquitto",
        "/usr/bin/mosquitto",
    ]
    .iter()
    .find(|p| Path::new(p).is_file())
    .map_or_else(|| "mosquitto".to_owned(), |p| (*p).to_owned())
}

/// Writes `ca.pem`, `broker.pem`/`broker.key` (for 127.0.0.1) and `client.pem`/`client.key`.
fn write_certs(dir: &Path) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "test broker CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    for (name, cn) in [("broker", "127.0.0.1"), ("client", "edge-agent")] {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        p.subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let cert = p.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    }
}

fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "mosquitto did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtts_with_a_client_certificate_stores_messages() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_certs(d);
    let (plain, tls) = (free_port(), free_port());
    std::fs::write(
        d.join("mosquitto.conf"),
        format!(
            "per_listener_settings false\nallow_anonymous true\nuser root\npersistence false\n\
             listener {plain} 127.0.0.1\n\
             listener {tls} 127.0.0.1\ncafile {ca}\ncertfile {cert}\nkeyfile {key}\n\
             require_certificate true\n",
            ca = d.join("ca.pem").display(),
            cert = d.join("broker.pem").display(),
            key = d.join("broker.key").display(),
        ),
    )
    .unwrap();
    let log_file = std::fs::File::create(d.join("mosquitto.log")).unwrap();
    let _broker = Broker(
        Command::new(mosquitto_binary())
            .arg("-c")
            .arg(d.join("mosquitto.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("mosquitto must be installed (.ci/test installs it)"),
    );
    wait_listening(plain);
    wait_listening(tls);

    let cfg = EdgeConfig::from_toml(
        &format!(
            "data_dir = \"data\"\n[[streams]]\nname = \"telemetry\"\n\
             [[sources]]\nkind = \"mqtt\"\nurl = \"mqtts://127.0.0.1:{tls}\"\ntopics = [\"t/#\"]\n\
             stream = \"telemetry\"\ntls_ca = \"ca.pem\"\ntls_cert = \"client.pem\"\ntls_key = \"client.key\"\n"
        ),
        d,
        Some(HashMap::new()),
    )
    .unwrap();
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage)).unwrap();
    let app = AppState::new(&cfg, log.clone());
    edge_agent::sources::spawn_all(&cfg, app.ingest.clone(), app.sources.clone()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !app.sources.ready() {
        assert!(
            Instant::now() < deadline,
            "no TLS subscription: {:?}\nbroker log:\n{}",
            app.sources.not_ready_reason(),
            std::fs::read_to_string(d.join("mosquitto.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let (client, mut eventloop) =
        AsyncClient::new(MqttOptions::new("tls-test-pub", "127.0.0.1", plain), 100);
    for i in 0..10 {
        client
            .publish("t/dev1", QoS::AtLeastOnce, false, format!("{{\"v\":{i}}}"))
            .await
            .unwrap();
    }
    let mut acked = 0;
    while acked < 10 {
        if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await.unwrap() {
            acked += 1;
        }
    }
    let mut durable = log.durable_watch();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let seq = log.status().streams[0].durable_seq;
        if seq >= 10 {
            assert_eq!(seq, 10);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "only {seq} stored");
        let _ = tokio::time::timeout(Duration::from_millis(200), durable.changed()).await;
    }
    log.shutdown();
}

#[test]
fn mqtts_config_names_the_missing_key() {
    let base = "data_dir = \"/tmp/x\"\n[[streams]]\nname = \"s\"\n[[sources]]\nkind = \"mqtt\"\ntopics = [\"t/#\"]\nstream = \"s\"\n";
    let cases = [
        ("url = \"mqtts://b:8883\"\n", "sources[0].tls_ca"),
        (
            "url = \"mqtts://b:8883\"\ntls_ca = \"ca.pem\"\ntls_cert = \"c.pem\"\n",
            "sources[0].tls_key",
        ),
        (
            "url = \"mqtt://b\"\ntls_ca = \"ca.pem\"\n",
            "sources[0].url",
        ),
    ];
    for (extra, key) in cases {
        let e = EdgeConfig::from_toml(
            &format!("{base}{extra}"),
            Path::new("/"),
            Some(HashMap::new()),
        )
        .unwrap_err();
        assert_eq!(e.key(), Some(key), "{e}");
    }
    let ok = EdgeConfig::from_toml(
        &format!("{base}url = \"mqtts://b\"\ntls_ca = \"ca.pem\"\n"),
        Path::new("/etc/tributary"),
        Some(HashMap::new()),
    )
    .unwrap();
    let edge_agent::config::SourceConfig::Mqtt(m) = &ok.sources[0] else {
        panic!("not mqtt")
    };
    assert_eq!(
        m.tls.as_ref().map(|t| t.ca.clone()),
        Some("/etc/tributary/ca.pem".into())
    );
}
