//! Blocks the hub refuses for good, so that a lane never stalls behind one.
//!
//! `DECODED_TOO_LARGE` (the block's records would exceed the hub's
//! `ingest.block_decoded_bytes_max`) and `BAD_BLOCK` (it fails its checks or does not decode)
//! close the session, and the same block would be sent again after every reconnect, forever.
//! Both messages name the stream (`stream S: ...`), and the first names the hub's limit, so
//! the agent finds the refused block among the blocks of that stream the hub has not
//! acknowledged yet: one whose decoded size is over the limit, or one that does not decode
//! here either. Each such block is quarantined by the log (a copy in `data_dir/quarantine/`, a
//! `Refused` gap marker, both fsynced: `LogHandle::quarantine_refused`), counted, and logged
//! with its stream, epoch, seqs and the hub's reason; the next session reports its range as a
//! `Corrupt` gap and the records after it flow. A block re-sealed from a backlog run is not
//! stored anywhere: when it is the one over the limit, the agent remembers the limit and ships
//! such runs as stored from then on.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use sync::block::{DecodeLimits, decode_block, size_block};
use sync::protocol::{CloseReason, ErrorCode};

use super::LinkStatus;
use crate::log::{LogHandle, StoredBlock};

/// What the hub's permanent refusals taught this agent, kept across sessions.
#[derive(Debug, Default)]
pub(super) struct Poison {
    /// The hub's decoded-size limit, once a re-sealed block was refused for it.
    pub(super) decoded_limit: Option<u64>,
}

/// Whether `code` refuses a block for good: sending it again cannot succeed.
pub(super) fn permanent(code: ErrorCode) -> bool {
    !resend_refused() && matches!(code, ErrorCode::DecodedTooLarge | ErrorCode::BadBlock)
}

/// Test-only mutation switch (`fault-injection` builds only; nothing reads it otherwise):
/// with `TRIBUTARY_TEST_EDGE_RESEND_REFUSED=1` every refusal is taken as transient, as before
/// this module existed, so `tests/tests/refused_block.rs` can show its checks catch an agent
/// that resends a refused block forever.
fn resend_refused() -> bool {
    #[cfg(feature = "fault-injection")]
    {
        const RESEND_REFUSED_ENV: &str = "TRIBUTARY_TEST_EDGE_RESEND_REFUSED";
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            let on = std::env::var_os(RESEND_REFUSED_ENV).is_some_and(|v| v == "1");
            if on {
                tracing::error!("{RESEND_REFUSED_ENV}=1: REFUSED BLOCKS ARE RESENT FOREVER (test-only mutation switch)");
            }
            on
        })
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        false
    }
}

/// The stream a refusal names: `stream S: ...`.
fn refused_stream(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("stream ")?;
    let (name, _) = rest.split_once(':')?;
    (!name.is_empty() && !name.contains(' ')).then_some(name)
}

/// The limit a `DECODED_TOO_LARGE` message names: `... more than the N-byte limit`.
fn refused_limit(message: &str) -> Option<u64> {
    let (_, rest) = message.rsplit_once("more than the ")?;
    let (n, _) = rest.split_once("-byte limit")?;
    n.parse().ok()
}

/// Whether the hub would refuse `b` as it refused the block behind `code`.
fn is_poison(b: &StoredBlock, code: ErrorCode, limit: Option<u64>) -> bool {
    match (code, limit) {
        (ErrorCode::DecodedTooLarge, Some(limit)) => {
            let unbounded = DecodeLimits {
                decoded_bytes_max: u64::MAX,
                ..DecodeLimits::default()
            };
            size_block(&b.bytes, &unbounded).is_ok_and(|s| s.decoded_bytes() > limit)
        }
        (ErrorCode::BadBlock, _) => decode_block(&b.bytes, &DecodeLimits::default()).is_err(),
        _ => false,
    }
}

/// The blocks of `stream` after the hub's acknowledgement, up to `offered_max` per epoch
/// (what this session handed to the sender), that the hub refuses for good.
fn find(
    log: &LogHandle,
    stream: &str,
    offered_max: &dyn Fn(u64) -> Option<u64>,
    code: ErrorCode,
    limit: Option<u64>,
) -> Result<Vec<(u64, u64, u64)>, String> {
    let status = log.status();
    let st = status.streams.iter().find(|s| s.stream == stream);
    let mut found = Vec::new();
    for (epoch, _, _) in log.epochs_held(stream) {
        let Some(until) = offered_max(epoch) else {
            continue;
        };
        let mut after = st
            .filter(|s| s.epoch == epoch)
            .map_or(0, |s| s.acked_durable);
        while after < until {
            let blocks = log
                .read_blocks(stream, epoch, after, 4 << 20)
                .map_err(|e| format!("reading local log: {e}"))?;
            let Some(last) = blocks.last() else { break };
            let next = last.header.last_seq();
            for b in blocks.iter().filter(|b| b.header.first_seq <= until) {
                if is_poison(b, code, limit) {
                    found.push((epoch, b.header.first_seq, b.header.last_seq()));
                }
            }
            if next <= after {
                break;
            }
            after = next;
        }
    }
    Ok(found)
}

/// Handles a session the hub closed with a permanent refusal: quarantines the refused blocks
/// (or learns the limit a re-sealed block broke). Returns `true` when something was done
/// about it, so the next session goes ahead at once; `false` leaves the usual backoff.
pub(super) async fn on_refusal(
    log: &LogHandle,
    status: &LinkStatus,
    reason: &CloseReason,
    offered: &HashMap<(String, u64), u64>,
    poison: &mut Poison,
) -> bool {
    let Some(stream) = refused_stream(&reason.message) else {
        return false;
    };
    let limit = refused_limit(&reason.message);
    let offered_max = |e: u64| offered.get(&(stream.to_string(), e)).copied();
    let found = match find(log, stream, &offered_max, reason.code, limit) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(stream, error = %e, "cannot look for the block the hub refused");
            return false;
        }
    };
    if found.is_empty() {
        // Not a stored block: a run re-sealed for shipping broke the limit.
        if let (ErrorCode::DecodedTooLarge, Some(limit)) = (reason.code, limit) {
            tracing::warn!(
                stream,
                limit,
                hub = %reason.message,
                "the hub refused a re-sealed backlog block over its decoded-size limit; runs over it now ship as stored"
            );
            poison.decoded_limit = Some(poison.decoded_limit.map_or(limit, |l| l.min(limit)));
            return true;
        }
        return false;
    }
    let mut done = 0;
    for (epoch, first, last) in found {
        let (log, stream_owned, why) = (log.clone(), stream.to_string(), reason.message.clone());
        let q = tokio::task::spawn_blocking(move || {
            log.quarantine_refused(&stream_owned, epoch, first, last, &why)
        })
        .await;
        match q {
            Ok(Ok(path)) => {
                done += 1;
                status.blocks_quarantined.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    stream,
                    epoch = format_args!("{epoch:016x}"),
                    first_seq = first,
                    last_seq = last,
                    code = ?reason.code,
                    hub = %reason.message,
                    quarantine = %path.display(),
                    "the hub refused a block for good; quarantined it, the lane moves on past a gap"
                );
            }
            Ok(Err(e)) => {
                tracing::error!(stream, epoch = format_args!("{epoch:016x}"), first, last, error = %e, "quarantine failed")
            }
            Err(e) => tracing::error!(stream, error = %e, "quarantine task failed"),
        }
    }
    done > 0
}

/// `blocks` re-sealed, unless a re-sealed one would break the hub's known decoded-size
/// limit: then the run ships as stored.
pub(super) fn within_limit(
    stored: Vec<StoredBlock>,
    resealed: Vec<Vec<u8>>,
    poison: &Poison,
) -> Vec<Vec<u8>> {
    let Some(limit) = poison.decoded_limit else {
        return resealed;
    };
    let unbounded = DecodeLimits {
        decoded_bytes_max: u64::MAX,
        ..DecodeLimits::default()
    };
    let over = resealed
        .iter()
        .any(|b| size_block(b, &unbounded).is_ok_and(|s| s.decoded_bytes() > limit));
    if over {
        stored.into_iter().map(|b| b.bytes).collect()
    } else {
        resealed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_their_stream_and_limit() {
        let m = "stream telemetry: block decodes to 5000000 bytes of records, more than the 1048576-byte limit";
        assert_eq!(refused_stream(m), Some("telemetry"));
        assert_eq!(refused_limit(m), Some(1_048_576));
        assert_eq!(refused_stream("no stream here"), None);
        assert_eq!(refused_limit("stream s: bad checksum"), None);
        assert!(permanent(ErrorCode::DecodedTooLarge) && permanent(ErrorCode::BadBlock));
        assert!(!permanent(ErrorCode::StorageFull) && !permanent(ErrorCode::Internal));
    }
}
