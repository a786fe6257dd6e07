//! Per-connection bounds of the hub's QUIC server, over real QUIC with real device
//! certificates: the hub and its server run in this process, devices are built on the
//! protocol's `Sender` (as the agent is).
//!
//! - `ingest.connections_per_device_max`: a device's new connection supersedes its oldest,
//!   which ends with `SUPERSEDED`; six connections of one certificate never take the slots of
//!   a small hub, so other devices still get in and ship.
//! - `ingest.hello_timeout`: a connection that opens no control stream, or sends half a Hello,
//!   is closed with `HELLO_TIMEOUT`.
//! - `ingest.blocks_in_flight_max`: past it a device cannot open another data stream (quinn's
//!   stream credit), and the hub counts it.
//! - The ingest budget is charged before a data stream's bytes are read: with the budget
//!   spent, blocks wait (nothing is committed), and flow again once it frees.
//! - `ingest.retry_above_handshakes = 0`: every new address is validated by a QUIC Retry, and
//!   devices still connect.
//! - Receive windows: with a small budget and many connections, the windows reserved
//!   (`tributary_hub_ingest_window_reserved_bytes`) never exceed the budget, later connections
//!   get smaller windows and still ship, and every window is released when its connection
//!   ends.
//! - A handshake flood with `ingest.retry_above_handshakes = 4`: Initials replayed from many
//!   UDP sockets that never continue hold at most four handshakes, every other new address
//!   gets a Retry, and honest devices connecting through the flood still ingest.
//!
//! In each, `/metrics` counts the limit and an honest device keeps being acknowledged.
//! Mutation checks (`core_hub::server::Mutation`, feature `fault-injection`): without the
//! supersede, the read charge, the window reservation or the Retry, the scenario that guards
//! it fails.

mod common;

use common::quic::{Running, connect};

use anyhow::{Context, Result, bail, ensure};
use core_hub::server::Mutation;
use core_hub::{Hub, HubConfig};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};
use sync::block::{VERSION_ROWS, encode_block};
use sync::protocol::{
    Backlog, ErrorCode, FrameBuffer, Instant, LaneAnnounce, Sender, SenderConfig, SenderEvent,
    TransmitKind,
};
use tokio::sync::watch;

const STREAM: &str = "telemetry";
const RECORDS_PER_BLOCK: u64 = 20;
/// Blocks a device keeps unacknowledged.
const IN_FLIGHT_BLOCKS: u64 = 4;
/// Only bounds a broken build's wait.
const WAIT: Duration = Duration::from_secs(20);

/// How a device's session ended, as the device saw it.
#[derive(Debug)]
struct Ended {
    code: Option<u64>,
}

fn code(c: ErrorCode) -> Option<u64> {
    Some(u64::from(c.to_u16()))
}

/// The device's log in `epoch`: block `n` holds seqs `n * RECORDS_PER_BLOCK + 1 ..`.
fn device_block(device: &str, epoch: u64, n: u64) -> Vec<u8> {
    let first = n * RECORDS_PER_BLOCK + 1;
    let records = common::records(device, first, first + RECORDS_PER_BLOCK - 1);
    encode_block(VERSION_ROWS, epoch, first, &records).unwrap()
}

/// One device session in a fresh `epoch` (so a reconnecting device needs no log of its past
/// sessions): it ships blocks up to `limit` (blocks in its log), keeping [`IN_FLIGHT_BLOCKS`]
/// unacknowledged, and reports every ack on `acked`. Returns when the session ends.
async fn device(
    device: String,
    epoch: u64,
    conn: quinn::Connection,
    acked: watch::Sender<u64>,
    mut limit: watch::Receiver<u64>,
) -> Result<Ended> {
    let clock = StdInstant::now();
    let now = || Instant::from_nanos(clock.elapsed().as_nanos() as u64);
    let (mut ctl_tx, mut ctl_rx) = conn.open_bi().await?;
    let lane = LaneAnnounce {
        stream: STREAM.into(),
        epoch,
        first_seq: 1,
        last_seq: 0,
        acked_seq: 0,
        backlog: Backlog::default(),
        gaps: Vec::new(),
    };
    let mut sender = Sender::new(SenderConfig::default(), epoch, vec![lane], now())?;
    let mut frames = FrameBuffer::new(SenderConfig::default().frame_bytes_max);
    let (mut written, mut durable) = (0u64, 0u64);
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let cap = *limit.borrow_and_update();
        while written < cap.min(durable / RECORDS_PER_BLOCK + IN_FLIGHT_BLOCKS) {
            sender.offer_block(now(), STREAM, device_block(&device, epoch, written))?;
            written += 1;
        }
        while let Some(t) = sender.poll_transmit() {
            let sent = match t.kind {
                TransmitKind::Control => ctl_tx.write_all(&t.frame).await.map_err(|_| ()),
                TransmitKind::Data => send_uni(&conn, &t.frame).await,
            };
            if sent.is_err() {
                return Ok(Ended {
                    code: close_code(&conn).await,
                });
            }
        }
        let mut progressed = false;
        while let Some(ev) = sender.poll_event() {
            progressed = true;
            match ev {
                SenderEvent::WantBlocks { after_seq, .. } => {
                    let blocks = (after_seq / RECORDS_PER_BLOCK..written)
                        .map(|n| device_block(&device, epoch, n))
                        .collect();
                    sender.supply_blocks(now(), STREAM, epoch, blocks)?;
                }
                SenderEvent::Acked { durable_seq, .. } => {
                    durable = durable.max(durable_seq);
                    acked.send_replace(durable);
                }
                SenderEvent::Closed(r) => {
                    return Ok(Ended {
                        code: Some(u64::from(r.code.to_u16())),
                    });
                }
                SenderEvent::Established { .. } => {}
                SenderEvent::StreamRefused { stream, .. } => bail!("stream {stream} refused"),
                SenderEvent::StreamRetrying { .. } => {}
                SenderEvent::MintEpoch { .. } => bail!("unexpected MintEpoch"),
            }
        }
        if progressed {
            continue;
        }
        tokio::select! {
            read = ctl_rx.read(&mut buf) => match read {
                Ok(Some(n)) => {
                    frames.push(&buf[..n]);
                    while let Some(f) = frames.next_frame()? {
                        sender.handle_frame(now(), &f);
                    }
                }
                Ok(None) | Err(_) => return Ok(Ended { code: close_code(&conn).await }),
            },
            _ = limit.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => sender.handle_timeout(now()),
            _ = conn.closed() => return Ok(Ended { code: close_code(&conn).await }),
        }
    }
}

async fn send_uni(conn: &quinn::Connection, frame: &[u8]) -> Result<(), ()> {
    let mut s = conn.open_uni().await.map_err(|_| ())?;
    s.write_all(frame).await.map_err(|_| ())?;
    s.finish().map_err(|_| ())
}

/// The application close code, once the connection is closed.
async fn close_code(conn: &quinn::Connection) -> Option<u64> {
    match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(c) => Some(c.error_code.into_inner()),
        _ => None,
    }
}

/// Waits for `cond` to hold, checking every few milliseconds, up to `within`.
async fn wait_for(what: &str, within: Duration, mut cond: impl FnMut() -> bool) -> Result<()> {
    let deadline = StdInstant::now() + within;
    while !cond() {
        ensure!(StdInstant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn metric(hub: &Hub, name: &str) -> u64 {
    let text = core_hub::metrics::render(hub);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// A device session on its own task, the acks it got, and the size of its log.
struct Session {
    task: tokio::task::JoinHandle<Result<Ended>>,
    acked: watch::Receiver<u64>,
    limit: watch::Sender<u64>,
}

impl Session {
    /// Waits until the hub acknowledged `blocks` blocks of this session.
    async fn acked_blocks(&mut self, blocks: u64) -> Result<()> {
        let target = blocks * RECORDS_PER_BLOCK;
        tokio::time::timeout(WAIT, self.acked.wait_for(|&a| a >= target))
            .await
            .context("the device was not acknowledged in time")??;
        Ok(())
    }
}

/// Starts `name`'s device on `conn` in `epoch` with a log of `blocks` blocks.
fn run_device(name: &str, epoch: u64, conn: quinn::Connection, blocks: u64) -> Session {
    let (acked_tx, acked) = watch::channel(0u64);
    let (limit, limit_rx) = watch::channel(blocks);
    let task = tokio::spawn(device(name.to_string(), epoch, conn, acked_tx, limit_rx));
    Session { task, acked, limit }
}

/// Connects `name` and waits until the hub acknowledged a few blocks.
async fn ingesting(run: &Running, name: &str, cert: &Path) -> Result<Session> {
    let conn = connect(run.quic, cert).await?;
    let mut s = run_device(name, 1, conn, u64::MAX);
    s.acked_blocks(10).await?;
    Ok(s)
}

/// An ingest budget that allows three connections: 3/4 of it over their cost each.
const SMALL_HUB_MEMORY_BYTES: u64 = 4 * core_hub::server::CONNECTION_COST_BYTES;

fn small_hub(c: &mut HubConfig) {
    c.ingest.memory_bytes_max = SMALL_HUB_MEMORY_BYTES;
}

/// One certificate connects six times: each connection supersedes the one before with
/// `SUPERSEDED`, and two other devices still get into the three-connection hub and ship.
async fn supersede_scenario(run: &Running) -> Result<()> {
    let cert = common::quic::issue(&run.pki, "dev-1")?.0;
    let mut old = ingesting(run, "dev-1", &cert).await?;
    for round in 1..=5u64 {
        let conn = connect(run.quic, &cert).await?;
        let mut new = run_device("dev-1", round + 1, conn, u64::MAX);
        let ended = tokio::time::timeout(Duration::from_secs(5), &mut old.task)
            .await
            .context("the device's old connection was not superseded")???;
        assert_eq!(ended.code, code(ErrorCode::Superseded), "round {round}");
        // The new connection is served.
        new.acked_blocks(5).await?;
        assert_eq!(
            metric(&run.hub, "tributary_hub_connections_superseded_total"),
            round
        );
        old = new;
    }
    // Three slots in all; dev-1 holds one, so two honest devices get the other two.
    for name in ["dev-2", "dev-3"] {
        let cert = common::quic::issue(&run.pki, name)?.0;
        let s = ingesting(run, name, &cert).await?;
        assert!(!s.task.is_finished(), "{name}'s session ended");
    }
    assert!(!old.task.is_finished(), "dev-1's newest session ended");
    assert_eq!(
        metric(&run.hub, "tributary_hub_connections_refused_total"),
        0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_supersedes_the_devices_oldest() -> Result<()> {
    let run = common::quic::start(Mutation::None, small_hub).await?;
    supersede_scenario(&run).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_without_supersede_one_certificate_fills_the_hub() -> Result<()> {
    let run = common::quic::start(Mutation::NoSupersede, small_hub).await?;
    let err = supersede_scenario(&run).await;
    println!("without supersede: {err:?}");
    assert!(
        err.is_err(),
        "the supersede scenario passed without its guard"
    );
    assert_eq!(
        metric(&run.hub, "tributary_hub_connections_superseded_total"),
        0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_without_a_timely_hello_are_closed() -> Result<()> {
    let run = common::quic::start(Mutation::None, |c| {
        c.ingest.conn.hello_timeout = Duration::from_millis(300);
    })
    .await?;
    let cert = common::quic::issue(&run.pki, "dev-1")?.0;
    // No control stream at all.
    let silent = connect(run.quic, &cert).await?;
    let got = tokio::time::timeout(WAIT, close_code(&silent)).await?;
    assert_eq!(got, code(ErrorCode::HelloTimeout));
    // A control stream with half a Hello: a length prefix, then nothing more.
    let other = common::quic::issue(&run.pki, "dev-2")?.0;
    let half = connect(run.quic, &other).await?;
    let (mut tx, _rx) = half.open_bi().await?;
    tx.write_all(&[200, 0, 0, 0, 1, 2]).await?;
    let got = tokio::time::timeout(WAIT, close_code(&half)).await?;
    assert_eq!(got, code(ErrorCode::HelloTimeout));
    assert_eq!(
        metric(&run.hub, "tributary_hub_connections_hello_timeout_total"),
        2
    );
    // An honest device sends its Hello at once and is served.
    let honest = common::quic::issue(&run.pki, "dev-3")?.0;
    let mut s = ingesting(&run, "dev-3", &honest).await?;
    s.acked_blocks(20).await?;
    assert!(!s.task.is_finished());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_streams_beyond_blocks_in_flight_wait_for_credit() -> Result<()> {
    let run = common::quic::start(Mutation::None, |c| {
        c.ingest.conn.blocks_in_flight_max = 2;
        c.ingest.conn.hello_timeout = Duration::from_secs(60);
    })
    .await?;
    let cert = common::quic::issue(&run.pki, "dev-1")?.0;
    let conn = connect(run.quic, &cert).await?;
    // The start of a Hello opens the session (quinn shows a stream once it carries data).
    let (mut ctl_tx, _ctl_rx) = conn.open_bi().await?;
    ctl_tx.write_all(&[200, 0, 0, 0, 1]).await?;
    // Two data streams that never finish hold both places.
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut s = conn.open_uni().await?;
        s.write_all(&[100, 0]).await?;
        open.push(s);
    }
    let hub = run.hub.clone();
    wait_for("the in-flight limit on /metrics", WAIT, || {
        metric(&hub, "tributary_hub_blocks_in_flight_limited_total") >= 1
    })
    .await?;
    // A third stream gets no credit while they are open.
    let third = tokio::time::timeout(Duration::from_millis(500), conn.open_uni()).await;
    assert!(
        third.is_err(),
        "a third data stream was opened past the limit"
    );
    // An honest device, with the same limit, keeps being acknowledged.
    let honest = common::quic::issue(&run.pki, "dev-2")?.0;
    let mut s = ingesting(&run, "dev-2", &honest).await?;
    s.acked_blocks(30).await?;
    assert!(!s.task.is_finished());
    Ok(())
}

/// With the ingest budget spent, a device's data streams wait before they are read (counted),
/// nothing of them commits; once the budget frees they commit.
async fn budget_scenario(run: &Running) -> Result<()> {
    let cert = common::quic::issue(&run.pki, "dev-1")?.0;
    let conn = connect(run.quic, &cert).await?;
    let mut s = run_device("dev-1", 1, conn, 10);
    s.acked_blocks(10).await?;
    // Every commit is durable: only the connection's own charge (its cost and its window
    // above the floor) is held. Take the rest.
    let hub = run.hub.clone();
    let window = metric(&hub, "tributary_hub_ingest_window_reserved_bytes");
    let connection_only =
        core_hub::server::CONNECTION_COST_BYTES + window - core_hub::server::WINDOW_FLOOR_BYTES;
    wait_for("commits to release their charge", WAIT, || {
        hub.memory_in_use_bytes() <= connection_only
    })
    .await?;
    let free = run.hub.memory().available_permits() as u32;
    let held = run.hub.memory().clone().try_acquire_many_owned(free)?;
    let waits = metric(&run.hub, "tributary_hub_data_memory_waits_total");
    s.limit.send_replace(20);
    wait_for(
        "a data stream waiting for the budget",
        Duration::from_secs(5),
        || metric(&hub, "tributary_hub_data_memory_waits_total") > waits,
    )
    .await?;
    // Nothing is committed while the budget is spent.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*s.acked.borrow(), 10 * RECORDS_PER_BLOCK);
    drop(held);
    s.acked_blocks(20).await?;
    assert!(!s.task.is_finished());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_streams_are_charged_to_the_budget_before_they_are_read() -> Result<()> {
    let run = common::quic::start(Mutation::None, |_| {}).await?;
    budget_scenario(&run).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_with_uncharged_reads_nothing_waits_for_the_budget() -> Result<()> {
    let run = common::quic::start(Mutation::UnchargedReads, |_| {}).await?;
    let err = budget_scenario(&run).await;
    println!("uncharged reads: {err:?}");
    assert!(err.is_err(), "the budget scenario passed without its guard");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_new_address_is_validated_by_retry_when_asked() -> Result<()> {
    let run = common::quic::start(Mutation::None, |c| {
        c.ingest.conn.retry_above_handshakes = 0;
    })
    .await?;
    let cert = common::quic::issue(&run.pki, "dev-1")?.0;
    let mut s = ingesting(&run, "dev-1", &cert).await?;
    s.acked_blocks(20).await?;
    assert!(metric(&run.hub, "tributary_hub_quic_retries_total") >= 1);
    assert_eq!(
        metric(&run.hub, "tributary_hub_quic_handshakes_in_progress"),
        0
    );
    Ok(())
}

/// The budget of the window scenario: its windows' share (1/8, 2 MiB) is less than one full
/// window (the receiver's 4 MiB block window + 1 MiB), so connections get smaller windows.
const WINDOW_HUB_MEMORY_BYTES: u64 = 16 << 20;
/// Connections of the window scenario, each its own device.
const WINDOW_DEVICES: usize = 12;

/// Samples the reserved windows every few milliseconds until `stop`; returns their peak.
fn sample_windows(hub: Arc<Hub>, stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut peak = 0;
        while !*stop.borrow() {
            peak = peak.max(metric(&hub, "tributary_hub_ingest_window_reserved_bytes"));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        peak
    })
}

/// [`WINDOW_DEVICES`] devices connect to a hub with a small budget and ship as fast as their
/// windows let them: the windows reserved never exceed the budget (nor what the budget has
/// charged), later connections get reduced windows and still ship, and closing every
/// connection releases every window and every byte.
async fn window_scenario(run: &Running) -> Result<()> {
    let (stop_tx, stop) = watch::channel(false);
    let sampler = sample_windows(run.hub.clone(), stop);
    let mut sessions = Vec::new();
    for i in 0..WINDOW_DEVICES {
        let name = format!("dev-{i}");
        let cert = common::quic::issue(&run.pki, &name)?.0;
        let conn = connect(run.quic, &cert).await?;
        sessions.push((conn.clone(), run_device(&name, 1, conn, u64::MAX)));
    }
    for (_, s) in &mut sessions {
        s.acked_blocks(10).await?;
    }
    let hub = run.hub.clone();
    let reserved = metric(&hub, "tributary_hub_ingest_window_reserved_bytes");
    ensure!(
        reserved <= hub.memory_in_use_bytes(),
        "{reserved} bytes of windows but only {} bytes charged to the budget",
        hub.memory_in_use_bytes()
    );
    let reduced = metric(&hub, "tributary_hub_ingest_windows_reduced_total");
    ensure!(
        reduced >= WINDOW_DEVICES as u64 - 1,
        "only {reduced} of {WINDOW_DEVICES} connections got a reduced window"
    );
    for (conn, s) in sessions {
        conn.close(0u32.into(), b"done");
        let _ = s.task.await;
    }
    wait_for("every window to be released", WAIT, || {
        metric(&hub, "tributary_hub_ingest_window_reserved_bytes") == 0
            && hub.memory_in_use_bytes() == 0
    })
    .await?;
    stop_tx.send_replace(true);
    let peak = sampler.await?;
    ensure!(
        peak <= WINDOW_HUB_MEMORY_BYTES,
        "the windows reserved peaked at {peak} bytes, above the {WINDOW_HUB_MEMORY_BYTES}-byte budget"
    );
    ensure!(peak > 0, "no window was ever reserved");
    println!("windows: peak {peak} bytes reserved, {reduced} reduced");
    Ok(())
}

fn window_hub(c: &mut HubConfig) {
    c.ingest.memory_bytes_max = WINDOW_HUB_MEMORY_BYTES;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_windows_are_reserved_from_the_budget_and_released() -> Result<()> {
    let run = common::quic::start(Mutation::None, window_hub).await?;
    window_scenario(&run).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_with_unreserved_windows_they_exceed_the_budget() -> Result<()> {
    let run = common::quic::start(Mutation::UnreservedWindows, window_hub).await?;
    let err = window_scenario(&run).await;
    println!("unreserved windows: {err:?}");
    assert!(err.is_err(), "the window scenario passed without its guard");
    Ok(())
}

/// Handshakes in progress from which the flood scenario's hub sends Retries.
const RETRY_ABOVE: u64 = 4;
/// Clients that send an Initial and never continue.
const STALLED: usize = 32;
/// Honest devices connecting through the flood.
const HONEST: usize = 6;

/// QUIC v1 long-header packet types (bits 4-5 of the first byte, not header-protected; the
/// fixed bit may be greased, so it is not looked at).
const LONG_HEADER: u8 = 0x80;
const INITIAL: u8 = 0;
const RETRY: u8 = 3;

/// The long-header packet type of a datagram, `None` for a short header.
fn long_type(datagram: &[u8]) -> Option<u8> {
    let b = *datagram.first()?;
    (b & LONG_HEADER != 0).then_some((b >> 4) & 0x03)
}

/// `n` distinct client Initials (first datagrams of real quinn clients, with `cert`), caught
/// by a socket that never answers.
async fn captured_initials(cert: &Path, n: usize) -> Result<Vec<Vec<u8>>> {
    let trap = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    let tls = edge_agent::link::TlsPaths {
        ca: cert.join("ca.pem"),
        cert: cert.join("device.pem"),
        key: cert.join("device.key"),
    };
    let mut endpoint = edge_agent::link::client_endpoint("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(edge_agent::link::client_config(&tls)?);
    let to = trap.local_addr()?;
    let _connecting: Vec<_> = (0..n)
        .map(|_| endpoint.connect(to, "localhost"))
        .collect::<Result<_, _>>()?;
    let mut initials: Vec<Vec<u8>> = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    while initials.len() < n {
        let len = tokio::time::timeout(WAIT, trap.recv(&mut buf)).await??;
        let d = &buf[..len];
        ensure!(long_type(d) == Some(INITIAL), "not a QUIC Initial");
        // Byte 5 is the destination connection id's length; a retransmission repeats it.
        let dcid = |p: &[u8]| p[6..6 + p[5] as usize].to_vec();
        if !initials.iter().any(|i| dcid(i) == dcid(d)) {
            initials.push(d.to_vec());
        }
    }
    endpoint.close(0u32.into(), b"captured");
    Ok(initials)
}

/// Replays `initial` from a fresh UDP socket (a client that never continues) and returns the
/// type bits of the hub's first answer.
async fn replay(
    hub: std::net::SocketAddr,
    initial: Vec<u8>,
) -> Result<(u8, tokio::net::UdpSocket)> {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
    sock.send_to(&initial, hub).await?;
    let mut buf = vec![0u8; 1 << 16];
    let (len, _) = tokio::time::timeout(WAIT, sock.recv_from(&mut buf))
        .await
        .context("the hub did not answer a replayed Initial")??;
    let kind = long_type(&buf[..len]).context("a short-header answer to an Initial")?;
    Ok((kind, sock))
}

/// A flood of [`STALLED`] Initials that never continue, each from its own socket, then
/// [`HONEST`] devices connecting at once through it, each from its own endpoint: at most
/// [`RETRY_ABOVE`] stalled clients get handshake state, every other gets a Retry (counted),
/// the handshakes in progress stay bounded, and every honest device ingests.
async fn handshake_flood_scenario(run: &Running) -> Result<()> {
    let stalled_cert = common::quic::issue(&run.pki, "stalled")?.0;
    let initials = captured_initials(&stalled_cert, STALLED).await?;
    let replays: Vec<_> = initials
        .into_iter()
        .map(|i| tokio::spawn(replay(run.quic, i)))
        .collect();
    let (mut stateful, mut retried, mut held) = (0, 0, Vec::new());
    for r in replays {
        let (kind, sock) = r.await??;
        match kind {
            INITIAL => stateful += 1,
            RETRY => retried += 1,
            other => bail!("the hub answered an Initial with long-header type {other}"),
        }
        held.push(sock);
    }
    let (stop_tx, stop) = watch::channel(false);
    let hub = run.hub.clone();
    let peak_handshakes = tokio::spawn(async move {
        let mut peak = 0;
        while !*stop.borrow() {
            peak = peak.max(metric(&hub, "tributary_hub_quic_handshakes_in_progress"));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        peak
    });
    // Honest devices connect all at once, each from its own endpoint (common::quic::connect).
    let quic = run.quic;
    let mut connecting = Vec::new();
    for i in 0..HONEST {
        let name = format!("honest-{i}");
        let cert = common::quic::issue(&run.pki, &name)?.0;
        connecting.push(tokio::spawn(async move {
            let conn = connect(quic, &cert).await?;
            Ok::<_, anyhow::Error>((name, conn))
        }));
    }
    let mut sessions = Vec::new();
    for c in connecting {
        let (name, conn) = c.await??;
        sessions.push(run_device(&name, 1, conn, u64::MAX));
    }
    for s in &mut sessions {
        s.acked_blocks(10).await?;
    }
    stop_tx.send_replace(true);
    let peak = peak_handshakes.await?;
    let retries = metric(&run.hub, "tributary_hub_quic_retries_total");
    println!(
        "handshake flood: {stateful} stalled with state, {retried} retried; {retries} Retries \
         in all; peak {peak} handshakes in progress"
    );
    ensure!(
        stateful as u64 <= RETRY_ABOVE,
        "{stateful} stalled clients got handshake state, above retry_above_handshakes {RETRY_ABOVE}"
    );
    ensure!(
        retries >= (STALLED as u64 - RETRY_ABOVE) + HONEST as u64,
        "{retries} Retries for {STALLED} stalled clients and {HONEST} honest devices"
    );
    // The stalled handshakes plus the honest ones (validated, let through): bounded.
    ensure!(
        peak <= RETRY_ABOVE + HONEST as u64,
        "{peak} handshakes in progress at once"
    );
    drop(held);
    Ok(())
}

fn flood_hub(c: &mut HubConfig) {
    c.ingest.conn.retry_above_handshakes = RETRY_ABOVE as u32;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_flood_is_met_with_retries_and_devices_still_connect() -> Result<()> {
    let run = common::quic::start(Mutation::None, flood_hub).await?;
    handshake_flood_scenario(&run).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_without_retry_a_handshake_flood_holds_state() -> Result<()> {
    let run = common::quic::start(Mutation::NoRetry, flood_hub).await?;
    let err = handshake_flood_scenario(&run).await;
    println!("without retry: {err:?}");
    assert!(err.is_err(), "the flood scenario passed without its guard");
    assert_eq!(metric(&run.hub, "tributary_hub_quic_retries_total"), 0);
    Ok(())
}
