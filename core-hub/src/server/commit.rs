//! Commits: each is submitted to the WAL in the order the receiver emits it, and its
//! durability awaited on its own task so the connection keeps reading while the WAL
//! group-commits.

use std::time::Duration;

use sync::block::BlockHeader;
use sync::protocol::{CommitItem, ErrorCode, Receiver};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::ConnCtx;
use crate::ingest::{IngestError, VerifiedBlock};
use crate::wal::CommitError;

/// How long a closing session waits for the commits it already handed to the WAL, so that
/// nothing of it becomes durable after the device saw the session end.
const SETTLE_ON_CLOSE: Duration = Duration::from_secs(1);

/// The ingest-budget charge of a block the receiver was just handed, kept for that block's
/// commit so the block is never charged twice and never waits for memory in between.
pub(super) struct Charged {
    stream: String,
    epoch: u64,
    first_seq: u64,
    permit: OwnedSemaphorePermit,
}

impl Charged {
    pub(super) fn new(stream: &str, header: &BlockHeader, permit: OwnedSemaphorePermit) -> Self {
        Charged {
            stream: stream.to_owned(),
            epoch: header.epoch,
            first_seq: header.first_seq,
            permit,
        }
    }

    /// The charge, if it is the one of this block.
    fn take_for(
        slot: &mut Option<Charged>,
        stream: &str,
        h: &BlockHeader,
    ) -> Option<OwnedSemaphorePermit> {
        let ours = slot.as_ref().is_some_and(|c| {
            c.stream == stream && c.epoch == h.epoch && c.first_seq == h.first_seq
        });
        ours.then(|| slot.take().map(|c| c.permit)).flatten()
    }
}

/// What a commit task reports back to its connection loop.
pub(super) enum Done {
    Committed {
        stream: String,
        epoch: u64,
        durable_seq: u64,
    },
    /// The commit of `stream`/`epoch` ending at `last_seq` failed.
    Failed {
        stream: String,
        epoch: u64,
        last_seq: u64,
        error: IngestError,
    },
}

impl Done {
    fn failed(stream: &str, epoch: u64, last_seq: u64, error: IngestError) -> Done {
        Done::Failed {
            stream: stream.to_owned(),
            epoch,
            last_seq,
            error,
        }
    }
}

/// Submits a commit in order, then waits for durability on a separate task so the connection
/// keeps reading while the WAL group-commits.
pub(super) async fn commit(
    ctx: &ConnCtx,
    device: &str,
    stream: String,
    epoch: u64,
    item: CommitItem,
    done: &mpsc::UnboundedSender<Done>,
    charged: &mut Option<Charged>,
) {
    let done = done.clone();
    let last_seq = item.last_seq();
    match item {
        CommitItem::Block {
            header,
            block,
            skip_through,
            records,
            checksum,
        } => {
            let held = Charged::take_for(charged, &stream, &header);
            let vb = VerifiedBlock {
                header,
                block,
                skip_through,
                records,
                checksum: Some(checksum.checksum),
            };
            match ctx
                .hub
                .submit_verified_charged(device, &stream, vb, held)
                .await
            {
                Ok(pending) => {
                    tokio::spawn(async move {
                        let msg = match pending.wait().await {
                            Ok(outcome) => Done::Committed {
                                stream,
                                epoch,
                                durable_seq: outcome.durable_seq(),
                            },
                            Err(e) => Done::failed(&stream, epoch, last_seq, e),
                        };
                        let _ = done.send(msg);
                    });
                }
                Err(e) => {
                    let _ = done.send(Done::failed(&stream, epoch, last_seq, e));
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
                    Err(e) => Done::failed(&stream, epoch, last_seq, e),
                };
                let _ = done.send(msg);
            });
        }
    }
}

/// Whether `e` refuses the stream rather than the session: the device may not write it (the
/// allow-list, a forbidden or bad key) or a per-device quota would be exceeded. To an agent
/// that understands it the hub says so with a StreamRefused frame and the session carries on.
pub(super) fn refuses_stream(e: &IngestError) -> bool {
    matches!(
        e,
        IngestError::BadStreamName(_)
            | IngestError::Unauthorized(_)
            | IngestError::ForbiddenKey { .. }
            | IngestError::BadKey { .. }
            | IngestError::BadTags { .. }
            | IngestError::QuotaExceeded { .. }
    )
}

/// Waits, up to [`SETTLE_ON_CLOSE`], for the outcomes of the `in_flight` commits a closing
/// session handed to the WAL. The receiver hands out nothing once closed, so after this no
/// record of the session becomes durable once the device sees it closed (unless the WAL is
/// slower than the bound, which is logged).
pub(super) async fn settle(
    device: &str,
    done_rx: &mut mpsc::UnboundedReceiver<Done>,
    mut in_flight: usize,
) {
    let deadline = tokio::time::Instant::now() + SETTLE_ON_CLOSE;
    while in_flight > 0 {
        match tokio::time::timeout_at(deadline, done_rx.recv()).await {
            Ok(Some(_)) => in_flight -= 1,
            Ok(None) => return,
            Err(_) => {
                tracing::warn!(%device, in_flight, "closing with commits still in flight");
                return;
            }
        }
    }
}

/// Sends an Ack for every lane of this session whose `tiered_seq` rose; the receiver keeps the
/// last value it sent per lane and ignores lanes outside the session.
pub(super) fn push_tiered(ctx: &ConnCtx, device: &str, rx: &mut Receiver) {
    for m in ctx.hub.marks(device) {
        if m.tiered_seq > 0 {
            rx.update_tiered(ctx.now(), &m.stream, m.epoch, m.tiered_seq);
        }
    }
}

pub(super) fn error_code(e: &IngestError) -> ErrorCode {
    match e {
        IngestError::Fenced(_) => ErrorCode::DeviceFenced,
        IngestError::Conflict { .. } => ErrorCode::ConflictFenced,
        // A forbidden key is content the device may not write to that stream: the stream is
        // refused (see `refuses_stream`), the device's other streams keep flowing.
        IngestError::BadStreamName(_)
        | IngestError::Unauthorized(_)
        | IngestError::ForbiddenKey { .. }
        | IngestError::BadKey { .. }
        | IngestError::BadTags { .. } => ErrorCode::UnauthorizedStream,
        // Nothing was created; the stream is refused, its other lanes keep flowing.
        IngestError::QuotaExceeded { .. } => ErrorCode::QuotaExceeded,
        IngestError::TooLarge { .. } | IngestError::BadBlock(_) => ErrorCode::BadBlock,
        IngestError::DecodedTooLarge { .. } => ErrorCode::DecodedTooLarge,
        IngestError::BadDeviceId | IngestError::ReservedSeq | IngestError::BadGap { .. } => {
            ErrorCode::ProtocolViolation
        }
        IngestError::OutOfOrder { .. } => ErrorCode::ProtocolViolation,
        // Conditions that clear by themselves: the agent retries after a short fixed delay.
        IngestError::Unavailable(
            CommitError::DiskFull { .. }
            | CommitError::FdExhausted { .. }
            | CommitError::Full(_)
            | CommitError::EarlierFailed,
        ) => ErrorCode::StorageFull,
        IngestError::Unavailable(_) | IngestError::Catalog(_) | IngestError::Internal(_) => {
            ErrorCode::Internal
        }
    }
}
