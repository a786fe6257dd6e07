//! Device sensor sources: hwmon and thermal zones, IIO, NMEA GPS, and the seeded simulator,
//! from the `firmware` crate, polled on an interval and fed through the one ingest path.
//!
//! Reading sysfs or a serial port blocks, so each poll runs on the blocking pool. A bad
//! channel (garbage value, missing file) yields a clear error for that channel only: it is
//! logged the first time it is seen and counted, and the other channels and the agent keep
//! running. A poll the log refuses (disk full under `on_full = "block"`) is logged and counted
//! in `refused_records`: a sensor cannot be paused like a producer, and holding its readings
//! in memory would only move the overflow from the disk to RAM.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use firmware::sim::{SimConfig, SimKind, Simulator};
use sync::Record;

use crate::config::{SensorKind, SensorSourceConfig};
use crate::http::ingest::{Ingest, now_ns};

/// Counters of one sensor source, for `/metrics`.
#[derive(Debug, Default)]
pub struct SensorStats {
    pub polls: AtomicU64,
    pub records: AtomicU64,
    pub channel_errors: AtomicU64,
    pub refused_records: AtomicU64,
}

/// Runs one sensor source until the process ends.
pub async fn run(cfg: SensorSourceConfig, ingest: Ingest, stats: Arc<SensorStats>) {
    let mut reader = match Reader::new(&cfg) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(stream = %cfg.stream, error = %e, "sensor source not started");
            return;
        }
    };
    let mut seen_errors = HashSet::new();
    let mut pending: Vec<Record> = Vec::new();
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (r, records, errors) = match tokio::task::spawn_blocking(move || reader.poll()).await {
            Ok(out) => out,
            Err(e) => {
                tracing::error!(error = %e, "sensor poll panicked; source stopped");
                return;
            }
        };
        reader = r;
        stats.polls.fetch_add(1, Ordering::Relaxed);
        for e in errors {
            stats.channel_errors.fetch_add(1, Ordering::Relaxed);
            if seen_errors.len() < 1024 && seen_errors.insert(e.clone()) {
                tracing::warn!(stream = %cfg.stream, error = %e, "sensor channel unreadable (logged once)");
            }
        }
        pending.extend(records);
        if pending.is_empty() {
            continue;
        }
        let n = pending.len() as u64;
        match ingest
            .ingest(&cfg.stream, std::mem::take(&mut pending))
            .await
        {
            Ok(_) => {
                stats.records.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                stats.refused_records.fetch_add(n, Ordering::Relaxed);
                tracing::warn!(stream = %cfg.stream, error = %e, records = n, "sensor poll refused by the log");
            }
        }
    }
}

/// One source's state between polls.
enum Reader {
    Hwmon(firmware::hwmon::HwmonSource),
    Iio(firmware::iio::IioSource),
    Nmea(Box<firmware::nmea::NmeaReader<std::io::BufReader<std::fs::File>>>),
    Sim(Box<Simulator>),
}

impl Reader {
    fn new(cfg: &SensorSourceConfig) -> Result<Reader, String> {
        Ok(match &cfg.kind {
            SensorKind::Hwmon { sysfs_root } => Reader::Hwmon(firmware::hwmon::HwmonSource::new(
                sysfs_root.clone(),
                cfg.key_prefix.clone(),
            )),
            SensorKind::Iio { sysfs_root } => Reader::Iio(firmware::iio::IioSource::new(
                sysfs_root.clone(),
                cfg.key_prefix.clone(),
            )),
            SensorKind::Nmea { path } => Reader::Nmea(Box::new(
                firmware::nmea::NmeaReader::open(path, &cfg.key_prefix)
                    .map_err(|e| e.to_string())?,
            )),
            SensorKind::Simulator {
                industrial,
                units,
                hz,
                seed,
            } => {
                let sim = SimConfig {
                    kind: if *industrial {
                        SimKind::Industrial
                    } else {
                        SimKind::Fleet
                    },
                    device_id: cfg.key_prefix.clone(),
                    units: *units,
                    hz: *hz,
                    seed: *seed,
                    start_ns: now_ns(),
                    ..SimConfig::default()
                };
                Reader::Sim(Box::new(
                    Simulator::new(sim).map_err(|e| format!("{}: {}", e.field, e.message))?,
                ))
            }
        })
    }

    /// One poll: the records read and the channels that failed, as messages.
    fn poll(mut self) -> (Reader, Vec<Record>, Vec<String>) {
        let now = now_ns();
        let (records, errors) = match &mut self {
            Reader::Hwmon(s) => {
                let p = s.poll(now);
                (
                    p.records,
                    p.errors.iter().map(ToString::to_string).collect(),
                )
            }
            Reader::Iio(s) => {
                let p = s.poll(now);
                (
                    p.records,
                    p.errors.iter().map(ToString::to_string).collect(),
                )
            }
            Reader::Nmea(r) => match r.read_batch(64, now_ns) {
                Ok(b) => (
                    b.records,
                    b.errors.iter().map(|e| format!("{e:?}")).collect(),
                ),
                Err(e) => (Vec::new(), vec![e.to_string()]),
            },
            // Bounded per poll, so a long stall never builds one huge batch.
            Reader::Sim(s) => (s.next_batch_max(now, 100_000), Vec::new()),
        };
        (self, records, errors)
    }
}

/// The poll interval's lower bound, so a misconfigured tiny interval cannot spin.
pub const INTERVAL_MIN: Duration = Duration::from_millis(10);
