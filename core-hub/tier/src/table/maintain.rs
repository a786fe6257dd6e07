//! Table maintenance: snapshot expiry and the removal of files no snapshot references.
//!
//! - **Expiry**: snapshots older than `snapshot_retention` are removed from the metadata (the
//!   current one always stays), by the `iceberg` crate's expire action through the catalog's
//!   compare-and-set. Time travel reaches back as far as the retention.
//! - **Orphans**: an object under the table's location is removed when no retained snapshot
//!   references it (the current metadata file and the metadata log, every snapshot's manifest
//!   list, its manifests and their live data files), the hub does not hold it as a chunk of
//!   its own (`keep`: chunks uploaded and not yet committed), and it is older than
//!   `orphan_grace`. Orphans are what expiry leaves (manifest lists and metadata files of
//!   expired snapshots, data files a retention delete removed), manifests and metadata a commit
//!   wrote before it lost a crash or a conflict, and metadata files beyond the log's length
//!   (`write.metadata.previous-versions-max`).
//!
//! Both run on the committer's task, between commits, so no commit of this hub is in flight;
//! each run removes at most `deletes_max` objects, the rest waits for the next run.

use std::collections::BTreeSet;
use std::time::Duration;

use iceberg::Result;
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};

use super::catalog::SqlCatalog;
use super::io::ObjectStoreIo;

/// How far maintenance goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaintainPolicy {
    /// Snapshots older than this expire (time travel reaches back this far).
    pub snapshot_retention: Duration,
    /// Unreferenced objects younger than this stay (a writer other than this hub may be
    /// between writing them and committing).
    pub orphan_grace: Duration,
    /// At most this many objects are removed per run.
    pub deletes_max: usize,
}

impl Default for MaintainPolicy {
    fn default() -> Self {
        MaintainPolicy {
            snapshot_retention: Duration::from_secs(7 * 86_400),
            orphan_grace: Duration::from_secs(3_600),
            deletes_max: 1_000,
        }
    }
}

/// What one maintenance run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Maintained {
    pub snapshots_expired: u64,
    pub orphans_removed: u64,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Expires the snapshots older than `retention` (never the current one). Returns the table
/// after it and how many expired; without any to expire nothing is committed.
pub async fn expire(
    catalog: &SqlCatalog,
    table: Table,
    retention: Duration,
    now_ms: i64,
) -> Result<(Table, u64)> {
    let cutoff = now_ms.saturating_sub(millis(retention));
    let current = table.metadata().current_snapshot_id();
    let due = table
        .metadata()
        .snapshots()
        .any(|s| s.timestamp_ms() < cutoff && Some(s.snapshot_id()) != current);
    if !due {
        return Ok((table, 0));
    }
    let before = table.metadata().snapshots().len();
    let tx = Transaction::new(&table);
    let tx = (tx.expire_snapshots())
        .expire_older_than_ms(cutoff)
        .retain_last(1)
        .apply(tx)?;
    let table = tx.commit(catalog).await?;
    let after = table.metadata().snapshots().len();
    Ok((table, before.saturating_sub(after) as u64))
}

/// Every URI a retained snapshot of `table` references: metadata files, manifest lists,
/// manifests and the data files live in some snapshot.
pub async fn referenced(table: &Table) -> Result<BTreeSet<String>> {
    referenced_by(table, true).await
}

/// [`referenced`], or with `all_snapshots` off what the current snapshot alone references
/// (the mutation of the tests: a time-travel reader then loses files).
pub(crate) async fn referenced_by(table: &Table, all_snapshots: bool) -> Result<BTreeSet<String>> {
    let meta = table.metadata();
    let mut refs = BTreeSet::new();
    refs.insert(table.metadata_location_result()?.to_owned());
    refs.extend(meta.metadata_log().iter().map(|l| l.metadata_file.clone()));
    let mut manifests = BTreeSet::new();
    let current = meta.current_snapshot_id();
    let snapshots = meta.snapshots();
    for snapshot in snapshots.filter(|s| all_snapshots || Some(s.snapshot_id()) == current) {
        refs.insert(snapshot.manifest_list().to_owned());
        let list = table.manifest_list_reader(snapshot).load().await?;
        for m in list.entries() {
            if !manifests.insert(m.manifest_path.clone()) {
                continue;
            }
            let loaded = m.load_manifest(table.file_io()).await?;
            refs.extend(
                (loaded.entries().iter())
                    .filter(|e| e.is_alive())
                    .map(|e| e.file_path().to_owned()),
            );
        }
    }
    refs.extend(manifests);
    Ok(refs)
}

/// An object a run may remove: unreferenced, not the hub's, older than the grace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    /// The object's key in tier 2.
    pub key: String,
    pub last_modified_ns: i64,
}

/// The orphans among `objects` (tier-2 keys under the table's location, with their last
/// modification), oldest first and at most `policy.deletes_max`.
pub fn orphans(
    io: &ObjectStoreIo,
    objects: impl IntoIterator<Item = (String, i64)>,
    referenced: &BTreeSet<String>,
    keep: impl Fn(&str) -> bool,
    policy: &MaintainPolicy,
    now_ns: i64,
) -> Vec<Orphan> {
    let grace = i64::try_from(policy.orphan_grace.as_nanos()).unwrap_or(i64::MAX);
    let mut out: Vec<Orphan> = objects
        .into_iter()
        .filter(|(key, modified)| {
            !referenced.contains(&io.uri(key))
                && !keep(key)
                && now_ns.saturating_sub(*modified) >= grace
        })
        .map(|(key, last_modified_ns)| Orphan {
            key,
            last_modified_ns,
        })
        .collect();
    out.sort_by_key(|o| o.last_modified_ns);
    out.truncate(policy.deletes_max);
    out
}
