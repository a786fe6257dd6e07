//! Shared harness for system tests: spawning the real binaries, free ports, the ledger checker,
//! a real MQTT broker, network namespaces with iptables faults, and a userspace UDP impairment
//! proxy (`tc netem` is not available on the CI machines).
//!
//! Every wait in here has a deadline, and every fault helper can report how many faults it
//! actually applied, so a fault test can prove its faults happened.

pub mod http;
pub mod ledger;
pub mod mosquitto;
pub mod netem;
pub mod netns;
pub mod ports;
pub mod procs;
