//! The Iceberg SQL catalog of the hub's tables: on a SQLite file beside the hub's data (the
//! default, nothing to run), or on a PostgreSQL database shared by several hubs.
//!
//! The tables and columns are those of the Iceberg SQL catalog that pyiceberg's `SqlCatalog`
//! and iceberg-rust's `iceberg-catalog-sql` use (`iceberg_tables`,
//! `iceberg_namespace_properties`), so any of them can open the same database and read the
//! hub's tables. It is written with rusqlite and tokio-postgres rather than
//! `iceberg-catalog-sql` because that crate's SQLite driver (sqlx) links a second, older
//! `libsqlite3-sys` than the hub's rusqlite, and a binary can link only one. The statements
//! are the same on both (`$N` parameters, numbered in the order they first appear, which
//! SQLite binds by position too; upserts as `ON CONFLICT ... DO UPDATE`).
//!
//! A commit writes the new metadata file first (synced through the table's [`FileIO`]), then
//! swaps the table's `metadata_location` with a compare-and-set `UPDATE` (SQLite: WAL journal,
//! `synchronous = FULL`; PostgreSQL: one statement, atomic). A crash before the swap leaves an
//! unreferenced metadata file and the table as it was; after it, the new snapshot.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use async_trait::async_trait;
use iceberg::io::FileIO;
use iceberg::spec::{TableMetadata, TableMetadataBuilder};
use iceberg::table::Table;
use iceberg::{
    Catalog, Error, ErrorKind, MetadataLocation, Namespace, NamespaceIdent, Result, TableCommit,
    TableCreation, TableIdent,
};
use rusqlite::Connection;

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

/// Where the catalog lives (`[tier2] iceberg_catalog`).
#[derive(Clone, PartialEq, Eq)]
pub enum CatalogLocation {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (`postgresql://user:password@host:port/database`).
    Postgres(String),
}

impl CatalogLocation {
    /// A `postgresql://` or `postgres://` URL, else a SQLite file path.
    pub fn parse(v: &str) -> CatalogLocation {
        if v.starts_with("postgresql://") || v.starts_with("postgres://") {
            CatalogLocation::Postgres(v.to_owned())
        } else {
            CatalogLocation::Sqlite(PathBuf::from(v))
        }
    }
}

/// Shown without the password of a PostgreSQL URL (logs, errors, `Debug` of the config).
impl std::fmt::Display for CatalogLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CatalogLocation::Sqlite(p) => write!(f, "{}", p.display()),
            CatalogLocation::Postgres(url) => match (url.find("://"), url.rfind('@')) {
                (Some(scheme), Some(at)) if at > scheme => {
                    let userinfo = &url[scheme + 3..at];
                    let user = userinfo.split(':').next().unwrap_or("");
                    let hidden = if userinfo.contains(':') { ":***" } else { "" };
                    write!(f, "{}{user}{hidden}{}", &url[..scheme + 3], &url[at..])
                }
                _ => f.write_str(url),
            },
        }
    }
}

impl std::fmt::Debug for CatalogLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CatalogLocation({self})")
    }
}

/// The database under the catalog.
enum Db {
    Sqlite(Mutex<Connection>),
    Postgres {
        url: String,
        /// Connected on first use and again after the connection broke.
        client: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    },
}

type Row = Vec<Option<String>>;

fn pg_args<'a>(params: &'a [&'a str]) -> Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)> {
    params.iter().map(|p| p as _).collect()
}

fn sql_err(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::new(ErrorKind::Unexpected, format!("iceberg catalog: {what}")).with_source(e)
}

impl Db {
    async fn postgres(url: &str) -> Result<tokio_postgres::Client> {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| sql_err("connecting to PostgreSQL", e))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::warn!(error = %e, "iceberg catalog: the PostgreSQL connection ended");
            }
        });
        Ok(client)
    }

    /// The PostgreSQL client, connected again if the connection broke.
    async fn connected<'a>(
        url: &str,
        slot: &'a tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    ) -> Result<tokio::sync::MutexGuard<'a, Option<tokio_postgres::Client>>> {
        let mut guard = slot.lock().await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            *guard = Some(Self::postgres(url).await?);
        }
        Ok(guard)
    }

    /// Runs `sql` with string parameters; returns its rows (every column as text).
    async fn query(&self, what: &str, sql: &str, params: &[&str]) -> Result<Vec<Row>> {
        match self {
            Db::Sqlite(conn) => {
                let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
                let run = || -> rusqlite::Result<Vec<Row>> {
                    let mut st = conn.prepare(sql)?;
                    let n = st.column_count();
                    let rows = st.query_map(rusqlite::params_from_iter(params), |r| {
                        (0..n).map(|i| r.get::<_, Option<String>>(i)).collect()
                    })?;
                    rows.collect()
                };
                run().map_err(|e| sql_err(what, e))
            }
            Db::Postgres { url, client } => {
                let guard = Self::connected(url, client).await?;
                let c = guard.as_ref().expect("connected");
                let rows = (c.query(sql, &pg_args(params)).await).map_err(|e| sql_err(what, e))?;
                Ok(rows
                    .iter()
                    .map(|r| {
                        (0..r.len())
                            .map(|i| r.get::<_, Option<String>>(i))
                            .collect()
                    })
                    .collect())
            }
        }
    }

    /// Runs a statement; returns the rows it changed.
    async fn execute(&self, what: &str, sql: &str, params: &[&str]) -> Result<u64> {
        match self {
            Db::Sqlite(conn) => {
                let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
                (conn.execute(sql, rusqlite::params_from_iter(params)))
                    .map(|n| n as u64)
                    .map_err(|e| sql_err(what, e))
            }
            Db::Postgres { url, client } => {
                let guard = Self::connected(url, client).await?;
                let c = guard.as_ref().expect("connected");
                (c.execute(sql, &pg_args(params)).await).map_err(|e| sql_err(what, e))
            }
        }
    }
}

/// An Iceberg SQL catalog on SQLite or PostgreSQL.
pub struct SqlCatalog {
    location: CatalogLocation,
    db: Db,
    file_io: FileIO,
    /// Where tables without an explicit location go: `{warehouse}/{namespace}/{table}`.
    warehouse: String,
}

impl std::fmt::Debug for SqlCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlCatalog")
            .field("location", &self.location)
            .finish_non_exhaustive()
    }
}

fn ns_key(ns: &NamespaceIdent) -> String {
    ns.join(".")
}

const TABLE_LOCATION: &str = "SELECT metadata_location FROM iceberg_tables
     WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3
       AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL)";

const UPSERT_TABLE: &str = "INSERT INTO iceberg_tables VALUES ($1, $2, $3, $4, NULL, 'TABLE')
     ON CONFLICT (catalog_name, table_namespace, table_name)
     DO UPDATE SET metadata_location = EXCLUDED.metadata_location,
                   previous_metadata_location = NULL, iceberg_type = 'TABLE'";

impl SqlCatalog {
    /// Opens (creating if needed) the catalog at `location`; table files go through
    /// `file_io`. A PostgreSQL database is connected to (and its tables created) now, so a
    /// wrong URL or an unreachable server fails the start with its reason.
    pub async fn open(
        location: &CatalogLocation,
        file_io: FileIO,
        warehouse: impl Into<String>,
    ) -> Result<Self> {
        let db = match location {
            CatalogLocation::Sqlite(path) => {
                let conn =
                    Connection::open(path).map_err(|e| sql_err("opening the catalog file", e))?;
                conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;")
                    .map_err(|e| sql_err("setting the journal mode", e))?;
                conn.busy_timeout(std::time::Duration::from_secs(10))
                    .map_err(|e| sql_err("setting the busy timeout", e))?;
                conn.execute_batch(SCHEMA)
                    .map_err(|e| sql_err("creating the catalog tables", e))?;
                Db::Sqlite(Mutex::new(conn))
            }
            CatalogLocation::Postgres(url) => {
                let client = Db::postgres(url).await?;
                client
                    .batch_execute(SCHEMA)
                    .await
                    .map_err(|e| sql_err("creating the catalog tables", e))?;
                Db::Postgres {
                    url: url.clone(),
                    client: tokio::sync::Mutex::new(Some(client)),
                }
            }
        };
        Ok(SqlCatalog {
            location: location.clone(),
            db,
            file_io,
            warehouse: warehouse.into(),
        })
    }

    /// Where the catalog lives.
    pub fn location(&self) -> &CatalogLocation {
        &self.location
    }

    /// The file IO every table of this catalog uses.
    pub fn file_io(&self) -> &FileIO {
        &self.file_io
    }

    async fn metadata_location(&self, t: &TableIdent) -> Result<Option<String>> {
        let ns = ns_key(t.namespace());
        let rows = (self.db)
            .query(
                "reading a table's metadata location",
                TABLE_LOCATION,
                &[CATALOG_NAME, &ns, t.name()],
            )
            .await?;
        Ok(rows
            .into_iter()
            .next()
            .and_then(|r| r.into_iter().next().flatten()))
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
        let ns = ns_key(ident.namespace());
        let swapped = (self.db)
            .execute(
                "swapping a table's metadata location",
                "UPDATE iceberg_tables SET metadata_location = $1, previous_metadata_location = $2
                 WHERE catalog_name = $3 AND table_namespace = $4 AND table_name = $5
                   AND metadata_location = $2",
                &[staged_loc, current_loc, CATALOG_NAME, &ns, ident.name()],
            )
            .await?;
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

fn first_column(rows: Vec<Row>) -> Vec<String> {
    rows.into_iter()
        .filter_map(|r| r.into_iter().next().flatten())
        .collect()
}

#[async_trait]
impl Catalog for SqlCatalog {
    async fn list_namespaces(
        &self,
        parent: Option<&NamespaceIdent>,
    ) -> Result<Vec<NamespaceIdent>> {
        if parent.is_some() {
            return Ok(Vec::new());
        }
        let rows = (self.db)
            .query(
                "listing namespaces",
                "SELECT namespace FROM iceberg_namespace_properties WHERE catalog_name = $1
                 UNION SELECT table_namespace FROM iceberg_tables WHERE catalog_name = $1",
                &[CATALOG_NAME],
            )
            .await?;
        first_column(rows)
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
        let ns = ns_key(namespace);
        for (k, v) in &props {
            (self.db)
                .execute(
                    "creating a namespace",
                    "INSERT INTO iceberg_namespace_properties VALUES ($1, $2, $3, $4)
                     ON CONFLICT (catalog_name, namespace, property_key)
                     DO UPDATE SET property_value = EXCLUDED.property_value",
                    &[CATALOG_NAME, &ns, k, v],
                )
                .await?;
        }
        Ok(Namespace::with_properties(namespace.clone(), properties))
    }

    async fn get_namespace(&self, namespace: &NamespaceIdent) -> Result<Namespace> {
        if !self.namespace_exists(namespace).await? {
            return Err(Error::new(
                ErrorKind::NamespaceNotFound,
                format!("no namespace {} in the catalog", ns_key(namespace)),
            ));
        }
        let ns = ns_key(namespace);
        let rows = (self.db)
            .query(
                "reading a namespace",
                "SELECT property_key, property_value FROM iceberg_namespace_properties
                 WHERE catalog_name = $1 AND namespace = $2",
                &[CATALOG_NAME, &ns],
            )
            .await?;
        let props = rows
            .into_iter()
            .filter_map(|mut r| {
                let v = r.pop().flatten().unwrap_or_default();
                Some((r.pop().flatten()?, v))
            })
            .collect();
        Ok(Namespace::with_properties(namespace.clone(), props))
    }

    async fn namespace_exists(&self, namespace: &NamespaceIdent) -> Result<bool> {
        let ns = ns_key(namespace);
        let rows = (self.db)
            .query(
                "checking a namespace",
                "SELECT namespace FROM iceberg_namespace_properties
                 WHERE catalog_name = $1 AND namespace = $2
                 UNION SELECT table_namespace FROM iceberg_tables
                 WHERE catalog_name = $1 AND table_namespace = $2",
                &[CATALOG_NAME, &ns],
            )
            .await?;
        Ok(!rows.is_empty())
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
        let ns = ns_key(namespace);
        (self.db)
            .execute(
                "dropping a namespace",
                "DELETE FROM iceberg_namespace_properties WHERE catalog_name = $1 AND namespace = $2",
                &[CATALOG_NAME, &ns],
            )
            .await?;
        Ok(())
    }

    async fn list_tables(&self, namespace: &NamespaceIdent) -> Result<Vec<TableIdent>> {
        let ns = ns_key(namespace);
        let rows = (self.db)
            .query(
                "listing tables",
                "SELECT table_name FROM iceberg_tables
                 WHERE catalog_name = $1 AND table_namespace = $2
                   AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL) ORDER BY table_name",
                &[CATALOG_NAME, &ns],
            )
            .await?;
        Ok(first_column(rows)
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
        if self.metadata_location(&ident).await?.is_some() {
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
        let ns = ns_key(namespace);
        (self.db)
            .execute(
                "registering a new table",
                "INSERT INTO iceberg_tables VALUES ($1, $2, $3, $4, NULL, 'TABLE')",
                &[CATALOG_NAME, &ns, ident.name(), &meta_loc],
            )
            .await?;
        self.table_from(ident, meta_loc, metadata)
    }

    async fn load_table(&self, table: &TableIdent) -> Result<Table> {
        let location = self
            .metadata_location(table)
            .await?
            .ok_or_else(|| no_table(table))?;
        let metadata = TableMetadata::read_from(&self.file_io, &location).await?;
        self.table_from(table.clone(), location, metadata)
    }

    async fn drop_table(&self, table: &TableIdent) -> Result<()> {
        let ns = ns_key(table.namespace());
        let n = (self.db)
            .execute(
                "dropping a table",
                "DELETE FROM iceberg_tables
                 WHERE catalog_name = $1 AND table_namespace = $2 AND table_name = $3",
                &[CATALOG_NAME, &ns, table.name()],
            )
            .await?;
        if n == 0 {
            return Err(no_table(table));
        }
        Ok(())
    }

    async fn purge_table(&self, table: &TableIdent) -> Result<()> {
        self.drop_table(table).await
    }

    async fn table_exists(&self, table: &TableIdent) -> Result<bool> {
        Ok(self.metadata_location(table).await?.is_some())
    }

    async fn rename_table(&self, src: &TableIdent, dest: &TableIdent) -> Result<()> {
        let (from_ns, to_ns) = (ns_key(src.namespace()), ns_key(dest.namespace()));
        let n = (self.db)
            .execute(
                "renaming a table",
                "UPDATE iceberg_tables SET table_namespace = $1, table_name = $2
                 WHERE catalog_name = $3 AND table_namespace = $4 AND table_name = $5",
                &[&to_ns, dest.name(), CATALOG_NAME, &from_ns, src.name()],
            )
            .await?;
        if n == 0 {
            return Err(no_table(src));
        }
        Ok(())
    }

    async fn register_table(&self, table: &TableIdent, metadata_location: String) -> Result<Table> {
        let metadata = TableMetadata::read_from(&self.file_io, &metadata_location).await?;
        let ns = ns_key(table.namespace());
        (self.db)
            .execute(
                "registering a table",
                UPSERT_TABLE,
                &[CATALOG_NAME, &ns, table.name(), &metadata_location],
            )
            .await?;
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
