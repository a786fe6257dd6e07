//! What the agent's status tells an operator, against real peers:
//! - a device the hub refuses shows, on `/v1/status` and `edge-agent status`, that its link is
//!   down, the hub's reason (the revoked certificate), since when and the next retry;
//!   `/readyz` turns 503 past `hub.link_down_unready_after` while `/healthz` stays 200; a good
//!   device's link is up and ready;
//! - an MQTT source shows its broker, its state (connected, then disconnected with the error
//!   once mosquitto stops, then connected again) and the messages it received.

use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use tributary_tests::cluster::{self, AgentSpec, HubSpec, Pki};
use tributary_tests::http;
use tributary_tests::mosquitto::Mosquitto;
use tributary_tests::procs::{bin_path, wait_for};

const WAIT: Duration = Duration::from_secs(30);

/// `edge-agent status --config CFG` as text.
fn status_text(agent: &AgentSpec) -> Result<String> {
    let out = std::process::Command::new(bin_path("edge-agent"))
        .args(["status", "--config"])
        .arg(&agent.config)
        .output()
        .context("running edge-agent status")?;
    anyhow::ensure!(
        out.status.success(),
        "edge-agent status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_refused_device_shows_the_hubs_reason_since_and_next_retry() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::init(dir.path().join("pki"))?;
    let good = pki.issue("dev-good", None)?;
    let revoked = pki.issue("dev-revoked", None)?;
    pki.revoke("dev-revoked")?;
    let hub_spec = HubSpec::new(dir.path());
    let _hub = hub_spec.start(&pki)?;

    let good_spec = AgentSpec::new(dir.path(), "good", good, Some(hub_spec.quic));
    let _good = good_spec.start()?;
    let mut bad_spec = AgentSpec::new(dir.path(), "bad", revoked, Some(hub_spec.quic));
    bad_spec.env.push((
        "TRIBUTARY_EDGE__HUB__LINK_DOWN_UNREADY_AFTER".into(),
        "2s".into(),
    ));
    let _bad = bad_spec.start()?;

    let up = wait_for(WAIT, "the good device's link up", || {
        let s = cluster::status(good_spec.http).ok()?;
        (cluster::link(&s) == "up").then_some(s)
    })?;
    let detail = &up["link_detail"];
    assert_eq!(detail["state"], "up", "{up}");
    assert!(
        detail["reason"].is_null(),
        "an up link keeps a reason: {up}"
    );
    assert!(detail["since"].is_string(), "{up}");
    let ready = http::get(good_spec.http, "/readyz")?;
    assert_eq!(ready.status, 200, "{}", ready.text());

    let down = wait_for(WAIT, "the refused device's reason and next retry", || {
        let s = cluster::status(bad_spec.http).ok()?;
        let d = &s["link_detail"];
        let named = d["reason"].as_str().is_some_and(|r| r.contains("revoked"));
        (cluster::link(&s) == "down" && named && d["next_retry"].is_string()).then_some(s)
    })?;
    assert!(down["link_detail"]["since"].is_string(), "{down}");

    let text = wait_for(WAIT, "`edge-agent status` to show the retry", || {
        status_text(&bad_spec)
            .ok()
            .filter(|t| t.contains("next retry in"))
    })?;
    let link = text.lines().find(|l| l.starts_with("link")).unwrap_or("");
    assert!(
        link.contains("down since") && link.contains("revoked"),
        "{text}"
    );

    // The reason is the last attempt's: under TLS 1.3 an attempt can also end as a lost
    // control stream before the hub's alert is read, so wait for one that names it.
    let body = wait_for(WAIT, "/readyz to answer 503 naming the revocation", || {
        let r = http::get(bad_spec.http, "/readyz").ok()?;
        (r.status == 503 && r.text().contains("revoked")).then(|| r.text())
    })?;
    assert!(body.contains("not ready"), "{body}");
    let health = http::get(bad_spec.http, "/healthz")?;
    assert_eq!(health.status, 200, "{}", health.text());
    Ok(())
}

/// The first MQTT source of a status.
fn source(status: &Value) -> Option<&Value> {
    status["sources"].as_array()?.first()
}

#[test]
fn mqtt_sources_show_broker_state_error_and_messages() -> Result<()> {
    let mut broker = Mosquitto::start()?;
    let dir = tempfile::tempdir()?;
    let pki = Pki::init(dir.path().join("pki"))?;
    let cert = pki.issue("dev-mqtt", None)?;
    let mut spec = AgentSpec::new(dir.path(), "mqtt", cert, None);
    spec.extra_toml = format!(
        "[[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{}\"\ntopics = [\"sensors/#\"]\n\
         stream = \"telemetry\"\nformat = \"json\"\n",
        broker.port()
    );
    // `start` waits for /healthz, which needs the subscription granted.
    let _agent = spec.start()?;
    let s = cluster::status(spec.http)?;
    let src = source(&s).context("no sources in the status")?;
    assert_eq!(src["state"], "connected", "{s}");
    assert!(
        src["broker"]
            .as_str()
            .is_some_and(|b| b.contains(&broker.port().to_string())),
        "{s}"
    );

    for i in 0..3 {
        let out = std::process::Command::new("mosquitto_pub")
            .args(["-h", "127.0.0.1", "-p", &broker.port().to_string()])
            .args([
                "-q",
                "1",
                "-t",
                "sensors/a",
                "-m",
                &format!("{{\"v\": {i}}}"),
            ])
            .output()?;
        anyhow::ensure!(out.status.success(), "mosquitto_pub failed");
    }
    wait_for(WAIT, "3 messages received", || {
        let s = cluster::status(spec.http).ok()?;
        (source(&s)?["messages_received"].as_u64()? >= 3).then_some(())
    })?;

    broker.stop()?;
    let s = wait_for(WAIT, "the source to show disconnected", || {
        let s = cluster::status(spec.http).ok()?;
        let src = source(&s)?;
        (src["state"] == "disconnected" && src["last_error"].is_string()).then_some(s)
    })?;
    assert!(source(&s).unwrap()["since"].is_string(), "{s}");
    let text = status_text(&spec)?;
    let line = text.lines().find(|l| l.starts_with("source")).unwrap_or("");
    assert!(
        line.contains("disconnected") && line.contains("last error"),
        "{text}"
    );

    broker.restart()?;
    wait_for(WAIT, "the source to connect again", || {
        let s = cluster::status(spec.http).ok()?;
        let src = source(&s)?;
        (src["state"] == "connected" && src["last_error"].is_null()).then_some(())
    })?;
    Ok(())
}
