//! MQTT republish: an optional sink that republishes merged streams to a core MQTT broker.
//!
//! One task per configured stream reads the stream in hub offset order (commit order, so per
//! key order holds) and publishes every record with QoS 1:
//!
//! - **Topic:** `topic_template` with `{stream}`, `{device}` and `{key}` filled in, each value
//!   escaped so that it fills its own topic level only ([`topic`] has the exact rule). A
//!   record's `_topic` field (where the edge's MQTT source keeps the original topic) is
//!   honoured only for the streams listed in `topic_from_record`, none by default: a producer
//!   cannot choose where the hub publishes with the hub's own broker credentials.
//! - **Checked before it is sent:** every topic is checked ([`topic::check_topic`]: length,
//!   NUL, wildcards, a leading `$`) and every packet's size is known, before anything reaches
//!   the MQTT client ([`plan`]).
//! - **Payload:** the record as one JSON object in the reader's NDJSON shape
//!   (`device, epoch, seq, key, ts, fields, offset, ingest_ts`, see
//!   [`crate::read::write_ndjson_line`]) without the newline and without the edge's internal
//!   fields `_topic` and `_mqtt_digest`.
//! - **Ids:** MQTT 5 user properties `device`, `epoch` and `seq` (plus `offset`), so that
//!   subscribers can deduplicate.
//!
//! **At least once.** A batch (at most `batch_records` records and `batch_bytes_max` bytes) is
//! published, then the task waits for every PUBACK of it; only then is the batch's end stored
//! as the stream's checkpoint (table `republish_checkpoints` in the hub catalog: a stream
//! position, the next hub offset). A broker or connection error drops the connection and
//! starts again from the checkpoint, so records published but not yet checkpointed are
//! published again: duplicates, never losses. The ids above identify them.
//!
//! **Never wedged by one record.** A record that cannot be published (an invalid or too long
//! topic, a packet over `packet_bytes_max` or the broker's maximum, a part MQTT cannot encode,
//! a broker refusal a retry cannot change, a record with which the broker keeps closing the
//! connection: [`SUSPECT_FAILURES`]) is dead-lettered ([`dead_letter`]): recorded,
//! counted, logged once per reason per episode, and skipped with its batch's checkpoint.
//!
//! When caught up the task polls the stream every `poll_interval` for new commits.
//!
//! **Sparkplug B.** With `format = "sparkplug"` the sink is a Sparkplug edge node instead
//! ([`sparkplug`]): an NDEATH Will and an NBIRTH per connection, a DBIRTH before a device's
//! data, one DDATA per record with `is_historical` set on backfill, and rebirths on request.
//! Checkpoints, dead letters and at-least-once are the same.

pub mod api;
mod config;
pub mod dead_letter;
pub mod plan;
pub mod sparkplug;
pub mod store;
pub mod topic;

#[cfg(feature = "fault-injection")]
pub use config::Mutation;
pub use config::{
    DEFAULT_BATCH_BYTES_MAX, DEFAULT_BATCH_RECORDS, DEFAULT_DEAD_LETTERS_MAX,
    DEFAULT_PACKET_BYTES_MAX, DEFAULT_POLL_INTERVAL, DEFAULT_TOPIC_BYTES_MAX,
    DEFAULT_TOPIC_TEMPLATE, Format, RawRepublish, RawSparkplug, RepublishConfig,
};
pub use dead_letter::{DeadLetter, Reason};
pub use plan::{DIGEST_FIELD, TOPIC_FIELD, payload_of};
pub use store::{checkpoint, dead_letter_counts, dead_letters};

use crate::ingest::Hub;
use crate::read::{PageLimit, read_records_with};
use dead_letter::Episode;
use plan::{Batch, Plan, plan_batch};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::LastWill;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use sparkplug::{EdgeNode, Outgoing};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::{mpsc, watch};

/// Why a republish step failed; the task reconnects and resumes from its checkpoint.
#[derive(Debug, Error)]
pub enum RepublishError {
    #[error("catalog: {0}")]
    Catalog(#[from] rusqlite::Error),
    #[error("reading the stream: {0}")]
    Read(#[from] crate::read::ReadError),
    #[error("mqtt client: {0}")]
    Client(Box<rumqttc::v5::ClientError>),
    #[error("mqtt connection: {0}")]
    Connection(String),
    #[error("broker asked to retry a publish later: {0:?}")]
    Refused(PubAckReason),
    #[error("a blocking task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error("stopped")]
    Stopped,
}

impl From<rumqttc::v5::ClientError> for RepublishError {
    fn from(e: rumqttc::v5::ClientError) -> Self {
        RepublishError::Client(Box::new(e))
    }
}

/// What the MQTT event loop reports to the publishing task.
#[derive(Debug)]
enum Conn {
    /// CONNACK, with the broker's maximum packet size if it has one.
    Connected(Option<u32>),
    Ack(PubAckReason),
    /// A message on a subscribed topic (Sparkplug's NCMD), its payload.
    Command(bytes::Bytes),
    Lost(String),
}

/// Starts one task per configured stream. They stop when `stop` turns true.
pub fn start(
    hub: Arc<Hub>,
    cfg: RepublishConfig,
    stop: watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    cfg.streams
        .iter()
        .map(|stream| {
            let (hub, cfg, stop, stream) = (hub.clone(), cfg.clone(), stop.clone(), stream.clone());
            tokio::spawn(async move { run_stream(hub, cfg, stream, stop).await })
        })
        .collect()
}

/// Connection losses with the same batch outstanding before the records of that batch are
/// published one at a time, and with one record outstanding on its own before that record is
/// dead-lettered as `broker_disconnected`.
pub const SUSPECT_FAILURES: u32 = 3;
/// The first reconnect delay; it doubles up to [`RECONNECT_DELAY_MAX`].
const RECONNECT_DELAY: Duration = Duration::from_millis(100);
const RECONNECT_DELAY_MAX: Duration = Duration::from_secs(5);

/// What one stream's sink remembers across its connections: its log episode, and which
/// batch keeps losing the connection (a record the broker will not take, though it passed
/// every check, must not wedge the stream).
#[derive(Debug, Default)]
struct Memory {
    episode: Episode,
    /// The batch start at which the connection was lost `failures` times in a row,
    /// `single_failures` of them with that one record outstanding alone.
    suspect_at: u64,
    failures: u32,
    single_failures: u32,
    /// Batches starting below this offset hold one record each.
    single_until: u64,
    /// A batch was committed in the current connection.
    progressed: bool,
    /// `format = "sparkplug"`: the edge node, which outlives connections.
    node: Option<EdgeNode>,
}

impl Memory {
    /// The connection was lost with the batch `from..end` outstanding.
    fn lost_at(&mut self, from: u64, end: u64, single: bool) {
        if self.failures > 0 && self.suspect_at == from {
            self.failures += 1;
        } else {
            (self.suspect_at, self.failures, self.single_failures) = (from, 1, 0);
        }
        self.single_failures += u32::from(single);
        if self.failures >= SUSPECT_FAILURES {
            self.single_until = self.single_until.max(end);
        }
    }

    fn committed(&mut self) {
        (self.failures, self.single_failures, self.progressed) = (0, 0, true);
    }

    /// Whether the batch at `from` holds one record, and whether that record is given up.
    fn suspicion(&self, from: u64) -> (bool, bool) {
        let give_up = self.suspect_at == from && self.single_failures >= SUSPECT_FAILURES;
        (from < self.single_until, give_up)
    }
}

async fn run_stream(
    hub: Arc<Hub>,
    cfg: RepublishConfig,
    stream: String,
    mut stop: watch::Receiver<bool>,
) {
    let mut delay = RECONNECT_DELAY;
    let mut mem = Memory {
        node: match &cfg.format {
            Format::Sparkplug(spb) => Some(EdgeNode::new(spb, &stream)),
            Format::Json => None,
        },
        ..Memory::default()
    };
    loop {
        if *stop.borrow() {
            return;
        }
        mem.progressed = false;
        match session(&hub, &cfg, &stream, &mut stop, &mut mem).await {
            Err(RepublishError::Stopped) | Ok(()) => return,
            Err(e) => {
                tracing::warn!(%stream, error = %e, "republish: resuming from the checkpoint");
            }
        }
        if mem.progressed {
            delay = RECONNECT_DELAY;
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.changed() => return,
        }
        delay = (delay * 2).min(RECONNECT_DELAY_MAX);
    }
}

/// Drives the MQTT event loop, forwarding CONNACK and PUBACKs; ends on the first error.
async fn drive(mut ev: EventLoop, tx: mpsc::UnboundedSender<Conn>) {
    loop {
        let conn = match ev.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(c))) => {
                Conn::Connected(c.properties.and_then(|p| p.max_packet_size))
            }
            Ok(Event::Incoming(Packet::PubAck(a))) => Conn::Ack(a.reason),
            Ok(Event::Incoming(Packet::Publish(p))) => Conn::Command(p.payload),
            Ok(Event::Incoming(Packet::Disconnect(d))) => {
                Conn::Lost(format!("the broker disconnected: {:?}", d.reason_code))
            }
            Ok(_) => continue,
            Err(e) => Conn::Lost(e.to_string()),
        };
        let lost = matches!(conn, Conn::Lost(_));
        if tx.send(conn).is_err() || lost {
            return;
        }
    }
}

async fn session(
    hub: &Arc<Hub>,
    cfg: &RepublishConfig,
    stream: &str,
    stop: &mut watch::Receiver<bool>,
    mem: &mut Memory,
) -> Result<(), RepublishError> {
    let mut opts = MqttOptions::new(
        format!("{}-{stream}", cfg.client_id),
        cfg.host.clone(),
        cfg.port,
    );
    opts.set_keep_alive(Duration::from_secs(30));
    opts.set_clean_start(true);
    if let Some(node) = &mut mem.node {
        let (h, s) = (hub.clone(), stream.to_string());
        let bd_seq = tokio::task::spawn_blocking(move || store::next_bd_seq(&h, &s)).await??;
        let will = node.start_session(bd_seq);
        opts.set_last_will(LastWill::new(
            will.topic,
            will.payload,
            QoS::AtLeastOnce,
            false,
            None,
        ));
    }
    let (client, ev) = AsyncClient::new(opts, cfg.batch_records.max(10));
    let (tx, mut conn) = mpsc::unbounded_channel();
    let driver = tokio::spawn(drive(ev, tx));
    let result = async {
        let broker_max = connected(&mut conn, stop).await?;
        let packet_max = broker_max.map_or(cfg.packet_bytes_max, |b| {
            cfg.packet_bytes_max.min(u64::from(b))
        });
        let mut sink = Sink {
            hub,
            cfg,
            stream,
            client: &client,
            conn: &mut conn,
            packet_max,
            mem,
            rebirth: false,
        };
        sink.publish_loop(stop).await
    }
    .await;
    if let (Err(RepublishError::Stopped), Some(node)) = (&result, &mem.node) {
        graceful_death(&client, &mut conn, node).await;
    }
    let _ = client.try_disconnect();
    driver.abort();
    result
}

/// A Sparkplug node that stops sends its NDEATH itself: a normal DISCONNECT discards the Will.
/// It waits a moment for the PUBACK (the Will covers every other way the connection ends).
async fn graceful_death(
    client: &AsyncClient,
    conn: &mut mpsc::UnboundedReceiver<Conn>,
    node: &EdgeNode,
) {
    let death = node.ndeath();
    if client
        .try_publish(death.topic, QoS::AtLeastOnce, false, death.payload)
        .is_err()
    {
        return;
    }
    let acked = async {
        while let Some(c) = conn.recv().await {
            if matches!(c, Conn::Ack(_) | Conn::Lost(_)) {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), acked).await;
}

/// Waits for the CONNACK; returns the broker's maximum packet size.
async fn connected(
    conn: &mut mpsc::UnboundedReceiver<Conn>,
    stop: &mut watch::Receiver<bool>,
) -> Result<Option<u32>, RepublishError> {
    loop {
        tokio::select! {
            c = conn.recv() => match c {
                Some(Conn::Connected(max)) => return Ok(max),
                Some(Conn::Lost(e)) => return Err(RepublishError::Connection(e)),
                Some(Conn::Ack(_) | Conn::Command(_)) => {}
                None => return Err(RepublishError::Connection("event loop ended".into())),
            },
            _ = stop.changed() => return Err(RepublishError::Stopped),
        }
    }
}

/// One connected session of one stream's sink.
struct Sink<'a> {
    hub: &'a Arc<Hub>,
    cfg: &'a RepublishConfig,
    stream: &'a str,
    client: &'a AsyncClient,
    conn: &'a mut mpsc::UnboundedReceiver<Conn>,
    /// The lower of `packet_bytes_max` and the broker's maximum packet size.
    packet_max: u64,
    mem: &'a mut Memory,
    /// Sparkplug: a rebirth was requested; the next batch starts with an NBIRTH.
    rebirth: bool,
}

impl Sink<'_> {
    async fn publish_loop(
        &mut self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(), RepublishError> {
        let (h, s) = (self.hub.clone(), self.stream.to_string());
        let mut next = tokio::task::spawn_blocking(move || checkpoint(&h, &s)).await??;
        if self.mem.node.is_some() {
            self.birth(stop).await?;
        }
        loop {
            if *stop.borrow() {
                return Err(RepublishError::Stopped);
            }
            if self.rebirth {
                self.birth(stop).await?;
            }
            let batch = self.next_batch(next).await?;
            if batch.records.is_empty() {
                self.idle(stop).await?;
                continue;
            }
            let dead = match self.publish(&batch, stop).await {
                Ok(dead) => dead,
                Err(e @ (RepublishError::Connection(_) | RepublishError::Client(_))) => {
                    let single = batch.records.len() == 1;
                    self.mem.lost_at(next, batch.next, single);
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            next = batch.next;
            let (h, s, keep) = (
                self.hub.clone(),
                self.stream.to_string(),
                self.cfg.dead_letters_max,
            );
            tokio::task::spawn_blocking(move || store::commit_batch(&h, &s, next, &dead, keep))
                .await??;
            self.mem.committed();
        }
    }

    /// Reads a page from `from` and plans a batch from its head.
    async fn next_batch(&self, from: u64) -> Result<Batch, RepublishError> {
        // The read is bounded in decoded bytes too, so a page never holds much more than the
        // batch it becomes.
        let (cut, give_up) = self.mem.suspicion(from);
        let limit = PageLimit {
            records: if cut { 1 } else { self.cfg.batch_records },
            bytes: Some(self.cfg.batch_bytes_max),
        };
        let (h, s) = (self.hub.clone(), self.stream.to_string());
        let page =
            tokio::task::spawn_blocking(move || read_records_with(&h, &s, from, limit)).await?;
        let page = match page {
            Ok(p) => p,
            // The stream appears with its first commit.
            Err(crate::read::ReadError::UnknownStream(_)) => crate::read::ReadPage {
                records: Vec::new(),
                next: from,
            },
            Err(e) => return Err(e.into()),
        };
        let mut batch = plan_batch(
            page.records,
            page.next,
            self.stream,
            self.cfg,
            self.packet_max,
            now_ns(),
        );
        if give_up
            && let Some(plan @ (Plan::Publish { .. } | Plan::Sparkplug(_))) =
                batch.plans.first_mut()
        {
            *plan = Plan::Dead {
                reason: Reason::BrokerDisconnected,
                detail: format!(
                    "the broker closed the connection {} times in a row with this record \
                     outstanding on its own",
                    self.mem.single_failures
                ),
            };
        }
        Ok(batch)
    }

    /// Caught up: waits for the poll interval, watching the connection.
    async fn idle(&mut self, stop: &mut watch::Receiver<bool>) -> Result<(), RepublishError> {
        tokio::select! {
            _ = tokio::time::sleep(self.cfg.poll_interval) => Ok(()),
            _ = stop.changed() => Err(RepublishError::Stopped),
            c = self.conn.recv() => match c {
                // Nothing is outstanding, so this is a connection error.
                Some(Conn::Lost(e)) => Err(RepublishError::Connection(e)),
                None => Err(RepublishError::Connection("event loop ended".into())),
                Some(Conn::Command(p)) => {
                    self.command(&p);
                    Ok(())
                }
                Some(_) => Ok(()),
            },
        }
    }

    /// Publishes the batch's publishable records and waits for their PUBACKs, which a broker
    /// sends in the order of the PUBLISHes; returns the batch's dead letters in offset order.
    async fn publish(
        &mut self,
        batch: &Batch,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Vec<DeadLetter>, RepublishError> {
        let mut sent = Vec::new();
        let mut refused = Vec::new();
        let now_ms = (now_ns() / 1_000_000) as u64;
        for (i, plan) in batch.plans.iter().enumerate() {
            match plan {
                Plan::Publish {
                    topic,
                    payload,
                    properties,
                } => {
                    self.send(topic, payload.clone(), properties.clone())
                        .await?;
                    sent.push(i);
                }
                Plan::Sparkplug(d) => {
                    let node = self.mem.node.as_mut().expect("a sparkplug sink has a node");
                    let ids = plan::properties_of(&batch.records[i], None);
                    let props = |o: &Outgoing| {
                        if o.data {
                            ids.clone()
                        } else {
                            PublishProperties::default()
                        }
                    };
                    let packet_max = self.packet_max;
                    let fits = |o: &Outgoing| {
                        let size =
                            plan::packet_size_with(&o.topic, o.payload.clone().into(), &props(o));
                        size <= packet_max
                    };
                    match node.device_data(d, now_ms, fits) {
                        Ok(messages) => {
                            for m in messages {
                                let p = props(&m);
                                self.send(&m.topic, m.payload.into(), p).await?;
                                sent.push(i);
                            }
                        }
                        Err((reason, detail)) => refused.push((i, reason, detail)),
                    }
                }
                Plan::Dead { .. } => {}
            }
        }
        for &i in &sent {
            if let Some(reason) = self.ack(stop).await? {
                let detail = format!("the broker answered {reason:?}");
                refused.push((i, Reason::BrokerRefused, detail));
            }
        }
        // A record whose DBIRTH and DDATA were both refused is dead-lettered once.
        refused.sort_by_key(|(i, _, _)| *i);
        refused.dedup_by_key(|(i, _, _)| *i);
        Ok(self.dead_letters(batch, refused))
    }

    async fn send(
        &self,
        topic: &str,
        payload: bytes::Bytes,
        properties: PublishProperties,
    ) -> Result<(), RepublishError> {
        self.client
            .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, properties)
            .await?;
        Ok(())
    }

    /// Sparkplug: subscribes to the node's NCMD (once per connection) and publishes the
    /// NBIRTH, waiting for its PUBACK.
    async fn birth(&mut self, stop: &mut watch::Receiver<bool>) -> Result<(), RepublishError> {
        let node = self.mem.node.as_mut().expect("a sparkplug sink has a node");
        if !self.rebirth {
            self.client
                .subscribe(node.ncmd_topic(), QoS::AtLeastOnce)
                .await?;
        }
        self.rebirth = false;
        let birth = node.nbirth((now_ns() / 1_000_000) as u64);
        self.send(
            &birth.topic,
            birth.payload.into(),
            PublishProperties::default(),
        )
        .await?;
        if let Some(reason) = self.ack(stop).await? {
            tracing::warn!(stream = %self.stream, ?reason, "republish: the broker refused the NBIRTH");
        }
        Ok(())
    }

    /// A message on the NCMD subscription: a rebirth request is answered before the next batch.
    fn command(&mut self, payload: &[u8]) {
        if sparkplug::asks_rebirth(payload) {
            tracing::info!(stream = %self.stream, "republish: Sparkplug rebirth requested");
            self.rebirth = true;
        }
    }

    /// The next PUBACK: `None` when it is a success, the reason when it is a refusal that a
    /// retry cannot change; a transient refusal or a lost connection is an error.
    async fn ack(
        &mut self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Option<PubAckReason>, RepublishError> {
        let c = loop {
            let c = tokio::select! {
                c = self.conn.recv() => c,
                _ = stop.changed() => return Err(RepublishError::Stopped),
            };
            match c {
                Some(Conn::Command(p)) => self.command(&p),
                c => break c,
            }
        };
        match c {
            Some(Conn::Ack(PubAckReason::Success | PubAckReason::NoMatchingSubscribers)) => {
                Ok(None)
            }
            Some(Conn::Ack(
                r @ (PubAckReason::QuotaExceeded | PubAckReason::PacketIdentifierInUse),
            )) => Err(RepublishError::Refused(r)),
            Some(Conn::Ack(r)) => Ok(Some(r)),
            Some(Conn::Connected(_)) => Err(RepublishError::Connection("reconnected".into())),
            Some(Conn::Command(_)) => unreachable!("handled above"),
            Some(Conn::Lost(e)) => Err(RepublishError::Connection(e)),
            None => Err(RepublishError::Connection("event loop ended".into())),
        }
    }

    /// The batch's dead letters (planned ones and `refused` by the broker), logged through
    /// the episode in offset order.
    fn dead_letters(
        &mut self,
        batch: &Batch,
        refused: Vec<(usize, Reason, String)>,
    ) -> Vec<DeadLetter> {
        let mut refused = refused.into_iter().peekable();
        let mut dead = Vec::new();
        for (i, (r, plan)) in batch.records.iter().zip(&batch.plans).enumerate() {
            let letter = match plan {
                Plan::Dead { reason, detail } => {
                    Some(DeadLetter::new(self.stream, r, *reason, detail.clone()))
                }
                Plan::Publish { .. } | Plan::Sparkplug(_) => refused
                    .next_if(|(j, _, _)| *j == i)
                    .map(|(_, reason, d)| DeadLetter::new(self.stream, r, reason, d)),
            };
            match letter {
                Some(d) => {
                    self.mem.episode.dead_lettered(&d);
                    dead.push(d);
                }
                None => self.mem.episode.published(self.stream),
            }
        }
        dead
    }
}

/// The hub's clock in nanoseconds since the Unix epoch.
fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}
