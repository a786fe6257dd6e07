//! The disk-full state: when writes are refused after ENOSPC, and when they resume.

#[allow(unused_imports)]
use super::*;

/// The wait after a disk-full failure before writes are tried again.
pub const DISK_FULL_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
/// The longest wait between retries while the disk stays full (the wait doubles per retry
/// that fails before anything committed).
pub const DISK_FULL_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Free bytes the WAL's file system must report before writes resume after a full disk
/// (quotas do not show in `statvfs`; the backoff bounds the retries there).
pub const DISK_FULL_RESUME_FREE_BYTES: u64 = 1 << 20;

/// Whether a write failed only because the file system (or a quota) is full. Such a write
/// can be undone by truncating; any other error leaves the file in an unknown state.
pub fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

/// Bytes available to unprivileged writers on the file system holding `dir`.
#[allow(unsafe_code)]
pub(super) fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain old data; all-zero bytes are a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// What the writer and the committer share to get through a full disk.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Set by the committer after a catalog commit failed for a full disk: the writer must cut
    /// the log back to the committed end before it writes anything else. Cleared by the
    /// committer when the writer's [`Piped::Rewound`] marker reaches it.
    pub(super) rewind: AtomicBool,
    /// When writes may be tried again.
    pub(super) full: Mutex<FullState>,
}

/// The retry schedule while the disk is full.
#[derive(Debug, Default)]
pub(super) struct FullState {
    pub(super) backoff: Duration,
    pub(super) retry_at: Option<Instant>,
    /// `group_commits` when writes last resumed: failing again before anything committed
    /// means the disk is still full, and the wait doubles.
    pub(super) commits_at_resume: u64,
}

/// Enters (or stays in) the disk-full state after `e`: writes are refused until the writer's
/// probe finds space again after the backoff.
pub(super) fn enter_disk_full(stats: &WalStats, shared: &Shared, e: &CommitError) {
    stats.disk_full_failures.fetch_add(1, Ordering::Relaxed);
    *stats.disk_full_error.lock().expect("disk-full lock") = Some(e.clone());
    let mut f = shared.full.lock().expect("disk-full state lock");
    if stats.disk_full.load(Ordering::Acquire) {
        // Another group in flight failed too; the schedule is already set.
        return;
    }
    let commits = stats.group_commits.load(Ordering::Relaxed);
    f.backoff = if f.backoff.is_zero() || commits != f.commits_at_resume {
        DISK_FULL_BACKOFF_INITIAL
    } else {
        (f.backoff * 2).min(DISK_FULL_BACKOFF_MAX)
    };
    f.retry_at = Some(Instant::now() + f.backoff);
    stats.disk_full.store(true, Ordering::Release);
    tracing::error!(
        error = %e,
        retry_in = ?f.backoff,
        "tier-1 disk full: the failed group was rolled back; refusing writes until space is free"
    );
}
