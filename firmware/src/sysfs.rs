//! What the sysfs readers (hwmon, thermal, IIO) share: the per-channel error, the poll result,
//! and careful file reading.
//!
//! sysfs attributes are small text files holding one value, but on a real board they can be
//! missing, unreadable (`EIO`, `ENODATA` while a sensor is not ready), empty or garbage, and a
//! broken sensor can report absurd numbers. Each of those becomes a [`SensorError`] naming the
//! file, collected next to the readings that did work, so one bad channel never hides the rest.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sync::Record;
use thiserror::Error;

/// sysfs attributes are at most one page; anything longer is not a sensor value.
const ATTRIBUTE_BYTES_MAX: u64 = 4096;
/// Garbage is quoted in errors, but only this much of it, so a log line stays a line.
const QUOTE_CHARS_MAX: usize = 48;

/// The result of one poll: every reading that worked, and every channel that did not.
#[derive(Debug, Default)]
pub struct Poll {
    /// One record per chip, zone or device that had at least one good channel.
    pub records: Vec<Record>,
    /// One error per channel (or per device attribute) that could not be read.
    pub errors: Vec<SensorError>,
}

impl Poll {
    /// Appends another poll's records and errors to this one.
    pub fn extend(&mut self, other: Poll) {
        self.records.extend(other.records);
        self.errors.extend(other.errors);
    }
}

/// Why one sensor channel (one sysfs file) gave no reading.
#[derive(Debug, Error)]
pub enum SensorError {
    /// The file or directory is missing or could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file holds nothing but whitespace.
    #[error("{}: empty value", path.display())]
    Empty { path: PathBuf },
    /// The file holds something that is not a number of the expected form.
    #[error("{}: not a number: {value:?}", path.display())]
    NotNumeric { path: PathBuf, value: String },
    /// The number, converted to `unit`, cannot come from a working sensor.
    #[error("{}: {value} {unit} is outside the plausible range {min} to {max} {unit}", path.display())]
    OutOfRange {
        path: PathBuf,
        value: f64,
        min: f64,
        max: f64,
        unit: &'static str,
    },
}

impl SensorError {
    /// The sysfs file (or directory) at fault.
    pub fn path(&self) -> &Path {
        match self {
            SensorError::Read { path, .. }
            | SensorError::Empty { path }
            | SensorError::NotNumeric { path, .. }
            | SensorError::OutOfRange { path, .. } => path,
        }
    }
}

/// How to turn one integer attribute into a plausible SI value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scaling {
    /// The kernel's unit per SI unit, for example 1000 for millidegrees.
    pub divisor: f64,
    pub min: f64,
    pub max: f64,
    pub unit: &'static str,
}

/// Reads a trimmed text attribute; whitespace only is [`SensorError::Empty`].
pub(crate) fn read_text(path: &Path) -> Result<String, SensorError> {
    let read_err = |source| SensorError::Read {
        path: path.to_owned(),
        source,
    };
    let mut bytes = Vec::new();
    fs::File::open(path)
        .and_then(|f| f.take(ATTRIBUTE_BYTES_MAX).read_to_end(&mut bytes))
        .map_err(read_err)?;
    let text = String::from_utf8_lossy(&bytes).trim().to_owned();
    if text.is_empty() {
        return Err(SensorError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(text)
}

/// Reads an integer attribute and converts it with `scaling`, checking plausibility.
pub(crate) fn read_scaled(path: &Path, scaling: Scaling) -> Result<f64, SensorError> {
    let text = read_text(path)?;
    let raw = parse_int(path, &text)?;
    let value = raw / scaling.divisor;
    check_range(path, value, scaling)
}

/// Parses an optionally signed decimal integer. One too large for `i64` is still returned (as
/// an `f64`) so the caller reports it as out of range rather than as garbage.
pub(crate) fn parse_int(path: &Path, text: &str) -> Result<f64, SensorError> {
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(not_numeric(path, text));
    }
    match text.parse::<i64>() {
        Ok(n) => Ok(n as f64),
        // All digits, so this only fails on overflow and the f64 parse succeeds.
        Err(_) => text.parse::<f64>().map_err(|_| not_numeric(path, text)),
    }
}

/// Parses a finite decimal number such as `0.000805664` or `-273.15` (IIO scale and offset).
pub(crate) fn parse_decimal(path: &Path, text: &str) -> Result<f64, SensorError> {
    // `f64::from_str` also takes `inf` and `NaN`, which no sensor attribute means.
    let plain = text
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'+' | b'e' | b'E'));
    match text.parse::<f64>() {
        Ok(v) if plain && v.is_finite() => Ok(v),
        _ => Err(not_numeric(path, text)),
    }
}

pub(crate) fn check_range(path: &Path, value: f64, scaling: Scaling) -> Result<f64, SensorError> {
    if value.is_finite() && (scaling.min..=scaling.max).contains(&value) {
        return Ok(value);
    }
    Err(SensorError::OutOfRange {
        path: path.to_owned(),
        value,
        min: scaling.min,
        max: scaling.max,
        unit: scaling.unit,
    })
}

fn not_numeric(path: &Path, text: &str) -> SensorError {
    let value: String = text.chars().take(QUOTE_CHARS_MAX).collect();
    SensorError::NotNumeric {
        path: path.to_owned(),
        value,
    }
}

/// The entries of `dir` named `{prefix}{N}`, sorted by N. Other entries are ignored.
pub(crate) fn list_indexed(dir: &Path, prefix: &str) -> Result<Vec<(u32, PathBuf)>, SensorError> {
    let read_err = |source| SensorError::Read {
        path: dir.to_owned(),
        source,
    };
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let name = entry.file_name();
        let index = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|n| n.parse().ok());
        if let Some(index) = index {
            found.push((index, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The file names in `dir`, sorted, so records list their fields in a stable order.
pub(crate) fn file_names(dir: &Path) -> Result<Vec<String>, SensorError> {
    let read_err = |source| SensorError::Read {
        path: dir.to_owned(),
        source,
    };
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(read_err)? {
        if let Some(name) = entry.map_err(read_err)?.file_name().to_str() {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// Turns a label such as `Package id 0` into a key or field part such as `package_id_0`.
pub(crate) fn sanitize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
            out.push(c);
        } else if !out.ends_with('_') {
            out.push('_');
        }
    }
    let out = out.trim_matches('_');
    if out.is_empty() {
        "unnamed".to_owned()
    } else {
        out.to_owned()
    }
}

/// Makes names unique by suffixing the sysfs index to every name that occurs more than once:
/// two `nvme` chips become `nvme-1` and `nvme-3`, a lone `coretemp` stays `coretemp`.
pub(crate) fn unique_names(items: &[(u32, String)]) -> Vec<String> {
    items
        .iter()
        .map(|(index, name)| {
            let shared = items.iter().filter(|(_, n)| n == name).count() > 1;
            if shared {
                format!("{name}-{index}")
            } else {
                name.clone()
            }
        })
        .collect()
}

/// Makes `field` unique among `taken` by suffixing the channel name (and then a counter).
pub(crate) fn unique_field(
    taken: &[(String, sync::Value)],
    field: String,
    channel: &str,
) -> String {
    let free = |f: &str| !taken.iter().any(|(n, _)| n == f);
    if free(&field) {
        return field;
    }
    let with_channel = format!("{field}_{channel}");
    if free(&with_channel) {
        return with_channel;
    }
    (2..)
        .map(|i| format!("{with_channel}_{i}"))
        .find(|f| free(f))
        .unwrap_or(with_channel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitize_makes_plain_names() {
        assert_eq!(sanitize("Package id 0"), "package_id_0");
        assert_eq!(sanitize("  +12V / rail "), "12v_rail");
        assert_eq!(sanitize("x86_pkg_temp"), "x86_pkg_temp");
        assert_eq!(sanitize("///"), "unnamed");
    }

    #[test]
    fn parse_int_tells_garbage_from_overflow() {
        let p = Path::new("f");
        assert_eq!(parse_int(p, "-42").unwrap(), -42.0);
        assert!(matches!(
            parse_int(p, "4.2"),
            Err(SensorError::NotNumeric { .. })
        ));
        assert!(matches!(
            parse_int(p, "-"),
            Err(SensorError::NotNumeric { .. })
        ));
        assert!(parse_int(p, "99999999999999999999999").unwrap() > 9e22);
    }

    #[test]
    fn parse_decimal_rejects_non_finite() {
        let p = Path::new("f");
        assert_eq!(parse_decimal(p, "0.5").unwrap(), 0.5);
        assert_eq!(parse_decimal(p, "1e-3").unwrap(), 0.001);
        assert!(matches!(
            parse_decimal(p, "inf"),
            Err(SensorError::NotNumeric { .. })
        ));
        assert!(matches!(
            parse_decimal(p, "NaN"),
            Err(SensorError::NotNumeric { .. })
        ));
        assert!(matches!(
            parse_decimal(p, "1e999"),
            Err(SensorError::NotNumeric { .. })
        ));
    }

    #[test]
    fn unique_names_only_suffix_duplicates() {
        let items = vec![
            (1, "nvme".to_owned()),
            (2, "coretemp".to_owned()),
            (3, "nvme".to_owned()),
        ];
        assert_eq!(unique_names(&items), ["nvme-1", "coretemp", "nvme-3"]);
    }
}
