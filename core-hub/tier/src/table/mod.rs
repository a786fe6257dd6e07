//! Streams as Apache Iceberg tables (format v2) over the tier-2 chunk files.
//!
//! Each stream is the table `tributary.{stream}` of an Iceberg SQL catalog ([`catalog`]); its
//! location is the stream's chunk prefix (`streams/{stream}/`), its data files are the chunk
//! files the hub already writes, and its metadata lives in `streams/{stream}/metadata/`
//! (JSON and Avro, which a `*.parquet` glob never matches). Nothing is stored twice.
//!
//! - **Schema**: the chunk's fixed columns with fixed field ids 1 to 8, then one column per
//!   registry column, added by a schema update the first time a range carries it. Chunk files
//!   carry no Parquet field ids, so the table's `schema.name-mapping.default` maps every
//!   column name to its id (the mapping every Iceberg reader applies to such files).
//! - **Partitioning**: by the day of `ingest_ts`. Tiering cuts its ranges where the ingest day
//!   changes, so every chunk lies in one partition and a day's chunks are one contiguous run
//!   of hub offsets. `ts` (event time) bounds are in every data file's metrics, so engines
//!   prune event-time filters from the manifests.
//! - **Exactly once**: [`Lake::commit_ranges`] appends ranges' files in one snapshot whose
//!   summary records `tributary.tiered-end` (the last range's end offset). Before it commits
//!   it reads the current snapshot's mark: a range at or below it was committed before a
//!   crash, and is not appended again. The hub's own catalog moves `tiered_end` only after this
//!   returns, so a crash anywhere leaves each record in the table once.

pub mod catalog;
pub mod io;
pub mod maintain;
pub mod rewrite;

use std::collections::HashMap;
use std::sync::Arc;

use iceberg::spec::{
    DataContentType, DataFileBuilder, DataFileFormat, Datum, Literal, NestedField, PrimitiveType,
    Schema, Struct, Transform, Type, UnboundPartitionSpec,
};
use iceberg::table::Table;
use iceberg::transaction::AddColumn;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::{Catalog, NamespaceIdent, TableCreation, TableIdent};

use crate::chunk::ChunkSummary;
use crate::schema::{FieldRegistry, ValueKind};
use crate::store::Tier2;

pub use catalog::{CATALOG_NAME, CatalogLocation, SqlCatalog};
pub use io::ObjectStoreIo;
pub use maintain::{MaintainPolicy, Maintained};
pub use rewrite::Removed;

/// The namespace of every stream's table.
pub const NAMESPACE: &str = "tributary";
/// Snapshot summary key: the stream offset every record below which is in the table.
pub const TIERED_END: &str = "tributary.tiered-end";
/// Snapshot summary key: the first stream offset of the range the snapshot appended.
pub const RANGE_FIRST: &str = "tributary.range-first";
/// The table property Iceberg readers resolve file columns by, when files carry no field ids.
pub const NAME_MAPPING: &str = "schema.name-mapping.default";

/// Why a table operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LakeError {
    #[error("iceberg table {table}: {what}: {source}")]
    Iceberg {
        table: String,
        what: &'static str,
        #[source]
        source: Box<iceberg::Error>,
    },
    #[error("iceberg catalog {path}: {source}")]
    Catalog {
        path: String,
        #[source]
        source: Box<iceberg::Error>,
    },
    #[error("iceberg table {table}: listing its files: {source}")]
    List {
        table: String,
        #[source]
        source: Box<crate::store::ListError>,
    },
    #[error("iceberg table {table}: removing an orphan: {source}")]
    Delete {
        table: String,
        #[source]
        source: Box<crate::store::DeleteError>,
    },
}

/// The fixed columns of every chunk, with their field ids and Iceberg types.
fn fixed_fields() -> Vec<NestedField> {
    use PrimitiveType::{Int, Long, String as Str, Timestamptz};
    let f = |id, name: &str, t| NestedField::required(id, name, Type::Primitive(t));
    vec![
        f(1, "device", Str),
        f(2, "epoch", Long),
        f(3, "seq", Long),
        f(4, "hub_offset", Long),
        f(5, "key", Str),
        f(6, "ts", Timestamptz),
        f(7, "ts_ns_rem", Int),
        f(8, "ingest_ts", Timestamptz),
    ]
}

const HUB_OFFSET_ID: i32 = 4;
const TS_ID: i32 = 6;
const INGEST_TS_ID: i32 = 8;

fn iceberg_type(kind: ValueKind) -> Type {
    Type::Primitive(match kind {
        ValueKind::F64 => PrimitiveType::Double,
        ValueKind::I64 => PrimitiveType::Long,
        ValueKind::Bool => PrimitiveType::Boolean,
        ValueKind::Str | ValueKind::Tag => PrimitiveType::String,
        ValueKind::Bytes => PrimitiveType::Binary,
    })
}

/// The name mapping (`schema.name-mapping.default`) of `schema`: each top-level column's name
/// to its field id.
fn name_mapping(schema: &Schema) -> String {
    let entries: Vec<serde_json::Value> = schema
        .as_struct()
        .fields()
        .iter()
        .map(|f| serde_json::json!({"field-id": f.id, "names": [f.name]}))
        .collect();
    serde_json::Value::Array(entries).to_string()
}

/// One chunk file to append: its object key and what it holds.
#[derive(Debug, Clone)]
pub struct LakeFile {
    pub path: String,
    pub summary: ChunkSummary,
}

/// One tiering range to append: `[first, end)` of the stream and its chunk files.
#[derive(Debug, Clone)]
pub struct LakeRange {
    pub first: u64,
    pub end: u64,
    pub files: Vec<LakeFile>,
}

/// What [`Lake::commit_ranges`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// A new snapshot holds the range.
    Committed { snapshot_id: i64 },
    /// The table already held the range (committed before a crash): nothing was appended.
    AlreadyCommitted,
}

/// The Iceberg tables of one hub's tier 2.
#[derive(Debug, Clone)]
pub struct Lake {
    catalog: Arc<SqlCatalog>,
    io: ObjectStoreIo,
    tier2: Tier2,
    namespace: NamespaceIdent,
    /// Mutation switch of the tests: off, a range is appended even if the table holds it.
    #[cfg(feature = "fault-injection")]
    recheck: Arc<std::sync::atomic::AtomicBool>,
    /// Mutation switch of the tests: off, orphan removal keeps only what the current
    /// snapshot references.
    #[cfg(feature = "fault-injection")]
    all_snapshots: Arc<std::sync::atomic::AtomicBool>,
}

fn day_of(ns: i64) -> i32 {
    i32::try_from(ns.div_euclid(86_400 * 1_000_000_000)).unwrap_or(i32::MAX)
}

impl Lake {
    /// Opens the catalog at `catalog` for the tables of `tier2`, whose root URI is `base`
    /// (`file:///srv/tier2`, `s3://bucket`).
    pub async fn open(
        tier2: &Tier2,
        base: &str,
        catalog: &CatalogLocation,
    ) -> Result<Lake, LakeError> {
        let io = ObjectStoreIo::new(base, tier2.store().clone());
        let cat_err = |source| LakeError::Catalog {
            path: catalog.to_string(),
            source: Box::new(source),
        };
        let catalog = (SqlCatalog::open(catalog, io.file_io(), base).await).map_err(cat_err)?;
        let namespace = NamespaceIdent::new(NAMESPACE.to_owned());
        if !catalog
            .namespace_exists(&namespace)
            .await
            .map_err(cat_err)?
        {
            catalog
                .create_namespace(&namespace, HashMap::new())
                .await
                .map_err(cat_err)?;
        }
        Ok(Lake {
            catalog: Arc::new(catalog),
            io,
            tier2: tier2.clone(),
            namespace,
            #[cfg(feature = "fault-injection")]
            recheck: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            #[cfg(feature = "fault-injection")]
            all_snapshots: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        })
    }

    /// Turns the already-committed check of [`Lake::commit_ranges`] off or on (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn set_recheck(&self, on: bool) {
        self.recheck.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    #[cfg(feature = "fault-injection")]
    fn rechecks(&self) -> bool {
        self.recheck.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn rechecks(&self) -> bool {
        true
    }

    /// Makes orphan removal keep only what the current snapshot references (off) or what
    /// any retained snapshot does (on, the default). Tests only.
    #[cfg(feature = "fault-injection")]
    pub fn set_orphans_see_all_snapshots(&self, on: bool) {
        self.all_snapshots
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    #[cfg(feature = "fault-injection")]
    fn orphans_see_all_snapshots(&self) -> bool {
        self.all_snapshots.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn orphans_see_all_snapshots(&self) -> bool {
        true
    }

    /// The catalog.
    pub fn catalog(&self) -> &Arc<SqlCatalog> {
        &self.catalog
    }

    /// The URI a table's metadata names the tier-2 object `key` by.
    pub fn uri(&self, key: &str) -> String {
        self.io.uri(key)
    }

    fn ident(&self, stream: &str) -> TableIdent {
        TableIdent::new(self.namespace.clone(), stream.to_owned())
    }

    fn err<'a>(
        stream: &'a str,
        what: &'static str,
    ) -> impl FnOnce(iceberg::Error) -> LakeError + 'a {
        move |source| LakeError::Iceberg {
            table: format!("{NAMESPACE}.{stream}"),
            what,
            source: Box::new(source),
        }
    }

    /// The stream's table, created (empty, with the fixed columns) if it does not exist.
    pub async fn table(&self, stream: &str) -> Result<Table, LakeError> {
        let ident = self.ident(stream);
        let exists = (self.catalog.table_exists(&ident).await)
            .map_err(Self::err(stream, "looking it up"))?;
        if exists {
            return (self.catalog.load_table(&ident).await)
                .map_err(Self::err(stream, "loading it"));
        }
        if let Some(location) = self.newest_metadata(stream).await? {
            tracing::warn!(
                table = %ident,
                %location,
                "the catalog lacks the table; registering its newest metadata file from tier 2"
            );
            return (self.catalog.register_table(&ident, location).await)
                .map_err(Self::err(stream, "registering it again"));
        }
        let schema = Schema::builder()
            .with_fields(fixed_fields().into_iter().map(Arc::new))
            .build()
            .map_err(Self::err(stream, "building its schema"))?;
        let spec = UnboundPartitionSpec::builder()
            .add_partition_field(INGEST_TS_ID, "ingest_day", Transform::Day)
            .map_err(Self::err(stream, "building its partition spec"))?
            .build();
        let creation = TableCreation::builder()
            .name(stream.to_owned())
            .location(
                self.io
                    .uri(crate::layout::chunks_prefix(stream).trim_end_matches('/')),
            )
            .properties([(NAME_MAPPING.to_owned(), name_mapping(&schema))])
            .format_version(iceberg::spec::FormatVersion::V2)
            .schema(schema)
            .partition_spec(spec)
            .build();
        (self.catalog.create_table(&self.namespace, creation).await)
            .map_err(Self::err(stream, "creating it"))
    }

    /// The URI of the highest-versioned `*.metadata.json` under the stream's table location,
    /// if any: the table as it was last committed (or as a commit that lost its swap left it,
    /// which holds only ranges whose files and manifests were durable). A catalog lost with
    /// the hub's data directory is rebuilt from it.
    async fn newest_metadata(&self, stream: &str) -> Result<Option<String>, LakeError> {
        let prefix = format!("{}metadata/", crate::layout::chunks_prefix(stream));
        let objects = (self.tier2.list(&prefix).await).map_err(|source| LakeError::List {
            table: format!("{NAMESPACE}.{stream}"),
            source: Box::new(source),
        })?;
        let version = |key: &str| -> Option<u64> {
            let name = key.rsplit('/').next()?.strip_suffix(".metadata.json")?;
            name.split('-').next()?.parse().ok()
        };
        Ok(objects
            .iter()
            .filter_map(|o| Some((version(&o.path)?, &o.path)))
            .max()
            .map(|(_, key)| self.io.uri(key)))
    }

    /// The offset below which every record of `stream` is in its table (0 for a new table).
    pub async fn tiered_end(&self, stream: &str) -> Result<u64, LakeError> {
        Ok(tiered_end_of(&self.table(stream).await?))
    }

    /// Adds the registry's columns the table lacks (in registry order, so field ids follow
    /// the registry's ordinals) and refreshes the name mapping. Returns the table after it.
    async fn evolve(
        &self,
        stream: &str,
        table: Table,
        registry: &FieldRegistry,
    ) -> Result<Table, LakeError> {
        let schema = table.metadata().current_schema().clone();
        let missing: Vec<_> = registry
            .columns()
            .iter()
            .filter(|c| schema.field_by_name(&c.name).is_none())
            .collect();
        if missing.is_empty() {
            return Ok(table);
        }
        let tx = Transaction::new(&table);
        let mut update = tx.update_schema();
        for c in &missing {
            update = update.add_column(AddColumn::optional(&c.name, iceberg_type(c.kind)));
        }
        let tx = update
            .apply(tx)
            .map_err(Self::err(stream, "adding columns"))?;
        let table =
            (tx.commit(&*self.catalog).await).map_err(Self::err(stream, "adding columns"))?;
        let mapping = name_mapping(table.metadata().current_schema());
        let tx = Transaction::new(&table);
        let tx = tx
            .update_table_properties()
            .set(NAME_MAPPING.to_owned(), mapping)
            .apply(tx)
            .map_err(Self::err(stream, "updating its name mapping"))?;
        (tx.commit(&*self.catalog).await).map_err(Self::err(stream, "updating its name mapping"))
    }

    /// Appends tiering ranges of `stream` (consecutive, in offset order) in one snapshot,
    /// leaving out those the table already holds (committed before a crash: a range ending at
    /// or below the current snapshot's mark).
    pub async fn commit_ranges(
        &self,
        stream: &str,
        registry: &FieldRegistry,
        ranges: &[LakeRange],
    ) -> Result<CommitOutcome, LakeError> {
        let table = self.table(stream).await?;
        let held = if self.rechecks() {
            tiered_end_of(&table)
        } else {
            0
        };
        let todo: Vec<&LakeRange> = ranges.iter().filter(|r| r.end > held).collect();
        let (Some(first), Some(last)) = (todo.first(), todo.last()) else {
            return Ok(CommitOutcome::AlreadyCommitted);
        };
        assert!(
            first.first >= held,
            "ranges end on range boundaries: {}..{} against the mark {held}",
            first.first,
            first.end
        );
        let table = self.evolve(stream, table, registry).await?;
        let data_files = (todo.iter().flat_map(|r| &r.files))
            .map(|f| self.data_file(stream, f))
            .collect::<Result<Vec<_>, _>>()?;
        let props = HashMap::from([
            (TIERED_END.to_owned(), last.end.to_string()),
            (RANGE_FIRST.to_owned(), first.first.to_string()),
        ]);
        let tx = Transaction::new(&table);
        let tx = tx
            .fast_append()
            // The mark above is the check: iceberg-rust's own duplicate check reads every
            // manifest of the table on every commit, a cost that grows with the table.
            .with_check_duplicate(false)
            .add_data_files(data_files)
            .set_snapshot_properties(props)
            .apply(tx)
            .map_err(Self::err(stream, "appending ranges"))?;
        let table =
            (tx.commit(&*self.catalog).await).map_err(Self::err(stream, "appending ranges"))?;
        let snapshot_id = table.metadata().current_snapshot_id().unwrap_or(-1);
        assert_eq!(
            tiered_end_of(&table),
            last.end,
            "the new snapshot carries the last range's end"
        );
        Ok(CommitOutcome::Committed { snapshot_id })
    }

    /// Removes the chunk files at `paths` (tier-2 keys) from the stream's table in one
    /// `delete` snapshot (tier-2 retention). The objects stay until no retained snapshot
    /// references them ([`Lake::maintain`]); files the table no longer holds are skipped.
    pub async fn delete_files(&self, stream: &str, paths: &[String]) -> Result<Removed, LakeError> {
        let table = self.table(stream).await?;
        let uris = paths.iter().map(|p| self.io.uri(p)).collect();
        let (_, removed) = rewrite::remove_files(&self.catalog, table, &uris)
            .await
            .map_err(Self::err(stream, "deleting files"))?;
        Ok(removed)
    }

    /// Expires the stream's old snapshots, then removes what no retained snapshot references
    /// (see [`maintain`]). `keep` names the tier-2 keys the hub holds as chunks of its own.
    pub async fn maintain(
        &self,
        stream: &str,
        policy: &MaintainPolicy,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Maintained, LakeError> {
        let table = self.table(stream).await?;
        let now_ns = chrono::Utc::now().timestamp_nanos_opt().unwrap_or(i64::MAX);
        let (table, snapshots_expired) = maintain::expire(
            &self.catalog,
            table,
            policy.snapshot_retention,
            now_ns / 1_000_000,
        )
        .await
        .map_err(Self::err(stream, "expiring snapshots"))?;
        let refs = (maintain::referenced_by(&table, self.orphans_see_all_snapshots()).await)
            .map_err(Self::err(stream, "reading what its snapshots reference"))?;
        let name = || format!("{NAMESPACE}.{stream}");
        let objects =
            (self.tier2.list(&crate::layout::chunks_prefix(stream)).await).map_err(|source| {
                LakeError::List {
                    table: name(),
                    source: Box::new(source),
                }
            })?;
        let objects = objects.into_iter().map(|o| (o.path, o.last_modified_ns));
        let orphans = maintain::orphans(&self.io, objects, &refs, keep, policy, now_ns);
        for o in &orphans {
            (self.tier2.delete(&o.key).await).map_err(|source| LakeError::Delete {
                table: name(),
                source: Box::new(source),
            })?;
        }
        Ok(Maintained {
            snapshots_expired,
            orphans_removed: orphans.len() as u64,
        })
    }

    fn data_file(&self, stream: &str, f: &LakeFile) -> Result<iceberg::spec::DataFile, LakeError> {
        let s = &f.summary;
        let micros = |ns: i64| ns.div_euclid(1000);
        let day = day_of(s.min_ingest_ts_ns);
        assert_eq!(
            day,
            day_of(s.max_ingest_ts_ns),
            "a chunk lies in one ingest day ({})",
            f.path
        );
        let lower = HashMap::from([
            (HUB_OFFSET_ID, Datum::long(s.min_offset as i64)),
            (TS_ID, Datum::timestamptz_micros(micros(s.min_ts_ns))),
            (
                INGEST_TS_ID,
                Datum::timestamptz_micros(micros(s.min_ingest_ts_ns)),
            ),
        ]);
        let upper = HashMap::from([
            (HUB_OFFSET_ID, Datum::long(s.max_offset as i64)),
            (TS_ID, Datum::timestamptz_micros(micros(s.max_ts_ns))),
            (
                INGEST_TS_ID,
                Datum::timestamptz_micros(micros(s.max_ingest_ts_ns)),
            ),
        ]);
        DataFileBuilder::default()
            .content(DataContentType::Data)
            .file_path(self.io.uri(&f.path))
            .file_format(DataFileFormat::Parquet)
            .partition(Struct::from_iter([Some(Literal::date(day))]))
            .record_count(s.rows)
            .file_size_in_bytes(s.bytes)
            .lower_bounds(lower)
            .upper_bounds(upper)
            .build()
            .map_err(|e| LakeError::Iceberg {
                table: format!("{NAMESPACE}.{stream}"),
                what: "describing a data file",
                source: Box::new(iceberg::Error::new(
                    iceberg::ErrorKind::DataInvalid,
                    e.to_string(),
                )),
            })
    }
}

/// The `tributary.tiered-end` of the table's current snapshot (0 without one).
pub fn tiered_end_of(table: &Table) -> u64 {
    table
        .metadata()
        .current_snapshot()
        .and_then(|s| s.summary().additional_properties.get(TIERED_END).cloned())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
