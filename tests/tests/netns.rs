//! Tests of the network-namespace helper: a UDP echo across the veth link, a partition and a
//! random-loss rule proven by iptables counters, a link flap, and cleanup.
//!
//! These need root (CI runs as root). Where namespaces cannot be created the test fails with
//! the helper's message rather than skipping, so a CI machine without them is noticed.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use tributary_tests::netns::{DropSpec, L4, NetnsPair, Side, list_namespaces};
use tributary_tests::procs::{Proc, ProcSpec, wait_until};

const WAIT: Duration = Duration::from_secs(10);
const ECHO_PORT: u16 = 4000;

/// A UDP echo thread inside side B, counting what reached it.
fn start_echo(pair: &NetnsPair) -> Result<(SocketAddr, Arc<AtomicU64>)> {
    let addr = SocketAddr::from((pair.addr(Side::B), ECHO_PORT));
    let socket = pair.udp_bind(Side::B, addr)?;
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    socket.set_read_timeout(Some(Duration::from_millis(100)))?;
    // Serves until the test drops its counter, so the thread never outlives the test by much.
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while Arc::strong_count(&counter) > 1 {
            if let Ok((len, from)) = socket.recv_from(&mut buf) {
                counter.fetch_add(1, Ordering::SeqCst);
                let _ = socket.send_to(&buf[..len], from);
            }
        }
    });
    Ok((addr, received))
}

fn client(pair: &NetnsPair) -> Result<UdpSocket> {
    let socket = pair.udp_bind(Side::A, SocketAddr::from(([0, 0, 0, 0], 0)))?;
    socket.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(socket)
}

fn round_trip(socket: &UdpSocket, to: SocketAddr, payload: &[u8]) -> Result<()> {
    socket.send_to(payload, to)?;
    let mut buf = [0u8; 2048];
    let (len, _) = socket.recv_from(&mut buf).context("no echo")?;
    anyhow::ensure!(&buf[..len] == payload, "echo changed the payload");
    Ok(())
}

#[test]
fn namespaces_link_partition_loss_and_cleanup() -> Result<()> {
    let pair = NetnsPair::create()?;
    let names = [
        pair.name(Side::A).to_string(),
        pair.name(Side::B).to_string(),
    ];
    let listed = list_namespaces()?;
    assert!(
        names.iter().all(|n| listed.contains(n)),
        "{names:?} not in {listed:?}"
    );
    let addresses = pair.run(Side::A, "ip", &["-o", "addr", "show", "dev", "veth0"])?;
    assert!(addresses.contains("10.201.0.1/30"), "{addresses}");

    let (echo, received) = start_echo(&pair)?;
    let socket = client(&pair)?;
    round_trip(&socket, echo, b"hello")?;

    // Partition: nothing reaches B, and the counters prove the drops.
    let partition = pair.partition()?;
    for i in 0..10u8 {
        socket.send_to(&[i], echo)?;
    }
    let rule_b = partition.rules[1].clone();
    wait_until(WAIT, "the partition to drop 10 packets", || {
        pair.dropped(&rule_b).unwrap_or(0) >= 10
    })?;
    assert_eq!(
        received.load(Ordering::SeqCst),
        1,
        "a packet crossed the partition"
    );
    let dropped = pair.heal(&partition)?;
    assert!(dropped >= 10, "partition dropped {dropped}");
    round_trip(&socket, echo, b"healed")?;

    // Random loss of half the UDP packets to the echo port, proven by the counter.
    let spec = DropSpec {
        probability: Some(0.5),
        protocol: Some(L4::Udp),
        dport: Some(ECHO_PORT),
        sport: None,
    };
    let loss = pair.add_drop(Side::B, spec)?;
    let before = received.load(Ordering::SeqCst);
    for i in 0..200u8 {
        socket.send_to(&[i], echo)?;
    }
    wait_until(WAIT, "all 200 packets to be dropped or echoed", || {
        pair.dropped(&loss).unwrap_or(0) + received.load(Ordering::SeqCst) - before == 200
    })?;
    let lost = pair.dropped(&loss)?;
    assert!((50..150).contains(&lost), "dropped {lost} of 200 at p=0.5");
    // Read the echoes of the packets that got through, so later round trips see only their own.
    let mut buf = [0u8; 16];
    for _ in 0..200 - lost {
        socket
            .recv_from(&mut buf)
            .context("an echo of a packet that passed the loss rule")?;
    }
    pair.remove_drop(&loss)?;

    // A flap: the link goes down and comes back, and traffic resumes.
    pair.set_link(Side::A, false)?;
    let state = pair.run(Side::A, "ip", &["-o", "link", "show", "veth0"])?;
    assert!(state.contains("state DOWN"), "{state}");
    pair.set_link(Side::A, true)?;
    // Short read timeouts while the link comes back, so a packet lost to the flap costs little.
    socket.set_read_timeout(Some(Duration::from_millis(100)))?;
    wait_until(WAIT, "traffic after the flap", || {
        round_trip(&socket, echo, b"after flap").is_ok()
    })?;

    drop(pair);
    let listed = list_namespaces()?;
    assert!(
        names.iter().all(|n| !listed.contains(n)),
        "left behind: {listed:?}"
    );
    Ok(())
}

#[test]
fn a_process_runs_inside_a_namespace() -> Result<()> {
    let pair = NetnsPair::create()?;
    let spec = ProcSpec::new("ip")
        .args(["-o", "addr", "show", "dev", "veth0"])
        .netns(pair.name(Side::B));
    let mut proc = Proc::spawn(spec)?;
    assert!(proc.wait_exit(WAIT)?.success(), "{}", proc.log_tail(10));
    assert!(proc.stdout().contains("10.201.0.2/30"), "{}", proc.stdout());

    // A TCP connection opened from A reaches a listener in B.
    let listener = pair.tcp_listen(Side::B, SocketAddr::from((pair.addr(Side::B), 8080)))?;
    let to = listener.local_addr()?;
    let stream = pair.tcp_connect(Side::A, to, WAIT)?;
    let (_, from) = listener.accept()?;
    assert_eq!(from.ip(), pair.addr(Side::A));
    drop(stream);
    Ok(())
}
