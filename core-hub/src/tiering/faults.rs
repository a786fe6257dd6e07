//! Test-only fault points in the tiering protocol, like `wal::FaultPoint` for tier 1.
//!
//! A fault makes the step fail (the uploader stops this round and retries later), or, with
//! `TRIBUTARY_TIER_FAULT=<point>:exit`, ends the whole process at once with exit code 86, which
//! is how the crash tests kill a real hub exactly between upload and commit; `<point>:delay:MS`
//! only holds the step open, so that the system crash loop's random kills land there. Only
//! builds with core-hub's `fault-injection` feature read the variable (the test build,
//! `cargo build --workspace --all-targets`); a release build has no hook and no variable.

use std::sync::Arc;

/// The environment variable a child hub process reads its fault from.
#[cfg(feature = "fault-injection")]
pub const FAULT_ENV: &str = "TRIBUTARY_TIER_FAULT";
/// Exit code of a process ended by an `:exit` fault.
pub const FAULT_EXIT_CODE: i32 = 86;

/// A step of the upload protocol where a test can inject a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierFaultPoint {
    /// After the chunk object was uploaded and verified, before any manifest is written.
    AfterUpload,
    /// After the manifests were written, before the Iceberg commit (or the catalog commit).
    AfterManifest,
    /// After the range's Iceberg snapshot was committed, before the hub's catalog commit.
    AfterTableCommit,
    /// After the catalog commit, before WAL files are evicted.
    BeforeEvict,
}

impl TierFaultPoint {
    #[cfg(feature = "fault-injection")]
    fn name(self) -> &'static str {
        match self {
            TierFaultPoint::AfterUpload => "after_upload",
            TierFaultPoint::AfterManifest => "after_manifest",
            TierFaultPoint::AfterTableCommit => "after_table_commit",
            TierFaultPoint::BeforeEvict => "before_evict",
        }
    }
}

/// Called at every [`TierFaultPoint`]; returning `true` makes that step fail.
pub type TierFaultHook = Arc<dyn Fn(TierFaultPoint) -> bool + Send + Sync>;

/// The hook described by [`FAULT_ENV`], if set: `after_upload:exit` exits the process at that
/// point (after `skip` earlier hits, with `after_upload:exit:3`), `after_upload:fail` fails it
/// every time, `after_upload:delay:300` holds that step open for 300 ms and goes on.
/// Always `None` without the `fault-injection` feature.
#[cfg(not(feature = "fault-injection"))]
pub fn hook_from_env() -> Option<TierFaultHook> {
    None
}

/// See the build without the feature, which always returns `None`.
#[cfg(feature = "fault-injection")]
pub fn hook_from_env() -> Option<TierFaultHook> {
    let spec = std::env::var(FAULT_ENV).ok()?;
    let mut parts = spec.split(':');
    let point = parts.next()?.to_string();
    let action = parts.next().unwrap_or("fail").to_string();
    let number: u64 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let (skip, spec_delay_ms) = if action == "delay" {
        (0, number)
    } else {
        (number, 0)
    };
    let hits = std::sync::atomic::AtomicU64::new(0);
    tracing::error!(%spec, "{FAULT_ENV} is set: tiering fault injection is ON (tests only)");
    Some(Arc::new(move |p: TierFaultPoint| {
        if p.name() != point {
            return false;
        }
        if hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < skip {
            return false;
        }
        if action == "delay" {
            // `<point>:delay:MS` holds the step open for MS milliseconds and lets it go on: the
            // crash loop widens the window between upload and commit so that random kills land
            // in it. The counter field is the delay here, not a skip count.
            let ms = spec_delay_ms;
            let wait = || std::thread::sleep(std::time::Duration::from_millis(ms));
            match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
                _ => wait(),
            }
            return false;
        }
        if action == "exit" {
            eprintln!("TIER_FAULT_EXIT {}", p.name());
            std::process::exit(FAULT_EXIT_CODE);
        }
        true
    }))
}
