//! Reads committed frames back by position, each verified by the one [`read_verified`]
//! (the check recovery applies too, `format::verify_frame`).

use super::format::{EntryHeader, FrameError, list_wal_files_in, verify_frame, wal_file_path};
use crate::catalog::BlockRow;
use crate::storage::{Storage, StorageFile};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use thiserror::Error;

/// Why a committed frame could not be read back.
#[derive(Debug, Error)]
pub enum WalReadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: frame at {pos} is damaged: {what}")]
    Corrupt {
        path: PathBuf,
        pos: u64,
        what: &'static str,
    },
}

impl FrameError {
    /// The damage, as [`WalReadError::Corrupt`] names it.
    pub fn what(self) -> &'static str {
        match self {
            FrameError::Short => "frame shorter than its headers",
            FrameError::BadLength => "frame length differs from the index",
            FrameError::Checksum => "frame checksum mismatch",
        }
    }
}

/// Reads committed frames by position. Safe to use while the writer appends: it only reads
/// ranges the catalog says are committed, and WAL files are append-only.
#[derive(Debug)]
pub struct WalReader {
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    files: Mutex<HashMap<u64, Arc<dyn StorageFile>>>,
}

/// Open file handles kept by a reader.
const READER_FILES_MAX: usize = 64;

impl WalReader {
    /// A reader over `dir` on `storage`.
    pub fn with_storage(storage: Arc<dyn Storage>, dir: &Path) -> WalReader {
        WalReader {
            storage,
            dir: dir.to_path_buf(),
            files: Mutex::new(HashMap::new()),
        }
    }

    fn file(&self, first: u64) -> Result<Arc<dyn StorageFile>, WalReadError> {
        let mut files = self.files.lock().expect("reader files lock");
        if let Some(f) = files.get(&first) {
            return Ok(f.clone());
        }
        let path = wal_file_path(&self.dir, first);
        let f = self
            .storage
            .open(&path)
            .map_err(|source| WalReadError::Io { path, source })?;
        if files.len() >= READER_FILES_MAX {
            files.clear();
        }
        files.insert(first, f.clone());
        Ok(f)
    }

    /// The WAL files, by first logical offset.
    pub fn files(&self) -> std::io::Result<Vec<u64>> {
        list_wal_files_in(&*self.storage, &self.dir)
    }

    /// Removes WAL file `first` once tiering has recorded its eviction, and forgets its
    /// handle. Returns the bytes it held (0 if it was gone already). The removal needs no
    /// directory fsync: should it not survive a crash, tiering removes the file again at open,
    /// since it lies below the recorded tier-1 floor.
    pub fn evict(&self, first: u64) -> std::io::Result<u64> {
        let path = wal_file_path(&self.dir, first);
        let len = self.storage.open(&path).map_or(0, |f| f.len());
        self.forget(first);
        match self.storage.remove(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            r => r.map(|()| len),
        }
    }

    /// Drops a cached handle, e.g. after tiering removed the file.
    pub fn forget(&self, first: u64) {
        self.files.lock().expect("reader files lock").remove(&first);
    }

    /// Reads and verifies the frame of `row`, returning its entry header and block bytes.
    pub fn read(&self, row: &BlockRow) -> Result<(EntryHeader, Vec<u8>), WalReadError> {
        self.read_at(row.wal_file, row.wal_pos, row.frame_len)
    }

    /// Reads and verifies the frame at `pos` in WAL file `first`.
    pub fn read_at(
        &self,
        first: u64,
        pos: u64,
        frame_len: u32,
    ) -> Result<(EntryHeader, Vec<u8>), WalReadError> {
        let file = self.file(first)?;
        read_verified(&*file, pos, frame_len).map_err(|e| match e {
            ReadError::Io(source) => WalReadError::Io {
                path: wal_file_path(&self.dir, first),
                source,
            },
            ReadError::Frame(f) => WalReadError::Corrupt {
                path: wal_file_path(&self.dir, first),
                pos,
                what: f.what(),
            },
        })
    }
}

/// Why [`read_verified`] failed.
#[derive(Debug)]
pub(super) enum ReadError {
    Io(std::io::Error),
    Frame(FrameError),
}

/// Reads the `frame_len`-byte frame at `pos` and verifies it.
pub(super) fn read_verified(
    file: &dyn StorageFile,
    pos: u64,
    frame_len: u32,
) -> Result<(EntryHeader, Vec<u8>), ReadError> {
    let mut buf = vec![0u8; frame_len as usize];
    file.read_at(&mut buf, pos).map_err(ReadError::Io)?;
    let (header, block) = verify_frame(&buf).map_err(ReadError::Frame)?;
    Ok((header, block.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemStorage;
    use crate::wal::format::{KIND_BLOCK, WAL_HEADER_LEN, encode_frame, frame_len};

    #[test]
    fn reads_back_what_was_framed_and_names_damage() {
        let m = MemStorage::with_seed(4);
        let dir = Path::new("/wal");
        m.create_dir(dir).unwrap();
        let f = m.create(&wal_file_path(dir, 0)).unwrap();
        let h = EntryHeader {
            kind: KIND_BLOCK,
            device: 1,
            stream: 1,
            count: 1,
            epoch: 0,
            first_seq: 1,
            hub_offset_base: 0,
            ingest_ts: 0,
            checksum: 0,
        };
        let mut frame = vec![0u8; WAL_HEADER_LEN];
        encode_frame(&mut frame, &h, b"block");
        f.append(&frame).unwrap();
        let r = WalReader::with_storage(Arc::new(m.clone()), dir);
        let len = frame_len(5) as u32;
        let (got, block) = r.read_at(0, WAL_HEADER_LEN as u64, len).unwrap();
        assert_eq!((got, block.as_slice()), (h, &b"block"[..]));
        let err = r.read_at(0, WAL_HEADER_LEN as u64, len - 1).unwrap_err();
        assert!(matches!(err, WalReadError::Corrupt { what, .. } if what.contains("length")));
        assert!(matches!(r.read_at(8, 0, len), Err(WalReadError::Io { .. })));
        assert_eq!(r.files().unwrap(), vec![0]);
        assert_eq!(r.evict(0).unwrap(), frame.len() as u64);
        assert_eq!(r.evict(0).unwrap(), 0);
        assert!(r.files().unwrap().is_empty());
    }
}
