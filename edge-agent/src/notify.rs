//! systemd integration: `READY=1` once the agent serves, and watchdog pings while it is healthy.
//!
//! The unit (`firmware/systemd/tributary-edge.service`) is `Type=notify` with `WatchdogSec`.
//! Pings stop when the local log is poisoned, so systemd restarts an agent whose storage failed:
//! the restart re-verifies the disk, which is the documented way out of a poisoned log. Outside
//! systemd (`NOTIFY_SOCKET` unset) every call here does nothing.

use std::time::Duration;

use crate::log::LogHandle;

/// Tells systemd the agent is ready (the log is recovered and the API listens).
pub fn ready() {
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "sd_notify READY failed");
    }
}

/// Pings the watchdog at half its period while the log is healthy. Runs until the process ends.
pub async fn watchdog(log: LogHandle) {
    let Some(period) = sd_notify::watchdog_enabled() else {
        return;
    };
    let every = (period / 2).max(Duration::from_millis(100));
    tracing::info!(?period, "systemd watchdog enabled");
    loop {
        if log.status().poisoned.is_none() {
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
        }
        tokio::time::sleep(every).await;
    }
}
