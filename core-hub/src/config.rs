//! The hub's configuration: `hub.toml` plus `TRIBUTARY_HUB__*` environment overrides.
//!
//! The file is read once with the `config` crate into raw serde structs ([`RawConfig`]), then
//! turned into typed values ([`HubConfig`]): socket addresses, durations, byte sizes and
//! validated names. Every failure is one [`ConfigError`] that names the key at fault, so an
//! operator can fix the file without reading our code. Libraries take [`HubConfig`]; only the
//! binary reads files and the environment.

use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;
use thiserror::Error;

/// Environment variable prefix: `TRIBUTARY_HUB__LISTEN__QUIC` overrides `listen.quic`.
pub const ENV_PREFIX: &str = "TRIBUTARY_HUB";
/// Separator between key segments in environment variable names.
pub const ENV_SEPARATOR: &str = "__";

/// Why the configuration is unusable. Always names the key at fault.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read the configuration: {0}")]
    Read(String),
    #[error("config key `{key}`: {problem}")]
    Key { key: String, problem: String },
    /// A key whose value came from the environment variable `var`.
    #[error("config key `{key}` (set by the environment variable {var}): {problem}")]
    Env {
        key: String,
        var: String,
        problem: String,
    },
}

#[path = "config_errors.rs"]
mod errors;

impl ConfigError {
    fn key(key: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError::Key {
            key: key.into(),
            problem: problem.into(),
        }
    }
}

/// The typed hub configuration.
#[derive(Debug, Clone)]
pub struct HubConfig {
    pub data_dir: PathBuf,
    pub listen: ListenConfig,
    /// TLS material for the QUIC listener; `None` when `[tls]` is absent (HTTP-only runs and tests).
    pub tls: Option<TlsPaths>,
    pub tier2: Tier2Config,
    pub wal: WalConfig,
    pub ingest: IngestConfig,
    pub streams: StreamPolicy,
    pub http: HttpConfig,
    /// `[completeness]`: clock skew, idle timeout (see `completeness`).
    pub completeness: crate::completeness::CompletenessConfig,
    /// `[republish]`: the optional MQTT republish sink (see `republish`).
    pub republish: Option<crate::republish::RepublishConfig>,
    /// `[read]`: byte bounds on reader pages, the block cache and follow streams.
    pub read: ReadConfig,
    /// `[metrics]`: how many devices `/metrics` lists by name.
    pub metrics: MetricsConfig,
    /// `log.format`: text lines (the default) or JSON lines (see `crate::logging`).
    pub log: crate::logging::LogFormat,
}

/// Where the hub listens.
#[derive(Debug, Clone)]
pub struct ListenConfig {
    /// Devices connect here over QUIC with mutual TLS.
    pub quic: SocketAddr,
    /// The HTTP API, `/metrics` and `/healthz`.
    pub http: SocketAddr,
}

/// Paths of the hub's TLS material, as written by `core-hub pki init`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// `tls.revoked`: the revocation list (`core-hub pki revoke`), reloaded while the hub runs;
    /// the issuance record `issued.txt` beside it, when present, is what its serials are
    /// checked against. Default: `revoked.txt` beside `tls.ca`.
    pub revoked: PathBuf,
}

impl TlsPaths {
    /// The three TLS files, with the revocation list at its default place beside `ca`.
    pub fn new(ca: PathBuf, cert: PathBuf, key: PathBuf) -> TlsPaths {
        let revoked = default_revoked(&ca);
        TlsPaths {
            ca,
            cert,
            key,
            revoked,
        }
    }
}

/// `revoked.txt` beside the CA certificate.
fn default_revoked(ca: &Path) -> PathBuf {
    ca.with_file_name(crate::pki::REVOKED_FILE)
}

/// Tier 2: where sealed chunks go as Parquet, how big they are, and how long each tier keeps
/// data (see `tiering` and docs/tiering.md). Its `Debug` shows the S3 secret as `<redacted>`.
#[derive(Clone)]
pub struct Tier2Config {
    /// `file:///...` or `s3://bucket/prefix`, kept verbatim after validation.
    pub url: String,
    pub scheme: String,
    /// S3 endpoint (e.g. `http://127.0.0.1:9000` for an S3-compatible server); `None` uses the
    /// environment (`AWS_ENDPOINT_URL`) or AWS itself. Requests are always path-style.
    pub endpoint: Option<String>,
    /// S3 region; `None` uses `AWS_REGION` or `us-east-1`.
    pub region: Option<String>,
    /// S3 credentials; `None` uses `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`.
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    /// A chunk is sealed once it holds this many records...
    pub chunk_records_max: u64,
    /// ... or this many bytes of tier-1 frames ...
    pub chunk_bytes_max: u64,
    /// ... or its first record is this old (so a slow stream still reaches tier 2).
    pub chunk_age_max: Duration,
    /// How often the uploader looks for work when idle.
    pub poll_interval: Duration,
    /// Longest wait for one tier-2 request (with the store's own retries) before the round
    /// fails and is retried later.
    pub request_timeout: Duration,
    /// Tiered data is kept in tier 1 for fast reads for at least this long...
    pub tier1_retention_time: Duration,
    /// ... unless tier 1 grows past this many bytes (untiered data is never evicted).
    pub tier1_retention_bytes: u64,
    /// Ingest is pushed back once tier 1 holds this many bytes (tier 2 down or behind).
    pub tier1_budget_bytes: u64,
    /// Tier-2 chunks older than this (by ingest time) are deleted; `None` keeps them forever.
    pub tier2_retention_time: Option<Duration>,
    /// Oldest tier-2 chunks are deleted while a stream holds more than this; `None`: no limit.
    pub tier2_retention_bytes: Option<u64>,
    /// Time between two full passes of the tier-2 scrub (`crate::scrub::scrub_tier2`).
    pub scrub_interval: Duration,
    /// Read rate bound of the tier-2 scrub, bytes per second (0: unbounded).
    pub scrub_bytes_per_sec_max: u64,
    /// Column type hints by stream name, then field (`[[streams]] types = { temp = "float" }`):
    /// a field pinned to float gets a DOUBLE column from its first integer on. Copied from
    /// [`StreamPolicy::field_types`].
    pub field_types: BTreeMap<String, BTreeMap<String, tier::ValueKind>>,
    /// How tier 2 presents a stream to SQL engines: Parquet files to glob, or an Iceberg table.
    pub table: TableFormat,
    /// The Iceberg SQL catalog when `table` is Iceberg: a SQLite file (the default,
    /// `{data_dir}/iceberg.sqlite`) or a PostgreSQL URL.
    pub iceberg_catalog: tier::table::CatalogLocation,
    /// Commits and upkeep of the Iceberg tables.
    pub lake: LakeConfig,
}

/// The Iceberg tables' commits and upkeep (`[tier2]` keys that apply to `table = "iceberg"`
/// only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LakeConfig {
    /// Least time between two tiering rounds that committed (`commit_interval`): what one
    /// round uploads goes into one snapshot per table, so a table sees at most one commit per
    /// interval (plus one per `RANGES_PER_SNAPSHOT_MAX` ranges after a backlog).
    pub commit_interval: Duration,
    /// Time between two upkeep runs (`maintenance_interval`).
    pub maintenance_interval: Duration,
    /// `snapshot_retention` and `orphan_grace`.
    pub policy: tier::table::MaintainPolicy,
}

/// Default `tier2.commit_interval`.
pub const DEFAULT_LAKE_COMMIT_INTERVAL: Duration = Duration::from_secs(10);

/// Default `tier2.maintenance_interval`.
pub const DEFAULT_LAKE_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(3_600);

/// `[tier2] table`: what a stream is in tier 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TableFormat {
    /// Hive-partitioned Parquet files under `streams/{stream}/` (read with a glob).
    #[default]
    Parquet,
    /// The same files, committed as an Apache Iceberg table (format v2) in an SQL catalog.
    Iceberg,
}

/// The tier-1 write-ahead log.
#[derive(Debug, Clone, Copy)]
pub struct WalConfig {
    /// A WAL file is rolled once it would grow past this size.
    pub segment_bytes_max: u64,
    /// How long the writer waits after the first request of a batch for more to arrive.
    pub group_commit_linger: Duration,
}

/// Limits on what devices send.
#[derive(Debug, Clone, Copy)]
pub struct IngestConfig {
    /// The global ingest memory budget, shared by every connection.
    pub memory_bytes_max: u64,
    /// The largest encoded block (header + compressed body) accepted.
    pub block_bytes_max: u32,
    /// The largest decompressed block body accepted.
    pub block_raw_bytes_max: u32,
    /// The most records one block may hold.
    pub records_per_block_max: u32,
    /// The most memory one block's records may take once decoded (their decoded size, see
    /// `sync::decoded`, computed before decoding). Applies to blocks devices send and to blocks
    /// already stored: a stored block over it is quarantined instead of decoded.
    pub block_decoded_bytes_max: u64,
    /// The most streams one connection may announce.
    pub streams_per_connection_max: NonZeroU32,
    /// Per-device hub state: streams, epochs and lanes per device, columns per stream.
    pub state: StateQuotas,
    /// Per-connection bounds: connections per device, deadlines, blocks in flight, Retry.
    pub conn: ConnectionQuotas,
}

/// Bounds on what one connection, and one device's connections, may hold
/// (`ingest.connections_per_device_max`, `ingest.hello_timeout`, `ingest.control_idle_timeout`,
/// `ingest.blocks_in_flight_max`, `ingest.retry_above_handshakes`); see `crate::server` and
/// docs/security.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionQuotas {
    /// Connections one device may hold at once; a newer one supersedes the oldest.
    pub connections_per_device_max: u32,
    /// How long a new connection has to open its control stream and send its Hello.
    pub hello_timeout: Duration,
    /// How long a session's control stream may stay silent (the agent pings well within it).
    pub control_idle_timeout: Duration,
    /// Data streams one connection may have being read, decoded or awaiting commit.
    pub blocks_in_flight_max: u32,
    /// Handshakes in progress at or above which a new, unvalidated client address gets a QUIC
    /// Retry; 0 sends every new address one.
    pub retry_above_handshakes: u32,
    /// `ingest.stream_refusal_retry`: how long a stream the hub refused (allow-list, quota,
    /// forbidden key) stays refused before the agent offers it again on the same session.
    pub stream_refusal_retry: Duration,
}

impl Default for ConnectionQuotas {
    fn default() -> Self {
        ConnectionQuotas {
            connections_per_device_max: 1,
            hello_timeout: Duration::from_secs(10),
            control_idle_timeout: Duration::from_secs(30),
            blocks_in_flight_max: 32,
            retry_above_handshakes: 64,
            stream_refusal_retry: Duration::from_secs(30),
        }
    }
}

/// Bounds on the hub state one device can create (`ingest.*_per_device_max`,
/// `ingest.columns_per_stream_max`); see `crate::ingest::quotas` and docs/security.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateQuotas {
    /// Distinct streams a device may hold lanes or backlog reports in.
    pub streams_per_device_max: u32,
    /// Distinct epochs a device may hold lanes in.
    pub epochs_per_device_max: u32,
    /// Distinct `(epoch, stream)` lanes a device may hold.
    pub lanes_per_device_max: u32,
    /// Distinct field names (columns) one stream may hold, over every device.
    pub columns_per_stream_max: u32,
    /// Of those, how many one device may bring (so a shared stream outlives one bad device).
    pub columns_per_device_max: u32,
}

impl Default for StateQuotas {
    fn default() -> Self {
        StateQuotas {
            streams_per_device_max: DEFAULT_STREAMS_PER_DEVICE_MAX,
            epochs_per_device_max: DEFAULT_EPOCHS_PER_DEVICE_MAX,
            lanes_per_device_max: DEFAULT_LANES_PER_DEVICE_MAX,
            columns_per_stream_max: DEFAULT_COLUMNS_PER_STREAM_MAX,
            columns_per_device_max: DEFAULT_COLUMNS_PER_DEVICE_MAX,
        }
    }
}

/// `[metrics]`: bounds on what `/metrics` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsConfig {
    /// Devices listed with their own series (the first by name); the rest are left out.
    pub device_series_max: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            device_series_max: DEFAULT_DEVICE_SERIES_MAX,
        }
    }
}

/// Which streams exist and who may write them.
#[derive(Debug, Clone, Default)]
pub struct StreamPolicy {
    /// Configured stream names; empty means any valid stream name is accepted.
    pub configured: BTreeSet<String>,
    /// Per-device allow-lists; a device without an entry may write every accepted stream.
    pub device_allow: BTreeMap<String, BTreeSet<String>>,
    /// Auto-scaling policies by stream name (`[[streams]] scale = {..}`); a stream without
    /// one keeps a single segment.
    pub scale: BTreeMap<String, ScalePolicy>,
    /// Streams whose record keys must start with `{device}/` (`[[streams]]
    /// keys_prefixed_by_device = true`, issue 6 §1): a device writes only its own keys.
    pub keys_prefixed_by_device: BTreeSet<String>,
    /// Tier-2 column type hints by stream, then field (`[[streams]] types = { temp = "float" }`,
    /// docs/format/parquet.md): only `"float"` today, which pins a number field to DOUBLE.
    pub field_types: BTreeMap<String, BTreeMap<String, tier::ValueKind>>,
}

/// When a stream's segments split and merge (see `crate::streams` and docs/streams.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalePolicy {
    /// Target records/s per segment; `None` when only bytes count.
    pub target_records_per_s: Option<u64>,
    /// Target bytes/s per segment (tier-1 block bytes); `None` when only records count.
    pub target_bytes_per_s: Option<u64>,
    /// How long a segment must stay above the target to split, or two neighbours below a
    /// quarter of it to merge.
    pub window: Duration,
    /// Never merge below this many open segments.
    pub min_segments: u32,
    /// Never split above this many open segments.
    pub max_segments: u32,
}

/// Default `max_segments` of a scaling policy.
pub const DEFAULT_MAX_SEGMENTS: u32 = 64;

/// The HTTP API.
#[derive(Clone)]
pub struct HttpConfig {
    /// Bearer tokens accepted by the reader API. Empty (and no admin token): the reader API is
    /// open. `Debug` shows only how many there are (likewise for the other tokens).
    pub reader_tokens: Vec<String>,
    /// Bearer tokens for mutations (`POST /v1/devices/{id}/retire`); they also read. With
    /// reader tokens but no admin token, mutations are refused.
    pub admin_tokens: Vec<String>,
    /// When set, `/metrics` needs it (or an admin token); else it needs a reader token when
    /// reader tokens are set.
    pub metrics_token: Option<String>,
    /// Timeouts, caps and allowed hosts (`http.header_timeout` ... `http.allowed_hosts`).
    pub limits: crate::http_limits::HttpLimits,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            reader_tokens: Vec::new(),
            admin_tokens: Vec::new(),
            metrics_token: None,
            limits: crate::http_limits::default_limits(),
        }
    }
}

/// What a `Debug` of a configuration shows instead of a secret: config structs are logged and
/// printed in errors, and a secret must never reach a log.
pub const REDACTED: &str = "<redacted>";

/// `Some("<redacted>")` for a set secret.
fn redacted(secret: &Option<String>) -> Option<&'static str> {
    secret.as_ref().map(|_| REDACTED)
}

/// `["<redacted>", ...]`, one per token.
fn redacted_all(tokens: &[String]) -> Vec<&'static str> {
    tokens.iter().map(|_| REDACTED).collect()
}

impl std::fmt::Debug for Tier2Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier2Config")
            .field("url", &self.url)
            .field("scheme", &self.scheme)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &redacted(&self.secret_access_key))
            .field("chunk_records_max", &self.chunk_records_max)
            .field("chunk_bytes_max", &self.chunk_bytes_max)
            .field("chunk_age_max", &self.chunk_age_max)
            .field("poll_interval", &self.poll_interval)
            .field("request_timeout", &self.request_timeout)
            .field("tier1_retention_time", &self.tier1_retention_time)
            .field("tier1_retention_bytes", &self.tier1_retention_bytes)
            .field("tier1_budget_bytes", &self.tier1_budget_bytes)
            .field("tier2_retention_time", &self.tier2_retention_time)
            .field("tier2_retention_bytes", &self.tier2_retention_bytes)
            .field("scrub_interval", &self.scrub_interval)
            .field("scrub_bytes_per_sec_max", &self.scrub_bytes_per_sec_max)
            .field("field_types", &self.field_types)
            .field("table", &self.table)
            .field("iceberg_catalog", &self.iceberg_catalog)
            .field("lake", &self.lake)
            .finish()
    }
}

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("reader_tokens", &redacted_all(&self.reader_tokens))
            .field("admin_tokens", &redacted_all(&self.admin_tokens))
            .field("metrics_token", &redacted(&self.metrics_token))
            .field("limits", &self.limits)
            .finish()
    }
}

impl StreamPolicy {
    /// Whether `device` may write `stream`; the stream name must already be valid.
    pub fn allows(&self, device: &str, stream: &str) -> bool {
        if !self.configured.is_empty() && !self.configured.contains(stream) {
            return false;
        }
        match self.device_allow.get(device) {
            Some(allowed) => allowed.contains(stream),
            None => true,
        }
    }
}

/// `true` for stream names made of `[A-Za-z0-9_.-]`, 1 to 64 bytes, and not `.` or `..`.
pub fn valid_stream_name(name: &str) -> bool {
    valid_name(name, 64)
}

/// `true` for device ids made of `[A-Za-z0-9_.-]`, 1 to 128 bytes, and not `.` or `..`.
pub fn valid_device_id(id: &str) -> bool {
    valid_name(id, 128)
}

fn valid_name(s: &str, len_max: usize) -> bool {
    let charset = s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    charset && !s.is_empty() && s.len() <= len_max && s != "." && s != ".."
}

/// The raw shape of `hub.toml`, before typing.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub data_dir: Option<String>,
    #[serde(default)]
    pub listen: RawListen,
    pub tls: Option<RawTls>,
    #[serde(default)]
    pub tier2: RawTier2,
    #[serde(default)]
    pub wal: RawWal,
    #[serde(default)]
    pub ingest: RawIngest,
    #[serde(default)]
    pub streams: Vec<RawStream>,
    #[serde(default)]
    pub devices: BTreeMap<String, RawDevice>,
    #[serde(default)]
    pub http: RawHttp,
    #[serde(default)]
    pub completeness: crate::completeness::RawCompleteness,
    pub republish: Option<crate::republish::RawRepublish>,
    #[serde(default)]
    pub read: RawRead,
    #[serde(default)]
    pub metrics: RawMetrics,
    #[serde(default)]
    pub log: crate::logging::RawLog,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListen {
    pub quic: Option<String>,
    pub http: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub ca: Option<String>,
    pub cert: Option<String>,
    pub key: Option<String>,
    pub revoked: Option<String>,
}

#[derive(Default, Deserialize)]
pub struct RawTier2 {
    pub url: Option<String>,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub chunk_records_max: Option<u64>,
    pub chunk_bytes_max: Option<String>,
    pub chunk_age_max: Option<String>,
    pub poll_interval: Option<String>,
    pub request_timeout: Option<String>,
    pub tier1_retention_time: Option<String>,
    pub tier1_retention_bytes: Option<String>,
    pub tier1_budget_bytes: Option<String>,
    pub tier2_retention_time: Option<String>,
    pub tier2_retention_bytes: Option<String>,
    pub scrub_interval: Option<String>,
    pub scrub_bytes_per_sec_max: Option<String>,
    pub table: Option<String>,
    pub iceberg_catalog: Option<String>,
    pub commit_interval: Option<String>,
    pub snapshot_retention: Option<String>,
    pub orphan_grace: Option<String>,
    pub maintenance_interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWal {
    pub segment_bytes_max: Option<String>,
    pub group_commit_linger: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIngest {
    pub memory_bytes_max: Option<String>,
    pub block_bytes_max: Option<String>,
    pub block_raw_bytes_max: Option<String>,
    pub records_per_block_max: Option<u64>,
    pub block_decoded_bytes_max: Option<String>,
    pub streams_per_connection_max: Option<u64>,
    pub streams_per_device_max: Option<u64>,
    pub epochs_per_device_max: Option<u64>,
    pub lanes_per_device_max: Option<u64>,
    pub columns_per_stream_max: Option<u64>,
    pub columns_per_device_max: Option<u64>,
    pub connections_per_device_max: Option<u64>,
    pub hello_timeout: Option<String>,
    pub control_idle_timeout: Option<String>,
    pub blocks_in_flight_max: Option<u64>,
    pub retry_above_handshakes: Option<u64>,
    pub stream_refusal_retry: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStream {
    pub name: String,
    pub scale: Option<RawScale>,
    pub keys_prefixed_by_device: Option<bool>,
    /// Column type hints for tier 2: field name -> `"float"`.
    pub types: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawScale {
    pub target_records_per_s: Option<u64>,
    pub target_bytes_per_s: Option<String>,
    pub window: Option<String>,
    pub min_segments: Option<u32>,
    pub max_segments: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDevice {
    pub streams: Option<Vec<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    pub reader_tokens: Option<Vec<String>>,
    pub admin_tokens: Option<Vec<String>>,
    pub metrics_token: Option<String>,
    pub header_timeout: Option<String>,
    pub body_timeout: Option<String>,
    pub idle_timeout: Option<String>,
    pub connections_max: Option<u64>,
    pub requests_max: Option<u64>,
    pub allowed_hosts: Option<Vec<String>>,
}

impl std::fmt::Debug for RawTier2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawTier2")
            .field("url", &self.url)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &redacted(&self.secret_access_key))
            .field("chunk_records_max", &self.chunk_records_max)
            .field("chunk_bytes_max", &self.chunk_bytes_max)
            .field("chunk_age_max", &self.chunk_age_max)
            .field("poll_interval", &self.poll_interval)
            .field("request_timeout", &self.request_timeout)
            .field("tier1_retention_time", &self.tier1_retention_time)
            .field("tier1_retention_bytes", &self.tier1_retention_bytes)
            .field("tier1_budget_bytes", &self.tier1_budget_bytes)
            .field("tier2_retention_time", &self.tier2_retention_time)
            .field("tier2_retention_bytes", &self.tier2_retention_bytes)
            .field("scrub_interval", &self.scrub_interval)
            .field("scrub_bytes_per_sec_max", &self.scrub_bytes_per_sec_max)
            .finish()
    }
}

impl std::fmt::Debug for RawHttp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tokens = self.reader_tokens.as_deref().map(redacted_all);
        let admin = self.admin_tokens.as_deref().map(redacted_all);
        f.debug_struct("RawHttp")
            .field("reader_tokens", &tokens)
            .field("admin_tokens", &admin)
            .field("metrics_token", &redacted(&self.metrics_token))
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("connections_max", &self.connections_max)
            .field("requests_max", &self.requests_max)
            .field("allowed_hosts", &self.allowed_hosts)
            .finish()
    }
}

/// Default QUIC listen address.
pub const DEFAULT_QUIC: &str = "0.0.0.0:7400";
/// Default HTTP listen address.
pub const DEFAULT_HTTP: &str = "127.0.0.1:7480";
/// Default WAL file size before rolling.
pub const DEFAULT_WAL_SEGMENT_BYTES_MAX: u64 = 256 << 20;
/// Default group-commit linger.
pub const DEFAULT_GROUP_COMMIT_LINGER: Duration = Duration::from_millis(1);
/// Default global ingest memory budget.
pub const DEFAULT_MEMORY_BYTES_MAX: u64 = 512 << 20;
/// Default largest encoded block.
pub const DEFAULT_BLOCK_BYTES_MAX: u32 = 16 << 20;
/// Default largest decompressed block body.
pub const DEFAULT_BLOCK_RAW_BYTES_MAX: u32 = 64 << 20;
/// Default most records per block.
pub const DEFAULT_RECORDS_PER_BLOCK_MAX: u32 = 1 << 20;
/// Default largest decoded size of one block's records.
pub const DEFAULT_BLOCK_DECODED_BYTES_MAX: u64 = sync::block::DECODED_BYTES_MAX_DEFAULT;
/// Default most streams per connection.
pub const DEFAULT_STREAMS_PER_CONNECTION_MAX: u32 = 1024;
/// Default `ingest.streams_per_device_max`: a device ships a handful of streams.
pub const DEFAULT_STREAMS_PER_DEVICE_MAX: u32 = 256;
/// Default `ingest.epochs_per_device_max`: one epoch per data-directory wipe or clone.
pub const DEFAULT_EPOCHS_PER_DEVICE_MAX: u32 = 64;
/// Default `ingest.lanes_per_device_max`: streams times the epochs still in use.
pub const DEFAULT_LANES_PER_DEVICE_MAX: u32 = 1024;
/// Default `ingest.columns_per_stream_max`: distinct field names of one stream. Encoding a
/// tier-2 chunk costs about 45 KiB of memory per column, so this bounds it near 46 MiB.
pub const DEFAULT_COLUMNS_PER_STREAM_MAX: u32 = 1024;
/// Default `ingest.columns_per_device_max`: half a stream's columns, so it takes more than one
/// device to fill a shared stream, while one device alone can still write a wide stream.
pub const DEFAULT_COLUMNS_PER_DEVICE_MAX: u32 = 512;
/// Default `metrics.device_series_max`.
pub const DEFAULT_DEVICE_SERIES_MAX: usize = 1000;

/// Default records per tier-2 chunk.
pub const DEFAULT_CHUNK_RECORDS_MAX: u64 = 1_000_000;
/// Default tier-1 bytes per tier-2 chunk.
pub const DEFAULT_CHUNK_BYTES_MAX: u64 = 64 << 20;
/// Default age at which a partial chunk is sealed.
pub const DEFAULT_CHUNK_AGE_MAX: Duration = Duration::from_secs(60);
/// Default idle poll of the uploader.
pub const DEFAULT_TIER_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Default longest wait for one tier-2 request.
pub const DEFAULT_TIER_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time tiered data stays in tier 1.
pub const DEFAULT_TIER1_RETENTION_TIME: Duration = Duration::from_secs(3600);
/// Default tier-1 budget before ingest is pushed back.
pub const DEFAULT_TIER1_BUDGET_BYTES: u64 = 16 << 30;

impl HubConfig {
    /// Reads `path` and the process environment.
    pub fn load(path: &Path) -> Result<HubConfig, ConfigError> {
        Self::load_with_env(Some(path), None)
    }

    /// Reads `path` (if any) and the environment; `env` replaces the process environment
    /// when given, which keeps tests free of global state.
    pub fn load_with_env(
        path: Option<&Path>,
        env: Option<config::Map<String, String>>,
    ) -> Result<HubConfig, ConfigError> {
        let mut builder = config::Config::builder();
        if let Some(path) = path {
            let file = config::File::from(path)
                .format(config::FileFormat::Toml)
                .required(true);
            builder = builder.add_source(file);
        }
        let env_keys = errors::EnvKeys::collect(env.as_ref());
        let environment = config::Environment::with_prefix(ENV_PREFIX)
            .separator(ENV_SEPARATOR)
            .try_parsing(true)
            .source(env);
        let raw: RawConfig = builder
            .add_source(environment)
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| env_keys.annotate(errors::from_config_error(e)))?;
        Self::from_raw(raw).map_err(|e| env_keys.annotate(e))
    }

    /// Parses TOML text (no environment), for tests and tools.
    pub fn from_toml(text: &str) -> Result<HubConfig, ConfigError> {
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(errors::from_config_error)?;
        Self::from_raw(raw)
    }

    /// A configuration with every default and the given data directory.
    pub fn with_data_dir(data_dir: impl Into<PathBuf>) -> HubConfig {
        let raw = RawConfig {
            data_dir: Some(data_dir.into().display().to_string()),
            ..RawConfig::default()
        };
        Self::from_raw(raw).expect("defaults are valid")
    }

    /// Turns the raw structs into typed values.
    pub fn from_raw(raw: RawConfig) -> Result<HubConfig, ConfigError> {
        let data_dir = PathBuf::from(
            raw.data_dir
                .ok_or_else(|| ConfigError::key("data_dir", "is required"))?,
        );
        let listen = ListenConfig {
            quic: parse_addr(
                "listen.quic",
                raw.listen.quic.as_deref().unwrap_or(DEFAULT_QUIC),
            )?,
            http: parse_addr(
                "listen.http",
                raw.listen.http.as_deref().unwrap_or(DEFAULT_HTTP),
            )?,
        };
        let tls = raw.tls.map(parse_tls).transpose()?;
        let mut tier2 = parse_tier2(raw.tier2, &data_dir)?;
        let wal = parse_wal(&raw.wal)?;
        let ingest = parse_ingest(&raw.ingest)?;
        let streams = parse_streams(raw.streams, raw.devices)?;
        tier2.field_types = streams.field_types.clone();
        let http = parse_http(raw.http)?;
        let completeness = raw.completeness.parse()?;
        let republish = raw.republish.as_ref().map(|r| r.parse()).transpose()?;
        let read = parse_read(&raw.read)?;
        let metrics = parse_metrics(&raw.metrics)?;
        let log = raw
            .log
            .parse()
            .map_err(|problem| ConfigError::key("log.format", problem))?;
        Ok(HubConfig {
            log,
            read,
            metrics,
            completeness,
            republish,
            data_dir,
            listen,
            tls,
            tier2,
            wal,
            ingest,
            streams,
            http,
        })
    }

    /// The catalog database path.
    pub fn catalog_path(&self) -> PathBuf {
        self.data_dir.join("catalog.sqlite")
    }

    /// The WAL directory.
    pub fn wal_dir(&self) -> PathBuf {
        self.data_dir.join("wal")
    }

    /// The block decode limits derived from `[ingest]`.
    pub fn decode_limits(&self) -> sync::block::DecodeLimits {
        sync::block::DecodeLimits {
            raw_bytes_max: self.ingest.block_raw_bytes_max,
            records_max: self.ingest.records_per_block_max,
            body_bytes_max: self.ingest.block_bytes_max,
            decoded_bytes_max: self.ingest.block_decoded_bytes_max,
        }
    }
}

/// Where a local tier 2 sits relative to the data directory, when that is a risk: a lost disk
/// then takes tier 1 and tier 2 with it, so tier 2 is no backup (`core-hub run` logs a warning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier2Placement {
    /// `tier2.url` is a directory inside `data_dir` (the default `file://{data_dir}/tier2`).
    InsideDataDir,
    /// A directory elsewhere, but on the filesystem that holds `data_dir`.
    SameFilesystem,
}

impl HubConfig {
    /// `Some` when tier 2 is a local directory inside `data_dir` or on its filesystem; `None`
    /// for S3 and for a directory on another filesystem. Paths that do not exist yet are judged
    /// by their nearest existing ancestor, as that is where they will be created.
    pub fn tier2_placement(&self) -> Option<Tier2Placement> {
        use std::os::unix::fs::MetadataExt as _;
        let dir = Path::new(self.tier2.url.strip_prefix("file://")?);
        if dir.starts_with(&self.data_dir) {
            return Some(Tier2Placement::InsideDataDir);
        }
        let device = |p: &Path| {
            p.ancestors()
                .find_map(|a| std::fs::metadata(a).ok())
                .map(|m| m.dev())
        };
        match (device(dir), device(&self.data_dir)) {
            (Some(a), Some(b)) if a == b => Some(Tier2Placement::SameFilesystem),
            _ => None,
        }
    }
}

fn parse_addr(key: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| {
        ConfigError::key(
            key,
            format!("`{s}` is not a socket address such as 0.0.0.0:7400"),
        )
    })
}

fn parse_tls(raw: RawTls) -> Result<TlsPaths, ConfigError> {
    let need = |v: Option<String>, key: &str| {
        v.map(PathBuf::from)
            .ok_or_else(|| ConfigError::key(key, "is required when [tls] is present"))
    };
    let ca = need(raw.ca, "tls.ca")?;
    let revoked = match raw.revoked {
        Some(p) if p.is_empty() => return Err(ConfigError::key("tls.revoked", "is empty")),
        Some(p) => PathBuf::from(p),
        None => default_revoked(&ca),
    };
    Ok(TlsPaths {
        cert: need(raw.cert, "tls.cert")?,
        key: need(raw.key, "tls.key")?,
        ca,
        revoked,
    })
}

fn parse_tier2(raw: RawTier2, data_dir: &Path) -> Result<Tier2Config, ConfigError> {
    let url = raw
        .url
        .clone()
        .unwrap_or_else(|| format!("file://{}", data_dir.join("tier2").display()));
    let (scheme, rest) = url.split_once("://").ok_or_else(|| {
        ConfigError::key(
            "tier2.url",
            format!("`{url}` is not a URL such as file:///path or s3://bucket/prefix"),
        )
    })?;
    match scheme {
        "file" if rest.starts_with('/') => {}
        "s3" if !rest.is_empty() => {}
        "file" => {
            return Err(ConfigError::key(
                "tier2.url",
                "a file:// URL needs an absolute path",
            ));
        }
        _ => {
            return Err(ConfigError::key(
                "tier2.url",
                format!("unsupported scheme `{scheme}`; use file:// or s3://"),
            ));
        }
    }
    let scheme = scheme.to_string();
    let dur = |key: &str, v: &Option<String>, default: Duration| match v.as_deref() {
        Some(s) => parse_duration(&format!("tier2.{key}"), s),
        None => Ok(default),
    };
    let opt_dur = |key: &str, v: &Option<String>| {
        v.as_deref()
            .map(|s| parse_duration(&format!("tier2.{key}"), s))
            .transpose()
    };
    let bytes = |key: &str, v: &Option<String>, default: u64| {
        opt_bytes(&format!("tier2.{key}"), v.as_deref(), default)
    };
    let chunk_records_max = raw.chunk_records_max.unwrap_or(DEFAULT_CHUNK_RECORDS_MAX);
    if chunk_records_max == 0 {
        return Err(ConfigError::key(
            "tier2.chunk_records_max",
            "must be at least 1",
        ));
    }
    let chunk_bytes_max = bytes(
        "chunk_bytes_max",
        &raw.chunk_bytes_max,
        DEFAULT_CHUNK_BYTES_MAX,
    )?;
    let tier1_budget_bytes = bytes(
        "tier1_budget_bytes",
        &raw.tier1_budget_bytes,
        DEFAULT_TIER1_BUDGET_BYTES,
    )?;
    let tier1_retention_bytes = bytes(
        "tier1_retention_bytes",
        &raw.tier1_retention_bytes,
        tier1_budget_bytes / 2,
    )?;
    if tier1_retention_bytes > tier1_budget_bytes {
        return Err(ConfigError::key(
            "tier2.tier1_retention_bytes",
            "must not exceed tier2.tier1_budget_bytes",
        ));
    }
    let tier2_retention_bytes = raw
        .tier2_retention_bytes
        .as_deref()
        .map(|s| opt_bytes("tier2.tier2_retention_bytes", Some(s), 0))
        .transpose()?;
    let table = parse_table_format(raw.table.as_deref())?;
    let lake = parse_lake(&raw, table)?;
    Ok(Tier2Config {
        field_types: BTreeMap::new(),
        url,
        scheme,
        endpoint: raw.endpoint,
        region: raw.region,
        access_key_id: raw.access_key_id,
        secret_access_key: raw.secret_access_key,
        chunk_records_max,
        chunk_bytes_max,
        chunk_age_max: dur("chunk_age_max", &raw.chunk_age_max, DEFAULT_CHUNK_AGE_MAX)?,
        poll_interval: dur(
            "poll_interval",
            &raw.poll_interval,
            DEFAULT_TIER_POLL_INTERVAL,
        )?,
        request_timeout: dur(
            "request_timeout",
            &raw.request_timeout,
            DEFAULT_TIER_REQUEST_TIMEOUT,
        )?,
        tier1_retention_time: dur(
            "tier1_retention_time",
            &raw.tier1_retention_time,
            DEFAULT_TIER1_RETENTION_TIME,
        )?,
        tier1_retention_bytes,
        tier1_budget_bytes,
        tier2_retention_time: opt_dur("tier2_retention_time", &raw.tier2_retention_time)?,
        tier2_retention_bytes,
        scrub_interval: dur(
            "scrub_interval",
            &raw.scrub_interval,
            crate::scrub::DEFAULT_TIER2_INTERVAL,
        )?,
        scrub_bytes_per_sec_max: bytes(
            "scrub_bytes_per_sec_max",
            &raw.scrub_bytes_per_sec_max,
            crate::scrub::DEFAULT_TIER2_BYTES_PER_SEC_MAX,
        )?,
        table,
        iceberg_catalog: raw.iceberg_catalog.as_deref().map_or_else(
            || tier::table::CatalogLocation::Sqlite(data_dir.join("iceberg.sqlite")),
            tier::table::CatalogLocation::parse,
        ),
        lake,
    })
}

fn parse_table_format(v: Option<&str>) -> Result<TableFormat, ConfigError> {
    match v {
        None | Some("parquet") => Ok(TableFormat::Parquet),
        Some("iceberg") => Ok(TableFormat::Iceberg),
        Some(other) => Err(ConfigError::key(
            "tier2.table",
            format!("`{other}` is neither \"parquet\" nor \"iceberg\""),
        )),
    }
}

/// The Iceberg upkeep keys; set with `table = "parquet"`, they are refused (they would do
/// nothing).
fn parse_lake(raw: &RawTier2, table: TableFormat) -> Result<LakeConfig, ConfigError> {
    let keys = [
        ("commit_interval", &raw.commit_interval),
        ("snapshot_retention", &raw.snapshot_retention),
        ("orphan_grace", &raw.orphan_grace),
        ("maintenance_interval", &raw.maintenance_interval),
    ];
    if table == TableFormat::Parquet
        && let Some((key, _)) = keys.iter().find(|(_, v)| v.is_some())
    {
        return Err(ConfigError::key(
            format!("tier2.{key}"),
            "applies to Iceberg tables only; set tier2.table = \"iceberg\" or remove it",
        ));
    }
    let defaults = tier::table::MaintainPolicy::default();
    let dur = |key: &str, v: &Option<String>, default: Duration| match v.as_deref() {
        Some(s) => parse_duration(&format!("tier2.{key}"), s),
        None => Ok(default),
    };
    Ok(LakeConfig {
        commit_interval: dur(
            "commit_interval",
            &raw.commit_interval,
            DEFAULT_LAKE_COMMIT_INTERVAL,
        )?,
        maintenance_interval: dur(
            "maintenance_interval",
            &raw.maintenance_interval,
            DEFAULT_LAKE_MAINTENANCE_INTERVAL,
        )?,
        policy: tier::table::MaintainPolicy {
            snapshot_retention: dur(
                "snapshot_retention",
                &raw.snapshot_retention,
                defaults.snapshot_retention,
            )?,
            orphan_grace: dur("orphan_grace", &raw.orphan_grace, defaults.orphan_grace)?,
            deletes_max: defaults.deletes_max,
        },
    })
}

fn parse_wal(raw: &RawWal) -> Result<WalConfig, ConfigError> {
    let segment_bytes_max = opt_bytes(
        "wal.segment_bytes_max",
        raw.segment_bytes_max.as_deref(),
        DEFAULT_WAL_SEGMENT_BYTES_MAX,
    )?;
    if segment_bytes_max < 1 << 20 {
        return Err(ConfigError::key(
            "wal.segment_bytes_max",
            "must be at least 1MiB",
        ));
    }
    let group_commit_linger = match raw.group_commit_linger.as_deref() {
        Some(s) => parse_duration("wal.group_commit_linger", s)?,
        None => DEFAULT_GROUP_COMMIT_LINGER,
    };
    if group_commit_linger > Duration::from_secs(1) {
        return Err(ConfigError::key(
            "wal.group_commit_linger",
            "must be at most 1s",
        ));
    }
    Ok(WalConfig {
        segment_bytes_max,
        group_commit_linger,
    })
}

fn parse_ingest(raw: &RawIngest) -> Result<IngestConfig, ConfigError> {
    let memory_bytes_max = opt_bytes(
        "ingest.memory_bytes_max",
        raw.memory_bytes_max.as_deref(),
        DEFAULT_MEMORY_BYTES_MAX,
    )?;
    let block_bytes_max = opt_u32_bytes(
        "ingest.block_bytes_max",
        raw.block_bytes_max.as_deref(),
        DEFAULT_BLOCK_BYTES_MAX,
    )?;
    let block_raw_bytes_max = opt_u32_bytes(
        "ingest.block_raw_bytes_max",
        raw.block_raw_bytes_max.as_deref(),
        DEFAULT_BLOCK_RAW_BYTES_MAX,
    )?;
    // A WAL frame carries an entry header and the block; it must fit sync's frame limit.
    if !(1024..=sync::segment::FRAME_BYTES_MAX - 1024).contains(&block_bytes_max) {
        return Err(ConfigError::key(
            "ingest.block_bytes_max",
            "must be between 1KiB and 255MiB",
        ));
    }
    // Admission control needs room for at least one worst-case block (see `ingest::block_cost`).
    let worst = u64::from(block_bytes_max) + 2 * u64::from(block_raw_bytes_max);
    if memory_bytes_max < worst {
        return Err(ConfigError::key(
            "ingest.memory_bytes_max",
            format!("must be at least block_bytes_max + 2 * block_raw_bytes_max = {worst} bytes"),
        ));
    }
    let records = raw
        .records_per_block_max
        .unwrap_or(u64::from(DEFAULT_RECORDS_PER_BLOCK_MAX));
    let records_per_block_max =
        u32::try_from(records)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                ConfigError::key(
                    "ingest.records_per_block_max",
                    "must be between 1 and 4294967295",
                )
            })?;
    let block_decoded_bytes_max = opt_bytes(
        "ingest.block_decoded_bytes_max",
        raw.block_decoded_bytes_max.as_deref(),
        DEFAULT_BLOCK_DECODED_BYTES_MAX,
    )?;
    if block_decoded_bytes_max < 1024 {
        return Err(ConfigError::key(
            "ingest.block_decoded_bytes_max",
            "must be at least 1KiB",
        ));
    }
    let streams = raw
        .streams_per_connection_max
        .unwrap_or(u64::from(DEFAULT_STREAMS_PER_CONNECTION_MAX));
    let streams_per_connection_max = u32::try_from(streams)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| {
            ConfigError::key(
                "ingest.streams_per_connection_max",
                "must be between 1 and 4294967295",
            )
        })?;
    Ok(IngestConfig {
        memory_bytes_max,
        block_bytes_max,
        block_raw_bytes_max,
        records_per_block_max,
        block_decoded_bytes_max,
        streams_per_connection_max,
        state: parse_state_quotas(raw)?,
        conn: parse_connection_quotas(raw)?,
    })
}

/// The per-connection bounds of `[ingest]`.
fn parse_connection_quotas(raw: &RawIngest) -> Result<ConnectionQuotas, ConfigError> {
    let d = ConnectionQuotas::default();
    let count = |key: &str, v: Option<u64>, default: u32, max: u32| -> Result<u32, ConfigError> {
        match v {
            None => Ok(default),
            Some(n) => u32::try_from(n)
                .ok()
                .filter(|&n| (1..=max).contains(&n))
                .ok_or_else(|| ConfigError::key(key, format!("must be between 1 and {max}"))),
        }
    };
    let deadline =
        |key: &str, v: Option<&str>, default: Duration| -> Result<Duration, ConfigError> {
            let t = v.map_or(Ok(default), |s| parse_duration(key, s))?;
            if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&t) {
                return Err(ConfigError::key(key, "must be between 100ms and 1h"));
            }
            Ok(t)
        };
    let raw_idle = raw.control_idle_timeout.as_deref();
    let q = ConnectionQuotas {
        connections_per_device_max: count(
            "ingest.connections_per_device_max",
            raw.connections_per_device_max,
            d.connections_per_device_max,
            1024,
        )?,
        hello_timeout: deadline(
            "ingest.hello_timeout",
            raw.hello_timeout.as_deref(),
            d.hello_timeout,
        )?,
        control_idle_timeout: deadline(
            "ingest.control_idle_timeout",
            raw_idle,
            d.control_idle_timeout,
        )?,
        blocks_in_flight_max: count(
            "ingest.blocks_in_flight_max",
            raw.blocks_in_flight_max,
            d.blocks_in_flight_max,
            4096,
        )?,
        // 0 validates every new client address.
        retry_above_handshakes: match raw.retry_above_handshakes {
            None => d.retry_above_handshakes,
            Some(n) => u32::try_from(n).map_err(|_| {
                ConfigError::key(
                    "ingest.retry_above_handshakes",
                    "must be at most 4294967295",
                )
            })?,
        },
        stream_refusal_retry: deadline(
            "ingest.stream_refusal_retry",
            raw.stream_refusal_retry.as_deref(),
            d.stream_refusal_retry,
        )?,
    };
    // The agent pings every 10 s; an idle deadline near that would cut honest sessions.
    if q.control_idle_timeout < Duration::from_secs(15) {
        return Err(ConfigError::key(
            "ingest.control_idle_timeout",
            "must be at least 15s (the agent pings every 10s)",
        ));
    }
    Ok(q)
}

/// The per-device state quotas of `[ingest]`; each must be at least 1.
fn parse_state_quotas(raw: &RawIngest) -> Result<StateQuotas, ConfigError> {
    let d = StateQuotas::default();
    let one = |key: &str, v: Option<u64>, default: u32| -> Result<u32, ConfigError> {
        match v {
            None => Ok(default),
            Some(n) => u32::try_from(n)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| ConfigError::key(key, "must be between 1 and 4294967295")),
        }
    };
    let q = StateQuotas {
        streams_per_device_max: one(
            "ingest.streams_per_device_max",
            raw.streams_per_device_max,
            d.streams_per_device_max,
        )?,
        epochs_per_device_max: one(
            "ingest.epochs_per_device_max",
            raw.epochs_per_device_max,
            d.epochs_per_device_max,
        )?,
        lanes_per_device_max: one(
            "ingest.lanes_per_device_max",
            raw.lanes_per_device_max,
            d.lanes_per_device_max,
        )?,
        columns_per_stream_max: one(
            "ingest.columns_per_stream_max",
            raw.columns_per_stream_max,
            d.columns_per_stream_max,
        )?,
        columns_per_device_max: one(
            "ingest.columns_per_device_max",
            raw.columns_per_device_max,
            d.columns_per_device_max,
        )?,
    };
    Ok(q)
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    pub device_series_max: Option<u64>,
}

fn parse_metrics(raw: &RawMetrics) -> Result<MetricsConfig, ConfigError> {
    let device_series_max = match raw.device_series_max {
        None => DEFAULT_DEVICE_SERIES_MAX,
        Some(n) => usize::try_from(n)
            .ok()
            .filter(|&n| (1..=1_000_000).contains(&n))
            .ok_or_else(|| {
                ConfigError::key("metrics.device_series_max", "must be between 1 and 1000000")
            })?,
    };
    Ok(MetricsConfig { device_series_max })
}

fn parse_streams(
    streams: Vec<RawStream>,
    devices: BTreeMap<String, RawDevice>,
) -> Result<StreamPolicy, ConfigError> {
    let mut configured = BTreeSet::new();
    let mut scale = BTreeMap::new();
    let mut keys_prefixed_by_device = BTreeSet::new();
    let mut field_types = BTreeMap::new();
    for (i, s) in streams.into_iter().enumerate() {
        if !valid_stream_name(&s.name) {
            return Err(ConfigError::key(
                format!("streams[{i}].name"),
                format!("`{}` is not [A-Za-z0-9_.-]{{1,64}}", s.name),
            ));
        }
        if let Some(raw) = s.scale {
            scale.insert(
                s.name.clone(),
                parse_scale(&format!("streams[{i}].scale"), raw)?,
            );
        }
        if s.keys_prefixed_by_device == Some(true) {
            keys_prefixed_by_device.insert(s.name.clone());
        }
        if let Some(types) = s.types {
            field_types.insert(s.name.clone(), parse_field_types(i, types)?);
        }
        configured.insert(s.name);
    }
    let mut device_allow = BTreeMap::new();
    for (id, dev) in devices {
        if !valid_device_id(&id) {
            return Err(ConfigError::key(
                format!("devices.{id}"),
                "device id is not [A-Za-z0-9_.-]{1,128}",
            ));
        }
        let Some(list) = dev.streams else { continue };
        let mut allowed = BTreeSet::new();
        for name in list {
            let key = format!("devices.{id}.streams");
            if !valid_stream_name(&name) {
                return Err(ConfigError::key(
                    key,
                    format!("`{name}` is not a valid stream name"),
                ));
            }
            if !configured.is_empty() && !configured.contains(&name) {
                return Err(ConfigError::key(
                    key,
                    format!("`{name}` is not a configured [[streams]] name"),
                ));
            }
            allowed.insert(name);
        }
        device_allow.insert(id, allowed);
    }
    Ok(StreamPolicy {
        configured,
        device_allow,
        scale,
        keys_prefixed_by_device,
        field_types,
    })
}

/// `streams[i].types`: field name -> column type. `"float"` is the one hint: integers and
/// decimals of the field share one DOUBLE column from the first record on.
fn parse_field_types(
    i: usize,
    raw: BTreeMap<String, String>,
) -> Result<BTreeMap<String, tier::ValueKind>, ConfigError> {
    raw.into_iter()
        .map(|(field, ty)| match ty.as_str() {
            "float" => Ok((field, tier::ValueKind::F64)),
            other => Err(ConfigError::key(
                format!("streams[{i}].types.{field}"),
                format!("`{other}` is not a column type hint; the one hint is \"float\""),
            )),
        })
        .collect()
}

fn parse_scale(key: &str, raw: RawScale) -> Result<ScalePolicy, ConfigError> {
    let bytes = raw
        .target_bytes_per_s
        .as_deref()
        .map(|s| {
            parse_bytes(s).map_err(|p| ConfigError::key(format!("{key}.target_bytes_per_s"), p))
        })
        .transpose()?;
    if raw.target_records_per_s.is_none() && bytes.is_none() {
        return Err(ConfigError::key(
            key,
            "needs target_records_per_s or target_bytes_per_s",
        ));
    }
    if raw.target_records_per_s == Some(0) || bytes == Some(0) {
        return Err(ConfigError::key(key, "targets must be above 0"));
    }
    let window = match raw.window.as_deref() {
        Some(w) => parse_duration(&format!("{key}.window"), w)?,
        None => Duration::from_secs(60),
    };
    if window.is_zero() {
        return Err(ConfigError::key(format!("{key}.window"), "must be above 0"));
    }
    let min_segments = raw.min_segments.unwrap_or(1);
    let max_segments = raw.max_segments.unwrap_or(DEFAULT_MAX_SEGMENTS);
    if min_segments == 0 || min_segments > max_segments || max_segments > 1024 {
        return Err(ConfigError::key(
            format!("{key}.max_segments"),
            "need 1 <= min_segments <= max_segments <= 1024",
        ));
    }
    Ok(ScalePolicy {
        target_records_per_s: raw.target_records_per_s,
        target_bytes_per_s: bytes,
        window,
        min_segments,
        max_segments,
    })
}

fn parse_tokens(key: &str, tokens: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
    let tokens = tokens.unwrap_or_default();
    if let Some(i) = tokens
        .iter()
        .position(|t| t.len() < 16 || t.chars().any(char::is_whitespace))
    {
        return Err(ConfigError::key(
            format!("{key}[{i}]"),
            "tokens must be at least 16 characters, without spaces",
        ));
    }
    Ok(tokens)
}

fn parse_http(raw: RawHttp) -> Result<HttpConfig, ConfigError> {
    let d = crate::http_limits::default_limits();
    let duration = |key: &str, v: Option<&str>, default: Duration| match v {
        Some(s) => match parse_duration(key, s)? {
            d if d.is_zero() => Err(ConfigError::key(key, "must be above 0")),
            d => Ok(d),
        },
        None => Ok(default),
    };
    let count = |key: &str, v: Option<u64>, default: usize| match v {
        Some(0) => Err(ConfigError::key(key, "must be above 0")),
        Some(n) => usize::try_from(n).map_err(|_| ConfigError::key(key, "is too large")),
        None => Ok(default),
    };
    let metrics = parse_tokens("http.metrics_token", raw.metrics_token.map(|t| vec![t]))?;
    let limits = crate::http_limits::HttpLimits {
        header_timeout: duration(
            "http.header_timeout",
            raw.header_timeout.as_deref(),
            d.header_timeout,
        )?,
        body_timeout: duration(
            "http.body_timeout",
            raw.body_timeout.as_deref(),
            d.body_timeout,
        )?,
        idle_timeout: duration(
            "http.idle_timeout",
            raw.idle_timeout.as_deref(),
            d.idle_timeout,
        )?,
        connections_max: count(
            "http.connections_max",
            raw.connections_max,
            d.connections_max,
        )?,
        requests_max: count("http.requests_max", raw.requests_max, d.requests_max)?,
        body_bytes_max: d.body_bytes_max,
        allowed_hosts: raw.allowed_hosts.unwrap_or_default(),
    };
    Ok(HttpConfig {
        reader_tokens: parse_tokens("http.reader_tokens", raw.reader_tokens)?,
        admin_tokens: parse_tokens("http.admin_tokens", raw.admin_tokens)?,
        metrics_token: metrics.into_iter().next(),
        limits,
    })
}

fn opt_bytes(key: &str, s: Option<&str>, default: u64) -> Result<u64, ConfigError> {
    match s {
        Some(s) => parse_bytes(s).map_err(|problem| ConfigError::key(key, problem)),
        None => Ok(default),
    }
}

fn opt_u32_bytes(key: &str, s: Option<&str>, default: u32) -> Result<u32, ConfigError> {
    let n = opt_bytes(key, s, u64::from(default))?;
    u32::try_from(n).map_err(|_| ConfigError::key(key, "must be below 4GiB"))
}

/// Parses `512MiB`, `16 MiB`, `64KiB`, `2GB`, `1024` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a byte size such as 512MiB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit `{other}` in `{s}`; use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` overflows"))
}

/// `[read]`: what one reader may make the hub hold (see `crate::read` and docs/streams.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadConfig {
    /// A page of records (the records API, reader-group batches, republish and tier-2 reads)
    /// stops before its records' decoded size (`sync::decoded`) would pass this; a page always
    /// holds at least one record.
    pub page_bytes_max: u64,
    /// The decoded blocks the readers' shared cache keeps, by decoded size.
    pub cache_bytes_max: u64,
    /// Concurrent `follow=true` responses; the next one is refused with 503.
    pub follows_max: u32,
    /// NDJSON bytes queued for one follow response that its client has not taken yet.
    pub follow_buffer_bytes_max: u64,
    /// A follow response whose client takes nothing for this long while its buffer is full
    /// is ended (logged and counted).
    pub follow_stall_timeout: Duration,
}

/// Default `read.page_bytes_max`.
pub const DEFAULT_PAGE_BYTES_MAX: u64 = 4 << 20;
/// Default `read.cache_bytes_max`.
pub const DEFAULT_CACHE_BYTES_MAX: u64 = 256 << 20;
/// Default `read.follows_max`.
pub const DEFAULT_FOLLOWS_MAX: u32 = 256;
/// Default `read.follow_buffer_bytes_max`.
pub const DEFAULT_FOLLOW_BUFFER_BYTES_MAX: u64 = 1 << 20;
/// Default `read.follow_stall_timeout`.
pub const DEFAULT_FOLLOW_STALL_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for ReadConfig {
    fn default() -> Self {
        ReadConfig {
            page_bytes_max: DEFAULT_PAGE_BYTES_MAX,
            cache_bytes_max: DEFAULT_CACHE_BYTES_MAX,
            follows_max: DEFAULT_FOLLOWS_MAX,
            follow_buffer_bytes_max: DEFAULT_FOLLOW_BUFFER_BYTES_MAX,
            follow_stall_timeout: DEFAULT_FOLLOW_STALL_TIMEOUT,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRead {
    pub page_bytes_max: Option<String>,
    pub cache_bytes_max: Option<String>,
    pub follows_max: Option<u64>,
    pub follow_buffer_bytes_max: Option<String>,
    pub follow_stall_timeout: Option<String>,
}

fn parse_read(raw: &RawRead) -> Result<ReadConfig, ConfigError> {
    let at_least = |key: &str, v: u64, min: u64, what: &str| {
        if v < min {
            Err(ConfigError::key(key, format!("must be at least {what}")))
        } else {
            Ok(v)
        }
    };
    let page = opt_bytes(
        "read.page_bytes_max",
        raw.page_bytes_max.as_deref(),
        DEFAULT_PAGE_BYTES_MAX,
    )?;
    let page_bytes_max = at_least("read.page_bytes_max", page, 1024, "1KiB")?;
    let cache_bytes_max = opt_bytes(
        "read.cache_bytes_max",
        raw.cache_bytes_max.as_deref(),
        DEFAULT_CACHE_BYTES_MAX,
    )?;
    let follows = raw.follows_max.unwrap_or(u64::from(DEFAULT_FOLLOWS_MAX));
    let follows_max = u32::try_from(follows)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| ConfigError::key("read.follows_max", "must be between 1 and 4294967295"))?;
    let buffer = opt_bytes(
        "read.follow_buffer_bytes_max",
        raw.follow_buffer_bytes_max.as_deref(),
        DEFAULT_FOLLOW_BUFFER_BYTES_MAX,
    )?;
    let follow_buffer_bytes_max = at_least("read.follow_buffer_bytes_max", buffer, 4096, "4KiB")?;
    let follow_stall_timeout = match raw.follow_stall_timeout.as_deref() {
        Some(s) => parse_duration("read.follow_stall_timeout", s)?,
        None => DEFAULT_FOLLOW_STALL_TIMEOUT,
    };
    if follow_stall_timeout.is_zero() {
        return Err(ConfigError::key(
            "read.follow_stall_timeout",
            "must be longer than 0s",
        ));
    }
    Ok(ReadConfig {
        page_bytes_max,
        cache_bytes_max,
        follows_max,
        follow_buffer_bytes_max,
        follow_stall_timeout,
    })
}

fn parse_duration(key: &str, s: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(s.trim())
        .map_err(|e| ConfigError::key(key, format!("`{s}` is not a duration such as 1ms: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier2_placement_flags_a_tier2_a_lost_disk_takes_along() {
        let root = tempfile::tempdir().unwrap();
        let data = root.path().join("data");
        let with = |tier2: Option<String>| {
            let mut text = format!("data_dir = {:?}\n", data.display().to_string());
            if let Some(url) = tier2 {
                text.push_str(&format!("[tier2]\nurl = {url:?}\n"));
            }
            HubConfig::from_toml(&text).unwrap().tier2_placement()
        };
        assert_eq!(with(None), Some(Tier2Placement::InsideDataDir));
        let beside = format!("file://{}", root.path().join("tier2").display());
        assert_eq!(with(Some(beside)), Some(Tier2Placement::SameFilesystem));
        assert_eq!(with(Some("s3://bucket/prefix".into())), None);
        // /proc is its own filesystem on every Linux: a stand-in for another disk.
        assert_eq!(with(Some("file:///proc/tier2".into())), None);
    }

    #[test]
    fn tier2_table_format_and_its_upkeep_parse() {
        let d = HubConfig::from_toml("data_dir = \"/d\"").unwrap().tier2;
        assert_eq!(d.table, TableFormat::Parquet);
        use tier::table::CatalogLocation;
        assert_eq!(
            d.iceberg_catalog,
            CatalogLocation::Sqlite(PathBuf::from("/d/iceberg.sqlite"))
        );
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[tier2]\ntable = \"iceberg\"\niceberg_catalog = \"/c/cat.db\"",
        )
        .unwrap()
        .tier2;
        assert_eq!(c.table, TableFormat::Iceberg);
        assert_eq!(
            c.iceberg_catalog,
            CatalogLocation::Sqlite(PathBuf::from("/c/cat.db"))
        );
        let pg = HubConfig::from_toml(
            "data_dir = \"/d\"\n[tier2]\ntable = \"iceberg\"\n\
             iceberg_catalog = \"postgresql://hub:s3cret@db:5432/lake\"",
        )
        .unwrap()
        .tier2;
        let url = "postgresql://hub:s3cret@db:5432/lake".to_owned();
        assert_eq!(pg.iceberg_catalog, CatalogLocation::Postgres(url));
        let shown = format!("{:?}", pg);
        assert!(
            shown.contains("postgresql://hub:***@db:5432/lake") && !shown.contains("s3cret"),
            "{shown}"
        );
        let bad = HubConfig::from_toml("data_dir = \"/d\"\n[tier2]\ntable = \"delta\"")
            .unwrap_err()
            .to_string();
        assert!(bad.contains("delta") && bad.contains("iceberg"), "{bad}");
        assert_eq!(c.lake.policy, tier::table::MaintainPolicy::default());
        assert_eq!(
            c.lake.maintenance_interval,
            DEFAULT_LAKE_MAINTENANCE_INTERVAL
        );
        assert_eq!(c.lake.commit_interval, DEFAULT_LAKE_COMMIT_INTERVAL);
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[tier2]\ntable = \"iceberg\"\ntier2_retention_time = \"30days\"\n\
             snapshot_retention = \"2h\"\norphan_grace = \"0s\"\nmaintenance_interval = \"10m\"\n\
             commit_interval = \"1m\"",
        )
        .unwrap()
        .tier2;
        let m = c.lake;
        assert_eq!(m.policy.snapshot_retention, Duration::from_secs(7_200));
        assert_eq!(m.policy.orphan_grace, Duration::ZERO);
        assert_eq!(m.maintenance_interval, Duration::from_secs(600));
        assert_eq!(m.commit_interval, Duration::from_secs(60));
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[tier2]\nsnapshot_retention = \"2h\""),
            "tier2.snapshot_retention"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[tier2]\ntable = \"iceberg\"\norphan_grace = \"soon\""),
            "tier2.orphan_grace"
        );
    }

    #[test]
    fn tier2_keys_parse() {
        let c = HubConfig::from_toml(
            r#"
            data_dir = "/d"
            [tier2]
            url = "s3://bucket"
            endpoint = "http://127.0.0.1:9000"
            region = "eu-west-1"
            chunk_records_max = 5000
            chunk_bytes_max = "8MiB"
            chunk_age_max = "10s"
            tier1_retention_time = "5m"
            tier1_retention_bytes = "1GiB"
            tier1_budget_bytes = "4GiB"
            tier2_retention_time = "30days"
            tier2_retention_bytes = "1TiB"
            "#,
        )
        .unwrap();
        let t = &c.tier2;
        assert_eq!(t.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(t.chunk_records_max, 5000);
        assert_eq!(t.chunk_bytes_max, 8 << 20);
        assert_eq!(t.chunk_age_max, Duration::from_secs(10));
        assert_eq!(t.tier1_retention_bytes, 1 << 30);
        assert_eq!(t.tier1_budget_bytes, 4 << 30);
        assert_eq!(
            t.tier2_retention_time,
            Some(Duration::from_secs(30 * 86400))
        );
        assert_eq!(t.tier2_retention_bytes, Some(1 << 40));
        let d = HubConfig::from_toml("data_dir = \"/d\"").unwrap().tier2;
        assert_eq!(d.tier1_budget_bytes, DEFAULT_TIER1_BUDGET_BYTES);
        assert!(d.tier2_retention_time.is_none());
        assert_eq!(
            problem_key(
                "data_dir = \"/d\"\n[tier2]\ntier1_retention_bytes = \"2GiB\"\ntier1_budget_bytes = \"1GiB\""
            ),
            "tier2.tier1_retention_bytes"
        );
    }

    #[test]
    fn defaults_apply() {
        let c = HubConfig::from_toml("data_dir = \"/var/lib/hub\"").unwrap();
        assert_eq!(c.listen.quic, "0.0.0.0:7400".parse().unwrap());
        assert_eq!(c.listen.http, "127.0.0.1:7480".parse().unwrap());
        assert_eq!(c.tier2.url, "file:///var/lib/hub/tier2");
        assert_eq!(c.wal.segment_bytes_max, 256 << 20);
        assert_eq!(c.wal.group_commit_linger, Duration::from_millis(1));
        assert_eq!(c.ingest.memory_bytes_max, 512 << 20);
        assert_eq!(c.ingest.block_bytes_max, 16 << 20);
        assert!(c.tls.is_none());
        assert!(c.http.reader_tokens.is_empty());
        assert!(c.streams.allows("anyone", "telemetry"));
    }

    #[test]
    fn full_file_parses() {
        let text = r#"
            data_dir = "/d"
            [listen]
            quic = "127.0.0.1:9000"
            http = "127.0.0.1:9001"
            [tls]
            ca = "pki/ca.pem"
            cert = "pki/hub.pem"
            key = "pki/hub.key"
            [tier2]
            url = "s3://bucket/prefix"
            [wal]
            segment_bytes_max = "64MiB"
            group_commit_linger = "2ms"
            [ingest]
            memory_bytes_max = "1GiB"
            block_bytes_max = "4MiB"
            records_per_block_max = 5000
            streams_per_connection_max = 8
            [[streams]]
            name = "telemetry"
            [[streams]]
            name = "status"
            [devices.truck-1]
            streams = ["status"]
            [http]
            reader_tokens = ["0123456789abcdef0123"]
        "#;
        let c = HubConfig::from_toml(text).unwrap();
        assert_eq!(c.listen.quic.port(), 9000);
        assert_eq!(c.tls.unwrap().key, PathBuf::from("pki/hub.key"));
        assert_eq!(c.tier2.scheme, "s3");
        assert_eq!(c.wal.segment_bytes_max, 64 << 20);
        assert_eq!(c.wal.group_commit_linger, Duration::from_millis(2));
        assert_eq!(c.ingest.records_per_block_max, 5000);
        assert_eq!(c.ingest.streams_per_connection_max.get(), 8);
        assert!(c.streams.allows("truck-1", "status"));
        assert!(!c.streams.allows("truck-1", "telemetry"));
        assert!(c.streams.allows("truck-2", "telemetry"));
        assert!(!c.streams.allows("truck-2", "other"));
        assert_eq!(c.http.reader_tokens.len(), 1);
    }

    fn problem_key(text: &str) -> String {
        match HubConfig::from_toml(text) {
            Err(ConfigError::Key { key, .. }) => key,
            other => panic!("expected a key error, got {other:?}"),
        }
    }

    #[test]
    fn bad_values_name_their_key() {
        assert_eq!(problem_key("[listen]\nquic = \"x\""), "data_dir");
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[listen]\nquic = \"nope\""),
            "listen.quic"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[wal]\nsegment_bytes_max = \"12 parsecs\""),
            "wal.segment_bytes_max"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[wal]\ngroup_commit_linger = \"soon\""),
            "wal.group_commit_linger"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[tier2]\nurl = \"ftp://x\""),
            "tier2.url"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[[streams]]\nname = \"../etc\""),
            "streams[0].name"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[tls]\nca = \"a\""),
            "tls.cert"
        );
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[http]\nreader_tokens = [\"short\"]"),
            "http.reader_tokens[0]"
        );
        let allow = "data_dir = \"/d\"\n[[streams]]\nname = \"a\"\n[devices.d1]\nstreams = [\"b\"]";
        assert_eq!(problem_key(allow), "devices.d1.streams");
        let mem = "data_dir = \"/d\"\n[ingest]\nmemory_bytes_max = \"1MiB\"";
        assert_eq!(problem_key(mem), "ingest.memory_bytes_max");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = HubConfig::from_toml("data_dir = \"/d\"\n[wal]\nsegment_size = 3");
        assert!(
            matches!(err, Err(ConfigError::Key { ref key, .. }) if key == "wal.segment_size"),
            "{err:?}"
        );
    }

    #[test]
    fn env_overrides_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hub.toml");
        std::fs::write(
            &path,
            "data_dir = \"/d\"\n[listen]\nquic = \"0.0.0.0:7400\"\n",
        )
        .unwrap();
        let mut env = config::Map::new();
        env.insert(
            "TRIBUTARY_HUB__LISTEN__QUIC".to_string(),
            "127.0.0.1:7999".to_string(),
        );
        env.insert(
            "TRIBUTARY_HUB__DATA_DIR".to_string(),
            "/elsewhere".to_string(),
        );
        env.insert(
            "TRIBUTARY_HUB__INGEST__RECORDS_PER_BLOCK_MAX".to_string(),
            "77".to_string(),
        );
        env.insert(
            "TRIBUTARY_HUB__WAL__GROUP_COMMIT_LINGER".to_string(),
            "3ms".to_string(),
        );
        let c = HubConfig::load_with_env(Some(&path), Some(env)).unwrap();
        assert_eq!(c.listen.quic, "127.0.0.1:7999".parse().unwrap());
        assert_eq!(c.data_dir, PathBuf::from("/elsewhere"));
        assert_eq!(c.ingest.records_per_block_max, 77);
        assert_eq!(c.wal.group_commit_linger, Duration::from_millis(3));
    }

    #[test]
    fn env_bad_value_names_key() {
        let mut env = config::Map::new();
        env.insert("TRIBUTARY_HUB__DATA_DIR".to_string(), "/d".to_string());
        env.insert(
            "TRIBUTARY_HUB__LISTEN__HTTP".to_string(),
            "nowhere".to_string(),
        );
        let err = HubConfig::load_with_env(None, Some(env)).unwrap_err();
        assert!(
            matches!(err, ConfigError::Env { ref key, ref var, .. }
                if key == "listen.http" && var == "TRIBUTARY_HUB__LISTEN__HTTP"),
            "{err}"
        );
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("16 MiB").unwrap(), 16 << 20);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("1 parsec").is_err());
        assert!(parse_bytes("99999999999999999TiB").is_err());
    }

    #[test]
    fn names() {
        assert!(valid_stream_name("telemetry.v2_x-1"));
        for bad in ["", ".", "..", "a/b", "../x", "a b", "é", &"x".repeat(65)] {
            assert!(!valid_stream_name(bad), "{bad:?}");
        }
        assert!(valid_device_id(&"d".repeat(128)));
        assert!(!valid_device_id(&"d".repeat(129)));
    }

    #[test]
    fn stream_scale_policies() {
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[[streams]]\nname = \"t\"\nscale = { target_records_per_s = 1000, target_bytes_per_s = \"1MiB\", window = \"200ms\" }\n[[streams]]\nname = \"u\"\n",
        )
        .unwrap();
        let p = c.streams.scale["t"];
        assert_eq!(p.target_records_per_s, Some(1000));
        assert_eq!(p.target_bytes_per_s, Some(1 << 20));
        assert_eq!(p.window, Duration::from_millis(200));
        assert_eq!((p.min_segments, p.max_segments), (1, DEFAULT_MAX_SEGMENTS));
        assert!(!c.streams.scale.contains_key("u"));
        assert!(c.streams.keys_prefixed_by_device.is_empty());
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[[streams]]\nname = \"t\"\nkeys_prefixed_by_device = true\n[[streams]]\nname = \"u\"\nkeys_prefixed_by_device = false\n",
        )
        .unwrap();
        assert_eq!(
            c.streams.keys_prefixed_by_device.iter().collect::<Vec<_>>(),
            vec!["t"]
        );
        let base = "data_dir = \"/d\"\n[[streams]]\nname = \"t\"\n";
        assert_eq!(
            problem_key(&format!("{base}scale = {{ window = \"1s\" }}")),
            "streams[0].scale"
        );
        assert_eq!(
            problem_key(&format!(
                "{base}scale = {{ target_records_per_s = 5, window = \"soon\" }}"
            )),
            "streams[0].scale.window"
        );
        assert_eq!(
            problem_key(&format!(
                "{base}scale = {{ target_records_per_s = 5, min_segments = 5, max_segments = 2 }}"
            )),
            "streams[0].scale.max_segments"
        );
    }

    #[test]
    fn stream_type_hints() {
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[[streams]]\nname = \"t\"\n[streams.types]\ntemp = \"float\"\nengine_Temp = \"float\"\n[[streams]]\nname = \"u\"\n",
        )
        .unwrap();
        let want: BTreeMap<String, tier::ValueKind> = [
            ("engine_Temp".to_owned(), tier::ValueKind::F64),
            ("temp".to_owned(), tier::ValueKind::F64),
        ]
        .into();
        assert_eq!(c.streams.field_types["t"], want);
        assert_eq!(c.tier2.field_types["t"], want);
        assert!(!c.tier2.field_types.contains_key("u"));
        let base = "data_dir = \"/d\"\n[[streams]]\nname = \"t\"\n";
        assert_eq!(
            problem_key(&format!("{base}types = {{ temp = \"int\" }}")),
            "streams[0].types.temp"
        );
    }

    #[test]
    fn debug_output_never_shows_secrets() {
        let secret = "s3-secret-WJALRXUTNFEMI";
        let token = "reader-token-0123456789abcdef";
        let text = format!(
            r#"
            data_dir = "/d"
            [tier2]
            url = "s3://bucket"
            access_key_id = "AKIAEXAMPLE"
            secret_access_key = "{secret}"
            [http]
            reader_tokens = ["{token}"]
            "#
        );
        let raw: RawConfig = toml_raw(&text);
        let typed = HubConfig::from_toml(&text).unwrap();
        assert_eq!(typed.tier2.secret_access_key.as_deref(), Some(secret));
        for shown in [
            format!("{typed:?}"),
            format!("{typed:#?}"),
            format!("{raw:?}"),
            format!("{:?}", typed.tier2),
            format!("{:?}", typed.http),
        ] {
            assert!(!shown.contains(secret), "the S3 secret in {shown}");
            assert!(!shown.contains(token), "a reader token in {shown}");
            assert!(
                shown.contains(REDACTED),
                "nothing marked redacted in {shown}"
            );
        }
        // What is not secret still shows, so the output stays useful.
        let shown = format!("{typed:?}");
        assert!(
            shown.contains("AKIAEXAMPLE") && shown.contains("s3://bucket"),
            "{shown}"
        );
    }

    fn toml_raw(text: &str) -> RawConfig {
        config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()
            .unwrap()
            .try_deserialize()
            .unwrap()
    }

    #[test]
    fn the_revocation_list_defaults_beside_the_ca() {
        let tls = "[tls]\nca = \"/p/ca.pem\"\ncert = \"/p/hub.pem\"\nkey = \"/p/hub.key\"\n";
        let c = HubConfig::from_toml(&format!("data_dir = \"/d\"\n{tls}")).unwrap();
        assert_eq!(c.tls.unwrap().revoked, PathBuf::from("/p/revoked.txt"));
        let explicit = format!("data_dir = \"/d\"\n{tls}revoked = \"/etc/trb/revoked.txt\"\n");
        let c = HubConfig::from_toml(&explicit).unwrap();
        assert_eq!(
            c.tls.unwrap().revoked,
            PathBuf::from("/etc/trb/revoked.txt")
        );
        let empty = format!("data_dir = \"/d\"\n{tls}revoked = \"\"\n");
        assert_eq!(problem_key(&empty), "tls.revoked");
    }

    #[test]
    fn state_quotas_and_the_metrics_bound_are_typed_and_checked() {
        let d = HubConfig::from_toml("data_dir = \"/d\"").unwrap();
        assert_eq!(d.ingest.state, StateQuotas::default());
        assert_eq!(d.ingest.state.streams_per_device_max, 256);
        assert_eq!(d.metrics.device_series_max, 1000);
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[ingest]\nstreams_per_device_max = 3\nepochs_per_device_max = 4\n\
             lanes_per_device_max = 5\ncolumns_per_stream_max = 6\n[metrics]\ndevice_series_max = 7",
        )
        .unwrap();
        let q = c.ingest.state;
        assert_eq!((q.streams_per_device_max, q.epochs_per_device_max), (3, 4));
        assert_eq!((q.lanes_per_device_max, q.columns_per_stream_max), (5, 6));
        assert_eq!(c.metrics.device_series_max, 7);
        for key in [
            "streams_per_device_max",
            "epochs_per_device_max",
            "lanes_per_device_max",
            "columns_per_stream_max",
        ] {
            let text = format!("data_dir = \"/d\"\n[ingest]\n{key} = 0");
            assert_eq!(problem_key(&text), format!("ingest.{key}"));
        }
        assert_eq!(
            problem_key("data_dir = \"/d\"\n[metrics]\ndevice_series_max = 0"),
            "metrics.device_series_max"
        );
        assert!(HubConfig::from_toml("data_dir = \"/d\"\n[metrics]\nseries = 1").is_err());
    }

    #[test]
    fn connection_bounds_parse_and_name_their_key() {
        let c = HubConfig::from_toml(
            "data_dir = \"/d\"\n[ingest]\nconnections_per_device_max = 2\nhello_timeout = \"5s\"\n\
             control_idle_timeout = \"45s\"\nblocks_in_flight_max = 8\nretry_above_handshakes = 0",
        )
        .unwrap();
        let want = ConnectionQuotas {
            connections_per_device_max: 2,
            hello_timeout: Duration::from_secs(5),
            control_idle_timeout: Duration::from_secs(45),
            blocks_in_flight_max: 8,
            retry_above_handshakes: 0,
            stream_refusal_retry: Duration::from_secs(30),
        };
        assert_eq!(c.ingest.conn, want);
        let d = HubConfig::from_toml("data_dir = \"/d\"")
            .unwrap()
            .ingest
            .conn;
        assert_eq!(d, ConnectionQuotas::default());
        assert_eq!(d.connections_per_device_max, 1);
        let bad = |line: &str| problem_key(&format!("data_dir = \"/d\"\n[ingest]\n{line}"));
        let cases = [
            (
                "connections_per_device_max = 0",
                "ingest.connections_per_device_max",
            ),
            ("hello_timeout = \"10\"", "ingest.hello_timeout"),
            ("hello_timeout = \"1ms\"", "ingest.hello_timeout"),
            (
                "control_idle_timeout = \"5s\"",
                "ingest.control_idle_timeout",
            ),
            ("blocks_in_flight_max = 0", "ingest.blocks_in_flight_max"),
            (
                "stream_refusal_retry = \"30\"",
                "ingest.stream_refusal_retry",
            ),
            (
                "stream_refusal_retry = \"2h\"",
                "ingest.stream_refusal_retry",
            ),
            ("blocks_in_flight_max = 5000", "ingest.blocks_in_flight_max"),
        ];
        for (line, key) in cases {
            assert_eq!(bad(line), key, "{line}");
        }
    }
}
