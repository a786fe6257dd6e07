//! Storage IO for the local log, behind a small object-safe trait.
//!
//! Every byte the log writes goes through [`Storage`], so the crash-safety argument can be
//! tested rather than assumed:
//! - [`RealStorage`] is `std::fs` plus `fdatasync` (`File::sync_data`) and directory fsyncs;
//! - [`MemStorage`] keeps files in memory, tracks what is durable, and on [`MemStorage::crash`]
//!   forgets every create, rename and remove that was not made durable and leaves each file's
//!   unsynced suffix dropped, torn, zeroed, scrambled or with later writes but not earlier ones;
//! - [`FaultyStorage`] wraps another storage and injects EIO or ENOSPC at chosen operations.
//!
//! The model of durability is the POSIX one the log relies on: file contents are durable after
//! `sync` on that file; a new, renamed or removed directory entry is durable only after
//! `sync_dir` on its parent directory. Directories themselves are assumed to exist once
//! created (the log creates them at open and syncs their parents).

mod faulty;
mod mem;

pub use faulty::{Fault, FaultError, FaultyStorage};
pub use mem::{CrashInfo, CrashStats, MemStorage};

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The kind of a storage operation, used by fault injection and crash accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Create,
    OpenAppend,
    Append,
    Sync,
    Truncate,
    Rename,
    Remove,
    CreateDir,
    SyncDir,
    Read,
}

/// A file open for appending. Owned by exactly one writer.
pub trait WriteFile: Send + fmt::Debug {
    /// Appends all of `data` at the end of the file.
    fn append(&mut self, data: &[u8]) -> io::Result<()>;
    /// Makes every appended byte durable (fdatasync).
    fn sync(&mut self) -> io::Result<()>;
    /// Current length, including bytes not yet durable.
    fn len(&self) -> u64;
    /// True when the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The file operations the local log needs. Object safe, shared between threads.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Creates `path` empty (truncating an existing file) and opens it for appending.
    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>>;
    /// Opens an existing file for appending at its end.
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WriteFile>>;
    /// Reads a whole file.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Reads exactly `len` bytes at `offset`.
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>>;
    /// The file's length.
    fn len(&self, path: &Path) -> io::Result<u64>;
    /// True when `path` exists (file or directory).
    fn exists(&self, path: &Path) -> bool;
    /// Shrinks a file to `len` bytes and makes the new length durable.
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Renames a file, replacing `to`. Durable after `sync_dir` of both parents.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file. Durable after `sync_dir` of its parent.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// The names of the entries of a directory (files only), sorted.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates a directory and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Makes the directory's entries durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Bytes free on the file system holding `dir`, when the implementation knows. Advisory
    /// only: the log enforces `disk_bytes_max` from its own accounting.
    fn available_bytes(&self, _dir: &Path) -> Option<u64> {
        None
    }
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealStorage;

#[derive(Debug)]
struct RealFile {
    file: File,
    len: u64,
}

impl WriteFile for RealFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all(data)?;
        self.len += data.len() as u64;
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> u64 {
        self.len
    }
}

impl Storage for RealStorage {
    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(path)?;
        Ok(Box::new(RealFile { file, len: 0 }))
    }
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let file = OpenOptions::new().append(true).open(path)?;
        let len = file.metadata()?.len();
        Ok(Box::new(RealFile { file, len }))
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let file = File::open(path)?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    }
    fn len(&self, path: &Path) -> io::Result<u64> {
        Ok(fs::metadata(path)?.len())
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(path)?;
        file.set_len(len)?;
        file.sync_all()
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        names.sort();
        Ok(names)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// The parent directory of `path`, for `sync_dir` after creating or removing it.
pub fn parent_dir(path: &Path) -> PathBuf {
    path.parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}
