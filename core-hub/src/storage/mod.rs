//! Storage IO for the hub's tier-1 log and a local tier 2, behind a small object-safe trait.
//!
//! Every byte the WAL writes, and every file it creates, rolls, truncates or removes, goes
//! through [`Storage`], and so does every object of a `file://` tier 2 ([`StorageStore`], an
//! `object_store::ObjectStore` over this trait), so the crash-safety argument can be tested
//! rather than assumed (`Hub::open_on` opens the whole hub on a chosen storage):
//! - [`RealStorage`] is `std::fs` plus `fdatasync` (`File::sync_data`) and directory fsyncs;
//! - [`MemStorage`] keeps files in memory, tracks what is durable, and on
//!   [`MemStorage::crash`] throws away what a power cut may throw away: unsynced bytes are
//!   dropped, torn, or left as zeros, in any order within an fsync group, and directory
//!   entries that were not made durable by a directory sync are lost. It also injects EIO and
//!   ENOSPC at chosen operations, and a full disk by capacity.
//!
//! The model of durability is the POSIX one the WAL relies on: file contents (and length) are
//! durable after [`StorageFile::sync`] on that file; a new, renamed or removed directory entry
//! is durable only after [`Storage::sync_dir`] on its parent. Directories themselves are
//! assumed to exist once created: [`Storage::create_dir`] syncs every level it creates into
//! its parent before it returns.
//!
//! The SQLite catalog is not behind this trait: it stays on real files, and SQLite with
//! `synchronous=FULL` keeps a committed transaction and drops an uncommitted one.

mod mem;
mod object;

pub use mem::{CrashInfo, CrashMode, Fault, FaultError, MemStorage};
pub use object::StorageStore;

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

/// The kind of a storage operation, for fault injection and crash accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Create,
    Open,
    Append,
    WriteAt,
    Sync,
    Truncate,
    Rename,
    Remove,
    CreateDir,
    SyncDir,
}

/// An open file. Shared between the WAL's writer (which appends) and its committer (which
/// syncs), so every method takes `&self`.
pub trait StorageFile: Send + Sync + fmt::Debug {
    /// Appends all of `data` at the end of the file.
    fn append(&self, data: &[u8]) -> io::Result<()>;
    /// Writes `data` at `pos` (the WAL rewrites a file header in place).
    fn write_at(&self, data: &[u8], pos: u64) -> io::Result<()>;
    /// Makes the file's bytes and length durable (`fdatasync`).
    fn sync(&self) -> io::Result<()>;
    /// Cuts (or extends) the file to `len` bytes. Not durable until [`StorageFile::sync`].
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Reads exactly `buf.len()` bytes at `pos`.
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()>;
    /// The current length, including bytes not yet durable.
    fn len(&self) -> u64;
    /// True when the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The file operations the hub's tier-1 log and a local tier 2 need. Object safe, shared
/// between threads.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Creates `path` empty (truncating an existing file), open for reading and appending.
    /// The entry is durable after [`Storage::sync_dir`] of the parent.
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Opens an existing file for reading and appending at its end.
    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Cuts a file to `len` bytes, without syncing.
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Renames a file, replacing `to`. Durable after `sync_dir` of both parents.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file. Durable after `sync_dir` of its parent.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Creates a directory and its parents, durably: every level it creates is synced into
    /// its parent before this returns, so a power cut cannot take a directory away from
    /// files that were synced into it.
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// Makes the directory's entries durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Reads a whole file.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// The names of the files in a directory, sorted.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// The files and subdirectories of a directory, sorted by name (tier 2's listings).
    fn read_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>>;
    /// A file's length and last modification, including bytes not yet durable.
    fn stat(&self, path: &Path) -> io::Result<FileStat>;
    /// Bytes available to unprivileged writers on the file system holding `dir`, when known.
    fn free_bytes(&self, dir: &Path) -> Option<u64>;
}

/// One entry of [`Storage::read_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub is_dir: bool,
}

/// What [`Storage::stat`] tells about a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStat {
    pub len: u64,
    pub modified: SystemTime,
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealStorage;

impl RealStorage {
    /// A shared handle, as the WAL takes it.
    pub fn shared() -> Arc<dyn Storage> {
        Arc::new(RealStorage)
    }
}

/// `fs::create_dir_all`, with each directory it creates synced into its parent (top down), so
/// the new entries survive a power cut. Levels that already existed are not synced again.
pub fn create_dir_durable(dir: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .filter(|a| !a.as_os_str().is_empty())
        .take_while(|a| !a.is_dir())
        .collect();
    for level in missing.iter().rev() {
        match fs::create_dir(level) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && level.is_dir() => continue,
            Err(e) => return Err(e),
        }
        let parent = match level.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// A real file with its length tracked, so appends need no seek (`pwrite` at the end).
#[derive(Debug)]
struct RealFile {
    file: File,
    len: AtomicU64,
}

impl RealFile {
    fn shared(file: File) -> io::Result<Arc<dyn StorageFile>> {
        let len = AtomicU64::new(file.metadata()?.len());
        Ok(Arc::new(RealFile { file, len }))
    }

    /// After a failed write the length is whatever reached the file.
    fn refresh_len(&self) {
        if let Ok(m) = self.file.metadata() {
            self.len.store(m.len(), Ordering::Release);
        }
    }
}

impl StorageFile for RealFile {
    fn append(&self, data: &[u8]) -> io::Result<()> {
        let at = self.len.load(Ordering::Acquire);
        if let Err(e) = self.file.write_all_at(data, at) {
            self.refresh_len();
            return Err(e);
        }
        self.len.store(at + data.len() as u64, Ordering::Release);
        Ok(())
    }
    fn write_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        let r = self.file.write_all_at(data, pos);
        self.refresh_len();
        r
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)?;
        self.len.store(len, Ordering::Release);
        Ok(())
    }
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, pos)
    }
    fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }
}

fn open_rw(path: &Path, create: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(create)
        .open(path)
}

impl Storage for RealStorage {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        RealFile::shared(open_rw(path, true)?)
    }
    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        RealFile::shared(open_rw(path, false)?)
    }
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        open_rw(path, false)?.set_len(len)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        create_dir_durable(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
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
    fn read_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_file() || kind.is_dir() {
                out.push(DirEntry {
                    name: entry.file_name().to_string_lossy().into_owned(),
                    is_dir: kind.is_dir(),
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
    fn stat(&self, path: &Path) -> io::Result<FileStat> {
        let m = fs::metadata(path)?;
        if !m.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: not a file", path.display()),
            ));
        }
        Ok(FileStat {
            len: m.len(),
            modified: m.modified()?,
        })
    }
    fn free_bytes(&self, dir: &Path) -> Option<u64> {
        statvfs_free(dir)
    }
}

/// Bytes available to unprivileged writers on the file system holding `dir`.
#[allow(unsafe_code)]
fn statvfs_free(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain old data; all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_file_appends_at_its_tracked_end() {
        let dir = tempfile::tempdir().unwrap();
        let s = RealStorage;
        let path = dir.path().join("f");
        let f = s.create(&path).unwrap();
        f.append(b"hello ").unwrap();
        f.append(b"world").unwrap();
        f.set_len(5).unwrap();
        f.append(b"!").unwrap();
        f.sync().unwrap();
        s.sync_dir(dir.path()).unwrap();
        assert_eq!(s.read(&path).unwrap(), b"hello!");
        let g = s.open(&path).unwrap();
        assert_eq!(g.len(), 6);
        let mut buf = [0u8; 2];
        g.read_at(&mut buf, 4).unwrap();
        assert_eq!(&buf, b"o!");
        assert_eq!(s.list(dir.path()).unwrap(), vec!["f".to_string()]);
        s.create_dir(&dir.path().join("sub")).unwrap();
        let names: Vec<(String, bool)> = s
            .read_dir(dir.path())
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.is_dir))
            .collect();
        assert_eq!(names, [("f".to_string(), false), ("sub".to_string(), true)]);
        assert_eq!(s.stat(&path).unwrap().len, 6);
        assert!(
            s.stat(&dir.path().join("sub")).is_err(),
            "a directory is no file"
        );
        assert!(s.free_bytes(dir.path()).is_some());
    }
}
