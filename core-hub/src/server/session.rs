//! One device connection: admission, then the loop around the protocol's `Receiver`.
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

use super::ConnCtx;
use super::admission::{admit_connection, peer_device};
use super::commit::{Done, error_code, push_tiered, settle};
use super::data::{DECODE_AHEAD, Data, next_data, read_data};
use super::events::{Announced, announced_last_seqs, handle_event};

/// Runs one connection from its handshake to its end.
pub(super) async fn connection(ctx: ConnCtx, incoming: quinn::Incoming) -> Result<(), String> {
    let conn = incoming.await.map_err(|e| format!("handshake: {e}"))?;
    let (device, leaf) = peer_device(&conn)?;
    let _charge = match admit_connection(&ctx).await {
        Ok(c) => c,
        Err(msg) => {
            tracing::warn!(%device, reason = %msg, "refusing a connection");
            close_with(&conn, ErrorCode::LimitExceeded, &msg);
            return Ok(());
        }
    };
    let (mut ctl_tx, ctl_rx) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("{device}: control stream: {e}"))?;
    if let Some((code, msg)) = gate(&ctx, &device, &leaf) {
        refuse(&conn, &mut ctl_tx, code, &msg).await;
        return Ok(());
    }
    tracing::info!(%device, remote = %conn.remote_address(), "device connected");
    let session = Session::new(ctx, conn, device, leaf, ctl_tx, ctl_rx);
    session.run().await
}

/// Why a device may not start a session now, checked once its control stream is open.
fn gate(ctx: &ConnCtx, device: &str, leaf: &CertificateDer<'_>) -> Option<(ErrorCode, String)> {
    // The list may have changed between the handshake's check and now.
    if ctx.revocations.current().is_cert_revoked(leaf) {
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
    /// The largest data stream read, in bytes.
    frame_max: usize,
    /// Tiering moves tiered_seq long after the last ack of new data; an idle agent hears of it
    /// only through this signal, so it can free what tier 2 now holds.
    tiered_rx: watch::Receiver<u64>,
    /// What each lane announced in the Hello (the first control frame): its last seq (Backlog
    /// frames carry no seqs, and completeness needs it to report how many records a device
    /// owes) and its backlog, recorded once the session is established.
    announced: Option<Announced>,
    /// Commits handed to the WAL whose outcome has not come back on `done_rx`.
    in_flight: usize,
}

impl Session {
    fn new(
        ctx: ConnCtx,
        conn: quinn::Connection,
        device: String,
        leaf: CertificateDer<'static>,
        ctl_tx: quinn::SendStream,
        ctl_rx: quinn::RecvStream,
    ) -> Session {
        let rx = Receiver::new(device.clone(), ctx.receiver_cfg.clone(), ctx.now());
        let frames = FrameBuffer::new(ctx.receiver_cfg.frame_bytes_max);
        let (done_tx, done_rx) = mpsc::unbounded_channel::<Done>();
        // The control stream carries small frames (blocks come on their own streams); it is
        // read chunk by chunk from quinn's own buffers, so an idle connection holds no buffer.
        let frame_max = ctx.receiver_cfg.frame_bytes_max as usize + 16;
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
            frame_max,
            tiered_rx,
            announced: None,
            in_flight: 0,
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
        handle_event(
            &self.ctx,
            &self.device,
            &mut self.rx,
            ev,
            &self.done_tx,
            announced,
        )
        .await
    }

    /// Ends the session: its commits settle, then the Error frame the receiver queued with
    /// its close goes out (the agent acts on its code: a refused stream is left out of the
    /// next session), then the connection closes with the same code.
    async fn end(&mut self, (code, msg): (ErrorCode, String)) {
        settle(&self.device, &mut self.done_rx, self.in_flight).await;
        while let Some(t) = self.rx.poll_transmit() {
            if self.ctl_tx.write_all(&t.frame).await.is_err() {
                break;
            }
        }
        let _ = self.ctl_tx.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.ctl_tx.stopped()).await;
        close_with(&self.conn, code, &msg);
        if code == ErrorCode::Revoked {
            let closed = &self.ctx.hub.stats().revocation.sessions_closed;
            closed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Waits for whatever comes first.
    async fn next_input(&mut self) -> Input {
        let now = self.ctx.now();
        let deadline = self
            .rx
            .poll_timeout()
            .map(|t| tokio::time::Instant::now() + t.saturating_since(now));
        let reading = self.ahead.len() < DECODE_AHEAD;
        tokio::select! {
            read = self.ctl_rx.read_chunk(64 << 10, true) => Input::Control(read),
            uni = self.conn.accept_uni(), if reading => Input::DataStream(uni),
            data = next_data(&mut self.ahead) => Input::Data(data),
            Some(done) = self.done_rx.recv() => Input::Done(done),
            Ok(()) = self.tiered_rx.changed() => Input::Tiered,
            _ = self.ctx.revoke_rx.changed() => Input::RevocationsChanged,
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
                let cfg = self.ctx.receiver_cfg.clone();
                let read = read_data(s, self.frame_max, cfg, self.ctx.hub.clone());
                self.ahead.push_back(tokio::spawn(read));
            }
            Input::Data(data) => self.on_data(data),
            Input::Done(done) => self.on_done(done),
            Input::Tiered => push_tiered(&self.ctx, &self.device, &mut self.rx),
            Input::RevocationsChanged => self.check_revoked(),
            Input::Timer => self.rx.handle_timeout(self.ctx.now()),
            Input::Closed(reason) => return Err(format!("{device}: {reason}")),
        }
        Ok(())
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
            Data::Frame(bytes) => self.rx.handle_frame(now, &bytes),
            Data::Decoded(stream, block, slot) => {
                self.rx.handle_decoded_block(now, stream, block);
                drop(slot);
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
            Done::Failed(e) => self.rx.close(now, error_code(&e), &e.to_string()),
        }
    }

    /// Closes the session if the list now names its certificate, by device or by serial.
    fn check_revoked(&mut self) {
        if self.ctx.revoked(&self.device, &self.leaf) {
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
fn close_with(conn: &quinn::Connection, code: ErrorCode, msg: &str) {
    conn.close(
        quinn::VarInt::from_u32(u32::from(code.to_u16())),
        msg.as_bytes(),
    );
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
    close_with(conn, code, msg);
}
