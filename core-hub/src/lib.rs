//! The hub library: everything `core-hub` does, as modules the binary and the tests share.
//!
//! - [`config`]: `hub.toml` and `TRIBUTARY_HUB__*` overrides, parsed once into typed values.
//! - [`pki`]: the fleet CA, device certificates, revocation, and the rustls server config.
//! - [`catalog`]: SQLite beside the log: devices, streams, marks, the block index.
//! - [`wal`]: tier 1, one write-ahead log for all devices, group commit.
//! - [`storage`]: the file operations tier 1 uses, real or in memory with simulated power loss.
//! - [`ingest`]: [`ingest::Hub`], the API the QUIC driver calls for every block.
//! - [`poison`]: stored blocks that do not decode within the limits are quarantined, not
//!   decoded.
//! - [`read`], [`api`], [`metrics`], [`client`]: the reader API, HTTP, `/metrics`, and the
//!   CLI's HTTP client.
//! - [`completeness`], [`status`], [`republish`]: completeness answers and watermarks, the
//!   operator status page at `/`, and the MQTT republish sink.
//! - [`tiering`]: tier 2 (Parquet on object storage), eviction, read-through, recovery.
//! - [`streams`]: merged streams: key-hash segments over the WAL, auto-scaling, cuts, reader
//!   groups.
//! - [`demo`]: `core-hub demo`, a hub and simulated edges with flaky links, verified end to end.

pub mod api;
pub mod api_error;
pub mod catalog;
pub mod client;
pub mod completeness;
pub mod config;
pub mod demo;
pub mod http_limits;
pub mod ingest;
pub mod logging;
pub mod metrics;
pub mod pki;
pub mod poison;
pub mod read;
pub mod refusals;
pub mod republish;
pub mod scrub;
pub mod server;
pub mod status;
pub mod storage;
pub mod streams;
pub mod tiering;
pub mod wal;

pub use config::HubConfig;
pub use ingest::{CommitOutcome, Hub, IngestError, Mark, content_checksum};
