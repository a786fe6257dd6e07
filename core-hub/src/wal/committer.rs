//! The committer thread: one fsync and one catalog transaction for every group written, then
//! the completions, in write order. The acknowledgement rule lives here: a caller completes
//! only after the fsync that covers its block and the catalog commit that records it.

use super::disk_full::{Shared, enter_disk_full};
use super::{
    AppendDone, CommitError, Completion, DeferredMeta, FaultPoint, WalEnv, WalStats, WriterConfig,
    fault, poison,
};
use crate::catalog::{Catalog, GroupCommit};
use crate::storage::StorageFile;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};

/// What travels from the writer to the committer.
pub(super) enum Piped {
    /// A group in the file.
    Group(Box<Written>),
    /// The writer has cut the log back to the committed end (after the committer asked); the
    /// committer acknowledges once every group before this marker has failed.
    Rewound(mpsc::Sender<()>),
}

/// A group in the file, on its way to durability.
pub(super) struct Written {
    /// The catalog rows of the group (marks, blocks, offsets, the WAL end it reaches).
    pub(super) g: GroupCommit,
    pub(super) dones: Vec<Done>,
    pub(super) requests: usize,
    /// The file to fsync, `None` when the group wrote nothing (gaps only).
    pub(super) file: Option<Arc<dyn StorageFile>>,
    /// Set when writing failed: the group fails, and so does everything after it.
    pub(super) error: Option<CommitError>,
    /// The group's blocks for [`WriterConfig::on_commit`].
    pub(super) routed: Vec<crate::streams::CommittedBlock>,
}

/// Makes written groups durable: one `fdatasync` for every group queued behind it, then one
/// catalog transaction for all of them, then the completions, in write order.
pub(super) struct Committer {
    env: WalEnv,
    catalog: Arc<Catalog>,
    cfg: WriterConfig,
    stats: Arc<WalStats>,
    deferred: Arc<Mutex<DeferredMeta>>,
    shared: Arc<Shared>,
    /// Named in disk-full errors of the catalog, which lives there.
    data_dir: PathBuf,
}

/// Consecutive groups merged into one fsync and one catalog transaction.
struct Merged {
    g: GroupCommit,
    dones: Vec<Done>,
    files: Vec<Arc<dyn StorageFile>>,
    routed: Vec<crate::streams::CommittedBlock>,
    requests: usize,
}

/// A completion waiting for its batch's outcome.
pub(super) enum Done {
    Append(Completion<AppendDone>, AppendDone),
    Gap(Completion<()>),
}

impl Done {
    pub(super) fn finish(self, result: Result<(), CommitError>) {
        match (self, result) {
            (Done::Append(f, d), Ok(())) => f(Ok(d)),
            (Done::Append(f, _), Err(e)) => f(Err(e)),
            (Done::Gap(f), r) => f(r),
        }
    }
}

impl Committer {
    pub(super) fn new(
        env: &WalEnv,
        catalog: &Arc<Catalog>,
        cfg: &WriterConfig,
        stats: &Arc<WalStats>,
        deferred: &Arc<Mutex<DeferredMeta>>,
        shared: &Arc<Shared>,
        dir: &Path,
    ) -> Committer {
        Committer {
            env: env.clone(),
            catalog: catalog.clone(),
            cfg: cfg.clone(),
            stats: stats.clone(),
            deferred: deferred.clone(),
            shared: shared.clone(),
            data_dir: dir.parent().unwrap_or(dir).to_path_buf(),
        }
    }

    pub(super) fn run(self, rx: mpsc::Receiver<Piped>) {
        loop {
            let first = match rx.recv_timeout(self.env.tuning.idle_flush) {
                Ok(w) => w,
                Err(RecvTimeoutError::Timeout) => {
                    self.flush_deferred();
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            };
            // Everything queued behind the first group is in the file already: one fsync
            // and one catalog transaction cover them all.
            let mut items = vec![first];
            while let Ok(w) = rx.try_recv() {
                items.push(w);
            }
            self.commit(items);
        }
        self.flush_deferred();
    }

    /// Commits the groups between rewind markers; acknowledges each marker once every group
    /// before it is done with.
    pub(super) fn commit(&self, items: Vec<Piped>) {
        let mut run = Vec::with_capacity(items.len());
        for item in items {
            match item {
                Piped::Group(w) => run.push(*w),
                Piped::Rewound(ack) => {
                    self.commit_run(std::mem::take(&mut run));
                    self.shared.rewind.store(false, Ordering::Release);
                    let _ = ack.send(());
                }
            }
        }
        self.commit_run(run);
    }

    /// Commits the groups before the first failed one, and fails the rest. While a rewind is
    /// pending, every group fails: it was written after a group whose catalog commit failed,
    /// and its bytes are being cut off.
    pub(super) fn commit_run(&self, mut groups: Vec<Written>) {
        if groups.is_empty() {
            return;
        }
        if self.shared.rewind.load(Ordering::Acquire) {
            let e = self.disk_full_error();
            for w in groups {
                for done in w.dones {
                    done.finish(Err(e.clone()));
                }
            }
            return;
        }
        let failed_at = groups
            .iter()
            .position(|w| w.error.is_some())
            .unwrap_or(groups.len());
        let failed = groups.split_off(failed_at);
        let mut result = Ok(());
        if !groups.is_empty() {
            result = self.commit_ok(groups);
        }
        for w in failed {
            let e = match (&result, w.error) {
                (Ok(()), Some(e)) => e,
                _ => CommitError::Poisoned,
            };
            result = Err(CommitError::Poisoned);
            for done in w.dones {
                done.finish(Err(e.clone()));
            }
        }
    }

    pub(super) fn disk_full_error(&self) -> CommitError {
        self.stats
            .disk_full_error
            .lock()
            .expect("disk-full lock")
            .clone()
            .unwrap_or_else(|| CommitError::DiskFull {
                path: self.data_dir.clone(),
                detail: "no space left".into(),
            })
    }

    /// Fsync, catalog transaction, completions. Returns the outcome the callers saw.
    fn commit_ok(&self, groups: Vec<Written>) -> Result<(), CommitError> {
        let mut m = merge(groups);
        let result = if self.stats.poisoned.load(Ordering::Acquire) {
            Err(CommitError::Poisoned)
        } else {
            self.sync(&m.files)
                .and_then(|()| self.catalog_commit(&mut m.g))
        };
        match &result {
            Err(CommitError::Poisoned) => {}
            // SQLite rolled the transaction back; the metadata goes with a later commit.
            Err(CommitError::DiskFull { .. }) => self.restore_deferred(std::mem::take(&mut m.g)),
            Err(e) => poison(&self.stats, e),
            Ok(()) => self.committed(&m.g, m.requests, std::mem::take(&mut m.routed)),
        }
        if let Err(e @ CommitError::DiskFull { .. }) = &result {
            // The rewind first: the writer checks it before the disk-full state, so it drains
            // its queue only after the marker's acknowledgement, which comes after the
            // callbacks below (see `Writer::fail_and_drain` for why the order matters). Set
            // before the callbacks so their callers already see the disk-full state.
            self.shared.rewind.store(true, Ordering::Release);
            enter_disk_full(&self.stats, &self.shared, &self.env.tuning, e);
        }
        for done in m.dones {
            done.finish(result.clone());
        }
        result
    }

    /// The catalog transaction of merged groups, with the deferred metadata.
    fn catalog_commit(&self, g: &mut GroupCommit) -> Result<(), CommitError> {
        self.take_deferred(g);
        if fault(&self.cfg, FaultPoint::CatalogCommit) {
            return Err(CommitError::Catalog("injected fault".into()));
        }
        if fault(&self.cfg, FaultPoint::CatalogNoSpace) {
            return Err(CommitError::DiskFull {
                path: self.data_dir.clone(),
                detail: "catalog: database or disk is full (injected)".into(),
            });
        }
        self.catalog
            .commit_group(g)
            .map_err(|e| self.catalog_error(&e))
    }

    /// After a catalog commit: the committed end moves (only forward), readers see the
    /// blocks, and then the producers are acknowledged (by the caller).
    fn committed(
        &self,
        g: &GroupCommit,
        requests: usize,
        routed: Vec<crate::streams::CommittedBlock>,
    ) {
        self.stats.record_batch(requests);
        if let Some(end) = g.wal_end {
            let before = self.stats.committed_end.swap(end, Ordering::AcqRel);
            assert!(
                end >= before,
                "the committed WAL end moved back from {before} to {end}"
            );
        }
        if let Some(hook) = &self.cfg.on_commit
            && !routed.is_empty()
        {
            hook(&crate::streams::CommittedGroup { blocks: routed });
        }
    }

    /// A catalog failure: SQLite's `SQLITE_FULL` (ENOSPC or EDQUOT while writing its log) is
    /// a full disk, rolled back; anything else poisons.
    pub(super) fn catalog_error(&self, e: &crate::catalog::CatalogError) -> CommitError {
        let full = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<rusqlite::Error>())
            .and_then(rusqlite::Error::sqlite_error_code)
            .is_some_and(|c| c == rusqlite::ErrorCode::DiskFull);
        if full {
            CommitError::DiskFull {
                path: self.data_dir.clone(),
                detail: e.to_string(),
            }
        } else {
            CommitError::Catalog(e.to_string())
        }
    }

    /// Makes the written groups durable: one `fdatasync` per file they touched.
    fn sync(&self, files: &[Arc<dyn StorageFile>]) -> Result<(), CommitError> {
        if self.skip_commit_sync() {
            return Ok(());
        }
        for f in files {
            if fault(&self.cfg, FaultPoint::Fsync) {
                return Err(CommitError::Io("injected fsync fault".into()));
            }
            f.sync().map_err(|e| CommitError::Io(e.to_string()))?;
            self.stats.fsyncs.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    #[cfg(feature = "fault-injection")]
    fn skip_commit_sync(&self) -> bool {
        self.env.tuning.mutated(super::Mutation::SkipCommitSync)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn skip_commit_sync(&self) -> bool {
        false
    }

    pub(super) fn take_deferred(&self, g: &mut GroupCommit) {
        let mut d = self.deferred.lock().expect("deferred lock");
        g.contacts.extend(d.contacts.drain());
        g.backlogs.extend(d.backlogs.drain().map(|(_, b)| b));
    }

    /// Puts back the metadata of a failed commit, unless newer values arrived meanwhile.
    pub(super) fn restore_deferred(&self, g: GroupCommit) {
        let mut d = self.deferred.lock().expect("deferred lock");
        for (device, at) in g.contacts {
            d.contacts.entry(device).or_insert(at);
        }
        for b in g.backlogs {
            d.backlogs.entry((b.device, b.stream)).or_insert(b);
        }
    }

    pub(super) fn flush_deferred(&self) {
        // While the disk is full the commit would only fail again; the metadata waits.
        if self.stats.poisoned.load(Ordering::Acquire)
            || self.stats.disk_full.load(Ordering::Acquire)
            || self.deferred.lock().expect("deferred lock").is_empty()
        {
            return;
        }
        let mut g = GroupCommit::default();
        self.take_deferred(&mut g);
        if let Err(e) = self.catalog.commit_group(&g) {
            tracing::warn!(error = %e, "could not store device contacts and backlogs");
            if matches!(self.catalog_error(&e), CommitError::DiskFull { .. }) {
                self.restore_deferred(g);
            }
        }
    }
}

/// Merges groups in write order: later marks and offsets come later, and the catalog keeps
/// the maximum mark, so nothing moves backwards.
fn merge(groups: Vec<Written>) -> Merged {
    let requests = groups.iter().map(|w| w.requests).sum();
    let mut m = Merged {
        g: GroupCommit::default(),
        dones: Vec::with_capacity(requests),
        files: Vec::new(),
        routed: Vec::new(),
        requests,
    };
    for w in groups {
        if let (Some(end), Some(before)) = (w.g.wal_end, m.g.wal_end) {
            assert!(end >= before, "groups are committed in write order");
        }
        m.g.blocks.extend(w.g.blocks);
        m.g.marks.extend(w.g.marks);
        m.g.stream_offsets.extend(w.g.stream_offsets);
        m.g.gaps.extend(w.g.gaps);
        m.g.wal_end = w.g.wal_end.or(m.g.wal_end);
        m.dones.extend(w.dones);
        m.routed.extend(w.routed);
        if let Some(f) = w.file
            && !m.files.iter().any(|x| Arc::ptr_eq(x, &f))
        {
            m.files.push(f);
        }
    }
    m
}
