//! Snapshots that remove whole data files, which the `iceberg` crate has no action for.
//!
//! [`remove_files`] writes a `delete` snapshot: every manifest of the current snapshot that
//! holds a removed file is rewritten (the file's entry marked deleted, the others kept as
//! existing, with their sequence numbers), every other manifest is carried over as it is, and
//! the new manifest list and metadata are swapped in by the catalog's compare-and-set. The
//! files themselves stay in storage: older snapshots still reference them until they expire
//! ([`super::maintain`]). The snapshot carries the parent's `tributary.tiered-end` over, so
//! the exactly-once mark of [`super::Lake::commit_ranges`] is never lost by a delete.

use std::collections::{BTreeSet, HashMap};

use iceberg::spec::{
    DataFileFormat, FormatVersion, MAIN_BRANCH, ManifestContentType, ManifestFile,
    ManifestListWriter, ManifestWriter, ManifestWriterBuilder, Operation, Snapshot, Summary,
};
use iceberg::table::Table;
use iceberg::{Error, ErrorKind, Result};

use super::TIERED_END;
use super::catalog::SqlCatalog;

/// Summary key: data files a `delete` snapshot removed.
pub const DELETED_FILES: &str = "deleted-data-files";
/// Summary key: records those files held.
pub const DELETED_RECORDS: &str = "deleted-records";

/// What [`remove_files`] removed from the table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    pub files: u64,
    pub records: u64,
}

/// A fresh snapshot id no snapshot of `table` has.
fn new_snapshot_id(table: &Table) -> i64 {
    loop {
        let id = rand::random::<i64>() & i64::MAX;
        if id != 0 && table.metadata().snapshot_by_id(id).is_none() {
            return id;
        }
    }
}

struct Producer<'a> {
    table: &'a Table,
    snapshot_id: i64,
    sequence_number: i64,
    tag: String,
    manifests_written: u32,
}

impl Producer<'_> {
    fn metadata_path(&self, name: &str) -> String {
        format!("{}/metadata/{name}", self.table.metadata().location())
    }

    fn manifest_writer(&mut self) -> Result<ManifestWriter> {
        self.manifests_written += 1;
        let path = self.metadata_path(&format!(
            "{}-m{}.{}",
            self.tag,
            self.manifests_written,
            DataFileFormat::Avro
        ));
        let meta = self.table.metadata();
        let builder = ManifestWriterBuilder::new(
            self.table.file_io().new_output(path)?,
            Some(self.snapshot_id),
            meta.current_schema().clone(),
            meta.default_partition_spec().as_ref().clone(),
        );
        Ok(builder.build_v2_data())
    }

    /// `manifest` without the entries of `remove` (marked deleted), or `None` when it holds
    /// none of them (it is then carried over unchanged).
    async fn rewrite(
        &mut self,
        manifest: &ManifestFile,
        remove: &BTreeSet<String>,
        removed: &mut Removed,
    ) -> Result<Option<ManifestFile>> {
        let loaded = manifest.load_manifest(self.table.file_io()).await?;
        let hits = |e: &&std::sync::Arc<iceberg::spec::ManifestEntry>| {
            e.is_alive() && remove.contains(e.file_path())
        };
        if !loaded.entries().iter().any(|e| hits(&e)) {
            return Ok(None);
        }
        let mut writer = self.manifest_writer()?;
        for e in loaded.entries().iter().filter(|e| e.is_alive()) {
            let seq = e.sequence_number.unwrap_or(manifest.sequence_number);
            let file_seq = e.file_sequence_number.or(Some(manifest.sequence_number));
            if hits(&e) {
                removed.files += 1;
                removed.records += e.record_count();
                writer.add_delete_file(e.data_file().clone(), seq, file_seq)?;
            } else {
                let added_by = e.snapshot_id().unwrap_or(manifest.added_snapshot_id);
                writer.add_existing_file(e.data_file().clone(), added_by, seq, file_seq)?;
            }
        }
        Ok(Some(writer.write_manifest_file().await?))
    }
}

/// Removes the data files at `remove` (full URIs, as the table's manifests name them) from
/// the current snapshot in one `delete` snapshot. Files the table no longer holds are skipped,
/// so a retry after a crash is harmless; with none left to remove nothing is committed.
/// Returns the table after the commit and what was removed.
pub async fn remove_files(
    catalog: &SqlCatalog,
    table: Table,
    remove: &BTreeSet<String>,
) -> Result<(Table, Removed)> {
    let Some(current) = table.metadata().current_snapshot().cloned() else {
        return Ok((table, Removed::default()));
    };
    if table.metadata().format_version() != FormatVersion::V2 {
        return Err(Error::new(
            ErrorKind::FeatureUnsupported,
            "whole-file deletes are written for format v2 tables only",
        ));
    }
    let list = table.manifest_list_reader(&current).load().await?;
    let snapshot_id = new_snapshot_id(&table);
    let mut p = Producer {
        table: &table,
        snapshot_id,
        sequence_number: table.metadata().next_sequence_number(),
        tag: format!("del-{snapshot_id}"),
        manifests_written: 0,
    };
    let mut removed = Removed::default();
    let mut manifests = Vec::with_capacity(list.entries().len());
    for m in list.entries() {
        let kept = match m.content {
            ManifestContentType::Data => p.rewrite(m, remove, &mut removed).await?,
            ManifestContentType::Deletes => None,
        };
        manifests.push(kept.unwrap_or_else(|| m.clone()));
    }
    if removed.files == 0 {
        return Ok((table, removed));
    }
    let list_path = p.metadata_path(&format!("snap-{snapshot_id}-0-{}.avro", p.tag));
    let mut writer = ManifestListWriter::v2(
        table.file_io().new_output(&list_path)?.writer().await?,
        snapshot_id,
        Some(current.snapshot_id()),
        p.sequence_number,
    );
    writer.add_manifests(manifests.into_iter())?;
    writer.close().await?;

    let mut props = HashMap::from([
        (DELETED_FILES.to_owned(), removed.files.to_string()),
        (DELETED_RECORDS.to_owned(), removed.records.to_string()),
    ]);
    if let Some(end) = current.summary().additional_properties.get(TIERED_END) {
        props.insert(TIERED_END.to_owned(), end.clone());
    }
    let snapshot = Snapshot::builder()
        .with_snapshot_id(snapshot_id)
        .with_parent_snapshot_id(Some(current.snapshot_id()))
        .with_sequence_number(p.sequence_number)
        .with_timestamp_ms(chrono::Utc::now().timestamp_millis())
        .with_manifest_list(list_path)
        .with_summary(Summary {
            operation: Operation::Delete,
            additional_properties: props,
        })
        .with_schema_id(table.metadata().current_schema_id())
        .build();
    let location = table.metadata_location_result()?.to_owned();
    let metadata = (table.metadata().clone())
        .into_builder(Some(location))
        .set_branch_snapshot(snapshot, MAIN_BRANCH)?
        .build()?
        .metadata;
    let table = catalog.commit_metadata(&table, metadata).await?;
    Ok((table, removed))
}
