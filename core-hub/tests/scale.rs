//! Scale: many device connections against one hub, and the hub's memory while they are all up.
//!
//! The hub is the real `core-hub` binary in its own process, so its RSS is its own. The devices
//! are lightweight clients in this process: one quinn client endpoint multiplexing every
//! connection, each with its own device certificate (issued in-process from the run's CA, ECDSA
//! P-256) and its own `sync::protocol::Sender` driving the real protocol over the real
//! connection. Each device ships one small block (a few telemetry records) and waits for the
//! hub's durable ack; then all of them stay connected (keepalives running) while the hub's RSS
//! is sampled.
//!
//! The assertion: the hub's peak RSS stays within `ingest.memory_bytes_max` plus a fixed
//! overhead ([`FIXED_OVERHEAD_BYTES`]: runtime, SQLite, the WAL writer), and every device got
//! its ack. The hub charges every connection's own state
//! ([`core_hub::server::CONNECTION_COST_BYTES`]) to the budget, so the bound does not grow with
//! the number of connections; the budget is configured here to admit them all
//! ([`memory_bytes_max`]).
//!
//! CI runs 1,000 devices. `TRIBUTARY_SOAK=1` runs 10,000 (`TRIBUTARY_SCALE_DEVICES` overrides
//! both): `TRIBUTARY_SOAK=1 cargo test --release -p core-hub --test scale -- --nocapture`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant as StdInstant};

use anyhow::{Context, Result, bail};
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sync::protocol::{
    Backlog, FrameBuffer, Instant, LaneAnnounce, Sender, SenderConfig, SenderEvent, TransmitKind,
};
use sync::record::{Record, Value};
use tokio::sync::{Semaphore, watch};

/// The ingest budget for blocks, on top of what the connections take of it.
const BLOCKS_BYTES: u64 = 64 << 20;
/// What the hub holds outside the ingest budget regardless of load: the runtime, SQLite's
/// cache, the WAL writer. Measured idle at about 10 MiB.
const FIXED_OVERHEAD_BYTES: u64 = 64 << 20;

/// The ingest budget configured for `devices` connections: connections may hold 3/4 of it
/// (`core_hub::server::CONNECTIONS_BUDGET_SHARE`), blocks have [`BLOCKS_BYTES`] besides.
fn memory_bytes_max(devices: usize) -> u64 {
    let (num, den) = core_hub::server::CONNECTIONS_BUDGET_SHARE;
    let conns = devices as u64 * core_hub::server::CONNECTION_COST_BYTES;
    (conns.div_ceil(num) * den + BLOCKS_BYTES).max(BLOCKS_BYTES * den / num)
}
/// Handshakes in flight at once: a fleet reconnecting after a hub restart is spread by jitter,
/// not all in the same millisecond.
const CONNECTING_MAX: usize = 256;
/// Devices that share one client UDP socket.
const DEVICES_PER_SOCKET: usize = 50;
const STREAM: &str = "telemetry";
const RECORDS_PER_DEVICE: u64 = 8;

fn device_count() -> usize {
    if let Some(n) = std::env::var("TRIBUTARY_SCALE_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return n;
    }
    if std::env::var("TRIBUTARY_SOAK").is_ok_and(|v| v == "1") {
        10_000
    } else {
        1_000
    }
}

/// The hub process; killed when dropped so a failing test leaves nothing behind.
struct HubProcess {
    child: Child,
    quic: SocketAddr,
}

impl Drop for HubProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl HubProcess {
    /// `(VmRSS, VmHWM)` in bytes.
    fn rss(&self) -> Result<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let field = |name: &str| -> Result<u64> {
            let line = status
                .lines()
                .find(|l| l.starts_with(name))
                .with_context(|| format!("{name} missing"))?;
            let kb: u64 = line.split_whitespace().nth(1).context("value")?.parse()?;
            Ok(kb * 1024)
        };
        Ok((field("VmRSS:")?, field("VmHWM:")?))
    }
}

fn start_hub(dir: &std::path::Path, memory_bytes_max: u64) -> Result<HubProcess> {
    let pki = dir.join("pki");
    let config = format!(
        r#"data_dir = "{data}"
[listen]
quic = "127.0.0.1:0"
http = "127.0.0.1:0"
[tls]
ca = "{pki}/ca.pem"
cert = "{pki}/hub.pem"
key = "{pki}/hub.key"
[ingest]
memory_bytes_max = "{mem}"
block_bytes_max = "1MiB"
block_raw_bytes_max = "4MiB"
"#,
        data = dir.join("hub").display(),
        pki = pki.display(),
        mem = memory_bytes_max,
    );
    let path = dir.join("hub.toml");
    std::fs::write(&path, config)?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_core-hub"))
        .args(["run", "--config"])
        .arg(&path)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = child.stderr.take().context("stderr")?;
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    // Drain stderr for the whole run: a full pipe would stall the hub's logging.
    std::thread::spawn(move || {
        let mut addr_tx = Some(addr_tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("QUIC listener up")
                && let Some(tx) = addr_tx.take()
            {
                let addr = line
                    .split("local_addr=")
                    .nth(1)
                    .map(|s| s.split_whitespace().next().unwrap_or("").to_owned());
                let _ = tx.send(addr);
            }
            if line.contains("ERROR") || line.contains("panicked") {
                eprintln!("hub: {line}");
            }
        }
    });
    // The guard exists before the wait, so a hub that never comes up is still killed.
    let mut hub = HubProcess {
        child,
        quic: "0.0.0.0:0".parse()?,
    };
    let addr = addr_rx
        .recv_timeout(Duration::from_secs(60))
        .context("the hub did not report its QUIC address")?;
    hub.quic = addr
        .context("no local_addr in the listener line")?
        .parse()?;
    Ok(hub)
}

/// Device certificates signed by the run's CA, as `(chain, key)`.
fn issue_devices(
    pki_dir: &std::path::Path,
    n: usize,
) -> Result<Vec<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>> {
    let ca_pem = std::fs::read_to_string(pki_dir.join("ca.pem"))?;
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(pki_dir.join("ca.key"))?)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key)?;
    (0..n)
        .map(|i| {
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            let mut dn = DistinguishedName::new();
            dn.push(DnType::CommonName, format!("scale-{i:05}"));
            params.distinguished_name = dn;
            params.is_ca = IsCa::ExplicitNoCa;
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &issuer)?;
            let key_der = PrivateKeyDer::Pkcs8(key.serialize_der().into());
            Ok((vec![cert.der().clone()], key_der))
        })
        .collect()
}

fn client_config(
    roots: &Arc<rustls::RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<quinn::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots.clone())
        .with_client_auth_cert(chain, key)?;
    tls.alpn_protocols = vec![edge_agent::link::ALPN.to_vec()];
    tls.enable_early_data = false;
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(quic));
    cfg.transport_config(Arc::new(edge_agent::link::transport_config()));
    Ok(cfg)
}

/// One small block of telemetry for device `i`.
fn device_block(i: usize, epoch: u64) -> Result<Vec<u8>> {
    let records: Vec<Record> = (0..RECORDS_PER_DEVICE)
        .map(|s| Record {
            tags: Vec::new(),
            key: format!("scale-{i:05}/engine"),
            ts: 1_764_374_400_000_000_000 + s as i64 * 1_000_000_000,
            fields: vec![
                ("engine_temp_c".into(), Value::F64(80.0 + s as f64 / 10.0)),
                ("odometer_m".into(), Value::I64(100_000 + s as i64)),
                ("ignition".into(), Value::Bool(true)),
            ],
        })
        .collect();
    Ok(sync::block::encode_block(
        sync::block::VERSION_ROWS,
        epoch,
        1,
        &records,
    )?)
}

/// Runs one device: Hello, ship the block, wait for the durable ack (then release the
/// handshake slot), and keep the session alive until `stop`.
async fn device(
    conn: quinn::Connection,
    block: Vec<u8>,
    epoch: u64,
    slot: tokio::sync::OwnedSemaphorePermit,
    acked: Arc<AtomicUsize>,
    reports: tokio::sync::mpsc::UnboundedSender<Result<()>>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let clock = StdInstant::now();
    let now = || Instant::from_nanos(clock.elapsed().as_nanos() as u64);
    let (mut ctl_tx, mut ctl_rx) = conn.open_bi().await?;
    let lane = LaneAnnounce {
        stream: STREAM.into(),
        epoch,
        first_seq: 1,
        last_seq: RECORDS_PER_DEVICE,
        acked_seq: 0,
        backlog: Backlog {
            blocks: 1,
            bytes: block.len() as u64,
            oldest_unsent_ts: Some(1_764_374_400_000_000_000),
        },
        gaps: Vec::new(),
    };
    let cfg = SenderConfig::default();
    let mut frames = FrameBuffer::new(cfg.frame_bytes_max);
    let mut sender = Sender::new(cfg, epoch, vec![lane], now())?;
    let mut slot = Some(slot);
    let mut buf = vec![0u8; 4096];
    loop {
        let mut progressed = false;
        while let Some(t) = sender.poll_transmit() {
            progressed = true;
            match t.kind {
                TransmitKind::Control => ctl_tx.write_all(&t.frame).await?,
                TransmitKind::Data => {
                    let mut s = conn.open_uni().await?;
                    s.write_all(&t.frame).await?;
                    s.finish()?;
                }
            }
        }
        while let Some(ev) = sender.poll_event() {
            progressed = true;
            match ev {
                SenderEvent::Established { .. } => {}
                SenderEvent::WantBlocks {
                    stream,
                    epoch,
                    after_seq,
                    ..
                } => {
                    let blocks = if after_seq < RECORDS_PER_DEVICE {
                        vec![block.clone()]
                    } else {
                        Vec::new()
                    };
                    sender.supply_blocks(now(), &stream, epoch, blocks)?;
                }
                SenderEvent::Acked { durable_seq, .. } => {
                    if durable_seq >= RECORDS_PER_DEVICE && slot.take().is_some() {
                        acked.fetch_add(1, Ordering::SeqCst);
                        let _ = reports.send(Ok(()));
                    }
                }
                SenderEvent::MintEpoch { .. } => bail!("unexpected MintEpoch"),
                SenderEvent::StreamRefused { stream, .. } => {
                    bail!("unexpected refusal of {stream}")
                }
                SenderEvent::StreamRetrying { .. } => {}
                SenderEvent::Closed(reason) => {
                    bail!("session closed: {:?}: {}", reason.code, reason.message)
                }
            }
        }
        if progressed {
            continue;
        }
        let wait = sender.poll_timeout().map(|t| t.saturating_since(now()));
        tokio::select! {
            read = ctl_rx.read(&mut buf) => match read? {
                Some(n) => {
                    frames.push(&buf[..n]);
                    while let Some(f) = frames.next_frame()? {
                        sender.handle_frame(now(), &f);
                    }
                }
                None => bail!("hub closed the control stream"),
            },
            _ = async { match wait { Some(d) => tokio::time::sleep(d).await, None => std::future::pending().await } } => {
                sender.handle_timeout(now());
            }
            _ = stop.changed() => {
                conn.close(0u32.into(), b"test over");
                return Ok(());
            }
            closed = conn.closed() => bail!("connection lost: {closed}"),
        }
    }
}

#[test]
fn ten_thousand_devices_within_the_memory_budget() -> Result<()> {
    let self_rss = || -> Result<u64> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        let line = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .context("VmRSS")?;
        Ok(line
            .split_whitespace()
            .nth(1)
            .context("value")?
            .parse::<u64>()?
            * 1024)
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n = device_count();
    let dir = tempfile::tempdir()?;
    core_hub::pki::init(&dir.path().join("pki"), &[], false)?;
    let t0 = StdInstant::now();
    let certs = issue_devices(&dir.path().join("pki"), n)?;
    let issue_secs = t0.elapsed().as_secs_f64();
    let budget = memory_bytes_max(n);
    let hub = start_hub(dir.path(), budget)?;
    let (idle_rss, _) = hub.rss()?;
    let clients_before = self_rss()?;

    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(dir.path().join("pki/ca.pem"))? {
        roots.add(ca?)?;
    }
    let roots = Arc::new(roots);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        // Real devices each have their own socket; one socket for the whole fleet overflows
        // its receive buffer under hundreds of handshakes, and a connection whose flights keep
        // being dropped there backs off past its idle timeout. One socket per 50 devices.
        let mut endpoints = Vec::new();
        for _ in 0..n.div_ceil(DEVICES_PER_SOCKET) {
            endpoints.push(edge_agent::link::client_endpoint("127.0.0.1:0".parse()?)?);
        }
        let slots = Arc::new(Semaphore::new(CONNECTING_MAX));
        let acked = Arc::new(AtomicUsize::new(0));
        let retried = Arc::new(AtomicUsize::new(0));
        let (stop_tx, stop_rx) = watch::channel(false);
        // Each device reports once: acked, or the error that ended it.
        let (report_tx, mut report_rx) = tokio::sync::mpsc::unbounded_channel::<Result<()>>();
        let mut devices = tokio::task::JoinSet::new();
        let t1 = StdInstant::now();
        let mut peak = 0u64;
        for (i, (chain, key)) in certs.into_iter().enumerate() {
            let slot = slots.clone().acquire_owned().await?;
            let cfg = client_config(&roots, chain, key)?;
            let endpoint = endpoints[i / DEVICES_PER_SOCKET].clone();
            let connecting = endpoint.connect_with(cfg.clone(), hub.quic, "localhost")?;
            let (acked, stop, reports) = (acked.clone(), stop_rx.clone(), report_tx.clone());
            let (retried, quic) = (retried.clone(), hub.quic);
            let epoch = 1 + i as u64;
            let block = device_block(i, epoch)?;
            devices.spawn(async move {
                // A handshake that timed out is tried once more, as an agent would; the test
                // counts these and bounds them below.
                let connected = match connecting.await {
                    Err(quinn::ConnectionError::TimedOut) => {
                        retried.fetch_add(1, Ordering::SeqCst);
                        match endpoint.connect_with(cfg, quic, "localhost") {
                            Ok(again) => again.await.map_err(anyhow::Error::from),
                            Err(e) => Err(anyhow::Error::from(e)),
                        }
                    }
                    other => other.map_err(anyhow::Error::from),
                };
                let result = match connected {
                    Ok(conn) => {
                        device(conn, block, epoch, slot, acked, reports.clone(), stop).await
                    }
                    Err(e) => Err(anyhow::anyhow!("connect: {e}")),
                };
                let result = result.map_err(|e| e.context(format!("device {i}")));
                if let Err(e) = &result {
                    let _ = reports.send(Err(anyhow::anyhow!("{e:#}")));
                }
                result
            });
            if i % 500 == 0 {
                peak = peak.max(hub.rss()?.0);
            }
            // A device that failed early shows up here rather than at the end.
            if let Some(done) = devices.try_join_next() {
                done??;
                bail!("a device session ended before the test stopped it");
            }
        }
        // Every device reports once; the first failure fails the test with its cause.
        for _ in 0..n {
            report_rx.recv().await.context("reports channel closed")??;
        }
        let connect_secs = t1.elapsed().as_secs_f64();
        if let Some(done) = devices.try_join_next() {
            done??;
            bail!("a device session ended before the test stopped it");
        }
        anyhow::ensure!(
            acked.load(Ordering::SeqCst) == n,
            "{} of {n} devices acked",
            acked.load(Ordering::SeqCst)
        );
        anyhow::ensure!(
            devices.len() == n,
            "{} of {n} device sessions still up",
            devices.len()
        );
        let (rss, hwm) = hub.rss()?;
        peak = peak.max(rss);
        let clients = self_rss()?;
        stop_tx.send_replace(true);
        while let Some(done) = devices.join_next().await {
            done??;
        }
        for endpoint in &endpoints {
            endpoint.wait_idle().await;
        }
        let retried = retried.load(Ordering::SeqCst);
        println!("scale: {retried} of {n} handshakes timed out once and were retried");
        anyhow::ensure!(
            retried * 100 <= n,
            "{retried} of {n} handshakes timed out (more than 1%)"
        );
        anyhow::Ok((connect_secs, rss, hwm.max(peak), clients))
    })?;
    let (connect_secs, rss, hwm, clients) = report;
    let bound = budget + FIXED_OVERHEAD_BYTES;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "scale: {n} devices (certs issued in {issue_secs:.1} s), all connected and acked in {connect_secs:.1} s; \
         hub RSS idle {:.0} MiB, with all connected {:.0} MiB, peak {:.0} MiB = {:.1} KiB per connection; \
         bound {:.0} MiB (ingest budget {:.0} MiB, {} KiB of it per connection, + fixed {:.0} MiB); \
         the client side of the same connections (this process) grew by {:.1} KiB per connection",
        mib(idle_rss),
        mib(rss),
        mib(hwm),
        (hwm.saturating_sub(idle_rss)) as f64 / 1024.0 / n as f64,
        mib(bound),
        mib(budget),
        core_hub::server::CONNECTION_COST_BYTES >> 10,
        mib(FIXED_OVERHEAD_BYTES),
        clients.saturating_sub(clients_before) as f64 / 1024.0 / n as f64
    );
    assert!(hwm <= bound, "hub peak RSS {hwm} exceeds the bound {bound}");
    Ok(())
}
