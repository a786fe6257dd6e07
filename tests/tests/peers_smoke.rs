//! Smoke test of the peer-benchmark plumbing (`tributary_tests::peers`), so the benchmark
//! program (`tests/benches/peers.rs`) cannot rot unnoticed: a real `nats-server` with JetStream
//! (`sync_interval: always`, file storage) accepts the configuration, the minimal client
//! creates a stream, publishes with acks (plain and pipelined) and reads the count back, and a
//! refused publish is an error rather than a silent success.

use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};
use tributary_tests::peers::{self, NatsClient, NatsServer, jetstream_conf};

#[test]
fn jetstream_publish_with_ack_round_trips() -> Result<()> {
    let dir = tempfile::Builder::new().prefix("trb-nats-").tempdir()?;
    let port = peers::free_port();
    let conf = jetstream_conf("smoke", port, &dir.path().join("js"), None, "");
    let mut server = NatsServer::start(dir.path(), "nats", port, &conf)?;
    let mut client = NatsClient::connect(server.addr())?;
    client.js_api(
        None,
        "STREAM.CREATE.SMOKE",
        &json!({ "name": "SMOKE", "subjects": ["smoke.>"], "storage": "file", "num_replicas": 1 }),
    )?;
    for i in 1..=20u64 {
        assert_eq!(
            client.js_publish("smoke.a", format!("{{\"i\":{i}}}").as_bytes())?,
            i
        );
    }
    let replies: Vec<String> = (0..30)
        .map(|i| client.send_request("smoke.b", format!("{i}").as_bytes()))
        .collect::<Result<_>>()?;
    for (k, reply) in replies.iter().enumerate() {
        assert_eq!(
            peers::parse_pub_ack(&client.wait_reply(reply)?)?,
            21 + k as u64
        );
    }
    assert_eq!(client.stream_messages(None, "SMOKE")?, 50);

    // Nothing listens on this subject: JetStream answers "no responders", an error.
    client.timeout = Duration::from_secs(5);
    let error = client.js_publish("nobody.here", b"x").unwrap_err();
    assert!(format!("{error:#}").contains("no responders"), "{error:#}");

    // File storage survives a restart of the server.
    server.restart()?;
    let mut again = NatsClient::connect(server.addr())?;
    assert_eq!(again.stream_messages(None, "SMOKE")?, 50);
    let info = again.js_api(None, "STREAM.INFO.SMOKE", &Value::Null)?;
    assert_eq!(
        info.pointer("/config/storage").and_then(Value::as_str),
        Some("file")
    );
    Ok(())
}
