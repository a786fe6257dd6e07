//! The Modbus source: polls a device's registers and coils on an interval, over TCP or over a
//! serial line (RTU, [`rtu`]), and appends one record per poll, one field per channel, through
//! the one ingest path ([`Ingest::ingest`]).
//!
//! A channel whose read fails (an exception code, a timeout) is left out of that poll's record
//! and counted (`tributary_edge_modbus_errors_total{source,channel}`), with a WARN at most once a
//! minute per channel; the other channels are still read. A timeout or a broken connection
//! drops the connection, because a late answer would arrive as the reply to the next request;
//! the next read reconnects once, and if that fails too the device is taken as gone: the source
//! reports it (`tributary_edge_modbus_up`, `/v1/status`) and reconnects with a doubling backoff.
//!
//! Decoding ([`decode`]) is pure and tested for every type and order. The network driver needs
//! the `modbus` feature (`tokio-modbus`); without it the agent refuses `kind = "modbus"` at load.

use std::sync::atomic::{AtomicU64, Ordering};

use sync::Value;

use super::link::{Link, Metric, ReportLine, render_labelled, render_per_source};
use crate::config::{ModbusChannel, ModbusSourceConfig, ModbusType, Order};

/// Counters and connection state of one Modbus source, for `/metrics` and `/v1/status`.
#[derive(Debug)]
pub struct ModbusStats {
    /// The device as `/v1/status` names it (`host:port`, or the serial line and unit).
    device: String,
    stream: String,
    channels: Vec<String>,
    pub polls: AtomicU64,
    pub records: AtomicU64,
    /// Per channel, in config order: reads that failed.
    pub channel_errors: Vec<AtomicU64>,
    /// Connects (or serial port opens) that failed or timed out.
    pub connect_errors: AtomicU64,
    /// Reads that got no answer within the timeout.
    pub timeouts: AtomicU64,
    /// Records the log refused (disk full under `on_full = "block"`).
    pub refused_records: AtomicU64,
    /// Whether the device answers.
    pub link: Link,
}

impl ModbusStats {
    pub fn new(cfg: &ModbusSourceConfig) -> Self {
        ModbusStats {
            device: cfg.describe(),
            stream: cfg.stream.clone(),
            channels: cfg.channels.iter().map(|c| c.name.clone()).collect(),
            polls: AtomicU64::new(0),
            records: AtomicU64::new(0),
            channel_errors: cfg.channels.iter().map(|_| AtomicU64::new(0)).collect(),
            connect_errors: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            refused_records: AtomicU64::new(0),
            link: Link::default(),
        }
    }

    /// This source's line in `/v1/status`; `index` is its place among the Modbus sources.
    pub fn report(&self, index: usize) -> crate::http::status::SourceReport {
        self.link.report(ReportLine {
            index,
            kind: "modbus",
            peer: &self.device,
            stream: &self.stream,
            messages: self.polls.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
        })
    }
}

/// Prometheus text for every Modbus source (empty without any).
pub fn render(all: &[std::sync::Arc<ModbusStats>]) -> String {
    let mut out = String::new();
    if all.is_empty() {
        return out;
    }
    let per_source: [Metric<ModbusStats>; 6] = [
        ("polls_total", "counter", "polls of the device", |s| {
            s.polls.load(Ordering::Relaxed)
        }),
        ("records_total", "counter", "records appended", |s| {
            s.records.load(Ordering::Relaxed)
        }),
        (
            "connect_errors_total",
            "counter",
            "connects that failed or timed out",
            |s| s.connect_errors.load(Ordering::Relaxed),
        ),
        (
            "timeouts_total",
            "counter",
            "reads the device did not answer within the timeout",
            |s| s.timeouts.load(Ordering::Relaxed),
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
            "1 while the device answers, 0 while it does not",
            |s| u64::from(s.link.is_up()),
        ),
    ];
    render_per_source(&mut out, "tributary_edge_modbus_", &per_source, all);
    let rows = all.iter().enumerate().flat_map(|(i, s)| {
        s.channels
            .iter()
            .zip(&s.channel_errors)
            .map(move |(name, n)| (i, name.as_str(), n.load(Ordering::Relaxed)))
    });
    render_labelled(
        &mut out,
        "tributary_edge_modbus_errors_total",
        "channel reads that failed (exception, timeout, connection lost)",
        "channel",
        rows,
    );
    out
}

/// A channel's value from the registers it read (exactly `ty.count()` of them), with scale and
/// offset applied. Integers stay integers while scale is 1 and offset 0 (and the value fits an
/// i64); anything else becomes an f64.
pub fn decode(ch: &ModbusChannel, regs: &[u16]) -> Value {
    assert_eq!(regs.len(), usize::from(ch.ty.count()), "register count");
    let raw = raw_bytes(regs, ch.byte_order, ch.word_order);
    let b = |n: usize| -> [u8; 8] {
        let mut out = [0; 8];
        out[8 - n..].copy_from_slice(&raw[..n]);
        out
    };
    enum Raw {
        Int(i128),
        Float(f64),
    }
    let v = match ch.ty {
        ModbusType::U16 => Raw::Int(u16::from_be_bytes([raw[0], raw[1]]).into()),
        ModbusType::I16 => Raw::Int(i16::from_be_bytes([raw[0], raw[1]]).into()),
        ModbusType::U32 => Raw::Int((u64::from_be_bytes(b(4)) as u32).into()),
        ModbusType::I32 => Raw::Int((u64::from_be_bytes(b(4)) as u32 as i32).into()),
        ModbusType::F32 => Raw::Float(f32::from_bits(u64::from_be_bytes(b(4)) as u32).into()),
        ModbusType::U64 => Raw::Int(u64::from_be_bytes(b(8)).into()),
        ModbusType::I64 => Raw::Int(i64::from_be_bytes(b(8)).into()),
        ModbusType::F64 => Raw::Float(f64::from_bits(u64::from_be_bytes(b(8)))),
        ModbusType::Bool => unreachable!("bool channels read bits, not registers"),
    };
    let plain = ch.scale == 1.0 && ch.offset == 0.0;
    match v {
        Raw::Int(i) if plain => match i64::try_from(i) {
            Ok(i) => Value::I64(i),
            Err(_) => Value::F64(i as f64),
        },
        Raw::Int(i) => Value::F64(i as f64 * ch.scale + ch.offset),
        Raw::Float(f) => Value::F64(f * ch.scale + ch.offset),
    }
}

/// The registers' bytes, most significant first, undoing the device's byte and word order.
fn raw_bytes(regs: &[u16], byte_order: Order, word_order: Order) -> Vec<u8> {
    let mut words = regs.to_vec();
    if word_order == Order::Little {
        words.reverse();
    }
    words
        .iter()
        .flat_map(|w| match byte_order {
            Order::Big => w.to_be_bytes(),
            Order::Little => w.to_le_bytes(),
        })
        .collect()
}

#[cfg(feature = "modbus")]
pub use driver::run;
#[cfg(feature = "modbus")]
pub use rtu::{RtuUnit, run_bus};

#[cfg(feature = "modbus")]
mod rtu;

#[cfg(feature = "modbus")]
mod driver {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use sync::{Record, Value};
    use tokio::net::lookup_host;
    use tokio_modbus::client::{Context, Reader};
    use tokio_modbus::prelude::Slave;

    use super::{ModbusStats, decode};
    use crate::config::{ModbusChannel, ModbusFunction, ModbusSourceConfig, ModbusTransport};
    use crate::http::ingest::{Ingest, now_ns};

    /// The longest wait between reconnects to a device that does not answer.
    pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(30);
    /// A channel's failures are logged at most this often.
    const WARN_EVERY: Duration = Duration::from_secs(60);

    /// Why one read failed.
    pub(super) enum ReadError {
        /// The device answered with an exception code: the connection is fine.
        Exception(String),
        /// No answer within the timeout.
        Timeout(String),
        /// An answer that does not fit the request (another unit's, a late one, the wrong
        /// function or size): the line is fine, the answer is not used.
        Protocol(String),
        /// The connection or the port failed.
        Io(String),
    }

    impl ReadError {
        pub(super) fn message(&self) -> &str {
            match self {
                ReadError::Exception(e)
                | ReadError::Timeout(e)
                | ReadError::Protocol(e)
                | ReadError::Io(e) => e,
            }
        }
    }

    /// Runs one Modbus TCP source until the process ends. `index` is its place among the
    /// Modbus sources (the `source` label).
    pub async fn run(
        cfg: ModbusSourceConfig,
        index: usize,
        ingest: Ingest,
        stats: Arc<ModbusStats>,
    ) {
        let ModbusTransport::Tcp { address } = cfg.transport.clone() else {
            unreachable!("RTU sources run on a bus (run_bus)");
        };
        let mut poller = Poller {
            address,
            ctx: None,
            backoff: cfg.poll_interval,
            next_connect: Instant::now(),
            device: Device::new(cfg, index, stats),
        };
        let mut tick = tokio::time::interval(poller.device.cfg.poll_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Some(record) = poller.poll().await {
                poller.device.append(&ingest, record).await;
            }
        }
    }

    /// One device's config, counters and log throttle: what TCP and RTU polling share.
    pub(super) struct Device {
        pub(super) index: usize,
        pub(super) cfg: ModbusSourceConfig,
        pub(super) stats: Arc<ModbusStats>,
        /// Per channel: when its failure was last logged, and how many since.
        warned: Vec<Option<(Instant, u64)>>,
    }

    impl Device {
        pub(super) fn new(cfg: ModbusSourceConfig, index: usize, stats: Arc<ModbusStats>) -> Self {
            Device {
                index,
                warned: vec![None; cfg.channels.len()],
                cfg,
                stats,
            }
        }

        /// Reads channel `i`, counting and logging a failure.
        pub(super) async fn read(
            &mut self,
            ctx: &mut Context,
            i: usize,
        ) -> Result<Value, ReadError> {
            let r = read_channel(ctx, &self.cfg.channels[i], self.cfg.timeout).await;
            if let Err(e) = &r {
                if matches!(e, ReadError::Timeout(_)) {
                    self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                }
                self.channel_failed(i, e.message());
            }
            r
        }

        /// The record of one poll from the fields read; `None` when nothing was.
        pub(super) fn record(&self, fields: Vec<(String, Value)>) -> Option<Record> {
            if fields.is_empty() {
                return None;
            }
            Some(Record {
                tags: Vec::new(),
                key: self.cfg.key.clone(),
                ts: now_ns(),
                fields,
            })
        }

        /// Appends one poll's record, counting it or its refusal.
        pub(super) async fn append(&self, ingest: &Ingest, record: Record) {
            match ingest.ingest(&self.cfg.stream, vec![record]).await {
                Ok(_) => {
                    self.stats.records.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.stats.refused_records.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(source = self.index, stream = %self.cfg.stream, error = %e, "modbus poll refused by the log");
                }
            }
        }

        /// Counts a failed read of channel `i` and logs it unless logged within a minute.
        fn channel_failed(&mut self, i: usize, error: &str) {
            self.stats.channel_errors[i].fetch_add(1, Ordering::Relaxed);
            let now = Instant::now();
            let slot = &mut self.warned[i];
            match slot {
                Some((at, suppressed)) if now.duration_since(*at) < WARN_EVERY => {
                    *suppressed += 1;
                }
                _ => {
                    let suppressed = slot.map_or(0, |(_, n)| n);
                    tracing::warn!(
                        source = self.index,
                        channel = %self.cfg.channels[i].name,
                        error = %error,
                        suppressed,
                        "modbus channel read failed (logged at most once a minute per channel)"
                    );
                    *slot = Some((now, 0));
                }
            }
        }
    }

    /// One TCP source's connection and bookkeeping between polls.
    struct Poller {
        address: String,
        device: Device,
        ctx: Option<Context>,
        /// The wait before the next connect after a failed one.
        backoff: Duration,
        next_connect: Instant,
    }

    impl Poller {
        /// Reads every channel; `None` when nothing could be read.
        async fn poll(&mut self) -> Option<Record> {
            if self.ctx.is_none() && !self.connect().await {
                return None;
            }
            self.device.stats.polls.fetch_add(1, Ordering::Relaxed);
            let mut fields = Vec::with_capacity(self.device.cfg.channels.len());
            let (mut reconnected, mut answered) = (false, false);
            let mut lost = None;
            for i in 0..self.device.cfg.channels.len() {
                if self.ctx.is_none() {
                    // One reconnect per poll: a device that accepts connections but never
                    // answers costs at most two timeouts a poll, and then the backoff.
                    if reconnected || !self.connect().await {
                        break;
                    }
                    reconnected = true;
                }
                let Some(ctx) = self.ctx.as_mut() else { break };
                match self.device.read(ctx, i).await {
                    Ok(v) => {
                        answered = true;
                        fields.push((self.device.cfg.channels[i].name.clone(), v));
                    }
                    Err(ReadError::Exception(_)) => answered = true,
                    // Over TCP any other failure drops the connection: a late answer would
                    // arrive as the reply to the next request.
                    Err(e) => {
                        self.ctx = None;
                        self.device.stats.link.set_down(e.message());
                        lost = Some(e.message().to_owned());
                    }
                }
            }
            if answered {
                self.device.stats.link.set_up();
                self.backoff = self.device.cfg.poll_interval;
            } else if let Some(e) = lost.filter(|_| self.ctx.is_none() && !self.waiting()) {
                self.back_off(&e);
            }
            self.device.record(fields)
        }

        /// Opens the connection unless the backoff says wait; false when there is none. The
        /// device counts as up only once it answers a read.
        async fn connect(&mut self) -> bool {
            if self.waiting() {
                return false;
            }
            let cfg = &self.device.cfg;
            match try_connect(&self.address, cfg.unit_id, cfg.timeout).await {
                Ok(ctx) => {
                    self.ctx = Some(ctx);
                    tracing::debug!(source = self.device.index, address = %self.address, "modbus device connected");
                    true
                }
                Err(e) => {
                    self.device
                        .stats
                        .connect_errors
                        .fetch_add(1, Ordering::Relaxed);
                    self.back_off(&e);
                    false
                }
            }
        }

        /// A failed connect already set the wait.
        fn waiting(&self) -> bool {
            Instant::now() < self.next_connect
        }

        /// Nothing answered because of `e`: waits before the next connect, doubling the wait
        /// each time up to [`BACKOFF_MAX`], and logs the first failure of each outage.
        fn back_off(&mut self, e: &str) {
            let d = &self.device;
            let first = d.stats.link.is_up() || self.backoff == d.cfg.poll_interval;
            d.stats.link.set_down(e);
            self.next_connect = Instant::now() + self.backoff;
            if first {
                tracing::warn!(source = d.index, device = %d.cfg.describe(), error = %e, retry_in = ?self.backoff, "modbus device not answering");
            }
            self.backoff = (self.backoff * 2).min(BACKOFF_MAX.max(d.cfg.poll_interval));
        }
    }

    /// One read of `ch`, bounded by `timeout`.
    async fn read_channel(
        ctx: &mut Context,
        ch: &ModbusChannel,
        timeout: Duration,
    ) -> Result<Value, ReadError> {
        let (addr, count) = (ch.address, ch.ty.count());
        let done = tokio::time::timeout(no_timeout_mutation(timeout), async {
            match ch.function {
                ModbusFunction::Holding => ctx
                    .read_holding_registers(addr, count)
                    .await
                    .map(|r| r.map(Answer::Words)),
                ModbusFunction::Input => ctx
                    .read_input_registers(addr, count)
                    .await
                    .map(|r| r.map(Answer::Words)),
                ModbusFunction::Coil => ctx
                    .read_coils(addr, count)
                    .await
                    .map(|r| r.map(Answer::Bits)),
                ModbusFunction::Discrete => ctx
                    .read_discrete_inputs(addr, count)
                    .await
                    .map(|r| r.map(Answer::Bits)),
            }
        })
        .await;
        let answer = match done {
            Err(_) => return Err(ReadError::Timeout(format!("timed out after {timeout:?}"))),
            Ok(Err(tokio_modbus::Error::Protocol(e))) => {
                return Err(ReadError::Protocol(e.to_string()));
            }
            Ok(Err(e)) => return Err(ReadError::Io(e.to_string())),
            Ok(Ok(Err(code))) => {
                return Err(ReadError::Exception(format!("exception: {code}")));
            }
            Ok(Ok(Ok(a))) => a,
        };
        answer.value(ch)
    }

    /// The read timeout. Test-only mutation switch (`fault-injection` builds only): with
    /// `TRIBUTARY_TEST_EDGE_MODBUS_NO_READ_TIMEOUT=1` a read waits a day for its answer, as a
    /// driver with no read timeout would, so `tests/sources_modbus_rtu.rs` can show that its
    /// checks catch a unit that never answers stalling the other units on its line.
    fn no_timeout_mutation(timeout: Duration) -> Duration {
        #[cfg(feature = "fault-injection")]
        {
            const ENV: &str = "TRIBUTARY_TEST_EDGE_MODBUS_NO_READ_TIMEOUT";
            static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let on = *ON.get_or_init(|| {
                let on = std::env::var_os(ENV).is_some_and(|v| v == "1");
                if on {
                    tracing::error!(
                        "{ENV}=1: MODBUS READS HAVE NO TIMEOUT (test-only mutation switch)"
                    );
                }
                on
            });
            if on {
                return Duration::from_secs(86_400);
            }
        }
        timeout
    }

    /// One TCP connect, bounded by the timeout.
    async fn try_connect(address: &str, unit_id: u8, timeout: Duration) -> Result<Context, String> {
        let addr: SocketAddr = lookup_host(address)
            .await
            .map_err(|e| format!("resolve {address}: {e}"))?
            .next()
            .ok_or_else(|| format!("{address} resolves to no address"))?;
        match tokio::time::timeout(
            timeout,
            tokio_modbus::client::tcp::connect_slave(addr, Slave(unit_id)),
        )
        .await
        {
            Ok(Ok(ctx)) => Ok(ctx),
            Ok(Err(e)) => Err(format!("connect {addr}: {e}")),
            Err(_) => Err(format!("connect {addr}: timed out after {timeout:?}")),
        }
    }

    /// What one read returned.
    enum Answer {
        Words(Vec<u16>),
        Bits(Vec<bool>),
    }

    impl Answer {
        fn value(self, ch: &ModbusChannel) -> Result<Value, ReadError> {
            match self {
                Answer::Words(w) if w.len() == usize::from(ch.ty.count()) => Ok(decode(ch, &w)),
                Answer::Words(w) => Err(ReadError::Protocol(format!(
                    "asked for {} registers, got {}",
                    ch.ty.count(),
                    w.len()
                ))),
                Answer::Bits(b) => b
                    .first()
                    .map(|b| Value::Bool(*b))
                    .ok_or_else(|| ReadError::Protocol("no bit in the answer".into())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModbusFunction;

    fn ch(ty: ModbusType, byte_order: Order, word_order: Order) -> ModbusChannel {
        ModbusChannel {
            name: "x".into(),
            function: ModbusFunction::Holding,
            address: 0,
            ty,
            byte_order,
            word_order,
            scale: 1.0,
            offset: 0.0,
        }
    }

    /// The registers a device in the given orders sends for `bytes` (most significant first).
    fn encode(bytes: &[u8], byte_order: Order, word_order: Order) -> Vec<u16> {
        let mut words: Vec<u16> = bytes
            .chunks(2)
            .map(|p| match byte_order {
                Order::Big => u16::from_be_bytes([p[0], p[1]]),
                Order::Little => u16::from_le_bytes([p[0], p[1]]),
            })
            .collect();
        if word_order == Order::Little {
            words.reverse();
        }
        words
    }

    const ORDERS: [(Order, Order); 4] = [
        (Order::Big, Order::Big),
        (Order::Big, Order::Little),
        (Order::Little, Order::Big),
        (Order::Little, Order::Little),
    ];

    #[test]
    fn every_type_decodes_in_every_order() {
        let cases: Vec<(ModbusType, Vec<u8>, Value)> = vec![
            (
                ModbusType::U16,
                0xBEEFu16.to_be_bytes().into(),
                Value::I64(0xBEEF),
            ),
            (
                ModbusType::I16,
                (-1234i16).to_be_bytes().into(),
                Value::I64(-1234),
            ),
            (
                ModbusType::U32,
                0xDEAD_BEEFu32.to_be_bytes().into(),
                Value::I64(0xDEAD_BEEF),
            ),
            (
                ModbusType::I32,
                (-123_456_789i32).to_be_bytes().into(),
                Value::I64(-123_456_789),
            ),
            (
                ModbusType::F32,
                3.25f32.to_be_bytes().into(),
                Value::F64(3.25),
            ),
            (
                ModbusType::U64,
                0x0123_4567_89AB_CDEFu64.to_be_bytes().into(),
                Value::I64(0x0123_4567_89AB_CDEF),
            ),
            (
                ModbusType::U64,
                u64::MAX.to_be_bytes().into(),
                Value::F64(u64::MAX as f64),
            ),
            (
                ModbusType::I64,
                (-9_876_543_210_123i64).to_be_bytes().into(),
                Value::I64(-9_876_543_210_123),
            ),
            (
                ModbusType::F64,
                (-2.5e-3f64).to_be_bytes().into(),
                Value::F64(-2.5e-3),
            ),
        ];
        for (ty, bytes, want) in cases {
            for (bo, wo) in ORDERS {
                let regs = encode(&bytes, bo, wo);
                let got = decode(&ch(ty, bo, wo), &regs);
                assert_eq!(
                    got, want,
                    "{ty:?} byte_order {bo:?} word_order {wo:?} regs {regs:04x?}"
                );
            }
        }
    }

    #[test]
    fn orders_differ_on_the_wire() {
        // 0x11223344 as each of the four orders sends it.
        let c = |bo, wo| decode(&ch(ModbusType::U32, bo, wo), &[0x1122, 0x3344]);
        assert_eq!(c(Order::Big, Order::Big), Value::I64(0x1122_3344));
        assert_eq!(c(Order::Big, Order::Little), Value::I64(0x3344_1122));
        assert_eq!(c(Order::Little, Order::Big), Value::I64(0x2211_4433));
        assert_eq!(c(Order::Little, Order::Little), Value::I64(0x4433_2211));
    }

    #[test]
    fn scale_and_offset_apply_to_every_number() {
        let mut c = ch(ModbusType::I16, Order::Big, Order::Big);
        c.scale = 0.1;
        c.offset = -40.0;
        let got = decode(&c, &[(-50i16) as u16]);
        assert_eq!(got, Value::F64(-50.0 * 0.1 - 40.0));
        c.ty = ModbusType::F32;
        let regs = encode(&10.0f32.to_be_bytes(), Order::Big, Order::Big);
        assert_eq!(decode(&c, &regs), Value::F64(10.0 * 0.1 - 40.0));
    }

    #[test]
    fn metrics_name_source_and_channel() {
        let cfg = ModbusSourceConfig {
            transport: crate::config::ModbusTransport::Tcp {
                address: "127.0.0.1:502".into(),
            },
            unit_id: 1,
            poll_interval: std::time::Duration::from_secs(1),
            timeout: std::time::Duration::from_secs(1),
            stream: "plc".into(),
            key: "k".into(),
            channels: vec![ch(ModbusType::U16, Order::Big, Order::Big)],
        };
        let s = std::sync::Arc::new(ModbusStats::new(&cfg));
        s.channel_errors[0].fetch_add(3, Ordering::Relaxed);
        let text = render(&[s]);
        assert!(
            text.contains("tributary_edge_modbus_errors_total{source=\"0\",channel=\"x\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("tributary_edge_modbus_up{source=\"0\"} 0"),
            "{text}"
        );
    }
}
