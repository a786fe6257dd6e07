//! Closing the intervals of keys that went quiet, by the clock.
//!
//! Without this, a `downsample` interval or a `window` of a key closes only when a later
//! record of the same key arrives: a sensor that stops sending never has its last interval
//! emitted. The rule ([`IdleClose`], `[[streams]] idle_close_after`): an open interval of a key
//! is closed, and emitted, once both
//! - its end (`start + interval`, event time) plus `idle_close_after` has passed on the
//!   agent's clock (processing time), and
//! - no record of that key has reached the stage for `idle_close_after` of processing time,
//!   so a backfill of old records that keeps arriving is not cut into pieces.
//!
//! The default `idle_close_after` is the stage's own interval. A record that arrives for an
//! interval closed this way (or an older one) is late: counted in `late_records` and dropped,
//! so no interval is ever emitted twice. Each stage remembers, per key, the start of the last
//! interval the clock closed (part of its snapshot, so a derived stream keeps it across
//! restarts). The agent checks once per [`IDLE_TICK`]; tests drive [`super::Pipeline::close_idle`]
//! with a clock of their own ([`super::Pipeline::with_clock`]).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often the agent looks for idle intervals.
pub const IDLE_TICK: Duration = Duration::from_secs(1);

/// When the clock closes an interval of a quiet key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdleClose {
    /// After the stage's own interval (the default).
    #[default]
    Interval,
    /// After this many nanoseconds.
    AfterNs(i64),
    /// Never: an interval closes only when a later record of its key arrives.
    Off,
}

impl IdleClose {
    /// The wait, for a stage of `interval` ns; `None` when off.
    pub fn after_ns(self, interval: i64) -> Option<i64> {
        match self {
            IdleClose::Interval => Some(interval),
            IdleClose::AfterNs(n) => Some(n.max(0)),
            IdleClose::Off => None,
        }
    }
}

/// A pipeline's processing-time clock: nanoseconds since the Unix epoch.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The wall clock.
pub fn wall_clock() -> Clock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
    })
}

/// True when the interval `[start, start + interval)`, last fed at `seen`, is due at `now`.
pub fn due(start: i64, interval: i64, seen: i64, after: i64, now: i64) -> bool {
    let end = start.saturating_add(interval);
    now >= end.saturating_add(after) && now.saturating_sub(seen) >= after
}

/// The keys of `open` whose interval is [`due`] now, sorted (so emission order is stable);
/// `at` gives an entry's interval start and the time its key was last seen.
pub fn due_keys<T>(
    open: &std::collections::HashMap<String, T>,
    at: impl Fn(&T) -> (i64, i64),
    (interval, after, now): (i64, i64, i64),
) -> Vec<String> {
    let mut due_now: Vec<String> = open
        .iter()
        .filter(|(_, v)| {
            let (start, seen) = at(v);
            due(start, interval, seen, after, now)
        })
        .map(|(k, _)| k.clone())
        .collect();
    due_now.sort();
    due_now
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_needs_both_the_end_passed_and_the_key_quiet() {
        // Interval [0, 10), wait 5.
        assert!(!due(0, 10, 0, 5, 14), "end + wait not passed");
        assert!(due(0, 10, 0, 5, 15));
        assert!(!due(0, 10, 12, 5, 15), "a record 3 ago: not quiet");
        assert!(due(0, 10, 12, 5, 17));
        assert!(!due(i64::MAX - 1, 10, 0, 5, i64::MAX - 1), "no overflow");
        assert_eq!(IdleClose::Interval.after_ns(7), Some(7));
        assert_eq!(IdleClose::AfterNs(-3).after_ns(7), Some(0));
        assert_eq!(IdleClose::Off.after_ns(7), None);
    }
}
