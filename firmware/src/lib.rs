//! Tributary firmware: sensor sources and the device simulator.
