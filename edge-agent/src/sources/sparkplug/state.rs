//! The host application's view of the edge nodes: each node's and device's BIRTH (alias →
//! name and datatype), its `bdSeq`, the expected `seq`, and whether it is online. A sans-IO
//! state machine: [`Host::handle`] takes one message and the receive time and hands back the
//! records to store and the nodes to ask for a rebirth; it never reads the clock or a socket.
//!
//! The rules (Sparkplug B 3.0, host application side):
//! - NBIRTH replaces the node's state (its devices too: they must be born again) and sets the
//!   next expected `seq` to its own plus one. NDATA, DBIRTH, DDATA and DDEATH each carry the
//!   node's next `seq`, 0..=255 wrapping; another value is a gap: an event record
//!   (`spb_event = "seq_gap"`, fields `_spb_seq_expected`, `_spb_seq_received`), counted, and
//!   the count goes on from the value received.
//! - DATA or DBIRTH for a node without BIRTH state (never seen, or dead), DDATA for a device
//!   without one, or a metric whose alias or name the BIRTH does not hold: a rebirth request
//!   for the node, at most one per node per `rebirth_interval`. Such a message's metrics are
//!   not stored (their types are unknown) and the message is counted as dropped; an unknown
//!   metric alone is left out of a message whose other metrics are stored.
//! - NDEATH whose `bdSeq` matches the BIRTH's marks the node and its devices offline and is
//!   stored as an event record (`spb_event = "death"`, field `_spb_bdseq`); any other NDEATH
//!   (an older session's will arriving late) is stale: ignored and counted. DDEATH of an online
//!   device likewise (`spb_event = "death"` with the `device` tag, field `_spb_seq`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prost::Message as _;
use sync::{Record, Value};
use tracing::{debug, info, warn};

use super::proto::{Metric, MetricProblem, MetricValue, Payload, decode_value};
use crate::sources::mqtt::MqttStats;

/// Nodes tracked at once; BIRTHs of further nodes are refused (counted as bad payloads).
pub const NODES_MAX: usize = 4096;
/// Devices tracked per node; further DBIRTHs are refused likewise.
pub const DEVICES_PER_NODE_MAX: usize = 1024;
/// The tag marking records of historical metrics (`is_historical`): `historical = "true"`.
pub const HISTORICAL_TAG: &str = "historical";
/// The tag naming an event record (`seq_gap`, `death`).
pub const EVENT_TAG: &str = "spb_event";

/// One host application's settings.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Shortest time between two rebirth requests to one node.
    pub rebirth_interval_ns: i64,
    /// `ingest.fields_per_record_max`: a record holds at most this many metrics.
    pub fields_max: usize,
}

/// What one message produced.
#[derive(Debug, Default)]
pub struct Output {
    pub records: Vec<Record>,
    /// `(group, edge_node)` of each node to send `Node Control/Rebirth`.
    pub rebirths: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct NodeId {
    group: String,
    edge_node: String,
}

/// A BIRTH's metrics: alias and name to (name, datatype).
#[derive(Debug, Default)]
struct Table {
    by_alias: HashMap<u64, (String, u32)>,
    by_name: HashMap<String, u32>,
}

impl Table {
    /// The name and datatype of `m`: by alias when it has one, else by name.
    fn resolve<'a>(&'a self, m: &'a Metric) -> Option<(&'a str, u32)> {
        if let Some(a) = m.alias {
            return self.by_alias.get(&a).map(|(n, dt)| (n.as_str(), *dt));
        }
        let name = m.name.as_deref()?;
        self.by_name.get(name).map(|dt| (name, *dt))
    }
}

#[derive(Debug)]
struct Node {
    bd_seq: Option<u64>,
    next_seq: u8,
    online: bool,
    table: Table,
    devices: HashMap<String, Device>,
}

#[derive(Debug)]
struct Device {
    online: bool,
    table: Table,
}

/// The message types of `spBv1.0/{group}/{type}/{edge_node}[/{device}]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    NBirth,
    NDeath,
    NData,
    DBirth,
    DDeath,
    DData,
    /// NCMD, DCMD and STATE: other applications' traffic (and this one's own commands).
    Ignored,
}

struct Topic<'a> {
    kind: Kind,
    group: &'a str,
    edge_node: &'a str,
    device: Option<&'a str>,
}

fn parse_topic(topic: &str) -> Result<Topic<'_>, String> {
    let mut parts = topic.split('/');
    if parts.next() != Some("spBv1.0") {
        return Err("not in the spBv1.0 namespace".into());
    }
    let group = parts.next().unwrap_or_default();
    if group == "STATE" {
        return Ok(Topic {
            kind: Kind::Ignored,
            group,
            edge_node: "",
            device: None,
        });
    }
    let kind = match parts.next().unwrap_or_default() {
        "NBIRTH" => Kind::NBirth,
        "NDEATH" => Kind::NDeath,
        "NDATA" => Kind::NData,
        "DBIRTH" => Kind::DBirth,
        "DDEATH" => Kind::DDeath,
        "DDATA" => Kind::DData,
        "NCMD" | "DCMD" => Kind::Ignored,
        other => return Err(format!("unknown message type {other:?}")),
    };
    let edge_node = parts.next().unwrap_or_default();
    let device = parts.next();
    let device_kind = matches!(kind, Kind::DBirth | Kind::DDeath | Kind::DData);
    if group.is_empty() || edge_node.is_empty() || parts.next().is_some() {
        return Err("expected spBv1.0/{group}/{type}/{edge_node}[/{device}]".into());
    }
    if kind != Kind::Ignored && device_kind != device.is_some_and(|d| !d.is_empty()) {
        return Err("a device message needs a device level, a node message none".into());
    }
    Ok(Topic {
        kind,
        group,
        edge_node,
        device,
    })
}

/// The Sparkplug host state of one MQTT source.
pub struct Host {
    cfg: HostConfig,
    nodes: HashMap<NodeId, Node>,
    /// When each node was last asked for a rebirth.
    rebirth_at: HashMap<NodeId, i64>,
    stats: Arc<MqttStats>,
}

impl Host {
    pub fn new(cfg: HostConfig, stats: Arc<MqttStats>) -> Self {
        Host {
            cfg,
            nodes: HashMap::new(),
            rebirth_at: HashMap::new(),
            stats,
        }
    }

    /// Handles one message received at `now_ns`, appending what it produced to `out`.
    pub fn handle(&mut self, topic: &str, payload: &[u8], now_ns: i64, out: &mut Output) {
        let start = out.records.len();
        if let Err(why) = self.try_handle(topic, payload, now_ns, out) {
            out.records.truncate(start);
            self.stats.bad_payloads.fetch_add(1, Ordering::Relaxed);
            warn!(topic, error = %why, "sparkplug: message not stored");
        }
    }

    fn try_handle(
        &mut self,
        topic: &str,
        payload: &[u8],
        now_ns: i64,
        out: &mut Output,
    ) -> Result<(), String> {
        let t = parse_topic(topic)?;
        if t.kind == Kind::Ignored {
            return Ok(());
        }
        let p = Payload::decode(payload).map_err(|e| format!("not a Sparkplug B payload: {e}"))?;
        let id = NodeId {
            group: t.group.to_owned(),
            edge_node: t.edge_node.to_owned(),
        };
        let mut tags = vec![
            ("group".to_owned(), t.group.to_owned()),
            ("edge_node".to_owned(), t.edge_node.to_owned()),
        ];
        if let Some(d) = t.device {
            tags.push(("device".to_owned(), d.to_owned()));
        }
        if let Some(why) = sync::record::tags_problem(&tags) {
            return Err(format!("topic levels as tags: {why}"));
        }
        let ctx = Ctx {
            tags,
            ts: self.payload_ts(&p, now_ns),
            now_ns,
        };
        match t.kind {
            Kind::NBirth => self.nbirth(id, &p, &ctx, out),
            Kind::NDeath => self.ndeath(&id, &p, &ctx, out),
            Kind::NData => self.ndata(id, &p, &ctx, out),
            Kind::DBirth => self.dbirth(id, t.device.unwrap_or_default(), &p, &ctx, out),
            Kind::DDeath => self.ddeath(&id, t.device.unwrap_or_default(), &p, &ctx, out),
            Kind::DData => self.ddata(id, t.device.unwrap_or_default(), &p, &ctx, out),
            Kind::Ignored => Ok(()),
        }
    }

    fn nbirth(
        &mut self,
        id: NodeId,
        p: &Payload,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        if self.nodes.len() >= NODES_MAX && !self.nodes.contains_key(&id) {
            return Err(format!("more than {NODES_MAX} edge nodes"));
        }
        let seq = seq_of(p)?;
        let table = self.birth_table(p)?;
        let bd_seq = p
            .metrics
            .iter()
            .find(|m| m.name.as_deref() == Some("bdSeq"))
            .and_then(int_of);
        info!(group = %id.group, edge_node = %id.edge_node, bd_seq, metrics = table.by_name.len(), "sparkplug: node born");
        push_metrics(&ctx.tags, p, &table, ctx, &self.cfg, &self.stats, out);
        let node = Node {
            bd_seq,
            next_seq: seq.wrapping_add(1),
            online: true,
            table,
            devices: HashMap::new(),
        };
        self.nodes.insert(id, node);
        Ok(())
    }

    fn ndeath(
        &mut self,
        id: &NodeId,
        p: &Payload,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        let bd_seq = p
            .metrics
            .iter()
            .find(|m| m.name.as_deref() == Some("bdSeq"))
            .and_then(int_of);
        let node = self
            .nodes
            .get_mut(id)
            .filter(|n| n.online && (n.bd_seq.is_none() || n.bd_seq == bd_seq));
        let Some(node) = node else {
            self.stats.spb_stale_deaths.fetch_add(1, Ordering::Relaxed);
            info!(group = %id.group, edge_node = %id.edge_node, bd_seq, "sparkplug: stale NDEATH ignored (no live BIRTH with its bdSeq)");
            return Ok(());
        };
        node.online = false;
        node.devices.values_mut().for_each(|d| d.online = false);
        self.stats.spb_deaths.fetch_add(1, Ordering::Relaxed);
        info!(group = %id.group, edge_node = %id.edge_node, bd_seq, "sparkplug: node offline");
        let bd = bd_seq.unwrap_or_default() as i64;
        out.records.push(event(
            &ctx.tags,
            "death",
            ctx.ts,
            vec![("_spb_bdseq".into(), Value::I64(bd))],
        ));
        Ok(())
    }

    fn ndata(
        &mut self,
        id: NodeId,
        p: &Payload,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        let seq = seq_of(p)?;
        let Some(node) = self.nodes.get_mut(&id).filter(|n| n.online) else {
            return self.missing_state(id, "NDATA for a node without BIRTH state", ctx, out);
        };
        check_seq(node, seq, ctx, &self.stats, out);
        let unknown = push_metrics(&ctx.tags, p, &node.table, ctx, &self.cfg, &self.stats, out);
        if unknown {
            self.rebirth(id, ctx.now_ns, out);
        }
        Ok(())
    }

    fn dbirth(
        &mut self,
        id: NodeId,
        device: &str,
        p: &Payload,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        let seq = seq_of(p)?;
        let table = self.birth_table(p)?;
        let Some(node) = self.nodes.get_mut(&id).filter(|n| n.online) else {
            return self.missing_state(id, "DBIRTH for a node without BIRTH state", ctx, out);
        };
        if node.devices.len() >= DEVICES_PER_NODE_MAX && !node.devices.contains_key(device) {
            return Err(format!(
                "more than {DEVICES_PER_NODE_MAX} devices on one node"
            ));
        }
        check_seq(node, seq, ctx, &self.stats, out);
        info!(group = %id.group, edge_node = %id.edge_node, device, metrics = table.by_name.len(), "sparkplug: device born");
        push_metrics(&ctx.tags, p, &table, ctx, &self.cfg, &self.stats, out);
        node.devices.insert(
            device.to_owned(),
            Device {
                online: true,
                table,
            },
        );
        Ok(())
    }

    fn ddeath(
        &mut self,
        id: &NodeId,
        device: &str,
        p: &Payload,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        let seq = seq_of(p)?;
        let Some(node) = self.nodes.get_mut(id).filter(|n| n.online) else {
            self.stats.spb_stale_deaths.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        check_seq(node, seq, ctx, &self.stats, out);
        let Some(d) = node.devices.get_mut(device).filter(|d| d.online) else {
            self.stats.spb_stale_deaths.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        d.online = false;
        self.stats.spb_deaths.fetch_add(1, Ordering::Relaxed);
        info!(group = %id.group, edge_node = %id.edge_node, device, "sparkplug: device offline");
        out.records.push(event(
            &ctx.tags,
            "death",
            ctx.ts,
            vec![("_spb_seq".into(), Value::I64(i64::from(seq)))],
        ));
        Ok(())
    }

    fn ddata(
        &mut self,
        id: NodeId,
        device: &str,
        p: &Payload,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        let seq = seq_of(p)?;
        let Some(node) = self.nodes.get_mut(&id).filter(|n| n.online) else {
            return self.missing_state(id, "DDATA for a node without BIRTH state", ctx, out);
        };
        check_seq(node, seq, ctx, &self.stats, out);
        let Some(d) = node.devices.get(device).filter(|d| d.online) else {
            return self.missing_state(id, "DDATA for a device without BIRTH state", ctx, out);
        };
        let unknown = push_metrics(&ctx.tags, p, &d.table, ctx, &self.cfg, &self.stats, out);
        if unknown {
            self.rebirth(id, ctx.now_ns, out);
        }
        Ok(())
    }

    /// A message that needs BIRTH state the host does not have: dropped, rebirth requested.
    fn missing_state(
        &mut self,
        id: NodeId,
        why: &str,
        ctx: &Ctx,
        out: &mut Output,
    ) -> Result<(), String> {
        self.stats
            .spb_dropped_messages
            .fetch_add(1, Ordering::Relaxed);
        debug!(group = %id.group, edge_node = %id.edge_node, why, "sparkplug: message dropped");
        self.rebirth(id, ctx.now_ns, out);
        Ok(())
    }

    /// Asks `id` for a rebirth unless it was asked within `rebirth_interval`.
    fn rebirth(&mut self, id: NodeId, now_ns: i64, out: &mut Output) {
        let interval = self.cfg.rebirth_interval_ns;
        if self
            .rebirth_at
            .get(&id)
            .is_some_and(|t| now_ns.saturating_sub(*t) < interval)
        {
            return;
        }
        if self.rebirth_at.len() >= NODES_MAX {
            self.rebirth_at
                .retain(|_, t| now_ns.saturating_sub(*t) < interval);
        }
        info!(group = %id.group, edge_node = %id.edge_node, "sparkplug: requesting a rebirth");
        self.stats
            .spb_rebirths_requested
            .fetch_add(1, Ordering::Relaxed);
        out.rebirths.push((id.group.clone(), id.edge_node.clone()));
        self.rebirth_at.insert(id, now_ns);
    }

    /// The alias and name table of a BIRTH. A metric without a name or datatype is counted and
    /// left out; two metrics with one alias refuse the BIRTH.
    fn birth_table(&self, p: &Payload) -> Result<Table, String> {
        let mut t = Table::default();
        for m in &p.metrics {
            let (Some(name), Some(dt)) = (&m.name, m.datatype) else {
                self.stats.spb_bad_metrics.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if let Some(a) = m.alias
                && t.by_alias
                    .insert(a, (name.clone(), dt))
                    .is_some_and(|(n, _)| n != *name)
            {
                return Err(format!("BIRTH gives alias {a} to two metrics"));
            }
            t.by_name.insert(name.clone(), dt);
        }
        Ok(t)
    }

    /// The payload's timestamp in ns, else `now_ns`.
    fn payload_ts(&self, p: &Payload, now_ns: i64) -> i64 {
        p.timestamp.and_then(ms_to_ns).unwrap_or(now_ns)
    }
}

/// What every record of one message shares.
struct Ctx {
    tags: Vec<(String, String)>,
    ts: i64,
    now_ns: i64,
}

fn ms_to_ns(ms: u64) -> Option<i64> {
    i64::try_from(ms).ok()?.checked_mul(1_000_000)
}

fn seq_of(p: &Payload) -> Result<u8, String> {
    match p.seq {
        Some(s) => u8::try_from(s).map_err(|_| format!("seq {s} is over 255")),
        None => Err("no seq".into()),
    }
}

/// An integer metric's value (the `bdSeq` of a BIRTH or DEATH).
fn int_of(m: &Metric) -> Option<u64> {
    match m.value {
        Some(MetricValue::LongValue(v)) => Some(v),
        Some(MetricValue::IntValue(v)) => Some(u64::from(v)),
        _ => None,
    }
}

/// Checks `seq` against the node's expected one, recording a gap, and moves on from it.
fn check_seq(node: &mut Node, seq: u8, ctx: &Ctx, stats: &MqttStats, out: &mut Output) {
    let expected = node.next_seq;
    node.next_seq = seq.wrapping_add(1);
    if seq == expected || !switches::gap_check() {
        return;
    }
    stats.spb_seq_gaps.fetch_add(1, Ordering::Relaxed);
    warn!(tags = ?ctx.tags, expected, received = seq, "sparkplug: seq gap: messages were lost");
    let fields = vec![
        ("_spb_seq_expected".into(), Value::I64(i64::from(expected))),
        ("_spb_seq_received".into(), Value::I64(i64::from(seq))),
    ];
    out.records
        .push(event(&ctx.tags, "seq_gap", ctx.ts, fields));
}

/// Test-only mutation switch (feature `fault-injection`; without it the check is always on):
/// off, a `seq` other than the expected one is taken as it comes, with no gap event and no
/// count. Per thread: [`Host::handle`] runs on the caller's thread, and tests run in parallel
/// threads.
pub mod switches {
    #[cfg(feature = "fault-injection")]
    thread_local! {
        static GAP_CHECK: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    }

    /// Turns seq gap detection on or off for hosts handling messages on this thread.
    #[cfg(feature = "fault-injection")]
    pub fn set_gap_check(on: bool) {
        GAP_CHECK.with(|c| c.set(on));
    }

    /// Whether a seq gap is detected (always, without the feature).
    pub(crate) fn gap_check() -> bool {
        #[cfg(feature = "fault-injection")]
        return GAP_CHECK.with(std::cell::Cell::get);
        #[cfg(not(feature = "fault-injection"))]
        true
    }
}

fn event(tags: &[(String, String)], kind: &str, ts: i64, fields: Vec<(String, Value)>) -> Record {
    let mut tags = tags.to_vec();
    tags.push((EVENT_TAG.to_owned(), kind.to_owned()));
    Record {
        key: sync::record::key_from_tags(&tags),
        tags,
        ts,
        fields,
    }
}

/// Appends the payload's metrics as fields of records: one record per (timestamp,
/// historical), in metric order, a second metric of one name and timestamp starting another
/// record. `bdSeq` is bookkeeping and never a field. True when a metric was not in `table`.
fn push_metrics(
    tags: &[(String, String)],
    p: &Payload,
    table: &Table,
    ctx: &Ctx,
    cfg: &HostConfig,
    stats: &MqttStats,
    out: &mut Output,
) -> bool {
    let start = out.records.len();
    let mut unknown = false;
    for m in &p.metrics {
        let Some((name, dt)) = table.resolve(m) else {
            stats.spb_unknown_metrics.fetch_add(1, Ordering::Relaxed);
            unknown = true;
            continue;
        };
        if name == "bdSeq" {
            continue;
        }
        let value = match decode_value(m, dt) {
            Ok(Some(v)) => v,
            Ok(None) => continue,
            Err(MetricProblem::Unsupported(_)) => {
                stats.spb_skipped_metrics.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(MetricProblem::Bad(why)) => {
                stats.spb_bad_metrics.fetch_add(1, Ordering::Relaxed);
                warn!(metric = name, error = %why, "sparkplug: metric not stored");
                continue;
            }
        };
        let ts = m.timestamp.and_then(ms_to_ns).unwrap_or(ctx.ts);
        let historical = m.is_historical == Some(true);
        let records = &mut out.records[start..];
        if let Some(r) = place(records, tags, ts, historical, cfg.fields_max, name, value) {
            out.records.push(r);
        }
    }
    unknown
}

/// Adds `name = value` to the first record of `ts` and `historical` with room for it; else
/// returns a new record holding it.
fn place(
    records: &mut [Record],
    tags: &[(String, String)],
    ts: i64,
    historical: bool,
    fields_max: usize,
    name: &str,
    value: Value,
) -> Option<Record> {
    let fits = |r: &Record| {
        r.ts == ts
            && (r.tag(HISTORICAL_TAG).is_some() == historical)
            && r.fields.len() < fields_max
            && !r.fields.iter().any(|(n, _)| n == name)
    };
    if let Some(r) = records.iter_mut().find(|r| fits(r)) {
        r.fields.push((name.to_owned(), value));
        return None;
    }
    let mut tags = tags.to_vec();
    if historical {
        tags.push((HISTORICAL_TAG.to_owned(), "true".to_owned()));
    }
    Some(Record {
        key: sync::record::key_from_tags(&tags),
        tags,
        ts,
        fields: vec![(name.to_owned(), value)],
    })
}
