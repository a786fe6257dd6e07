//! The replicator: a thin quinn driver around `sync::protocol::Sender`.
//!
//! One task owns the link. It connects with mutual TLS, opens the control stream, and runs the
//! sans-IO sender: frames the sender wants written go on the control stream (`Control`) or on
//! a fresh unidirectional stream each (`Data`), events are answered from the local log, and one
//! timer drives keepalives and backlog reports. When the session ends for any reason it
//! reconnects with exponential backoff and jitter, capped, reset after a session that reached
//! the established state, and it never gives up: a stalled link is always visible in
//! [`LinkStatus`] and on `/metrics`.
//!
//! A stream the hub refuses (not on its allow-list, a per-device quota, a forbidden key) comes
//! as a StreamRefused frame with its code and retry time: the session and the device's other
//! streams carry on, the refused stream's records stay in the local log, and the sender offers
//! it again on the same session once the retry time has passed (the hub's allow-list may have
//! changed). `/metrics` lists each refused stream with its code while it is refused.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use sync::protocol::{
    Backlog, ErrorCode, FrameBuffer, GapMarker, GapReason, Instant, LaneAnnounce, Sender,
    SenderConfig, SenderEvent, TransmitKind,
};

use crate::link::{self, TlsPaths};
use crate::log::{self as locallog, LogHandle};

mod poison;

mod reconnect;
mod refused;

pub use refused::RefusedStream;

/// Streams left out of every session: those configured to stay on the device. (A stream the
/// hub refuses is announced as usual: leaving a stream the hub holds out of the Hello would
/// look like a data directory restored without it, and mint a new epoch.)
#[derive(Debug, Default)]
struct Refused {
    /// `replicate = false` streams: never announced, never shipped.
    local_only: std::collections::HashSet<String>,
}

impl Refused {
    fn contains(&mut self, stream: &str) -> bool {
        self.local_only.contains(stream)
    }
}

/// How the replicator reaches its hub.
#[derive(Debug, Clone)]
pub struct ReplicatorConfig {
    pub hub_addr: String,
    pub server_name: String,
    pub tls: TlsPaths,
    /// First retry delay after a failed or ended session.
    pub backoff_initial: Duration,
    /// Longest delay between attempts.
    pub backoff_max: Duration,
    /// Delay (jittered) before reconnecting after the hub said `STORAGE_FULL`.
    pub storage_full_retry: Duration,
    /// Optional cap on block bytes sent per second.
    pub bandwidth_bytes_per_s: Option<u64>,
    /// Per-stream priority; higher drains first. Order within a stream always wins.
    pub priorities: Vec<(String, u8)>,
    /// While catching up, consecutive small blocks are re-sealed into blocks of up to this many
    /// records before they ship (0 ships blocks as stored). See [`reblock`].
    pub reblock_records_max: usize,
    /// Body version of re-sealed blocks; version 2 (columnar) is what makes backlog cheap.
    pub reblock_version: u8,
    /// Streams that stay on the device (`replicate = false`): never announced or shipped, so
    /// the hub never acknowledges them as tiered and local retention alone frees them.
    pub local_only: Vec<String>,
    pub sender: SenderConfig,
}

impl ReplicatorConfig {
    pub fn new(hub_addr: String, server_name: String, tls: TlsPaths) -> Self {
        ReplicatorConfig {
            hub_addr,
            server_name,
            tls,
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            storage_full_retry: crate::config::DEFAULT_STORAGE_FULL_RETRY,
            bandwidth_bytes_per_s: None,
            priorities: Vec::new(),
            reblock_records_max: sync::columnar::OFFLINE_BLOCK_RECORDS,
            reblock_version: sync::block::VERSION_COLUMNAR,
            local_only: Vec::new(),
            sender: SenderConfig::default(),
        }
    }
}

/// The link's state as `/metrics`, `/v1/status` and `edge-agent status` show it.
#[derive(Debug)]
pub struct LinkStatus {
    state: Mutex<LinkState>,
    /// True while a session is established; the HTTP status follows it.
    up_tx: tokio::sync::watch::Sender<bool>,
    pub connects: AtomicU64,
    pub sessions_established: AtomicU64,
    pub disconnects: AtomicU64,
    pub blocks_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub epochs_minted: AtomicU64,
    /// Streams the hub refused (each refusal counted once per retry period).
    pub streams_refused: AtomicU64,
    /// The streams the hub refuses right now, with code, reason and next retry.
    refused_now: Mutex<std::collections::BTreeMap<String, RefusedStream>>,
    /// Sessions the hub ended because its storage was full.
    pub storage_full: AtomicU64,
    /// Blocks the hub refused for good, quarantined and reported as gaps.
    pub blocks_quarantined: AtomicU64,
}

/// What the link is doing right now: state, last error, since when, next retry.
pub use crate::http::status::LinkRecord as LinkState;

impl Default for LinkStatus {
    fn default() -> Self {
        LinkStatus {
            state: Mutex::new(LinkState::default()),
            up_tx: tokio::sync::watch::channel(false).0,
            connects: AtomicU64::new(0),
            sessions_established: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
            blocks_sent: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            epochs_minted: AtomicU64::new(0),
            streams_refused: AtomicU64::new(0),
            refused_now: Mutex::default(),
            storage_full: AtomicU64::new(0),
            blocks_quarantined: AtomicU64::new(0),
        }
    }
}

impl LinkStatus {
    pub fn not_configured() -> Arc<LinkStatus> {
        let s = Arc::new(LinkStatus::default());
        s.set("not configured", None);
        s
    }

    /// Follows whether a session is established.
    pub fn subscribe_up(&self) -> tokio::sync::watch::Receiver<bool> {
        self.up_tx.subscribe()
    }

    fn set(&self, state: &str, error: Option<String>) {
        let now = crate::http::status::now_ms();
        self.state
            .lock()
            .expect("link state lock")
            .record(state, error, now);
        self.up_tx.send_replace(state == "up");
    }

    /// The next connection attempt is due in `delay` (shown by `/v1/status`).
    pub fn retry_in(&self, delay: Duration) {
        let now = crate::http::status::now_ms();
        self.state
            .lock()
            .expect("link state lock")
            .retry_in(delay, now);
    }

    /// The link's counters in Prometheus text format, for the agent's `/metrics`.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let up = if self.state().state == "up" { 1 } else { 0 };
        let mut out = String::with_capacity(1024);
        let counters = [
            (
                "tributary_edge_link_connects_total",
                "Connection attempts to the hub.",
                &self.connects,
            ),
            (
                "tributary_edge_link_sessions_total",
                "Sessions that completed the handshake.",
                &self.sessions_established,
            ),
            (
                "tributary_edge_link_disconnects_total",
                "Sessions or attempts that ended.",
                &self.disconnects,
            ),
            (
                "tributary_edge_link_blocks_sent_total",
                "Block and gap frames sent.",
                &self.blocks_sent,
            ),
            (
                "tributary_edge_link_bytes_sent_total",
                "Bytes of block and gap frames sent.",
                &self.bytes_sent,
            ),
            (
                "tributary_edge_epochs_minted_total",
                "Epochs minted because the hub was ahead of this data directory.",
                &self.epochs_minted,
            ),
            (
                "tributary_edge_link_streams_refused_total",
                "Streams the hub refused (allow-list, quota, forbidden key), once per refusal; offered again after the hub's retry time.",
                &self.streams_refused,
            ),
            (
                "tributary_edge_link_storage_full_total",
                "Sessions the hub ended or refused because its storage was full (retried after hub.storage_full_retry).",
                &self.storage_full,
            ),
            (
                "tributary_edge_link_blocks_refused_total",
                "Blocks the hub refused for good (DECODED_TOO_LARGE, BAD_BLOCK), quarantined under data_dir/quarantine/ and reported to the hub as gaps.",
                &self.blocks_quarantined,
            ),
        ];
        let _ = writeln!(
            out,
            "# HELP tributary_edge_link_up 1 while a replication session is established."
        );
        let _ = writeln!(
            out,
            "# TYPE tributary_edge_link_up gauge\ntributary_edge_link_up {up}"
        );
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        refused::render(&mut out, &self.refused_streams());
        out
    }

    /// A snapshot of the state.
    pub fn state(&self) -> LinkState {
        self.state.lock().expect("link state lock").clone()
    }
}

/// Exponential backoff with full jitter.
#[derive(Debug)]
struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
    rng: SmallRng,
}

impl Backoff {
    fn next_delay(&mut self) -> Duration {
        let exp = self.initial.saturating_mul(1u32 << self.attempt.min(16));
        self.attempt = self.attempt.saturating_add(1);
        self.jittered(exp.min(self.max))
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }

    /// `delay` scaled into [delay/2, delay]: the jitter spreads a fleet's reconnects after a
    /// hub restart or once its storage frees.
    fn jittered(&mut self, delay: Duration) -> Duration {
        delay.mul_f64(self.rng.random_range(0.5..=1.0))
    }
}

/// How a session ended, for the wait before the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionEnd {
    /// It got established (or a stream was refused and the next session leaves it out): the
    /// backoff starts over.
    Reset,
    /// It never got established: the backoff keeps growing.
    Failed,
    /// The hub's storage is full: retry after `storage_full_retry`, whatever the backoff.
    StorageFull,
}

/// Runs the replicator until the process ends. Never returns on its own.
pub async fn run(cfg: ReplicatorConfig, log: LogHandle, status: Arc<LinkStatus>) {
    // Seeded from the clock: jitter only has to differ between devices, not be secret.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut backoff = Backoff {
        initial: cfg.backoff_initial,
        max: cfg.backoff_max,
        attempt: 0,
        rng: SmallRng::seed_from_u64(seed),
    };
    let bind: SocketAddr = "0.0.0.0:0".parse().expect("literal address");
    let endpoint = loop {
        match link::client_endpoint(bind) {
            Ok(e) => break e,
            Err(e) => {
                status.set("down", Some(format!("opening UDP socket: {e}")));
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    };
    let clock = StdInstant::now();
    let mut refused = Refused {
        local_only: cfg.local_only.iter().cloned().collect(),
    };
    let mut poison = poison::Poison::default();
    // Fast attempts left after a session that lived (see `reconnect`).
    let mut fast_left = 0u32;
    loop {
        status.set("connecting", None);
        status.connects.fetch_add(1, Ordering::Relaxed);
        let deadline = match fast_left {
            0 => reconnect::connect_timeout(backoff.attempt),
            _ => reconnect::CONNECT_TIMEOUT_FIRST,
        };
        let lived_before = status.sessions_established.load(Ordering::Relaxed);
        let outcome = session(
            deadline,
            &cfg,
            &endpoint,
            &log,
            &status,
            clock,
            &mut refused,
            &mut poison,
        )
        .await;
        status.disconnects.fetch_add(1, Ordering::Relaxed);
        let delay = match outcome {
            Ok(SessionEnd::Reset) => {
                backoff.reset();
                fast_left = reconnect::FAST_RETRIES;
                backoff.next_delay()
            }
            Ok(SessionEnd::Failed) if fast_left > 0 => {
                fast_left -= 1;
                backoff.jittered(reconnect::FAST_RETRY)
            }
            Ok(SessionEnd::Failed) => backoff.next_delay(),
            Ok(SessionEnd::StorageFull) => {
                // The hub comes back by itself once space frees: a growing backoff would only
                // delay the catch-up (up to `backoff_max`) after it did.
                backoff.reset();
                backoff.jittered(cfg.storage_full_retry)
            }
            Err(e) => {
                tracing::warn!(error = %e, "replication session ended");
                status.set("down", Some(e));
                // A session that lived and then broke (a hub killed or restarted) starts the
                // attempts over, fast.
                if status.sessions_established.load(Ordering::Relaxed) > lived_before {
                    backoff.reset();
                    fast_left = reconnect::FAST_RETRIES;
                }
                if fast_left > 0 {
                    fast_left -= 1;
                    backoff.jittered(reconnect::FAST_RETRY)
                } else {
                    backoff.next_delay()
                }
            }
        };
        if status.state().state != "down" {
            status.set("down", None);
        }
        status.retry_in(delay);
        tokio::time::sleep(delay).await;
    }
}

fn now_of(clock: StdInstant) -> Instant {
    Instant::from_nanos(clock.elapsed().as_nanos() as u64)
}

/// Resolves the hub address; a name is looked up on every attempt so DNS changes apply.
async fn resolve(addr: &str) -> Result<SocketAddr, String> {
    let mut it = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| format!("resolving {addr}: {e}"))?;
    it.next()
        .ok_or_else(|| format!("resolving {addr}: no addresses"))
}

/// The lanes the log holds, as the Hello announces them, except refused streams.
fn announce(log: &LogHandle, refused: &mut Refused) -> Vec<LaneAnnounce> {
    let status = log.status();
    let mut lanes = Vec::new();
    for st in &status.streams {
        if refused.contains(&st.stream) {
            continue;
        }
        let gaps = log.gaps(&st.stream);
        for (epoch, first, last) in log.epochs_held(&st.stream) {
            let current = epoch == st.epoch;
            let backlog = if current {
                Backlog {
                    blocks: st.backlog_blocks,
                    bytes: st.backlog_bytes,
                    oldest_unsent_ts: st.oldest_unsent_ts,
                }
            } else {
                Backlog::default()
            };
            let lane_gaps = gaps
                .iter()
                .filter(|g| g.epoch == epoch)
                .map(gap_marker)
                .collect();
            lanes.push(LaneAnnounce {
                stream: st.stream.clone(),
                epoch,
                first_seq: first,
                last_seq: last,
                acked_seq: if current { st.acked_durable } else { 0 },
                backlog,
                gaps: lane_gaps,
            });
        }
    }
    lanes
}

fn gap_marker(g: &locallog::Gap) -> GapMarker {
    let reason = match g.reason {
        locallog::GapReason::Dropped => GapReason::DiskFull,
        // The hub knows no "refused" reason: the block is quarantined, as a corrupt one is.
        locallog::GapReason::Corrupt | locallog::GapReason::Refused => GapReason::Corrupt,
    };
    GapMarker {
        first_seq: g.first_seq,
        last_seq: g.last_seq,
        reason,
        count: g.records,
    }
}

/// One connection. Returns how it ended, which sets the wait before the next one.
// The replicator's state for one attempt, passed as it is owned by the run loop.
#[allow(clippy::too_many_arguments)]
async fn session(
    connect_timeout: Duration,
    cfg: &ReplicatorConfig,
    endpoint: &quinn::Endpoint,
    log: &LogHandle,
    status: &LinkStatus,
    clock: StdInstant,
    refused: &mut Refused,
    poison: &mut poison::Poison,
) -> Result<SessionEnd, String> {
    let addr = resolve(&cfg.hub_addr).await?;
    // Re-read the certificate files on every attempt: a rotated certificate applies at once.
    let client = link::client_config(&cfg.tls).map_err(|e| e.to_string())?;
    let connecting = endpoint
        .connect_with(client, addr, &cfg.server_name)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let handshake = async {
        let conn = connecting
            .await
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        let (ctl_tx, ctl_rx) = conn
            .open_bi()
            .await
            .map_err(|e| format!("opening control stream: {e}"))?;
        Ok::<_, String>((conn, ctl_tx, ctl_rx))
    };
    let (conn, mut ctl_tx, mut ctl_rx) =
        tokio::time::timeout(connect_timeout, handshake)
            .await
            .map_err(|_| format!("connecting to {addr}: no answer within {connect_timeout:?}"))??;
    let mut sender_cfg = cfg.sender.clone();
    sender_cfg.capabilities = refused::capabilities(sender_cfg.capabilities);
    let mut sender = Sender::new(
        sender_cfg,
        log.epoch(),
        announce(log, refused),
        now_of(clock),
    )
    .map_err(|e| format!("local log: {e}"))?;
    for (stream, prio) in &cfg.priorities {
        sender.set_priority(stream, *prio);
    }
    let mut frames = FrameBuffer::new(cfg.sender.frame_bytes_max);
    let mut durable = log.durable_watch();
    let mut offered = Offered::default();
    let mut bucket = cfg.bandwidth_bytes_per_s.map(TokenBucket::new);
    let mut established = false;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // Drain everything the sender has to say before waiting: answering an event can queue
        // transmits, and a transmit can free window for more events.
        let mut progressed = false;
        while let Some(t) = sender.poll_transmit() {
            progressed = true;
            match t.kind {
                TransmitKind::Control => ctl_tx
                    .write_all(&t.frame)
                    .await
                    .map_err(control_write_error)?,
                TransmitKind::Data => {
                    if let Some(b) = bucket.as_mut() {
                        b.take(t.frame.len() as u64).await;
                    }
                    send_data(&conn, t.frame, status).await?;
                }
            }
        }
        while let Some(ev) = sender.poll_event() {
            progressed = true;
            match ev {
                SenderEvent::Established { version, epoch_max } => {
                    tracing::info!(version, epoch_max = format_args!("{epoch_max:016x}"), hub = %addr, "replication session established");
                    established = true;
                    status.sessions_established.fetch_add(1, Ordering::Relaxed);
                    status.set("up", None);
                }
                SenderEvent::WantBlocks {
                    stream,
                    epoch,
                    after_seq,
                    bytes_max,
                } => {
                    let blocks = log
                        .read_blocks(&stream, epoch, after_seq, bytes_max as usize)
                        .map_err(|e| format!("reading local log: {e}"))?;
                    if let Some(last) = blocks.last() {
                        offered.note(&stream, epoch, last.header.last_seq());
                    }
                    let stored = poison.decoded_limit.map(|_| blocks.clone());
                    let resealed = reblock(blocks, cfg.reblock_records_max, cfg.reblock_version)
                        .map_err(|e| format!("re-sealing backlog blocks: {e}"))?;
                    let blocks = match stored {
                        Some(stored) => poison::within_limit(stored, resealed, poison),
                        None => resealed,
                    };
                    sender
                        .supply_blocks(now_of(clock), &stream, epoch, blocks)
                        .map_err(|e| e.to_string())?;
                }
                SenderEvent::Acked {
                    stream,
                    epoch,
                    durable_seq,
                    tiered_seq,
                } => {
                    log.set_acked(&stream, epoch, durable_seq, tiered_seq)
                        .map_err(|e| e.to_string())?;
                    status.stream_shipping(&stream);
                }
                SenderEvent::MintEpoch { epoch_min, rekey } => {
                    let epoch = mint(log, epoch_min, &rekey).await?;
                    status.epochs_minted.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        epoch = format_args!("{epoch:016x}"),
                        epoch_min = format_args!("{epoch_min:016x}"),
                        "hub is ahead of this data directory; minted a new epoch"
                    );
                    sender.epoch_minted(now_of(clock), epoch);
                }
                SenderEvent::StreamRefused {
                    stream,
                    code,
                    retry_after,
                    message,
                    ..
                } => status.stream_refused(&stream, code, retry_after, &message),
                SenderEvent::StreamRetrying { stream } => {
                    tracing::info!(%stream, "offering a refused stream to the hub again");
                }
                SenderEvent::Closed(reason) => {
                    let _ = ctl_tx.finish();
                    conn.close(
                        quinn::VarInt::from_u32(u32::from(reason.code.to_u16())),
                        reason.message.as_bytes(),
                    );
                    if reason.code == ErrorCode::Shutdown
                        || !reason.by_peer && reason.code == ErrorCode::IdleTimeout
                    {
                        return Ok(if established {
                            SessionEnd::Reset
                        } else {
                            SessionEnd::Failed
                        });
                    }
                    if reason.by_peer && reason.code == ErrorCode::StorageFull {
                        status.storage_full.fetch_add(1, Ordering::Relaxed);
                        let msg = format!(
                            "hub storage full ({}); keeping the data and retrying in about {:?}",
                            reason.message, cfg.storage_full_retry
                        );
                        tracing::warn!("{msg}");
                        status.set("down", Some(msg));
                        return Ok(SessionEnd::StorageFull);
                    }
                    if reason.by_peer
                        && poison::permanent(reason.code)
                        && poison::on_refusal(log, status, &reason, &offered.last, poison).await
                    {
                        let msg = format!(
                            "hub refused a block for good ({}); quarantined it, moving on",
                            reason.message
                        );
                        status.set("down", Some(msg));
                        return Ok(SessionEnd::Reset);
                    }
                    return Err(format!(
                        "hub closed the session: {:?}: {}",
                        reason.code, reason.message
                    ));
                }
            }
        }
        if progressed {
            continue;
        }
        let deadline = sender.poll_timeout().map(|t| {
            let now = now_of(clock);
            tokio::time::Instant::now() + t.saturating_since(now)
        });
        tokio::select! {
            read = ctl_rx.read(&mut buf) => {
                match read.map_err(control_read_error)? {
                    Some(n) => {
                        frames.push(&buf[..n]);
                        while let Some(f) = frames.next_frame().map_err(|e| format!("hub sent a bad frame: {e}"))? {
                            sender.handle_frame(now_of(clock), &f);
                        }
                    }
                    None => return Err("hub closed the control stream".into()),
                }
            }
            changed = durable.changed() => {
                if changed.is_err() {
                    return Err("local log closed".into());
                }
                offer_new_blocks(&mut sender, log, &mut offered, clock, refused)?;
            }
            _ = sleep_until(deadline) => sender.handle_timeout(now_of(clock)),
            closed = conn.closed() => return Err(format!("connection lost: {closed}")),
        }
    }
}

/// A control-stream read error with its cause: quinn's "connection lost" alone does not say
/// whether the hub closed, reset (a hub that died and came back) or timed out.
fn control_read_error(e: quinn::ReadError) -> String {
    match e {
        quinn::ReadError::ConnectionLost(cause) => {
            format!("control stream: connection lost: {cause}")
        }
        other => format!("control stream: {other}"),
    }
}

/// A control-stream write error with its cause, as [`control_read_error`].
fn control_write_error(e: quinn::WriteError) -> String {
    match e {
        quinn::WriteError::ConnectionLost(cause) => {
            format!("control stream: connection lost: {cause}")
        }
        other => format!("control stream: {other}"),
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Writes one Data frame on its own unidirectional stream, so blocks do not wait behind each
/// other; the hub reorders them within its window.
async fn send_data(
    conn: &quinn::Connection,
    frame: Vec<u8>,
    status: &LinkStatus,
) -> Result<(), String> {
    let mut s = conn
        .open_uni()
        .await
        .map_err(|e| format!("opening data stream: {e}"))?;
    status.blocks_sent.fetch_add(1, Ordering::Relaxed);
    status
        .bytes_sent
        .fetch_add(frame.len() as u64, Ordering::Relaxed);
    s.write_all(&frame)
        .await
        .map_err(|e| format!("data stream: {e}"))?;
    s.finish().map_err(|e| format!("data stream: {e}"))?;
    Ok(())
}

/// Re-seals a run of stored blocks into fewer, larger blocks for shipping.
///
/// Live data ships as the small blocks the log sealed for low latency. A backlog (after an
/// outage, or a slow link) is read back in runs, and a run of small blocks compresses far
/// better as one large columnar block: this is how block size adapts to the link without
/// rewriting anything on disk. The seq range and the records are exactly those of the stored
/// blocks; the hub's content checksums are per record, so they match whatever the boundaries.
/// A block already large enough, or alone in its run, ships as stored.
pub fn reblock(
    blocks: Vec<locallog::StoredBlock>,
    records_max: usize,
    version: u8,
) -> Result<Vec<Vec<u8>>, String> {
    if records_max == 0 || blocks.len() < 2 {
        return Ok(blocks.into_iter().map(|b| b.bytes).collect());
    }
    let mut out = Vec::new();
    let mut run: Vec<locallog::StoredBlock> = Vec::new();
    let mut run_records = 0usize;
    for b in blocks {
        let n = b.header.count as usize;
        let contiguous = run
            .last()
            .is_none_or(|p| p.header.last_seq() + 1 == b.header.first_seq);
        if !run.is_empty() && (run_records + n > records_max || !contiguous) {
            out.extend(seal_run(std::mem::take(&mut run), version)?);
            run_records = 0;
        }
        run_records += n;
        run.push(b);
    }
    if !run.is_empty() {
        out.extend(seal_run(run, version)?);
    }
    Ok(out)
}

/// One run re-sealed: one block, or several where the run's records exceed what a columnar
/// block holds (distinct columns, decoded size; `locallog::cut_for`), so that a backlog with
/// many distinct field names never fails to re-seal.
fn seal_run(run: Vec<locallog::StoredBlock>, version: u8) -> Result<Vec<Vec<u8>>, String> {
    if run.len() == 1 {
        return Ok(vec![run.into_iter().next().expect("one block").bytes]);
    }
    let limits = sync::block::DecodeLimits::default();
    let first = run[0].header;
    let last_flags = run.last().expect("non-empty run").header.flags;
    let mut records = Vec::with_capacity(run.iter().map(|b| b.header.count as usize).sum());
    for b in &run {
        let block = sync::block::decode_block(&b.bytes, &limits).map_err(|e| e.to_string())?;
        records.extend(block.records);
    }
    let runs = locallog::cut_for(version, &records);
    let (mut at, mut out) = (0usize, Vec::with_capacity(runs.len()));
    for (k, len) in runs.iter().enumerate() {
        let opts = sync::block::EncodeOptions {
            version,
            // Only a batch's continuation at the very end of the run carries over; inside the
            // run the batch is whole.
            flags: if k + 1 == runs.len() {
                last_flags & sync::block::FLAG_BATCH_CONTINUES
            } else {
                sync::block::FLAG_BATCH_CONTINUES
            },
            zstd_level: sync::block::DEFAULT_ZSTD_LEVEL,
        };
        let seq = first.first_seq + at as u64;
        let block = sync::block::encode_block_with(&opts, first.epoch, seq, &records[at..at + len])
            .map_err(|e| e.to_string())?;
        out.push(block);
        at += len;
    }
    Ok(out)
}

/// The newest block the driver has handed to the sender per lane.
#[derive(Debug, Default)]
struct Offered {
    last: std::collections::HashMap<(String, u64), u64>,
}

impl Offered {
    fn note(&mut self, stream: &str, epoch: u64, last_seq: u64) {
        let e = self.last.entry((stream.to_owned(), epoch)).or_insert(0);
        *e = (*e).max(last_seq);
    }
}

/// Offers blocks made durable since the last offer, so live data ships without waiting for the
/// sender to ask again. The sender ignores blocks it is not ready for and asks later.
fn offer_new_blocks(
    sender: &mut Sender,
    log: &LogHandle,
    offered: &mut Offered,
    clock: StdInstant,
    refused: &mut Refused,
) -> Result<(), String> {
    let status = log.status();
    for st in &status.streams {
        if refused.contains(&st.stream) {
            continue;
        }
        let key = (st.stream.clone(), st.epoch);
        let after = offered.last.get(&key).copied().unwrap_or(st.acked_durable);
        if st.durable_seq <= after {
            continue;
        }
        let blocks = log
            .read_blocks(&st.stream, st.epoch, after, 4 << 20)
            .map_err(|e| e.to_string())?;
        for b in blocks {
            offered.note(&st.stream, st.epoch, b.header.last_seq());
            sender
                .offer_block(now_of(clock), &st.stream, b.bytes)
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Mints an epoch above `epoch_min` and moves the records the hub cannot take under their old
/// seqs into it.
async fn mint(
    log: &LogHandle,
    epoch_min: u64,
    rekey: &[sync::protocol::Rekey],
) -> Result<u64, String> {
    let log = log.clone();
    let rekey = rekey.to_vec();
    tokio::task::spawn_blocking(move || {
        log.mint_epoch_rekey(epoch_min, &rekey)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// A token bucket for the optional bandwidth cap.
#[derive(Debug)]
struct TokenBucket {
    rate: u64,
    tokens: f64,
    at: tokio::time::Instant,
}

impl TokenBucket {
    fn new(rate: u64) -> Self {
        TokenBucket {
            rate: rate.max(1),
            tokens: rate as f64,
            at: tokio::time::Instant::now(),
        }
    }

    async fn take(&mut self, n: u64) {
        let now = tokio::time::Instant::now();
        let burst = self.rate as f64;
        self.tokens =
            (self.tokens + now.duration_since(self.at).as_secs_f64() * self.rate as f64).min(burst);
        self.at = now;
        self.tokens -= n as f64;
        if self.tokens < 0.0 {
            let wait = Duration::from_secs_f64(-self.tokens / self.rate as f64);
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sync::{Record, Value};

    fn stored(epoch: u64, first_seq: u64, n: usize) -> locallog::StoredBlock {
        let records: Vec<Record> = (0..n)
            .map(|i| Record {
                tags: Vec::new(),
                key: format!("k{}", i % 3),
                ts: 1_000 + (first_seq as i64 + i as i64) * 10,
                fields: vec![("v".into(), Value::F64(first_seq as f64 + i as f64 / 100.0))],
            })
            .collect();
        let bytes =
            sync::block::encode_block(sync::block::VERSION_ROWS, epoch, first_seq, &records)
                .unwrap();
        let header = sync::block::decode_header(&bytes).unwrap();
        locallog::StoredBlock { header, bytes }
    }

    fn records_of(blocks: &[Vec<u8>]) -> Vec<(u64, Record)> {
        let limits = sync::block::DecodeLimits::default();
        let mut out = Vec::new();
        for b in blocks {
            let d = sync::block::decode_block(b, &limits).unwrap();
            for (i, r) in d.records.into_iter().enumerate() {
                out.push((d.header.first_seq + i as u64, r));
            }
        }
        out
    }

    #[test]
    fn reblock_merges_runs_and_keeps_every_record() {
        let input: Vec<_> = (0..10).map(|i| stored(9, 1 + i * 50, 50)).collect();
        let expected = records_of(&input.iter().map(|b| b.bytes.clone()).collect::<Vec<_>>());
        let out = reblock(input, 200, sync::block::VERSION_COLUMNAR).unwrap();
        assert_eq!(out.len(), 3, "500 records in runs of at most 200");
        let headers: Vec<_> = out
            .iter()
            .map(|b| sync::block::decode_header(b).unwrap())
            .collect();
        assert_eq!(
            headers.iter().map(|h| h.count).collect::<Vec<_>>(),
            vec![200, 200, 100]
        );
        assert!(
            headers
                .iter()
                .all(|h| h.epoch == 9 && h.version == sync::block::VERSION_COLUMNAR)
        );
        assert_eq!(records_of(&out), expected);
    }

    #[test]
    fn reblock_leaves_single_blocks_and_gaps_alone() {
        let one = stored(1, 1, 10);
        let bytes = one.bytes.clone();
        assert_eq!(reblock(vec![one], 1000, 2).unwrap(), vec![bytes]);
        // A seq gap between blocks (a dropped range) splits the run.
        let out = reblock(
            vec![stored(1, 1, 10), stored(1, 11, 10), stored(1, 40, 10)],
            1000,
            2,
        )
        .unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(records_of(&out).len(), 30);
    }

    #[test]
    fn local_only_streams_are_always_left_out() {
        let mut r = Refused {
            local_only: ["raw".to_string()].into_iter().collect(),
        };
        assert!(
            r.contains("raw"),
            "a replicate = false stream is never offered"
        );
        assert!(
            !r.contains("filtered"),
            "a refused stream is still announced"
        );
    }

    #[test]
    fn backoff_grows_to_the_cap_and_resets() {
        let mut b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
            attempt: 0,
            rng: SmallRng::seed_from_u64(7),
        };
        let first = b.next_delay();
        assert!(first <= Duration::from_millis(100) && first >= Duration::from_millis(50));
        for _ in 0..40 {
            assert!(b.next_delay() <= Duration::from_secs(30));
        }
        let late = b.next_delay();
        assert!(
            late >= Duration::from_secs(15),
            "capped delay keeps at least half the cap: {late:?}"
        );
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
