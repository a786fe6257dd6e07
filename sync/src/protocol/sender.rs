//! The edge side of the replication protocol: a sans-IO state machine per connection.
//!
//! The sender announces the edge's lanes (one per `(stream, epoch)` it holds) in its Hello,
//! learns the hub's marks from the Welcome, and then streams fsynced blocks and gap markers
//! from right after each mark. It pulls blocks from the driver's log
//! ([`SenderEvent::WantBlocks`] answered by [`Sender::supply_blocks`]) and also takes freshly
//! sealed blocks directly ([`Sender::offer_block`]) when they are next in line, so the live
//! path does not re-read the disk. Everything in flight is bounded by a window (bytes and
//! items); higher-priority streams go first, but a lane never overtakes an older epoch of the
//! same stream, and seq order within a lane is always kept.
//!
//! Nothing here needs to survive a disconnect: a new sender built from the edge's log resumes
//! from the hub's marks, and everything unacknowledged is sent again. The hub makes resends
//! idempotent.

use super::frame::{
    Backlog, BacklogEntry, ErrorCode, ErrorFrame, Frame, GapMarker, GapReason, Hello, LaneAnnounce,
    LaneWelcome, Welcome,
};
use super::{CloseReason, Instant, Liveness, Timeouts, Transmit, TransmitKind, frame};
use crate::block::{self, BlockError};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use thiserror::Error;

mod refusal;

/// Limits and timers of a sender.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    pub version_min: u16,
    pub version_max: u16,
    pub frame_bytes_max: u32,
    /// Own cap on unacknowledged block bytes; the effective window is the smaller of this
    /// and the hub's.
    pub window_bytes_max: u64,
    /// Own cap on unacknowledged blocks and gap markers.
    pub window_items_max: u64,
    /// Block bytes queued per lane ahead of the window (read from the log, not yet sent).
    pub queue_bytes_max: u64,
    /// How often a Backlog frame is sent while connected.
    pub backlog_interval: Duration,
    pub timeouts: Timeouts,
    /// [`frame::capability`] bits announced in the Hello (all this build knows by default).
    pub capabilities: u64,
}

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig {
            version_min: frame::PROTOCOL_VERSION,
            version_max: frame::PROTOCOL_VERSION,
            frame_bytes_max: frame::FRAME_BYTES_MAX_DEFAULT,
            window_bytes_max: 32 << 20,
            window_items_max: 4096,
            queue_bytes_max: 8 << 20,
            backlog_interval: Duration::from_secs(10),
            timeouts: Timeouts::default(),
            capabilities: frame::capability::ALL,
        }
    }
}

/// Records the edge must move out of a lane into the new epoch: everything at or above
/// `from_seq` in `(stream, epoch)`, in order, before any newer data of that stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rekey {
    pub stream: String,
    pub epoch: u64,
    pub from_seq: u64,
}

/// What the sender asks of, or reports to, the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderEvent {
    /// The hub accepted the Hello.
    Established { version: u16, epoch_max: u64 },
    /// Read sealed, fsynced blocks of the lane with `last_seq > after_seq`, in order, about
    /// `bytes_max` of them (at least one), and pass them to [`Sender::supply_blocks`]; an
    /// empty answer means "none right now".
    WantBlocks {
        stream: String,
        epoch: u64,
        after_seq: u64,
        bytes_max: u64,
    },
    /// The hub's marks advanced. Persist them: retention keys on `tiered_seq`.
    Acked {
        stream: String,
        epoch: u64,
        durable_seq: u64,
        tiered_seq: u64,
    },
    /// The hub is ahead of this edge's history (restored or cloned data directory). Mint an
    /// epoch `>= epoch_min`, move the `rekey` records into it first, then write new data to it,
    /// and call [`Sender::epoch_minted`]. Seqs of the old epochs are never reused.
    MintEpoch { epoch_min: u64, rekey: Vec<Rekey> },
    /// The hub refused `stream` for now (`code`: `UNAUTHORIZED_STREAM`, `QUOTA_EXCEEDED`);
    /// its records stay in the log and the sender offers it again after `retry_after`, on this
    /// session. Show it; nothing to persist.
    StreamRefused {
        stream: String,
        epoch: u64,
        code: ErrorCode,
        retry_after: Duration,
        message: String,
    },
    /// A refused stream's retry time came: it is being offered again.
    StreamRetrying { stream: String },
    /// The session is over; flush pending transmits, close, reconnect with backoff.
    Closed(CloseReason),
}

/// Why a block or gap handed to the sender was refused. These are driver bugs or a corrupt
/// local log, never peer input.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum OfferError {
    #[error("block header is invalid: {0}")]
    BadBlock(#[from] BlockError),
    #[error("block of epoch {got} supplied for lane epoch {want}")]
    WrongEpoch { want: u64, got: u64 },
    #[error("no lane {stream}/{epoch} in this session")]
    UnknownLane { stream: String, epoch: u64 },
    #[error("invalid stream name {0:?}")]
    InvalidStream(String),
    #[error("gap marker {first_seq}..={last_seq} is empty or starts at 0")]
    BadGap { first_seq: u64, last_seq: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    AwaitWelcome,
    Established,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Created before the Welcome; the hub's marks are not known yet.
    Pending,
    /// Streaming from the hub's mark.
    Normal,
    /// The hub is ahead: send blocks up to `limit` only for comparison, until the Verdict.
    Behind { limit: u64, verdict: Option<u64> },
}

/// An encoded Block or Gap frame waiting for the window.
#[derive(Debug)]
struct Out {
    last_seq: u64,
    bytes: u64,
    frame: Vec<u8>,
    kind: TransmitKind,
}

#[derive(Debug)]
struct Lane {
    stream: String,
    epoch: u64,
    held_last: u64,
    /// `last_seq` as announced in the Hello: the hub judges "behind" against this.
    announced_last: u64,
    gaps: Vec<GapMarker>,
    /// The edge's figures for what it held beyond `backlog_base` up to `backlog_top` when it
    /// last reported them; see [`Lane::current_backlog`].
    backlog: Backlog,
    backlog_base: u64,
    backlog_top: u64,
    mode: Mode,
    /// The hub's durable and tiered marks as last heard.
    hub_mark: u64,
    hub_tiered: u64,
    /// Next seq to queue.
    cursor: u64,
    queue: VecDeque<Out>,
    queue_bytes: u64,
    /// Sent, not yet acknowledged: (last_seq, bytes).
    /// Sent, not yet acknowledged: (last_seq, bytes, counted in the window).
    inflight: VecDeque<(u64, u64, bool)>,
    want_outstanding: bool,
    /// `held_last` when the log last answered "nothing": no new want until it grows.
    exhausted_at: Option<u64>,
    durable: u64,
    tiered: u64,
    /// Where the Welcome said to resume.
    resume_from: u64,
    /// An Ack for this lane arrived in this session (the hub's junction check is done).
    acked_in_session: bool,
    /// The hub refused the stream: nothing is queued or sent until then.
    refused_until: Option<Instant>,
}

impl Lane {
    fn new(stream: String, epoch: u64, first: u64, last: u64, mode: Mode) -> Self {
        Lane {
            stream,
            epoch,
            held_last: last,
            announced_last: 0,
            gaps: Vec::new(),
            backlog: Backlog::default(),
            backlog_base: 0,
            backlog_top: 0,
            mode,
            hub_mark: 0,
            hub_tiered: 0,
            cursor: first.max(1),
            queue: VecDeque::new(),
            queue_bytes: 0,
            inflight: VecDeque::new(),
            want_outstanding: false,
            exhausted_at: None,
            durable: 0,
            tiered: 0,
            resume_from: first.max(1),
            acked_in_session: false,
            refused_until: None,
        }
    }

    /// The backlog as of now. The edge reports figures for seqs `backlog_base+1..=backlog_top`
    /// (unacknowledged when it measured them); as the hub's mark moves through that range the
    /// figures shrink in proportion, and once the mark reaches `backlog_top` nothing of that
    /// backlog is owed any more. This keeps the periodic Backlog frame true while connected
    /// even when the edge does not call [`Sender::update_backlog`] again (the oldest unsent
    /// event time stays as reported until then: conservative for completeness).
    fn current_backlog(&self) -> Backlog {
        let b = self.backlog;
        if b == Backlog::default() {
            return b;
        }
        if self.hub_mark >= self.backlog_top {
            return Backlog::default();
        }
        if self.hub_mark <= self.backlog_base || self.backlog_top <= self.backlog_base {
            return b;
        }
        let span = u128::from(self.backlog_top - self.backlog_base);
        let left = u128::from(self.backlog_top - self.hub_mark);
        let scale = |v: u64| u64::try_from((u128::from(v) * left).div_ceil(span)).unwrap_or(v);
        Backlog {
            blocks: scale(b.blocks),
            bytes: scale(b.bytes),
            oldest_unsent_ts: b.oldest_unsent_ts,
        }
    }

    /// The last seq this lane will send in this session.
    fn limit(&self) -> u64 {
        match self.mode {
            Mode::Behind {
                limit,
                verdict: None,
            } => limit,
            Mode::Behind {
                verdict: Some(_), ..
            }
            | Mode::Pending => 0,
            Mode::Normal => self.held_last,
        }
    }

    /// Blocks at or below the hub's mark in a normal lane are only the hub's junction check:
    /// the hub holds nothing for them and acknowledges them only once the check is done, so
    /// they must not take window space the rest of the check needs.
    fn counts_in_window(&self, last_seq: u64) -> bool {
        !(self.mode == Mode::Normal && last_seq <= self.hub_mark)
    }

    /// Seqs at or below this are not reported as lost: the hub holds them. In a lane the hub
    /// is ahead of, the edge's own losses are reported too, so the hub can skip them when
    /// comparing.
    fn floor(&self) -> u64 {
        match self.mode {
            Mode::Behind { verdict: None, .. } => 0,
            _ => self.hub_mark,
        }
    }

    /// True when nothing of this lane can block a later epoch of the same stream.
    fn settled(&self, current_epoch: u64) -> bool {
        match self.mode {
            Mode::Behind { .. } => true,
            Mode::Pending => false,
            Mode::Normal => {
                let no_more =
                    self.cursor > self.held_last || self.exhausted_at == Some(self.held_last);
                self.epoch != current_epoch
                    && no_more
                    && !self.want_outstanding
                    && self.queue.is_empty()
                    && self.inflight.is_empty()
            }
        }
    }

    fn push_out(&mut self, first: u64, last: u64, bytes: u64, frame: Frame) {
        let kind = if first <= self.hub_mark {
            TransmitKind::Control
        } else {
            TransmitKind::Data
        };
        self.queue_bytes += bytes;
        self.queue.push_back(Out {
            last_seq: last,
            bytes,
            frame: frame.encode(),
            kind,
        });
        self.cursor = last + 1;
    }

    fn push_gap(&mut self, g: GapMarker) {
        let frame = Frame::Gap {
            stream: self.stream.clone(),
            epoch: self.epoch,
            gap: g,
        };
        self.push_out(g.first_seq, g.last_seq, 0, frame);
    }

    /// Queues gap frames for `from..=to`, a range the log has no blocks for: explicit markers
    /// where the edge recorded them, `Missing` elsewhere. Seqs the hub holds are skipped.
    fn fill_hole(&mut self, from: u64, to: u64) {
        if from <= self.floor() {
            // Below the hub's mark the hub holds the data: say only that the edge does not,
            // so that the hub stops waiting for the block ending at its mark.
            let last_seq = to.min(self.floor());
            let count = last_seq - from + 1;
            self.push_gap(GapMarker {
                first_seq: from,
                last_seq,
                reason: GapReason::Missing,
                count,
            });
        }
        let mut at = from.max(self.floor() + 1);
        while at <= to {
            let covering = self
                .gaps
                .iter()
                .find(|g| g.first_seq <= at && at <= g.last_seq)
                .copied();
            let g = match covering {
                Some(g) => {
                    let clipped = g.clip_from(at).expect("marker covers at");
                    let last_seq = clipped.last_seq.min(to);
                    GapMarker {
                        last_seq,
                        count: clipped.count.min(last_seq - at + 1),
                        ..clipped
                    }
                }
                None => {
                    let next = self
                        .gaps
                        .iter()
                        .map(|g| g.first_seq)
                        .filter(|&f| f > at)
                        .min();
                    let last_seq = next.map_or(to, |n| (n - 1).min(to));
                    let count = last_seq - at + 1;
                    GapMarker {
                        first_seq: at,
                        last_seq,
                        reason: GapReason::Missing,
                        count,
                    }
                }
            };
            self.push_gap(g);
            at = g.last_seq + 1;
        }
        self.cursor = self.cursor.max(to + 1);
    }

    /// Queues the markers that cover the cursor, so that a lost range is reported even when
    /// no block follows it yet.
    fn queue_covering_gaps(&mut self) {
        loop {
            let at = self.cursor;
            if at > self.limit() {
                return;
            }
            let Some(g) = self
                .gaps
                .iter()
                .find(|g| g.first_seq <= at && at <= g.last_seq)
                .copied()
            else {
                return;
            };
            // Below the hub's mark this only tells the hub that the edge does not hold the
            // seqs (so it stops waiting for the block ending at its mark); above, it is loss.
            let last_seq = if at <= self.floor() {
                g.last_seq.min(self.floor())
            } else {
                g.last_seq.min(self.limit())
            };
            let count = g.count.min(last_seq - at + 1);
            self.push_gap(GapMarker {
                first_seq: at,
                last_seq,
                count,
                ..g
            });
        }
    }
}

/// The edge side of one connection.
#[derive(Debug)]
pub struct Sender {
    config: SenderConfig,
    phase: Phase,
    version: u16,
    current_epoch: u64,
    epoch_max: u64,
    now: Instant,
    live: Liveness,
    lanes: Vec<Lane>,
    index: HashMap<(String, u64), usize>,
    priorities: HashMap<String, u8>,
    window_bytes: u64,
    window_items: u64,
    inflight_bytes: u64,
    inflight_items: u64,
    control: VecDeque<Transmit>,
    events: VecDeque<SenderEvent>,
    next_backlog: Option<Instant>,
    mint_emitted: bool,
    /// Round-robin start among lanes of equal priority.
    rr: usize,
    /// Streams the hub refused, until when (lanes opened meanwhile start refused).
    refused: HashMap<String, Instant>,
}

impl Sender {
    /// A sender for a new connection. `lanes` lists every `(stream, epoch)` the edge holds,
    /// each stream's lanes oldest epoch first, with the backlog and gap markers of each.
    /// Queues the Hello.
    pub fn new(
        config: SenderConfig,
        current_epoch: u64,
        lanes: Vec<LaneAnnounce>,
        now: Instant,
    ) -> Result<Self, OfferError> {
        let live = Liveness::new(config.timeouts, now);
        let mut s = Sender {
            window_bytes: config.window_bytes_max,
            window_items: config.window_items_max,
            config,
            phase: Phase::AwaitWelcome,
            version: 0,
            current_epoch,
            epoch_max: 0,
            now,
            live,
            lanes: Vec::new(),
            index: HashMap::new(),
            priorities: HashMap::new(),
            inflight_bytes: 0,
            inflight_items: 0,
            control: VecDeque::new(),
            events: VecDeque::new(),
            next_backlog: None,
            mint_emitted: false,
            rr: 0,
            refused: HashMap::new(),
        };
        for a in &lanes {
            if !frame::valid_stream_name(&a.stream) {
                return Err(OfferError::InvalidStream(a.stream.clone()));
            }
            let i = s.add_lane(
                a.stream.clone(),
                a.epoch,
                a.first_seq,
                a.last_seq,
                Mode::Pending,
            );
            let lane = &mut s.lanes[i];
            lane.gaps = a.gaps.clone();
            lane.gaps.sort_by_key(|g| g.first_seq);
            lane.backlog = a.backlog;
            lane.backlog_base = a.acked_seq;
            lane.backlog_top = a.last_seq;
            lane.durable = a.acked_seq;
            lane.announced_last = a.last_seq;
        }
        let hello = Hello {
            version_min: s.config.version_min,
            version_max: s.config.version_max,
            current_epoch,
            lanes,
            capabilities: s.config.capabilities,
        };
        s.push_control(Frame::Hello(hello));
        Ok(s)
    }

    fn add_lane(&mut self, stream: String, epoch: u64, first: u64, last: u64, mode: Mode) -> usize {
        let i = self.lanes.len();
        self.index.insert((stream.clone(), epoch), i);
        self.lanes.push(Lane::new(stream, epoch, first, last, mode));
        i
    }

    pub fn is_established(&self) -> bool {
        self.phase == Phase::Established
    }

    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    /// The epoch new data goes to.
    pub fn current_epoch(&self) -> u64 {
        self.current_epoch
    }

    /// Sets a stream's priority (default 0). Higher drains first; seq order within a stream
    /// and epoch order within a stream are never traded for priority.
    pub fn set_priority(&mut self, stream: &str, priority: u8) {
        self.priorities.insert(stream.to_owned(), priority);
    }

    /// Block bytes sent and not yet acknowledged.
    pub fn inflight_bytes(&self) -> u64 {
        self.inflight_bytes
    }

    /// Feeds one complete frame (length prefix included).
    pub fn handle_frame(&mut self, now: Instant, bytes: &[u8]) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        self.live.last_rx = now;
        match Frame::decode(bytes, self.config.frame_bytes_max) {
            Ok(f) => self.on_frame(f),
            Err(e) => {
                let code = match e {
                    frame::FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
                    _ => ErrorCode::ProtocolViolation,
                };
                self.close(now, code, &e.to_string());
            }
        }
        self.pump();
    }

    fn on_frame(&mut self, f: Frame) {
        match (self.phase, f) {
            (_, Frame::Error(e)) => self.closed_by_peer(e),
            (_, Frame::Ping) => {}
            (Phase::AwaitWelcome, Frame::Welcome(w)) => self.on_welcome(w),
            (
                Phase::Established,
                Frame::Ack {
                    stream,
                    epoch,
                    durable_seq,
                    tiered_seq,
                },
            ) => self.on_ack(&stream, epoch, durable_seq, tiered_seq),
            (
                Phase::Established,
                Frame::Verdict {
                    stream,
                    epoch,
                    matched_through,
                },
            ) => self.on_verdict(&stream, epoch, matched_through),
            (Phase::Established, Frame::StreamRefused(r))
                if self.config.capabilities & frame::capability::STREAM_REFUSED != 0 =>
            {
                self.on_refused(r)
            }
            (phase, f) => {
                let msg = format!("unexpected {} frame in state {phase:?}", f.name());
                self.close(self.now, ErrorCode::ProtocolViolation, &msg);
            }
        }
    }

    fn on_welcome(&mut self, w: Welcome) {
        if w.version < self.config.version_min || w.version > self.config.version_max {
            let msg = format!(
                "hub chose version {}, edge speaks {}..={}",
                w.version, self.config.version_min, self.config.version_max
            );
            return self.close(self.now, ErrorCode::UnsupportedVersion, &msg);
        }
        self.version = w.version;
        self.epoch_max = w.epoch_max;
        self.window_bytes = self.config.window_bytes_max.min(w.window_bytes);
        self.window_items = self.config.window_items_max.min(w.window_items).max(1);
        let mut welcomed: HashMap<(String, u64), LaneWelcome> = HashMap::new();
        for (stream, epoch, lw) in w.lanes {
            if !self.index.contains_key(&(stream.clone(), epoch)) {
                // The hub holds a lane this edge has nothing of.
                self.add_lane(stream.clone(), epoch, 0, 0, Mode::Pending);
            }
            welcomed.insert((stream, epoch), lw);
        }
        for i in 0..self.lanes.len() {
            let key = (self.lanes[i].stream.clone(), self.lanes[i].epoch);
            let lw = welcomed.get(&key).copied();
            self.start_lane(i, lw);
        }
        self.phase = Phase::Established;
        // The first report goes out at once: the Hello's figures are for the handshake, and
        // the hub records backlog only from Backlog frames.
        self.next_backlog = Some(self.now);
        self.events.push_back(SenderEvent::Established {
            version: self.version,
            epoch_max: self.epoch_max,
        });
        self.check_mint();
    }

    fn start_lane(&mut self, i: usize, lw: Option<LaneWelcome>) {
        let lane = &mut self.lanes[i];
        let Some(lw) = lw else {
            // Not in the Welcome: a lane the hub has never seen.
            lane.mode = Mode::Normal;
            return;
        };
        lane.hub_mark = lw.durable_seq;
        lane.hub_tiered = lw.tiered_seq;
        lane.cursor = lw.resume_from.clamp(1, lw.durable_seq.saturating_add(1));
        lane.resume_from = lane.cursor;
        if lw.durable_seq > lane.announced_last {
            lane.mode = Mode::Behind {
                limit: lane.announced_last,
                verdict: None,
            };
            return;
        }
        // The Welcome's marks are not reported as acknowledged: only an Ack, which the hub
        // sends once it has compared the block ending at its mark, vouches for this edge's copy.
        lane.mode = Mode::Normal;
    }

    fn on_ack(&mut self, stream: &str, epoch: u64, durable_seq: u64, tiered_seq: u64) {
        let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) else {
            return;
        };
        let lane = &mut self.lanes[i];
        lane.acked_in_session = true;
        while let Some(&(last, bytes, counted)) = lane.inflight.front() {
            if last > durable_seq {
                break;
            }
            lane.inflight.pop_front();
            if counted {
                self.inflight_bytes -= bytes;
                self.inflight_items -= 1;
            }
        }
        let owed_before = lane.current_backlog() != Backlog::default();
        lane.hub_mark = lane.hub_mark.max(durable_seq);
        lane.hub_tiered = lane.hub_tiered.max(tiered_seq);
        if owed_before && lane.current_backlog() == Backlog::default() {
            // Caught up: tell the hub now rather than at the next interval, so completeness
            // answers flip to `complete` promptly.
            lane.backlog = Backlog::default();
            self.push_control(Frame::Backlog(self.backlog_entries()));
        }
        let lane = &mut self.lanes[i];
        // In a lane the hub is ahead of, only what the Verdict confirmed is ours.
        let cap = match lane.mode {
            Mode::Behind { verdict: None, .. } | Mode::Pending => return,
            Mode::Behind {
                verdict: Some(m), ..
            } => m,
            Mode::Normal => u64::MAX,
        };
        let (durable_seq, tiered_seq) = (durable_seq.min(cap), tiered_seq.min(cap));
        if durable_seq > lane.durable || tiered_seq > lane.tiered {
            lane.durable = lane.durable.max(durable_seq);
            lane.tiered = lane.tiered.max(tiered_seq);
            self.events.push_back(SenderEvent::Acked {
                stream: lane.stream.clone(),
                epoch,
                durable_seq: lane.durable,
                tiered_seq: lane.tiered,
            });
        }
    }

    fn on_verdict(&mut self, stream: &str, epoch: u64, matched_through: u64) {
        let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) else {
            return;
        };
        let lane = &mut self.lanes[i];
        let Mode::Behind {
            limit,
            verdict: None,
        } = lane.mode
        else {
            let msg = format!("Verdict for lane {stream}/{epoch}, which is not behind the hub");
            return self.close(self.now, ErrorCode::ProtocolViolation, &msg);
        };
        let matched = matched_through.min(limit);
        lane.mode = Mode::Behind {
            limit,
            verdict: Some(matched),
        };
        // Queued comparison blocks are moot now.
        lane.queue.clear();
        lane.queue_bytes = 0;
        if matched > lane.durable {
            lane.durable = matched;
            lane.tiered = lane.tiered.max(matched.min(lane.hub_tiered));
            self.events.push_back(SenderEvent::Acked {
                stream: stream.to_owned(),
                epoch,
                durable_seq: lane.durable,
                tiered_seq: lane.tiered,
            });
        }
        self.check_mint();
    }

    /// Emits MintEpoch once every lane the hub is ahead of has its Verdict, if the current
    /// epoch is among them or records need moving.
    fn check_mint(&mut self) {
        if self.mint_emitted {
            return;
        }
        let mut rekey = Vec::new();
        let mut mint = false;
        for lane in &self.lanes {
            match lane.mode {
                Mode::Behind { verdict: None, .. } => return,
                Mode::Behind {
                    verdict: Some(m), ..
                } => {
                    mint |= lane.epoch == self.current_epoch;
                    if m < lane.held_last {
                        rekey.push(Rekey {
                            stream: lane.stream.clone(),
                            epoch: lane.epoch,
                            from_seq: m + 1,
                        });
                    }
                }
                _ => {}
            }
        }
        if mint || !rekey.is_empty() {
            self.mint_emitted = true;
            let top = self.lanes.iter().map(|l| l.epoch).max().unwrap_or(0);
            let Some(epoch_min) = self
                .epoch_max
                .max(self.current_epoch)
                .max(top)
                .checked_add(1)
            else {
                // No epoch above the last one exists: minting would reuse one, so refuse.
                let msg = "the hub reports the highest possible epoch; no new epoch can be minted";
                return self.close(self.now, ErrorCode::ProtocolViolation, msg);
            };
            self.events
                .push_back(SenderEvent::MintEpoch { epoch_min, rekey });
        }
    }

    /// The driver minted `epoch` after [`SenderEvent::MintEpoch`]; new data goes there.
    pub fn epoch_minted(&mut self, now: Instant, epoch: u64) {
        self.now = now;
        self.current_epoch = epoch;
        self.pump();
    }

    /// Offers a block the moment it is sealed and fsynced. The sender queues it if it is next
    /// in line and there is room; otherwise it only notes that the log grew and reads the
    /// block back later through [`SenderEvent::WantBlocks`]. A block of an epoch with no lane
    /// yet opens one (a newly minted epoch).
    pub fn offer_block(
        &mut self,
        now: Instant,
        stream: &str,
        block: Vec<u8>,
    ) -> Result<(), OfferError> {
        self.now = now;
        if !frame::valid_stream_name(stream) {
            return Err(OfferError::InvalidStream(stream.to_owned()));
        }
        let h = block::decode_header(&block)?;
        let i = self.lane_for(stream, h.epoch, h.first_seq);
        let lane = &mut self.lanes[i];
        if h.last_seq() > lane.held_last {
            lane.held_last = h.last_seq();
            lane.exhausted_at = None;
        }
        let in_line = h.first_seq <= lane.cursor && lane.cursor <= h.last_seq();
        let room = lane.queue_bytes + block.len() as u64 <= self.config.queue_bytes_max;
        let open = lane.refused_until.is_none();
        if lane.mode == Mode::Normal && !lane.want_outstanding && in_line && room && open {
            self.enqueue_block(i, block)?;
        }
        self.pump();
        Ok(())
    }

    fn lane_for(&mut self, stream: &str, epoch: u64, first_seq: u64) -> usize {
        if let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) {
            return i;
        }
        let mode = if self.phase == Phase::Established {
            Mode::Normal
        } else {
            Mode::Pending
        };
        let i = self.add_lane(
            stream.to_owned(),
            epoch,
            first_seq,
            first_seq.saturating_sub(1),
            mode,
        );
        self.lanes[i].refused_until = self.refused.get(stream).copied();
        i
    }

    /// Records a gap marker written while connected (for example a disk-budget drop).
    pub fn offer_gap(
        &mut self,
        now: Instant,
        stream: &str,
        epoch: u64,
        gap: GapMarker,
    ) -> Result<(), OfferError> {
        self.now = now;
        if !frame::valid_stream_name(stream) {
            return Err(OfferError::InvalidStream(stream.to_owned()));
        }
        if gap.first_seq == 0 || gap.first_seq > gap.last_seq {
            return Err(OfferError::BadGap {
                first_seq: gap.first_seq,
                last_seq: gap.last_seq,
            });
        }
        let i = self.lane_for(stream, epoch, gap.first_seq);
        let lane = &mut self.lanes[i];
        let at = lane.gaps.partition_point(|g| g.first_seq < gap.first_seq);
        lane.gaps.insert(at, gap);
        if gap.last_seq > lane.held_last {
            lane.held_last = gap.last_seq;
            lane.exhausted_at = None;
        }
        self.pump();
        Ok(())
    }

    /// The driver's answer to [`SenderEvent::WantBlocks`]: blocks in seq order (an empty
    /// list means the log holds nothing more right now).
    pub fn supply_blocks(
        &mut self,
        now: Instant,
        stream: &str,
        epoch: u64,
        blocks: Vec<Vec<u8>>,
    ) -> Result<(), OfferError> {
        self.now = now;
        let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) else {
            return Err(OfferError::UnknownLane {
                stream: stream.to_owned(),
                epoch,
            });
        };
        let lane = &mut self.lanes[i];
        lane.want_outstanding = false;
        if lane.refused_until.is_some() {
            // Read before the refusal: what the log answered is dropped, and read again
            // from the mark once the refusal lapses.
            self.lift_refusals();
            self.pump();
            return Ok(());
        }
        if blocks.is_empty() {
            lane.exhausted_at = Some(lane.held_last);
            // Comparing a lane the hub is ahead of must finish: what the log cannot supply,
            // the edge does not hold.
            if let Mode::Behind {
                limit,
                verdict: None,
            } = lane.mode
                && lane.cursor <= limit
            {
                lane.fill_hole(lane.cursor, limit);
            }
        }
        let mut result = Ok(());
        for b in blocks {
            if let Err(e) = self.enqueue_block(i, b) {
                result = Err(e);
                break;
            }
        }
        self.pump();
        result
    }

    fn enqueue_block(&mut self, i: usize, block: Vec<u8>) -> Result<(), OfferError> {
        let h = block::decode_header(&block)?;
        let lane = &mut self.lanes[i];
        if h.epoch != lane.epoch {
            return Err(OfferError::WrongEpoch {
                want: lane.epoch,
                got: h.epoch,
            });
        }
        if h.last_seq() > lane.held_last {
            lane.held_last = h.last_seq();
        }
        if h.last_seq() < lane.cursor || h.first_seq > lane.limit() {
            return Ok(());
        }
        if h.first_seq > lane.cursor {
            lane.fill_hole(lane.cursor, h.first_seq - 1);
        }
        let bytes = block.len() as u64;
        let frame = Frame::Block {
            stream: lane.stream.clone(),
            block,
        };
        lane.push_out(h.first_seq, h.last_seq(), bytes, frame);
        Ok(())
    }

    /// Queues gap markers and asks the log for more blocks wherever there is room.
    fn pump(&mut self) {
        if self.phase != Phase::Established {
            return;
        }
        for i in 0..self.lanes.len() {
            let lane = &mut self.lanes[i];
            if lane.refused_until.is_some() {
                continue;
            }
            if matches!(lane.mode, Mode::Normal | Mode::Behind { verdict: None, .. }) {
                lane.queue_covering_gaps();
            }
            let room = self.config.queue_bytes_max.saturating_sub(lane.queue_bytes);
            let more = lane.cursor <= lane.limit() && lane.exhausted_at != Some(lane.held_last);
            if lane.want_outstanding || room == 0 || !more {
                continue;
            }
            lane.want_outstanding = true;
            self.events.push_back(SenderEvent::WantBlocks {
                stream: lane.stream.clone(),
                epoch: lane.epoch,
                after_seq: lane.cursor - 1,
                bytes_max: room,
            });
        }
    }

    /// Updates the backlog figures reported in the next Backlog frame.
    pub fn update_backlog(&mut self, stream: &str, epoch: u64, backlog: Backlog) {
        if let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) {
            let lane = &mut self.lanes[i];
            lane.backlog = backlog;
            lane.backlog_base = lane.hub_mark.max(lane.durable);
            lane.backlog_top = lane.held_last;
        }
    }

    /// The next frame to write. Drain this and [`Sender::poll_event`] until both are empty.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        if let Some(t) = self.control.pop_front() {
            return Some(t);
        }
        if self.phase != Phase::Established {
            return None;
        }
        let i = self.pick_lane()?;
        let lane = &mut self.lanes[i];
        let out = lane
            .queue
            .pop_front()
            .expect("picked lane has queued frames");
        lane.queue_bytes -= out.bytes;
        let counted = lane.counts_in_window(out.last_seq);
        lane.inflight.push_back((out.last_seq, out.bytes, counted));
        if counted {
            self.inflight_bytes += out.bytes;
            self.inflight_items += 1;
        }
        self.live.last_tx = self.now;
        self.rr = i + 1;
        self.pump();
        Some(Transmit {
            frame: out.frame,
            kind: out.kind,
        })
    }

    /// The lane whose next frame goes out: window permitting, the highest priority, never
    /// ahead of an unsettled older epoch of the same stream; round-robin among equals.
    fn pick_lane(&self) -> Option<usize> {
        let n = self.lanes.len();
        let mut best: Option<(u8, usize)> = None;
        for k in 0..n {
            let i = (self.rr + k) % n;
            let lane = &self.lanes[i];
            let Some(head) = lane.queue.front() else {
                continue;
            };
            let fits = !lane.counts_in_window(head.last_seq) || self.window_allows(head.bytes);
            if !fits || !self.epoch_order_allows(i) {
                continue;
            }
            let prio = self.priorities.get(&lane.stream).copied().unwrap_or(0);
            if best.is_none_or(|(p, _)| prio > p) {
                best = Some((prio, i));
            }
        }
        best.map(|(_, i)| i)
    }

    fn window_allows(&self, bytes: u64) -> bool {
        self.inflight_items == 0
            || (self.inflight_bytes + bytes <= self.window_bytes
                && self.inflight_items < self.window_items)
    }

    fn epoch_order_allows(&self, i: usize) -> bool {
        let lane = &self.lanes[i];
        if matches!(lane.mode, Mode::Behind { .. }) {
            return true;
        }
        self.lanes[..i]
            .iter()
            .filter(|l| l.stream == lane.stream)
            .all(|l| l.settled(self.current_epoch))
    }

    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    /// Fires the idle timeout, keepalive and backlog report.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        if now >= self.live.idle_deadline() {
            let msg = format!("nothing received for {:?}", self.config.timeouts.idle);
            return self.close(now, ErrorCode::IdleTimeout, &msg);
        }
        if self.lift_refusals() {
            self.pump();
        }
        if self.next_backlog.is_some_and(|t| now >= t) {
            self.next_backlog = Some(now + self.config.backlog_interval);
            self.push_control(Frame::Backlog(self.backlog_entries()));
        }
        if now >= self.live.keepalive_deadline() {
            self.push_control(Frame::Ping);
        }
    }

    fn backlog_entries(&self) -> Vec<BacklogEntry> {
        self.lanes
            .iter()
            .take(frame::LANES_MAX)
            .map(|l| BacklogEntry {
                stream: l.stream.clone(),
                epoch: l.epoch,
                backlog: l.current_backlog(),
            })
            .collect()
    }

    /// When to call [`Sender::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase == Phase::Closed {
            return None;
        }
        let t = self
            .live
            .idle_deadline()
            .min(self.live.keepalive_deadline());
        let t = self.next_refusal_lapse().map_or(t, |r| r.min(t));
        Some(self.next_backlog.map_or(t, |b| b.min(t)))
    }

    /// Ends the session from the edge's side (shutdown, certificate change).
    pub fn close(&mut self, now: Instant, code: ErrorCode, message: &str) {
        if self.phase == Phase::Closed {
            return;
        }
        self.now = now;
        self.push_control(Frame::Error(ErrorFrame {
            code,
            message: message.to_owned(),
        }));
        self.phase = Phase::Closed;
        let reason = CloseReason {
            code,
            message: message.to_owned(),
            by_peer: false,
        };
        self.events.push_back(SenderEvent::Closed(reason));
    }

    fn closed_by_peer(&mut self, e: ErrorFrame) {
        self.phase = Phase::Closed;
        let reason = CloseReason {
            code: e.code,
            message: e.message,
            by_peer: true,
        };
        self.events.push_back(SenderEvent::Closed(reason));
    }

    fn push_control(&mut self, frame: Frame) {
        self.live.last_tx = self.now;
        self.control.push_back(Transmit {
            frame: frame.encode(),
            kind: TransmitKind::Control,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlog_shrinks_as_the_hub_catches_up() {
        let mut lane = Lane::new("t".into(), 1, 1, 100, Mode::Normal);
        lane.backlog = Backlog {
            blocks: 10,
            bytes: 1000,
            oldest_unsent_ts: Some(5),
        };
        lane.backlog_base = 0;
        lane.backlog_top = 100;
        assert_eq!(lane.current_backlog(), lane.backlog);
        lane.hub_mark = 50;
        let half = lane.current_backlog();
        assert_eq!((half.blocks, half.bytes), (5, 500));
        assert_eq!(half.oldest_unsent_ts, Some(5));
        lane.hub_mark = 99;
        assert_eq!(lane.current_backlog().blocks, 1);
        lane.hub_mark = 100;
        assert_eq!(lane.current_backlog(), Backlog::default());
    }
}
