//! Upkeep of the streams' Iceberg tables on the tiering task: snapshot expiry and orphan
//! removal ([`tier::table::maintain`]), at most once per `tier2.maintenance_interval`; and,
//! when tiering opens, the table brought up to what the hub's catalog holds as tiered.
//!
//! It runs after a round's commits, evictions and retention, under the round lock, so no
//! commit of this hub is in flight while it decides what is an orphan. It never fails a
//! round: an error is logged, counted (`tributary_hub_iceberg_maintenance_errors_total`) and
//! retried at the next interval, so tiering (and through it ingest) never waits on it.

use super::store;
use super::{TierOpenError, Tiering};
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
    /// Appends to each stream's table the ranges the hub's catalog holds as tiered and the
    /// table lacks. That happens only when the table was lost or is behind: a catalog rebuilt
    /// by `recover --from-tier2` (the table itself is registered again from its newest
    /// metadata file, `tier::table::Lake::table`), or an Iceberg catalog restored from an
    /// older copy. The ranges come from tier 2's manifests, whose files are durable. Returns
    /// the number of ranges appended.
    pub(super) async fn reconcile_lake(&self) -> Result<u64, TierOpenError> {
        let Some(lake) = &self.lake else {
            return Ok(0);
        };
        let mut appended = 0;
        for (sid, st) in store::streams_with_state(self.hub.catalog())? {
            let Some(name) = self.hub.stream_name(sid) else {
                continue;
            };
            let held = lake.tiered_end(&name).await?;
            if held >= st.tiered_end {
                continue;
            }
            let fail = |source: tier::TierError| TierOpenError::Reconcile {
                stream: name.clone(),
                source: Box::new(source),
            };
            let manifests = (self.store.list_manifests(&name).await).map_err(|e| fail(e.into()))?;
            let (ranges, columns) = missing_ranges(manifests, held, st.tiered_end);
            let Some(last) = ranges.last() else {
                continue;
            };
            let registry = tier::FieldRegistry::from_columns(columns)
                .map_err(|e| fail(e.into()))?
                .without_widening();
            tracing::warn!(
                stream = %name,
                table_end = held,
                tiered_end = st.tiered_end,
                ranges = ranges.len(),
                "the Iceberg table lacks tiered ranges; appending them from tier 2's manifests"
            );
            if last.end < st.tiered_end {
                // Chunk files a rebuild adopted without a manifest: no summary to describe
                // them by, so the table does not list them (docs/tiering.md).
                tracing::warn!(
                    stream = %name,
                    from = last.end,
                    to = st.tiered_end,
                    "tiered offsets without manifests are left out of the Iceberg table"
                );
            }
            lake.commit_ranges(&name, &registry, &ranges).await?;
            appended += ranges.len() as u64;
        }
        Ok(appended)
    }

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

/// The ranges `[held, tiered_end)` of `manifests` (grouped by the range each manifest names),
/// in offset order, with the columns of the last manifest.
fn missing_ranges(
    manifests: Vec<tier::Manifest>,
    held: u64,
    tiered_end: u64,
) -> (Vec<tier::table::LakeRange>, Vec<tier::ColumnSpec>) {
    let mut ranges: std::collections::BTreeMap<u64, tier::table::LakeRange> = Default::default();
    let mut columns = Vec::new();
    let mut manifests = manifests;
    manifests.sort_by_key(|m| m.first_offset);
    for m in manifests {
        let first = m.extra["range_first"].as_u64().unwrap_or(m.first_offset);
        let end = m.extra["range_end"].as_u64().unwrap_or(m.end_offset);
        if first < held || end > tiered_end {
            continue;
        }
        columns.clone_from(&m.columns);
        let range = ranges
            .entry(first)
            .or_insert_with(|| tier::table::LakeRange {
                first,
                end,
                files: Vec::new(),
            });
        range.files.push(tier::table::LakeFile {
            path: m.path,
            summary: m.summary,
        });
    }
    (ranges.into_values().collect(), columns)
}
