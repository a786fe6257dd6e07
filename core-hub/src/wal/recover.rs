//! Cutting the log back to the committed end: at open ([`recover`]), and while the hub runs
//! after a catalog commit failed for a full disk ([`rewind`]). Both go through one
//! [`cut_to`]; recovery additionally repairs a header cut short, fsyncs the cut, and
//! re-verifies every committed frame of the active file.

use super::format::{
    FrameHeader, WAL_HEADER_LEN, header_ok, list_wal_files_in, verify_frame, wal_file_header,
    wal_file_path,
};
use crate::catalog::CatalogError;
use crate::storage::{RealStorage, Storage, StorageFile};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use sync::segment::FRAME_HEADER_LEN;
use thiserror::Error;

/// Why the WAL could not be opened.
#[derive(Debug, Error)]
pub enum WalOpenError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the catalog says the WAL holds {committed_end} bytes, but {what}")]
    Missing { committed_end: u64, what: String },
    #[error("{path}: committed WAL data is damaged at byte {pos}: {what}")]
    Corrupt {
        path: PathBuf,
        pos: u64,
        what: String,
    },
    #[error("the catalog cannot be read for the WAL's committed end")]
    Catalog {
        #[source]
        source: CatalogError,
    },
}

pub(super) fn open_io(path: &Path) -> impl FnOnce(std::io::Error) -> WalOpenError + '_ {
    move |source| WalOpenError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What recovery found.
#[derive(Debug)]
pub struct Recovered {
    /// The active file; appends go to its end.
    pub file: Arc<dyn StorageFile>,
    pub first: u64,
    /// Length of the active file in bytes, header included.
    pub len: u64,
    /// Uncommitted bytes dropped from the tail.
    pub dropped_bytes: u64,
}

/// Which cut: at open, or while running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// At open, after a crash: repair, fsync and re-verify.
    Recover,
    /// While running, after a catalog commit failed for a full disk. No fsync failed and the
    /// bytes before the end are the committed ones, so nothing is re-verified; the truncation
    /// is not synced either (the bytes cut are past the committed end, where recovery drops
    /// them anyway). Removed files are: one that came back after a crash would start inside
    /// the range the active file goes on to commit. `sync_dir` is false only under a
    /// test-only mutation.
    Rewind { sync_dir: bool },
}

/// Brings `dir` on the real file system back to exactly the `committed_end` logical bytes the
/// catalog covers.
pub fn recover(dir: &Path, committed_end: u64) -> Result<Recovered, WalOpenError> {
    recover_in(&RealStorage, dir, committed_end)
}

/// As [`recover`], on `storage`.
pub fn recover_in(
    storage: &dyn Storage,
    dir: &Path,
    committed_end: u64,
) -> Result<Recovered, WalOpenError> {
    storage.create_dir(dir).map_err(open_io(dir))?;
    cut_to(storage, dir, committed_end, Cut::Recover)
}

/// Cuts the log back to `committed_end` while the hub runs: later files are removed and the
/// active one is truncated. See [`Cut::Rewind`] for what it syncs and why it does not verify.
pub(super) fn rewind(
    storage: &dyn Storage,
    dir: &Path,
    committed_end: u64,
    sync_dir: bool,
) -> Result<Recovered, WalOpenError> {
    cut_to(storage, dir, committed_end, Cut::Rewind { sync_dir })
}

/// The one cut both recovery and rewind make: the file holding `end` becomes the active file,
/// cut to `end`, and every later file is removed.
fn cut_to(
    storage: &dyn Storage,
    dir: &Path,
    end: u64,
    cut: Cut,
) -> Result<Recovered, WalOpenError> {
    let files = list_wal_files_in(storage, dir).map_err(open_io(dir))?;
    let Some(idx) = files.iter().rposition(|&f| f <= end) else {
        if end != 0 || cut != Cut::Recover {
            let what = "no WAL file covers that offset".to_string();
            return Err(WalOpenError::Missing {
                committed_end: end,
                what,
            });
        }
        return create_active(storage, dir, &files);
    };
    let first = files[idx];
    let later = &files[idx + 1..];
    let mut dropped = remove_files(storage, dir, later)?;
    if cut == (Cut::Rewind { sync_dir: true }) && !later.is_empty() {
        // As after cutting off a group: the removals are durable before the log grows
        // again past where those files started (see `Writer::cut_group`).
        storage.sync_dir(dir).map_err(open_io(dir))?;
    }
    let path = wal_file_path(dir, first);
    let need = WAL_HEADER_LEN as u64 + (end - first);
    let file = storage.open(&path).map_err(open_io(&path))?;
    let len = file.len();
    if len < need {
        let what = format!("{} holds only {len} of its {need} bytes", path.display());
        return Err(WalOpenError::Missing {
            committed_end: end,
            what,
        });
    }
    if cut == Cut::Recover {
        repair_header(&path, &*file, need)?;
    }
    if len > need {
        dropped += len - need;
        file.set_len(need).map_err(open_io(&path))?;
    }
    assert_eq!(
        file.len(),
        need,
        "the active file ends at the committed end"
    );
    if cut == Cut::Recover {
        file.sync().map_err(open_io(&path))?;
        storage.sync_dir(dir).map_err(open_io(dir))?;
        verify_frames(&path, &file, need)?;
    }
    Ok(Recovered {
        file,
        first,
        len: need,
        dropped_bytes: dropped,
    })
}

/// Removes `files` (all past the committed end), returning the bytes they held.
fn remove_files(storage: &dyn Storage, dir: &Path, files: &[u64]) -> Result<u64, WalOpenError> {
    let mut dropped = 0;
    for &f in files {
        let path = wal_file_path(dir, f);
        dropped += storage.open(&path).map_or(0, |h| h.len());
        storage.remove(&path).map_err(open_io(&path))?;
    }
    Ok(dropped)
}

/// A bad header is damage, unless the file holds nothing committed: a file rolled just before
/// a crash, whose header never reached the disk, gets its header rewritten.
fn repair_header(path: &Path, file: &dyn StorageFile, need: u64) -> Result<(), WalOpenError> {
    let mut header = [0u8; WAL_HEADER_LEN];
    let read = file.read_at(&mut header, 0);
    if read.is_ok() && header_ok(&header) {
        return Ok(());
    }
    if need != WAL_HEADER_LEN as u64 {
        return Err(WalOpenError::Corrupt {
            path: path.to_path_buf(),
            pos: 0,
            what: "bad WAL file header".into(),
        });
    }
    file.write_at(&wal_file_header(), 0).map_err(open_io(path))
}

/// The first WAL file, at offset 0, after removing `stale` files that start past it.
fn create_active(
    storage: &dyn Storage,
    dir: &Path,
    stale: &[u64],
) -> Result<Recovered, WalOpenError> {
    let dropped = remove_files(storage, dir, stale)?;
    let path = wal_file_path(dir, 0);
    let file = new_wal_file(storage, &path).map_err(open_io(&path))?;
    storage.sync_dir(dir).map_err(open_io(dir))?;
    Ok(Recovered {
        file,
        first: 0,
        len: WAL_HEADER_LEN as u64,
        dropped_bytes: dropped,
    })
}

/// Creates a WAL file holding just its header, fsynced. The caller syncs the directory.
fn new_wal_file(storage: &dyn Storage, path: &Path) -> std::io::Result<Arc<dyn StorageFile>> {
    let file = create_wal_file(storage, path)?;
    file.sync()?;
    Ok(file)
}

/// Creates a WAL file holding just its header, not yet synced: a failure here is a write
/// failure (possibly a full disk), not an fsync failure.
pub(super) fn create_wal_file(
    storage: &dyn Storage,
    path: &Path,
) -> std::io::Result<Arc<dyn StorageFile>> {
    let file = storage.create(path)?;
    file.append(&wal_file_header())?;
    Ok(file)
}

/// Opens a WAL file (one a failed group rolled into) and empties it down to a valid header.
/// The header is rewritten only if its creation was cut short.
pub(super) fn empty_wal_file(
    storage: &dyn Storage,
    path: &Path,
) -> std::io::Result<Arc<dyn StorageFile>> {
    let file = storage.open(path)?;
    let mut header = [0u8; WAL_HEADER_LEN];
    let intact = file.read_at(&mut header, 0).is_ok() && header_ok(&header);
    if !intact {
        file.set_len(0)?;
        file.append(&wal_file_header())?;
    }
    file.set_len(WAL_HEADER_LEN as u64)?;
    Ok(file)
}

/// A [`Read`] over `[pos, end)` of a storage file, for buffered scanning.
struct Cursor<'a> {
    file: &'a dyn StorageFile,
    pos: u64,
    end: u64,
}

impl Read for Cursor<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min((self.end - self.pos) as usize);
        self.file.read_at(&mut buf[..n], self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// Checks every frame in `[header, end)` of the active file, streaming.
fn verify_frames(path: &Path, file: &Arc<dyn StorageFile>, end: u64) -> Result<(), WalOpenError> {
    let mut pos = WAL_HEADER_LEN as u64;
    let cursor = Cursor {
        file: &**file,
        pos,
        end,
    };
    let mut reader = BufReader::with_capacity(1 << 20, cursor);
    let mut frame = Vec::new();
    let corrupt = |pos: u64, what: &str| WalOpenError::Corrupt {
        path: path.to_path_buf(),
        pos,
        what: what.into(),
    };
    while pos < end {
        let mut fh = [0u8; FRAME_HEADER_LEN];
        reader
            .read_exact(&mut fh)
            .map_err(|_| corrupt(pos, "short frame header"))?;
        let header = FrameHeader::decode(&fh);
        let frame_end = pos + (FRAME_HEADER_LEN as u64) + u64::from(header.payload_len);
        if !header.len_ok() || frame_end > end {
            return Err(corrupt(pos, "bad frame length"));
        }
        frame.clear();
        frame.extend_from_slice(&fh);
        frame.resize(FRAME_HEADER_LEN + header.payload_len as usize, 0);
        reader
            .read_exact(&mut frame[FRAME_HEADER_LEN..])
            .map_err(|_| corrupt(pos, "short frame"))?;
        verify_frame(&frame).map_err(|e| corrupt(pos, &e.to_string()))?;
        pos = frame_end;
    }
    assert_eq!(pos, end, "frames end exactly at the committed end");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{CrashMode, MemStorage};

    #[test]
    fn recovery_truncates_to_the_committed_end() {
        let dir = tempfile::tempdir().unwrap();
        let rec = recover(dir.path(), 0).unwrap();
        assert_eq!(rec.len, WAL_HEADER_LEN as u64);
        // Uncommitted garbage after the committed end (0) is dropped, and a later file too.
        rec.file.append(&[1, 2, 3, 4, 5]).unwrap();
        drop(rec);
        let path = wal_file_path(dir.path(), 0);
        std::fs::write(wal_file_path(dir.path(), 5), wal_file_header()).unwrap();
        let rec = recover(dir.path(), 0).unwrap();
        assert_eq!(rec.dropped_bytes, 5 + WAL_HEADER_LEN as u64);
        assert_eq!(super::super::list_wal_files(dir.path()).unwrap(), vec![0]);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            WAL_HEADER_LEN as u64
        );
    }

    #[test]
    fn recovery_refuses_missing_committed_bytes() {
        let dir = tempfile::tempdir().unwrap();
        drop(recover(dir.path(), 0).unwrap());
        assert!(matches!(
            recover(dir.path(), 100),
            Err(WalOpenError::Missing { .. })
        ));
    }

    #[test]
    fn a_header_that_never_reached_the_disk_is_rewritten_only_if_nothing_is_committed() {
        let m = MemStorage::with_seed(9);
        let dir = Path::new("/wal");
        drop(recover_in(&m, dir, 0).unwrap());
        let path = wal_file_path(dir, 0);
        let f = m.open(&path).unwrap();
        f.write_at(&[0u8; WAL_HEADER_LEN], 0).unwrap();
        f.append(b"frames").unwrap();
        f.sync().unwrap();
        m.crash(CrashMode::Drop);
        assert!(matches!(
            recover_in(&m, dir, 6),
            Err(WalOpenError::Corrupt { pos: 0, .. })
        ));
        let rec = recover_in(&m, dir, 0).unwrap();
        assert_eq!(rec.len, WAL_HEADER_LEN as u64);
        assert_eq!(m.read(&path).unwrap(), wal_file_header());
    }

    #[test]
    fn rewind_cuts_without_recreating() {
        let m = MemStorage::with_seed(10);
        let dir = Path::new("/wal");
        let rec = recover_in(&m, dir, 0).unwrap();
        rec.file.append(b"uncommitted").unwrap();
        let rec = rewind(&m, dir, 0, true).unwrap();
        assert_eq!(rec.dropped_bytes, 11);
        assert_eq!(rec.file.len(), WAL_HEADER_LEN as u64);
        assert!(matches!(
            rewind(&m, Path::new("/none"), 0, true),
            Err(WalOpenError::Io { .. })
        ));
    }
}
