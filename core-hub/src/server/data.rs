//! Data streams: each Block or Gap frame comes on its own unidirectional stream, read and
//! decoded on its own task, with its share of the ingest budget taken before its bytes are.
//!
//! # The charge, step by step
//!
//! 1. The frame's 4-byte length prefix is read; a frame over the limit ends the session.
//! 2. The announced length is charged to the ingest budget (`Hub::memory`) before any byte of
//!    the body is read: while the budget is spent the task waits, quinn stops extending the
//!    stream's flow-control credit, and the device's writes stall. Nothing is buffered for it
//!    beyond the QUIC receive window.
//! 3. The body is read with a progress deadline (`ingest.control_idle_timeout`): a stream
//!    that stops sending ends the session with `IDLE_TIMEOUT` rather than hold its charge.
//! 4. A Block's decompressed size, then its records' exact decoded size, are added to the
//!    charge before the body is decompressed and before any record is built. When the budget
//!    cannot grow at once, everything held is let go and the whole cost awaited: holding part
//!    while waiting for more could deadlock connections against each other. Nothing is ever
//!    decoded outside the budget.
//!
//! Charges of one connection are taken in the order its streams were opened (each task waits
//! for its predecessor's turn), so a connection's oldest stream never waits for memory its
//! younger ones hold. The charge then travels with the decoded block into the WAL submission
//! and is released once the block is durable.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use sync::protocol::{DecodedBlock, ErrorCode, Frame, ReceiverConfig};
use tokio::sync::{OwnedSemaphorePermit, oneshot};
use tokio::task::JoinHandle;

use super::ConnStats;
use crate::ingest::Hub;

/// Data streams per connection read and decoded ahead of the receiver, in parallel.
pub const DECODE_AHEAD: usize = 4;

/// Bytes of the frame length prefix.
const LEN_PREFIX: usize = 4;

/// What a data stream's task hands to its connection task.
pub(super) enum Data {
    /// A frame for [`sync::protocol::Receiver::handle_frame`] (not a block, or one that does
    /// not parse), with its charge.
    Frame(Vec<u8>, OwnedSemaphorePermit),
    /// A block decoded on the blocking pool; the permit is its share of the ingest budget.
    Decoded(String, DecodedBlock, OwnedSemaphorePermit),
    /// A block that failed to verify or decode, and the code to close with.
    BadBlock(ErrorCode, String),
    /// The stream exceeded the frame limit.
    TooLarge,
    /// The stream sent nothing for the progress deadline.
    Stalled,
}

/// What every data-stream task of a connection shares.
pub(super) struct DataCtx {
    pub(super) frame_max: usize,
    pub(super) cfg: ReceiverConfig,
    pub(super) hub: Arc<Hub>,
    /// The progress deadline of a data stream's reads.
    pub(super) idle: Duration,
    /// Test-only: decode without charging the budget (the bug the charge guards against).
    pub(super) uncharged: bool,
}

/// A task's place in its connection's charge order: it charges once `prev` is done, and
/// drops `next` when its own charge is complete.
pub(super) struct Turn {
    pub(super) prev: Option<oneshot::Receiver<()>>,
    pub(super) next: oneshot::Sender<()>,
}

impl DataCtx {
    fn stats(&self) -> &ConnStats {
        &self.hub.stats().connections
    }

    /// Takes `bytes` of the budget, waiting (and counting the wait) while it is spent.
    async fn charge(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        let n = self.hub.permits_for(bytes);
        if let Ok(p) = self.hub.memory().clone().try_acquire_many_owned(n) {
            return Some(p);
        }
        ConnStats::bump(&self.stats().memory_waits);
        self.hub.memory().clone().acquire_many_owned(n).await.ok()
    }

    /// Grows `held` to `total` bytes: at once if the budget allows, else by letting it go and
    /// awaiting the whole (see the module docs).
    async fn grow(&self, held: OwnedSemaphorePermit, total: u64) -> Option<OwnedSemaphorePermit> {
        let want = self.hub.permits_for(total) as usize;
        let Some(more) = want.checked_sub(held.num_permits()).filter(|&m| m > 0) else {
            return Some(held);
        };
        let mut held = held;
        match self
            .hub
            .memory()
            .clone()
            .try_acquire_many_owned(more as u32)
        {
            Ok(p) => {
                held.merge(p);
                Some(held)
            }
            Err(_) => {
                drop(held);
                self.charge(total).await
            }
        }
    }
}

/// Reads one data stream and prepares its frame: a Block is verified, decoded and hashed on
/// the blocking pool, so the connection task does none of that work.
pub(super) async fn read_data(mut s: quinn::RecvStream, dc: Arc<DataCtx>, turn: Turn) -> Data {
    let mut prefix = [0u8; LEN_PREFIX];
    match read_exactly(&mut s, &mut prefix, dc.idle).await {
        Read::Full => {}
        Read::Short(_) | Read::Broken => return Data::TooLarge,
        Read::Stalled => return Data::Stalled,
    }
    let total = LEN_PREFIX + u32::from_le_bytes(prefix) as usize;
    if total > dc.frame_max {
        return Data::TooLarge;
    }
    if let Some(prev) = turn.prev {
        let _ = prev.await;
    }
    let charge = if dc.uncharged {
        dc.hub.memory().clone().try_acquire_many_owned(0).ok()
    } else {
        dc.charge(total as u64).await
    };
    let Some(charge) = charge else {
        return Data::BadBlock(ErrorCode::Internal, "the ingest budget is closed".into());
    };
    let mut bytes = vec![0u8; total];
    bytes[..LEN_PREFIX].copy_from_slice(&prefix);
    match read_exactly(&mut s, &mut bytes[LEN_PREFIX..], dc.idle).await {
        Read::Full => {}
        Read::Short(n) => bytes.truncate(LEN_PREFIX + n),
        Read::Broken => return Data::TooLarge,
        Read::Stalled => return Data::Stalled,
    }
    if !matches!(s.read_to_end(0).await, Ok(rest) if rest.is_empty()) {
        return Data::TooLarge;
    }
    let data = prepare(bytes, charge, &dc).await;
    drop(turn.next);
    data
}

/// How a bounded read ended.
enum Read {
    Full,
    /// The stream finished after this many bytes.
    Short(usize),
    Broken,
    Stalled,
}

/// Fills `buf` from the stream, each read within `idle` of the one before.
async fn read_exactly(s: &mut quinn::RecvStream, buf: &mut [u8], idle: Duration) -> Read {
    let mut filled = 0;
    while filled < buf.len() {
        match tokio::time::timeout(idle, s.read(&mut buf[filled..])).await {
            Err(_) => return Read::Stalled,
            Ok(Err(_)) => return Read::Broken,
            Ok(Ok(None)) => return Read::Short(filled),
            Ok(Ok(Some(n))) => filled += n,
        }
    }
    Read::Full
}

/// Turns a read frame into what the receiver takes: a Block is decoded within the budget.
async fn prepare(bytes: Vec<u8>, charge: OwnedSemaphorePermit, dc: &DataCtx) -> Data {
    let Ok(Frame::Block { stream, block }) = Frame::decode(&bytes, dc.cfg.frame_bytes_max) else {
        return Data::Frame(bytes, charge);
    };
    let Ok(header) = sync::block::decode_header(&block) else {
        return Data::Frame(bytes, charge);
    };
    drop(bytes);
    let sizing = crate::ingest::sizing_cost(block.len(), &header);
    let permit = match dc.uncharged {
        true => Some(charge),
        false => dc.grow(charge, sizing).await,
    };
    let Some(permit) = permit else {
        return Data::BadBlock(ErrorCode::Internal, "the ingest budget is closed".into());
    };
    decode(stream, block, &header, permit, dc).await
}

/// Sizes the block, grows the charge to its whole cost, then builds its records, all on the
/// blocking pool.
async fn decode(
    stream: String,
    mut block: Vec<u8>,
    header: &sync::block::BlockHeader,
    mut permit: OwnedSemaphorePermit,
    dc: &DataCtx,
) -> Data {
    loop {
        let (sized, back) = match size(block, dc.cfg.decode_limits).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return bad(&stream, e),
            Err(e) => return failed(&stream, format!("sizing failed: {e}")),
        };
        block = back;
        let cost = crate::ingest::block_cost(block.len(), header, sized.decoded_bytes());
        let want = dc.hub.permits_for(cost) as usize;
        if dc.uncharged || permit.num_permits() >= want {
            let pool = dc.hub.record_pool().clone();
            let build = move || DecodedBlock::from_sized(block, &sized, pool.take());
            return match tokio::task::spawn_blocking(build).await {
                Ok(Ok(d)) => Data::Decoded(stream, d, permit),
                Ok(Err(e)) => bad(&stream, e),
                Err(e) => failed(&stream, format!("decoding failed: {e}")),
            };
        }
        // The decompressed body is let go while the whole cost is awaited, then sized again.
        drop(sized);
        permit = match dc.grow(permit, cost).await {
            Some(p) => p,
            None => {
                return Data::BadBlock(ErrorCode::Internal, "the ingest budget is closed".into());
            }
        };
    }
}

fn bad(stream: &str, e: sync::block::BlockError) -> Data {
    let code = sync::protocol::block_error_code(&e);
    Data::BadBlock(code, format!("stream {stream}: {e}"))
}

fn failed(stream: &str, what: String) -> Data {
    Data::BadBlock(ErrorCode::BadBlock, format!("stream {stream}: {what}"))
}

/// Decompresses and sizes a block on the blocking pool, handing the block back.
async fn size(
    block: Vec<u8>,
    limits: sync::block::DecodeLimits,
) -> Result<
    Result<(sync::block::SizedBlock, Vec<u8>), sync::block::BlockError>,
    tokio::task::JoinError,
> {
    let run = move || sync::block::size_block(&block, &limits).map(|s| (s, block));
    tokio::task::spawn_blocking(run).await
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
