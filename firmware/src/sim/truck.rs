//! One simulated truck: driving legs, parking, engine warm-up, fuel burn and a GPS track.
//!
//! A truck alternates between driving (ignition on) for 20-90 minutes and parking (ignition
//! off) for 5-30 minutes. While driving it follows legs of 30 s to 10 min, each with a target
//! speed (a stop, town, rural road or motorway), accelerating and braking at truck-like rates.
//! The engine warms toward a temperature that rises with load and cools toward ambient when
//! parked; fuel falls with distance and is refilled at a stop when low.

use std::f64::consts::{PI, TAU};

use rand::Rng;
use rand::rngs::StdRng;
use sync::Value;

use super::{Faultable, approach, gauss, round, uniform};

/// Fields a fault can hit, with what a spike makes of them (glitches seen on CAN buses).
pub(super) const FAULTABLE: &[Faultable] = &[
    ("engine_temp_c", |v| v + 65.0),
    ("oil_bar", |_| 0.0),
    ("battery_v", |_| 25.5),
    ("speed_kmh", |_| 255.0),
];

const ACCEL_KMH_PER_S: f64 = 2.9;
const BRAKE_KMH_PER_S: f64 = 5.4;
const SPEED_KMH_MAX: f64 = 120.0;
const TANK_L: f64 = 600.0;
const METERS_PER_DEGREE_LAT: f64 = 111_320.0;

#[derive(Debug)]
pub(super) struct Truck {
    lat: f64,
    lon: f64,
    heading_rad: f64,
    speed_kmh: f64,
    target_kmh: f64,
    /// Seconds left in the current leg (driving) or stop (parked).
    leg_left_s: f64,
    /// Seconds of driving left before the next stop.
    drive_left_s: f64,
    ignition: bool,
    engine_temp_c: f64,
    oil_bar: f64,
    battery_v: f64,
    fuel_pct: f64,
    odometer_m: f64,
    ambient_c: f64,
    /// Fuel burn at 60 km/h, litres per km.
    burn_l_per_km: f64,
    /// The temperature sensor's calibration drifts slowly.
    temp_bias_c: f64,
}

impl Truck {
    /// A truck somewhere in Europe, two thirds of them on the road at the start.
    pub(super) fn new(rng: &mut StdRng) -> Self {
        let ambient_c = uniform(rng, -5.0, 28.0);
        let driving = rng.random_bool(0.67);
        let mut truck = Truck {
            lat: uniform(rng, 45.0, 55.0),
            lon: uniform(rng, -5.0, 15.0),
            heading_rad: uniform(rng, 0.0, TAU),
            speed_kmh: 0.0,
            target_kmh: 0.0,
            leg_left_s: 0.0,
            drive_left_s: uniform(rng, 600.0, 5400.0),
            ignition: driving,
            engine_temp_c: if driving {
                uniform(rng, 80.0, 92.0)
            } else {
                ambient_c + uniform(rng, 0.0, 30.0)
            },
            oil_bar: 0.0,
            battery_v: if driving { 14.1 } else { 12.6 },
            fuel_pct: uniform(rng, 25.0, 100.0),
            odometer_m: uniform(rng, 1e7, 9e8).floor(),
            ambient_c,
            burn_l_per_km: uniform(rng, 0.26, 0.36),
            temp_bias_c: 0.0,
        };
        if driving {
            truck.new_leg(rng);
            truck.speed_kmh = truck.target_kmh;
            truck.oil_bar = oil_target(truck.speed_kmh);
        } else {
            truck.leg_left_s = uniform(rng, 60.0, 1800.0);
        }
        truck
    }

    /// Advances `dt_s` seconds and returns the clean, rounded sample (without `fault`).
    pub(super) fn step(&mut self, rng: &mut StdRng, dt_s: f64) -> Vec<(String, Value)> {
        self.schedule(rng, dt_s);
        self.drive(rng, dt_s);
        self.engine(rng, dt_s);
        vec![
            (
                "engine_temp_c".to_owned(),
                Value::F64(round(
                    self.engine_temp_c + self.temp_bias_c + gauss(rng, 0.05),
                    2,
                )),
            ),
            (
                "oil_bar".to_owned(),
                Value::F64(round((self.oil_bar + gauss(rng, 0.01)).max(0.0), 3)),
            ),
            (
                "battery_v".to_owned(),
                Value::F64(round(self.battery_v + gauss(rng, 0.01), 2)),
            ),
            ("speed_kmh".to_owned(), Value::F64(round(self.speed_kmh, 1))),
            ("fuel_pct".to_owned(), Value::F64(round(self.fuel_pct, 1))),
            ("odometer_m".to_owned(), Value::I64(self.odometer_m as i64)),
            ("lat".to_owned(), Value::F64(round(self.lat, 6))),
            ("lon".to_owned(), Value::F64(round(self.lon, 6))),
            ("ignition".to_owned(), Value::Bool(self.ignition)),
        ]
    }

    /// Starts and ends legs, stops and trips.
    fn schedule(&mut self, rng: &mut StdRng, dt_s: f64) {
        self.leg_left_s -= dt_s;
        if self.ignition {
            self.drive_left_s -= dt_s;
            if self.drive_left_s <= 0.0 && self.speed_kmh < 0.5 {
                self.park(rng);
            } else if self.drive_left_s <= 0.0 {
                self.target_kmh = 0.0;
            } else if self.leg_left_s <= 0.0 {
                self.new_leg(rng);
            }
        } else if self.leg_left_s <= 0.0 {
            self.ignition = true;
            self.drive_left_s = uniform(rng, 1200.0, 5400.0);
            self.new_leg(rng);
        }
    }

    fn new_leg(&mut self, rng: &mut StdRng) {
        let roll: f64 = rng.random();
        self.target_kmh = match roll {
            r if r < 0.10 => 0.0,
            r if r < 0.35 => uniform(rng, 25.0, 50.0),
            r if r < 0.60 => uniform(rng, 55.0, 80.0),
            _ => uniform(rng, 80.0, 90.0),
        };
        self.leg_left_s = if self.target_kmh == 0.0 {
            uniform(rng, 10.0, 90.0)
        } else {
            uniform(rng, 30.0, 600.0)
        };
        if rng.random_bool(0.3) {
            self.heading_rad += uniform(rng, -PI / 2.0, PI / 2.0);
        }
    }

    fn park(&mut self, rng: &mut StdRng) {
        self.ignition = false;
        self.target_kmh = 0.0;
        self.speed_kmh = 0.0;
        self.leg_left_s = uniform(rng, 300.0, 1800.0);
        if self.fuel_pct < 15.0 {
            self.fuel_pct = uniform(rng, 95.0, 100.0);
        }
    }

    /// Speed toward the leg's target within truck acceleration limits, then position.
    fn drive(&mut self, rng: &mut StdRng, dt_s: f64) {
        let delta = (self.target_kmh - self.speed_kmh)
            .clamp(-BRAKE_KMH_PER_S * dt_s, ACCEL_KMH_PER_S * dt_s);
        let jitter = if self.target_kmh > 0.0 {
            gauss(rng, 0.3 * dt_s.sqrt())
        } else {
            0.0
        };
        self.speed_kmh = (self.speed_kmh + delta + jitter).clamp(0.0, SPEED_KMH_MAX);
        if self.target_kmh == 0.0 && self.speed_kmh < 1.0 {
            self.speed_kmh = 0.0;
        }
        // Roads wind more at town speeds than on the motorway.
        let wander = if self.speed_kmh > 60.0 { 0.005 } else { 0.02 };
        self.heading_rad = (self.heading_rad + gauss(rng, wander * dt_s.sqrt())).rem_euclid(TAU);
        let distance_m = self.speed_kmh / 3.6 * dt_s;
        self.lat = (self.lat + distance_m * self.heading_rad.cos() / METERS_PER_DEGREE_LAT)
            .clamp(-89.9, 89.9);
        let m_per_deg_lon = METERS_PER_DEGREE_LAT * self.lat.to_radians().cos();
        self.lon = (self.lon + distance_m * self.heading_rad.sin() / m_per_deg_lon + 180.0)
            .rem_euclid(360.0)
            - 180.0;
        self.odometer_m += distance_m;
        let load = 1.0 + ((self.speed_kmh - 60.0) / 60.0).powi(2) * 0.3;
        self.fuel_pct = (self.fuel_pct
            - distance_m / 1000.0 * self.burn_l_per_km * load / TANK_L * 100.0)
            .max(0.0);
    }

    /// Engine temperature, oil pressure and battery voltage follow the ignition and the load.
    fn engine(&mut self, rng: &mut StdRng, dt_s: f64) {
        self.temp_bias_c = (self.temp_bias_c + gauss(rng, 0.0005 * dt_s.sqrt())).clamp(-1.5, 1.5);
        if self.ignition {
            let target = 84.0 + 0.08 * self.speed_kmh;
            self.engine_temp_c = approach(self.engine_temp_c, target, dt_s, 240.0);
            self.oil_bar = approach(self.oil_bar, oil_target(self.speed_kmh), dt_s, 2.0);
            self.battery_v = approach(self.battery_v, 14.1, dt_s, 30.0);
        } else {
            self.engine_temp_c = approach(self.engine_temp_c, self.ambient_c, dt_s, 1500.0);
            self.oil_bar = approach(self.oil_bar, 0.0, dt_s, 3.0);
            self.battery_v = approach(self.battery_v, 12.5, dt_s, 600.0);
        }
    }
}

/// Oil pressure rises with engine speed, which follows road speed.
fn oil_target(speed_kmh: f64) -> f64 {
    1.6 + 0.03 * speed_kmh
}
