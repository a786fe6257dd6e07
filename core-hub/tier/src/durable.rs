//! Durable writes to a local tier 2: every put and delete on a `file://` tier 2 reaches stable
//! storage before it returns.
//!
//! object_store's `LocalFileSystem` (without `with_fsync`) writes a staging file and renames it
//! into place without syncing either, so a power loss after the hub committed a chunk could
//! leave the chunk at 0 bytes while the agents had already freed their copies. Here a put goes:
//!
//! 1. create the object's directory (and any missing ancestor) if needed;
//! 2. write `{object}#{n}` (a staging name `LocalFileSystem`'s listings skip) and fsync it;
//! 3. rename it over the object's name and fsync the object's directory;
//! 4. fsync the parent of every directory whose own entry is not yet known durable, up to the
//!    tier-2 root (a directory made in step 1 is only reachable once its parent is synced).
//!
//! A delete fsyncs the object's directory after the unlink. [`LocalDurability::open`] creates
//! the root the same way. Reads, listings and everything else still go through
//! `LocalFileSystem`, which shares the root and the path mapping.
//!
//! With the `fault-injection` feature, [`SyncProbe`] records every sync in order and can skip
//! the file or the directory syncs (mutation checks: the tests prove a put without them is
//! caught by [`SyncProbe::check_put`]).

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path as FsPath, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use object_store::local::LocalFileSystem;
use object_store::path::Path;

/// Why a durable local write failed; [`crate::PutError`] and [`crate::DeleteError`] wrap it
/// with the object's name.
#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("mapping to a file: {0}")]
    Path(#[source] object_store::Error),
    #[error("the blocking write task failed: {0}")]
    Task(String),
}

fn io<'a>(
    what: &'static str,
    path: &'a FsPath,
) -> impl FnOnce(std::io::Error) -> DurableError + 'a {
    move |source| DurableError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// A local tier-2 root and the directories under it whose entries are known durable.
#[derive(Debug)]
pub(crate) struct LocalDurability {
    fs: LocalFileSystem,
    root: PathBuf,
    /// Directories whose own entry (in their parent) has been fsynced since this process made
    /// or first saw them. A directory is added only after that fsync returned.
    synced: Mutex<HashSet<PathBuf>>,
    /// Staging-name counter; a leftover staging file of an earlier process is skipped.
    staging: AtomicU64,
    #[cfg(feature = "fault-injection")]
    probe: SyncProbe,
}

impl LocalDurability {
    /// Creates `root` if needed, durably (every new directory's parent is fsynced), and opens
    /// `LocalFileSystem` on it.
    pub(crate) fn open(root: &FsPath) -> Result<LocalDurability, DurableError> {
        let made = missing_ancestors(root);
        std::fs::create_dir_all(root).map_err(io("creating directory", root))?;
        let root = std::fs::canonicalize(root).map_err(io("resolving", root))?;
        let fs = LocalFileSystem::new_with_prefix(&root).map_err(DurableError::Path)?;
        let me = LocalDurability {
            fs,
            root,
            synced: Mutex::new(HashSet::new()),
            staging: AtomicU64::new(1),
            #[cfg(feature = "fault-injection")]
            probe: SyncProbe::default(),
        };
        // `made` holds the new directories, deepest first: each one's parent gains an entry.
        for dir in &made {
            match dir.parent() {
                Some(p) if p.as_os_str().is_empty() => me.sync_dir(FsPath::new("."))?,
                Some(p) => me.sync_dir(p)?,
                None => {}
            }
        }
        Ok(me)
    }

    pub(crate) fn store(&self) -> &LocalFileSystem {
        &self.fs
    }

    pub(crate) fn root(&self) -> &FsPath {
        &self.root
    }

    #[cfg(feature = "fault-injection")]
    pub(crate) fn probe(&self) -> &SyncProbe {
        &self.probe
    }

    /// The file an object lives in.
    pub(crate) fn file_of(&self, location: &Path) -> Result<PathBuf, DurableError> {
        self.fs
            .path_to_filesystem(location)
            .map_err(DurableError::Path)
    }

    /// Writes `bytes` to `location` durably (steps 1 to 4 of the module doc). Blocking.
    pub(crate) fn put(&self, location: &Path, bytes: &[u8]) -> Result<(), DurableError> {
        let dest = self.file_of(location)?;
        let dir = dest
            .parent()
            .ok_or_else(|| io("no directory for", &dest)(ErrorKind::InvalidInput.into()))?
            .to_path_buf();
        self.create_dir(&dir)?;
        let (mut file, staging) = self.open_staging(&dest)?;
        let written = (|| {
            file.write_all(bytes).map_err(io("writing", &staging))?;
            self.sync_file(&file, &staging)?;
            drop(file);
            std::fs::rename(&staging, &dest).map_err(io("renaming into place", &dest))?;
            #[cfg(feature = "fault-injection")]
            self.probe.record(SyncEvent::Rename {
                from: staging.clone(),
                to: dest.clone(),
            });
            Ok(())
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&staging);
            return Err(e);
        }
        self.sync_dir(&dir)?;
        self.sync_ancestors(&dir)?;
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::PutDone(dest));
        Ok(())
    }

    /// Removes `location` and fsyncs its directory. `Ok(false)`: there was no such object.
    pub(crate) fn delete(&self, location: &Path) -> Result<bool, DurableError> {
        let dest = self.file_of(location)?;
        let existed = match std::fs::remove_file(&dest) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(e) => return Err(io("removing", &dest)(e)),
        };
        // Sync even when it was gone already: an earlier unsynced removal becomes durable.
        if let Some(dir) = dest.parent().filter(|d| d.exists()) {
            self.sync_dir(dir)?;
        }
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::DeleteDone(dest));
        Ok(existed)
    }

    /// Creates `dir` and its missing ancestors; the new ones lose any stale "durable" mark
    /// (a directory removed behind our back and made again needs its entry synced again).
    fn create_dir(&self, dir: &FsPath) -> Result<(), DurableError> {
        if dir.is_dir() {
            return Ok(());
        }
        let made = missing_ancestors(dir);
        {
            let mut synced = self.synced.lock().expect("synced directories");
            for d in &made {
                synced.remove(d);
            }
        }
        std::fs::create_dir_all(dir).map_err(io("creating directory", dir))
    }

    /// Opens a new staging file next to `dest`: `{dest}#{n}`, all digits after the `#`, which
    /// `LocalFileSystem` never lists as an object.
    fn open_staging(&self, dest: &FsPath) -> Result<(File, PathBuf), DurableError> {
        loop {
            let n = self.staging.fetch_add(1, Ordering::Relaxed);
            let mut name = dest.as_os_str().to_owned();
            name.push(format!("#{n}"));
            let path = PathBuf::from(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => return Ok((f, path)),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io("creating", &path)(e)),
            }
        }
    }

    /// Makes the entry of `dir` durable, and so on upwards, up to the root or to a directory
    /// already known durable.
    fn sync_ancestors(&self, dir: &FsPath) -> Result<(), DurableError> {
        let mut d = dir;
        while d != self.root && d.starts_with(&self.root) {
            if self.synced.lock().expect("synced directories").contains(d) {
                return Ok(());
            }
            let Some(parent) = d.parent() else {
                return Ok(());
            };
            self.sync_dir(parent)?;
            self.synced
                .lock()
                .expect("synced directories")
                .insert(d.to_path_buf());
            d = parent;
        }
        Ok(())
    }

    fn sync_file(&self, file: &File, path: &FsPath) -> Result<(), DurableError> {
        #[cfg(feature = "fault-injection")]
        if self.probe.skips_file_syncs() {
            return Ok(());
        }
        file.sync_all().map_err(io("syncing", path))?;
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::File(path.to_path_buf()));
        Ok(())
    }

    fn sync_dir(&self, dir: &FsPath) -> Result<(), DurableError> {
        #[cfg(feature = "fault-injection")]
        if self.probe.skips_dir_syncs() {
            return Ok(());
        }
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing directory", dir))?;
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::Dir(dir.to_path_buf()));
        Ok(())
    }
}

/// `dir` and its ancestors that do not exist yet, deepest first.
fn missing_ancestors(dir: &FsPath) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut d = Some(dir);
    while let Some(p) = d.filter(|p| !p.as_os_str().is_empty() && !p.exists()) {
        out.push(p.to_path_buf());
        d = p.parent();
    }
    out
}

/// One step of a durable local write, in the order it happened (`fault-injection` only).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncEvent {
    /// `sync_all` of a written file returned.
    File(PathBuf),
    /// `sync_all` of a directory returned.
    Dir(PathBuf),
    /// A staging file was renamed over an object.
    Rename { from: PathBuf, to: PathBuf },
    /// A put of this file returned.
    PutDone(PathBuf),
    /// A delete of this file returned.
    DeleteDone(PathBuf),
}

/// Records the syncs of a local tier 2 and switches them off (`fault-injection` only).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Default)]
pub struct SyncProbe {
    events: Mutex<Vec<SyncEvent>>,
    skip_file: std::sync::atomic::AtomicBool,
    skip_dir: std::sync::atomic::AtomicBool,
}

/// Events a probe keeps; past it the oldest half is dropped, so that a long-running test
/// binary built with the feature does not grow without bound.
#[cfg(feature = "fault-injection")]
const PROBE_EVENTS_MAX: usize = 1 << 16;

#[cfg(feature = "fault-injection")]
impl SyncProbe {
    /// Records one step (the stores that write through a probe: this module's and the hub's
    /// storage-backed one).
    pub fn record(&self, e: SyncEvent) {
        let mut events = self.events.lock().expect("sync events");
        if events.len() >= PROBE_EVENTS_MAX {
            events.drain(..PROBE_EVENTS_MAX / 2);
        }
        events.push(e);
    }

    /// Every event so far (the newest [`PROBE_EVENTS_MAX`] at most).
    pub fn events(&self) -> Vec<SyncEvent> {
        self.events.lock().expect("sync events").clone()
    }

    /// Mutation switch: written files are no longer fsynced.
    pub fn skip_file_syncs(&self, skip: bool) {
        self.skip_file.store(skip, Ordering::Relaxed);
    }

    /// Mutation switch: directories are no longer fsynced.
    pub fn skip_dir_syncs(&self, skip: bool) {
        self.skip_dir.store(skip, Ordering::Relaxed);
    }

    /// Whether written files go unsynced (the mutation is on).
    pub fn skips_file_syncs(&self) -> bool {
        self.skip_file.load(Ordering::Relaxed)
    }

    /// Whether directories go unsynced (the mutation is on).
    pub fn skips_dir_syncs(&self) -> bool {
        self.skip_dir.load(Ordering::Relaxed)
    }

    /// How many file and directory syncs returned so far.
    pub fn counts(&self) -> (u64, u64) {
        let ev = self.events.lock().expect("sync events");
        let files = ev
            .iter()
            .filter(|e| matches!(e, SyncEvent::File(_)))
            .count();
        let dirs = ev.iter().filter(|e| matches!(e, SyncEvent::Dir(_))).count();
        (files as u64, dirs as u64)
    }

    /// Whether the put of `dest` (a file under `root`) that returned last was durable when it
    /// returned: its staging file synced before the rename, its directory synced after it,
    /// and every directory between it and `root` synced into its parent by then.
    pub fn check_put(&self, root: &FsPath, dest: &FsPath) -> Result<(), String> {
        let ev = self.events();
        let done = ev
            .iter()
            .rposition(|e| *e == SyncEvent::PutDone(dest.to_path_buf()))
            .ok_or_else(|| format!("no put of {} returned", dest.display()))?;
        let rename = ev[..done]
            .iter()
            .rposition(|e| matches!(e, SyncEvent::Rename { to, .. } if to == dest))
            .ok_or_else(|| format!("{} was never renamed into place", dest.display()))?;
        let SyncEvent::Rename { from, .. } = &ev[rename] else {
            unreachable!("matched above")
        };
        let start = ev[..rename]
            .iter()
            .rposition(|e| matches!(e, SyncEvent::PutDone(_) | SyncEvent::DeleteDone(_)))
            .map_or(0, |i| i + 1);
        if !ev[start..rename].contains(&SyncEvent::File(from.clone())) {
            return Err(format!(
                "file sync missing: {} was renamed over {} unsynced",
                from.display(),
                dest.display()
            ));
        }
        let dir = dest.parent().ok_or("no parent")?;
        if !ev[rename..done].contains(&SyncEvent::Dir(dir.to_path_buf())) {
            return Err(format!(
                "directory sync missing: {} after the rename of {}",
                dir.display(),
                dest.display()
            ));
        }
        let mut d = dir;
        while d != root {
            let parent = d.parent().ok_or("dest is not under root")?;
            if !ev[..done].contains(&SyncEvent::Dir(parent.to_path_buf())) {
                return Err(format!(
                    "directory sync missing: {} (holds {}) never synced",
                    parent.display(),
                    d.display()
                ));
            }
            d = parent;
        }
        Ok(())
    }

    /// Whether the delete of `dest` that returned last synced its directory.
    pub fn check_delete(&self, dest: &FsPath) -> Result<(), String> {
        let ev = self.events();
        let done = ev
            .iter()
            .rposition(|e| *e == SyncEvent::DeleteDone(dest.to_path_buf()))
            .ok_or_else(|| format!("no delete of {} returned", dest.display()))?;
        let dir = dest.parent().ok_or("no parent")?;
        let start = ev[..done]
            .iter()
            .rposition(|e| matches!(e, SyncEvent::PutDone(_) | SyncEvent::DeleteDone(_)))
            .map_or(0, |i| i + 1);
        if ev[start..done].contains(&SyncEvent::Dir(dir.to_path_buf())) {
            Ok(())
        } else {
            Err(format!(
                "directory sync missing: {} after deleting {}",
                dir.display(),
                dest.display()
            ))
        }
    }
}
