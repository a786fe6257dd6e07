//! One simulated industrial machine: a motor-driven pump on a duty cycle.
//!
//! The machine runs for 10-60 minutes and stops for 2-15. While running, pressure and flow
//! ramp to the machine's set points and pulse with the pump, the motor warms toward a
//! load-dependent temperature, and vibration grows slowly as the bearings wear. While stopped,
//! pressure falls to the static head and flow to zero. The pressure sensor's calibration
//! drifts.

use rand::Rng;
use rand::rngs::StdRng;
use sync::Value;

use super::{Faultable, approach, gauss, round, uniform};

/// Fields a fault can hit, with what a spike makes of them.
pub(super) const FAULTABLE: &[Faultable] = &[
    ("vibration_rms", |v| v * 8.0 + 20.0),
    ("pressure_bar", |_| 0.0),
    ("flow_lpm", |v| v * 3.0 + 500.0),
    ("motor_temp_c", |v| v + 80.0),
];

/// Bearing wear adds this much vibration per hour of running (mm/s).
const WEAR_MM_S_PER_HOUR: f64 = 0.01;

#[derive(Debug)]
pub(super) struct Machine {
    running: bool,
    /// Seconds left in the current run or stop.
    phase_left_s: f64,
    /// Seconds since the machine started, for the pump's pulsation.
    clock_s: f64,
    pressure_set_bar: f64,
    flow_set_lpm: f64,
    pressure_bar: f64,
    flow_lpm: f64,
    motor_temp_c: f64,
    ambient_c: f64,
    /// Baseline vibration of a healthy machine, and what wear has added (mm/s RMS).
    vibration_base: f64,
    wear: f64,
    pressure_bias_bar: f64,
    pulse_period_s: f64,
}

impl Machine {
    pub(super) fn new(rng: &mut StdRng) -> Self {
        let ambient_c = uniform(rng, 12.0, 32.0);
        let running = rng.random_bool(0.75);
        let pressure_set_bar = uniform(rng, 4.0, 8.0);
        let flow_set_lpm = uniform(rng, 80.0, 160.0);
        Machine {
            running,
            phase_left_s: if running {
                uniform(rng, 60.0, 3600.0)
            } else {
                uniform(rng, 30.0, 900.0)
            },
            clock_s: 0.0,
            pressure_set_bar,
            flow_set_lpm,
            pressure_bar: if running { pressure_set_bar } else { 0.3 },
            flow_lpm: if running { flow_set_lpm } else { 0.0 },
            motor_temp_c: if running {
                ambient_c + uniform(rng, 35.0, 45.0)
            } else {
                ambient_c + uniform(rng, 0.0, 10.0)
            },
            ambient_c,
            vibration_base: uniform(rng, 0.8, 1.6),
            wear: uniform(rng, 0.0, 1.5),
            pressure_bias_bar: 0.0,
            pulse_period_s: uniform(rng, 4.0, 12.0),
        }
    }

    /// Advances `dt_s` seconds and returns the clean, rounded sample (without `fault`).
    pub(super) fn step(&mut self, rng: &mut StdRng, dt_s: f64) -> Vec<(String, Value)> {
        self.schedule(rng, dt_s);
        self.clock_s += dt_s;
        self.pressure_bias_bar =
            (self.pressure_bias_bar + gauss(rng, 0.0002 * dt_s.sqrt())).clamp(-0.2, 0.2);
        let (pressure_target, flow_target, temp_target) = if self.running {
            let pulse = 0.15 * (std::f64::consts::TAU * self.clock_s / self.pulse_period_s).sin();
            let load = self.flow_lpm / self.flow_set_lpm;
            (
                self.pressure_set_bar + pulse,
                self.flow_set_lpm,
                self.ambient_c + 38.0 + 6.0 * load,
            )
        } else {
            (0.3, 0.0, self.ambient_c)
        };
        self.pressure_bar = approach(self.pressure_bar, pressure_target, dt_s, 4.0);
        self.flow_lpm = approach(self.flow_lpm, flow_target, dt_s, 3.0);
        self.motor_temp_c = approach(
            self.motor_temp_c,
            temp_target,
            dt_s,
            if self.running { 600.0 } else { 1200.0 },
        );
        let vibration = if self.running {
            self.wear += WEAR_MM_S_PER_HOUR * dt_s / 3600.0;
            self.vibration_base + self.wear + gauss(rng, 0.08)
        } else {
            0.05 + gauss(rng, 0.01)
        };
        let flow_noise = if self.running { gauss(rng, 0.8) } else { 0.0 };
        vec![
            (
                "vibration_rms".to_owned(),
                Value::F64(round(vibration.max(0.0), 3)),
            ),
            (
                "pressure_bar".to_owned(),
                Value::F64(round(
                    (self.pressure_bar + self.pressure_bias_bar + gauss(rng, 0.02)).max(0.0),
                    3,
                )),
            ),
            (
                "flow_lpm".to_owned(),
                Value::F64(round((self.flow_lpm + flow_noise).max(0.0), 2)),
            ),
            (
                "motor_temp_c".to_owned(),
                Value::F64(round(self.motor_temp_c + gauss(rng, 0.05), 2)),
            ),
            ("running".to_owned(), Value::Bool(self.running)),
        ]
    }

    fn schedule(&mut self, rng: &mut StdRng, dt_s: f64) {
        self.phase_left_s -= dt_s;
        if self.phase_left_s > 0.0 {
            return;
        }
        self.running = !self.running;
        self.phase_left_s = if self.running {
            uniform(rng, 600.0, 3600.0)
        } else {
            uniform(rng, 120.0, 900.0)
        };
        if self.running {
            self.clock_s = 0.0;
        }
    }
}
