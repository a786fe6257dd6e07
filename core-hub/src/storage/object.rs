//! [`StorageStore`]: a local tier 2 as an `object_store::ObjectStore` over the hub's
//! [`Storage`] trait, so a `file://` tier 2 is written with the same syscalls, and crashed by
//! the same `MemStorage` power cuts, as tier 1.
//!
//! Object `a/b/c` is the file `{root}/a/b/c` (object names map to file names verbatim; the
//! hub's names are plain ASCII). Every put is durable when it returns:
//!
//! 1. the object's directory is created if missing ([`Storage::create_dir`]: each new level
//!    synced into its parent);
//! 2. the bytes go to a staging file `{object}#{n}` next to it, which is synced;
//! 3. the staging file is renamed over the object's name and the directory is synced;
//! 4. the first time this process puts into a directory, the parent of every directory
//!    between it and the root is synced too (an entry made by an earlier, crashed process
//!    may never have been).
//!
//! A delete syncs the directory after the unlink, also when the object was gone already (an
//! earlier unsynced removal becomes durable). Listings skip staging files (`#` then digits,
//! as `LocalFileSystem` does), so a put cut short by a power loss leaves no visible object;
//! the staging file stays behind, harmless, until the name is put again.
//!
//! Reads (`get`, `head`, `list`, `list_with_delimiter`) go through [`Storage::read`],
//! [`Storage::stat`] and [`Storage::read_dir`]; `copy` is a read and a put. Multipart uploads
//! are not offered: tier 2 puts whole chunks. No put answers with an ETag, so
//! `tier::Tier2::upload_chunk` verifies every upload by reading its footer back.
//!
//! With the `fault-injection` feature every sync is recorded in a `tier::durable::SyncProbe`
//! (the probe `tier`'s own local store uses), whose switches leave the file or the directory
//! syncs out: the mutation checks of `core-hub/tests/tier_durable.rs` and
//! `core-hub/tests/crash_sim_tier.rs`.

use super::Storage;
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::{BoxStream, StreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{
    CopyMode, CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload,
    ObjectMeta, ObjectStore, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use std::collections::HashSet;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[cfg(feature = "fault-injection")]
use tier::durable::{SyncEvent, SyncProbe};

const STORE: &str = "StorageStore";

/// A local tier 2 on a [`Storage`]. Cheap to clone (shared).
#[derive(Clone)]
pub struct StorageStore {
    inner: Arc<Inner>,
}

struct Inner {
    storage: Arc<dyn Storage>,
    root: PathBuf,
    /// Directories under the root whose own entry was synced into its parent by this
    /// process (step 4 of the module doc runs once per directory).
    known: Mutex<HashSet<PathBuf>>,
    /// Staging-name counter.
    staging: AtomicU64,
    #[cfg(feature = "fault-injection")]
    probe: Arc<SyncProbe>,
}

impl fmt::Debug for StorageStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageStore")
            .field("root", &self.inner.root)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for StorageStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StorageStore({})", self.inner.root.display())
    }
}

impl StorageStore {
    /// Opens the store at `root` on `storage`, creating the root durably if it is missing.
    pub fn open(storage: Arc<dyn Storage>, root: &Path) -> io::Result<StorageStore> {
        storage.create_dir(root)?;
        Ok(StorageStore {
            inner: Arc::new(Inner {
                storage,
                root: root.to_path_buf(),
                known: Mutex::new(HashSet::new()),
                staging: AtomicU64::new(1),
                #[cfg(feature = "fault-injection")]
                probe: Arc::new(SyncProbe::default()),
            }),
        })
    }

    /// The directory the objects live in.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The recorded syncs and the mutation switches (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    pub fn probe(&self) -> &Arc<SyncProbe> {
        &self.inner.probe
    }

    /// Runs a blocking storage step off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> object_store::Result<T> + Send + 'static,
    ) -> object_store::Result<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| generic(io::Error::other(e.to_string())))?
    }
}

fn generic(e: io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: STORE,
        source: Box::new(e),
    }
}

/// An IO error about `location`, as object_store names it.
fn io_err(location: &ObjectPath, e: io::Error) -> object_store::Error {
    match e.kind() {
        io::ErrorKind::NotFound => object_store::Error::NotFound {
            path: location.to_string(),
            source: Box::new(e),
        },
        _ => generic(io::Error::new(e.kind(), format!("{location}: {e}"))),
    }
}

/// Whether `name` is a staging file (`{object}#{digits}`), never listed as an object.
fn is_staging(name: &str) -> bool {
    name.rsplit_once('#')
        .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

impl Inner {
    fn file_of(&self, location: &ObjectPath) -> PathBuf {
        let mut p = self.root.clone();
        p.extend(location.parts().map(|part| part.as_ref().to_owned()));
        p
    }

    /// Steps 1 to 4 of the module doc.
    fn put(&self, location: &ObjectPath, bytes: &[u8]) -> io::Result<()> {
        let dest = self.file_of(location);
        let dir = dest.parent().unwrap_or(&self.root).to_path_buf();
        self.storage.create_dir(&dir)?;
        let staging = self.staging_name(&dest);
        let written = (|| {
            let file = self.storage.create(&staging)?;
            file.append(bytes)?;
            self.sync_file(&*file, &staging)?;
            drop(file);
            self.storage.rename(&staging, &dest)?;
            #[cfg(feature = "fault-injection")]
            self.probe.record(SyncEvent::Rename {
                from: staging.clone(),
                to: dest.clone(),
            });
            Ok(())
        })();
        if let Err(e) = written {
            let _ = self.storage.remove(&staging);
            return Err(e);
        }
        self.sync_dir(&dir)?;
        self.sync_ancestors(&dir)?;
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::PutDone(dest));
        Ok(())
    }

    fn staging_name(&self, dest: &Path) -> PathBuf {
        let n = self.staging.fetch_add(1, Ordering::Relaxed);
        let mut name = dest.as_os_str().to_owned();
        name.push(format!("#{n}"));
        PathBuf::from(name)
    }

    /// Syncs the parent of `dir` and of every directory above it, up to the root or to one
    /// this process already synced into its parent.
    fn sync_ancestors(&self, dir: &Path) -> io::Result<()> {
        let mut d = dir;
        while d != self.root && d.starts_with(&self.root) {
            if self.known.lock().expect("known directories").contains(d) {
                return Ok(());
            }
            let Some(parent) = d.parent() else {
                return Ok(());
            };
            self.sync_dir(parent)?;
            self.known
                .lock()
                .expect("known directories")
                .insert(d.to_path_buf());
            d = parent;
        }
        Ok(())
    }

    /// Removes `location` and syncs its directory. `Ok(false)`: there was no such object.
    fn delete(&self, location: &ObjectPath) -> io::Result<bool> {
        let dest = self.file_of(location);
        let existed = match self.storage.remove(&dest) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(e),
        };
        let dir = dest.parent().unwrap_or(&self.root);
        match self.sync_dir(dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && !existed => {}
            r => r?,
        }
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::DeleteDone(dest));
        Ok(existed)
    }

    fn sync_file(&self, file: &dyn super::StorageFile, _path: &Path) -> io::Result<()> {
        #[cfg(feature = "fault-injection")]
        if self.probe.skips_file_syncs() {
            return Ok(());
        }
        file.sync()?;
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::File(_path.to_path_buf()));
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        #[cfg(feature = "fault-injection")]
        if self.probe.skips_dir_syncs() {
            return Ok(());
        }
        self.storage.sync_dir(dir)?;
        #[cfg(feature = "fault-injection")]
        self.probe.record(SyncEvent::Dir(dir.to_path_buf()));
        Ok(())
    }

    fn meta(&self, location: &ObjectPath) -> object_store::Result<ObjectMeta> {
        let stat = self
            .storage
            .stat(&self.file_of(location))
            .map_err(|e| io_err(location, e))?;
        Ok(ObjectMeta {
            location: location.clone(),
            last_modified: stat.modified.into(),
            size: stat.len,
            e_tag: None,
            version: None,
        })
    }

    /// The entries of the directory of `prefix`; none when it does not exist.
    fn entries(&self, prefix: &ObjectPath) -> io::Result<Vec<super::DirEntry>> {
        match self.storage.read_dir(&self.file_of(prefix)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            r => r,
        }
    }

    /// Every object at or below `prefix`, depth first.
    fn walk(&self, prefix: &ObjectPath, out: &mut Vec<ObjectMeta>) -> object_store::Result<()> {
        for e in self.entries(prefix).map_err(|e| io_err(prefix, e))? {
            let Ok(part) = ObjectPath::parse(&e.name) else {
                continue; // not a name this store writes
            };
            let child: ObjectPath = prefix.parts().chain(part.parts()).collect();
            if e.is_dir {
                self.walk(&child, out)?;
            } else if !is_staging(&e.name) {
                match self.meta(&child) {
                    Ok(m) => out.push(m),
                    // Removed since the directory was read.
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    fn list_with_delimiter(&self, prefix: &ObjectPath) -> object_store::Result<ListResult> {
        let mut objects = Vec::new();
        let mut common_prefixes = Vec::new();
        for e in self.entries(prefix).map_err(|e| io_err(prefix, e))? {
            let Ok(part) = ObjectPath::parse(&e.name) else {
                continue;
            };
            let child: ObjectPath = prefix.parts().chain(part.parts()).collect();
            if e.is_dir {
                common_prefixes.push(child);
            } else if !is_staging(&e.name) {
                objects.push(self.meta(&child)?);
            }
        }
        Ok(ListResult {
            objects,
            common_prefixes,
            extensions: Default::default(),
        })
    }

    fn get(&self, location: &ObjectPath, options: GetOptions) -> object_store::Result<GetResult> {
        let meta = self.meta(location)?;
        options.check_preconditions(&meta)?;
        let range = match &options.range {
            Some(r) => r
                .as_range(meta.size)
                .map_err(|source| object_store::Error::Generic {
                    store: STORE,
                    source: Box::new(source),
                })?,
            None => 0..meta.size,
        };
        let data = if options.head {
            Bytes::new()
        } else {
            let all = self
                .storage
                .read(&self.file_of(location))
                .map_err(|e| io_err(location, e))?;
            let (lo, hi) = (range.start as usize, (range.end as usize).min(all.len()));
            Bytes::from(all).slice(lo.min(hi)..hi)
        };
        let stream = futures_util::stream::once(futures_util::future::ready(Ok(data)));
        Ok(GetResult {
            payload: GetResultPayload::Stream(stream.boxed()),
            meta,
            range,
            attributes: Default::default(),
            extensions: Default::default(),
        })
    }
}

fn not_implemented(operation: &str) -> object_store::Error {
    object_store::Error::NotImplemented {
        operation: operation.to_owned(),
        implementer: STORE.to_owned(),
    }
}

#[async_trait]
impl ObjectStore for StorageStore {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if !matches!(opts.mode, PutMode::Overwrite) {
            return Err(not_implemented("put_opts with a conditional mode"));
        }
        let location = location.clone();
        let bytes = Bytes::from(payload);
        self.blocking(move |s| s.put(&location, &bytes).map_err(|e| io_err(&location, e)))
            .await?;
        Ok(PutResult {
            e_tag: None,
            version: None,
            extensions: Default::default(),
        })
    }

    async fn put_multipart_opts(
        &self,
        _location: &ObjectPath,
        _opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(not_implemented("put_multipart_opts"))
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let location = location.clone();
        self.blocking(move |s| s.get(&location, options)).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        let me = self.clone();
        locations
            .then(move |location| {
                let me = me.clone();
                async move {
                    let location = location?;
                    let l = location.clone();
                    let existed = me
                        .blocking(move |s| s.delete(&l).map_err(|e| io_err(&l, e)))
                        .await?;
                    if existed {
                        Ok(location)
                    } else {
                        Err(object_store::Error::NotFound {
                            path: location.to_string(),
                            source: "no such object".into(),
                        })
                    }
                }
            })
            .boxed()
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let me = self.clone();
        let prefix = prefix.cloned().unwrap_or_default();
        futures_util::stream::once(async move {
            me.blocking(move |s| {
                let mut out = Vec::new();
                s.walk(&prefix, &mut out).map(|()| out)
            })
            .await
        })
        .map(|r| match r {
            Ok(v) => futures_util::stream::iter(v.into_iter().map(Ok)).boxed(),
            Err(e) => futures_util::stream::once(futures_util::future::ready(Err(e))).boxed(),
        })
        .flatten()
        .boxed()
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        let prefix = prefix.cloned().unwrap_or_default();
        self.blocking(move |s| s.list_with_delimiter(&prefix)).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        let (from, to) = (from.clone(), to.clone());
        self.blocking(move |s| {
            if matches!(options.mode, CopyMode::Create) && s.meta(&to).is_ok() {
                return Err(object_store::Error::AlreadyExists {
                    path: to.to_string(),
                    source: "the target exists".into(),
                });
            }
            let bytes = s
                .storage
                .read(&s.file_of(&from))
                .map_err(|e| io_err(&from, e))?;
            s.put(&to, &bytes).map_err(|e| io_err(&to, e))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{CrashMode, MemStorage};
    use futures_util::TryStreamExt;
    use object_store::ObjectStoreExt;

    fn store(m: &MemStorage) -> StorageStore {
        StorageStore::open(Arc::new(m.clone()), Path::new("/t2")).unwrap()
    }

    #[tokio::test]
    async fn puts_survive_a_power_cut_and_listings_hide_staging_files() {
        let m = MemStorage::with_seed(7);
        let s = store(&m);
        let a = ObjectPath::from("streams/s/d=1/a.parquet");
        s.put(&a, PutPayload::from_static(b"chunk")).await.unwrap();
        // A put cut short before its rename leaves only a staging file.
        m.create(Path::new("/t2/streams/s/d=1/b.parquet#9"))
            .unwrap();
        m.crash(CrashMode::AnyOrder);
        let got = s.get(&a).await.unwrap().bytes().await.unwrap();
        assert_eq!(&got[..], b"chunk");
        let listed: Vec<ObjectMeta> = s.list(Some(&"streams".into())).try_collect().await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].location, a);
        assert_eq!(listed[0].size, 5);
        let top = s
            .list_with_delimiter(Some(&"streams/s".into()))
            .await
            .unwrap();
        assert_eq!(top.common_prefixes, vec![ObjectPath::from("streams/s/d=1")]);
        assert!(top.objects.is_empty());
        let r = s.get_range(&a, 1..3).await.unwrap();
        assert_eq!(&r[..], b"hu");
        assert_eq!(s.head(&a).await.unwrap().size, 5);
    }

    #[tokio::test]
    async fn deletes_are_durable_and_missing_objects_are_not_found() {
        let m = MemStorage::with_seed(8);
        let s = store(&m);
        let a = ObjectPath::from("x/a");
        s.put(&a, PutPayload::from_static(b"1")).await.unwrap();
        s.copy(&a, &ObjectPath::from("x/b")).await.unwrap();
        s.delete(&a).await.unwrap();
        m.crash(CrashMode::Drop);
        assert!(matches!(
            s.get(&a).await,
            Err(object_store::Error::NotFound { .. })
        ));
        assert!(matches!(
            s.delete(&a).await,
            Err(object_store::Error::NotFound { .. })
        ));
        let b = s.get(&"x/b".into()).await.unwrap().bytes().await.unwrap();
        assert_eq!(&b[..], b"1");
        assert!(
            s.list(Some(&"nothing".into()))
                .try_collect::<Vec<_>>()
                .await
                .unwrap()
                .is_empty()
        );
    }
}
