//! Iceberg's file IO on the hub's tier-2 object store.
//!
//! Every Iceberg file (table metadata, manifest lists, manifests) is written through the same
//! `ObjectStore` as the chunks: on a local tier 2 that is the hub's synced store (file, rename
//! and directory fsyncs before a put returns), on S3 the bucket. iceberg-rust's own local
//! storage writes metadata without an fsync, which a power cut after the catalog's swap would
//! turn into a table pointing at a missing file.
//!
//! Iceberg names files by absolute URI (`file:///srv/tier2/streams/s/metadata/…`,
//! `s3://bucket/streams/s/…`); [`ObjectStoreIo`] maps a URI under its `base` to the object key
//! below it and refuses any other.

use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use iceberg::io::{
    FileIO, FileIOBuilder, FileMetadata, FileRead, FileWrite, InputFile, OutputFile, Storage,
    StorageConfig, StorageFactory,
};
use iceberg::{Error, ErrorKind, Result};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

/// Iceberg storage over an object store rooted at `base` (a URI without a trailing `/`).
#[derive(Clone)]
pub struct ObjectStoreIo {
    base: String,
    store: Arc<dyn ObjectStore>,
}

impl std::fmt::Debug for ObjectStoreIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStoreIo")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl ObjectStoreIo {
    /// Storage for the URIs under `base` (`file:///srv/tier2`, `s3://bucket`).
    pub fn new(base: impl Into<String>, store: Arc<dyn ObjectStore>) -> ObjectStoreIo {
        ObjectStoreIo {
            base: base.into().trim_end_matches('/').to_owned(),
            store,
        }
    }

    /// A [`FileIO`] that hands out this storage.
    pub fn file_io(&self) -> FileIO {
        FileIOBuilder::new(Arc::new(self.clone())).build()
    }

    /// The object key of `uri`, which must lie under `base`.
    pub fn key(&self, uri: &str) -> Result<Path> {
        let rest = uri
            .strip_prefix(&self.base)
            .and_then(|r| r.strip_prefix('/'))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::DataInvalid,
                    format!("{uri} is outside the tier-2 root {}", self.base),
                )
            })?;
        Path::parse(rest).map_err(|e| {
            Error::new(ErrorKind::DataInvalid, format!("bad object name {uri}")).with_source(e)
        })
    }

    /// The URI of object key `key`.
    pub fn uri(&self, key: &str) -> String {
        format!("{}/{}", self.base, key.trim_start_matches('/'))
    }
}

fn store_err(what: &str, path: &str, e: object_store::Error) -> Error {
    let kind = match e {
        object_store::Error::NotFound { .. } => ErrorKind::DataInvalid,
        _ => ErrorKind::Unexpected,
    };
    Error::new(kind, format!("tier 2: {what} {path}")).with_source(e)
}

// The storage is handed to iceberg-rust's `FileIO` in process only; it holds a live store
// and cannot be sent to another process, which typetag's serde bound would allow.
impl serde::Serialize for ObjectStoreIo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.base)
    }
}

impl<'de> serde::Deserialize<'de> for ObjectStoreIo {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> std::result::Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "the hub's tier-2 storage cannot be rebuilt from its serialized form",
        ))
    }
}

#[typetag::serde]
impl StorageFactory for ObjectStoreIo {
    fn build(&self, _config: &StorageConfig) -> Result<Arc<dyn Storage>> {
        Ok(Arc::new(self.clone()))
    }
}

#[async_trait]
#[typetag::serde]
impl Storage for ObjectStoreIo {
    async fn exists(&self, path: &str) -> Result<bool> {
        match self.store.head(&self.key(path)?).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store_err("checking", path, e)),
        }
    }

    async fn metadata(&self, path: &str) -> Result<FileMetadata> {
        let meta = self
            .store
            .head(&self.key(path)?)
            .await
            .map_err(|e| store_err("reading the size of", path, e))?;
        Ok(FileMetadata { size: meta.size })
    }

    async fn read(&self, path: &str) -> Result<Bytes> {
        let got = self
            .store
            .get(&self.key(path)?)
            .await
            .map_err(|e| store_err("reading", path, e))?;
        got.bytes().await.map_err(|e| store_err("reading", path, e))
    }

    async fn reader(&self, path: &str) -> Result<Box<dyn FileRead>> {
        Ok(Box::new(RangeReader {
            io: self.clone(),
            key: self.key(path)?,
            uri: path.to_owned(),
        }))
    }

    async fn write(&self, path: &str, bs: Bytes) -> Result<()> {
        self.store
            .put(&self.key(path)?, bs.into())
            .await
            .map(|_| ())
            .map_err(|e| store_err("writing", path, e))
    }

    async fn writer(&self, path: &str) -> Result<Box<dyn FileWrite>> {
        Ok(Box::new(BufferedWriter {
            io: self.clone(),
            uri: path.to_owned(),
            buf: Some(BytesMut::new()),
        }))
    }

    async fn delete(&self, path: &str) -> Result<()> {
        match self.store.delete(&self.key(path)?).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_err("deleting", path, e)),
        }
    }

    async fn delete_prefix(&self, path: &str) -> Result<()> {
        let prefix = self.key(path)?;
        let mut listed = self.store.list(Some(&prefix));
        while let Some(meta) = listed.next().await {
            let meta = meta.map_err(|e| store_err("listing", path, e))?;
            self.delete(&self.uri(meta.location.as_ref())).await?;
        }
        Ok(())
    }

    async fn delete_stream(&self, mut paths: BoxStream<'static, String>) -> Result<()> {
        while let Some(p) = paths.next().await {
            self.delete(&p).await?;
        }
        Ok(())
    }

    fn new_input(&self, path: &str) -> Result<InputFile> {
        Ok(InputFile::new(Arc::new(self.clone()), path.to_owned()))
    }

    fn new_output(&self, path: &str) -> Result<OutputFile> {
        Ok(OutputFile::new(Arc::new(self.clone()), path.to_owned()))
    }
}

/// Ranged reads of one object (Parquet footers and pages).
struct RangeReader {
    io: ObjectStoreIo,
    key: Path,
    uri: String,
}

#[async_trait]
impl FileRead for RangeReader {
    async fn read(&self, range: Range<u64>) -> Result<Bytes> {
        self.io
            .store
            .get_range(&self.key, range)
            .await
            .map_err(|e| store_err("reading", &self.uri, e))
    }
}

/// A writer that puts the whole object at `close` (one durable put; Iceberg's metadata and
/// manifest files are small).
struct BufferedWriter {
    io: ObjectStoreIo,
    uri: String,
    buf: Option<BytesMut>,
}

#[async_trait]
impl FileWrite for BufferedWriter {
    async fn write(&mut self, bs: Bytes) -> Result<()> {
        let buf = self.buf.as_mut().ok_or_else(|| {
            Error::new(
                ErrorKind::Unexpected,
                format!("{} is already closed", self.uri),
            )
        })?;
        buf.extend_from_slice(&bs);
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        let buf = self.buf.take().ok_or_else(|| {
            Error::new(
                ErrorKind::Unexpected,
                format!("{} is already closed", self.uri),
            )
        })?;
        Storage::write(&self.io, &self.uri, buf.freeze()).await
    }
}
