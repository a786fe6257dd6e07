//! Modbus RTU: the devices on one serial line, polled by one task that owns the port.
//!
//! A serial bus carries one request at a time, and an answer names only the unit, not the
//! request. So every RTU source on one `serial.path` is a unit of one [`run_bus`] task, which
//! polls the unit whose poll is due first (the one waiting longest goes first), reads its
//! channels one request after the other, and only then turns to the next unit. Each unit keeps
//! its own poll interval, timeout, counters and state.
//!
//! A unit that does not answer costs one timeout per poll: its remaining channels are skipped
//! and its next poll waits, doubling from its poll interval up to 30 s, so a dead unit takes
//! little of the line's time and the other units keep their intervals. A timeout keeps the port
//! open: nothing is in flight once the answer is given up on, and an answer that comes too late
//! is refused by the client's check of unit id and function code (a `Protocol` error, counted
//! on the channel it was taken for). Only a port error (the adapter unplugged) closes the port;
//! the next poll opens it again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sync::Record;
use tokio_modbus::client::Context;
use tokio_modbus::prelude::{Slave, SlaveContext};

use super::ModbusStats;
use super::driver::{BACKOFF_MAX, Device, ReadError};
use crate::config::{ModbusSourceConfig, Parity, SerialLine};
use crate::http::ingest::Ingest;

/// One RTU source handed to [`run_bus`]: its config, its place among the Modbus sources (the
/// `source` label) and its counters.
pub struct RtuUnit {
    pub index: usize,
    pub cfg: ModbusSourceConfig,
    pub stats: Arc<ModbusStats>,
}

/// Polls every unit on `line` until the process ends, one request at a time.
pub async fn run_bus(line: SerialLine, units: Vec<RtuUnit>, ingest: Ingest) {
    assert!(!units.is_empty(), "a bus has at least one unit");
    let now = Instant::now();
    let mut bus = Bus {
        units: units
            .into_iter()
            .map(|u| Unit {
                backoff: u.cfg.poll_interval,
                next_due: now,
                device: Device::new(u.cfg, u.index, u.stats),
            })
            .collect(),
        line,
        port: None,
    };
    loop {
        let i = bus.next_unit();
        tokio::time::sleep_until(bus.units[i].next_due.into()).await;
        if let Some(record) = bus.poll(i).await {
            bus.units[i].device.append(&ingest, record).await;
        }
    }
}

/// One serial line and its units.
struct Bus {
    line: SerialLine,
    /// Open while the port works; opened again by the next poll after a port error.
    port: Option<Context>,
    units: Vec<Unit>,
}

/// One unit on the line and when it is polled next.
struct Unit {
    device: Device,
    next_due: Instant,
    /// The wait after a poll nobody answered; doubles up to [`BACKOFF_MAX`].
    backoff: Duration,
}

impl Bus {
    /// The unit whose poll is due first; on a tie, the first in config order.
    fn next_unit(&self) -> usize {
        (0..self.units.len())
            .min_by_key(|&i| self.units[i].next_due)
            .expect("a bus has at least one unit")
    }

    /// Polls unit `i`: every channel, in order, unless the unit stops answering.
    async fn poll(&mut self, i: usize) -> Option<Record> {
        let due = self.units[i].next_due;
        if self.port.is_none() {
            match open(&self.line) {
                Ok(ctx) => {
                    tracing::debug!(line = %self.line.describe(), "modbus serial line open");
                    self.port = Some(ctx);
                }
                Err(e) => {
                    let unit = &mut self.units[i];
                    unit.device
                        .stats
                        .connect_errors
                        .fetch_add(1, Ordering::Relaxed);
                    unit.back_off(&e);
                    return None;
                }
            }
        }
        let ctx = self.port.as_mut().expect("opened above");
        let unit = &mut self.units[i];
        ctx.set_slave(Slave(unit.device.cfg.unit_id));
        unit.device.stats.polls.fetch_add(1, Ordering::Relaxed);
        let mut fields = Vec::with_capacity(unit.device.cfg.channels.len());
        let (mut answered, mut failed) = (false, None);
        for c in 0..unit.device.cfg.channels.len() {
            match unit.device.read(ctx, c).await {
                Ok(v) => {
                    answered = true;
                    fields.push((unit.device.cfg.channels[c].name.clone(), v));
                }
                Err(ReadError::Exception(_)) => answered = true,
                Err(ReadError::Protocol(_)) => {}
                Err(ReadError::Timeout(e)) => {
                    failed = Some(e);
                    break;
                }
                Err(ReadError::Io(e)) => {
                    failed = Some(format!("{}: {e}", self.line.describe()));
                    self.port = None;
                    break;
                }
            }
        }
        match (answered, failed) {
            (false, Some(e)) => unit.back_off(&e),
            _ => {
                if answered {
                    unit.device.stats.link.set_up();
                    unit.backoff = unit.device.cfg.poll_interval;
                }
                unit.next_due = (due + unit.device.cfg.poll_interval).max(Instant::now());
            }
        }
        unit.device.record(fields)
    }
}

impl Unit {
    /// Nothing answered because of `e`: the unit is reported down and polled again after the
    /// backoff, which doubles up to [`BACKOFF_MAX`]. Logs the first failure of each outage.
    fn back_off(&mut self, e: &str) {
        let d = &self.device;
        let first = d.stats.link.is_up() || self.backoff == d.cfg.poll_interval;
        d.stats.link.set_down(e);
        self.next_due = Instant::now() + self.backoff;
        if first {
            tracing::warn!(source = d.index, device = %d.cfg.describe(), error = %e, retry_in = ?self.backoff, "modbus device not answering");
        }
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX.max(d.cfg.poll_interval));
    }
}

/// Opens the serial port with the line's settings, as an RTU client.
fn open(line: &SerialLine) -> Result<Context, String> {
    use tokio_serial::{DataBits, FlowControl, StopBits};
    let parity = match line.parity {
        Parity::None => tokio_serial::Parity::None,
        Parity::Even => tokio_serial::Parity::Even,
        Parity::Odd => tokio_serial::Parity::Odd,
    };
    let data_bits = match line.data_bits {
        5 => DataBits::Five,
        6 => DataBits::Six,
        7 => DataBits::Seven,
        _ => DataBits::Eight,
    };
    let stop_bits = if line.stop_bits == 2 {
        StopBits::Two
    } else {
        StopBits::One
    };
    let builder = tokio_serial::new(line.path.to_string_lossy(), line.baud)
        .parity(parity)
        .data_bits(data_bits)
        .stop_bits(stop_bits)
        .flow_control(FlowControl::None);
    let port = tokio_serial::SerialStream::open(&builder)
        .map_err(|e| format!("open {}: {e}", line.describe()))?;
    Ok(tokio_modbus::client::rtu::attach(port))
}
