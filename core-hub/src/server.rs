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

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use rustls::pki_types::CertificateDer;
use sync::protocol::Instant;
use sync::protocol::{
    BacklogEntry, CommitItem, ErrorCode, FrameBuffer, LaneMarks, Marks, MarksQuery, Receiver,
    ReceiverConfig, ReceiverEvent,
};
use tokio::sync::{mpsc, watch};

use crate::config::HubConfig;
use crate::ingest::{BacklogReport, Hub, IngestError, VerifiedBlock};
use crate::pki::{self, SharedRevocations};

/// How often the revocation list file is checked for changes.
const REVOCATION_POLL: Duration = Duration::from_secs(1);
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

/// Binds the QUIC listener and serves devices until `shutdown` flips to true.
pub async fn start(
    cfg: &HubConfig,
    hub: Arc<Hub>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(Server, tokio::task::JoinHandle<()>), ServeError> {
    let tls_paths = cfg.tls.as_ref().ok_or(ServeError::NoTls)?;
    let revoked_path = tls_paths
        .ca
        .parent()
        .map(|d| d.join("revoked.txt"))
        .unwrap_or_else(|| "revoked.txt".into());
    let revocations = SharedRevocations::open(&revoked_path).map_err(ServeError::Revocations)?;
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
    tokio::spawn(poll_revocations(revocations.clone(), revoke_tx));
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
                clock,
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

/// Reloads the revocation list when its file changes and tells every connection.
async fn poll_revocations(revocations: Arc<SharedRevocations>, tx: watch::Sender<u64>) {
    let mut generation = 0u64;
    loop {
        tokio::time::sleep(REVOCATION_POLL).await;
        match revocations.reload_if_changed() {
            Ok(true) => {
                generation += 1;
                tracing::info!(
                    revoked = revocations.current().len(),
                    "revocation list reloaded"
                );
                if tx.send(generation).is_err() {
                    return;
                }
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "reading the revocation list"),
        }
    }
}

struct ConnCtx {
    hub: Arc<Hub>,
    revocations: Arc<SharedRevocations>,
    revoke_rx: watch::Receiver<u64>,
    receiver_cfg: ReceiverConfig,
    clock: StdInstant,
}

impl ConnCtx {
    fn now(&self) -> Instant {
        Instant::from_nanos(self.clock.elapsed().as_nanos() as u64)
    }
}

/// The device id from the verified client certificate.
fn peer_device(conn: &quinn::Connection) -> Result<String, String> {
    let identity = conn.peer_identity().ok_or("no client certificate")?;
    let certs = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| "unexpected peer identity type".to_string())?;
    let leaf = certs.first().ok_or("empty client certificate chain")?;
    pki::device_id_from_cert(leaf).map_err(|e| format!("client certificate: {e}"))
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
    let device = peer_device(&conn)?;
    let (mut ctl_tx, mut ctl_rx) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("{device}: control stream: {e}"))?;
    if let Some(reason) = ctx.hub.is_fenced(&device) {
        tracing::warn!(%device, %reason, "refusing a fenced device");
        let frame = sync::protocol::error_frame(
            ErrorCode::DeviceFenced,
            &format!("device is fenced: {reason}"),
        );
        let _ = ctl_tx.write_all(&frame).await;
        let _ = ctl_tx.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), ctl_tx.stopped()).await;
        conn.close(
            quinn::VarInt::from_u32(u32::from(ErrorCode::DeviceFenced.to_u16())),
            b"fenced",
        );
        return Ok(());
    }
    ctx.hub.touch(&device);
    tracing::info!(%device, remote = %conn.remote_address(), "device connected");
    let mut rx = Receiver::new(device.clone(), ctx.receiver_cfg.clone(), ctx.now());
    let mut frames = FrameBuffer::new(ctx.receiver_cfg.frame_bytes_max);
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
    let (data_tx, mut data_rx) = mpsc::channel::<Vec<u8>>(256);
    // The control stream carries small frames (blocks come on their own streams): a small read
    // buffer keeps per-connection memory low with thousands of devices.
    let mut buf = vec![0u8; 8 << 10];
    let frame_max = ctx.receiver_cfg.frame_bytes_max as usize + 16;
    loop {
        let mut progressed = false;
        while let Some(t) = rx.poll_transmit() {
            progressed = true;
            ctl_tx
                .write_all(&t.frame)
                .await
                .map_err(|e| format!("{device}: control stream: {e}"))?;
        }
        while let Some(ev) = rx.poll_event() {
            progressed = true;
            if let Some(end) = handle_event(&ctx, &device, &mut rx, ev, &done_tx).await {
                let _ = ctl_tx.finish();
                let _ = tokio::time::timeout(Duration::from_secs(2), ctl_tx.stopped()).await;
                conn.close(
                    quinn::VarInt::from_u32(u32::from(end.0.to_u16())),
                    end.1.as_bytes(),
                );
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
            read = ctl_rx.read(&mut buf) => match read {
                Ok(Some(n)) => {
                    frames.push(&buf[..n]);
                    loop {
                        match frames.next_frame() {
                            Ok(Some(f)) => rx.handle_frame(ctx.now(), &f),
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
            uni = conn.accept_uni() => {
                let mut s = uni.map_err(|e| format!("{device}: {e}"))?;
                let tx = data_tx.clone();
                tokio::spawn(async move {
                    // An oversize data stream is cut off here; the receiver then sees a
                    // truncated frame and closes only this connection.
                    if let Ok(bytes) = s.read_to_end(frame_max).await {
                        let _ = tx.send(bytes).await;
                    } else {
                        let _ = tx.send(Vec::new()).await;
                    }
                });
            }
            Some(bytes) = data_rx.recv() => {
                if bytes.is_empty() {
                    rx.close(ctx.now(), ErrorCode::FrameTooLarge, "data stream exceeded the frame limit");
                } else {
                    rx.handle_frame(ctx.now(), &bytes);
                }
            }
            Some(done) = done_rx.recv() => match done {
                Done::Committed { stream, epoch, durable_seq } => {
                    let tiered = ctx.hub.tiered_seq(&device, &stream, epoch);
                    rx.committed(ctx.now(), &stream, epoch, durable_seq, tiered);
                }
                Done::Failed(e) => rx.close(ctx.now(), error_code(&e), &e.to_string()),
            },
            _ = ctx.revoke_rx.changed() => {
                if ctx.revocations.current().is_revoked(&device) {
                    tracing::warn!(%device, "certificate revoked; disconnecting");
                    rx.close(ctx.now(), ErrorCode::Revoked, "certificate revoked");
                }
            }
            _ = sleep_until(deadline) => rx.handle_timeout(ctx.now()),
            reason = conn.closed() => return Err(format!("{device}: {reason}")),
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn error_code(e: &IngestError) -> ErrorCode {
    match e {
        IngestError::Fenced(_) => ErrorCode::DeviceFenced,
        IngestError::Conflict { .. } => ErrorCode::ConflictFenced,
        IngestError::BadStreamName(_) | IngestError::Unauthorized(_) => {
            ErrorCode::UnauthorizedStream
        }
        IngestError::TooLarge { .. } | IngestError::BadBlock(_) => ErrorCode::BadBlock,
        IngestError::BadDeviceId | IngestError::ReservedSeq | IngestError::BadGap { .. } => {
            ErrorCode::ProtocolViolation
        }
        IngestError::OutOfOrder { .. } => ErrorCode::ProtocolViolation,
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
        }
        ReceiverEvent::Commit {
            stream,
            epoch,
            item,
        } => commit(ctx, device, stream, epoch, item, done).await,
        ReceiverEvent::Backlog { entries, .. } => record_backlog(ctx, device, &entries),
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
            ..
        } => {
            let vb = VerifiedBlock {
                header,
                block,
                skip_through,
                records,
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

fn record_backlog(ctx: &ConnCtx, device: &str, entries: &[BacklogEntry]) {
    ctx.hub.touch(device);
    for e in entries {
        let report = BacklogReport {
            blocks: e.backlog.blocks,
            bytes: e.backlog.bytes,
            oldest_unsent_ts: e.backlog.oldest_unsent_ts,
            last_seq: 0,
        };
        if let Err(err) = ctx.hub.record_backlog(device, &e.stream, report) {
            tracing::warn!(%device, stream = %e.stream, error = %err, "recording backlog");
        }
    }
}
