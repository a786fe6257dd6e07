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
//!
//! `MQTT_BENCH_FORMAT=sparkplug`: the same comparison for the Sparkplug B host. Each side's
//! publisher is an edge node that sends NBIRTH (`bdSeq`), DBIRTH (three metrics with aliases)
//! and then `N` DDATA, each the three metrics by alias (Double, Int64, Boolean) with a payload
//! timestamp and the node's `seq`, encoded with the agent's own prost messages
//! (`sources::sparkplug::proto`). The plain subscriber counts the messages of group `plain`;
//! the agent (`format = "sparkplug"`, group `agent`) is timed until the DBIRTH's record and the
//! `N` DDATA records are durable, and must report no seq gap. Published at QoS 1, like the JSON
//! mode, so that no message is lost and both sides count the same messages (a Sparkplug node
//! sends DATA at QoS 0).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use edge_agent::config::EdgeConfig;
use edge_agent::http::AppState;
use edge_agent::log::Log;
use edge_agent::sources::sparkplug::proto::{self, Metric, MetricValue, Payload};
use edge_agent::storage::RealStorage;
use prost::Message as _;
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

/// What the publishers send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// One JSON object per message on `bench/{side}/x`.
    Json,
    /// A Sparkplug B edge node: NBIRTH, DBIRTH, then DDATA.
    Sparkplug,
}

impl Format {
    /// Messages published for `n` data messages.
    fn messages(self, n: u64) -> u64 {
        match self {
            Format::Json => n,
            Format::Sparkplug => n + 2,
        }
    }

    /// Records the agent stores for `n` data messages (the DBIRTH's metrics are one record).
    fn records(self, n: u64) -> u64 {
        match self {
            Format::Json => n,
            Format::Sparkplug => n + 1,
        }
    }

    /// The plain subscriber's filter for `side`.
    fn filter(self, side: &str) -> String {
        match self {
            Format::Json => format!("bench/{side}/#"),
            Format::Sparkplug => format!("spBv1.0/{side}/#"),
        }
    }

    /// Message `i` of `side`: topic and payload.
    fn message(self, side: &str, i: u64) -> (String, Vec<u8>) {
        match self {
            Format::Json => (
                format!("bench/{side}/x"),
                format!("{{\"v\":{}.5,\"i\":{i}}}", i % 1000).into_bytes(),
            ),
            Format::Sparkplug => sparkplug_message(side, i),
        }
    }
}

/// The device's three metrics: alias, name, datatype.
const SPB_METRICS: [(u64, &str, u32); 3] = [
    (1, "temperature", proto::datatype::DOUBLE),
    (2, "counter", proto::datatype::INT64),
    (3, "running", proto::datatype::BOOLEAN),
];

/// Message `i` of the bench's edge node in group `side`: NBIRTH, DBIRTH, then DDATA.
fn sparkplug_message(side: &str, i: u64) -> (String, Vec<u8>) {
    let ts = 1_764_374_400_000 + i;
    let value = |alias: u64| match alias {
        1 => MetricValue::DoubleValue(20.0 + (i % 100) as f64 / 10.0),
        2 => MetricValue::LongValue(i),
        _ => MetricValue::BooleanValue(i.is_multiple_of(2)),
    };
    let (kind, metrics) = match i {
        0 => {
            let bd_seq = Metric {
                name: Some("bdSeq".into()),
                datatype: Some(proto::datatype::INT64),
                value: Some(MetricValue::LongValue(0)),
                ..Metric::default()
            };
            ("NBIRTH", vec![bd_seq])
        }
        1 => {
            let born = SPB_METRICS.iter().map(|&(alias, name, datatype)| Metric {
                name: Some(name.into()),
                alias: Some(alias),
                datatype: Some(datatype),
                value: Some(value(alias)),
                ..Metric::default()
            });
            ("DBIRTH", born.collect())
        }
        _ => {
            let data = SPB_METRICS.iter().map(|&(alias, _, _)| Metric {
                alias: Some(alias),
                value: Some(value(alias)),
                ..Metric::default()
            });
            ("DDATA", data.collect())
        }
    };
    let payload = Payload {
        timestamp: Some(ts),
        metrics,
        seq: Some(i % 256),
        ..Payload::default()
    };
    let device = if kind == "NBIRTH" { "" } else { "/dev-1" };
    (
        format!("spBv1.0/{side}/{kind}/node-1{device}"),
        payload.encode_to_vec(),
    )
}

/// Publishes the messages of `side` for `n` data messages at QoS 1, pipelined up to the
/// broker's inflight window.
async fn publish(
    port: u16,
    format: Format,
    side: &'static str,
    n: u64,
    progress: Arc<std::sync::atomic::AtomicU64>,
) -> anyhow::Result<()> {
    let mut opts = MqttOptions::new(format!("bench-pub-{side}"), "127.0.0.1", port);
    opts.set_inflight(1000);
    opts.set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    let n = format.messages(n);
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let (topic, payload) = format.message(side, i);
            client
                .publish(topic, QoS::AtLeastOnce, false, payload)
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

/// The plain subscriber: seconds from the first publish to the last delivery.
async fn plain(port: u16, format: Format, n: u64) -> anyhow::Result<f64> {
    let mut opts = MqttOptions::new("bench-plain-sub", "127.0.0.1", port);
    opts.set_inflight(1000);
    let (client, mut eventloop) = AsyncClient::new(opts, 1000);
    client
        .subscribe(format.filter("plain"), QoS::AtLeastOnce)
        .await?;
    loop {
        if let Event::Incoming(Packet::SubAck(_)) = eventloop.poll().await? {
            break;
        }
    }
    let start = Instant::now();
    let publisher = tokio::spawn(publish(port, format, "plain", n, Default::default()));
    let total = format.messages(n);
    let mut got = 0;
    while got < total {
        if let Event::Incoming(Packet::Publish(_)) = eventloop.poll().await? {
            got += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    publisher.await??;
    Ok(secs)
}

/// The agent: seconds from the first publish until the records of `n` messages are durable.
async fn agent(
    port: u16,
    format: Format,
    n: u64,
    fsync: &str,
    dir: &std::path::Path,
) -> anyhow::Result<f64> {
    let source = match format {
        Format::Json => "topics = [\"bench/agent/#\"]\n",
        Format::Sparkplug => "format = \"sparkplug\"\nhost_id = \"bench\"\ngroups = [\"agent\"]\n",
    };
    let cfg = EdgeConfig::from_toml(
        &format!(
            "data_dir = \"data\"\n[storage]\nfsync = \"{fsync}\"\n[[streams]]\nname = \"telemetry\"\n\
             [[sources]]\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{port}\"\n\
             {source}stream = \"telemetry\"\n"
        ),
        dir,
        Some(Default::default()),
    )?;
    let records = format.records(n);
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
    let publisher = tokio::spawn(publish(port, format, "agent", n, published.clone()));
    let stored = || {
        log.status()
            .streams
            .iter()
            .find(|s| s.stream == "telemetry")
            .map_or(0, |s| s.durable_seq)
    };
    // A stall (the source stops taking messages) is reported, not waited on forever.
    let waited = tokio::time::timeout(Duration::from_secs(120), async {
        while stored() < records {
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
            "the agent stalled: {} of {records} records durable after 120 s ({:.0} msg/s until then); \
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
    if format == Format::Sparkplug {
        let stats = app
            .sources
            .mqtt_stats(0)
            .context("the MQTT source's counters")?;
        let gaps = stats
            .spb_seq_gaps
            .load(std::sync::atomic::Ordering::Relaxed);
        let dropped = stats
            .spb_dropped_messages
            .load(std::sync::atomic::Ordering::Relaxed);
        if gaps != 0 || dropped != 0 || stored() != records {
            bail!(
                "the Sparkplug host saw {gaps} seq gaps and dropped {dropped} messages; {} records \
                 durable, {records} expected",
                stored()
            );
        }
    }
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
    let format = match std::env::var("MQTT_BENCH_FORMAT").as_deref() {
        Err(_) | Ok("json") => Format::Json,
        Ok("sparkplug") => Format::Sparkplug,
        Ok(other) => bail!("MQTT_BENCH_FORMAT={other:?}: use json or sparkplug"),
    };
    let plain_s = rt.block_on(plain(broker.port, format, n))?;
    let agent_s = rt.block_on(agent(broker.port, format, n, &fsync, dir.path()))?;
    let (p, a) = (n as f64 / plain_s, n as f64 / agent_s);
    let what = match format {
        Format::Json => "mqtt qos1",
        Format::Sparkplug => "sparkplug DDATA qos1",
    };
    println!("{what}: plain subscriber {n} messages in {plain_s:.2} s = {p:.0} msg/s");
    println!(
        "{what}: agent (durable, fsync {fsync}) {n} messages in {agent_s:.2} s = {a:.0} msg/s"
    );
    println!(
        "{what}: agent / plain = {:.1}% (target >= 80%)",
        100.0 * a / p
    );
    Ok(())
}
