//! The revocation list, polled: a changed file is reloaded and every live session re-checks
//! its certificate, so a revoked certificate's sessions end within [`REVOCATION_POLL`] plus the
//! settle bound of a closing session.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use tokio::sync::watch;

use super::ConnCtx;
#[cfg(feature = "fault-injection")]
use super::Mutation;
use crate::ingest::Hub;
use crate::pki::SharedRevocations;
use crate::refusals::RefusedAt;

/// How often the revocation list file is checked for changes: a revoked certificate's live
/// sessions are closed within this plus [`SETTLE_ON_CLOSE`].
const REVOCATION_POLL: Duration = Duration::from_millis(250);

/// Reloads the revocation list when its file changes and tells every connection. A list that
/// cannot be read leaves the previous one in force, loudly: that is never "nothing revoked".
pub(super) async fn poll_revocations(
    revocations: Arc<SharedRevocations>,
    hub: Arc<Hub>,
    tx: watch::Sender<u64>,
) {
    let stats = &hub.stats().revocation;
    // The status page shows the devices the verifier and the sessions refuse.
    stats.show_refusals(revocations.refusals().clone());
    let mut generation = 0u64;
    loop {
        tokio::time::sleep(REVOCATION_POLL).await;
        match revocations.reload_if_changed() {
            Ok(true) => {
                generation += 1;
                let list = revocations.current();
                stats.publish(&list);
                tracing::info!(
                    revoked = list.len(),
                    problems = list.problems().len(),
                    "revocation list reloaded"
                );
                if tx.send(generation).is_err() {
                    return;
                }
            }
            Ok(false) => {}
            Err(e) => {
                stats
                    .load_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::error!(
                    path = %revocations.path().display(),
                    error = %e,
                    "cannot read the revocation list; the previous list stays in force"
                );
            }
        }
    }
}

impl ConnCtx {
    /// Whether this session's certificate is revoked now, by device or by serial; a revoked
    /// one is recorded as refused `at`, for the status page.
    pub(super) fn revoked(&self, device: &str, leaf: &CertificateDer<'_>, at: RefusedAt) -> bool {
        let list = self.revocations.current();
        #[cfg(feature = "fault-injection")]
        if self.mutation == Mutation::RevokeByDeviceOnly && !list.is_revoked(device) {
            return false;
        }
        let _ = device;
        let revoked = list.is_cert_revoked(leaf);
        if revoked {
            self.revocations.refusals().refused(&list, leaf, at);
        }
        revoked
    }
}
