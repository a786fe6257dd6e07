//! A minimal UDP relay between one demo edge and the hub, which the demo can switch off.
//!
//! QUIC runs over UDP, so cutting a link is as simple as dropping every datagram in both
//! directions while the switch is off: the edge and the hub see exactly what a truck driving
//! through a dead zone sees (silence, then retransmissions once the path is back). Each client
//! address (the edge's QUIC socket) gets its own upstream socket, so the hub sees one peer per
//! edge socket, as it would without the relay. The demo owns this relay; it does not use the
//! tests crate's richer proxy, because the product must not depend on test code.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::net::UdpSocket;
use tokio::task::{JoinHandle, JoinSet};

/// Largest datagram relayed; QUIC never sends more than this.
const DATAGRAM_MAX: usize = 65_535;

/// Counters the progress display shows.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
}

/// A running relay; dropping it stops every task it started.
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    stats: Arc<RelayStats>,
    task: JoinHandle<()>,
}

impl Relay {
    /// Listens on a free loopback port and forwards to `upstream`. Starts with the link up.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Relay> {
        let front = Arc::new(UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?);
        let addr = front.local_addr()?;
        let up = Arc::new(AtomicBool::new(true));
        let stats = Arc::new(RelayStats::default());
        let task = tokio::spawn(run(front, upstream, up.clone(), stats.clone()));
        Ok(Relay {
            addr,
            up,
            stats,
            task,
        })
    }

    /// Where the edge should send its QUIC datagrams.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches the link on (forward) or off (drop every datagram both ways).
    pub fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Relaxed);
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> &RelayStats {
        &self.stats
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // Aborting the front task drops its JoinSet, which aborts every upstream task.
        self.task.abort();
    }
}

/// The front loop: client datagrams go to the client's upstream socket.
async fn run(
    front: Arc<UdpSocket>,
    upstream: SocketAddr,
    up: Arc<AtomicBool>,
    stats: Arc<RelayStats>,
) {
    let mut sessions: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut buf = vec![0u8; DATAGRAM_MAX];
    loop {
        let Ok((len, client)) = front.recv_from(&mut buf).await else {
            // A transient error on a UDP socket (e.g. an ICMP report); keep relaying.
            continue;
        };
        if !up.load(Ordering::Relaxed) {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let socket = match sessions.get(&client) {
            Some(s) => s.clone(),
            None => {
                let Ok(socket) = open_upstream(upstream).await else {
                    stats.dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let socket = Arc::new(socket);
                tasks.spawn(back(
                    socket.clone(),
                    front.clone(),
                    client,
                    up.clone(),
                    stats.clone(),
                ));
                sessions.insert(client, socket.clone());
                socket
            }
        };
        if socket.send(&buf[..len]).await.is_ok() {
            stats.forwarded.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn open_upstream(upstream: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    socket.connect(upstream).await?;
    Ok(socket)
}

/// The back loop of one client: hub datagrams go back to that client through the front socket.
async fn back(
    socket: Arc<UdpSocket>,
    front: Arc<UdpSocket>,
    client: SocketAddr,
    up: Arc<AtomicBool>,
    stats: Arc<RelayStats>,
) {
    let mut buf = vec![0u8; DATAGRAM_MAX];
    loop {
        let Ok(len) = socket.recv(&mut buf).await else {
            continue;
        };
        if !up.load(Ordering::Relaxed) {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if front.send_to(&buf[..len], client).await.is_ok() {
            stats.forwarded.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn forwards_both_ways_and_drops_when_off() {
        let server = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let relay = Relay::start(server.local_addr().unwrap()).await.unwrap();
        let client = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        client.connect(relay.addr()).await.unwrap();
        let mut buf = [0u8; 64];

        client.send(b"ping").await.unwrap();
        let (n, from) = server.recv_from(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"ping");
        server.send_to(b"pong", from).await.unwrap();
        let n = client.recv(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"pong");

        relay.set_up(false);
        client.send(b"lost").await.unwrap();
        // The relay counts the drop once it has read the datagram; wait on that, not on time.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while relay.stats().dropped.load(Ordering::Relaxed) == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the relay never saw the datagram"
            );
            tokio::task::yield_now().await;
        }
        relay.set_up(true);
        client.send(b"back").await.unwrap();
        let n = server.recv(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"back", "the dropped datagram must never arrive");
    }
}
