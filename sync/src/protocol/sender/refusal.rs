//! A stream the hub refuses ([`StreamRefused`]): its lanes stop until the refusal lapses,
//! then start again from the hub's mark on the same session.
//!
//! Blocks of the stream already sent are not acknowledged by the hub; they leave the window at
//! once (the hub stops counting them too) and are read again from the log later. The session
//! and every other stream carry on.

use std::time::Duration;

use super::{Instant, Mode, Sender, SenderEvent};
use crate::protocol::frame::StreamRefused;

impl Sender {
    pub(super) fn on_refused(&mut self, r: StreamRefused) {
        let until = self.now + Duration::from_millis(r.retry_after_ms);
        self.refused.insert(r.stream.clone(), until);
        for i in 0..self.lanes.len() {
            if self.lanes[i].stream != r.stream || self.lanes[i].mode != Mode::Normal {
                continue;
            }
            let lane = &mut self.lanes[i];
            lane.refused_until = Some(until);
            lane.queue.clear();
            lane.queue_bytes = 0;
            for (_, bytes, counted) in lane.inflight.drain(..) {
                if counted {
                    self.inflight_bytes -= bytes;
                    self.inflight_items -= 1;
                }
            }
            lane.cursor = lane.restart_at();
            lane.exhausted_at = None;
        }
        self.events.push_back(SenderEvent::StreamRefused {
            stream: r.stream,
            epoch: r.epoch,
            code: r.code,
            retry_after: Duration::from_millis(r.retry_after_ms),
            message: r.message,
        });
    }

    /// Lifts every refusal whose time has come, for lanes with no log read outstanding (one
    /// that is lifts when its answer arrives). Returns whether any was lifted.
    pub(super) fn lift_refusals(&mut self) -> bool {
        let now = self.now;
        let mut lifted = Vec::new();
        for lane in &mut self.lanes {
            let due = lane.refused_until.is_some_and(|t| now >= t);
            if due && !lane.want_outstanding {
                lane.refused_until = None;
                lane.cursor = lane.restart_at();
                lane.exhausted_at = None;
                if !lifted.contains(&lane.stream) {
                    lifted.push(lane.stream.clone());
                }
            }
        }
        self.refused.retain(|_, t| now < *t);
        let any = !lifted.is_empty();
        for stream in lifted {
            self.events
                .push_back(SenderEvent::StreamRetrying { stream });
        }
        any
    }

    /// When the next refusal lapses (lanes waiting for a log read lift when it answers).
    pub(super) fn next_refusal_lapse(&self) -> Option<Instant> {
        self.lanes
            .iter()
            .filter(|l| !l.want_outstanding)
            .filter_map(|l| l.refused_until)
            .min()
    }
}

impl super::Lane {
    /// Where a lane starts again after a refusal: after the hub's mark once the hub has
    /// acknowledged the lane in this session, otherwise where the Welcome said (the hub still
    /// waits for the block ending at its mark).
    fn restart_at(&self) -> u64 {
        if self.acked_in_session {
            self.hub_mark.max(self.durable).saturating_add(1)
        } else {
            self.resume_from
        }
    }
}
