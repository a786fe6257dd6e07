//! Record sources besides the HTTP API: the MQTT subscriber ([`mqtt`]), the device sensors
//! ([`sensors`]), the Modbus TCP poller ([`modbus`]) and the OPC UA client ([`opcua`]).
//!
//! Every source hands whole batches to [`crate::http::Ingest::ingest`], the agent's one front
//! door, so counting, durability and (later) filters apply the same way to every source. This
//! module also holds what sources share with the HTTP API: readiness for `/healthz` and the
//! source counters for `/metrics`.

pub mod flatten;
pub mod link;
pub mod modbus;
pub mod mqtt;
pub mod opcua;
pub mod sensors;
#[cfg(feature = "sparkplug")]
pub mod sparkplug;

/// The subscriptions of a Sparkplug host for `groups` (none in builds without the feature,
/// whose config load refuses `format = "sparkplug"` first).
pub fn sparkplug_topics(groups: &[String]) -> Vec<String> {
    groups.iter().map(|g| format!("spBv1.0/{g}/#")).collect()
}

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use thiserror::Error;

use crate::config::{EdgeConfig, SourceConfig};
use crate::http::Ingest;

/// Readiness and counters of every configured source. Shared with the HTTP API.
#[derive(Debug, Default)]
pub struct SourcesState {
    /// One flag per MQTT source, in config order: every subscription granted on the current
    /// connection.
    mqtt_ready: Vec<AtomicBool>,
    mqtt_stats: Vec<Arc<mqtt::MqttStats>>,
    /// One connection record per MQTT source, in config order, for `/v1/status`.
    mqtt_conn: Vec<Mutex<MqttConn>>,
    /// One per Modbus source, in config order: counters and the device's state.
    modbus: Vec<Arc<modbus::ModbusStats>>,
    /// One per OPC UA source, in config order: counters and the session's state.
    opcua: Vec<Arc<opcua::OpcuaStats>>,
}

/// What `/v1/status` shows of one MQTT source's connection.
#[derive(Debug, Default)]
struct MqttConn {
    broker: String,
    stream: String,
    /// Subscribed on the current connection.
    ready: bool,
    /// Why the last connection ended (kept until the next one is subscribed).
    last_error: Option<String>,
    /// Unix ms of the last change.
    since_ms: u64,
}

impl SourcesState {
    /// State for the sources `cfg` declares, none of them ready yet.
    pub fn new(cfg: &EdgeConfig) -> Self {
        let mqtt: Vec<_> = cfg
            .sources
            .iter()
            .filter_map(|s| match s {
                SourceConfig::Mqtt(m) => Some(m),
                _ => None,
            })
            .collect();
        let n = mqtt.len();
        let started = crate::http::status::now_ms();
        SourcesState {
            mqtt_ready: (0..n).map(|_| AtomicBool::new(false)).collect(),
            mqtt_stats: (0..n)
                .map(|_| Arc::new(mqtt::MqttStats::default()))
                .collect(),
            mqtt_conn: mqtt
                .iter()
                .map(|m| {
                    Mutex::new(MqttConn {
                        broker: m.url.clone(),
                        stream: m.stream.clone(),
                        since_ms: started,
                        ..MqttConn::default()
                    })
                })
                .collect(),
            modbus: cfg
                .sources
                .iter()
                .filter_map(|s| match s {
                    SourceConfig::Modbus(m) => Some(Arc::new(modbus::ModbusStats::new(m))),
                    _ => None,
                })
                .collect(),
            opcua: cfg
                .sources
                .iter()
                .filter_map(|s| match s {
                    SourceConfig::Opcua(o) => Some(Arc::new(opcua::OpcuaStats::new(o))),
                    _ => None,
                })
                .collect(),
        }
    }

    /// The counters of the `index`-th OPC UA source.
    pub fn opcua_stats(&self, index: usize) -> Option<&Arc<opcua::OpcuaStats>> {
        self.opcua.get(index)
    }

    /// The counters of the `index`-th Modbus source.
    pub fn modbus_stats(&self, index: usize) -> Option<&Arc<modbus::ModbusStats>> {
        self.modbus.get(index)
    }

    /// True once every source is ready (trivially true without sources).
    pub fn ready(&self) -> bool {
        self.mqtt_ready.iter().all(|r| r.load(Ordering::Acquire))
    }

    /// Why the sources are not ready, for `/healthz`.
    pub fn not_ready_reason(&self) -> Option<String> {
        let waiting: Vec<String> = self
            .mqtt_ready
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.load(Ordering::Acquire))
            .map(|(i, _)| format!("sources[{i}] (mqtt)"))
            .collect();
        if waiting.is_empty() {
            None
        } else {
            Some(format!(
                "waiting for the broker to grant every subscription of {}",
                waiting.join(", ")
            ))
        }
    }

    pub(crate) fn set_mqtt_ready(&self, index: usize, ready: bool) {
        if let Some(r) = self.mqtt_ready.get(index) {
            r.store(ready, Ordering::Release);
        }
        if let Some(c) = self.mqtt_conn.get(index) {
            let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
            if c.ready != ready {
                c.ready = ready;
                c.since_ms = crate::http::status::now_ms();
            }
            if ready {
                c.last_error = None;
            }
        }
    }

    /// The `index`-th MQTT source lost its connection (or never got one) because of `why`.
    pub(crate) fn mqtt_lost(&self, index: usize, why: &str) {
        self.set_mqtt_ready(index, false);
        if let Some(c) = self.mqtt_conn.get(index) {
            let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
            if c.last_error.is_none() {
                c.since_ms = crate::http::status::now_ms();
            }
            c.last_error = Some(why.to_owned());
        }
    }

    /// Each MQTT source's connection, for `/v1/status`.
    pub fn reports(&self) -> Vec<crate::http::status::SourceReport> {
        let modbus = self.modbus.iter().enumerate().map(|(i, m)| m.report(i));
        let opcua = self.opcua.iter().enumerate().map(|(i, o)| o.report(i));
        self.mqtt_conn
            .iter()
            .zip(&self.mqtt_stats)
            .enumerate()
            .map(|(i, (c, stats))| {
                let c = c.lock().unwrap_or_else(|e| e.into_inner());
                let state = match (c.ready, &c.last_error) {
                    (true, _) => "connected",
                    (false, Some(_)) => "disconnected",
                    (false, None) => "connecting",
                };
                crate::http::status::SourceReport {
                    source: i,
                    kind: "mqtt".into(),
                    broker: c.broker.clone(),
                    stream: c.stream.clone(),
                    state: state.into(),
                    last_error: c.last_error.clone(),
                    since: Some(crate::http::status::rfc3339_ms(c.since_ms)),
                    messages_received: stats.received.load(Ordering::Relaxed),
                    records: stats.records.load(Ordering::Relaxed),
                }
            })
            .chain(modbus)
            .chain(opcua)
            .collect()
    }

    /// The counters of the `index`-th MQTT source.
    pub fn mqtt_stats(&self, index: usize) -> Option<&Arc<mqtt::MqttStats>> {
        self.mqtt_stats.get(index)
    }

    /// Prometheus text for the source counters (empty without sources).
    pub fn render(&self) -> String {
        let mut out = modbus::render(&self.modbus);
        out.push_str(&opcua::render(&self.opcua));
        if self.mqtt_stats.is_empty() {
            return out;
        }
        let counters: [Counter; 8] = [
            ("received", "MQTT PUBLISH packets received", |s| {
                s.received.load(Ordering::Relaxed)
            }),
            (
                "acks_sent",
                "PUBACKs and PUBRECs sent for durable (or refused) messages",
                |s| s.acks_sent.load(Ordering::Relaxed),
            ),
            (
                "dup_received",
                "received with DUP set (redeliveries)",
                |s| s.dup_received.load(Ordering::Relaxed),
            ),
            (
                "duplicates_dropped",
                "redeliveries recognised as already stored and not appended again",
                |s| s.duplicates_dropped.load(Ordering::Relaxed),
            ),
            ("records", "records appended", |s| {
                s.records.load(Ordering::Relaxed)
            }),
            (
                "bad_payloads",
                "payloads that did not parse (acked, not stored)",
                |s| s.bad_payloads.load(Ordering::Relaxed),
            ),
            (
                "topic_mismatches",
                "topics that did not match topic_template (dropped, or stored keyed by the topic with unmatched = \"store\")",
                |s| s.topic_mismatches.load(Ordering::Relaxed),
            ),
            (
                "bad_timestamps",
                "ts_field missing or unreadable (refused, or stored at the receive time with ts_invalid = \"receive_time\")",
                |s| s.bad_timestamps.load(Ordering::Relaxed),
            ),
        ];
        let sparkplug: [Counter; 8] = [
            (
                "rebirths_requested",
                "Sparkplug rebirth requests (NCMD Node Control/Rebirth) sent",
                |s| s.spb_rebirths_requested.load(Ordering::Relaxed),
            ),
            (
                "seq_gaps",
                "Sparkplug seq gaps recorded (spb_event = \"seq_gap\" records)",
                |s| s.spb_seq_gaps.load(Ordering::Relaxed),
            ),
            (
                "deaths",
                "Sparkplug nodes and devices marked offline by a matching DEATH",
                |s| s.spb_deaths.load(Ordering::Relaxed),
            ),
            (
                "stale_deaths",
                "Sparkplug DEATHs ignored as stale (no live BIRTH they match)",
                |s| s.spb_stale_deaths.load(Ordering::Relaxed),
            ),
            (
                "dropped_messages",
                "Sparkplug DATA and DBIRTH messages dropped for lack of BIRTH state",
                |s| s.spb_dropped_messages.load(Ordering::Relaxed),
            ),
            (
                "unknown_metrics",
                "Sparkplug metrics whose alias or name the BIRTH did not hold",
                |s| s.spb_unknown_metrics.load(Ordering::Relaxed),
            ),
            (
                "skipped_metrics",
                "Sparkplug DataSet and Template metrics, not stored",
                |s| s.spb_skipped_metrics.load(Ordering::Relaxed),
            ),
            (
                "bad_metrics",
                "Sparkplug metrics whose value did not fit their datatype",
                |s| s.spb_bad_metrics.load(Ordering::Relaxed),
            ),
        ];
        let all = counters
            .into_iter()
            .map(|c| ("mqtt", c))
            .chain(sparkplug.into_iter().map(|c| ("sparkplug", c)));
        for (family, (name, help, get)) in all {
            let _ = writeln!(out, "# HELP tributary_edge_{family}_{name}_total {help}");
            let _ = writeln!(out, "# TYPE tributary_edge_{family}_{name}_total counter");
            for (i, s) in self.mqtt_stats.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "tributary_edge_{family}_{name}_total{{source=\"{i}\"}} {}",
                    get(s)
                );
            }
        }
        out
    }
}

/// A counter's name, help text and reader, for [`SourcesState::render`].
type Counter = (&'static str, &'static str, fn(&mqtt::MqttStats) -> u64);

/// Why the sources could not start.
#[derive(Debug, Error)]
pub enum StartError {
    #[error("sources[{index}].url: {message}")]
    BadUrl { index: usize, message: String },
}

/// Starts every configured source on the current tokio runtime. They run until the process
/// ends, reconnecting on their own.
pub fn spawn_all(
    cfg: &EdgeConfig,
    ingest: Ingest,
    state: Arc<SourcesState>,
) -> Result<(), StartError> {
    let mut mqtt_index = 0;
    let mut modbus_index = 0;
    let mut modbus = Vec::new();
    let mut opcua_index = 0;
    for (index, source) in cfg.sources.iter().enumerate() {
        match source {
            SourceConfig::Mqtt(m) => {
                let source = mqtt::MqttSource::new(
                    m.clone(),
                    &cfg.data_dir,
                    mqtt_index,
                    ingest.clone(),
                    state.clone(),
                )
                .map_err(|message| StartError::BadUrl { index, message })?;
                tokio::spawn(source.run());
                mqtt_index += 1;
            }
            SourceConfig::Sensor(sensor) => {
                let mut sensor = sensor.clone();
                sensor.interval = sensor.interval.max(sensors::INTERVAL_MIN);
                let stats = Arc::new(sensors::SensorStats::default());
                tokio::spawn(sensors::run(sensor, ingest.clone(), stats));
            }
            SourceConfig::Modbus(m) => {
                modbus.push((modbus_index, m));
                modbus_index += 1;
            }
            SourceConfig::Opcua(o) => {
                spawn_opcua(o, opcua_index, &ingest, &state);
                opcua_index += 1;
            }
        }
    }
    spawn_modbus(modbus, &ingest, &state);
    Ok(())
}

/// Starts the Modbus sources, each with its place among them: a task per TCP device, and a
/// task per serial line for the RTU devices on it (`modbus::run_bus`).
#[cfg(feature = "modbus")]
fn spawn_modbus(
    sources: Vec<(usize, &crate::config::ModbusSourceConfig)>,
    ingest: &Ingest,
    state: &SourcesState,
) {
    use crate::config::ModbusTransport;
    let mut buses: Vec<(crate::config::SerialLine, Vec<modbus::RtuUnit>)> = Vec::new();
    for (index, cfg) in sources {
        let Some(stats) = state.modbus_stats(index).cloned() else {
            continue;
        };
        match &cfg.transport {
            ModbusTransport::Tcp { .. } => {
                tokio::spawn(modbus::run(cfg.clone(), index, ingest.clone(), stats));
            }
            ModbusTransport::Rtu(line) => {
                let unit = modbus::RtuUnit {
                    index,
                    cfg: cfg.clone(),
                    stats,
                };
                // Config load made sure every source on one path gives the line the same
                // settings.
                match buses.iter_mut().find(|(l, _)| l.path == line.path) {
                    Some((_, units)) => units.push(unit),
                    None => buses.push((line.clone(), vec![unit])),
                }
            }
        }
    }
    for (line, units) in buses {
        tokio::spawn(modbus::run_bus(line, units, ingest.clone()));
    }
}

/// Without the `modbus` feature there is nothing to start: config load refuses
/// `kind = "modbus"` in such builds.
#[cfg(not(feature = "modbus"))]
fn spawn_modbus(
    _sources: Vec<(usize, &crate::config::ModbusSourceConfig)>,
    _ingest: &Ingest,
    _state: &SourcesState,
) {
}

/// Starts the `index`-th OPC UA source.
#[cfg(feature = "opcua")]
fn spawn_opcua(
    cfg: &crate::config::OpcuaSourceConfig,
    index: usize,
    ingest: &Ingest,
    state: &SourcesState,
) {
    if let Some(stats) = state.opcua_stats(index) {
        let client = opcua::build_client(cfg);
        tokio::spawn(opcua::run(
            cfg.clone(),
            index,
            ingest.clone(),
            stats.clone(),
            client,
        ));
    }
}

/// Without the `opcua` feature there is nothing to start: config load refuses
/// `kind = "opcua"` in such builds.
#[cfg(not(feature = "opcua"))]
fn spawn_opcua(
    _cfg: &crate::config::OpcuaSourceConfig,
    _index: usize,
    _ingest: &Ingest,
    _state: &SourcesState,
) {
}
