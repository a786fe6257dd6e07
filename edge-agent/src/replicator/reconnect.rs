//! How long one connection attempt may take before it counts as failed.
//!
//! quinn gives up on a handshake only at the transport's idle timeout (30 s), so a hub that
//! restarted while an attempt's first packets were lost, or that is not listening yet, held
//! the agent for 30 s before its next try. The first attempts after a session ended get a short
//! deadline instead (a LAN or even a slow cellular handshake takes well under a second); it
//! doubles with each failed attempt up to the transport's own, so a hub that is really away,
//! or a link that needs long handshakes, still gets the full time and the backoff between
//! attempts keeps growing to `backoff_max`.

use std::time::Duration;

/// The first attempt's deadline.
pub(super) const CONNECT_TIMEOUT_FIRST: Duration = Duration::from_secs(1);
/// The longest deadline: the transport's idle timeout.
pub(super) const CONNECT_TIMEOUT_MAX: Duration = Duration::from_secs(30);

/// Attempts right after a session that lived: a hub restart is the likely cause, so they come
/// quickly (a jittered [`FAST_RETRY`] apart, each with the first deadline) before the usual
/// growing backoff takes over for a hub that is really away.
pub(super) const FAST_RETRIES: u32 = 8;
/// The delay (jittered into its upper half) between fast attempts.
pub(super) const FAST_RETRY: Duration = Duration::from_millis(400);

/// The deadline of the attempt after `failures` failed attempts in a row.
pub(super) fn connect_timeout(failures: u32) -> Duration {
    CONNECT_TIMEOUT_FIRST
        .saturating_mul(1u32 << failures.min(16))
        .min(CONNECT_TIMEOUT_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_starts_short_and_grows_to_the_transport_timeout() {
        assert_eq!(connect_timeout(0), Duration::from_secs(1));
        assert_eq!(connect_timeout(1), Duration::from_secs(2));
        assert_eq!(connect_timeout(4), Duration::from_secs(16));
        assert_eq!(connect_timeout(5), CONNECT_TIMEOUT_MAX);
        assert_eq!(connect_timeout(40), CONNECT_TIMEOUT_MAX);
        // Fast attempts after a hub restart: a failed one plus the wait stays under 2 s.
        assert!(CONNECT_TIMEOUT_FIRST + FAST_RETRY < Duration::from_secs(2));
    }
}
