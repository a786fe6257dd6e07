//! The OPC UA client source: one session to a server, one subscription with a monitored item
//! per configured variable, each data change appended as a record through the one ingest path
//! ([`crate::http::Ingest::ingest`]).
//!
//! A record holds one field (the item's `name`), the value's source timestamp (the server
//! timestamp when the source gave none, the receive time when neither is set) and the tags
//! `node` (the node id) and the item's own. A value with a bad status, or of a type with no
//! field type (arrays, structures), is counted per item (`tributary_edge_opcua_errors_total`)
//! and not stored.
//!
//! **Session loss.** The source owns the reconnect: when the session's connection ends (the
//! server restarted, the link broke, keep-alives failed) it drops the session, reconnects with
//! a doubling backoff, creates a new session, re-creates the subscription and every monitored
//! item, and then appends one gap record (tag `opcua_event = "gap"`, fields `_opcua_gap_start_ns`
//! and `_opcua_gap_end_ns`, the same event-record convention as the Sparkplug host's
//! `spb_event = "seq_gap"`) covering the time from the loss to the new subscription: values
//! sampled in that window were never received. Reconnects and gaps are counted.
//!
//! Data changes go from the client's callback into a bounded queue (`queue_max`); one writer
//! drains it in batches. A change that finds the queue full is dropped and counted
//! (`dropped_total`), never blocking the client.
//!
//! Value conversion ([`value_of`]) and time conversion are pure and tested here; the client
//! needs the `opcua` feature (async-opcua); without it the agent refuses `kind = "opcua"` at load.

use std::sync::atomic::{AtomicU64, Ordering};

use super::link::{Link, Metric, ReportLine, render_labelled, render_per_source};
use crate::config::OpcuaSourceConfig;

/// The tag naming an event record of this source (`gap`).
pub const EVENT_TAG: &str = "opcua_event";

/// Counters and session state of one OPC UA source, for `/metrics` and `/v1/status`.
#[derive(Debug)]
pub struct OpcuaStats {
    endpoint: String,
    stream: String,
    items: Vec<String>,
    /// Data changes received from the server.
    pub changes: AtomicU64,
    pub records: AtomicU64,
    /// Sessions established again after one was lost.
    pub reconnects: AtomicU64,
    /// Gap records appended (one per session loss).
    pub gaps: AtomicU64,
    /// Connects and session set-ups that failed.
    pub connect_errors: AtomicU64,
    /// Per item, in config order: refused monitored items, bad statuses, unstorable values.
    pub item_errors: Vec<AtomicU64>,
    /// Changes dropped because the queue to the log was full.
    pub dropped: AtomicU64,
    /// Records the log refused (disk full under `on_full = "block"`).
    pub refused_records: AtomicU64,
    /// Whether the subscription is in place on a live session.
    pub link: Link,
}

impl OpcuaStats {
    pub fn new(cfg: &OpcuaSourceConfig) -> Self {
        OpcuaStats {
            endpoint: cfg.endpoint.clone(),
            stream: cfg.stream.clone(),
            items: cfg.items.iter().map(|c| c.name.clone()).collect(),
            changes: AtomicU64::new(0),
            records: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            connect_errors: AtomicU64::new(0),
            item_errors: cfg.items.iter().map(|_| AtomicU64::new(0)).collect(),
            dropped: AtomicU64::new(0),
            refused_records: AtomicU64::new(0),
            link: Link::default(),
        }
    }

    /// This source's line in `/v1/status`; `index` is its place among the OPC UA sources.
    pub fn report(&self, index: usize) -> crate::http::status::SourceReport {
        self.link.report(ReportLine {
            index,
            kind: "opcua",
            peer: &self.endpoint,
            stream: &self.stream,
            messages: self.changes.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
        })
    }
}

/// Prometheus text for every OPC UA source (empty without any).
pub fn render(all: &[std::sync::Arc<OpcuaStats>]) -> String {
    let mut out = String::new();
    if all.is_empty() {
        return out;
    }
    let per_source: [Metric<OpcuaStats>; 8] = [
        ("changes_total", "counter", "data changes received", |s| {
            s.changes.load(Ordering::Relaxed)
        }),
        ("records_total", "counter", "records appended", |s| {
            s.records.load(Ordering::Relaxed)
        }),
        (
            "reconnects_total",
            "counter",
            "sessions established again after one was lost",
            |s| s.reconnects.load(Ordering::Relaxed),
        ),
        (
            "gaps_total",
            "counter",
            "gap records appended (opcua_event = \"gap\"), one per session loss",
            |s| s.gaps.load(Ordering::Relaxed),
        ),
        (
            "connect_errors_total",
            "counter",
            "connects and session set-ups that failed",
            |s| s.connect_errors.load(Ordering::Relaxed),
        ),
        (
            "dropped_total",
            "counter",
            "data changes dropped because the queue to the log was full",
            |s| s.dropped.load(Ordering::Relaxed),
        ),
        (
            "refused_records_total",
            "counter",
            "records the local log refused",
            |s| s.refused_records.load(Ordering::Relaxed),
        ),
        (
            "up",
            "gauge",
            "1 while the subscription is in place, 0 while it is not",
            |s| u64::from(s.link.is_up()),
        ),
    ];
    render_per_source(&mut out, "tributary_edge_opcua_", &per_source, all);
    let rows = all.iter().enumerate().flat_map(|(i, s)| {
        s.items
            .iter()
            .zip(&s.item_errors)
            .map(move |(name, n)| (i, name.as_str(), n.load(Ordering::Relaxed)))
    });
    render_labelled(
        &mut out,
        "tributary_edge_opcua_errors_total",
        "items refused, values with a bad status or of no storable type",
        "item",
        rows,
    );
    out
}

/// The gap record for a session lost at `start_ns` and subscribed again at `end_ns`.
pub fn gap_record(key: &str, start_ns: i64, end_ns: i64) -> sync::Record {
    sync::Record {
        key: key.to_owned(),
        tags: vec![(EVENT_TAG.to_owned(), "gap".to_owned())],
        ts: start_ns,
        fields: vec![
            ("_opcua_gap_start_ns".into(), sync::Value::I64(start_ns)),
            ("_opcua_gap_end_ns".into(), sync::Value::I64(end_ns)),
        ],
    }
}

/// Test-only switch (feature `fault-injection`): with `TRIBUTARY_FAULT_OPCUA_NO_RESUBSCRIBE=1`
/// in its environment the source does not re-create its subscription after a session loss,
/// so the OPC UA test can show it notices.
#[cfg(feature = "fault-injection")]
fn resubscribe_after_loss() -> bool {
    std::env::var_os("TRIBUTARY_FAULT_OPCUA_NO_RESUBSCRIBE").is_none()
}

#[cfg(not(feature = "fault-injection"))]
#[cfg_attr(not(feature = "opcua"), allow(dead_code))]
fn resubscribe_after_loss() -> bool {
    true
}

#[cfg(feature = "opcua")]
pub use driver::{build_client, run, time_ns, value_of};

#[cfg(feature = "opcua")]
mod driver {
    use std::str::FromStr;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use ::opcua::client::{
        Client, ClientBuilder, DataChangeCallback, IdentityToken, MonitoredItem, Session,
        SessionPollResult,
    };
    use ::opcua::crypto::SecurityPolicy;
    use ::opcua::types::{
        DataChangeFilter, DataChangeTrigger, DataValue, DateTime, DeadbandType, ExtensionObject,
        MessageSecurityMode, MonitoredItemCreateRequest, MonitoringMode, MonitoringParameters,
        NodeId, ReadValueId, StatusCode, TimestampsToReturn, UserTokenPolicy, Variant,
    };
    use futures_util::StreamExt as _;
    use sync::{Record, Value};
    use tokio::sync::mpsc;

    use super::{OpcuaStats, gap_record, resubscribe_after_loss};
    use crate::config::{Deadband, OpcuaItem, OpcuaSourceConfig, SecurityMode};
    use crate::http::ingest::{Ingest, now_ns};

    /// The longest wait between reconnects to a server that does not answer.
    const BACKOFF_MAX: Duration = Duration::from_secs(30);
    /// The first wait after a loss.
    const BACKOFF_MIN: Duration = Duration::from_millis(250);
    /// The most records in one append.
    const BATCH_MAX: usize = 1024;
    /// Ticks (100 ns) from 1601-01-01, OPC UA's epoch, to 1970-01-01.
    const UNIX_EPOCH_TICKS: i64 = 116_444_736_000_000_000;

    /// Runs one OPC UA source until the process ends. `index` is its place among the OPC UA
    /// sources (the `source` label).
    /// Runs the source with `client`, the result of [`build_client`] (called before the task is
    /// spawned, one source after the other, so that sources sharing a `pki_dir` do not race to
    /// create its key pair).
    pub async fn run(
        cfg: OpcuaSourceConfig,
        index: usize,
        ingest: Ingest,
        stats: Arc<OpcuaStats>,
        client: Result<Client, String>,
    ) {
        let (tx, rx) = mpsc::channel(cfg.queue_max);
        tokio::spawn(write(cfg.stream.clone(), index, ingest, stats.clone(), rx));
        let mut client = match client {
            Ok(c) => c,
            Err(e) => {
                stats.link.set_down(&e);
                tracing::error!(source = index, endpoint = %cfg.endpoint, error = %e, "opcua client could not be set up");
                return;
            }
        };
        let mut backoff = BACKOFF_MIN;
        // When the last session was lost, while no subscription has replaced it.
        let mut lost_at: Option<i64> = None;
        let mut subscribed_once = false;
        loop {
            match session(
                &cfg,
                index,
                &mut client,
                &stats,
                &tx,
                &mut lost_at,
                subscribed_once,
            )
            .await
            {
                Ok(why) => {
                    subscribed_once = true;
                    backoff = BACKOFF_MIN;
                    lost_at.get_or_insert_with(now_ns);
                    stats.link.set_down(&why);
                    tracing::warn!(source = index, endpoint = %cfg.endpoint, error = %why, "opcua session lost; reconnecting");
                }
                Err(e) => {
                    stats.connect_errors.fetch_add(1, Ordering::Relaxed);
                    if stats.link.is_up() || backoff == BACKOFF_MIN {
                        tracing::warn!(source = index, endpoint = %cfg.endpoint, error = %e, "opcua server not answering");
                    }
                    stats.link.set_down(&e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// One session: connects, subscribes, records the gap of the session before, and waits
    /// for the connection to end. `Ok(why)` once a subscribed session was lost; `Err` when it
    /// never got that far.
    async fn session(
        cfg: &OpcuaSourceConfig,
        index: usize,
        client: &mut Client,
        stats: &Arc<OpcuaStats>,
        tx: &mpsc::Sender<Record>,
        lost_at: &mut Option<i64>,
        subscribed_once: bool,
    ) -> Result<String, String> {
        let endpoint = endpoint_of(cfg);
        let (session, event_loop) = tokio::time::timeout(
            cfg.timeout,
            client.connect_to_matching_endpoint(endpoint, identity(cfg)),
        )
        .await
        .map_err(|_| format!("connect to {} timed out", cfg.endpoint))?
        .map_err(|e| explain(cfg, &e.to_string()))?;
        let (ev_tx, mut ev_rx) = mpsc::channel::<Result<(), String>>(4);
        let driver = tokio::spawn(async move {
            let events = event_loop.enter();
            futures_util::pin_mut!(events);
            while let Some(ev) = events.next().await {
                let end = match ev {
                    Ok(SessionPollResult::Reconnected(_)) => Ok(()),
                    Ok(SessionPollResult::ConnectionLost(code)) => {
                        Err(format!("connection lost: {code}"))
                    }
                    Err(code) => Err(format!("session failed: {code}")),
                    Ok(_) => continue,
                };
                let last = end.is_err();
                if ev_tx.send(end).await.is_err() || last {
                    break;
                }
            }
        });
        let _abort = AbortOnDrop(driver);
        match tokio::time::timeout(cfg.timeout, ev_rx.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(e))) => return Err(explain(cfg, &e)),
            Ok(None) => return Err("session ended before it was established".into()),
            Err(_) => return Err(format!("session to {} timed out", cfg.endpoint)),
        }
        // The gap record goes into the queue before the new subscription's first change, so
        // the log holds it between the values of the two sessions.
        let gap_end = match lost_at.take() {
            Some(start) => Some(record_gap(cfg, index, stats, tx, start).await),
            None => None,
        };
        let resubscribe = !subscribed_once || resubscribe_after_loss();
        if resubscribe && let Err(e) = subscribe(cfg, index, &session, stats, tx).await {
            // Nothing was received since the recorded gap ended: the next one starts there.
            *lost_at = gap_end;
            return Err(e);
        }
        stats.link.set_up();
        tracing::info!(source = index, endpoint = %cfg.endpoint, items = cfg.items.len(), "opcua subscription in place");
        let why = match ev_rx.recv().await {
            Some(Err(e)) => e,
            _ => "session ended".to_owned(),
        };
        let _ = session.disconnect().await;
        Ok(why)
    }

    /// Counts and queues the gap record of a session lost at `start`, ending now; returns the
    /// end.
    async fn record_gap(
        cfg: &OpcuaSourceConfig,
        index: usize,
        stats: &OpcuaStats,
        tx: &mpsc::Sender<Record>,
        start: i64,
    ) -> i64 {
        stats.reconnects.fetch_add(1, Ordering::Relaxed);
        stats.gaps.fetch_add(1, Ordering::Relaxed);
        let end = now_ns();
        tracing::warn!(source = index, endpoint = %cfg.endpoint, gap_ms = (end - start) / 1_000_000, "opcua session back; values in the outage were not received, gap recorded");
        // The queue may be full: the gap record waits for room rather than being lost.
        let _ = tx.send(gap_record(&cfg.key, start, end)).await;
        end
    }

    /// Aborts the session's event loop when the session is given up.
    struct AbortOnDrop(tokio::task::JoinHandle<()>);

    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }

    /// The client of `cfg`, creating the key pair in `pki_dir` if there is none.
    pub fn build_client(cfg: &OpcuaSourceConfig) -> Result<Client, String> {
        for dir in ["trusted", "rejected"] {
            let path = cfg.pki_dir.join(dir);
            std::fs::create_dir_all(&path)
                .map_err(|e| format!("pki_dir: cannot create {}: {e}", path.display()))?;
        }
        ClientBuilder::new()
            .application_name("Tributary edge agent")
            .application_uri("urn:tributary:edge-agent")
            .product_uri("urn:tributary:edge-agent")
            .pki_dir(cfg.pki_dir.clone())
            .create_sample_keypair(true)
            .trust_server_certs(cfg.trust_unknown)
            .verify_server_certs(true)
            // The source reconnects on its own: a lost connection ends the event loop.
            .session_retry_limit(0)
            .recreate_subscriptions(false)
            .request_timeout(cfg.timeout)
            .client()
            .map_err(|e| format!("client config: {}", e.join("; ")))
    }

    fn endpoint_of(cfg: &OpcuaSourceConfig) -> ::opcua::types::EndpointDescription {
        let policy = SecurityPolicy::from_str(&cfg.security_policy).unwrap_or(SecurityPolicy::None);
        let mode = match cfg.security_mode {
            SecurityMode::None => MessageSecurityMode::None,
            SecurityMode::Sign => MessageSecurityMode::Sign,
            SecurityMode::SignAndEncrypt => MessageSecurityMode::SignAndEncrypt,
        };
        let token = match cfg.user {
            None => UserTokenPolicy::anonymous(),
            Some(_) => UserTokenPolicy {
                token_type: ::opcua::types::UserTokenType::UserName,
                ..UserTokenPolicy::anonymous()
            },
        };
        (cfg.endpoint.as_str(), policy.to_uri(), mode, token).into()
    }

    fn identity(cfg: &OpcuaSourceConfig) -> IdentityToken {
        match &cfg.user {
            None => IdentityToken::Anonymous,
            Some((u, p)) => IdentityToken::new_user_name(u.clone(), p.clone()),
        }
    }

    /// A connect error in words an operator can act on; an untrusted server certificate says
    /// where the trust list is.
    fn explain(cfg: &OpcuaSourceConfig, e: &str) -> String {
        // After the first refusal the client finds the certificate in `rejected/` and reports
        // only `BadSecurityChecksFailed`; the operator still has to move it.
        let rejected_held = || {
            std::fs::read_dir(cfg.pki_dir.join("rejected")).is_ok_and(|mut d| d.next().is_some())
        };
        if e.contains("BadCertificateUntrusted")
            || e.contains("rejected directory")
            || (e.contains("BadSecurityChecksFailed") && rejected_held())
        {
            return format!(
                "the server's certificate is not in the trust list: move it from {} to {} \
                 (or set trust_unknown = true): {e}",
                cfg.pki_dir.join("rejected").display(),
                cfg.pki_dir.join("trusted").display()
            );
        }
        let lower = e.to_ascii_lowercase();
        if lower.contains("matching endpoint") || e.contains("BadSecurityPolicyRejected") {
            return format!(
                "the server offers no endpoint with security_policy = {:?} and security_mode = {:?}: {e}",
                cfg.security_policy, cfg.security_mode
            );
        }
        e.to_owned()
    }

    /// Creates the subscription and its monitored items on `session`. An item the server
    /// refuses is logged and counted; the others still run.
    async fn subscribe(
        cfg: &OpcuaSourceConfig,
        index: usize,
        session: &Arc<Session>,
        stats: &Arc<OpcuaStats>,
        tx: &mpsc::Sender<Record>,
    ) -> Result<(), String> {
        let cb_stats = stats.clone();
        let cb_tx = tx.clone();
        let items = cfg.items.clone();
        let key = cfg.key.clone();
        let callback = DataChangeCallback::new(move |dv: DataValue, item: &MonitoredItem| {
            on_change(&items, &key, &cb_stats, &cb_tx, dv, item);
        });
        let id = session
            .create_subscription(cfg.publishing_interval, 30, 10, 0, 0, true, callback)
            .await
            .map_err(|e| format!("create subscription: {e}"))?;
        let requests = cfg
            .items
            .iter()
            .enumerate()
            .map(|(i, it)| request(i, it))
            .collect::<Result<Vec<_>, String>>()?;
        let created = session
            .create_monitored_items(id, TimestampsToReturn::Both, requests)
            .await
            .map_err(|e| format!("create monitored items: {e}"))?;
        for (i, c) in created.iter().enumerate() {
            let code = c.result.status_code;
            if code.is_bad() {
                if let Some(n) = stats.item_errors.get(i) {
                    n.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(source = index, item = %cfg.items[i].name, node = %cfg.items[i].node_id, status = %code, "opcua monitored item refused by the server");
            }
        }
        Ok(())
    }

    /// The create request of item `i`; its client handle is `i + 1`.
    fn request(i: usize, it: &OpcuaItem) -> Result<MonitoredItemCreateRequest, String> {
        let node = NodeId::from_str(&it.node_id)
            .map_err(|_| format!("items[{i}].node_id: {:?} is not a node id", it.node_id))?;
        let filter = match it.deadband {
            None => ExtensionObject::null(),
            Some(d) => {
                let (ty, v) = match d {
                    Deadband::Absolute(v) => (DeadbandType::Absolute, v),
                    Deadband::Percent(v) => (DeadbandType::Percent, v),
                };
                ExtensionObject::from_message(DataChangeFilter {
                    trigger: DataChangeTrigger::StatusValue,
                    deadband_type: ty as u32,
                    deadband_value: v,
                })
            }
        };
        Ok(MonitoredItemCreateRequest {
            item_to_monitor: ReadValueId::from(node),
            monitoring_mode: MonitoringMode::Reporting,
            requested_parameters: MonitoringParameters {
                client_handle: u32::try_from(i + 1).unwrap_or(u32::MAX),
                sampling_interval: it.sampling_interval.as_secs_f64() * 1000.0,
                filter,
                queue_size: it.queue_size,
                discard_oldest: true,
            },
        })
    }

    /// The client's callback: one change becomes one record in the queue.
    fn on_change(
        items: &[OpcuaItem],
        key: &str,
        stats: &OpcuaStats,
        tx: &mpsc::Sender<Record>,
        dv: DataValue,
        item: &MonitoredItem,
    ) {
        stats.changes.fetch_add(1, Ordering::Relaxed);
        let i = (item.client_handle() as usize).wrapping_sub(1);
        let Some(it) = items.get(i) else {
            return;
        };
        let value = match dv.status {
            Some(s) if s.is_bad() => None,
            _ => dv.value.as_ref().and_then(value_of),
        };
        let Some(value) = value else {
            stats.item_errors[i].fetch_add(1, Ordering::Relaxed);
            tracing::debug!(item = %it.name, status = %dv.status.unwrap_or(StatusCode::Good), "opcua value not stored");
            return;
        };
        let ts = dv
            .source_timestamp
            .or(dv.server_timestamp)
            .map(time_ns)
            .unwrap_or_else(now_ns);
        let record = Record {
            key: key.to_owned(),
            tags: it.tags.clone(),
            ts,
            fields: vec![(it.name.clone(), value)],
        };
        if tx.try_send(record).is_err() {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drains the queue into the log in batches.
    async fn write(
        stream: String,
        index: usize,
        ingest: Ingest,
        stats: Arc<OpcuaStats>,
        mut rx: mpsc::Receiver<Record>,
    ) {
        let mut batch = Vec::with_capacity(BATCH_MAX);
        while rx.recv_many(&mut batch, BATCH_MAX).await > 0 {
            let n = batch.len() as u64;
            match ingest.ingest(&stream, std::mem::take(&mut batch)).await {
                Ok(_) => {
                    stats.records.fetch_add(n, Ordering::Relaxed);
                }
                Err(e) => {
                    stats.refused_records.fetch_add(n, Ordering::Relaxed);
                    tracing::warn!(source = index, stream = %stream, error = %e, "opcua records refused by the log");
                }
            }
        }
    }

    /// A value's field, when it has a field type: numbers, booleans, strings, byte strings,
    /// localized text and times (ns since the Unix epoch).
    pub fn value_of(v: &Variant) -> Option<Value> {
        Some(match v {
            Variant::Boolean(b) => Value::Bool(*b),
            Variant::SByte(n) => Value::I64((*n).into()),
            Variant::Byte(n) => Value::I64((*n).into()),
            Variant::Int16(n) => Value::I64((*n).into()),
            Variant::UInt16(n) => Value::I64((*n).into()),
            Variant::Int32(n) => Value::I64((*n).into()),
            Variant::UInt32(n) => Value::I64((*n).into()),
            Variant::Int64(n) => Value::I64(*n),
            Variant::UInt64(n) => match i64::try_from(*n) {
                Ok(n) => Value::I64(n),
                Err(_) => Value::F64(*n as f64),
            },
            Variant::Float(f) => Value::F64((*f).into()),
            Variant::Double(f) => Value::F64(*f),
            Variant::String(s) => Value::Str(s.as_ref().to_owned()),
            Variant::ByteString(b) => Value::Bytes(b.value.clone().unwrap_or_default()),
            Variant::LocalizedText(t) => Value::Str(t.text.as_ref().to_owned()),
            Variant::DateTime(t) => Value::I64(time_ns(**t)),
            Variant::StatusCode(c) => Value::I64(c.bits().into()),
            _ => return None,
        })
    }

    /// An OPC UA time as ns since the Unix epoch (saturating far outside 1678..2262).
    pub fn time_ns(t: DateTime) -> i64 {
        t.ticks()
            .saturating_sub(UNIX_EPOCH_TICKS)
            .saturating_mul(100)
    }
}

#[cfg(all(test, feature = "opcua"))]
mod tests {
    use ::opcua::types::{DateTime, Variant};
    use sync::Value;

    use super::{time_ns, value_of};

    #[test]
    fn values_keep_their_kind() {
        assert_eq!(value_of(&Variant::Boolean(true)), Some(Value::Bool(true)));
        assert_eq!(value_of(&Variant::Int16(-3)), Some(Value::I64(-3)));
        assert_eq!(value_of(&Variant::UInt32(7)), Some(Value::I64(7)));
        assert_eq!(
            value_of(&Variant::UInt64(u64::MAX)),
            Some(Value::F64(u64::MAX as f64))
        );
        assert_eq!(value_of(&Variant::Float(1.5)), Some(Value::F64(1.5)));
        assert_eq!(value_of(&Variant::Double(-2.25)), Some(Value::F64(-2.25)));
        assert_eq!(
            value_of(&Variant::String("on".into())),
            Some(Value::Str("on".into()))
        );
        assert_eq!(value_of(&Variant::Empty), None);
    }

    #[test]
    fn times_are_unix_nanoseconds() {
        let unix = DateTime::parse_from_rfc3339("2023-11-14T22:13:20.123Z").unwrap();
        assert_eq!(time_ns(unix), 1_700_000_000_123_000_000);
    }
}
