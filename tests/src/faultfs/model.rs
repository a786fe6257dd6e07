//! The fault filesystem's state, without FUSE: inodes held in memory, each with a durable image
//! and what changed since the last sync, and the power cut that decides what survives.
//!
//! A regular file keeps its durable bytes, its live bytes (what reads see) and the list of
//! unsynced operations (writes and truncates) that turn one into the other; `fsync` and
//! `fdatasync` apply the list to the durable bytes. A directory keeps its durable entries and its
//! live entries; creating, renaming or removing a name changes the live entries only, and only
//! `fsync` of that directory makes them durable (as POSIX asks; real filesystems often persist
//! more, never less). Metadata other than size (mode, owner, times) is not modelled as volatile.
//!
//! [`Model::power_cut`] turns the filesystem off (every later call fails with `EIO`, like a
//! device that lost power) and returns the state a restart would find, chosen by the
//! [`CutMode`], with a [`FaultCounts`] of every fault it applied.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::time::SystemTime;

use rand::Rng;

/// The root directory's inode number (FUSE's).
pub const ROOT: u64 = 1;

/// How many of the newest unsynced operations a write checks for ones it fully overwrites.
/// A page written back again and again (SQLite's `-shm` through `mmap`) then stays one entry.
const COALESCE_WINDOW: usize = 16;

/// A call's failure: an errno value (`libc::ENOENT`, ...).
pub type Errno = i32;

/// What a power cut does to writes and entries that were not synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutMode {
    /// Every unsynced write, truncate and entry change is lost.
    Drop,
    /// Each file's unsynced operations reached the disk in order, and the power went during the
    /// last write: only a prefix of it survives. Entry changes are lost.
    Tear,
    /// Each file's size reached the disk but its unsynced data did not: bytes past the durable
    /// image read as zeros. Entry changes are lost.
    Zeros,
    /// Each unsynced operation survives or not, independently: a later write of a file can
    /// persist without an earlier one, and a directory's unsynced entries can persist without
    /// the data of the files they name.
    Reorder,
}

impl CutMode {
    pub const ALL: [CutMode; 4] = [
        CutMode::Drop,
        CutMode::Tear,
        CutMode::Zeros,
        CutMode::Reorder,
    ];
}

/// Every fault power cuts applied, summed over cuts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub cuts: u64,
    /// Unsynced writes and truncates that did not survive.
    pub ops_dropped: u64,
    /// Writes of which only a prefix survived.
    pub writes_torn: u64,
    /// Files that came back longer than their durable image, with zeros for the unsynced data.
    pub files_zero_filled: u64,
    /// Unsynced operations that survived although an earlier one of the same file did not.
    pub ops_reordered: u64,
    /// Directories whose unsynced entry changes were lost.
    pub dirs_dropped: u64,
    /// Directories whose unsynced entry changes survived without a sync of the directory.
    pub dirs_kept_unsynced: u64,
}

impl FaultCounts {
    /// Faults of any kind (cuts themselves not counted).
    pub fn faults(&self) -> u64 {
        self.ops_dropped
            + self.writes_torn
            + self.files_zero_filled
            + self.ops_reordered
            + self.dirs_dropped
            + self.dirs_kept_unsynced
    }

    pub fn add(&mut self, other: &FaultCounts) {
        self.cuts += other.cuts;
        self.ops_dropped += other.ops_dropped;
        self.writes_torn += other.writes_torn;
        self.files_zero_filled += other.files_zero_filled;
        self.ops_reordered += other.ops_reordered;
        self.dirs_dropped += other.dirs_dropped;
        self.dirs_kept_unsynced += other.dirs_kept_unsynced;
    }
}

/// File or directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// Metadata that is not volatile in this model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
}

impl Meta {
    pub fn new(perm: u16, uid: u32, gid: u32) -> Meta {
        let now = SystemTime::now();
        Meta {
            perm,
            uid,
            gid,
            mtime: now,
            ctime: now,
        }
    }
}

/// What `stat` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub size: u64,
    pub meta: Meta,
}

/// One unsynced change to a file's bytes.
#[derive(Debug, Clone)]
enum Op {
    Write { offset: usize, data: Vec<u8> },
    Truncate(usize),
}

impl Op {
    fn apply(&self, bytes: &mut Vec<u8>) {
        match self {
            Op::Write { offset, data } => write_at(bytes, *offset, data),
            Op::Truncate(len) => bytes.resize(*len, 0),
        }
    }

    /// Whether this write leaves nothing of `earlier` visible (same bytes or a superset).
    fn covers(&self, earlier: &Op) -> bool {
        match (self, earlier) {
            (Op::Write { offset, data }, Op::Write { offset: o, data: d }) => {
                *offset <= *o && o + d.len() <= offset + data.len()
            }
            _ => false,
        }
    }
}

fn write_at(bytes: &mut Vec<u8>, offset: usize, data: &[u8]) {
    let end = offset + data.len();
    if bytes.len() < end {
        bytes.resize(end, 0);
    }
    bytes[offset..end].copy_from_slice(data);
}

#[derive(Debug, Clone, Default)]
struct FileBody {
    durable: Vec<u8>,
    live: Vec<u8>,
    pending: Vec<Op>,
}

impl FileBody {
    fn settled(bytes: Vec<u8>) -> FileBody {
        FileBody {
            durable: bytes.clone(),
            live: bytes,
            pending: Vec::new(),
        }
    }

    fn push(&mut self, op: Op) {
        op.apply(&mut self.live);
        let window = self.pending.len().saturating_sub(COALESCE_WINDOW);
        let mut index = 0;
        self.pending.retain(|earlier| {
            index += 1;
            index <= window || !op.covers(earlier)
        });
        self.pending.push(op);
    }

    fn sync(&mut self) {
        for op in self.pending.drain(..) {
            op.apply(&mut self.durable);
        }
        assert!(
            self.durable == self.live,
            "a synced file's durable image differs from what it reads"
        );
    }

    /// The bytes a restart finds under `mode`.
    fn survive(&self, mode: CutMode, rng: &mut impl Rng, counts: &mut FaultCounts) -> Vec<u8> {
        let mut image = self.durable.clone();
        let Some((last, earlier)) = self.pending.split_last() else {
            return image;
        };
        match mode {
            CutMode::Drop => counts.ops_dropped += self.pending.len() as u64,
            CutMode::Tear => {
                earlier.iter().for_each(|op| op.apply(&mut image));
                match last {
                    Op::Write { offset, data } if data.len() > 1 => {
                        let keep = rng.random_range(1..data.len());
                        write_at(&mut image, *offset, &data[..keep]);
                        counts.writes_torn += 1;
                    }
                    _ => counts.ops_dropped += 1,
                }
            }
            CutMode::Zeros => {
                counts.ops_dropped += self.pending.len() as u64;
                if self.live.len() > image.len() {
                    counts.files_zero_filled += 1;
                }
                image.resize(self.live.len(), 0);
            }
            CutMode::Reorder => reorder(&self.pending, &mut image, rng, counts),
        }
        image
    }
}

fn reorder(pending: &[Op], image: &mut Vec<u8>, rng: &mut impl Rng, counts: &mut FaultCounts) {
    let mut skipped = false;
    for op in pending {
        if rng.random_bool(0.5) {
            op.apply(image);
            counts.ops_reordered += u64::from(skipped);
        } else {
            skipped = true;
            counts.ops_dropped += 1;
        }
    }
}

#[derive(Debug, Clone, Default)]
struct DirBody {
    durable: BTreeMap<OsString, u64>,
    live: BTreeMap<OsString, u64>,
}

impl DirBody {
    fn settled(entries: BTreeMap<OsString, u64>) -> DirBody {
        DirBody {
            durable: entries.clone(),
            live: entries,
        }
    }

    fn survive(
        &self,
        mode: CutMode,
        rng: &mut impl Rng,
        counts: &mut FaultCounts,
    ) -> BTreeMap<OsString, u64> {
        if self.live == self.durable {
            return self.durable.clone();
        }
        if mode == CutMode::Reorder && rng.random_bool(0.5) {
            counts.dirs_kept_unsynced += 1;
            return self.live.clone();
        }
        counts.dirs_dropped += 1;
        self.durable.clone()
    }
}

#[derive(Debug, Clone)]
enum Body {
    File(FileBody),
    Dir(DirBody),
}

#[derive(Debug, Clone)]
struct Inode {
    body: Body,
    meta: Meta,
}

impl Inode {
    fn attr(&self, ino: u64) -> Attr {
        let (kind, size) = match &self.body {
            Body::File(file) => (Kind::File, file.live.len() as u64),
            Body::Dir(dir) => (Kind::Dir, dir.live.len() as u64),
        };
        Attr {
            ino,
            kind,
            size,
            meta: self.meta,
        }
    }
}

/// The whole filesystem.
#[derive(Debug)]
pub struct Model {
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
    powered: bool,
}

impl Default for Model {
    fn default() -> Self {
        Model::new()
    }
}

impl Model {
    /// An empty filesystem: a root directory, everything durable.
    pub fn new() -> Model {
        let root = Inode {
            body: Body::Dir(DirBody::default()),
            meta: Meta::new(0o755, 0, 0),
        };
        Model {
            inodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            powered: true,
        }
    }

    fn inode(&self, ino: u64) -> Result<&Inode, Errno> {
        if !self.powered {
            return Err(libc::EIO);
        }
        self.inodes.get(&ino).ok_or(libc::ENOENT)
    }

    fn inode_mut(&mut self, ino: u64) -> Result<&mut Inode, Errno> {
        if !self.powered {
            return Err(libc::EIO);
        }
        self.inodes.get_mut(&ino).ok_or(libc::ENOENT)
    }

    fn dir(&self, ino: u64) -> Result<&DirBody, Errno> {
        match &self.inode(ino)?.body {
            Body::Dir(dir) => Ok(dir),
            Body::File(_) => Err(libc::ENOTDIR),
        }
    }

    fn dir_mut(&mut self, ino: u64) -> Result<&mut DirBody, Errno> {
        match &mut self.inode_mut(ino)?.body {
            Body::Dir(dir) => Ok(dir),
            Body::File(_) => Err(libc::ENOTDIR),
        }
    }

    fn file_mut(&mut self, ino: u64) -> Result<&mut FileBody, Errno> {
        match &mut self.inode_mut(ino)?.body {
            Body::File(file) => Ok(file),
            Body::Dir(_) => Err(libc::EISDIR),
        }
    }

    pub fn attr(&self, ino: u64) -> Result<Attr, Errno> {
        Ok(self.inode(ino)?.attr(ino))
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, Errno> {
        let ino = *self.dir(parent)?.live.get(name).ok_or(libc::ENOENT)?;
        self.attr(ino)
    }

    /// Creates `name` in `parent` (live only until `parent` is synced).
    pub fn create(
        &mut self,
        parent: u64,
        name: &OsStr,
        kind: Kind,
        meta: Meta,
    ) -> Result<Attr, Errno> {
        if self.dir(parent)?.live.contains_key(name) {
            return Err(libc::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let body = match kind {
            Kind::File => Body::File(FileBody::default()),
            Kind::Dir => Body::Dir(DirBody::default()),
        };
        self.inodes.insert(ino, Inode { body, meta });
        self.dir_mut(parent)?.live.insert(name.to_owned(), ino);
        self.attr(ino)
    }

    /// `unlink` (`kind` = file) or `rmdir` (`kind` = dir, which must be empty).
    pub fn remove(&mut self, parent: u64, name: &OsStr, kind: Kind) -> Result<(), Errno> {
        let attr = self.lookup(parent, name)?;
        match (kind, attr.kind) {
            (Kind::File, Kind::Dir) => return Err(libc::EISDIR),
            (Kind::Dir, Kind::File) => return Err(libc::ENOTDIR),
            (Kind::Dir, Kind::Dir) if attr.size > 0 => return Err(libc::ENOTEMPTY),
            _ => {}
        }
        self.dir_mut(parent)?.live.remove(name);
        Ok(())
    }

    /// `rename`; `noreplace` is `RENAME_NOREPLACE`.
    pub fn rename(
        &mut self,
        parent: u64,
        name: &OsStr,
        new_parent: u64,
        new_name: &OsStr,
        noreplace: bool,
    ) -> Result<(), Errno> {
        let moving = self.lookup(parent, name)?;
        self.dir(new_parent)?;
        match self.lookup(new_parent, new_name) {
            Ok(target) if target.ino == moving.ino => return Ok(()),
            Ok(_) if noreplace => return Err(libc::EEXIST),
            Ok(target) => match (moving.kind, target.kind) {
                (Kind::File, Kind::Dir) => return Err(libc::EISDIR),
                (Kind::Dir, Kind::File) => return Err(libc::ENOTDIR),
                (Kind::Dir, Kind::Dir) if target.size > 0 => return Err(libc::ENOTEMPTY),
                _ => {}
            },
            Err(libc::ENOENT) => {}
            Err(error) => return Err(error),
        }
        self.dir_mut(parent)?.live.remove(name);
        self.dir_mut(new_parent)?
            .live
            .insert(new_name.to_owned(), moving.ino);
        Ok(())
    }

    /// Up to `size` bytes at `offset` of what the file reads now.
    pub fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        match &self.inode(ino)?.body {
            Body::File(file) => {
                let start = (offset as usize).min(file.live.len());
                let end = start.saturating_add(size as usize).min(file.live.len());
                Ok(file.live[start..end].to_vec())
            }
            Body::Dir(_) => Err(libc::EISDIR),
        }
    }

    pub fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        let file = self.file_mut(ino)?;
        if !data.is_empty() {
            file.push(Op::Write {
                offset: offset as usize,
                data: data.to_vec(),
            });
        }
        self.touch(ino);
        Ok(data.len() as u32)
    }

    pub fn truncate(&mut self, ino: u64, len: u64) -> Result<(), Errno> {
        let file = self.file_mut(ino)?;
        if file.live.len() as u64 != len {
            file.push(Op::Truncate(len as usize));
        }
        self.touch(ino);
        Ok(())
    }

    /// Changes what the given fields name (`chmod`, `chown`).
    pub fn set_meta(
        &mut self,
        ino: u64,
        perm: Option<u16>,
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> Result<(), Errno> {
        let meta = &mut self.inode_mut(ino)?.meta;
        meta.perm = perm.unwrap_or(meta.perm);
        meta.uid = uid.unwrap_or(meta.uid);
        meta.gid = gid.unwrap_or(meta.gid);
        meta.ctime = SystemTime::now();
        Ok(())
    }

    fn touch(&mut self, ino: u64) {
        if let Some(inode) = self.inodes.get_mut(&ino) {
            let now = SystemTime::now();
            inode.meta.mtime = now;
            inode.meta.ctime = now;
        }
    }

    /// `fsync`/`fdatasync` of a file (its bytes and size) or of a directory (its entries).
    pub fn sync(&mut self, ino: u64) -> Result<(), Errno> {
        match &mut self.inode_mut(ino)?.body {
            Body::File(file) => file.sync(),
            Body::Dir(dir) => dir.durable = dir.live.clone(),
        }
        Ok(())
    }

    /// The live entries of a directory, in name order.
    pub fn entries(&self, ino: u64) -> Result<Vec<(OsString, Attr)>, Errno> {
        let dir = self.dir(ino)?;
        dir.live
            .iter()
            .map(|(name, child)| Ok((name.clone(), self.attr(*child)?)))
            .collect()
    }

    /// Cuts the power: from now on every call fails with `EIO`. Returns what a restart finds:
    /// every inode reachable from the root through surviving entries, with its surviving bytes,
    /// all durable; and the faults this cut applied.
    pub fn power_cut(&mut self, mode: CutMode, rng: &mut impl Rng) -> (Model, FaultCounts) {
        self.powered = false;
        let mut counts = FaultCounts {
            cuts: 1,
            ..FaultCounts::default()
        };
        let mut survivor = Model {
            inodes: HashMap::new(),
            next_ino: self.next_ino,
            powered: true,
        };
        let mut queue = vec![ROOT];
        let mut seen = HashSet::new();
        while let Some(ino) = queue.pop() {
            let Some(inode) = self.inodes.get(&ino).filter(|_| seen.insert(ino)) else {
                continue;
            };
            let body = match &inode.body {
                Body::File(file) => {
                    Body::File(FileBody::settled(file.survive(mode, rng, &mut counts)))
                }
                Body::Dir(dir) => {
                    let entries = dir.survive(mode, rng, &mut counts);
                    queue.extend(entries.values().rev());
                    Body::Dir(DirBody::settled(entries))
                }
            };
            let meta = inode.meta;
            survivor.inodes.insert(ino, Inode { body, meta });
        }
        (survivor, counts)
    }

    /// Whether a power cut turned this filesystem off.
    pub fn powered(&self) -> bool {
        self.powered
    }
}
