//! An in-memory [`Storage`] that can simulate power loss.
//!
//! Each file (an inode) keeps its current bytes, the bytes known to be durable, and the appends
//! made since its last `sync` (the unsynced suffix, as a list of writes); the namespace keeps
//! the current path -> inode map and the durable one. `sync` on a file makes its bytes durable;
//! `sync_dir` makes the entries of that directory durable (creates, renames and removes).
//! [`MemStorage::crash`] throws away everything else, like a power cut would: a directory entry
//! that was never covered by a `sync_dir` is gone, whatever happened to its file's bytes.
//!
//! A power cut does not respect write boundaries or write order, so within each file's unsynced
//! suffix `crash` picks one of these (seeded, so runs are reproducible; counted in
//! [`CrashStats`]):
//! - **drop**: nothing unsynced survives;
//! - **torn**: a random prefix survives, cut anywhere;
//! - **scatter**: the file keeps a random length, and each piece of the unsynced region (pieces
//!   end at write boundaries and at random cuts) holds its data, zeros (the file grew but the
//!   data never arrived) or garbage;
//! - **reorder**: a later write of the group persists and an earlier one does not (it reads as
//!   zeros or garbage), which leaves a hole followed by valid frames.
//!
//! Durable bytes are never touched: only [`MemStorage::corrupt_byte`] damages them, to model
//! bit rot.
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

/// What [`MemStorage::crash`] did to unsynced file suffixes, summed over every crash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CrashStats {
    /// Suffixes lost whole.
    pub dropped: u64,
    /// Suffixes cut to a random prefix.
    pub torn: u64,
    /// Suffixes kept in pieces of data, zeros and garbage.
    pub scattered: u64,
    /// Suffixes where a later write persisted without an earlier one.
    pub reordered: u64,
    /// Pieces left as zeros, and as garbage, by scatter and reorder.
    pub zero_pieces: u64,
    pub garbage_pieces: u64,
}

#[derive(Debug, Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
    /// `(start, end)` of every append since the last sync, in order.
    writes: Vec<(usize, usize)>,
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
    stats: CrashStats,
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

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_rand() % n }
    }

    /// Applies one crash mode to the unsynced suffix of `inode` (its data starts with its
    /// durable bytes and is longer).
    fn lose_suffix(&mut self, inode: &mut Inode) {
        let (from, to) = (inode.durable.len(), inode.data.len());
        match self.below(4) {
            0 => {
                self.stats.dropped += 1;
                inode.data.truncate(from);
            }
            1 => {
                self.stats.torn += 1;
                let keep = self.below((to - from) as u64 + 1) as usize;
                inode.data.truncate(from + keep);
            }
            2 => {
                self.stats.scattered += 1;
                let len = from + 1 + self.below((to - from) as u64) as usize;
                inode.data.truncate(len);
                let cuts = self.pieces(inode, from, len);
                for (a, b) in cuts {
                    match self.below(4) {
                        0 => self.spoil(&mut inode.data[a..b], false),
                        1 => self.spoil(&mut inode.data[a..b], true),
                        _ => {}
                    }
                }
            }
            _ => {
                self.stats.reordered += 1;
                let writes = self.unsynced_writes(inode, from, to);
                // Lose one write that is not the last; with a single write, lose its front part.
                let (a, b) = if writes.len() >= 2 {
                    writes[self.below(writes.len() as u64 - 1) as usize]
                } else {
                    (
                        from,
                        from + 1 + self.below((to - from - 1).max(1) as u64) as usize,
                    )
                };
                let garbage = self.below(2) == 1;
                self.spoil(&mut inode.data[a..b.min(to)], garbage);
            }
        }
    }

    /// The unsynced writes of `inode` clipped to `from..to`; one write if none was recorded.
    fn unsynced_writes(&self, inode: &Inode, from: usize, to: usize) -> Vec<(usize, usize)> {
        let w: Vec<(usize, usize)> = inode
            .writes
            .iter()
            .map(|&(a, b)| (a.max(from), b.min(to)))
            .filter(|(a, b)| a < b)
            .collect();
        if w.is_empty() { vec![(from, to)] } else { w }
    }

    /// Splits `from..len` into pieces at write boundaries and at random cuts.
    fn pieces(&mut self, inode: &Inode, from: usize, len: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (a, b) in self.unsynced_writes(inode, from, len) {
            let mut at = a;
            while at < b {
                let step = 1 + self.below(((b - a) / 2).max(1) as u64) as usize;
                let end = (at + step).min(b);
                out.push((at, end));
                at = end;
            }
        }
        out
    }

    /// Overwrites a piece with zeros or garbage.
    fn spoil(&mut self, piece: &mut [u8], garbage: bool) {
        if garbage {
            self.stats.garbage_pieces += 1;
            for b in piece.iter_mut() {
                *b = self.next_rand() as u8;
            }
        } else {
            self.stats.zero_pieces += 1;
            piece.fill(0);
        }
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

    /// Simulates power loss now: keeps only durable entries and durable bytes, plus whatever
    /// the chosen crash mode leaves of each file's unsynced suffix. Clears the crash point.
    /// Returns where the crash point landed, if one was reached.
    pub fn crash(&self) -> Option<CrashInfo> {
        let mut s = self.lock();
        s.live = s.durable_names.clone();
        let live: BTreeSet<u64> = s.live.values().copied().collect();
        s.inodes.retain(|id, _| live.contains(id));
        let mut ids: Vec<u64> = s.inodes.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let mut inode = s.inodes.remove(&id).expect("listed");
            if inode.data.len() > inode.durable.len() && inode.data.starts_with(&inode.durable) {
                s.lose_suffix(&mut inode);
            } else {
                inode.data = inode.durable.clone();
            }
            inode.durable = inode.data.clone();
            inode.writes.clear();
            s.inodes.insert(id, inode);
        }
        s.crash_at = None;
        s.crashed.take()
    }

    /// What the crashes so far did to unsynced suffixes.
    pub fn crash_stats(&self) -> CrashStats {
        self.lock().stats
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
        inode.writes.clear();
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
                    let start = inode.data.len();
                    inode.data.extend_from_slice(&data[..keep]);
                    inode.writes.push((start, start + keep));
                }
            }
            return Err(e);
        }
        let inode = s
            .inodes
            .get_mut(&self.inode)
            .ok_or_else(|| not_found(&self.path))?;
        let start = inode.data.len();
        inode.data.extend_from_slice(data);
        inode.writes.push((start, start + data.len()));
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
        inode.writes.clear();
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
                let inode = s.inodes.get_mut(&id).expect("live inode");
                inode.data.clear();
                inode.writes.clear();
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
        inode.writes.clear();
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
        assert!(got.len() <= b"durable-volatile".len());
    }

    #[test]
    fn renames_and_removes_need_a_directory_sync() {
        let m = MemStorage::with_seed(5);
        let dir = Path::new("/d");
        m.create_dir_all(dir).unwrap();
        let mut a = m.create(&dir.join("a")).unwrap();
        a.append(b"x").unwrap();
        a.sync().unwrap();
        m.sync_dir(dir).unwrap();
        m.rename(&dir.join("a"), &dir.join("b")).unwrap();
        m.crash();
        assert!(m.exists(&dir.join("a")) && !m.exists(&dir.join("b")));
        m.remove(&dir.join("a")).unwrap();
        m.crash();
        assert!(m.exists(&dir.join("a")), "an unsynced remove is undone");
        m.remove(&dir.join("a")).unwrap();
        m.sync_dir(dir).unwrap();
        m.crash();
        assert!(!m.exists(&dir.join("a")));
    }

    /// Every mode shows up over many crashes, durable bytes are never touched, the file never
    /// grows past what was written, and a reorder keeps the last write whole.
    #[test]
    fn crash_modes_only_touch_the_unsynced_suffix() {
        let m = MemStorage::with_seed(9);
        let dir = Path::new("/d");
        m.create_dir_all(dir).unwrap();
        let path = dir.join("f");
        let mut f = m.create(&path).unwrap();
        f.append(b"durable!").unwrap();
        f.sync().unwrap();
        m.sync_dir(dir).unwrap();
        let mut hole_then_data = 0;
        for round in 0..400u32 {
            let mut f = m.open_append(&path).unwrap();
            let writes: Vec<Vec<u8>> = (0..3u8).map(|w| vec![0xA0 + w; 16]).collect();
            for w in &writes {
                f.append(w).unwrap();
            }
            m.crash();
            let got = m.read(&path).unwrap();
            assert!(got.starts_with(b"durable!"), "round {round}");
            assert!(got.len() <= 8 + 48, "round {round}");
            let tail = &got[8..];
            if tail.len() == 48
                && tail[32..] == writes[2][..]
                && tail[..32] != [&writes[0][..], &writes[1][..]].concat()
            {
                hole_then_data += 1;
            }
            m.truncate(&path, 8).unwrap();
        }
        let st = m.crash_stats();
        assert!(
            st.dropped > 0 && st.torn > 0 && st.scattered > 0 && st.reordered > 0,
            "{st:?}"
        );
        assert!(st.zero_pieces > 0 && st.garbage_pieces > 0, "{st:?}");
        assert!(
            hole_then_data > 0,
            "a later write persisted without an earlier one"
        );
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
