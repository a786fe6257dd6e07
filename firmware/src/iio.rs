//! Linux IIO (industrial I/O) devices read from sysfs: ADCs, temperature, humidity, pressure,
//! IMUs.
//!
//! Layout (Documentation/ABI/testing/sysfs-bus-iio):
//!
//! ```text
//! {root}/bus/iio/devices/iio:deviceN/name
//! {root}/bus/iio/devices/iio:deviceN/in_<chan>_raw       raw ADC counts, e.g. in_voltage0_raw
//! {root}/bus/iio/devices/iio:deviceN/in_<chan>_input     already processed, used as is
//! {root}/bus/iio/devices/iio:deviceN/in_<chan>_scale     or the type-wide in_<type>_scale
//! {root}/bus/iio/devices/iio:deviceN/in_<chan>_offset    or the type-wide in_<type>_offset
//! ```
//!
//! `<chan>` is a type with an optional index and modifier (`voltage0`, `accel_x`, `temp`); the
//! type is its leading letters. For a `_raw` channel the value is `(raw + offset) * scale`, per
//! the ABI. The per-channel scale/offset wins over the type-wide one. **A missing scale means 1
//! and a missing offset means 0**: both are optional in the ABI. A `_input` channel is already
//! processed by the driver and takes no scale or offset; when a channel has both, `_input` is
//! read.
//!
//! The ABI's units are then converted to SI for the types listed in [`IIO_UNITS`] (millivolt
//! to V, milli degree C to degC, ...) and the field is named `{chan}_{unit}`: `voltage0_v`,
//! `temp_c`, `accel_x_m_s2`. Other types keep the ABI's unit and are named `{chan}`.
//! One record per device per poll, keyed `{device_id}/iio/{name}`.

use std::path::{Path, PathBuf};

use sync::{Record, Value};

use crate::hwmon::{CURRENT_A_RANGE, POWER_W_RANGE, TEMP_C_RANGE, VOLTAGE_V_RANGE};
use crate::sysfs::{self, Poll, Scaling, SensorError};

/// Any processed value beyond this magnitude is garbage, whatever the channel type.
pub const IIO_ABS_MAX: f64 = 1e12;

/// How one IIO channel type's ABI unit becomes an SI value and a field name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IioUnit {
    /// The channel type, e.g. `voltage`.
    pub ty: &'static str,
    /// ABI units per SI unit: 1000 for millivolts.
    pub divisor: f64,
    /// Appended to the field name: `voltage0_v`.
    pub suffix: &'static str,
    /// The SI unit's name in error messages.
    pub unit: &'static str,
    /// Plausible SI values; anything else is reported as out of range.
    pub range: (f64, f64),
}

const fn unit(
    ty: &'static str,
    divisor: f64,
    suffix: &'static str,
    unit: &'static str,
    range: (f64, f64),
) -> IioUnit {
    IioUnit {
        ty,
        divisor,
        suffix,
        unit,
        range,
    }
}

const ANY: (f64, f64) = (-IIO_ABS_MAX, IIO_ABS_MAX);

/// Channel types with a known ABI unit (Documentation/ABI/testing/sysfs-bus-iio).
pub const IIO_UNITS: [IioUnit; 10] = [
    unit("voltage", 1_000.0, "v", "V", VOLTAGE_V_RANGE),
    unit("current", 1_000.0, "a", "A", CURRENT_A_RANGE),
    unit("power", 1_000.0, "w", "W", POWER_W_RANGE),
    unit("temp", 1_000.0, "c", "degC", TEMP_C_RANGE),
    unit("humidityrelative", 1_000.0, "pct", "%RH", (-10.0, 110.0)),
    unit("pressure", 1.0, "kpa", "kPa", (0.0, 100_000.0)),
    unit("accel", 1.0, "m_s2", "m/s^2", ANY),
    unit("anglvel", 1.0, "rad_s", "rad/s", ANY),
    unit("magn", 1.0, "gauss", "Gauss", ANY),
    unit("illuminance", 1.0, "lux", "lux", (0.0, IIO_ABS_MAX)),
];

/// Any other type: the ABI's unit, kept as is.
const UNKNOWN_UNIT: IioUnit = unit("", 1.0, "", "(IIO ABI unit)", ANY);

/// Reads IIO devices under one sysfs root.
#[derive(Debug, Clone)]
pub struct IioSource {
    sysfs_root: PathBuf,
    device_id: String,
}

/// How one channel is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Raw,
    Input,
}

impl Form {
    fn suffix(self) -> &'static str {
        match self {
            Form::Raw => "raw",
            Form::Input => "input",
        }
    }
}

impl IioSource {
    /// `sysfs_root` is [`crate::hwmon::SYSFS_ROOT`] on a device; `device_id` prefixes the keys.
    pub fn new(sysfs_root: impl Into<PathBuf>, device_id: impl Into<String>) -> Self {
        IioSource {
            sysfs_root: sysfs_root.into(),
            device_id: device_id.into(),
        }
    }

    /// Reads every IIO device once: one record per device with at least one good channel.
    pub fn poll(&self, now_ns: i64) -> Poll {
        let mut poll = Poll::default();
        let dir = self.sysfs_root.join("bus/iio/devices");
        let devices = match sysfs::list_indexed(&dir, "iio:device") {
            Ok(devices) => devices,
            Err(e) => {
                poll.errors.push(e);
                return poll;
            }
        };
        let named: Vec<(u32, String)> = devices
            .iter()
            .map(|(index, dir)| match sysfs::read_text(&dir.join("name")) {
                Ok(name) => (*index, sysfs::sanitize(&name)),
                Err(e) => {
                    poll.errors.push(e);
                    (*index, format!("iio_device{index}"))
                }
            })
            .collect();
        for ((_, dir), name) in devices.iter().zip(sysfs::unique_names(&named)) {
            let fields = read_device(dir, &mut poll.errors);
            if !fields.is_empty() {
                let key = format!("{}/iio/{name}", self.device_id);
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
}

/// Reads every channel of one device, in file-name order.
fn read_device(dir: &Path, errors: &mut Vec<SensorError>) -> Vec<(String, Value)> {
    let names = match sysfs::file_names(dir) {
        Ok(names) => names,
        Err(e) => {
            errors.push(e);
            return Vec::new();
        }
    };
    let mut fields = Vec::new();
    for file in &names {
        let Some((chan, form)) = parse_channel(file) else {
            continue;
        };
        if form == Form::Raw && names.iter().any(|n| *n == format!("in_{chan}_input")) {
            continue;
        }
        match read_channel(dir, chan, form) {
            Ok((field, value)) => {
                let field = sysfs::unique_field(&fields, field, chan);
                fields.push((field, Value::F64(value)));
            }
            Err(e) => errors.push(e),
        }
    }
    fields
}

/// `in_voltage0_raw` -> ("voltage0", Raw); `in_temp_input` -> ("temp", Input).
fn parse_channel(file: &str) -> Option<(&str, Form)> {
    let rest = file.strip_prefix("in_")?;
    let (chan, form) = match rest.strip_suffix("_raw") {
        Some(chan) => (chan, Form::Raw),
        None => (rest.strip_suffix("_input")?, Form::Input),
    };
    if chan_type(chan).is_empty() {
        return None;
    }
    Some((chan, form))
}

/// The channel's type: its leading letters (`accel` in `accel_x`, `voltage` in `voltage0`).
fn chan_type(chan: &str) -> &str {
    let end = chan
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(chan.len());
    &chan[..end]
}

/// Reads one channel, applies offset and scale for raw values, converts to SI and checks range.
fn read_channel(dir: &Path, chan: &str, form: Form) -> Result<(String, f64), SensorError> {
    let ty = chan_type(chan);
    let u = IIO_UNITS
        .iter()
        .find(|u| u.ty == ty)
        .copied()
        .unwrap_or(UNKNOWN_UNIT);
    let abi_value = match form {
        Form::Input => {
            let path = dir.join(format!("in_{chan}_input"));
            sysfs::parse_decimal(&path, &sysfs::read_text(&path)?)?
        }
        Form::Raw => {
            let path = dir.join(format!("in_{chan}_raw"));
            let raw = sysfs::parse_int(&path, &sysfs::read_text(&path)?)?;
            let offset = optional_attr(dir, chan, ty, "offset")?.unwrap_or(0.0);
            let scale = optional_attr(dir, chan, ty, "scale")?.unwrap_or(1.0);
            (raw + offset) * scale
        }
    };
    let value_file = dir.join(format!("in_{chan}_{}", form.suffix()));
    let scaling = Scaling {
        divisor: u.divisor,
        min: u.range.0,
        max: u.range.1,
        unit: u.unit,
    };
    let value = sysfs::check_range(&value_file, abi_value / u.divisor, scaling)?;
    let name = sysfs::sanitize(chan);
    let field = if u.suffix.is_empty() {
        name
    } else {
        format!("{name}_{}", u.suffix)
    };
    Ok((field, value))
}

/// Reads `in_{chan}_{attr}`, else `in_{type}_{attr}`; `None` when neither exists.
fn optional_attr(dir: &Path, chan: &str, ty: &str, attr: &str) -> Result<Option<f64>, SensorError> {
    for name in [format!("in_{chan}_{attr}"), format!("in_{ty}_{attr}")] {
        let path = dir.join(name);
        if path.exists() {
            return sysfs::parse_decimal(&path, &sysfs::read_text(&path)?).map(Some);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_parse() {
        assert_eq!(
            parse_channel("in_voltage0_raw"),
            Some(("voltage0", Form::Raw))
        );
        assert_eq!(
            parse_channel("in_accel_x_raw"),
            Some(("accel_x", Form::Raw))
        );
        assert_eq!(parse_channel("in_temp_input"), Some(("temp", Form::Input)));
        assert_eq!(parse_channel("in_voltage_scale"), None);
        assert_eq!(parse_channel("in_voltage0_raw_available"), None);
        assert_eq!(parse_channel("out_voltage0_raw"), None);
        assert_eq!(parse_channel("in_0_raw"), None);
        assert_eq!(chan_type("voltage0-voltage1"), "voltage");
        assert_eq!(chan_type("humidityrelative"), "humidityrelative");
    }
}
