//! MQTT QoS 1 ingest against a plain QoS 1 subscriber on the same mosquitto, in the same run.
//!
//! 1. A plain rumqttc subscriber (automatic acks, nothing stored) receives `N` QoS 1 messages
//!    that a publisher sends as fast as the broker takes them: the broker's delivery rate.
//! 2. The agent's MQTT source (in-process: mapping, manual acks after durability, DUP
//!    detection, the log writer with fsync) receives `N` more; timed until all are durable.
//!
//! The broker is started like `tests/src/mosquitto.rs` does, with `max_inflight_messages 1000`
//! and `max_queued_messages 1000000` (the recommended broker config).
//!
//! Run: `cargo bench -p edge-agent --bench mqtt_ingest` (target: the agent at least 80% of the
//! plain subscriber). `MQTT_BENCH_MESSAGES` (default 200,000), `MQTT_BENCH_FSYNC` (default
//! `interval:10ms`), `MOSQUITTO` (default: found on `PATH` or in /usr/sbin).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use edge_agent::config::EdgeConfig;
use edge_agent::http::AppState;
use edge_agent::log::Log;
use edge_agent::storage::RealStorage;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Broker {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mosquitto_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("MOSQUITTO") {
        return Ok(p.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|d| d.join("mosquitto"))
        .find(|p| p.is_file())
        .context("mosquitto not found: install it (apt-get install mosquitto) or set MOSQUITTO")
}

fn start_broker() -> anyhow::Result<Broker> {
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let conf = dir.path().join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\nmax_inflight_messages 1000\n\
             max_queued_messages 1000000\nuser root\npersistence false\nlog_dest none\n"
        ),
    )?;
    let child = Command::new(mosquitto_binary()?)
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let broker = Broker {
        child,
        port,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("mosquitto did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(broker)
}

/// Publishes `n` QoS 1 messages on `topic`, pipelined up to the broker's inflight window.
async fn publish(
    port: u16,
    topic: &str,
    n: u64,
    progress: Arc<std::sync::atomic::AtomicU64>,
) -> anyhow::Result<()> {
    let mut opts = MqttOptions::new(format!("bench-pub-{topic}"), "127.0.0.1", port);
    opts.set_inflight(1000);
    opts.set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    let topic = topic.to_owned();
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let payload = format!("{{\"v\":{}.5,\"i\":{i}}}", i % 1000);
            client
                .publish(topic.as_str(), QoS::AtLeastOnce, false, payload)
                .await?;
        }
        Ok::<_, anyhow::Error>(client)
    });
    let mut acked = 0;
    while acked < n {
        if let Event::Incoming(Packet::PubAck(_)) = eventloop.poll().await? {
            acked += 1;
            progress.store(acked, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let _client = sender.await??;
    Ok(())
}

/// The plain subscriber: seconds from the first publish to the `n`-th delivery.
async fn plain(port: u16, n: u64) -> anyhow::Result<f64> {
    let mut opts = MqttOptions::new("bench-plain-sub", "127.0.0.1", port);
    opts.set_inflight(1000);
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    client.subscribe("bench/plain/#", QoS::AtLeastOnce).await?;
    loop {
        if let Event::Incoming(Packet::SubAck(_)) = eventloop.poll().await? {
            break;
        }
    }
    let start = Instant::now();
    let publisher = tokio::spawn(publish(port, "bench/plain/x", n, Default::default()));
    let mut got = 0;
    while got < n {
        if let Event::Incoming(Packet::Publish(_)) = eventloop.poll().await? {
            got += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    publisher.await??;
    Ok(secs)
}

/// The agent: seconds from the first publish until `n` records are durable.
async fn agent(port: u16, n: u64, fsync: &str, dir: &std::path::Path) -> anyhow::Result<f64> {
    let cfg = EdgeConfig::from_toml(
        &format!(
            "data_dir = \"data\"\n[storage]\nfsync = \"{fsync}\"\n[[streams]]\nname = \"telemetry\"\n\
             [[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{port}\"\n\
             topics = [\"bench/agent/#\"]\nstream = \"telemetry\"\n"
        ),
        dir,
        Some(Default::default()),
    )?;
    let (log, _) = Log::open(cfg.log_config(), Arc::new(RealStorage))?;
    let app = AppState::new(&cfg, log.clone());
    edge_agent::sources::spawn_all(&cfg, app.ingest.clone(), app.sources.clone())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !app.sources.ready() {
        if Instant::now() > deadline {
            bail!("the agent's subscription was not granted");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut durable = log.durable_watch();
    let start = Instant::now();
    let published = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let publisher = tokio::spawn(publish(port, "bench/agent/x", n, published.clone()));
    let stored = || {
        log.status()
            .streams
            .iter()
            .find(|s| s.stream == "telemetry")
            .map_or(0, |s| s.durable_seq)
    };
    // A stall (the source stops taking messages) is reported, not waited on forever.
    let waited = tokio::time::timeout(Duration::from_secs(120), async {
        while stored() < n {
            if durable.changed().await.is_err() {
                break;
            }
        }
    })
    .await;
    if waited.is_err() {
        let stats = app
            .sources
            .mqtt_stats(0)
            .context("the MQTT source's counters")?;
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        bail!(
            "the agent stalled: {} of {n} messages durable after 120 s ({:.0} msg/s until then); \
             the broker acked {} publishes; the source received {} ({} DUP) and stored {}",
            stored(),
            stored() as f64 / start.elapsed().as_secs_f64(),
            load(&published),
            load(&stats.received),
            load(&stats.dup_received),
            load(&stats.records),
        );
    }
    let secs = start.elapsed().as_secs_f64();
    publisher.await??;
    log.shutdown();
    Ok(secs)
}

fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n: u64 = env("MQTT_BENCH_MESSAGES", 200_000);
    let fsync: String = env("MQTT_BENCH_FSYNC", "interval:10ms".to_owned());
    let broker = start_broker()?;
    let dir = tempfile::Builder::new()
        .prefix("mqtt-bench-")
        .tempdir_in(".")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let plain_s = rt.block_on(plain(broker.port, n))?;
    let agent_s = rt.block_on(agent(broker.port, n, &fsync, dir.path()))?;
    let (p, a) = (n as f64 / plain_s, n as f64 / agent_s);
    println!("mqtt qos1: plain subscriber {n} messages in {plain_s:.2} s = {p:.0} msg/s");
    println!(
        "mqtt qos1: agent (durable, fsync {fsync}) {n} messages in {agent_s:.2} s = {a:.0} msg/s"
    );
    println!(
        "mqtt qos1: agent / plain = {:.1}% (target >= 80%)",
        100.0 * a / p
    );
    Ok(())
}
