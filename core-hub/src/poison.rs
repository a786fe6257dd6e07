//! Stored poison: a committed block that cannot be decoded within the hub's limits.
//!
//! Ingest refuses a block whose records would exceed `ingest.block_decoded_bytes_max`
//! (`sync::decoded`), but a block can already be in the WAL when that matters: stored by a
//! build without the bound, or under a higher limit than the one in force now. Decoding such a
//! block would take the memory the bound exists to protect, and the readers that meet it
//! (tiering, the records API and stream readers, republish, the scrubber) run again after every
//! restart, so a crash there is a crash loop. Every reader of stored blocks therefore decodes
//! through [`decode_stored`]: a block that is over the limit or does not decode is sized and
//! refused before any record is built, **quarantined** in the tier-1 quarantine list the
//! scrubber keeps (`crate::scrub`, `quarantine.json`, skipped by every reader from then on),
//! logged once, counted on `/metrics` (`tributary_hub_stored_blocks_quarantined_total`,
//! `..._refused_total`, from [`crate::ingest::IngestStats`]), and the reader carries on
//! without its records.

use crate::catalog::BlockRow;
use crate::ingest::Hub;
use std::sync::atomic::Ordering;
use sync::block::{Block, BlockError};
use thiserror::Error;

/// A stored block that was quarantined instead of decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error(
    "stored block at hub offset {offset} (seqs {first_seq}..={last_seq}) is quarantined: {what}"
)]
pub struct Poison {
    pub offset: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub what: String,
}

/// Decodes the stored block of `row` within the hub's stored-block limits
/// ([`Hub::stored_decode_limits`]). One that is over them or does not decode is quarantined
/// and returned as [`Poison`], its records never built.
pub fn decode_stored(hub: &Hub, row: &BlockRow, block: &[u8]) -> Result<Block, Poison> {
    let limits = hub.stored_decode_limits();
    let result = sync::block::size_block(block, &limits).and_then(|sized| {
        let mut records = Vec::new();
        let header = sized.decode_into(&mut records)?;
        Ok(Block { header, records })
    });
    result.map_err(|e| quarantine(hub, row, &e))
}

/// Records `row` as poison: quarantined (persisted), logged and counted.
pub fn quarantine(hub: &Hub, row: &BlockRow, e: &BlockError) -> Poison {
    let stats = hub.stats();
    stats.stored_refused.fetch_add(1, Ordering::Relaxed);
    let poison = Poison {
        offset: row.hub_offset_base,
        first_seq: row.first_seq,
        last_seq: row.last_seq,
        what: e.to_string(),
    };
    let device = hub
        .device_name(row.device)
        .unwrap_or_else(|| format!("#{}", row.device));
    let stream = hub
        .stream_name(row.stream)
        .unwrap_or_else(|| format!("#{}", row.stream));
    let damaged = crate::scrub::Damaged {
        wal_file: row.wal_file,
        wal_pos: row.wal_pos,
        device: device.clone(),
        stream: stream.clone(),
        epoch: row.epoch,
        first_seq: row.first_seq,
        last_seq: row.last_seq,
        what: format!("does not decode within the limits: {e}"),
    };
    match crate::scrub::quarantine_block(hub, damaged) {
        Ok(true) => {
            stats.stored_quarantined.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                %device, %stream, epoch = %sync::epoch::format(row.epoch), first_seq = row.first_seq,
                last_seq = row.last_seq, wal_file = row.wal_file, wal_pos = row.wal_pos,
                error = %e,
                "stored block does not decode within the limits: quarantined, its records are not served"
            );
        }
        Ok(false) => {}
        Err(qe) => tracing::error!(
            %device, %stream, error = %e, quarantine_error = %qe,
            "stored block does not decode within the limits, and cannot be quarantined; skipped"
        ),
    }
    poison
}
