//! The MQTT source: subscribes on a local broker with a persistent session and QoS 1 (or 2),
//! turns each PUBLISH into records, appends them durably, and only then acknowledges.
//!
//! `mqtts://host[:8883]` connects over TLS (rumqttc's rustls transport with the ring provider,
//! [`tls_client_config`]): `tls_ca` is the CA the broker's certificate must chain to (its name
//! must match the URL's host), and `tls_cert` / `tls_key` a client certificate for brokers that
//! require one. Tested against mosquitto with `require_certificate true` in `tests/mqtt_tls.rs`.
//!
//! # Flow and backpressure
//!
//! One task drives the rumqttc event loop and pushes each PUBLISH, tagged with the client of
//! the connection it came on, into a bounded channel. One writer task takes whatever is queued
//! (up to [`BATCH_MESSAGES_MAX`]), appends it as one atomic batch through
//! [`Ingest::ingest`](crate::http::Ingest::ingest), waits for durability, and then sends the
//! PUBACKs in the order the messages arrived (MQTT 3.1.1 §4.6 requires acks in receive order).
//!
//! The acks go back to the event loop task over a channel of this connection's, and that task
//! writes them straight onto the connection before it polls again, and whenever it would
//! otherwise wait. They do not go through rumqttc's request channel: its event loop reads up to
//! ten packets per turn but takes one request, so under a broker that sends faster than that
//! (one that ignores `max_inflight_messages`, or has it at 0) queued acks fell behind, the
//! request channel filled, the writer waited on it while the event loop task waited on the
//! writer, and the source stopped for good.
//! When storage is slow, the channel fills, the event loop task stops reading the socket, and the
//! broker stops sending once its inflight window (`max_inflight_messages`) is full of unacked
//! messages: memory stays bounded and nothing is lost, because the broker holds the rest.
//!
//! Acks are manual (`set_manual_acks(true)`): a PUBACK never goes out for a message that is not
//! durable. Each connection gets its own client and event loop; when a connection ends both are
//! dropped, so an ack the writer sends for a message of an old connection goes into a closed
//! channel and is never sent on a new connection, where its packet id could name another message.
//!
//! # Mapping
//!
//! - key and tags: with `topic_template` (such as `sensors/{device}/{sensor}`), each capture
//!   takes one non-empty level and becomes a tag (`device=dev7`, `sensor=temp`); the key is
//!   [`sync::record::key_from_tags`] of the record's tags (`device=dev7/sensor=temp`, the same
//!   whatever the captures' order). A line-protocol payload's own tags are kept, a capture
//!   replacing a tag of its name. A template of literals only captures nothing and keeps the
//!   topic as the key. Without a template: the topic (JSON) or the line's tags (line protocol).
//! - a topic that does not match the template is counted in
//!   `tributary_edge_mqtt_topic_mismatches_total` and logged as a WARN naming the topic and
//!   the template, at most once per [`MISMATCH_WARN_EVERY`] per source with the number held
//!   back since ([`RateLimit`]). `unmatched = "drop"` (the default) acks it and stores nothing;
//!   `"store"` stores it keyed by the whole topic with no tags (line protocol: the line's key).
//! - `_topic`: a string field holding the original topic, so the hub can republish on it (the
//!   one `_` field the hub keeps as a tier-2 column). `_mqtt_digest` (below) is the only other
//!   field the source adds; the hub leaves it out of tier 2. Tags and the unmatched policy add
//!   no field.
//! - A scalar JSON payload (a number, `true`/`false` or a string, such as `72.5` or `"on"`), or
//!   plain text that reads as a finite number (`+7`), is one field named by `value_field`
//!   (default `value`), typed as in objects (by the same parser). `null` is a bad payload. It
//!   carries no event time: with `ts_field` set, `ts_invalid` decides as for a missing one.
//! - Otherwise JSON payloads must be one object. Nested objects flatten into `parent.child` names in one
//!   pass ([`super::flatten`]); arrays are kept as their JSON text; `null` is skipped; fields
//!   come in name order (of two equal names the first wins); integers stay `i64`, other numbers
//!   `f64`. A payload over `ingest.fields_per_record_max` fields, or with a top-level name
//!   starting with `_` (reserved for the agent's own fields), is a bad payload (below); so is a
//!   line-protocol payload with such a field.
//!   `ts_field` (a flattened name) gives the event time in `ts_unit`; it is removed from the
//!   fields. Missing or unreadable timestamps are counted and get the receive time.
//! - Line protocol payloads may hold several lines; the measurement name is ignored (the
//!   source's `stream` decides).
//! - A payload that does not parse is counted in `tributary_edge_mqtt_bad_payloads_total`,
//!   logged, and acked without storing anything: redelivering it would never succeed.
//!
//! # Duplicates after a crash
//!
//! If the agent dies after a batch became durable but before its PUBACKs left, the broker
//! redelivers those messages with DUP set (same packet id, topic and payload) when the
//! persistent session resumes. The agent recognises them with a 64-bit FNV-1a digest of
//! (topic, payload, packet id), which it stores **inside the first record of each message** as
//! the `i64` field `_mqtt_digest`. Storing it in the record makes it durable atomically with the
//! data: there is no side file to keep in step, and no window where the data is durable but the
//! digest is not. At start-up the writer reads the digests of the stream's last `dedupe_window`
//! records back from the log; at run time it adds each appended digest. A message with DUP set
//! whose digest is in that set is acked and not stored again
//! (`tributary_edge_mqtt_duplicates_dropped_total`); a DUP message whose digest is not there was
//! never stored (the crash came before the append) and is stored normally.
//!
//! Limits:
//! - Only messages with DUP set are checked; a broker that redelivers without DUP would
//!   produce duplicates (mosquitto sets DUP on redelivery).
//! - The window counts records of the stream, not messages: if more than `dedupe_window`
//!   records (default 65,536, every packet id) were appended to the stream after the message, a
//!   redelivery of it is stored again. The broker's inflight window must stay well below it.
//! - Two different messages with the same topic, payload and packet id, the second one
//!   redelivered with DUP, would be taken for one: the second is dropped. That needs the broker
//!   to reuse the packet id for an identical payload within the window and then to redeliver it.
//! - If retention deletes the segments holding the window before a restart, those digests are
//!   gone; that only matters if the broker still has the messages inflight, which it cannot have
//!   for longer than the agent was down plus one inflight window.
//! - Each message costs one extra `i64` field in the log.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rumqttc::{
    AsyncClient, Event, EventLoop, MqttOptions, Outgoing, Packet, PubAck, PubRec, Publish, QoS,
    SubscribeFilter, TlsConfiguration, Transport,
};
use sync::block::{DecodeLimits, decode_block};
use sync::parse::{ParseOptions, parse_line_protocol};
use sync::record::key_from_tags;
use sync::{Record, Value};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use super::SourcesState;
use crate::config::{MqttSourceConfig, MqttUnmatched, PayloadFormat, TsUnit};
use crate::http::ingest::RESERVED_PREFIX;
use crate::http::{Ingest, now_ns};
use crate::log::AppendError;

/// The field holding the original topic.
pub const TOPIC_FIELD: &str = "_topic";
/// The field holding a message's digest (see the module docs).
pub const DIGEST_FIELD: &str = "_mqtt_digest";
/// Most messages appended as one batch.
pub const BATCH_MESSAGES_MAX: usize = 1024;
/// Messages queued between the event loop task and the writer.
const CHANNEL_MESSAGES: usize = 2048;
/// rumqttc's request channel. Only the subscription goes through it; acks take the
/// connection's own ack channel (see the module docs).
const REQUEST_CHANNEL: usize = 16;
/// Largest incoming packet accepted.
const PACKET_BYTES_MAX: usize = 1 << 20;

/// Counters of one MQTT source, shown on `/metrics`.
#[derive(Debug, Default)]
pub struct MqttStats {
    pub received: AtomicU64,
    /// PUBACKs and PUBRECs written onto the connection and flushed.
    pub acks_sent: AtomicU64,
    pub dup_received: AtomicU64,
    pub duplicates_dropped: AtomicU64,
    pub records: AtomicU64,
    pub bad_payloads: AtomicU64,
    pub topic_mismatches: AtomicU64,
    pub bad_timestamps: AtomicU64,
    /// Sparkplug (`format = "sparkplug"`, see `sources::sparkplug`): rebirth requests sent.
    pub spb_rebirths_requested: AtomicU64,
    /// Sparkplug: seq gaps recorded.
    pub spb_seq_gaps: AtomicU64,
    /// Sparkplug: nodes and devices marked offline by a matching DEATH.
    pub spb_deaths: AtomicU64,
    /// Sparkplug: DEATHs ignored as stale (no live BIRTH they match).
    pub spb_stale_deaths: AtomicU64,
    /// Sparkplug: DATA and DBIRTH messages dropped for lack of BIRTH state.
    pub spb_dropped_messages: AtomicU64,
    /// Sparkplug: metrics whose alias or name the BIRTH did not hold.
    pub spb_unknown_metrics: AtomicU64,
    /// Sparkplug: DataSet and Template metrics, not stored.
    pub spb_skipped_metrics: AtomicU64,
    /// Sparkplug: metrics whose value did not fit their datatype.
    pub spb_bad_metrics: AtomicU64,
}

/// One configured MQTT subscription set and where its records go.
pub struct MqttSource {
    cfg: MqttSourceConfig,
    index: usize,
    host: String,
    port: u16,
    client_id: String,
    ingest: Ingest,
    state: Arc<SourcesState>,
    stats: Arc<MqttStats>,
    /// Set for `mqtts://`: built once from the PEM files at start-up.
    tls: Option<Arc<rustls::ClientConfig>>,
}

/// The rustls client configuration for `mqtts://` (ring provider, TLS 1.2 and 1.3): the
/// broker's certificate must chain to `tls_ca` and name the URL's host; a client certificate is
/// presented when configured.
pub fn tls_client_config(t: &crate::config::MqttTlsConfig) -> Result<rustls::ClientConfig, String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
    let certs = |p: &Path| -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
        let pem = read(p)?;
        let certs = rustls_pemfile::certs(&mut &pem[..])
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", p.display()))?;
        if certs.is_empty() {
            return Err(format!("{}: no PEM certificate in it", p.display()));
        }
        Ok(certs)
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(&t.ca)? {
        roots
            .add(c)
            .map_err(|e| format!("{}: {e}", t.ca.display()))?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots);
    match &t.client {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain = certs(cert)?;
            let pem = read(key)?;
            let key_der = rustls_pemfile::private_key(&mut &pem[..])
                .map_err(|e| format!("{}: {e}", key.display()))?
                .ok_or_else(|| format!("{}: no PEM private key in it", key.display()))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| format!("{}: {e}", cert.display()))
        }
    }
}

/// A received message and the ack channel of the connection it came on (to ack it there).
struct Incoming {
    publish: Publish,
    acks: mpsc::UnboundedSender<Out>,
    received_ns: i64,
}

/// What the writer hands back to a connection: an ack, or a QoS 0 message to publish
/// (a Sparkplug rebirth request), written straight onto the connection like the acks.
#[derive(Debug)]
enum Out {
    Ack(Ack),
    #[cfg_attr(not(feature = "sparkplug"), allow(dead_code))]
    Publish(Publish),
}

impl Out {
    fn packet(self) -> Packet {
        match self {
            Out::Ack(a) => a.packet(),
            Out::Publish(p) => Packet::Publish(p),
        }
    }
}

/// A PUBACK (QoS 1) or PUBREC (QoS 2) owed for a durable message.
#[derive(Debug, Clone, Copy)]
struct Ack {
    pkid: u16,
    qos: QoS,
}

impl Ack {
    fn packet(self) -> Packet {
        match self.qos {
            QoS::ExactlyOnce => Packet::PubRec(PubRec::new(self.pkid)),
            _ => Packet::PubAck(PubAck::new(self.pkid)),
        }
    }
}

/// Writes `first` and every ack queued behind it onto the connection, in order, and flushes.
async fn send_acks(
    eventloop: &mut EventLoop,
    first: Option<Out>,
    acks: &mut mpsc::UnboundedReceiver<Out>,
    stats: &MqttStats,
) -> Result<(), String> {
    let Some(network) = eventloop.network.as_mut() else {
        return Ok(()); // not connected: these acks belong to a connection that is gone
    };
    let (mut wrote, mut acked) = (false, 0);
    let mut next = first.or_else(|| acks.try_recv().ok());
    while let Some(out) = next {
        acked += u64::from(matches!(out, Out::Ack(_)));
        network
            .write(out.packet())
            .await
            .map_err(|e| format!("sending an ack: {e}"))?;
        wrote = true;
        next = acks.try_recv().ok();
    }
    if wrote {
        network
            .flush()
            .await
            .map_err(|e| format!("sending acks: {e}"))?;
        stats.acks_sent.fetch_add(acked, Ordering::Relaxed);
    }
    Ok(())
}

impl MqttSource {
    /// Checks the URL and derives the client id. `index` counts MQTT sources only.
    pub fn new(
        cfg: MqttSourceConfig,
        data_dir: &Path,
        index: usize,
        ingest: Ingest,
        state: Arc<SourcesState>,
    ) -> Result<Self, String> {
        let (host, port) = parse_url(&cfg.url)?;
        let tls = match &cfg.tls {
            Some(t) => Some(Arc::new(tls_client_config(t)?)),
            None if cfg.url.starts_with("mqtts://") => {
                return Err("mqtts:// needs tls_ca".into());
            }
            None => None,
        };
        let client_id = cfg
            .client_id
            .clone()
            .unwrap_or_else(|| default_client_id(data_dir, index));
        let stats = state
            .mqtt_stats(index)
            .cloned()
            .unwrap_or_else(|| Arc::new(MqttStats::default()));
        Ok(MqttSource {
            cfg,
            index,
            host,
            port,
            client_id,
            ingest,
            state,
            stats,
            tls,
        })
    }

    /// For a Sparkplug host: sets the STATE will on `opts` and returns the STATE topic and
    /// the online payload to publish once subscribed, both with this connection's timestamp.
    fn sparkplug_state(&self, opts: &mut MqttOptions) -> Option<(String, String)> {
        #[cfg(feature = "sparkplug")]
        if let Some(spb) = &self.cfg.sparkplug {
            use super::sparkplug;
            let ts = crate::http::status::now_ms();
            opts.set_last_will(sparkplug::state_will(&spb.host_id, ts));
            let topic = sparkplug::state_topic(&spb.host_id);
            return Some((topic, sparkplug::state_payload(true, ts)));
        }
        let _ = opts;
        None
    }

    /// The client id used with the broker.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Runs until the log closes: reconnects on its own, with a capped backoff.
    pub async fn run(self) {
        let (tx, rx) = mpsc::channel(CHANNEL_MESSAGES);
        let writer = Writer {
            mapper: Mapper::new(&self.cfg, self.stats.clone())
                .with_fields_max(self.ingest.log().config().fields_per_record_max),
            stream: self.cfg.stream.clone(),
            ingest: self.ingest.clone(),
            stats: self.stats.clone(),
            seen: Dedupe::load(&self.ingest, &self.cfg.stream, self.cfg.dedupe_window),
            #[cfg(feature = "sparkplug")]
            sparkplug: self.cfg.sparkplug.as_ref().map(|spb| {
                let cfg = super::sparkplug::HostConfig {
                    rebirth_interval_ns: i64::try_from(spb.rebirth_interval.as_nanos())
                        .unwrap_or(i64::MAX),
                    fields_max: self.ingest.log().config().fields_per_record_max,
                };
                super::sparkplug::Host::new(cfg, self.stats.clone())
            }),
        };
        let writer = tokio::spawn(writer.run(rx));
        let qos = if self.cfg.qos == 2 {
            QoS::ExactlyOnce
        } else {
            QoS::AtLeastOnce
        };
        let filters: Vec<SubscribeFilter> = self
            .cfg
            .topics
            .iter()
            .map(|t| SubscribeFilter::new(t.clone(), qos))
            .collect();
        info!(
            source = self.index,
            broker = %format!("{}:{}", self.host, self.port),
            client_id = %self.client_id,
            "mqtt source starting"
        );
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut opts = MqttOptions::new(self.client_id.clone(), self.host.clone(), self.port);
            opts.set_clean_session(false)
                .set_manual_acks(true)
                .set_keep_alive(Duration::from_secs(30))
                .set_max_packet_size(PACKET_BYTES_MAX, PACKET_BYTES_MAX);
            if let Some(tls) = &self.tls {
                opts.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
                    tls.clone(),
                )));
            }
            let state_birth = self.sparkplug_state(&mut opts);
            let (client, eventloop) = AsyncClient::new(opts, REQUEST_CHANNEL);
            let outcome = self
                .connection(client, eventloop, &filters, &tx, state_birth)
                .await;
            self.state.set_mqtt_ready(self.index, false);
            match outcome {
                Connection::WriterGone => {
                    let _ = writer.await;
                    return;
                }
                Connection::Lost { was_up, why } => {
                    self.state.mqtt_lost(self.index, &why);
                    if was_up {
                        backoff = Duration::from_millis(100);
                    }
                    warn!(source = self.index, error = %why, retry_in = ?backoff, "mqtt connection lost");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Drives one connection until it fails.
    async fn connection(
        &self,
        client: AsyncClient,
        mut eventloop: EventLoop,
        filters: &[SubscribeFilter],
        tx: &mpsc::Sender<Incoming>,
        state_birth: Option<(String, String)>,
    ) -> Connection {
        let mut was_up = false;
        // Acks for this connection only: when it ends the receiver goes, and an ack the writer
        // sends for one of its messages fails there instead of reaching a new connection, where
        // its packet id could name another message.
        let (ack_tx, mut ack_rx) = mpsc::unbounded_channel::<Out>();
        let mut first_ack = None;
        // Requests queued in rumqttc's request channel and not yet on the wire: the
        // subscription, then a Sparkplug host's STATE. While any is pending the poll is not
        // raced against the acks, so a poll cancelled while it waits loses no request.
        let mut requests_pending = 1usize;
        loop {
            if let Err(why) =
                send_acks(&mut eventloop, first_ack.take(), &mut ack_rx, &self.stats).await
            {
                return Connection::Lost { was_up, why };
            }
            let polled = if requests_pending == 0 {
                tokio::select! {
                    biased;
                    e = eventloop.poll() => Some(e),
                    ack = ack_rx.recv() => {
                        first_ack = ack;
                        None
                    }
                }
            } else {
                Some(eventloop.poll().await)
            };
            let event = match polled {
                None => continue,
                Some(Ok(e)) => e,
                Some(Err(e)) => {
                    return Connection::Lost {
                        was_up,
                        why: e.to_string(),
                    };
                }
            };
            match event {
                Event::Incoming(Packet::ConnAck(ack)) => {
                    was_up = true;
                    info!(
                        source = self.index,
                        session_present = ack.session_present,
                        "mqtt connected"
                    );
                    // Subscribing again on a resumed session is harmless and keeps the filters
                    // in step with the config.
                    if let Err(e) = client.subscribe_many(filters.to_vec()).await {
                        return Connection::Lost {
                            was_up,
                            why: e.to_string(),
                        };
                    }
                }
                Event::Incoming(Packet::SubAck(ack)) => {
                    let refused: Vec<&str> = ack
                        .return_codes
                        .iter()
                        .zip(filters)
                        .filter(|(c, _)| matches!(c, rumqttc::SubscribeReasonCode::Failure))
                        .map(|(_, f)| f.path.as_str())
                        .collect();
                    if refused.is_empty() {
                        info!(source = self.index, topics = %crate::logging::List(&self.cfg.topics), "mqtt subscriptions granted");
                        if let Some((topic, online)) = &state_birth {
                            // Sparkplug 3.0: the host's STATE goes out once it is subscribed.
                            requests_pending += 1;
                            if let Err(e) = client
                                .publish(topic.clone(), QoS::AtLeastOnce, true, online.clone())
                                .await
                            {
                                return Connection::Lost {
                                    was_up,
                                    why: e.to_string(),
                                };
                            }
                        }
                        self.state.set_mqtt_ready(self.index, true);
                    } else {
                        error!(source = self.index, refused = %crate::logging::List(&refused), "the broker refused subscriptions: check its ACLs");
                    }
                }
                Event::Outgoing(Outgoing::Subscribe(_) | Outgoing::Publish(_)) => {
                    requests_pending = requests_pending.saturating_sub(1);
                }
                Event::Incoming(Packet::Publish(publish)) => {
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                    if publish.dup {
                        self.stats.dup_received.fetch_add(1, Ordering::Relaxed);
                    }
                    let msg = Incoming {
                        publish,
                        acks: ack_tx.clone(),
                        received_ns: now_ns(),
                    };
                    // Waiting for room is the backpressure: the socket is not read meanwhile.
                    // Acks the writer hands back during the wait still go out.
                    let permit = loop {
                        tokio::select! {
                            p = tx.reserve() => break p,
                            ack = ack_rx.recv() => {
                                if let Err(why) = send_acks(&mut eventloop, ack, &mut ack_rx, &self.stats).await {
                                    return Connection::Lost { was_up, why };
                                }
                            }
                        }
                    };
                    match permit {
                        Ok(p) => p.send(msg),
                        Err(_) => return Connection::WriterGone,
                    }
                }
                _ => {}
            }
        }
    }
}

enum Connection {
    WriterGone,
    Lost { was_up: bool, why: String },
}

/// Appends batches and acks them in order.
struct Writer {
    mapper: Mapper,
    stream: String,
    ingest: Ingest,
    stats: Arc<MqttStats>,
    seen: Dedupe,
    /// The Sparkplug host state, for `format = "sparkplug"`.
    #[cfg(feature = "sparkplug")]
    sparkplug: Option<super::sparkplug::Host>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Incoming>) {
        let mut batch: Vec<Incoming> = Vec::with_capacity(BATCH_MESSAGES_MAX);
        while rx.recv_many(&mut batch, BATCH_MESSAGES_MAX).await > 0 {
            if !self.write(&batch).await {
                return;
            }
            // Acks in receive order, only now that the batch is durable. An ack for a message of
            // a connection that has ended fails here, harmlessly, and is never sent.
            for m in batch.drain(..) {
                if m.publish.qos != QoS::AtMostOnce {
                    let _ = m.acks.send(Out::Ack(Ack {
                        pkid: m.publish.pkid,
                        qos: m.publish.qos,
                    }));
                }
            }
        }
    }

    /// Maps and appends one batch; false when the log has closed.
    async fn write(&mut self, batch: &[Incoming]) -> bool {
        let mut records = Vec::with_capacity(batch.len());
        let mut digests = Vec::with_capacity(batch.len());
        let mut dropped = 0u64;
        for m in batch {
            let digest = digest(&m.publish);
            if m.publish.dup && (self.seen.contains(digest) || digests.contains(&digest)) {
                dropped += 1;
                continue;
            }
            let before = records.len();
            self.map(m, digest, &mut records);
            if records.len() > before {
                digests.push(digest);
            }
        }
        let dup = batch.iter().filter(|m| m.publish.dup).count();
        if dup > 0 {
            self.stats
                .duplicates_dropped
                .fetch_add(dropped, Ordering::Relaxed);
            // One line per batch with redeliveries: they happen after reconnects only.
            info!(stream = %self.stream, dup, dropped, "mqtt: redeliveries received; those already stored are not stored again");
        }
        if records.is_empty() {
            return true;
        }
        let count = records.len() as u64;
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.ingest.ingest(&self.stream, records.clone()).await {
                Ok(_) => break,
                Err(AppendError::Closed) => return false,
                Err(
                    e @ (AppendError::RecordTooLarge { .. }
                    | AppendError::TooManyFields { .. }
                    | AppendError::Unsealable { .. }
                    | AppendError::BadKey { .. }),
                ) => {
                    // One message can never be stored (too large, over the field limit after
                    // the stream's filters, or a key the hub refuses, as a topic with an empty
                    // level gives): store the others one by one, count the rest.
                    warn!(stream = %self.stream, error = %e, "mqtt: a batch holds an oversize record; storing message by message");
                    return self.write_each(records).await;
                }
                Err(e) => {
                    // Full under `block`, or a storage failure: hold the batch (and so the
                    // broker's inflight window) and retry; nothing is acked meanwhile.
                    debug!(stream = %self.stream, error = %e, "mqtt: append failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
        self.stats.records.fetch_add(count, Ordering::Relaxed);
        for d in digests {
            self.seen.insert(d);
        }
        true
    }

    /// Appends the records of one message: through the Sparkplug host for such a source
    /// (sending the rebirth requests it asks for on the message's connection), else the mapper.
    fn map(&mut self, m: &Incoming, digest: u64, records: &mut Vec<Record>) {
        #[cfg(feature = "sparkplug")]
        if let Some(host) = &mut self.sparkplug {
            use super::sparkplug;
            let mut out = sparkplug::Output::default();
            host.handle(
                &m.publish.topic,
                &m.publish.payload,
                m.received_ns,
                &mut out,
            );
            if let Some(first) = out.records.first_mut() {
                set_field(&mut first.fields, DIGEST_FIELD, Value::I64(digest as i64));
            }
            records.extend(out.records);
            let now_ms = u64::try_from(m.received_ns / 1_000_000).unwrap_or_default();
            for (group, node) in out.rebirths {
                let _ = m.acks.send(Out::Publish(sparkplug::rebirth_command(
                    &group, &node, now_ms,
                )));
            }
            return;
        }
        self.mapper.map(&m.publish, m.received_ns, digest, records);
    }

    /// The fallback for a batch the log refused as a whole: each message's records alone.
    async fn write_each(&mut self, records: Vec<Record>) -> bool {
        let mut groups: Vec<Vec<Record>> = Vec::new();
        for r in records {
            let starts = r.fields.iter().any(|(n, _)| n == DIGEST_FIELD);
            match groups.last_mut() {
                Some(g) if !starts => g.push(r),
                _ => groups.push(vec![r]),
            }
        }
        for g in groups {
            let digest = g[0].fields.iter().find_map(|(n, v)| match (n.as_str(), v) {
                (DIGEST_FIELD, Value::I64(d)) => Some(*d as u64),
                _ => None,
            });
            let n = g.len() as u64;
            match self.ingest.ingest(&self.stream, g).await {
                Ok(_) => {
                    self.stats.records.fetch_add(n, Ordering::Relaxed);
                    if let Some(d) = digest {
                        self.seen.insert(d);
                    }
                }
                Err(AppendError::Closed) => return false,
                Err(e) => {
                    self.stats.bad_payloads.fetch_add(1, Ordering::Relaxed);
                    warn!(stream = %self.stream, error = %e, "mqtt: message refused by the log; acked without storing");
                }
            }
        }
        true
    }
}

/// The digests of recently stored messages, oldest first.
struct Dedupe {
    set: HashSet<u64>,
    order: VecDeque<u64>,
    cap: usize,
}

impl Dedupe {
    fn new(cap: usize) -> Self {
        Dedupe {
            set: HashSet::new(),
            order: VecDeque::new(),
            cap,
        }
    }

    /// Reads the digests of the stream's last `cap` records back from the log.
    fn load(ingest: &Ingest, stream: &str, cap: usize) -> Self {
        let mut found: Vec<u64> = Vec::new();
        let log = ingest.log();
        let mut held = log.epochs_held(stream);
        held.reverse();
        let mut remaining = cap as u64;
        let mut per_epoch: Vec<Vec<u64>> = Vec::new();
        for (epoch, first, last) in held {
            if remaining == 0 {
                break;
            }
            let from = first.max(last.saturating_sub(remaining - 1));
            remaining -= (last + 1).saturating_sub(from).min(remaining);
            let mut digests = Vec::new();
            let mut after = from.saturating_sub(1);
            loop {
                let blocks = match log.read_blocks(stream, epoch, after, 4 << 20) {
                    Ok(b) => b,
                    Err(e) => {
                        warn!(stream, error = %e, "mqtt: could not read recent records for duplicate detection");
                        break;
                    }
                };
                let Some(last_block) = blocks.last() else {
                    break;
                };
                let next_after = last_block.header.last_seq();
                if next_after <= after {
                    break;
                }
                after = next_after;
                for b in blocks {
                    let Ok(block) = decode_block(&b.bytes, &DecodeLimits::default()) else {
                        continue;
                    };
                    for r in &block.records {
                        if let Some(d) = r.fields.iter().find_map(|(n, v)| match (n.as_str(), v) {
                            (DIGEST_FIELD, Value::I64(d)) => Some(*d as u64),
                            _ => None,
                        }) {
                            digests.push(d);
                        }
                    }
                }
            }
            per_epoch.push(digests);
        }
        for digests in per_epoch.into_iter().rev() {
            found.extend(digests);
        }
        let mut dedupe = Dedupe::new(cap);
        for d in found {
            dedupe.insert(d);
        }
        info!(
            stream,
            digests = dedupe.order.len(),
            "mqtt: recent message digests loaded for duplicate detection"
        );
        dedupe
    }

    fn contains(&self, d: u64) -> bool {
        self.set.contains(&d)
    }

    fn insert(&mut self, d: u64) {
        if self.set.insert(d) {
            self.order.push_back(d);
        }
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
    }
}

/// FNV-1a 64 of (topic, payload, packet id): stable across builds and restarts, unlike std's
/// hasher, because it is stored in the log.
pub fn digest(p: &Publish) -> u64 {
    let mut h = Fnv::new();
    h.write(p.topic.as_bytes());
    h.write(&[0xff]);
    h.write(&p.payload);
    h.write(&p.pkid.to_be_bytes());
    h.0
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The default client id: derived from the data directory, so it is the same across restarts
/// (the broker keeps the session under it) and differs between agents on one broker.
pub fn default_client_id(data_dir: &Path, index: usize) -> String {
    let dir = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_owned());
    let mut h = Fnv::new();
    h.write(dir.as_os_str().as_encoded_bytes());
    format!("trb-{:016x}-{index}", h.0)
}

/// `mqtt://host[:port]` (default 1883) or `mqtts://host[:port]` (default 8883) into host and port.
fn parse_url(url: &str) -> Result<(String, u16), String> {
    let (rest, default_port) = match (url.strip_prefix("mqtt://"), url.strip_prefix("mqtts://")) {
        (Some(r), _) => (r, 1883),
        (_, Some(r)) => (r, 8883),
        _ => {
            return Err(format!(
                "expected mqtt://host:port or mqtts://host:port, found {url:?}"
            ));
        }
    };
    let rest = rest.trim_end_matches('/');
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("bad port in {url:?}"))?,
        ),
        None => (rest, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("no host in {url:?}"));
    }
    Ok((host.to_owned(), port))
}

/// Turns messages into records, per the source's config.
pub struct Mapper {
    format: PayloadFormat,
    template: Option<Vec<TemplateLevel>>,
    /// `topic_template` as written, for the mismatch warning.
    template_text: String,
    unmatched: MqttUnmatched,
    /// `value_field`: the field a scalar payload becomes.
    value_field: String,
    ts_field: Option<String>,
    ts_unit: TsUnit,
    /// `ts_invalid = "receive_time"`: see [`MqttSourceConfig`].
    ts_invalid_receive_time: bool,
    stats: Arc<MqttStats>,
    /// `ingest.fields_per_record_max`: a payload over it is refused as a bad payload.
    fields_max: usize,
    /// The mismatch warning, at most once per [`MISMATCH_WARN_EVERY`].
    mismatch_warn: Mutex<RateLimit>,
}

enum TemplateLevel {
    Literal(String),
    /// `{name}`: the level becomes the tag `name`.
    Capture(String),
}

/// Shortest time between two mismatch warnings of one source.
pub const MISMATCH_WARN_EVERY: Duration = Duration::from_secs(10);

/// Lets one event through per period and counts the ones held back meanwhile.
#[derive(Debug)]
pub struct RateLimit {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimit {
    pub fn new(every: Duration) -> Self {
        RateLimit {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// An event at `now`: `Some(held back since the last one let through)` when this one may
    /// go out, `None` when it is held back (and counted).
    pub fn hit(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

impl Mapper {
    pub fn new(cfg: &MqttSourceConfig, stats: Arc<MqttStats>) -> Self {
        let template = cfg.topic_template.as_ref().map(|t| {
            t.split('/')
                .map(|l| {
                    if l.len() > 2 && l.starts_with('{') && l.ends_with('}') {
                        TemplateLevel::Capture(l[1..l.len() - 1].to_owned())
                    } else {
                        TemplateLevel::Literal(l.to_owned())
                    }
                })
                .collect()
        });
        Mapper {
            format: cfg.format,
            template,
            template_text: cfg.topic_template.clone().unwrap_or_default(),
            unmatched: cfg.unmatched,
            value_field: cfg.value_field.clone(),
            ts_field: cfg.ts_field.clone(),
            ts_unit: cfg.ts_unit,
            ts_invalid_receive_time: cfg.ts_invalid_receive_time,
            stats,
            fields_max: crate::log::FIELDS_PER_RECORD_DEFAULT,
            mismatch_warn: Mutex::new(RateLimit::new(MISMATCH_WARN_EVERY)),
        }
    }

    /// The mapper with another per-record field limit (`ingest.fields_per_record_max`).
    pub fn with_fields_max(mut self, fields_max: usize) -> Self {
        self.fields_max = fields_max;
        self
    }

    /// The tags the template captures from `topic`, or `None` when it does not match (each
    /// capture takes one non-empty level).
    fn captures(levels: &[TemplateLevel], topic: &str) -> Option<Vec<(String, String)>> {
        let mut tags = Vec::new();
        let mut parts = topic.split('/');
        for level in levels {
            let part = parts.next()?;
            match level {
                TemplateLevel::Literal(l) if l != part => return None,
                TemplateLevel::Literal(_) => {}
                TemplateLevel::Capture(_) if part.is_empty() || part.contains('\0') => {
                    return None;
                }
                TemplateLevel::Capture(name) => tags.push((name.clone(), part.to_owned())),
            }
        }
        match parts.next() {
            Some(_) => None,
            None => Some(tags),
        }
    }

    /// Counts and warns about a topic off the template (rate-limited); true when the message
    /// is still stored (`unmatched = "store"`).
    fn on_mismatch(&self, topic: &str) -> bool {
        self.stats.topic_mismatches.fetch_add(1, Ordering::Relaxed);
        let let_through = self
            .mismatch_warn
            .lock()
            .map(|mut w| w.hit(Instant::now()))
            .unwrap_or(None);
        if let Some(suppressed) = let_through {
            warn!(
                topic,
                template = %self.template_text,
                unmatched = ?self.unmatched,
                suppressed,
                "mqtt: topic does not match topic_template ({suppressed} more since the last warning)"
            );
        }
        self.unmatched == MqttUnmatched::Store
    }

    /// Appends the records of one message to `out`; a bad payload adds none (counted, logged),
    /// and so does a topic off the template under `unmatched = "drop"`.
    pub fn map(&self, p: &Publish, received_ns: i64, digest: u64, out: &mut Vec<Record>) {
        let tags = match self
            .template
            .as_deref()
            .map(|t| Self::captures(t, &p.topic))
        {
            None => None,
            // A template of literals only captures nothing: keyed as without one.
            Some(Some(tags)) => Some(tags).filter(|t| !t.is_empty()),
            Some(None) if self.on_mismatch(&p.topic) => None,
            Some(None) => return,
        };
        let start = out.len();
        let ok = match self.format {
            PayloadFormat::Json => self.map_json(p, tags, received_ns, out),
            PayloadFormat::Line => self.map_line(p, tags, received_ns, out),
        };
        if let Err(why) = ok {
            out.truncate(start);
            self.stats.bad_payloads.fetch_add(1, Ordering::Relaxed);
            warn!(topic = %p.topic, error = %why, "mqtt: payload not stored");
            return;
        }
        for r in &mut out[start..] {
            set_field(&mut r.fields, TOPIC_FIELD, Value::Str(p.topic.clone()));
        }
        if let Some(first) = out.get_mut(start) {
            set_field(&mut first.fields, DIGEST_FIELD, Value::I64(digest as i64));
        }
    }

    /// A scalar payload (a JSON number, bool or string, or plain text that reads as a number)
    /// as its one field, `value_field`; `None` for anything else (an object goes on to the
    /// flattener). Numbers are typed as in objects: by the same parser, on `{"v": payload}`.
    fn scalar(&self, payload: &[u8]) -> Result<Option<(String, Value)>, String> {
        let text = payload.trim_ascii();
        if text.first().is_none_or(|b| matches!(b, b'{' | b'[')) {
            return Ok(None);
        }
        match serde_json::from_slice::<serde_json::Value>(text) {
            Ok(serde_json::Value::Null) => return Err("the payload is null: no value".into()),
            Ok(_) => {
                // One scalar, checked above: wrapping it cannot add fields.
                let wrapped = [b"{\"v\":".as_slice(), text, b"}"].concat();
                let mut fields = super::flatten::flatten_json(&wrapped, self.fields_max)
                    .map_err(|e| e.to_string())?
                    .fields;
                return Ok(fields.pop().map(|(_, v)| (self.value_field.clone(), v)));
            }
            Err(_) => {}
        }
        let Ok(text) = std::str::from_utf8(text) else {
            return Ok(None);
        };
        if let Ok(i) = text.parse::<i64>() {
            return Ok(Some((self.value_field.clone(), Value::I64(i))));
        }
        match text.parse::<f64>() {
            Ok(f) if f.is_finite() => Ok(Some((self.value_field.clone(), Value::F64(f)))),
            _ => Ok(None),
        }
    }

    fn map_json(
        &self,
        p: &Publish,
        tags: Option<Vec<(String, String)>>,
        received_ns: i64,
        out: &mut Vec<Record>,
    ) -> Result<(), String> {
        let mut fields = match self.scalar(&p.payload)? {
            Some(field) => vec![field],
            None => {
                super::flatten::flatten_json(&p.payload, self.fields_max)
                    .map_err(|e| e.to_string())?
                    .fields
            }
        };
        let mut ts = received_ns;
        if let Some(name) = &self.ts_field {
            let found = fields
                .iter()
                .position(|(n, _)| n == name)
                .map(|i| fields.remove(i).1);
            let read = match &found {
                Some(v) => to_ns(v, self.ts_unit, received_ns),
                None => Err(format!("no field {name:?} (ts_field)")),
            };
            match read {
                Ok(t) => ts = t,
                Err(why) => {
                    self.stats.bad_timestamps.fetch_add(1, Ordering::Relaxed);
                    if !self.ts_invalid_receive_time {
                        return Err(format!(
                            "event time: {why} (set ts_invalid = \"receive_time\" to store \
                             such messages at their receive time)"
                        ));
                    }
                    debug!(topic = %p.topic, error = %why, "mqtt: receive time used");
                }
            }
        }
        let (key, tags) = match tags {
            Some(tags) => (key_from_tags(&tags), tags),
            None => (p.topic.clone(), Vec::new()),
        };
        out.push(Record {
            tags,
            key,
            ts,
            fields,
        });
        Ok(())
    }

    fn map_line(
        &self,
        p: &Publish,
        captured: Option<Vec<(String, String)>>,
        received_ns: i64,
        out: &mut Vec<Record>,
    ) -> Result<(), String> {
        let text = std::str::from_utf8(&p.payload).map_err(|_| "not UTF-8".to_owned())?;
        let opts = ParseOptions {
            default_ts: Some(received_ns),
            fields_max: self.fields_max,
            plausible_at: Some(received_ns),
            ..ParseOptions::default()
        };
        let lines = parse_line_protocol(text, &opts).map_err(|e| e.to_string())?;
        if lines.is_empty() {
            return Err("no lines".into());
        }
        if let Some((i, (name, _))) = lines.iter().enumerate().find_map(|(i, l)| {
            let reserved = |(n, _): &&(String, Value)| n.starts_with(RESERVED_PREFIX);
            l.record.fields.iter().find(reserved).map(|f| (i, f))
        }) {
            return Err(format!(
                "line {}: the field {name:?} is reserved: names starting with '_' are set only by the agent",
                i + 1
            ));
        }
        for l in lines {
            let mut r = l.record;
            if let Some(captured) = &captured {
                // The topic's captures join the line's tags, replacing any of the same name.
                for (name, value) in captured {
                    match r.tags.iter_mut().find(|(n, _)| n == name) {
                        Some(t) => t.1 = value.clone(),
                        None => r.tags.push((name.clone(), value.clone())),
                    }
                }
                r.key = key_from_tags(&r.tags);
            }
            out.push(r);
        }
        Ok(())
    }
}

/// Sets a field, replacing one of the same name (names are unique within a record).
fn set_field(fields: &mut Vec<(String, Value)>, name: &str, value: Value) {
    match fields.iter_mut().find(|(n, _)| n == name) {
        Some(f) => f.1 = value,
        None => fields.push((name.to_owned(), value)),
    }
}

/// A timestamp value as nanoseconds since the epoch, by the agent's one time parser
/// ([`sync::time`]): a string is RFC 3339 with `Z` or a numeric offset (whatever `unit`), a
/// number is in `unit`. A number implausible in `unit` but plausible in another, judged at
/// `now`, is an error naming that unit, as over HTTP.
pub fn to_ns(v: &Value, unit: TsUnit, now: i64) -> Result<i64, String> {
    use sync::time::{TimeUnit, likely_unit, parse_epoch_f64, parse_epoch_number, parse_rfc3339};
    let unit = match unit {
        TsUnit::S => TimeUnit::S,
        TsUnit::Ms => TimeUnit::Ms,
        TsUnit::Us => TimeUnit::Us,
        TsUnit::Ns => TimeUnit::Ns,
        TsUnit::Rfc3339 => {
            let Value::Str(s) = v else {
                return Err(format!(
                    "expected an RFC 3339 string (ts_unit = \"rfc3339\"), found {v:?}"
                ));
            };
            return parse_rfc3339(s).map_err(|e| e.to_string());
        }
    };
    match v {
        Value::Str(s) => parse_rfc3339(s).map_err(|e| e.to_string()),
        Value::I64(i) => {
            let ns = parse_epoch_number(*i, unit).map_err(|e| e.to_string())?;
            match likely_unit(*i, unit, now) {
                Some(likely) => Err(format!(
                    "{i} in {unit} (ts_unit) is {}: it looks like {likely}, set ts_unit = \"{likely}\"",
                    sync::time::format_rfc3339(ns)
                )),
                None => Ok(ns),
            }
        }
        Value::F64(f) => parse_epoch_f64(*f, unit).map_err(|e| e.to_string()),
        other => Err(format!(
            "expected a number or an RFC 3339 string, found {other:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(format: PayloadFormat) -> MqttSourceConfig {
        MqttSourceConfig {
            url: "mqtt://127.0.0.1:1883".into(),
            topics: vec!["sensors/#".into()],
            stream: "telemetry".into(),
            format,
            topic_template: Some("sensors/{device}/{sensor}".into()),
            value_field: "value".into(),
            unmatched: MqttUnmatched::Drop,
            ts_field: Some("ts".into()),
            ts_unit: TsUnit::Ms,
            ts_invalid_receive_time: false,
            client_id: None,
            qos: 1,
            dedupe_window: 16,
            tls: None,
            sparkplug: None,
        }
    }

    fn publish(topic: &str, payload: &str) -> Publish {
        Publish::new(topic, QoS::AtLeastOnce, payload.as_bytes().to_vec())
    }

    #[test]
    fn json_mapping() {
        let m = Mapper::new(&cfg(PayloadFormat::Json), Arc::default());
        let mut out = Vec::new();
        let p = publish(
            "sensors/dev7/temp",
            r#"{"ts":1500,"v":1.5,"n":{"a":2,"b":{"c":true}},"z":null,"arr":[1,2]}"#,
        );
        m.map(&p, 42, 9, &mut out);
        let r = &out[0];
        assert_eq!(r.key, "device=dev7/sensor=temp");
        assert_eq!(r.tag("device"), Some("dev7"));
        assert_eq!(r.tag("sensor"), Some("temp"));
        assert_eq!(r.ts, 1_500_000_000);
        let names: Vec<&str> = r.fields.iter().map(|(n, _)| n.as_str()).collect();
        // The payload's order, flattened as over HTTP; null is no field.
        assert_eq!(
            names,
            [
                "v",
                "n.a",
                "n.b.c",
                "arr.0",
                "arr.1",
                TOPIC_FIELD,
                DIGEST_FIELD
            ]
        );
        assert_eq!(r.fields[5].1, Value::Str("sensors/dev7/temp".into()));
        // A missing or unreadable ts refuses the message (counted twice: bad timestamp, bad
        // payload).
        for no_time in [r#"{"v":1}"#, r#"{"ts":"noon","v":1}"#] {
            m.map(&publish("sensors/a/b", no_time), 42, 9, &mut out);
        }
        assert_eq!(out.len(), 1, "never silently stored at the receive time");
        assert_eq!(m.stats.bad_timestamps.load(Ordering::Relaxed), 2);
        for bad in ["[1]", "{", "\u{1}", "null", "on"] {
            m.map(&publish("sensors/a/b", bad), 0, 0, &mut out);
        }
        assert_eq!(out.len(), 1);
        assert_eq!(m.stats.bad_payloads.load(Ordering::Relaxed), 7);
        // ts_invalid = "receive_time" stores them at the receive time, still counted.
        let mut c = cfg(PayloadFormat::Json);
        c.ts_invalid_receive_time = true;
        let m = Mapper::new(&c, Arc::default());
        m.map(&publish("sensors/a/b", r#"{"v":1}"#), 42, 9, &mut out);
        assert_eq!(out[1].ts, 42);
        assert_eq!(m.stats.bad_timestamps.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn captures_are_tags_and_the_key_is_theirs() {
        let mut c = cfg(PayloadFormat::Json);
        c.ts_field = None;
        // Captured in either order, the same tags give the same key.
        c.topic_template = Some("site/{sensor}/x/{device}".into());
        let swapped = Mapper::new(&c, Arc::default());
        let m = Mapper::new(&cfg(PayloadFormat::Json), Arc::default());
        let mut out = Vec::new();
        m.map(
            &publish("sensors/dev7/temp", r#"{"ts":1,"v":1}"#),
            0,
            1,
            &mut out,
        );
        swapped.map(&publish("site/temp/x/dev7", r#"{"v":1}"#), 0, 2, &mut out);
        let tags = vec![
            ("device".to_owned(), "dev7".to_owned()),
            ("sensor".to_owned(), "temp".to_owned()),
        ];
        assert_eq!(out[0].tags, tags);
        assert_eq!(out[0].key, key_from_tags(&tags));
        assert_eq!(out[1].key, out[0].key);
        // Values that need escaping in a key are escaped there, kept as sent in the tag.
        m.map(
            &publish("sensors/a=b/t%", r#"{"ts":1,"v":1}"#),
            0,
            3,
            &mut out,
        );
        assert_eq!(out[2].key, "device=a%3Db/sensor=t%25");
        assert_eq!(out[2].tag("device"), Some("a=b"));
        // No captured tag and no bookkeeping becomes a field: only `_` fields are added.
        for r in &out {
            let extra: Vec<&str> = r.fields.iter().map(|(n, _)| n.as_str()).collect();
            assert!(
                extra.iter().all(|n| *n == "v" || n.starts_with('_')),
                "{extra:?}"
            );
        }
        // A literal-only template still matches (no tags: the key is the topic).
        c.topic_template = Some("plant/line1".into());
        let literal = Mapper::new(&c, Arc::default());
        literal.map(&publish("plant/line1", r#"{"v":1}"#), 0, 4, &mut out);
        assert_eq!(out[3].key, "plant/line1");
        assert!(out[3].tags.is_empty());
        assert_eq!(literal.stats.topic_mismatches.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn scalar_payloads_become_value_field() {
        let mut c = cfg(PayloadFormat::Json);
        c.ts_field = None;
        c.value_field = "reading".into();
        let m = Mapper::new(&c, Arc::default());
        let cases = [
            ("72.5", Value::F64(72.5)),
            ("  42\n", Value::I64(42)),
            ("-3", Value::I64(-3)),
            ("1e3", Value::F64(1000.0)),
            ("true", Value::Bool(true)),
            (r#""on""#, Value::Str("on".into())),
            // Plain text numbers that are not JSON.
            ("+7", Value::I64(7)),
            ("5.", Value::F64(5.0)),
        ];
        let mut out = Vec::new();
        for (payload, _) in &cases {
            m.map(&publish("sensors/d/s", payload), 5, 1, &mut out);
        }
        assert_eq!(out.len(), cases.len());
        for (r, (payload, want)) in out.iter().zip(&cases) {
            assert_eq!(r.field("reading"), Some(want), "{payload}");
            assert_eq!(r.ts, 5);
            assert_eq!(r.key, "device=d/sensor=s");
        }
        // Not numbers, not JSON: refused as before.
        for bad in ["nan", "inf", "12 13", "1,\"w\":2", ""] {
            m.map(&publish("sensors/d/s", bad), 5, 1, &mut out);
        }
        assert_eq!(out.len(), cases.len());
        assert_eq!(m.stats.bad_payloads.load(Ordering::Relaxed), 5);
        // Objects keep working; with ts_field, a scalar has no event time: ts_invalid decides.
        m.map(&publish("sensors/d/s", r#"{"reading":1}"#), 5, 1, &mut out);
        assert_eq!(out.last().unwrap().field("reading"), Some(&Value::I64(1)));
        let strict = Mapper::new(&cfg(PayloadFormat::Json), Arc::default());
        strict.map(&publish("sensors/d/s", "1"), 5, 1, &mut out);
        assert_eq!(strict.stats.bad_timestamps.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn unmatched_topics_drop_or_store() {
        let mut c = cfg(PayloadFormat::Json);
        c.ts_field = None;
        let drop = Mapper::new(&c, Arc::default());
        c.unmatched = MqttUnmatched::Store;
        let store = Mapper::new(&c, Arc::default());
        let off = ["other/x", "sensors/x", "sensors/a/b/c", "sensors//b"];
        let mut out = Vec::new();
        for t in off {
            drop.map(&publish(t, r#"{"v":1}"#), 0, 1, &mut out);
        }
        assert!(out.is_empty(), "dropped: {out:?}");
        assert_eq!(drop.stats.topic_mismatches.load(Ordering::Relaxed), 4);
        assert_eq!(drop.stats.bad_payloads.load(Ordering::Relaxed), 0);
        for t in off {
            store.map(&publish(t, r#"{"v":1}"#), 0, 1, &mut out);
        }
        assert_eq!(store.stats.topic_mismatches.load(Ordering::Relaxed), 4);
        let keys: Vec<&str> = out.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, off, "stored keyed by the whole topic");
        assert!(out.iter().all(|r| r.tags.is_empty()));
        // Line protocol under "store" keeps the line's own key, as without a template.
        let mut l = cfg(PayloadFormat::Line);
        l.unmatched = MqttUnmatched::Store;
        let line = Mapper::new(&l, Arc::default());
        out.clear();
        line.map(&publish("other", "m,dev=x v=1 5"), 0, 1, &mut out);
        assert_eq!(out[0].key, "dev=x");
    }

    #[test]
    fn mismatch_warnings_are_rate_limited() {
        let mut w = RateLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(w.hit(t0), Some(0));
        assert_eq!(w.hit(t0), None);
        assert_eq!(w.hit(t0 + Duration::from_secs(9)), None);
        assert_eq!(
            w.hit(t0 + Duration::from_secs(10)),
            Some(2),
            "two held back"
        );
        assert_eq!(w.hit(t0 + Duration::from_secs(11)), None);
        assert_eq!(w.hit(t0 + Duration::from_secs(30)), Some(1));
    }

    #[test]
    fn offsets_are_honoured() {
        let mut c = cfg(PayloadFormat::Json);
        c.ts_unit = TsUnit::Rfc3339;
        let m = Mapper::new(&c, Arc::default());
        let mut out = Vec::new();
        for ts in ["2025-12-01T12:00:00+01:00", "2025-12-01T12:00:00.5+01:00"] {
            let payload = format!(r#"{{"ts":"{ts}","v":1}}"#);
            m.map(&publish("sensors/a/b", &payload), 42, 9, &mut out);
        }
        let noon_ns = 1_764_590_400_000_000_000;
        let hour = 3_600_000_000_000;
        assert_eq!(out[0].ts, noon_ns - hour);
        assert_eq!(out[1].ts, noon_ns - hour + 500_000_000);
        assert_eq!(m.stats.bad_timestamps.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn line_mapping() {
        let m = Mapper::new(&cfg(PayloadFormat::Line), Arc::default());
        let mut out = Vec::new();
        m.map(
            &publish("sensors/d/s", "m,dev=x v=1 5\nm,dev=y v=2 6\n"),
            0,
            3,
            &mut out,
        );
        assert_eq!(out.len(), 2);
        // The captures join the line's tags; the key is theirs.
        assert_eq!(out[0].key, "dev=x/device=d/sensor=s");
        assert_eq!(out[1].tag("device"), Some("d"));
        assert_eq!(out[1].ts, 6);
        assert!(out[0].fields.iter().any(|(n, _)| n == DIGEST_FIELD));
        assert!(!out[1].fields.iter().any(|(n, _)| n == DIGEST_FIELD));
    }

    #[test]
    fn timestamps() {
        let now = 1_764_590_400_000_000_000;
        assert_eq!(to_ns(&Value::I64(2), TsUnit::S, now), Ok(2_000_000_000));
        assert_eq!(to_ns(&Value::F64(1.5), TsUnit::S, now), Ok(1_500_000_000));
        assert_eq!(to_ns(&Value::I64(7), TsUnit::Us, now), Ok(7_000));
        assert!(to_ns(&Value::I64(i64::MAX), TsUnit::S, now).is_err());
        assert!(to_ns(&Value::Str("x".into()), TsUnit::Ms, now).is_err());
        // A string is RFC 3339 whatever the unit, its offset honoured.
        let s = Value::Str("2025-12-01T13:00:00+01:00".into());
        assert_eq!(to_ns(&s, TsUnit::Ms, now), Ok(now));
        assert_eq!(to_ns(&s, TsUnit::Rfc3339, now), Ok(now));
        assert!(to_ns(&Value::I64(1), TsUnit::Rfc3339, now).is_err());
        assert_eq!(
            to_ns(
                &Value::Str("1970-01-01T00:00:01.5Z".into()),
                TsUnit::Rfc3339,
                now
            ),
            Ok(1_500_000_000)
        );
        assert!(to_ns(&Value::F64(f64::NAN), TsUnit::Ns, now).is_err());
        // Seconds sent where ms are configured: refused, naming the unit.
        let e = to_ns(&Value::I64(now / 1_000_000_000), TsUnit::Ms, now).unwrap_err();
        assert!(e.contains("looks like s"), "{e}");
    }

    #[test]
    fn urls_and_ids() {
        assert_eq!(
            parse_url("mqtt://127.0.0.1:1884").unwrap(),
            ("127.0.0.1".into(), 1884)
        );
        assert_eq!(parse_url("mqtt://broker").unwrap(), ("broker".into(), 1883));
        assert_eq!(parse_url("mqtts://x:1").unwrap(), ("x".into(), 1));
        assert_eq!(
            parse_url("mqtts://broker").unwrap(),
            ("broker".into(), 8883)
        );
        assert!(parse_url("mqtt://x:y").is_err());
        let a = default_client_id(Path::new("/nonexistent/a"), 0);
        assert_eq!(a, default_client_id(Path::new("/nonexistent/a"), 0));
        assert_ne!(a, default_client_id(Path::new("/nonexistent/b"), 0));
        assert!(a.len() <= 23, "{a}");
    }

    #[test]
    fn dedupe_window_forgets_oldest() {
        let mut d = Dedupe::new(2);
        d.insert(1);
        d.insert(2);
        d.insert(3);
        assert!(!d.contains(1));
        assert!(d.contains(2) && d.contains(3));
        let a = digest(&publish("t", "p"));
        let mut b = publish("t", "p");
        b.pkid = 9;
        assert_ne!(a, digest(&b));
    }
}
