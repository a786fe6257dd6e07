//! A fault-injecting FUSE filesystem for power-loss tests of the real binaries.
//!
//! [`FaultFs::mount`] mounts an empty in-memory filesystem (served by a thread of the test
//! process, through the `fuser` crate, with no libfuse and no `fusermount`: the test runs as
//! root and mounts `/dev/fuse` itself). Programs use it like any disk. What they write is kept
//! as a durable image plus the unsynced changes (see [`model`]): file data becomes durable on
//! `fsync`/`fdatasync` of the file, a directory's entries (create, rename, unlink, mkdir) on
//! `fsync` of the directory.
//!
//! A power loss is two steps:
//! 1. [`FaultFs::power_cut`]: the filesystem goes dark (every call fails with `EIO`) and decides
//!    what a restart will find, by [`CutMode`]: unsynced changes dropped, the last write torn,
//!    zeros for unsynced appends, or a random subset of the unsynced writes applied (a later
//!    one without an earlier one). It returns the [`FaultCounts`] of what it did.
//! 2. The test kills every process that used the mount, then [`FaultFs::restart`] unmounts it
//!    and mounts the surviving state at the same path, with cold kernel caches.
//!
//! SQLite in WAL mode works on it: `pread`/`pwrite`, `fsync`, `ftruncate`, POSIX locks (kept by
//! the kernel) and the shared `mmap` of the `-shm` file (files are opened without `direct_io`,
//! so the mapping goes through the page cache). The unit tests below check that, and the
//! semantics the power-loss suites rely on.

pub mod model;

mod fuse;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail, ensure};
use fuser::{BackgroundSession, Config, MountOption};
use rand::Rng;

use model::Model;
pub use model::{CutMode, FaultCounts};

/// A mounted fault filesystem. Dropping it unmounts.
#[derive(Debug)]
pub struct FaultFs {
    mountpoint: PathBuf,
    model: Arc<Mutex<Model>>,
    session: Option<BackgroundSession>,
    /// What the last power cut left, until [`FaultFs::restart`] mounts it.
    survivor: Option<Model>,
    counts: FaultCounts,
}

impl FaultFs {
    /// Mounts an empty fault filesystem at `mountpoint` (created if missing). Needs root and
    /// `/dev/fuse`.
    pub fn mount(mountpoint: impl Into<PathBuf>) -> Result<FaultFs> {
        let mountpoint = mountpoint.into();
        std::fs::create_dir_all(&mountpoint)
            .with_context(|| format!("creating mount point {}", mountpoint.display()))?;
        let mut fs = FaultFs {
            mountpoint,
            model: Arc::new(Mutex::new(Model::new())),
            session: None,
            survivor: None,
            counts: FaultCounts::default(),
        };
        fs.session = Some(fs.spawn()?);
        Ok(fs)
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Every fault applied so far, over all cuts.
    pub fn counts(&self) -> &FaultCounts {
        &self.counts
    }

    /// Cuts the power (see the module doc): returns what this cut did. The processes using the
    /// mount must be killed before [`FaultFs::restart`].
    pub fn power_cut(&mut self, mode: CutMode, rng: &mut impl Rng) -> FaultCounts {
        let mut model = self.lock();
        let (survivor, counts) = model.power_cut(mode, rng);
        drop(model);
        self.survivor = Some(survivor);
        self.counts.add(&counts);
        counts
    }

    /// Unmounts the dark filesystem and mounts what the last power cut left.
    pub fn restart(&mut self) -> Result<()> {
        let Some(survivor) = self.survivor.take() else {
            bail!(
                "restart of {} without a power cut",
                self.mountpoint.display()
            );
        };
        if let Some(session) = self.session.take() {
            unmount(session, &self.mountpoint)?;
        }
        *self.lock() = survivor;
        self.session = Some(self.spawn()?);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spawn(&self) -> Result<BackgroundSession> {
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("faultfs".into()),
            MountOption::Subtype("faultfs".into()),
            MountOption::NoAtime,
        ];
        let fs = fuse::FuseFs {
            model: Arc::clone(&self.model),
        };
        fuser::spawn_mount(fs, &self.mountpoint, &config).with_context(|| {
            format!(
                "mounting the fault filesystem at {} (needs root and /dev/fuse)",
                self.mountpoint.display()
            )
        })
    }
}

impl Drop for FaultFs {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            // A process still using the mount (a test that failed before it killed it) makes a
            // plain unmount fail; the lazy fallback detaches the mount all the same.
            let _ = unmount(session, &self.mountpoint);
        }
    }
}

/// Unmounts; falls back to a lazy unmount when something still holds the mount (the kernel
/// then detaches it at once and the new mount takes the path).
fn unmount(session: BackgroundSession, mountpoint: &Path) -> Result<()> {
    if session.umount_and_join().is_ok() {
        return Ok(());
    }
    let status = Command::new("umount")
        .arg("-l")
        .arg(mountpoint)
        .status()
        .context("running umount -l")?;
    ensure!(
        status.success() || !is_mounted(mountpoint),
        "umount -l {} failed with {status}",
        mountpoint.display()
    );
    Ok(())
}

fn is_mounted(path: &Path) -> bool {
    Command::new("mountpoint")
        .arg("-q")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests;
