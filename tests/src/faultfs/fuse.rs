//! The FUSE side of the fault filesystem: each kernel request becomes one call on the shared
//! [`Model`], under its lock.
//!
//! Files are opened without `direct_io`, so reads, writes and shared `mmap` (SQLite's `-shm`
//! wal-index) go through the kernel's page cache, and dirty mapped pages reach the model as
//! ordinary writes. The filesystem does not implement `getlk`/`setlk`/`flock`, so the kernel
//! keeps POSIX and BSD locks itself; on one machine that is exactly what SQLite needs.

use std::ffi::OsStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fuser::{
    Errno as FuseErrno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use super::model::{Attr, Errno, Kind, Meta, Model};

/// How long the kernel may cache names and attributes. Only the kernel changes this
/// filesystem, and a remount after a power cut starts with empty caches.
const TTL: Duration = Duration::from_secs(1);

/// The blocks `statfs` reports, of 4 KiB: plenty free, so no program sees a full disk.
const STATFS_BLOCKS: u64 = 1 << 24;

/// The [`Filesystem`] mounted by [`super::FaultFs`].
#[derive(Debug)]
pub(super) struct FuseFs {
    pub(super) model: Arc<Mutex<Model>>,
}

impl FuseFs {
    fn model(&self) -> MutexGuard<'_, Model> {
        // A panic elsewhere with the lock held is a bug the test already reports; the state is
        // still consistent enough to fail the remaining requests cleanly.
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn errno(code: Errno) -> FuseErrno {
    FuseErrno::from_i32(code)
}

fn file_attr(attr: &Attr) -> FileAttr {
    let (kind, nlink) = match attr.kind {
        Kind::File => (FileType::RegularFile, 1),
        Kind::Dir => (FileType::Directory, 2),
    };
    FileAttr {
        ino: INodeNo(attr.ino),
        size: attr.size,
        blocks: attr.size.div_ceil(512),
        atime: attr.meta.mtime,
        mtime: attr.meta.mtime,
        ctime: attr.meta.ctime,
        crtime: attr.meta.ctime,
        kind,
        perm: attr.meta.perm,
        nlink,
        uid: attr.meta.uid,
        gid: attr.meta.gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

fn reply_entry(reply: ReplyEntry, result: Result<Attr, Errno>) {
    match result {
        Ok(attr) => reply.entry(&TTL, &file_attr(&attr), Generation(0)),
        Err(code) => reply.error(errno(code)),
    }
}

fn reply_empty(reply: ReplyEmpty, result: Result<(), Errno>) {
    match result {
        Ok(()) => reply.ok(),
        Err(code) => reply.error(errno(code)),
    }
}

fn reply_attr(reply: ReplyAttr, result: Result<Attr, Errno>) {
    match result {
        Ok(attr) => reply.attr(&TTL, &file_attr(&attr)),
        Err(code) => reply.error(errno(code)),
    }
}

fn meta(req: &Request, mode: u32, umask: u32) -> Meta {
    Meta::new((mode & !umask & 0o7777) as u16, req.uid(), req.gid())
}

impl Filesystem for FuseFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        reply_entry(reply, self.model().lookup(parent.0, name));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        reply_attr(reply, self.model().attr(ino.0));
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut model = self.model();
        let perm = mode.map(|m| (m & 0o7777) as u16);
        let result = model
            .set_meta(ino.0, perm, uid, gid)
            .and_then(|()| size.map_or(Ok(()), |len| model.truncate(ino.0, len)))
            .and_then(|()| model.attr(ino.0));
        reply_attr(reply, result);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let meta = meta(req, mode, umask);
        reply_entry(reply, self.model().create(parent.0, name, Kind::Dir, meta));
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(reply, self.model().remove(parent.0, name, Kind::File));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply_empty(reply, self.model().remove(parent.0, name, Kind::Dir));
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if !(flags - RenameFlags::RENAME_NOREPLACE).is_empty() {
            return reply.error(FuseErrno::EINVAL);
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let result = self
            .model()
            .rename(parent.0, name, newparent.0, newname, noreplace);
        reply_empty(reply, result);
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.model().attr(ino.0) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        match self.model().read(ino.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.model().write(ino.0, offset, data) {
            Ok(written) => reply.written(written),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        // Closing a file makes nothing durable.
        reply_empty(reply, self.model().attr(ino.0).map(drop));
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, self.model().sync(ino.0));
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.model().entries(ino.0) {
            Ok(entries) => entries,
            Err(code) => return reply.error(errno(code)),
        };
        let dots = [
            (".".into(), ino.0, Kind::Dir),
            ("..".into(), ino.0, Kind::Dir),
        ];
        let all = dots.into_iter().chain(
            entries
                .into_iter()
                .map(|(name, attr)| (name, attr.ino, attr.kind)),
        );
        for (index, (name, child, kind)) in all.enumerate().skip(offset as usize) {
            let kind = match kind {
                Kind::File => FileType::RegularFile,
                Kind::Dir => FileType::Directory,
            };
            let name: std::ffi::OsString = name;
            if reply.add(INodeNo(child), index as u64 + 1, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply_empty(reply, self.model().sync(ino.0));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        if !self.model().powered() {
            return reply.error(FuseErrno::EIO);
        }
        reply.statfs(
            STATFS_BLOCKS,
            STATFS_BLOCKS,
            STATFS_BLOCKS,
            1 << 20,
            1 << 20,
            4096,
            255,
            4096,
        );
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply_empty(reply, self.model().attr(ino.0).map(drop));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let meta = meta(req, mode, umask);
        match self.model().create(parent.0, name, Kind::File, meta) {
            Ok(attr) => reply.created(
                &TTL,
                &file_attr(&attr),
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if mode != 0 {
            return reply.error(errno(libc::EOPNOTSUPP));
        }
        let mut model = self.model();
        let result = model.attr(ino.0).and_then(|attr| {
            let end = offset.saturating_add(length);
            if end > attr.size {
                model.truncate(ino.0, end)
            } else {
                Ok(())
            }
        });
        reply_empty(reply, result);
    }
}
