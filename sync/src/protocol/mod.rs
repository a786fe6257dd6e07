//! The replication protocol: two sans-IO state machines, the edge's [`Sender`] and the hub's
//! [`Receiver`], and the wire [`frame`]s between them.
//!
//! Neither machine performs IO, reads the clock or draws random numbers. A driver feeds them
//! inputs (`handle_frame`, `handle_timeout` and commands such as [`Sender::offer_block`] or
//! [`Receiver::committed`]) and drains their outputs (`poll_transmit`, `poll_event`,
//! `poll_timeout`). Time is an [`Instant`] the driver passes in. That makes the protocol
//! testable deterministically with a virtual clock (`sync/tests/protocol_sim.rs`), and makes
//! each quinn driver one small loop:
//!
//! ```text
//! loop {
//!     while let Some(t) = machine.poll_transmit() { write t.frame to the control stream,
//!                                                   or (TransmitKind::Data) any stream }
//!     while let Some(e) = machine.poll_event()    { act on e, answer via commands }
//!     select { frame read => machine.handle_frame(now, &frame),
//!              timer at machine.poll_timeout() => machine.handle_timeout(now),
//!              command => ... }
//!     if machine.is_closed() && nothing left to transmit { close the connection }
//! }
//! ```
//!
//! The rules (seqs, epochs, acks, windows, verification, error codes) are specified in
//! `docs/protocol/sync.md`.

pub mod checksum;
pub mod frame;
pub mod receiver;
pub mod sender;

pub use checksum::RangeChecksum;
pub use frame::{
    Backlog, BacklogEntry, ErrorCode, Frame, FrameBuffer, FrameError, GapMarker, GapReason,
    LaneAnnounce, PROTOCOL_VERSION, StreamRefused,
};
pub use receiver::{
    CommitItem, DecodedBlock, LaneMarks, Marks, MarksQuery, Receiver, ReceiverConfig,
    ReceiverEvent, ReceiverStats, Refusal, block_error_code,
};
pub use sender::{OfferError, Rekey, Sender, SenderConfig, SenderEvent};

use std::time::Duration;

/// A point in time, in nanoseconds from an origin the driver chooses (for example the
/// process start). The protocol only compares instants and adds durations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    pub const ZERO: Instant = Instant(0);

    pub fn from_nanos(nanos: u64) -> Instant {
        Instant(nanos)
    }

    pub fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time since `earlier`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;

    fn add(self, d: Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

/// A frame ready to be written, with a hint about which transport stream may carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The encoded frame, length prefix included.
    pub frame: Vec<u8>,
    pub kind: TransmitKind,
}

/// Where a frame may travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransmitKind {
    /// Must go on the connection's single ordered control stream, after every earlier
    /// Control frame.
    Control,
    /// A Block or Gap frame past the hub's mark: may go on its own stream and arrive in any
    /// order; the receiver reorders within its advertised window.
    Data,
}

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReason {
    pub code: ErrorCode,
    pub message: String,
    /// True if the peer sent the Error frame; false if this side closed.
    pub by_peer: bool,
}

/// Timers shared by both machines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Close if nothing was received for this long.
    pub idle: Duration,
    /// Send a Ping if nothing was sent for this long; must be well below the peer's `idle`.
    pub keepalive: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            idle: Duration::from_secs(30),
            keepalive: Duration::from_secs(10),
        }
    }
}

/// The encoded Error frame for `code`, for drivers that refuse a connection before a state
/// machine exists (for example, a fenced or revoked device).
pub fn error_frame(code: ErrorCode, message: &str) -> Vec<u8> {
    Frame::Error(frame::ErrorFrame {
        code,
        message: message.to_owned(),
    })
    .encode()
}

/// Idle and keepalive bookkeeping, identical on both sides.
#[derive(Debug, Clone, Copy)]
struct Liveness {
    timeouts: Timeouts,
    last_rx: Instant,
    last_tx: Instant,
}

impl Liveness {
    fn new(timeouts: Timeouts, now: Instant) -> Self {
        Liveness {
            timeouts,
            last_rx: now,
            last_tx: now,
        }
    }

    fn idle_deadline(&self) -> Instant {
        self.last_rx + self.timeouts.idle
    }

    fn keepalive_deadline(&self) -> Instant {
        self.last_tx + self.timeouts.keepalive
    }
}
