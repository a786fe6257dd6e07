//! Reads committed frames back by position, verifying each.

#[allow(unused_imports)]
use super::*;

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

/// Reads committed frames by position. Safe to use while the writer appends: it only reads
/// ranges the catalog says are committed, and WAL files are append-only.
#[derive(Debug)]
pub struct WalReader {
    dir: PathBuf,
    files: Mutex<HashMap<u64, Arc<File>>>,
}

/// Open file handles kept by a reader.
pub(super) const READER_FILES_MAX: usize = 64;

impl WalReader {
    /// A reader over `dir`.
    pub fn new(dir: &Path) -> WalReader {
        WalReader {
            dir: dir.to_path_buf(),
            files: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn file(&self, first: u64) -> Result<Arc<File>, WalReadError> {
        let mut files = self.files.lock().expect("reader files lock");
        if let Some(f) = files.get(&first) {
            return Ok(f.clone());
        }
        let path = wal_file_path(&self.dir, first);
        let f = Arc::new(File::open(&path).map_err(|source| WalReadError::Io { path, source })?);
        if files.len() >= READER_FILES_MAX {
            files.clear();
        }
        files.insert(first, f.clone());
        Ok(f)
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
        let path = || wal_file_path(&self.dir, first);
        let mut buf = vec![0u8; frame_len as usize];
        file.read_exact_at(&mut buf, pos)
            .map_err(|source| WalReadError::Io {
                path: path(),
                source,
            })?;
        let corrupt = |what| WalReadError::Corrupt {
            path: path(),
            pos,
            what,
        };
        if buf.len() < FRAME_HEADER_LEN + ENTRY_HEADER_LEN {
            return Err(corrupt("frame shorter than its headers"));
        }
        let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
        if len + FRAME_HEADER_LEN != buf.len() {
            return Err(corrupt("frame length differs from the index"));
        }
        let payload = &buf[FRAME_HEADER_LEN..];
        if crc32c::crc32c(payload) != crc {
            return Err(corrupt("frame checksum mismatch"));
        }
        let header = EntryHeader::decode(payload).ok_or_else(|| corrupt("short entry header"))?;
        Ok((header, payload[ENTRY_HEADER_LEN..].to_vec()))
    }
}