//! The embedded Iceberg SQL catalog: one SQLite file beside the hub's data.
//!
//! The tables and columns are those of the Iceberg SQL catalog that pyiceberg's `SqlCatalog`
//! and iceberg-rust's `iceberg-catalog-sql` use (`iceberg_tables`,
//! `iceberg_namespace_properties`), so any of them can open the same file and read the hub's
//! tables. It is written with rusqlite rather than `iceberg-catalog-sql` because that crate's
//! SQLite driver (sqlx) links a second, older `libsqlite3-sys` than the hub's rusqlite, and a
//! binary can link only one.
//!
//! A commit writes the new metadata file first (synced through the table's [`FileIO`]), then
//! swaps the table's `metadata_location` with a compare-and-set `UPDATE` in one SQLite
//! transaction (WAL journal, `synchronous = FULL`). A crash before the swap leaves an
//! unreferenced metadata file and the table as it was; after it, the new snapshot.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use iceberg::io::FileIO;
use iceberg::spec::{TableMetadata, TableMetadataBuilder};
use iceberg::table::Table;
use iceberg::{
    Catalog, Error, ErrorKind, MetadataLocation, Namespace, NamespaceIdent, Result, TableCommit,
    TableCreation, TableIdent,
};
use rusqlite::{Connection, OptionalExtension, params};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS iceberg_tables (
    catalog_name VARCHAR(255) NOT NULL,
    table_namespace VARCHAR(255) NOT NULL,
    table_name VARCHAR(255) NOT NULL,
    metadata_location VARCHAR(1000),
    previous_metadata_location VARCHAR(1000),
    iceberg_type VARCHAR(5),
    PRIMARY KEY (catalog_name, table_namespace, table_name)
);
CREATE TABLE IF NOT EXISTS iceberg_namespace_properties (
    catalog_name VARCHAR(255) NOT NULL,
    namespace VARCHAR(255) NOT NULL,
    property_key VARCHAR(255),
    property_value VARCHAR(1000),
    PRIMARY KEY (catalog_name, namespace, property_key)
);";

/// The catalog name the hub registers its tables under (pyiceberg: `SqlCatalog("tributary")`).
pub const CATALOG_NAME: &str = "tributary";

/// An Iceberg SQL catalog on a SQLite file.
#[derive(Debug)]
pub struct SqliteCatalog {
    path: PathBuf,
    conn: Mutex<Connection>,
    file_io: FileIO,
    /// Where tables without an explicit location go: `{warehouse}/{namespace}/{table}`.
    warehouse: String,
}

fn sql_err(what: &str, e: rusqlite::Error) -> Error {
    Error::new(ErrorKind::Unexpected, format!("iceberg catalog: {what}")).with_source(e)
}

fn ns_key(ns: &NamespaceIdent) -> String {
    ns.join(".")
}

impl SqliteCatalog {
    /// Opens (creating if needed) the catalog at `path`; table files go through `file_io`.
    pub fn open(path: &Path, file_io: FileIO, warehouse: impl Into<String>) -> Result<Self> {
        let conn = Connection::open(path).map_err(|e| sql_err("opening the catalog file", e))?;
        conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;")
            .map_err(|e| sql_err("setting the journal mode", e))?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(|e| sql_err("setting the busy timeout", e))?;
        conn.execute_batch(SCHEMA)
            .map_err(|e| sql_err("creating the catalog tables", e))?;
        Ok(SqliteCatalog {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
            file_io,
            warehouse: warehouse.into(),
        })
    }

    /// The catalog file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file IO every table of this catalog uses.
    pub fn file_io(&self) -> &FileIO {
        &self.file_io
    }

    fn with_conn<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        f(&conn)
    }

    fn metadata_location(&self, t: &TableIdent) -> Result<Option<String>> {
        self.with_conn(|c| {
            c.query_row(
                "SELECT metadata_location FROM iceberg_tables
                 WHERE catalog_name = ?1 AND table_namespace = ?2 AND table_name = ?3
                   AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL)",
                params![CATALOG_NAME, ns_key(t.namespace()), t.name()],
                |r| r.get::<_, Option<String>>(0),
            )
            .optional()
        })
        .map(Option::flatten)
        .map_err(|e| sql_err("reading a table's metadata location", e))
    }

    fn table_from(
        &self,
        ident: TableIdent,
        location: String,
        metadata: TableMetadata,
    ) -> Result<Table> {
        Table::builder()
            .file_io(self.file_io.clone())
            .metadata_location(location)
            .identifier(ident)
            .metadata(metadata)
            .runtime(iceberg::Runtime::try_current()?)
            .build()
    }

    /// Makes `metadata` the table's current metadata, if the table still is at `table`'s
    /// metadata location (the same compare-and-set as every other commit). For the snapshots
    /// the `iceberg` crate has no action for: deletes of whole files and rewrites.
    pub async fn commit_metadata(&self, table: &Table, metadata: TableMetadata) -> Result<Table> {
        let current_loc = table.metadata_location_result()?;
        let next = current_loc
            .parse::<MetadataLocation>()?
            .with_next_version()
            .with_new_metadata(&metadata)
            .to_string();
        self.swap(table.identifier(), current_loc, &next, metadata)
            .await
    }

    /// Writes `metadata` at `staged_loc`, then swaps the table's row from `current_loc` to
    /// it; fails with a retryable conflict if another commit moved the row first.
    async fn swap(
        &self,
        ident: &TableIdent,
        current_loc: &str,
        staged_loc: &str,
        metadata: TableMetadata,
    ) -> Result<Table> {
        let parsed = staged_loc.parse::<MetadataLocation>()?;
        metadata.write_to(&self.file_io, &parsed).await?;
        let swapped = self
            .with_conn(|c| {
                c.execute(
                    "UPDATE iceberg_tables SET metadata_location = ?1, previous_metadata_location = ?2
                     WHERE catalog_name = ?3 AND table_namespace = ?4 AND table_name = ?5
                       AND metadata_location = ?2",
                    params![
                        staged_loc,
                        current_loc,
                        CATALOG_NAME,
                        ns_key(ident.namespace()),
                        ident.name()
                    ],
                )
            })
            .map_err(|e| sql_err("swapping a table's metadata location", e))?;
        if swapped == 0 {
            return Err(Error::new(
                ErrorKind::CatalogCommitConflicts,
                format!("table {ident} changed during the commit"),
            )
            .with_retryable(true));
        }
        self.table_from(ident.clone(), staged_loc.to_owned(), metadata)
    }
}

fn no_table(t: &TableIdent) -> Error {
    Error::new(
        ErrorKind::TableNotFound,
        format!("no table {t} in the catalog"),
    )
}

#[async_trait]
impl Catalog for SqliteCatalog {
    async fn list_namespaces(
        &self,
        parent: Option<&NamespaceIdent>,
    ) -> Result<Vec<NamespaceIdent>> {
        if parent.is_some() {
            return Ok(Vec::new());
        }
        let names = self
            .with_conn(|c| {
                let mut st = c.prepare(
                    "SELECT namespace FROM iceberg_namespace_properties WHERE catalog_name = ?1
                     UNION SELECT table_namespace FROM iceberg_tables WHERE catalog_name = ?1",
                )?;
                st.query_map([CATALOG_NAME], |r| r.get::<_, String>(0))?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(|e| sql_err("listing namespaces", e))?;
        names
            .iter()
            .map(|n| NamespaceIdent::from_strs(n.split('.')))
            .collect()
    }

    async fn create_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> Result<Namespace> {
        let mut props = properties.clone();
        // pyiceberg's marker row: a namespace exists once it has a property.
        props
            .entry("exists".into())
            .or_insert_with(|| "true".into());
        self.with_conn(|c| {
            for (k, v) in &props {
                c.execute(
                    "INSERT OR REPLACE INTO iceberg_namespace_properties VALUES (?1, ?2, ?3, ?4)",
                    params![CATALOG_NAME, ns_key(namespace), k, v],
                )?;
            }
            Ok(())
        })
        .map_err(|e| sql_err("creating a namespace", e))?;
        Ok(Namespace::with_properties(namespace.clone(), properties))
    }

    async fn get_namespace(&self, namespace: &NamespaceIdent) -> Result<Namespace> {
        if !self.namespace_exists(namespace).await? {
            return Err(Error::new(
                ErrorKind::NamespaceNotFound,
                format!("no namespace {} in the catalog", ns_key(namespace)),
            ));
        }
        let props = self
            .with_conn(|c| {
                let mut st = c.prepare(
                    "SELECT property_key, property_value FROM iceberg_namespace_properties
                     WHERE catalog_name = ?1 AND namespace = ?2",
                )?;
                st.query_map(params![CATALOG_NAME, ns_key(namespace)], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, Option<String>>(1)?.unwrap_or_default(),
                    ))
                })?
                .collect::<rusqlite::Result<HashMap<_, _>>>()
            })
            .map_err(|e| sql_err("reading a namespace", e))?;
        Ok(Namespace::with_properties(namespace.clone(), props))
    }

    async fn namespace_exists(&self, namespace: &NamespaceIdent) -> Result<bool> {
        self.with_conn(|c| {
            c.query_row(
                "SELECT EXISTS (SELECT 1 FROM iceberg_namespace_properties
                                WHERE catalog_name = ?1 AND namespace = ?2)
                     OR EXISTS (SELECT 1 FROM iceberg_tables
                                WHERE catalog_name = ?1 AND table_namespace = ?2)",
                params![CATALOG_NAME, ns_key(namespace)],
                |r| r.get::<_, bool>(0),
            )
        })
        .map_err(|e| sql_err("checking a namespace", e))
    }

    async fn update_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> Result<()> {
        self.create_namespace(namespace, properties)
            .await
            .map(|_| ())
    }

    async fn drop_namespace(&self, namespace: &NamespaceIdent) -> Result<()> {
        if !self.list_tables(namespace).await?.is_empty() {
            return Err(Error::new(
                ErrorKind::DataInvalid,
                format!("namespace {} still holds tables", ns_key(namespace)),
            ));
        }
        self.with_conn(|c| {
            c.execute(
                "DELETE FROM iceberg_namespace_properties WHERE catalog_name = ?1 AND namespace = ?2",
                params![CATALOG_NAME, ns_key(namespace)],
            )
        })
        .map_err(|e| sql_err("dropping a namespace", e))?;
        Ok(())
    }

    async fn list_tables(&self, namespace: &NamespaceIdent) -> Result<Vec<TableIdent>> {
        let names = self
            .with_conn(|c| {
                let mut st = c.prepare(
                    "SELECT table_name FROM iceberg_tables
                     WHERE catalog_name = ?1 AND table_namespace = ?2
                       AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL) ORDER BY table_name",
                )?;
                st.query_map(params![CATALOG_NAME, ns_key(namespace)], |r| {
                    r.get::<_, String>(0)
                })?
                .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(|e| sql_err("listing tables", e))?;
        Ok(names
            .into_iter()
            .map(|n| TableIdent::new(namespace.clone(), n))
            .collect())
    }

    async fn create_table(
        &self,
        namespace: &NamespaceIdent,
        creation: TableCreation,
    ) -> Result<Table> {
        let ident = TableIdent::new(namespace.clone(), creation.name.clone());
        if self.metadata_location(&ident)?.is_some() {
            return Err(Error::new(
                ErrorKind::TableAlreadyExists,
                format!("table {ident} already exists"),
            ));
        }
        let location = creation.location.clone().unwrap_or_else(|| {
            format!(
                "{}/{}/{}",
                self.warehouse.trim_end_matches('/'),
                namespace.join("/"),
                ident.name()
            )
        });
        let creation = TableCreation {
            location: Some(location.clone()),
            ..creation
        };
        let metadata = TableMetadataBuilder::from_table_creation(creation)?
            .build()?
            .metadata;
        let meta_loc = MetadataLocation::new_with_metadata(location, &metadata);
        metadata.write_to(&self.file_io, &meta_loc).await?;
        let meta_loc = meta_loc.to_string();
        self.with_conn(|c| {
            c.execute(
                "INSERT INTO iceberg_tables VALUES (?1, ?2, ?3, ?4, NULL, 'TABLE')",
                params![CATALOG_NAME, ns_key(namespace), ident.name(), meta_loc],
            )
        })
        .map_err(|e| sql_err("registering a new table", e))?;
        self.table_from(ident, meta_loc, metadata)
    }

    async fn load_table(&self, table: &TableIdent) -> Result<Table> {
        let location = self
            .metadata_location(table)?
            .ok_or_else(|| no_table(table))?;
        let metadata = TableMetadata::read_from(&self.file_io, &location).await?;
        self.table_from(table.clone(), location, metadata)
    }

    async fn drop_table(&self, table: &TableIdent) -> Result<()> {
        let n = self
            .with_conn(|c| {
                c.execute(
                    "DELETE FROM iceberg_tables
                     WHERE catalog_name = ?1 AND table_namespace = ?2 AND table_name = ?3",
                    params![CATALOG_NAME, ns_key(table.namespace()), table.name()],
                )
            })
            .map_err(|e| sql_err("dropping a table", e))?;
        if n == 0 {
            return Err(no_table(table));
        }
        Ok(())
    }

    async fn purge_table(&self, table: &TableIdent) -> Result<()> {
        self.drop_table(table).await
    }

    async fn table_exists(&self, table: &TableIdent) -> Result<bool> {
        Ok(self.metadata_location(table)?.is_some())
    }

    async fn rename_table(&self, src: &TableIdent, dest: &TableIdent) -> Result<()> {
        let n = self
            .with_conn(|c| {
                c.execute(
                    "UPDATE iceberg_tables SET table_namespace = ?4, table_name = ?5
                     WHERE catalog_name = ?1 AND table_namespace = ?2 AND table_name = ?3",
                    params![
                        CATALOG_NAME,
                        ns_key(src.namespace()),
                        src.name(),
                        ns_key(dest.namespace()),
                        dest.name()
                    ],
                )
            })
            .map_err(|e| sql_err("renaming a table", e))?;
        if n == 0 {
            return Err(no_table(src));
        }
        Ok(())
    }

    async fn register_table(&self, table: &TableIdent, metadata_location: String) -> Result<Table> {
        let metadata = TableMetadata::read_from(&self.file_io, &metadata_location).await?;
        self.with_conn(|c| {
            c.execute(
                "INSERT OR REPLACE INTO iceberg_tables VALUES (?1, ?2, ?3, ?4, NULL, 'TABLE')",
                params![
                    CATALOG_NAME,
                    ns_key(table.namespace()),
                    table.name(),
                    metadata_location
                ],
            )
        })
        .map_err(|e| sql_err("registering a table", e))?;
        self.table_from(table.clone(), metadata_location, metadata)
    }

    async fn update_table(&self, commit: TableCommit) -> Result<Table> {
        let ident = commit.identifier().clone();
        let current = self.load_table(&ident).await?;
        let current_loc = current.metadata_location_result()?.to_string();
        let staged = commit.apply(current)?;
        let staged_loc = staged.metadata_location_result()?.to_string();
        let metadata = staged.metadata().clone();
        self.swap(&ident, &current_loc, &staged_loc, metadata).await
    }
}
