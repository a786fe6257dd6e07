//! An in-memory [`Storage`] that can simulate power loss.
//!
//! Each file (an inode) keeps its current bytes and the bytes known to be durable; the
//! namespace keeps the current path -> inode map and the durable one. `sync` on a file makes its
//! bytes durable; `sync_dir` makes the entries of that directory durable (creates, renames and
//! removes). [`MemStorage::crash`] throws away everything else, like a power cut would.
//!
//! A power cut rarely lands on a write boundary, so `crash` keeps a random prefix of each file's
//! unsynced appended bytes (seeded, so runs are reproducible): that is the torn tail recovery
//! must truncate. Unsynced bytes are never reordered or scrambled: we model a disk that writes
//! appended data in order, which is what the recovery scan relies on to tell a torn tail
//! (nothing valid after the fault) from a corrupt block (valid frames after it).
//!
//! A crash point makes the power cut happen *during* a chosen operation: the operation with
//! global index `k` fails, a random prefix of an in-flight append reaches the page cache, and
//! every later operation fails until [`MemStorage::crash`] is called.

use super::{OpKind, Storage, WriteFile};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Where a crash point landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashInfo {
    /// 1-based index of the operation that crashed.
    pub op_index: u64,
    pub op: OpKind,
    pub path: PathBuf,
    /// The file's length before the operation (0 for non-file operations).
    pub file_len: u64,
}

#[derive(Debug, Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
}

#[derive(Debug, Default)]
struct MemState {
    inodes: HashMap<u64, Inode>,
    next_inode: u64,
    live: BTreeMap<PathBuf, u64>,
    durable_names: BTreeMap<PathBuf, u64>,
    dirs: BTreeSet<PathBuf>,
    ops: u64,
    crash_at: Option<u64>,
    crashed: Option<CrashInfo>,
    rng: u64,
}

impl MemState {
    /// Counts an operation and fails it if it is the crash point or after it.
    fn begin(&mut self, op: OpKind, path: &Path, file_len: u64) -> io::Result<()> {
        if self.crashed.is_some() {
            return Err(crashed_err());
        }
        self.ops += 1;
        if self.crash_at == Some(self.ops) {
            let info = CrashInfo {
                op_index: self.ops,
                op,
                path: path.to_path_buf(),
                file_len,
            };
            self.crashed = Some(info);
            return Err(crashed_err());
        }
        Ok(())
    }

    fn next_rand(&mut self) -> u64 {
        // splitmix64: tiny, seeded, good enough to pick torn-tail lengths.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn inode_of(&self, path: &Path) -> io::Result<u64> {
        self.live.get(path).copied().ok_or_else(|| not_found(path))
    }

    fn check_parent(&self, path: &Path) -> io::Result<()> {
        match path.parent() {
            Some(p) if !p.as_os_str().is_empty() && !self.dirs.contains(p) => Err(not_found(p)),
            _ => Ok(()),
        }
    }
}

fn crashed_err() -> io::Error {
    io::Error::other("simulated power loss: storage is down until crash() is called")
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file", path.display()),
    )
}

/// In-memory files with an honest model of what survives a power cut. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct MemStorage {
    state: Arc<Mutex<MemState>>,
}

impl MemStorage {
    /// An empty storage whose torn tails are drawn from `seed`.
    pub fn with_seed(seed: u64) -> MemStorage {
        let s = MemStorage::default();
        s.lock().rng = seed;
        s
    }

    fn lock(&self) -> MutexGuard<'_, MemState> {
        // A panic while holding this lock is a test bug; keep going with the data as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Operations counted so far (everything but reads, lists and exists).
    pub fn ops(&self) -> u64 {
        self.lock().ops
    }

    /// Makes the operation with global 1-based index `op_index` the moment power is lost.
    pub fn set_crash_at(&self, op_index: u64) {
        self.lock().crash_at = Some(op_index);
    }

    /// Where the crash point landed, if it has been reached.
    pub fn crash_info(&self) -> Option<CrashInfo> {
        self.lock().crashed.clone()
    }

    /// Simulates power loss now: keeps only durable entries and durable bytes, plus a random
    /// prefix of each file's unsynced appended tail. Clears the crash point. Returns where the
    /// crash point landed, if one was reached.
    pub fn crash(&self) -> Option<CrashInfo> {
        let mut s = self.lock();
        s.live = s.durable_names.clone();
        let live: BTreeSet<u64> = s.live.values().copied().collect();
        s.inodes.retain(|id, _| live.contains(id));
        let ids: Vec<u64> = s.inodes.keys().copied().collect();
        for id in ids {
            let coin = s.next_rand();
            let inode = s.inodes.get_mut(&id).expect("listed");
            let durable_len = inode.durable.len();
            if inode.data.len() > durable_len && inode.data.starts_with(&inode.durable) {
                let extra = (inode.data.len() - durable_len) as u64;
                // Half the time nothing unsynced survives; otherwise a random prefix does.
                let keep = if coin & 1 == 0 {
                    0
                } else {
                    (coin >> 1) % (extra + 1)
                };
                inode.data.truncate(durable_len + keep as usize);
            } else {
                inode.data = inode.durable.clone();
            }
            inode.durable = inode.data.clone();
        }
        s.crash_at = None;
        s.crashed.take()
    }

    /// The bytes of a file as they are now, durable or not. For tests.
    pub fn contents(&self, path: &Path) -> Option<Vec<u8>> {
        let s = self.lock();
        let id = s.live.get(path)?;
        Some(s.inodes[id].data.clone())
    }

    /// Overwrites one byte of a file in place and makes it durable, to simulate bit rot.
    pub fn corrupt_byte(&self, path: &Path, offset: usize, xor: u8) -> io::Result<()> {
        let mut s = self.lock();
        let id = s.inode_of(path)?;
        let inode = s.inodes.get_mut(&id).expect("live inode");
        let len = inode.data.len();
        let b = inode
            .data
            .get_mut(offset)
            .ok_or_else(|| io::Error::other(format!("offset {offset} beyond {len}")))?;
        *b ^= xor;
        inode.durable = inode.data.clone();
        Ok(())
    }
}

#[derive(Debug)]
struct MemFile {
    state: Arc<Mutex<MemState>>,
    inode: u64,
    path: PathBuf,
}

impl MemFile {
    fn lock(&self) -> MutexGuard<'_, MemState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl WriteFile for MemFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        let mut s = self.lock();
        let len = s.inodes.get(&self.inode).map_or(0, |i| i.data.len() as u64);
        if let Err(e) = s.begin(OpKind::Append, &self.path, len) {
            if s.crashed
                .as_ref()
                .is_some_and(|c| c.op_index == s.ops && c.op == OpKind::Append)
            {
                // The cut landed mid-write: part of it may have reached the page cache.
                let keep = (s.next_rand() % (data.len() as u64 + 1)) as usize;
                if let Some(inode) = s.inodes.get_mut(&self.inode) {
                    inode.data.extend_from_slice(&data[..keep]);
                }
            }
            return Err(e);
        }
        let inode = s
            .inodes
            .get_mut(&self.inode)
            .ok_or_else(|| not_found(&self.path))?;
        inode.data.extend_from_slice(data);
        Ok(())
    }

    fn sync(&mut self) -> io::Result<()> {
        let mut s = self.lock();
        let len = s.inodes.get(&self.inode).map_or(0, |i| i.data.len() as u64);
        s.begin(OpKind::Sync, &self.path, len)?;
        let inode = s
            .inodes
            .get_mut(&self.inode)
            .ok_or_else(|| not_found(&self.path))?;
        inode.durable.clone_from(&inode.data);
        Ok(())
    }

    fn len(&self) -> u64 {
        self.lock()
            .inodes
            .get(&self.inode)
            .map_or(0, |i| i.data.len() as u64)
    }
}

impl Storage for MemStorage {
    fn create(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let mut s = self.lock();
        s.begin(OpKind::Create, path, 0)?;
        s.check_parent(path)?;
        let id = match s.live.get(path) {
            Some(&id) => {
                s.inodes.get_mut(&id).expect("live inode").data.clear();
                id
            }
            None => {
                s.next_inode += 1;
                let id = s.next_inode;
                s.inodes.insert(id, Inode::default());
                s.live.insert(path.to_path_buf(), id);
                id
            }
        };
        Ok(Box::new(MemFile {
            state: self.state.clone(),
            inode: id,
            path: path.to_path_buf(),
        }))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let mut s = self.lock();
        s.begin(OpKind::OpenAppend, path, 0)?;
        let id = s.inode_of(path)?;
        Ok(Box::new(MemFile {
            state: self.state.clone(),
            inode: id,
            path: path.to_path_buf(),
        }))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let s = self.lock();
        let id = s.inode_of(path)?;
        Ok(s.inodes[&id].data.clone())
    }

    fn read_at(&self, path: &Path, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let s = self.lock();
        let id = s.inode_of(path)?;
        let data = &s.inodes[&id].data;
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        data.get(start..start + len)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past end of file"))
    }

    fn len(&self, path: &Path) -> io::Result<u64> {
        let s = self.lock();
        let id = s.inode_of(path)?;
        Ok(s.inodes[&id].data.len() as u64)
    }

    fn exists(&self, path: &Path) -> bool {
        let s = self.lock();
        s.live.contains_key(path) || s.dirs.contains(path)
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut s = self.lock();
        let id = s.inode_of(path)?;
        let cur = s.inodes[&id].data.len() as u64;
        s.begin(OpKind::Truncate, path, cur)?;
        let inode = s.inodes.get_mut(&id).expect("live inode");
        inode.data.truncate(len as usize);
        // Like RealStorage, truncate syncs the file.
        inode.durable = inode.data.clone();
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.begin(OpKind::Rename, from, 0)?;
        s.check_parent(to)?;
        let id = s.inode_of(from)?;
        s.live.remove(from);
        s.live.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.begin(OpKind::Remove, path, 0)?;
        s.live
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| not_found(path))
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let s = self.lock();
        if !s.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        let names = s
            .live
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        Ok(names)
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.begin(OpKind::CreateDir, dir, 0)?;
        for anc in dir.ancestors() {
            if !anc.as_os_str().is_empty() {
                s.dirs.insert(anc.to_path_buf());
            }
        }
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.begin(OpKind::SyncDir, dir, 0)?;
        s.durable_names.retain(|p, _| p.parent() != Some(dir));
        let now: Vec<(PathBuf, u64)> = s
            .live
            .iter()
            .filter(|(p, _)| p.parent() == Some(dir))
            .map(|(p, id)| (p.clone(), *id))
            .collect();
        s.durable_names.extend(now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_entries_and_bytes_are_lost() {
        let m = MemStorage::with_seed(0);
        let dir = Path::new("/d");
        m.create_dir_all(dir).unwrap();
        let mut a = m.create(&dir.join("a")).unwrap();
        a.append(b"hello").unwrap();
        a.sync().unwrap();
        m.crash();
        // The file was never linked durably.
        assert!(!m.exists(&dir.join("a")));

        let mut b = m.create(&dir.join("b")).unwrap();
        b.append(b"durable").unwrap();
        b.sync().unwrap();
        m.sync_dir(dir).unwrap();
        b.append(b"-volatile").unwrap();
        m.crash();
        let got = m.read(&dir.join("b")).unwrap();
        assert!(got.starts_with(b"durable"));
        assert!(b"durable-volatile".starts_with(&got));
    }

    #[test]
    fn crash_point_freezes_storage() {
        let m = MemStorage::with_seed(1);
        m.create_dir_all(Path::new("/d")).unwrap();
        m.set_crash_at(3);
        let mut f = m.create(Path::new("/d/f")).unwrap();
        assert!(f.append(b"x").is_err());
        assert!(f.sync().is_err());
        let info = m.crash().unwrap();
        assert_eq!(info.op, OpKind::Append);
        assert!(!m.exists(Path::new("/d/f")));
    }
}
