//! Small append-only marker files: `epochs.log` (the epoch history) and `gaps.log` per stream
//! (gap markers, and the marks of records moved to a newer epoch by a rekey).
//!
//! They use the segment container and framing from `sync::segment` (a 16-byte header, then
//! `len | crc32c | payload` frames), so a torn tail is detected and truncated exactly like a
//! segment's. Entries are fixed-size and tiny; each append is fsynced before the caller
//! proceeds. These files, not the catalog, are what makes epochs and gap markers survive the
//! loss of `catalog.db`.

use super::index::{Gap, GapReason};
use crate::storage::{Storage, WriteFile};
use std::io;
use std::path::{Path, PathBuf};
use sync::segment::{
    FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, frame_header, scan_frames, segment_header,
};

pub(crate) const EPOCHS_FILE: &str = "epochs.log";
pub(crate) const GAPS_FILE: &str = "gaps.log";

const GAP_PAYLOAD_LEN: usize = 8 + 8 + 8 + 8 + 1;

/// Reads a marker file's entries. A missing file has none. A torn or corrupt tail is cut off
/// (durably) and reported as the number of bytes removed.
pub(crate) fn read_entries(storage: &dyn Storage, path: &Path) -> io::Result<(Vec<Vec<u8>>, u64)> {
    if !storage.exists(path) {
        return Ok((Vec::new(), 0));
    }
    let bytes = storage.read(path)?;
    if sync::segment::check_header(&bytes).is_err() {
        // A header that never became durable (crash while creating the file) or rot: salvage
        // nothing and start the file again. Callers log what was lost.
        let lost = bytes.len() as u64;
        storage.remove(path)?;
        storage.sync_dir(&crate::storage::parent_dir(path))?;
        return Ok((Vec::new(), lost));
    }
    let scan = scan_frames(&bytes, SEGMENT_HEADER_LEN);
    let entries = scan
        .frames
        .iter()
        .map(|f| bytes[f.block_offset() as usize..f.end() as usize].to_vec())
        .collect();
    let cut = bytes.len() as u64 - scan.valid_len;
    if cut > 0 {
        storage.truncate(path, scan.valid_len)?;
    }
    Ok((entries, cut))
}

/// An open marker file, appended to with an fsync per call.
#[derive(Debug)]
pub(crate) struct MarkerFile {
    file: Box<dyn WriteFile>,
}

impl MarkerFile {
    /// Opens `path` for appending, creating it durably (header, fsync, directory fsync) if absent.
    pub(crate) fn open(storage: &dyn Storage, path: &Path) -> io::Result<MarkerFile> {
        let file = if storage.exists(path) {
            storage.open_append(path)?
        } else {
            let mut f = storage.create(path)?;
            f.append(&segment_header())?;
            f.sync()?;
            storage.sync_dir(&crate::storage::parent_dir(path))?;
            f
        };
        Ok(MarkerFile { file })
    }

    /// Appends entries in one write and fsyncs them.
    pub(crate) fn append(&mut self, entries: &[Vec<u8>]) -> io::Result<()> {
        let mut buf = Vec::with_capacity(entries.iter().map(|e| e.len() + FRAME_HEADER_LEN).sum());
        for e in entries {
            buf.extend_from_slice(&frame_header(e));
            buf.extend_from_slice(e);
        }
        self.file.append(&buf)?;
        self.file.sync()
    }
}

/// Rewrites a marker file with exactly `entries`: tmp file, fsync, rename, directory fsync.
pub(crate) fn rewrite(storage: &dyn Storage, path: &Path, entries: &[Vec<u8>]) -> io::Result<()> {
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let mut f = storage.create(&tmp)?;
    let mut buf = segment_header().to_vec();
    for e in entries {
        buf.extend_from_slice(&frame_header(e));
        buf.extend_from_slice(e);
    }
    f.append(&buf)?;
    f.sync()?;
    storage.rename(&tmp, path)?;
    storage.sync_dir(&crate::storage::parent_dir(path))
}

pub(crate) fn encode_epoch(epoch: u64) -> Vec<u8> {
    epoch.to_le_bytes().to_vec()
}

pub(crate) fn decode_epoch(e: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(e.try_into().ok()?))
}

const MOVE_PAYLOAD_LEN: usize = 8 + 8 + 1;
const MOVE_TAG: u8 = 0xFF;

/// A rekey mark in `gaps.log`: the records of `epoch` from `from_seq` on were copied into a
/// newer epoch. A different payload length from a gap, so older readers skip it.
pub(crate) fn encode_move(epoch: u64, from_seq: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(MOVE_PAYLOAD_LEN);
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&from_seq.to_le_bytes());
    out.push(MOVE_TAG);
    out
}

pub(crate) fn decode_move(e: &[u8]) -> Option<(u64, u64)> {
    if e.len() != MOVE_PAYLOAD_LEN || e[16] != MOVE_TAG {
        return None;
    }
    let u = |at: usize| u64::from_le_bytes(e[at..at + 8].try_into().expect("8 bytes"));
    Some((u(0), u(8)))
}

pub(crate) fn encode_gap(g: &Gap) -> Vec<u8> {
    let mut out = Vec::with_capacity(GAP_PAYLOAD_LEN);
    out.extend_from_slice(&g.epoch.to_le_bytes());
    out.extend_from_slice(&g.first_seq.to_le_bytes());
    out.extend_from_slice(&g.last_seq.to_le_bytes());
    out.extend_from_slice(&g.records.to_le_bytes());
    out.push(match g.reason {
        GapReason::Dropped => 0,
        GapReason::Corrupt => 1,
        GapReason::Refused => 2,
    });
    out
}

pub(crate) fn decode_gap(e: &[u8]) -> Option<Gap> {
    if e.len() != GAP_PAYLOAD_LEN {
        return None;
    }
    let u = |at: usize| u64::from_le_bytes(e[at..at + 8].try_into().expect("8 bytes"));
    let reason = match e[32] {
        0 => GapReason::Dropped,
        1 => GapReason::Corrupt,
        2 => GapReason::Refused,
        _ => return None,
    };
    let g = Gap {
        epoch: u(0),
        first_seq: u(8),
        last_seq: u(16),
        records: u(24),
        reason,
    };
    (g.first_seq >= 1 && g.first_seq <= g.last_seq).then_some(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;

    #[test]
    fn gap_round_trip_and_torn_tail() {
        let m = MemStorage::with_seed(3);
        m.create_dir_all(Path::new("/s")).unwrap();
        let p = Path::new("/s/gaps.log");
        let g = Gap {
            epoch: 9,
            first_seq: 3,
            last_seq: 7,
            records: 5,
            reason: GapReason::Corrupt,
        };
        let mut f = MarkerFile::open(&m, p).unwrap();
        f.append(&[encode_gap(&g), encode_gap(&g)]).unwrap();
        drop(f);
        // A torn third entry.
        let mut raw = m.open_append(p).unwrap();
        raw.append(&[1, 2, 3]).unwrap();
        let (entries, cut) = read_entries(&m, p).unwrap();
        assert_eq!(cut, 3);
        assert_eq!(entries.len(), 2);
        assert_eq!(decode_gap(&entries[0]), Some(g));
    }
}
