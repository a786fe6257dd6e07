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

/// Channel types with a known ABI unit: (type, ABI units per SI unit, field suffix, range).
pub const IIO_UNITS: [(&str, f64, &str, (f64, f64)); 10] = [
    ("voltage", 1_000.0, "v", VOLTAGE_V_RANGE),
    ("current", 1_000.0, "a", CURRENT_A_RANGE),
    ("power", 1_000.0, "w", POWER_W_RANGE),
    ("temp", 1_000.0, "c", TEMP_C_RANGE),
    ("humidityrelative", 1_000.0, "pct", (-10.0, 110.0)),
    ("pressure", 1.0, "kpa", (0.0, 100_000.0)),
    ("accel", 1.0, "m_s2", (-IIO_ABS_MAX, IIO_ABS_MAX)),
    ("anglvel", 1.0, "rad_s", (-IIO_ABS_MAX, IIO_ABS_MAX)),
    ("magn", 1.0, "gauss", (-IIO_ABS_MAX, IIO_ABS_MAX)),
    ("illuminance", 1.0, "lux", (0.0, IIO_ABS_MAX)),
];

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

impl IioSource {
    /// `sysfs_root` is [`crate::hwmon::SYSFS_ROOT`] on a device; `device_id` prefixes the keys.
    pub fn new(sysfs_root: impl Into<PathBuf>, device_id: impl Into<String>) -> Self {
        IioSource { sysfs_root: sysfs_root.into(), device_id: device_id.into() }
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
                poll.records.push(Record { key, ts: now_ns, fields });
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
        let Some((chan, form)) = parse_channel(file) else { continue };
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
    let end = chan.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(chan.len());
    &chan[..end]
}

/// Reads one channel, applies offset and scale for raw values, converts to SI and checks range.
fn read_channel(dir: &Path, chan: &str, form: Form) -> Result<(String, f64), SensorError> {
    let ty = chan_type(chan);
    let (divisor, suffix, range) = IIO_UNITS
        .iter()
        .find(|(t, ..)| *t == ty)
        .map(|&(_, d, s, r)| (d, s, r))
        .unwrap_or((1.0, "", (-IIO_ABS_MAX, IIO_ABS_MAX)));
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
    let unit = if suffix.is_empty() { "(IIO ABI unit)" } else { suffix };
    let scaling = Scaling { divisor, min: range.0, max: range.1, unit };
    let path = dir.join(format!("in_{chan}_{}", if form == Form::Raw { "raw" } else { "input" }));
    let value = sysfs::check_range(&path, abi_value / divisor, scaling)?;
    let field = if suffix.is_empty() { sysfs::sanitize(chan) } else { format!("{}_{suffix}", sysfs::sanitize(chan)) };
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
        assert_eq!(parse_channel("in_voltage0_raw"), Some(("voltage0", Form::Raw)));
        assert_eq!(parse_channel("in_accel_x_raw"), Some(("accel_x", Form::Raw)));
        assert_eq!(parse_channel("in_temp_input"), Some(("temp", Form::Input)));
        assert_eq!(parse_channel("in_voltage_scale"), None);
        assert_eq!(parse_channel("in_voltage0_raw_available"), None);
        assert_eq!(parse_channel("out_voltage0_raw"), None);
        assert_eq!(parse_channel("in_0_raw"), None);
        assert_eq!(chan_type("voltage0-voltage1"), "voltage");
        assert_eq!(chan_type("humidityrelative"), "humidityrelative");
    }
}
