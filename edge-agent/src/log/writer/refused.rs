//! Blocks the hub refuses for good (`DECODED_TOO_LARGE`, or a `BAD_BLOCK` this agent cannot
//! decode either): resending them can never succeed, and a lane stuck behind one never moves.
//!
//! The writer quarantines such a block like a corrupt one found at recovery, in this order:
//! its frame is copied to `data_dir/quarantine/` (fsynced, with the directory), then its seq
//! range is recorded as a `Refused` gap marker in the stream's `gaps.log` (fsynced) and in the
//! index. From then on the block is never read for shipping ([`super::super::index`] skips
//! blocks inside gap markers) and the replicator reports the range to the hub as a `Corrupt`
//! gap, so the lane moves on and the records after it flow. The segment itself is left as it
//! is; retention deletes it once the hub has tiered past it. A crash between the two steps
//! leaves a quarantine copy and no marker: the block is refused again after the restart and
//! quarantined again (the copy is rewritten, not duplicated).

use super::Writer;
use crate::log::QuarantineError;
use crate::log::index::{Gap, GapReason};
use crate::log::recovery::gap_row;
use std::path::PathBuf;

impl Writer {
    /// Quarantines the stored blocks of stream `j`, `epoch`, that lie within
    /// `first_seq..=last_seq` (the range the hub refused), and records the range as a gap.
    /// Returns the quarantine file.
    pub(super) fn quarantine_refused(
        &mut self,
        j: usize,
        epoch: u64,
        first_seq: u64,
        last_seq: u64,
        why: &str,
    ) -> Result<PathBuf, QuarantineError> {
        let name = self.streams[j].name.clone();
        let (frames, blocks) = self.refused_frames(&name, epoch, first_seq, last_seq)?;
        let qdir = self.cfg.data_dir.join("quarantine");
        let qpath = qdir.join(format!("{name}-{epoch}-{first_seq}-{last_seq}.refused"));
        self.write_durably(&qdir, &qpath, &frames)
            .map_err(|e| QuarantineError::Io(io_context("quarantine", &qpath, &e)))?;
        let gap = Gap {
            epoch,
            first_seq,
            last_seq,
            reason: GapReason::Refused,
            records: last_seq - first_seq + 1,
        };
        self.append_gaps(j, &[gap])
            .map_err(|e| QuarantineError::Io(format!("gaps.log of {name}: {e}")))?;
        {
            let mut s = self.shared.lock();
            let idx = s.streams.get_mut(&name).expect("configured stream");
            if !idx.gaps.contains(&gap) {
                idx.gaps.push(gap);
                idx.gaps.sort_by_key(|g| (g.epoch, g.first_seq));
            }
            idx.quarantined_blocks += blocks;
        }
        if let Err(e) = self.catalog.add_gap(&gap_row(&name, &gap)) {
            tracing::warn!(error = %e, "catalog: recording a gap marker failed (gaps.log has it)");
        }
        tracing::error!(
            stream = %name,
            epoch = format_args!("{epoch:016x}"),
            first_seq,
            last_seq,
            quarantine = %qpath.display(),
            reason = why,
            "the hub refused this block for good; quarantined, and its seqs reported as a gap"
        );
        Ok(qpath)
    }

    /// The frames of the blocks of `(stream, epoch)` within `first..=last`, and how many.
    fn refused_frames(
        &self,
        stream: &str,
        epoch: u64,
        first: u64,
        last: u64,
    ) -> Result<(Vec<u8>, u64), QuarantineError> {
        let places: Vec<(PathBuf, u64, u64)> = {
            let s = self.shared.lock();
            let idx = s
                .streams
                .get(stream)
                .ok_or_else(|| QuarantineError::UnknownStream(stream.to_string()))?;
            idx.segments
                .iter()
                .filter(|g| g.epoch == epoch)
                .flat_map(|g| {
                    g.blocks
                        .iter()
                        .filter(|b| first <= b.first_seq && b.last_seq() <= last)
                        .map(|b| (g.path.clone(), b.offset, b.frame_bytes()))
                })
                .collect()
        };
        if places.is_empty() {
            return Err(QuarantineError::NotHeld {
                stream: stream.to_string(),
                epoch,
                first_seq: first,
                last_seq: last,
            });
        }
        let mut frames = Vec::new();
        for (path, offset, len) in &places {
            let bytes = self
                .storage
                .read_at(path, *offset, *len as usize)
                .map_err(|e| QuarantineError::Io(io_context("read", path, &e)))?;
            frames.extend_from_slice(&bytes);
        }
        Ok((frames, places.len() as u64))
    }

    /// Writes `bytes` to `path` in `dir`: create, append, fsync, directory fsync.
    fn write_durably(
        &self,
        dir: &std::path::Path,
        path: &std::path::Path,
        bytes: &[u8],
    ) -> std::io::Result<()> {
        self.storage.create_dir_all(dir)?;
        let mut f = self.storage.create(path)?;
        f.append(bytes)?;
        f.sync()?;
        self.storage.sync_dir(dir)?;
        let parent = crate::storage::parent_dir(dir);
        self.storage.sync_dir(&parent)
    }
}

fn io_context(op: &str, path: &std::path::Path, e: &std::io::Error) -> String {
    format!("{op} {}: {e}", path.display())
}
