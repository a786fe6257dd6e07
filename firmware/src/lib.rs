//! Tributary firmware: the device side of a deployment.
//!
//! - [`hwmon`]: Linux hwmon chips and thermal zones read from sysfs, in SI units.
//! - [`iio`]: Linux IIO devices read from sysfs, with scale and offset applied.
//! - [`nmea`]: NMEA 0183 GPS sentences (GGA, RMC) from a serial device or a file.
//! - [`sim`]: a seeded simulator of fleet trucks and industrial machines.
//!
//! Everything here is plain blocking `std` code with no async runtime: the edge agent calls it
//! from a blocking task, and it links into the device binary, so it stays small. Every source
//! turns bad sensor input into a typed error next to the readings that did work; nothing here
//! panics on input from a device.
//!
//! The packaging next to this crate (`systemd/tributary-edge.service`, `config/edge.toml`)
//! and the cross-building notes are described in `firmware/README.md`.

pub mod hwmon;
pub mod iio;
pub mod nmea;
pub mod sim;
mod sysfs;

pub use sysfs::{Poll, SensorError};
