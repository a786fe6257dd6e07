//! A seeded simulator of fleet trucks and industrial machines, for demos, benchmarks and the
//! `simulator` source on a development box without sensors.
//!
//! Each device simulates `units` trucks or machines sampled at `hz`. Values follow simple
//! physics with sensor noise and slow drift: trucks drive legs at changing speeds along a
//! wandering heading, park with the ignition off, warm their engines up and burn fuel with
//! distance; machines run duty cycles, their motors warm up and their bearings wear. Values are
//! rounded like a real sensor's (2-3 decimals) so columnar encodings see realistic data.
//!
//! **Faults.** A clean sample starts a fault episode with probability
//! [`SimConfig::fault_probability`]: either a one-sample spike (an absurd value) or a stuck
//! sensor (one value repeated for 5-60 samples). Every affected sample has `fault = true`.
//! After an episode at least one clean sample follows before the next can start, so each rising
//! edge of `fault` is one episode.
//!
//! **Dead zones.** [`Simulator::link_up`] says whether the device has a link at a given time.
//! It is a pure function of the seed, the device id and the time, independent of sampling, so
//! a demo can drop and restore links on the same schedule the data describes. Time is cut into
//! windows of [`LinkSchedule::window_s`]; each window after the first holds one dead zone with
//! [`LinkSchedule::dead_zone_probability`].
//!
//! **Determinism.** The same config gives the same records, whatever the `until_ns` steps of
//! [`Simulator::next_batch`] are: each unit has its own `StdRng` seeded from the seed, the
//! device id and the unit's index (so a unit's data does not depend on how many units there
//! are). Reproducible for a given `rand` version; `StdRng`'s algorithm may change between
//! `rand` releases.

mod machine;
mod truck;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sync::{Record, Value};
use thiserror::Error;

/// What the simulated device carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimKind {
    /// Trucks: one record per truck per sample, keyed `{device}/truck-{i:04}/engine`, with
    /// `engine_temp_c oil_bar battery_v speed_kmh fuel_pct odometer_m lat lon ignition fault`
    /// (the fields of `gen_telemetry.py`).
    Fleet,
    /// Machines: one record per machine per sample, keyed `{device}/machine-{i:02}`, with
    /// `vibration_rms pressure_bar flow_lpm motor_temp_c running fault`.
    Industrial,
}

/// When the simulated device has no link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSchedule {
    /// Each window holds at most one dead zone. The first window is always up.
    pub window_s: f64,
    /// The chance that a window holds a dead zone.
    pub dead_zone_probability: f64,
    /// A dead zone's duration is uniform between these, in seconds (max <= `window_s`).
    pub dead_zone_min_s: f64,
    pub dead_zone_max_s: f64,
}

impl Default for LinkSchedule {
    /// A dead zone of 10-60 s in about half of the 2-minute windows: a truck in hilly country.
    fn default() -> Self {
        LinkSchedule {
            window_s: 120.0,
            dead_zone_probability: 0.5,
            dead_zone_min_s: 10.0,
            dead_zone_max_s: 60.0,
        }
    }
}

/// The simulator's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub kind: SimKind,
    /// Prefixes every key.
    pub device_id: String,
    /// Trucks or machines on this device, 1 to [`UNITS_MAX`].
    pub units: usize,
    /// Samples per second per unit, above 0 and at most [`HZ_MAX`].
    pub hz: f64,
    pub seed: u64,
    /// The first sample's time, nanoseconds since the Unix epoch.
    pub start_ns: i64,
    /// The chance that a clean sample starts a fault episode, 0 to 1.
    pub fault_probability: f64,
    pub link: LinkSchedule,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            kind: SimKind::Fleet,
            device_id: "sim".to_owned(),
            units: 1,
            hz: 1.0,
            seed: 0,
            start_ns: 1_764_374_400_000_000_000,
            fault_probability: 0.001,
            link: LinkSchedule::default(),
        }
    }
}

/// The most units one simulated device carries.
pub const UNITS_MAX: usize = 100_000;
/// The highest sample rate: one sample per millisecond per unit.
pub const HZ_MAX: f64 = 1_000.0;

/// A [`SimConfig`] value the simulator cannot use.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("simulator config: {field}: {message}")]
pub struct SimConfigError {
    pub field: &'static str,
    pub message: String,
}

/// The simulator: yields every sample due, in time order.
#[derive(Debug)]
pub struct Simulator {
    config: SimConfig,
    step_ns: i64,
    /// Each unit's offset within a step, so units do not all report at the same instant.
    offsets_ns: Vec<i64>,
    /// Unit indexes sorted by offset: the emission order within one step.
    order: Vec<usize>,
    units: Vec<Unit>,
    /// The next sample is step `step` of unit `order[pos]`.
    step: i64,
    pos: usize,
    link_seed: u64,
}

/// One truck or machine with its own random stream and fault state.
#[derive(Debug)]
struct Unit {
    key: String,
    rng: StdRng,
    model: Model,
    fault: FaultState,
}

#[derive(Debug)]
enum Model {
    Truck(truck::Truck),
    Machine(machine::Machine),
}

impl Simulator {
    /// Checks the config and sets every unit's initial state from the seed.
    pub fn new(config: SimConfig) -> Result<Self, SimConfigError> {
        validate(&config)?;
        let step_ns = ((1e9 / config.hz).round() as i64).max(1);
        let base_seed = config.seed ^ fnv1a(config.device_id.as_bytes());
        let offsets_ns: Vec<i64> = (0..config.units as i64)
            .map(|i| i * 1_000_003 % step_ns)
            .collect();
        let mut order: Vec<usize> = (0..config.units).collect();
        order.sort_by_key(|&i| (offsets_ns[i], i));
        let units = (0..config.units)
            .map(|i| new_unit(&config, base_seed, i))
            .collect();
        let link_seed = splitmix64(base_seed ^ 0x6c69_6e6b_5f73_6368);
        Ok(Simulator {
            config,
            step_ns,
            offsets_ns,
            order,
            units,
            step: 0,
            pos: 0,
            link_seed,
        })
    }

    /// The config this simulator runs.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// The timestamp of the next sample [`Simulator::next_batch`] will produce.
    pub fn next_ts(&self) -> i64 {
        self.sample_ts(self.step, self.order[self.pos])
    }

    /// Every sample with `ts <= until_ns` not yet produced, in time order.
    pub fn next_batch(&mut self, until_ns: i64) -> Vec<Record> {
        self.next_batch_max(until_ns, usize::MAX)
    }

    /// Like [`Simulator::next_batch`], but at most `records_max` records; the rest come in
    /// the next call. Use this when `until_ns` may be far ahead (a bounded batch).
    pub fn next_batch_max(&mut self, until_ns: i64, records_max: usize) -> Vec<Record> {
        let mut out = Vec::new();
        while out.len() < records_max {
            let unit = self.order[self.pos];
            let ts = self.sample_ts(self.step, unit);
            if ts > until_ns {
                break;
            }
            out.push(self.units[unit].sample(ts, &self.config, self.step_ns));
            self.pos += 1;
            if self.pos == self.order.len() {
                self.pos = 0;
                self.step += 1;
            }
        }
        out
    }

    /// Whether the device has a link at `t_ns`: false inside a dead zone. Pure in the seed,
    /// the device id and `t_ns`; always true before the first window ends.
    pub fn link_up(&self, t_ns: i64) -> bool {
        let window = self.window_of(t_ns);
        !self
            .dead_zone_in(window)
            .is_some_and(|(s, e)| s <= t_ns && t_ns < e)
    }

    /// The dead zones `[start_ns, end_ns)` that overlap `[from_ns, until_ns)`, in order: the
    /// schedule a demo uses to drop links. The work is one step per link window in the range,
    /// so ask for the span you will run, not for all time.
    pub fn dead_zones(&self, from_ns: i64, until_ns: i64) -> Vec<(i64, i64)> {
        if until_ns <= from_ns {
            return Vec::new();
        }
        (self.window_of(from_ns)..=self.window_of(until_ns))
            .filter_map(|w| self.dead_zone_in(w))
            .filter(|&(s, e)| s < until_ns && e > from_ns)
            .collect()
    }

    fn sample_ts(&self, step: i64, unit: usize) -> i64 {
        self.config
            .start_ns
            .saturating_add(step.saturating_mul(self.step_ns))
            .saturating_add(self.offsets_ns[unit])
    }

    fn window_ns(&self) -> i64 {
        (self.config.link.window_s * 1e3).round() as i64 * 1_000_000
    }

    fn window_of(&self, t_ns: i64) -> i64 {
        t_ns.saturating_sub(self.config.start_ns)
            .div_euclid(self.window_ns())
    }

    /// The dead zone of window `w`, if it has one. Window 0 (and anything before it) has none,
    /// so a device starts connected.
    fn dead_zone_in(&self, w: i64) -> Option<(i64, i64)> {
        let link = &self.config.link;
        if w <= 0 {
            return None;
        }
        let mut rng = StdRng::seed_from_u64(splitmix64(self.link_seed ^ w as u64));
        if !rng.random_bool(link.dead_zone_probability) {
            return None;
        }
        // Whole milliseconds: a schedule an operator can read.
        let ms = |s: f64| (s * 1e3).round() as i64;
        let duration_ms = rng.random_range(ms(link.dead_zone_min_s)..=ms(link.dead_zone_max_s));
        let offset_ms = rng.random_range(0..=ms(link.window_s) - duration_ms);
        let start = self
            .config
            .start_ns
            .saturating_add(w.saturating_mul(self.window_ns()));
        let start = start.saturating_add(offset_ms * 1_000_000);
        Some((start, start.saturating_add(duration_ms * 1_000_000)))
    }
}

fn validate(c: &SimConfig) -> Result<(), SimConfigError> {
    let bad = |field, message: &str| {
        Err(SimConfigError {
            field,
            message: message.to_owned(),
        })
    };
    let link = &c.link;
    if c.units == 0 || c.units > UNITS_MAX {
        return bad(
            "units",
            &format!("expected 1 to {UNITS_MAX}, found {}", c.units),
        );
    }
    if !(c.hz > 0.0 && c.hz <= HZ_MAX) {
        return bad(
            "hz",
            &format!("expected more than 0 and at most {HZ_MAX}, found {}", c.hz),
        );
    }
    if !(0.0..=1.0).contains(&c.fault_probability) {
        return bad("fault_probability", "expected 0 to 1");
    }
    if !(link.window_s >= 1.0 && link.window_s < 1e9) {
        return bad("link.window_s", "expected 1 s or more");
    }
    if !(0.0..=1.0).contains(&link.dead_zone_probability) {
        return bad("link.dead_zone_probability", "expected 0 to 1");
    }
    let durations_ok = link.dead_zone_min_s >= 0.0
        && link.dead_zone_min_s <= link.dead_zone_max_s
        && link.dead_zone_max_s <= link.window_s;
    if !durations_ok {
        return bad(
            "link.dead_zone_max_s",
            "expected 0 <= dead_zone_min_s <= dead_zone_max_s <= window_s",
        );
    }
    Ok(())
}

fn new_unit(config: &SimConfig, base_seed: u64, index: usize) -> Unit {
    let mut rng = StdRng::seed_from_u64(splitmix64(base_seed ^ splitmix64(index as u64 + 1)));
    let (key, model) = match config.kind {
        SimKind::Fleet => (
            format!("{}/truck-{index:04}/engine", config.device_id),
            Model::Truck(truck::Truck::new(&mut rng)),
        ),
        SimKind::Industrial => (
            format!("{}/machine-{index:02}", config.device_id),
            Model::Machine(machine::Machine::new(&mut rng)),
        ),
    };
    Unit {
        key,
        rng,
        model,
        fault: FaultState::default(),
    }
}

impl Unit {
    /// Advances the physics one step and produces the sample, faults applied.
    fn sample(&mut self, ts: i64, config: &SimConfig, step_ns: i64) -> Record {
        let dt_s = step_ns as f64 / 1e9;
        let (mut fields, faultable) = match &mut self.model {
            Model::Truck(t) => (t.step(&mut self.rng, dt_s), truck::FAULTABLE),
            Model::Machine(m) => (m.step(&mut self.rng, dt_s), machine::FAULTABLE),
        };
        let faulted = self.fault.apply(
            &mut self.rng,
            config.fault_probability,
            &mut fields,
            faultable,
        );
        fields.push(("fault".to_owned(), Value::Bool(faulted)));
        Record {
            tags: Vec::new(),
            key: self.key.clone(),
            ts,
            fields,
        }
    }
}

/// A field that can fail, and the absurd value a spike turns a reading into.
pub(crate) type Faultable = (&'static str, fn(f64) -> f64);

/// A unit's fault episode, if one is under way.
#[derive(Debug, Default)]
struct FaultState {
    stuck: Option<Stuck>,
    /// The previous sample was faulted: no new episode may start on this one.
    previous_faulted: bool,
}

/// A sensor repeating one value.
#[derive(Debug)]
struct Stuck {
    field: &'static str,
    value: Value,
    remaining: u32,
}

impl FaultState {
    /// Continues or starts an episode on `fields`; returns whether this sample is faulted.
    fn apply(
        &mut self,
        rng: &mut StdRng,
        p: f64,
        fields: &mut [(String, Value)],
        faultable: &[Faultable],
    ) -> bool {
        let faulted = if let Some(stuck) = &mut self.stuck {
            set_field(fields, stuck.field, stuck.value.clone());
            stuck.remaining -= 1;
            if stuck.remaining == 0 {
                self.stuck = None;
            }
            true
        } else if !self.previous_faulted && rng.random_bool(p) {
            self.start(rng, fields, faultable);
            true
        } else {
            false
        };
        self.previous_faulted = faulted;
        faulted
    }

    fn start(&mut self, rng: &mut StdRng, fields: &mut [(String, Value)], faultable: &[Faultable]) {
        let (field, spike) = faultable[rng.random_range(0..faultable.len())];
        // The FAULTABLE tables name f64 fields of their own model: only a bug breaks this.
        let Some(Value::F64(current)) = get_field(fields, field) else {
            panic!("faultable field {field} is not an f64 field of this model");
        };
        if rng.random_bool(0.5) {
            set_field(fields, field, Value::F64(round(spike(current), 3)));
        } else {
            // This sample is the first of the stuck run.
            let remaining = rng.random_range(4..=59);
            self.stuck = Some(Stuck {
                field,
                value: Value::F64(current),
                remaining,
            });
        }
    }
}

fn get_field(fields: &[(String, Value)], name: &str) -> Option<Value> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

fn set_field(fields: &mut [(String, Value)], name: &str, value: Value) {
    if let Some((_, v)) = fields.iter_mut().find(|(n, _)| n == name) {
        *v = value;
    }
}

/// A normal draw (Box-Muller), so the simulator needs no distribution crate.
pub(crate) fn gauss(rng: &mut StdRng, sigma: f64) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    sigma * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A uniform draw in `[lo, hi)`, or `lo` when the range is empty.
pub(crate) fn uniform(rng: &mut StdRng, lo: f64, hi: f64) -> f64 {
    if hi > lo {
        lo + (hi - lo) * rng.random::<f64>()
    } else {
        lo
    }
}

/// Moves `value` toward `target` as a first-order lag with time constant `tau_s`; stable for
/// any step length.
pub(crate) fn approach(value: f64, target: f64, dt_s: f64, tau_s: f64) -> f64 {
    value + (target - value) * (1.0 - (-dt_s / tau_s).exp())
}

/// Rounds like a sensor with `decimals` digits of resolution.
pub(crate) fn round(v: f64, decimals: i32) -> f64 {
    let m = 10f64.powi(decimals);
    (v * m).round() / m
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauss_has_unit_variance() {
        let mut rng = StdRng::seed_from_u64(1);
        let n = 20_000;
        let draws: Vec<f64> = (0..n).map(|_| gauss(&mut rng, 1.0)).collect();
        let mean = draws.iter().sum::<f64>() / n as f64;
        let var = draws.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
    }

    #[test]
    fn approach_never_overshoots() {
        assert_eq!(approach(0.0, 10.0, 1e9, 1.0), 10.0);
        let v = approach(0.0, 10.0, 1.0, 10.0);
        assert!(v > 0.0 && v < 10.0);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases: [(SimConfig, &str); 4] = [
            (
                SimConfig {
                    units: 0,
                    ..SimConfig::default()
                },
                "units",
            ),
            (
                SimConfig {
                    hz: f64::NAN,
                    ..SimConfig::default()
                },
                "hz",
            ),
            (
                SimConfig {
                    fault_probability: 1.5,
                    ..SimConfig::default()
                },
                "fault_probability",
            ),
            (
                SimConfig {
                    link: LinkSchedule {
                        dead_zone_max_s: 500.0,
                        ..LinkSchedule::default()
                    },
                    ..SimConfig::default()
                },
                "link.dead_zone_max_s",
            ),
        ];
        for (config, field) in cases {
            let err = Simulator::new(config).expect_err(field);
            assert_eq!(err.field, field);
        }
    }
}
