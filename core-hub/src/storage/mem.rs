//! An in-memory [`Storage`] that simulates power loss and injects IO faults.
//!
//! Each file (an inode) keeps its current bytes, the bytes known to be durable, and the writes
//! and length changes made since its last `sync` (its fsync group). The namespace keeps the
//! current path -> inode map and the durable one: `sync_dir` makes a directory's creates,
//! renames and removes durable. [`MemStorage::crash`] throws away everything else, like a
//! power cut would, in one of the [`CrashMode`]s: the unsynced writes of a file are dropped,
//! torn at a point, left as zeros (the size reached the disk, the data did not), or any subset
//! of them survives, each whole, torn or as zeros, in any order.
//!
//! A crash point makes the power cut happen *during* a chosen operation: the operation with
//! global index `k` fails (an append at the crash point leaves a random prefix in the page
//! cache), and every later operation fails until [`MemStorage::crash`] is called.
//!
//! Faults ([`Fault`]) make matching operations fail with EIO or ENOSPC without a crash; a
//! capacity ([`MemStorage::set_capacity`]) makes appends fail with ENOSPC once the files hold
//! that many bytes (the part that fits is written, as a real file system does).
//!
//! Randomness comes from one seed, so runs are reproducible.

use super::{DirEntry, FileStat, OpKind, Storage, StorageFile};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

/// Where a crash point landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashInfo {
    /// 1-based index of the operation that crashed.
    pub op_index: u64,
    pub op: OpKind,
    pub path: PathBuf,
    /// The file's length before the operation (0 for directory operations).
    pub file_len: u64,
}

/// What a power cut does to the writes a file received since its last sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrashMode {
    /// None of them survives.
    Drop,
    /// They survive in order up to a random point, the write at that point torn.
    Torn,
    /// The file keeps the length they gave it, but their bytes read as zeros.
    Zeros,
    /// Each survives or not on its own: whole, torn, as zeros, or not at all.
    AnyOrder,
}

impl CrashMode {
    /// Every mode, for drawing one at random.
    pub const ALL: [CrashMode; 4] = [
        CrashMode::Drop,
        CrashMode::Torn,
        CrashMode::Zeros,
        CrashMode::AnyOrder,
    ];
}

/// The error a fault returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultError {
    /// `EIO`: the device failed.
    Eio,
    /// `ENOSPC`: the file system is full.
    Enospc,
    /// `EMFILE`: the process has no file descriptor left (a create or open allocates one).
    Emfile,
}

impl FaultError {
    fn to_io(self) -> io::Error {
        match self {
            FaultError::Eio => io::Error::from_raw_os_error(libc::EIO),
            FaultError::Enospc => io::Error::from_raw_os_error(libc::ENOSPC),
            FaultError::Emfile => io::Error::from_raw_os_error(libc::EMFILE),
        }
    }
}

/// One injected fault: it fires on the `skip + 1`-th matching operation, once or on every
/// later match (`sticky`).
#[derive(Debug, Clone)]
pub struct Fault {
    /// Only operations of this kind match; `None` matches every counted operation.
    pub op: Option<OpKind>,
    /// Only paths containing this fragment match.
    pub path_contains: Option<String>,
    /// Matching operations let through before the fault fires.
    pub skip: u64,
    pub error: FaultError,
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
    done: bool,
}

/// A change since the file's last sync.
#[derive(Debug, Clone)]
enum Pending {
    Write { pos: usize, bytes: Vec<u8> },
    SetLen(usize),
}

#[derive(Debug, Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
    pending: Vec<Pending>,
    /// The last write or length change (`None`: never changed).
    modified: Option<SystemTime>,
}

impl Inode {
    fn write(&mut self, pos: usize, bytes: &[u8]) {
        self.modified = Some(SystemTime::now());
        if self.data.len() < pos + bytes.len() {
            self.data.resize(pos + bytes.len(), 0);
        }
        self.data[pos..pos + bytes.len()].copy_from_slice(bytes);
        self.pending.push(Pending::Write {
            pos,
            bytes: bytes.to_vec(),
        });
    }

    fn set_len(&mut self, len: usize) {
        self.modified = Some(SystemTime::now());
        self.data.resize(len, 0);
        self.pending.push(Pending::SetLen(len));
    }

    fn sync(&mut self) {
        self.durable.clone_from(&self.data);
        self.pending.clear();
    }
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
    faults: Vec<FaultState>,
    faults_fired: u64,
    capacity: Option<u64>,
    rng: u64,
}

impl MemState {
    /// Counts an operation; fails it at or after the crash point, or when a fault matches.
    fn begin(&mut self, op: OpKind, path: &Path, file_len: u64) -> io::Result<()> {
        if self.crashed.is_some() {
            return Err(crashed_err());
        }
        self.ops += 1;
        if self.crash_at == Some(self.ops) {
            self.crashed = Some(CrashInfo {
                op_index: self.ops,
                op,
                path: path.to_path_buf(),
                file_len,
            });
            return Err(crashed_err());
        }
        match self.fault_for(op, path) {
            Some(e) => {
                self.faults_fired += 1;
                Err(e.to_io())
            }
            None => Ok(()),
        }
    }

    fn fault_for(&mut self, op: OpKind, path: &Path) -> Option<FaultError> {
        for st in self.faults.iter_mut().filter(|s| !s.done) {
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
            if st.seen > st.fault.skip {
                st.done = !st.fault.sticky;
                return Some(st.fault.error);
            }
        }
        None
    }

    /// Whether the crash point is this very operation (it landed mid-write).
    fn crashed_now(&self, op: OpKind) -> bool {
        self.crashed
            .as_ref()
            .is_some_and(|c| c.op_index == self.ops && c.op == op)
    }

    fn next_rand(&mut self) -> u64 {
        // splitmix64: tiny, seeded, good enough to pick torn lengths and survivors.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_rand() % (n as u64 + 1)) as usize
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

    fn used(&self) -> u64 {
        let live: BTreeSet<u64> = self.live.values().copied().collect();
        live.iter()
            .map(|id| self.inodes[id].data.len() as u64)
            .sum()
    }

    /// Writes `bytes` at `pos` of `inode`, as much as fits in the capacity, then fails with
    /// ENOSPC if not all of it did.
    fn write(&mut self, inode: u64, pos: usize, bytes: &[u8]) -> io::Result<()> {
        let len = self.inodes.get(&inode).map_or(0, |i| i.data.len());
        let growth = (pos + bytes.len()).saturating_sub(len) as u64;
        let room = self
            .capacity
            .map_or(u64::MAX, |c| c.saturating_sub(self.used()));
        let fits = if growth > room {
            bytes.len() - (growth - room) as usize
        } else {
            bytes.len()
        };
        let node = self.inodes.get_mut(&inode).expect("open inode");
        node.write(pos, &bytes[..fits]);
        if fits < bytes.len() {
            return Err(FaultError::Enospc.to_io());
        }
        Ok(())
    }

    /// The contents after a power cut, from the durable bytes and the unsynced changes.
    fn survive(&mut self, id: u64, mode: CrashMode) -> Vec<u8> {
        let inode = self.inodes.get(&id).expect("listed inode");
        let mut out = inode.durable.clone();
        let pending = inode.pending.clone();
        let stop = match mode {
            CrashMode::Torn => self.below(pending.len()),
            _ => pending.len(),
        };
        for (i, p) in pending.into_iter().enumerate().take(stop + 1) {
            let choice = match (mode, i == stop) {
                (CrashMode::Drop, _) => continue,
                (CrashMode::Torn, false) => Survive::Whole,
                (CrashMode::Torn, true) => Survive::Torn,
                (CrashMode::Zeros, _) => Survive::Zeros,
                (CrashMode::AnyOrder, _) => Survive::ALL[self.below(3)],
            };
            self.apply(&mut out, p, choice);
        }
        out
    }

    fn apply(&mut self, out: &mut Vec<u8>, p: Pending, how: Survive) {
        match (p, how) {
            (_, Survive::Lost) => {}
            (Pending::SetLen(len), _) => out.resize(len, 0),
            (Pending::Write { pos, mut bytes }, how) => {
                match how {
                    Survive::Torn => {
                        let keep = self.below(bytes.len());
                        bytes.truncate(keep);
                    }
                    Survive::Zeros => bytes.iter_mut().for_each(|b| *b = 0),
                    Survive::Whole | Survive::Lost => {}
                }
                if out.len() < pos + bytes.len() {
                    out.resize(pos + bytes.len(), 0);
                }
                out[pos..pos + bytes.len()].copy_from_slice(&bytes);
            }
        }
    }
}

/// How one unsynced change survives a power cut.
#[derive(Debug, Clone, Copy)]
enum Survive {
    Whole,
    Torn,
    Zeros,
    Lost,
}

impl Survive {
    const ALL: [Survive; 4] = [Survive::Whole, Survive::Torn, Survive::Zeros, Survive::Lost];
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
    /// An empty storage whose random choices are drawn from `seed`.
    pub fn with_seed(seed: u64) -> MemStorage {
        let s = MemStorage::default();
        s.lock().rng = seed;
        s
    }

    fn lock(&self) -> MutexGuard<'_, MemState> {
        // A panic while holding this lock is a test bug; keep going with the data as it is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Operations counted so far (everything but reads and lists).
    pub fn ops(&self) -> u64 {
        self.lock().ops
    }

    /// Makes the operation with global 1-based index `op_index` the moment power is lost.
    pub fn set_crash_at(&self, op_index: u64) {
        self.lock().crash_at = Some(op_index);
    }

    /// Removes a crash point not yet reached.
    pub fn disarm(&self) {
        self.lock().crash_at = None;
    }

    /// Where the crash point landed, if it has been reached.
    pub fn crash_info(&self) -> Option<CrashInfo> {
        self.lock().crashed.clone()
    }

    /// Adds a fault.
    pub fn inject(&self, fault: Fault) {
        self.lock().faults.push(FaultState {
            fault,
            seen: 0,
            done: false,
        });
    }

    /// Removes every fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Operations failed by a fault so far.
    pub fn faults_fired(&self) -> u64 {
        self.lock().faults_fired
    }

    /// Limits the bytes all files may hold (`None`: unlimited).
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.lock().capacity = bytes;
    }

    /// Bytes the live files hold.
    pub fn used_bytes(&self) -> u64 {
        self.lock().used()
    }

    /// Simulates power loss now: keeps the durable directory entries, and of each file its
    /// durable bytes plus what `mode` lets survive of its unsynced changes. Clears the crash
    /// point (faults and capacity stay). Returns where the crash point landed, if reached.
    pub fn crash(&self, mode: CrashMode) -> Option<CrashInfo> {
        let mut s = self.lock();
        s.live = s.durable_names.clone();
        let live: BTreeSet<u64> = s.live.values().copied().collect();
        s.inodes.retain(|id, _| live.contains(id));
        for id in live {
            let data = s.survive(id, mode);
            let inode = s.inodes.get_mut(&id).expect("live inode");
            inode.data = data;
            inode.sync();
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

    fn file(&self, inode: u64, path: &Path) -> Arc<dyn StorageFile> {
        Arc::new(MemFile {
            state: self.state.clone(),
            inode,
            path: path.to_path_buf(),
        })
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

    fn len_in(&self, s: &MemState) -> usize {
        s.inodes.get(&self.inode).map_or(0, |i| i.data.len())
    }
}

impl StorageFile for MemFile {
    fn append(&self, data: &[u8]) -> io::Result<()> {
        let mut s = self.lock();
        let len = self.len_in(&s);
        if let Err(e) = s.begin(OpKind::Append, &self.path, len as u64) {
            if s.crashed_now(OpKind::Append) || e.raw_os_error() == Some(libc::ENOSPC) {
                // Cut mid-write, or out of space part way: a prefix reached the page cache.
                let keep = s.below(data.len());
                s.write(self.inode, len, &data[..keep])?;
            }
            return Err(e);
        }
        s.write(self.inode, len, data)
    }

    fn write_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        let mut s = self.lock();
        let len = self.len_in(&s) as u64;
        s.begin(OpKind::WriteAt, &self.path, len)?;
        s.write(self.inode, pos as usize, data)
    }

    fn sync(&self) -> io::Result<()> {
        let mut s = self.lock();
        let len = self.len_in(&s) as u64;
        s.begin(OpKind::Sync, &self.path, len)?;
        s.inodes.get_mut(&self.inode).expect("open inode").sync();
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut s = self.lock();
        let cur = self.len_in(&s) as u64;
        s.begin(OpKind::Truncate, &self.path, cur)?;
        s.inodes
            .get_mut(&self.inode)
            .expect("open inode")
            .set_len(len as usize);
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        let s = self.lock();
        let data = &s
            .inodes
            .get(&self.inode)
            .ok_or_else(|| not_found(&self.path))?
            .data;
        let start = usize::try_from(pos).map_err(io::Error::other)?;
        let src = data
            .get(start..start + buf.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past end of file"))?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn len(&self) -> u64 {
        self.len_in(&self.lock()) as u64
    }
}

impl Storage for MemStorage {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let mut s = self.lock();
        s.begin(OpKind::Create, path, 0)?;
        s.check_parent(path)?;
        let id = match s.live.get(path) {
            Some(&id) => {
                s.inodes.get_mut(&id).expect("live inode").set_len(0);
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
        Ok(self.file(id, path))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let mut s = self.lock();
        s.begin(OpKind::Open, path, 0)?;
        let id = s.inode_of(path)?;
        Ok(self.file(id, path))
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let mut s = self.lock();
        let id = s.inode_of(path)?;
        let cur = s.inodes[&id].data.len() as u64;
        s.begin(OpKind::Truncate, path, cur)?;
        s.inodes
            .get_mut(&id)
            .expect("live inode")
            .set_len(len as usize);
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

    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.lock();
        s.begin(OpKind::CreateDir, dir, 0)?;
        for anc in dir.ancestors().filter(|a| !a.as_os_str().is_empty()) {
            s.dirs.insert(anc.to_path_buf());
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

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let s = self.lock();
        let id = s.inode_of(path)?;
        Ok(s.inodes[&id].data.clone())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let s = self.lock();
        if !s.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        Ok(s.live
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect())
    }

    fn read_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let s = self.lock();
        if !s.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        let name = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned());
        let files = s.live.keys().filter(|p| p.parent() == Some(dir));
        let mut out: Vec<DirEntry> = files
            .filter_map(|p| name(p).map(|name| (name, false)))
            .chain(
                s.dirs
                    .iter()
                    .filter(|p| p.parent() == Some(dir))
                    .filter_map(|p| name(p).map(|name| (name, true))),
            )
            .map(|(name, is_dir)| DirEntry { name, is_dir })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn stat(&self, path: &Path) -> io::Result<FileStat> {
        let s = self.lock();
        let inode = &s.inodes[&s.inode_of(path)?];
        Ok(FileStat {
            len: inode.data.len() as u64,
            modified: inode.modified.unwrap_or(SystemTime::UNIX_EPOCH),
        })
    }

    fn free_bytes(&self, _dir: &Path) -> Option<u64> {
        let s = self.lock();
        s.capacity.map(|c| c.saturating_sub(s.used()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(m: &MemStorage, synced: &[u8], unsynced: &[&[u8]]) -> PathBuf {
        let dir = Path::new("/d");
        m.create_dir(dir).unwrap();
        let path = dir.join("f");
        let f = m.create(&path).unwrap();
        f.append(synced).unwrap();
        f.sync().unwrap();
        m.sync_dir(dir).unwrap();
        for w in unsynced {
            f.append(w).unwrap();
        }
        path
    }

    #[test]
    fn unsynced_entries_are_lost() {
        let m = MemStorage::with_seed(0);
        let dir = Path::new("/d");
        m.create_dir(dir).unwrap();
        let f = m.create(&dir.join("a")).unwrap();
        f.append(b"hello").unwrap();
        f.sync().unwrap();
        m.crash(CrashMode::AnyOrder);
        assert!(m.read(&dir.join("a")).is_err(), "never linked durably");
    }

    #[test]
    fn each_mode_keeps_the_durable_bytes() {
        for seed in 0..200 {
            for mode in CrashMode::ALL {
                let m = MemStorage::with_seed(seed);
                let path = file_with(&m, b"durable", &[b"-one", b"-two"]);
                m.crash(mode);
                let got = m.read(&path).unwrap();
                assert!(got.starts_with(b"durable"), "{mode:?} seed {seed}: {got:?}");
                let tail = &got[7..];
                match mode {
                    CrashMode::Drop => assert!(tail.is_empty()),
                    CrashMode::Torn => assert!(b"-one-two".starts_with(tail), "{tail:?}"),
                    CrashMode::Zeros => assert_eq!(tail, &[0u8; 8]),
                    CrashMode::AnyOrder => assert!(tail.len() <= 8),
                }
            }
        }
    }

    #[test]
    fn any_order_can_keep_a_later_write_without_an_earlier_one() {
        let hole = (0..500).any(|seed| {
            let m = MemStorage::with_seed(seed);
            let path = file_with(&m, b"", &[b"aaaa", b"bbbb"]);
            m.crash(CrashMode::AnyOrder);
            m.read(&path).unwrap() == b"\0\0\0\0bbbb"
        });
        assert!(hole, "some seed must reorder the two writes");
    }

    #[test]
    fn crash_point_freezes_storage() {
        let m = MemStorage::with_seed(1);
        m.create_dir(Path::new("/d")).unwrap();
        m.set_crash_at(3);
        let f = m.create(Path::new("/d/f")).unwrap();
        assert!(f.append(b"x").is_err());
        assert!(f.sync().is_err());
        let info = m.crash(CrashMode::Torn).unwrap();
        assert_eq!(info.op, OpKind::Append);
        assert!(m.read(Path::new("/d/f")).is_err());
    }

    #[test]
    fn capacity_and_faults_fail_with_their_errors() {
        let m = MemStorage::with_seed(2);
        let path = file_with(&m, b"12345", &[]);
        m.set_capacity(Some(8));
        let f = m.open(&path).unwrap();
        let e = f.append(b"6789").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(m.free_bytes(Path::new("/d")), Some(8 - f.len()));
        m.set_capacity(None);
        m.inject(Fault::on(OpKind::Sync, FaultError::Eio));
        assert_eq!(f.sync().unwrap_err().raw_os_error(), Some(libc::EIO));
        f.sync().unwrap();
        assert_eq!(m.faults_fired(), 1);
    }

    #[test]
    fn removes_and_truncates_need_their_syncs() {
        let m = MemStorage::with_seed(3);
        let path = file_with(&m, b"abcdef", &[]);
        m.truncate(&path, 2).unwrap();
        m.remove(&path).unwrap();
        m.crash(CrashMode::Drop);
        assert_eq!(m.read(&path).unwrap(), b"abcdef");
    }
}
