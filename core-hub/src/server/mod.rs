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
//! decodes and hashes its Block frame on the blocking pool (`DecodedBlock::from_sized`, into
//! record buffers reused from [`crate::ingest::RecordPool`]) and the connection task only runs
//! the receiver's bookkeeping (`Receiver::handle_decoded_block`). Up to [`DECODE_AHEAD`] data
//! streams per connection are read and decoded at once, and their results are fed to the
//! receiver in the order the streams were opened, which is the order the agent sent them, so
//! blocks reach the receiver in seq order and never wait decoded in its reorder buffer.
//! A data stream's announced length is charged to the ingest budget before its body is read,
//! and its [`crate::ingest::block_cost`] (its body and its records' exact decoded size,
//! computed before they are built) before it is decoded; when the budget is spent the stream
//! waits (QUIC flow control stalls the device) and nothing is decoded outside it. The charge
//! goes with the block into its WAL submission and is released once the block is durable, so
//! a connection never waits for memory while holding some (`data` has the order of charges
//! that keeps connections from deadlocking). A block whose records would exceed
//! `ingest.block_decoded_bytes_max` closes the session with `DECODED_TOO_LARGE`.
//!
//! # Memory per connection
//!
//! Every established connection reserves [`CONNECTION_COST_BYTES`] from the global ingest
//! budget (`ingest.memory_bytes_max`) for its lifetime: its quinn and TLS state, the protocol
//! receiver and the driver's buffers (measured at 109–115 KiB idle), and the floor of its
//! QUIC receive window ([`WINDOW_FLOOR_BYTES`]). Connections together may hold at most
//! [`CONNECTIONS_BUDGET_SHARE`] of the budget; a device that would exceed it is refused
//! (`LIMIT_EXCEEDED`) and retries with its backoff. The receive window above the floor is
//! reserved from the budget too, from what is free when the connection is admitted and
//! within [`WINDOWS_BUDGET_SHARE`], so blocks always keep the rest (`admission`, "Receive
//! windows"). Everything quinn may buffer for a connection is within its window, so the
//! hub's memory is `ingest.memory_bytes_max` plus a fixed overhead (runtime, SQLite, WAL
//! writer) for any number of devices, busy or idle (docs/security.md, "Devices:
//! connections"). Per-device slots, deadlines and blocks in flight are in `admission` and
//! `session`.
//!
//! # Refused streams
//!
//! A stream the device may not write (not on its allow-list, an invalid name, a forbidden
//! key) or one past a per-device quota is refused alone: a StreamRefused frame with the code
//! (`UNAUTHORIZED_STREAM`, `QUOTA_EXCEEDED`) and `ingest.stream_refusal_retry`, after which the
//! agent offers it again on the same session (`events::refuse`, docs/protocol/sync.md). The
//! session and the device's other streams carry on. An agent that does not announce the
//! capability has its session closed with the code instead, as before.
//!
//! # Modules
//!
//! - `admission`: who may open a session (the verified device id, the connection's share of
//!   the ingest budget).
//! - `session`: the per-connection loop around the receiver.
//! - `data`: data-stream reads and their decode, with their memory charge.
//! - `events`: what the loop does with each receiver event (marks, backlog, fences).
//! - `commit`: handing commits to the WAL and reporting their outcome.
//! - `revocation`: polling the revocation list and dropping revoked sessions.
//! - `reset_key`: the stateless-reset key kept across restarts, so agents notice a hub that
//!   died and came back at their next packet instead of at their idle timeout.

mod admission;
mod commit;
mod data;
mod events;
mod reset_key;
mod revocation;
mod session;
mod stats;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use sync::protocol::{ErrorCode, Instant, ReceiverConfig};
use tokio::sync::{Semaphore, watch};

use crate::config::{ConnectionQuotas, HubConfig};
use crate::ingest::Hub;
use crate::pki::{self, SharedRevocations};

pub use admission::{
    CONNECTION_COST_BYTES, CONNECTIONS_BUDGET_SHARE, WINDOW_FLOOR_BYTES, WINDOWS_BUDGET_SHARE,
};
pub use data::DECODE_AHEAD;
pub use stats::{ConnStats, connection_metrics};

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
    #[error(transparent)]
    ResetKey(#[from] reset_key::ResetKeyError),
}

/// Flow-control settings for device connections.
///
/// The per-connection receive window is the receiver's advertised block window (32 MiB) plus
/// headroom for control frames. The hub's listener advertises only the floor during the
/// handshake and raises each admitted connection's window with what it reserved of the ingest
/// budget (`admission`, "Receive windows").
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
    /// A device's new connection never supersedes its old ones (no per-device limit).
    #[cfg(feature = "fault-injection")]
    NoSupersede,
    /// Data streams are read and decoded without charging the ingest budget.
    #[cfg(feature = "fault-injection")]
    UnchargedReads,
    /// Every connection gets the full receive window, reserved nowhere.
    #[cfg(feature = "fault-injection")]
    UnreservedWindows,
    /// No QUIC Retry, whatever the handshake load.
    #[cfg(feature = "fault-injection")]
    NoRetry,
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
    tracing::error!(?mutation, "TEST-ONLY MUTATION: a server guard is off");
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
    let mut transport = transport_config(receiver_cfg.window_bytes);
    // Past this many data streams, the device waits for stream credit instead of the hub
    // buffering its blocks (the session loop stops taking streams at the same bound).
    let blocks_max = cfg.ingest.conn.blocks_in_flight_max;
    transport.max_concurrent_uni_streams(quinn::VarInt::from_u32(blocks_max));
    // Until a connection is admitted and its window reserved, it may send only the floor.
    if !mutation.unreserved_windows() {
        transport.receive_window(quinn::VarInt::from_u32(WINDOW_FLOOR_BYTES as u32));
    }
    server_cfg.transport_config(Arc::new(transport));
    let socket = udp_socket(cfg.listen.quic)?;
    let runtime =
        quinn::default_runtime().ok_or_else(|| ServeError::Quic("no async runtime".into()))?;
    let reset = reset_key::load_or_create(hub.storage().as_ref(), hub.data_dir())?;
    let mut endpoint_cfg = reset_key::endpoint_config(&reset);
    // quinn's default (one reset per 20 ms for the whole endpoint) would let a restarted hub
    // answer only 50 of its devices per second; each reset is smaller than the packet that
    // caused it, so a faster rate amplifies nothing.
    endpoint_cfg.min_reset_interval(Duration::from_micros(50));
    let endpoint = quinn::Endpoint::new(endpoint_cfg, Some(server_cfg), socket, runtime).map_err(
        |source| ServeError::Bind {
            addr: cfg.listen.quic,
            source,
        },
    )?;
    let local_addr = endpoint.local_addr().map_err(|source| ServeError::Bind {
        addr: cfg.listen.quic,
        source,
    })?;
    let (num, den) = WINDOWS_BUDGET_SHARE;
    let windows_share = cfg.ingest.memory_bytes_max / den * num;
    let windows = Arc::new(Semaphore::new(
        usize::try_from(windows_share / crate::ingest::MEMORY_PERMIT_BYTES)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS),
    ));
    let (revoke_tx, revoke_rx) = watch::channel(0u64);
    let (num, den) = CONNECTIONS_BUDGET_SHARE;
    let conn_share = cfg.ingest.memory_bytes_max / den * num;
    let connections = Arc::new(Semaphore::new(
        usize::try_from(conn_share / CONNECTION_COST_BYTES)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS),
    ));
    tokio::spawn(revocation::poll_revocations(
        revocations.clone(),
        hub.clone(),
        revoke_tx,
    ));
    let ep = endpoint.clone();
    let data = Arc::new(data::DataCtx {
        frame_max: receiver_cfg.frame_bytes_max as usize + 16,
        cfg: receiver_cfg.clone(),
        hub: hub.clone(),
        idle: cfg.ingest.conn.control_idle_timeout,
        uncharged: mutation.uncharged_reads(),
    });
    let shared = ConnCtx {
        hub: hub.clone(),
        revocations: revocations.clone(),
        revoke_rx: revoke_rx.clone(),
        receiver_cfg: receiver_cfg.clone(),
        connections: connections.clone(),
        windows,
        slots: admission::DeviceSlots::new(
            cfg.ingest.conn.connections_per_device_max,
            hub.stats().devices_connected.clone(),
        ),
        quotas: cfg.ingest.conn,
        data,
        clock: StdInstant::now(),
        mutation,
    };
    let task = tokio::spawn(async move {
        loop {
            let incoming = tokio::select! {
                i = ep.accept() => i,
                _ = shutdown.changed() => None,
            };
            let Some(incoming) = incoming else { break };
            let Some(handshake) = admission::validate_or_retry(&shared, incoming) else {
                continue;
            };
            let ctx = shared.clone();
            tokio::spawn(async move {
                if let Err(e) = session::connection(ctx, handshake).await {
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
    r.timeouts.idle = cfg.ingest.conn.control_idle_timeout;
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

/// What every connection task shares with the accept loop.
#[derive(Clone)]
struct ConnCtx {
    hub: Arc<Hub>,
    revocations: Arc<SharedRevocations>,
    revoke_rx: watch::Receiver<u64>,
    receiver_cfg: ReceiverConfig,
    /// One permit per connection the budget share allows.
    connections: Arc<Semaphore>,
    /// The windows' share of the budget, in permits of `MEMORY_PERMIT_BYTES`.
    windows: Arc<Semaphore>,
    /// Every device's live connections.
    slots: Arc<admission::DeviceSlots>,
    quotas: ConnectionQuotas,
    /// What every data-stream task shares.
    data: Arc<data::DataCtx>,
    clock: StdInstant,
    mutation: Mutation,
}

impl Mutation {
    /// Whether a device's new connection supersedes its oldest at the limit.
    fn supersedes(self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self == Mutation::NoSupersede {
            return false;
        }
        true
    }

    fn unreserved_windows(self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self == Mutation::UnreservedWindows {
            return true;
        }
        false
    }

    fn retries(self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self == Mutation::NoRetry {
            return false;
        }
        true
    }

    fn uncharged_reads(self) -> bool {
        #[cfg(feature = "fault-injection")]
        if self == Mutation::UnchargedReads {
            return true;
        }
        false
    }
}

impl ConnCtx {
    fn now(&self) -> Instant {
        Instant::from_nanos(self.clock.elapsed().as_nanos() as u64)
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
