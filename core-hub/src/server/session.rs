//! One device connection: admission, then the loop around the protocol's `Receiver`.
//!
//! Deadlines: a connection has `ingest.hello_timeout` from the end of its handshake to open
//! its control stream and deliver a complete Hello, or it closes with `HELLO_TIMEOUT`; after
//! that the receiver's idle timeout (`ingest.control_idle_timeout`) closes a silent session
//! with `IDLE_TIMEOUT`, and each data stream's reads have the same progress deadline. At most
//! `ingest.blocks_in_flight_max` data streams are taken per connection, counting those being
//! read or decoded and the commits not yet durable; past it the loop stops accepting streams
//! and quinn's stream limit (the same number) makes the device wait for credit.
//!
//! The loop is the driver the sans-IO receiver asks for: it flushes the receiver's transmits,
//! acts on its events, then waits for the next input (a control chunk, a data stream, a
//! decoded block, a commit outcome, a tiering or revocation signal, or the receiver's timer)
//! and feeds it in. Each step is its own method.

use std::collections::VecDeque;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use sync::protocol::{ErrorCode, FrameBuffer, Receiver, ReceiverEvent};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::admission::{DeviceSlot, Handshake, admit_connection, peer_device};
use super::commit::{Charged, Done, error_code, push_tiered, refuses_stream, settle};
use super::data::{DECODE_AHEAD, Data, Turn, next_data, read_data};
use super::events::{self, Announced, announced_last_seqs, handle_event};
use super::{ConnCtx, ConnStats};
use crate::refusals::RefusedAt;

/// Runs one connection from its handshake to its end.
pub(super) async fn connection(ctx: ConnCtx, handshake: Handshake) -> Result<(), String> {
    let conn = handshake
        .incoming
        .await
        .map_err(|e| format!("handshake: {e}"));
    drop(handshake.guard);
    let conn = conn?;
    let hello_by = tokio::time::Instant::now() + ctx.quotas.hello_timeout;
    let (device, leaf) = peer_device(&conn)?;
    let (slot, superseded) = ctx.slots.claim(&device, ctx.mutation.supersedes());
    if superseded > 0 {
        tracing::info!(%device, superseded, "a new connection supersedes the device's oldest");
    }
    let _charge = match admit_connection(&ctx, &conn, superseded > 0).await {
        Ok(c) => c,
        Err(msg) => {
            tracing::warn!(%device, reason = %msg, "refusing a connection");
            ConnStats::bump(&ctx.hub.stats().connections.refused);
            close_with(
                &ctx.hub.stats().connections,
                &conn,
                ErrorCode::LimitExceeded,
                &msg,
            );
            return Ok(());
        }
    };
    let Some((mut ctl_tx, ctl_rx)) = control_stream(&ctx, &conn, &device, &slot, hello_by).await?
    else {
        return Ok(());
    };
    if let Some((code, msg)) = gate(&ctx, &device, &leaf) {
        refuse(&ctx.hub.stats().connections, &conn, &mut ctl_tx, code, &msg).await;
        return Ok(());
    }
    tracing::info!(%device, remote = %conn.remote_address(), "device connected");
    let session = Session::new(ctx, conn, (device, leaf), (ctl_tx, ctl_rx), slot, hello_by);
    session.run().await
}

/// Waits for the control stream, until the Hello deadline or until a newer connection of the
/// device supersedes this one (both close the connection with their code: `None`).
async fn control_stream(
    ctx: &ConnCtx,
    conn: &quinn::Connection,
    device: &str,
    slot: &DeviceSlot,
    hello_by: tokio::time::Instant,
) -> Result<Option<(quinn::SendStream, quinn::RecvStream)>, String> {
    let stats = &ctx.hub.stats().connections;
    tokio::select! {
        bi = conn.accept_bi() => match bi {
            Ok(streams) => Ok(Some(streams)),
            Err(e) => Err(format!("{device}: control stream: {e}")),
        },
        _ = tokio::time::sleep_until(hello_by) => {
            tracing::warn!(%device, "no control stream within ingest.hello_timeout; closing");
            ConnStats::bump(&stats.hello_timeouts);
            close_with(stats, conn, ErrorCode::HelloTimeout, "no control stream within the Hello deadline");
            Ok(None)
        }
        _ = slot.superseded.notified() => {
            tracing::info!(%device, "superseded before its session started; closing");
            ConnStats::bump(&stats.superseded);
            close_with(stats, conn, ErrorCode::Superseded, "a newer connection of this device took its place");
            Ok(None)
        }
    }
}

/// Why a device may not start a session now, checked once its control stream is open.
fn gate(ctx: &ConnCtx, device: &str, leaf: &CertificateDer<'_>) -> Option<(ErrorCode, String)> {
    // The list may have changed between the handshake's check and now.
    let list = ctx.revocations.current();
    if list.is_cert_revoked(leaf) {
        let refusals = ctx.revocations.refusals();
        refusals.refused(&list, leaf, RefusedAt::SessionStart);
        tracing::warn!(%device, "refusing a revoked certificate");
        return Some((ErrorCode::Revoked, "certificate revoked".into()));
    }
    if let Some(reason) = ctx.hub.is_fenced(device) {
        tracing::warn!(%device, %reason, "refusing a fenced device");
        return Some((
            ErrorCode::DeviceFenced,
            format!("device is fenced: {reason}"),
        ));
    }
    ctx.hub.touch(device);
    // A certificate the list accepts: whatever refused this device before no longer does.
    ctx.revocations.refusals().accepted(device);
    // While tier 1 takes no writes, a session would only ship blocks to be refused: say so at
    // once, and the agent comes back after its short storage retry.
    if let Some(why) = ctx.hub.storage_unavailable() {
        tracing::debug!(%device, reason = %why, "refusing a session: storage full");
        return Some((ErrorCode::StorageFull, why.to_string()));
    }
    None
}

/// One input the loop waits for.
enum Input {
    Control(Result<Option<quinn::Chunk>, quinn::ReadError>),
    DataStream(Result<quinn::RecvStream, quinn::ConnectionError>),
    Data(Data),
    Done(Done),
    Tiered,
    RevocationsChanged,
    Superseded,
    HelloTimeout,
    Timer,
    Closed(quinn::ConnectionError),
}

/// A session's state, owned by its connection task.
struct Session {
    ctx: ConnCtx,
    conn: quinn::Connection,
    device: String,
    leaf: CertificateDer<'static>,
    ctl_tx: quinn::SendStream,
    ctl_rx: quinn::RecvStream,
    rx: Receiver,
    frames: FrameBuffer,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    /// Data streams being read and decoded, in the order they were opened.
    ahead: VecDeque<JoinHandle<Data>>,
    /// Replays already counted with the hub's duplicates.
    replays: u64,
    /// Tiering moves tiered_seq long after the last ack of new data; an idle agent hears of it
    /// only through this signal, so it can free what tier 2 now holds.
    tiered_rx: watch::Receiver<u64>,
    /// What each lane announced in the Hello (the first control frame): its last seq (Backlog
    /// frames carry no seqs, and completeness needs it to report how many records a device
    /// owes) and its backlog, recorded once the session is established.
    announced: Option<Announced>,
    /// Commits handed to the WAL whose outcome has not come back on `done_rx`.
    in_flight: usize,
    /// The charge of the block last handed to the receiver, for its commit.
    charged: Option<Charged>,
    /// The newest data stream's charge turn: the next stream charges after it.
    turn: Option<tokio::sync::oneshot::Receiver<()>>,
    /// Whether the loop is holding data streams back at `ingest.blocks_in_flight_max`.
    limited: bool,
    /// This connection's place among its device's connections.
    slot: DeviceSlot,
    /// When the Hello must have arrived.
    hello_by: tokio::time::Instant,
}

impl Session {
    fn new(
        ctx: ConnCtx,
        conn: quinn::Connection,
        (device, leaf): (String, CertificateDer<'static>),
        (ctl_tx, ctl_rx): (quinn::SendStream, quinn::RecvStream),
        slot: DeviceSlot,
        hello_by: tokio::time::Instant,
    ) -> Session {
        let rx = Receiver::new(device.clone(), ctx.receiver_cfg.clone(), ctx.now());
        let frames = FrameBuffer::new(ctx.receiver_cfg.frame_bytes_max);
        let (done_tx, done_rx) = mpsc::unbounded_channel::<Done>();
        let tiered_rx = ctx.hub.subscribe_tiered();
        Session {
            ctx,
            conn,
            device,
            leaf,
            ctl_tx,
            ctl_rx,
            rx,
            frames,
            done_tx,
            done_rx,
            ahead: VecDeque::with_capacity(DECODE_AHEAD),
            replays: 0,
            tiered_rx,
            announced: None,
            in_flight: 0,
            charged: None,
            turn: None,
            limited: false,
            slot,
            hello_by,
        }
    }

    async fn run(mut self) -> Result<(), String> {
        loop {
            self.count_replays();
            let mut progressed = self.flush_transmits().await?;
            while let Some(ev) = self.rx.poll_event() {
                progressed = true;
                if let Some(end) = self.on_event(ev).await {
                    self.end(end).await;
                    return Ok(());
                }
            }
            // A block that produced no commit (a replay, or one the receiver holds for
            // reordering, bounded by its window) gives its charge back now.
            self.charged = None;
            if !progressed {
                let input = self.next_input().await;
                self.on_input(input)?;
            }
        }
    }

    /// Blocks the receiver acknowledged again without a commit (replays of what the hub
    /// holds) count with the hub's duplicates.
    fn count_replays(&mut self) {
        let seen = self.rx.stats().replays;
        if seen > self.replays {
            let duplicates = &self.ctx.hub.stats().duplicates;
            duplicates.fetch_add(seen - self.replays, std::sync::atomic::Ordering::Relaxed);
            self.replays = seen;
        }
    }

    /// Writes the receiver's queued frames; whether there were any.
    async fn flush_transmits(&mut self) -> Result<bool, String> {
        let mut progressed = false;
        // Once closed, the Error frame waits for the end, after the session's commits
        // settled: the device must not see the end while its records are still landing.
        while (!self.rx.is_closed() || self.ctx.close_before_settle())
            && let Some(t) = self.rx.poll_transmit()
        {
            progressed = true;
            self.ctl_tx
                .write_all(&t.frame)
                .await
                .map_err(|e| format!("{}: control stream: {e}", self.device))?;
        }
        Ok(progressed)
    }

    /// Acts on one receiver event; the code and message to close with once the session is over.
    async fn on_event(&mut self, ev: ReceiverEvent) -> Option<(ErrorCode, String)> {
        self.in_flight += usize::from(matches!(ev, ReceiverEvent::Commit { .. }));
        let announced = self.announced.as_ref();
        let charged = &mut self.charged;
        let (ctx, rx, done) = (&self.ctx, &mut self.rx, &self.done_tx);
        handle_event(ctx, &self.device, rx, ev, done, announced, charged).await
    }

    /// Ends the session: its commits settle, then the Error frame the receiver queued with
    /// its close goes out (the agent acts on its code), then the connection closes with the
    /// same code.
    async fn end(&mut self, (code, msg): (ErrorCode, String)) {
        settle(&self.device, &mut self.done_rx, self.in_flight).await;
        while let Some(t) = self.rx.poll_transmit() {
            if self.ctl_tx.write_all(&t.frame).await.is_err() {
                break;
            }
        }
        let _ = self.ctl_tx.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ctl_tx.stopped()).await;
        close_with(&self.ctx.hub.stats().connections, &self.conn, code, &msg);
        let stats = self.ctx.hub.stats();
        match code {
            ErrorCode::Revoked => ConnStats::bump(&stats.revocation.sessions_closed),
            ErrorCode::Superseded => ConnStats::bump(&stats.connections.superseded),
            ErrorCode::HelloTimeout => ConnStats::bump(&stats.connections.hello_timeouts),
            ErrorCode::IdleTimeout => ConnStats::bump(&stats.connections.idle_timeouts),
            _ => {}
        }
    }

    /// Waits for whatever comes first.
    async fn next_input(&mut self) -> Input {
        let now = self.ctx.now();
        let deadline = self
            .rx
            .poll_timeout()
            .map(|t| tokio::time::Instant::now() + t.saturating_since(now));
        let reading = self.may_take_stream();
        let awaiting_hello = self.announced.is_none();
        tokio::select! {
            // The control stream carries small frames (blocks come on their own streams); it
            // is read chunk by chunk from quinn's own buffers, so an idle one holds no buffer.
            read = self.ctl_rx.read_chunk(64 << 10, true) => Input::Control(read),
            uni = self.conn.accept_uni(), if reading => Input::DataStream(uni),
            data = next_data(&mut self.ahead) => Input::Data(data),
            Some(done) = self.done_rx.recv() => Input::Done(done),
            Ok(()) = self.tiered_rx.changed() => Input::Tiered,
            _ = self.ctx.revoke_rx.changed() => Input::RevocationsChanged,
            _ = self.slot.superseded.notified() => Input::Superseded,
            _ = tokio::time::sleep_until(self.hello_by), if awaiting_hello => Input::HelloTimeout,
            _ = sleep_until(deadline) => Input::Timer,
            reason = self.conn.closed() => Input::Closed(reason),
        }
    }

    /// Feeds one input to the receiver; an error ends the connection without an Error frame.
    fn on_input(&mut self, input: Input) -> Result<(), String> {
        let device = &self.device;
        match input {
            Input::Control(Ok(Some(chunk))) => self.on_control(&chunk.bytes),
            Input::Control(Ok(None)) => return Err(format!("{device}: control stream closed")),
            Input::Control(Err(e)) => return Err(format!("{device}: control stream: {e}")),
            Input::DataStream(s) => {
                let s = s.map_err(|e| format!("{device}: {e}"))?;
                self.take_stream(s);
            }
            Input::Data(data) => self.on_data(data),
            Input::Done(done) => self.on_done(done),
            Input::Tiered => push_tiered(&self.ctx, &self.device, &mut self.rx),
            Input::RevocationsChanged => self.check_revoked(),
            Input::Superseded => {
                let msg = "a newer connection of this device took its place";
                tracing::info!(%device, "superseded by a newer connection; closing");
                self.rx.close(self.ctx.now(), ErrorCode::Superseded, msg);
            }
            Input::HelloTimeout => {
                let msg = "no Hello within the Hello deadline";
                tracing::warn!(%device, "no Hello within ingest.hello_timeout; closing");
                self.rx.close(self.ctx.now(), ErrorCode::HelloTimeout, msg);
            }
            Input::Timer => self.rx.handle_timeout(self.ctx.now()),
            Input::Closed(reason) => return Err(format!("{device}: {reason}")),
        }
        Ok(())
    }

    /// Whether another data stream may be taken: fewer than [`DECODE_AHEAD`] being read, and
    /// fewer than `ingest.blocks_in_flight_max` being read or awaiting their commit.
    fn may_take_stream(&mut self) -> bool {
        let max = self.ctx.quotas.blocks_in_flight_max as usize;
        let in_flight = self.ahead.len() + self.in_flight;
        let limited = in_flight >= max;
        if limited && !self.limited {
            ConnStats::bump(&self.ctx.hub.stats().connections.blocks_in_flight_limited);
        }
        self.limited = limited;
        !limited && self.ahead.len() < DECODE_AHEAD
    }

    /// Starts reading a data stream on its own task, charging after the one before it.
    fn take_stream(&mut self, s: quinn::RecvStream) {
        let (next, this) = tokio::sync::oneshot::channel();
        let turn = Turn {
            prev: self.turn.replace(this),
            next,
        };
        let read = read_data(s, self.ctx.data.clone(), turn);
        self.ahead.push_back(tokio::spawn(read));
    }

    /// Feeds the complete frames of a control-stream chunk to the receiver.
    fn on_control(&mut self, chunk: &[u8]) {
        self.frames.push(chunk);
        loop {
            match self.frames.next_frame() {
                Ok(Some(f)) => {
                    if self.announced.is_none() {
                        let max = self.ctx.receiver_cfg.frame_bytes_max;
                        self.announced = Some(announced_last_seqs(&f, max));
                    }
                    self.rx.handle_frame(self.ctx.now(), &f)
                }
                Ok(None) => break,
                Err(e) => {
                    let msg = e.to_string();
                    self.rx
                        .close(self.ctx.now(), ErrorCode::FrameTooLarge, &msg);
                    break;
                }
            }
        }
    }

    /// Feeds a data stream's result to the receiver, in the order the streams were opened.
    fn on_data(&mut self, data: Data) {
        let now = self.ctx.now();
        match data {
            Data::Frame(bytes, charge) => {
                self.rx.handle_frame(now, &bytes);
                drop(charge);
            }
            Data::Decoded(stream, block, permit) => {
                self.charged = Some(Charged::new(&stream, &block.header, permit));
                self.rx.handle_decoded_block(now, stream, block);
            }
            Data::Stalled => {
                let msg = "a data stream made no progress within ingest.control_idle_timeout";
                self.rx.close(now, ErrorCode::IdleTimeout, msg)
            }
            Data::BadBlock(code, msg) => self.rx.close(now, code, &msg),
            Data::TooLarge => {
                let msg = "data stream exceeded the frame limit";
                self.rx.close(now, ErrorCode::FrameTooLarge, msg)
            }
        }
    }

    /// Tells the receiver how a commit ended.
    fn on_done(&mut self, done: Done) {
        self.in_flight -= 1;
        let now = self.ctx.now();
        match done {
            Done::Committed {
                stream,
                epoch,
                durable_seq,
            } => {
                let tiered = self.ctx.hub.tiered_seq(&self.device, &stream, epoch);
                self.rx.committed(now, &stream, epoch, durable_seq, tiered);
            }
            Done::Failed {
                stream,
                epoch,
                last_seq,
                error,
            } => {
                // A refused stream is refused alone: the session and its other streams carry
                // on (for an agent that understands it; an older one is closed as before).
                if refuses_stream(&error) {
                    let device = self.device.clone();
                    events::refuse(&self.ctx, &device, &mut self.rx, &stream, epoch, &error);
                }
                if !self.rx.commit_failed(now, &stream, epoch, last_seq) {
                    self.rx.close(now, error_code(&error), &error.to_string());
                }
            }
        }
    }

    /// Closes the session if the list now names its certificate, by device or by serial.
    fn check_revoked(&mut self) {
        if self
            .ctx
            .revoked(&self.device, &self.leaf, RefusedAt::LiveSession)
        {
            tracing::warn!(device = %self.device, "certificate revoked; disconnecting");
            self.rx
                .close(self.ctx.now(), ErrorCode::Revoked, "certificate revoked");
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Closes the QUIC connection with a protocol error code as its application code.
/// Closes a connection with `code`, counted in `tributary_hub_sessions_ended_total`: every
/// close with a code goes through here.
fn close_with(stats: &ConnStats, conn: &quinn::Connection, code: ErrorCode, msg: &str) {
    stats.ended(code);
    conn.close(
        quinn::VarInt::from_u32(u32::from(code.to_u16())),
        msg.as_bytes(),
    );
}

/// Ends a connection before its session starts: an error frame on the control stream (which
/// the agent's protocol machine reports with its code), then the connection close.
async fn refuse(
    stats: &ConnStats,
    conn: &quinn::Connection,
    ctl_tx: &mut quinn::SendStream,
    code: ErrorCode,
    msg: &str,
) {
    let frame = sync::protocol::error_frame(code, msg);
    let _ = ctl_tx.write_all(&frame).await;
    let _ = ctl_tx.finish();
    let _ = tokio::time::timeout(Duration::from_secs(2), ctl_tx.stopped()).await;
    close_with(stats, conn, code, msg);
}
