//! What the session loop does with each receiver event: marks from the catalog, backlog
//! figures, fences and the session's end.

use std::collections::HashMap;

use sync::protocol::{
    Backlog, BacklogEntry, ErrorCode, Frame, LaneMarks, Marks, MarksQuery, Receiver, ReceiverEvent,
    Refusal,
};
use tokio::sync::mpsc;

use super::ConnCtx;
use super::commit::{Charged, Done, commit, error_code};
use crate::ingest::{BacklogReport, Hub, IngestError};

/// Acts on one receiver event. Returns the code and message to close with when the session
/// is over.
pub(super) async fn handle_event(
    ctx: &ConnCtx,
    device: &str,
    rx: &mut Receiver,
    ev: ReceiverEvent,
    done: &mpsc::UnboundedSender<Done>,
    announced: Option<&Announced>,
    charged: &mut Option<Charged>,
) -> Option<(ErrorCode, String)> {
    match ev {
        ReceiverEvent::NeedMarks {
            current_epoch,
            lanes,
        } => match load_marks(ctx, device, current_epoch, &lanes, rx.refuses_streams()) {
            // Mid-session the refusal goes first, so that nothing of the stream waiting for
            // these marks is committed; at the handshake it follows the Welcome.
            Ok((marks, refused)) if rx.is_established() => {
                for (stream, e) in refused {
                    refuse(ctx, device, rx, &stream, 0, &e);
                }
                rx.marks_loaded(ctx.now(), marks);
            }
            Ok((marks, refused)) => {
                rx.marks_loaded(ctx.now(), marks);
                for (stream, e) in refused {
                    refuse(ctx, device, rx, &stream, 0, &e);
                }
            }
            Err((code, msg)) => rx.close(ctx.now(), code, &msg),
        },
        ReceiverEvent::Established {
            version,
            current_epoch,
        } => {
            tracing::info!(%device, version, current_epoch = %sync::epoch::format(current_epoch), "session established");
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
        } => commit(ctx, device, stream, epoch, item, done, charged).await,
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

/// Refuses `stream` for the hub's `ingest.stream_refusal_retry` (or closes the session of an
/// agent that does not understand StreamRefused). Counted and logged once per stream and
/// retry period: the receiver says nothing new while the stream is refused already.
pub(super) fn refuse(
    ctx: &ConnCtx,
    device: &str,
    rx: &mut Receiver,
    stream: &str,
    epoch: u64,
    e: &IngestError,
) {
    let refusal = Refusal {
        code: error_code(e),
        retry_after: ctx.quotas.stream_refusal_retry,
        message: e.to_string(),
    };
    if rx.refuse_stream(ctx.now(), stream, epoch, &refusal) {
        ctx.hub.stats().connections.stream_refused(refusal.code);
        tracing::info!(
            %device,
            %stream,
            code = e.code(),
            reason = %e,
            retry_after = ?refusal.retry_after,
            "stream refused; the device's session and other streams carry on"
        );
    }
}

/// Streams a marks query refused, with why; the session carries on without them.
type RefusedStreams = Vec<(String, IngestError)>;

/// Answers a marks query from the catalog, authorizing every stream first. With `per_stream`
/// (the agent understands StreamRefused) a stream the device may not write is returned among
/// the refused ones, with its marks still loaded; otherwise it fails the query.
fn load_marks(
    ctx: &ConnCtx,
    device: &str,
    current_epoch: u64,
    lanes: &[MarksQuery],
    per_stream: bool,
) -> Result<(Marks, RefusedStreams), (ErrorCode, String)> {
    let mut refused: RefusedStreams = Vec::new();
    let mut authorize = |stream: &str| -> Result<(), (ErrorCode, String)> {
        match ctx.hub.authorize(device, stream) {
            Ok(()) => Ok(()),
            Err(e) if per_stream => {
                if !refused.iter().any(|(s, _)| s == stream) {
                    refused.push((stream.to_owned(), e));
                }
                Ok(())
            }
            Err(e) => Err((error_code(&e), e.to_string())),
        }
    };
    let known = ctx.hub.marks(device);
    let limit = ctx.receiver_cfg.checksum_ranges_max;
    let mut out = Marks {
        epoch_max: ctx.hub.epoch_max(device),
        lanes: Vec::new(),
    };
    let mut lane_marks =
        |stream: &str, epoch: u64, from: u64| -> Result<LaneMarks, (ErrorCode, String)> {
            authorize(stream)?;
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
    Ok((out, refused))
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

/// Per `(stream, epoch)`: the last seq and the backlog a lane announced in the Hello.
pub(super) type Announced = HashMap<(String, u64), (u64, Backlog)>;

/// The `last_seq` and backlog of every lane a Hello frame announces; empty for any other frame
/// (a malformed one is the receiver's to refuse).
pub(super) fn announced_last_seqs(frame: &[u8], frame_bytes_max: u32) -> Announced {
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
        match ctx.hub.record_backlog(device, &e.stream, report) {
            Ok(()) => {}
            // Quota and allow-list refusals are counted and logged by ingest and by the
            // stream's refusal; the device repeats its backlog every period, so a line here
            // would repeat too.
            Err(err @ (IngestError::QuotaExceeded { .. } | IngestError::Unauthorized(_))) => {
                tracing::debug!(%device, stream = %e.stream, error = %err, "backlog refused");
            }
            Err(err) => {
                tracing::warn!(%device, stream = %e.stream, error = %err, "recording backlog");
            }
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
            capabilities: 0,
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
