//! Refusing one stream without ending the session.
//!
//! The driver refuses a stream when the hub will not store it (not on the device's allow-list,
//! a per-device quota, a key the device may not write). To an edge that announced
//! [`capability::STREAM_REFUSED`] the receiver sends a [`StreamRefused`] frame and carries on:
//! nothing of the stream is committed until `retry_after` has passed, its blocks already in
//! flight are dropped without an Ack, and every other stream keeps flowing. Once the refusal
//! lapses the edge offers the stream again from the hub's mark and the hub judges it afresh,
//! so a fixed allow-list takes effect within `retry_after` on the same session. An edge
//! without the capability gets the old behaviour: the session closes with the code.

use std::time::Duration;

use super::{Instant, Phase, Receiver};
#[cfg(doc)]
use crate::protocol::ReceiverEvent;
use crate::protocol::TransmitKind;
use crate::protocol::frame::{ErrorCode, Frame, StreamRefused, capability};

/// Why, and for how long, the hub refuses a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    /// The edge offers the stream again after this long.
    pub retry_after: Duration,
    pub message: String,
}

impl Receiver {
    /// Whether the edge understands [`StreamRefused`]; without it a refusal closes the session.
    pub fn refuses_streams(&self) -> bool {
        self.capabilities & capability::STREAM_REFUSED != 0
    }

    /// Whether `stream` is refused right now.
    pub fn is_refused(&self, stream: &str) -> bool {
        self.refused
            .get(stream)
            .is_some_and(|&until| self.now < until)
    }

    /// Refuses `stream` (every lane of it) for `r.retry_after`; `epoch` names the lane whose
    /// block was refused (0 at the handshake). Returns true when a StreamRefused frame went out,
    /// false when the stream was refused already (nothing new to say) or the session was closed
    /// instead (an edge without the capability, or before the session is established).
    pub fn refuse_stream(&mut self, now: Instant, stream: &str, epoch: u64, r: &Refusal) -> bool {
        if self.phase == Phase::Closed {
            return false;
        }
        self.now = now;
        if !self.refuses_streams() || self.phase != Phase::Established {
            self.close(now, r.code, &r.message);
            return false;
        }
        if self.is_refused(stream) {
            return false;
        }
        self.refused.insert(stream.to_owned(), now + r.retry_after);
        for i in self.lanes_of(stream) {
            self.stop_lane(i);
        }
        let frame = StreamRefused {
            stream: stream.to_owned(),
            epoch,
            code: r.code,
            retry_after_ms: u64::try_from(r.retry_after.as_millis()).unwrap_or(u64::MAX),
            message: r.message.clone(),
        };
        self.push(Frame::StreamRefused(frame), TransmitKind::Control);
        self.stats.streams_refused += 1;
        true
    }

    /// A commit handed out for `stream`/`epoch` ending at `last_seq` failed. If the stream is
    /// refused, the failure is part of that refusal (a later block of the lane cannot follow a
    /// refused one): it is absorbed and true is returned. Otherwise the driver must close.
    pub fn commit_failed(&mut self, now: Instant, stream: &str, epoch: u64, last_seq: u64) -> bool {
        self.now = now;
        if !self.refused.contains_key(stream) {
            return false;
        }
        let Some(&i) = self.index.get(&(stream.to_owned(), epoch)) else {
            return true;
        };
        let lane = &mut self.lanes[i];
        if let Some(at) = lane.pending.iter().position(|p| p.0 == last_seq) {
            let (_, bytes, counted) = lane.pending.remove(at).expect("position is in range");
            if counted {
                self.release_held(bytes);
            }
        }
        self.rewind_if_settled(i);
        true
    }

    fn lanes_of(&self, stream: &str) -> Vec<usize> {
        (0..self.lanes.len())
            .filter(|&i| self.lanes[i].stream == stream)
            .collect()
    }

    /// Stops committing a lane: what waits in its reorder buffer is dropped, and its commits
    /// not yet durable stop counting against the window (the edge stops counting them too).
    /// A lane the hub is ahead of is only compared, never committed: it carries on.
    fn stop_lane(&mut self, i: usize) {
        if self.lanes[i].behind.is_some() {
            return;
        }
        let lane = &mut self.lanes[i];
        lane.refused = true;
        lane.carry = None;
        let waiting = std::mem::take(&mut lane.reorder);
        let mut released = Vec::new();
        for p in lane.pending.iter_mut().filter(|p| p.2) {
            p.2 = false;
            released.push(p.1);
        }
        for (_, (item, parked)) in waiting {
            if parked {
                self.parked_bytes -= item.bytes();
                self.parked_items -= 1;
            } else {
                released.push(item.bytes());
            }
        }
        for bytes in released {
            self.release_held(bytes);
        }
        self.rewind_if_settled(i);
    }

    fn release_held(&mut self, bytes: u64) {
        // Only this machine's own bookkeeping can break this.
        assert!(
            self.held_items > 0 && self.held_bytes >= bytes,
            "held accounting: {} items, {} bytes, releasing {bytes}",
            self.held_items,
            self.held_bytes
        );
        self.held_bytes -= bytes;
        self.held_items -= 1;
    }

    /// Once every commit of a refused lane has its outcome, the lane forgets what it handed
    /// out past the mark: the edge sends it again from the mark when the refusal lapses.
    pub(super) fn rewind_if_settled(&mut self, i: usize) {
        let lane = &mut self.lanes[i];
        if !lane.refused || !lane.pending.is_empty() {
            return;
        }
        let mark = lane.mark;
        lane.frontier = mark;
        lane.ring.retain(|r| r.last_seq <= mark);
        lane.carry = None;
    }

    /// Whether an item of `stream`/`epoch` is dropped because the stream is refused. A lapsed
    /// refusal is lifted here, by the first item after it, once every lane of the stream has
    /// settled its commits: the lanes' marks are looked up again ([`ReceiverEvent::NeedMarks`]),
    /// which is where the driver judges the stream afresh, and the item waits for the answer.
    pub(super) fn drops_refused(&mut self, stream: &str, epoch: u64) -> bool {
        let Some(&until) = self.refused.get(stream) else {
            return false;
        };
        let lane = self.index.get(&(stream.to_owned(), epoch)).copied();
        if lane.is_some_and(|i| self.lanes[i].behind.is_some()) {
            return false;
        }
        let lanes = self.lanes_of(stream);
        let settled = lanes.iter().all(|&i| self.lanes[i].pending.is_empty());
        if self.now < until || !settled {
            return true;
        }
        self.refused.remove(stream);
        let mut again = Vec::new();
        for i in lanes {
            let lane = &mut self.lanes[i];
            lane.refused = false;
            if lane.behind.is_none() && lane.loaded {
                lane.loaded = false;
                again.push(i);
            }
        }
        if !again.is_empty() {
            self.ask_marks(again);
        }
        false
    }
}
