//! Shared harness for system tests: spawning the real binaries, free ports, the ledger checker,
//! a real MQTT broker, network namespaces with iptables faults, and a userspace UDP impairment
//! proxy (`tc netem` is not available on the CI machines).
//!
//! - [`adversary`]: a QUIC client with a device certificate that speaks the protocol and then
//!   attacks the hub (decode bombs, floods, stalls), and a sampler of the hub's memory.
//! - [`procs`]: start, `kill9`, `terminate` and restart binaries found by [`procs::bin_path`];
//!   [`procs::wait_until`] is the one deadline-bounded wait.
//! - [`cluster`]: pki, configs, and a hub with its agents as real processes.
//! - [`chaos`]: seeds, soak switch, paced producers and mid-transfer checks for kill schedules.
//! - [`http`]: a tiny blocking HTTP/1.1 client for `/healthz`, `/metrics` and NDJSON.
//! - [`ports`]: free loopback ports, never handed out twice in one process.
//! - [`ledger`]: what producers were acknowledged, checked against what the hub holds.
//! - [`mosquitto`]: a real broker on a free port.
//! - [`netns`]: two namespaces joined by veth, with counted iptables DROP rules.
//! - [`netem`]: delay, jitter, loss, reordering, duplication and a rate cap for UDP (QUIC).
//! - [`tier2`]: the hub's tiering marks (from its catalog) and tier 2 as DuckDB reads it.
//! - [`faultfs`]: a FUSE filesystem in memory that loses unsynced writes at a power cut.
//! - [`peers`]: `nats-server` (JetStream) with a minimal client, and a keep-alive HTTP poster,
//!   for the side-by-side benchmarks against peer systems.
//!
//! Every wait in here has a deadline, and every fault helper reports how many faults it actually
//! applied, so a fault test can prove its faults happened.

pub mod adversary;
pub mod chaos;
pub mod cluster;
pub mod faultfs;
pub mod http;
pub mod ledger;
pub mod lossy;
pub mod mosquitto;
pub mod netem;
pub mod netns;
pub mod peers;
pub mod ports;
pub mod procs;
pub mod tier2;

/// The port picker's own test lives here, not in `ports.rs`: other crates' tests include that
/// file by path, and their binaries run in parallel with tests that bind ports of their own.
#[cfg(test)]
mod ports_tests {
    use crate::ports::{Proto, free};
    use std::collections::HashSet;
    use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};

    #[test]
    fn ports_are_distinct_and_bindable() {
        let mut seen = HashSet::new();
        for proto in [Proto::Tcp, Proto::Udp, Proto::Both]
            .into_iter()
            .cycle()
            .take(60)
        {
            let port = free(proto);
            assert!(seen.insert(port), "port {port} handed out twice");
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            if proto != Proto::Udp {
                assert!(
                    TcpListener::bind(addr).is_ok(),
                    "port {port} not free for TCP"
                );
            }
            if proto != Proto::Tcp {
                assert!(
                    UdpSocket::bind(addr).is_ok(),
                    "port {port} not free for UDP"
                );
            }
        }
    }
}
