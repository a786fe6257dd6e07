//! Upkeep of the streams' Iceberg tables on the tiering task: snapshot expiry and orphan
//! removal ([`tier::table::maintain`]), at most once per `tier2.maintenance_interval`.
//!
//! It runs after a round's commits, evictions and retention, under the round lock, so no
//! commit of this hub is in flight while it decides what is an orphan. It never fails a
//! round: an error is logged, counted (`tributary_hub_iceberg_maintenance_errors_total`) and
//! retried at the next interval, so tiering (and through it ingest) never waits on it.

use super::Tiering;
use super::store;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// What one pass over every table did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LakeUpkeep {
    pub tables: u64,
    pub snapshots_expired: u64,
    pub orphans_removed: u64,
}

impl Tiering {
    /// Runs the tables' upkeep if `maintenance_interval` passed since the last run (or
    /// `force`). Returns what it did, `None` when it did not run.
    pub async fn maintain_lake(&self, force: bool) -> Option<LakeUpkeep> {
        let lake = self.lake.as_ref()?;
        let interval = self.cfg.lake.maintenance_interval;
        {
            let mut last = self.lake_maintained.lock().expect("upkeep lock");
            if !force && last.is_some_and(|t| t.elapsed() < interval) {
                return None;
            }
            *last = Some(Instant::now());
        }
        let mut done = LakeUpkeep::default();
        let policy = self.cfg.lake.policy;
        // A whole pass may take many requests: bounded as a whole, generously.
        let limit = self.cfg.request_timeout * 30;
        for (stream, keep) in self.hub_chunks_by_stream().ok()? {
            let run = lake.maintain(&stream, &policy, |k| keep.contains(k));
            match tokio::time::timeout(limit, run).await {
                Ok(Ok(m)) => {
                    done.tables += 1;
                    done.snapshots_expired += m.snapshots_expired;
                    done.orphans_removed += m.orphans_removed;
                }
                Ok(Err(e)) => self.upkeep_failed(&stream, &e.to_string()),
                Err(_) => self.upkeep_failed(&stream, &format!("took longer than {limit:?}")),
            }
        }
        let s = &self.stats;
        s.lake_snapshots_expired
            .fetch_add(done.snapshots_expired, Relaxed);
        s.lake_orphans_removed
            .fetch_add(done.orphans_removed, Relaxed);
        Some(done)
    }

    fn upkeep_failed(&self, stream: &str, error: &str) {
        self.stats.lake_maintenance_errors.fetch_add(1, Relaxed);
        tracing::warn!(
            stream,
            error,
            "iceberg table maintenance failed; retried next interval"
        );
    }

    /// Every tiered stream's name with the tier-2 keys of the chunks the hub holds (pending
    /// or committed): never orphans, whatever the table says.
    fn hub_chunks_by_stream(&self) -> Result<Vec<(String, BTreeSet<String>)>, String> {
        let cat = self.hub.catalog();
        let fail = |e: crate::catalog::CatalogError| {
            self.upkeep_failed("*", &e.to_string());
            e.to_string()
        };
        let pending = store::pending_chunks(cat).map_err(fail)?;
        let mut out = Vec::new();
        for (sid, _) in store::streams_with_state(cat).map_err(fail)? {
            let Some(name) = self.hub.stream_name(sid) else {
                continue;
            };
            let mut keep: BTreeSet<String> = (store::committed_chunks(cat, sid).map_err(fail)?)
                .into_iter()
                .map(|c| c.path)
                .collect();
            keep.extend(
                pending
                    .iter()
                    .filter(|c| c.stream == sid)
                    .map(|c| c.path.clone()),
            );
            out.push((name, keep));
        }
        Ok(out)
    }
}
