//! Data streams: each Block or Gap frame comes on its own unidirectional stream, read and
//! decoded on its own task, with its share of the ingest budget.

use std::collections::VecDeque;
use std::sync::Arc;

use sync::protocol::{DecodedBlock, ErrorCode, Frame, ReceiverConfig};
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;

use crate::ingest::Hub;

/// Data streams per connection read and decoded ahead of the receiver, in parallel.
pub const DECODE_AHEAD: usize = 4;

/// What a data stream's task hands to its connection task.
pub(super) enum Data {
    /// A frame for [`Receiver::handle_frame`] (not a block, or one it decodes itself).
    Frame(Vec<u8>),
    /// A block decoded on the blocking pool; the permit is its share of the ingest budget.
    Decoded(String, DecodedBlock, OwnedSemaphorePermit),
    /// A block that failed to verify or decode, and the code to close with.
    BadBlock(ErrorCode, String),
    /// The stream exceeded the frame limit.
    TooLarge,
}

/// Reads one data stream and prepares its frame: a Block is verified, decoded and hashed on
/// the blocking pool, so the connection task does none of that work.
pub(super) async fn read_data(
    mut s: quinn::RecvStream,
    frame_max: usize,
    cfg: ReceiverConfig,
    hub: Arc<Hub>,
) -> Data {
    // An oversize data stream is cut off here; only this connection is closed.
    let Ok(bytes) = s.read_to_end(frame_max).await else {
        return Data::TooLarge;
    };
    let Ok(Frame::Block { stream, block }) = Frame::decode(&bytes, cfg.frame_bytes_max) else {
        return Data::Frame(bytes);
    };
    let Ok(header) = sync::block::decode_header(&block) else {
        return Data::Frame(bytes);
    };
    let sizing = crate::ingest::sizing_cost(block.len(), &header);
    let Some(mut permit) = try_reserve(&hub, sizing) else {
        return Data::Frame(bytes);
    };
    drop(bytes);
    let limits = cfg.decode_limits;
    let pool = hub.record_pool().clone();
    let memory = hub.clone();
    let decode = move || {
        let sized = sync::block::size_block(&block, &limits)?;
        // The records' own share, before they are built; without it the receiver decodes the
        // frame itself.
        let Some(more) = try_reserve(&memory, sized.decoded_bytes()) else {
            return Ok(Err(block));
        };
        permit.merge(more);
        DecodedBlock::from_sized(block, &sized, pool.take()).map(|d| Ok((d, permit)))
    };
    match tokio::task::spawn_blocking(decode).await {
        Ok(Ok(Ok((d, permit)))) => Data::Decoded(stream, d, permit),
        Ok(Ok(Err(block))) => Data::Frame(Frame::Block { stream, block }.encode()),
        Ok(Err(e)) => Data::BadBlock(
            sync::protocol::block_error_code(&e),
            format!("stream {stream}: {e}"),
        ),
        Err(e) => Data::BadBlock(
            ErrorCode::BadBlock,
            format!("stream {stream}: decoding failed: {e}"),
        ),
    }
}

/// Takes `bytes` of the ingest budget if it is free now.
fn try_reserve(hub: &Hub, bytes: u64) -> Option<OwnedSemaphorePermit> {
    let permits = bytes.div_ceil(crate::ingest::MEMORY_PERMIT_BYTES).max(1);
    u32::try_from(permits)
        .ok()
        .and_then(|n| hub.memory().clone().try_acquire_many_owned(n).ok())
}

/// Waits for the oldest data stream's result; pending while there is none.
pub(super) async fn next_data(ahead: &mut VecDeque<JoinHandle<Data>>) -> Data {
    match ahead.front_mut() {
        Some(task) => {
            let data = task.await.unwrap_or_else(|e| {
                Data::BadBlock(
                    ErrorCode::BadBlock,
                    format!("reading a data stream failed: {e}"),
                )
            });
            ahead.pop_front();
            data
        }
        None => std::future::pending().await,
    }
}
