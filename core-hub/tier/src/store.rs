//! [`Tier2`]: the object store holding chunk files and manifests.
//!
//! A thin layer over `object_store` that names the object in every error and implements the
//! checks the hub's exactly-once protocol needs: [`Tier2::upload_chunk`] uploads a chunk and
//! verifies it before the hub commits its manifest, and [`Tier2::verify_chunk`] re-reads an
//! object's size and footer.
//!
//! Every put and delete is durable when it returns: S3 acknowledges only stored objects, and
//! on a local directory opened here the writes go through [`crate::durable`] (file fsync,
//! rename, directory fsyncs up to the root) instead of `LocalFileSystem`'s unsynced put. A
//! wrapped store ([`Tier2::from_store`]) is as durable as it makes itself: the hub wraps its own
//! local store, which writes through the hub's storage trait with the same syncs. The hub relies on it:
//! it commits a chunk, tells agents `tiered_seq` and evicts tier 1 only after the chunk's and
//! its manifest's puts returned (`docs/tiering.md`, "Sync points").

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{
    ClientOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutPayload, PutResult, RetryConfig,
};
use parquet::file::metadata::{FooterTail, ParquetMetaDataReader};
use parquet::file::statistics::Statistics;

use crate::TierError;
use crate::chunk::{ChunkSummary, DecodeError, TierRecord, decode_chunk};
use crate::config::TierConfig;
use crate::durable::{DurableError, LocalDurability};
use crate::layout::{Manifest, manifests_prefix};

/// Why tier 2 could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("creating tier-2 directory {path}: {source}")]
    CreateDir { path: String, source: DurableError },
    #[error("opening tier 2 at {location}: {source}")]
    Store {
        location: String,
        source: object_store::Error,
    },
    #[error("S3 tier 2 at {endpoint}: {what} is not configured (config or {env})")]
    MissingCredential {
        endpoint: String,
        what: &'static str,
        env: &'static str,
    },
}

/// Why an object could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PutError {
    #[error("bad object path {path:?}: {source}")]
    Path {
        path: String,
        source: object_store::path::Error,
    },
    #[error("putting {path}: {source}")]
    Store {
        path: String,
        source: object_store::Error,
    },
    #[error("serializing manifest {path}: {source}")]
    Serialize {
        path: String,
        source: serde_json::Error,
    },
    #[error("putting {path} durably: {source}")]
    Durable { path: String, source: DurableError },
}

/// Why an uploaded chunk failed verification. Any variant means: do not commit, re-upload.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("bad object path {path:?}: {source}")]
    Path {
        path: String,
        source: object_store::path::Error,
    },
    #[error("verifying {path}: {source}")]
    Store {
        path: String,
        source: object_store::Error,
    },
    #[error("{path}: size {found} bytes, expected {expected}")]
    Size {
        path: String,
        found: u64,
        expected: u64,
    },
    #[error("{path}: bad parquet footer: {reason}")]
    Footer { path: String, reason: String },
    #[error("{path}: footer says {found}, expected {expected}")]
    Mismatch {
        path: String,
        found: String,
        expected: String,
    },
}

/// How [`Tier2::upload_chunk`] verified an upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verified {
    /// The store's MD5 ETag equals the chunk's MD5, and a HEAD shows the object.
    Digest,
    /// The footer was read back and matches the chunk's summary.
    Footer,
}

fn unquote(etag: &str) -> &str {
    etag.trim_matches('"')
}

/// The PUT's ETag when it proves the store holds exactly the uploaded bytes: an MD5 (32 hex
/// digits; multipart and SSE-KMS ETags are not) equal to `digest`, the bytes' own MD5.
fn etag_proves_content<'a>(etag: Option<&'a str>, digest: Option<&str>) -> Option<&'a str> {
    let etag = unquote(etag?);
    let is_md5 = etag.len() == 32 && etag.bytes().all(|b| b.is_ascii_hexdigit());
    (is_md5 && etag.eq_ignore_ascii_case(digest?)).then_some(etag)
}

fn md5_hex(bytes: &[u8]) -> String {
    use md5::{Digest, Md5};
    use std::fmt::Write as _;
    let digest = Md5::digest(bytes);
    let mut out = String::with_capacity(32);
    for b in digest.iter() {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Why an object could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    #[error("bad object path {path:?}: {source}")]
    Path {
        path: String,
        source: object_store::path::Error,
    },
    #[error("{path} does not exist")]
    NotFound { path: String },
    #[error("reading {path}: {source}")]
    Store {
        path: String,
        source: object_store::Error,
    },
    #[error("decoding chunk {path}: {source}")]
    Decode { path: String, source: DecodeError },
    #[error("parsing manifest {path}: {source}")]
    Manifest {
        path: String,
        source: serde_json::Error,
    },
}

/// Why a listing failed.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    #[error("bad prefix {prefix:?}: {source}")]
    Path {
        prefix: String,
        source: object_store::path::Error,
    },
    #[error("listing {prefix}: {source}")]
    Store {
        prefix: String,
        source: object_store::Error,
    },
    #[error("listing {prefix}: {source}")]
    Get {
        prefix: String,
        source: Box<GetError>,
    },
}

/// Why an object could not be deleted.
#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    #[error("bad object path {path:?}: {source}")]
    Path {
        path: String,
        source: object_store::path::Error,
    },
    #[error("deleting {path}: {source}")]
    Store {
        path: String,
        source: object_store::Error,
    },
    #[error("deleting {path} durably: {source}")]
    Durable { path: String, source: DurableError },
}

/// One object found by a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub path: String,
    pub size: u64,
    /// Last modification, nanoseconds since the Unix epoch (retention by age).
    pub last_modified_ns: i64,
}

/// Tier 2: a local directory or an S3 bucket. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Tier2 {
    store: Arc<dyn ObjectStore>,
    location: String,
    /// Whether PUTs may answer with an MD5 ETag (S3, or an unknown wrapped store), which
    /// [`Tier2::upload_chunk`] then checks instead of reading the footer back.
    md5_etags: bool,
    /// A local directory: puts and deletes go through it, synced (`store` reads the same root).
    local: Option<Arc<LocalDurability>>,
    /// The root directory of a wrapped store that is a local directory (the hub's).
    root: Option<std::path::PathBuf>,
    /// The sync probe of a wrapped local store (tests only).
    #[cfg(feature = "fault-injection")]
    probe: Option<Arc<crate::durable::SyncProbe>>,
}

impl Tier2 {
    /// Opens tier 2 as configured. For S3, credentials fall back to `AWS_ACCESS_KEY_ID` /
    /// `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`); addressing is always path-style.
    pub fn open(config: &TierConfig) -> Result<Tier2, OpenError> {
        match config {
            TierConfig::Local { root } => {
                let location = root.display().to_string();
                let local = LocalDurability::open(root).map_err(|source| OpenError::CreateDir {
                    path: location.clone(),
                    source,
                })?;
                Ok(Tier2 {
                    store: Arc::new(local.store().clone()),
                    location,
                    md5_etags: false,
                    local: Some(Arc::new(local)),
                    root: None,
                    #[cfg(feature = "fault-injection")]
                    probe: None,
                })
            }
            TierConfig::S3 {
                endpoint,
                region,
                bucket,
                access_key_id,
                secret_access_key,
                allow_http,
            } => {
                // reqwest is built without a crypto provider (ring only, see the BRIEF); make
                // sure one is installed for https endpoints. Err = one already is.
                let _ = rustls::crypto::ring::default_provider().install_default();
                let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
                let key_id = access_key_id
                    .clone()
                    .or_else(|| env("AWS_ACCESS_KEY_ID"))
                    .ok_or_else(|| OpenError::MissingCredential {
                        endpoint: endpoint.clone(),
                        what: "access_key_id",
                        env: "AWS_ACCESS_KEY_ID",
                    })?;
                let secret = secret_access_key
                    .clone()
                    .or_else(|| env("AWS_SECRET_ACCESS_KEY"))
                    .ok_or_else(|| OpenError::MissingCredential {
                        endpoint: endpoint.clone(),
                        what: "secret_access_key",
                        env: "AWS_SECRET_ACCESS_KEY",
                    })?;
                let mut builder = AmazonS3Builder::new()
                    .with_endpoint(endpoint)
                    .with_region(region)
                    .with_bucket_name(bucket)
                    .with_access_key_id(key_id)
                    .with_secret_access_key(secret)
                    .with_virtual_hosted_style_request(false)
                    // Fail within seconds when the store is down: the hub's tiering loop
                    // retries on its own schedule and must notice an outage (backpressure).
                    .with_retry(RetryConfig {
                        max_retries: 3,
                        retry_timeout: Duration::from_secs(15),
                        ..RetryConfig::default()
                    })
                    .with_client_options(
                        ClientOptions::new()
                            .with_allow_http(*allow_http)
                            .with_connect_timeout(Duration::from_secs(5))
                            .with_timeout(Duration::from_secs(120)),
                    );
                if access_key_id.is_none()
                    && let Some(token) = env("AWS_SESSION_TOKEN")
                {
                    builder = builder.with_token(token);
                }
                let location = format!("s3 {endpoint}/{bucket}");
                let store = builder.build().map_err(|source| OpenError::Store {
                    location: location.clone(),
                    source,
                })?;
                Ok(Tier2 {
                    store: Arc::new(store),
                    location,
                    md5_etags: true,
                    local: None,
                    root: None,
                    #[cfg(feature = "fault-injection")]
                    probe: None,
                })
            }
        }
    }

    /// Wraps an existing store (tests: fault injection, throttling). Its puts are as durable
    /// as the store makes them: a wrapped `LocalFileSystem` needs `with_fsync(true)`.
    pub fn from_store(store: Arc<dyn ObjectStore>, location: impl Into<String>) -> Tier2 {
        Tier2 {
            store,
            location: location.into(),
            md5_etags: true,
            local: None,
            root: None,
            #[cfg(feature = "fault-injection")]
            probe: None,
        }
    }

    /// Names the directory a wrapped store keeps its objects in (object `a/b` is the file
    /// `root/a/b`), for [`Tier2::local_root`].
    pub fn with_local_root(mut self, root: impl Into<std::path::PathBuf>) -> Tier2 {
        self.root = Some(root.into());
        self
    }

    /// Hands over the sync probe a wrapped local store writes through (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn with_sync_probe(mut self, probe: Arc<crate::durable::SyncProbe>) -> Tier2 {
        self.probe = Some(probe);
        self
    }

    /// The root directory of a local tier 2 (`None` for S3 and stores wrapped without one).
    pub fn local_root(&self) -> Option<&std::path::Path> {
        self.root
            .as_deref()
            .or_else(|| self.local.as_deref().map(LocalDurability::root))
    }

    /// The syncs of a local tier 2, recorded, with the mutation switches (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn sync_probe(&self) -> Option<&crate::durable::SyncProbe> {
        self.probe
            .as_deref()
            .or_else(|| self.local.as_deref().map(LocalDurability::probe))
    }

    /// A human-readable location for logs.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// The underlying store, for reads. Writes through it bypass the synced puts and deletes
    /// of a local tier 2: write through [`Tier2`]'s methods.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Uploads a chunk file to its deterministic path (overwrites any earlier attempt). The
    /// local store writes a staging file, syncs it and renames it, S3 PUTs are atomic, so
    /// readers never see a partial object; either way it is durable when this returns.
    pub async fn put_chunk(&self, path: &str, bytes: Bytes) -> Result<(), PutError> {
        self.raw_put(path, bytes).await
    }

    /// Plain PUT of any object (the benchmark's baseline; also used for staging). Durable
    /// when it returns, like every put.
    pub async fn raw_put(&self, path: &str, bytes: Bytes) -> Result<(), PutError> {
        self.put_object(path, bytes).await.map(|_| ())
    }

    async fn put_object(&self, path: &str, bytes: Bytes) -> Result<PutResult, PutError> {
        let location = Path::parse(path).map_err(|source| PutError::Path {
            path: path.to_owned(),
            source,
        })?;
        if let Some(local) = &self.local {
            let local = local.clone();
            let durable = |source| PutError::Durable {
                path: path.to_owned(),
                source,
            };
            tokio::task::spawn_blocking(move || local.put(&location, &bytes))
                .await
                .map_err(|join| durable(DurableError::Task(join.to_string())))?
                .map_err(durable)?;
            // No ETag: `upload_chunk` reads the footer back (from the synced file).
            return Ok(PutResult {
                e_tag: None,
                version: None,
                extensions: Default::default(),
            });
        }
        self.store
            .put(&location, PutPayload::from_bytes(bytes))
            .await
            .map_err(|source| PutError::Store {
                path: path.to_owned(),
                source,
            })
    }

    /// Uploads a chunk to its deterministic path and verifies it, in as few round trips as
    /// the store allows:
    ///
    /// - where the PUT answers with an MD5 ETag (single-part S3 PUTs) equal to the MD5 of
    ///   `bytes`, the store provably received exactly these bytes; a HEAD then confirms the
    ///   object is visible at `path` with that size and ETag ([`Verified::Digest`]);
    /// - otherwise (a local directory, or an ETag that is no MD5, as with SSE-KMS) the
    ///   footer is read back and checked against `summary` ([`Verified::Footer`]).
    ///
    /// Reading the footer back costs a ranged GET, and a small GET answer can wait out a
    /// 40 ms delayed ACK on some servers; the digest path needs none.
    pub async fn upload_chunk(
        &self,
        path: &str,
        bytes: Bytes,
        summary: &ChunkSummary,
    ) -> Result<Verified, TierError> {
        // The digest is computed on another core while the PUT is in flight.
        let digest = self.md5_etags.then(|| {
            let bytes = bytes.clone();
            tokio::task::spawn_blocking(move || md5_hex(&bytes))
        });
        let put = self.put_object(path, bytes).await?;
        let digest = match digest {
            Some(task) => task.await.ok(),
            None => None,
        };
        let Some(etag) = etag_proves_content(put.e_tag.as_deref(), digest.as_deref()) else {
            self.verify_chunk(path, summary).await?;
            return Ok(Verified::Footer);
        };
        // The object is visible at `path`, with that size and the same ETag.
        let (_, meta) = self.head_sized(path, summary.bytes).await?;
        let found = meta.e_tag.as_deref().map(unquote);
        if found.is_some_and(|t| !t.eq_ignore_ascii_case(etag)) {
            return Err(VerifyError::Mismatch {
                path: path.to_owned(),
                found: format!("ETag {}", found.unwrap_or_default()),
                expected: format!("ETag {etag} (the MD5 of the uploaded chunk)"),
            }
            .into());
        }
        Ok(Verified::Digest)
    }

    /// HEAD of `path`, which must have `size` bytes.
    async fn head_sized(&self, path: &str, size: u64) -> Result<(Path, ObjectMeta), VerifyError> {
        let location = Path::parse(path).map_err(|source| VerifyError::Path {
            path: path.to_owned(),
            source,
        })?;
        let meta = self
            .store
            .head(&location)
            .await
            .map_err(|source| VerifyError::Store {
                path: path.to_owned(),
                source,
            })?;
        if meta.size != size {
            return Err(VerifyError::Size {
                path: path.to_owned(),
                found: meta.size,
                expected: size,
            });
        }
        Ok((location, meta))
    }

    /// Checks an uploaded chunk: its size (HEAD), then its Parquet footer (range GET of the
    /// tail): row count and the `offset` column's min/max must match `summary`.
    pub async fn verify_chunk(
        &self,
        path: &str,
        summary: &ChunkSummary,
    ) -> Result<(), VerifyError> {
        let (location, meta) = self.head_sized(path, summary.bytes).await?;
        let store_err = |source| VerifyError::Store {
            path: path.to_owned(),
            source,
        };
        let footer_err = |reason: String| VerifyError::Footer {
            path: path.to_owned(),
            reason,
        };
        if meta.size < 12 {
            return Err(footer_err(format!("object of {} bytes", meta.size)));
        }
        // One range GET usually covers the whole footer (ours are a few KiB).
        let guess = meta.size.min(64 * 1024);
        let mut tail = self
            .store
            .get_range(&location, meta.size - guess..meta.size)
            .await
            .map_err(store_err)?;
        let last8: [u8; 8] = tail[tail.len() - 8..]
            .try_into()
            .map_err(|_| footer_err("short read".into()))?;
        let footer = FooterTail::try_from(last8).map_err(|e| footer_err(e.to_string()))?;
        let need = footer.metadata_length() as u64 + 8;
        if need > meta.size {
            return Err(footer_err(format!("metadata length {need} > object size")));
        }
        if need > tail.len() as u64 {
            tail = self
                .store
                .get_range(&location, meta.size - need..meta.size)
                .await
                .map_err(store_err)?;
        }
        let start = tail.len() - need as usize;
        let metadata = ParquetMetaDataReader::decode_metadata(&tail[start..tail.len() - 8])
            .map_err(|e| footer_err(e.to_string()))?;
        let rows = metadata.file_metadata().num_rows();
        if u64::try_from(rows).ok() != Some(summary.rows) {
            return Err(VerifyError::Mismatch {
                path: path.to_owned(),
                found: format!("{rows} rows"),
                expected: format!("{} rows", summary.rows),
            });
        }
        let offset_col = metadata
            .file_metadata()
            .schema_descr()
            .columns()
            .iter()
            .position(|c| c.name() == "hub_offset")
            .ok_or_else(|| footer_err("no offset column".into()))?;
        let mut range: Option<(i64, i64)> = None;
        for rg in metadata.row_groups() {
            let Some(Statistics::Int64(s)) = rg.column(offset_col).statistics() else {
                return Err(footer_err("offset column has no INT64 statistics".into()));
            };
            let (Some(lo), Some(hi)) = (s.min_opt(), s.max_opt()) else {
                return Err(footer_err("offset statistics lack min/max".into()));
            };
            range = Some(match range {
                None => (*lo, *hi),
                Some((a, b)) => (a.min(*lo), b.max(*hi)),
            });
        }
        let expected = (summary.min_offset as i64, summary.max_offset as i64);
        if range != Some(expected) {
            return Err(VerifyError::Mismatch {
                path: path.to_owned(),
                found: format!("offsets {range:?}"),
                expected: format!("offsets {expected:?}"),
            });
        }
        Ok(())
    }

    /// Writes a manifest to [`Manifest::path`]; returns that path.
    pub async fn put_manifest(&self, manifest: &Manifest) -> Result<String, PutError> {
        let path = manifest.path();
        let json = serde_json::to_vec_pretty(manifest).map_err(|source| PutError::Serialize {
            path: path.clone(),
            source,
        })?;
        self.raw_put(&path, Bytes::from(json)).await?;
        Ok(path)
    }

    /// Reads one manifest.
    pub async fn get_manifest(&self, path: &str) -> Result<Manifest, GetError> {
        let bytes = self.get(path).await?;
        serde_json::from_slice(&bytes).map_err(|source| GetError::Manifest {
            path: path.to_owned(),
            source,
        })
    }

    /// Every manifest of a stream, in first-offset order.
    pub async fn list_manifests(&self, stream: &str) -> Result<Vec<Manifest>, ListError> {
        let prefix = manifests_prefix(stream);
        let objects = self.list(&prefix).await?;
        let mut out = Vec::with_capacity(objects.len());
        for o in objects.iter().filter(|o| o.path.ends_with(".json")) {
            let m = self
                .get_manifest(&o.path)
                .await
                .map_err(|e| ListError::Get {
                    prefix: prefix.clone(),
                    source: Box::new(e),
                })?;
            out.push(m);
        }
        out.sort_by_key(|m| (m.first_offset, m.segment));
        Ok(out)
    }

    /// The streams that have manifests (what recovery rebuilds), sorted.
    pub async fn list_streams(&self) -> Result<Vec<String>, ListError> {
        let prefix = "_tributary/manifests/";
        let location = Path::parse(prefix).map_err(|source| ListError::Path {
            prefix: prefix.to_owned(),
            source,
        })?;
        let result = self
            .store
            .list_with_delimiter(Some(&location))
            .await
            .map_err(|source| ListError::Store {
                prefix: prefix.to_owned(),
                source,
            })?;
        let mut streams: Vec<String> = result
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_owned))
            .collect();
        streams.sort();
        Ok(streams)
    }

    /// Every object under `prefix` (recursive), sorted by path.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, ListError> {
        let location = Path::parse(prefix).map_err(|source| ListError::Path {
            prefix: prefix.to_owned(),
            source,
        })?;
        let metas: Vec<_> = self
            .store
            .list(Some(&location))
            .try_collect()
            .await
            .map_err(|source| ListError::Store {
                prefix: prefix.to_owned(),
                source,
            })?;
        let mut out: Vec<ObjectInfo> = metas
            .into_iter()
            .map(|m| ObjectInfo {
                path: m.location.to_string(),
                size: m.size,
                last_modified_ns: m.last_modified.timestamp_nanos_opt().unwrap_or(i64::MAX),
            })
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// Reads a whole object.
    pub async fn get(&self, path: &str) -> Result<Bytes, GetError> {
        let location = Path::parse(path).map_err(|source| GetError::Path {
            path: path.to_owned(),
            source,
        })?;
        let map = |source| match source {
            object_store::Error::NotFound { .. } => GetError::NotFound {
                path: path.to_owned(),
            },
            source => GetError::Store {
                path: path.to_owned(),
                source,
            },
        };
        let result = self.store.get(&location).await.map_err(map)?;
        result.bytes().await.map_err(map)
    }

    /// Reads and decodes a chunk file (read-through, recovery). Decoding runs on a blocking
    /// thread so that a large chunk does not stall the async runtime.
    pub async fn read_chunk(&self, path: &str) -> Result<Vec<TierRecord>, GetError> {
        let bytes = self.get(path).await?;
        let owned = path.to_owned();
        match tokio::task::spawn_blocking(move || decode_chunk(bytes)).await {
            Ok(r) => r.map_err(|source| GetError::Decode {
                path: owned,
                source,
            }),
            Err(join) => Err(GetError::Decode {
                path: owned,
                source: DecodeError::Metadata(format!("decoder task failed: {join}")),
            }),
        }
    }

    /// Deletes an object. Deleting a missing object succeeds (retention is idempotent). On a
    /// local directory the removal is durable when this returns (directory fsync).
    pub async fn delete(&self, path: &str) -> Result<(), DeleteError> {
        let location = Path::parse(path).map_err(|source| DeleteError::Path {
            path: path.to_owned(),
            source,
        })?;
        if let Some(local) = &self.local {
            let local = local.clone();
            let durable = |source| DeleteError::Durable {
                path: path.to_owned(),
                source,
            };
            return tokio::task::spawn_blocking(move || local.delete(&location))
                .await
                .map_err(|join| durable(DurableError::Task(join.to_string())))?
                .map(|_| ())
                .map_err(durable);
        }
        match self.store.delete(&location).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(DeleteError::Store {
                path: path.to_owned(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_md5_etag_equal_to_the_digest_proves_the_content() {
        let digest = md5_hex(b"chunk");
        assert_eq!(digest.len(), 32);
        let quoted = format!("\"{}\"", digest.to_uppercase());
        assert_eq!(
            etag_proves_content(Some(&quoted), Some(&digest)),
            Some(digest.to_uppercase().as_str())
        );
        // Another object's digest, a multipart ETag, a local store's ETag, or none at all.
        assert_eq!(
            etag_proves_content(Some(&md5_hex(b"other")), Some(&digest)),
            None
        );
        let multipart = format!("{digest}-2");
        assert_eq!(etag_proves_content(Some(&multipart), Some(&digest)), None);
        assert_eq!(
            etag_proves_content(Some("2a1b-5f3e-400"), Some(&digest)),
            None
        );
        assert_eq!(etag_proves_content(None, Some(&digest)), None);
        assert_eq!(etag_proves_content(Some(&digest), None), None);
    }
}
