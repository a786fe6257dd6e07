//! The simulator: determinism, physical plausibility, per-key time order, the configured
//! fault rate, and dead zones. Long runs here simulate hours of data in well under a second.

use std::collections::HashMap;

use firmware::sim::{LinkSchedule, SimConfig, SimKind, Simulator};
use sync::{Record, Value};

const START: i64 = 1_764_374_400_000_000_000;
const SECOND: i64 = 1_000_000_000;

fn config(kind: SimKind, units: usize, seed: u64) -> SimConfig {
    SimConfig {
        kind,
        device_id: "edge-1".to_owned(),
        units,
        hz: 1.0,
        seed,
        start_ns: START,
        ..SimConfig::default()
    }
}

fn run(config: SimConfig, seconds: i64) -> Vec<Record> {
    Simulator::new(config)
        .unwrap()
        .next_batch(START + seconds * SECOND - 1)
}

fn f64_of(r: &Record, name: &str) -> f64 {
    match r.field(name) {
        Some(Value::F64(v)) => *v,
        other => panic!("{name} in {r:?}: {other:?}"),
    }
}

fn bool_of(r: &Record, name: &str) -> bool {
    match r.field(name) {
        Some(Value::Bool(b)) => *b,
        other => panic!("{name} in {r:?}: {other:?}"),
    }
}

fn by_key(records: &[Record]) -> HashMap<&str, Vec<&Record>> {
    let mut map: HashMap<&str, Vec<&Record>> = HashMap::new();
    for r in records {
        map.entry(r.key.as_str()).or_default().push(r);
    }
    map
}

#[test]
fn same_seed_same_records_whatever_the_batching() {
    for kind in [SimKind::Fleet, SimKind::Industrial] {
        let all = run(config(kind, 5, 7), 600);
        assert_eq!(all.len(), 5 * 600);
        let mut sim = Simulator::new(config(kind, 5, 7)).unwrap();
        let mut stepped = Vec::new();
        let mut until = START;
        while stepped.len() < all.len() {
            // Uneven steps, and bounded batches, must not change the stream.
            until += 7 * SECOND / 3;
            stepped.extend(sim.next_batch_max(until, 4));
        }
        assert_eq!(stepped, all, "{kind:?}");
        assert_ne!(
            run(config(kind, 5, 8), 600),
            all,
            "a different seed must give different data"
        );
    }
}

#[test]
fn a_unit_does_not_depend_on_how_many_units_there_are() {
    let one = run(config(SimKind::Fleet, 1, 3), 120);
    let many = run(config(SimKind::Fleet, 4, 3), 120);
    let first: Vec<_> = many
        .iter()
        .filter(|r| r.key == "edge-1/truck-0000/engine")
        .cloned()
        .collect();
    assert_eq!(first, one);
}

#[test]
fn records_are_in_time_order_and_keys_are_named() {
    let records = run(config(SimKind::Fleet, 12, 1), 300);
    assert!(
        records.windows(2).all(|w| w[0].ts <= w[1].ts),
        "global time order"
    );
    for (key, rs) in by_key(&records) {
        assert!(
            key.starts_with("edge-1/truck-") && key.ends_with("/engine"),
            "{key}"
        );
        assert!(
            rs.windows(2).all(|w| w[0].ts < w[1].ts),
            "{key}: per-key monotonic"
        );
        assert!(
            rs.iter()
                .all(|r| r.ts >= START && r.ts < START + 300 * SECOND)
        );
    }
    let machines = run(config(SimKind::Industrial, 3, 1), 10);
    let keys: Vec<_> = by_key(&machines)
        .into_keys()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(
        keys,
        [
            "edge-1/machine-00",
            "edge-1/machine-01",
            "edge-1/machine-02"
        ]
    );
}

#[test]
fn truck_values_are_physically_plausible() {
    // Six hours of 20 trucks, one sample every 5 s.
    let c = SimConfig {
        hz: 0.2,
        ..config(SimKind::Fleet, 20, 11)
    };
    let records = run(c, 6 * 3600);
    let fields: Vec<_> = records[0].fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        fields,
        [
            "engine_temp_c",
            "oil_bar",
            "battery_v",
            "speed_kmh",
            "fuel_pct",
            "odometer_m",
            "lat",
            "lon",
            "ignition",
            "fault"
        ]
    );
    let mut moved = 0;
    let mut parked = 0;
    for (key, rs) in by_key(&records) {
        for r in rs.iter().filter(|r| !bool_of(r, "fault")) {
            let check = |name: &str, lo: f64, hi: f64| {
                let v = f64_of(r, name);
                assert!((lo..=hi).contains(&v), "{key} {name} = {v} at {}", r.ts);
            };
            check("engine_temp_c", -30.0, 125.0);
            check("oil_bar", 0.0, 7.0);
            check("battery_v", 11.5, 15.0);
            check("speed_kmh", 0.0, 130.0);
            check("fuel_pct", 0.0, 100.0);
            check("lat", -90.0, 90.0);
            check("lon", -180.0, 180.0);
            // Sensor resolution: at most 2 decimals for temperatures.
            let t = f64_of(r, "engine_temp_c");
            assert_eq!((t * 100.0).round() / 100.0, t);
            if !bool_of(r, "ignition") {
                assert_eq!(
                    f64_of(r, "speed_kmh"),
                    0.0,
                    "{key}: parked trucks do not move"
                );
                parked += 1;
            }
        }
        let odometer: Vec<i64> = rs
            .iter()
            .map(|r| match r.field("odometer_m") {
                Some(Value::I64(v)) => *v,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(
            odometer.windows(2).all(|w| w[0] <= w[1]),
            "{key}: odometer never runs back"
        );
        let driven_m = odometer.last().unwrap() - odometer[0];
        moved += i64::from(driven_m > 10_000);
        // Fuel falls with distance; it only rises when refilled (a large jump at a stop).
        let fuel: Vec<f64> = rs.iter().map(|r| f64_of(r, "fuel_pct")).collect();
        assert!(
            fuel.windows(2).all(|w| w[1] <= w[0] || w[1] - w[0] > 50.0),
            "{key}: fuel {fuel:?}"
        );
    }
    assert!(
        moved >= 15,
        "most trucks drive more than 10 km in 6 hours, {moved} did"
    );
    assert!(parked > 0, "some samples are taken parked");
}

#[test]
fn engines_warm_up_after_a_cold_start() {
    // Find a truck that starts parked and cold, and check it warms once it drives.
    let records = run(
        SimConfig {
            hz: 0.1,
            ..config(SimKind::Fleet, 30, 5)
        },
        4 * 3600,
    );
    let mut warmed = 0;
    for rs in by_key(&records).values() {
        let clean: Vec<_> = rs.iter().filter(|r| !bool_of(r, "fault")).collect();
        let first_drive = clean.iter().position(|r| bool_of(r, "ignition"));
        let Some(i) = first_drive.filter(|&i| i > 0 && f64_of(clean[0], "engine_temp_c") < 50.0)
        else {
            continue;
        };
        let later = clean.iter().skip(i + 60).find(|r| bool_of(r, "ignition"));
        if let Some(later) = later {
            assert!(
                f64_of(later, "engine_temp_c") > 75.0,
                "10 minutes of driving warms the engine"
            );
            warmed += 1;
        }
    }
    assert!(warmed > 0, "no cold start found among 30 trucks");
}

#[test]
fn machine_values_are_physically_plausible() {
    let records = run(
        SimConfig {
            hz: 0.5,
            ..config(SimKind::Industrial, 10, 2)
        },
        4 * 3600,
    );
    let fields: Vec<_> = records[0].fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        fields,
        [
            "vibration_rms",
            "pressure_bar",
            "flow_lpm",
            "motor_temp_c",
            "running",
            "fault"
        ]
    );
    let mut running = 0;
    let mut stopped = 0;
    for r in records.iter().filter(|r| !bool_of(r, "fault")) {
        let (vib, p, flow, temp) = (
            f64_of(r, "vibration_rms"),
            f64_of(r, "pressure_bar"),
            f64_of(r, "flow_lpm"),
            f64_of(r, "motor_temp_c"),
        );
        assert!((0.0..=20.0).contains(&vib), "{r:?}");
        assert!((0.0..=12.0).contains(&p), "{r:?}");
        assert!((0.0..=300.0).contains(&flow), "{r:?}");
        assert!((-30.0..=130.0).contains(&temp), "{r:?}");
        if bool_of(r, "running") {
            running += 1;
        } else {
            stopped += 1;
            assert!(vib < 0.5, "a stopped machine barely vibrates: {r:?}");
        }
    }
    assert!(
        running > stopped && stopped > 0,
        "duty cycles: {running} running, {stopped} stopped"
    );
}

#[test]
fn faults_occur_at_the_configured_rate() {
    for kind in [SimKind::Fleet, SimKind::Industrial] {
        let p = 0.01;
        let c = SimConfig {
            fault_probability: p,
            ..config(kind, 20, 99)
        };
        let records = run(c, 3600);
        // An episode can start on any sample whose predecessor was clean; each rising edge of
        // `fault` is one episode.
        let (mut chances, mut episodes, mut stuck_runs) = (0u64, 0u64, 0u64);
        for rs in by_key(&records).values() {
            let mut previous = false;
            let mut run_len = 0;
            for r in rs {
                let fault = bool_of(r, "fault");
                if !previous {
                    chances += 1;
                    episodes += u64::from(fault);
                }
                run_len = if fault { run_len + 1 } else { 0 };
                stuck_runs += u64::from(run_len == 5);
                previous = fault;
            }
        }
        let expected = chances as f64 * p;
        let sigma = (chances as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (episodes as f64 - expected).abs() < 4.0 * sigma,
            "{kind:?}: {episodes} episodes in {chances} chances, expected {expected:.0} +- {sigma:.0}"
        );
        assert!(
            stuck_runs > 0 && stuck_runs < episodes,
            "{kind:?}: both spikes and stuck sensors occur"
        );
    }
}

#[test]
fn no_faults_when_the_probability_is_zero() {
    let records = run(
        SimConfig {
            fault_probability: 0.0,
            ..config(SimKind::Industrial, 5, 1)
        },
        3600,
    );
    assert!(records.iter().all(|r| !bool_of(r, "fault")));
}

#[test]
fn dead_zones_exist_and_follow_the_seed() {
    let sim = Simulator::new(config(SimKind::Fleet, 1, 4)).unwrap();
    let hour = 3600 * SECOND;
    let zones = sim.dead_zones(START, START + hour);
    // 29 windows after the first, each with a 50% chance: the odds of fewer than 5 are ~1e-4,
    // and the seed is fixed anyway.
    assert!(zones.len() >= 5, "{zones:?}");
    assert!(sim.link_up(START), "a device starts connected");
    assert!(
        sim.link_up(START + 119 * SECOND),
        "the first window is always up"
    );
    let link = LinkSchedule::default();
    for &(s, e) in &zones {
        let secs = (e - s) as f64 / 1e9;
        assert!(
            secs >= link.dead_zone_min_s && secs <= link.dead_zone_max_s,
            "{secs}"
        );
        assert!(!sim.link_up(s) && !sim.link_up((s + e) / 2) && !sim.link_up(e - 1));
        assert!(sim.link_up(s - 1) && sim.link_up(e));
    }
    assert!(
        zones.windows(2).all(|w| w[0].1 <= w[1].0),
        "zones are ordered and disjoint"
    );
    // Sampled every second, link_up agrees with the listed zones.
    let down = (0..3600)
        .filter(|s| !sim.link_up(START + s * SECOND))
        .count() as i64;
    let listed: i64 = zones
        .iter()
        .map(|(s, e)| (e - s + SECOND - 1) / SECOND)
        .sum();
    assert!(
        (down - listed).abs() <= zones.len() as i64,
        "{down} s down, {listed} s listed"
    );

    // The schedule is a function of the seed and device, not of sampling.
    let mut sampled = Simulator::new(config(SimKind::Fleet, 1, 4)).unwrap();
    sampled.next_batch(START + hour);
    assert_eq!(sampled.dead_zones(START, START + hour), zones);
    let other = Simulator::new(config(SimKind::Fleet, 1, 5)).unwrap();
    assert_ne!(other.dead_zones(START, START + hour), zones);
    let other_device = Simulator::new(SimConfig {
        device_id: "edge-2".to_owned(),
        ..config(SimKind::Fleet, 1, 4)
    })
    .unwrap();
    assert_ne!(other_device.dead_zones(START, START + hour), zones);
}

#[test]
fn next_ts_tells_when_the_next_sample_is_due() {
    let mut sim = Simulator::new(SimConfig {
        hz: 10.0,
        ..config(SimKind::Industrial, 3, 1)
    })
    .unwrap();
    assert_eq!(sim.next_ts(), START);
    let batch = sim.next_batch(START + SECOND - 1);
    assert_eq!(batch.len(), 30);
    assert!(sim.next_ts() >= START + SECOND);
    assert_eq!(sim.next_batch(sim.next_ts() - 1), vec![]);
    assert_eq!(sim.next_batch(sim.next_ts()).len(), 1);
}
