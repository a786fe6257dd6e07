//! A userspace UDP impairment proxy: `tc netem` for machines that do not have it.
//!
//! The proxy binds a UDP port, forwards every client's datagrams to one upstream address and the
//! answers back, and on the way applies delay, jitter, loss, reordering, duplication and a rate
//! cap, separately per direction. Each client gets its own upstream socket, so every client keeps
//! a stable 4-tuple towards the upstream (QUIC depends on it) and several clients work at once.
//!
//! Why it is built the way it is:
//! - One scheduler task per direction owns that direction's seeded RNG and its queue, so a run
//!   with the same seed and the same traffic makes the same decisions.
//! - Every fault is counted ([`ProxyStats`]), because a fault test must prove its faults happened.
//! - Memory is bounded: the rate shaper drops from the tail once `queue_bytes_max` bytes wait,
//!   and all delayed packets together never exceed `ProxyConfig::pending_bytes_max`.
//! - Jitter never reorders packets on its own (as netem behaves with a rate set); only the
//!   `reorder` probability does, so the `reordered` counter means exactly what it says.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

/// The shortest hold-back for a reordered packet, used when the configured delay is smaller.
/// Without it a reordered packet on a zero-delay link would overtake nothing.
pub const REORDER_HOLD_MIN: Duration = Duration::from_millis(10);

/// Largest UDP payload the proxy forwards; anything longer cannot exist on the wire.
const DATAGRAM_BYTES_MAX: usize = 65_535;

/// Packets waiting between a socket reader and its direction's scheduler.
const INBOUND_CHANNEL_MAX: usize = 1024;

/// The faults applied to one direction of the link.
///
/// Probabilities are in `[0, 1]`. The default is a perfect link.
#[derive(Debug, Clone, PartialEq)]
pub struct Impairment {
    /// Fixed one-way delay added to every packet.
    pub delay: Duration,
    /// Extra delay drawn uniformly from `[0, jitter]` per packet. It never reorders by itself.
    pub jitter: Duration,
    /// Probability that a packet is dropped.
    pub loss: f64,
    /// Probability that a packet is held back by an extra `max(delay, REORDER_HOLD_MIN)`,
    /// letting later packets overtake it.
    pub reorder: f64,
    /// Probability that a packet is delivered twice.
    pub duplicate: f64,
    /// Link rate cap in bytes per second; `None` means unlimited.
    pub rate_bytes_per_s: Option<u64>,
    /// Bytes that may wait for the rate-capped link before packets are dropped from the tail.
    pub queue_bytes_max: u64,
}

impl Default for Impairment {
    fn default() -> Self {
        Impairment {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            reorder: 0.0,
            duplicate: 0.0,
            rate_bytes_per_s: None,
            queue_bytes_max: 128 * 1024,
        }
    }
}

impl Impairment {
    /// A perfect link: no delay, no loss, no cap.
    pub fn none() -> Self {
        Impairment::default()
    }

    /// Rejects values the proxy cannot apply (a probability outside `[0, 1]`, a zero rate).
    pub fn validate(&self) -> io::Result<()> {
        for (name, p) in [
            ("loss", self.loss),
            ("reorder", self.reorder),
            ("duplicate", self.duplicate),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(invalid(format!("{name} probability {p} is outside [0, 1]")));
            }
        }
        if self.rate_bytes_per_s == Some(0) {
            return Err(invalid(
                "rate_bytes_per_s must be positive (use None for no cap)".into(),
            ));
        }
        Ok(())
    }
}

/// Which way a setting applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Datagrams from the clients to the upstream.
    ClientToUpstream,
    /// Datagrams from the upstream back to the clients.
    UpstreamToClient,
    /// Both of the above.
    Both,
}

/// How the proxy is set up. Build it with [`ProxyConfig::new`] and adjust the fields.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where the proxy listens for clients; port 0 picks a free one.
    pub listen: SocketAddr,
    /// The one address every client's traffic goes to.
    pub upstream: SocketAddr,
    /// Seed for the per-direction RNGs; the same seed and traffic give the same faults.
    pub seed: u64,
    /// Faults from the clients to the upstream.
    pub client_to_upstream: Impairment,
    /// Faults from the upstream to the clients.
    pub upstream_to_client: Impairment,
    /// Bound on the bytes held in one direction's delay queue; beyond it packets are dropped
    /// and counted as `dropped_overflow`.
    pub pending_bytes_max: usize,
    /// Bound on distinct clients; datagrams from further clients are dropped and counted.
    pub sessions_max: usize,
}

impl ProxyConfig {
    /// A perfect link on a free loopback port in front of `upstream`, seed 0.
    pub fn new(upstream: SocketAddr) -> Self {
        ProxyConfig {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            upstream,
            seed: 0,
            client_to_upstream: Impairment::none(),
            upstream_to_client: Impairment::none(),
            pending_bytes_max: 32 * 1024 * 1024,
            sessions_max: 4096,
        }
    }
}

/// Counters for one direction. `received` counts datagrams that entered the proxy;
/// `forwarded` counts datagrams sent out, duplicates included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DirectionStats {
    pub received: u64,
    pub forwarded: u64,
    pub forwarded_bytes: u64,
    pub dropped_loss: u64,
    pub dropped_partition: u64,
    pub dropped_queue: u64,
    pub dropped_overflow: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub send_errors: u64,
}

impl DirectionStats {
    /// Every datagram the proxy discarded in this direction, for whatever reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss + self.dropped_partition + self.dropped_queue + self.dropped_overflow
    }
}

/// A snapshot of the proxy's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyStats {
    pub client_to_upstream: DirectionStats,
    pub upstream_to_client: DirectionStats,
    /// Clients that got an upstream socket.
    pub sessions: u64,
    /// Datagrams dropped because `sessions_max` clients already exist.
    pub sessions_rejected: u64,
}

/// The proxy's entry points; see [`ProxyHandle`] for what a running proxy offers.
#[derive(Debug)]
pub struct UdpImpairProxy;

impl UdpImpairProxy {
    /// Starts the proxy on the current tokio runtime.
    pub async fn spawn(config: ProxyConfig) -> io::Result<ProxyHandle> {
        let (shared, local_addr) = start_tasks(config).await?;
        Ok(ProxyHandle {
            shared,
            local_addr,
            thread: None,
        })
    }

    /// Starts the proxy on its own thread and runtime, for synchronous tests.
    /// Works from any context, including inside another runtime.
    pub fn start(config: ProxyConfig) -> io::Result<ProxyHandle> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let join = std::thread::Builder::new()
            .name("udp-impair-proxy".into())
            .spawn(move || run_owned_runtime(config, ready_tx, stop_rx))?;
        let (shared, local_addr) = ready_rx
            .recv()
            .map_err(|_| io::Error::other("proxy thread exited before starting"))??;
        let thread = Some(OwnedThread {
            stop: Some(stop_tx),
            join: Some(join),
        });
        Ok(ProxyHandle {
            shared,
            local_addr,
            thread,
        })
    }
}

/// A running proxy. Dropping it stops every task and closes the sockets.
pub struct ProxyHandle {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    thread: Option<OwnedThread>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("local_addr", &self.local_addr)
            .field("upstream", &self.shared.upstream)
            .finish()
    }
}

impl ProxyHandle {
    /// The address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Replaces the impairment of one or both directions; applies to packets arriving from now.
    pub fn set(&self, direction: Direction, impairment: Impairment) -> io::Result<()> {
        impairment.validate()?;
        let mut settings = lock(&self.shared.settings);
        if direction != Direction::UpstreamToClient {
            settings[0] = impairment.clone();
        }
        if direction != Direction::ClientToUpstream {
            settings[1] = impairment;
        }
        Ok(())
    }

    /// The impairment in force for one direction (`Both` reports the client-to-upstream one).
    pub fn impairment(&self, direction: Direction) -> Impairment {
        lock(&self.shared.settings)[dir_index(direction)].clone()
    }

    /// Cuts (`true`) or heals (`false`) the link. While cut, every datagram is dropped,
    /// including the ones already waiting in a delay queue.
    pub fn partition(&self, cut: bool) {
        self.shared.partitioned.store(cut, AtomicOrdering::SeqCst);
    }

    /// Whether the link is cut.
    pub fn is_partitioned(&self) -> bool {
        self.shared.partitioned.load(AtomicOrdering::SeqCst)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ProxyStats {
        *lock(&self.shared.stats)
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        for task in lock(&self.shared.tasks).drain(..) {
            task.abort();
        }
        if let Some(mut thread) = self.thread.take() {
            if let Some(stop) = thread.stop.take() {
                let _ = stop.send(());
            }
            if let Some(join) = thread.join.take() {
                let _ = join.join();
            }
        }
    }
}

struct OwnedThread {
    stop: Option<oneshot::Sender<()>>,
    join: Option<std::thread::JoinHandle<()>>,
}

type Ready = io::Result<(Arc<Shared>, SocketAddr)>;

fn run_owned_runtime(
    config: ProxyConfig,
    ready: std::sync::mpsc::Sender<Ready>,
    stop: oneshot::Receiver<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    runtime.block_on(async move {
        let started = start_tasks(config).await;
        let ok = started.is_ok();
        let _ = ready.send(started);
        if ok {
            // Either a stop message or the handle's drop (sender gone) ends the proxy.
            let _ = stop.await;
        }
    });
}

/// State shared by the handle and the tasks.
struct Shared {
    upstream: SocketAddr,
    /// `[client_to_upstream, upstream_to_client]`.
    settings: Mutex<[Impairment; 2]>,
    partitioned: AtomicBool,
    stats: Mutex<ProxyStats>,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Shared {
    fn with_stats(&self, dir: usize, update: impl FnOnce(&mut DirectionStats)) {
        let mut stats = lock(&self.stats);
        let direction = if dir == 0 {
            &mut stats.client_to_upstream
        } else {
            &mut stats.upstream_to_client
        };
        update(direction);
    }

    fn track(&self, handle: AbortHandle) {
        lock(&self.tasks).push(handle);
    }
}

async fn start_tasks(config: ProxyConfig) -> io::Result<(Arc<Shared>, SocketAddr)> {
    config.client_to_upstream.validate()?;
    config.upstream_to_client.validate()?;
    let listener = Arc::new(UdpSocket::bind(config.listen).await?);
    let local_addr = listener.local_addr()?;
    let shared = Arc::new(Shared {
        upstream: config.upstream,
        settings: Mutex::new([
            config.client_to_upstream.clone(),
            config.upstream_to_client.clone(),
        ]),
        partitioned: AtomicBool::new(false),
        stats: Mutex::new(ProxyStats::default()),
        tasks: Mutex::new(Vec::new()),
    });
    let (c2u_tx, c2u_rx) = mpsc::channel(INBOUND_CHANNEL_MAX);
    let (u2c_tx, u2c_rx) = mpsc::channel(INBOUND_CHANNEL_MAX);
    for (dir, rx) in [(0, c2u_rx), (1, u2c_rx)] {
        let scheduler = Scheduler::new(dir, &config, shared.clone(), listener.clone());
        shared.track(tokio::spawn(scheduler.run(rx)).abort_handle());
    }
    let reader = ClientReader {
        listener,
        shared: shared.clone(),
        c2u: c2u_tx,
        u2c: u2c_tx,
    };
    shared.track(tokio::spawn(reader.run(config.sessions_max)).abort_handle());
    Ok((shared, local_addr))
}

/// A datagram on its way into a scheduler.
struct Inbound {
    data: Vec<u8>,
    target: Target,
}

/// Where a datagram leaves the proxy.
#[derive(Clone)]
enum Target {
    /// Through a client's own connected upstream socket.
    Upstream(Arc<UdpSocket>),
    /// Through the listening socket, back to a client.
    Client(SocketAddr),
}

/// Reads datagrams from clients and creates one upstream socket per client.
struct ClientReader {
    listener: Arc<UdpSocket>,
    shared: Arc<Shared>,
    c2u: mpsc::Sender<Inbound>,
    u2c: mpsc::Sender<Inbound>,
}

impl ClientReader {
    async fn run(self, sessions_max: usize) {
        let mut sessions: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
        let mut buf = vec![0u8; DATAGRAM_BYTES_MAX];
        loop {
            // Errors such as ECONNREFUSED (an ICMP answer to an earlier send) are per packet.
            let Ok((len, from)) = self.listener.recv_from(&mut buf).await else {
                tokio::task::yield_now().await;
                continue;
            };
            let Some(socket) = self.session(&mut sessions, from, sessions_max).await else {
                continue;
            };
            let inbound = Inbound {
                data: buf[..len].to_vec(),
                target: Target::Upstream(socket),
            };
            if self.c2u.send(inbound).await.is_err() {
                return;
            }
        }
    }

    async fn session(
        &self,
        sessions: &mut HashMap<SocketAddr, Arc<UdpSocket>>,
        client: SocketAddr,
        sessions_max: usize,
    ) -> Option<Arc<UdpSocket>> {
        if let Some(socket) = sessions.get(&client) {
            return Some(socket.clone());
        }
        if sessions.len() >= sessions_max {
            lock(&self.shared.stats).sessions_rejected += 1;
            return None;
        }
        let socket = Arc::new(connect_upstream(self.shared.upstream).await.ok()?);
        let reader = UpstreamReader {
            socket: socket.clone(),
            client,
            u2c: self.u2c.clone(),
        };
        self.shared.track(tokio::spawn(reader.run()).abort_handle());
        lock(&self.shared.stats).sessions += 1;
        sessions.insert(client, socket.clone());
        Some(socket)
    }
}

async fn connect_upstream(upstream: SocketAddr) -> io::Result<UdpSocket> {
    let bind: SocketAddr = match upstream {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(bind).await?;
    socket.connect(upstream).await?;
    Ok(socket)
}

/// Reads the upstream's answers to one client.
struct UpstreamReader {
    socket: Arc<UdpSocket>,
    client: SocketAddr,
    u2c: mpsc::Sender<Inbound>,
}

impl UpstreamReader {
    async fn run(self) {
        let mut buf = vec![0u8; DATAGRAM_BYTES_MAX];
        loop {
            // A connected UDP socket reports ECONNREFUSED while the upstream is down (for
            // example a killed hub); the session must survive that and resume when it is back.
            let Ok(len) = self.socket.recv(&mut buf).await else {
                tokio::task::yield_now().await;
                continue;
            };
            let inbound = Inbound {
                data: buf[..len].to_vec(),
                target: Target::Client(self.client),
            };
            if self.u2c.send(inbound).await.is_err() {
                return;
            }
        }
    }
}

/// A datagram waiting in a delay queue.
struct Pending {
    at: Instant,
    order: u64,
    data: Vec<u8>,
    target: Target,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.order) == (other.at, other.order)
    }
}

impl Eq for Pending {}

impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Pending {
    /// Reversed, so the standard max-heap pops the earliest packet first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.order).cmp(&(self.at, self.order))
    }
}

/// One direction's impairment engine: decides each packet's fate and releases it on time.
struct Scheduler {
    dir: usize,
    shared: Arc<Shared>,
    listener: Arc<UdpSocket>,
    rng: StdRng,
    queue: BinaryHeap<Pending>,
    pending_bytes: usize,
    pending_bytes_max: usize,
    /// When the rate-capped link finishes sending what it has accepted.
    link_free_at: Instant,
    /// The latest release time of an in-order packet; later packets never go before it.
    last_in_order_at: Instant,
    order: u64,
}

impl Scheduler {
    fn new(
        dir: usize,
        config: &ProxyConfig,
        shared: Arc<Shared>,
        listener: Arc<UdpSocket>,
    ) -> Self {
        let now = Instant::now();
        // Distinct streams per direction, so one direction's traffic never shifts the other's.
        let seed = config.seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(dir as u64 + 1));
        Scheduler {
            dir,
            shared,
            listener,
            rng: StdRng::seed_from_u64(seed),
            queue: BinaryHeap::new(),
            pending_bytes: 0,
            pending_bytes_max: config.pending_bytes_max,
            link_free_at: now,
            last_in_order_at: now,
            order: 0,
        }
    }

    async fn run(mut self, mut inbound: mpsc::Receiver<Inbound>) {
        loop {
            let next = self.queue.peek().map(|p| p.at);
            tokio::select! {
                packet = inbound.recv() => match packet {
                    Some(packet) => self.admit(packet),
                    None => return,
                },
                _ = sleep_until_opt(next), if next.is_some() => self.release_due().await,
            }
        }
    }

    fn admit(&mut self, packet: Inbound) {
        let now = Instant::now();
        let imp = lock(&self.shared.settings)[self.dir].clone();
        let len = packet.data.len();
        self.shared.with_stats(self.dir, |s| s.received += 1);
        if self.shared.partitioned.load(AtomicOrdering::SeqCst) {
            self.shared
                .with_stats(self.dir, |s| s.dropped_partition += 1);
            return;
        }
        if self.chance(imp.loss) {
            self.shared.with_stats(self.dir, |s| s.dropped_loss += 1);
            return;
        }
        let Some(departs) = self.shape(now, len, &imp) else {
            self.shared.with_stats(self.dir, |s| s.dropped_queue += 1);
            return;
        };
        let at = self.release_time(departs, &imp);
        if !self.chance(imp.duplicate) {
            self.enqueue(at, packet.data, packet.target);
            return;
        }
        if self.enqueue(at, packet.data.clone(), packet.target.clone())
            && self.enqueue(at, packet.data, packet.target)
        {
            self.shared.with_stats(self.dir, |s| s.duplicated += 1);
        }
    }

    /// The rate cap: when the packet leaves the link, or `None` if the queue is full.
    fn shape(&mut self, now: Instant, len: usize, imp: &Impairment) -> Option<Instant> {
        let Some(rate) = imp.rate_bytes_per_s else {
            return Some(now);
        };
        let start = self.link_free_at.max(now);
        let backlog_bytes = (start - now).as_secs_f64() * rate as f64;
        if backlog_bytes + len as f64 > imp.queue_bytes_max as f64 {
            return None;
        }
        self.link_free_at = start + Duration::from_secs_f64(len as f64 / rate as f64);
        Some(self.link_free_at)
    }

    /// Adds delay and jitter without reordering, then maybe holds the packet back.
    fn release_time(&mut self, departs: Instant, imp: &Impairment) -> Instant {
        let jitter_ns = u64::try_from(imp.jitter.as_nanos()).unwrap_or(u64::MAX);
        let jitter = if jitter_ns > 0 {
            self.rng.random_range(0..=jitter_ns)
        } else {
            0
        };
        let at = (departs + imp.delay + Duration::from_nanos(jitter)).max(self.last_in_order_at);
        if self.chance(imp.reorder) {
            self.shared.with_stats(self.dir, |s| s.reordered += 1);
            return at + imp.delay.max(REORDER_HOLD_MIN);
        }
        self.last_in_order_at = at;
        at
    }

    fn enqueue(&mut self, at: Instant, data: Vec<u8>, target: Target) -> bool {
        if self.pending_bytes + data.len() > self.pending_bytes_max {
            self.shared
                .with_stats(self.dir, |s| s.dropped_overflow += 1);
            return false;
        }
        self.pending_bytes += data.len();
        self.order += 1;
        self.queue.push(Pending {
            at,
            order: self.order,
            data,
            target,
        });
        true
    }

    async fn release_due(&mut self) {
        let now = Instant::now();
        while self.queue.peek().is_some_and(|p| p.at <= now) {
            let Some(packet) = self.queue.pop() else {
                break;
            };
            self.pending_bytes -= packet.data.len();
            self.deliver(packet).await;
        }
    }

    async fn deliver(&mut self, packet: Pending) {
        if self.shared.partitioned.load(AtomicOrdering::SeqCst) {
            self.shared
                .with_stats(self.dir, |s| s.dropped_partition += 1);
            return;
        }
        let sent = match &packet.target {
            Target::Upstream(socket) => socket.send(&packet.data).await,
            Target::Client(client) => self.listener.send_to(&packet.data, client).await,
        };
        let len = packet.data.len() as u64;
        self.shared.with_stats(self.dir, |s| match sent {
            Ok(_) => {
                s.forwarded += 1;
                s.forwarded_bytes += len;
            }
            Err(_) => s.send_errors += 1,
        });
    }

    /// Draws only for a non-zero probability, so a perfect link consumes no randomness.
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.random_bool(p)
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn dir_index(direction: Direction) -> usize {
    match direction {
        Direction::ClientToUpstream | Direction::Both => 0,
        Direction::UpstreamToClient => 1,
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

/// A poisoned lock only means another test thread panicked; the data is still usable counters.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
