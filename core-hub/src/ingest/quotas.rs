//! Per-device bounds on the hub state devices create: streams, epochs and lanes per device
//! (`ingest.streams_per_device_max`, `ingest.epochs_per_device_max`,
//! `ingest.lanes_per_device_max`) and columns per stream (`ingest.columns_per_stream_max`),
//! of which one device may bring at most `ingest.columns_per_device_max`: a stream many
//! devices share cannot be filled by one of them.
//!
//! Without them one device (buggy firmware, a stolen certificate) could make the catalog, the
//! per-lane state, the Parquet schemas and `/metrics` grow without end. Each check runs before
//! anything is created: a refused block, gap or backlog report interns no stream and writes
//! no row. The counts are rebuilt from the catalog at start-up (marks, backlog rows and the
//! `stream_fields` registry), so a limit holds across restarts.
//!
//! A lane counts from its first admitted block, gap or backlog report (before its commit), so
//! concurrent blocks cannot overshoot a limit. Every refusal is counted per limit
//! ([`QuotaStats`], `tributary_hub_quota_refused_total{limit=..}`) and logged once per device
//! and limit: a device that keeps retrying does not flood the log.

use super::{Hub, IngestError, Names};
use crate::catalog::{Catalog, CatalogError, DeviceId, StreamId};
use crate::config::StateQuotas;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use sync::record::Record;

/// Which per-device state limit tripped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    StreamsPerDevice,
    EpochsPerDevice,
    LanesPerDevice,
    ColumnsPerStream,
    ColumnsPerDevice,
}

impl Limit {
    /// Every limit, in the order of [`QuotaStats::refused`].
    pub const ALL: [Limit; 5] = [
        Limit::StreamsPerDevice,
        Limit::EpochsPerDevice,
        Limit::LanesPerDevice,
        Limit::ColumnsPerStream,
        Limit::ColumnsPerDevice,
    ];

    /// The config key of the limit.
    pub fn key(self) -> &'static str {
        match self {
            Limit::StreamsPerDevice => "ingest.streams_per_device_max",
            Limit::EpochsPerDevice => "ingest.epochs_per_device_max",
            Limit::LanesPerDevice => "ingest.lanes_per_device_max",
            Limit::ColumnsPerStream => "ingest.columns_per_stream_max",
            Limit::ColumnsPerDevice => "ingest.columns_per_device_max",
        }
    }

    /// The `limit` label on `/metrics`.
    pub fn label(self) -> &'static str {
        match self {
            Limit::StreamsPerDevice => "streams_per_device",
            Limit::EpochsPerDevice => "epochs_per_device",
            Limit::LanesPerDevice => "lanes_per_device",
            Limit::ColumnsPerStream => "columns_per_stream",
            Limit::ColumnsPerDevice => "columns_per_device",
        }
    }

    fn index(self) -> usize {
        Limit::ALL.iter().position(|&l| l == self).expect("listed")
    }
}

/// A refusal: the stream it was for, the limit and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaError {
    pub stream: String,
    pub limit: Limit,
    pub max: u32,
}

/// Refusals per limit, for `/metrics`.
#[derive(Debug, Default)]
pub struct QuotaStats {
    refused: [AtomicU64; Limit::ALL.len()],
}

impl QuotaStats {
    /// Refusals of `limit` so far.
    pub fn refused(&self, limit: Limit) -> u64 {
        self.refused[limit.index()].load(Ordering::Relaxed)
    }
}

/// What one device holds.
#[derive(Debug, Default)]
struct DeviceState {
    streams: HashSet<String>,
    epochs: HashSet<u64>,
    lanes: HashSet<(u64, String)>,
    /// Limits already logged for this device (once per device and limit).
    logged: HashSet<Limit>,
}

/// The columns of one stream, and how many of them each device brought.
#[derive(Debug, Default)]
struct StreamColumns {
    names: HashSet<String>,
    by_device: HashMap<String, u32>,
}

/// The per-device state counts and their limits. One per hub.
#[derive(Debug)]
pub struct Quotas {
    limits: StateQuotas,
    devices: Mutex<HashMap<String, DeviceState>>,
    /// Field names per stream (by stream name), as registered in the catalog.
    columns: Mutex<HashMap<String, StreamColumns>>,
    logged_columns: Mutex<HashSet<(String, Limit)>>,
    stats: QuotaStats,
    /// Test-only: a limit left unchecked (see [`Quotas::disable_check`]).
    #[cfg(feature = "fault-injection")]
    unchecked: Mutex<Option<Limit>>,
}

impl Quotas {
    pub fn new(limits: StateQuotas) -> Quotas {
        Quotas {
            limits,
            devices: Mutex::new(HashMap::new()),
            columns: Mutex::new(HashMap::new()),
            logged_columns: Mutex::new(HashSet::new()),
            stats: QuotaStats::default(),
            #[cfg(feature = "fault-injection")]
            unchecked: Mutex::new(None),
        }
    }

    /// Mutation check (feature `fault-injection`, never in release builds): stops checking
    /// `limit`, so a test can prove it fails without the check.
    #[cfg(feature = "fault-injection")]
    pub fn disable_check(&self, limit: Option<Limit>) {
        *self.unchecked.lock().expect("quota lock") = limit;
    }

    /// Whether `limit` is checked (always, outside mutation checks).
    fn checked(&self, limit: Limit) -> bool {
        #[cfg(feature = "fault-injection")]
        if *self.unchecked.lock().expect("quota lock") == Some(limit) {
            return false;
        }
        let _ = limit;
        true
    }

    /// The limits in force.
    pub fn limits(&self) -> StateQuotas {
        self.limits
    }

    /// Refusals per limit.
    pub fn stats(&self) -> &QuotaStats {
        &self.stats
    }

    /// Start-up: a lane the catalog holds (limits are not checked: they may have been
    /// lowered since; such a device only gets nothing new).
    pub fn load_lane(&self, device: &str, epoch: u64, stream: &str) {
        let mut devices = self.devices.lock().expect("quota lock");
        let d = devices.entry(device.to_owned()).or_default();
        d.streams.insert(stream.to_owned());
        d.epochs.insert(epoch);
        d.lanes.insert((epoch, stream.to_owned()));
    }

    /// Start-up: a stream the device reported a backlog for.
    pub fn load_stream(&self, device: &str, stream: &str) {
        let mut devices = self.devices.lock().expect("quota lock");
        let d = devices.entry(device.to_owned()).or_default();
        d.streams.insert(stream.to_owned());
    }

    /// Start-up: a registered column of `stream`.
    /// Counts a registered column of `stream`, brought by `device` when known.
    pub fn load_column(&self, stream: &str, field: &str, device: Option<&str>) {
        let mut columns = self.columns.lock().expect("quota lock");
        let set = columns.entry(stream.to_owned()).or_default();
        if set.names.insert(field.to_owned())
            && let Some(d) = device
        {
            *set.by_device.entry(d.to_owned()).or_default() += 1;
        }
    }

    /// Admits `stream` for `device` (a backlog report): refused if it is new to the device
    /// and the device is at `streams_per_device_max`.
    pub fn admit_stream(&self, device: &str, stream: &str) -> Result<(), QuotaError> {
        let mut devices = self.devices.lock().expect("quota lock");
        let d = devices.entry(device.to_owned()).or_default();
        if d.streams.contains(stream) {
            return Ok(());
        }
        if d.streams.len() >= self.limits.streams_per_device_max as usize
            && self.checked(Limit::StreamsPerDevice)
        {
            return Err(self.refuse(device, d, stream, Limit::StreamsPerDevice));
        }
        d.streams.insert(stream.to_owned());
        Ok(())
    }

    /// Admits lane `(epoch, stream)` for `device` (a block or a gap): refused if it is new and
    /// would take the device past any of its stream, epoch or lane limits.
    pub fn admit_lane(&self, device: &str, epoch: u64, stream: &str) -> Result<(), QuotaError> {
        let mut devices = self.devices.lock().expect("quota lock");
        let d = devices.entry(device.to_owned()).or_default();
        if d.lanes.contains(&(epoch, stream.to_owned())) {
            return Ok(());
        }
        let q = self.limits;
        let new_stream = !d.streams.contains(stream);
        let new_epoch = !d.epochs.contains(&epoch);
        let tripped = [
            (
                Limit::StreamsPerDevice,
                new_stream && d.streams.len() >= q.streams_per_device_max as usize,
            ),
            (
                Limit::EpochsPerDevice,
                new_epoch && d.epochs.len() >= q.epochs_per_device_max as usize,
            ),
            (
                Limit::LanesPerDevice,
                d.lanes.len() >= q.lanes_per_device_max as usize,
            ),
        ]
        .into_iter()
        .find(|&(limit, over)| over && self.checked(limit))
        .map(|(limit, _)| limit);
        if let Some(limit) = tripped {
            return Err(self.refuse(device, d, stream, limit));
        }
        d.streams.insert(stream.to_owned());
        d.epochs.insert(epoch);
        d.lanes.insert((epoch, stream.to_owned()));
        Ok(())
    }

    /// Admits the field names a block brings to `stream`: `register` persists the new ones
    /// (in the catalog) before they count, under the same lock, so concurrent blocks cannot
    /// overshoot. Refused, with nothing registered, if the stream would exceed
    /// `columns_per_stream_max` or `device` would have brought more than
    /// `columns_per_device_max` of them.
    pub fn admit_columns<E>(
        &self,
        device: &str,
        stream: &str,
        names: &[&str],
        register: impl FnOnce(&[&str]) -> Result<(), E>,
    ) -> Result<Result<(), QuotaError>, E> {
        let mut columns = self.columns.lock().expect("quota lock");
        let set = columns.entry(stream.to_owned()).or_default();
        let new: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| !set.names.contains(*n))
            .collect();
        if new.is_empty() {
            return Ok(Ok(()));
        }
        let mine = set.by_device.get(device).copied().unwrap_or(0) as usize;
        let over = if set.names.len() + new.len() > self.limits.columns_per_stream_max as usize {
            Some(Limit::ColumnsPerStream)
        } else if mine + new.len() > self.limits.columns_per_device_max as usize {
            Some(Limit::ColumnsPerDevice)
        } else {
            None
        };
        if let Some(limit) = over.filter(|&l| self.checked(l)) {
            let max = self.max_of(limit);
            self.stats.refused[limit.index()].fetch_add(1, Ordering::Relaxed);
            let first = self
                .logged_columns
                .lock()
                .expect("quota lock")
                .insert((stream.to_owned(), limit));
            if first {
                tracing::warn!(
                    device,
                    stream,
                    limit = limit.key(),
                    max,
                    columns = set.names.len(),
                    columns_of_device = mine,
                    new = new.len(),
                    "refusing a block: it would take the stream past its column limit"
                );
            }
            let stream = stream.to_owned();
            return Ok(Err(QuotaError { stream, limit, max }));
        }
        register(&new)?;
        *set.by_device.entry(device.to_owned()).or_default() += new.len() as u32;
        set.names.extend(new.into_iter().map(str::to_owned));
        Ok(Ok(()))
    }

    /// The configured value of `limit`.
    fn max_of(&self, limit: Limit) -> u32 {
        match limit {
            Limit::StreamsPerDevice => self.limits.streams_per_device_max,
            Limit::EpochsPerDevice => self.limits.epochs_per_device_max,
            Limit::LanesPerDevice => self.limits.lanes_per_device_max,
            Limit::ColumnsPerStream => self.limits.columns_per_stream_max,
            Limit::ColumnsPerDevice => self.limits.columns_per_device_max,
        }
    }

    /// Counts and (once per device and limit) logs a refusal.
    fn refuse(&self, device: &str, d: &mut DeviceState, stream: &str, limit: Limit) -> QuotaError {
        self.stats.refused[limit.index()].fetch_add(1, Ordering::Relaxed);
        let max = self.max_of(limit);
        if d.logged.insert(limit) {
            tracing::warn!(
                device,
                stream,
                limit = limit.key(),
                max,
                streams = d.streams.len(),
                epochs = d.epochs.len(),
                lanes = d.lanes.len(),
                "refusing new state for a device at its limit (logged once per device and limit)"
            );
        }
        QuotaError {
            stream: stream.to_owned(),
            limit,
            max,
        }
    }
}

impl From<QuotaError> for IngestError {
    fn from(e: QuotaError) -> Self {
        IngestError::QuotaExceeded {
            stream: e.stream,
            key: e.limit.key(),
            max: e.max,
        }
    }
}

/// The state counts of every device and stream the catalog holds.
pub(super) fn load(
    catalog: &Catalog,
    names: &Names,
    limits: StateQuotas,
) -> Result<Quotas, CatalogError> {
    let q = Quotas::new(limits);
    let device = |id: DeviceId| names.device_names.get(&id);
    let stream = |id: StreamId| names.stream_names.get(&id);
    for m in catalog.all_marks()? {
        if let (Some(d), Some(s)) = (device(m.device), stream(m.stream)) {
            q.load_lane(d, m.epoch, s);
        }
    }
    for (d, s) in catalog.backlog_streams()? {
        if let (Some(d), Some(s)) = (device(d), stream(s)) {
            q.load_stream(d, s);
        }
    }
    for (s, field, d) in catalog.stream_fields()? {
        if let Some(s) = stream(s) {
            q.load_column(s, &field, d.and_then(device).map(String::as_str));
        }
    }
    Ok(q)
}

impl Hub {
    /// The per-device state quotas and their refusal counts.
    pub fn quotas(&self) -> &Quotas {
        &self.quotas
    }

    /// Admits the lane `(device, epoch, stream)` before anything is created for it.
    pub(super) fn admit_lane_quota(
        &self,
        device: &str,
        stream: &str,
        epoch: u64,
    ) -> Result<(), IngestError> {
        Ok(self.quotas.admit_lane(device, epoch, stream)?)
    }

    /// Admits `stream` for a backlog report of `device`.
    pub(super) fn admit_stream_quota(&self, device: &str, stream: &str) -> Result<(), IngestError> {
        Ok(self.quotas.admit_stream(device, stream)?)
    }

    /// Admits the field names of a block's records for stream `s`, registering new ones (as
    /// brought by device `d`) in the catalog first.
    pub(super) fn admit_columns_quota(
        &self,
        (device, d): (&str, DeviceId),
        (stream, s): (&str, StreamId),
        records: &[Record],
    ) -> Result<(), IngestError> {
        let names = field_names(records);
        let register = |new: &[&str]| self.catalog.register_fields(s, d, new);
        Ok(self
            .quotas
            .admit_columns(device, stream, &names, register)??)
    }
}

/// The distinct field and tag names of `records`, cheaply: records of a block mostly repeat
/// the previous record's names, which are skipped without hashing. A tag and a field of one
/// name are two columns but count once here, so a device's columns are bounded by at most
/// twice its quota.
fn field_names(records: &[Record]) -> Vec<&str> {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut prev: &[(String, sync::record::Value)] = &[];
    let mut prev_tags: &[(String, String)] = &[];
    for r in records {
        if r.tags.as_slice() != prev_tags {
            seen.extend(r.tags.iter().map(|(n, _)| n.as_str()));
            prev_tags = &r.tags;
        }
        for (i, (name, _)) in r.fields.iter().enumerate() {
            if prev.get(i).is_some_and(|(p, _)| p == name) {
                continue;
            }
            seen.insert(name.as_str());
        }
        prev = &r.fields;
    }
    seen.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(streams: u32, epochs: u32, lanes: u32, columns: u32) -> Quotas {
        Quotas::new(StateQuotas {
            streams_per_device_max: streams,
            epochs_per_device_max: epochs,
            lanes_per_device_max: lanes,
            columns_per_stream_max: columns,
            columns_per_device_max: columns,
        })
    }

    #[test]
    fn each_limit_trips_on_new_state_only() {
        let q = q(2, 2, 3, 8);
        q.admit_lane("d", 1, "a").unwrap();
        q.admit_lane("d", 1, "b").unwrap();
        let e = q.admit_lane("d", 1, "c").unwrap_err();
        assert_eq!(e.limit, Limit::StreamsPerDevice);
        q.admit_lane("d", 2, "a").unwrap();
        let e = q.admit_lane("d", 3, "a").unwrap_err();
        assert_eq!(e.limit, Limit::EpochsPerDevice);
        let e = q.admit_lane("d", 2, "b").unwrap_err();
        assert_eq!(e.limit, Limit::LanesPerDevice);
        // Known lanes and streams pass; another device has its own counts.
        q.admit_lane("d", 1, "a").unwrap();
        q.admit_stream("d", "b").unwrap();
        assert_eq!(
            q.admit_stream("d", "z").unwrap_err().limit,
            Limit::StreamsPerDevice
        );
        q.admit_lane("e", 9, "z").unwrap();
        assert_eq!(q.stats().refused(Limit::StreamsPerDevice), 2);
        assert_eq!(q.stats().refused(Limit::EpochsPerDevice), 1);
        assert_eq!(q.stats().refused(Limit::LanesPerDevice), 1);
    }

    #[test]
    fn columns_are_registered_only_when_admitted() {
        let q = q(8, 8, 8, 3);
        let ok = |_: &[&str]| Ok::<(), ()>(());
        q.admit_columns("d", "s", &["a", "b"], ok).unwrap().unwrap();
        let e = q
            .admit_columns("d", "s", &["a", "c", "x"], |_| -> Result<(), ()> {
                panic!("a refused block registers nothing")
            })
            .unwrap()
            .unwrap_err();
        assert_eq!(e.limit, Limit::ColumnsPerStream);
        q.admit_columns("d", "s", &["c", "a"], ok).unwrap().unwrap();
        // A failed registration leaves the count as it was.
        assert!(q.admit_columns("d", "t", &["a"], |_| Err(())).is_err());
        q.admit_columns("d", "t", &["a", "b", "c"], ok)
            .unwrap()
            .unwrap();
        assert_eq!(q.stats().refused(Limit::ColumnsPerStream), 1);
    }

    #[test]
    fn one_device_cannot_take_every_column_of_a_shared_stream() {
        let q = Quotas::new(StateQuotas {
            columns_per_stream_max: 6,
            columns_per_device_max: 3,
            ..StateQuotas::default()
        });
        let ok = |_: &[&str]| Ok::<(), ()>(());
        q.admit_columns("bad", "s", &["a", "b", "c"], ok)
            .unwrap()
            .unwrap();
        let e = q
            .admit_columns("bad", "s", &["d"], ok)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.limit, Limit::ColumnsPerDevice);
        // The columns it brought stay usable by everyone; others still have room.
        q.admit_columns("good", "s", &["a", "x", "y", "w"], ok)
            .unwrap()
            .unwrap();
        q.admit_columns("bad", "s", &["a", "x"], ok)
            .unwrap()
            .unwrap();
        let e = q
            .admit_columns("third", "s", &["z"], ok)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.limit, Limit::ColumnsPerStream);
        assert_eq!(q.stats().refused(Limit::ColumnsPerDevice), 1);
        assert_eq!(q.stats().refused(Limit::ColumnsPerStream), 1);
        // Counts loaded at start-up (from the catalog) are charged to their device.
        let q2 = Quotas::new(StateQuotas {
            columns_per_stream_max: 6,
            columns_per_device_max: 3,
            ..StateQuotas::default()
        });
        for f in ["a", "b", "c"] {
            q2.load_column("s", f, Some("bad"));
        }
        q2.load_column("s", "old", None);
        let e = q2
            .admit_columns("bad", "s", &["d"], ok)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.limit, Limit::ColumnsPerDevice);
        q2.admit_columns("good", "s", &["d"], ok).unwrap().unwrap();
    }
}
