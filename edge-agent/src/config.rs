//! The agent's configuration: `edge.toml` plus `TRIBUTARY_EDGE__*` environment overrides.
//!
//! The file is read once with the `config` crate into raw serde structs, then turned into typed
//! values ([`EdgeConfig`]): socket addresses, durations, byte sizes and enums. Every problem is
//! reported through one [`ConfigError`] that names the key at fault, so an operator can fix the
//! file without reading code. Nothing else in the agent looks at strings from the file.
//!
//! Relative paths (`data_dir`, `tls.*`) are resolved against the directory holding the config
//! file, so the agent behaves the same whatever its working directory is.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use crate::filters::{Agg, DownsampleMode, StageSpec};
use crate::log::{FsyncPolicy, LogConfig, OnFull};

mod modbus;
pub use modbus::{
    ModbusChannel, ModbusFunction, ModbusSourceConfig, ModbusTransport, ModbusType, Order, Parity,
    SerialLine,
};
mod opcua;
pub use opcua::{Deadband, OpcuaItem, OpcuaSourceConfig, SecurityMode};

/// The environment variable prefix: `TRIBUTARY_EDGE__HUB__ADDR` overrides `[hub] addr`.
pub const ENV_PREFIX: &str = "TRIBUTARY_EDGE";
/// Separates the prefix and the key path segments in environment variable names.
pub const ENV_SEPARATOR: &str = "__";
/// Where the HTTP API listens unless configured.
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:7401";
/// The largest ingest request body unless configured.
pub const DEFAULT_BODY_BYTES_MAX: usize = 16 << 20;
/// The fsync policy unless configured.
pub const DEFAULT_FSYNC: &str = "interval:10ms";
/// The disk budget unless configured.
pub const DEFAULT_DISK_BYTES_MAX: u64 = 2 << 30;
/// The largest segment roll size derived from the budget (the size unless configured).
pub const DEFAULT_SEGMENT_BYTES_MAX: u64 = 64 << 20;
/// Sealed segments the disk budget must hold beyond one active segment per stream: the log can
/// drop only sealed, durable segments, so with fewer the budget could not be kept.
pub const BUDGET_SPARE_SEGMENTS: u64 = 2;
/// The smallest `storage.segment_bytes_max` (the log refuses smaller).
pub const SEGMENT_BYTES_MIN: u64 = 1024;

/// A configuration problem, naming the key at fault.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read or is not valid TOML. `path` is empty for in-memory text.
    #[error("{}: {message}", shown_path(path))]
    Read { path: PathBuf, message: String },
    /// A key holds a value the agent cannot use.
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

/// A path for messages; in-memory text has none.
fn shown_path(path: &Path) -> String {
    if path.as_os_str().is_empty() {
        "config".to_owned()
    } else {
        path.display().to_string()
    }
}

impl ConfigError {
    fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The dotted key at fault, when the problem is with one key.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Read { .. } => None,
        }
    }
}

/// The whole, validated agent configuration.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// Holds the segments, the catalog and the `LOCK` file.
    pub data_dir: PathBuf,
    /// The hub to replicate to; `None` until replication is configured.
    pub hub: Option<HubConfig>,
    /// The device identity and the fleet CA; required with `[hub]`.
    pub tls: Option<TlsConfig>,
    pub http: HttpConfig,
    pub storage: StorageConfig,
    pub ingest: IngestConfig,
    /// The local streams, in the order they were declared.
    pub streams: Vec<StreamConfig>,
    pub sources: Vec<SourceConfig>,
    /// `log.format`: how the agent's own diagnostics are written (`crate::logging`), not the
    /// record log.
    pub log_format: crate::logging::LogFormat,
}

/// How long an agent waits before reconnecting to a hub whose storage was full.
pub const DEFAULT_STORAGE_FULL_RETRY: Duration = Duration::from_secs(5);

/// How long the link may be down before `/readyz` answers 503.
pub const DEFAULT_LINK_DOWN_UNREADY_AFTER: Duration = Duration::from_secs(300);

/// `[hub]`: where the hub listens for devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubConfig {
    /// `host:port`; the host is resolved when connecting, so it may be a DNS name.
    pub addr: String,
    /// The name the hub's certificate must carry; defaults to the host part of `addr`.
    pub server_name: String,
    /// `backoff_max`: the longest wait between reconnect attempts; default 30 s.
    pub backoff_max: Duration,
    /// `storage_full_retry`: the wait before reconnecting after the hub said its storage is
    /// full (a condition that clears without the agent); default 5 s, jittered.
    pub storage_full_retry: Duration,
    /// `bandwidth_bytes_per_s`: a cap on block bytes sent per second; default none.
    pub bandwidth_bytes_per_s: Option<u64>,
    /// `link_down_unready_after`: how long the link may be down (not up, counted from when it
    /// was last up, or from start) before `/readyz` answers 503; default 5 min.
    pub link_down_unready_after: Duration,
}

/// `[tls]`: PEM files written by `core-hub pki issue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// `[http]`: the local ingest API, `/healthz`, `/metrics` and `/v1/status`. Its `Debug` shows
/// the token as `<redacted>`: configs end up in logs.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// Larger request bodies get 413.
    pub body_bytes_max: usize,
    /// When set, ingest requests must carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Timeouts, caps and allowed hosts (`http.header_timeout` ... `http.allowed_hosts`); its
    /// `body_bytes_max` is the one above.
    pub limits: crate::http::limits::HttpLimits,
    /// `http.influx_streams`: Influx `db` (v1) or `bucket` (v2) names mapped to the streams
    /// they write to; a name not listed is itself the stream.
    pub influx_streams: std::collections::BTreeMap<String, String>,
}

/// What a `Debug` of a configuration shows instead of a secret.
pub const REDACTED: &str = "<redacted>";

impl std::fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConfig")
            .field("listen", &self.listen)
            .field("body_bytes_max", &self.body_bytes_max)
            .field("token", &self.token.as_ref().map(|_| REDACTED))
            .field("limits", &self.limits)
            .field("influx_streams", &self.influx_streams)
            .finish()
    }
}

impl std::fmt::Debug for RawHttp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawHttp")
            .field("listen", &self.listen)
            .field("body_bytes_max", &self.body_bytes_max)
            .field("token", &self.token.as_ref().map(|_| REDACTED))
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("connections_max", &self.connections_max)
            .field("requests_max", &self.requests_max)
            .field("allowed_hosts", &self.allowed_hosts)
            .finish()
    }
}

/// Default `http.connections_max` of the agent.
pub const DEFAULT_HTTP_CONNECTIONS_MAX: usize = 128;
/// Default `http.requests_max` of the agent.
pub const DEFAULT_HTTP_REQUESTS_MAX: usize = 32;

/// `[storage]`: the local log's durability, sealing and disk budget.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    pub fsync: FsyncPolicy,
    pub disk_bytes_max: u64,
    pub on_full: OnFull,
    pub segment_bytes_max: u64,
    pub block_records_max: usize,
    pub block_bytes_max: usize,
    pub block_linger: Duration,
    pub block_version: u8,
    pub queue_batches_max: usize,
}

/// `[ingest]`: rules every record meets before it is stored, whatever its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngestConfig {
    /// `fields_per_record_max`: the most fields a record may carry from a producer (HTTP
    /// NDJSON and line protocol, MQTT payloads) and after the stream's filters; default 1,000,
    /// at most the columnar format's column limit less the agent's own fields.
    pub fields_per_record_max: usize,
}

/// `[[streams]]`: one local stream.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamConfig {
    pub name: String,
    /// Higher ships first when streams compete for the link; order within a stream always wins.
    pub priority: u8,
    /// `filters`: the stages every record goes through before sequencing (see `crate::filters`).
    pub filters: Vec<StageSpec>,
    /// `source_stream`: set for a derived stream, which is fed by its filter runner from this
    /// stream's stored records and takes no records from sources or the HTTP API.
    pub source_stream: Option<String>,
    /// `replicate`: false keeps the stream on the device (default true).
    pub replicate: bool,
    /// `retention`: for a local stream (`replicate = false`) that feeds derived streams, how long
    /// records are kept after every derived stream has consumed them (default 1h). Replicated
    /// streams are freed by the hub's acknowledgements instead.
    pub retention: Duration,
    /// `idle_close_after`: how long after its end (and after its key's last record) the clock
    /// closes a quiet key's open `downsample` interval or `window` (default: the stage's
    /// interval; `"off"`: only a later record closes it). See `crate::filters::idle`.
    pub idle_close: crate::filters::IdleClose,
}

impl StreamConfig {
    /// True when the stream is fed by a filter runner from `source_stream`.
    pub fn is_derived(&self) -> bool {
        self.source_stream.is_some()
    }
}

/// How long a local source stream keeps consumed records unless `retention` is set.
pub const DEFAULT_LOCAL_RETENTION: Duration = Duration::from_secs(3600);

/// `[[sources]]`: where records come from besides the always-on HTTP API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceConfig {
    Mqtt(MqttSourceConfig),
    Sensor(SensorSourceConfig),
    Modbus(ModbusSourceConfig),
    Opcua(OpcuaSourceConfig),
}

/// A device sensor source from the `firmware` crate, polled by the agent. See `sources::sensors`.
#[derive(Debug, Clone, PartialEq)]
pub struct SensorSourceConfig {
    pub kind: SensorKind,
    pub stream: String,
    /// `interval`: how often the source is polled; default 10 s (1 s for the simulator).
    pub interval: Duration,
    /// `key_prefix`: the first part of every routing key; default the host name.
    pub key_prefix: String,
}

/// Which sensors, with their settings.
#[derive(Debug, Clone, PartialEq)]
pub enum SensorKind {
    /// `kind = "hwmon"`: `/sys/class/hwmon` and `/sys/class/thermal` under `sysfs_root`.
    Hwmon { sysfs_root: PathBuf },
    /// `kind = "iio"`: `/sys/bus/iio/devices` under `sysfs_root`, scale and offset applied.
    Iio { sysfs_root: PathBuf },
    /// `kind = "nmea"`: NMEA 0183 sentences from a serial device or file at `path`.
    Nmea { path: PathBuf },
    /// `kind = "simulator"`: the seeded fleet (`sim = "fleet"`) or industrial simulator.
    Simulator {
        industrial: bool,
        units: usize,
        hz: f64,
        seed: u64,
    },
}

impl Eq for SensorSourceConfig {}

/// A `kind = "mqtt"` source: subscriptions on a local broker. See `sources::mqtt` for how
/// messages become records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MqttSourceConfig {
    pub url: String,
    pub topics: Vec<String>,
    pub stream: String,
    pub format: PayloadFormat,
    /// `topic_template`: such as `sensors/{device}/{sensor}`; each capture becomes a tag
    /// (`device=dev7`, `sensor=temp`) and the key is `sync::record::key_from_tags` of the
    /// record's tags. `None`: the key is the whole topic (JSON) or the line's tags (line).
    pub topic_template: Option<String>,
    /// `value_field`: the field a scalar JSON payload (`72.5`, `true`, `"on"`) or a plain-text
    /// number is stored in; default `value`.
    pub value_field: String,
    /// `unmatched`: what happens to a message whose topic does not match `topic_template`.
    pub unmatched: MqttUnmatched,
    /// `ts_field`: the JSON field holding the event time; `None`: the receive time.
    pub ts_field: Option<String>,
    /// `ts_unit`: how a number in `ts_field` is written; default `ms`. A string there is
    /// always RFC 3339 with its zone.
    pub ts_unit: TsUnit,
    /// `ts_invalid = "receive_time"`: a missing or unreadable `ts_field` gets the receive time
    /// (counted); the default `"reject"` refuses the message as a bad payload.
    pub ts_invalid_receive_time: bool,
    /// `client_id`: the MQTT client id; default derived from the data directory (stable across
    /// restarts, which the persistent session needs).
    pub client_id: Option<String>,
    /// `qos`: 1 (default) or 2.
    pub qos: u8,
    /// `dedupe_window`: how many recent message digests are kept to recognise redeliveries;
    /// default 65536 (every MQTT packet id). Must be at least the broker's inflight window.
    pub dedupe_window: usize,
    /// For `mqtts://`: `tls_ca` (required), `tls_cert` and `tls_key` (both or neither).
    pub tls: Option<MqttTlsConfig>,
    /// `format = "sparkplug"`: the source is a Sparkplug B host application (see
    /// `sources::sparkplug`); `format` is then unused.
    pub sparkplug: Option<SparkplugConfig>,
}

/// `unmatched`: a message whose topic does not match `topic_template` is dropped (acked,
/// counted, logged) or stored keyed by its whole topic, with no tags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MqttUnmatched {
    #[default]
    Drop,
    Store,
}

impl MqttUnmatched {
    /// Parses `drop` or `store`, naming `key` on failure.
    pub fn parse(key: &str, s: &str) -> Result<Self, ConfigError> {
        match s {
            "drop" => Ok(MqttUnmatched::Drop),
            "store" => Ok(MqttUnmatched::Store),
            other => Err(ConfigError::invalid(
                key,
                format!("expected drop | store, found {other:?}"),
            )),
        }
    }
}

/// A Sparkplug B host application's settings (`format = "sparkplug"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparkplugConfig {
    /// `host_id`: the host application id, in `spBv1.0/STATE/{host_id}`.
    pub host_id: String,
    /// `groups`: the Sparkplug groups subscribed to; default every group (`["+"]`).
    pub groups: Vec<String>,
    /// `rebirth_interval`: shortest time between two rebirth requests to one node; default 10 s.
    pub rebirth_interval: Duration,
}

/// TLS to the broker (`mqtts://`): rustls with the ring provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MqttTlsConfig {
    /// PEM: the CA certificate(s) the broker's certificate must chain to.
    pub ca: PathBuf,
    /// PEM: a client certificate and its key, for brokers that require one.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// The unit of a JSON timestamp field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TsUnit {
    S,
    Ms,
    Us,
    Ns,
    /// A string such as `2026-11-29T17:00:00.123Z`.
    Rfc3339,
}

/// How a payload or request body encodes records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadFormat {
    /// One JSON object per line (NDJSON).
    Json,
    /// InfluxDB line protocol.
    Line,
}

impl PayloadFormat {
    /// Parses `json` or `line`, naming `key` on failure.
    pub fn parse(key: &str, s: &str) -> Result<Self, ConfigError> {
        match s {
            "json" => Ok(PayloadFormat::Json),
            "line" => Ok(PayloadFormat::Line),
            other => Err(ConfigError::invalid(
                key,
                format!("expected json | line, found {other:?}"),
            )),
        }
    }
}

impl EdgeConfig {
    /// Reads `path` and applies `TRIBUTARY_EDGE__*` overrides from the process environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with_env(path, None)
    }

    /// Like [`EdgeConfig::load`], with the environment given explicitly (`None`: the process's).
    /// Tests use this so they never mutate the process environment.
    pub fn load_with_env(
        path: &Path,
        env: Option<HashMap<String, String>>,
    ) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let base = path.parent().map(Path::to_owned).unwrap_or_default();
        Self::from_toml(&text, &base, env).map_err(|e| match e {
            ConfigError::Read { message, .. } => ConfigError::Read {
                path: path.to_owned(),
                message,
            },
            other => other,
        })
    }

    /// Parses TOML text; relative paths are resolved against `base`.
    pub fn from_toml(
        text: &str,
        base: &Path,
        env: Option<HashMap<String, String>>,
    ) -> Result<Self, ConfigError> {
        let from_env = EnvKeys::collect(env.as_ref());
        let environment = config::Environment::with_prefix(ENV_PREFIX)
            .prefix_separator(ENV_SEPARATOR)
            .separator(ENV_SEPARATOR)
            .try_parsing(true)
            .source(env.map(|m| m.into_iter().collect()));
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .add_source(environment)
            .build()
            .and_then(|c| c.try_deserialize())
            .map_err(|e| from_env.annotate(from_config_error(e)))?;
        raw.into_typed(base).map_err(|e| from_env.annotate(e))
    }

    /// The local log's configuration for this agent.
    pub fn log_config(&self) -> LogConfig {
        let s = &self.storage;
        LogConfig {
            data_dir: self.data_dir.clone(),
            streams: self.streams.iter().map(|s| s.name.clone()).collect(),
            fsync: s.fsync,
            segment_bytes_max: s.segment_bytes_max,
            block_records_max: s.block_records_max,
            block_bytes_max: s.block_bytes_max,
            block_linger: s.block_linger,
            block_version: s.block_version,
            disk_bytes_max: s.disk_bytes_max,
            on_full: s.on_full,
            queue_batches_max: s.queue_batches_max,
            fields_per_record_max: self.ingest.fields_per_record_max,
            ..LogConfig::default()
        }
    }

    /// Looks a stream up by name.
    pub fn stream(&self, name: &str) -> Option<&StreamConfig> {
        self.streams.iter().find(|s| s.name == name)
    }
}

/// The keys the environment set (dotted, lowercase, as the `config` crate reads them), each
/// with the variable that set it, so an error names the variable the operator has to fix.
struct EnvKeys(HashMap<String, String>);

impl EnvKeys {
    fn collect(env: Option<&HashMap<String, String>>) -> EnvKeys {
        let vars: Vec<String> = match env {
            Some(m) => m.keys().cloned().collect(),
            None => std::env::vars_os()
                .filter_map(|(k, _)| k.into_string().ok())
                .collect(),
        };
        let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}").to_lowercase();
        let keys = vars.into_iter().filter_map(|var| {
            let rest = var.to_lowercase().strip_prefix(&prefix)?.to_owned();
            Some((rest.replace(ENV_SEPARATOR, "."), var))
        });
        EnvKeys(keys.collect())
    }

    fn annotate(&self, e: ConfigError) -> ConfigError {
        match e {
            ConfigError::Invalid { key, message } => match self.0.get(&key) {
                Some(var) => ConfigError::Invalid {
                    message: format!("{message} (set by the environment variable {var})"),
                    key,
                },
                None => ConfigError::Invalid { key, message },
            },
            other => other,
        }
    }
}

/// Turns the `config` crate's error into ours, keeping the key when it names one.
fn from_config_error(e: config::ConfigError) -> ConfigError {
    match from_config_error_raw(e) {
        ConfigError::Invalid { key, message } => ConfigError::Invalid {
            key: dotted(&key),
            message,
        },
        other => other,
    }
}

use sync::config_key::dotted;

fn from_config_error_raw(e: config::ConfigError) -> ConfigError {
    match e {
        config::ConfigError::Type {
            key: Some(key),
            unexpected,
            expected,
            ..
        } => ConfigError::invalid(key, format!("expected {expected}, found {unexpected}")),
        config::ConfigError::At {
            error,
            key: Some(key),
            ..
        } => match *error {
            config::ConfigError::Message(m) => match unknown_field(&m) {
                Some((field, tail)) => ConfigError::invalid(format!("{key}.{field}"), tail),
                None => ConfigError::invalid(key, m),
            },
            other => ConfigError::invalid(key, other.to_string()),
        },
        config::ConfigError::Message(m) => match unknown_field(&m) {
            Some((field, tail)) => ConfigError::invalid(field, tail),
            None => ConfigError::Read {
                path: PathBuf::new(),
                message: m,
            },
        },
        other => ConfigError::Read {
            path: PathBuf::new(),
            message: other.to_string(),
        },
    }
}

/// serde reports an unknown key as "unknown field `x`, expected ..."; returns the key and
/// a message that starts with "unknown key".
fn unknown_field(message: &str) -> Option<(String, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (field, tail) = rest.split_once('`')?;
    Some((field.to_owned(), format!("unknown key{tail}")))
}

// ---------------------------------------------------------------------------------------------
// Raw serde structs: exactly what the file may contain, as loosely typed as the file is.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    data_dir: Option<String>,
    hub: Option<RawHub>,
    tls: Option<RawTls>,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    storage: RawStorage,
    #[serde(default)]
    ingest: RawIngest,
    #[serde(default)]
    streams: Vec<RawStream>,
    #[serde(default)]
    sources: Vec<RawSource>,
    #[serde(default)]
    log: crate::logging::RawLog,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHub {
    addr: Option<String>,
    server_name: Option<String>,
    backoff_max: Option<String>,
    storage_full_retry: Option<String>,
    bandwidth_bytes_per_s: Option<String>,
    link_down_unready_after: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttp {
    listen: Option<String>,
    body_bytes_max: Option<String>,
    token: Option<String>,
    header_timeout: Option<String>,
    body_timeout: Option<String>,
    idle_timeout: Option<String>,
    connections_max: Option<String>,
    requests_max: Option<String>,
    allowed_hosts: Option<Vec<String>>,
    influx_streams: Option<std::collections::BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStorage {
    fsync: Option<String>,
    disk_bytes_max: Option<String>,
    on_full: Option<String>,
    segment_bytes_max: Option<String>,
    block_records_max: Option<String>,
    block_bytes_max: Option<String>,
    block_linger: Option<String>,
    block_version: Option<String>,
    queue_batches_max: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIngest {
    fields_per_record_max: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStream {
    name: Option<String>,
    priority: Option<String>,
    filters: Option<Vec<RawStage>>,
    source_stream: Option<String>,
    replicate: Option<String>,
    retention: Option<String>,
    idle_close_after: Option<String>,
}

/// One `filters` entry: `{ kind = "where", expr = "temp > 3" }` and so on (see `docs/filters.md`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    kind: Option<String>,
    expr: Option<String>,
    field: Option<String>,
    threshold: Option<String>,
    interval: Option<String>,
    mode: Option<String>,
    aggs: Option<Vec<String>>,
    fields: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    kind: Option<String>,
    url: Option<String>,
    topics: Option<Vec<String>>,
    stream: Option<String>,
    format: Option<String>,
    topic_template: Option<String>,
    value_field: Option<String>,
    unmatched: Option<String>,
    ts_field: Option<String>,
    ts_unit: Option<String>,
    ts_invalid: Option<String>,
    client_id: Option<String>,
    qos: Option<String>,
    dedupe_window: Option<String>,
    tls_ca: Option<String>,
    tls_cert: Option<String>,
    tls_key: Option<String>,
    host_id: Option<String>,
    groups: Option<Vec<String>>,
    rebirth_interval: Option<String>,
    interval: Option<String>,
    key_prefix: Option<String>,
    sysfs_root: Option<String>,
    path: Option<String>,
    sim: Option<String>,
    units: Option<String>,
    hz: Option<String>,
    seed: Option<String>,
    address: Option<String>,
    transport: Option<String>,
    serial: Option<modbus::RawSerial>,
    unit_id: Option<String>,
    poll_interval: Option<String>,
    timeout: Option<String>,
    key: Option<String>,
    channels: Option<Vec<modbus::RawChannel>>,
    endpoint: Option<String>,
    security_policy: Option<String>,
    security_mode: Option<String>,
    user: Option<String>,
    password: Option<String>,
    pki_dir: Option<String>,
    trust_unknown: Option<String>,
    publishing_interval: Option<String>,
    queue_max: Option<String>,
    items: Option<Vec<opcua::RawItem>>,
}

impl RawConfig {
    fn into_typed(self, base: &Path) -> Result<EdgeConfig, ConfigError> {
        let data_dir = required("data_dir", self.data_dir)?;
        let data_dir = resolve_path("data_dir", &data_dir, base)?;
        let hub = self.hub.map(RawHub::into_typed).transpose()?;
        let tls = self.tls.map(|t| t.into_typed(base)).transpose()?;
        if hub.is_some() && tls.is_none() {
            return Err(ConfigError::invalid(
                "tls",
                "required when [hub] is set: add ca, cert and key (written by `core-hub pki issue`)",
            ));
        }
        let streams = streams_typed(self.streams)?;
        let sources = self
            .sources
            .into_iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.into_typed(i, &streams, base, &data_dir)
                    .map(|o| o.map(|s| (i, s)))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let modbus: Vec<_> = sources
            .iter()
            .filter_map(|(i, s)| match s {
                SourceConfig::Modbus(m) => Some((*i, m)),
                _ => None,
            })
            .collect();
        modbus::check_buses(&modbus)?;
        let sources = sources.into_iter().map(|(_, s)| s).collect();
        Ok(EdgeConfig {
            data_dir,
            hub,
            tls,
            http: self.http.into_typed()?,
            storage: self.storage.into_typed(streams.len())?,
            ingest: self.ingest.into_typed()?,
            streams,
            sources,
            log_format: self
                .log
                .parse()
                .map_err(|m| ConfigError::invalid("log.format", m))?,
        })
    }
}

impl RawHub {
    fn into_typed(self) -> Result<HubConfig, ConfigError> {
        let addr = required("hub.addr", self.addr)?;
        let host = host_of("hub.addr", &addr)?;
        let server_name = match self.server_name {
            Some(name) if name.trim().is_empty() => {
                return Err(ConfigError::invalid("hub.server_name", "must not be empty"));
            }
            Some(name) => name,
            None => host.to_owned(),
        };
        let backoff_max = match self.backoff_max {
            Some(s) => parse_duration("hub.backoff_max", &s)?,
            None => Duration::from_secs(30),
        };
        if backoff_max.is_zero() {
            return Err(ConfigError::invalid(
                "hub.backoff_max",
                "must be above zero, such as 30s",
            ));
        }
        let storage_full_retry = match self.storage_full_retry {
            Some(s) => parse_duration("hub.storage_full_retry", &s)?,
            None => DEFAULT_STORAGE_FULL_RETRY,
        };
        if storage_full_retry.is_zero() {
            return Err(ConfigError::invalid(
                "hub.storage_full_retry",
                "must be above zero, such as 5s",
            ));
        }
        let bandwidth_bytes_per_s = match self.bandwidth_bytes_per_s {
            Some(s) => match parse_bytes("hub.bandwidth_bytes_per_s", &s)? {
                0 => {
                    return Err(ConfigError::invalid(
                        "hub.bandwidth_bytes_per_s",
                        "must be above zero; leave it out for no cap",
                    ));
                }
                n => Some(n),
            },
            None => None,
        };
        let link_down_unready_after = match self.link_down_unready_after {
            Some(s) => parse_duration("hub.link_down_unready_after", &s)?,
            None => DEFAULT_LINK_DOWN_UNREADY_AFTER,
        };
        if link_down_unready_after.is_zero() {
            return Err(ConfigError::invalid(
                "hub.link_down_unready_after",
                "must be above zero, such as 5m",
            ));
        }
        Ok(HubConfig {
            addr,
            server_name,
            backoff_max,
            storage_full_retry,
            bandwidth_bytes_per_s,
            link_down_unready_after,
        })
    }
}

impl RawTls {
    fn into_typed(self, base: &Path) -> Result<TlsConfig, ConfigError> {
        let path = |key: &str, v: Option<String>| -> Result<PathBuf, ConfigError> {
            resolve_path(key, &required(key, v)?, base)
        };
        Ok(TlsConfig {
            ca: path("tls.ca", self.ca)?,
            cert: path("tls.cert", self.cert)?,
            key: path("tls.key", self.key)?,
        })
    }
}

impl RawHttp {
    fn into_typed(self) -> Result<HttpConfig, ConfigError> {
        let listen = self.listen.as_deref().unwrap_or(DEFAULT_HTTP_LISTEN);
        let listen: SocketAddr = listen.parse().map_err(|_| {
            ConfigError::invalid(
                "http.listen",
                format!("expected an address like 127.0.0.1:7401, found {listen:?}"),
            )
        })?;
        let body_bytes_max = match &self.body_bytes_max {
            Some(s) => positive_usize(
                "http.body_bytes_max",
                parse_bytes("http.body_bytes_max", s)?,
            )?,
            None => DEFAULT_BODY_BYTES_MAX,
        };
        let limits = self.limits(body_bytes_max)?;
        // An empty token (for example an empty environment override) means "no token".
        let token = self.token.filter(|t| !t.is_empty());
        let influx_streams = self.influx_streams.unwrap_or_default();
        if let Some((name, stream)) = influx_streams.iter().find(|(_, s)| s.is_empty()) {
            let why = format!("{name:?} maps to an empty stream name ({stream:?})");
            return Err(ConfigError::invalid("http.influx_streams", why));
        }
        Ok(HttpConfig {
            listen,
            body_bytes_max,
            token,
            limits,
            influx_streams,
        })
    }

    fn limits(
        &self,
        body_bytes_max: usize,
    ) -> Result<crate::http::limits::HttpLimits, ConfigError> {
        use crate::http::limits::HttpLimits;
        let d = HttpLimits::new(0, 0, body_bytes_max);
        let duration = |key: &str, v: &Option<String>, default| match v {
            Some(s) => match parse_duration(key, s)? {
                d if d.is_zero() => Err(ConfigError::invalid(key, "must be above 0")),
                d => Ok(d),
            },
            None => Ok(default),
        };
        Ok(HttpLimits {
            header_timeout: duration(
                "http.header_timeout",
                &self.header_timeout,
                d.header_timeout,
            )?,
            body_timeout: duration("http.body_timeout", &self.body_timeout, d.body_timeout)?,
            idle_timeout: duration("http.idle_timeout", &self.idle_timeout, d.idle_timeout)?,
            connections_max: count_or(
                "http.connections_max",
                self.connections_max.clone(),
                DEFAULT_HTTP_CONNECTIONS_MAX,
            )?,
            requests_max: count_or(
                "http.requests_max",
                self.requests_max.clone(),
                DEFAULT_HTTP_REQUESTS_MAX,
            )?,
            body_bytes_max,
            allowed_hosts: self.allowed_hosts.clone().unwrap_or_default(),
        })
    }
}

impl RawIngest {
    fn into_typed(self) -> Result<IngestConfig, ConfigError> {
        let key = "ingest.fields_per_record_max";
        let max = crate::log::FIELDS_PER_RECORD_LIMIT;
        let n = count_or(
            key,
            self.fields_per_record_max,
            crate::log::FIELDS_PER_RECORD_DEFAULT,
        )?;
        if n > max {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{n} is more than the block format allows ({max}: its {} columns per block less the agent's own fields)",
                    sync::columnar::COLUMNS_MAX
                ),
            ));
        }
        Ok(IngestConfig {
            fields_per_record_max: n,
        })
    }
}

impl RawStorage {
    /// `streams`: how many streams the log holds (each has an active segment of its own).
    fn into_typed(self, streams: usize) -> Result<StorageConfig, ConfigError> {
        let disk_bytes_max = bytes_or(
            "storage.disk_bytes_max",
            self.disk_bytes_max,
            DEFAULT_DISK_BYTES_MAX,
        )?;
        let d = LogConfig::default();
        let fsync = parse_fsync(
            "storage.fsync",
            self.fsync.as_deref().unwrap_or(DEFAULT_FSYNC),
        )?;
        let on_full = match self.on_full.as_deref() {
            None | Some("drop-oldest") => OnFull::DropOldest,
            Some("block") => OnFull::Block,
            Some(other) => {
                return Err(ConfigError::invalid(
                    "storage.on_full",
                    format!("expected drop-oldest | block, found {other:?}"),
                ));
            }
        };
        Ok(StorageConfig {
            fsync,
            disk_bytes_max,
            on_full,
            segment_bytes_max: segment_bytes(self.segment_bytes_max, disk_bytes_max, streams)?,
            block_records_max: count_or(
                "storage.block_records_max",
                self.block_records_max,
                d.block_records_max,
            )?,
            block_bytes_max: positive_usize(
                "storage.block_bytes_max",
                bytes_or(
                    "storage.block_bytes_max",
                    self.block_bytes_max,
                    d.block_bytes_max as u64,
                )?,
            )?,
            block_linger: match self.block_linger {
                Some(s) => parse_duration("storage.block_linger", &s)?,
                None => d.block_linger,
            },
            block_version: block_version(self.block_version, d.block_version)?,
            queue_batches_max: count_or(
                "storage.queue_batches_max",
                self.queue_batches_max,
                d.queue_batches_max,
            )?,
        })
    }
}

impl RawSource {
    /// `Ok(None)` for `kind = "http"`, which is always on and needs no settings.
    fn into_typed(
        self,
        index: usize,
        streams: &[StreamConfig],
        base: &Path,
        data_dir: &Path,
    ) -> Result<Option<SourceConfig>, ConfigError> {
        let key = |k: &str| format!("sources[{index}].{k}");
        let kind = required(&key("kind"), self.kind.clone())?;
        match kind.as_str() {
            "http" => Ok(None),
            "mqtt" => {
                let sparkplug = self.sparkplug_typed(index)?;
                let url = required(&key("url"), self.url)?;
                if !(url.starts_with("mqtt://") || url.starts_with("mqtts://")) {
                    return Err(ConfigError::invalid(
                        key("url"),
                        format!("expected mqtt://host:port or mqtts://host:port, found {url:?}"),
                    ));
                }
                let topics = match &sparkplug {
                    Some(_) if self.topics.is_some() => {
                        return Err(ConfigError::invalid(
                            key("topics"),
                            "not with format = \"sparkplug\": the subscriptions follow from groups",
                        ));
                    }
                    Some(spb) => crate::sources::sparkplug_topics(&spb.groups),
                    None => self.topics.unwrap_or_default(),
                };
                if topics.is_empty() || topics.iter().any(|t| t.is_empty()) {
                    return Err(ConfigError::invalid(
                        key("topics"),
                        "expected a non-empty list of topic filters, such as [\"sensors/#\"]",
                    ));
                }
                let stream = required(&key("stream"), self.stream)?;
                source_stream_ok(&key("stream"), &stream, streams)?;
                if streams
                    .iter()
                    .any(|s| s.name == stream && !s.filters.is_empty())
                {
                    return Err(ConfigError::invalid(
                        key("stream"),
                        format!(
                            "stream {stream:?} has filters, which would drop the message digests \
                             MQTT duplicate detection keeps in each record: point the source at an \
                             unfiltered stream and add a derived stream (source_stream = \
                             {stream:?}) with the filters"
                        ),
                    ));
                }
                let format = match self.format.as_deref().unwrap_or("json") {
                    "sparkplug" => PayloadFormat::Json,
                    f => PayloadFormat::parse(&key("format"), f).map_err(|_| {
                        ConfigError::invalid(
                            key("format"),
                            format!("expected json | line | sparkplug, found {f:?}"),
                        )
                    })?,
                };
                if sparkplug.is_some() && (self.topic_template.is_some() || self.ts_field.is_some())
                {
                    return Err(ConfigError::invalid(
                        key("format"),
                        "sparkplug takes no topic_template or ts_field: the topic and payload say both",
                    ));
                }
                if let Some(t) = &self.topic_template {
                    check_topic_template(&key("topic_template"), t)?;
                }
                let value_field = self.value_field.unwrap_or_else(|| "value".into());
                check_value_field(&key("value_field"), &value_field, self.ts_field.as_deref())?;
                if self.unmatched.is_some() && self.topic_template.is_none() {
                    return Err(ConfigError::invalid(
                        key("unmatched"),
                        "only with topic_template: without one every topic matches",
                    ));
                }
                let unmatched = match self.unmatched.as_deref() {
                    None => MqttUnmatched::Drop,
                    Some(u) => MqttUnmatched::parse(&key("unmatched"), u)?,
                };
                let ts_unit = match self.ts_unit.as_deref().unwrap_or("ms") {
                    "s" => TsUnit::S,
                    "ms" => TsUnit::Ms,
                    "us" => TsUnit::Us,
                    "ns" => TsUnit::Ns,
                    "rfc3339" => TsUnit::Rfc3339,
                    other => {
                        return Err(ConfigError::invalid(
                            key("ts_unit"),
                            format!("expected s | ms | us | ns | rfc3339, found {other:?}"),
                        ));
                    }
                };
                let qos = match self.qos.as_deref().map(str::trim) {
                    None | Some("1") => 1,
                    Some("2") => 2,
                    Some(other) => {
                        return Err(ConfigError::invalid(
                            key("qos"),
                            format!("expected 1 | 2, found {other:?}"),
                        ));
                    }
                };
                let dedupe_window = count_or(&key("dedupe_window"), self.dedupe_window, 65_536)?;
                let path = |k: &str, v: Option<String>| -> Result<Option<PathBuf>, ConfigError> {
                    v.filter(|p| !p.is_empty())
                        .map(|p| resolve_path(&key(k), &p, base))
                        .transpose()
                };
                let ca = path("tls_ca", self.tls_ca)?;
                let cert = path("tls_cert", self.tls_cert)?;
                let tls_key = path("tls_key", self.tls_key)?;
                let tls = if url.starts_with("mqtts://") {
                    let ca = ca.ok_or_else(|| {
                        ConfigError::invalid(
                            key("tls_ca"),
                            "required with mqtts://: the PEM file of the CA that signed the broker's certificate",
                        )
                    })?;
                    let client = match (cert, tls_key) {
                        (Some(c), Some(k)) => Some((c, k)),
                        (None, None) => None,
                        (Some(_), None) => {
                            return Err(ConfigError::invalid(
                                key("tls_key"),
                                "required with tls_cert: the client certificate's private key (PEM)",
                            ));
                        }
                        (None, Some(_)) => {
                            return Err(ConfigError::invalid(
                                key("tls_cert"),
                                "required with tls_key: the client certificate (PEM)",
                            ));
                        }
                    };
                    Some(MqttTlsConfig { ca, client })
                } else {
                    if ca.is_some() || cert.is_some() || tls_key.is_some() {
                        return Err(ConfigError::invalid(
                            key("url"),
                            "tls_ca, tls_cert and tls_key need an mqtts:// url",
                        ));
                    }
                    None
                };
                Ok(Some(SourceConfig::Mqtt(MqttSourceConfig {
                    url,
                    topics,
                    stream,
                    format,
                    topic_template: self.topic_template.filter(|t| !t.is_empty()),
                    value_field,
                    unmatched,
                    ts_field: self.ts_field.filter(|t| !t.is_empty()),
                    ts_unit,
                    ts_invalid_receive_time: match self.ts_invalid.as_deref().unwrap_or("reject") {
                        "reject" => false,
                        "receive_time" => true,
                        other => {
                            return Err(ConfigError::invalid(
                                key("ts_invalid"),
                                format!("expected reject | receive_time, found {other:?}"),
                            ));
                        }
                    },
                    client_id: self.client_id.filter(|t| !t.is_empty()),
                    qos,
                    dedupe_window,
                    tls,
                    sparkplug,
                })))
            }
            "hwmon" | "iio" | "nmea" | "simulator" => {
                self.into_sensor(&kind, index, streams).map(Some)
            }
            "modbus" => modbus::RawModbus {
                transport: self.transport,
                address: self.address,
                serial: self.serial,
                unit_id: self.unit_id,
                poll_interval: self.poll_interval,
                timeout: self.timeout,
                stream: self.stream,
                key: self.key,
                channels: self.channels,
            }
            .into_typed(index, streams, base)
            .map(|m| Some(SourceConfig::Modbus(m))),
            "opcua" => opcua::RawOpcua {
                endpoint: self.endpoint,
                security_policy: self.security_policy,
                security_mode: self.security_mode,
                user: self.user,
                password: self.password,
                pki_dir: self.pki_dir,
                trust_unknown: self.trust_unknown,
                publishing_interval: self.publishing_interval,
                timeout: self.timeout,
                stream: self.stream,
                key: self.key,
                queue_max: self.queue_max,
                items: self.items,
            }
            .into_typed(index, streams, base, data_dir)
            .map(|o| Some(SourceConfig::Opcua(o))),
            other => Err(ConfigError::invalid(
                key("kind"),
                format!(
                    "expected mqtt | hwmon | iio | nmea | simulator | modbus | opcua | http, found {other:?} (stdin goes through `edge-agent ingest`)"
                ),
            )),
        }
    }

    /// The Sparkplug settings when `format = "sparkplug"`; refuses them otherwise.
    fn sparkplug_typed(&self, index: usize) -> Result<Option<SparkplugConfig>, ConfigError> {
        let key = |k: &str| format!("sources[{index}].{k}");
        if self.format.as_deref() != Some("sparkplug") {
            let stray = [
                ("host_id", self.host_id.is_some()),
                ("groups", self.groups.is_some()),
                ("rebirth_interval", self.rebirth_interval.is_some()),
            ];
            if let Some((k, _)) = stray.iter().find(|(_, set)| *set) {
                return Err(ConfigError::invalid(
                    key(k),
                    "only with format = \"sparkplug\"",
                ));
            }
            return Ok(None);
        }
        if !cfg!(feature = "sparkplug") {
            return Err(ConfigError::invalid(
                key("format"),
                "this build has no Sparkplug support (cargo feature `sparkplug`)",
            ));
        }
        let host_id = required(&key("host_id"), self.host_id.clone())?;
        let level_ok = |s: &str| !s.is_empty() && !s.contains(['/', '#']);
        if !level_ok(&host_id) || host_id.contains('+') {
            return Err(ConfigError::invalid(
                key("host_id"),
                format!("expected one topic level without / + #, found {host_id:?}"),
            ));
        }
        let groups = self.groups.clone().unwrap_or_else(|| vec!["+".into()]);
        if groups.is_empty()
            || groups
                .iter()
                .any(|g| !level_ok(g) || (g.contains('+') && g != "+"))
        {
            return Err(ConfigError::invalid(
                key("groups"),
                format!("expected a non-empty list of group ids (or \"+\"), found {groups:?}"),
            ));
        }
        let rebirth_interval = match &self.rebirth_interval {
            Some(s) => parse_duration(&key("rebirth_interval"), s)?,
            None => Duration::from_secs(10),
        };
        Ok(Some(SparkplugConfig {
            host_id,
            groups,
            rebirth_interval,
        }))
    }

    fn into_sensor(
        self,
        kind: &str,
        index: usize,
        streams: &[StreamConfig],
    ) -> Result<SourceConfig, ConfigError> {
        let key = |k: &str| format!("sources[{index}].{k}");
        let stream = required(&key("stream"), self.stream)?;
        source_stream_ok(&key("stream"), &stream, streams)?;
        let default_interval = if kind == "simulator" {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(10)
        };
        let interval = match self.interval {
            Some(s) => parse_duration(&key("interval"), &s)?,
            None => default_interval,
        };
        if interval.is_zero() {
            return Err(ConfigError::invalid(
                key("interval"),
                "must be above zero, such as 10s",
            ));
        }
        let sysfs_root = PathBuf::from(self.sysfs_root.unwrap_or_else(|| "/sys".into()));
        let number = |k: &str, v: Option<String>, default: f64| -> Result<f64, ConfigError> {
            match v {
                None => Ok(default),
                Some(s) => s
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| {
                        ConfigError::invalid(
                            key(k),
                            format!("expected a positive number, found {s:?}"),
                        )
                    }),
            }
        };
        let kind = match kind {
            "hwmon" => SensorKind::Hwmon { sysfs_root },
            "iio" => SensorKind::Iio { sysfs_root },
            "nmea" => SensorKind::Nmea {
                path: PathBuf::from(required(&key("path"), self.path)?),
            },
            _ => {
                let industrial = match self.sim.as_deref().unwrap_or("fleet") {
                    "fleet" => false,
                    "industrial" => true,
                    other => {
                        return Err(ConfigError::invalid(
                            key("sim"),
                            format!("expected fleet | industrial, found {other:?}"),
                        ));
                    }
                };
                let units = number("units", self.units, 1.0)? as usize;
                let hz = number("hz", self.hz, 1.0)?;
                let seed = number("seed", self.seed, 1.0)? as u64;
                SensorKind::Simulator {
                    industrial,
                    units: units.max(1),
                    hz,
                    seed,
                }
            }
        };
        let key_prefix = self
            .key_prefix
            .filter(|p| !p.is_empty())
            .unwrap_or_else(host_name);
        Ok(SourceConfig::Sensor(SensorSourceConfig {
            kind,
            stream,
            interval,
            key_prefix,
        }))
    }
}

/// A source writes to a declared stream that is not derived.
fn source_stream_ok(key: &str, stream: &str, streams: &[StreamConfig]) -> Result<(), ConfigError> {
    match streams.iter().find(|s| s.name == stream) {
        None => Err(ConfigError::invalid(
            key,
            format!("no [[streams]] entry is named {stream:?}"),
        )),
        Some(s) if s.is_derived() => Err(ConfigError::invalid(
            key,
            format!(
                "stream {stream:?} is derived (source_stream = {:?}) and only its filter runner \
                 writes to it: point the source at {:?}",
                s.source_stream.as_deref().unwrap_or_default(),
                s.source_stream.as_deref().unwrap_or_default()
            ),
        )),
        Some(_) => Ok(()),
    }
}

/// The machine's host name, the default key prefix of sensor sources.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "device".into())
}

/// A topic template is `/`-separated levels, each literal or one `{name}` capture.
fn check_topic_template(key: &str, t: &str) -> Result<(), ConfigError> {
    let mut names: Vec<&str> = Vec::new();
    for level in t.split('/') {
        let capture = level.starts_with('{') && level.ends_with('}') && level.len() > 2;
        if level.contains(['{', '}', '+', '#']) && !capture {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "level {level:?}: expected a literal or one {{name}} capture per level, \
                     such as \"sensors/{{device}}/{{sensor}}\""
                ),
            ));
        }
        if !capture {
            continue;
        }
        // Each capture names a tag: unique, and not `_`-prefixed (the agent's own names).
        let name = &level[1..level.len() - 1];
        if name.contains(['{', '}']) || name.starts_with('_') || name.contains('\0') {
            return Err(ConfigError::invalid(
                key,
                format!("capture {level:?}: a tag name, not starting with '_'"),
            ));
        }
        if name.len() > 1024 {
            return Err(ConfigError::invalid(
                key,
                format!("a capture name of {} bytes: at most 1024", name.len()),
            ));
        }
        if names.contains(&name) {
            return Err(ConfigError::invalid(
                key,
                format!("capture {level:?} appears twice: each names one tag"),
            ));
        }
        names.push(name);
    }
    if names.len() > sync::parse::TAGS_MAX {
        return Err(ConfigError::invalid(
            key,
            format!(
                "{} captures, more than the {} tags a record may have at ingest",
                names.len(),
                sync::parse::TAGS_MAX
            ),
        ));
    }
    Ok(())
}

/// `value_field`: a field name for scalar payloads; not reserved, and not the `ts_field`.
fn check_value_field(key: &str, name: &str, ts_field: Option<&str>) -> Result<(), ConfigError> {
    if name.is_empty() || name.starts_with('_') {
        return Err(ConfigError::invalid(
            key,
            format!("expected a field name not starting with '_', found {name:?}"),
        ));
    }
    if ts_field == Some(name) {
        return Err(ConfigError::invalid(
            key,
            format!("{name:?} is also ts_field: a scalar payload would be taken as its event time"),
        ));
    }
    Ok(())
}

fn streams_typed(raw: Vec<RawStream>) -> Result<Vec<StreamConfig>, ConfigError> {
    if raw.is_empty() {
        return Err(ConfigError::invalid(
            "streams",
            "declare at least one stream: [[streams]] name = \"telemetry\"",
        ));
    }
    let mut streams: Vec<StreamConfig> = Vec::with_capacity(raw.len());
    for (i, s) in raw.into_iter().enumerate() {
        let key = format!("streams[{i}].name");
        let name = required(&key, s.name)?;
        check_stream_name(&key, &name)?;
        if streams.iter().any(|prev| prev.name == name) {
            return Err(ConfigError::invalid(
                key,
                format!("stream {name:?} is declared twice"),
            ));
        }
        let priority = match s.priority {
            None => 0,
            Some(p) => p.parse::<u8>().map_err(|_| {
                ConfigError::invalid(
                    format!("streams[{i}].priority"),
                    format!("expected an integer from 0 to 255, found {p:?}"),
                )
            })?,
        };
        let replicate = match s.replicate.as_deref().map(str::trim) {
            None | Some("true") => true,
            Some("false") => false,
            Some(other) => {
                return Err(ConfigError::invalid(
                    format!("streams[{i}].replicate"),
                    format!("expected true | false, found {other:?}"),
                ));
            }
        };
        let retention = match &s.retention {
            None => DEFAULT_LOCAL_RETENTION,
            Some(_) if replicate => {
                return Err(ConfigError::invalid(
                    format!("streams[{i}].retention"),
                    "only a local stream (replicate = false) has a retention; a replicated \
                     stream is kept until the hub has tiered it",
                ));
            }
            Some(r) => parse_duration(&format!("streams[{i}].retention"), r)?,
        };
        let filters = s
            .filters
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(j, st)| st.into_typed(&format!("streams[{i}].filters[{j}]")))
            .collect::<Result<Vec<_>, _>>()?;
        // Compile once here so that a bad expression is reported with its key at start-up.
        if let Err(crate::filters::CompileError::Stage { stage, message }) =
            crate::filters::Pipeline::compile(&filters)
        {
            return Err(ConfigError::invalid(
                format!("streams[{i}].filters[{stage}]"),
                message,
            ));
        }
        let source_stream = s.source_stream.filter(|t| !t.trim().is_empty());
        let idle_close = idle_close(
            &format!("streams[{i}].idle_close_after"),
            s.idle_close_after,
        )?;
        streams.push(StreamConfig {
            name,
            priority,
            filters,
            source_stream,
            replicate,
            retention,
            idle_close,
        });
    }
    // Derived streams: the source is another declared stream, and not itself derived (so there
    // are no cycles and each runner reads records that came from outside).
    for (i, s) in streams.iter().enumerate() {
        let Some(src) = &s.source_stream else {
            continue;
        };
        let key = format!("streams[{i}].source_stream");
        match streams.iter().find(|t| &t.name == src) {
            None => {
                return Err(ConfigError::invalid(
                    key,
                    format!("no [[streams]] entry is named {src:?}"),
                ));
            }
            Some(t) if t.name == s.name => {
                return Err(ConfigError::invalid(
                    key,
                    "a stream cannot derive from itself",
                ));
            }
            Some(t) if t.is_derived() => {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "{src:?} is itself derived; derive from the stream its sources write to"
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(streams)
}

impl RawStage {
    fn into_typed(self, key: &str) -> Result<StageSpec, ConfigError> {
        let k = |f: &str| format!("{key}.{f}");
        let kind = required(&k("kind"), self.kind)?;
        let interval = |v: Option<String>| -> Result<i64, ConfigError> {
            let d = parse_duration(&k("interval"), &required(&k("interval"), v)?)?;
            match i64::try_from(d.as_nanos()) {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(ConfigError::invalid(
                    k("interval"),
                    "expected a duration above zero, such as 10s",
                )),
            }
        };
        Ok(match kind.as_str() {
            "where" => StageSpec::Where(required(&k("expr"), self.expr)?),
            "deadband" => {
                let t = required(&k("threshold"), self.threshold)?;
                let threshold = t
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| {
                        ConfigError::invalid(
                            k("threshold"),
                            format!("expected a number >= 0, found {t:?}"),
                        )
                    })?;
                StageSpec::Deadband {
                    field: required(&k("field"), self.field)?,
                    threshold,
                }
            }
            "downsample" => StageSpec::Downsample {
                interval_ns: interval(self.interval)?,
                mode: match self.mode.as_deref().unwrap_or("last") {
                    "last" => DownsampleMode::Last,
                    "mean" => DownsampleMode::Mean,
                    other => {
                        return Err(ConfigError::invalid(
                            k("mode"),
                            format!("expected last | mean, found {other:?}"),
                        ));
                    }
                },
            },
            "window" => {
                let aggs = self
                    .aggs
                    .unwrap_or_else(|| {
                        ["count", "min", "max", "mean", "last"]
                            .map(String::from)
                            .to_vec()
                    })
                    .iter()
                    .map(|a| match a.as_str() {
                        "count" => Ok(Agg::Count),
                        "min" => Ok(Agg::Min),
                        "max" => Ok(Agg::Max),
                        "mean" => Ok(Agg::Mean),
                        "last" => Ok(Agg::Last),
                        other => Err(ConfigError::invalid(
                            k("aggs"),
                            format!("expected count | min | max | mean | last, found {other:?}"),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if aggs.is_empty() {
                    return Err(ConfigError::invalid(
                        k("aggs"),
                        "name at least one aggregate",
                    ));
                }
                StageSpec::Window {
                    interval_ns: interval(self.interval)?,
                    field: required(&k("field"), self.field)?,
                    aggs,
                }
            }
            "project" => {
                let fields = self.fields.unwrap_or_default();
                if fields.is_empty() {
                    return Err(ConfigError::invalid(
                        k("fields"),
                        "expected a non-empty list such as [\"temp\", \"hum as humidity\"]",
                    ));
                }
                let mut keep = Vec::with_capacity(fields.len());
                for f in fields {
                    let (name, rename) = match f.split_once(" as ") {
                        Some((a, b)) => (a.trim().to_owned(), Some(b.trim().to_owned())),
                        None => (f.trim().to_owned(), None),
                    };
                    if name.is_empty() || rename.as_deref().is_some_and(str::is_empty) {
                        return Err(ConfigError::invalid(
                            k("fields"),
                            format!("expected \"name\" or \"name as new_name\", found {f:?}"),
                        ));
                    }
                    keep.push((name, rename));
                }
                StageSpec::Project(keep)
            }
            other => {
                return Err(ConfigError::invalid(
                    k("kind"),
                    format!(
                        "expected where | deadband | downsample | window | project, found {other:?}"
                    ),
                ));
            }
        })
    }
}

/// Stream names appear in URLs, file names and metric labels, so they stay plain.
pub fn check_stream_name(key: &str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            key,
            format!("expected 1 to 64 of A-Z a-z 0-9 _ - . (not starting with .), found {name:?}"),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar parsers. Each names its key in the error.
// ---------------------------------------------------------------------------------------------

fn required(key: &str, v: Option<String>) -> Result<String, ConfigError> {
    match v {
        Some(s) if !s.trim().is_empty() => Ok(s),
        Some(_) => Err(ConfigError::invalid(key, "must not be empty")),
        None => Err(ConfigError::invalid(key, "missing")),
    }
}

fn resolve_path(_key: &str, value: &str, base: &Path) -> Result<PathBuf, ConfigError> {
    let p = PathBuf::from(value);
    Ok(if p.is_absolute() { p } else { base.join(p) })
}

/// The host part of `host:port`, checking that the port is a number.
fn host_of<'a>(key: &str, addr: &'a str) -> Result<&'a str, ConfigError> {
    let bad = || ConfigError::invalid(key, format!("expected host:port, found {addr:?}"));
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    Ok(host)
}

/// `always`, `never` or `interval:<duration>` such as `interval:10ms`.
pub fn parse_fsync(key: &str, s: &str) -> Result<FsyncPolicy, ConfigError> {
    let bad = || {
        ConfigError::invalid(
            key,
            format!("expected always | interval:<N>ms | never, found {s:?}"),
        )
    };
    match s {
        "always" => Ok(FsyncPolicy::Always),
        "never" => Ok(FsyncPolicy::Never),
        _ => {
            let d = s.strip_prefix("interval:").ok_or_else(bad)?;
            let d = humantime::parse_duration(d.trim()).map_err(|_| bad())?;
            if d.is_zero() {
                return Err(bad());
            }
            Ok(FsyncPolicy::Interval(d))
        }
    }
}

/// The canonical text of a policy, as `parse_fsync` reads it back.
pub fn fsync_name(p: &FsyncPolicy) -> String {
    match p {
        FsyncPolicy::Always => "always".into(),
        FsyncPolicy::Never => "never".into(),
        FsyncPolicy::Interval(d) => format!("interval:{}ms", d.as_millis()),
    }
}

/// A duration with its unit, such as `2ms` or `30s`.
pub fn parse_duration(key: &str, s: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(s.trim()).map_err(|_| {
        ConfigError::invalid(
            key,
            format!("expected a duration with a unit, such as 2ms or 30s, found {s:?}"),
        )
    })
}

/// A byte size: a plain number of bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB.
pub fn parse_bytes(key: &str, s: &str) -> Result<u64, ConfigError> {
    let bad = || {
        ConfigError::invalid(
            key,
            format!("expected a size such as 4096, 512KiB, 64MiB or 2GiB, found {s:?}"),
        )
    };
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" | "bytes" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(multiplier).ok_or_else(bad)
}

/// `idle_close_after`: a duration, or `off`.
fn idle_close(key: &str, v: Option<String>) -> Result<crate::filters::IdleClose, ConfigError> {
    use crate::filters::IdleClose;
    match v.as_deref().map(str::trim) {
        None => Ok(IdleClose::Interval),
        Some("off") => Ok(IdleClose::Off),
        Some(d) => {
            let d = parse_duration(key, d)?;
            Ok(IdleClose::AfterNs(
                i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
            ))
        }
    }
}

/// `storage.segment_bytes_max`: as configured, if the budget holds one active segment per
/// stream plus [`BUDGET_SPARE_SEGMENTS`] of it; else derived from the budget (half of that
/// share, at most [`DEFAULT_SEGMENT_BYTES_MAX`]). A budget too small for either is refused,
/// naming both keys and the minimum.
fn segment_bytes(raw: Option<String>, budget: u64, streams: usize) -> Result<u64, ConfigError> {
    let slots = streams.max(1) as u64 + BUDGET_SPARE_SEGMENTS;
    let per = if streams == 1 { "stream" } else { "streams" };
    let Some(raw) = raw else {
        let derived = (budget / (2 * slots)).min(DEFAULT_SEGMENT_BYTES_MAX);
        if derived < SEGMENT_BYTES_MIN {
            let min = 2 * slots * SEGMENT_BYTES_MIN;
            return Err(ConfigError::invalid(
                "storage.disk_bytes_max",
                format!(
                    "{} is too small for {streams} {per}: storage.segment_bytes_max is derived \
                     from the budget and would fall below {}; raise storage.disk_bytes_max to \
                     at least {}",
                    size(budget),
                    size(SEGMENT_BYTES_MIN),
                    size(min)
                ),
            ));
        }
        return Ok(derived);
    };
    let seg = bytes_or("storage.segment_bytes_max", Some(raw), 0)?;
    if seg < SEGMENT_BYTES_MIN {
        return Err(ConfigError::invalid(
            "storage.segment_bytes_max",
            format!(
                "{} is below the minimum of {}",
                size(seg),
                size(SEGMENT_BYTES_MIN)
            ),
        ));
    }
    let min = seg.saturating_mul(slots);
    if budget < min {
        return Err(ConfigError::invalid(
            "storage.disk_bytes_max",
            format!(
                "{} cannot hold the log with storage.segment_bytes_max = {} and {streams} {per}: \
                 it needs one active segment per stream plus {BUDGET_SPARE_SEGMENTS} to drop, at \
                 least {}; raise storage.disk_bytes_max to {}, lower storage.segment_bytes_max \
                 to at most {}, or leave storage.segment_bytes_max out to derive it from the budget",
                size(budget),
                size(seg),
                size(min),
                size(min),
                size((budget / slots).max(1)),
            ),
        ));
    }
    Ok(seg)
}

/// A byte size as written in the config: `64MiB` when exact, else bytes.
fn size(n: u64) -> String {
    match n {
        0 => "0".into(),
        n if n % (1 << 30) == 0 => format!("{}GiB", n >> 30),
        n if n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

fn bytes_or(key: &str, v: Option<String>, default: u64) -> Result<u64, ConfigError> {
    let n = match v {
        Some(s) => parse_bytes(key, &s)?,
        None => default,
    };
    if n == 0 {
        return Err(ConfigError::invalid(key, "must be greater than zero"));
    }
    Ok(n)
}

fn positive_usize(key: &str, n: u64) -> Result<usize, ConfigError> {
    match usize::try_from(n) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ConfigError::invalid(
            key,
            format!("expected a size from 1 byte up, found {n}"),
        )),
    }
}

fn count_or(key: &str, v: Option<String>, default: usize) -> Result<usize, ConfigError> {
    let Some(s) = v else { return Ok(default) };
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ConfigError::invalid(
            key,
            format!("expected a positive integer, found {s:?}"),
        )),
    }
}

fn block_version(v: Option<String>, default: u8) -> Result<u8, ConfigError> {
    match v.as_deref().map(str::trim) {
        None => Ok(default),
        Some("1") => Ok(1),
        Some("2") => Ok(2),
        Some(other) => Err(ConfigError::invalid(
            "storage.block_version",
            format!("expected 1 (rows) | 2 (columnar), found {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_ingest_token() {
        let token = "edge-token-0123456789abcdef";
        let text = format!(
            "data_dir = \"data\"\n[http]\ntoken = \"{token}\"\n[[streams]]\nname = \"telemetry\"\n"
        );
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .build()
            .and_then(|c| c.try_deserialize())
            .unwrap();
        let typed = EdgeConfig::from_toml(&text, Path::new("/etc/tributary"), None).unwrap();
        assert_eq!(typed.http.token.as_deref(), Some(token));
        for shown in [
            format!("{typed:?}"),
            format!("{typed:#?}"),
            format!("{raw:?}"),
        ] {
            assert!(!shown.contains(token), "the token in {shown}");
            assert!(shown.contains(REDACTED), "nothing redacted in {shown}");
            assert!(shown.contains("telemetry"), "the rest still shows: {shown}");
        }
    }
}
