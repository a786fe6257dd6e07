//! The QUIC server: a thin quinn driver around `sync::protocol::Receiver`, one per connection.
//!
//! The device id is the subject CN of the client certificate that mutual TLS verified; no
//! frame can name it. Control frames travel on the bidirectional stream the agent opens
//! first; each Block or Gap frame may come on its own unidirectional stream, in any order,
//! and the receiver reorders them within the window it advertised. Commits are submitted to
//! the hub's WAL in the order the receiver emits them and acknowledged only once
//! [`crate::ingest::PendingCommit::wait`] reports them fsynced and in the catalog.
//!
//! A misbehaving peer (bad frame, oversize frame, bad block, conflict) gets an Error frame and
//! its connection closed; every other connection carries on.
//!
//! # Decoding off the connection task
//!
//! Decoding a block and hashing its records is most of the hub's CPU per block (a 32,768-record
//! catch-up block costs tens of milliseconds). Each data stream's task therefore verifies,
//! decodes and hashes its Block frame on the blocking pool ([`DecodedBlock::decode`], into
//! record buffers reused from [`crate::ingest::RecordPool`]) and the connection task only runs
//! the receiver's bookkeeping ([`Receiver::handle_decoded_block`]). Up to [`DECODE_AHEAD`] data
//! streams per connection are read and decoded at once, and their results are fed to the
//! receiver in the order the streams were opened, which is the order the agent sent them, so
//! blocks reach the receiver in seq order and never wait decoded in its reorder buffer.
//! A decoded block holds its [`crate::ingest::block_cost`] of the ingest budget (its body and
//! its records' exact decoded size, computed before they are built) until the receiver took
//! it; when the budget cannot cover it at once, the frame goes to the receiver undecoded (it
//! decodes it itself, within the same decode limits), so decoding ahead never waits for memory
//! and cannot deadlock with commits waiting for it. A block whose records would exceed
//! `ingest.block_decoded_bytes_max` closes the session with `DECODED_TOO_LARGE`.
//!
//! # Memory per connection
//!
//! Every established connection reserves [`CONNECTION_COST_BYTES`] from the global ingest
//! budget (`ingest.memory_bytes_max`) for its lifetime: its quinn and TLS state, the protocol
//! receiver and the driver's buffers, measured at 109–115 KiB idle. Connections together may
//! hold at most [`CONNECTIONS_BUDGET_SHARE`] of the budget, so blocks always keep the rest; a
//! device that would exceed it is refused (`LIMIT_EXCEEDED`) and retries with its backoff.
//! The hub's memory is therefore `ingest.memory_bytes_max` plus a fixed overhead (runtime,
//! SQLite, WAL writer) for any number of devices. Idle connections hold no receive buffers
//! (quinn allocates them as data arrives, and the control stream is read chunk by chunk), so
//! the flow-control windows bound only what an active connection has in flight.
//!
//! # Refused streams
//!
//! A stream the device may not write (not on its allow-list, or an invalid name) ends the
//! session with `UNAUTHORIZED_STREAM` and a message that names the stream between backticks
//! (the first backtick-quoted word). The agent then leaves that stream out of its next sessions
//! (`edge_agent::replicator`), so its allowed streams keep flowing after one reconnect.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use rustls::pki_types::CertificateDer;
use sync::protocol::Instant;
use sync::protocol::{
    Backlog, BacklogEntry, CommitItem, DecodedBlock, ErrorCode, Frame, FrameBuffer, LaneMarks,
    Marks, MarksQuery, Receiver, ReceiverConfig, ReceiverEvent,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use crate::config::HubConfig;
use crate::ingest::{BacklogReport, Hub, IngestError, VerifiedBlock};
use crate::pki::{self, SharedRevocations};
use crate::wal::CommitError;

/// What an idle, established connection costs the hub (see the module docs), charged to the
/// ingest budget for the connection's lifetime.
pub const CONNECTION_COST_BYTES: u64 = 128 << 10;
/// The share of the ingest budget connections may hold together, in quarters: 3/4.
pub const CONNECTIONS_BUDGET_SHARE: (u64, u64) = (3, 4);
/// How long a new connection waits for its share of the budget before it is refused.
const CONNECTION_ADMIT_WAIT: Duration = Duration::from_secs(5);

/// How often the revocation list file is checked for changes: a revoked certificate's live
/// sessions are closed within this plus [`SETTLE_ON_CLOSE`].
const REVOCATION_POLL: Duration = Duration::from_millis(250);
/// How long a closing session waits for the commits it already handed to the WAL, so that
/// nothing of it becomes durable after the device saw the session end.
const SETTLE_ON_CLOSE: Duration = Duration::from_secs(1);
/// Socket buffers requested for the QUIC listener.
const UDP_BUFFER_BYTES: usize = 16 << 20;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the [tls] section is required to accept devices over QUIC")]
    NoTls,
    #[error("TLS: {0}")]
    Tls(#[from] pki::TlsError),
    #[error("QUIC: {0}")]
    Quic(String),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("revocation list: {0}")]
    Revocations(std::io::Error),
}

/// Flow-control settings for device connections.
///
/// The per-connection receive window is the receiver's advertised block window (32 MiB) plus
/// headroom for control frames; the global ingest memory budget in `[ingest]` bounds what all
/// connections together may hold decoded, so windows only bound bytes on the wire.
pub fn transport_config(window_bytes: u64) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let window = u32::try_from(window_bytes + (1 << 20)).unwrap_or(u32::MAX);
    t.receive_window(quinn::VarInt::from_u32(window));
    t.stream_receive_window(quinn::VarInt::from_u32(window.min(16 << 20)));
    t.send_window(8 << 20);
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(1024));
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(4));
    t.keep_alive_interval(Some(Duration::from_secs(5)));
    t.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        30_000,
    ))));
    // BBR, not the default loss-based Cubic: devices sit on lossy cellular and satellite links
    // where random loss is not congestion; the hub sends acks and control frames, and uses the
    // same controller so both directions keep their rate under loss (issue 4, "Network faults").
    t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
    t
}

/// A running QUIC listener.
#[derive(Debug)]
pub struct Server {
    pub endpoint: quinn::Endpoint,
    pub local_addr: SocketAddr,
}

/// Test-only switches that leave one revocation guard out, so the revocation suite can prove
/// it catches the bug (`core-hub/tests/revocation.rs`). Only [`Mutation::None`] exists without
/// the `fault-injection` feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mutation {
    #[default]
    None,
    /// Live sessions are checked against revoked devices only, not serials.
    #[cfg(feature = "fault-injection")]
    RevokeByDeviceOnly,
    /// The Error frame of a closed session goes out before its commits settled.
    #[cfg(feature = "fault-injection")]
    CloseBeforeSettle,
}

/// Binds the QUIC listener and serves devices until `shutdown` flips to true.
pub async fn start(
    cfg: &HubConfig,
    hub: Arc<Hub>,
    shutdown: watch::Receiver<bool>,
) -> Result<(Server, tokio::task::JoinHandle<()>), ServeError> {
    start_mutated(cfg, hub, shutdown, Mutation::None).await
}

/// As [`start`], with a test-only [`Mutation`] (feature `fault-injection`).
#[cfg(feature = "fault-injection")]
pub async fn start_with_mutation(
    cfg: &HubConfig,
    hub: Arc<Hub>,
    shutdown: watch::Receiver<bool>,
    mutation: Mutation,
) -> Result<(Server, tokio::task::JoinHandle<()>), ServeError> {
    tracing::error!(?mutation, "TEST-ONLY MUTATION: a revocation guard is off");
    start_mutated(cfg, hub, shutdown, mutation).await
}

async fn start_mutated(
    cfg: &HubConfig,
    hub: Arc<Hub>,
    mut shutdown: watch::Receiver<bool>,
    mutation: Mutation,
) -> Result<(Server, tokio::task::JoinHandle<()>), ServeError> {
    let tls_paths = cfg.tls.as_ref().ok_or(ServeError::NoTls)?;
    let revocations =
        SharedRevocations::open(&tls_paths.revoked).map_err(ServeError::Revocations)?;
    hub.stats().revocation.publish(&revocations.current());
    tracing::info!(
        path = %tls_paths.revoked.display(),
        entries = revocations.current().len(),
        problems = revocations.current().problems().len(),
        "revocation list (tls.revoked) loaded"
    );
    let tls = pki::server_tls_config(tls_paths, revocations.clone())?;
    let quic_tls = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| ServeError::Quic(e.to_string()))?;
    let receiver_cfg = receiver_config(cfg);
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(quic_tls));
    server_cfg.transport_config(Arc::new(transport_config(receiver_cfg.window_bytes)));
    let socket = udp_socket(cfg.listen.quic)?;
    let runtime =
        quinn::default_runtime().ok_or_else(|| ServeError::Quic("no async runtime".into()))?;
    let endpoint = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server_cfg),
        socket,
        runtime,
    )
    .map_err(|source| ServeError::Bind {
        addr: cfg.listen.quic,
        source,
    })?;
    let local_addr = endpoint.local_addr().map_err(|source| ServeError::Bind {
        addr: cfg.listen.quic,
        source,
    })?;
    let (revoke_tx, revoke_rx) = watch::channel(0u64);
    let (num, den) = CONNECTIONS_BUDGET_SHARE;
    let conn_share = cfg.ingest.memory_bytes_max / den * num;
    let connections = Arc::new(Semaphore::new(
        usize::try_from(conn_share / CONNECTION_COST_BYTES)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS),
    ));
    tokio::spawn(poll_revocations(
        revocations.clone(),
        hub.clone(),
        revoke_tx,
    ));
    let ep = endpoint.clone();
    let task = tokio::spawn(async move {
        let clock = StdInstant::now();
        loop {
            let incoming = tokio::select! {
                i = ep.accept() => i,
                _ = shutdown.changed() => None,
            };
            let Some(incoming) = incoming else { break };
            let ctx = ConnCtx {
                hub: hub.clone(),
                revocations: revocations.clone(),
                revoke_rx: revoke_rx.clone(),
                receiver_cfg: receiver_cfg.clone(),
                connections: connections.clone(),
                clock,
                mutation,
            };
            tokio::spawn(async move {
                if let Err(e) = connection(ctx, incoming).await {
                    tracing::info!(error = %e, "device connection ended");
                }
            });
        }
        ep.close(
            quinn::VarInt::from_u32(u32::from(ErrorCode::Shutdown.to_u16())),
            b"hub shutting down",
        );
    });
    tracing::info!(%local_addr, "QUIC listener up");
    Ok((
        Server {
            endpoint,
            local_addr,
        },
        task,
    ))
}

fn receiver_config(cfg: &HubConfig) -> ReceiverConfig {
    let mut r = ReceiverConfig::default();
    r.decode_limits.body_bytes_max = cfg.ingest.block_bytes_max;
    r.decode_limits.raw_bytes_max = cfg.ingest.block_raw_bytes_max;
    r.decode_limits.records_max = cfg.ingest.records_per_block_max;
    r.decode_limits.decoded_bytes_max = cfg.ingest.block_decoded_bytes_max;
    r.frame_bytes_max = cfg.ingest.block_bytes_max.saturating_add(1 << 16);
    r.lanes_max = cfg.ingest.streams_per_connection_max.get() as usize;
    // One connection never holds more than a quarter of the global ingest budget.
    r.window_bytes = r
        .window_bytes
        .min(cfg.ingest.memory_bytes_max / 4)
        .max(1 << 20);
    r
}

fn udp_socket(addr: SocketAddr) -> Result<std::net::UdpSocket, ServeError> {
    let bind_err = |source| ServeError::Bind { addr, source };
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )
    .map_err(bind_err)?;
    // Best effort: the kernel clamps to net.core.rmem_max, which only costs throughput.
    let _ = sock.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = sock.set_send_buffer_size(UDP_BUFFER_BYTES);
    sock.bind(&addr.into()).map_err(bind_err)?;
    Ok(sock.into())
}

/// Reloads the revocation list when its file changes and tells every connection. A list that
/// cannot be read leaves the previous one in force, loudly: that is never "nothing revoked".
async fn poll_revocations(
    revocations: Arc<SharedRevocations>,
    hub: Arc<Hub>,
    tx: watch::Sender<u64>,
) {
    let stats = &hub.stats().revocation;
    let mut generation = 0u64;
    loop {
        tokio::time::sleep(REVOCATION_POLL).await;
        match revocations.reload_if_changed() {
            Ok(true) => {
                generation += 1;
                let list = revocations.current();
                stats.publish(&list);
                tracing::info!(
                    revoked = list.len(),
                    problems = list.problems().len(),
                    "revocation list reloaded"
                );
                if tx.send(generation).is_err() {
                    return;
                }
            }
            Ok(false) => {}
            Err(e) => {
                stats
                    .load_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::error!(
                    path = %revocations.path().display(),
                    error = %e,
                    "cannot read the revocation list; the previous list stays in force"
                );
            }
        }
    }
}

struct ConnCtx {
    hub: Arc<Hub>,
    revocations: Arc<SharedRevocations>,
    revoke_rx: watch::Receiver<u64>,
    receiver_cfg: ReceiverConfig,
    /// One permit per connection the budget share allows.
    connections: Arc<Semaphore>,
    clock: StdInstant,
    mutation: Mutation,
}

/// A connection's reservation: its slot among connections and its bytes of the ingest budget.
struct ConnectionCharge {
    _slot: OwnedSemaphorePermit,
    _memory: OwnedSemaphorePermit,
}

/// Charges a new connection to the ingest budget, waiting a little when it is spent.
async fn admit_connection(ctx: &ConnCtx) -> Result<ConnectionCharge, String> {
    let full = || {
        format!(
            "the hub is at its connection capacity ({} connections within the ingest memory budget)",
            ctx.connections.available_permits()
        )
    };
    let slot = ctx
        .connections
        .clone()
        .try_acquire_owned()
        .map_err(|_| full())?;
    let permits = CONNECTION_COST_BYTES.div_ceil(crate::ingest::MEMORY_PERMIT_BYTES) as u32;
    let memory = tokio::time::timeout(
        CONNECTION_ADMIT_WAIT,
        ctx.hub.memory().clone().acquire_many_owned(permits),
    )
    .await
    .map_err(|_| "the ingest memory budget is spent; retry later".to_string())?
    .map_err(|_| "the ingest budget is closed".to_string())?;
    Ok(ConnectionCharge {
        _slot: slot,
        _memory: memory,
    })
}

/// Data streams per connection read and decoded ahead of the receiver, in parallel.
pub const DECODE_AHEAD: usize = 4;

/// What a data stream's task hands to its connection task.
enum Data {
    /// A frame for [`Receiver::handle_frame`] (not a block, or one it decodes itself).
    Frame(Vec<u8>),
    /// A block decoded on the blocking pool; the permit is its share of the ingest budget.
    Decoded(String, DecodedBlock, OwnedSemaphorePermit),
    /// A block that failed to verify or decode, and the code to close with.
    BadBlock(ErrorCode, String),
    /// The stream exceeded the frame limit.
    TooLarge,
}

/// Reads one data stream and prepares its frame: a Block is verified, decoded and hashed on
/// the blocking pool, so the connection task does none of that work.
async fn read_data(
    mut s: quinn::RecvStream,
    frame_max: usize,
    cfg: ReceiverConfig,
    hub: Arc<Hub>,
) -> Data {
    // An oversize data stream is cut off here; only this connection is closed.
    let Ok(bytes) = s.read_to_end(frame_max).await else {
        return Data::TooLarge;
    };
    let Ok(Frame::Block { stream, block }) = Frame::decode(&bytes, cfg.frame_bytes_max) else {
        return Data::Frame(bytes);
    };
    let Ok(header) = sync::block::decode_header(&block) else {
        return Data::Frame(bytes);
    };
    let sizing = crate::ingest::sizing_cost(block.len(), &header);
    let Some(mut permit) = try_reserve(&hub, sizing) else {
        return Data::Frame(bytes);
    };
    drop(bytes);
    let limits = cfg.decode_limits;
    let pool = hub.record_pool().clone();
    let memory = hub.clone();
    let decode = move || {
        let sized = sync::block::size_block(&block, &limits)?;
        // The records' own share, before they are built; without it the receiver decodes the
        // frame itself.
        let Some(more) = try_reserve(&memory, sized.decoded_bytes()) else {
            return Ok(Err(block));
        };
        permit.merge(more);
        DecodedBlock::from_sized(block, &sized, pool.take()).map(|d| Ok((d, permit)))
    };
    match tokio::task::spawn_blocking(decode).await {
        Ok(Ok(Ok((d, permit)))) => Data::Decoded(stream, d, permit),
        Ok(Ok(Err(block))) => Data::Frame(Frame::Block { stream, block }.encode()),
        Ok(Err(e)) => Data::BadBlock(
            sync::protocol::block_error_code(&e),
            format!("stream {stream}: {e}"),
        ),
        Err(e) => Data::BadBlock(
            ErrorCode::BadBlock,
            format!("stream {stream}: decoding failed: {e}"),
        ),
    }
}

/// Takes `bytes` of the ingest budget if it is free now.
fn try_reserve(hub: &Hub, bytes: u64) -> Option<OwnedSemaphorePermit> {
    let permits = bytes.div_ceil(crate::ingest::MEMORY_PERMIT_BYTES).max(1);
    u32::try_from(permits)
        .ok()
        .and_then(|n| hub.memory().clone().try_acquire_many_owned(n).ok())
}

/// Waits for the oldest data stream's result; pending while there is none.
async fn next_data(ahead: &mut std::collections::VecDeque<tokio::task::JoinHandle<Data>>) -> Data {
    match ahead.front_mut() {
        Some(task) => {
            let data = task.await.unwrap_or_else(|e| {
                Data::BadBlock(
                    ErrorCode::BadBlock,
                    format!("reading a data stream failed: {e}"),
                )
            });
            ahead.pop_front();
            data
        }
        None => std::future::pending().await,
    }
}

impl ConnCtx {
    fn now(&self) -> Instant {
        Instant::from_nanos(self.clock.elapsed().as_nanos() as u64)
    }

    /// Whether this session's certificate is revoked now, by device or by serial.
    fn revoked(&self, device: &str, leaf: &CertificateDer<'_>) -> bool {
        let list = self.revocations.current();
        #[cfg(feature = "fault-injection")]
        if self.mutation == Mutation::RevokeByDeviceOnly {
            return list.is_revoked(device);
        }
        let _ = device;
        list.is_cert_revoked(leaf)
    }

    /// Whether a closed session's Error frame may go out before its commits settled.
    fn close_before_settle(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.mutation == Mutation::CloseBeforeSettle {
            return true;
        }
        let _ = self.mutation;
        false
    }
}

/// The device id and the leaf certificate (for revocation checks) the handshake verified.
fn peer_device(conn: &quinn::Connection) -> Result<(String, CertificateDer<'static>), String> {
    let identity = conn.peer_identity().ok_or("no client certificate")?;
    let certs = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| "unexpected peer identity type".to_string())?;
    let leaf = certs.first().ok_or("empty client certificate chain")?;
    let device = pki::device_id_from_cert(leaf).map_err(|e| format!("client certificate: {e}"))?;
    Ok((device, leaf.clone()))
}

/// What a commit task reports back to its connection loop.
enum Done {
    Committed {
        stream: String,
        epoch: u64,
        durable_seq: u64,
    },
    Failed(IngestError),
}

async fn connection(mut ctx: ConnCtx, incoming: quinn::Incoming) -> Result<(), String> {
    let conn = incoming.await.map_err(|e| format!("handshake: {e}"))?;
    let (device, leaf) = peer_device(&conn)?;
    let _charge = match admit_connection(&ctx).await {
        Ok(c) => c,
        Err(msg) => {
            tracing::warn!(%device, reason = %msg, "refusing a connection");
            conn.close(
                quinn::VarInt::from_u32(u32::from(ErrorCode::LimitExceeded.to_u16())),
                msg.as_bytes(),
            );
            return Ok(());
        }
    };
    let (mut ctl_tx, mut ctl_rx) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("{device}: control stream: {e}"))?;
    // The list may have changed between the handshake's check and now.
    if ctx.revocations.current().is_cert_revoked(&leaf) {
        tracing::warn!(%device, "refusing a revoked certificate");
        refuse(
            &conn,
            &mut ctl_tx,
            ErrorCode::Revoked,
            "certificate revoked",
        )
        .await;
        return Ok(());
    }
    if let Some(reason) = ctx.hub.is_fenced(&device) {
        tracing::warn!(%device, %reason, "refusing a fenced device");
        let msg = format!("device is fenced: {reason}");
        refuse(&conn, &mut ctl_tx, ErrorCode::DeviceFenced, &msg).await;
        return Ok(());
    }
    ctx.hub.touch(&device);
    // While tier 1 takes no writes, a session would only ship blocks to be refused: say so at
    // once, and the agent comes back after its short storage retry.
    if let Some(why) = ctx.hub.storage_unavailable() {
        tracing::debug!(%device, reason = %why, "refusing a session: storage full");
        refuse(&conn, &mut ctl_tx, ErrorCode::StorageFull, &why.to_string()).await;
        return Ok(());
    }
    tracing::info!(%device, remote = %conn.remote_address(), "device connected");
    let mut rx = Receiver::new(device.clone(), ctx.receiver_cfg.clone(), ctx.now());
    let mut frames = FrameBuffer::new(ctx.receiver_cfg.frame_bytes_max);
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
    // Data streams being read and decoded, in the order they were opened.
    let mut ahead = std::collections::VecDeque::with_capacity(DECODE_AHEAD);
    let mut replays = 0u64;
    // The control stream carries small frames (blocks come on their own streams); it is read
    // chunk by chunk from quinn's own buffers, so an idle connection holds no read buffer.
    let frame_max = ctx.receiver_cfg.frame_bytes_max as usize + 16;
    // Tiering moves tiered_seq long after the last ack of new data; an idle agent hears of it
    // only through this signal (issue 7), so it can free what tier 2 now holds.
    let mut tiered_rx = ctx.hub.subscribe_tiered();
    // What each lane announced in the Hello (the first control frame): its last seq (Backlog
    // frames carry no seqs, and completeness needs it to report how many records a device
    // owes) and its backlog, recorded once the session is established.
    let mut announced: Option<Announced> = None;
    // Commits handed to the WAL whose outcome has not come back on `done_rx`.
    let mut in_flight = 0usize;
    loop {
        // Blocks the receiver acknowledged again without a commit (replays of what the hub
        // holds) count with the hub's duplicates.
        let seen = rx.stats().replays;
        if seen > replays {
            ctx.hub
                .stats()
                .duplicates
                .fetch_add(seen - replays, std::sync::atomic::Ordering::Relaxed);
            replays = seen;
        }
        let mut progressed = false;
        // Once closed, the Error frame waits for the end below, after the session's commits
        // settled: the device must not see the end while its records are still landing.
        while (!rx.is_closed() || ctx.close_before_settle())
            && let Some(t) = rx.poll_transmit()
        {
            progressed = true;
            ctl_tx
                .write_all(&t.frame)
                .await
                .map_err(|e| format!("{device}: control stream: {e}"))?;
        }
        while let Some(ev) = rx.poll_event() {
            progressed = true;
            in_flight += usize::from(matches!(ev, ReceiverEvent::Commit { .. }));
            let lasts = announced.as_ref();
            if let Some(end) = handle_event(&ctx, &device, &mut rx, ev, &done_tx, lasts).await {
                settle(&device, &mut done_rx, in_flight).await;
                // The Error frame the receiver queued with its close goes out first: the agent
                // acts on its code (a refused stream is left out of the next session).
                while let Some(t) = rx.poll_transmit() {
                    if ctl_tx.write_all(&t.frame).await.is_err() {
                        break;
                    }
                }
                let _ = ctl_tx.finish();
                let _ = tokio::time::timeout(Duration::from_secs(2), ctl_tx.stopped()).await;
                conn.close(
                    quinn::VarInt::from_u32(u32::from(end.0.to_u16())),
                    end.1.as_bytes(),
                );
                if end.0 == ErrorCode::Revoked {
                    let closed = &ctx.hub.stats().revocation.sessions_closed;
                    closed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                return Ok(());
            }
        }
        if progressed {
            continue;
        }
        let deadline = rx
            .poll_timeout()
            .map(|t| tokio::time::Instant::now() + t.saturating_since(ctx.now()));
        tokio::select! {
            read = ctl_rx.read_chunk(64 << 10, true) => match read {
                Ok(Some(chunk)) => {
                    frames.push(&chunk.bytes);
                    loop {
                        match frames.next_frame() {
                            Ok(Some(f)) => {
                                if announced.is_none() {
                                    announced = Some(announced_last_seqs(&f, ctx.receiver_cfg.frame_bytes_max));
                                }
                                rx.handle_frame(ctx.now(), &f)
                            }
                            Ok(None) => break,
                            Err(e) => {
                                rx.close(ctx.now(), ErrorCode::FrameTooLarge, &e.to_string());
                                break;
                            }
                        }
                    }
                }
                Ok(None) => return Err(format!("{device}: control stream closed")),
                Err(e) => return Err(format!("{device}: control stream: {e}")),
            },
            uni = conn.accept_uni(), if ahead.len() < DECODE_AHEAD => {
                let s = uni.map_err(|e| format!("{device}: {e}"))?;
                let cfg = ctx.receiver_cfg.clone();
                ahead.push_back(tokio::spawn(read_data(s, frame_max, cfg, ctx.hub.clone())));
            }
            data = next_data(&mut ahead) => match data {
                Data::Frame(bytes) => rx.handle_frame(ctx.now(), &bytes),
                Data::Decoded(stream, block, slot) => {
                    rx.handle_decoded_block(ctx.now(), stream, block);
                    drop(slot);
                }
                Data::BadBlock(code, msg) => rx.close(ctx.now(), code, &msg),
                Data::TooLarge => rx.close(ctx.now(), ErrorCode::FrameTooLarge, "data stream exceeded the frame limit"),
            },
            Some(done) = done_rx.recv() => {
                in_flight -= 1;
                match done {
                    Done::Committed { stream, epoch, durable_seq } => {
                        let tiered = ctx.hub.tiered_seq(&device, &stream, epoch);
                        rx.committed(ctx.now(), &stream, epoch, durable_seq, tiered);
                    }
                    Done::Failed(e) => rx.close(ctx.now(), error_code(&e), &e.to_string()),
                }
            }
            Ok(()) = tiered_rx.changed() => push_tiered(&ctx, &device, &mut rx),
            _ = ctx.revoke_rx.changed() => {
                // By device or by this certificate's serial: the list names either.
                if ctx.revoked(&device, &leaf) {
                    tracing::warn!(%device, "certificate revoked; disconnecting");
                    rx.close(ctx.now(), ErrorCode::Revoked, "certificate revoked");
                }
            }
            _ = sleep_until(deadline) => rx.handle_timeout(ctx.now()),
            reason = conn.closed() => return Err(format!("{device}: {reason}")),
        }
    }
}

/// Waits, up to [`SETTLE_ON_CLOSE`], for the outcomes of the `in_flight` commits a closing
/// session handed to the WAL. The receiver hands out nothing once closed, so after this no
/// record of the session becomes durable once the device sees it closed (unless the WAL is
/// slower than the bound, which is logged).
async fn settle(device: &str, done_rx: &mut mpsc::UnboundedReceiver<Done>, mut in_flight: usize) {
    let deadline = tokio::time::Instant::now() + SETTLE_ON_CLOSE;
    while in_flight > 0 {
        match tokio::time::timeout_at(deadline, done_rx.recv()).await {
            Ok(Some(_)) => in_flight -= 1,
            Ok(None) => return,
            Err(_) => {
                tracing::warn!(%device, in_flight, "closing with commits still in flight");
                return;
            }
        }
    }
}

/// Sends an Ack for every lane of this session whose `tiered_seq` rose; the receiver keeps the
/// last value it sent per lane and ignores lanes outside the session.
fn push_tiered(ctx: &ConnCtx, device: &str, rx: &mut Receiver) {
    for m in ctx.hub.marks(device) {
        if m.tiered_seq > 0 {
            rx.update_tiered(ctx.now(), &m.stream, m.epoch, m.tiered_seq);
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Ends a connection before its session starts: an error frame on the control stream (which
/// the agent's protocol machine reports with its code), then the connection close.
async fn refuse(
    conn: &quinn::Connection,
    ctl_tx: &mut quinn::SendStream,
    code: ErrorCode,
    msg: &str,
) {
    let frame = sync::protocol::error_frame(code, msg);
    let _ = ctl_tx.write_all(&frame).await;
    let _ = ctl_tx.finish();
    let _ = tokio::time::timeout(Duration::from_secs(2), ctl_tx.stopped()).await;
    conn.close(
        quinn::VarInt::from_u32(u32::from(code.to_u16())),
        msg.as_bytes(),
    );
}

fn error_code(e: &IngestError) -> ErrorCode {
    match e {
        IngestError::Fenced(_) => ErrorCode::DeviceFenced,
        IngestError::Conflict { .. } => ErrorCode::ConflictFenced,
        // A forbidden key is content the device may not write to that stream: the stream is
        // refused (the message names it first), the device's other streams keep flowing.
        IngestError::BadStreamName(_)
        | IngestError::Unauthorized(_)
        | IngestError::ForbiddenKey { .. } => ErrorCode::UnauthorizedStream,
        IngestError::TooLarge { .. } | IngestError::BadBlock(_) => ErrorCode::BadBlock,
        IngestError::DecodedTooLarge { .. } => ErrorCode::DecodedTooLarge,
        IngestError::BadDeviceId | IngestError::ReservedSeq | IngestError::BadGap { .. } => {
            ErrorCode::ProtocolViolation
        }
        IngestError::OutOfOrder { .. } => ErrorCode::ProtocolViolation,
        // Conditions that clear by themselves: the agent retries after a short fixed delay.
        IngestError::Unavailable(
            CommitError::DiskFull { .. } | CommitError::Full(_) | CommitError::EarlierFailed,
        ) => ErrorCode::StorageFull,
        IngestError::Unavailable(_) | IngestError::Catalog(_) | IngestError::Internal(_) => {
            ErrorCode::Internal
        }
    }
}

/// Acts on one receiver event. Returns the code and message to close with when the session
/// is over.
async fn handle_event(
    ctx: &ConnCtx,
    device: &str,
    rx: &mut Receiver,
    ev: ReceiverEvent,
    done: &mpsc::UnboundedSender<Done>,
    announced: Option<&Announced>,
) -> Option<(ErrorCode, String)> {
    match ev {
        ReceiverEvent::NeedMarks {
            current_epoch,
            lanes,
        } => match load_marks(ctx, device, current_epoch, &lanes) {
            Ok(marks) => rx.marks_loaded(ctx.now(), marks),
            Err((code, msg)) => rx.close(ctx.now(), code, &msg),
        },
        ReceiverEvent::Established {
            version,
            current_epoch,
        } => {
            tracing::info!(%device, version, current_epoch, "session established");
            ctx.hub.touch(device);
            // The Hello's backlog is recorded before any block of this session commits: a
            // device that comes back owing data is never taken for complete on its first
            // commit alone. The Backlog frame the edge sends right after corrects any figure
            // the hub's marks made stale.
            if let Some(a) = announced {
                let entries: Vec<BacklogEntry> = a
                    .iter()
                    .map(|((stream, epoch), &(_, backlog))| BacklogEntry {
                        stream: stream.clone(),
                        epoch: *epoch,
                        backlog,
                    })
                    .collect();
                record_backlog(ctx, device, &entries, announced);
            }
        }
        ReceiverEvent::Commit {
            stream,
            epoch,
            item,
        } => commit(ctx, device, stream, epoch, item, done).await,
        ReceiverEvent::Backlog { entries, .. } => record_backlog(ctx, device, &entries, announced),
        ReceiverEvent::Fenced {
            stream,
            epoch,
            first_seq,
            last_seq,
        } => {
            let reason = format!(
                "conflicting content for {stream} epoch {epoch} seqs {first_seq}..={last_seq}"
            );
            tracing::error!(%device, %reason, "ALARM: device fenced");
            ctx.hub
                .stats()
                .conflicts
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ctx.hub.fence(device, &reason);
        }
        ReceiverEvent::Closed(reason) => {
            if !reason.by_peer && reason.code == ErrorCode::DecodedTooLarge {
                let counter = &ctx.hub.stats().decoded_too_large;
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if reason.by_peer {
                tracing::info!(%device, code = ?reason.code, message = %reason.message, "device closed the session");
            } else {
                tracing::warn!(%device, code = ?reason.code, message = %reason.message, "closing device session");
            }
            return Some((reason.code, reason.message));
        }
    }
    None
}

/// Answers a marks query from the catalog, authorizing every stream first.
fn load_marks(
    ctx: &ConnCtx,
    device: &str,
    current_epoch: u64,
    lanes: &[MarksQuery],
) -> Result<Marks, (ErrorCode, String)> {
    let known = ctx.hub.marks(device);
    let limit = ctx.receiver_cfg.checksum_ranges_max;
    let mut out = Marks {
        epoch_max: ctx.hub.epoch_max(device),
        lanes: Vec::new(),
    };
    let lane_marks =
        |stream: &str, epoch: u64, from: u64| -> Result<LaneMarks, (ErrorCode, String)> {
            ctx.hub
                .authorize(device, stream)
                .map_err(|e| (error_code(&e), e.to_string()))?;
            let m = known
                .iter()
                .find(|m| m.stream == stream && m.epoch == epoch);
            let ranges = ctx
                .hub
                .range_checksums(device, stream, epoch, from, limit)
                .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
            Ok(LaneMarks {
                stream: stream.to_owned(),
                epoch,
                durable_seq: m.map_or(0, |m| m.durable_seq),
                tiered_seq: m.map_or(0, |m| m.tiered_seq),
                gaps: committed_gaps(&ctx.hub, device, stream, epoch, from),
                ranges,
            })
        };
    for q in lanes {
        out.lanes
            .push(lane_marks(&q.stream, q.epoch, q.checksums_from)?);
    }
    for m in known.iter().filter(|m| m.epoch == current_epoch) {
        if !out
            .lanes
            .iter()
            .any(|l| l.stream == m.stream && l.epoch == m.epoch)
        {
            out.lanes
                .push(lane_marks(&m.stream, m.epoch, m.durable_seq)?);
        }
    }
    Ok(out)
}

/// Gap ranges the hub committed for a lane, ending at or after `from`.
fn committed_gaps(hub: &Hub, device: &str, stream: &str, epoch: u64, from: u64) -> Vec<(u64, u64)> {
    let (Ok(d), Some(s)) = (hub.device_id(device), hub.lookup_stream(stream)) else {
        return Vec::new();
    };
    let rows = hub.catalog().gaps_of(d).unwrap_or_else(|e| {
        tracing::warn!(%device, error = %e, "reading committed gaps");
        Vec::new()
    });
    rows.into_iter()
        .filter(|g| g.stream == s && g.epoch == epoch && g.last_seq >= from)
        .map(|g| (g.first_seq, g.last_seq))
        .collect()
}

/// Submits a commit in order, then waits for durability on a separate task so the connection
/// keeps reading while the WAL group-commits.
async fn commit(
    ctx: &ConnCtx,
    device: &str,
    stream: String,
    epoch: u64,
    item: CommitItem,
    done: &mpsc::UnboundedSender<Done>,
) {
    let done = done.clone();
    match item {
        CommitItem::Block {
            header,
            block,
            skip_through,
            records,
            checksum,
        } => {
            let vb = VerifiedBlock {
                header,
                block,
                skip_through,
                records,
                checksum: Some(checksum.checksum),
            };
            match ctx.hub.submit_verified(device, &stream, vb).await {
                Ok(pending) => {
                    tokio::spawn(async move {
                        let msg = match pending.wait().await {
                            Ok(outcome) => Done::Committed {
                                stream,
                                epoch,
                                durable_seq: outcome.durable_seq(),
                            },
                            Err(e) => Done::Failed(e),
                        };
                        let _ = done.send(msg);
                    });
                }
                Err(e) => {
                    let _ = done.send(Done::Failed(e));
                }
            }
        }
        CommitItem::Gap(g) => {
            let hub = ctx.hub.clone();
            let device = device.to_owned();
            tokio::spawn(async move {
                let reason = format!("{:?}", g.reason);
                let msg = match hub
                    .record_gap(&device, &stream, epoch, g.first_seq, g.last_seq, &reason)
                    .await
                {
                    Ok(durable_seq) => Done::Committed {
                        stream,
                        epoch,
                        durable_seq,
                    },
                    Err(e) => Done::Failed(e),
                };
                let _ = done.send(msg);
            });
        }
    }
}

/// Per `(stream, epoch)`: the last seq and the backlog a lane announced in the Hello.
type Announced = HashMap<(String, u64), (u64, Backlog)>;

/// The `last_seq` and backlog of every lane a Hello frame announces; empty for any other frame
/// (a malformed one is the receiver's to refuse).
fn announced_last_seqs(frame: &[u8], frame_bytes_max: u32) -> Announced {
    match Frame::decode(frame, frame_bytes_max) {
        Ok(Frame::Hello(h)) => h
            .lanes
            .into_iter()
            .map(|l| ((l.stream, l.epoch), (l.last_seq, l.backlog)))
            .collect(),
        _ => HashMap::new(),
    }
}

/// Stores a Backlog frame's figures. A lane's `last_seq` is the one it announced in the Hello
/// (0, unknown, for a lane first written during the session); the device keeps appending, so
/// it is a lower bound of what it holds.
fn record_backlog(
    ctx: &ConnCtx,
    device: &str,
    entries: &[BacklogEntry],
    announced: Option<&Announced>,
) {
    ctx.hub.touch(device);
    for e in entries {
        let last_seq = announced
            .and_then(|a| a.get(&(e.stream.clone(), e.epoch)))
            .map_or(0, |&(last, _)| last);
        let report = BacklogReport {
            blocks: e.backlog.blocks,
            bytes: e.backlog.bytes,
            oldest_unsent_ts: e.backlog.oldest_unsent_ts,
            last_seq,
        };
        if let Err(err) = ctx.hub.record_backlog(device, &e.stream, report) {
            tracing::warn!(%device, stream = %e.stream, error = %err, "recording backlog");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sync::protocol::frame::Hello;
    use sync::protocol::{Backlog, LaneAnnounce};

    #[test]
    fn hello_lanes_give_the_announced_last_seqs() {
        let lane = |stream: &str, epoch, last_seq| LaneAnnounce {
            stream: stream.into(),
            epoch,
            first_seq: 1,
            last_seq,
            acked_seq: 0,
            backlog: Backlog::default(),
            gaps: Vec::new(),
        };
        let hello = Frame::Hello(Hello {
            version_min: 1,
            version_max: 1,
            current_epoch: 2,
            lanes: vec![
                lane("telemetry", 1, 90),
                lane("telemetry", 2, 7),
                lane("status", 2, 3),
            ],
        });
        let got = announced_last_seqs(&hello.encode(), 1 << 20);
        assert_eq!(got.len(), 3);
        assert_eq!(got[&("telemetry".to_string(), 1)].0, 90);
        assert_eq!(got[&("telemetry".to_string(), 2)].0, 7);
        assert_eq!(got[&("status".to_string(), 2)].0, 3);
        // Any other first frame (or garbage) announces nothing; the receiver refuses it.
        assert!(announced_last_seqs(&Frame::Ping.encode(), 1 << 20).is_empty());
        assert!(announced_last_seqs(b"\x00\x01", 1 << 20).is_empty());
    }
}
