//! Tier 2 of the hub: sealed hub chunks as Parquet files on object storage.
//!
//! The hub (core-hub) decides *what* goes up and *when* (chunk boundaries in its catalog, the
//! exactly-once protocol, retention); this crate is the mechanism:
//!
//! - [`schema`]: the per-stream field registry and its column naming rule (schema evolution);
//! - [`chunk`]: [`TierRecord`], [`encode_chunk`] / [`decode_chunk`] and the [`ChunkSummary`]
//!   the hub stores and later verifies against;
//! - [`layout`]: deterministic object names ([`chunk_path`], [`manifest_path`]) and the
//!   [`Manifest`] JSON kept under `_tributary/`, outside `streams/`, so SQL engines never see it;
//! - [`store`]: [`Tier2`], the object store (a local directory by default, or S3 with
//!   path-style addressing) with put / verify / list / read / delete;
//! - [`durable`]: the synced writes of a local tier 2 (file, rename, directories);
//! - [`testing`]: an s3s-fs server on loopback for tests and benchmarks.
//!
//! The file format is documented in `docs/format/parquet.md`.

pub mod chunk;
pub mod config;
pub mod durable;
pub mod layout;
pub mod schema;
pub mod store;
pub mod table;
pub mod testing;

pub use chunk::{
    ChunkSummary, DecodeError, EncodeError, EncodeOptions, SeqRange, TierRecord, decode_chunk,
    decode_chunk_with_threads, encode_chunk, encode_chunk_with_threads,
};
pub use config::TierConfig;
pub use durable::DurableError;
pub use layout::{
    Manifest, chunk_path, chunks_prefix, ingest_date, manifest_path, manifests_prefix,
};
pub use schema::{ColumnChange, ColumnSpec, FieldRegistry, RegistryError, ValueKind};
pub use store::{
    DeleteError, GetError, ListError, ObjectInfo, OpenError, PutError, Tier2, Verified, VerifyError,
};

/// Any tier error, for callers that handle them alike (`?` converts every per-operation error).
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Put(#[from] PutError),
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error(transparent)]
    Get(#[from] GetError),
    #[error(transparent)]
    List(#[from] ListError),
    #[error(transparent)]
    Delete(#[from] DeleteError),
    #[error(transparent)]
    Lake(#[from] table::LakeError),
}
