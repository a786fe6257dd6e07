//! Test-only switches that turn recovery rules off, so that mutation tests can show the crash
//! simulation's checker notices when a rule is missing.
//!
//! They exist only with the `fault-injection` cargo feature, which this crate's own
//! dev-dependencies enable for its tests; a build without the feature has no switch at all, and
//! nothing here reads the environment. A switch is per thread, because recovery runs on the
//! thread that calls [`super::Log::open`] and tests run in parallel threads.

#[cfg(feature = "fault-injection")]
mod imp {
    use std::cell::Cell;

    thread_local! {
        static BATCH_RULE: Cell<bool> = const { Cell::new(true) };
        static HOLE_RULE: Cell<bool> = const { Cell::new(true) };
    }

    /// Turns the batch-completeness rule on or off for recoveries run by this thread. Off,
    /// recovery keeps every block of an incomplete batch.
    pub fn set_batch_rule(on: bool) {
        BATCH_RULE.with(|c| c.set(on));
    }

    /// Turns the never-durable hole rule on or off for recoveries run by this thread. Off,
    /// every hole followed by a valid frame is taken for corruption, as before sync marks.
    pub fn set_hole_rule(on: bool) {
        HOLE_RULE.with(|c| c.set(on));
    }

    pub(crate) fn batch_rule() -> bool {
        BATCH_RULE.with(Cell::get)
    }

    pub(crate) fn hole_rule() -> bool {
        HOLE_RULE.with(Cell::get)
    }
}

#[cfg(feature = "fault-injection")]
pub(crate) use imp::{batch_rule, hole_rule};
#[cfg(feature = "fault-injection")]
pub use imp::{set_batch_rule, set_hole_rule};

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn batch_rule() -> bool {
    true
}

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn hole_rule() -> bool {
    true
}

/// Mutation check for block cutting: off, the sealer and the re-blocker seal a run in one block
/// whatever its columns, as they once did. Process-wide (the writer has its own thread), so only
/// a test binary of its own may turn it off.
#[cfg(feature = "fault-injection")]
static BLOCK_CUT_OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns block cutting at the columnar limits on or off, process-wide.
#[cfg(feature = "fault-injection")]
pub fn set_block_cut(on: bool) {
    BLOCK_CUT_OFF.store(!on, std::sync::atomic::Ordering::SeqCst);
}

/// Whether sealing cuts blocks at the columnar limits (always, without the feature).
pub fn block_cut() -> bool {
    #[cfg(feature = "fault-injection")]
    return !BLOCK_CUT_OFF.load(std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(feature = "fault-injection"))]
    true
}
