//! Linux hwmon chips and thermal zones, read from sysfs and converted to SI units.
//!
//! Layout (Documentation/hwmon/sysfs-interface.rst and the thermal sysfs ABI):
//!
//! ```text
//! {root}/class/hwmon/hwmonN/name                   chip name, e.g. "coretemp"
//! {root}/class/hwmon/hwmonN/tempK_input [_label]   millidegree Celsius  -> `{label}_c`   f64 degC
//! {root}/class/hwmon/hwmonN/inK_input   [_label]   millivolt            -> `{label}_v`   f64 V
//! {root}/class/hwmon/hwmonN/fanK_input  [_label]   revolutions/minute   -> `{label}_rpm` i64
//! {root}/class/hwmon/hwmonN/powerK_input[_label]   microwatt            -> `{label}_w`   f64 W
//! {root}/class/hwmon/hwmonN/currK_input [_label]   milliampere          -> `{label}_a`   f64 A
//! {root}/class/thermal/thermal_zoneN/{type,temp}   millidegree Celsius  -> `temp_c`      f64 degC
//! ```
//!
//! Older drivers keep the attributes in `hwmonN/device/`; that directory is used when `hwmonN`
//! has no `name`. A channel without a label is named after the channel (`temp1_c`). One record
//! is produced per chip (`{device_id}/hwmon/{name}`) and per zone (`{device_id}/thermal/{type}`)
//! per poll; names shared by several chips or zones get the sysfs index appended (`nvme-1`).
//! The sysfs root is a parameter so tests can point it at a fake tree.

use std::path::{Path, PathBuf};

use sync::{Record, Value};

use crate::sysfs::{self, Poll, Scaling, SensorError};

/// Where sysfs is mounted on a real device.
pub const SYSFS_ROOT: &str = "/sys";

/// Temperatures outside this range (degC) cannot come from a working sensor. The top is high
/// enough for thermocouple interfaces; a reading of 1e6 degC is garbage.
pub const TEMP_C_RANGE: (f64, f64) = (-100.0, 1500.0);
/// Voltages outside this range (V) are garbage.
pub const VOLTAGE_V_RANGE: (f64, f64) = (-600.0, 600.0);
/// Fan speeds outside this range (RPM) are garbage.
pub const FAN_RPM_RANGE: (f64, f64) = (0.0, 100_000.0);
/// Power readings outside this range (W) are garbage.
pub const POWER_W_RANGE: (f64, f64) = (-100_000.0, 100_000.0);
/// Currents outside this range (A) are garbage.
pub const CURRENT_A_RANGE: (f64, f64) = (-10_000.0, 10_000.0);

/// One hwmon channel type: its file prefix, unit conversion and field suffix.
#[derive(Debug, Clone, Copy)]
struct ChannelKind {
    prefix: &'static str,
    suffix: &'static str,
    scaling: Scaling,
    /// Fan speeds are whole numbers and stay integers.
    integer: bool,
}

const fn kind(
    prefix: &'static str,
    suffix: &'static str,
    divisor: f64,
    range: (f64, f64),
    unit: &'static str,
) -> ChannelKind {
    ChannelKind {
        prefix,
        suffix,
        scaling: Scaling {
            divisor,
            min: range.0,
            max: range.1,
            unit,
        },
        integer: false,
    }
}

const KINDS: [ChannelKind; 5] = [
    kind("temp", "c", 1_000.0, TEMP_C_RANGE, "degC"),
    kind("in", "v", 1_000.0, VOLTAGE_V_RANGE, "V"),
    ChannelKind {
        integer: true,
        ..kind("fan", "rpm", 1.0, FAN_RPM_RANGE, "RPM")
    },
    kind("power", "w", 1_000_000.0, POWER_W_RANGE, "W"),
    kind("curr", "a", 1_000.0, CURRENT_A_RANGE, "A"),
];

const THERMAL_SCALING: Scaling = Scaling {
    divisor: 1_000.0,
    min: TEMP_C_RANGE.0,
    max: TEMP_C_RANGE.1,
    unit: "degC",
};

/// Reads hwmon chips and thermal zones under one sysfs root.
#[derive(Debug, Clone)]
pub struct HwmonSource {
    sysfs_root: PathBuf,
    device_id: String,
}

impl HwmonSource {
    /// `sysfs_root` is [`SYSFS_ROOT`] on a device; `device_id` prefixes every record key.
    pub fn new(sysfs_root: impl Into<PathBuf>, device_id: impl Into<String>) -> Self {
        HwmonSource {
            sysfs_root: sysfs_root.into(),
            device_id: device_id.into(),
        }
    }

    /// Reads every hwmon chip and thermal zone once, stamping records with `now_ns`.
    pub fn poll(&self, now_ns: i64) -> Poll {
        let mut poll = self.poll_hwmon(now_ns);
        poll.extend(self.poll_thermal(now_ns));
        poll
    }

    /// Reads every hwmon chip once: one record per chip with at least one good channel.
    pub fn poll_hwmon(&self, now_ns: i64) -> Poll {
        let mut poll = Poll::default();
        let chips = match sysfs::list_indexed(&self.sysfs_root.join("class/hwmon"), "hwmon") {
            Ok(chips) => chips,
            Err(e) => {
                poll.errors.push(e);
                return poll;
            }
        };
        let named: Vec<(u32, PathBuf, String)> = chips
            .into_iter()
            .map(|(index, dir)| {
                let (attrs, name) = chip_name(index, &dir, &mut poll.errors);
                (index, attrs, name)
            })
            .collect();
        let keys = sysfs::unique_names(
            &named
                .iter()
                .map(|(i, _, n)| (*i, n.clone()))
                .collect::<Vec<_>>(),
        );
        for ((_, attrs, _), name) in named.iter().zip(keys) {
            let fields = read_chip(attrs, &mut poll.errors);
            if !fields.is_empty() {
                let key = format!("{}/hwmon/{name}", self.device_id);
                poll.records.push(Record {
                    tags: Vec::new(),
                    key,
                    ts: now_ns,
                    fields,
                });
            }
        }
        poll
    }

    /// Reads every thermal zone once: one record per zone with a good `temp`.
    pub fn poll_thermal(&self, now_ns: i64) -> Poll {
        let mut poll = Poll::default();
        let zones =
            match sysfs::list_indexed(&self.sysfs_root.join("class/thermal"), "thermal_zone") {
                Ok(zones) => zones,
                Err(e) => {
                    poll.errors.push(e);
                    return poll;
                }
            };
        let typed: Vec<(u32, String)> = zones
            .iter()
            .map(|(index, dir)| match sysfs::read_text(&dir.join("type")) {
                Ok(t) => (*index, sysfs::sanitize(&t)),
                Err(e) => {
                    poll.errors.push(e);
                    (*index, format!("thermal_zone{index}"))
                }
            })
            .collect();
        for ((_, dir), name) in zones.iter().zip(sysfs::unique_names(&typed)) {
            match sysfs::read_scaled(&dir.join("temp"), THERMAL_SCALING) {
                Ok(c) => poll.records.push(Record {
                    tags: Vec::new(),
                    key: format!("{}/thermal/{name}", self.device_id),
                    ts: now_ns,
                    fields: vec![("temp_c".to_owned(), Value::F64(c))],
                }),
                Err(e) => poll.errors.push(e),
            }
        }
        poll
    }
}

/// The directory holding a chip's attributes and the chip's name. A missing `name` is an
/// error, but the chip is still read, under `hwmonN`.
fn chip_name(index: u32, dir: &Path, errors: &mut Vec<SensorError>) -> (PathBuf, String) {
    let name_file = dir.join("name");
    let legacy = dir.join("device");
    if !name_file.exists() && legacy.join("name").exists() {
        return chip_name(index, &legacy, errors);
    }
    match sysfs::read_text(&name_file) {
        Ok(name) => (dir.to_owned(), sysfs::sanitize(&name)),
        Err(e) => {
            errors.push(e);
            (dir.to_owned(), format!("hwmon{index}"))
        }
    }
}

/// Reads every `*_input` channel of one chip, in file-name order.
fn read_chip(dir: &Path, errors: &mut Vec<SensorError>) -> Vec<(String, Value)> {
    let names = match sysfs::file_names(dir) {
        Ok(names) => names,
        Err(e) => {
            errors.push(e);
            return Vec::new();
        }
    };
    let mut fields = Vec::new();
    for file in &names {
        let Some((kind, channel)) = parse_channel(file) else {
            continue;
        };
        match read_channel(dir, kind, channel, errors) {
            Ok((field, value)) => {
                let field = sysfs::unique_field(&fields, field, channel);
                fields.push((field, value));
            }
            Err(e) => errors.push(e),
        }
    }
    fields
}

/// `temp1_input` -> (temp, "temp1"); anything else -> None.
fn parse_channel(file: &str) -> Option<(ChannelKind, &str)> {
    let channel = file.strip_suffix("_input")?;
    let digits_at = channel.find(|c: char| c.is_ascii_digit())?;
    let (prefix, digits) = channel.split_at(digits_at);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    KINDS
        .iter()
        .find(|k| k.prefix == prefix)
        .map(|k| (*k, channel))
}

/// Reads one channel's value and names its field from the label, if there is one.
fn read_channel(
    dir: &Path,
    kind: ChannelKind,
    channel: &str,
    errors: &mut Vec<SensorError>,
) -> Result<(String, Value), SensorError> {
    let value = sysfs::read_scaled(&dir.join(format!("{channel}_input")), kind.scaling)?;
    let value = if kind.integer {
        Value::I64(value as i64)
    } else {
        Value::F64(value)
    };
    let label_file = dir.join(format!("{channel}_label"));
    // Labels are optional, so a missing one just means the channel's own name. A label that
    // exists but cannot be read is reported, and the reading is kept under the channel name.
    let base = if label_file.exists() {
        match sysfs::read_text(&label_file) {
            Ok(label) => sysfs::sanitize(&label),
            Err(e) => {
                errors.push(e);
                channel.to_owned()
            }
        }
    } else {
        channel.to_owned()
    };
    Ok((format!("{base}_{}", kind.suffix), value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_parse() {
        assert_eq!(
            parse_channel("temp12_input").map(|(k, c)| (k.prefix, c)),
            Some(("temp", "temp12"))
        );
        assert_eq!(
            parse_channel("in0_input").map(|(k, c)| (k.prefix, c)),
            Some(("in", "in0"))
        );
        assert!(parse_channel("temp1_label").is_none());
        assert!(parse_channel("temp_input").is_none());
        assert!(parse_channel("intrusion0_input").is_none());
        assert!(parse_channel("temp1a_input").is_none());
    }
}
