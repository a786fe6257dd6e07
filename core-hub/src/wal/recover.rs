//! Recovery at open, and the rewind after a catalog commit failed for a full disk: both cut
//! the log back to the committed end.

#[allow(unused_imports)]
use super::*;

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
    /// The active file, positioned at its end.
    pub file: File,
    pub first: u64,
    /// Length of the active file in bytes, header included.
    pub len: u64,
    /// Uncommitted bytes dropped from the tail.
    pub dropped_bytes: u64,
}

/// Brings `dir` back to exactly the `committed_end` logical bytes the catalog covers.
pub fn recover(dir: &Path, committed_end: u64) -> Result<Recovered, WalOpenError> {
    std::fs::create_dir_all(dir).map_err(open_io(dir))?;
    let files = list_wal_files(dir).map_err(open_io(dir))?;
    let Some(idx) = files.iter().rposition(|&f| f <= committed_end) else {
        if committed_end != 0 {
            let what = "no WAL file covers that offset".to_string();
            return Err(WalOpenError::Missing {
                committed_end,
                what,
            });
        }
        return create_active(dir, 0, files.iter().map(|&f| wal_file_path(dir, f)));
    };
    let first = files[idx];
    let mut dropped = 0;
    for &later in &files[idx + 1..] {
        let path = wal_file_path(dir, later);
        dropped += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(&path).map_err(open_io(&path))?;
    }
    let path = wal_file_path(dir, first);
    let need = WAL_HEADER_LEN as u64 + (committed_end - first);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(open_io(&path))?;
    let len = file.metadata().map_err(open_io(&path))?.len();
    if len < need {
        let what = format!(
            "{} holds only {} of its {} committed bytes",
            path.display(),
            len,
            need
        );
        return Err(WalOpenError::Missing {
            committed_end,
            what,
        });
    }
    let mut header = [0u8; WAL_HEADER_LEN];
    file.read_exact(&mut header).map_err(open_io(&path))?;
    if !header_ok(&header) {
        if need != WAL_HEADER_LEN as u64 {
            return Err(WalOpenError::Corrupt {
                path,
                pos: 0,
                what: "bad WAL file header".into(),
            });
        }
        // A file rolled just before a crash, holding nothing committed: rewrite its header.
        file.write_all_at(&wal_file_header(), 0)
            .map_err(open_io(&path))?;
    }
    if len > need {
        dropped += len - need;
        file.set_len(need).map_err(open_io(&path))?;
    }
    file.sync_all().map_err(open_io(&path))?;
    sync_dir(dir).map_err(open_io(dir))?;
    verify_frames(&path, &mut file, need)?;
    file.seek(SeekFrom::Start(need)).map_err(open_io(&path))?;
    Ok(Recovered {
        file,
        first,
        len: need,
        dropped_bytes: dropped,
    })
}

/// Cuts the log back to `committed_end` while the hub runs, after a catalog commit failed for
/// a full disk: later files are removed and the active one is truncated. Unlike [`recover`]
/// it neither fsyncs nor re-verifies: no fsync failed, the bytes before the end are the
/// committed ones, and the bytes cut are past the committed end, where recovery drops them
/// anyway should the cut not survive a crash.
pub(super) fn rewind(dir: &Path, committed_end: u64) -> Result<Recovered, WalOpenError> {
    let files = list_wal_files(dir).map_err(open_io(dir))?;
    let Some(idx) = files.iter().rposition(|&f| f <= committed_end) else {
        let what = "no WAL file covers that offset".to_string();
        return Err(WalOpenError::Missing {
            committed_end,
            what,
        });
    };
    let first = files[idx];
    let mut dropped = 0;
    for &later in &files[idx + 1..] {
        let path = wal_file_path(dir, later);
        dropped += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(&path).map_err(open_io(&path))?;
    }
    let path = wal_file_path(dir, first);
    let need = WAL_HEADER_LEN as u64 + (committed_end - first);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(open_io(&path))?;
    let len = file.metadata().map_err(open_io(&path))?.len();
    if len < need {
        let what = format!("{} holds only {len} of its {need} bytes", path.display());
        return Err(WalOpenError::Missing {
            committed_end,
            what,
        });
    }
    if len > need {
        dropped += len - need;
        file.set_len(need).map_err(open_io(&path))?;
    }
    file.seek(SeekFrom::Start(need)).map_err(open_io(&path))?;
    Ok(Recovered {
        file,
        first,
        len: need,
        dropped_bytes: dropped,
    })
}

pub(super) fn create_active(
    dir: &Path,
    first: u64,
    stale: impl Iterator<Item = PathBuf>,
) -> Result<Recovered, WalOpenError> {
    let mut dropped = 0;
    for path in stale {
        dropped += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(&path).map_err(open_io(&path))?;
    }
    let path = wal_file_path(dir, first);
    let file = new_wal_file(&path).map_err(open_io(&path))?;
    sync_dir(dir).map_err(open_io(dir))?;
    Ok(Recovered {
        file,
        first,
        len: WAL_HEADER_LEN as u64,
        dropped_bytes: dropped,
    })
}

/// Creates a WAL file holding just its header, fsynced. The caller syncs the directory.
pub(super) fn new_wal_file(path: &Path) -> std::io::Result<File> {
    let file = create_wal_file(path)?;
    file.sync_all()?;
    Ok(file)
}

/// Creates a WAL file holding just its header, not yet synced: a failure here is a write
/// failure (possibly a full disk), not an fsync failure.
pub(super) fn create_wal_file(path: &Path) -> std::io::Result<File> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    file.write_all(&wal_file_header())?;
    Ok(file)
}

/// Opens a WAL file (one a failed group rolled into) and empties it down to a valid header,
/// positioned at its end. The header is rewritten only if its creation was cut short.
pub(super) fn empty_wal_file(path: &Path) -> std::io::Result<File> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let mut header = [0u8; WAL_HEADER_LEN];
    let intact = file.read_exact(&mut header).is_ok() && header_ok(&header);
    if !intact {
        file.set_len(0)?;
        file.write_all_at(&wal_file_header(), 0)?;
    }
    file.set_len(WAL_HEADER_LEN as u64)?;
    file.seek(SeekFrom::Start(WAL_HEADER_LEN as u64))?;
    Ok(file)
}

pub(super) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Checks every frame in `[header, end)` of the active file, streaming.
pub(super) fn verify_frames(path: &Path, file: &mut File, end: u64) -> Result<(), WalOpenError> {
    file.seek(SeekFrom::Start(WAL_HEADER_LEN as u64))
        .map_err(open_io(path))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, &*file);
    let mut pos = WAL_HEADER_LEN as u64;
    let mut payload = Vec::new();
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
        let len = u32::from_le_bytes(fh[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(fh[4..].try_into().expect("4 bytes"));
        let frame_end = pos + (FRAME_HEADER_LEN as u64) + u64::from(len);
        if len < ENTRY_HEADER_LEN as u32 || len > FRAME_BYTES_MAX || frame_end > end {
            return Err(corrupt(pos, "bad frame length"));
        }
        payload.resize(len as usize, 0);
        reader
            .read_exact(&mut payload)
            .map_err(|_| corrupt(pos, "short frame"))?;
        if crc32c::crc32c(&payload) != crc {
            return Err(corrupt(pos, "frame checksum mismatch"));
        }
        pos = frame_end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_truncates_to_the_committed_end() {
        let dir = tempfile::tempdir().unwrap();
        let rec = recover(dir.path(), 0).unwrap();
        assert_eq!(rec.len, WAL_HEADER_LEN as u64);
        drop(rec);
        // Uncommitted garbage after the committed end (0) is dropped, and a later file too.
        let path = wal_file_path(dir.path(), 0);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[1, 2, 3, 4, 5]).unwrap();
        std::fs::write(wal_file_path(dir.path(), 5), wal_file_header()).unwrap();
        let rec = recover(dir.path(), 0).unwrap();
        assert_eq!(rec.dropped_bytes, 5 + WAL_HEADER_LEN as u64);
        assert_eq!(list_wal_files(dir.path()).unwrap(), vec![0]);
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
}
