//! A [`Storage`] wrapper that injects IO errors (EIO, ENOSPC) at chosen operations.
//!
//! Faults are deterministic: a fault fires on the `skip + 1`-th operation that matches its kind
//! (and optional path fragment), and either once or on every later match (`sticky`).
//! [`FaultyStorage::seeded`] derives one such fault from a seed for randomized tests.

use super::{OpKind, Storage, WriteFile};
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The error a fault returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultError {
    /// `EIO`: the device failed.
    Eio,
    /// `ENOSPC`: the file system is full.
    Enospc,
}

impl FaultError {
    fn to_io(self) -> io::Error {
        match self {
            FaultError::Eio => io::Error::from_raw_os_error(libc::EIO),
            FaultError::Enospc => io::Error::from_raw_os_error(libc::ENOSPC),
        }
    }
}

/// One injected fault.
#[derive(Debug, Clone)]
pub struct Fault {
    /// Only operations of this kind match; `None` matches every counted operation.
    pub op: Option<OpKind>,
    /// Only paths containing this fragment match.
    pub path_contains: Option<String>,
    /// Matching operations let through before the fault fires.
    pub skip: u64,
    pub error: FaultError,
    /// Keep failing every later matching operation.
    pub sticky: bool,
}

impl Fault {
    /// A fault on the first operation of `op`.
    pub fn on(op: OpKind, error: FaultError) -> Fault {
        Fault {
            op: Some(op),
            path_contains: None,
            skip: 0,
            error,
            sticky: false,
        }
    }
}

#[derive(Debug)]
struct FaultState {
    fault: Fault,
    seen: u64,
    fired: u64,
}

#[derive(Debug, Default)]
struct Faults {
    list: Mutex<Vec<FaultState>>,
}

impl Faults {
    fn check(&self, op: OpKind, path: &Path) -> io::Result<()> {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        for st in list.iter_mut() {
            let kind_ok = st.fault.op.is_none_or(|k| k == op);
            let path_ok = st
                .fault
                .path_contains
                .as_ref()
                .is_none_or(|f| path.to_string_lossy().contains(f.as_str()));
            if !(kind_ok && path_ok) {
                continue;
            }
            st.seen += 1;
            let due = st.seen > st.fault.skip && (st.fault.sticky || st.fired == 0);
            if due {
                st.fired += 1;
                return Err(st.fault.error.to_io());
            }
        }
        Ok(())
    }
}

/// Wraps a storage and fails chosen operations.
#[derive(Debug, Clone)]
pub struct FaultyStorage {
    inner: Arc<dyn Storage>,
    faults: Arc<Faults>,
}

impl FaultyStorage {
    /// No faults until [`FaultyStorage::add`] is called.
    pub fn new(inner: Arc<dyn Storage>) -> FaultyStorage {
        FaultyStorage {
            inner,
            faults: Arc::default(),
        }
    }

    /// One fault derived from `seed`: a random kind among appends, syncs and creates, after a
    /// random number (below `ops_max`) of matching operations, EIO or ENOSPC.
    pub fn seeded(inner: Arc<dyn Storage>, seed: u64, ops_max: u64) -> FaultyStorage {
        let mut x = seed ^ 0x5DEE_CE66_D1CE_4E5B;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let op = [
            OpKind::Append,
            OpKind::Sync,
            OpKind::Create,
            OpKind::SyncDir,
        ][(next() % 4) as usize];
        let error = if next() % 2 == 0 {
            FaultError::Eio
        } else {
            FaultError::Enospc
        };
        let f = FaultyStorage::new(inner);
        f.add(Fault {
            op: Some(op),
            path_contains: None,
            skip: next() % ops_max.max(1),
            error,
            sticky: true,
        });
        f
    }

    /// Adds a fault.
    pub fn add(&self, fault: Fault) {
        let mut list = self.faults.list.lock().unwrap_or_else(|e| e.into_inner());
        list.push(FaultState {
            fault,
            seen: 0,
            fired: 0,
        });
    }

    /// Removes every fault (the "disk" is healthy again).
    pub fn clear(&self) {
        self.faults
            .list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// How many faults have fired.
    pub fn fired(&self) -> u64 {
        self.faults
            .list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|s| s.fired)
            .sum()
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Box<dyn WriteFile>,
    faults: Arc<Faults>,
    path: std::path::PathBuf,
}

impl WriteFile for FaultyFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.faults.check(OpKind::Append, &self.path)?;
        self.inner.append(data)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.faults.check(OpKind::Sync, &self.path)?;
        self.inner.sync()
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
}

impl FaultyStorage {
    fn wrap(&self, path: &Path, inner: Box<dyn WriteFile>) -> Box<dyn WriteFile> {
        Box::new(FaultyFile {
            inner,
            faults: self.faults.clone(),
            path: path.to_path_buf(),
        })
    }
}

impl Storage for FaultyStorage {
    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        self.faults.check(OpKind::Create, path)?;
        let f = self.inner.create(path)?;
        Ok(self.wrap(path, f))
    }
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        self.faults.check(OpKind::OpenAppend, path)?;
        let f = self.inner.open_append(path)?;
        Ok(self.wrap(path, f))
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.faults.check(OpKind::Read, path)?;
        self.inner.read(path)
    }
    fn read_at(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.faults.check(OpKind::Read, path)?;
        self.inner.read_at(path, offset, len)
    }
    fn len(&self, path: &Path) -> io::Result<u64> {
        self.inner.len(path)
    }
    fn exists(&self, path: &Path) -> bool {
        self.inner.exists(path)
    }
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        self.faults.check(OpKind::Truncate, path)?;
        self.inner.truncate(path, len)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.faults.check(OpKind::Rename, from)?;
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.faults.check(OpKind::Remove, path)?;
        self.inner.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.faults.check(OpKind::CreateDir, dir)?;
        self.inner.create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.faults.check(OpKind::SyncDir, dir)?;
        self.inner.sync_dir(dir)
    }
    fn available_bytes(&self, dir: &Path) -> Option<u64> {
        self.inner.available_bytes(dir)
    }
}
