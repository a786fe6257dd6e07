//! Free loopback ports for the processes a test starts.
//!
//! A port is found by test-binding it and releasing it, and the process-wide set below makes
//! sure parallel tests in one binary are never handed the same port twice.
//!
//! Candidates come from below the kernel's ephemeral range (`ip_local_port_range`) where
//! possible: a port handed out from inside that range can be taken by any outgoing connection
//! before the child process binds it, which makes tests flaky. `bind(0)` is the fallback.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The lowest port we pick; below are well-known and registered services.
const PICK_LOW: u16 = 20_000;
/// Candidates tried below the ephemeral range before falling back to `bind(0)`.
const PICK_ATTEMPTS: usize = 200;

/// Which protocols the port must be free for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
    /// Free for TCP and UDP at once, e.g. a hub that serves QUIC and HTTP on one number.
    Both,
}

/// A loopback port free for TCP.
pub fn tcp() -> u16 {
    free(Proto::Tcp)
}

/// A loopback port free for UDP.
pub fn udp() -> u16 {
    free(Proto::Udp)
}

/// A loopback port free for both TCP and UDP.
pub fn both() -> u16 {
    free(Proto::Both)
}

/// `127.0.0.1:<port>` with a port free for `proto`.
pub fn loopback(proto: Proto) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free(proto)))
}

/// A port free for `proto` on 127.0.0.1 that this process has not handed out before.
///
/// Panics only if the machine has no free port left after many attempts, which no test can
/// recover from.
pub fn free(proto: Proto) -> u16 {
    let mut state = state()
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (low, high) = pick_range();
    for _ in 0..PICK_ATTEMPTS {
        let port = state.rng.random_range(low..high);
        if !state.handed.contains(&port) && is_free(port, proto) {
            state.handed.insert(port);
            return port;
        }
    }
    for _ in 0..PICK_ATTEMPTS {
        if let Some(port) = kernel_pick(proto).filter(|p| !state.handed.contains(p)) {
            state.handed.insert(port);
            return port;
        }
    }
    panic!(
        "no free loopback {proto:?} port found after {} attempts",
        2 * PICK_ATTEMPTS
    );
}

struct State {
    handed: HashSet<u16>,
    rng: StdRng,
}

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(|| {
        // Seeded by pid and time so concurrent test binaries start at different candidates.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let seed = (nanos as u64) ^ (u64::from(std::process::id()) << 32);
        Mutex::new(State {
            handed: HashSet::new(),
            rng: StdRng::seed_from_u64(seed),
        })
    })
}

/// The range below the ephemeral ports, or an empty-safe default when it cannot be read.
fn pick_range() -> (u16, u16) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if ephemeral_low > PICK_LOW + 1_000 {
        (PICK_LOW, ephemeral_low)
    } else {
        (PICK_LOW, 32_768)
    }
}

fn is_free(port: u16, proto: Proto) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let tcp_ok = || TcpListener::bind(addr).is_ok();
    let udp_ok = || UdpSocket::bind(addr).is_ok();
    match proto {
        Proto::Tcp => tcp_ok(),
        Proto::Udp => udp_ok(),
        Proto::Both => tcp_ok() && udp_ok(),
    }
}

fn kernel_pick(proto: Proto) -> Option<u16> {
    let any = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let port = match proto {
        Proto::Udp => UdpSocket::bind(any).ok()?.local_addr().ok()?.port(),
        Proto::Tcp | Proto::Both => TcpListener::bind(any).ok()?.local_addr().ok()?.port(),
    };
    is_free(port, proto).then_some(port)
}
