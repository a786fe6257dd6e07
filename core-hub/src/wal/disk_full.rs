//! The disk-full state machine: when writes are refused after ENOSPC, and when they resume.
//!
//! ```text
//!            enter (a group failed for a full disk)
//!   Open ───────────────────────────────────────────► Full { retry_at, backoff }
//!    ▲                                                  │  enter again: stays Full
//!    └──────────── resume (retry_at passed and ─────────┘
//!                  the file system shows space)
//! ```
//!
//! The backoff starts at [`WalTuning::disk_full_backoff_initial`] and doubles, up to the
//! maximum, each time the disk fills again before anything committed since the last resume.
//! [`FullState`] is the pure part (clock and counters passed in); [`enter_disk_full`] and
//! [`try_resume`] apply it to the writer's shared flags.
//!
//! Running out of file descriptors (EMFILE, ENFILE) when a roll creates the next WAL file, or
//! syncs the directory, is transient in the same way and uses the same schedule, owned by the
//! writer alone ([`enter_fd_exhausted`], [`fd_retry_due`], [`end_fd_exhausted`]): the group is
//! cut off and its requests fail with the retryable `FdExhausted`, requests are refused until
//! the backoff has passed, then the next group (or the writer's idle probe) tries again. One
//! `error` line when an episode starts, one `warn` line when it ends; every failed attempt
//! counts in `tributary_hub_wal_fd_exhausted_total`. `open(2)` fails with EMFILE or ENFILE
//! before it creates anything, so a failed creation leaves no file behind.

use super::{CommitError, WalStats, WalTuning};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

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

/// Whether an operation failed only because the process (EMFILE) or the system (ENFILE) has
/// no file descriptor left: nothing was created or changed, and it can be retried later.
pub fn is_fd_exhausted(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// The retryable error for a failed descriptor allocation at `path`.
pub(super) fn fd_error(path: &std::path::Path, e: &std::io::Error) -> CommitError {
    CommitError::FdExhausted {
        path: path.to_path_buf(),
        detail: e.to_string(),
    }
}

/// What the writer and the committer share to get through a full disk.
#[derive(Debug, Default)]
pub(super) struct Shared {
    /// Set by the committer after a catalog commit failed for a full disk: the writer must cut
    /// the log back to the committed end before it writes anything else. Cleared by the
    /// committer when the writer's rewind marker reaches it.
    pub(super) rewind: AtomicBool,
    /// When writes may be tried again.
    pub(super) full: Mutex<FullState>,
}

/// The retry schedule while the disk is full.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct FullState {
    backoff: Duration,
    /// `Some` while full: when a probe may first end it.
    retry_at: Option<Instant>,
    /// `group_commits` when writes last resumed: failing again before anything committed
    /// means the disk is still full, and the wait doubles.
    commits_at_resume: u64,
}

impl FullState {
    /// Enters the full state at `now`, `commits` group commits into the run. Returns the
    /// backoff chosen, or `None` if already full (another group in flight failed too).
    pub(super) fn enter(&mut self, now: Instant, commits: u64, t: &WalTuning) -> Option<Duration> {
        if self.retry_at.is_some() {
            return None;
        }
        self.backoff = if self.backoff.is_zero() || commits != self.commits_at_resume {
            t.disk_full_backoff_initial
        } else {
            (self.backoff * 2).min(t.disk_full_backoff_max)
        };
        assert!(self.backoff <= t.disk_full_backoff_max.max(t.disk_full_backoff_initial));
        self.retry_at = Some(now + self.backoff);
        Some(self.backoff)
    }

    /// Whether a probe at `now`, seeing `free` bytes, ends the full state.
    pub(super) fn may_resume(&self, now: Instant, free: Option<u64>, t: &WalTuning) -> bool {
        let Some(at) = self.retry_at else {
            return false;
        };
        now >= at && free.is_none_or(|b| b >= t.disk_full_resume_free_bytes)
    }

    /// Leaves the full state, `commits` group commits into the run.
    pub(super) fn resume(&mut self, now: Instant, commits: u64) {
        let at = self.retry_at.take();
        assert!(
            at.is_some_and(|at| now >= at),
            "resumed before the backoff passed"
        );
        self.commits_at_resume = commits;
    }

    pub(super) fn is_full(&self) -> bool {
        self.retry_at.is_some()
    }
}

/// Enters (or stays in) the disk-full state after `e`: writes are refused until the writer's
/// probe finds space again after the backoff.
pub(super) fn enter_disk_full(stats: &WalStats, shared: &Shared, t: &WalTuning, e: &CommitError) {
    assert!(
        matches!(e, CommitError::DiskFull { .. }),
        "not a full disk: {e}"
    );
    stats.disk_full_failures.fetch_add(1, Ordering::Relaxed);
    *stats.disk_full_error.lock().expect("disk-full lock") = Some(e.clone());
    let mut f = shared.full.lock().expect("disk-full state lock");
    let commits = stats.group_commits.load(Ordering::Relaxed);
    let Some(backoff) = f.enter(Instant::now(), commits, t) else {
        assert!(
            stats.disk_full.load(Ordering::Acquire),
            "full state without the flag"
        );
        return;
    };
    stats.disk_full.store(true, Ordering::Release);
    tracing::error!(
        error = %e,
        retry_in = ?backoff,
        "tier-1 disk full: the failed group was rolled back; refusing writes until space is free"
    );
}

/// Ends the disk-full state once the backoff has passed and `free()` shows space. Returns
/// whether writes resumed. The next groups are the real test: if they fail again, the wait
/// doubles.
pub(super) fn try_resume(
    stats: &WalStats,
    shared: &Shared,
    t: &WalTuning,
    free: impl FnOnce() -> Option<u64>,
) -> bool {
    if !stats.disk_full.load(Ordering::Acquire)
        || stats.poisoned.load(Ordering::Acquire)
        || shared.rewind.load(Ordering::Acquire)
    {
        return false;
    }
    let mut f = shared.full.lock().expect("disk-full state lock");
    let now = Instant::now();
    let free = free();
    if !f.may_resume(now, free, t) {
        return false;
    }
    f.resume(now, stats.group_commits.load(Ordering::Relaxed));
    stats.disk_full.store(false, Ordering::Release);
    stats.disk_full_resumed.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(free_bytes = %crate::logging::Maybe(free.as_ref()), "the WAL's file system has space again; tier-1 writes resume");
    true
}

/// Starts (or extends) an out-of-descriptors episode after the failed attempt `e`: counts
/// it, and refuses writes for the next backoff (doubling while nothing commits in between).
/// Logs only when the episode starts.
pub(super) fn enter_fd_exhausted(
    stats: &WalStats,
    fd: &mut FullState,
    t: &WalTuning,
    e: &CommitError,
) {
    assert!(
        matches!(e, CommitError::FdExhausted { .. }),
        "not an fd exhaustion: {e}"
    );
    stats.fd_exhausted_failures.fetch_add(1, Ordering::Relaxed);
    *stats.fd_exhausted_error.lock().expect("fd lock") = Some(e.clone());
    let commits = stats.group_commits.load(Ordering::Relaxed);
    let backoff = fd.enter(Instant::now(), commits, t);
    if !stats.fd_exhausted.swap(true, Ordering::AcqRel) {
        tracing::error!(
            error = %e,
            retry_in = ?backoff,
            "tier-1 out of file descriptors: the failed group was rolled back; refusing writes \
             and retrying with backoff (raise the hub's open-file limit if this repeats)"
        );
    }
}

/// Whether the backoff of an episode has passed at `now`: if so, the episode's wait ends
/// (the next attempt decides). `false` while waiting, and when no episode runs.
pub(super) fn fd_retry_due(
    stats: &WalStats,
    fd: &mut FullState,
    t: &WalTuning,
    now: Instant,
) -> bool {
    if !fd.may_resume(now, None, t) {
        return false;
    }
    fd.resume(now, stats.group_commits.load(Ordering::Relaxed));
    true
}

/// The error requests are refused with while an episode waits out its backoff.
pub(super) fn fd_refusal(stats: &WalStats, fd: &FullState) -> Option<CommitError> {
    if !fd.is_full() {
        return None;
    }
    stats.fd_exhausted_error.lock().expect("fd lock").clone()
}

/// Ends the episode after an attempt got its descriptors (a group written, or the probe).
pub(super) fn end_fd_exhausted(stats: &WalStats) {
    if stats.fd_exhausted.swap(false, Ordering::AcqRel) {
        tracing::warn!("tier 1 has file descriptors again; writes resume");
    }
}

impl WalStats {
    /// The error writes fail with while tier 1 is out of file descriptors, `None` otherwise.
    pub fn fd_exhausted(&self) -> Option<CommitError> {
        if !self.fd_exhausted.load(Ordering::Acquire) {
            return None;
        }
        self.fd_exhausted_error.lock().expect("fd lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuning() -> WalTuning {
        WalTuning {
            disk_full_backoff_initial: Duration::from_millis(100),
            disk_full_backoff_max: Duration::from_millis(350),
            disk_full_resume_free_bytes: 10,
            ..WalTuning::default()
        }
    }

    #[test]
    fn backoff_doubles_while_nothing_commits_and_resets_after_a_commit() {
        let t = tuning();
        let mut f = FullState::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(f.enter(t0, 0, &t), Some(ms(100)));
        assert_eq!(f.enter(t0, 0, &t), None, "already full");
        assert!(!f.may_resume(t0 + ms(99), None, &t));
        assert!(f.may_resume(t0 + ms(100), None, &t));
        f.resume(t0 + ms(100), 0);
        assert_eq!(f.enter(t0 + ms(101), 0, &t), Some(ms(200)));
        f.resume(t0 + ms(301), 0);
        assert_eq!(f.enter(t0 + ms(302), 0, &t), Some(ms(350)), "capped");
        f.resume(t0 + ms(652), 0);
        assert_eq!(
            f.enter(t0 + ms(653), 1, &t),
            Some(ms(100)),
            "a commit resets"
        );
    }

    #[test]
    fn resume_needs_the_free_space_when_it_is_known() {
        let t = tuning();
        let mut f = FullState::default();
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        assert!(!f.may_resume(later, None, &t), "not full");
        f.enter(t0, 0, &t);
        assert!(!f.may_resume(later, Some(9), &t));
        assert!(f.may_resume(later, Some(10), &t));
        assert!(
            f.may_resume(later, None, &t),
            "unknown free space: the backoff decides"
        );
        f.resume(later, 0);
        assert!(!f.is_full());
    }

    #[test]
    #[should_panic(expected = "resumed before the backoff passed")]
    fn resuming_early_is_a_bug() {
        let t = tuning();
        let mut f = FullState::default();
        let t0 = Instant::now();
        f.enter(t0, 0, &t);
        f.resume(t0, 0);
    }

    #[test]
    fn the_shared_flags_follow_the_state() {
        let t = WalTuning {
            disk_full_backoff_initial: Duration::ZERO,
            ..tuning()
        };
        let stats = WalStats::default();
        let shared = Shared::default();
        let e = CommitError::DiskFull {
            path: "/x".into(),
            detail: "full".into(),
        };
        enter_disk_full(&stats, &shared, &t, &e);
        assert!(stats.disk_full().is_some());
        assert!(!try_resume(&stats, &shared, &t, || Some(0)));
        assert!(try_resume(&stats, &shared, &t, || Some(10)));
        assert!(stats.disk_full().is_none());
        assert_eq!(stats.disk_full_resumed.load(Ordering::Relaxed), 1);
        assert_eq!(stats.disk_full_failures.load(Ordering::Relaxed), 1);
    }
}
