//! Tests of the UDP impairment proxy with a plain UDP echo server behind it.
//!
//! Each test proves both that the fault happened (the proxy's counters) and that its effect is
//! visible to the client (what came back), with seeded RNGs so the counts are reproducible.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use tokio::net::UdpSocket;
use tokio::time::timeout;
use tributary_tests::netem::{Direction, Impairment, ProxyConfig, ProxyHandle, UdpImpairProxy};

const WAIT: Duration = Duration::from_secs(10);

/// An echo server that counts what it received.
struct Echo {
    addr: SocketAddr,
    received: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo() -> Result<Echo> {
    let socket = UdpSocket::bind("127.0.0.1:0").await?;
    let addr = socket.local_addr()?;
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let task = tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((len, from)) = socket.recv_from(&mut buf).await {
            counter.fetch_add(1, Ordering::SeqCst);
            let _ = socket.send_to(&buf[..len], from).await;
        }
    });
    Ok(Echo {
        addr,
        received,
        task,
    })
}

async fn proxy(upstream: SocketAddr, seed: u64) -> Result<ProxyHandle> {
    let config = ProxyConfig {
        seed,
        ..ProxyConfig::new(upstream)
    };
    Ok(UdpImpairProxy::spawn(config).await?)
}

async fn client(proxy: &ProxyHandle) -> Result<UdpSocket> {
    let socket = UdpSocket::bind("127.0.0.1:0").await?;
    socket.connect(proxy.local_addr()).await?;
    Ok(socket)
}

fn packet(seq: u64, len: usize) -> Vec<u8> {
    let mut data = seq.to_be_bytes().to_vec();
    data.resize(len.max(8), 0xAB);
    data
}

fn seq_of(data: &[u8]) -> u64 {
    u64::from_be_bytes(data[..8].try_into().expect("packets carry an 8-byte seq"))
}

/// Waits (with a deadline) for `condition` over the proxy's state.
async fn until(what: &str, mut condition: impl FnMut() -> bool) -> Result<()> {
    timeout(WAIT, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .with_context(|| format!("timed out waiting for {what}"))
}

/// Receives everything that is already on its way, until `expected` datagrams arrived.
async fn receive(socket: &UdpSocket, expected: u64, into: &mut Vec<u64>) -> Result<()> {
    let mut buf = vec![0u8; 65_536];
    for _ in 0..expected {
        let len = timeout(WAIT, socket.recv(&mut buf))
            .await
            .context("echo did not come back")??;
        into.push(seq_of(&buf[..len]));
    }
    Ok(())
}

/// Sends `count` packets in batches, waiting after each batch until everything the proxy let
/// through came back, so no kernel buffer ever overflows and the proxy's counters are exact.
/// Returns the seqs received, in arrival order.
async fn exchange(proxy: &ProxyHandle, socket: &UdpSocket, count: u64) -> Result<Vec<u64>> {
    let mut got = Vec::new();
    for batch in (0..count).collect::<Vec<_>>().chunks(50) {
        let before = proxy.stats();
        for seq in batch {
            socket.send(&packet(*seq, 64)).await?;
        }
        let sent = before.client_to_upstream.received + batch.len() as u64;
        until("the proxy to take the batch in", || {
            proxy.stats().client_to_upstream.received == sent
        })
        .await?;
        // Everything admitted upstream is echoed; wait until the way back settled too.
        until("the batch to settle", || {
            let s = proxy.stats();
            let pending_up = s.client_to_upstream.received - s.client_to_upstream.dropped();
            let out_up = s.client_to_upstream.forwarded;
            let back = s.upstream_to_client;
            out_up == pending_up + s.client_to_upstream.duplicated
                && back.received == out_up
                && back.forwarded + back.dropped() == back.received + back.duplicated
        })
        .await?;
        let arrived =
            proxy.stats().upstream_to_client.forwarded - before.upstream_to_client.forwarded;
        receive(socket, arrived, &mut got).await?;
    }
    Ok(got)
}

async fn lost_seqs(seed: u64, loss: f64, count: u64) -> Result<(Vec<u64>, ProxyHandle, Echo)> {
    let server = echo().await?;
    let proxy = proxy(server.addr, seed).await?;
    proxy.set(
        Direction::ClientToUpstream,
        Impairment {
            loss,
            ..Impairment::none()
        },
    )?;
    let socket = client(&proxy).await?;
    let got: HashSet<u64> = exchange(&proxy, &socket, count)
        .await?
        .into_iter()
        .collect();
    let lost = (0..count).filter(|seq| !got.contains(seq)).collect();
    Ok((lost, proxy, server))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loss_is_within_bounds_and_reproducible() -> Result<()> {
    let (count, loss) = (2000u64, 0.2);
    let (lost, proxy, server) = lost_seqs(42, loss, count).await?;
    let stats = proxy.stats().client_to_upstream;
    assert_eq!(stats.dropped_loss, lost.len() as u64, "{stats:?}");
    assert_eq!(
        server.received.load(Ordering::SeqCst),
        count - lost.len() as u64
    );
    // Binomial(2000, 0.2): mean 400, sd ~17.9; five sd either side.
    let sd = (count as f64 * loss * (1.0 - loss)).sqrt();
    let mean = count as f64 * loss;
    assert!(
        (lost.len() as f64 - mean).abs() < 5.0 * sd,
        "lost {} of {count}",
        lost.len()
    );
    assert_eq!(proxy.stats().upstream_to_client.dropped(), 0);

    let (again, _, _) = lost_seqs(42, loss, count).await?;
    assert_eq!(
        lost, again,
        "same seed, same traffic: the same packets must be lost"
    );
    let (other, _, _) = lost_seqs(43, loss, count).await?;
    assert_ne!(lost, other, "another seed must lose other packets");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_and_jitter_are_applied() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 1).await?;
    let (delay, jitter) = (Duration::from_millis(30), Duration::from_millis(20));
    proxy.set(
        Direction::Both,
        Impairment {
            delay,
            jitter,
            ..Impairment::none()
        },
    )?;
    let socket = client(&proxy).await?;
    let mut buf = [0u8; 64];
    let mut rtts = Vec::new();
    for seq in 0..10 {
        let sent = Instant::now();
        socket.send(&packet(seq, 16)).await?;
        let len = timeout(WAIT, socket.recv(&mut buf)).await??;
        assert_eq!(seq_of(&buf[..len]), seq);
        rtts.push(sent.elapsed());
    }
    let min = *rtts.iter().min().unwrap();
    let max = *rtts.iter().max().unwrap();
    assert!(
        min >= 2 * delay,
        "round trip {min:?} shorter than twice the one-way delay {delay:?}"
    );
    // Generous upper bound: two delays, two jitters, and scheduling slack on a busy CI box
    // (the lower bound above is the real check of the delay).
    assert!(
        max < 2 * (delay + jitter) + Duration::from_secs(2),
        "round trip {max:?}"
    );
    assert!(max > min, "jitter must vary the delay: {rtts:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_are_delivered_and_counted() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 7).await?;
    proxy.set(
        Direction::ClientToUpstream,
        Impairment {
            duplicate: 0.3,
            ..Impairment::none()
        },
    )?;
    let socket = client(&proxy).await?;
    let got = exchange(&proxy, &socket, 500).await?;
    let duplicated = proxy.stats().client_to_upstream.duplicated;
    assert!(
        (100..200).contains(&duplicated),
        "duplicated {duplicated} of 500 at p=0.3"
    );
    assert_eq!(got.len() as u64, 500 + duplicated);
    assert_eq!(server.received.load(Ordering::SeqCst), 500 + duplicated);
    assert_eq!(
        got.iter().collect::<HashSet<_>>().len(),
        500,
        "every packet arrives at least once"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reordering_is_visible_and_counted() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 9).await?;
    let delay = Duration::from_millis(5);
    proxy.set(
        Direction::ClientToUpstream,
        Impairment {
            delay,
            reorder: 0.2,
            ..Impairment::none()
        },
    )?;
    let socket = client(&proxy).await?;
    // Sent back to back, so held-back packets are overtaken by the ones behind them.
    let mut got = Vec::new();
    for seq in 0..200 {
        socket.send(&packet(seq, 32)).await?;
    }
    receive(&socket, 200, &mut got).await?;
    let reordered = proxy.stats().client_to_upstream.reordered;
    let inversions = got.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(
        (15..70).contains(&reordered),
        "reordered {reordered} of 200 at p=0.2"
    );
    assert!(inversions > 0, "no reordering visible: {got:?}");
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..200).collect::<Vec<_>>(),
        "reordering must not lose packets"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_cap_is_respected() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 3).await?;
    let rate = 400_000u64;
    let imp = Impairment {
        rate_bytes_per_s: Some(rate),
        queue_bytes_max: 20_000,
        ..Impairment::none()
    };
    proxy.set(Direction::ClientToUpstream, imp)?;
    let socket = Arc::new(client(&proxy).await?);
    // Offer about twice the cap for 0.6 s: 1000-byte packets every 1.25 ms.
    let sender = socket.clone();
    let send = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_micros(1250));
        for seq in 0..480 {
            tick.tick().await;
            sender.send(&packet(seq, 1000)).await?;
        }
        anyhow::Ok(())
    });
    let mut buf = vec![0u8; 2048];
    let mut first = None;
    let (mut last, mut bytes, mut packets) = (Instant::now(), 0u64, 0u64);
    // The stream ends once the sender has finished and every packet the proxy forwarded has
    // come back. A quiet spell alone does not end it: a stalled machine is not the end.
    let deadline = Instant::now() + WAIT;
    loop {
        match timeout(Duration::from_millis(100), socket.recv(&mut buf)).await {
            Ok(received) => {
                let len = received? as u64;
                let now = Instant::now();
                if first.is_none() {
                    first = Some(now);
                } else {
                    bytes += len;
                }
                last = now;
                packets += 1;
            }
            Err(_) => {
                if send.is_finished() && packets == proxy.stats().client_to_upstream.forwarded {
                    break;
                }
                ensure!(
                    Instant::now() < deadline,
                    "{packets} packets came back, the proxy forwarded {:?}",
                    proxy.stats().client_to_upstream
                );
            }
        }
    }
    send.await??;
    let elapsed = last - first.context("nothing came back")?;
    let measured = bytes as f64 / elapsed.as_secs_f64();
    let stats = proxy.stats().client_to_upstream;
    assert!(
        stats.dropped_queue > 0,
        "the queue must overflow at twice the rate: {stats:?}"
    );
    assert_eq!(packets, stats.forwarded);
    let ratio = measured / rate as f64;
    assert!(
        (0.5..=1.5).contains(&ratio),
        "measured {measured:.0} B/s against a cap of {rate} B/s"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_direction_loss_only_affects_that_direction() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 11).await?;
    proxy.set(
        Direction::UpstreamToClient,
        Impairment {
            loss: 0.3,
            ..Impairment::none()
        },
    )?;
    assert_eq!(
        proxy.impairment(Direction::ClientToUpstream),
        Impairment::none()
    );
    let socket = client(&proxy).await?;
    let got = exchange(&proxy, &socket, 500).await?;
    let stats = proxy.stats();
    assert_eq!(stats.client_to_upstream.dropped(), 0);
    assert_eq!(
        server.received.load(Ordering::SeqCst),
        500,
        "every request must reach the server"
    );
    let lost_back = stats.upstream_to_client.dropped_loss;
    assert!(
        (100..200).contains(&lost_back),
        "lost {lost_back} of 500 answers at p=0.3"
    );
    assert_eq!(got.len() as u64, 500 - lost_back);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_drops_everything_and_heals() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 5).await?;
    let socket = client(&proxy).await?;
    assert_eq!(exchange(&proxy, &socket, 20).await?.len(), 20);

    proxy.partition(true);
    assert!(proxy.is_partitioned());
    for seq in 100..120 {
        socket.send(&packet(seq, 64)).await?;
    }
    until("the partition to drop all 20", || {
        proxy.stats().client_to_upstream.dropped_partition == 20
    })
    .await?;
    assert_eq!(
        server.received.load(Ordering::SeqCst),
        20,
        "nothing may cross a partition"
    );

    proxy.partition(false);
    let got = exchange(&proxy, &socket, 30).await?;
    assert_eq!(got.len(), 30, "the link must heal");
    assert_eq!(server.received.load(Ordering::SeqCst), 50);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_clients_keep_their_own_sessions() -> Result<()> {
    let server = echo().await?;
    let proxy = proxy(server.addr, 13).await?;
    let clients = [
        client(&proxy).await?,
        client(&proxy).await?,
        client(&proxy).await?,
    ];
    for (i, socket) in clients.iter().enumerate() {
        socket.send(&packet(i as u64, 32)).await?;
    }
    for (i, socket) in clients.iter().enumerate() {
        let mut got = Vec::new();
        receive(socket, 1, &mut got).await?;
        assert_eq!(got, vec![i as u64], "each client gets its own answers");
    }
    assert_eq!(proxy.stats().sessions, 3);
    Ok(())
}

#[test]
fn a_synchronous_test_can_own_a_proxy() -> Result<()> {
    let server = std::net::UdpSocket::bind("127.0.0.1:0")?;
    server.set_read_timeout(Some(WAIT))?;
    let proxy = UdpImpairProxy::start(ProxyConfig::new(server.local_addr()?))?;
    let client = std::net::UdpSocket::bind("127.0.0.1:0")?;
    client.set_read_timeout(Some(WAIT))?;
    client.send_to(b"ping", proxy.local_addr())?;
    let mut buf = [0u8; 16];
    let (len, from) = server.recv_from(&mut buf)?;
    assert_eq!(&buf[..len], b"ping");
    server.send_to(b"pong", from)?;
    let (len, _) = client.recv_from(&mut buf)?;
    assert_eq!(&buf[..len], b"pong");
    assert!(
        proxy
            .set(
                Direction::Both,
                Impairment {
                    loss: 1.5,
                    ..Impairment::none()
                }
            )
            .is_err()
    );
    drop(proxy);
    Ok(())
}
